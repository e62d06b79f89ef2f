"""PPO for small LMs on the paper's own model (issue 39): its three failure modes and its fixes, SmolLM2-135M-Instruct.

The paper (ppo_slm.py, arXiv 2607.25091) trained SmolLM2-135M/360M and Pythia by PPO and reports three failure modes
of small-model PPO, each with a fix, then a preference win rate over the SFT policy. The ground here: testbed-nl
level 3 (three-number sums) in SmolLM2's chat template, `ppo_slm.py --dataset testbed-nl`: chosen = the worked
solution, rejected = the same with one wrong step (its final answer still right: only the reasoning is wrong) or a
wrong final answer, so the reward model can be right and wrong in ways a verifier measures. SFT (LoRA) and the
reward model are trained once (`stages`, seed 1; the RM's held-out pair accuracy, by kind of wrong, is the paper's
"discriminative reward" premise) and passed by path to every arm (STAGE_FLAGS + PPO_FLAGS):

1. the adapter freeze: `--policy-init naive_adapter` (the SFT adapter loaded with PeftModel.from_pretrained, as the
   standard PEFT/TRL path does) against merge-and-reinit: trainable language-model tensors, whether the LoRA moves
   (its B matrices leave 0) and what the run does;
2. bfloat16 ratios: `--ppo-dtype bfloat16` against float32, two PPO steps each from the same SFT model and seed on a
   small batch (bfloat16 can be far slower on a CPU without native bfloat16: 25x under autocast in
   benchmarks/speed/cpu_precision.md): the importance ratio's max, the
   fraction of tokens above 10 or not finite (safety/ratio_above_10) and the guard's skips;
3. reward-model error: N(0, (2 sigma)^2) added to every training score (sigma: the RM score std of the clean run's
   first 5 steps, the paper's stress test) with the safety envelope on (score whitening and clip, reward whitening,
   ratio guard, rollback) and off (all four off); the outcome run is the clean reference;
4. the outcome: PPO with the envelope on and the clean RM, seeds 1 and 2: the win rate over the SFT policy on the
   same held-out prompts, judged by the clean reward model and by the verifier (the final answer), and greedy
   accuracy before and after.

The rules, written before the runs (n held-out prompts; noise of a rate: +-1.96 sqrt(p(1-p)/n), of a difference of
two rates: claim_runs.margin; the collapse rule's "partly" and its noise were made precise after seed 1's envelope-on
run and before any envelope-off run was recorded):
- freeze: shown if the naive path has no trainable language-model tensor and stops before or at its first update,
  while merge-and-reinit trains every LoRA B matrix.
- bfloat16: shown if the bfloat16 run's max ratio exceeds the guard's 5 (or any ratio is above 10 or not finite)
  while float32's stays below 5; else not shown.
- collapse (defined before running): the held-out greedy accuracy ends below half the SFT policy's, or the run stops
  early (rollback limit, KL below -50). Shown if the noisy run collapses with the envelope off and not with it on,
  on every seed run; partly if no run collapses either way but the envelope-off run ends lower on every seed
  (greedy accuracy, the difference beyond the noise of two rates); else not shown.
- outcome: shown if the RM win rate is above 0.5 beyond the noise on both seeds with the verifier's win rate at 0.5
  or above; partly if above 0.5 on both inside the noise, or beyond it on one, or beyond on both with the verifier
  below 0.5; else not shown.

    python -m benchmarks.claims.ppo_slm_smollm2     # stages, then every arm (estimated at 2-3 hours of one thread)
    python -m benchmarks.claims.ppo_slm_smollm2 --seeds 2 --dtypes  # beside it, once the stages are recorded
    python -m benchmarks.claims.ppo_slm_smollm2 --steps 1 --sft-steps 1 --rm-steps 1 --num-eval-prompts 4 \\
        --num-eval-pairs 8 --dtypes fp32 --out /tmp/p.md --output-dir /tmp/p_runs --records /tmp/p_records  # smoke

Every finished run is a record in benchmarks/claims/runs/ppo_slm_smollm2/ (benchmarks/claims/claim_runs.py); ppo_slm.py
writes no checkpoints, so an interrupted run starts again. --report-only writes the report from the records.

The gate (benchmarks/claims/claim_runs.py, `claims`), once the stages are made and before any PPO run: PPO adds nothing
to the prompt; the SFT policy's held-out greedy accuracy must leave room; and 80 prompts must be able to show the
paper's win rate over SFT (the outcome) and a collapse to half the SFT accuracy (the envelope). The freeze and the
bfloat16 checks are counts and maxima, not rates: no gate. A failed gate makes a verdict "untestable here".
"""

