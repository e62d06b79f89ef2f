"""OC-GRPO's claim on a real model (issues 38, 60): guided rollouts past the learning cliff, on SmolLM2-135M-Instruct.

The claim: when every unguided rollout of a prompt fails, GRPO gets no signal; OC-GRPO rolls the group out again
from a prompt that carries the first steps of the reference solution, trains those rollouts as answers to the
unguided prompt with an importance weight, and beats GRPO. The premise comes first, read back from the records of
benchmarks/premises/oc_grpo_premise_smollm2.py (never measured here: a missing record is a one-line error naming its
command): a testbed-nl level whose unguided sampled pass@8 lies in [0.05, 0.30] and whose guided prompts (solution
prefixes stopping before the step that states the result) lift it beyond the noise, with leakage 0. The passing level
with the largest lift is the cliff level, and its passing fractions are the OC arms' --prefix-fractions. When no level
passes, the benchmark stops after the gate with the verdict "untestable here: premise, <figures>", before any arm.

Four arms, the same recipe, steps, prompts per step, seeds and held-out problems (testbed-nl levels 1, 2 and the
cliff): GRPO (grpo.py); OC-GRPO (oc_grpo.py, per-token correction); OC-GRPO with --correction none; GRPO whose group
size is the completions per prompt and step that the OC-GRPO run of the same seed drew (the sample-matched control).
Measured: held-out greedy accuracy per level before and after (the trainers' own evaluation), and, from each run's
final weights on the held-out cliff-level problems, sampled accuracy and pass@k, the KL to the initial policy and the
entropy (`probe`); per step, the all-fail groups the cascade rescued and the policy's entropy. Writes
benchmarks/claims/oc_grpo_smollm2.md with the verdict rule of the issue and docs/img/oc_grpo_smollm2.png.

    python -m benchmarks.premises.oc_grpo_premise_smollm2   # the premise first (its records are read here)
    python -m benchmarks.claims.oc_grpo_smollm2       # 4 arms x seeds 1 and 2, 4-5 hours of a 2-core CPU
    python -m benchmarks.claims.oc_grpo_smollm2 --seeds 1 --steps 2 --num-eval-problems 2 --probe-samples 2 \\
        --out /tmp/oc.md --plot /tmp/oc.png --output-dir /tmp/oc_runs --records /tmp/oc_records   # a smoke run

Budget: in the smoke run a step took 61-65 s on one thread (GRPO and OC-GRPO, step 1), so a run of 30 steps is
30-40 minutes with its evaluations and probe, a seed of four runs 2-2.5 hours, and the two seeds 4-5 hours: far
beyond the 90 minutes of ../shared/CLAIMS.md, kept so because 30 steps is the recipe of the other SmolLM2 claims
(grpo_smollm2, rloo_sec_smollm2). So the benchmark outlives a session: seeds run one after the other (a finished seed is
a complete comparison), the report is rewritten after every run, every finished run is kept as a record in
benchmarks/claims/runs/oc_grpo_smollm2/ (benchmarks/claims/claim_runs.py: read back, not rerun), and an unfinished one
continues from its last checkpoint (every --save-every steps; run folders are not committed, so within one checkout)
through the trainer's own --resume. Rerun the same command until the report says it is complete; --report-only writes
the report from the records and runs nothing.

The gate (benchmarks/claims/claim_runs.py, `claim`), before any arm trains: the guidance the OC arms add to each judged
problem (the held-out cliff-level problems of every seed, at every fraction of the cascade) must not state the answer;
the claim is about discovering the solutions of all-fail groups, so its headroom is the base model's sampled pass@k
on them (the probe, measured first); and 40 problems a seed must be able to show the paper's gain over GRPO. With no
level passing the premise, the gate is read on FALLBACK (the former cliff, level 3, at the premise's fractions), so
that the report still says what else would stop the claim.
"""

import argparse
import dataclasses
import os
import time

