"""ppo_slm.py's safety envelope under a deliberately noisy reward model, one layer switched off at a time.

SFT and the reward model are trained once and shared (passed by path). Rows: safety on with the clean RM;
safety on with Gaussian noise of `noise_sigmas` x the RM's score std added to every training score (the
paper's N(0, 2 sigma)); then the noisy RM with score whitening/clip, the ratio guard, or the rollback off.
Evaluation always uses the clean RM: its mean score and the win rate over the SFT policy on the same held-out
prompts, the exact-match verifier's win rate and greedy accuracy, and the run's worst KL, ratio and safety
events. Prints the table and writes it to benchmarks/testbed/ppo_slm_benchmark.md.

    python -m benchmarks.testbed.ppo_slm_benchmark          # testbed-weak, level 3, 60 PPO steps per row
    python -m benchmarks.testbed.ppo_slm_benchmark --steps 250 --seeds 1 2 3
"""

import os
import time
from dataclasses import dataclass

import torch
import tyro

import ppo_slm
from benchmarks import ROOT
from common.logger import read_metrics

ROWS = [  # (name, noisy RM, ppo_slm.py flags)
    ("safety on, clean RM", False, []), ("safety on, noisy RM", True, []),
    ("no score whitening/clip, noisy RM", True, ["--no-score-norm"]),
    ("no ratio guard, noisy RM", True, ["--no-ratio-guard"]),
    ("no rollback, noisy RM", True, ["--no-rollback"])]


@dataclass
class Bench:
    steps: int = 60
    """PPO steps per row"""
    seeds: tuple[int, ...] = (1,)
    """one run per row and seed (SFT and RM come from the first seed)"""
    noise_sigmas: float = 2.0
    """noise std in units of the RM's score std on the SFT policy's rollouts"""
    sft_adapter: str = ""
    """reuse this SFT adapter (e.g. runs/<default run>/sft_adapter) instead of training one"""
    reward_model: str = ""
    """reuse this reward model instead of training one"""
    threads: int = 1
    """torch CPU threads"""
    output_dir: str = "runs/ppo_slm_benchmark"
    """run folders"""
    report: str = os.path.join(ROOT, "benchmarks", "testbed", "ppo_slm_benchmark.md")
    """markdown table written at the end"""


def main(bench: Bench) -> list[dict]:
    torch.set_num_threads(bench.threads)
    t0 = time.time()
    given = (["--sft-adapter", bench.sft_adapter] if bench.sft_adapter else []) + (
        ["--reward-model", bench.reward_model] if bench.reward_model else [])
    stages = ppo_slm.main(tyro.cli(ppo_slm.Args, args=["--output-dir", bench.output_dir, "--run-name", "stages",
                                                       "--total-steps", "1", *given]))
    paths = ["--sft-adapter", stages["sft_adapter"], "--reward-model", stages["reward_model"]]
    rows, sigma = [], None
    for seed in bench.seeds:
        for name, noisy, flags in ROWS:
            if noisy and sigma is None:
                sigma = float(torch.tensor([r["rm/score_std"] for r in clean_steps]).mean())
            cli = ["--output-dir", bench.output_dir, "--run-name", f"{name.replace(' ', '_').replace(',', '')}__{seed}",
                   "--total-steps", str(bench.steps), "--seed", str(seed), *paths, *flags]
            if noisy:
                cli += ["--rm-noise-std", f"{bench.noise_sigmas * sigma:.4f}"]
            t = time.time()
            out = ppo_slm.main(tyro.cli(ppo_slm.Args, args=cli))
            steps = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
            if not noisy and seed == bench.seeds[0] and not flags:
                clean_steps = steps
            b, a = out["before"], out["after"]
            rows.append(dict(
                row=name, seed=seed, rm_acc=out["rm_accuracy"], rm_before=b["eval/rm_score"], rm_after=a["eval/rm_score"],
                win_rm=a["eval/win_rate_rm"], win_ver=a["eval/win_rate_verifier"],
                greedy=f"{b['eval/greedy_accuracy']:.3f} -> {a['eval/greedy_accuracy']:.3f}",
                max_kl=max(r["policy/kl_ref"] for r in steps), max_ratio=max(r["safety/max_ratio"] for r in steps),
                skips=sum(r["safety/ratio_guard_skips"] for r in steps), rollbacks=out["rollbacks"],
                steps=out["steps"], wall=time.time() - t))
            print(rows[-1], flush=True)
    head = ("| run | seed | RM score before -> after | win rate (RM) | win rate (verifier) | greedy accuracy | "
            "max KL to ref | max ratio | guard skips | rollbacks | steps | wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['row']} | {r['seed']} | {r['rm_before']:.3f} -> {r['rm_after']:.3f} | {r['win_rm']:.3f} | "
                     f"{r['win_ver']:.3f} | {r['greedy']} | {r['max_kl']:.2f} | {r['max_ratio']:.2f} | {r['skips']} | "
                     f"{r['rollbacks']} | {r['steps']} | {r['wall']:.0f} |")
    table = "\n".join(lines)
    print(f"\nreward model held-out pair accuracy {stages['rm_accuracy']:.3f}; noise std "
          f"{bench.noise_sigmas} x {sigma:.3f}; total {time.time() - t0:.0f} s\n\n{table}")
    with open(bench.report, "w") as f:
        f.write(f"# ppo_slm.py safety benchmark\n\n`python -m benchmarks.testbed.ppo_slm_benchmark` ({bench.steps} "
                f"PPO steps per row, seeds {list(bench.seeds)}). Reward model held-out pair accuracy "
                f"{stages['rm_accuracy']:.3f}; training-score noise std {bench.noise_sigmas} x {sigma:.3f}.\n\n{table}\n")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Bench))
