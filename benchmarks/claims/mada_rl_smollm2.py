"""MADA-RL's claims on SmolLM2-135M-Instruct (issues 42, 62), on a Stage 1 that trains its generators.

The claims (mada_rl.py, ALGORITHMS.md 5.6-5.7): after training, the generator/critic debate beats the generators'
majority vote and the best single generator, and critics trained with the counterfactual advantage A_C = R_C - 2 acc_G
beat critics trained with the plain GRPO z-score of R_C (debate accuracy, improvement rate: majority wrong -> critic
right; break rate: majority right -> critic wrong). Both rest on generators that Stage 1 trained, not broke: the last
run (issue 62) trained them at the CPU demo's LoRA rate 1e-3 at T = 1 with 0-9 % of samples right, so nearly every
group was all wrong, its z-scored reward was the length term alone, and 5 of 6 generators collapsed to 1-3-token
replies. So, measured first, in this order, each kept as a record (claim_runs.cached / finished_run):

1. The critic premise (issue 42) on each candidate level: the base model's greedy accuracy alone and as a critic
   reading 1 or 0 right of three proposals (benchmarks/premises/testbed_premises.py `proposal_cells`); a level counts
   where 1 of 3 right responses lifts accuracy by >= 0.10 over none (the critics start from the base model). No level:
   "premise fails", nothing more runs. (Added in the second session of issue 62, before any run at the new settings:
   the first pass chose level 1, whose critic premise then failed, 0.250 against 0.000.)
2. The Stage-1 premise on the levels of step 1: the base model's SAMPLED accuracy on the training level, on the first
   SAMPLED[0] distinct training problems of seed 1 x SAMPLED[1] samples (<= 64 new tokens), at each T of TEMPERATURES
   (0.5 and 0.3 were added with step 1: level 2 sat at 0.131 at T 0.7, below the band, and a lower temperature moves
   a sample towards the greedy reply, 0.225). It must lie in BAND = [0.20, 0.80], so that groups are mixed.
   `choose_setting` picks, among the settings in the band, the one with the most distinct held-out problems (the
   claim is judged on that level's held-out split: level 2 has 40, level 1 only 20 sums), then the most mixed groups
   (right and wrong samples in one group), then the higher temperature. None in the band: "untestable here" (the
   premise fails), nothing more runs.
3. A Stage-1 probe at each learning rate of LRS (1e-4, 3e-4: the demo's 1e-3 broke the generators) on seed 1: mada_rl.py
   with the arms' flags, --critic-steps 0 and --debate-rounds 1, i.e. the three generators trained for --agent-steps
   steps each with the paper's reward R = 2 R_acc + R_len (z-scored per group), their held-out greedy accuracy against
   the base model's (the run's first evaluation, every adapter still B = 0), and Stage 2's draw (each critic problem
   answered by the three generators at the chosen T: stage2.jsonl, acc_G). `keeps`: the generators' mean at or above
   the base model's and none below it beyond the noise of two cells (claim_runs.margin); `choose_lr`: of the rates that
   keep, the one whose generators gained most (ties: the smaller). None keeps: "untestable here" with the figures, no
   arm runs. The probe of the chosen rate is seed 1's Stage 1, and seed 2 gets its own at that rate. (The rate is
   chosen on the judged split's held-out problems; both arms read the same generators, so the choice favours neither.)
4. The gate (claim_runs.gate): leakage, headroom (the base model on the judged split), power, and `baseline_headroom`:
   the generator ensemble's per-instance accuracy acc_G on the critic problems (the counterfactual baseline) must vary
   across problems with its mean in [0.10, 0.90] on every seed; an identically-0 baseline fails it (the last run's
   seed 2), as does an identically-1 one.
5. The arms, seeds 1 and 2, both on that seed's Stage-1 run (--generators-from): the counterfactual critics and the
   plain ones (--no-counterfactual), which read the very Stage-2 proposals of that run's stage2.jsonl (mada_rl.py reads
   the file; tests/test_mada_rl.py shows it). --agent-steps critic steps each, the chosen T and rate.

The start (--start): every agent is the base model (`base`, the paper's setting: its agents start from one instruct
model), or the post-GRPO model of the other SmolLM2 claims (`grpo`, STARTS), trained first where the checkout lacks it.
On the base model the premise fails (issue 62's second session: level 1's critic premise fails, level 2's sampled
accuracy is 0.025 / 0.131 / 0.153 / 0.172 at T 1 / 0.7 / 0.5 / 0.3, below the band), so the same rules, unchanged, run
again from the post-GRPO start, with its own records (prefixed grpo-start_) and report
(mada_rl_smollm2_grpo_start.md). Said before any run from that start; the base model's report stays as it is.

The rules, written before the runs: (debate) the counterfactual arm's debate above the generators' vote beyond the
noise on both seeds: shown; above on both inside the noise, or beyond on one: partly; else not shown; the same against
the best single generator (the best of three on the judged problems: a generous baseline); (critic) the counterfactual
arm's debate above the plain arm's, the same rule; (critic rates) its improvement rate above the plain arm's, the same
rule on the problems whose vote is wrong, and its break rate said beside the plain arm's. A seed whose Stage 1 did not
keep its generators makes the debate verdicts "premise fails"; a failed gate makes a verdict "untestable here".

Time on this 2-core CPU (a SmolLM2 step of 4 prompts x 8 samples costs 40-50 s at about 41 tokens a reply, the last
run's records; 64 new tokens at most): the critic cells 1-3 minutes a level; the sampled premise 320 replies a level and
temperature, about 2.5 minutes each (8 cells if both levels keep the critic premise); each Stage-1 run (two probes
at seed 1, one at seed 2) 30 steps (3 generators x 10) plus three greedy
evaluations and Stage 2's draw, about 25-30 minutes; each arm 30 critic steps and two debates, about 25 minutes, 4 of
them. In all about 3 h 15 min at level 2 (about 2 h 30 min at level 1, with shorter replies and fewer problems):
NOT within the ~90-minute budget, over it by about 1 h 45 min (1 h at level 1). The premise and the probes (about 1 h)
come first and decide whether the arms (about 2 h with seed 2's Stage 1) run at all. Nothing was cut to fit.

    python -m benchmarks.claims.mada_rl_smollm2 --premise-only   # the sampled premise, critic cells, probes (~1 h)
    python -m benchmarks.claims.mada_rl_smollm2                  # then seed 2's Stage 1 and the arms (~2 h)
    python -m benchmarks.claims.mada_rl_smollm2 --report-only    # the report from the records
    python -m benchmarks.claims.mada_rl_smollm2 --start grpo --premise-only   # from the post-GRPO start (+16 min)
    python -m benchmarks.claims.mada_rl_smollm2 --sampled-problems 4 --samples 2 --num-eval-problems 8 \\
        --agent-steps 1 --seeds 1 --num-prompts 2 --group-size 2 --max-new-tokens 32 --num-train-problems 36 \\
        --out /tmp/m.md --arms-dir /tmp/m_runs --records /tmp/m_records   # a smoke run

Every run is a record in benchmarks/claims/runs/mada_rl_smollm2/, so a rerun reads it back; mada_rl.py writes no
checkpoints, so an interrupted run starts again. Writes benchmarks/claims/mada_rl_smollm2.md.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import tyro

import mada_rl
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (HEADROOM, Claim, cached, finished_run, gate, gate_section, margin,
                                          untestable, verdict_lines)
from benchmarks.premises.testbed_premises import nl_accuracy, proposal_cells, proposal_premises
from common.data import encode_prompts, load_problems, render_prompt

MODEL = "smollm2-135m-instruct"
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "mada_rl_smollm2")
LEVELS, TEMPERATURES, LRS = (1, 2), (1.0, 0.7, 0.5, 0.3), (1e-4, 3e-4)
"""the candidates: training (and judged) level, sampling temperature, LoRA learning rate"""
BAND = (0.2, 0.8)
"""where the base model's sampled accuracy on the training level must lie, so that groups are mixed"""
SAMPLED = (40, 8)
"""the sampled premise: distinct training problems x samples each"""
ARM_FLAGS = ["--dataset", "testbed-nl", "--num-generators", "3", "--num-critics", "3",
             "--micro-batch-size", "16", "--share-prompt", "--eval-every", "0", "--log-samples", "4"]