import argparse
import os
import time

import torch
import tyro
from safetensors.torch import load_file

import ppo_slm
from benchmarks import ROOT
from benchmarks.claims.claim_runs import Claim, cached, finished_run, gate, gate_section, margin, untestable

MODEL, LEVEL = "smollm2-135m-instruct", 3
NOISE_SIGMAS = 2.0
"""the injected RM error, in units of the RM's score std over the clean seed-1 run's first 5 steps (the paper:
N(0, 2 sigma))"""
ENVELOPE_OFF = ["--no-score-norm", "--no-whiten-rewards", "--no-ratio-guard", "--no-rollback"]


def stage_flags(cli) -> list[str]:
    """The ground of every run: model, data, generation and the two supervised stages (the paper's T 0.9, top-p 0.95
    and LoRA rank 16 for SmolLM2-135M; 64 new tokens: a level-3 worked solution is about 40 tokens)."""
    return ["--model-name", MODEL, "--sft-lora-r", "16", "--lora-r", "16", "--dataset", "testbed-nl",
            "--levels", str(LEVEL), "--num-train-examples", "500",
            "--num-eval-pairs", str(cli.num_eval_pairs), "--num-eval-prompts", str(cli.num_eval_prompts),
            "--max-new-tokens", "64", "--temperature", "0.9", "--top-p", "0.95", "--sft-steps", str(cli.sft_steps),
            "--sft-batch-size", "16", "--rm-steps", str(cli.rm_steps), "--rm-batch-size", "16", "--log-samples", "4"]


def run_args(cli, name: str, seed: int, *flags: str) -> "ppo_slm.Args":
    """One ppo_slm.py run: the stages' flags, the shared SFT adapter and reward model (except for the stages run),
    16 prompts a step in mini-batches of 8, `cli.steps` PPO steps unless `flags` say otherwise."""
    shared = [] if name == "stages" else ["--sft-adapter", os.path.join(cli.output_dir, "stages", "sft_adapter"),
                                          "--reward-model", os.path.join(cli.output_dir, "stages", "reward_model")]
    args = tyro.cli(ppo_slm.Args, args=[*stage_flags(cli), *shared, "--num-prompts", "16", "--minibatch-size", "8",
                                        "--total-steps", str(cli.steps), *flags, "--seed", str(seed),
                                        "--output-dir", cli.output_dir, "--run-name", f"{name}_seed{seed}"
                                        if name != "stages" else "stages"])
    args.num_minibatches = args.num_prompts // args.minibatch_size  # filled in by main(), so in its args.json
    return args


def lora_b_moved(run_dir: str) -> dict:
    """Of the trained policy's LoRA B matrices (0 at the start: the policy starts as the SFT model), how many left 0."""
    adapter = load_file(os.path.join(run_dir, "ppo_adapter", "adapter_model.safetensors"))
    b = [t for n, t in adapter.items() if "lora_B" in n]
    return {"lora_b": len(b), "lora_b_moved": sum(bool(t.abs().sum() > 0) for t in b)}


def naive_freeze(args) -> dict:
    """The naive adapter path run for real: how many language-model tensors it can train, and how the run ends."""
    from peft import PeftModel

    from common.models import load_model
    from grounds import path_of

    policy = PeftModel.from_pretrained(load_model(path_of(MODEL)), args.sft_adapter)
    lora = [n for n, _ in policy.named_parameters() if "lora_" in n]
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    t0 = time.time()
    try:
        out = ppo_slm.main(args)
        ended = f"ran {out['steps']} steps"
    except SystemExit as e:
        ended = str(e)
    return {"lora_tensors": len(lora), "trainable_lm_tensors": len(trainable), "ended": ended,
            "seconds": time.time() - t0}


