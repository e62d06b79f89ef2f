"""Peak memory of one micro-batch's forward and backward in the update, at Qwen2.5's vocabulary (V = 151,936 head
rows, 151,665 tokens) and 1,024 completion tokens, on CPU: the trainers' `completion_logprobs` against the code it
replaced, with and without `--gradient-checkpointing`, in float32 and under bfloat16 autocast (float32 weights).

    python -m benchmarks.speed.update_memory                            # 1 and 2 rows; writes update_memory.md
    python -m benchmarks.speed.update_memory --rows 1 2 4 --old-rows 2  # update_memory.md's run: 23 min, 2 busy cores

The model is a randomly initialised Qwen2 built here (hidden 128, 2 layers, intermediate 256, 4 heads and 2 KV
heads, tied embeddings as in Qwen2.5-0.5B and 1.5B), its padded head rows masked as `load_model` does
(`mask_padded_head`): small enough that the vocabulary-sized tensors dominate, as they do at real sizes once
activations are checkpointed. Each configuration runs in a fresh process (MALLOC_MMAP_THRESHOLD_=65536, so that
freed buffers go back to the system at once): it builds the model, runs one small warm-up update (which pages in
the kernels and allocates the parameters' gradients, held between micro-batches anyway), then measures the resident
high-water mark (VmHWM, reset through /proc/self/clear_refs) over one forward of `completion_logprobs` with the
entropy, the loss and its backward, minus the resident size just before. A calibration row checks the method on a
tensor of known size. The measurements are compared with docs/fsdp.md's formula, printed beside them. A last table
counts (tensor by tensor, no RSS) the activations one decoder layer of Qwen2.5-0.5B's and 1.5B's shapes saves.
"""

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import ROOT

V, TOKENS, HIDDEN, LAYERS, INTER, HEADS, KV_HEADS = 151936, 151665, 128, 2, 256, 4, 2
PROMPT, COMPLETION = 64, 1024


def status(key: str) -> int:
    """VmRSS (resident now) or VmHWM (peak since the last reset) of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def settle_and_reset_peak() -> int:
    """Give freed heap back to the system, restart the peak count; the resident size now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def old_token_logprobs(logits_BCV, targets_BC, temperature=1.0, with_entropy=False):
    """completion_logprobs before this change, after its forward: full-size float32 log-softmax and entropy."""
    z_BCV = logits_BCV.float() / temperature
    lse_BC = z_BCV.logsumexp(-1)
    logp_BC = z_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1) - lse_BC
    entropy_BC = None
    if with_entropy:
        with torch.no_grad():
            probs = (z_BCV - lse_BC.unsqueeze(-1)).exp()
            entropy_BC = lse_BC - (probs * z_BCV).sum(-1)
    return logp_BC, entropy_BC


def old_completion_logprobs(model, input_ids_BT, attention_mask_BT, prompt_len, temperature=1.0, with_entropy=False):
    from common.rollout import completion_logits

    logits_BCV = completion_logits(model, input_ids_BT, attention_mask_BT, prompt_len)
    return old_token_logprobs(logits_BCV, input_ids_BT[:, prompt_len:], temperature, with_entropy)


def build_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.models import mask_padded_head

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=INTER,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=True,
                      max_position_embeddings=2048)
    model = Qwen2ForCausalLM(cfg).train()
    mask_padded_head(model, TOKENS)
    return model


def update(model, fn, rows: int, completion: int, dtype: str) -> None:
    """One micro-batch of the trainers' update: log-probs and entropy of the completion, a loss, its backward."""
    g = torch.Generator().manual_seed(rows)
    ids_BT = torch.randint(0, TOKENS, (rows, PROMPT + completion), generator=g)
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[0, :7] = 0  # a left-padded prompt
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        logp_BC, entropy_BC = fn(model, ids_BT, attn_BT, PROMPT, 1.0, with_entropy=True)
    loss = -(logp_BC * torch.randn(rows, 1, generator=g)).sum() / (rows * completion) + 0 * entropy_BC.sum()
    loss.backward()