"""mada_rl.py's flags in every run (LoRA r 8 on every projection: its default); the start (--model-name), level,
temperature, rate, batch, tokens and problems are added from the choices and the command line"""
STARTS = ("base", "grpo")
"""every agent's start (--start): the base model, or the post-GRPO model of the other SmolLM2 claims
(benchmarks/claims/grpo_smollm2.start_args: 30 steps on levels 1-2 at 48 new tokens, seed 1; level 2 greedy 0.525
there), on which level 2 may be inside the Stage-1 band where the base model's is not (0.172 at best)"""


def start_model(start: str, records: str, make: bool) -> str:
    """--model-name of every run under `start`; the post-GRPO model is trained where this checkout lacks it (about
    16 minutes on one thread, recorded as grpo_seed1.json in `records`)."""
    if start == "base":
        return MODEL
    import grpo
    from benchmarks.claims.grpo_smollm2 import START, start_args

    if make:
        finished_run(grpo, start_args(), records, weights=True)
    return os.path.join(START, "grpo_seed1", "checkpoint")


def tagged(start: str, name: str) -> str:
    """A record's or run's name under --start: the base model's keep their names, the others are prefixed."""
    return name if start == "base" else f"{start}-start_{name}"


# --- 1. the Stage-1 premise: sampled accuracy on the training level, and the choice of level and temperature ----------
def held_out(level: int, cli) -> int:
    """Distinct held-out problems of `level` the arms are judged on (the fewest over the seeds)."""
    return min(len({p.question for p in load_problems("testbed-nl", "test", (level,), cli.num_eval_problems, s)})
               for s in cli.seeds)


