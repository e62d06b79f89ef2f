"""SEC's claim on a real model (issue 61): the learned curriculum against uniform sampling over testbed-nl levels 2, 3
and 5, on SmolLM2-135M-Instruct (RLOO both arms, the same steps, prompts a step, seeds and evaluation).

The design, and why (written before any run of it). The first design (levels 1-5, 30 steps) could not show anything:
with five arms, 4 prompts a step and tau 0.4, the bandit moved about 10 % of the draws. Here one level is live and two
are dead: on the base model, greedy 0.225 on level 2 and 0.000 on levels 3 and 5
(benchmarks/premises/testbed_premises_smollm2.md). A dead level's groups all fail, their RLOO advantages are all 0, so
its mean |advantage| (SEC's arm reward) is 0 and its Q stays at 0, while level 2's Q climbs towards the mean |advantage|
of its groups, 2p(1-p) at success rate p (`mean_abs_advantage`). So SEC should draw level 2 well above a third of the
time (at most e^(Q/tau) / (e^(Q/tau) + 2): 0.53 at p = 0.2, 0.64 at p = 0.5), and uniform keeps a third. Judged on the
live level: held-out greedy accuracy on level 2, `--judge-problems` (200) problems measured on the base model and on
each run's final weights (the same problems; the trainer's own evaluation, 40 problems a level, gives all three levels
before and after). Two power lines in the gate: the accuracy one (claim_runs.gate: can 200 problems show the gain the
extra level-2 prompts can give) and the mechanism one (`mechanism_gate`: the level-2 share SEC's own update rule reaches
in the planned steps at the base model's sampled level-2 success, against uniform's noise; pure arithmetic). At p = 0.2
SEC is expected to draw level 2 0.50 of the time over 20 steps, 13.6 prompts more than uniform's 26.7 of 80, which at
GAIN_PER_PROMPT is 0.091 of level-2 accuracy; 200 problems detect 0.087 from 0.225 (40 would detect 0.206), hence 200.
The risk said in advance: at temperature 1 the base model rarely answers level 2 right (the first steps of the
committed SmolLM2 runs score 0.00-0.06 on levels 1-2, 1-3 and 2, benchmarks/claims/runs/), and at p = 0.03 the expected
share is 0.36 (+2.3 prompts, 0.015 of accuracy): both power lines then fail, and the bandit can act only once training
lifts level 2's sampled success (about 0.12 is needed over 20 steps).
Measured (2026-12-04, `--gate-only`): the base model's sampled level-2 success is 0.019, so the gate fails on both
power lines (expected share 0.352). `--start grpo` starts both arms from the post-GRPO model instead (STARTS: level 2
greedy 0.525 there, levels 3 and 5 still dead), where level 2 is live from the first step; its records and runs are
named with a "grpo-start_" prefix, and it is the default since.
The learning rate, chosen before the arms by one rule: the rate at which uniform holds its start over the 20 steps.
At the other SmolLM2 claims' 2e-5 (full fine-tuning), both arms fell from the post-GRPO start on seed 1 (judged level 2
0.645 -> 0.345 for SEC, -> 0.265 for uniform: the recipe, not the curriculum; their records stay beside, named
without a rate); at 5e-6 uniform held it (0.645 -> 0.660), so both arms run at 5e-6, the default (runs at a rate other
than 2e-5 are named with it, `lr_tagged`).

The budget: about 90 minutes of this 2-core CPU for 2 arms x 2 seeds at `--steps 20`: the starts (greedy on 200
level-2 problems and 4 samples on 40 of them, 2 seeds) about 5 minutes; a run about 20 minutes (20 steps of 4 prompts x
8 samples x 48 tokens at 40-60 s, two evaluations of 120 problems about a minute each, the judged 200 about 1.5); 80-100
minutes in all (up to 10 over, on a busy machine). Writes benchmarks/claims/rloo_sec_smollm2.md (rewritten after every
run, so an interrupted benchmark keeps what it has) and docs/img/rloo_sec_smollm2.png (level 2's draw share against
step, SEC and uniform, both seeds).

    python -m benchmarks.claims.rloo_sec_smollm2 --gate-only    # the gate (the starts) alone: about 5 minutes
    python -m benchmarks.claims.rloo_sec_smollm2                # 2 arms x seeds 1 and 2, 20 steps: 80-100 minutes
    python -m benchmarks.claims.rloo_sec_smollm2 --start base --seeds 1 --steps 1 --num-eval-problems 2 --judge-problems 2 \\
        --out /tmp/sec.md --plot /tmp/sec.png --output-dir /tmp/sec_runs --records /tmp/sec_records   # a smoke run

Each run is rloo_sec.py's own main with the flags printed in the report (the command reproduces one run). Every
finished run is kept as a record in benchmarks/claims/runs/rloo_sec_smollm2/ (benchmarks/claims/claim_runs.py,
`finished_run`, with the judged accuracy of its final weights): a run with the same arguments is read back, not rerun,
and an interrupted one continues from its last checkpoint (every 5 steps), so `--seeds 1 2` after `--seeds 1` runs only
seed 2. `--report-only` writes the report from the records, running nothing; `--gate-only` measures the starts (the
gate) and writes the report with it from the records, training nothing. The records of the first design are in
runs/rloo_sec_smollm2/old_levels_1-5/, never read here.

The verdict, per seed: the mechanism is SEC's level-2 draw share over the run (rloo_sec.py's sec/level_frac/level_2,
the levels drawn) above 1/3 by more than the 95 % noise of uniform's share over as many draws; the outcome is SEC's
held-out level-2 greedy accuracy above uniform's beyond the noise (claim_runs.margin). Both on both seeds: shown. The
mechanism on both seeds without the outcome: "mechanism shown, outcome partly shown" (ahead on both seeds inside the
noise, or beyond on one) or "mechanism shown, outcome not shown"; the mechanism on one seed: "mechanism shown on seed S
only, outcome ..."; on neither: "not shown: the bandit did not move the draws". A failed gate makes it "untestable
here: <gate, figure>" with the rule's reading beside it.
"""

