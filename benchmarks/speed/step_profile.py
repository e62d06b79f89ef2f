"""Where a grpo.py step spends its time, beside the raw cost of the same work (the profile behind
benchmarks/speed/trl_throughput.md).

    python -m benchmarks.speed.step_profile      # about 3 minutes on 2 cores

For the three settings of trl_throughput.py (8 prompts x 8 samples), in one process: grpo.py's
per-phase times (median over steps 3..N of time/generate, time/logprobs, time/update and
perf/step_time), and the raw costs on the same model and batch: `model.generate` alone, one
forward+backward over every token alone (what TRL and a plain loop pay), and one optimizer step.
Writes benchmarks/speed/step_profile.md.
"""

import argparse
import os
import platform
import statistics
import time

import torch
import tyro
from transformers import GenerationConfig

import grpo
from benchmarks.speed.bench_models import bench_models
from common.data import encode_prompts, load_problems, render_prompt
from common.logger import read_metrics
from common.models import load_model, load_tokenizer
from common.rollout import left_pad

SETTINGS = [("1M, natural answers (max 8)", "1M", 8), ("1M, 32 forced tokens", "1M-forced", 32),
            ("10M, 32 forced tokens", "10M-forced", 32)]
PROMPTS, GROUP = 8, 8


def ours(model_dir, max_new, steps):
    out = grpo.main(tyro.cli(grpo.Args, args=[
        "--model-name", model_dir, "--num-prompts", str(PROMPTS), "--group-size", str(GROUP),
        "--max-new-tokens", str(max_new), "--micro-batch-size", str(PROMPTS * GROUP), "--total-steps", str(steps),
        "--eval-every", "0", "--num-eval-problems", "8", "--eval-samples", "0", "--output-dir", "runs/benchmarks",
        "--run-name", f"profile_{os.getpid()}_{max_new}"]))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r][2:]
    keys = ["time/generate", "time/logprobs", "time/update", "perf/step_time", "rollout/completion_len"]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def raw(model_dir, max_new, steps):
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    problems = load_problems("testbed", "train", (3,), PROMPTS, 1)
    rows = [p for p in encode_prompts(tok, [render_prompt(q, tok) for q in problems], 0) for _ in range(GROUP)]
    ids, mask = left_pad(rows, tok.pad_token_id)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    gen, fwd_bwd, opt_step = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        t1 = time.perf_counter()
        attn = torch.cat([mask, (seqs[:, ids.shape[1]:] != tok.pad_token_id).long()], 1)
        model(input_ids=seqs, attention_mask=attn).logits.float().logsumexp(-1).mean().backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        gen.append(t1 - t0), fwd_bwd.append(t2 - t1), opt_step.append(t3 - t2)
    med = lambda x: statistics.median(x[2:])  # noqa: E731
    return {"generate": med(gen), "fwd_bwd": med(fwd_bwd), "optimizer": med(opt_step)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_profile.md"))
    cli = p.parse_args()
    models = bench_models()
    lines = ["# Where a grpo.py step goes (8 prompts x 8 samples, seconds, median of steps 3.."
             f"{cli.steps})", "",
             f"`python -m benchmarks.speed.step_profile`, {time.strftime('%Y-%m-%d')}, {platform.machine()} CPU, "
             f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads.", "",
             "| setting | ours: generate (hf loop) | ours: old log-probs | ours: update (fwd+bwd+optimizer) | ours: whole step "
             "| raw: model.generate | raw: fwd+bwd over all tokens | raw: optimizer step | raw total |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, key, max_new in SETTINGS:
        o, r = ours(models[key], max_new, cli.steps), raw(models[key], max_new, cli.steps)
        raw_total = r["generate"] + r["fwd_bwd"] + r["optimizer"]
        lines.append(f"| {label} | {o['time/generate']:.3f} | {o['time/logprobs']:.3f} | {o['time/update']:.3f} | "
                     f"{o['perf/step_time']:.3f} | {r['generate']:.3f} | {r['fwd_bwd']:.3f} | {r['optimizer']:.3f} | "
                     f"{raw_total:.3f} |")
        print(lines[-1], flush=True)
    open(cli.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
