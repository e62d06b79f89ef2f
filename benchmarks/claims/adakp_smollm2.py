"""AdaKP's claim on a real model (issue 40): adaptive knowledge points on SmolLM2-135M-Instruct after some RL.

The claim (adakp.py, docs/adakp.md): choosing each training prompt's knowledge points (KPs) by how much they lower
the policy's entropy on a probe, and re-choosing them as training goes, trains a policy that answers better without
hints than a subset chosen once (static) or no hints at all. It rests on two premises, both measured here first:
hints matter and their choice matters (after 30 GRPO steps on levels 1-2, helpful KPs lift held-out level 4 from
0.150 to 0.900 and distractors give 0.050, benchmarks/premises/testbed_premises_smollm2.md; on the base model they do
not), and the entropy proxy tells the two apart.

The start: the post-GRPO model of benchmarks/claims/grpo_smollm2.py's recipe, seed 1, 30 steps (`start_args`, trained
again if this checkout lacks it). On it, at level 4 of testbed-nl:
1. the premise cells: held-out greedy accuracy with no hint, the helpful KPs and the distractors (40 problems, 64
   new tokens, benchmarks/premises/testbed_premises.py's prompts);
2. the proxy: score(k | {}) of each of the 4 KPs of --proxy-problems training problems (top-50 entropy on the
   problem's worked solution as probe, adakp.py's default) against the pass-rate gain of {k} over no hint, measured
   by --proxy-samples rollouts (benchmarks/testbed/adakp_benchmark.proxy_check); Spearman correlation with the gains and
   with the helpful label, and the proxy's cost against the rollouts it replaces;
3. training: adakp.py with --kp-mode adakp (proxy-greedy, re-chosen online), static (proxy-greedy once) and none
   (plain GRPO on the same prompts), the same recipe, steps, prompts and seeds; measured on the final weights with
   the cells of 1 (no-hint accuracy is what the hints are for; with-hint accuracy says what the policy learnt to use).

    python -m benchmarks.claims.adakp_smollm2         # 6 runs of 6-20 minutes, the proxy check 20 (one thread)
    python -m benchmarks.claims.adakp_smollm2 --seeds 1 --steps 2 --num-eval-problems 4 --proxy-problems 2 \\
        --proxy-samples 2 --out /tmp/a.md --output-dir /tmp/a_runs --records /tmp/a_records   # a smoke run

Every finished run and measurement is kept as a record in benchmarks/claims/runs/adakp_smollm2/
(benchmarks/claims/claim_runs.py), so the command is rerun until its report says it is complete; an interrupted run
continues from its checkpoint. The verdict rule: shown if adakp beats both static and none on no-hint level-4 accuracy
beyond the noise on both seeds; partly if it beats them on both seeds inside the noise or on one seed beyond it; else
not shown. Before the arms, the gate (benchmarks/claims/claim_runs.py, `claim`): no knowledge point of a judged problem
may state its answer, the start's no-hint accuracy must leave room, and 40 problems must be able to show a plausible
gain; where it fails, the verdict is "untestable here".
"""

import argparse
import os
import time

import torch
import tyro

import adakp
import grpo
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (GROUND, Claim, cached, finished_run, gate, gate_section, margin,
                                          recorded_leakage, records_ground, untestable, verdict_lines)
from benchmarks.claims.grpo_smollm2 import START, start_args
from benchmarks.premises.testbed_premises import hinted_prompt, nl_accuracy
from benchmarks.testbed.adakp_benchmark import proxy_check, proxy_lines
from common.data import load_problems, render_prompt
from common.models import load_model, load_tokenizer
from grounds import path_of

MODEL, LEVEL = "smollm2-135m-instruct", 4
ARMS = ("adakp", "static", "none")
RECIPE = ["--dataset", "testbed-nl", "--levels", str(LEVEL), "--num-prompts", "4", "--group-size", "8",
          "--max-new-tokens", "48", "--micro-batch-size", "16", "--share-prompt", "--learning-rate", "2e-5",
          "--eval-samples", "0", "--log-samples", "4", "--eval-every", "0", "--save-every", "10",
          "--proxy-batch-size", "32", "--num-train-problems", "40"]
"""grpo_smollm2's recipe at level 4 (4 prompts x 8 samples, 48 new tokens, float32, full fine-tuning) on 40 training
problems: each comes back 3 times in 30 steps, so AdaKP's re-selection (every 10 steps: one pass over them), fading
and growing act; with all 500, no problem comes back within 30 steps and adakp is a static subset chosen lazily"""


