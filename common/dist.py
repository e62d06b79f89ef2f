"""Data parallelism under `torchrun`, written out: every rank samples its own prompts, and
gradients and loss normalisers are summed across ranks (no DDP wrapper)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world_size, device). Single process when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, world, device


def _all_reduce_(x: torch.Tensor) -> None:
    """In-place sum over ranks; NCCL only reduces CUDA tensors, so CPU scalars make a round trip."""
    if dist.get_backend() == "nccl" and x.device.type != "cuda":
        y = x.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        x.copy_(y.cpu())
    else:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        _all_reduce_(x)
    return x


def all_reduce_grads(model) -> None:
    """Sum gradients over ranks; the loss was already divided by the global normaliser."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_mean(metrics: dict) -> dict:
    """Average scalar metrics over ranks for logging."""
    if not (dist.is_available() and dist.is_initialized()):
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    _all_reduce_(t)
    return {**metrics, **{k: (t[i] / dist.get_world_size()).item() for i, k in enumerate(keys)}}