import argparse
import math
import os
import time

import numpy as np
import torch
import tyro

import rloo_sec
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (Claim, cached, finished_run, gate, gate_section, margin, untestable,
                                          verdict_lines)

MODEL, LIVE, LEVELS = "smollm2-135m-instruct", 2, (2, 3, 5)
PROMPTS, GROUP, MAX_NEW = 4, 8, 48
RECIPE = ["--dataset", "testbed-nl", "--levels", *map(str, LEVELS), "--num-prompts",
          str(PROMPTS), "--group-size", str(GROUP), "--max-new-tokens", str(MAX_NEW), "--micro-batch-size", "16",
          "--share-prompt", "--eval-samples", "0", "--log-samples", "4",
          "--eval-every", "0", "--save-every", "5"]
ARMS = {"sec": ["--curriculum", "label"], "uniform": ["--curriculum", "uniform"]}
SHOWN = {"sec": "SEC", "uniform": "uniform"}
TAU, ALPHA, TEMPERATURE = rloo_sec.Args.sec_tau, rloo_sec.Args.sec_alpha, rloo_sec.Args.temperature
SAMPLED = (40, 4)
"""the base model's sampled level-2 success (the p of the mechanism line): 4 samples on the first 40 judged problems,
at the training temperature"""
GAIN_PER_PROMPT = 0.40 / 60
"""held-out level-2 greedy gain per level-2 training prompt of benchmarks/claims/grpo_smollm2.md (same recipe, levels
1-2: +0.550 and +0.250 on seeds 1 and 2 in 30 steps of 4 prompts, about 60 of them level 2), the accuracy gain an extra
level-2 prompt is taken to give (linear, and all of that run's gain put on its level-2 prompts)"""
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "rloo_sec_smollm2")
STARTS = {"base": MODEL, "grpo": os.path.join("runs", "smollm2_start", "grpo_seed1", "checkpoint")}
"""both arms' start (--start): the base model, or the post-GRPO model of the other SmolLM2 claims
(benchmarks/claims/grpo_smollm2.start_args: 30 steps on levels 1-2, level 2 greedy 0.525, levels 3 and 5 still at
0.000 / 0.025), whose sampled level-2 success gives the bandit a live arm from the first step (the base model's is
0.019: the gate's mechanism line fails there)"""