def hint_cells(model_dir: str, n: int) -> dict:
    """Greedy accuracy on n held-out level-4 problems with no hint, with the helpful KPs, with the distractors."""
    t0 = time.time()
    tok, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    problems = load_problems("testbed-nl", "test", (LEVEL,), n, 0)
    return {"none": nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems]),
            "helpful": nl_accuracy(model, tok, problems, [hinted_prompt(p, tok, True) for p in problems]),
            "distractors": nl_accuracy(model, tok, problems, [hinted_prompt(p, tok, False) for p in problems]),
            "seconds": time.time() - t0}


def claim(cli, start: dict) -> Claim:
    """The claim's gate declaration: adakp above static and none on no-hint level 4 of the start's cells."""
    return Claim(split=f"held-out level 4, the cells' {cli.num_eval_problems} problems", n=cli.num_eval_problems,
                 seeds=list(cli.seeds), start={s: start["measured"]["none"] for s in cli.seeds},
                 start_is="no-hint greedy accuracy of the start (every arm's)", effect=0.10,
                 effect_is="plausible: KnowRL's no-hint gain over its base, +9.6 points (ALGORITHMS.md 4.2; AdaKP's own "
                           "paper not found)",
                 contexts_are="the knowledge points of every judged problem, helpful and distractors")


def knowledge_points(n: int) -> list:
    """(knowledge point, gold answer) for every KP of the judged problems (hint_cells')."""
    return [(h, p.answer) for p in load_problems("testbed-nl", "test", (LEVEL,), n, 0) for h in p.hints]


def kp_means(rows: list) -> dict:
    """Means over the training steps of the KPs shown (|S|), the helpful share of them, the all-fail groups and the
    proxy's forwards (summed)."""
    steps = [r for r in rows if "kp/mean_size" in r]
    mean = lambda k: sum(r[k] for r in steps) / max(len(steps), 1)  # noqa: E731
    return {"size": mean("kp/mean_size"), "helpful": mean("kp/helpful_frac"),
            "zero_correct": mean("kp/zero_correct_frac"), "proxy_passes": sum(r["kp/proxy_passes"] for r in steps)}


def verdict(after: dict, seeds: list, n: int) -> tuple[str, list[str]]:
    """The issue's rule on no-hint accuracy after training: {(arm, seed): accuracy}."""
    beyond, ahead, notes = [], [], []
    for s in seeds:
        a = after[("adakp", s)]
        for other in ("static", "none"):
            b = after[(other, s)]
            m = margin(a, b, n)
            ahead.append(a > b)
            beyond.append(a - b > m)
            notes.append(f"seed {s}: adakp {a:.3f} against {other} {b:.3f} ({a - b:+.3f}, noise +-{m:.3f})")
    if all(beyond):
        return "shown", notes
    seeds_beyond = [all(beyond[2 * i : 2 * i + 2]) for i in range(len(seeds))]
    if all(ahead) or any(seeds_beyond):
        return "partly shown", notes
    return "not shown", notes


