"""MADA-RL's claim on a real model (issue 42), its premise first: does a critic on SmolLM2-135M-Instruct answer better
when one of three proposals it reads is right than with none?

The claim (mada_rl.py): after training, the generator/critic debate beats the generators' majority vote, and the
counterfactual critic advantage beats the plain one. Both rest on a critic that uses what it reads: a right proposal
among wrong ones must lift its accuracy over answering alone. On the testbed that premise failed (the model never
read proposals); this measures it on the real model, as mada_rl.py's critics read proposals by default (the
generators' worked responses, `--critic-sees responses`) and as bare answers (`--critic-sees answers`), on the base
model and after a short GRPO run (grpo_smollm2.py's recipe, seed 1: 30 steps on levels 1-2), on held-out level 2
(zero-shot 0.225 greedy, benchmarks/premises/testbed_premises_smollm2.md: room above and below). The cells are
benchmarks/premises/testbed_premises.py's (`proposal_cells`): a right response is the problem's worked solution, a wrong
one the same with a near miss in place of the answer, so its last step and its final answer are wrong.

The rule (../shared/CLAIMS.md, issue 42): the premise holds on a model when 1 of 3 right responses lifts greedy
accuracy by >= 0.10 over no proposals. If it fails on the base model and after GRPO, the verdict is "premise fails"
with both figures, and the training arms (debate against vote, counterfactual against plain critics) are not
evidence either way. Writes benchmarks/claims/mada_rl_smollm2.md.

The arms, where the premise holds on the base model (mada_rl.py's critics start from it: fresh LoRA adapters on the
frozen base): `mada_rl.py` on level 2 (3 generators, 3 critics, LoRA r = 8 on every projection, lr 1e-3, 4 prompts
x 8 samples, 64 new tokens, ARM_FLAGS) with the counterfactual critic advantage, and the plain one (GRPO group
z-score, --no-counterfactual) trained on the same generators (--generators-from the first run: one Stage 1 a seed),
seeds 1 and 2. Measured on 40 held-out level-2 problems, greedy: the single generator (mean over the three), the
generators' majority vote, the debate (round 2, mean over critics), the critics' improvement rate (majority wrong ->
critic right) and break rate (majority right -> critic wrong); trainable parameters against full fine-tuning.
The rules, written before the runs: (debate) the counterfactual arm's debate above the vote beyond the noise on both
seeds: shown; above on both inside the noise, or beyond on one: partly; else not shown. (critic advantage) the
counterfactual arm's debate above the plain arm's, the same rule.

    python -m benchmarks.claims.mada_rl_smollm2       # the premise (records), then 2 arms x 2 seeds
    python -m benchmarks.claims.mada_rl_smollm2 --steps 2 --num-eval-problems 4 --agent-steps 1 --seeds 1 \\
        --out /tmp/m.md --output-dir /tmp/m_runs --records /tmp/m_records   # a smoke run

Every run and each model's cells are kept as records in benchmarks/claims/runs/mada_rl_smollm2/
(benchmarks/claims/claim_runs.py), so a rerun reads them back; mada_rl.py writes no checkpoints, so an interrupted arm
starts again.

The gate (benchmarks/claims/claim_runs.py, `claims`), once the base model's cells are measured and before any arm
trains: the critics read the generators' own samples, nothing built from the reference; the base model (every agent's
start, so also the generators' vote) must leave room on level 2; and 40 problems must be able to show the paper's
effects. A failed gate makes a verdict "untestable here".
"""

import argparse
import os
import time

import torch

import grpo
import mada_rl
from benchmarks import ROOT
import tyro
from benchmarks.claims.claim_runs import (Claim, cached, finished_run, gate, gate_section, margin, untestable,
                                          verdict_lines)
from benchmarks.claims.grpo_smollm2 import RECIPE, START, start_args
from benchmarks.premises.testbed_premises import nl_accuracy, proposal_cells, proposal_premises
from common.data import load_problems, render_prompt
from common.models import load_model, load_tokenizer
from grounds import path_of

MODEL, LEVEL = "smollm2-135m-instruct", 2
BASE = "SmolLM2-135M-Instruct"
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "mada_rl_smollm2")
ARM_FLAGS = ["--model-name", MODEL, "--dataset", "testbed-nl", "--levels", str(LEVEL), "--num-generators", "3",
             "--num-critics", "3", "--num-prompts", "4", "--group-size", "8", "--max-new-tokens", "64",
             "--micro-batch-size", "16", "--share-prompt", "--num-train-problems", "360", "--eval-every", "0",
             "--log-samples", "4"]