def start_model(start: str) -> str:
    """The --model-name of both arms; the post-GRPO start is trained first where this checkout lacks it (about 16
    minutes on one thread; recorded as grpo_seed1.json in RECORDS)."""
    if start == "grpo" and not os.path.isdir(STARTS["grpo"]):
        import grpo
        from benchmarks.claims.grpo_smollm2 import start_args

        finished_run(grpo, start_args(), RECORDS, weights=True)
    return STARTS[start]


def tagged(start: str, name: str) -> str:
    """A record's or run's name under --start: the base model's keep their names, others are prefixed."""
    return name if start == "base" else f"{start}-start_{name}"


LR, FIRST_LR = 5e-6, 2e-5
"""both arms' learning rate unless --learning-rate says otherwise (the rate at which uniform holds the post-GRPO start;
module docstring), and the first attempt's (the other SmolLM2 claims' full fine-tuning rate), whose runs keep untagged
names"""


def lr_tagged(lr: float, name: str) -> str:
    """A run's name at --learning-rate lr: the first attempt's rate (FIRST_LR) keeps its runs' names, others carry the
    rate, so the records at several rates stay side by side.

    >>> lr_tagged(2e-5, "sec_seed1"), lr_tagged(5e-6, "sec_seed1")
    ('sec_seed1', 'lr5e-06_sec_seed1')
    """
    return name if lr == FIRST_LR else f"lr{lr:g}_{name}"


# --- the mechanism's power: what SEC's own update rule does with one live level and two dead ones ------------------
def mean_abs_advantage(p: float, group: int = GROUP) -> float:
    """SEC's expected arm reward for a level of success rate p: the mean |A| of an RLOO group of `group` 0/1 rewards
    (rloo_sec.rloo_advantages), over k ~ Binomial(group, p) successes. With k successes a success has A = (G-k)/(G-1)
    and a failure |A| = k/(G-1), so the group's mean |A| is 2k(G-k)/(G(G-1)); E[k(G-k)] = G(G-1)p(1-p), whence 2p(1-p)
    whatever G (a level whose problems differ in p gives less: 2 E[p_x(1-p_x)]).

    >>> round(mean_abs_advantage(0.2), 4), round(mean_abs_advantage(0.4, group=4), 4), mean_abs_advantage(0.0)
    (0.32, 0.48, 0.0)
    """
    rewards_KG = torch.tensor([[1.0] * k + [0.0] * (group - k) for k in range(group + 1)])
    adv_KG = rloo_sec.rloo_advantages(rewards_KG)[0]
    return sum(math.comb(group, k) * p**k * (1 - p) ** (group - k) * adv_KG[k].abs().mean().item()
               for k in range(group + 1))


def live_shares(p: float, steps: int, prompts: int = PROMPTS, dead: int = 2, group: int = GROUP, tau: float = TAU,
                alpha: float = ALPHA) -> list[float]:
    """The live level's expected draw share at each step 1..steps under SEC (rloo_sec.arm_probs and td_update, Q from
    0), if every batch that draws it returns its expected reward mean_abs_advantage(p) and the dead levels return 0 (so
    their Q stays 0). Exact over the one chance left: whether a step's `prompts` draws hit the live level at all
    (1 - (1 - pi)^prompts), which decides whether its Q is updated.

    By hand at p = 0.2: step 1, Q = 0, pi = 1/3; the batch holds level 2 with 1 - (2/3)^4 = 65/81, and then
    Q = 0.5 x 0.32 = 0.16, pi = e^0.4 / (e^0.4 + 2) = 1.4918 / 3.4918 = 0.4272; step 2: 65/81 x 0.4272 + 16/81 x 1/3
    = 0.3428 + 0.0658 = 0.4087.

    >>> [round(x, 4) for x in live_shares(0.2, 2)]
    [0.3333, 0.4087]
    """
    r = mean_abs_advantage(p, group)
    q_after = [0.0]  # the live level's Q after k updates: the same whichever steps they came at
    for _ in range(steps):
        q_after.append(rloo_sec.td_update([q_after[-1]], torch.tensor([r]), torch.tensor([1.0]), alpha)[0])
    chance, shares = {0: 1.0}, []  # P(k updates so far)
    for _ in range(steps):
        share, nxt = 0.0, {}
        for k, w in chance.items():
            pi = rloo_sec.arm_probs([q_after[k]] + [0.0] * dead, [1] * (dead + 1), tau)[0]
            hit = 1 - (1 - pi) ** prompts
            share += w * pi
            nxt[k + 1] = nxt.get(k + 1, 0.0) + w * hit
            nxt[k] = nxt.get(k, 0.0) + w * (1 - hit)
        chance = nxt
        shares.append(share)
    return shares