def report(cli, start: dict, proxy: dict, runs: dict, section: list, failed: list) -> str:
    seeds_done = [s for s in cli.seeds if all((a, s) in runs for a in ARMS)]  # the verdict's arms
    n = cli.num_eval_problems
    sc = start["measured"]
    evals = [r for r in start["rows"] if "eval/greedy_accuracy" in r]
    lv = {k: f"{evals[0][f'eval/greedy_accuracy/level_{k}']:.3f} -> {evals[-1][f'eval/greedy_accuracy/level_{k}']:.3f}"
          for k in (1, 2)}
    lines = ["# AdaKP on SmolLM2-135M-Instruct (issue 40)", "",
             f"`python -m benchmarks.claims.adakp_smollm2 --seeds {' '.join(map(str, cli.seeds))} --steps {cli.steps} "
             f"--num-eval-problems {n} --proxy-problems {cli.proxy_problems} --proxy-samples {cli.proxy_samples}`, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s). "
             f"Greedy accuracy on {n} held-out level-{LEVEL} problems of testbed-nl, up to 64 new tokens (a cut "
             f"answer scores 0); noise of a difference of two such cells: up to +-{margin(0.5, 0.5, n):.2f} (95 %, "
             "at 0.5).", "", *section,
             f"The start (all arms): benchmarks/claims/grpo_smollm2.py's recipe, seed 1, {cli.steps} steps on levels "
             f"1-2 (held-out greedy level 1 {lv[1]}, level 2 {lv[2]}; {start['seconds'] / 60:.0f} minutes).", "",
             "## The premise on the start", "",
             "| level 4 | no hint | helpful KPs | distractors |", "|---|---|---|---|",
             f"| start | {sc['none']:.3f} | {sc['helpful']:.3f} | {sc['distractors']:.3f} |", "",
             "## The proxy on the start", "",
             *proxy_lines(proxy, LEVEL, cli.proxy_samples, "the worked solution, its first 96 tokens"), ""]
    lines += ["## Training", "",
              f"`python adakp.py --model-name {START}/grpo_seed1/checkpoint {' '.join(RECIPE)} --total-steps "
              f"{cli.steps} --num-eval-problems {n} --seed S --kp-mode ARM`. Trained on level-{LEVEL} prompts "
              "carrying the arm's KPs, evaluated without them (the trainer's own held-out evaluation, 48 new tokens: "
              "'no hint (trainer)': 40 held-out problems of its own, not the cells' 40), and with the cells above on the "
              "final weights. KPs shown: mean KPs a training prompt carried; all-fail: training groups whose 8 "
              "rollouts all fail; proxy forwards: during the steps (static chooses once before training, in "
              "forwards the trainer prints and does not log).", "",
              "| arm | seed | no hint (trainer) before -> after | no hint | helpful KPs | distractors | KPs shown | "
              "helpful share | all-fail groups | proxy forwards | minutes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    after = {}
    for (arm, seed), rec in runs.items():
        ev = [r for r in rec["rows"] if "eval/greedy_accuracy" in r]
        c, k = rec["measured"]["cells"], kp_means(rec["rows"])
        after[(arm, seed)] = c["none"]
        lines.append(f"| {arm} | {seed} | {ev[0]['eval/greedy_accuracy']:.3f} -> {ev[-1]['eval/greedy_accuracy']:.3f} "
                     f"| {c['none']:.3f} | {c['helpful']:.3f} | {c['distractors']:.3f} | {k['size']:.2f} | "
                     f"{k['helpful']:.2f} | {k['zero_correct']:.3f} | {k['proxy_passes']:.0f} | "
                     f"{rec['seconds'] / 60:.0f} |")
    def judge(done):
        status, notes = verdict(after, done, n)
        return (f"{untestable(failed)} (the rule alone: {status})" if failed else status), notes

    lines += verdict_lines(seeds_done, cli.seeds, judge,
                           "The rule (issue 40): adakp beats both static and none on no-hint level-4 accuracy beyond "
                           "the noise on both seeds: shown; ahead of both on every seed inside the noise, or beyond it "
                           "on one seed: partly; else not shown.")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30, help="training steps of every arm (and of the start)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out level-4 problems a cell")
    p.add_argument("--proxy-problems", type=int, default=40, help="training problems of the proxy check")
    p.add_argument("--proxy-samples", type=int, default=8, help="rollouts a (problem, KP) context in the proxy check")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "adakp_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join("runs", "adakp_smollm2"), help="run folders")
    p.add_argument("--start-dir", default=START, help="the start's run folder (shared with the other claims)")
    p.add_argument("--records", default=os.path.join(ROOT, "benchmarks", "claims", "runs", "adakp_smollm2"))
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # the start's path is relative, so records made in one clone are read back in another
    n = cli.num_eval_problems
    start = finished_run(grpo, start_args(cli.steps, cli.start_dir), cli.records, weights=not cli.report_only,
                         make=not cli.report_only,
                         measure=lambda d: hint_cells(os.path.join(d, "checkpoint"), n))
    tokenizer = load_tokenizer(path_of(MODEL))
    leaks = recorded_leakage(os.path.join(cli.records, "gate_leakage.json"), {"n": n}, lambda: knowledge_points(n),
                             tokenizer, records_ground(cli.records) if cli.report_only else GROUND)
    lines, failed = gate(claim(cli, start), leaks)
    section = gate_section([(lines, failed)])
    print("\n".join(section))
    weights = os.path.join(cli.start_dir, "grpo_seed1", "checkpoint")
    proxy = cached(os.path.join(cli.records, "proxy.json"),
                   {"problems": cli.proxy_problems, "samples": cli.proxy_samples, "start_steps": cli.steps},
                   lambda: proxy_check(weights, "testbed-nl", LEVEL, cli.proxy_problems, cli.proxy_samples, 48, 32),
                   make=not cli.report_only)
    runs = {}
    for seed in cli.seeds:
        for arm in cli.arms:
            args = tyro.cli(adakp.Args, args=["--model-name", weights, *RECIPE, "--total-steps", str(cli.steps),
                                              "--num-eval-problems", str(n), "--seed", str(seed), "--kp-mode", arm,
                                              "--output-dir", cli.output_dir, "--run-name", f"{arm}_seed{seed}"])
            if cli.report_only and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                continue
            runs[(arm, seed)] = finished_run(adakp, args, cli.records, lambda d: {
                "cells": hint_cells(os.path.join(d, "checkpoint"), n), "n": n}, make=not cli.report_only)
            with open(cli.out, "w") as f:
                f.write(report(cli, start, proxy, runs, section, failed))
    text = report(cli, start, proxy, runs, section, failed)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
