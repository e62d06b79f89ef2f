"""Will it fit? The memory a run needs per rank and phase, from the model's config.json alone (`--plan-memory`,
docs/memory.md). No torch here: the plan answers before anything loads. A trainer declares what it holds where it
parses its flags, `ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))` (the fields of Holds); the byte counts
are docs/fsdp.md's, measured in benchmarks/speed/update_memory.md and benchmarks/speed/plan_memory.md. GB = 1e9 bytes.
"""

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, replace

# Mirrored so that the plan needs no torch (tests/test_memory_plan.py keeps them equal to their sources):
LOGPROB_CHUNK = 2**22  # common.rollout: vocabulary entries token_logprobs converts to float32 at a time
DEFAULT_PROMPT_BUDGET = 2048  # common.rollout: the prompt length assumed without --max-prompt-tokens
GENERATION_ROWS = 512  # common.rollout.HFEngine's max_batch: rows one generation call samples at once
BUCKET_BYTES = 25 * 2**20  # common.dist: plain data parallel all-reduces gradients in buckets of this size
RESERVE = 0.10
"""the part of a device kept out of the plan's reach: on a GPU the CUDA context and the allocator's fragmentation,
on the CPU the interpreter, torch and transformers (not counted tensor by tensor)"""


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer (Llama, Qwen2, Mistral, SmolLM2 and their kin) as its config.json gives it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # rows of the LM head
    tied: bool  # input and output embeddings are one matrix
    qkv_bias: bool = False
    max_positions: int = 0

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear map of one decoder layer, by the module names LoRA targets."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_matmul(self) -> int:  # one layer's matrix weights (what autocast copies to bfloat16)
        return sum(a * b for a, b in self.linears().values())

    @property
    def layer_params(self) -> int:  # and its q/k/v biases and two norms
        return self.layer_matmul + self.qkv_bias * (self.heads + 2 * self.kv_heads) * self.head_dim + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_matmul + self.vocab * self.hidden


@dataclass(frozen=True)
class Lora:
    """`adapters` LoRA adapters of rank r on the `targets` modules of every layer; one trains at a time."""

    r: int
    targets: tuple[str, ...]
    adapters: int = 1


@dataclass(frozen=True)
class Holds:
    """What a trainer loads. The policy: trained in full (float32 master weights), or with lora_r a frozen base in
    --dtype carrying `adapters` adapters of rank lora_r on lora_targets. reference: a frozen copy of the policy,
    stored as its weights are. frozen: other frozen models (teachers, a reward model), each a --model-name stored in
    --dtype or a (name, dtype) pair. value_head: a trained hidden -> 1 head. dtype, rows, micro_batch: for a trainer
    whose flags are named otherwise (--dtype, --num-prompts x --group-size, --micro-batch-size)."""

    lora_r: int = 0
    lora_targets: tuple = ()
    adapters: int = 1
    reference: bool = False
    frozen: tuple = ()
    value_head: bool = False
    dtype: str = ""
    rows: int = 0
    micro_batch: int = 0

    @property
    def lora(self) -> Lora | None:
        return Lora(self.lora_r, tuple(self.lora_targets), self.adapters) if self.lora_r else None


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


# Reading a model's shape without loading it

