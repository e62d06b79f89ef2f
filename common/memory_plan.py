"""Will it fit? The memory a run needs, per phase, from the model's config.json alone, before anything loads
(`--plan-memory`, docs/memory.md). No torch is imported here: the plan answers in a fraction of a second.

A trainer declares what it holds in one statement, right after it parses its flags:

    memory_plan.plan(ARGS, memory_plan.Holds(reference=ARGS.beta > 0))

and the plan counts, at the run's flags and per rank: the weights of every model held, gradients and AdamW state,
autocast's bfloat16 weight copies, the KV cache of a generation, the activations and logits of one micro-batch,
vLLM's share, and under --fsdp the shards and the gathered layers; per phase (generation, evaluation, log-prob passes,
update). The byte counts are docs/fsdp.md's; benchmarks/update_memory.md measures one micro-batch of the update and
benchmarks/plan_memory.md whole steps, against this module. GB = 1e9 bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, replace

from common.args import fail

LOGPROB_CHUNK = 2**22
"""common.rollout.LOGPROB_CHUNK: vocabulary entries token_logprobs converts to float32 at a time (mirrored here, so
that the plan needs no torch; tests/test_memory_plan.py keeps the two equal, and the next three too)"""
DEFAULT_PROMPT_BUDGET = 2048
"""common.rollout.DEFAULT_PROMPT_BUDGET: the prompt length assumed when --max-prompt-tokens is not set"""
GENERATION_ROWS = 512
"""common.rollout.HFEngine's max_batch: the rows one generation call samples at once"""
BUCKET_BYTES = 25 * 2**20
"""common.dist.BUCKET_BYTES: plain data parallel all-reduces the gradients in buckets of this size"""
RESERVE = 0.10
"""the part of a device the plan keeps out of reach: on a GPU the CUDA context and the caching allocator's
fragmentation, on the CPU the interpreter, torch and transformers themselves (not counted tensor by tensor)"""


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer (Llama, Qwen2, Mistral, SmolLM2 and their kin) as its config.json gives it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # rows of the LM head (vocab_size)
    tied: bool  # input and output embeddings are one matrix
    qkv_bias: bool = False
    max_positions: int = 0

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear map in one decoder layer, by the module names LoRA targets."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_matmul(self) -> int:
        """Weights of one layer's matrix products (what autocast copies to bfloat16)."""
        return sum(a * b for a, b in self.linears().values())

    @property
    def layer_params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layer_matmul + bias + 2 * self.hidden  # and its two norms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_matmul + self.vocab * self.hidden


@dataclass(frozen=True)
class Lora:
    """LoRA adapters on a frozen base: rank r on each `targets` module of every layer; `adapters` of them are held,
    one trains at a time (its gradients and AdamW state)."""

    r: int
    targets: tuple[str, ...]
    adapters: int = 1


@dataclass(frozen=True)
class Holds:
    """What a trainer loads. The policy: trained in full (float32 master weights; `lora=None`) or a frozen base in
    --dtype with `lora` adapters. `reference`: a frozen copy of the policy, stored as the policy's weights are.
    `frozen`: other frozen models (teachers, a reward model), each a --model-name form stored in --dtype, or a
    (name, dtype) pair. `value_head`: a trained hidden -> 1 head. `dtype`, `rows`, `micro_batch`: for a trainer whose
    flags are named otherwise (0 / '': --dtype, --num-prompts x --group-size, --micro-batch-size)."""

    lora: Lora | None = None
    reference: bool = False
    frozen: tuple = ()
    value_head: bool = False
    dtype: str = ""
    rows: int = 0
    micro_batch: int = 0


@dataclass(frozen=True)
class Setup:
    """The run's flags as the plan reads them (one rank)."""

    dtype: str = "float32"
    master_weights: bool = True
    fsdp: bool = False
    ranks: int = 1
    rows: int = 128  # rollouts a step
    group: int = 8  # completions per prompt
    micro_batch: int = 32
    minibatch: int = 0  # rows per optimizer step (0: all the rows)
    prompt: int = 64
    completion: int = 8
    checkpointing: bool = False
    backend: str = "hf"
    vllm_share: float = 0.3
    vllm_dtype: str = "auto"
    device: str = "cpu"
    device_bytes: float = 0.0  # 0: unknown
    eval_problems: int = 0
    eval_samples: int = 0
    old_logprobs: bool = False  # a no-grad pass of the policy before the update (several epochs or mini-batches)


