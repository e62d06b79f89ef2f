"""The plumbing around every trainer's loop, so that its `main()` shows the algorithm: seeding and the run folder,
loading the problems, resuming, timing and throughput metrics, the end of the run (the step's math is the trainer's)."""

from __future__ import annotations

import os
import random
import resource
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from common.checkpoint import resume
from common.data import load_problems
from common.dist import all_reduce_sum
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
    statistics) summed over ranks and divided by all ranks' n_tok tokens, optim/grad_norm (mean over steps) and
    optim/lr. On one process: the sums as they are."""
    keys = sorted(sums)
    total = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(n_tok)], dtype=torch.float64))
    n_tok = total[-1].item()
    return {**{k: total[i].item() / (n_updates if k.startswith("loss/") else max(n_tok, 1.0))
               for i, k in enumerate(keys)},
            "optim/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0, "optim/lr": lr}


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
    """The final evaluation (returned), logged at `step`; the logger closed (curve.png); rank 0 prints before, after."""
    final_eval = run_eval()
    logger.log(step, final_eval)
    final_eval = without_samples(final_eval)
    logger.close()
    if rank == 0:
        before, after = first_eval.get("eval/greedy_accuracy", 0.0), final_eval.get("eval/greedy_accuracy", 0.0)
        print(f"{what}: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points, "
              f"n={final_eval.get('eval/num_problems', '?')}); run folder {run_dir}")
    return final_eval