def claims(cli, sft_greedy: float) -> dict:
    """The gate declarations of the outcome (a win rate over SFT against 0.5) and of the collapse (the envelope-off
    run falling to half the SFT policy's accuracy)."""
    split = f"{cli.num_eval_prompts} held-out level-{LEVEL} prompts"
    common = dict(split=split, n=cli.num_eval_prompts, seeds=list(cli.seeds), start={s: sft_greedy for s in cli.seeds},
                  start_is="greedy accuracy of the SFT policy (every run's start)",
                  contexts_are="none: PPO adds nothing to the prompt; the reward model scores the samples")
    return {"outcome": Claim(**common, effect=0.08, against=0.5, name="outcome",
                             effect_is="the paper: win rates 0.565-0.597 over SFT for SmolLM2-360M, ALGORITHMS.md 8.7"),
            "collapse": Claim(**common, effect=sft_greedy / 2, fall=True, name="collapse",
                              effect_is="the collapse rule: below half the SFT policy's accuracy")}


def steps_of(record: dict) -> list[dict]:
    return [r for r in record["rows"] if "reward/mean" in r]


def evals_of(record: dict) -> list[dict]:
    return [r for r in record["rows"] if "eval/greedy_accuracy" in r]


def collapsed(record: dict, sft_greedy: float, total_steps: int) -> bool:
    """The rule of the module docstring: greedy accuracy below half the SFT policy's, or stopped early."""
    final = evals_of(record)[-1]
    return final["eval/greedy_accuracy"] < sft_greedy / 2 or len(steps_of(record)) < total_steps


def fate(record: dict, collapsed_: bool) -> str:
    """'collapsed (0.300)', 'collapsed (stopped at step 12, 0.700)' or 'did not collapse (0.775)': with the final
    greedy accuracy."""
    n, acc = len(steps_of(record)), evals_of(record)[-1]["eval/greedy_accuracy"]
    stopped = f"stopped at step {n}, " if collapsed_ and n < record["args"]["total_steps"] else ""
    return f"{'collapsed' if collapsed_ else 'did not collapse'} ({stopped}{acc:.3f})"


def run_row(name: str, seed: int, rec: dict) -> str:
    steps, first, final = steps_of(rec), evals_of(rec)[0], evals_of(rec)[-1]
    last = steps[-5:] or [{}]
    mean = lambda k: sum(r.get(k, 0.0) for r in last) / len(last)  # noqa: E731
    return (f"| {name} | {seed} | {len(steps)} | {first['eval/greedy_accuracy']:.3f} -> "
            f"{final['eval/greedy_accuracy']:.3f} | {first['eval/rm_score']:.3f} -> {final['eval/rm_score']:.3f} | "
            f"{final['eval/win_rate_rm']:.3f} | {final['eval/win_rate_verifier']:.3f} | {mean('policy/kl_ref'):.2f} | "
            f"{max(r['safety/max_ratio'] for r in steps):.2f} | {sum(r['safety/ratio_guard_skips'] for r in steps)} | "
            f"{final.get('safety/rollbacks', 0)} | {rec['seconds'] / 60:.0f} |")


