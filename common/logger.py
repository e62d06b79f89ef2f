"""Run folder, metrics (console, JSONL, wandb), learning curve, checkpoints, resume, and the flag checks
every trainer shares.

    runs/<run_name>/
        args.json          the resolved arguments
        metrics.jsonl      one JSON object per logged step (and per eval)
        samples.jsonl      a few rollouts and greedy held-out answers as text, at evaluation steps and the last step
        curve.png          reward and eval accuracy against step, written at the end
        checkpoint/        latest checkpoint (model, tokenizer, optimizer, RNG, data position)
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

CONSOLE_KEYS = ("reward/mean", "train/accuracy", "adv/frac_zero_std", "loss/policy", "policy/entropy",
                "rollout/completion_len", "perf/step_time", "eval/greedy_accuracy")
SAMPLES = "samples/"
"""metrics whose key starts with this hold lists of sample dicts (`sample_rows`): they go to samples.jsonl, not to
metrics.jsonl ('samples/train': the step's rollouts, 'samples/eval': greedy held-out answers)"""
PROMPT_TAIL_CHARS = 200
"""how much of the end of a prompt a sample keeps (the question is at the end; chat headers and hints before it)"""


class RunLogger:
    """Writes every metric to metrics.jsonl, a compact line to the console, and wandb with `track`."""

    def __init__(self, args, run_dir: str, enabled: bool = True):
        self.run_dir, self.enabled, self.wandb, self.samples_file = run_dir, enabled, None, None
        if not enabled:  # non-zero ranks under torchrun
            return
        os.makedirs(run_dir, exist_ok=True)
        path, now = os.path.join(run_dir, "args.json"), json.loads(json.dumps(dataclasses.asdict(args)))
        if getattr(args, "resume", "") and os.path.exists(path):  # a resumed run keeps its original args.json
            try:
                with open(path) as f:
                    saved = dict(json.load(f))
            except (ValueError, TypeError):
                saved = {}
            changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if k != "resume" and saved.get(k) != v]
            if changed:
                print("note: resuming with flags that differ from args.json: " + ", ".join(changed))
        else:
            with open(path, "w") as f:
                json.dump(now, f, indent=2)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=os.path.basename(run_dir),
                                    config=dataclasses.asdict(args), dir=run_dir, resume="allow",
                                    id=os.path.basename(run_dir).replace("/", "_"))

    def log(self, step: int, metrics: dict, bar=None) -> None:
        """One row of metrics.jsonl and a console line; the sample lists among `metrics` (keys 'samples/...') go to
        samples.jsonl, one row per sample, to the console (one compact line each) and to wandb as a Table."""
        if not self.enabled:
            return
        samples = {k: v for k, v in metrics.items() if k.startswith(SAMPLES)}
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items() if k not in samples}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        line = f"step {step:>4} " + " ".join(
            f"{k.split('/')[-1]}={row[k]:.3g}" for k in CONSOLE_KEYS if isinstance(row.get(k), (int, float)))
        write = bar.write if bar is not None else print
        write(line)
        for key, rows in samples.items():
            self.log_samples(step, key[len(SAMPLES):], rows, write)

    def log_samples(self, step: int, kind: str, rows: list[dict], write=print) -> None:
        if not rows:
            return
        if self.samples_file is None:
            self.samples_file = open(os.path.join(self.run_dir, "samples.jsonl"), "a")
        rows = [{k: _plain(v) for k, v in r.items()} for r in rows]
        for i, r in enumerate(rows):
            self.samples_file.write(json.dumps({"step": step, "kind": kind, "index": i, **r}) + "\n")
            write(console_sample(step, kind, i, r))
        self.samples_file.flush()
        if self.wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for r in rows for k in r))
            data = [[r.get(c) if not isinstance(r.get(c), (list, dict)) else json.dumps(r.get(c)) for c in columns]
                    for r in rows]
            table = wandb.Table(columns=["step", *columns], data=[[step, *d] for d in data])
            self.wandb.log({f"{SAMPLES}{kind}": table}, step=step)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.samples_file is not None:
            self.samples_file.close()
        if plot:
            plot_curve(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.run_dir, "curve.png"))
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.floating, np.integer, np.bool_)):
        v = v.item()
    return v