def sampled_cells(cli, levels, have: dict) -> dict:
    """`have` with the cells it lacks added: the base model's sampled accuracy on the first cli.sampled_problems
    distinct training problems of the first seed, cli.samples samples each, for each of `levels` at each temperature,
    and the fraction of mixed groups."""
    from common.models import load_model, load_tokenizer, mask_padded_head
    from common.rollout import HFEngine
    from common.verifiers import score
    from grounds import path_of

    out, tok, engine = dict(have), None, None
    for lv in levels:
        for temp in TEMPERATURES:
            if f"L{lv} T{temp:g}" in out:
                continue
            if engine is None:
                tok, model = load_tokenizer(path_of(cli.model)), load_model(path_of(cli.model)).eval()
                mask_padded_head(model, len(tok))
                engine = HFEngine(model, tok, max_batch=64)
            pool, problems = load_problems("testbed-nl", "train", (lv,), cli.num_train_problems, cli.seeds[0]), []
            for p in pool:  # the first distinct questions of the pool the trainer splits among its agents
                if p.question not in {q.question for q in problems} and len(problems) < cli.sampled_problems:
                    problems.append(p)
            ids = encode_prompts(tok, [render_prompt(p, tok) for p in problems])
            t0 = time.time()
            torch.manual_seed(0)
            r = engine.generate(ids, n=cli.samples, temperature=temp, max_new_tokens=cli.max_new_tokens)
            right_PS = np.array(score(r.texts, [p for p in problems for _ in range(cli.samples)],
                                      r.truncated_B)).reshape(len(problems), cli.samples)
            solved_P = right_PS.sum(1)
            out[f"L{lv} T{temp:g}"] = {"level": lv, "temperature": temp, "accuracy": float(right_PS.mean()),
                                       "mixed": float(((solved_P > 0) & (solved_P < cli.samples)).mean()),
                                       "cut": float(np.asarray(r.truncated_B, dtype=float).mean()),
                                       "problems": len(problems), "samples": cli.samples,
                                       "held_out": held_out(lv, cli), "seconds": time.time() - t0}
            print(f"sampled premise L{lv} T{temp:g}: {out[f'L{lv} T{temp:g}']['accuracy']:.3f}", flush=True)
    return out


def choose_setting(cells: dict, levels=None) -> str | None:
    """The key of the chosen level and temperature: in BAND and on one of `levels` (those whose critic premise holds;
    None: any), then the most distinct held-out problems (the judged split), then the most mixed groups, then the
    higher temperature; None when no such setting is in the band.

    >>> choose_setting({"L1 T1": dict(accuracy=0.5, held_out=20, mixed=0.9, temperature=1.0, level=1),
    ...                 "L2 T1": dict(accuracy=0.1, held_out=40, mixed=0.3, temperature=1.0, level=2),
    ...                 "L2 T0.7": dict(accuracy=0.25, held_out=40, mixed=0.5, temperature=0.7, level=2)})
    'L2 T0.7'
    """
    inside = [k for k, c in cells.items() if BAND[0] <= c["accuracy"] <= BAND[1]
              and (levels is None or c["level"] in levels)]
    if not inside:
        return None
    return max(inside, key=lambda k: (cells[k]["held_out"], cells[k]["mixed"], cells[k]["temperature"]))


# --- 3. the Stage-1 probe: generators trained at each rate, against the base model ------------------------------------
def run_args(cli, level: int, temp: float, lr: float, seed: int, arm: str = "stage1") -> mada_rl.Args:
    """The run of one Stage 1 ('stage1': generators only, then Stage 2's draw; no critic steps, no critic round) or of
    one arm ('counterfactual', 'plain') on that seed's Stage-1 run."""
    stage1 = tagged(cli.start, f"stage1_L{level}_T{temp:g}_lr{lr:g}_seed{seed}")
    flags = [*ARM_FLAGS, "--model-name", cli.model, "--levels", str(level), "--temperature", str(temp),
             "--proposal-temperature", str(temp),
             "--learning-rate", str(lr), "--num-prompts", str(cli.num_prompts), "--group-size", str(cli.group_size),
             "--max-new-tokens", str(cli.max_new_tokens), "--num-train-problems", str(cli.num_train_problems),
             "--num-eval-problems", str(cli.num_eval_problems), "--generator-steps", str(cli.agent_steps),
             "--seed", str(seed), "--output-dir", cli.arms_dir]
    if arm == "stage1":
        flags += ["--critic-steps", "0", "--debate-rounds", "1", "--run-name", stage1]
    else:
        flags += ["--critic-steps", str(cli.agent_steps), "--generators-from", os.path.join(cli.arms_dir, stage1),
                  "--run-name", tagged(cli.start, f"{arm}_seed{seed}"),
                  *(["--no-counterfactual"] if arm == "plain" else [])]
    args = tyro.cli(mada_rl.Args, args=flags)
    # filled in by main(); claim_runs compares it and finds the last evaluation by it
    args.total_steps = 3 * cli.agent_steps * (1 if arm == "stage1" else 2)
    return args


def stage_2_draw(run_dir: str) -> dict:
    """acc_G of every critic problem of a run's Stage 2 (its stage2.jsonl), kept in its record."""
    with open(os.path.join(run_dir, "stage2.jsonl")) as f:
        return {"acc_g": [json.loads(line)["acc_g"] for line in f]}


def debate_rows(record: dict) -> list[dict]:
    """The held-out evaluations of a run: a Stage-1 run's before and after Stage 1 (twice: no critic steps); an arm's
    with its generators and untrained critics, and at the end."""
    return [r for r in record["rows"] if "mada/eval/debate_accuracy" in r]


def stage1_figures(record: dict) -> dict:
    """What a Stage-1 run did to its generators: the base model's held-out greedy accuracy (every adapter B = 0),
    each generator's after Stage 1, the held-out problems, the mean length of each generator's sampled replies at its
    first and last step, and its Stage-2 draw's acc_G."""
    ev = debate_rows(record)
    lens = [[r["rollout/completion_len"] for r in record["rows"]
             if r.get("mada/stage") == 1 and r.get("mada/agent") == g and "rollout/completion_len" in r]
            for g in range(3)]
    return {"base": ev[0]["mada/eval/single_accuracy"], "n": int(ev[0]["mada/eval/problems"]),
            "gens": [ev[-1][f"mada/eval/single_accuracy/gen{g}"] for g in range(3)],
            "lens": [(x[0], x[-1]) if x else (0.0, 0.0) for x in lens], "acc_g": record["measured"].get("acc_g", [])}