def report(cli, stages: dict, naive: dict | None, runs: dict, sigma: float | None) -> str:
    n = cli.num_eval_prompts
    s0 = evals_of(stages)[0]
    sft_greedy = s0["eval/greedy_accuracy"]
    gates = {name: gate(c, {"leaks": 0, "contexts": 0}) for name, c in claims(cli, sft_greedy).items()}
    gated = lambda name, v: f"{untestable(gates[name][1])} (the rule alone: {v})" if gates[name][1] else v  # noqa: E731
    kinds = " ".join(f"{k.split('/')[-1]} {s0[k]:.3f}" for k in sorted(s0) if k.startswith("rm/pair_accuracy/"))
    lines = ["# PPO for small LMs on SmolLM2-135M-Instruct (issue 39)", "",
             f"`python -m benchmarks.claims.ppo_slm_smollm2 --steps {cli.steps} --sft-steps {cli.sft_steps} --rm-steps "
             f"{cli.rm_steps} --num-eval-prompts {n}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, "
             f"{torch.get_num_threads()} thread(s). Each run: `python ppo_slm.py {' '.join(stage_flags(cli))} "
             "--sft-adapter STAGES/sft_adapter --reward-model STAGES/reward_model --num-prompts 16 --minibatch-size 8 "
             f"--total-steps {cli.steps} --seed S` plus its arm's flags. Held out: {n} level-{LEVEL} prompts, one "
             f"sample each (T 0.9) for the RM score and win rates, greedy for accuracy; a rate's noise is up to "
             f"+-{margin(0.5, 0.5, n) / 2 ** 0.5:.2f} at 0.5.", "", *gate_section(list(gates.values()), list(gates)),
             "## The ground", "",
             f"SFT (LoRA r 16, {cli.sft_steps} steps of 16 worked solutions) and the reward model ({cli.rm_steps} "
             f"steps of 16 pairs) from SmolLM2-135M-Instruct, seed 1, {stages['seconds'] / 60:.0f} minutes. Reward "
             f"model held-out pair accuracy {s0['rm/pair_accuracy']:.3f} on {cli.num_eval_pairs} pairs (by what is "
             f"wrong in the rejected solution: {kinds}; a wrong step keeps the right final answer). The SFT policy: "
             f"greedy accuracy {sft_greedy:.3f}, mean RM score of its samples {s0['eval/rm_score']:.3f}."]
    head = ["", "| run | seed | steps | greedy accuracy | RM score | win rate (RM) | win rate (verifier) | KL to ref "
            "(last 5) | max ratio | guard skips | rollbacks | minutes |", "|---|---|" + "---|" * 10]
    if naive is not None:
        moved = runs.get(("ppo", 1), {}).get("measured", {})
        lines += ["", "## 1. The adapter freeze", "",
                  f"Naive path (`--policy-init naive_adapter`): {naive['trainable_lm_tensors']} trainable of "
                  f"{naive['lora_tensors']} LoRA tensors after PeftModel.from_pretrained; the run: {naive['ended']}"]
        if moved:
            lines += ["", f"Merge-and-reinit (the outcome run, seed 1): {moved['lora_b_moved']} of {moved['lora_b']} "
                      f"LoRA B matrices moved off their starting 0 in {cli.steps} steps."]
            shown = naive["trainable_lm_tensors"] == 0 and "freeze" in naive["ended"] and \
                moved["lora_b_moved"] == moved["lora_b"] > 0
            lines += ["", f"Verdict, freeze: {'shown' if shown else 'not shown'} (rule: module docstring)."]
    dtypes = [dt for dt in ("fp32", "bf16") if (dt, 1) in runs]
    if dtypes:
        lines += ["", "## 2. bfloat16 importance ratios", "",
                  f"`--ppo-dtype float32` / `bfloat16`, {cli.bf16_steps} PPO steps of 8 prompts (mini-batches of 4), "
                  "32 new tokens, seed 1, the same SFT model.", "",
                  "| dtype | max ratio | largest fraction of a step's tokens with ratio > 10 or not finite | "
                  "guard skips | logits fixed | minutes |",
                  "|---|---|---|---|---|---|"]
        stats = {}
        for dt in dtypes:
            st = steps_of(runs[(dt, 1)])
            stats[dt] = (max(r["safety/max_ratio"] for r in st), max(r["safety/ratio_above_10"] for r in st))
            lines.append(f"| {dt} | {stats[dt][0]:.3g} | {stats[dt][1]:.4f} | "
                         f"{sum(r['safety/ratio_guard_skips'] for r in st)} | "
                         f"{sum(r['safety/logit_fixes'] for r in st)} | {runs[(dt, 1)]['seconds'] / 60:.0f} |")
        bad = lambda m, f: not m <= 5 or f > 0  # noqa: E731 (NaN counts as bad)
        if len(dtypes) == 2:
            shown = bad(*stats["bf16"]) and not bad(*stats["fp32"])
            lines += ["", "Verdict, bfloat16: untestable here: the check cannot fail on this ground. The old and the new "
                      "log-probs of a ratio come from the same forward (the same dtype and batch size, a float32 "
                      "log-softmax), so a ratio moves only with the update, in either dtype (issue 56; the rule "
                      f"alone: {'shown' if shown else 'not shown'})."]
        else:
            lines += ["", f"Incomplete: only the {dtypes[0]} run is recorded; rerun the command."]
    noisy = sorted(k for k in runs if k[0].startswith("noisy"))
    if noisy:
        lines += ["", "## 3. Reward-model error", "",
                  f"N(0, ({NOISE_SIGMAS:g} x {sigma:.3f})^2) added to every training score (sigma: RM score std of the "
                  "clean seed-1 run's first 5 steps); evaluation with the clean RM. Envelope off: " +
                  " ".join(f"`{f}`" for f in ENVELOPE_OFF) + ". Collapse: greedy accuracy below "
                  f"{sft_greedy / 2:.3f} (half the SFT policy's) or an early stop.", *head]
        for name, seed in noisy:
            lines.append(run_row(name, seed, runs[(name, seed)]))
        seeds = sorted({s for _, s in noisy if ("noisy_on", s) in runs and ("noisy_off", s) in runs})
        if seeds != sorted(cli.seeds) or len(seeds) < 2:
            lines += ["", f"Incomplete: seeds with both noisy runs {seeds or 'none'} of {list(cli.seeds)} (a verdict "
                      "needs two); rerun the command."]
        else:
            col = {(a, s): collapsed(runs[(a, s)], sft_greedy, cli.steps) for a in ("noisy_on", "noisy_off")
                   for s in seeds}
            acc = {(a, s): evals_of(runs[(a, s)])[-1]["eval/greedy_accuracy"] for a in ("noisy_on", "noisy_off")
                   for s in seeds}
            if all(col[("noisy_off", s)] and not col[("noisy_on", s)] for s in seeds):
                verdict = "shown"
            elif any(col[("noisy_on", s)] for s in seeds):
                verdict = "not shown (the envelope did not prevent a collapse)"
            elif not any(col.values()) and all(acc[("noisy_on", s)] - acc[("noisy_off", s)] >
                                               margin(acc[("noisy_on", s)], acc[("noisy_off", s)], n) for s in seeds):
                verdict = ("partly shown (no collapse either way; the envelope ends higher beyond the noise on each "
                           "seed)")
            else:
                verdict = "not shown"
            lines += ["", f"Verdict, collapse (seeds {seeds}): {gated('collapse', verdict)}. " + "; ".join(
                f"seed {s}: off {fate(runs[('noisy_off', s)], col[('noisy_off', s)])}, "
                f"on {fate(runs[('noisy_on', s)], col[('noisy_on', s)])}" for s in seeds)]
    outcome = sorted(s for a, s in runs if a == "ppo")
    if outcome:
        lines += ["", "## 4. The outcome: PPO against the SFT policy", *head]
        lines += [run_row("ppo", s, runs[("ppo", s)]) for s in outcome]
        if outcome == sorted(cli.seeds) and len(outcome) >= 2:
            win = {s: evals_of(runs[("ppo", s)])[-1] for s in outcome}
            beyond = [win[s]["eval/win_rate_rm"] - 0.5 > margin(0.5, 0.5, n) / 2 ** 0.5 for s in outcome]
            above = [win[s]["eval/win_rate_rm"] > 0.5 for s in outcome]
            verifier_ok = all(win[s]["eval/win_rate_verifier"] >= 0.5 for s in outcome)
            verdict = ("shown" if all(beyond) and verifier_ok else
                       "partly shown" if all(above) or any(beyond) else "not shown")
            lines += ["", f"Verdict, outcome: {gated('outcome', verdict)} (RM win rates " + ", ".join(
                f"{win[s]['eval/win_rate_rm']:.3f}" for s in outcome) + "; verifier " + ", ".join(
                f"{win[s]['eval/win_rate_verifier']:.3f}" for s in outcome) + ")."]
        else:
            lines += ["", f"Incomplete: outcome seeds finished {outcome} of {list(cli.seeds)}; rerun the command."]
    return "\n".join(lines) + "\n"