"""mada_rl.py's flags in both arms (LoRA r 8, lr 1e-3: its defaults): grpo_smollm2's batch on the premise's level,
64 new tokens (a level-2 worked solution is 49-55 tokens), 60 training problems an agent (6 agents)"""


def claims(cli, base: dict) -> dict:
    """The gate declarations of the two verdicts: debate over the generators' vote, counterfactual over plain critics
    (the base model's greedy accuracy alone is every agent's start, and the vote of three copies of it)."""
    n = cli.num_eval_problems
    common = dict(split=f"held-out level {LEVEL}, {n} problems a seed (the trainer's evaluation)",
                  n=min(len({p.question for p in load_problems("testbed-nl", "test", (LEVEL,), n, s)})
                        for s in cli.seeds),
                  seeds=list(cli.seeds), start={s: base[f"L{LEVEL}"] for s in cli.seeds},
                  start_is="greedy accuracy of the base model (every agent's start; the cells)",
                  contexts_are="none from the reference: the critics read the generators' own samples")
    return {"debate": Claim(**common, effect=0.02, name="debate",
                            effect_is="the paper: MADA over its base, 39.9 -> 41.9, ALGORITHMS.md 5.6"),
            "critic": Claim(**common, effect=0.008, name="critic", effect_is="the paper: without the counterfactual "
                            "advantage 41.1 against 41.9 (p = 0.095), ALGORITHMS.md 5.6")}


def cells(model_dir: str, n: int) -> dict:
    """Greedy accuracy on n held-out level-2 problems alone and with three proposals (answers or responses, 1 or 0
    of them right), up to 64 new tokens, the trainers' tokenizer and renderer (seed 0: testbed_premises' problems)."""
    t0 = time.time()
    tok, model = load_tokenizer(path_of(MODEL)), load_model(model_dir).eval()
    problems = load_problems("testbed-nl", "test", (LEVEL,), n, 0)
    m = {f"L{LEVEL}": nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems])}
    return {**m, **proposal_cells(model, tok, problems, LEVEL), "seconds": time.time() - t0}


def arm_args(arm: str, seed: int, cli) -> "mada_rl.Args":
    """The run of one arm: 'counterfactual', or 'plain' on the counterfactual run's generators."""
    extra = (["--no-counterfactual", "--generators-from", os.path.join(cli.arms_dir, f"counterfactual_seed{seed}")]
             if arm == "plain" else [])
    args = tyro.cli(mada_rl.Args, args=[*ARM_FLAGS, *extra, "--generator-steps", str(cli.agent_steps),
                                        "--critic-steps", str(cli.agent_steps), "--num-eval-problems",
                                        str(cli.num_eval_problems), "--seed", str(seed), "--output-dir", cli.arms_dir,
                                        "--run-name", f"{arm}_seed{seed}"])
    args.total_steps = 6 * cli.agent_steps  # filled in by main(); claim_runs compares it and finds the last eval by it
    return args


def debate_rows(record: dict) -> list[dict]:
    """The held-out debates of a run: before training (or, --generators-from, of the generators), after Stage 1 and
    at the end."""
    return [r for r in record["rows"] if "mada/eval/debate_accuracy" in r]


SHORT = 5
"""a generator whose sampled replies average fewer tokens than this at its last Stage-1 step writes no worked answer"""


