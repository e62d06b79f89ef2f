"""Data parallelism under `torchrun`, written out: every rank samples its own prompts, and gradients and loss
normalisers are summed across ranks (no DDP wrapper).

Two ways to hold the model:
- plain (default): every rank keeps the whole model and optimizer; after backward, `all_reduce_grads` sums the
  gradients in buckets of at most 25 MB.
- `--fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on every decoder layer (and on untied input and output
  embeddings) and on the root, so each rank keeps 1/world of the parameters, gradients and AdamW state; a layer's
  parameters are all-gathered just before its forward and its gradients reduce-scattered (summed, not averaged) right
  after its backward. `shard_models` wraps the policy and the reference/teacher models the same way; `clip_grad_norm_`
  on the sharded parameters computes the global norm. Generation under FSDP runs inside `unsharded(model)` (every
  layer gathered once, no collective per decoding step, so ranks may stop at different lengths), and a separate
  sampler gets full tensors one parameter at a time (`full_weights`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import glob
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20
"""plain data parallel: gradients are all-reduced in flat buckets of at most this many bytes"""


def init_distributed(device: str, timeout_minutes: float = 180.0) -> tuple[int, int, str]:
    """(rank, world_size, device); a single process when not launched by torchrun. `timeout_minutes`: how long a rank
    waits in a collective for the others (NCCL's 10 are shorter than ppo_slm.py's SFT and RM stages on rank 0 alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        import torch.distributed.nn.functional  # noqa: F401  (before the group exists: see release_process_group)

        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
        atexit.register(release_process_group)
    return rank, world, device


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (a trainer passes --seed + rank: each rank its own random stream)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def release_process_group() -> None:
    """Registered at exit by init_distributed (and shard_models' one-process group): destroy the process group and
    free it, with no barrier (a rank that ends early, or fails, never waits), while the interpreter is whole.

    Why more than destroy_process_group: under FSDP2 the group outlived it. DTensor caches its sharding plans in
    lru caches keyed by device mesh, and each DeviceMesh holds the group in `_pg_registry`, so the group and gloo's
    threads (gloo_tcp_loop, pt_gloo_runloop) lived on into the interpreter's teardown, where the group was freed
    at an arbitrary point of module clean-up and a rank sometimes aborted ("terminate called without an active
    exception", SIGABRT). Emptying the meshes' registries (and dropping an uncaught error's frames, already printed)
    frees the group here, in the main thread, with every module alive. Each FSDP unit's mesh info holds the group
    too, and one decoder layer's unit sometimes outlived main() (once in CI, once in about 60 runs here, on a
    one-process --fsdp resume; what kept it was not found), so mesh infos drop their handles as well. A gloo thread
    still running afterwards (a model kept alive past exit) is named on stderr, which every torchrun launch in the
    suite asserts never happens (tests/conftest.py assert_released_at_exit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    for name in ("last_exc", "last_value", "last_traceback"):  # an uncaught error's frames (already printed) hold
        setattr(sys, name, None)  # the group through their locals
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

        for obj in gc.get_objects():
            kind = type(obj)  # not isinstance: that reads __class__, and a deprecated torch alias warns on it
            if issubclass(kind, DeviceMesh):
                obj._pg_registry.clear()
            elif issubclass(kind, DataParallelMeshInfo):  # an FSDP unit's own handles on the group
                for name in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
                    if getattr(obj, name, None) is not None:
                        setattr(obj, name, None)
    gc.collect()
    left = sorted(n for n in _thread_names() if n.startswith(("gloo", "pt_gloo")))
    if left:
        print(f"[dist] pid {os.getpid()}: gloo threads still running at exit ({', '.join(left)}): an object outside "
              "the process group still holds it", file=sys.stderr, flush=True)


def _thread_names() -> list[str]:
    """The names of this process's threads (Linux; none elsewhere)."""
    names = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names


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


def _reduce_bucket(grads: list[torch.Tensor]) -> None:
    if len(grads) == 1 and grads[0].is_contiguous():
        _all_reduce_(grads[0])
        return
    flat = torch.cat([g.flatten() for g in grads])
    _all_reduce_(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def all_reduce_grads(model, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum gradients over ranks; the loss was already divided by the global normaliser. Gradients go in buckets of
    at most `bucket_bytes` (one of the same dtype, in parameter order), so the extra memory is one bucket, not a
    copy of every gradient; only trainable parameters' (a LoRA trainer's other adapters are frozen). Nothing to do
    under FSDP: its backward already reduce-scattered the summed gradients."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or is_sharded(model):
        return
    bucket, size = [], 0
    for g in (p.grad for p in model.parameters() if p.grad is not None and p.requires_grad):
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype):
            _reduce_bucket(bucket)
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        _reduce_bucket(bucket)


def global_std(x: torch.Tensor) -> torch.Tensor:
    """The (biased) standard deviation of `x` pooled over every rank's `x`: what one process holding the union batch
    computes (`x.std(unbiased=False)` on one process).

    >>> global_std(torch.tensor([1., 3.]))
    tensor(1.)
    """
    moments = all_reduce_sum(torch.stack([torch.tensor(float(x.numel())), x.double().sum(), x.double().pow(2).sum()]))
    n = moments[0].clamp(min=1)
    return ((moments[2] / n - (moments[1] / n) ** 2).clamp(min=0).sqrt()).to(x.dtype)


def all_reduce_mean(metrics: dict) -> dict:
    """Average scalar metrics over ranks for logging."""
    if not (dist.is_available() and dist.is_initialized()):
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    t = all_reduce_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return {**metrics, **{k: (t[i] / dist.get_world_size()).item() for i, k in enumerate(keys)}}


# FSDP2


def is_sharded(model) -> bool:
    """Whether `model` was wrapped by `fully_shard` (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The modules to shard one by one: those whose class the model names in `_no_split_modules` (the decoder
    layers of a Hugging Face model, e.g. Qwen2DecoderLayer)."""
    names = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def shard_models(args, *models):
    """With `args.fsdp`: FSDP2 on every decoder layer and then on the root of each model (None passes through),
    all on one mesh over every rank; gradients are summed over ranks (the losses are divided by global
    normalisers, as on the plain path). --dtype bfloat16 / float16 (with master weights): compute with copies of the
    parameters in that dtype and reduce gradients in float32; the sharded parameters and AdamW state stay float32
    (frozen models stored in float32, the reference and direct_opd's teachers, compute under the same policy).
    Without --fsdp the models come back unchanged. One process with --fsdp gets a one-rank group (same code path)."""
    if not getattr(args, "fsdp", False):
        return models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(m for m in models if m is not None).device if any(m is not None for m in models) else None
    if not dist.is_initialized():  # a single process: a group of one, so that FSDP has a mesh
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(release_process_group)
    mesh = init_device_mesh(device.type if device is not None else "cpu", (dist.get_world_size(),))
    low = getattr(args, "dtype", "float32") != "float32" and getattr(args, "master_weights", False)
    mp = (MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32) if low
          else MixedPrecisionPolicy())
    for model in (m for m in models if m is not None):
        units = decoder_layers(model)
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and embed is not None and head.weight is not embed.weight:  # untied: units of their own
            units += [embed, head]  # (tied ones share a parameter and stay with the root)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # final norm, tied embeddings
        for m in (m for m in model.modules() if is_sharded(m)):  # these two setters are per module, not recursive
            m.set_gradient_divide_factor(1.0)  # sum over ranks, as all_reduce_grads does ...
            m.set_force_sum_reduction_for_comms(True)  # ... with ReduceOp.SUM (gloo has no PREMUL_SUM)
    return models


@contextlib.contextmanager
def unsharded(model):
    """Gather every FSDP-sharded layer of `model` once and keep it gathered inside the block (generation: no
    collective per forward, so ranks may run different numbers of decoding steps); reshard on exit. The full
    parameters cost one model's memory per rank meanwhile. Does nothing for a plain model."""
    mods = [m for m in model.modules() if is_sharded(m)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_weights(model):
    """(name, full tensor) for every entry of the state dict, one at a time: a sharded (DTensor) entry is
    all-gathered on its own just before it is yielded, so no rank ever holds a whole gathered state dict. Every rank
    must iterate to the end (each gather is a collective)."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def agree(flag: bool, model) -> bool:
    """True only if `flag` holds on every rank, when `model` is sharded (its forwards are collectives, so every rank
    must take the same branch); `flag` itself otherwise."""
    return not max_over_ranks(int(not flag), model)


def max_over_ranks(n: int, model) -> int:
    """The largest `n` over ranks when `model` is sharded, `n` itself otherwise: a rank with less work pads its
    forwards (each a collective under FSDP) up to the count of the busiest rank."""
    if not is_sharded(model) or dist.get_world_size() == 1:
        return n
    t = torch.tensor([float(n)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def rank_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) when no process group is initialized."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