def keeps(fig: dict) -> bool:
    """Stage 1 kept its generators: their mean held-out accuracy at or above the base model's, and none below it
    beyond the noise of two cells of n problems (a collapsed generator, 0.000 against 0.225, is far beyond).

    >>> keeps({"base": 0.225, "gens": [0.25, 0.2, 0.25], "n": 40})
    True
    >>> keeps({"base": 0.225, "gens": [0.5, 0.0, 0.3], "n": 40})  # the mean is up, one generator collapsed
    False
    """
    mean = sum(fig["gens"]) / len(fig["gens"])
    return mean >= fig["base"] and all(g >= fig["base"] - margin(g, fig["base"], fig["n"]) for g in fig["gens"])


def choose_lr(probes: dict) -> float | None:
    """Of the rates whose Stage 1 keeps its generators ({rate: stage1_figures}), the one whose generators gained most
    (ties: the smaller rate); None when none keeps."""
    kept = [lr for lr, fig in probes.items() if keeps(fig)]
    if not kept:
        return None
    return max(kept, key=lambda lr: (sum(probes[lr]["gens"]), -lr))


# --- 4. the gate ----------------------------------------------------------------------------------------------------
def baseline_headroom(acc_g: dict) -> tuple[str, list[str]]:
    """The gate's line on the counterfactual baseline, {seed: acc_G of each critic problem}: on every seed it varies
    across problems (at least two values) and its mean lies in HEADROOM; an identically-0 baseline (every generator
    wrong on every problem) fails, as A_C is then the raw critic reward. Returns (line, failed)."""
    lo, hi = HEADROOM
    ok = {s: len(set(a)) > 1 and lo <= float(np.mean(a)) <= hi for s, a in acc_g.items()}
    figs = "; ".join(f"seed {s}: mean {np.mean(a):.3f} over {len(a)} problems, "
                     + ", ".join(f"{k}/3 right {np.mean(np.round(np.array(a) * 3) == k):.2f}" for k in range(4))
                     for s, a in acc_g.items())
    line = (f"- headroom (counterfactual baseline): acc_G, the generator ensemble's per-instance accuracy on the "
            f"critic problems (Stage 2's draw), must vary across problems with its mean in [{lo:.2f}, {hi:.2f}]: "
            f"{figs}: "
            f"{'pass' if all(ok.values()) else '**fail**'}")
    said = lambda a: f"identically {a[0]:.3f}" if len(set(a)) == 1 else f"mean {np.mean(a):.3f}"  # noqa: E731
    failed = [f"headroom, acc_G {said(a)} on seed {s}" for s, a in acc_g.items() if not ok[s]]
    return line, failed


def claims(cli, level: int, starts: dict) -> dict:
    """The gate declarations of the two verdicts (debate over the generators' vote and best generator; counterfactual
    over plain critics); `starts`: {seed: the base model's held-out greedy accuracy}, every agent's start."""
    common = dict(split=f"held-out level {level}, {held_out(level, cli)} problems a seed (the trainer's evaluation)",
                  n=held_out(level, cli), seeds=list(cli.seeds), start=starts,
                  start_is="greedy accuracy of the base model (every agent's start: the Stage-1 runs' first "
                           "evaluation)",
                  contexts_are="none from the reference: the critics read the generators' own samples")
    return {"debate": Claim(**common, effect=0.02, name="debate",
                            effect_is="the paper: MADA over its base, 39.9 -> 41.9, ALGORITHMS.md 5.6"),
            "critic": Claim(**common, effect=0.008, name="critic", effect_is="the paper: without the counterfactual "
                            "advantage 41.1 against 41.9 (p = 0.095), ALGORITHMS.md 5.6")}


def gates_of(cli, level: int, stage1: dict) -> dict:
    """{name: (lines, failed)} of both claims, with the counterfactual baseline's line on each."""
    line, failed = baseline_headroom({s: stage1[s]["acc_g"] for s in cli.seeds})
    out = {}
    for name, c in claims(cli, level, {s: stage1[s]["base"] for s in cli.seeds}).items():
        lines, f = gate(c, {"leaks": 0, "contexts": 0})
        out[name] = (lines + [line.replace("(counterfactual baseline)", f"({name}, counterfactual baseline)")],
                     f + failed)
    return out


# --- 2. the critic premise (issue 42) on the chosen level -----------------------------------------------------------
def cells(level: int, n: int, model_name: str = MODEL) -> dict:
    """The start model's greedy accuracy on n held-out problems of `level` alone and with three proposals (answers or
    responses, 1 or 0 of them right), up to 64 new tokens (seed 0: testbed_premises' problems)."""
    from common.models import load_model, load_tokenizer
    from grounds import path_of

    t0 = time.time()
    tok, model = load_tokenizer(path_of(model_name)), load_model(path_of(model_name)).eval()
    problems = load_problems("testbed-nl", "test", (level,), n, 0)
    m = {f"L{level}": nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems])}
    return {**m, **proposal_cells(model, tok, problems, level), "seconds": time.time() - t0}


def critic_holds(base: dict, level: int) -> bool:
    return [ok for label, _, ok, _ in proposal_premises(base, level) if label.startswith("responses: ")][0]


# --- 5. the report -------------------------------------------------------------------------------------------------
SHORT = 5
"""a generator whose sampled replies average fewer tokens than this at its last Stage-1 step writes no worked answer"""