def draw_noise(steps: int, prompts: int = PROMPTS, share: float = 1 / 3) -> float:
    """95 % half-width of the live level's share of steps x prompts draws at `share` (uniform's): a share beyond
    1/3 + it is more than uniform sampling's luck.

    >>> round(draw_noise(20), 3)
    0.103
    """
    return 1.96 * (share * (1 - share) / (steps * prompts)) ** 0.5


def mechanism_power(p: float, steps: int, prompts: int = PROMPTS) -> dict:
    """What `live_shares` gives over a run: the expected level-2 share at its last step and over the run, the level-2
    prompts it adds to uniform's third, and the noise the run's share is judged against.

    >>> {k: round(v, 2) for k, v in mechanism_power(0.2, 20).items()}
    {'last': 0.53, 'run': 0.5, 'extra': 13.63, 'noise': 0.1}
    """
    s = live_shares(p, steps, prompts)
    return {"last": s[-1], "run": sum(s) / steps, "extra": prompts * (sum(s) - steps / 3),
            "noise": draw_noise(steps, prompts)}


def mechanism_gate(p0: float, steps: int, prompts: int = PROMPTS) -> tuple[list[str], list[str]]:
    """The gate's mechanism line at the base model's sampled level-2 success p0 (with 0.2 and 0.4 beside it, and the
    smallest p that passes), and the failure with its figures ([] when it passes)."""
    m = mechanism_power(p0, steps, prompts)
    at = {q: mechanism_power(q, steps, prompts) for q in (0.2, 0.4)}
    need = next((k / 100 for k in range(1, 51) if mechanism_power(k / 100, steps, prompts)["run"] - 1 / 3
                 > m["noise"]), None)
    ok = m["run"] - 1 / 3 > m["noise"]
    line = (f"- power (mechanism): if each batch that draws level 2 returned the mean |advantage| of RLOO groups at "
            f"its sampled success p (2p(1-p)) and levels 3 and 5 returned 0, SEC's own update (rloo_sec.arm_probs, "
            f"td_update: tau {TAU}, alpha {ALPHA}, {prompts} prompts a step) would draw level 2 with an expected share "
            f"of {m['run']:.3f} over the {steps} steps ({m['last']:.3f} at the last), against 1/3 for uniform: "
            f"{m['extra']:+.1f} level-2 prompts of {steps * prompts}, at the start's p = {p0:.3f} (p = 0.2: "
            f"{at[0.2]['run']:.3f}, {at[0.2]['extra']:+.1f}; p = 0.4: {at[0.4]['run']:.3f}, {at[0.4]['extra']:+.1f}); "
            f"uniform's share of {steps * prompts} draws is 1/3 +-{m['noise']:.3f}, which SEC's clears from p = "
            f"{need if need is not None else 'none up to 0.5'}: {'pass' if ok else '**fail**'}")
    failed = [] if ok else [f"mechanism power, expected level-2 share {m['run']:.3f} at p {p0:.3f} within 1/3 "
                            f"+-{m['noise']:.3f}"]
    return [line], failed


# --- the judged split: held-out level 2 ------------------------------------------------------------------------------
def level2(model_path: str, n: int, seed: int, sampled: tuple[int, int] = (0, 0)) -> dict:
    """Greedy accuracy of the model at `model_path` on the first n held-out level-2 problems of `seed` (common.evaluate,
    48 new tokens, as rloo_sec.py evaluates; its 40 a level are the first 40 of these), with "distinct"; sampled=(k, s):
    also "sampled", the success of s samples on each of the first k at the training temperature."""
    from common.data import load_problems
    from common.evaluate import evaluate
    from common.models import load_model, load_tokenizer, mask_padded_head
    from common.rollout import HFEngine

    tok, model = load_tokenizer(model_path), load_model(model_path).eval()
    mask_padded_head(model, len(tok))
    problems = load_problems("testbed-nl", "test", (LIVE,), n, seed)
    out = {**evaluate(HFEngine(model, tok), tok, problems, MAX_NEW), "distinct": len({p.question for p in problems})}
    if sampled[0]:
        torch.manual_seed(seed)
        s = evaluate(HFEngine(model, tok), tok, problems[: sampled[0]], MAX_NEW, num_samples=sampled[1],
                     temperature=TEMPERATURE)
        out["sampled"] = s["eval/sampled_accuracy"]
    return out