def generator_lines(runs: dict) -> list[str]:
    """Each trained generator of a seed: its held-out greedy accuracy after Stage 1 and its sampled replies' mean
    length in tokens at its first and last Stage-1 step (a generator that learnt to say nothing shows here, and the
    vote and the debate read its empty proposals)."""
    lines = ["", "The generators after Stage 1 (the counterfactual run trains them; the plain run reuses them): "
             "held-out greedy accuracy, and the mean length of their sampled replies at their first -> last "
             "training step (tokens).", "",
             "| seed | " + " | ".join(f"generator {g}" for g in range(3)) + " | best generator | final debate |",
             "|---|" + "---|" * 5]
    notes = []
    for (arm, seed), rec in sorted(runs.items(), key=lambda kv: kv[0][1]):
        if arm != "counterfactual":
            continue
        stage1 = [r for r in rec["rows"] if r.get("mada/stage") == 1 and "rollout/completion_len" in r]
        after = debate_rows(rec)[-2]  # after Stage 1: the generators the critics read
        if "mada/eval/single_accuracy/gen0" not in after:
            continue
        acc = [after[f"mada/eval/single_accuracy/gen{g}"] for g in range(3)]
        lens = [[r["rollout/completion_len"] for r in stage1 if r.get("mada/agent") == g] for g in range(3)]
        cells = [f"{a:.3f} ({n[0]:.0f} -> {n[-1]:.0f})" if n else f"{a:.3f}" for a, n in zip(acc, lens)]
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {max(acc):.3f} | "
                     f"{debate_rows(rec)[-1]['mada/eval/debate_accuracy']:.3f} |")
        base = debate_rows(rec)[0]["mada/eval/single_accuracy"]
        below = sum(a < base for a in acc)
        short = sum(bool(n) and n[-1] < SHORT for n in lens)
        notes.append(f"seed {seed}: {below} of 3 generators end below the base model alone ({base:.3f}); {short} of 3 "
                     f"sample replies of under {SHORT} tokens on average at their last step")
    if len(lines) == 5:
        return []
    return lines + ["", "Stage 1 on this ground: " + "; ".join(notes) + ". The vote and the debate read these "
                    "generators, so a debate above their vote is not a debate above the base model."]


def arm_lines(runs: dict, cli, gates: dict) -> list[str]:
    """The arms' table and verdicts from {(arm, seed): record}."""
    n = cli.num_eval_problems
    f = lambda x: f"{x:.3f}"  # noqa: E731
    lines = ["", "## The arms", "",
             f"`python mada_rl.py {' '.join(ARM_FLAGS)} --generator-steps {cli.agent_steps} --critic-steps "
             f"{cli.agent_steps} --num-eval-problems {n} --seed S` (counterfactual), and the same with "
             "`--no-counterfactual --generators-from <the counterfactual run>` (plain: its critics train on the same "
             f"generators and the same problems). Greedy, {n} held-out level-{LEVEL} problems; 'base': every agent "
             "the base model; vote: the three generators' majority; debate: round 2, mean over the three critics; "
             "improvement: majority wrong -> critic right; break: majority right -> critic wrong; 'untrained critics': "
             "the same debate before Stage 3 (critics = the base model), the control for a second round without "
             "critic training.", "",
             "| arm | seed | base single | generators single | vote | debate, untrained critics | debate | debate - "
             "vote | improvement | break | critics beat generators (training) | minutes |", "|---|---|" + "---|" * 10]
    if not runs:
        return lines[:4] + ["", "No arm is recorded yet: rerun the command (without --report-only)."]
    for (arm, seed), rec in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ev, stage3 = debate_rows(rec), [r for r in rec["rows"] if r.get("mada/stage") == 3]
        first, fin = ev[0], ev[-1]
        base = f(first["mada/eval/single_accuracy"]) if arm == "counterfactual" else "(same)"
        beats = sum(r["mada/beats_generators"] for r in stage3) / max(len(stage3), 1)
        lines.append(f"| {arm} | {seed} | {base} | {f(fin['mada/eval/single_accuracy'])} | "
                     f"{f(fin['mada/eval/majority_accuracy'])} | {f(ev[-2]['mada/eval/debate_accuracy'])} | "
                     f"{f(fin['mada/eval/debate_accuracy'])} | "
                     f"{fin['mada/eval/debate_accuracy'] - fin['mada/eval/majority_accuracy']:+.3f} | "
                     f"{f(fin['mada/eval/improvement_rate'])} | {f(fin['mada/eval/break_rate'])} | {beats:+.3f} | "
                     f"{fin.get('mada/train_time_s', rec['seconds']) / 60:.0f} |")
    lines += generator_lines(runs)
    params = next((debate_rows(r)[0] for r in runs.values()), {})
    if "mada/trainable_params_per_agent" in params:
        lines += ["", f"Trainable parameters: {params['mada/trainable_params_per_agent']:,} an agent, "
                  f"{params['mada/trainable_params_total']:,} for the six, against {params['mada/base_params']:,} "
                  "for full fine-tuning of one model (the paper: 18.5M an agent against 1.78B)."]
    lines += ["", "'critics beat generators': the critics' training accuracy minus the generators' acc_G on the same "
              "problems, mean over Stage 3 steps (sampled at T = 1)."]
    done = [s for s in cli.seeds if all((a, s) in runs for a in ("counterfactual", "plain"))]

    def judge(seeds, a_key, b_of, name):
        notes, beyond, ahead = [], [], []
        for s in seeds:
            a, b = a_key(s), b_of(s)
            beyond.append(a - b > margin(a, b, n))
            ahead.append(a > b)
            notes.append(f"seed {s}: {a:.3f} against {b:.3f} ({a - b:+.3f}, noise +-{margin(a, b, n):.3f})")
        status = "shown" if all(beyond) else "partly shown" if all(ahead) or any(beyond) else "not shown"
        failed = gates[name][1]
        return (f"{untestable(failed)} (the rule alone: {status})" if failed else status), notes

    fin = lambda arm, s, k: debate_rows(runs[(arm, s)])[-1][f"mada/eval/{k}"]  # noqa: E731
    debate = verdict_lines(done, cli.seeds, lambda d: judge(d, lambda s: fin("counterfactual", s, "debate_accuracy"),
                                                            lambda s: fin("counterfactual", s, "majority_accuracy"),
                                                            "debate"),
                           "Debate against the vote (counterfactual arm): the debate above the generators' majority "
                           "beyond the noise on both seeds: shown; above on both inside it, or beyond on one: partly.")
    critic = verdict_lines(done, cli.seeds, lambda d: judge(d, lambda s: fin("counterfactual", s, "debate_accuracy"),
                                                            lambda s: fin("plain", s, "debate_accuracy"), "critic"),
                           "Counterfactual against plain critic advantage: the counterfactual arm's debate above the "
                           "plain arm's, the same rule.")
    if len(debate) > 2:
        # the debate's ground: generators at least as good as the base model alone. Where Stage 1 left them below it
        # on a seed, their vote is no baseline for the paper's claim, whatever the rule computes (CLAIMS.md: a run on
        # a failed premise is reported, never as evidence)
        alone = {s: debate_rows(runs[("counterfactual", s)])[0]["mada/eval/single_accuracy"] for s in done}
        broken = [s for s in done if fin("counterfactual", s, "single_accuracy") < alone[s]]
        if broken and gates["debate"][1]:  # untestable here already; the premise's failure is noted
            debate[1] = debate[1].replace("Verdict", "Verdict, debate")
            debate.append(f"- Stage 1 also left the generators below the base model alone on seed"
                          f"{'s' if len(broken) > 1 else ''} {', '.join(map(str, broken))} (premise fails): " + "; ".join(
                              f"seed {s}: debate {fin('counterfactual', s, 'debate_accuracy'):.3f}, generators "
                              f"{fin('counterfactual', s, 'single_accuracy'):.3f}, base alone {alone[s]:.3f}"
                              for s in done))
        elif broken:
            debate[1] = (f"## Verdict, debate: premise fails (Stage 1 left the generators below the base model alone "
                         f"on seed{'s' if len(broken) > 1 else ''} {', '.join(map(str, broken))}; the rule alone would "
                         f"say: {debate[1].split(': ', 1)[1]})")
            debate.append("- the debate against the base model alone: " + "; ".join(
                f"seed {s}: {fin('counterfactual', s, 'debate_accuracy'):.3f} against {alone[s]:.3f}" for s in done))
        else:
            debate[1] = debate[1].replace("Verdict", "Verdict, debate")
        critic[1] = critic[1].replace("Verdict", "Verdict, critic")
        return lines + debate + critic
    return lines + debate