def who(cli) -> str:
    """What every agent starts from, in the report's words."""
    return "base model" if cli.start == "base" else "post-GRPO start"


def critic_lines(base_cells: dict, cli) -> list[str]:
    """The critic premise of each candidate level ({level: its cells, None when not measured})."""
    lines = ["## The critic premise (issue 42), on each candidate level", "",
             f"The {who(cli)}'s greedy accuracy on {cli.num_eval_problems} held-out problems of the level (seed 0, "
             "benchmarks/premises/testbed_premises.py `proposal_cells`; level 1 has 20) alone and as a critic reading "
             "three proposals (a right one: the worked solution; a wrong one: the same with a near miss); a level "
             "counts where 1 of 3 right responses lifts it by >= 0.10 over none.", "",
             "| level | premise | figures | |", "|---|---|---|---|"]
    for lv, b in base_cells.items():
        lines += ([f"| {lv} | {label} | {fig} | {'pass' if ok else '**fail**'} |"
                   for label, fig, ok, _ in proposal_premises(b, lv)] if b is not None else
                  [f"| {lv} | not measured | | |"])
    return lines + ["", "The arms need the 'responses' line: the critics read the generators' worked replies."]


def premise_lines(sampled: dict, choice: str | None, probes: dict, lr: float | None, stage1: dict, cli) -> list[str]:
    """The Stage-1 premise: the sampled accuracies and the chosen setting, each rate's probe and the chosen rate, and
    each seed's Stage 1 at that rate."""
    n_s = next(iter(sampled.values()))
    lines = ["## The Stage-1 premise", "",
             f"The {who(cli)}'s sampled accuracy on {n_s['problems']} distinct training problems x {n_s['samples']} "
             f"samples (seed {cli.seeds[0]}'s training pool, <= {cli.max_new_tokens} new tokens, a cut reply scores "
             f"0); it must lie in [{BAND[0]:.2f}, {BAND[1]:.2f}] so that groups are mixed. 'mixed': groups with right "
             "and wrong samples; 'held out': distinct problems of the judged split.", "",
             "| level | T | sampled accuracy | mixed groups | cut | held out | in the band |", "|---|" + "---|" * 6]
    for k, c in sorted(sampled.items(), key=lambda kv: (kv[1]["level"], -kv[1]["temperature"])):
        lines.append(f"| {c['level']} | {c['temperature']:g} | {c['accuracy']:.3f} | {c['mixed']:.2f} | "
                     f"{c['cut']:.2f} | {c['held_out']} | {'yes' if BAND[0] <= c['accuracy'] <= BAND[1] else 'no'} |")
    if choice is None:
        return lines + ["", "No setting on a level whose critic premise holds is in the band: the Stage-1 premise "
                        "fails, and nothing more runs."]
    c = sampled[choice]
    lines += ["", f"Chosen (`choose_setting`): level {c['level']} at T = {c['temperature']:g}: sampled accuracy "
              f"{c['accuracy']:.3f}, in the band, on a level whose critic premise holds; of those settings it has the "
              "most distinct held-out "
              f"problems ({c['held_out']}), then the most mixed groups ({c['mixed']:.2f}), then the higher "
              "temperature.", "",
              f"The Stage-1 probe (seed {cli.seeds[0]}): the three generators after {cli.agent_steps} steps each at "
              "each learning rate (R = 2 R_acc + R_len, z-scored per group), held-out greedy accuracy on the judged "
              "problems against the base model's, and the mean length of their sampled replies at their first -> last "
              "step (tokens).", "",
              "| rate | base | generator 0 | generator 1 | generator 2 | mean | keeps | minutes |",
              "|---|" + "---|" * 7]
    for rate, fig in probes.items():
        lines.append(f"| {rate:g} | {fig['base']:.3f} | " + " | ".join(
            f"{a:.3f} ({n0:.0f} -> {n1:.0f})" for a, (n0, n1) in zip(fig["gens"], fig["lens"]))
            + f" | {np.mean(fig['gens']):.3f} | {'yes' if keeps(fig) else 'no'} | {fig['seconds'] / 60:.0f} |")
    if len(probes) < len(LRS):
        return lines + ["", f"Probes recorded: {len(probes)} of {len(LRS)}; rerun the command (without --report-only)."]
    if lr is None:
        return lines + ["", "No rate keeps the generators at or above the base model ('keeps': their mean at or above "
                        "it, none below it beyond the noise of two cells): the Stage-1 premise fails, and no arm runs."]
    won, mean = probes[lr], float(np.mean(probes[lr]["gens"]))
    lines += ["", f"Chosen (`choose_lr`): {lr:g}, of the rates that keep the generators the one whose generators "
              f"gained most (mean {mean:.3f} against the base model's {won['base']:.3f}; noise "
              f"+-{margin(mean, won['base'], won['n']):.3f} for two cells of {won['n']} problems). Its probe is seed "
              f"{cli.seeds[0]}'s Stage 1."]
    for s, fig in stage1.items():
        short = sum(n1 < SHORT for _, n1 in fig["lens"])
        lines.append(f"- seed {s}, Stage 1 at {lr:g}: generators " + " / ".join(f"{a:.3f}" for a in fig["gens"])
                     + f" against the base model's {fig['base']:.3f} ({'keeps' if keeps(fig) else 'does not keep'}; "
                     f"{short} of 3 sample replies under {SHORT} tokens at their last step)")
    return lines