ARMS = ("ppo", "noisy_on", "noisy_off")
"""The arms made per seed (the stages, the naive path and the ratio runs are made once, with seed 1)."""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of the outcome and noisy-RM runs")
    p.add_argument("--steps", type=int, default=40, help="PPO steps of the outcome and noisy-RM runs")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--rm-steps", type=int, default=150)
    p.add_argument("--bf16-steps", type=int, default=2, help="PPO steps of the float32 / bfloat16 ratio runs")
    p.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="the ratio runs to make (bf16 can be far slower on a CPU: leave it out of a smoke run)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                   help="the per-seed arms to make (two processes can share a seed's arms; the full report afterwards: "
                        "--report-only)")
    p.add_argument("--num-eval-prompts", type=int, default=80)
    p.add_argument("--num-eval-pairs", type=int, default=200)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "ppo_slm_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join("runs", "ppo_slm_smollm2"), help="run folders")
    p.add_argument("--records", default=os.path.join(ROOT, "benchmarks", "claims", "runs", "ppo_slm_smollm2"))
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # the runs' --sft-adapter / --reward-model are relative: records made in one clone read in another
    stages_args = run_args(cli, "stages", 1)
    stages_args.total_steps = 0  # SFT, the reward model and the SFT policy's evaluation only
    runs, naive, sigma = {}, None, None

    def write():
        with open(cli.out, "w") as f:
            f.write(report(cli, stages, naive, runs, sigma))

    def have(args) -> bool:
        return os.path.exists(os.path.join(cli.records, f"{args.run_name}.json"))

    plan = [("ppo", s, []) for s in cli.seeds if "ppo" in cli.arms or cli.report_only]
    arm_runs = [run_args(cli, a, s, *f) for a, s, f in plan]
    small = ["--num-prompts", "8", "--minibatch-size", "4", "--max-new-tokens", "32", "--num-eval-prompts", "4",
             "--total-steps", str(cli.bf16_steps)]
    ratio_runs = {dt: run_args(cli, dt, 1, *small, "--ppo-dtype", "float32" if dt == "fp32" else "bfloat16")
                  for dt in cli.dtypes}
    naive_args = run_args(cli, "naive", 1, "--policy-init", "naive_adapter", "--total-steps", "2")
    names = ([a.run_name for a in arm_runs + list(ratio_runs.values())] + ["naive"] +
             [f"{a}_seed{s}" for s in cli.seeds for a in ("noisy_on", "noisy_off")])
    need_weights = not cli.report_only and not all(os.path.exists(os.path.join(cli.records, f"{name}.json"))
                                                   for name in names)  # a run to make needs the stages' folder
    stages = finished_run(ppo_slm, stages_args, cli.records, weights=need_weights, make=not cli.report_only)
    if (1 in cli.seeds and not cli.report_only) or os.path.exists(os.path.join(cli.records, "naive.json")):
        naive = cached(os.path.join(cli.records, "naive.json"), {"args": naive_args.run_name, "steps": cli.steps,
                                                                 "sft_steps": cli.sft_steps},
                       lambda: naive_freeze(naive_args), make=not cli.report_only)
    for (arm, seed, _), args in zip(plan, arm_runs):
        if cli.report_only and not have(args):
            continue
        runs[(arm, seed)] = finished_run(ppo_slm, args, cli.records, lora_b_moved, make=not cli.report_only)
        write()
    for dt, args in ratio_runs.items():
        if cli.report_only and not have(args):
            continue
        runs[(dt, 1)] = finished_run(ppo_slm, args, cli.records, make=not cli.report_only)
        write()
    ref = run_args(cli, "ppo", 1)  # sigma of the injected error: the clean seed-1 run's, whatever seeds run here
    clean = runs.get(("ppo", 1)) or (finished_run(ppo_slm, ref, cli.records, lora_b_moved, make=not cli.report_only)
                                        if have(ref) else None)
    if clean is not None:
        sigma = sum(r["rm/score_std"] for r in steps_of(clean)[:5]) / len(steps_of(clean)[:5])
        for seed in cli.seeds:
            for arm, flags in (("noisy_on", []), ("noisy_off", ENVELOPE_OFF)):
                if arm not in cli.arms and not cli.report_only:
                    continue
                args = run_args(cli, arm, seed, *flags, "--rm-noise-std", f"{NOISE_SIGMAS * sigma:.4f}")
                if cli.report_only and not have(args):
                    continue
                runs[(arm, seed)] = finished_run(ppo_slm, args, cli.records, make=not cli.report_only)
                write()
    write()
    with open(cli.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