def sample_rows(tokenizer, rollouts, problems: list, k: int, group_size: int = 1, **fields) -> list[dict]:
    """Up to `k` rows of `rollouts` as text for samples.jsonl, the first row of each of the first k groups of
    `group_size` rows: the end of its prompt and its completion as decoded with the special tokens shown (so a missing
    or doubled eos is visible), `truncated` (no stop token within --max-new-tokens: the text is cut), the gold answer
    and level of its problem (`problems` per row), and for each keyword its value at that row (a per-row tensor or
    list: the reward and its parts, the advantage, a trainer's own fields). Costs no generation: the rows are the
    step's (or the evaluation's) own.

    >>> from common.rollout import attach
    >>> from common.testbed import Problem, build_tokenizer
    >>> tok = build_tokenizer()
    >>> r = attach([tok("Q:1+2\\nA:")["input_ids"]] * 2, [(tok("3")["input_ids"] + [tok.eos_token_id], "3", False),
    ...            (tok("4")["input_ids"], "4", True)], tok.pad_token_id)
    >>> rows = sample_rows(tok, r, [Problem("1+2", "3")] * 2, k=4, group_size=1, reward=torch.tensor([1.0, 0.0]))
    >>> [(x["completion"], x["truncated"], x["gold"], x["reward"]) for x in rows]
    [('3<|im_end|>', False, '3', 1.0), ('4', True, '3', 0.0)]
    """
    out = []
    for b in range(0, len(problems), group_size)[:k]:
        L = rollouts.prompt_len
        prompt_L = rollouts.input_ids_BT[b, :L][rollouts.attention_mask_BT[b, :L] > 0]
        completion = rollouts.completion_ids_BC[b, : int(rollouts.lengths_B[b])]
        problem = problems[b]
        out.append({"prompt_tail": tokenizer.decode(prompt_L, skip_special_tokens=False)[-PROMPT_TAIL_CHARS:],
                    "completion": tokenizer.decode(completion, skip_special_tokens=False),
                    "truncated": bool(rollouts.truncated_B[b]), "gold": getattr(problem, "answer", None),
                    "level": getattr(problem, "level", None),
                    **{name: _plain(v[b]) if v is not None else None for name, v in fields.items()}})
    return out


def console_sample(step: int, kind: str, index: int, row: dict, width: int = 100) -> str:
    """One compact console line of a sample: its scalar fields, the end of the prompt and the completion, newlines
    shown as '\\n', cut to `width` characters each ('[cut]' marks a completion cut at --max-new-tokens).

    >>> console_sample(3, "train", 0, {"prompt_tail": "Q:1+2\\nA:", "completion": "3", "truncated": False,
    ...                                "gold": "3", "reward": 1.0, "level": 1})
    "  sample step 3 train #0: gold=3 reward=1 | 'Q:1+2\\\\nA:' -> '3'"
    """
    def short(text: str, keep_end: bool = False) -> str:
        text = repr(text)[1:-1]
        return ("..." + text[-width:] if keep_end else text[:width] + "...") if len(text) > width else text

    fields = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                      if k not in ("prompt_tail", "completion", "truncated", "level") and v is not None
                      and not isinstance(v, (list, dict)))
    cut = " [cut]" if row.get("truncated") else ""
    return (f"  sample step {step} {kind} #{index}: {fields} | '{short(row.get('prompt_tail', ''), True)}' -> "
            f"'{short(row.get('completion', ''))}'{cut}")


