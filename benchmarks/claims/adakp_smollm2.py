"""AdaKP's claim on a real model (issues 40, 60): adaptive knowledge points on SmolLM2-135M-Instruct after some RL.

The claim (adakp.py, docs/adakp.md): choosing each training prompt's knowledge points (KPs) by how much they lower
the policy's entropy on a probe, and re-choosing them as training goes, trains a policy that answers better without
hints than a subset chosen once (static) or no hints at all. It rests on two premises, measured here before any arm
trains: the helpful KPs lift the policy's no-hint accuracy (distractors do not), and the entropy proxy tells the two
apart. testbed-nl's KPs state no answer from its version 2 on (common/testbed_nl.py VERSION): the operation's rule or
a partial sum; a run on version 1's KPs, which held the final equation, measured copying.

The start: the post-GRPO model of benchmarks/claims/grpo_smollm2.py's recipe, seed 1, --start-steps steps
(`start_args`, trained again if this checkout lacks it). At level 4 of testbed-nl:
1. the premise cells: held-out greedy accuracy with no hint, the helpful KPs and the distractors (40 problems, 64
   new tokens, benchmarks/premises/testbed_premises.py's prompts), on the start and on the base model;
2. the proxy: score(k | {}) of each of the 4 KPs of --proxy-problems training problems (top-50 entropy on adakp.py's
   default probe, the problem's worked solution) against the pass-rate gain of {k} over no hint, measured by
   --proxy-samples rollouts (benchmarks/testbed/adakp_benchmark.proxy_check); Spearman correlation with the gains and
   with the helpful label, and the proxy's cost against the rollouts it replaces; measured whatever the gate says;
3. only where the gate passes, training: adakp.py with --kp-mode adakp (proxy-greedy, re-chosen online), static
   (proxy-greedy once) and none (plain GRPO on the same prompts), the same recipe, steps, prompts and seeds; measured
   on the final weights with the cells of 1 (no-hint accuracy is what the hints are for; with-hint accuracy says
   what the policy learnt to use).

    python -m benchmarks.claims.adakp_smollm2         # the cells and the proxy check, ~25 minutes (one thread); the
                                                      # arms, where the gate passes: 6 runs of 6-20 minutes
    python -m benchmarks.claims.adakp_smollm2 --seeds 1 --steps 2 --num-eval-problems 4 --proxy-problems 2 \\
        --proxy-samples 2 --out /tmp/a.md --output-dir /tmp/a_runs --records /tmp/a_records   # a smoke run

The smoke run reads the 30-step start from runs/smollm2_start (--start-dir; trained there, ~16 minutes, where it is
missing). Every finished run and measurement is kept as a record in benchmarks/claims/runs/adakp_smollm2/
(benchmarks/claims/claim_runs.py, keyed by the testbed-nl version), so the command is rerun until its report says it
is complete; an interrupted run continues from its checkpoint.

The gate (benchmarks/claims/claim_runs.py `gate`, then `premise` and `probe_line` here), at the top of the report:
no KP of a judged problem may state its answer; the start's no-hint accuracy must leave room; 40 problems on 2 seeds
must be able to show a plausible gain; and the premise: helpful KPs minus no hint on the start beyond the noise rule's
margin (claim_runs.margin at the cells' distinct problems). A probe line counts the probes (adakp.py's default, the
worked solution) that state the answer: reported, not gated, as the probe is the proxy's teacher-forced target and
never part of a prompt the policy answers. Where the gate fails no arm trains and the verdict is "untestable here:
<gate, figures>". Where it passes: shown if adakp beats both static and none on no-hint level-4 accuracy beyond the
noise on both seeds; partly if it beats them on both seeds inside the noise or on one seed beyond it; else not shown.
"""

import argparse
import os
import time

import torch
import tyro

import adakp
import grpo
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (GROUND, Claim, cached, finished_run, gate, gate_section, leakage, margin,
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
    """Greedy accuracy on n held-out level-4 problems with no hint, with the helpful KPs, with the distractors, and
    how many distinct problems they are (the noise rule's n)."""
    t0 = time.time()
    tok, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    problems = load_problems("testbed-nl", "test", (LEVEL,), n, 0)
    return {"none": nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems]),
            "helpful": nl_accuracy(model, tok, problems, [hinted_prompt(p, tok, True) for p in problems]),
            "distractors": nl_accuracy(model, tok, problems, [hinted_prompt(p, tok, False) for p in problems]),
            "distinct": len({p.question for p in problems}), "seconds": time.time() - t0}


