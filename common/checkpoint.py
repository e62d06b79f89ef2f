"""Checkpoints and exact resume. One checkpoint folder per run, written by rank 0: the model (save_pretrained),
tokenizer, trainer_state.pt (step, world size, optimizer, scheduler and whatever the trainer adds) and rank{r}_state.pt
for every rank r (its Python/NumPy/torch RNG states and prompt sampler), so that under torchrun each rank continues its
own random stream and data order. Under --fsdp (FSDP2) every rank also writes its model and AdamW shards to
checkpoint/sharded through torch.distributed.checkpoint (what resume reads); model.safetensors is the consolidated
export.

A save writes checkpoint.tmp, then manifest.json last (every file's size and sha256): a folder is complete when it has
one. Then the previous checkpoint is removed (its manifest first) and checkpoint.tmp renamed to checkpoint. A kill at
any instant leaves at least one complete folder, and --resume takes the newest complete one of checkpoint,
checkpoint.tmp and checkpoint.old (written by earlier versions); the next save first makes it `checkpoint` again.
--resume and loading the folder as a model check every file against the manifest.

Ctrl-C (`catch_ctrl_c`, docs/runs.md): the first one in a trainer's step loop stops the run after that step, once the
loop has saved it, with the command that resumes it; any other quits at once, saying which checkpoint is kept."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import sys
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from common.args import fail
from common.dist import all_reduce_sum, is_sharded, rank_world
from common.logger import read_metrics
from common.manifest import MANIFEST, SHARDED, check_files, read_manifest, write_manifest

KILL_AFTER_SAVE = "TINYPOST_TEST_KILL_AFTER_SAVE"
"""tests: SIGKILL the process at a deterministic point: STEP right after the checkpoint of that step is written;
STEP:swap in its save, after the previous checkpoint is removed and before checkpoint.tmp is renamed into place"""
FOLDERS = ("checkpoint", "checkpoint.old", "checkpoint.tmp")
"""where a run's checkpoint can be, in order of preference at the same step (.old: written by earlier versions)"""


def _crash_point(step: int, stage: str = "") -> None:
    if os.environ.get(KILL_AFTER_SAVE) == f"{step}:{stage}".rstrip(":"):
        os.kill(os.getpid(), signal.SIGKILL)


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, scheduler, sampler,
                    extra: dict | None = None, rank_extra: dict | None = None) -> str | None:
    """Called by every rank. Rank 0 writes run_dir/checkpoint (a kill at any point leaves a complete checkpoint: the
    module's docstring) with each rank's RNG states, sampler and `rank_extra` (a trainer's per-rank state, e.g.
    adakp's knowledge points) gathered into rank{r}_state.pt; `extra` (the same on every rank) to trainer_state.pt.
    `resume` returns both. `optimizer` None: weights only (--no-save-optimizer)."""
    own = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
           "sampler": sampler.state_dict(), **(rank_extra or {})}
    (rank, world), sharded = rank_world(), is_sharded(model)
    owns = [own] if world == 1 else [None] * world
    if world > 1:
        dist.gather_object(own, owns if rank == 0 else None, dst=0)
        if rank != 0 and not sharded:
            return None
    final, tmp = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp")
    if rank == 0:
        keep_newest(run_dir)  # a run resumed from checkpoint.tmp or .old: never delete its only complete checkpoint
        _remove(tmp)
    try:
        if sharded:  # FSDP2: every rank writes its shards; rank 0 also the consolidated model
            if world > 1:
                dist.barrier()  # tmp is cleared before anyone writes into it
            save_sharded(tmp, model, optimizer)  # returns once every rank's shards are written (DCP's last collective)
            if rank != 0:
                return None
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for r, state in enumerate(owns):
            torch.save(state, os.path.join(tmp, f"rank{r}_state.pt"))
        torch.save({"step": step, "world_size": world, "optimizer": None if sharded or not optimizer else
                    optimizer.state_dict(), "weights_only": not optimizer, "fsdp": sharded,
                    "scheduler": scheduler.state_dict(), **(extra or {})},
                   os.path.join(tmp, "trainer_state.pt"))
        write_manifest(tmp, step)
    except Exception as e:
        full = disk_full(e, run_dir)  # before the partial save is removed and frees its space
        if rank == 0:
            _remove(tmp)  # at once: a partial save holds space a full disk needs
        if full:
            fail(f"the disk is full: the checkpoint of step {step} could not be written in {run_dir}; the partial save "
                 f"was removed and {_kept(run_dir)}")
        raise
    _remove(final)  # checkpoint.tmp is complete: a kill from here on resumes from it
    _crash_point(step, "swap")
    os.replace(tmp, final)
    _crash_point(step)
    return final