def report(cols: dict, cli, grpo_record: dict, runs: dict | None = None) -> str:
    n = cli.num_eval_problems
    gates = {name: gate(c, {"leaks": 0, "contexts": 0}) for name, c in claims(cli, cols[BASE]).items()}
    holds = {name: [ok for label, _, ok, _ in proposal_premises(m, LEVEL) if label.startswith("responses: ")][0]
             for name, m in cols.items()}
    evals = [r for r in grpo_record["rows"] if "eval/greedy_accuracy" in r]
    lv = {k: f"{evals[0][f'eval/greedy_accuracy/level_{k}']:.3f} -> {evals[-1][f'eval/greedy_accuracy/level_{k}']:.3f}"
          for k in (1, 2)}
    verdict = ("premise holds on " + " and ".join(name for name, ok in holds.items() if ok) if any(holds.values())
               else "premise fails")
    lines = ["# MADA-RL on SmolLM2-135M-Instruct (issue 42): the critic premise", "",
             f"`python -m benchmarks.claims.mada_rl_smollm2 --steps {cli.steps} --num-eval-problems {n}`, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s). "
             f"Greedy accuracy on {n} "
             f"held-out level-{LEVEL} problems of testbed-nl (up to 64 new tokens; a cut answer scores 0), alone and "
             "as a critic reading three proposals, as bare answers and as worked responses (a right one: the "
             "problem's worked solution; a wrong one: the same with a near miss in place of the answer). 'After "
             f"GRPO': `python grpo.py {' '.join(RECIPE)} --total-steps {cli.steps} --seed 1 --eval-every 0 "
             f"--num-eval-problems 40` (held-out greedy accuracy level 1 {lv[1]}, level 2 {lv[2]}; "
             f"{grpo_record['seconds'] / 60:.0f} minutes). Noise: a cell of {n} problems is "
             f"+-{1.96 * (0.25 / n) ** 0.5:.2f} at p = 0.5 (95 %).", "",
             *gate_section(list(gates.values()), list(gates)),
             f"## Verdict: {verdict}", "",
             "The premise (issue 42): with critics reading the generators' responses, 1 of 3 right lifts accuracy by "
             ">= 0.10 over answering alone. " + " ".join(
                 f"{name}: {one:.3f} against {alone:.3f} alone ({'holds' if ok else 'fails'}; the difference "
                 f"{one - alone:+.3f} is {'beyond' if abs(one - alone) > margin(one, alone, n) else 'within'} the "
                 f"+-{margin(one, alone, n):.3f} of two cells of {n} problems)."
                 for name, ok in holds.items()
                 for one, alone in [(cols[name][f"L{LEVEL}, 1 of 3 responses right"], cols[name][f"L{LEVEL}"])]),
             "", "| premise | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    rows = {name: proposal_premises(m, LEVEL) for name, m in cols.items()}
    for i, (label, _, _, _) in enumerate(rows[next(iter(cols))]):
        lines.append(f"| {label} | " + " | ".join(f"{rows[c][i][1]} {'pass' if rows[c][i][2] else '**fail**'}"
                                                  for c in cols) + " |")
    lines += ["", "| cell | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in [k for k in cols[next(iter(cols))] if k.startswith("L")]:
        lines.append(f"| {k} | " + " | ".join(f"{cols[c][k]:.3f}" for c in cols) + " |")
    if holds[BASE]:
        lines += arm_lines(runs or {}, cli, gates)
    else:
        lines += ["", "With the premise failing on both models the training arms of the claim (debate against the "
                  "generators' vote, counterfactual against plain critic advantages) were not run: neither outcome "
                  "could count for or against the paper on this ground."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="GRPO steps of the 'after' model")
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out level-2 problems a cell")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "mada_rl_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, START), help="the GRPO run's folder")
    p.add_argument("--records", default=RECORDS, help="finished runs' records (committed by default)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of the arms")
    p.add_argument("--agent-steps", type=int, default=10, help="training steps of each generator and each critic")
    p.add_argument("--arms-dir", default=os.path.join("runs", "mada_smollm2"), help="the arms' run folders")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # the plain arm's --generators-from is relative: records made in one clone are read in another
    n = cli.num_eval_problems
    base = cached(os.path.join(cli.records, "cells_base.json"), {"n": n}, lambda: cells(path_of(MODEL), n),
                  make=not cli.report_only)
    record = finished_run(grpo, start_args(cli.steps, cli.output_dir), cli.records,
                          lambda run_dir: {"cells": cells(os.path.join(run_dir, "checkpoint"), n), "n": n},
                          make=not cli.report_only)
    if record["measured"]["n"] != n:  # the cells of the trained model need its weights, which only the run has
        raise SystemExit(f"error: {cli.records}/grpo_seed1.json holds cells of {record['measured']['n']} problems, "
                         f"not {n}: move it aside to rerun the GRPO run")
    cols = {BASE: base, "after GRPO (seed 1)": record["measured"]["cells"]}
    runs = {}
    holds = [ok for label, _, ok, _ in proposal_premises(base, LEVEL) if label.startswith("responses: ")][0]
    for seed in cli.seeds if holds else []:  # the critics start from the base model: its premise gates the arms
        for arm in ("counterfactual", "plain"):
            args = arm_args(arm, seed, cli)
            if cli.report_only and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                continue
            plain_missing = not os.path.exists(os.path.join(cli.records, f"plain_seed{seed}.json"))
            runs[(arm, seed)] = finished_run(mada_rl, args, cli.records,
                                             weights=arm == "counterfactual" and plain_missing and not cli.report_only,
                                             make=not cli.report_only)
            with open(cli.out, "w") as f:
                f.write(report(cols, cli, record, runs))
    text = report(cols, cli, record, runs)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