def premise(cells: dict, n: int) -> tuple[str, list[str]]:
    """The gate's premise line and its failure ([] when it passes): the helpful KPs must lift the start's no-hint
    accuracy by more than the noise rule's margin at the cells' n distinct problems (a fall fails, as does a lift
    inside the noise).

    >>> premise({"none": 0.150, "helpful": 0.100}, 40)[1]
    ['premise, helpful KPs 0.100 - no hint 0.150 = -0.050, not above the noise +-0.145']
    >>> premise({"none": 0.150, "helpful": 0.500}, 40)[1]
    []
    """
    lift, m = cells["helpful"] - cells["none"], margin(cells["helpful"], cells["none"], n)
    line = (f"- premise: greedy accuracy of the start with the helpful KPs {cells['helpful']:.3f} against no hint "
            f"{cells['none']:.3f} ({lift:+.3f}), on the cells' {n} distinct problems, to exceed the noise +-{m:.3f} "
            f"(claim_runs.margin): {'pass' if lift > m else '**fail**'}")
    return line, [] if lift > m else [f"premise, helpful KPs {cells['helpful']:.3f} - no hint {cells['none']:.3f} = "
                                      f"{lift:+.3f}, not above the noise +-{m:.3f}"]


def probes(n: int, proxy_problems: int, tokenizer) -> dict:
    """adakp.py's default probe (--probe reference, --probe-len 96: the first 96 tokens of the worked solution) of the
    judged problems and of the proxy check's training problems, checked for the gold answer (claim_runs.leakage),
    with the probes' longest length in tokens."""
    out = {}
    for name, split, k in (("judged", "test", n), ("proxy", "train", proxy_problems)):
        problems = load_problems("testbed-nl", split, (LEVEL,), k, 0)
        z = [adakp.probe_tokens(p, tokenizer, adakp.Args.probe_len) for p in problems]
        out[name] = leakage([(tokenizer.decode(t), p.answer) for t, p in zip(z, problems)], tokenizer)
        out[name]["longest"] = max(map(len, z), default=0)
    return out


def probe_line(probe: dict) -> str:
    """The gate's probe line: how many probes state the answer; reported, not gated (`probes`' dict)."""
    j, x = probe["judged"], probe["proxy"]
    return (f"- probe: {j['leaks']} of {j['contexts']} judged problems' and {x['leaks']} of {x['contexts']} proxy "
            f"problems' probes state the gold answer (adakp.py's default probe, the worked solution's first "
            f"{adakp.Args.probe_len} tokens: the whole solution here, at most "
            f"{max(j['longest'], x['longest'])} tokens, which ends with the answer). adakp.py has no way to cut the "
            "probe before the final result (--probe-len cuts at a fixed token count; --probe rollout uses a correct "
            "rollout, which states it too); none is used. Reported, not gated: the probe is the proxy's "
            "teacher-forced target, never part of a prompt the policy answers")


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


def premise_table(rows: list[tuple[str, dict]], n: int) -> list[str]:
    """The premise cells of each model, with the helpful KPs' lift and its noise: [(model, hint_cells' dict)]."""
    lines = ["| level 4 | no hint | helpful KPs | distractors | helpful - no hint (noise) |", "|---|---|---|---|---|"]
    for name, c in rows:
        k = c.get("distinct", n)
        lines.append(f"| {name} | {c['none']:.3f} | {c['helpful']:.3f} | {c['distractors']:.3f} | "
                     f"{c['helpful'] - c['none']:+.3f} (+-{margin(c['helpful'], c['none'], k):.3f}) |")
    return lines