def start_record(path: str, n: int, seed: int, make: bool = True, start: str = "base") -> dict:
    """`level2` of both arms' start (--start), with its sampled success, kept in the record `path`."""
    sampled = (min(SAMPLED[0], n), SAMPLED[1])

    def measure():
        from grounds import path_of

        return level2(path_of(MODEL) if start == "base" else start_model(start), n, seed, sampled)

    settings = {"level": LIVE, "n": n, "seed": seed, "max_new_tokens": MAX_NEW, "sampled": list(sampled)}
    return cached(path, settings if start == "base" else {**settings, "start": STARTS[start]}, measure, make)


def claim(start: dict, p0: float, steps: int) -> Claim:
    """The outcome's gate declaration: SEC above uniform on held-out level 2 by what its expected extra level-2
    prompts can give (GAIN_PER_PROMPT each)."""
    extra = max(mechanism_power(p0, steps)["extra"], 0.0)
    n = next(iter(start.values()))["settings"]["n"]
    return Claim(split=f"held-out level 2, {n} problems (greedy, {MAX_NEW} new tokens)",
                 n=min(r["distinct"] for r in start.values()), seeds=list(start),
                 start={s: r["eval/greedy_accuracy"] for s, r in start.items()},
                 start_is="greedy accuracy of the start (both arms')", effect=GAIN_PER_PROMPT * extra,
                 effect_is=f"plausible: the {extra:.1f} extra level-2 prompts of the mechanism line at the start's "
                           f"p, x {GAIN_PER_PROMPT:.4f} a level-2 prompt (grpo_smollm2's level-2 gain, +0.40 "
                           "over about 60)")


# --- the runs and the report -----------------------------------------------------------------------------------------
def run_args(cli, flags: list, arm: str, seed: int) -> rloo_sec.Args:
    """rloo_sec.py's arguments for one arm and seed; its run is recorded as <run name>.json in --records."""
    name = tagged(cli.start, lr_tagged(cli.learning_rate, f"{arm}_seed{seed}"))
    return tyro.cli(rloo_sec.Args, args=[*flags, *ARMS[arm], "--seed", str(seed), "--output-dir", cli.output_dir,
                                         "--run-name", name])


def summarise(record: dict, start: dict) -> dict:
    """What the report shows of one run's record (claim_runs.finished_run): the judged level-2 accuracy before (the
    start's record) and after (measured on its final weights), the trainer's evaluations of every level, and per step
    the levels drawn (sec/level_frac: the share of the step's prompts from each level) and the bandit's probabilities
    (sec/prob: uniform's are 1/3 whatever its Q); the arm reward level 2's groups returned (sec/mean_abs_adv, over
    the steps that drew it), the mechanism line's 2p(1-p) as training met it."""
    evals = [r for r in record["rows"] if "eval/greedy_accuracy" in r]
    rows = [r for r in record["rows"] if "reward/mean" in r]
    drawn = [r[f"sec/count/arm_{LIVE}"] for r in rows]
    right = [r[f"sec/success/arm_{LIVE}"] * c for r, c in zip(rows, drawn) if c]
    return {
        "judged_before": start["eval/greedy_accuracy"], "judged_after": record["measured"]["eval/greedy_accuracy"],
        "before": {lv: evals[0][f"eval/greedy_accuracy/level_{lv}"] for lv in LEVELS},
        "after": {lv: evals[-1][f"eval/greedy_accuracy/level_{lv}"] for lv in LEVELS},
        "steps": [r["step"] for r in rows],
        "share": {lv: [r[f"sec/level_frac/level_{lv}"] for r in rows] for lv in LEVELS},
        "prob": {lv: [r[f"sec/prob/arm_{lv}"] for r in rows] for lv in LEVELS},
        "live_success": sum(right) / sum(drawn) if sum(drawn) else float("nan"),
        "live_abs_adv": float(np.mean([r[f"sec/mean_abs_adv/arm_{LIVE}"] for r, c in zip(rows, drawn) if c]
                                      or [float("nan")])),
        "zero_std": float(np.mean([r["adv/frac_zero_std"] for r in rows])), "seconds": record["seconds"],
    }


