"""The memory plan (`--plan-memory`, common/memory_plan.py) beside the measured peak resident memory of real training
steps on CPU: testbed-weak and SmolLM2-135M-Instruct, full fine-tuning (grpo.py's `main`) and LoRA (the adapters of
mada_rl.py's defaults on a frozen base, stepped by a few lines here: the trainers' own loading and rollout code, a
policy-gradient loss), micro-batch 4 and 16, gradient checkpointing off and on.

    python -m benchmarks.speed.plan_memory                    # every configuration; writes plan_memory.md
    python -m benchmarks.speed.plan_memory --models testbed-weak --modes full

Each configuration runs in a fresh process (MALLOC_MMAP_THRESHOLD_=65536, so that freed buffers go back to the system
at once; OMP_NUM_THREADS=1, nice 5). It first pages in torch's kernels with a tiny random model of the same
architecture (a forward, backward, AdamW step and generation), frees it, then runs two training steps of 16 rollouts
(4 prompts x 4 samples). The baseline is the resident size just before the policy loads (the tokenizer and the
problems already loaded: the plan does not count them); in the second step (AdamW's state exists by then) the resident
high-water mark (VmHWM, reset through /proc/self/clear_refs when a phase starts) is read at the end of the generation
and of the update, minus the baseline. The plan is evaluated at the step's actual shapes: its rows' prompt length
(left-padded to the longest) and completion width. Peak resident memory is what an out-of-memory kill sees, and it
counts every allocation torch makes on the CPU (tracemalloc sees none of them; torch keeps no CPU allocator
statistics); its noise is a few MB of interpreter objects, which matters for the 1M-parameter testbed only.
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
from contextlib import contextmanager

from common import memory_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {"testbed-weak": dict(dataset="testbed", max_new_tokens=8),
          "smollm2-135m-instruct": dict(dataset="testbed-nl", max_new_tokens=64)}
PROMPTS, GROUP = 4, 4
BETA = 0.01
"""grpo.py's KL coefficient here: a reference model and its log-prob pass, and an update at every step (without one,
a step whose rewards are all equal, SmolLM2's usual zero-shot case, skips its update)"""
MADA_LORA = dict(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 adapters=6)
"""mada_rl.py's defaults: rank 8, alpha 16, every linear map, 3 generators + 3 critics (one trains at a time)"""


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def code_pages() -> int:
    """Resident file-backed bytes other than mapped weights: RssFile less the resident part of every mapping of a
    .safetensors file (a frozen float32 base stays mapped from its file; weights that train are copied)."""
    mapped, path = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and not head[0].endswith(":"):
                path = head[-1] if len(head) >= 6 else ""
            elif head and head[0] == "Rss:" and path.endswith(".safetensors"):
                mapped += int(head[1]) * 1024
    return status("RssFile") - mapped