def _kept(run_dir: str) -> str:
    path = find_checkpoint(run_dir)
    if path is None:
        return "no earlier checkpoint exists: free some space and start again"
    step = (read_manifest(path) or {}).get("step")
    return (f"{path if step is None else f'the checkpoint of step {step}'} is kept: free some space and continue with "
            f"--resume {run_dir}")


def _remove(path: str) -> None:
    """Delete a checkpoint folder, its manifest first: a kill midway leaves a folder that is plainly incomplete."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MANIFEST))
    shutil.rmtree(path, ignore_errors=True)


def keep_newest(run_dir: str) -> None:
    """Leave only the newest complete checkpoint, as run_dir/checkpoint (a run resumed from checkpoint.tmp or .old
    after a kill moves it back), and nothing that could be mistaken for it."""
    best, final = find_checkpoint(run_dir), os.path.join(run_dir, "checkpoint")
    for path in (os.path.join(run_dir, name) for name in FOLDERS):
        if path != best:
            _remove(path)
    if best and best != final:
        os.replace(best, final)


def disk_full(e: BaseException, folder: str) -> bool:
    """Whether a failed write met a full disk: an OSError ENOSPC or EDQUOT in the exception's chain or text
    (safetensors and DCP pass it on as text), or torch.save's short write (`unexpected pos`: torch drops the errno)
    with under 64 MiB left in `folder`."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(x) for x in chain)
    return (any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for x in chain)
            or any(os.strerror(n) in text for n in (errno.ENOSPC, errno.EDQUOT))
            or "unexpected pos" in text and shutil.disk_usage(folder).free < 64 << 20)


def save_sharded(path: str, model, optimizer) -> None:
    """Called by every rank of an FSDP2 model: model and optimizer shards through torch.distributed.checkpoint into
    path/sharded (each rank its own), then the full weights gathered to rank 0's CPU and saved (from_pretrained)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    if optimizer:  # (none: --no-save-optimizer, the consolidated weights only)
        dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))), checkpoint_id=f"{path}/{SHARDED}")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=full)
        plain = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers"))
        model.config.architectures = [plain.__name__]  # not FSDP's generated subclass
        model.config.save_pretrained(path)


def load_sharded(path: str, model, optimizer) -> None:
    """Every rank: read its shards of the model and optimizer from path/sharded into an FSDP2 model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
    dcp.load(state, checkpoint_id=os.path.join(path, SHARDED))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def find_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint folder of a run (the highest step whose manifest is written; an unreadable
    manifest counts, for check_files to report). A run whose checkpoints have no manifest (saved by earlier versions):
    checkpoint, or checkpoint.old when a save was killed between its two renames."""
    paths = [os.path.join(run_dir, name) for name in FOLDERS]
    complete = [(m.get("step", -1), -i, p) for i, p in enumerate(paths) if (m := read_manifest(p)) is not None]
    if complete:
        return max(complete)[2]
    return next((p for p in paths[:2] if os.path.exists(os.path.join(p, "trainer_state.pt"))), None)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or ['no details'])[0][:160]}"


def _load(path: str, where: str) -> dict:
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # empty, truncated or not a torch file
        fail(f"{where}: {path} is truncated or corrupt ({_first_line(e)})")
    if not isinstance(state, dict):
        fail(f"{where}: {path} is not a trainer state")
    return state


def open_checkpoint(resume: str, rank: int, world: int) -> dict | None:
    """Read and check a --resume folder before any work: one-line errors for a missing folder, no checkpoint, a corrupt
    trainer_state.pt, missing weights or shards, a corrupt metrics.jsonl. None without --resume. With another world
    size than the saved one, rank r reads saved rank r % saved_world's state (`resume`)."""
    if not resume:
        return None
    run_dir, where = resume.rstrip("/"), f"--resume {resume}"
    if not os.path.isdir(run_dir):
        fail(f"{where}: no such folder")
    path = find_checkpoint(run_dir)
    if path is None:
        fail(f"{where}: no checkpoint in that folder (expected {os.path.join(run_dir, 'checkpoint')}/trainer_state.pt, "
             "written every --save-every steps and at the end)")
    if not check_files(path, where) and rank == 0:
        print(f"note: {path} has no {MANIFEST} (saved before checksums): its files are not checked")
    state = _load(os.path.join(path, "trainer_state.pt"), where)
    if state.get("weights_only"):
        fail(f"{where}: {path} holds weights only (--no-save-optimizer), not a run to resume; load it by --model-name")
    weights = os.path.join(path, "model.safetensors")
    if os.path.exists(weights):
        try:
            with safe_open(weights, "pt"):  # reads the header and checks it against the file size
                pass
        except Exception as e:
            fail(f"{where}: {weights} is truncated or corrupt ({_first_line(e)})")
    elif not os.path.exists(weights + ".index.json"):  # a sharded checkpoint has an index instead
        fail(f"{where}: {weights} is missing")
    if state.get("fsdp") and not os.path.isdir(os.path.join(path, SHARDED)):
        fail(f"{where}: {os.path.join(path, SHARDED)} is missing (the model and optimizer shards of an --fsdp run)")
    saved_world = state.get("world_size", 1)
    own_path = os.path.join(path, f"rank{rank % saved_world}_state.pt")  # another world size: saved rank r % saved
    if os.path.exists(own_path):
        own = _load(own_path, where)
    elif world == 1 and "rng" in state:  # a checkpoint written before the per-rank files
        own = state
    else:
        fail(f"{where}: {own_path} is missing (this process's RNG and sampler state)")
    own = {**own, "saved_world": saved_world}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        read_metrics(metrics, where)
    return {"run_dir": run_dir, "path": path, "state": state, "own": own, "rank": rank, "where": where}