def report(cli, start: dict, base: dict, leaks: dict, proxy: dict, runs: dict, section: list, failed: list) -> str:
    seeds_done = [s for s in cli.seeds if all((a, s) in runs for a in ARMS)]  # the verdict's arms
    n = cli.num_eval_problems
    evals = [r for r in start["rows"] if "eval/greedy_accuracy" in r]
    lv = {k: f"{evals[0][f'eval/greedy_accuracy/level_{k}']:.3f} -> {evals[-1][f'eval/greedy_accuracy/level_{k}']:.3f}"
          for k in (1, 2)}
    lines = ["# AdaKP on SmolLM2-135M-Instruct (issues 40, 60)", "",
             f"`python -m benchmarks.claims.adakp_smollm2 --seeds {' '.join(map(str, cli.seeds))} --steps {cli.steps} "
             f"--start-steps {cli.start_steps} --num-eval-problems {n} --proxy-problems {cli.proxy_problems} "
             f"--proxy-samples {cli.proxy_samples}`, {time.strftime('%Y-%m-%d')}, testbed-nl version {GROUND}, "
             f"{os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s). Greedy accuracy on {n} "
             f"held-out level-{LEVEL} problems of testbed-nl, up to 64 new tokens (a cut answer scores 0); noise of a "
             f"difference of two such cells: up to +-{margin(0.5, 0.5, n):.2f} (95 %, at 0.5).", "", *section,
             "## The premise", "",
             *premise_table([(MODEL, base), (f"the start, {cli.start_dir}/grpo_seed1", start["measured"])], n), "",
             f"Knowledge points of these problems that state the gold answer: {leaks['leaks']} of {leaks['contexts']} "
             "(helpful and distractors; the gate's leakage line). The start (all arms): "
             f"benchmarks/claims/grpo_smollm2.py's recipe, seed 1, {cli.start_steps} steps on levels 1-2 (held-out "
             f"greedy level 1 {lv[1]}, level 2 {lv[2]}; {start['seconds'] / 60:.0f} minutes).", "",
             "## The proxy on the start", "",
             *proxy_lines(proxy, LEVEL, cli.proxy_samples, "the worked solution, whole: it ends with the answer"), ""]
    if failed:
        lines += ["## Training", "", "No arm trained: the gate failed (above).", "",
                  f"## Verdict: {untestable(failed)}"]
        return "\n".join(lines) + "\n"
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
    lines += verdict_lines(seeds_done, cli.seeds, lambda done: verdict(after, done, n),
                           "The rule (issue 40): adakp beats both static and none on no-hint level-4 accuracy beyond "
                           "the noise on both seeds: shown; ahead of both on every seed inside the noise, or beyond it "
                           "on one seed: partly; else not shown.")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30, help="training steps of every arm")
    p.add_argument("--start-steps", type=int, default=30, help="GRPO steps of the start (shared with the other claims)")
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
    start = finished_run(grpo, start_args(cli.start_steps, cli.start_dir), cli.records, weights=not cli.report_only,
                         make=not cli.report_only,
                         measure=lambda d: hint_cells(os.path.join(d, "checkpoint"), n))
    base = cached(os.path.join(cli.records, "base_cells.json"), {"n": n}, lambda: hint_cells(path_of(MODEL), n),
                  make=not cli.report_only)
    tokenizer = load_tokenizer(path_of(MODEL))
    ground = records_ground(cli.records) if cli.report_only else GROUND
    leaks = recorded_leakage(os.path.join(cli.records, "gate_leakage.json"), {"n": n}, lambda: knowledge_points(n),
                             tokenizer, ground)
    probe = cached(os.path.join(cli.records, "probe_leakage.json"), {"n": n, "proxy_problems": cli.proxy_problems},
                   lambda: probes(n, cli.proxy_problems, tokenizer), make=ground == GROUND)
    lines, failed = gate(claim(cli, start), leaks)
    line, premise_failed = premise(start["measured"], start["measured"].get("distinct", n))
    lines, failed = [*lines, line, probe_line(probe)], [*failed, *premise_failed]
    section = gate_section([(lines, failed)])
    print("\n".join(section))
    weights = os.path.join(cli.start_dir, "grpo_seed1", "checkpoint")
    proxy = cached(os.path.join(cli.records, "proxy.json"),
                   {"problems": cli.proxy_problems, "samples": cli.proxy_samples, "start_steps": cli.start_steps},
                   lambda: proxy_check(weights, "testbed-nl", LEVEL, cli.proxy_problems, cli.proxy_samples, 48, 32),
                   make=not cli.report_only)
    runs = {}
    for seed in cli.seeds if not failed else []:  # a failed gate: no arm trains
        for arm in cli.arms:
            args = tyro.cli(adakp.Args, args=["--model-name", weights, *RECIPE, "--total-steps", str(cli.steps),
                                              "--num-eval-problems", str(n), "--seed", str(seed), "--kp-mode", arm,
                                              "--output-dir", cli.output_dir, "--run-name", f"{arm}_seed{seed}"])
            if cli.report_only and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                continue
            runs[(arm, seed)] = finished_run(adakp, args, cli.records, lambda d: {
                "cells": hint_cells(os.path.join(d, "checkpoint"), n), "n": n}, make=not cli.report_only)
            with open(cli.out, "w") as f:
                f.write(report(cli, start, base, leaks, proxy, runs, section, failed))
    text = report(cli, start, base, leaks, proxy, runs, section, failed)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