def read_metrics(path: str, where: str = "") -> list[dict]:
    """Rows of a metrics.jsonl. A last line cut short by a crash (no newline) is skipped; any other bad line is a
    one-line error."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = "bad"
        if row is None or (row == "bad" and i == len(lines)):
            continue
        if not (isinstance(row, dict) and "step" in row):
            fail(f"{where + ': ' if where else ''}{path} line {i} is not a metrics row")
        rows.append(row)
    return rows


def plot_curve(metrics_path: str, out_path: str) -> None:
    """Reward (train) and greedy accuracy (held-out) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style in (("reward/mean", "-"), ("eval/greedy_accuracy", "o-"), ("eval/pass_at_k", "s--")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=key, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------
# Checkpoints and resume
# ----------------------------------------------------------------------------------------
# One checkpoint folder per run, written by rank 0: the model (save_pretrained), tokenizer, trainer_state.pt
# (step, world size, optimizer, scheduler and whatever the trainer adds) and rank{r}_state.pt for every rank r
# (that rank's Python/NumPy/torch RNG states and its prompt sampler), so that under torchrun each rank continues
# its own random stream and data order.
# Under --fsdp (FSDP2) every rank also writes its model and AdamW shards to checkpoint/sharded through
# torch.distributed.checkpoint (what resume reads), and model.safetensors is the consolidated export.

KILL_AFTER_SAVE = "TINYPOST_TEST_KILL_AFTER_SAVE"
"""tests: SIGKILL the process right after the checkpoint of this step is written (a deterministic crash point)"""


def fail(msg: str):
    raise SystemExit(f"error: {msg}")


def check_sampling_args(args) -> None:
    """Sampling flags that would fail deep inside torch: a one-line error instead. Greedy decoding is what the
    evaluation does; a training sampler needs a temperature above 0 (its log-probs are divided by it)."""
    if not args.temperature > 0:
        fail(f"--temperature {args.temperature} must be above 0 (log-probs are computed at the sampling temperature; "
             "greedy answers are what the evaluation reports)")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p {args.top_p} must be in (0, 1] (1 keeps the sampler exactly on-policy)")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens {args.max_new_tokens} must be at least 1")