def verdict(res: dict, seeds: list, n: int, steps: int) -> tuple[str, list[str]]:
    """The rule of the module docstring on {(arm, seed): summary}: the mechanism (SEC's level-2 draw share over the run
    beyond uniform's noise) and the outcome (held-out level-2 greedy accuracy beyond the noise), per seed.

    >>> one = lambda share, acc: {"share": {LIVE: [share] * 20}, "judged_after": acc}
    >>> verdict({("sec", 1): one(0.6, 0.5), ("uniform", 1): one(0.3, 0.2),
    ...          ("sec", 2): one(0.6, 0.4), ("uniform", 2): one(0.35, 0.35)}, [1, 2], 200, 20)[0]
    'mechanism shown, outcome partly shown'
    """
    noise = draw_noise(steps)
    mech, beyond, ahead, notes = [], [], [], []
    for s in seeds:
        sec, uni = res[("sec", s)], res[("uniform", s)]
        share, share_u = float(np.mean(sec["share"][LIVE])), float(np.mean(uni["share"][LIVE]))
        a, b = sec["judged_after"], uni["judged_after"]
        mech.append(share - 1 / 3 > noise)
        beyond.append(a - b > margin(a, b, n))
        ahead.append(a > b)
        notes.append(f"seed {s}: level-2 draw share over the run SEC {share:.3f}, uniform {share_u:.3f} (1/3 "
                     f"+-{noise:.3f}); held-out level-2 greedy SEC {a:.3f} against uniform {b:.3f} ({a - b:+.3f}, "
                     f"noise +-{margin(a, b, n):.3f})")
    outcome = "shown" if all(beyond) else "partly shown" if all(ahead) or any(beyond) else "not shown"
    if all(mech):
        rule = "shown" if outcome == "shown" else f"mechanism shown, outcome {outcome}"
    elif any(mech):
        only = ", ".join(str(s) for s, m in zip(seeds, mech) if m)
        rule = f"mechanism shown on seed {only} only, outcome {outcome}"
    else:
        rule = f"not shown: the bandit did not move the draws beyond uniform's noise (outcome {outcome})"
    return rule, notes


def windows(xs: list, width: int = 5) -> list[float]:
    """Means of consecutive `width`-step windows (the last may be shorter)."""
    return [float(np.mean(xs[i : i + width])) for i in range(0, len(xs), width)]


