"""MADA-RL's claim on a real model (issue 42), its premise first: does a critic on SmolLM2-135M-Instruct answer better
when one of three proposals it reads is right than with none?

The claim (mada_rl.py): after training, the generator/critic debate beats the generators' majority vote, and the
counterfactual critic advantage beats the plain one. Both rest on a critic that uses what it reads: a right proposal
among wrong ones must lift its accuracy over answering alone. On the testbed that premise failed (the model never
read proposals); this measures it on the real model, as mada_rl.py's critics read proposals by default (the
generators' worked responses, `--critic-sees responses`) and as bare answers (`--critic-sees answers`), on the base
model and after a short GRPO run (grpo_smollm2.py's recipe, seed 1: 30 steps on levels 1-2), on held-out level 2
(zero-shot 0.225 greedy, benchmarks/testbed_premises_smollm2.md: room above and below). The cells are
benchmarks/testbed_premises.py's (`proposal_cells`): a right response is the problem's worked solution, a wrong one
the same with a near miss in place of the answer, so its last step and its final answer are wrong.

The rule (../shared/CLAIMS.md, issue 42): the premise holds on a model when 1 of 3 right responses lifts greedy
accuracy by >= 0.10 over no proposals. If it fails on the base model and after GRPO, the verdict is "premise fails"
with both figures, and the training arms (debate against vote, counterfactual against plain critics) are not
evidence either way. Writes benchmarks/mada_smollm2.md.

    python benchmarks/mada_smollm2.py                 # the GRPO run (about 30 minutes on one thread) and the cells
    python benchmarks/mada_smollm2.py --steps 2 --num-eval-problems 4 --out /tmp/m.md --output-dir /tmp/m_runs \\
        --records /tmp/m_records                        # a smoke run

The GRPO run and each model's cells are kept as records in benchmarks/runs/mada_smollm2/ (benchmarks/claim_runs.py),
so a rerun reads them back.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import grpo  # noqa: E402
from benchmarks.claim_runs import cached, finished_run, margin  # noqa: E402
from benchmarks.grpo_smollm2 import RECIPE, START, start_args  # noqa: E402
from benchmarks.testbed_premises import nl_accuracy, proposal_cells, proposal_premises  # noqa: E402
from common.data import load_problems, render_prompt  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from grounds import path_of  # noqa: E402

MODEL, LEVEL = "smollm2-135m-instruct", 2
RECORDS = os.path.join(ROOT, "benchmarks", "runs", "mada_smollm2")


def cells(model_dir: str, n: int) -> dict:
    """Greedy accuracy on n held-out level-2 problems alone and with three proposals (answers or responses, 1 or 0
    of them right), up to 64 new tokens, the trainers' tokenizer and renderer (seed 0: testbed_premises' problems)."""
    t0 = time.time()
    tok, model = load_tokenizer(path_of(MODEL)), load_model(model_dir).eval()
    problems = load_problems("testbed-nl", "test", (LEVEL,), n, 0)
    m = {f"L{LEVEL}": nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems])}
    return {**m, **proposal_cells(model, tok, problems, LEVEL), "seconds": time.time() - t0}


def report(cols: dict, cli, grpo_record: dict) -> str:
    n = cli.num_eval_problems
    holds = {name: [ok for label, _, ok in proposal_premises(m, LEVEL) if label.startswith("responses: ")][0]
             for name, m in cols.items()}
    evals = [r for r in grpo_record["rows"] if "eval/greedy_accuracy" in r]
    lv = {k: f"{evals[0][f'eval/greedy_accuracy/level_{k}']:.3f} -> {evals[-1][f'eval/greedy_accuracy/level_{k}']:.3f}"
          for k in (1, 2)}
    verdict = ("premise holds on " + " and ".join(name for name, ok in holds.items() if ok) if any(holds.values())
               else "premise fails")
    lines = ["# MADA-RL on SmolLM2-135M-Instruct (issue 42): the critic premise", "",
             f"`python benchmarks/mada_smollm2.py --steps {cli.steps} --num-eval-problems {n}`, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s). "
             f"Greedy accuracy on {n} "
             f"held-out level-{LEVEL} problems of testbed-nl (up to 64 new tokens; a cut answer scores 0), alone and "
             "as a critic reading three proposals, as bare answers and as worked responses (a right one: the "
             "problem's worked solution; a wrong one: the same with a near miss in place of the answer). 'After "
             f"GRPO': `python grpo.py {' '.join(RECIPE)} --total-steps {cli.steps} --seed 1 --eval-every 0 "
             f"--num-eval-problems 40` (held-out greedy accuracy level 1 {lv[1]}, level 2 {lv[2]}; "
             f"{grpo_record['seconds'] / 60:.0f} minutes). Noise: a cell of {n} problems is "
             f"+-{1.96 * (0.25 / n) ** 0.5:.2f} at p = 0.5 (95 %).", "",
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
    for i, (label, _, _) in enumerate(rows[next(iter(cols))]):
        lines.append(f"| {label} | " + " | ".join(f"{rows[c][i][1]} {'pass' if rows[c][i][2] else '**fail**'}"
                                                  for c in cols) + " |")
    lines += ["", "| cell | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in [k for k in cols[next(iter(cols))] if k.startswith("L")]:
        lines.append(f"| {k} | " + " | ".join(f"{cols[c][k]:.3f}" for c in cols) + " |")
    if any(holds.values()):
        lines += ["", "Where the premise holds, the claim's training arms come next (issue 42: debate against the "
                  "generators' vote and the single generator, counterfactual against plain critic advantages, 2 "
                  "seeds); they are not part of this file yet."]
    else:
        lines += ["", "With the premise failing on both models the training arms of the claim (debate against the "
                  "generators' vote, counterfactual against plain critic advantages) were not run: neither outcome "
                  "could count for or against the paper on this ground."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="GRPO steps of the 'after' model")
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out level-2 problems a cell")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "mada_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, START), help="the GRPO run's folder")
    p.add_argument("--records", default=RECORDS, help="finished runs' records (committed by default)")
    cli = p.parse_args()
    n = cli.num_eval_problems
    base = cached(os.path.join(cli.records, "cells_base.json"), {"n": n}, lambda: cells(path_of(MODEL), n))
    record = finished_run(grpo, start_args(cli.steps, cli.output_dir), cli.records,
                          lambda run_dir: {"cells": cells(os.path.join(run_dir, "checkpoint"), n), "n": n})
    if record["measured"]["n"] != n:  # the cells of the trained model need its weights, which only the run has
        raise SystemExit(f"error: {cli.records}/grpo_seed1.json holds cells of {record['measured']['n']} problems, "
                         f"not {n}: move it aside to rerun the GRPO run")
    text = report({"SmolLM2-135M-Instruct": base, "after GRPO (seed 1)": record["measured"]["cells"]}, cli, record)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