def check_run_args(args, min_group_size: int = 2) -> None:
    """Flags that contradict each other, shared by the group-sampling trainers: a one-line error before any work."""
    check_sampling_args(args)
    batch = args.num_prompts * args.group_size
    for name in ("num_prompts", "group_size", "num_iterations", "num_minibatches", "micro_batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.total_steps < 0:
        fail(f"--total-steps {args.total_steps} must be at least 0")
    if args.group_size < min_group_size:
        fail(f"--group-size {args.group_size} must be at least {min_group_size} (a group baseline needs two samples)")
    if batch % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch} rollouts "
             "(--num-prompts x --group-size)")
    if args.eval_samples > 0 and args.eval_pass_k > args.eval_samples:
        fail(f"--eval-pass-k {args.eval_pass_k} is larger than --eval-samples {args.eval_samples} "
             "(pass@k is estimated from that many samples per problem)")
    if args.share_prompt and args.gradient_checkpointing:
        fail("--share-prompt cannot share under --gradient-checkpointing: checkpointed layers keep no KV cache, so the "
             "policy's passes would take the plain forward and only the reference's would share; drop one of the two")
    if getattr(args, "tis", "none") != "none" and args.rollout_backend != "vllm":
        fail(f"--tis {args.tis} corrects a separate sampler's mismatch; --rollout-backend {args.rollout_backend} "
             "samples from the trainer itself (use --rollout-backend vllm)")


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, scheduler, sampler,
                    extra: dict | None = None, rank_extra: dict | None = None) -> str | None:
    """Called by every rank. Rank 0 writes run_dir/checkpoint atomically (a crash mid-write leaves the previous
    one intact), with each rank's RNG states, sampler and `rank_extra` (a trainer's per-rank state, e.g. adakp's
    knowledge-point selections) gathered into rank{r}_state.pt; `extra` (the same on every rank) goes to
    trainer_state.pt. `resume` returns both."""
    from common.dist import is_sharded

    own = {"rng": rng_state(), "sampler": sampler.state_dict(), **(rank_extra or {})}
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    owns = [own] if world == 1 else [None] * world
    sharded, rank = is_sharded(model), dist.get_rank() if world > 1 else 0
    if world > 1:
        dist.gather_object(own, owns if rank == 0 else None, dst=0)
        if rank != 0 and not sharded:
            return None
    final = os.path.join(run_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if sharded:  # FSDP2: every rank writes its shards; rank 0 also the consolidated model
        if world > 1:
            dist.barrier()  # tmp is cleared before anyone writes into it
        save_sharded(tmp, model, optimizer)
        if rank != 0:
            return None
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for r, state in enumerate(owns):
        torch.save(state, os.path.join(tmp, f"rank{r}_state.pt"))
    torch.save({"step": step, "world_size": world, "optimizer": None if sharded else optimizer.state_dict(),
                "fsdp": sharded, "scheduler": scheduler.state_dict(), **(extra or {})},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    if os.environ.get(KILL_AFTER_SAVE) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    return final


SHARDED = "sharded"
"""FSDP2 checkpoints: the torch.distributed.checkpoint folder (model and AdamW shards) inside checkpoint/"""


def save_sharded(path: str, model, optimizer) -> None:
    """Called by every rank of an FSDP2 model: model and optimizer shards through torch.distributed.checkpoint into
    path/sharded (each rank writes its own), then the full weights gathered to rank 0's CPU and written with
    save_pretrained into path, so that the folder loads with from_pretrained."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(path, SHARDED))
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

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, SHARDED))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def find_checkpoint(run_dir: str) -> str | None:
    """The checkpoint folder of a run, or the previous one if a save was interrupted mid-swap."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(run_dir, name)
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            return path
    return None


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
    """Read and check a --resume folder before any work: one-line errors for a missing folder, no checkpoint,
    a truncated or corrupt trainer_state.pt, missing weights or shards, or a corrupt metrics.jsonl. None without
    --resume. With a world size other than the saved one, rank r reads saved rank r % saved_world's state (`resume`)."""
    if not resume:
        return None
    run_dir, where = resume.rstrip("/"), f"--resume {resume}"
    if not os.path.isdir(run_dir):
        fail(f"{where}: no such folder")
    path = find_checkpoint(run_dir)
    if path is None:
        fail(f"{where}: no checkpoint in that folder (expected {os.path.join(run_dir, 'checkpoint')}/trainer_state.pt, "
             "written every --save-every steps and at the end)")
    state = _load(os.path.join(path, "trainer_state.pt"), where)
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
    from common.models import load_model

    state, own, where = ckpt["state"], ckpt["own"], ckpt["where"]
    from common.dist import is_sharded

    if bool(state.get("fsdp")) != is_sharded(model):
        fail(f"{where}: the checkpoint was written {'with' if state.get('fsdp') else 'without'} --fsdp; resume "
             f"{'with' if state.get('fsdp') else 'without'} it")
    try:
        if state.get("fsdp"):
            load_sharded(ckpt["path"], model, optimizer)
        else:
            model.load_state_dict(load_model(ckpt["path"], dtype, device).state_dict())
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(own["sampler"])
    except Exception as e:
        fail(f"{where}: {ckpt['path']} does not fit this run ({_first_line(e)})")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    note = ""
    if own["saved_world"] == world:
        set_rng_state(own["rng"])
    else:  # rank r took saved rank r % saved_world's sampler position (a prompt order is drawn from the sampler's own
        # seed, seed + rank); the random streams are new, seeded from this rank's seed and the step, so that no two
        # ranks repeat each other (not bit for bit what an uninterrupted run would do)
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


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Drop metric and sample rows logged after the checkpoint we resume from (they will be logged again); each file
    is replaced atomically, so a crash here loses nothing."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            rows = [r for r in read_metrics(path) if r["step"] <= last_step]
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(path + ".tmp", path)
