"""The plumbing around every trainer's loop, so that its `main()` shows the algorithm: seeding and the run folder,
loading the problems, resuming, Ctrl-C and the warning of a run that cannot learn, timing and throughput metrics, the
end of the run (the step's math is the trainer's)."""

from __future__ import annotations

import os
import random
import resource
import shlex
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from common.checkpoint import resume
from common.data import load_problems
from common.dist import all_reduce_sum
from common.reasoning_gym import is_rg, without_held_out
from common.logger import SAMPLES


def start_run(args, rank: int) -> str:
    """Seed python, numpy and torch with seed + rank; return the run folder: the --resume folder, or
    output_dir/{run_name or exp_name__seed__unix time}, with rank 0's time under torchrun (one folder for all)."""
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    stamp = [int(time.time())]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return getattr(args, "resume", "").rstrip("/") or os.path.join(
        args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}__{stamp[0]}")


def load_train_eval(args) -> tuple[list, list]:
    """Training and held-out problems: --eval-dataset (another file: both read whole), else --dataset's --eval-split."""
    fields = dict(dataset_config=args.dataset_config, question_field=args.question_field,
                  answer_field=args.answer_field, solution_field=args.solution_field,
                  whole=os.path.realpath(args.eval_dataset or args.dataset) != os.path.realpath(args.dataset))
    train = load_problems(args.dataset, args.train_split, args.levels, args.num_train_problems, args.seed, **fields)
    held_out = load_problems(args.eval_dataset or args.dataset, args.eval_split, args.levels, args.num_eval_problems,
                             args.seed, **fields)
    if is_rg(args.dataset):  # other seeds can draw the same question at a small level: none held out is trained on
        train = without_held_out(train, held_out)
    return train, held_out


def resume_state(ckpt, model, optimizer, scheduler, sampler, engine, args, device: str) -> dict:
    """{'step': 0} for a fresh run. With a checkpoint opened by open_checkpoint: the weights, optimizer, scheduler, this
    rank's sampler and RNG states restored, the engine given the weights; returns the checkpoint's trainer state."""
    if not ckpt:
        return {"step": 0}
    stored = str(next(model.parameters()).dtype).removeprefix("torch.")  # float32 master weights under --dtype bf16
    state = resume(ckpt, model, optimizer, scheduler, sampler, stored, device)
    engine.sync_weights(model)
    return state