def report(res: dict, cli, flags: list, section: list, failed: list, n_judged: int, p0: float) -> str:
    n, lv = cli.num_eval_problems, " | ".join(f"L{x}" for x in LEVELS)
    noise = draw_noise(cli.steps)
    minutes = sum(r["seconds"] for r in res.values()) / 60
    lines = [f"# SEC on SmolLM2-135M-Instruct (rloo_sec.py, testbed-nl levels {', '.join(map(str, LEVELS))})", "",
             f"`python -m benchmarks.claims.rloo_sec_smollm2 --start {cli.start} --learning-rate "
             f"{cli.learning_rate:g} --seeds {' '.join(map(str, cli.seeds))} --steps {cli.steps} --num-eval-problems "
             f"{n} --judge-problems {cli.judge_problems}`, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU (shared), float32, {minutes:.0f} minutes of runs"
             f"{'' if len(res) == len(cli.arms) * len(cli.seeds) else ' so far'} (the starts and the judged "
             "evaluations of final weights excluded). Each run is `python "
             f"rloo_sec.py {' '.join(flags)} "
             "--curriculum {label,uniform} --seed S`: RLOO on both arms, 4 prompts x 8 samples a step, 48 new tokens. "
             f"Judged: held-out greedy accuracy on {cli.judge_problems} level-2 problems a seed (the same for both "
             f"arms; noise of a difference of two arms up to +-{margin(0.5, 0.5, n_judged):.2f} at 0.5, 95 %); the "
             f"trainer's own evaluation, {n} problems a level, gives every level (+-{margin(0.5, 0.5, n):.2f}).", "",
             *section,
             "The design (module docstring): one live level and two dead ones. On the base model, greedy 0.225 / 0.000 "
             "/ 0.000 on levels 2 / 3 / 5 (benchmarks/premises/testbed_premises_smollm2.md); "
             + ("the same model is both arms' start" if cli.start == "base" else
                f"both arms start from {STARTS[cli.start]} (levels 3 and 5 still at 0.000 / 0.025 there)")
             + f", whose sampled level-2 success is {p0:.3f} (the starts' records): a dead level's RLOO groups have no "
             "advantage, so its Q stays 0 and SEC should draw level 2 above a third of the time; uniform draws it a "
             "third."]
    done = [s for s in cli.seeds if all((arm, s) in res for arm in ARMS)]

    def judge(seeds):
        rule, notes = verdict(res, seeds, n_judged, cli.steps)
        return (f"{untestable(failed)} (the rule alone: {rule})" if failed else rule), notes

    lines += verdict_lines(done, cli.seeds, judge,
                           "The rule (issue 61): the mechanism, SEC's level-2 draw share over the run above 1/3 beyond "
                           f"uniform's noise (+-{noise:.3f} over {cli.steps * PROMPTS} draws), and the outcome, "
                           "held-out level-2 greedy accuracy above uniform's beyond the noise, on both seeds: shown; "
                           "the mechanism without the outcome: mechanism shown, outcome partly (ahead on both seeds, "
                           "or beyond on one) or not shown; no mechanism: not shown.")
    lines += ["", "## Held-out greedy accuracy before -> after", "",
              f"Level 2 judged ({cli.judge_problems} problems), then every level by the trainer ({n} a level). Level-2 "
              "success: the sampled success of the training groups drawn from level 2 over the run (the p of the "
              "mechanism line, as training met it); level-2 mean |A|: SEC's arm reward for level 2 as training met it "
              "(rloo_sec.py's sec/mean_abs_adv, over the steps that drew level 2), against the mechanism line's "
              f"2p(1-p) = {mean_abs_advantage(p0):.3f} at the start's p (less where a level's problems differ in p: "
              "2 E[p_x(1 - p_x)]). Zero-advantage groups: of all the run's groups.", "",
              f"| arm | seed | level 2 judged | {lv} | level-2 success | level-2 mean abs(A) | zero-adv groups | "
              "minutes |", "|---|---|---|" + "---|" * (len(LEVELS) + 4)]
    for (arm, seed), r in res.items():
        cells = " | ".join(f"{r['before'][x]:.3f} -> {r['after'][x]:.3f}" for x in LEVELS)
        lines.append(f"| {SHOWN[arm]} | {seed} | {r['judged_before']:.3f} -> {r['judged_after']:.3f} | {cells} | "
                     f"{r['live_success']:.3f} | {r['live_abs_adv']:.3f} | {r['zero_std']:.3f} | "
                     f"{r['seconds'] / 60:.0f} |")
    width = 5
    spans = [f"{i + 1}-{min(i + width, cli.steps)}" for i in range(0, cli.steps, width)]
    lines += ["", "## Where each arm drew its prompts", "",
              f"Share of the prompts drawn from each level (rloo_sec.py's sec/level_frac), by windows of {width} steps "
              "and over the run; SEC's pi(level) is the bandit's probability at the last step (sec/prob; uniform's is "
              "1/3 whatever its Q). The mechanism line expected level 2 at "
              + ", ".join(f"{x:.2f}" for x in windows(live_shares(p0, cli.steps))) + " by window at the start's "
              f"p = {p0:.3f} (start: {STARTS[cli.start]}).", "",
              f"| arm | seed | level | steps {' | '.join(spans)} | run | final pi |",
              "|---|---|---|" + "---|" * (len(spans) + 2)]
    for (arm, seed), r in res.items():
        for x in LEVELS:
            lines.append(f"| {SHOWN[arm]} | {seed} | {x} | " + " | ".join(f"{v:.2f}" for v in windows(r["share"][x]))
                         + f" | {np.mean(r['share'][x]):.3f} | {r['prob'][x][-1]:.2f} |")
    lines += ["", f"Per-step metrics: the runs' records in {os.path.relpath(cli.records, ROOT)}/ "
              f"(benchmarks/claims/claim_runs.py). Plot: {os.path.relpath(cli.plot, ROOT)}."]
    return "\n".join(lines) + "\n"


