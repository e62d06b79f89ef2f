"""Vanilla GRPO vs OC-GRPO vs OC-GRPO without the context-shift correction, on the hardest testbed level, with a
compute-matched GRPO control.

Same problems, steps, seeds and optimiser for all; each row is one run. The cascade draws G more rollouts for each
prefix fraction it tries on an all-fail group, so OC-GRPO samples several times GRPO's rollouts; the control is GRPO
with its group size raised to the rollouts per prompt the OC-GRPO run of the same seed drew (rounded), so that any
gain that is only more sampling shows there too. Prints (and writes to
benchmarks/testbed/oc_grpo_benchmark.md) unguided held-out accuracy before/after, the fraction of groups
with a learning signal, and the fraction of all-fail groups the cascade rescued.

    python -m benchmarks.testbed.oc_grpo_benchmark             # level 5, 30 steps of 8 x 8, seed 1: ~3 minutes
    python -m benchmarks.testbed.oc_grpo_benchmark --steps 100 --seeds 1 2 3
"""

import json
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import grpo
import oc_grpo
from benchmarks import ROOT
from common.logger import read_metrics

METHODS = [("GRPO", grpo, []), ("OC-GRPO", oc_grpo, []),
           ("OC-GRPO, correction none", oc_grpo, ["--correction", "none"])]


@dataclass
class Bench:
    level: int = 5
    """testbed level (5: testbed-weak scores 0.00 greedy there)"""
    steps: int = 30
    """training steps per run"""
    seeds: tuple[int, ...] = (1,)
    """one run per method and seed"""
    num_prompts: int = 8
    """prompts per step"""
    group_size: int = 8
    """completions per prompt"""
    learning_rate: float = 1e-4
    """AdamW learning rate of every run"""
    num_eval_problems: int = 100
    """held-out problems per evaluation"""
    eval_samples: int = 4
    """samples per held-out problem for sampled accuracy (greedy is always measured)"""
    matched_control: bool = True
    """after each OC-GRPO run, run GRPO with the group size that draws as many rollouts per prompt"""
    threads: int = 1
    """torch CPU threads (the 1M-parameter testbed model gains nothing from more on a shared CPU)"""
    output_dir: str = "runs/oc_grpo_benchmark"
    """run folders"""
    report: str = os.path.join(ROOT, "benchmarks", "testbed", "oc_grpo_benchmark.md")
    """markdown table written at the end"""


def run_one(bench: Bench, name: str, module, extra: list, seed: int) -> dict:
    cli = ["--levels", str(bench.level), "--total-steps", str(bench.steps), "--seed", str(seed),
           "--num-prompts", str(bench.num_prompts), "--group-size", str(bench.group_size),
           "--learning-rate", str(bench.learning_rate), "--num-eval-problems", str(bench.num_eval_problems),
           "--eval-samples", str(bench.eval_samples), "--eval-every", "0", "--output-dir", bench.output_dir,
           "--run-name", re.sub(r"\W+", "", name) + f"__{seed}__{int(time.time())}", *extra]
    t0 = time.time()
    args = tyro.cli(module.Args, args=cli)
    out = module.main(args)
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    zero = sum(r.get("guide/zero_reward_groups", 0.0) for r in rows)
    return {
        "method": name, "seed": seed, "minutes": (time.time() - t0) / 60,
        "greedy_before": out["before"]["eval/greedy_accuracy"], "greedy_after": out["after"]["eval/greedy_accuracy"],
        "sampled_before": out["before"].get("eval/sampled_accuracy", float("nan")),
        "sampled_after": out["after"].get("eval/sampled_accuracy", float("nan")),
        "signal_groups": float(np.mean([1 - r["adv/frac_zero_std"] for r in rows])),
        "rescued": sum(r.get("guide/rescued_groups", 0.0) for r in rows) / zero if zero else float("nan"),
        "train_acc_first10": float(np.mean([r["train/accuracy"] for r in rows[:10]])),
        "train_acc_last10": float(np.mean([r["train/accuracy"] for r in rows[-10:]])),
        "is_weight_mean": float(np.mean([r["is/weight_mean"] for r in rows if r.get("guide/guided_groups")]
                                        or [np.nan])),
        "rollouts_per_prompt": float(np.mean([sampled_rollouts(r, args.group_size, args.num_prompts)
                                                for r in rows])) / args.num_prompts,
        "run_dir": out["run_dir"],
    }


def sampled_rollouts(row: dict, group_size: int, num_prompts: int) -> float:
    """Rollouts one step drew: P x G, plus G for each prefix fraction the cascade tried on each all-fail group (a
    group rescued at the i-th fraction cost i tries; one never rescued tried them all)."""
    fracs = sorted(float(k[len("guide/groups_at_f"):]) for k in row if k.startswith("guide/groups_at_f"))
    tries = sum((i + 1) * row[f"guide/groups_at_f{f:g}"] for i, f in enumerate(fracs))
    tries += len(fracs) * (row.get("guide/zero_reward_groups", 0.0) - row.get("guide/rescued_groups", 0.0))
    return group_size * (num_prompts + tries)


def table(results: list) -> str:
    head = ("| method | seed | greedy acc before -> after | sampled acc before -> after | groups with signal "
            "| all-fail groups rescued | unguided train acc (first 10 -> last 10 steps) | IS weight mean "
            "| rollouts per prompt | minutes |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        f = lambda x: "n/a" if x != x else f"{x:.3f}"  # noqa: E731 - nan -> n/a
        lines.append(f"| {r['method']} | {r['seed']} | {r['greedy_before']:.3f} -> {r['greedy_after']:.3f} | "
                     f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f} | {r['signal_groups']:.3f} | "
                     f"{f(r['rescued'])} | {r['train_acc_first10']:.3f} -> {r['train_acc_last10']:.3f} | "
                     f"{f(r['is_weight_mean'])} | {r['rollouts_per_prompt']:.1f} | {r['minutes']:.1f} |")
    return "\n".join(lines)


def main(bench: Bench) -> list:
    torch.set_num_threads(bench.threads)
    os.makedirs(bench.output_dir, exist_ok=True)
    results = []
    for seed in bench.seeds:
        runs = list(METHODS)
        while runs:
            name, module, extra = runs.pop(0)
            results.append(run_one(bench, name, module, extra, seed))
            with open(os.path.join(bench.output_dir, "results.jsonl"), "a") as f:  # partial results survive a kill
                f.write(json.dumps(results[-1]) + "\n")
            print(table(results), flush=True)
            if name == "OC-GRPO" and bench.matched_control:
                g = max(bench.group_size, round(results[-1]["rollouts_per_prompt"]))
                runs.append((f"GRPO, compute-matched (G = {g})", grpo, ["--group-size", str(g)]))
    text = table(results)
    with open(bench.report, "w") as f:
        f.write(f"# OC-GRPO benchmark (testbed level {bench.level})\n\n"
                f"`python -m benchmarks.testbed.oc_grpo_benchmark --level {bench.level} --steps {bench.steps} "
                f"--seeds {' '.join(map(str, bench.seeds))} --num-prompts {bench.num_prompts} "
                f"--group-size {bench.group_size} --learning-rate {bench.learning_rate}`\n\n{text}\n")
    return results


if __name__ == "__main__":
    main(tyro.cli(Bench))
