"""GRPO's advantage normalisation side by side on the embedded testbed (same steps, seeds, data).

    python -m benchmarks.testbed.grpo_ablation         # 150 steps per variant, seed 1
    python -m benchmarks.testbed.grpo_ablation --steps 300 --seeds 1 2 3

Prints held-out greedy accuracy before/after and the mean zero-std group fraction for
group_std (GRPO), group_mean (Dr. GRPO) and batch_std, and writes benchmarks/testbed/grpo_ablation.md.
"""

import argparse
import os
import time

import tyro

import grpo
from common.logger import read_metrics

VARIANTS = {"group_std (GRPO)": ["--adv-norm", "group_std"], "group_mean (Dr. GRPO)": ["--adv-norm", "group_mean"],
            "batch_std": ["--adv-norm", "batch_std"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_ablation.md"))
    cli = p.parse_args()
    rows = []
    for seed in cli.seeds:
        for name, flags in VARIANTS.items():
            t0 = time.time()
            args = tyro.cli(grpo.Args, args=["--total-steps", str(cli.steps), "--seed", str(seed), "--eval-every", "0",
                                             "--eval-samples", "0", "--run-name", f"ablation_{flags[1]}_{seed}",
                                             "--output-dir", "runs/benchmarks", *flags])
            out = grpo.main(args)
            steps = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
            rows.append((name, seed, out["before"]["eval/greedy_accuracy"], out["after"]["eval/greedy_accuracy"],
                         sum(r["adv/frac_zero_std"] for r in steps) / len(steps), time.time() - t0))
    lines = [f"# GRPO advantage normalisation, testbed level 3, {cli.steps} steps of 16x8, lr 5e-5", "",
             "| variant | seed | greedy before | greedy after | mean frac_zero_std | wall s |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {s} | {b:.3f} | {a:.3f} | {z:.3f} | {w:.0f} |" for n, s, b, a, z, w in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
