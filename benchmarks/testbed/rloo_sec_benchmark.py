"""SEC curricula side by side on the embedded multi-level testbed: label, estimated, uniform, and the
arm-signal=reward ablation, for the same steps and seeds.

For each run it prints and writes to benchmarks/testbed/rloo_sec_benchmark.md: the fraction of zero-advantage
(all-equal) groups, held-out greedy accuracy per level before and after, and where the sampler put
its mass (fraction of prompts drawn from each level, over the whole run and over its last third).

    python -m benchmarks.testbed.rloo_sec_benchmark               # 120 steps x 1 seed per config
    OMP_NUM_THREADS=1 python -m benchmarks.testbed.rloo_sec_benchmark --steps 150  # its report's run (a shared CPU)
    python -m benchmarks.testbed.rloo_sec_benchmark --steps 300 --seeds 1 2 3
"""

import argparse
import os
import time

import numpy as np
import tyro

import rloo_sec
from benchmarks import ROOT
from common.logger import read_metrics

CONFIGS = {
    "label": ["--curriculum", "label"],
    "estimated": ["--curriculum", "estimated"],
    "uniform": ["--curriculum", "uniform"],
    "label, arm-signal reward": ["--curriculum", "label", "--arm-signal", "reward"],
}
LEVELS = (1, 2, 3, 4, 5)


def run(name: str, extra: list, seed: int, steps: int, out_dir: str, common: list) -> dict:
    tag = name.replace(", ", "_").replace(" ", "-")
    args = tyro.cli(rloo_sec.Args, args=["--total-steps", str(steps), "--seed", str(seed), "--output-dir", out_dir,
                                         "--run-name", f"{tag}__{seed}__{int(time.time())}", *common, *extra])
    t0 = time.time()
    out = rloo_sec.main(args)
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    last = rows[-max(1, len(rows) // 3):]
    frac = lambda rs, lv: float(np.mean([r[f"sec/level_frac/level_{lv}"] for r in rs]))  # noqa: E731
    return {
        "minutes": (time.time() - t0) / 60,
        "zero_std": float(np.mean([r["adv/frac_zero_std"] for r in rows])),
        "zero_std_last": float(np.mean([r["adv/frac_zero_std"] for r in last])),
        "train_acc": float(np.mean([r["train/accuracy"] for r in rows])),
        "before": {lv: out["before"].get(f"eval/greedy_accuracy/level_{lv}", float("nan")) for lv in LEVELS},
        "after": {lv: out["after"].get(f"eval/greedy_accuracy/level_{lv}", float("nan")) for lv in LEVELS},
        "all_before": out["before"]["eval/greedy_accuracy"], "all_after": out["after"]["eval/greedy_accuracy"],
        "mass": {lv: frac(rows, lv) for lv in LEVELS},
        "mass_last": {lv: frac(last, lv) for lv in LEVELS},
        "arms_last": {k.split("arm_")[1]: float(np.mean([r[k] for r in last]))
                      for k in rows[-1] if k.startswith("sec/prob/arm_")},
    }


def mean_over_seeds(results: list) -> dict:
    out = {}
    for key, v in results[0].items():
        if isinstance(v, dict):
            out[key] = {k: float(np.mean([r[key][k] for r in results])) for k in v}
        else:
            out[key] = float(np.mean([r[key] for r in results]))
    return out


def table(res: dict, seeds, steps, common) -> str:
    lv = " | ".join(f"L{x}" for x in LEVELS)
    lines = ["# SEC benchmark (rloo_sec.py, embedded testbed levels 1-5)", "",
             f"{steps} steps per run, seeds {list(seeds)} (numbers are means over seeds); common flags: "
             f"`{' '.join(common) or '(defaults)'}`. Held-out greedy accuracy on 200 problems per level.", "",
             "## Held-out greedy accuracy per level (before -> after) and zero-advantage groups", "",
             f"| curriculum | {lv} | all | frac zero-std groups (whole run / last third) | train acc | minutes |",
             "|---|" + "---|" * (len(LEVELS) + 4)]
    for name, r in res.items():
        cells = " | ".join(f"{r['before'][x]:.2f} -> {r['after'][x]:.2f}" for x in LEVELS)
        lines.append(f"| {name} | {cells} | {r['all_before']:.3f} -> {r['all_after']:.3f} | "
                     f"{r['zero_std']:.3f} / {r['zero_std_last']:.3f} | {r['train_acc']:.3f} | {r['minutes']:.1f} |")
    lines += ["", "## Where the sampler put its mass: fraction of prompts per level (whole run / last third)", "",
              f"| curriculum | {lv} |", "|---|" + "---|" * len(LEVELS)]
    for name, r in res.items():
        cells = " | ".join(f"{r['mass'][x]:.2f} / {r['mass_last'][x]:.2f}" for x in LEVELS)
        lines.append(f"| {name} | {cells} |")
    lines += ["", "## Curriculum policy pi(arm), mean over the last third (label arms = levels, "
              "estimated arms = success-rate buckets, 0 hardest)", ""]
    for name, r in res.items():
        lines.append(f"- {name}: " + ", ".join(f"arm {k} {v:.2f}" for k, v in r["arms_last"].items()))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="training steps per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1], help="seeds (each config runs once per seed)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="configs to run")
    ap.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "sec_benchmark"), help="run folders")
    ap.add_argument("--report", default=os.path.join(ROOT, "benchmarks", "testbed", "rloo_sec_benchmark.md"),
                    help="markdown out")
    ap.add_argument("--common", default="--eval-every 0 --eval-samples 0",
                    help="flags passed to every run (quoted string)")
    a = ap.parse_args()
    common = a.common.split()
    res = {}
    for name in a.configs:
        res[name] = mean_over_seeds([run(name, CONFIGS[name], s, a.steps, a.output_dir, common) for s in a.seeds])
        text = table(res, a.seeds, a.steps, common)  # rewritten after every config: partial results survive
        with open(a.report, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