def judge(seeds, a_of, b_of, n_of, failed) -> tuple[str, list[str]]:
    """The rule: a above b beyond the noise on every seed: shown; above on all inside it, or beyond on one: partly."""
    notes, beyond, ahead = [], [], []
    for s in seeds:
        a, b, n = a_of(s), b_of(s), n_of(s)
        beyond.append(n > 0 and a - b > margin(a, b, n))
        ahead.append(a > b)
        notes.append(f"seed {s}: {a:.3f} against {b:.3f} ({a - b:+.3f}, noise +-{margin(a, b, max(n, 1)):.3f}, "
                     f"{n} problems)")
    status = "shown" if all(beyond) else "partly shown" if all(ahead) or any(beyond) else "not shown"
    return (f"{untestable(failed)} (the rule alone: {status})" if failed else status), notes


def arm_lines(runs: dict, stage1: dict, cli, gates: dict) -> list[str]:
    """The arms' table and verdicts from {(arm, seed): record} and {seed: stage1_figures}."""
    f = lambda x: f"{x:.3f}"  # noqa: E731
    lines = ["", "## The arms", "",
             "Both arms of a seed start from that seed's Stage-1 run (`--generators-from`) and read its Stage-2 draw "
             "(its stage2.jsonl): the same generators, the same problems, the very same proposals. Greedy, on the "
             "judged held-out problems; base: every agent the base model; vote: the three generators' majority; best "
             "generator: the best of the three on these problems; debate: round 2, mean over the three critics; "
             "'untrained critics': the same debate before Stage 3 (critics = the base model); improvement: vote wrong "
             "-> critic right, on the k problems whose vote is wrong; break: vote right -> critic wrong.", "",
             "| arm | seed | base | generators | best generator | vote | debate, untrained critics | debate | debate - "
             "vote | improvement (k) | break | critics beat generators (training) | minutes |",
             "|---|---|" + "---|" * 11]
    if not runs:
        return lines[:4] + ["", "No arm is recorded yet: rerun the command (without --report-only)."]
    fin = lambda arm, s: debate_rows(runs[(arm, s)])[-1]  # noqa: E731
    best = lambda arm, s: max(fin(arm, s)[f"mada/eval/single_accuracy/gen{g}"] for g in range(3))  # noqa: E731
    wrong = lambda arm, s: round((1 - fin(arm, s)["mada/eval/majority_accuracy"])  # noqa: E731
                                 * fin(arm, s)["mada/eval/problems"])
    for (arm, seed), rec in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ev, stage3 = debate_rows(rec), [r for r in rec["rows"] if r.get("mada/stage") == 3]
        end, beats = ev[-1], sum(r["mada/beats_generators"] for r in stage3) / max(len(stage3), 1)
        base = f(stage1[seed]["base"]) if seed in stage1 else "?"
        lines.append(f"| {arm} | {seed} | {base} | {f(end['mada/eval/single_accuracy'])} | {f(best(arm, seed))} | "
                     f"{f(end['mada/eval/majority_accuracy'])} | {f(ev[0]['mada/eval/debate_accuracy'])} | "
                     f"{f(end['mada/eval/debate_accuracy'])} | "
                     f"{end['mada/eval/debate_accuracy'] - end['mada/eval/majority_accuracy']:+.3f} | "
                     f"{f(end['mada/eval/improvement_rate'])} ({wrong(arm, seed)}) | "
                     f"{f(end['mada/eval/break_rate'])} | "
                     f"{beats:+.3f} | {rec['seconds'] / 60:.0f} |")
    lines += ["", "'critics beat generators': the critics' training accuracy minus the generators' acc_G on the same "
              "problems, mean over Stage 3 steps (sampled at the chosen T)."]
    params = next((debate_rows(r)[0] for r in runs.values()), {})
    if "mada/trainable_params_per_agent" in params:
        lines += ["", f"Trainable parameters: {params['mada/trainable_params_per_agent']:,} an agent, "
                  f"{params['mada/trainable_params_total']:,} for the six, against {params['mada/base_params']:,} "
                  "for full fine-tuning of one model (the paper: 18.5M an agent against 1.78B)."]
    done = [s for s in cli.seeds if all((a, s) in runs for a in ("counterfactual", "plain"))]
    acc = lambda arm, s, k: fin(arm, s)[f"mada/eval/{k}"]  # noqa: E731
    n_of = lambda s: int(fin("counterfactual", s)["mada/eval/problems"])  # noqa: E731
    cf = lambda s: acc("counterfactual", s, "debate_accuracy")  # noqa: E731
    verdicts = [
        ("debate", "the debate against the vote", lambda d: judge(d, cf, lambda s: acc("counterfactual", s,
                                                                                      "majority_accuracy"), n_of,
                                                                   gates["debate"][1]),
         "The counterfactual arm's debate above the generators' majority beyond the noise on both seeds: shown; above "
         "on both inside it, or beyond on one: partly."),
        ("debate", "the debate against the best generator", lambda d: judge(d, cf, lambda s: best("counterfactual", s),
                                                                            n_of, gates["debate"][1]),
         "The counterfactual arm's debate above the best single generator, the same rule."),
        ("critic", "counterfactual against plain critics", lambda d: judge(d, cf, lambda s: acc("plain", s,
                                                                                               "debate_accuracy"),
                                                                           n_of, gates["critic"][1]),
         "The counterfactual arm's debate above the plain arm's, the same rule."),
        ("critic", "the improvement rate", lambda d: judge(d, lambda s: acc("counterfactual", s, "improvement_rate"),
                                                           lambda s: acc("plain", s, "improvement_rate"),
                                                           lambda s: wrong("counterfactual", s), gates["critic"][1]),
         "The counterfactual critics' improvement rate above the plain ones', the same rule on the problems whose vote "
         "is wrong (both arms read the same generators, so the same problems).")]
    out = []
    for name, what, rule_of, rule in verdicts:
        v = verdict_lines(done, cli.seeds, rule_of, rule)
        if len(v) <= 2:
            return lines + v
        v[1] = v[1].replace("## Verdict", f"## Verdict, {what}")
        broken = [s for s in done if s in stage1 and not keeps(stage1[s])]
        if name == "debate" and broken:  # the vote of generators Stage 1 broke is no baseline for the paper's claim
            v[1] = v[1].replace(f"## Verdict, {what}: ", f"## Verdict, {what}: premise fails (Stage 1 did not keep "
                                f"the generators on seed{'s' if len(broken) > 1 else ''} "
                                f"{', '.join(map(str, broken))}); the rule alone: ")
        out += v
    brk = lambda arm, s: acc(arm, s, "break_rate")  # noqa: E731
    out += ["", "Break rates (vote right -> critic wrong; the paper: it should not rise): " + "; ".join(
        f"seed {s}: counterfactual {brk('counterfactual', s):.3f}, plain {brk('plain', s):.3f} (noise +-"
        f"{margin(brk('counterfactual', s), brk('plain', s), max(n_of(s) - wrong('counterfactual', s), 1)):.3f})"
        for s in done) + "."]
    return lines + out


