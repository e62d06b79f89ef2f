"""Direct-OPD vs vanilla OPD vs an identical-teacher control, on the embedded testbed.

The student is testbed-strong; the weak pair is testbed-weak before and after grpo.py on level 3 (built once
and cached by direct_opd.py). Same problems, steps, seeds and optimiser for every method; each row is one run.
No run has a verifier in its loss. Optional rows: direct with the KL coefficient starting at its floor, and
the pair with its roles swapped. Prints (and writes to benchmarks/testbed/direct_opd_benchmark.md) the student's
held-out accuracy before/after beside the teachers', and the dense-reward and KL diagnostics.

    python -m benchmarks.testbed.direct_opd_benchmark               # 150 steps, seed 1
    python -m benchmarks.testbed.direct_opd_benchmark --steps 200 --seeds 1 2 3 --methods direct control swapped
"""

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import direct_opd
from benchmarks import ROOT
from common.logger import read_metrics
from grounds.testbed_models import ensure_testbed_teacher_pair

METHODS = {  # name -> (label, direct_opd.py flags); "swapped" gets the built post-RL teacher's folder at run time
    "direct": ("direct", ["--reward", "direct"]),
    "vanilla_opd": ("vanilla_opd", ["--reward", "vanilla_opd"]),
    "control": ("control: identical teachers", ["--reward", "direct", "--teacher-post", "testbed-weak"]),
    "direct_beta0.5": ("direct, KL coefficient starts at its floor 0.5", ["--reward", "direct", "--kl-coef", "0.5"]),
    "swapped": ("swapped pair (negative shift)", ["--reward", "direct", "--teacher-post", "testbed-weak"]),
}


@dataclass
class Bench:
    steps: int = 150
    """training steps per run"""
    seeds: tuple[int, ...] = (1,)
    """one run per method and seed"""
    num_prompts: int = 16
    """prompts per step"""
    group_size: int = 4
    """completions per prompt"""
    learning_rate: float = 5e-5
    """AdamW learning rate of every run"""
    num_eval_problems: int = 200
    """held-out problems per evaluation"""
    eval_samples: int = 4
    """samples per held-out problem for sampled accuracy (greedy is always measured)"""
    threads: int = 1
    """torch CPU threads (the tiny testbed models gain little from more on a shared CPU)"""
    output_dir: str = "runs/direct_opd_benchmark"
    """run folders"""
    report: str = os.path.join(ROOT, "benchmarks", "testbed", "direct_opd_benchmark.md")
    """markdown table written at the end"""
    methods: tuple[str, ...] = ("direct", "vanilla_opd", "control")
    """which runs, in order: direct, vanilla_opd, control (identical teachers), direct_beta0.5, swapped (the pair's
    roles exchanged: a negative shift)"""


def run_one(bench: Bench, key: str, name: str, extra: list, seed: int) -> dict:
    cli = ["--total-steps", str(bench.steps), "--seed", str(seed), "--num-prompts", str(bench.num_prompts),
           "--group-size", str(bench.group_size), "--learning-rate", str(bench.learning_rate),
           "--num-eval-problems", str(bench.num_eval_problems), "--eval-samples", str(bench.eval_samples),
           "--eval-every", "0", "--output-dir", bench.output_dir,
           "--run-name", f"{key}__{seed}__{int(time.time())}", *extra]
    t0 = time.time()
    out = direct_opd.main(tyro.cli(direct_opd.Args, args=cli))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    mean = lambda k, part: float(np.mean([r[k] for r in part]))  # noqa: E731
    return {
        "method": name, "seed": seed, "minutes": (time.time() - t0) / 60,
        "greedy_before": out["before"]["eval/greedy_accuracy"], "greedy_after": out["after"]["eval/greedy_accuracy"],
        "sampled_before": out["before"].get("eval/sampled_accuracy", float("nan")),
        "sampled_after": out["after"].get("eval/sampled_accuracy", float("nan")),
        "teacher_pre": out["before"]["eval/teacher_pre_greedy_accuracy"],
        "teacher_post": out["before"]["eval/teacher_post_greedy_accuracy"],
        "wr_first10": mean("delta_opd/weighted_reward_mean", rows[:10]),
        "wr_last10": mean("delta_opd/weighted_reward_mean", rows[-10:]),
        "kl_last10": mean("loss/kl", rows[-10:]), "beta_last": rows[-1]["kl/coef"],
        "train_acc_first10": mean("train/accuracy", rows[:10]), "train_acc_last10": mean("train/accuracy", rows[-10:]),
        "run_dir": out["run_dir"],
    }


def table(results: list) -> str:
    head = ("| reward | seed | student greedy before -> after | student sampled before -> after | teacher pre / post "
            "greedy | weighted reward mean (first 10 -> last 10 steps) | KL to initial student (last 10) | beta (end) "
            "| rollout verifier acc (first 10 -> last 10) | minutes |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(f"| {r['method']} | {r['seed']} | {r['greedy_before']:.3f} -> {r['greedy_after']:.3f} | "
                     f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f} | {r['teacher_pre']:.3f} / "
                     f"{r['teacher_post']:.3f} | {r['wr_first10']:+.4f} -> {r['wr_last10']:+.4f} | "
                     f"{r['kl_last10']:.4f} | {r['beta_last']:.2f} | {r['train_acc_first10']:.3f} -> "
                     f"{r['train_acc_last10']:.3f} | {r['minutes']:.1f} |")
    return "\n".join(lines)


def main(bench: Bench) -> list:
    torch.set_num_threads(bench.threads)
    os.makedirs(bench.output_dir, exist_ok=True)
    results = []
    methods = []
    for m in bench.methods:
        label, flags = METHODS[m]
        if m == "swapped":  # the built post-RL teacher as pi_T_pre, the pre-RL one as pi_T_post
            flags = flags + ["--teacher-pre", ensure_testbed_teacher_pair()[1]]
        methods.append((m, label, flags))
    for seed in bench.seeds:
        for key, name, extra in methods:
            results.append(run_one(bench, key, name, extra, seed))
            with open(os.path.join(bench.output_dir, "results.jsonl"), "a") as f:  # partial results survive a kill
                f.write(json.dumps(results[-1]) + "\n")
            print(table(results), flush=True)
    text = table(results)
    with open(bench.report, "w") as f:
        f.write(f"# Direct-OPD benchmark (testbed level 3: testbed-strong student, testbed-weak pair before/after "
                f"rejection-sampling fine-tuning)\n\n`python -m benchmarks.testbed.direct_opd_benchmark "
                f"--steps {bench.steps} "
                f"--seeds {' '.join(map(str, bench.seeds))} --num-prompts {bench.num_prompts} "
                f"--group-size {bench.group_size} --learning-rate {bench.learning_rate}"
                f" --methods {' '.join(bench.methods)}`\n\n{text}\n")
    return results


if __name__ == "__main__":
    main(tyro.cli(Bench))