def settle_and_reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def warm_up(model_type: str, ckpt: bool, lora: bool) -> None:
    """Page in the kernels a step runs (their code counts in the resident size the first time it runs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.models import add_lora, enable_gradient_checkpointing
    from common.rollout import completion_logprobs

    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).train()
    if lora:
        model = add_lora(model, ["a", "b"], 4, 8, MADA_LORA["targets"])
    if ckpt:
        enable_gradient_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters())
    ids_BT = torch.randint(0, 300, (2, 12))
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[0, :2] = 0
    with torch.no_grad():
        model.eval()
        out = model(input_ids=ids_BT[:, :8], attention_mask=attn_BT[:, :8], use_cache=True)
        model(input_ids=ids_BT[:, 8:9], attention_mask=attn_BT[:, :9], past_key_values=out.past_key_values,
              use_cache=True)
        model.train()
    logp_BC, _ = completion_logprobs(model, ids_BT, attn_BT, 8, with_entropy=True)
    logp_BC.sum().backward()
    opt.step()
    del model, opt, out


class Meter:
    """The resident high-water mark above `base` of each phase of the second step (the first has no AdamW state yet
    when it generates)."""

    def __init__(self):
        self.base, self.updates, self.peaks, self.shape, self.held, self.split = None, 0, {}, None, None, None
        self.code = {}  # file-backed pages other than mapped weights above the baseline's, at each phase's end

    def set_base(self) -> None:
        """The baseline: the resident size now, all settled (and its anonymous and file-backed parts)."""
        self.base = settle_and_reset_peak()
        self.base_split = {k: status(k) for k in ("RssAnon", "RssFile")}
        self.base_code = code_pages()

    @contextmanager
    def phase(self, name: str):
        measured = self.updates == 1 and name in ("generate", "logprobs", "update")
        if measured:
            rss = settle_and_reset_peak() - self.base
            if name == "generate":  # between steps: weights and AdamW state; anonymous and file-backed (code) pages
                self.held, self.split = rss, {k: status(k) - self.base_split[k] for k in ("RssAnon", "RssFile")}
                self.code["held"] = code_pages() - self.base_code
        yield
        if measured:
            self.peaks[name] = status("VmHWM") - self.base
            self.code[name] = code_pages() - self.base_code
        self.updates += name == "update"


def patch(name: str, wrapper) -> None:
    """Replace function `name` by wrapper(original) wherever a loaded module of this project holds it (a trainer
    that imported it by name, or the module that defines it)."""
    original = None
    for mod in list(sys.modules.values()):
        f = getattr(mod, name, None) if mod and getattr(mod, "__file__", "") and ROOT in mod.__file__ else None
        if callable(f) and getattr(f, "__name__", "") == name:
            original = original or f
            setattr(mod, name, wrapper(f))
    assert original is not None, f"no loaded module defines {name}"


def full_step(c: dict, meter: Meter, out_dir: str) -> None:
    """Two steps of grpo.py's own main(), the phases timed by its `timed` blocks."""
    import grpo
    import common.logger  # noqa: F401  (the modules that define what is patched)
    import common.models  # noqa: F401
    import common.rollout  # noqa: F401

    def base_before(load):
        def wrapped(*a, **k):
            meter.set_base()
            model = load(*a, **k)
            meter.loaded = settle_and_reset_peak() - meter.base
            return model
        return wrapped

    def timed_too(timed):
        @contextmanager
        def wrapped(times, name):
            with meter.phase(name), timed(times, name):
                yield
        return wrapped

    def shapes_of(make_engine):
        def wrapped(*a, **k):
            engine = make_engine(*a, **k)
            generate = engine.generate

            def recorded(*ga, **gk):
                r = generate(*ga, **gk)
                if gk.get("n", 1) == GROUP and meter.updates == 1:  # the measured step's rollouts
                    meter.shape = (r.input_ids_BT.shape[0], r.prompt_len, r.input_ids_BT.shape[1] - r.prompt_len)
                return r
            engine.generate = recorded
            return engine
        return wrapped

    patch("load_policy", base_before)
    patch("timed", timed_too)
    patch("make_engine", shapes_of)
    spec = MODELS[c["model"]]
    grpo.main(grpo.Args(model_name=c["model"], dataset=spec["dataset"], num_prompts=PROMPTS, group_size=GROUP,
                        micro_batch_size=c["micro_batch"], gradient_checkpointing=c["ckpt"], total_steps=2,
                        max_new_tokens=spec["max_new_tokens"], eval_every=0, num_eval_problems=4, eval_samples=0,
                        beta=BETA, log_samples=0, save_optimizer=False, output_dir=out_dir, seed=1))