class RunControl:
    """Ctrl-C without a traceback, and a warning when a run cannot learn (docs/runs.md). The first Ctrl-C in the loop
    (`steps`) stops it after the step, saved (`save_due`, agreed over ranks): the --resume command, SystemExit(130). A
    second one, one outside the loop, or any in a trainer without checkpoints (`no_resume`: what to do instead) quits at
    once. Once main() has returned, Ctrl-C does what it did before."""

    def __init__(self, args, run_dir: str, rank: int, ckpt: dict | None = None, no_resume: str = ""):
        self.args, self.run_dir, self.rank, self.no_resume = args, run_dir, rank, no_resume
        self.saved = ckpt["state"]["step"] if ckpt else 0  # the last step whose checkpoint is on disk (0: none)
        self.step, self.looping, self.asked, self.stop, self.due, self.stuck = self.saved, False, 0, 0, 0, []
        previous, ref = signal.getsignal(signal.SIGINT), weakref.ref(self)  # weak: gone with main(), `previous` again
        if threading.current_thread() is threading.main_thread() and previous is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, lambda sig, frame: ref()._interrupt() if ref() else (
                previous if callable(previous) else signal.default_int_handler)(sig, frame))

    def _say(self, line: str) -> None:
        if self.rank == 0:
            os.write(2, f"\n{line}\n".encode())  # not print: safe inside a signal handler

    def _interrupt(self) -> None:
        if self.looping and not self.asked and not self.no_resume:
            self.asked = 1
            return self._say(f"stopping after step {self.step} finishes and saving a checkpoint; Ctrl-C again to quit "
                             "at once")
        kept = (f"the checkpoint of step {self.saved} is kept; {self.next_move()}" if self.saved else
                "no checkpoint was written yet (--save-every N writes one every N steps)")
        self._say(f"interrupted: {self.no_resume}" if self.no_resume else f"interrupted at step {self.step}: {kept}")
        os._exit(130)  # at once: no clean-up that could hang (worker pools, a vllm engine, wandb)

    def next_move(self) -> str:  # --no-save-optimizer: weights only, which --resume refuses; a new run loads them
        return (f"continue with: {self.command()}" if getattr(self.args, "save_optimizer", True) else "it holds weights"
                f" only (--no-save-optimizer): start a new run from them with --model-name {self.run_dir}/checkpoint")

    def command(self) -> str:
        """This run's command line with --resume <run folder> (torchrun on several nodes: add its launch flags)."""
        script, argv = f"{type(self.args).exp_name}.py", sys.argv[1:]
        if os.path.basename(sys.argv[0]) != script:  # main() called from Python
            return f"{script} with this run's flags and --resume {self.run_dir}"
        argv = [a for i, a in enumerate(argv) if not (a.startswith("--resume") or i and argv[i - 1] == "--resume")]
        world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun
        launch = sys.executable if not world else f"torchrun --nproc-per-node {local}" if world == local else "torchrun"
        return f"{launch} {shlex.join([sys.argv[0], *argv, '--resume', self.run_dir])}"

    def steps(self, bar):
        """The steps of `bar`; after the step a Ctrl-C stopped at (and its checkpoint), SystemExit(130)."""
        self.looping = True
        for self.step in bar:
            yield self.step
            self.saved = self.step if self.due else self.saved
            if self.stop:
                bar.close()  # its last line before ours
                self._say(f"stopped after step {self.step} (checkpoint saved); {self.next_move()}")
                raise SystemExit(130)
        self.looping = False

    def save_due(self, step: int) -> bool:
        """Whether `step` ends with a checkpoint: every --save-every steps, the last step, and the step a Ctrl-C on any
        rank stopped at (the same answer on every rank)."""
        self.stop = all_reduce_sum(torch.tensor([float(self.asked)])).item() > 0
        self.due = self.stop or step == self.args.total_steps or bool(
            self.args.save_every and step % self.args.save_every == 0)
        return self.due

    def warn_if_stuck(self, step: int, m: dict, patience: int = 3) -> None:
        """One console line when `patience` steps in a row had no learning signal (adv/mean_abs 0 in the metrics `m`:
        every advantage on every rank 0), saying why from the step's metrics; a step with signal resets the count."""
        self.stuck = self.stuck + [step] if m.get("adv/mean_abs") == 0 else []
        if len(self.stuck) == patience and self.rank == 0:
            acc, cut, n = m.get("train/accuracy"), m.get("rollout/truncated_frac", 0.0), self.args.max_new_tokens
            why = ["every group's rewards were equal"] if m.get("adv/frac_zero_std") == 1 else []
            why += ["none correct"] if acc == 0 else ["all correct: the problems are too easy"] if acc == 1 else []
            why += ([f"{100 * cut:.0f} % of completions were cut at --max-new-tokens {n}: raise it"] if cut >= 0.5
                    else ["too hard, or answers in a wrong format? (samples.jsonl)"] if acc == 0 else [])
            tqdm.write("; ".join([f"warning: steps {self.stuck[0]}-{step} had no learning signal (every advantage 0"
                                  + ("; updates skipped)" if m.get("update/skipped") else ")"), *why]))