import numpy as np
import torch
import tyro

import grpo
import oc_grpo
from benchmarks import ROOT
from benchmarks.premises import oc_grpo_premise_smollm2 as premise
from benchmarks.claims.claim_runs import (GROUND, Claim, added_text, cached, finished_run, gate, gate_section, margin,
                                          recorded_leakage, records_ground, untestable)
from common.data import encode_prompts, load_problems, render_prompt
from common.evaluate import pass_at_k
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine, batched_logprobs, completion_logprobs
from common.verifiers import score
from grounds import path_of

MODEL = "smollm2-135m-instruct"
GROUP, MICRO = 8, 16


@dataclasses.dataclass(frozen=True)
class Design:
    """What the premise decides: the cliff level (the level the claim is about) and the OC arms' prefix fractions."""
    cliff: int
    fractions: tuple

    @property
    def levels(self) -> tuple:
        """The training mix: levels 1 and 2 (a signal for GRPO from the first step) and the cliff."""
        return tuple(sorted({1, 2, self.cliff}))

    @property
    def cascade(self) -> list:
        return ["--prefix-fractions", *(f"{f:g}" for f in self.fractions)]


FALLBACK = Design(3, tuple(f for f in premise.FRACTIONS if f > 0))
"""where the gate is read when no level passes the premise: the former cliff, at the premise's guided fractions"""


def recipe(design: Design) -> list:
    return ["--model-name", MODEL, "--dataset", "testbed-nl", "--levels", *map(str, design.levels),
            "--num-prompts", "4", "--group-size", str(GROUP), "--max-new-tokens", str(premise.MAX_NEW_TOKENS),
            "--share-prompt",
            "--learning-rate", "2e-5", "--eval-samples", "0", "--log-samples", "4", "--eval-every", "0"]


# arm: (run folder tag, trainer, its own flags; None: the sample-matched group size, read from the OC-GRPO run); an
# oc_grpo arm gets the design's cascade before its flags
ARMS = {"GRPO": ("grpo", grpo, []),
        "OC-GRPO": ("oc_grpo", oc_grpo, []),
        "OC-GRPO, no correction": ("oc_grpo_nocorr", oc_grpo, ["--correction", "none"]),
        "GRPO, sample-matched": ("grpo_matched", grpo, None)}
VERDICT_ARMS = ("OC-GRPO", "GRPO", "GRPO, sample-matched")  # the method and the two controls of the rule
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "oc_grpo_smollm2")  # finished runs, committed


def matched_group_size(rows: list, group_size: int, num_prompts: int) -> int:
    """Completions per prompt and step that an OC-GRPO run drew, rounded: G for each prompt, and G more for each
    prefix fraction the cascade tried on each all-fail group (a group rescued at the i-th fraction cost i tries, one
    never rescued tried them all).

    >>> matched_group_size([{"guide/zero_reward_groups": 2.0, "guide/rescued_groups": 1.0, "guide/groups_at_f1": 1.0}],
    ...                    8, 4)
    12
    """
    draws = []
    for r in rows:
        fracs = sorted(float(k[len("guide/groups_at_f"):]) for k in r if k.startswith("guide/groups_at_f"))
        tries = sum((i + 1) * r[f"guide/groups_at_f{f:g}"] for i, f in enumerate(fracs))
        tries += len(fracs) * (r["guide/zero_reward_groups"] - r["guide/rescued_groups"])
        draws.append(group_size * (num_prompts + tries))
    return max(group_size, round(float(np.mean(draws)) / num_prompts))