def lora_step(c: dict, meter: Meter) -> None:
    """Two steps of a LoRA policy gradient on mada_rl.py's adapters: HFEngine rollouts, then micro-batched
    completion_logprobs, a loss and its backward, AdamW on the active adapter."""
    import torch

    from common.data import encode_prompts, load_problems, render_prompt
    from common.models import add_lora, enable_gradient_checkpointing, load_model, load_tokenizer
    from common.rollout import HFEngine, completion_logprobs
    from grounds import path_of
    from mada_rl_agents import adapter_params, use_adapter

    spec, path = MODELS[c["model"]], path_of(c["model"])
    tokenizer = load_tokenizer(path)
    problems = load_problems(spec["dataset"], "train", (3,), 64, 1)
    torch.manual_seed(1)
    meter.set_base()
    names = [f"a{k}" for k in range(MADA_LORA["adapters"])]
    model = add_lora(load_model(path, "float32"), names, MADA_LORA["r"], MADA_LORA["alpha"], MADA_LORA["targets"])
    meter.loaded = settle_and_reset_peak() - meter.base
    use_adapter(model, names[0])
    if c["ckpt"]:
        enable_gradient_checkpointing(model)
    optimizer = torch.optim.AdamW(adapter_params(model, names[0]).values(), lr=1e-4)
    engine = HFEngine(model, tokenizer)
    for step in (1, 2):
        prompt_ids = encode_prompts(tokenizer, [render_prompt(p, tokenizer) for p in problems[:PROMPTS]])
        with meter.phase("generate"):
            r = engine.generate(prompt_ids, n=GROUP, max_new_tokens=spec["max_new_tokens"])
        meter.shape = (r.input_ids_BT.shape[0], r.prompt_len, r.input_ids_BT.shape[1] - r.prompt_len)
        adv_B = torch.randn(len(r.input_ids_BT))
        with meter.phase("update"):
            optimizer.zero_grad(set_to_none=True)
            for rows in torch.arange(len(adv_B)).split(c["micro_batch"]):
                logp_BC, entropy_BC = completion_logprobs(model, r.input_ids_BT[rows], r.attention_mask_BT[rows],
                                                          r.prompt_len, with_entropy=True)
                mask_BC = r.completion_mask_BC[rows]
                loss = -(logp_BC * mask_BC * adv_B[rows, None]).sum() / r.completion_mask_BC.sum()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter_params(model, names[0]).values(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def worker(c: dict, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    start, meter = time.perf_counter(), Meter()
    model_type = json.load(open(memory_plan.config_path(c["model"])))["model_type"]
    warm_up(model_type, c["ckpt"], c["mode"] == "lora")
    with tempfile.TemporaryDirectory() as tmp:
        full_step(c, meter, tmp) if c["mode"] == "full" else lora_step(c, meter)
    with open(out_path, "w") as f:
        json.dump({**c, "base": meter.base, "loaded": getattr(meter, "loaded", None), "held": meter.held,
                   "held_split": meter.split, "peaks": meter.peaks, "code": meter.code, "shape": meter.shape,
                   "seconds": time.perf_counter() - start}, f)


def measure(c: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        worker_command = [sys.executable, "-m", "benchmarks.speed.plan_memory", "--worker", json.dumps(c), out]
        r = subprocess.run(["nice", "-n", "5", *worker_command],
                           capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16), "OMP_NUM_THREADS": "1",
                                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
        if r.returncode:
            raise SystemExit(f"error: configuration {c} failed:\n{r.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def plan(r: dict) -> dict:
    """The plan's bytes at the measured step's shapes: between steps (held), and per phase."""
    shape = memory_plan.read_shape(r["model"])
    rows, prompt, completion = r["shape"]
    lora = dict(lora_r=MADA_LORA["r"], lora_targets=MADA_LORA["targets"], adapters=MADA_LORA["adapters"]) \
        if r["mode"] == "lora" else {}
    s = memory_plan.Setup(rows=rows, group=GROUP, micro_batch=r["micro_batch"], prompt=prompt, completion=completion,
                          checkpointing=r["ckpt"])
    table = memory_plan.phases(shape, memory_plan.Holds(**lora, reference=r["mode"] == "full"), s, [])
    total = {k: sum(v.values()) for k, v in table.items()}
    return {"held": sum(v for k, v in table["generation"].items() if k != "KV cache and sampling"),
            "generate": total["generation"], "logprobs": total.get("log-prob passes"),
            "update": max(total["update: micro-batch"], total["update: optimizer step"]),
            "parts": {k: table["update: micro-batch"].get(k, 0) for k in ("activations", "logits")}}


def mb(x: float) -> str:
    return f"{x / 1e6:,.1f}" if abs(x) < 1e8 else f"{x / 1e6:,.0f}"


def table(results: list) -> list[str]:
    lines = ["| model | training | micro-batch | checkpointing | rows x (prompt + completion) | phase | measured MB | "
             "plan MB | measured / plan | of which code pages MB | the rest / plan | plan's activations + logits MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, measured = plan(r), {**r["peaks"], "held": r["held"]}
        files = r.get("code", {})
        rows, prompt, completion = r["shape"]
        for phase in ("held", "generate", "logprobs", "update"):
            if phase not in measured or not p[phase]:
                continue
            extra = (f"{mb(p['parts']['activations'])} + {mb(p['parts']['logits'])}" if phase == "update" else "")
            lines.append(f"| {r['model']} | {r['mode']} | {r['micro_batch']} | {'on' if r['ckpt'] else 'off'} | "
                         f"{rows} x ({prompt} + {completion}) | {phase} | {mb(measured[phase])} | {mb(p[phase])} | "
                         f"{measured[phase] / p[phase]:.3f} | " + (f"{mb(files[phase])} | "
                         f"{(measured[phase] - files[phase]) / p[phase]:.3f}" if files.get(phase) is not None
                         else " | ") + f" | {extra} |")
    return lines


def overhead(results: list) -> str:
    """Between the steps, per model and training mode: the plan's held bytes beside the measured resident size, split
    into anonymous memory, weights mapped from their .safetensors file and other file-backed pages (code)."""
    out = []
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in results):
        rs = [r for r in results if (r["model"], r["mode"]) == (model, mode) and "held" in r.get("code", {})]
        if not rs:
            continue
        parts = [(plan(r)["held"], r["held"], r["held_split"]["RssAnon"],
                  r["held_split"]["RssFile"] - r["code"]["held"], r["code"]["held"]) for r in rs]
        span = lambda k: f"{min(p[k] for p in parts) / 1e6:,.1f} to {max(p[k] for p in parts) / 1e6:,.1f}"  # noqa: E731
        out.append(f"{model} {mode}: plan {span(0)} MB, measured {span(1)} = anonymous {span(2)} + weights mapped "
                   f"from the file {span(3)} + other file pages {span(4)}")
    return "; ".join(out)


def ratios(results: list, model: str, files: bool) -> str:
    """The range of measured / plan over every phase of `model`'s rows (files: less the code pages first)."""
    out = []
    for r in (r for r in results if r["model"] == model):
        p, measured = plan(r), {**r["peaks"], "held": r["held"]}
        paged = r.get("code", {})
        out += [(measured[k] - (paged.get(k) or 0) * files) / p[k] for k in measured if p.get(k)
                if not files or paged.get(k) is not None]
    return f"{min(out):.2f} to {max(out):.2f}" if out else "not measured"


def ckpt_gap(results: list) -> str:
    """Measured over planned update peak of the checkpointed full fine-tuning rows of SmolLM2."""
    rs = [r for r in results if r["model"] != "testbed-weak" and r["mode"] == "full" and r["ckpt"]]
    return ", ".join(f"micro-batch {r['micro_batch']}: {r['peaks']['update'] / plan(r)['update']:.3f}" for r in rs)


def write(results: list, command: str, minutes: float) -> None:
    lines = ["# The memory plan beside measured steps (CPU)", "",
             f"`{command}` ({minutes:.0f} minutes on {os.cpu_count()} shared cores; `--help` says how it measures). "
             "Measured: the resident high-water mark of the second training step's phase above the resident size "
             "just before the policy loaded, each configuration in a fresh process (MB = 1e6 bytes); `held`: the "
             "resident size between the two steps (weights and AdamW state). Plan: common/memory_plan.py's phases "
             "at the step's shapes, float32, one rank (held: the weights and AdamW's state; generate: with the KV "
             "cache and sampling; logprobs: with the reference's no-grad micro-batch; update: the larger of the "
             "micro-batch moment and the optimizer step's). full = grpo.py's main() with --beta "
             f"{BETA} (a reference model and an update at every step); lora = mada_rl.py's adapters (rank "
             f"{MADA_LORA['r']} on every linear map, {MADA_LORA['adapters']} held, one trained) on a float32 base, "
             f"stepped by this script. {PROMPTS} prompts x {GROUP} samples a step. Code pages: the resident "
             "file-backed pages other than weights mapped from a .safetensors file, above the baseline's, at the "
             "phase's end (held: between the steps); the rest / plan: the measured peak less them, over the plan "
             "(an estimate: the pages at the phase's end, not at its peak).", "", *table(results), "",
             "Where they differ:", "",
             f"- Between the steps (MB): {overhead(results)}. A frozen float32 base stays mapped from its "
             ".safetensors file (LoRA), and the plan's base weights are those pages; after a full fine-tuning's "
             "load the file's mapping can stay resident beside the trained copy, which the plan does not count "
             "(testbed-weak's 4.3 MB file; not SmolLM2's). Other file pages are code paged in after the baseline "
             "(the warm-up's tiny model does not run every kernel), less pages the kernel evicted (negative). "
             "testbed-weak's whole state is 17 MB (7 MB with LoRA), so its rows are "
             f"{ratios(results, 'testbed-weak', False)} times the plan ({ratios(results, 'testbed-weak', True)} "
             "less the code pages): a mapped file, a few MB of code and 3 to 4 MB of anonymous memory beyond the "
             "plan's tensors, not traced here (interpreter objects, autograd's graph or the allocator's small "
             "blocks would be such a constant), which are 1 to 3 % of SmolLM2's rows: "
             f"{ratios(results, 'smollm2-135m-instruct', False)} times the plan.",
             "- SmolLM2, full, micro-batch 4, checkpointing on: the peak is at the end of the backward, where the "
             "input embedding's gradient is computed (tied: the whole 49,152 x 576 matrix; on the CPU "
             "`embedding_dense_backward` held two float32 copies, +226 MB in a per-layer trace of the resident "
             "size, run once by hand) beside about 85 MB of the logits' gradient path still alive. The plan has no "
             "such moment: without checkpointing the activations dwarf it; with it, it is the difference "
             f"({ckpt_gap(results)}).",
             "- One micro-batch per optimizer step (micro-batch 16 of 16 rows): its backward starts with no "
             "gradient and frees activations as it allocates gradients; the plan counts the gradients at the "
             "micro-batch moment only when there are several micro-batches.", ""]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_memory.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(models: list[str], modes: list[str], micro_batches: list[int], results_file: str = "") -> None:
    command = " ".join(["python -m benchmarks.speed.plan_memory"] + sys.argv[1:])
    if results_file:  # the table again from a run's printed results (the plan recomputed, nothing measured)
        with open(results_file) as f:
            runs = [json.loads(line) for line in f if line.startswith("{")]
        minutes = sum(r["seconds"] for r in runs) / 60  # the configurations' own time
        return write(runs, f"python -m benchmarks.speed.plan_memory {' '.join(sys.argv[1:])}", minutes)
    configs = [dict(model=m, mode=mode, micro_batch=b, ckpt=ck) for m in models for mode in modes
               for b in micro_batches for ck in (False, True)]
    start, results = time.perf_counter(), []
    for c in configs:
        results.append(measure(c))
        print(json.dumps(results[-1]), flush=True)
    write(results, command, (time.perf_counter() - start) / 60)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
        p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
        p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 16])
        p.add_argument("--results", default="", help="write plan_memory.md from the JSON lines a run printed")
        a = p.parse_args()
        main(a.models, a.modes, a.micro_batches, a.results)
