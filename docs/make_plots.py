"""Run the trainers' embedded demos and draw the curves shown in docs/<script>.md.

Each run is the trainer's own command line, run as a program from the repository root, one at a time, writing
runs/docs/<name>__<seed>/ (args.json, metrics.jsonl, the trainer's console output in train.log). A run that
finished before (its done.json exists) is not run again unless --rerun is given, so a second call only redraws.
The plot of each demo is the mean over its seeds of every metric, with the band from the lowest to the highest
seed (training metrics are first smoothed with a moving average), written to docs/img/<name>.png.

    nice -n 15 python docs/make_plots.py                           # every demo, its default seeds, then every plot
    nice -n 15 python docs/make_plots.py --only grpo --seeds 1 2 3 # one demo, chosen seeds
    python docs/make_plots.py --plot-only                          # redraw from the runs that exist
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (script, extra flags, default seeds, panels). Every demo runs with its defaults, as `python <script>` does
# (about 1-5 minutes a seed on a 2-core CPU). A panel is (title, [(metric, label)], smoothing window):
# window 0 for evaluation metrics (logged every --eval-every steps), > 0 for per-step training metrics.
DEMOS = {
    "grpo": ("grpo.py", [], [1, 2, 3], [
        ("held-out accuracy, level 3 (200 problems)",
         [("eval/greedy_accuracy", "greedy"), ("eval/sampled_accuracy", "sampled, T=1"),
          ("eval/pass_at_k", "pass@4")], 0),
        ("training rollouts", [("reward/mean", "reward (= accuracy)"), ("adv/frac_zero_std", "zero-std groups")], 20)]),
    "rloo_sec": ("rloo_sec.py", [], [1, 2, 3], [
        ("held-out greedy accuracy, levels 1-5",
         [("eval/greedy_accuracy", "all levels")] + [(f"eval/greedy_accuracy/level_{k}", f"level {k}")
                                                     for k in (1, 2, 3, 4, 5)], 0),
        ("SEC: probability of each arm", [(f"sec/prob/arm_{k}", f"level {k}") for k in (1, 2, 3, 4, 5)], 10)]),
    "oc_grpo": ("oc_grpo.py", [], [1, 2, 3], [
        ("held-out accuracy, level 5", [("eval/greedy_accuracy", "greedy"), ("eval/pass_at_k", "pass@4")], 0),
        ("guidance", [("guide/frac_rescued", "rescued / all-fail groups"), ("is/weight_mean", "mean IS weight"),
                      ("train/accuracy", "unguided train accuracy")], 20)]),
    "direct_opd": ("direct_opd.py", [], [1, 2, 3], [
        ("student held-out accuracy, level 3", [("eval/greedy_accuracy", "greedy"),
                                                ("eval/sampled_accuracy", "sampled, T=1")], 0),
        ("dense reward and KL coefficient", [("delta_opd/weighted_reward_mean", "mean A_t(v)"),
                                             ("kl/coef", "KL coefficient / 10")], 10)]),
    "ppo_slm": ("ppo_slm.py", [], [1, 2, 3], [
        ("held-out (PPO policy)", [("eval/rm_score", "reward-model score"),
                                   ("eval/greedy_accuracy", "greedy accuracy (verifier)")], 0),
        ("training rollouts", [("rm/score_mean", "raw RM score"), ("train/accuracy", "verifier accuracy")], 10)]),
    "adakp": ("adakp.py", [], [1, 2, 3], [
        ("held-out accuracy, level 4, plain prompt", [("eval/greedy_accuracy", "greedy"),
                                                     ("eval/pass_at_k", "pass@4")], 0),
        ("knowledge points", [("kp/mean_size", "mean |S| shown"), ("train/accuracy", "hinted train accuracy"),
                              ("kp/zero_correct_frac", "all-wrong groups")], 20)]),
    "mada_rl": ("mada_rl.py", [], [1, 2, 3], [
        ("held-out accuracy (before, after stage 1, end)",
         [("mada/eval/single_accuracy", "single generator (mean)"), ("mada/eval/majority_accuracy", "generators' vote"),
          ("mada/eval/debate_accuracy", "debate (mean over critics)")], 0),
        ("training rollouts of the active agent", [("train/accuracy", "accuracy"), ("mada/len_reward", "R_len")], 10)]),
    "rlpf": ("rlpf.py", [], [1, 2, 3], [
        ("held-out programs (sampled)", [("eval/pass_rate", "pass rate"),
                                         ("eval/fast_frac", "share of correct ones >= 2x faster"),
                                         ("eval/cgre", "CGRE")], 0),
        ("training rollouts", [("reward/mean", "staged reward"), ("train/accuracy", "correct")], 5)]),
}
SCALE = {"kl/coef": 0.1}

# Benchmark comparisons, drawn from the run folders a benchmark script leaves (make_plots.py does not run them):
# name: (the command that makes the runs, run folder pattern, {variant: label}, seeds, panels as above, one metric each)
COMPARISONS = {
    "rlpf_rewards": ("python -m benchmarks.testbed.rlpf_benchmark --steps 20", "runs/benchmarks/rlpf_{variant}_{seed}",
                     {"staged": "staged (RLPF)", "correctness": "correctness only (RLVR)",
                      "speed_ungated": "speed, ungated"}, [1, 2], [
        ("training programs: pass rate", "train/pass_rate", 5),
        ("training programs: share of correct ones >= 2x faster than the baseline", "train/fast_frac", 5)]),
    "adakp_arms": ("python -m benchmarks.testbed.adakp_benchmark --output-dir runs/adakp_benchmark (60 steps of 8 x 8, "
                   "level 4)",
                   "runs/adakp_benchmark/{variant}__{seed}__*",
                   {"adakp": "adakp", "static": "static", "random": "random", "all": "all KPs", "none": "no KPs"},
                   [1, 2], [
        ("training rollouts: accuracy (on the prompt trained on)", "train/accuracy", 5),
        ("groups whose G rollouts all fail", "kp/zero_correct_frac", 5)]),
}
  # drawn scaled so that it shares an axis with the metric beside it


def run_dir(name: str, seed: int) -> str:
    return os.path.join(ROOT, "runs", "docs", f"{name}__{seed}")


def run_demo(name: str, seed: int, rerun: bool) -> None:
    script, extra, _, _ = DEMOS[name]
    out = run_dir(name, seed)
    if os.path.exists(os.path.join(out, "done.json")) and not rerun:
        print(f"{name} seed {seed}: done before, kept ({out})")
        return
    cmd = [sys.executable, script, "--seed", str(seed), "--output-dir", os.path.join("runs", "docs"),
           "--run-name", f"{name}__{seed}", *extra]
    if os.path.exists(os.path.join(out, "metrics.jsonl")):  # a fresh run, not appended to an old one
        os.remove(os.path.join(out, "metrics.jsonl"))
    os.makedirs(out, exist_ok=True)
    print(f"{name} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if rc != 0:
        print(f"error: {name} seed {seed} exited with {rc} after {wall:.0f} s; see {out}/train.log")
        return
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"command": "python " + " ".join(cmd[1:]), "wall_s": round(wall, 1)}, f, indent=2)
    print(f"{name} seed {seed}: finished in {wall:.0f} s")


def read_metric(path: str, key: str) -> dict:
    """step -> value of `key` (the last row of a step wins: the final evaluation shares the last step)."""
    out = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            v = row.get(key)
            if isinstance(v, (int, float)) and np.isfinite(v):
                out[row["step"]] = float(v) * SCALE.get(key, 1.0)
    return out


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over `window` points (fewer at the start)."""
    if window <= 1:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def plot(name: str, seeds: list[int]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(run_dir(name, s), "metrics.jsonl") for s in seeds
             if os.path.exists(os.path.join(run_dir(name, s), "done.json"))]
    if not paths:
        print(f"{name}: no finished run to plot")
        return None
    panels = DEMOS[name][3]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.2))
    for ax, (title, metrics, window) in zip(np.atleast_1d(axes), panels):
        for metric, label in metrics:
            curves = [read_metric(p, metric) for p in paths]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            y_SN = np.array([smooth(np.array([c[s] for s in steps]), window) for c in curves])
            mean = y_SN.mean(0)
            line, = ax.plot(steps, mean, marker="o" if window == 0 else None, ms=3, lw=1.5, label=label)
            if len(paths) > 1:
                ax.fill_between(steps, y_SN.min(0), y_SN.max(0), color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(title + (f" (moving average, {window} steps)" if window > 1 else ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    used = [s for s in seeds if os.path.exists(os.path.join(run_dir(name, s), "done.json"))]
    band = ", band: min-max over seeds" if len(used) > 1 else ""
    cmd = " ".join(["python", DEMOS[name][0], *DEMOS[name][1], "--seed", "S"])
    fig.suptitle(f"{cmd}, S = {' '.join(map(str, used))} (mean{band})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
    out = os.path.join(ROOT, "docs", "img", f"{name}.png")
    fig.savefig(out, dpi=72)
    plt.close(fig)
    print(f"{name}: wrote {os.path.relpath(out, ROOT)} from seeds {used}")
    return out


def plot_comparison(name: str) -> str | None:
    """One line per variant (mean over seeds, band min-max), one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    command, pattern, variants, seeds, panels = COMPARISONS[name]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.2))
    found = 0
    for ax, (title, metric, window) in zip(np.atleast_1d(axes), panels):
        for variant, label in variants.items():
            paths = [sorted(glob.glob(os.path.join(ROOT, pattern.format(variant=variant, seed=s), "metrics.jsonl")))
                     for s in seeds]
            paths = [p[-1] for p in paths if p]  # the latest run of each seed
            if not paths:
                continue
            found += 1
            curves = [read_metric(p, metric) for p in paths]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            y_SN = np.array([smooth(np.array([c[s] for s in steps]), window) for c in curves])
            line, = ax.plot(steps, y_SN.mean(0), lw=1.5, label=f"{label} ({len(paths)} seeds)")
            if len(paths) > 1:
                ax.fill_between(steps, y_SN.min(0), y_SN.max(0), color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not found:
        plt.close(fig)
        print(f"{name}: no runs of `{command}` under {os.path.dirname(pattern)}")
        return None
    fig.suptitle(f"{command}, seeds {' '.join(map(str, seeds))} (mean, band: min-max over seeds; smoothed over "
                 f"{panels[0][2]} steps)", fontsize=9)
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "img", f"{name}.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    print(f"{name}: wrote {os.path.relpath(out, ROOT)}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(DEMOS), default=list(DEMOS), help="demos to run and plot")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default: each demo's own list)")
    p.add_argument("--rerun", action="store_true", help="run again even when a finished run exists")
    p.add_argument("--plot-only", action="store_true", help="only redraw from the runs that exist")
    a = p.parse_args()
    for name in a.only:
        seeds = a.seeds or DEMOS[name][2]
        if not a.plot_only:
            for seed in seeds:
                run_demo(name, seed, a.rerun)
        plot(name, seeds)
    for name in COMPARISONS:
        plot_comparison(name)


if __name__ == "__main__":
    main()