def resume(ckpt: dict, model, optimizer, scheduler, sampler, dtype: str, device: str) -> dict:
    """Load a checkpoint opened by open_checkpoint: weights, optimizer, scheduler, this rank's sampler and RNG
    states; then (rank 0) drop the metric rows logged after it. Returns trainer_state.pt (step, first_eval, ...)."""
    state, own, where = ckpt["state"], ckpt["own"], ckpt["where"]
    if bool(state.get("fsdp")) != is_sharded(model):
        fail(f"{where}: the checkpoint was written {'with' if state.get('fsdp') else 'without'} --fsdp; resume "
             f"{'with' if state.get('fsdp') else 'without'} it")
    try:
        if state.get("fsdp"):
            load_sharded(ckpt["path"], model, optimizer)
        else:
            from transformers import AutoModelForCausalLM  # the folder was checked file by file by open_checkpoint

            model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt["path"], dtype=getattr(torch, dtype))
                                  .state_dict())
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(own["sampler"])
    except Exception as e:
        fail(f"{where}: {ckpt['path']} does not fit this run ({_first_line(e)})")
    world, note = rank_world()[1], ""
    if own["saved_world"] == world:
        set_rng_state(own["rng"])
    else:  # rank r took saved rank r % saved_world's sampler position (its prompt order drawn from its own seed, seed +
        # rank); new random streams from this rank's seed and the step: no two ranks repeat each other (not bit for bit)
        seed = torch.initial_seed() * 1_000_003 + state["step"]
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        if isinstance(getattr(sampler, "rng", None), random.Random):  # a sampler with its own generator (rloo_sec)
            sampler.rng.seed(seed)
        note = (f" on {world} process(es), saved by {own['saved_world']}: weights, optimizer and schedule restored "
                f"(resharded under --fsdp), data positions from rank r % {own['saved_world']}, new random streams")
    if ckpt["rank"] == 0:
        truncate_metrics(ckpt["run_dir"], state["step"])
        print(f"resumed {ckpt['run_dir']} from step {state['step']}{note}")
    return {**state, **{k: v for k, v in own.items() if k not in ("rng", "sampler", "saved_world")}}


def resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device: str) -> dict:
    """{'step': 0} for a fresh run (`ckpt` None). With a checkpoint opened by open_checkpoint: the weights, optimizer,
    scheduler, this rank's sampler and RNG states restored, the rollout engine given the weights; returns the
    checkpoint's trainer state (its step, first evaluation and what the trainer saved)."""
    if not ckpt:
        return {"step": 0}
    stored = str(next(model.parameters()).dtype).removeprefix("torch.")  # float32 master weights under --dtype bf16
    state = resume(ckpt, model, optimizer, scheduler, sampler, stored, device)
    engine.sync_weights(model)
    return state


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Drop metric and sample rows logged after the checkpoint we resume from (they will be logged again); each file
    is replaced atomically, so a crash here loses nothing."""
    for path in (os.path.join(run_dir, name) for name in ("metrics.jsonl", "samples.jsonl")):
        if os.path.exists(path):
            rows = [r for r in read_metrics(path) if r["step"] <= last_step]
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(path + ".tmp", path)


# Ctrl-C


class CtrlC:
    """What a run's SIGINT handler (`catch_ctrl_c`) reads and its step loop sets: `step`, the step the loop is in (None
    outside the loop: before the first step and in the final evaluation), and `asked`, whether a first Ctrl-C in the
    loop asked for a stop."""

    def __init__(self, run_dir: str, rank: int, script: str = "", save_optimizer: bool = True, no_resume: str = ""):
        self.run_dir, self.rank, self.script = run_dir, rank, os.path.basename(script)
        self.save_optimizer, self.no_resume = save_optimizer, no_resume
        self.step, self.asked, self.quitting = None, False, threading.Lock()

    def say(self, line: str) -> None:
        if self.rank == 0:
            os.write(2, f"\n{line}\n".encode())  # not print: safe inside a signal handler

    def on_sigint(self) -> None:
        """The first Ctrl-C in the loop of a trainer with checkpoints: a stop after the step. Any other: one line
        saying which checkpoint is kept (or, `no_resume`, what to do instead), and exit status 130 at once."""
        if self.step is not None and not self.asked and not self.no_resume:
            self.asked = True
            self.watch_for_a_second_ctrl_c()
            return self.say(f"stopping after step {self.step} finishes and saving a checkpoint; Ctrl-C again to quit "
                            "at once")
        if not self.quitting.acquire(blocking=False):  # the watcher thread is already quitting
            return
        at = f" at step {self.step}" if self.step is not None else ""
        if self.no_resume:  # nothing to resume from, whatever the step
            self.say(f"interrupted: {self.no_resume}")
        else:
            path = find_checkpoint(self.run_dir)  # the newest complete one: a save cut short leaves the previous
            saved = (read_manifest(path) or {}).get("step") if path else None
            kept = (f"the checkpoint of step {saved} is kept; {self.next_move()}" if saved is not None else
                    f"{path} is kept; {self.next_move()}" if path else
                    "no checkpoint was written yet (--save-every N writes one every N steps)")
            self.say(f"interrupted{at}: {kept}")
        os._exit(130)  # at once: no clean-up that could hang (worker pools, a vllm engine, wandb)

    def watch_for_a_second_ctrl_c(self) -> None:
        """Python runs a signal handler only between bytecodes, so a second Ctrl-C during a long torch call (a forward,
        a generation) waited for it to return: seconds, not "at once". The interpreter's C-level handler also writes
        the signal's number to a wakeup fd; a thread reading it quits while the main thread is still in torch (which
        releases the GIL)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        ref = weakref.ref(self)  # weak, and only while the loop runs: a main() called from Python returns, and a
        # later SIGINT of that process is none of this run's business

        def watch():
            while True:
                if os.read(read_end, 1) == bytes([signal.SIGINT]):  # another signal with a Python handler: not ours
                    ctrl_c = ref()
                    if ctrl_c is None:
                        return
                    if ctrl_c.step is not None:
                        ctrl_c.on_sigint()

        threading.Thread(target=watch, name="second-ctrl-c", daemon=True).start()

    def stop_asked(self) -> bool:
        """Whether a Ctrl-C on any rank asked for a stop: one all-reduce of one number, so that every rank stops after
        the same step. The loop calls it once a step, on every rank."""
        return all_reduce_sum(torch.tensor([float(self.asked)])).item() > 0

    def exit_saved(self, bar=None) -> None:
        """After the step a Ctrl-C stopped at is saved: the progress bar closed (its last line before ours), one line
        saying how to go on, and SystemExit(130)."""
        if bar is not None:
            bar.close()
        self.say(f"stopped after step {self.step} (checkpoint saved); {self.next_move()}")
        self.step = None  # the loop is over
        raise SystemExit(130)

    def next_move(self) -> str:  # --no-save-optimizer: weights only, which --resume refuses; a new run loads them
        return (f"continue with: {self.command()}" if self.save_optimizer else "it holds weights only "
                f"(--no-save-optimizer): start a new run from them with --model-name {self.run_dir}/checkpoint")

    def command(self) -> str:
        """This run's command line with --resume <run folder> (torchrun on several nodes: add its launch flags)."""
        argv = sys.argv[1:]
        if os.path.basename(sys.argv[0]) != self.script:  # main() called from Python
            return f"{self.script} with this run's flags and --resume {self.run_dir}"
        argv = [a for i, a in enumerate(argv) if not (a.startswith("--resume") or i and argv[i - 1] == "--resume")]
        world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun
        launch = sys.executable if not world else f"torchrun --nproc-per-node {local}" if world == local else "torchrun"
        return f"{launch} {shlex.join([sys.argv[0], *argv, '--resume', self.run_dir])}"


def catch_ctrl_c(run_dir: str, rank: int, script: str = "", save_optimizer: bool = True,
                 no_resume: str = "") -> CtrlC:
    """From now on a Ctrl-C is one line and exit status 130 (CtrlC.on_sigint): returns the state the step loop sets
    (`step`) and reads (`stop_asked`). `script`: the trainer's file, for the --resume command; `no_resume`: a trainer
    without checkpoints, what to say instead. Installed from the main thread only, and not over a SIGINT the launcher
    ignores. The handler holds the state weakly: once main() has returned, Ctrl-C does what it did before."""
    ctrl_c = CtrlC(run_dir, rank, script, save_optimizer, no_resume)
    previous, ref = signal.getsignal(signal.SIGINT), weakref.ref(ctrl_c)
    if threading.current_thread() is threading.main_thread() and previous is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda sig, frame: ref().on_sigint() if ref() else (
            previous if callable(previous) else signal.default_int_handler)(sig, frame))
    return ctrl_c