def step_bar(args, start_step: int, rank: int):
    """The progress bar over steps start_step + 1 .. total_steps (rank 0 only)."""
    return tqdm(range(start_step + 1, args.total_steps + 1), desc=args.exp_name, disable=rank != 0,
                initial=start_step, total=args.total_steps)


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name]."""
    t0 = time.time()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.time() - t0


def sample_step(args, step: int) -> bool:
    """Whether the rollouts of `step` are written as samples (samples.jsonl): with --log-samples > 0, at evaluation
    steps (--eval-every), the last step, and every --log-samples-every steps."""
    every, extra = getattr(args, "eval_every", 0), args.log_samples_every
    return args.log_samples > 0 and (step == args.total_steps or bool(every and step % every == 0)
                                     or bool(extra and step % extra == 0))


def minibatch_order(args) -> torch.Tensor:
    """The batch's rows in the order an epoch's mini-batches take them (`order.split(args.minibatch_size)`): in order
    for one mini-batch, else shuffled; with --share-prompt a whole group at a time, its rows adjacent and in order, so
    that the update shares each group's prompt as the old log-probs' pass did (`common.rollout.completion_logits`);
    rows shuffled one by one would take the plain forward, which rounds differently (ratio not 1, issue 36).

    >>> from types import SimpleNamespace
    >>> order = minibatch_order(SimpleNamespace(batch_size=6, group_size=2, num_minibatches=3, share_prompt=True))
    >>> sorted(order.view(3, 2).tolist())
    [[0, 1], [2, 3], [4, 5]]
    """
    if args.num_minibatches == 1:
        return torch.arange(args.batch_size)
    if not args.share_prompt:
        return torch.randperm(args.batch_size)
    G = args.group_size
    return (torch.randperm(args.batch_size // G)[:, None] * G + torch.arange(G)).flatten()


def update_metrics(sums: dict, grad_norms: list[float], lr: float, n_updates: int, n_tok: float) -> dict:
    """The update's statistics, for the union batch of all ranks: the loss/* sums (each rank's share of the loss, its
    normalisers being global) summed over ranks as means over its n_updates optimizer steps, the other sums (per-token
    statistics) summed over ranks and divided by all ranks' n_tok tokens (as they are on one process), optim/grad_norm
    (mean over steps), optim/lr, update/skipped (1: no update, and loss/*, clip_frac, approx_kl the 0 it would log)."""
    keys = sorted(sums)
    total = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(n_tok)], dtype=torch.float64))
    n_tok = total[-1].item()
    skipped = dict.fromkeys(("loss/policy", "loss/kl", "policy/clip_frac", "policy/approx_kl"), 0.0)  # A = 0, ratio 1
    return {**({} if grad_norms else skipped), **{k: total[i].item() / (n_updates if k.startswith("loss/") else
                                                                      max(n_tok, 1.0)) for i, k in enumerate(keys)},
            "optim/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0, "optim/lr": lr,
            "update/skipped": float(not grad_norms)}


def peak_mem_gb(device: str) -> float:
    return (torch.cuda.max_memory_allocated() if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30


def rollout_perf_metrics(rollouts, times: dict, train_passes: int, device: str, gen_tokens: float | None = None,
                         train_rollouts=None) -> dict:
    """Completion length and truncation of the sampled `rollouts`, time/<phase> for each timed phase, generation
    throughput (gen_tokens: default, the rollouts' completion tokens), training throughput (train_passes passes, e.g.
    PPO epochs, over train_rollouts, default the rollouts), and peak memory."""
    gen_tokens = rollouts.lengths_B.sum().item() if gen_tokens is None else gen_tokens
    train_rollouts = rollouts if train_rollouts is None else train_rollouts
    return {"rollout/completion_len": rollouts.lengths_B.float().mean().item(),
            "rollout/truncated_frac": rollouts.truncated_B.float().mean().item(),
            **{f"time/{k}": v for k, v in times.items()},
            "perf/gen_tokens_per_s": gen_tokens / max(times.get("generate", 0.0), 1e-9),
            "perf/train_tokens_per_s": train_passes * train_rollouts.attention_mask_BT.sum().item()
            / max(times.get("update", 0.0), 1e-9),
            "perf/peak_mem_gb": peak_mem_gb(device)}


def first_evaluation(run_eval, state: dict, logger) -> dict:
    """The held-out evaluation before training, logged at the start step (a resumed run keeps the one it had)."""
    first_eval = state.get("first_eval")
    if first_eval is None:
        first_eval = run_eval()
        logger.log(state["step"], first_eval)
    return without_samples(first_eval)


def without_samples(metrics: dict) -> dict:
    """The metrics without their sample lists (common.logger.SAMPLES), as kept in checkpoints and returned by main."""
    return {k: v for k, v in metrics.items() if not k.startswith(SAMPLES)}


def finish_run(run_eval, logger, first_eval: dict, step: int, rank: int, run_dir: str,
               what: str = "held-out greedy accuracy") -> dict:
    """The final evaluation (returned), logged at `step`; the logger closed (curve.png); rank 0 prints before, after.
    Step 0 (--total-steps 0, an evaluation-only run): the weights never changed, so the first evaluation is the last."""
    final_eval = run_eval() if step else first_eval
    if step:
        logger.log(step, final_eval)
    final_eval = without_samples(final_eval)
    logger.close()
    if rank == 0:
        before, after = first_eval.get("eval/greedy_accuracy", 0.0), final_eval.get("eval/greedy_accuracy", 0.0)
        change = f"-> {after:.3f} ({100 * (after - before):+.1f} points, " if step else "(evaluation only, "
        print(f"{what}: {before:.3f} {change}n={final_eval.get('eval/num_problems', '?')}); run folder {run_dir}")
    return final_eval