def plot(res: dict, out: str, p0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    colours, first = {"sec": "tab:red", "uniform": "tab:blue"}, min(s for _, s in res)
    for (arm, seed), r in res.items():
        style = "-" if seed == first else "--"
        drawn = np.cumsum(r["share"][LIVE]) / np.arange(1, len(r["steps"]) + 1)
        ax.plot(r["steps"], drawn, style, color=colours[arm], label=f"{SHOWN[arm]} seed {seed}: drawn so far")
        if arm == "sec":
            ax.plot(r["steps"], r["prob"][LIVE], style, color=colours[arm], alpha=0.35, lw=1,
                    label=f"SEC seed {seed}: pi(level 2)")
    steps = max(len(r["steps"]) for r in res.values())
    ax.plot(range(1, steps + 1), live_shares(p0, steps), ":", color="grey", label=f"expected pi at p = {p0:.2f}")
    ax.axhline(1 / 3, color="black", lw=0.8, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("level 2's share of the draws")
    ax.set_ylim(0, 1)
    ax.set_title("Level 2 (live) against levels 3 and 5 (dead): SEC and uniform", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-eval-problems", type=int, default=40, help="the trainer's held-out problems per level")
    p.add_argument("--judge-problems", type=int, default=200, help="held-out level-2 problems of the judged split")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "rloo_sec_smollm2.md"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "rloo_sec_smollm2.png"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "sec_smollm2"), help="run folders")
    p.add_argument("--records", default=RECORDS, help="the starts' and the finished runs' records (committed)")
    p.add_argument("--start", choices=list(STARTS), default="grpo",
                   help="both arms' start: the base model, or the post-GRPO model (STARTS)")
    p.add_argument("--learning-rate", type=float, default=LR,
                   help="both arms' learning rate; runs at another rate than FIRST_LR are named with it")
    p.add_argument("--gate-only", action="store_true",
                   help="measure the gate (the starts) and write the report with it from the records; train nothing")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    flags = ["--model-name", STARTS[cli.start], *RECIPE, "--learning-rate", f"{cli.learning_rate:g}", "--total-steps",
             str(cli.steps), "--num-eval-problems", str(cli.num_eval_problems)]
    start = {s: start_record(os.path.join(cli.records, tagged(cli.start, f"start_seed{s}.json")), cli.judge_problems,
                             s, make=not cli.report_only, start=cli.start) for s in cli.seeds}
    p0 = float(np.mean([r["sampled"] for r in start.values()]))
    declared = claim(start, p0, cli.steps)
    lines, failed = gate(declared, {"leaks": 0, "contexts": 0})
    mech_lines, mech_failed = mechanism_gate(p0, cli.steps)
    section = gate_section([(lines + mech_lines, failed + mech_failed)])
    failed = failed + mech_failed
    print("\n".join(section))
    res, make = {}, not (cli.report_only or cli.gate_only)
    for seed in cli.seeds:  # seed-major: a finished seed is a complete comparison
        for arm in cli.arms:
            args = run_args(cli, flags, arm, seed)
            if not make and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                continue
            record = finished_run(rloo_sec, args, cli.records, make=make, measure=lambda d, s=seed: {
                **level2(os.path.join(d, "checkpoint"), cli.judge_problems, s), "n": cli.judge_problems})
            if record["measured"].get("n") != cli.judge_problems:
                raise SystemExit(f"error: {args.run_name}: its record judged {record['measured'].get('n')} level-2 "
                                 f"problems, not {cli.judge_problems}; rerun with --judge-problems "
                                 f"{record['measured'].get('n')}, or move the record aside to run it again")
            res[(arm, seed)] = summarise(record, start[seed])
            with open(cli.out, "w") as f:
                f.write(report(res, cli, flags, section, failed, declared.n, p0))
            plot(res, cli.plot, p0)
    text = report(res, cli, flags, section, failed, declared.n, p0)
    if res or cli.gate_only:  # a report from no record at all is left as it is, unless the gate is what was asked
        with open(cli.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