# ---------------------------------------------------------------------------------------------------------------
# Reading a model's shape without loading it

def cache_root() -> str:
    """grounds.cache.cache_root (the grounds package imports torch; tests keep the two equal)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TINYPOST_CACHE") or os.path.join(base, "tinypost")


def config_path(name: str) -> str:
    """The config.json of --model-name `name`: a local folder, an embedded model's cached folder (built by an earlier
    run: `grounds.path_of` names them `<name>-<recipe hash>`), or a hub id in the local Hugging Face cache."""
    folder = os.path.expanduser(name)
    if os.path.isdir(folder):
        path = os.path.join(folder, "config.json")
        return path if os.path.isfile(path) else fail(f"--plan-memory: {folder} has no config.json")
    root, key = cache_root(), name.lower()
    built = [os.path.join(root, d, "config.json") for d in (os.listdir(root) if os.path.isdir(root) else ())
             if re.fullmatch(re.escape(key) + r"-[0-9a-f]{12}", d)]
    built = [p for p in built if os.path.isfile(p)]
    if built:
        return max(built, key=os.path.getmtime)  # the latest recipe's build
    if "/" in name:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a valid repo id
            cached = None
        if isinstance(cached, str):
            return cached
    fail(f"--plan-memory reads config.json without loading anything, and finds none for {name!r}: not a folder, not "
         f"an embedded model built in {root} (a first run builds it), not in the local Hugging Face cache "
         f"(`huggingface-cli download {name} config.json` fetches the file alone)")


def read_shape(name: str) -> Shape:
    """The Shape of --model-name `name`, from its config.json."""
    path = config_path(name)
    try:
        with open(path) as f:
            return shape_of(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"--plan-memory: cannot read a decoder's shape from {path}: {type(e).__name__}: {e}")


def shape_of(cfg: dict) -> Shape:
    """A config.json's Shape (a multimodal config's text_config when it has one). Missing tie_word_embeddings means
    untied (the default of Llama, Qwen2 and Mistral); Qwen2 puts biases on q, k and v."""
    cfg = cfg.get("text_config") or cfg
    get = lambda *keys, default=None: next((cfg[k] for k in keys if cfg.get(k) is not None), default)  # noqa: E731
    hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
    return Shape(hidden=hidden, layers=get("num_hidden_layers", "n_layer"), heads=heads,
                 kv_heads=get("num_key_value_heads", default=heads), head_dim=get("head_dim", default=hidden // heads),
                 intermediate=get("intermediate_size", "n_inner", default=4 * hidden), vocab=cfg["vocab_size"],
                 tied=bool(cfg.get("tie_word_embeddings", False)),
                 qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                 max_positions=get("max_position_embeddings", "n_positions", default=0))


# ---------------------------------------------------------------------------------------------------------------
# The formulas (docs/fsdp.md: "Memory, worked out on paper")

def lora_params(m: Shape, lora: Lora) -> int:
    """Parameters of one adapter: r x (in + out) for every targeted linear map of every layer."""
    return m.layers * sum(lora.r * (a + b) for n, (a, b) in m.linears().items() if n in lora.targets)


def layer_activation_bytes(m: Shape, precision: str, lora: Lora | None = None) -> int:
    """Bytes one decoder layer keeps for backward, per token; precision 'float32', 'autocast' (bfloat16 compute over
    float32 weights) or 'bfloat16' (weights and compute in bfloat16: FSDP's copies, --no-master-weights, a LoRA base).
    Counted tensor by tensor at Qwen2.5's and SmolLM2's layer shapes (benchmarks/update_memory.md, plan_memory.md)."""
    h, i = m.hidden, m.intermediate
    full = {"float32": 40 * h + 16 * i, "autocast": 38 * h + 8 * i, "bfloat16": 24 * h + 8 * i}[precision]
    if lora is None:
        return full
    # A frozen base keeps no inputs for its weights' gradients: not the two norms', nor the inputs of q/k/v, of
    # gate/up and of down; an adapter keeps its module's input in float32 (the base's tensor itself when that is
    # float32, shared by the modules that read it; a float32 copy per module when the base is bfloat16) and its
    # rank-r activation.
    e, lin = (4 if precision == "float32" else 2), m.linears()
    targets = [n for n in lora.targets if n in lin]
    kept = full - 2 * e * h - e * (2 * h + i)
    if e == 4:
        groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",)]
        kept += sum(4 * lin[g[0]][0] for g in groups if set(g) & set(targets))  # o's input is kept by attention
    else:
        kept += sum(4 * lin[n][0] for n in targets)
    return kept + 4 * lora.r * len(targets)


def update_peak_bytes(m: Shape, rows: int, prompt: int, completion: int, precision: str = "float32",
                      checkpointing: bool = False, lora: Lora | None = None, head_gradient: bool = True) -> float:
    """The peak of one micro-batch's forward and backward above the state held between micro-batches (weights,
    gradients, AdamW), in bytes: activations plus the logits' and the LM head's moment. `head_gradient`: the LM
    head's weight gradient appears here (full fine-tuning without FSDP; under FSDP the root's gathered parameters
    count it)."""
    act, logits = micro_batch_bytes(m, rows, prompt, completion, precision, checkpointing, lora, head_gradient)
    return act + logits


def micro_batch_bytes(m: Shape, rows: int, prompt: int, completion: int, precision: str = "float32",
                      checkpointing: bool = False, lora: Lora | None = None,
                      head_gradient: bool = True) -> tuple[float, float]:
    """(activations, logits) of `update_peak_bytes`: the layers' saved tensors (checkpointed: each layer's input and
    one layer recomputed), autocast's bfloat16 weight copies, the final norm; and the larger of token_logprobs'
    backward (the logits kept for it and their gradient, 2e bytes an entry, e their dtype's size, plus two float32
    blocks of LOGPROB_CHUNK entries) and the LM head's backward (one logits-sized gradient beside the head's weight
    gradient: 4Vh bytes in float32, 8Vh under autocast: bf16 weight copy, bf16 gradient and its float32 copy)."""
    h, e = m.hidden, (4 if precision == "float32" else 2)
    tokens, entries = rows * (prompt + completion), rows * (completion + 1) * m.vocab
    per_layer = layer_activation_bytes(m, precision, lora)
    resid = 2 if precision == "bfloat16" else 4  # the residual stream stays float32 under autocast
    copies = 2 * m.layer_matmul if precision == "autocast" else 0  # autocast's bf16 copy, kept for backward
    if checkpointing:
        act = m.layers * tokens * resid * h + tokens * per_layer + copies
    else:
        act = m.layers * (tokens * per_layer + copies)
    act += tokens * 2 * resid * h  # final norm
    blocks, head = 2 * 4 * min(LOGPROB_CHUNK, entries), m.vocab * h  # two float32 blocks (a small batch: smaller)
    if precision == "autocast" and head_gradient and lora is None:
        return act, max(2 * e * entries + blocks + 2 * head, e * entries + 8 * head)
    head_bytes = e if head_gradient and lora is None else 0
    return act, max(2 * e * entries + blocks, e * entries + head_bytes * head)


def kv_cache_bytes(m: Shape, rows: int, tokens: int, e: int) -> float:
    return rows * tokens * m.layers * 2 * m.kv_heads * m.head_dim * e


def phases(m: Shape, holds: Holds, s: Setup, frozen: list[tuple[Shape, int]]) -> dict[str, dict[str, float]]:
    """Bytes per rank, by phase and part: {phase: {part: bytes}}. `frozen`: (shape, bytes a parameter) of each
    model in holds.frozen."""
    lora, low = holds.lora, s.dtype != "float32"
    n = s.ranks if s.fsdp else 1  # what FSDP shards is divided by the ranks
    e = 2 if low else 4  # compute dtype (logits, KV cache)
    if lora is None:
        stored = 4 if not low or s.master_weights else 2
        precision = "autocast" if low and s.master_weights and not s.fsdp else "bfloat16" if low else "float32"
        trained = m.params + (m.hidden + 1) * holds.value_head
        weights = {"policy weights": stored * m.params / n}
        largest = max(m.vocab, m.intermediate) * m.hidden
    else:
        stored, precision = 4, ("bfloat16" if low else "float32")  # adapters float32, the base in --dtype
        per_adapter = lora_params(m, lora)
        trained = per_adapter + (m.hidden + 1) * holds.value_head
        weights = {"policy weights (frozen base)": e * m.params / n,
                   f"LoRA adapters ({lora.adapters} x {per_adapter:,})": 4 * per_adapter * lora.adapters / n}
        largest = max(lora.r * max(a, b) for a, b in m.linears().values())
    held = {**weights,
            "AdamW state": 2 * stored * trained / n,
            "reference model": (stored if lora is None else e) * m.params / n * holds.reference,
            "frozen models": sum(b * f.params for f, b in frozen) / n}
    if holds.value_head:
        held["value head"] = 4 * (m.hidden + 1)
    on_gpu = s.device.startswith("cuda")
    vllm = 0.0
    if s.backend == "vllm":  # on a GPU its share of the device; on the CPU its weights and VLLM_CPU_KVCACHE_SPACE
        vllm = (s.vllm_share * s.device_bytes if on_gpu else
                (2 if low else 4) * m.params + float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30)
    if not on_gpu:
        held["vLLM (no sleep on CPU)"] = vllm
    copies = 2 * m.matmul_params if precision == "autocast" else 0  # the policy's bf16 copies, one forward long
    gathered = lambda grads: (m.layer_params * (12 if not low else 8 if grads else 6)  # noqa: E731
                              + e * m.vocab * m.hidden * (2 if grads else 1)) if s.fsdp else 0

    def generation(rows: int, prompts: int) -> dict[str, float]:
        if s.backend == "vllm":  # (on the CPU `held` has it already)
            return {**held, "vLLM (weights and KV cache)": vllm if on_gpu else 0}
        kv = kv_cache_bytes(m, rows, s.prompt + s.completion, e)
        prefill = prompts * s.prompt * (3 * m.intermediate + 4 * m.hidden) * e  # one layer at a time, no grad
        return {**held, "bf16 weight copies (autocast)": copies, "FSDP: whole model gathered": e * m.params if s.fsdp
                else 0, "KV cache and sampling": max(kv * (1 + 1 / m.layers) + 3 * rows * m.vocab * 4,
                                                     kv / max(rows // prompts, 1) + prefill)}

    def no_grad_pass(shape: Shape, policy: bool) -> float:
        rows, tokens = s.micro_batch, s.micro_batch * (s.prompt + s.completion)
        entries = rows * (s.completion + 1) * shape.vocab
        return (e * entries + 2 * 4 * min(LOGPROB_CHUNK, entries)
                + tokens * (3 * shape.intermediate + 4 * shape.hidden) * e + (copies if policy else 0))

    out = {}
    if s.fsdp:  # every model is built whole on every rank before shard_models cuts it (docs/fsdp.md: Loading)
        out["loading"] = {k: held[k] * n for k in (*weights, "reference model", "frozen models")}
    per_rank_prompts = max(1, s.rows // s.group)
    train_prompts = min(per_rank_prompts, max(1, GENERATION_ROWS // s.group))
    out["generation"] = generation(train_prompts * s.group, train_prompts)
    problems = math.ceil(s.eval_problems / s.ranks)
    if problems:
        greedy = min(problems, GENERATION_ROWS)
        sampled = min(problems, max(1, GENERATION_ROWS // max(s.eval_samples, 1)))
        out["evaluation"] = max((generation(greedy, greedy), generation(sampled * s.eval_samples, sampled))
                                if s.eval_samples else (generation(greedy, greedy),), key=lambda d: sum(d.values()))
    passes = ([no_grad_pass(m, True)] * s.old_logprobs + [no_grad_pass(m, False)] * holds.reference
              + [no_grad_pass(f, False) for f, _ in frozen])
    if passes:
        out["log-prob passes"] = {**held, "FSDP: gathered layers": gathered(False),
                                  "one no-grad micro-batch": max(passes)}
    act, logits = micro_batch_bytes(m, s.micro_batch, s.prompt, s.completion, precision, s.checkpointing, lora,
                                    head_gradient=not s.fsdp)
    update = {**held, "gradients": stored * trained / n, "FSDP: gathered layers": gathered(lora is None)}
    # one micro-batch per optimizer step: its backward starts with no gradient (zero_grad frees them) and frees
    # activations as it allocates them; from the second micro-batch on, every gradient is there from the start
    accumulating = s.micro_batch < (s.minibatch or s.rows)
    out["update: micro-batch"] = {**update, "gradients": update["gradients"] * accumulating, "activations": act,
                                  "logits": logits}
    step = stored * trained / n if on_gpu else 2 * 4 * largest  # foreach AdamW: one more state-sized list on a GPU
    out["update: optimizer step"] = {**update, "optimizer step temporaries": step,
                                     "all-reduce bucket": BUCKET_BYTES if s.ranks > 1 and not s.fsdp else 0}
    return {phase: {k: v for k, v in parts.items() if v} for phase, parts in out.items()}


def peak(table: dict[str, dict[str, float]]) -> tuple[str, float]:
    phase = max(table, key=lambda p: sum(table[p].values()))
    return phase, sum(table[phase].values())


# ---------------------------------------------------------------------------------------------------------------
# Fit, and the flag that would make it fit

def vllm_floor(m: Shape, s: Setup) -> float:
    """What vLLM's share must hold on a GPU to start: its weights and one full sequence's KV cache."""
    e = 4 if s.vllm_dtype == "float32" else 2
    return e * m.params + kv_cache_bytes(m, 1, s.prompt + s.completion, e)


def suggest(m: Shape, holds: Holds, s: Setup, frozen: list, usable: float) -> str:
    """The mildest change that brings the peak within `usable` bytes: one flag when one is enough (checkpointing, a
    smaller micro-batch, bfloat16 compute, vLLM's share, fewer rollouts or evaluation problems at once, FSDP over
    more ranks), else a few of them together, each at its mildest."""
    fits = lambda x: peak(phases(m, holds, x, frozen))[1] <= usable  # noqa: E731
    halves = lambda x: sorted({x >> k for k in range(1, 12)} - {0}, reverse=True)  # noqa: E731
    levers = [[("--gradient-checkpointing", dict(checkpointing=True))] if not s.checkpointing else [],
              [(f"--micro-batch-size {b}", dict(micro_batch=b)) for b in halves(s.micro_batch)],
              [("--dtype bfloat16", dict(dtype="bfloat16"))] if s.dtype == "float32" else []]
    if s.backend == "vllm" and s.device.startswith("cuda") and s.device_bytes:
        levers.append([(f"--vllm-gpu-memory-utilization {u / 100:g}", dict(vllm_share=u / 100))
                       for u in range(round(s.vllm_share * 100) - 5, 0, -5)
                       if u / 100 * s.device_bytes >= vllm_floor(m, s)])
    levers += [[(f"--num-prompts {p}", dict(rows=p * s.group)) for p in halves(s.rows // s.group)],
               [(f"--num-eval-problems {p}", dict(eval_problems=p)) for p in halves(s.eval_problems)],
               [(f"--fsdp on {r} ranks", dict(fsdp=True, ranks=r)) for r in (1, 2, 4, 8, 16, 32, 64, 128)
                if r >= s.ranks and not (s.fsdp and r == s.ranks) and r > 1]]
    levers = [lv for lv in levers if lv]
    alone = [next((flag for flag, change in lever if fits(replace(s, **change))), None) for lever in levers]
    if any(alone):
        return "fits with any one of: " + " | ".join(a for a in alone if a)
    picked, cur = {}, s  # lever -> option, each lever at the first option that fits, else its strongest
    for i, lever in enumerate(levers):
        picked[i] = next((j for j, (_, c) in enumerate(lever) if fits(replace(cur, **c))), len(lever) - 1)
        cur = replace(cur, **lever[picked[i]][1])
        if fits(cur):
            break
    else:
        return f"does not fit even with {' '.join(levers[i][j][0] for i, j in picked.items())}"
    for i in list(picked):  # then each lever back to its mildest option (or none) that still fits with the others
        others = s
        for i2, j2 in picked.items():
            others = replace(others, **levers[i2][j2][1]) if i2 != i else others
        mildest = [j for j in range(picked[i]) if fits(replace(others, **levers[i][j][1]))]
        if fits(others):
            del picked[i]
        elif mildest:
            picked[i] = mildest[0]
    return "fits with all of: " + " ".join(levers[i][j][0] for i, j in picked.items())


def device_bytes(device: str) -> tuple[float, str]:
    """Memory of one device and where the figure comes from: the smallest GPU nvidia-smi lists, or the CPU's
    available memory (/proc/meminfo MemAvailable); (0, reason) when neither can be read."""
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            return min(float(x) for x in out) * 2**20, "the GPU nvidia-smi lists"
        except (OSError, ValueError, subprocess.SubprocessError):
            return 0.0, "no GPU found (nvidia-smi)"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024.0, "this machine's available memory"
    except (OSError, StopIteration, ValueError):
        return 0.0, "no /proc/meminfo"


# ---------------------------------------------------------------------------------------------------------------
# The trainers' entry point

def setup_of(args, holds: Holds, shape: Shape) -> tuple[Setup, str, str]:
    """The Setup of a trainer's parsed flags (flags a trainer lacks take the shared defaults), where the prompt length
    comes from (--max-prompt-tokens, else DEFAULT_PROMPT_BUDGET capped by the model's positions: assumed) and where
    the device's memory comes from."""
    g = lambda name, default: getattr(args, name, default)  # noqa: E731
    group = g("group_size", 1)
    completion = g("max_new_tokens", 8)
    prompt, note = g("max_prompt_tokens", 0), "--max-prompt-tokens"
    if not prompt:
        prompt = min(DEFAULT_PROMPT_BUDGET, max(shape.max_positions - completion, 1) if shape.max_positions
                     else DEFAULT_PROMPT_BUDGET)
        note = "assumed: set --max-prompt-tokens to plan for yours"
    ranks = g("plan_ranks", 0) or int(os.environ.get("WORLD_SIZE", "1"))
    known = g("device_memory_gb", 0.0) * 1e9
    found = (known, "--device-memory-gb") if known else device_bytes(g("device", "cpu"))
    s = Setup(dtype=holds.dtype or g("dtype", "float32"), master_weights=g("master_weights", True),
              fsdp=g("fsdp", False), ranks=ranks, rows=holds.rows or g("num_prompts", 16) * group, group=group,
              micro_batch=holds.micro_batch or g("micro_batch_size", 32), prompt=prompt, completion=completion,
              minibatch=(holds.rows or g("num_prompts", 16) * group) // g("num_minibatches", 1),
              checkpointing=g("gradient_checkpointing", False), backend=g("rollout_backend", "hf"),
              vllm_share=g("vllm_gpu_memory_utilization", 0.3), vllm_dtype=g("vllm_dtype", "auto"),
              device=g("device", "cpu"), device_bytes=found[0],
              eval_problems=g("num_eval_problems", 0), eval_samples=g("eval_samples", 0),
              old_logprobs=g("num_iterations", 1) > 1 or g("num_minibatches", 1) > 1)
    return s, note, found[1]


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB" if x >= 1e8 else f"{x / 1e6:,.1f} MB"


def render(name: str, m: Shape, holds: Holds, s: Setup, frozen: list, prompt_note: str = "",
           device_note: str = "") -> tuple[list[str], bool | None]:
    """The plan as text lines, and whether it fits (None: no device memory known)."""
    table = phases(m, holds, s, frozen)
    where, top = peak(table)
    parts = list(dict.fromkeys(k for p in table.values() for k in p))
    col = lambda x: f"{x / 1e9:,.2f}" if top >= 1e9 else f"{x / 1e6:,.1f}"  # noqa: E731
    unit = "GB" if top >= 1e9 else "MB"
    what = f"LoRA r {holds.lora.r} on {', '.join(holds.lora.targets)}" if holds.lora else "trained in full"
    extra = [w for w, on in (("a reference copy", holds.reference), (f"{len(frozen)} frozen model(s)", frozen),
                             ("a value head", holds.value_head)) if on]
    precision = s.dtype + (" over float32 master weights" if s.dtype != "float32" and s.master_weights and
                           holds.lora is None else "")
    size = f"{m.params / 1e9:.2f} B" if m.params >= 1e9 else f"{m.params / 1e6:.1f} M"
    lines = [f"memory plan for {name}: {size} parameters ({m.layers} layers, hidden {m.hidden:,}, "
             f"intermediate {m.intermediate:,}, heads {m.heads}/{m.kv_heads} KV, vocabulary {m.vocab:,}, "
             f"{'tied' if m.tied else 'untied'} embeddings), {what}" + (f", with {' and '.join(extra)}" if extra
                                                                       else ""),
             f"per rank of {s.ranks}{' (--fsdp)' if s.fsdp else ''}, --dtype {precision}, {s.rows} rollouts a step, "
             f"micro-batch {s.micro_batch}, rows of {s.prompt:,} prompt ({prompt_note}) + {s.completion:,} "
             f"completion tokens, gradient checkpointing {'on' if s.checkpointing else 'off'}, "
             f"--rollout-backend {s.backend}",
             "",
             f"| {unit} | " + " | ".join(table) + " |", "|---" * (len(table) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(col(table[ph].get(p, 0)) if table[ph].get(p) else "" for ph in table) + " |"
              for p in parts]
    lines += ["| total | " + " | ".join(f"**{col(sum(v.values()))}**" for v in table.values()) + " |", "",
              f"peak: {gb(top)} in {where}"]
    if s.backend == "vllm" and s.device.startswith("cuda") and s.device_bytes:
        share, floor = s.vllm_share * s.device_bytes, vllm_floor(m, s)
        row = kv_cache_bytes(m, 1, s.prompt + s.completion, 4 if s.vllm_dtype == "float32" else 2)
        lines.append(f"vLLM's share {gb(share)} (--vllm-gpu-memory-utilization {s.vllm_share:g}): " + (
            f"cannot hold its weights and one sequence's KV cache ({gb(floor)}): raise it" if share < floor else
            f"its weights {gb(floor - row)}, a KV cache for {int((share - floor) // row) + 1:,} rows of "
            f"{s.prompt + s.completion:,} tokens at once (a step samples {s.rows})"))
    if not s.device_bytes:
        lines.append(f"device memory unknown ({device_note}): give --device-memory-gb")
        return lines, None
    usable = (1 - RESERVE) * s.device_bytes
    ok = top <= usable
    lines.append(f"device: {gb(s.device_bytes)} ({device_note}), {gb(usable)} usable "
                 f"({RESERVE:.0%} kept for what the plan does not count): "
                 + ("fits" if ok else "does not fit; " + suggest(m, holds, s, frozen, usable)))
    return lines, ok


def plan(args, holds: Holds) -> None:
    """With --plan-memory: print the plan of this run (rank 0) and exit, status 0 when it fits or no device memory
    is known, 1 when it does not fit. Without it: nothing."""
    if not getattr(args, "plan_memory", False):
        return
    m = read_shape(args.model_name)
    s, prompt_note, device_note = setup_of(args, holds, m)
    frozen = [(read_shape(f if isinstance(f, str) else f[0]),
               2 if (s.dtype if isinstance(f, str) else f[1]) != "float32" else 4) for f in holds.frozen]
    lines, ok = render(args.model_name, m, holds, s, frozen, prompt_note, device_note)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(lines), flush=True)
    raise SystemExit(0 if ok is not False else 1)