def report(cli, sampled: dict, choice, probes: dict, lr, stage1: dict, base_cells: dict | None, runs: dict,
           records: list) -> str:
    minutes = (sum(r["seconds"] for r in records) + sum(c["seconds"] for c in sampled.values())
               + sum(b.get("seconds", 0.0) for b in base_cells.values() if b)) / 60  # not the post-GRPO start's run
    lines = ["# MADA-RL on SmolLM2-135M-Instruct (issues 42, 62): Stage 1 first"
             + ("" if cli.start == "base" else ", every agent starting from the post-GRPO model"), "",
             f"`python -m benchmarks.claims.mada_rl_smollm2 --start {cli.start} --num-eval-problems "
             f"{cli.num_eval_problems} --agent-steps {cli.agent_steps} --seeds {' '.join(map(str, cli.seeds))}`, "
             f"{time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s), {minutes:.0f} minutes of runs "
             f"recorded. Runs: `python mada_rl.py --model-name {cli.model} {' '.join(ARM_FLAGS)} "
             "--levels L --temperature T "
             f"--proposal-temperature T --learning-rate LR --num-prompts {cli.num_prompts} --group-size "
             f"{cli.group_size} --max-new-tokens {cli.max_new_tokens} --num-train-problems {cli.num_train_problems} "
             f"--num-eval-problems {cli.num_eval_problems} --generator-steps {cli.agent_steps} --seed S` with "
             "`--critic-steps 0 --debate-rounds 1` (Stage 1), then `--critic-steps "
             f"{cli.agent_steps} --generators-from <that run>` with and without `--no-counterfactual` (the arms). "
             "Noise: a cell of 40 problems is +-0.15 at p = 0.5 (95 %), of 20 +-0.22.", ""]
    level = sampled[choice]["level"] if choice else None
    ok = [lv for lv, b in base_cells.items() if b is not None and critic_holds(b, lv)]
    critics_fail = bool(base_cells) and all(b is not None for b in base_cells.values()) and not ok
    premise_fails = critics_fail or choice is None or (lr is None and len(probes) == len(LRS))
    if choice and lr is not None and all(s in stage1 for s in cli.seeds):
        gates = gates_of(cli, level, stage1)
        lines += gate_section(list(gates.values()), list(gates))
    else:
        gates = None
        lines += ["## The gate (benchmarks/claims/claim_runs.py, before any arm trains)", "",
                  "Not reached: the premise fails first (below)." if premise_fails else
                  "Not yet: it needs every seed's Stage 1 (the base model's start and acc_G come from those runs).", ""]
    lines += critic_lines(base_cells, cli)
    if critics_fail:
        return "\n".join(lines + ["", "## Verdict: premise fails (on no level do the critics use a right proposal): "
                                  "no arm ran."]) + "\n"
    missing = [lv for lv, b in base_cells.items() if b is None]
    if missing:
        return "\n".join(lines + ["", f"Incomplete: the critic cells of level {', '.join(map(str, missing))} are "
                                  "not recorded; rerun the command (without --report-only)."]) + "\n"
    lines += [""] + premise_lines(sampled, choice, probes, lr, stage1, cli)
    if choice is None or lr is None:
        why = (f"no level whose critic premise holds ({', '.join(f'level {lv}' for lv in ok)}) gives a sampled "
               f"accuracy in [{BAND[0]:.2f}, {BAND[1]:.2f}] at any temperature tried ("
               + ", ".join(f"{k} {c['accuracy']:.3f}" for k, c in sampled.items() if c["level"] in ok) + ")"
               if choice is None else
               "no learning rate keeps the generators at or above the base model after Stage 1 (" + "; ".join(
                   f"{r:g}: " + " / ".join(f"{a:.3f}" for a in fig["gens"]) + f" against {fig['base']:.3f}"
                   for r, fig in probes.items()) + ")")
        if choice is None or len(probes) == len(LRS):
            lines += ["", f"## Verdict: premise fails (Stage 1): {why}", "",
                      "No arm ran: a debate of broken generators, or of generators whose groups hold no signal, could "
                      "count neither for nor against the paper."]
        return "\n".join(lines) + "\n"
    if gates is None:
        return "\n".join(lines + ["", "Incomplete: the Stage-1 runs of seeds " + ", ".join(
            str(s) for s in cli.seeds if s not in stage1) + " are missing; rerun the command."]) + "\n"
    return "\n".join(lines + arm_lines(runs, stage1, cli, gates)) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out problems (level 1 has 20)")
    p.add_argument("--agent-steps", type=int, default=10, help="training steps of each generator and each critic")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of Stage 1 and the arms")
    p.add_argument("--sampled-problems", type=int, default=SAMPLED[0], help="the sampled premise's problems")
    p.add_argument("--samples", type=int, default=SAMPLED[1], help="the sampled premise's samples a problem")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--group-size", type=int, default=8, help="samples a prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="a level-2 worked solution is 49-55 tokens")
    p.add_argument("--num-train-problems", type=int, default=360, help="before the six-way split (level 1: 61 "
                   "distinct)")
    p.add_argument("--start", choices=STARTS, default="base", help="every agent's start: the base model or the "
                   "post-GRPO model (STARTS)")
    p.add_argument("--out", default=None, help="the report (default: benchmarks/claims/mada_rl_smollm2.md, "
                   "or mada_rl_smollm2_grpo_start.md under --start grpo)")
    p.add_argument("--records", default=RECORDS, help="finished runs' records (committed by default)")
    p.add_argument("--arms-dir", default=os.path.join("runs", "mada_smollm2"), help="the runs' folders")
    p.add_argument("--premise-only", action="store_true", help="the sampled premise, critic cells and probes only")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # --generators-from is relative: records made in one clone are read in another
    make = not cli.report_only
    cli.out = cli.out or os.path.join(ROOT, "benchmarks", "claims", "mada_rl_smollm2"
                                      + ("" if cli.start == "base" else f"_{cli.start}_start") + ".md")
    cli.model = start_model(cli.start, cli.records, make)
    settings = {k: getattr(cli, k) for k in ("sampled_problems", "samples", "max_new_tokens", "num_train_problems",
                                              "num_eval_problems", "seeds")}
    settings.update({} if cli.start == "base" else {"model": cli.model})
    base_cells = {}
    for lv in LEVELS:  # 1. the critic premise of each candidate level
        try:
            name = f"cells_base_L{lv}.json" if cli.start == "base" else tagged(cli.start, f"cells_L{lv}.json")
            base_cells[lv] = cached(os.path.join(cli.records, name),
                                    {"n": cli.num_eval_problems, "level": lv,
                                     **({} if cli.start == "base" else {"model": cli.model})},
                                    lambda: cells(lv, cli.num_eval_problems, cli.model), make)
        except SystemExit:
            if make:
                raise
            base_cells[lv] = None
    ok = [lv for lv, b in base_cells.items() if b is not None and critic_holds(b, lv)]
    sampled = cached(os.path.join(cli.records, tagged(cli.start, "stage1_sampled.json")), settings,  # 2.
                     lambda have: sampled_cells(cli, ok, have), make, grow=True) if ok else {}
    sampled = {k: v for k, v in sampled.items() if k.startswith("L")}
    choice, records, probes, stage1, runs, lr = choose_setting(sampled, ok), {}, {}, {}, {}, None

    def record(args, weights=False):  # a run's record; None in a report when it is not recorded
        try:
            rec = finished_run(mada_rl, args, cli.records, stage_2_draw if "stage1" in args.run_name else None,
                               weights=weights and make, make=make)
        except SystemExit:
            if make:
                raise
            return None
        records[args.run_name] = rec
        return rec

    def write():
        text = report(cli, sampled, choice, probes, lr, stage1, base_cells, runs, list(records.values()))
        with open(cli.out, "w") as f:
            f.write(text)
        return text

    if choice is not None:
        level, temp = sampled[choice]["level"], sampled[choice]["temperature"]
        for rate in LRS:
            rec = record(run_args(cli, level, temp, rate, cli.seeds[0]))
            if rec is not None:
                probes[rate] = {**stage1_figures(rec), "seconds": rec["seconds"]}
            write()
        lr = choose_lr(probes) if len(probes) == len(LRS) else None
        if lr is not None:
            stage1[cli.seeds[0]] = probes[lr]
        for seed in cli.seeds[1:] if lr is not None and not cli.premise_only else []:
            rec = record(run_args(cli, level, temp, lr, seed))
            if rec is not None:
                stage1[seed] = stage1_figures(rec)
            write()
        for seed in cli.seeds if lr is not None and not cli.premise_only else []:
            if seed not in stage1:
                continue
            if make and not all(os.path.exists(os.path.join(cli.records, f"{a}_seed{seed}.json"))
                                for a in ("counterfactual", "plain")):
                rec = record(run_args(cli, level, temp, lr, seed), weights=True)  # its folder: the arms start from it
                stage1[seed] = {**stage1_figures(rec), "seconds": rec["seconds"]}  # a rerun (no folder) is this run
                if seed == cli.seeds[0]:
                    probes[lr] = stage1[seed]
            for arm in ("counterfactual", "plain"):
                rec = record(run_args(cli, level, temp, lr, seed, arm))
                if rec is not None:
                    runs[(arm, seed)] = rec
                write()
    print(write())


if __name__ == "__main__":
    main()