def leaf_update(fn, rows: int, completion: int, dtype: str) -> int:
    """The vocabulary-sized work alone: log-probs and entropy of leaf logits (as the LM head would return them)
    and their backward; the leaf is allocated before the peak count starts, its gradient after."""
    g = torch.Generator().manual_seed(rows)
    logits_BCV = torch.randn(rows, completion, V, generator=g).to(getattr(torch, {"fp32": "float32",
                                                                                     "bf16": "bfloat16"}[dtype]))
    targets_BC = torch.randint(0, TOKENS, (rows, completion), generator=g)
    logits_BCV.requires_grad_(True)
    base = settle_and_reset_peak()
    logp_BC, _ = fn(logits_BCV, targets_BC, 1.0, with_entropy=True)
    logp_BC.sum().backward()
    return status("VmHWM") - base


def worker(config: dict, out_path: str) -> None:
    from common.models import enable_gradient_checkpointing
    from common.rollout import completion_logprobs, token_logprobs

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    start = time.perf_counter()
    if config["level"] == "calibration":  # a tensor of known size, filled: the method must see its bytes
        base = settle_and_reset_peak()
        x = torch.ones(config["rows"] * 2**20 // 4)
        result = {"peak": status("VmHWM") - base, "expected": x.numel() * 4}
    elif config["level"] == "logits":
        fn = token_logprobs if config["code"] == "new" else old_token_logprobs
        leaf_update(fn, 1, 8, config["dtype"])  # warm-up: pages in the kernels' code
        result = {"peak": leaf_update(fn, config["rows"], config["completion"], config["dtype"])}
    else:
        model = build_model()
        if config["ckpt"]:
            enable_gradient_checkpointing(model)
        fn = completion_logprobs if config["code"] == "new" else old_completion_logprobs
        update(model, fn, 1, 16, config["dtype"])  # warm-up; allocates the parameters' gradients
        model.zero_grad(set_to_none=False)
        base = settle_and_reset_peak()
        update(model, fn, config["rows"], config["completion"], config["dtype"])
        result = {"peak": status("VmHWM") - base}
    with open(out_path, "w") as f:
        json.dump({**config, **result, "seconds": time.perf_counter() - start}, f)


def measure(config: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        r = subprocess.run([sys.executable, "-m", "benchmarks.speed.update_memory", "--worker", json.dumps(config),
                            out], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16),
                                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        if r.returncode:
            raise SystemExit(f"error: configuration {config} failed:\n{r.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def predicted(c: dict) -> float | None:
    """docs/fsdp.md's formula (common.memory_plan.micro_batch_bytes) for the new code's peak above the state held
    between micro-batches, in bytes."""
    if c["code"] != "new":
        return None
    from common.memory_plan import LOGPROB_CHUNK, Shape, micro_batch_bytes

    if c["level"] == "logits":  # the gradient of the leaf (kept by the caller) and the blocks
        return (4 if c["dtype"] == "fp32" else 2) * c["rows"] * c["completion"] * V + 2 * LOGPROB_CHUNK * 4
    shape = Shape(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                  intermediate=INTER, vocab=V, tied=True)
    precision = "float32" if c["dtype"] == "fp32" else "autocast"
    return sum(micro_batch_bytes(shape, c["rows"], PROMPT, c["completion"], precision, c["ckpt"]))


def mb(x: float) -> str:
    return f"{x / 1e6:,.0f}"


def table(results: list) -> list[str]:
    lines = ["| level | precision | code | checkpointing | rows B | completion C | peak MB | formula MB | "
             "measured / formula | peak bytes per B x C x V entry | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results[1:]:
        pred = predicted(r)
        entries = r["rows"] * (r["completion"] + (r["level"] == "model")) * V  # the model's logits have C + 1
        ratio = f"{r['peak'] / pred:.3f}" if pred else "-"
        lines.append(f"| {r['level']} | {r['dtype']} | {r['code']} | {'on' if r.get('ckpt') else 'off'} | "
                     f"{r['rows']} | {r['completion']} | {mb(r['peak'])} | {mb(pred) if pred else '-'} | {ratio} | "
                     f"{r['peak'] / entries:.1f} | {r['seconds']:.0f} |")
    return lines


QWEN_LAYERS = {"Qwen2.5-0.5B": (896, 14, 2, 4864), "Qwen2.5-1.5B": (1536, 12, 2, 8960)}
"""hidden, heads, KV heads, intermediate of the real models' decoder layers (their config.json)"""


def activation_bytes(name: str, dtype: str, ckpt: bool, tokens: int = 100) -> tuple[float, float]:
    """Bytes one decoder layer of `name`'s shape saves for backward per token, and per layer whatever the token
    count (autocast's bf16 weight copies), counted tensor by tensor (saved_tensors_hooks, distinct storages) over a
    forward of a 1- and a 2-layer model: the difference is one layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.models import enable_gradient_checkpointing
    from common.rollout import position_ids

    h, heads, kv_heads, inter = QWEN_LAYERS[name]
    saved = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=h, num_hidden_layers=layers,
                                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                                             intermediate_size=inter, tie_word_embeddings=True)).train()
        if ckpt:
            enable_gradient_checkpointing(model)
        weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1])
                                                                        for p in model.parameters()}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        found = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                kind = "weight" if t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes else "act"
                found[st.data_ptr()] = (kind, st.nbytes())
            return t

        ids_BT = torch.randint(0, 1000, (1, tokens))
        attn_BT = torch.ones_like(ids_BT)
        attn_BT[0, :4] = 0  # left padding, as in the trainers' batches: an attention mask, and the KV heads repeated
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=position_ids(attn_BT), logits_to_keep=1,
                  use_cache=False)
        saved[layers] = {k: sum(n for kind, n in found.values() if kind == k) for k in ("act", "weight")}
    return (saved[2]["act"] - saved[1]["act"]) / tokens, saved[2]["weight"] - saved[1]["weight"]


def activation_table() -> list[str]:
    lines = ["| layer shape | precision | checkpointing | saved per token and layer, bytes | in units of h | "
             "formula (docs/fsdp.md) | measured / formula | bf16 weight copies per layer, MB |",
             "|---|---|---|---|---|---|---|---|"]
    from common.memory_plan import Shape, layer_activation_bytes

    for name, (h, heads, kv_heads, inter) in QWEN_LAYERS.items():
        shape = Shape(hidden=h, layers=1, heads=heads, kv_heads=kv_heads, head_dim=h // heads, intermediate=inter,
                      vocab=1, tied=True)
        for dtype in ("fp32", "bf16"):
            for ckpt in (False, True):
                per_token, weights = activation_bytes(name, dtype, ckpt)
                formula = 4 * h if ckpt else layer_activation_bytes(shape, "float32" if dtype == "fp32" else "autocast")
                text = "4h" if ckpt else ("40h + 16I" if dtype == "fp32" else "38h + 8I")
                lines.append(f"| {name} (h {h}, I {inter}) | {dtype} | {'on' if ckpt else 'off'} | {per_token:,.0f} | "
                             f"{per_token / h:.1f} h | {text} = {formula:,} | {per_token / formula:.3f} | "
                             f"{mb(weights)} |")
                print(lines[-1], flush=True)
    return lines


def main(rows_list: list[int], old_rows: int, bf16_completion: int) -> None:
    configs = [{"level": "calibration", "rows": 1024}]
    configs += [{"level": "logits", "code": code, "dtype": dtype, "rows": 1, "completion": COMPLETION}
                for dtype in ("fp32", "bf16") for code in ("old", "new")]
    for code in ("old", "new"):
        for ckpt in (False, True):
            for rows in rows_list:
                if code == "new" or (rows <= old_rows and not ckpt):
                    configs.append({"level": "model", "code": code, "dtype": "fp32", "ckpt": ckpt, "rows": rows,
                                    "completion": COMPLETION})
    if bf16_completion:
        configs += [{"level": "model", "code": code, "dtype": "bf16", "ckpt": False, "rows": 1,
                     "completion": bf16_completion} for code in ("old", "new")]
    start, results = time.perf_counter(), []
    for c in configs:
        results.append(measure(c))
        print(json.dumps(results[-1]), flush=True)
    cal = results[0]
    activations = activation_table()
    command = " ".join(["python -m benchmarks.speed.update_memory"] + sys.argv[1:])
    lines = [
        "# Peak memory of one micro-batch of the update at Qwen2.5's vocabulary (CPU)",
        "",
        f"`{command}` ({(time.perf_counter() - start) / 60:.0f} minutes on {os.cpu_count()} shared cores; "
        "`--help` says what it does). "
        f"Model: a random Qwen2 with V = {V:,} head rows ({TOKENS:,} tokens, the padded rows masked as "
        f"`load_model` does), hidden {HIDDEN}, {LAYERS} layers, intermediate {INTER}, tied embeddings; rows of "
        f"{PROMPT} prompt + C completion tokens. `model`: one micro-batch of `completion_logprobs` with the entropy, "
        "a loss and its backward, the parameters' gradients already allocated (they are held between micro-batches "
        "anyway); `logits`: the same on leaf logits of B x C x V (the vocabulary-sized work alone: the leaf exists "
        "before the count starts, its gradient is counted). `old` is the code this replaced (full float32 "
        "log-softmax and entropy), `new` `token_logprobs`; bf16 = `torch.autocast('cpu', torch.bfloat16)` around "
        "the forward with float32 weights. Peak = resident high-water mark minus the resident size just before, "
        "each configuration in a fresh process (MB = 1e6 bytes). Calibration: a filled tensor of "
        f"{mb(cal['expected'])} MB read {mb(cal['peak'])} MB.",
        "",
        *table(results),
        "",
        "Formula (docs/fsdp.md, the new code): the peak is the larger of token_logprobs' backward (the logits kept "
        "for it and their gradient: 2e bytes per B x (C + 1) x V entry, e = 4 in float32, 2 for the bf16 logits of "
        "autocast, plus two float32 blocks of LOGPROB_CHUNK entries and, under autocast, the head's bf16 weight copy "
        "2Vh) and the LM head's backward (one logits-sized gradient, e per entry, beside the head's weight gradient: "
        "4Vh bytes in float32, 8Vh under autocast: bf16 weight copy, bf16 gradient and its float32 copy), plus the "
        "activations (per token and layer 40h + 16I bytes in float32, 38h + 8I under autocast with the layers' bf16 "
        "weight copies, 2 bytes a parameter; checkpointed: 4h per token and layer plus one layer's whole set "
        "during its recompute; 8h per token for the final norm). At C = 1,024 the first term is the peak; the bf16 "
        f"rows run at C = {bf16_completion} because this CPU's bf16 matrix products are slow (no native bf16), and "
        "there the head's weight gradient sets the peak. The bf16 logits coefficient is measured at full size on "
        "the `logits` rows (2 bytes of gradient per entry where the old code held 20).",
        "",
        "The activations of real layer shapes, counted (not RSS): bytes saved for backward by one decoder layer of "
        "Qwen2.5's shapes (a 2-layer minus a 1-layer random model, 100 tokens with a left-padded start, tensor by "
        "tensor with `torch.autograd.graph.saved_tensors_hooks`, distinct storages, parameters left out; under "
        "autocast the bf16 copies of the weights are counted apart):",
        "",
        *activations,
    ]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "update_memory.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--rows", type=int, nargs="+", default=[1, 2], help="micro-batch sizes (rows)")
        p.add_argument("--old-rows", type=int, default=1, help="largest micro-batch to run the old code at")
        p.add_argument("--bf16-completion", type=int, default=64,
                       help="completion tokens of the bf16-autocast rows (0: none; bf16 matmuls are slow on CPUs "
                            "without native bf16)")
        a = p.parse_args()
        main(a.rows, a.old_rows, a.bf16_completion)