def claim(cli, base_probes: dict, problems: dict, design: Design) -> Claim:
    """The claim's gate declaration: OC-GRPO above GRPO at the cliff level by the paper's margin."""
    return Claim(split=f"held-out level {design.cliff}, {cli.num_eval_problems} problems a seed (the trainers' "
                 "evaluation)",
                 n=min(len({p.question for p in ps}) for ps in problems.values()), seeds=list(cli.seeds),
                 start={s: base_probes[s]["pass_at_k"] for s in cli.seeds},
                 start_is=f"sampled pass@{cli.probe_samples} of the base model (discovering solutions: the probe)",
                 effect=0.039, effect_is="the paper: OC-GRPO +3.9 points over GRPO, ALGORITHMS.md 2.8",
                 contexts_are=f"the guidance of every judged problem at each fraction of `{' '.join(design.cascade)}`")


def guidance(problems: dict, tokenizer, design: Design) -> list:
    """(what the guided prompt adds to the plain one, the gold answer) for every judged problem and fraction."""
    return [(added_text(render_prompt(p, tokenizer), premise.guided_prompt(p, tokenizer, f)), p.answer)
            for ps in problems.values() for p in ps for f in design.fractions]


# --- the probe: sampled answers of the final policy on held-out cliff-level problems -------------------------------
@torch.no_grad()
def probe(model, base, tokenizer, problems: list, k: int, max_new_tokens: int, seed: int) -> dict:
    """k answers per problem sampled at T = 1 from `model`: sampled accuracy and pass@k (a cut answer scores 0), the
    mean per-token entropy of `model` along them, and, when `base` is given, KL(model || base) estimated on them:
    per token the k3 estimator exp(-d) - 1 + d with d = log pi_model - log pi_base, per answer the sum of d (k1)."""
    torch.manual_seed(seed)
    prompts = encode_prompts(tokenizer, [render_prompt(p, tokenizer) for p in problems])
    out = HFEngine(model, tokenizer).generate(prompts, n=k, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    correct = score(out.texts, [p for p in problems for _ in range(k)], out.truncated_B)
    per_problem = [int(sum(correct[i * k : (i + 1) * k])) for i in range(len(problems))]
    mask_BC, logps, entropies = out.completion_mask_BC, [], []
    for s in range(0, len(out.texts), 2 * k):  # two problems' answers at a time, their prompt shared
        logp, ent = completion_logprobs(model, out.input_ids_BT[s : s + 2 * k], out.attention_mask_BT[s : s + 2 * k],
                                        out.prompt_len, 1.0, with_entropy=True, share_prompt=k > 1)
        logps.append(logp)
        entropies.append(ent)
    logp_BC, entropy_BC = torch.cat(logps) * mask_BC, torch.cat(entropies) * mask_BC
    res = {"sampled_accuracy": sum(per_problem) / (k * len(problems)), "k": k,
           "pass_at_k": float(np.mean([pass_at_k(k, c, k) for c in per_problem])),
           "entropy": (entropy_BC.sum() / mask_BC.sum()).item(), "completion_len": mask_BC.sum(1).mean().item(),
           "truncated": out.truncated_B.float().mean().item()}
    if base is not None:
        d_BC = (logp_BC - batched_logprobs(base, out, 1.0, 2 * k, share_prompt=k > 1)) * mask_BC
        res["kl_token_k3"] = ((torch.expm1(-d_BC) + d_BC) * mask_BC).sum().item() / mask_BC.sum().item()
        res["kl_answer_k1"] = d_BC.sum(1).mean().item()
    return res


def cached_probe(path: str, settings: dict, model_dir: str, with_kl: bool, problems: list, make: bool = True) -> dict:
    """The probe of the model in `model_dir` (with the KL to the initial model if `with_kl`), read back from `path`
    when it was made with the same settings, else measured and written there."""
    def measure():
        t0, base_dir = time.time(), path_of(MODEL)
        tokenizer = load_tokenizer(base_dir)  # the trainers' tokenizer: the chat template's default system turn
        model = load_model(model_dir).eval()
        base = load_model(base_dir).eval() if with_kl else None
        res = probe(model, base, tokenizer, problems, settings["k"], settings["max_new_tokens"], settings["seed"])
        return {**res, "seconds": time.time() - t0}

    return cached(path, settings, measure, make)


# --- summaries, verdict, report, plot ------------------------------------------------------------------------------
def summarise(record: dict, levels: tuple) -> dict:
    steps = [r for r in record["rows"] if "reward/mean" in r]
    evals = [r for r in record["rows"] if "eval/greedy_accuracy" in r]
    trained = [r for r in steps if "policy/entropy" in r]  # a step with no signal anywhere has no update
    guided = [r for r in steps if r.get("guide/guided_groups")]
    zero = sum(r.get("guide/zero_reward_groups", 0.0) for r in steps)
    saved = record["args"]
    per_step = saved["num_prompts"] * saved["group_size"]
    per_step += saved["group_size"] * float(np.mean([r.get("guide/zero_reward_groups", 0.0) for r in steps]))
    head, tail = trained[:5], trained[-5:]
    return {
        "rows": steps, "wall_s": record["seconds"], "probe": record["measured"]["probe"],
        "group_size": saved["group_size"], "completions_per_step": per_step,
        "before": {lv: evals[0][f"eval/greedy_accuracy/level_{lv}"] for lv in levels},
        "after": {lv: evals[-1][f"eval/greedy_accuracy/level_{lv}"] for lv in levels},
        "no_signal": float(np.mean([r["adv/frac_zero_std"] for r in steps])),
        "skipped": sum(r.get("update/skipped", 0.0) for r in steps),
        "rescued": (sum(r.get("guide/rescued_groups", 0.0) for r in steps) / zero) if zero else float("nan"),
        "is_weight": float(np.mean([r["is/weight_mean"] for r in guided])) if guided else float("nan"),
        "at_clamp": float(np.mean([r["is/frac_at_clamp"] for r in guided])) if guided else float("nan"),
        "entropy_first": float(np.mean([r["policy/entropy"] for r in head])) if head else float("nan"),
        "entropy_last": float(np.mean([r["policy/entropy"] for r in tail])) if tail else float("nan"),
        "grad_norm_max": max((r["optim/grad_norm"] for r in trained), default=float("nan")),
    }


def verdict(res: dict, seeds: list, n: int, cliff: int) -> tuple[str | None, list]:
    """The issue's rule at the `cliff` level over `seeds` (each with the three VERDICT_ARMS): 'shown' if OC-GRPO beats
    both GRPO and the sample-matched GRPO beyond the noise on every seed; 'partly' if some of those comparisons are
    beyond the noise in its favour, 'not shown' if none; None without a seed. Also a line per comparison."""
    lines, wins, total = [], 0, 0
    for seed in seeds:
        oc = res[("OC-GRPO", seed)]
        for control in VERDICT_ARMS[1:]:
            a, b = oc["after"][cliff], res[(control, seed)]["after"][cliff]
            m = margin(a, b, n)
            beyond = a - b > m
            wins, total = wins + beyond, total + 1
            lines.append(f"- seed {seed}, OC-GRPO against {control}: {a:.3f} against {b:.3f}, difference "
                         f"{a - b:+.3f}, noise +-{m:.3f}: {'beyond the noise' if beyond else 'within the noise'}"
                         f"{'' if beyond or a >= b else ' (OC-GRPO lower)'}")
    if not total:
        return None, lines
    return ("shown" if wins == total else "partly" if wins else "not shown"), lines


def command_line(cli) -> str:
    return (f"`python -m benchmarks.claims.oc_grpo_smollm2 --seeds {' '.join(map(str, cli.seeds))} --steps {cli.steps} "
            f"--num-eval-problems {cli.num_eval_problems} --probe-samples {cli.probe_samples} --save-every "
            f"{cli.save_every}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU (shared), float32")


def premise_section(results: dict, design: Design | None) -> list[str]:
    """The premise table as its records hold it, which levels pass, and the design they give."""
    base = results["base"]
    k = next(iter(base.values()))["k"]
    return ["## The premise (benchmarks/premises/oc_grpo_premise_smollm2.md, read back from its records)", "",
            f"`{premise.COMMAND}`: sampled pass@{k} on each level's held-out problems (seed 1) from oc_grpo.py's "
            "guided prompt at each prefix fraction (0: the plain prompt; every fraction stops before the step that "
            "states the result), with the leakage of the guidance. A level passes on the base model (which the arms "
            f"train from) when its unguided pass@{k} lies in [{premise.BAND[0]:.2f}, {premise.BAND[1]:.2f}] and a "
            "guided fraction lifts it beyond the noise rule's margin with leakage 0.", "",
            *premise.premise_lines(base), "",
            (f"Cliff level {design.cliff}, `{' '.join(design.cascade)}` (of the passing levels, the one with the "
             "largest lift; its passing fractions)." if design else
             f"Cliff level: none, {premise.untestable_figures(base)}."), "",
            *premise.table_lines(results), ""]


def untestable_report(cli, section: list, failed: list, premised: list, results: dict) -> str:
    """The report of a benchmark stopped before any arm: no level holds the premise."""
    status = untestable([f"premise, {premise.untestable_figures(results['base'])}", *failed])
    return "\n".join(["# OC-GRPO on SmolLM2-135M-Instruct (issues 38, 60): guided rollouts past the learning cliff", "",
                      f"{command_line(cli)}; no arm ran: no testbed-nl level holds the premise.", "", *section,
                      *premised, "## Verdict", "",
                      f"**{status}**: with no level whose unguided pass@k is low but not zero and lifted by "
                      "guidance that does not state the answer, OC-GRPO has nothing to rescue that GRPO could not "
                      f"find, or no guidance to rescue it with. The gate above is read on level {FALLBACK.cliff} at "
                      f"`{' '.join(FALLBACK.cascade)}` (the former cliff; no level is the cliff now)."]) + "\n"


def report(res: dict, cli, flags: list, base_probes: dict, section: list, failed: list, premised: list,
           design: Design) -> str:
    n, k, cliff, levels = cli.num_eval_problems, cli.probe_samples, design.cliff, design.levels
    cascade = " ".join(design.cascade)
    f3 = lambda x: "n/a" if x != x else f"{x:.3f}"  # noqa: E731 - nan (no guided rows, no OC arm) -> n/a
    done = {s: all((arm, s) in res for arm in cli.arms) for s in cli.seeds}
    status, lines = verdict(res, [s for s in cli.seeds if all((a, s) in res for a in VERDICT_ARMS)], n, cliff)
    if status is not None and failed:
        status = f"{untestable(failed)} (the rule alone: {status})"
    run_min = sum(r["wall_s"] for r in res.values()) / 60
    probe_min = sum(r["probe"]["seconds"] for r in res.values()) / 60
    out = ["# OC-GRPO on SmolLM2-135M-Instruct (issues 38, 60): guided rollouts past the learning cliff", "",
           f"{command_line(cli)}, {run_min:.0f} minutes of runs{'' if all(done.values()) else ' so far'} (each run's "
           f"own steps and evaluations; the probes {probe_min:.0f} minutes more). Each run is", "",
           f"    python {{grpo,oc_grpo}}.py {' '.join(flags)} --seed S --micro-batch-size M [arm flags]", "",
           f"with the arm's flags: GRPO none (G = {GROUP}, M = {MICRO}); OC-GRPO `{cascade}`; OC-GRPO, no "
           f"correction `{cascade} --correction none`; GRPO, sample-matched `--group-size G'` with G' the "
           "completions per prompt and step the OC-GRPO run of the same seed drew (G for the prompt, G more for "
           "each fraction the cascade tried on its all-fail group), rounded, and M = a multiple of G' (--share-prompt "
           "keeps a group in one micro-batch; gradients do not depend on M).", "", *section, *premised,
           "## Design", "",
           f"- Premise: the section above. Level {cliff} is the cliff: of the levels whose unguided sampled pass@8 is "
           "low but not zero, the one a solution prefix lifts most, with guidance that does not state the answer; "
           "its passing fractions are the cascade. Greedy figures of the older table "
           "(benchmarks/premises/testbed_premises_smollm2.md) are not the premise: OC-GRPO rescues a group from "
           "sampled replies.",
           f"- Training mix: testbed-nl levels {', '.join(map(str, levels))}, drawn uniformly (1/{len(levels)} of the "
           "prompts each). Levels 1 and 2 give GRPO a signal from the first step (0.550 and 0.225 greedy zero-shot, "
           "testbed_premises_smollm2.md), and the answer format it learns on level 1 carries over (grpo_smollm2.md: "
           "levels 1-2, 30 steps, level 2 0.15 -> 0.70). How much of the batch fails whole is in the table (groups "
           f"without signal) and the plot. With 4 prompts a step, {cli.steps} steps bring about "
           f"{round(4 * cli.steps / len(levels))} level-{cliff} groups.",
           f"- Cascade `{cascade}` for both OC arms, lowest fraction first, each prefix cut before the step that "
           "states the result (oc_grpo.render_guided_prompt): a rescue is a success the model found with the first "
           "steps given, not a copied answer. The importance weight pi(y|x) / pi(y|x~) down-weights the tokens the "
           "guidance made likelier; --correction none trains on them at full weight.",
           f"- Recipe as the other SmolLM2 benchmarks (grpo_smollm2, rloo_sec_smollm2): 4 prompts x {GROUP} samples, "
           f"{premise.MAX_NEW_TOKENS} new tokens (the premise's), lr 2e-5, T = 1, one update per step, no KL term; "
           f"{cli.steps} steps; a checkpoint every "
           f"{cli.save_every} steps so that an interrupted run continues.",
           f"- Measured: held-out greedy accuracy per level before and after ({n} problems a level, the same for every "
           f"arm of a seed; a cut answer scores 0). From each run's final weights on the held-out level-{cliff} "
           f"problems (the probe): {k} answers sampled at T = 1 per problem, sampled accuracy and pass@{k}, entropy "
           "per token, and KL(final || initial) on those answers (k3 per token, k1 summed per answer); 'before' is "
           "the base model's probe. Per step: groups with no signal (adv/frac_zero_std), the all-fail groups the "
           "cascade rescued (guide/rescued_groups / guide/zero_reward_groups), the importance weight on guided tokens "
           "and the policy's entropy on the trained rows (policy/entropy).",
           f"- Noise: a cell of {n} problems is +-{1.96 * (0.25 / n) ** 0.5:.2f} at p = 0.5 (95 %). A difference of "
           f"two arms is beyond the noise when it exceeds 1.96 sqrt(2 p (1 - p) / {n}), p their mean accuracy (pooled "
           f"two-proportion test; 0.10 against 0.00: +-{margin(0.1, 0.0, n):.3f}).", "",
           f"## Verdict (the issue's rule, at level {cliff})", ""]
    if not all(done.values()):
        missing = [f"seed {s}" for s, d in done.items() if not d]
        out += [f"Partial: runs of {', '.join(missing)} still to come; rerun the command to continue (finished runs "
                "are read back, an interrupted one resumes from its checkpoint)." + ("" if status is None else
                f" On the complete seeds so far: {status}."), ""]
    elif status is None:
        out += [f"No verdict: the rule needs the arms {', '.join(VERDICT_ARMS)} (--arms).", ""]
    else:
        out += [f"**{status}**: OC-GRPO against GRPO and against the sample-matched GRPO, held-out greedy accuracy at "
                f"level {cliff} after training (shown: beyond the noise against both, on every seed; partly: some of "
                "these comparisons; not shown: none).", ""]
    out += lines
    lv = " | ".join(f"L{x} greedy" for x in levels)
    out += ["", "## Per seed", "",
            f"| arm | seed | {lv} | L{cliff} sampled | L{cliff} pass@{k} | KL to initial (token k3 / answer k1) | "
            f"L{cliff} entropy (probe) | entropy of trained rows (first -> last 5 steps) | groups without signal | "
            "all-fail groups rescued | IS weight (mean / at clamp) | max grad norm | completions a step (G) | wall "
            "min |",
            "|---|---|" + "---|" * (len(levels) + 12)]
    for (arm, seed), r in res.items():
        b, p = base_probes[seed], r["probe"]
        cells = " | ".join(f"{r['before'][x]:.3f} -> {r['after'][x]:.3f}" for x in levels)
        out.append(f"| {arm} | {seed} | {cells} | {b['sampled_accuracy']:.3f} -> {p['sampled_accuracy']:.3f} | "
                   f"{b['pass_at_k']:.3f} -> {p['pass_at_k']:.3f} | {p['kl_token_k3']:.4f} / {p['kl_answer_k1']:.3f} | "
                   f"{b['entropy']:.3f} -> {p['entropy']:.3f} | {r['entropy_first']:.3f} -> {r['entropy_last']:.3f} | "
                   f"{r['no_signal']:.3f} | {f3(r['rescued'])} | {f3(r['is_weight'])} / {f3(r['at_clamp'])} | "
                   f"{r['grad_norm_max']:.2f} | {r['completions_per_step']:.1f} ({r['group_size']}) | "
                   f"{r['wall_s'] / 60:.0f} |")
    out += ["", f"Probe 'before' is the base model on the same problems (its KL is 0). Per-step metrics and probes: "
            f"the runs' records in {os.path.relpath(cli.records, ROOT)}/ (benchmarks/claims/claim_runs.py). "
            f"Plot: {os.path.relpath(cli.plot, ROOT)} (all-fail groups rescued, groups with "
            "a signal and the policy's entropy against step)."]
    return "\n".join(out) + "\n"


def plot(res: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = lambda x: np.convolve(x, np.ones(5), mode="valid") if len(x) >= 5 else np.cumsum(x)  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    seeds = sorted({s for _, s in res})
    for (arm, seed), r in res.items():
        rows, style = r["rows"], dict(color=colours[arm], ls=("-", "--", ":", "-.")[seeds.index(seed) % 4],
                                      label=f"{arm} s{seed}")
        steps = [x["step"] for x in rows]
        steps = steps[len(steps) - len(window(steps)):]  # a 5-step window is plotted at its last step
        count = window(np.ones(len(rows)))
        if arm.startswith("OC"):  # rescued / all-fail groups over the window
            axes[0].plot(steps, window([x["guide/rescued_groups"] for x in rows])
                         / np.maximum(window([x["guide/zero_reward_groups"] for x in rows]), 1), **style)
        axes[1].plot(steps, window([1 - x["adv/frac_zero_std"] for x in rows]) / count, **style)
        trained = [x for x in rows if "policy/entropy" in x]  # a skipped update has no entropy
        if len(trained) >= 5:
            axes[2].plot([x["step"] for x in trained][4:], window([x["policy/entropy"] for x in trained]) / 5, **style)
    titles = ("all-fail groups rescued (OC arms)", "groups with a learning signal", "policy entropy, trained rows")
    for ax, title in zip(axes, titles):
        if ax is not axes[2]:  # the two fractions
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title + " (5-step windows)", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out problems per level")
    p.add_argument("--probe-samples", type=int, default=4, help="answers sampled per held-out cliff-level problem (k)")
    p.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps (what an interruption loses)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "oc_grpo_smollm2.md"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "oc_grpo_smollm2.png"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "oc_grpo_smollm2"), help="run folders")
    p.add_argument("--records", default=RECORDS, help="finished runs' records (committed by default)")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    p.add_argument("--premise-records", default=premise.RECORDS,
                   help="the records of benchmarks/premises/oc_grpo_premise_smollm2.py at its default settings")
    cli = p.parse_args()
    # the premise first, read back from its records (never measured here): it picks the cliff level and cascade
    results = premise.recorded_cells(cli.premise_records)
    picked = premise.cliff_design(results["base"])
    design = Design(picked[0], tuple(picked[1])) if picked else FALLBACK
    premised = premise_section(results, design if picked else None)
    flags = [*recipe(design), "--total-steps", str(cli.steps), "--num-eval-problems", str(cli.num_eval_problems)]
    os.makedirs(cli.records, exist_ok=True)
    res, base_probes, text, cliff = {}, {}, "no run finished\n", {}
    for seed in cli.seeds:  # the gate: the base model's probe on each seed's cliff-level problems, the guidance
        cliff[seed] = [q for q in load_problems("testbed-nl", "test", design.levels, cli.num_eval_problems, seed)
                       if q.level == design.cliff]  # the held-out problems the trainers evaluate on (load_train_eval)
        settings = {"k": cli.probe_samples, "max_new_tokens": premise.MAX_NEW_TOKENS, "seed": seed,
                    "problems": len(cliff[seed]), "level": design.cliff}
        base_probes[seed] = cached_probe(os.path.join(cli.records, f"base_probe_seed{seed}.json"), settings,
                                         path_of(MODEL), False, cliff[seed], make=not cli.report_only)
    tokenizer = load_tokenizer(path_of(MODEL))
    leaks = recorded_leakage(os.path.join(cli.records, "gate_leakage.json"), {
        "seeds": cli.seeds, "cascade": design.cascade, "n": cli.num_eval_problems, "level": design.cliff},
        lambda: guidance(cliff, tokenizer, design), tokenizer,
        records_ground(cli.records) if cli.report_only else GROUND)
    lines, failed = gate(claim(cli, base_probes, cliff, design), leaks)
    section = gate_section([(lines, failed)])
    print("\n".join(section + premised))
    if not picked:  # no level holds the premise: no arm runs
        text = untestable_report(cli, section, failed, premised, results)
        with open(cli.out, "w") as f:
            f.write(text)
        print(text)
        return
    for seed in cli.seeds:  # seed-major: a finished seed is a complete comparison
        problems, settings = cliff[seed], {"k": cli.probe_samples, "max_new_tokens": premise.MAX_NEW_TOKENS,
                                           "seed": seed, "problems": len(cliff[seed]), "level": design.cliff}
        for arm in cli.arms:
            tag, module, extra = ARMS[arm]
            group = GROUP
            if extra is None:  # the sample-matched control: as many completions per prompt as OC-GRPO drew
                oc = res.get(("OC-GRPO", seed))
                if oc is None:
                    print(f"{arm}, seed {seed}: skipped, it needs the OC-GRPO run of this seed (add it to --arms)")
                    continue
                group = matched_group_size(oc["rows"], GROUP, 4)
                extra = ["--group-size", str(group)]
            elif module is oc_grpo:
                extra = [*design.cascade, *extra]
            micro = group * max(1, MICRO // group)
            args = tyro.cli(module.Args, args=[*flags, *extra, "--micro-batch-size", str(micro), "--seed", str(seed),
                                               "--save-every", str(cli.save_every), "--output-dir", cli.output_dir,
                                               "--run-name", f"{tag}_seed{seed}"])
            measure = lambda run_dir: {"probe": cached_probe(  # noqa: E731 - the final weights' probe
                os.path.join(run_dir, "probe.json"), settings, os.path.join(run_dir, "checkpoint"), True, problems)}
            if cli.report_only and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                continue
            res[(arm, seed)] = summarise(finished_run(module, args, cli.records, measure, make=not cli.report_only),
                                         design.levels)
            text = report(res, cli, flags, base_probes, section, failed, premised, design)
            with open(cli.out, "w") as f:
                f.write(text)
            plot(res, cli.plot)
    print(text)


if __name__ == "__main__":
    main()