def cache_root() -> str:
    """grounds.cache.cache_root (grounds imports torch; a test keeps the two equal)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TINYPOST_CACHE") or os.path.join(base, "tinypost")


def config_path(name: str) -> str:
    """The config.json of --model-name `name`: a local folder, an embedded model's build (`<name>-<recipe hash>` in
    the cache, the latest), or a hub id in the local Hugging Face cache."""
    folder = os.path.expanduser(name)
    if os.path.isdir(folder):
        if os.path.isfile(path := os.path.join(folder, "config.json")):
            return path
        raise SystemExit(f"error: --plan-memory: {folder} has no config.json")
    root = cache_root()
    built = [os.path.join(root, d, "config.json") for d in (os.listdir(root) if os.path.isdir(root) else ())
             if re.fullmatch(re.escape(name.lower()) + r"-[0-9a-f]{12}", d)]
    if built := [p for p in built if os.path.isfile(p)]:
        return max(built, key=os.path.getmtime)
    if "/" in name:
        from huggingface_hub import try_to_load_from_cache

        try:
            if isinstance(cached := try_to_load_from_cache(name, "config.json"), str):
                return cached
        except ValueError:  # not a valid repo id
            pass
    raise SystemExit(f"error: --plan-memory reads config.json without loading anything, and finds none for {name!r}: "
                     f"not a folder, not an embedded model built in {root} (a first run builds it), not in the local "
                     f"Hugging Face cache (`huggingface-cli download {name} config.json` fetches the file alone)")


def read_shape(name: str) -> Shape:
    path = config_path(name)
    try:
        with open(path) as f:
            return shape_of(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --plan-memory: cannot read a decoder's shape from {path}: {type(e).__name__}: {e}")


def shape_of(cfg: dict) -> Shape:
    """A config.json's Shape (a multimodal config's text_config). No tie_word_embeddings means untied (Llama's, Qwen2's
    and Mistral's default); Qwen2 has biases on q, k and v."""
    cfg = cfg.get("text_config") or cfg
    get = lambda *keys, default=None: next((cfg[k] for k in keys if cfg.get(k) is not None), default)  # noqa: E731
    hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
    return Shape(hidden=hidden, layers=get("num_hidden_layers", "n_layer"), heads=heads,
                 kv_heads=get("num_key_value_heads", default=heads), head_dim=get("head_dim", default=hidden // heads),
                 intermediate=get("intermediate_size", "n_inner", default=4 * hidden), vocab=cfg["vocab_size"],
                 tied=bool(cfg.get("tie_word_embeddings", False)),
                 qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                 max_positions=get("max_position_embeddings", "n_positions", default=0))


# The formulas (docs/fsdp.md: "Memory, worked out on paper")

def lora_params(m: Shape, lora: Lora) -> int:
    """Parameters of one adapter: r x (in + out) for every targeted linear map of every layer."""
    return m.layers * sum(lora.r * (a + b) for n, (a, b) in m.linears().items() if n in lora.targets)


def layer_activation_bytes(m: Shape, precision: str, lora: Lora | None = None) -> int:
    """Bytes one decoder layer keeps for backward, per token; precision 'float32', 'autocast' (bfloat16 compute over
    float32 weights) or 'bfloat16' (FSDP's copies, --no-master-weights, a LoRA base), counted tensor by tensor."""
    h, i = m.hidden, m.intermediate
    full = {"float32": 40 * h + 16 * i, "autocast": 38 * h + 8 * i, "bfloat16": 24 * h + 8 * i}[precision]
    if lora is None:
        return full
    # A frozen base keeps no input for its weights' gradients (the two norms', q/k/v's, gate/up's, down's); an
    # adapter keeps its module's input in float32 (a float32 base's own tensor, shared by the modules that read it;
    # a copy per module over a bfloat16 base) and its rank-r activation.
    e, lin = (4 if precision == "float32" else 2), m.linears()
    targets = [n for n in lora.targets if n in lin]
    kept = full - 2 * e * h - e * (2 * h + i) + 4 * lora.r * len(targets)
    if e == 2:
        return kept + sum(4 * lin[n][0] for n in targets)
    groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",)]  # o's input: attention's
    return kept + sum(4 * lin[g[0]][0] for g in groups if set(g) & set(targets))


def micro_batch_bytes(m: Shape, rows: int, prompt: int, completion: int, precision: str = "float32",
                      checkpointing: bool = False, lora: Lora | None = None,
                      head_gradient: bool = True) -> tuple[float, float]:
    """(activations, logits): one micro-batch's forward and backward above the state held between micro-batches.
    Activations: the layers' saved tensors (checkpointed: each layer's input and one layer recomputed), autocast's
    bfloat16 weight copies, the final norm. Logits: the larger of token_logprobs' backward (the logits and their
    gradient, 2e bytes an entry, plus two float32 blocks of LOGPROB_CHUNK) and the LM head's (a logits-sized
    gradient beside the head's weight gradient: 4Vh bytes in float32; 8Vh under autocast: bf16 copy, bf16 gradient
    and its float32 copy). `head_gradient`: full fine-tuning without FSDP (under FSDP the gathered root counts it)."""
    h, e = m.hidden, (4 if precision == "float32" else 2)
    tokens, entries = rows * (prompt + completion), rows * (completion + 1) * m.vocab
    per_layer = layer_activation_bytes(m, precision, lora)
    resid = 2 if precision == "bfloat16" else 4  # the residual stream stays float32 under autocast
    copies = 2 * m.layer_matmul if precision == "autocast" else 0  # each layer's bf16 weights, kept for backward
    if checkpointing:
        act = m.layers * tokens * resid * h + tokens * per_layer + copies
    else:
        act = m.layers * (tokens * per_layer + copies)
    act += tokens * 2 * resid * h  # final norm
    blocks, head = 2 * 4 * min(LOGPROB_CHUNK, entries), m.vocab * h
    if precision == "autocast" and head_gradient and lora is None:
        return act, max(2 * e * entries + blocks + 2 * head, e * entries + 8 * head)
    return act, max(2 * e * entries + blocks, e * entries + (e if head_gradient and lora is None else 0) * head)


def kv_cache_bytes(m: Shape, rows: int, tokens: int, e: int) -> float:
    return rows * tokens * m.layers * 2 * m.kv_heads * m.head_dim * e


def frozen_shapes(holds: Holds, dtype: str) -> list[tuple[Shape, int]]:
    """(shape, bytes a parameter) of each model in holds.frozen."""
    pairs = [f if isinstance(f, (tuple, list)) else (f, dtype) for f in holds.frozen]
    return [(read_shape(name), 4 if d == "float32" else 2) for name, d in pairs]


def phases(m: Shape, holds: Holds, s: Setup, frozen: list[tuple[Shape, int]]) -> dict[str, dict[str, float]]:
    """Bytes per rank by phase and part, {phase: {part: bytes}}; `frozen`: frozen_shapes(holds, s.dtype)."""
    lora, low = holds.lora, s.dtype != "float32"
    n = s.ranks if s.fsdp else 1  # what FSDP shards is divided by the ranks
    e = 2 if low else 4  # compute dtype (logits, KV cache)
    head = (m.hidden + 1) * holds.value_head
    if lora is None:
        stored = 4 if not low or s.master_weights else 2
        precision = "autocast" if low and s.master_weights and not s.fsdp else "bfloat16" if low else "float32"
        trained, largest = m.params + head, max(m.vocab, m.intermediate) * m.hidden
        held = {"policy weights": stored * m.params / n}
    else:  # adapters in float32, the base in --dtype
        stored, precision, one = 4, ("bfloat16" if low else "float32"), lora_params(m, lora)
        trained, largest = one + head, max(lora.r * max(a, b) for a, b in m.linears().values())
        held = {"policy weights (frozen base)": e * m.params / n,
                f"LoRA adapters ({lora.adapters} x {one:,})": 4 * one * lora.adapters / n}
    held |= {"AdamW state": 2 * stored * trained / n,
             "reference model": (stored if lora is None else e) * m.params / n * holds.reference,
             "frozen models": sum(b * f.params for f, b in frozen) / n, "value head": 4 * head}
    on_gpu = s.device.startswith("cuda")
    vllm = 0.0
    if s.backend == "vllm":  # on a GPU its share of the device; on the CPU its weights and VLLM_CPU_KVCACHE_SPACE
        vllm = (s.vllm_share * s.device_bytes if on_gpu else
                e * m.params + float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30)
    if not on_gpu:
        held["vLLM (no sleep on CPU)"] = vllm
    copies = 2 * m.matmul_params if precision == "autocast" else 0  # the policy's bf16 copies, one forward long

    def gathered(grads: bool) -> float:  # FSDP: about 3 layers and the root's embeddings at once
        return (m.layer_params * (12 if not low else 8 if grads else 6)
                + e * m.vocab * m.hidden * (2 if grads else 1)) * s.fsdp

    def generation(rows: int, prompts: int) -> dict[str, float]:
        if s.backend == "vllm":  # (on the CPU `held` has it already)
            return {**held, "vLLM (weights and KV cache)": vllm * on_gpu}
        kv = kv_cache_bytes(m, rows, s.prompt + s.completion, e)
        prefill = prompts * s.prompt * (3 * m.intermediate + 4 * m.hidden) * e  # one layer at a time, no grad
        return {**held, "bf16 weight copies (autocast)": copies, "FSDP: whole model gathered": e * m.params * s.fsdp,
                "KV cache and sampling": max(kv * (1 + 1 / m.layers) + 3 * rows * m.vocab * 4,
                                             kv / max(rows // prompts, 1) + prefill)}

    def no_grad_pass(shape: Shape, policy: bool) -> float:
        tokens, entries = s.micro_batch * (s.prompt + s.completion), s.micro_batch * (s.completion + 1) * shape.vocab
        return (e * entries + 2 * 4 * min(LOGPROB_CHUNK, entries)
                + tokens * (3 * shape.intermediate + 4 * shape.hidden) * e + copies * policy)

    out = {}
    if s.fsdp:  # every model is built whole on every rank before shard_models cuts it (docs/fsdp.md: Loading)
        out["loading"] = {k: v * n for k, v in held.items() if "weights" in k or k.endswith(("model", "models"))
                          or k.startswith("LoRA")}
    prompts = min(max(1, s.rows // s.group), max(1, GENERATION_ROWS // s.group))
    out["generation"] = generation(prompts * s.group, prompts)
    if problems := math.ceil(s.eval_problems / s.ranks):
        greedy = min(problems, GENERATION_ROWS)
        sampled = min(problems, max(1, GENERATION_ROWS // max(s.eval_samples, 1)))
        evals = [generation(greedy, greedy)] + [generation(sampled * s.eval_samples, sampled)] * (s.eval_samples > 0)
        out["evaluation"] = max(evals, key=lambda d: sum(d.values()))
    passes = ([no_grad_pass(m, True)] * s.old_logprobs + [no_grad_pass(m, False)] * holds.reference
              + [no_grad_pass(f, False) for f, _ in frozen])
    if passes:
        out["log-prob passes"] = {**held, "FSDP: gathered layers": gathered(False),
                                  "one no-grad micro-batch": max(passes)}
    act, logits = micro_batch_bytes(m, s.micro_batch, s.prompt, s.completion, precision, s.checkpointing, lora,
                                    head_gradient=not s.fsdp)
    update = {**held, "gradients": stored * trained / n, "FSDP: gathered layers": gathered(lora is None)}
    # With one micro-batch per optimizer step, its backward starts with no gradient (zero_grad frees them) and
    # frees activations as it allocates gradients; from the second on, every gradient is there from the start.
    accumulating = s.micro_batch < (s.minibatch or s.rows)
    out["update: micro-batch"] = {**update, "gradients": update["gradients"] * accumulating, "activations": act,
                                  "logits": logits}
    step = stored * trained / n if on_gpu else 2 * 4 * largest  # foreach AdamW: one more state-sized list on a GPU
    out["update: optimizer step"] = {**update, "optimizer step temporaries": step,
                                     "all-reduce bucket": BUCKET_BYTES * (s.ranks > 1 and not s.fsdp)}
    return {phase: {k: v for k, v in parts.items() if v} for phase, parts in out.items()}


def peak(table: dict[str, dict[str, float]]) -> tuple[str, float]:
    phase = max(table, key=lambda p: sum(table[p].values()))
    return phase, sum(table[phase].values())


# Fit, and the flag that would make it fit

def vllm_floor(m: Shape, s: Setup) -> tuple[float, float]:
    """What vLLM's share must hold on a GPU to start, its weights and one sequence's KV cache: (weights, the KV)."""
    e = 4 if s.vllm_dtype == "float32" else 2
    return e * m.params, kv_cache_bytes(m, 1, s.prompt + s.completion, e)


def suggest(m: Shape, holds: Holds, s: Setup, frozen: list, usable: float) -> str:
    """The flags that bring the peak within `usable` bytes, mildest first: each one that does alone, at its mildest;
    when none does, the fewest together, each at its mildest."""
    fits = lambda x: peak(phases(m, holds, x, frozen))[1] <= usable  # noqa: E731
    halves = lambda x: sorted({x >> k for k in range(1, 12)} - {0}, reverse=True)  # noqa: E731
    levers = [[("--gradient-checkpointing", dict(checkpointing=True))] * (not s.checkpointing),
              [(f"--micro-batch-size {b}", dict(micro_batch=b)) for b in halves(s.micro_batch)],
              [("--dtype bfloat16", dict(dtype="bfloat16"))] * (s.dtype == "float32")]
    if s.backend == "vllm" and s.device.startswith("cuda") and s.device_bytes:
        levers.append([(f"--vllm-gpu-memory-utilization {u / 100:g}", dict(vllm_share=u / 100))
                       for u in range(round(s.vllm_share * 100) - 5, 0, -5)
                       if u / 100 * s.device_bytes >= sum(vllm_floor(m, s))])
    levers += [[(f"--num-prompts {p}", dict(rows=p * s.group)) for p in halves(s.rows // s.group)],
               [(f"--num-eval-problems {p}", dict(eval_problems=p)) for p in halves(s.eval_problems)],
               [(f"--fsdp on {r} ranks", dict(fsdp=True, ranks=r)) for r in (2, 4, 8, 16, 32, 64, 128)
                if r > s.ranks or (r == s.ranks and not s.fsdp)]]
    levers = [lever for lever in levers if lever]
    alone = [next((flag for flag, change in lever if fits(replace(s, **change))), None) for lever in levers]
    if any(alone):
        return "fits with any one of: " + " | ".join(a for a in alone if a)

    def apply(chosen: dict) -> Setup:  # {lever: its option}
        x = s
        for lever, option in chosen.items():
            x = replace(x, **levers[lever][option][1])
        return x

    def flags(chosen: dict) -> str:
        return " ".join(levers[lever][option][0] for lever, option in chosen.items())

    chosen = {}
    for i, lever in enumerate(levers):  # each lever at its mildest that fits with those before it, else its strongest
        chosen[i] = next((j for j in range(len(lever)) if fits(apply({**chosen, i: j}))), len(lever) - 1)
        if fits(apply(chosen)):
            break
    else:
        return "does not fit even with " + flags(chosen)
    for i in list(chosen):  # then each one back to none, or to its mildest that still fits with the others
        others = {k: v for k, v in chosen.items() if k != i}
        if fits(apply(others)):
            chosen = others
        else:
            chosen[i] = next(j for j in range(chosen[i] + 1) if fits(apply({**others, i: j})))
    return "fits with all of: " + flags(chosen)


def device_bytes(device: str) -> tuple[float, str]:
    """One device's memory and where the figure comes from: the smallest GPU nvidia-smi lists, or the CPU's available
    memory (/proc/meminfo); (0, why) when neither can be read."""
    try:
        if device.startswith("cuda"):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            return min(float(x) for x in out) * 2**20, "the GPU nvidia-smi lists"
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:")) * 1024.0, \
                "this machine's available memory"
    except (OSError, ValueError, StopIteration, subprocess.SubprocessError):
        return 0.0, "no GPU found (nvidia-smi)" if device.startswith("cuda") else "no /proc/meminfo"


# The trainers' entry point (common.args.cli)

def setup_of(args, holds: Holds, shape: Shape) -> tuple[Setup, str, str]:
    """The Setup of a trainer's flags (a flag it lacks takes the shared default), where the prompt length comes from
    (--max-prompt-tokens, else DEFAULT_PROMPT_BUDGET capped by the model's positions) and the device's memory."""
    g = lambda name, default: getattr(args, name, default)  # noqa: E731
    group, completion = g("group_size", 1), g("max_new_tokens", 8)
    prompt, note = g("max_prompt_tokens", 0), "--max-prompt-tokens"
    if not prompt:
        prompt = min(DEFAULT_PROMPT_BUDGET, max(shape.max_positions - completion, 1) if shape.max_positions
                     else DEFAULT_PROMPT_BUDGET)
        note = "assumed" + ": set --max-prompt-tokens to plan for yours" * hasattr(args, "max_prompt_tokens")
    rows, micro = holds.rows or g("num_prompts", 16) * group, holds.micro_batch or g("micro_batch_size", 32)
    minibatches = g("num_minibatches", 1)  # 0: ppo_slm.py's, derived later: one micro-batch a mini-batch
    known = g("device_memory_gb", 0.0) * 1e9
    found = (known, "--device-memory-gb") if known else device_bytes(g("device", "cpu"))
    s = Setup(dtype=holds.dtype or g("dtype", "float32"), master_weights=g("master_weights", True),
              fsdp=g("fsdp", False), ranks=g("plan_ranks", 0) or int(os.environ.get("WORLD_SIZE", "1")), rows=rows,
              group=group, micro_batch=micro, prompt=prompt, completion=completion,
              minibatch=rows // minibatches if minibatches else micro,
              checkpointing=g("gradient_checkpointing", False), backend=g("rollout_backend", "hf"),
              vllm_share=g("vllm_gpu_memory_utilization", 0.3), vllm_dtype=g("vllm_dtype", "auto"),
              device=g("device", "cpu"), device_bytes=found[0], eval_problems=g("num_eval_problems", 0),
              eval_samples=g("eval_samples", 0),
              old_logprobs=g("num_iterations", 1) > 1 or minibatches != 1 or g("ppo_epochs", 1) > 1)
    return s, note, found[1]


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB" if x >= 1e8 else f"{x / 1e6:,.1f} MB"


def render(name: str, m: Shape, holds: Holds, s: Setup, frozen: list, prompt_note: str = "",
           device_note: str = "") -> tuple[list[str], bool | None]:
    """The plan as lines of text, and whether it fits (None: the device's memory is unknown)."""
    table = phases(m, holds, s, frozen)
    where, top = peak(table)
    big = top >= 1e9
    col = lambda x: (f"{x / 1e9:,.2f}" if big else f"{x / 1e6:,.1f}") if x else ""  # noqa: E731
    lora = holds.lora
    extra = [w for w, on in (("a reference copy", holds.reference), (f"{len(frozen)} frozen model(s)", frozen),
                             ("a value head", holds.value_head)) if on]
    master = " over float32 master weights" * (s.dtype != "float32" and s.master_weights and lora is None)
    size = f"{m.params / 1e9:.2f} B" if m.params >= 1e9 else f"{m.params / 1e6:.1f} M"
    lines = [f"memory plan for {name}: {size} parameters ({m.layers} layers, hidden {m.hidden:,}, intermediate "
             f"{m.intermediate:,}, heads {m.heads}/{m.kv_heads} KV, vocabulary {m.vocab:,}, "
             f"{'tied' if m.tied else 'untied'} embeddings), "
             + (f"LoRA r {lora.r} on {', '.join(lora.targets)}" if lora else "trained in full")
             + (f", with {' and '.join(extra)}" if extra else ""),
             f"per rank of {s.ranks}{' (--fsdp)' * s.fsdp}, --dtype {s.dtype}{master}, {s.rows} rollouts a step, "
             f"micro-batch {s.micro_batch}, rows of {s.prompt:,} prompt ({prompt_note}) + {s.completion:,} "
             f"completion tokens, gradient checkpointing {'on' if s.checkpointing else 'off'}, "
             f"--rollout-backend {s.backend}", "",
             f"| {'GB' if big else 'MB'} | " + " | ".join(table) + " |", "|---" * (len(table) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(col(t.get(p, 0)) for t in table.values()) + " |"
              for p in dict.fromkeys(k for t in table.values() for k in t)]
    lines += ["| total | " + " | ".join(f"**{col(sum(t.values()))}**" for t in table.values()) + " |", "",
              f"peak: {gb(top)} in {where}"]
    if s.backend == "vllm" and s.device.startswith("cuda") and s.device_bytes:
        share, (weights, row) = s.vllm_share * s.device_bytes, vllm_floor(m, s)
        lines.append(f"vLLM's share {gb(share)} (--vllm-gpu-memory-utilization {s.vllm_share:g}): " + (
            f"cannot hold its weights and one sequence's KV cache ({gb(weights + row)}): raise it"
            if share < weights + row else f"its weights {gb(weights)}, a KV cache for "
            f"{int((share - weights - row) // row) + 1:,} rows of {s.prompt + s.completion:,} tokens at once (a step "
            f"samples {s.rows})"))
    if not s.device_bytes:
        return lines + [f"device memory unknown ({device_note}): give --device-memory-gb"], None
    usable = (1 - RESERVE) * s.device_bytes
    lines.append(f"device: {gb(s.device_bytes)} ({device_note}), {gb(usable)} usable ({RESERVE:.0%} kept for what the "
                 f"plan does not count): " + ("fits" if top <= usable else "does not fit; " +
                                              suggest(m, holds, s, frozen, usable)))
    if top > usable and prompt_note.startswith("assumed"):  # the usual cause on short-prompt data: say what it costs
        shorter = [(p, peak(phases(m, holds, replace(s, prompt=p), frozen))[1]) for p in (1024, 512, 256, 128)
                   if p < s.prompt]
        lines.append(f"the {s.prompt:,}-token prompts are assumed, not read from your data; the peak with "
                     "--max-prompt-tokens " + ", ".join(f"{p}: {gb(x)}" for p, x in shorter))
    return lines, top <= usable


def plan(args, holds: Holds) -> None:
    """Print the plan of this run (rank 0) and exit: status 0 when it fits or the device's memory is unknown, 1 when
    it does not fit."""
    m = read_shape(args.model_name)
    s, prompt_note, device_note = setup_of(args, holds, m)
    lines, ok = render(args.model_name, m, holds, s, frozen_shapes(holds, s.dtype), prompt_note, device_note)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(lines), flush=True)
    raise SystemExit(0 if ok is not False else 1)
