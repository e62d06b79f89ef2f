"""PPO for small LMs on the paper's own model (issues 39, 63): its three failure modes and its outcome, SmolLM2-135M.

The paper (ppo_slm.py, arXiv 2607.25091) trained SmolLM2-135M/360M and Pythia by PPO and reports three failure modes
of small-model PPO, each with a fix, then a preference win rate over the SFT policy. The ground here: testbed-nl
level 3 (three-number sums) in SmolLM2's chat template, `ppo_slm.py --dataset testbed-nl`: chosen = the worked
solution, rejected = the same with one arithmetic slip carried forward to a wrong final answer, in an earlier step
('step') or the last ('answer'), so no string cue tells them apart, only the arithmetic (testbed-nl version 2). SFT
(LoRA) is trained once (`stages`, seed 1), then reward models until one tells a wrong answer (the probe), and both
are passed by path to every arm:

0. the reward-model probe (`RM_PROBE`, in order, stopping at the first that passes `tells_wrong_answers`): the stages'
   own RM (the last design's recipe, 150 steps of 16 pairs over 500 pairs), then 4x the steps with every pair new
   (one pass over 9,600 pairs: nothing to memorise), then the same at LoRA rank 64. Each reports its held-out pair
   accuracy by kind and, on as many of its own training pairs, the same: far above held-out, it memorised; and its
   training loss, first and last 25-step window (ppo_slm_stages' loss_curve.json; near log 2: it learnt nothing).
   Beside it the SFT model's own likelihood on the same pairs (`likelihood_prefers`): whether the backbone the RM
   starts from can tell at all. If none passes, `frozen_readout` fits the best linear score head on the SFT
   backbone's frozen last-layer states (2,000 training pairs; at the token a score head reads, at the eos, and the
   mean over the completion): whether the backbone carries a wrong answer where a score head reads, untrained; and
   the head alone trained on those states with the RMs' optimiser (`recipe_head`): whether that optimiser finds what
   is there. The last design's RM (testbed-nl version 1) was 0.491 on the answer kind, chance: its 'step' kind had a
   string cue it learnt (1.000), the arithmetic it did not; the answer is visible to it (read at the last token before
   the eos, which is also the pad token, after "The answer is N").
1. the adapter freeze: `--policy-init naive_adapter` (the SFT adapter loaded with PeftModel.from_pretrained, as the
   standard PEFT/TRL path does) against merge-and-reinit (`fix`): trainable language-model tensors, whether the LoRA
   moves (its B matrices leave 0) and what the run does; 2 steps each;
2. bfloat16 ratios: needs a GPU. The overflow needs CUDA passes whose old and new log-probs disagree; on this CPU
   both come from the same forward in either dtype (issue 56), so nothing runs here. On a GPU:
   `python -m benchmarks.speed.gpu_check --only ppo_ratio` (ppo_slm.py's short testbed run in both dtypes);
3. reward-model error: N(0, (2 sigma)^2) added to every training score (sigma: the RM score std of the clean run's
   first 5 steps, the paper's stress test) with the safety envelope on (score whitening and clip, reward whitening,
   ratio guard, rollback) and off (all four off), if the gate's budget line says a collapse can happen in the steps;
4. the outcome: PPO with the envelope on and the chosen RM, seeds 1 and 2: the win rate over the SFT policy on the
   same held-out prompts, judged by the chosen reward model and by the verifier (the final answer: its win rate and
   greedy accuracy before and after).

The rules, written before the runs (n held-out prompts; noise of a rate: +-1.96 sqrt(p(1-p)/n), of a difference of
two rates: claim_runs.margin):
- reward model: tells a wrong answer if, on each kind of held-out pair, its pair accuracy is above 0.5 by more than
  claim_runs.margin(accuracy, 0.5, that kind's pairs); the first of RM_PROBE that does is every arm's RM. None: the
  outcome is "untestable here: no RM this ground trains tells a wrong answer" and no arm runs.
- budget (collapse): a collapse needs the policy to lose at least COLLAPSE_SHARE of the SFT policy's entropy (mean
  entropy a token of its held-out samples at T 0.9, top-p 0.95, `eval/entropy`). The most a step can lose is read
  from the last design's noisy-RM runs (their policy/entropy over 40 steps: the least-squares slope, averaged, plus
  1.96 standard errors, per unit learning rate); steps x lr x that below the need: "untestable here", no noisy arm.
- freeze: shown if the naive path has no trainable language-model tensor and stops at its first update, while
  merge-and-reinit trains every LoRA B matrix.
- collapse: the held-out greedy accuracy ends below half the run's start (the SFT policy's on its seed's problems),
  or the run stops early (rollback limit, KL below -50). Shown if the noisy run collapses with the envelope off and
  not with it on, on every seed; partly if no run collapses either way but the envelope-off run ends lower on every
  seed beyond claim_runs.margin; else not shown.
- outcome, by the RM (the paper's measure): shown if its win rate is above 0.5 beyond the noise on both seeds and the
  verifier sees no harm (its win rate not below 0.5 beyond the noise and greedy accuracy not below the start beyond
  the noise, each seed); partly if above 0.5 on both inside the noise, or beyond it on one, or beyond on both with
  harm; else not shown. By the verifier, said beside it: greedy accuracy up beyond the noise on both seeds, down
  beyond it on one, up on one only, or neither. (Until issue 63's fourth session a verifier win rate below 0.5 by
  any amount was harm; one sample a prompt puts an unchanged policy there about half the time. Changed before any
  outcome arm of this design ran.)

    python -m benchmarks.claims.ppo_slm_smollm2 --probe-only    # stages, the RM probe and the gate; then:
    python -m benchmarks.claims.ppo_slm_smollm2                 # the freeze pair and what the gate lets run
    python -m benchmarks.claims.ppo_slm_smollm2 --steps 1 --sft-steps 1 --rm-steps 1 --num-eval-prompts 4 \\
        --num-eval-pairs 8 --out /tmp/p.md --output-dir /tmp/p_runs --records /tmp/p_records  # smoke

Time on the loaded 2-core machine, one thread (from the last design's records: SFT and 150 RM steps 64 minutes, a
PPO step about 50 s, a 40-step arm 35-41 minutes at 80 held-out prompts, about 5 more at 160): stages about 70
minutes; each further RM of the probe about 4 x 50 = 200 minutes; the freeze pair about 10; the outcome arms 2 x 45;
the noisy arms, if the budget allows them, 4 x 45. So 3 hours if the stages' RM passes and the collapse stays out of
budget; about 7.5 hours to find that no RM passes (no arm then runs); 10 hours at most. Against the ~90 minutes of a
claim (../shared/CLAIMS.md) that is a 2x to 7x overrun, almost all of it the reward model. Alone on 2 threads
(issue 63's third session) an RM step of the probe took about 9.4 s: about 95 minutes for a 600-step RM. Measured in
all (issue 63's fifth session, when the probe ended with no RM): about 4.3 hours (stages 66 minutes, the two further
RMs about 91 and 92, frozen_readout 7), a 2.8x overrun, all of it the reward model; no arm ran.

Every finished run is a record in benchmarks/claims/runs/ppo_slm_smollm2/v2/ (claim_runs.py); the last design's
records (testbed-nl version 1) stay in the folder above it, read only for the entropy a noisy-RM step loses. ppo_slm.py
keeps no PPO checkpoints, so an interrupted PPO arm starts again; its SFT and RM stages save their state every 25
steps, so an interrupted stage (a probe RM: hours) continues from its last save in the next session (claim_runs'
stage_in_progress). --report-only writes the report from the records.

The gate (claim_runs.py `gate`, plus the reward model and the budget): PPO adds nothing to the prompt; the SFT
policy's held-out greedy accuracy must leave room; 160 prompts must be able to show the paper's win rate over SFT
(+0.08) and a collapse to half the SFT accuracy. The freeze is a count, not a rate: no gate.
"""

import argparse
import dataclasses
import json
import os
import random
import time

import numpy as np
import torch
import tyro
from safetensors.torch import load_file

import ppo_slm
import ppo_slm_stages as stages_lib
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (GROUND, Claim, cached, detectable, finished_run, gate, margin, same_args,
                                          untestable)

MODEL, LEVEL = "smollm2-135m-instruct", 3
NOISE_SIGMAS = 2.0
"""the injected RM error, in units of the RM's score std over the clean seed-1 run's first 5 steps (the paper:
N(0, 2 sigma))"""
ENVELOPE_OFF = ["--no-score-norm", "--no-whiten-rewards", "--no-ratio-guard", "--no-rollback"]
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "ppo_slm_smollm2")
"""the last design's records (testbed-nl version 1): read for the entropy its noisy-RM runs lost, never as runs"""
OLD_NOISY = ("noisy_on_seed1", "noisy_off_seed1", "noisy_on_seed2", "noisy_off_seed2")
RM_PROBE = (("stages", 1, 0, 16), ("rm_x4_one_pass", 4, 1, 16), ("rm_x4_one_pass_r64", 4, 1, 64))
"""the reward models tried, in order: (name, --rm-steps as a multiple of the stages', passes over fresh pairs (0: the
stages' 500 pairs, 4.8 passes at 150 steps), LoRA rank); lr 5e-4 and 16 pairs a step throughout"""
FROZEN_TRAIN_PAIRS = 2000
"""training pairs of the frozen-state readout (frozen_readout), measured once the probe has found no RM"""
COLLAPSE_SHARE = 0.5
"""the share of the SFT policy's entropy a collapse needs to lose (declared before the runs)"""


def stage_flags(cli) -> list[str]:
    """The ground of every run: model, data, generation and the two supervised stages (the paper's T 0.9, top-p 0.95
    and LoRA rank 16 for SmolLM2-135M; 64 new tokens: a level-3 worked solution is about 40 tokens)."""
    return ["--model-name", MODEL, "--sft-lora-r", "16", "--lora-r", "16", "--dataset", "testbed-nl",
            "--levels", str(LEVEL), "--num-train-examples", "500",
            "--num-eval-pairs", str(cli.num_eval_pairs), "--num-eval-prompts", str(cli.num_eval_prompts),
            "--max-new-tokens", "64", "--temperature", "0.9", "--top-p", "0.95", "--sft-steps", str(cli.sft_steps),
            "--sft-batch-size", "16", "--rm-steps", str(cli.rm_steps), "--rm-batch-size", "16", "--log-samples", "4"]


def run_args(cli, name: str, seed: int, *flags: str, rm: str = "") -> "ppo_slm.Args":
    """One ppo_slm.py run: the stages' flags, the stages' SFT adapter (except for the stages run) and the reward model
    `rm` (a folder; none: the run trains its own), 16 prompts a step in mini-batches of 8, `cli.steps` PPO steps unless
    `flags` say otherwise."""
    shared = [] if name == "stages" else ["--sft-adapter", os.path.join(cli.output_dir, "stages", "sft_adapter")]
    args = tyro.cli(ppo_slm.Args, args=[*stage_flags(cli), *shared, *(["--reward-model", rm] if rm else []),
                                        "--num-prompts", "16", "--minibatch-size", "8", "--total-steps",
                                        str(cli.steps), *flags, "--seed", str(seed), "--output-dir", cli.output_dir,
                                        "--run-name", name if name == "stages" or name.startswith("rm_")
                                        else f"{name}_seed{seed}"])
    args.num_minibatches = args.num_prompts // args.minibatch_size  # filled in by main(), so in its args.json
    return args


def probe_args(cli, name: str, times: int, passes: int, rank: int) -> "ppo_slm.Args":
    """An RM of the probe: stage 2 alone from the stages' SFT adapter (no PPO step, 4 held-out prompts for the SFT
    evaluation it also makes; its pairs are the stages' held-out pairs)."""
    steps = times * cli.rm_steps
    pairs = ["--num-train-examples", str(passes * steps * 16)] if passes else []
    return run_args(cli, name, 1, "--rm-steps", str(steps), *pairs, "--rm-lora-r", str(rank), "--total-steps", "0",
                    "--num-eval-prompts", "4")


def rm_folder(args) -> str:
    return os.path.join(args.output_dir, args.run_name, "reward_model")


def kind_counts(args) -> dict:
    """How many of the held-out pairs the RM is judged on are of each kind (the prompts' text does not change them)."""
    pairs = stages_lib.build_pairs(args, "test", args.num_eval_pairs, args.seed, None)
    return {k: sum(e.kind == k for e in pairs) for k in sorted({e.kind for e in pairs})}


def needed_accuracy(n: int) -> float:
    """The least pair accuracy above 0.5 by more than claim_runs.margin(accuracy, 0.5, n), on a 0.001 grid.

    >>> needed_accuracy(110), needed_accuracy(90)
    (0.632, 0.645)
    """
    return next((k / 1000 for k in range(500, 1001) if k / 1000 - 0.5 > margin(k / 1000, 0.5, n)), float("inf"))


def tells_wrong_answers(row: dict, counts: dict) -> bool:
    """The reward-model rule: on every kind of held-out pair (each ends on a wrong final answer), pair accuracy above
    chance beyond the noise.

    >>> counts = {"answer": 110, "step": 90}
    >>> tells_wrong_answers({"rm/pair_accuracy/answer": 0.70, "rm/pair_accuracy/step": 0.66}, counts)
    True
    >>> tells_wrong_answers({"rm/pair_accuracy/answer": 0.491, "rm/pair_accuracy/step": 1.0}, counts)  # the last RM's
    False
    """
    return all(row[f"rm/pair_accuracy/{k}"] > 0.5 + margin(row[f"rm/pair_accuracy/{k}"], 0.5, n)
               for k, n in counts.items())


def entropy_slopes(records: list[dict]) -> tuple[float, float]:
    """The entropy a PPO step loses per unit learning rate in `records` (minus the least-squares slope of each run's
    policy/entropy over its steps, over its learning rate, averaged over the runs) and its standard error.

    >>> rows = lambda lr, f: {"args": {"learning_rate": lr}, "rows": [{"step": s, "reward/mean": 0.0,
    ...                       "policy/entropy": f(s)} for s in range(1, 41)]}
    >>> loss, se = entropy_slopes([rows(1e-3, lambda s: 0.5 - 0.01 * s), rows(1e-3, lambda s: 0.5 - 0.01 * s)])
    >>> round(loss, 6), round(se, 6)
    (10.0, 0.0)
    """
    loss, var = [], []
    for rec in records:
        x = np.array([r["step"] for r in steps_of(rec)], dtype=float)
        y = np.array([r["policy/entropy"] for r in steps_of(rec)])
        slope, icept = np.polyfit(x, y, 1)
        resid = y - (icept + slope * x)
        se = np.sqrt(resid.var() * len(x) / (len(x) - 2) / ((x - x.mean()) ** 2).sum())
        lr = rec["args"]["learning_rate"]
        loss.append(-slope / lr)
        var.append((se / lr) ** 2)
    return float(np.mean(loss)), float(np.sqrt(sum(var)) / len(var))


def collapse_budget(sft_entropy: float, loss: float, se: float, steps: int, lr: float) -> dict:
    """The budget rule: can `steps` PPO steps at `lr` lose COLLAPSE_SHARE of the SFT policy's entropy, at the most a
    step loses that the records allow (their mean loss per unit lr plus 1.96 standard errors)?

    >>> b = collapse_budget(0.016, loss=0.053, se=0.107, steps=40, lr=2e-4)
    >>> b["can"], round(b["lost"], 4), b["needed"], round(b["steps_needed"])
    (False, 0.0021, 0.008, 152)
    >>> collapse_budget(0.016, loss=1.0, se=0.1, steps=40, lr=2e-4)["can"]
    True
    """
    most = max(0.0, loss + 1.96 * se)  # entropy a step loses, per unit learning rate
    lost, needed = steps * lr * most, COLLAPSE_SHARE * sft_entropy
    return {"can": lost >= needed, "lost": lost, "needed": needed, "per_step": lr * most,
            "steps_needed": needed / (lr * most) if most > 0 else float("inf")}


def rm_curve(run_dir: str) -> dict:
    """The trained RM's loss curve (ppo_slm_stages.fit_lora: the mean Bradley-Terry loss of each window of steps;
    log 2 = 0.693 is a score that tells nothing) from its folder; {} where the run trained no RM or kept no curve."""
    try:
        with open(os.path.join(run_dir, "reward_model", "loss_curve.json")) as f:
            curve = json.load(f)
    except OSError:
        return {}
    return {"rm_loss_curve": curve["mean_loss"], "rm_loss_window": curve["window_steps"]}


def sft_model(run_dir: str):
    """The stages' SFT model (its adapter merged: sft_merged) and tokenizer, float32 on the CPU, in eval mode."""
    from common.models import load_model, load_tokenizer

    sft_dir = os.path.join(run_dir, "sft_merged")
    return load_tokenizer(sft_dir), load_model(sft_dir, "float32", "cpu").eval()


def pair_batches(tokenizer, pairs: list, size: int):
    """`size` pairs at a time: (the number n of pairs, then ids, attention mask and completion mask of 2n left-padded
    rows, the chosen completions first and the rejected ones after)."""
    for s in range(0, len(pairs), size):
        b = pairs[s:s + size]
        yield len(b), *stages_lib.encode_pairs(tokenizer, [e.prompt for e in b] * 2,
                                               [e.chosen for e in b] + [e.rejected for e in b])


def kind_means(right: list, pairs: list, name: str) -> dict:
    """{name: the fraction of `right` that is true, name/<kind>: the same over each kind of `pairs`}."""
    return {name: float(np.mean(right)),
            **{f"{name}/{k}": float(np.mean([r for r, e in zip(right, pairs) if e.kind == k]))
               for k in sorted({e.kind for e in pairs})}}


@torch.no_grad()
def likelihood_prefers(run_dir: str, args) -> dict:
    """How often the SFT model's own likelihood (the summed log-probs of the completion tokens) is higher for the
    chosen solution than for the rejected one, on the RM's held-out pairs, by kind: whether the backbone the RM
    starts from can tell them apart at all."""
    from common.rollout import position_ids

    tokenizer, model = sft_model(run_dir)
    pairs = stages_lib.build_pairs(args, "test", args.num_eval_pairs, args.seed, tokenizer)
    right = []
    for n, ids_BT, attn_BT, comp_BT in pair_batches(tokenizer, pairs, 8):
        logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=position_ids(attn_BT)).logits
        logp_BT = torch.log_softmax(logits_BTV[:, :-1].float(), -1).gather(-1, ids_BT[:, 1:, None])[..., 0]
        total_B = (logp_BT * comp_BT[:, 1:]).sum(1)
        right += (total_B[:n] > total_B[n:]).tolist()
    return kind_means(right, pairs, "likelihood")


FROZEN_READS = {"read": "the token a score head reads", "eos": "the eos", "mean": "the mean over the completion"}
"""where frozen_readout reads the SFT backbone's last-layer state; a score head (transformers' sequence
classification) reads the last token that is not the pad id: with SmolLM2, whose pad is its eos, the token before it"""


def linear_readout(train_d_ND: torch.Tensor, test_d_MD: torch.Tensor, l2: float = 1e-2) -> tuple[float, torch.Tensor]:
    """A Bradley-Terry score head w on fixed features: minimise mean softplus(-w.d) + l2/2 |w|^2 over the
    chosen-minus-rejected feature differences d of `train_d_ND` (each feature scaled by its training std; full-batch
    L-BFGS). Returns its accuracy on those differences and, for each test difference, whether w.d > 0 there.

    >>> g = torch.Generator().manual_seed(0)
    >>> d_ND = torch.randn(400, 8, generator=g)
    >>> d_ND[:, 0] = d_ND[:, 0].abs() + 0.5  # one direction tells chosen from rejected
    >>> acc, right_M = linear_readout(d_ND[:300], d_ND[300:])
    >>> acc, right_M.float().mean().item()
    (1.0, 1.0)
    >>> acc, right_M = linear_readout(torch.randn(300, 8, generator=g), torch.randn(4000, 8, generator=g))
    >>> abs(right_M.float().mean().item() - 0.5) < 0.05  # noise: chance on new pairs
    True
    """
    scale_D = train_d_ND.std(0).clamp_min(1e-6)
    x_ND = (train_d_ND / scale_D).double()
    w_D = torch.zeros(x_ND.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w_D], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-x_ND @ w_D).mean() + l2 / 2 * w_D.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    w_D = w_D.detach()
    return float((x_ND @ w_D > 0).double().mean()), (test_d_MD / scale_D).double() @ w_D > 0


def recipe_head(train_d_ND: torch.Tensor, test_d_MD: torch.Tensor, steps: int, batch_size: int, lr: float,
                init_std: float, seed: int) -> tuple[float, torch.Tensor]:
    """The score head alone trained as the RM stage trains its (ppo_slm_stages.fit_lora: AdamW at `lr`, `steps`
    batches of `batch_size` pairs drawn at random, from N(0, init_std^2) as transformers initialises it) on fixed,
    unscaled feature differences: its accuracy on the training differences and, per test difference, whether right.

    >>> g = torch.Generator().manual_seed(0)
    >>> d_ND = torch.randn(400, 8, generator=g)
    >>> d_ND[:, 0] = d_ND[:, 0].abs() + 0.5
    >>> acc, right_M = recipe_head(d_ND[:300], d_ND[300:], 200, 16, 5e-2, 0.02, 0)
    >>> acc, right_M.float().mean().item()
    (1.0, 1.0)
    """
    gen = torch.Generator().manual_seed(seed)
    w_D = (torch.randn(train_d_ND.shape[1], generator=gen) * init_std).requires_grad_()
    opt = torch.optim.AdamW([w_D], lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        idx = rng.sample(range(len(train_d_ND)), batch_size)
        loss = torch.nn.functional.softplus(-train_d_ND[idx] @ w_D).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w_D = w_D.detach()
    return float((train_d_ND @ w_D > 0).double().mean()), test_d_MD @ w_D > 0


@torch.no_grad()
def frozen_readout(run_dir: str, args, num_train: int) -> dict:
    """The best linear score head on the SFT backbone's frozen last-layer states (linear_readout, fit on `num_train`
    training pairs), read at each of FROZEN_READS: its held-out pair accuracy by kind on the RM's held-out pairs.
    Where the trained RMs sit at chance, this says whether the backbone they start from carries a wrong answer where
    a score head can read it, without training the backbone."""
    from common.rollout import position_ids

    tokenizer, model = sft_model(run_dir)

    def differences(pairs: list) -> dict:
        out = {k: [] for k in FROZEN_READS}
        for n, ids_BT, attn_BT, comp_BT in pair_batches(tokenizer, pairs, 16):
            h_BTD = model.base_model(input_ids=ids_BT, attention_mask=attn_BT,
                                     position_ids=position_ids(attn_BT)).last_hidden_state.float()
            read_B = (torch.arange(ids_BT.shape[1]) * (ids_BT != tokenizer.pad_token_id)).argmax(-1)
            feats = {"read": h_BTD[torch.arange(len(ids_BT)), read_B], "eos": h_BTD[:, -1],
                     "mean": (h_BTD * comp_BT[..., None]).sum(1) / comp_BT.sum(1, keepdim=True)}
            for k, f_BD in feats.items():
                out[k].append(f_BD[:n] - f_BD[n:])
        return {k: torch.cat(v) for k, v in out.items()}

    held = stages_lib.build_pairs(args, "test", args.num_eval_pairs, args.seed, tokenizer)
    train_d, test_d = differences(stages_lib.build_pairs(args, "train", num_train, args.seed, tokenizer)), \
        differences(held)
    res = {"frozen/train_pairs": num_train}
    record = lambda name, fit, right_M: {**kind_means(right_M.tolist(), held, f"frozen/{name}"),  # noqa: E731
                                         f"frozen/fit/{name}": fit}
    with torch.enable_grad():
        for k in FROZEN_READS:
            res |= record(k, *linear_readout(train_d[k], test_d[k]))
        steps = RM_PROBE[-1][1] * args.rm_steps  # the probe's last RMs' steps, at the read position
        res |= record("recipe_head", *recipe_head(train_d["read"], test_d["read"], steps, args.rm_batch_size,
                                                  args.rm_lr, model.config.initializer_range, args.seed + 1))
        res |= {"frozen/recipe_head_steps": steps, "frozen/recipe_head_lr": args.rm_lr,
                "frozen/recipe_head_batch": args.rm_batch_size}
    return res


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


def claims(cli, sft_greedy: float, runs: dict | None = None) -> dict:
    """The gate declarations of the outcome (a win rate over SFT against 0.5) and of the collapse (the envelope-off
    run falling to half the SFT policy's accuracy). A seed's start is its outcome arm's first evaluation (its own
    held-out problems) once that arm is recorded; before, the stages' (seed 1's problems)."""
    split = f"{cli.num_eval_prompts} held-out level-{LEVEL} prompts"
    own = {s: evals_of(runs[("ppo", s)])[0]["eval/greedy_accuracy"] for s in cli.seeds if ("ppo", s) in (runs or {})}
    problems = ("each seed's own problems" if len(own) == len(cli.seeds) else
                "seed 1's problems" if not own else f"seed {', '.join(map(str, own))}'s own problems, else seed 1's")
    common = dict(split=split, n=cli.num_eval_prompts, seeds=list(cli.seeds),
                  start={s: own.get(s, sft_greedy) for s in cli.seeds},
                  start_is=f"greedy accuracy of the SFT policy (every run's start; {problems})",
                  contexts_are="none: PPO adds nothing to the prompt; the reward model scores the samples")
    return {"outcome": Claim(**common, effect=0.08, against=0.5, name="outcome",
                             effect_is="the paper: win rates 0.565-0.597 over SFT for SmolLM2-360M, ALGORITHMS.md 8.7"),
            "collapse": Claim(**common, effect=sft_greedy / 2, fall=True, name="collapse",
                              effect_is="the collapse rule: below half the SFT policy's accuracy")}


def steps_of(record: dict) -> list[dict]:
    return [r for r in record["rows"] if "reward/mean" in r]


def evals_of(record: dict) -> list[dict]:
    return [r for r in record["rows"] if "eval/greedy_accuracy" in r]


def minutes(record: dict) -> float:
    """The run's minutes, its stages included (args.json, from which the record counts, is written after them)."""
    return (record["seconds"] + record["rows"][0].get("time/stages", 0.0)) / 60


def collapsed(record: dict, total_steps: int) -> bool:
    """The collapse rule: greedy accuracy below half the run's start, or stopped early."""
    start, final = evals_of(record)[0], evals_of(record)[-1]
    return final["eval/greedy_accuracy"] < start["eval/greedy_accuracy"] / 2 or len(steps_of(record)) < total_steps


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
            f"{final['eval/win_rate_rm']:.3f} | {final['eval/win_rate_verifier']:.3f} | "
            f"{first.get('eval/entropy', float('nan')):.4f} -> {final.get('eval/entropy', float('nan')):.4f} | "
            f"{mean('policy/kl_ref'):.2f} | {max(r['safety/max_ratio'] for r in steps):.2f} | "
            f"{sum(r['safety/ratio_guard_skips'] for r in steps)} | {final.get('safety/rollbacks', 0)} | "
            f"{minutes(rec):.0f} |")


def by_kind(row: dict, name: str, counts: dict | None = None) -> str:
    """'answer 0.491 (110 pairs, needs 0.632) step 1.000 (...)' of a row's `name`/<kind> figures."""
    kinds = sorted(k.split("/")[-1] for k in row if k.startswith(name + "/"))
    need = lambda k: f" ({counts[k]} pairs, needs > {needed_accuracy(counts[k]):.3f})" if counts else ""  # noqa: E731
    return ", ".join(f"{k} {row[f'{name}/{k}']:.3f}{need(k)}" for k in kinds)


def rm_gate(probe: list, counts: dict) -> tuple[str, list[str], str]:
    """The reward-model line of the gate, what failed, and the chosen RM's name ('' if none)."""
    tried = "; ".join(f"{name}: {by_kind(rec['rows'][0], 'rm/pair_accuracy', counts)}" for name, _, rec in probe)
    rule = ("held-out pair accuracy above 0.5 beyond claim_runs.margin on each kind's pairs (each kind's rejected "
            "solution ends on a wrong answer)")
    if probe and tells_wrong_answers(probe[-1][2]["rows"][0], counts):
        return f"- reward model (outcome): {rule}: {tried}: pass ({probe[-1][0]})", [], probe[-1][0]
    if len(probe) == len(RM_PROBE):
        return (f"- reward model (outcome): {rule}: {tried}: **fail**",
                [f"no RM this ground trains tells a wrong answer ({len(probe)} tried: {tried})"], "")
    return (f"- reward model (outcome): {rule}: {tried or 'none measured'}: pending ({len(probe)} of {len(RM_PROBE)} "
            "tried; rerun with --probe-only)", ["pending: the RM probe is not finished"], "")


def budget_gate(cli, sft_entropy: float) -> tuple[str, list[str]]:
    """The collapse's budget line of the gate and what failed."""
    old = [json.load(open(os.path.join(RECORDS, f"{name}.json"))) for name in OLD_NOISY]
    loss, se = entropy_slopes(old)
    lr = ppo_slm.Args().learning_rate
    b = collapse_budget(sft_entropy, loss, se, cli.steps, lr)
    line = (f"- budget (collapse): the SFT policy's entropy {sft_entropy:.4f} nats a token (held-out samples, T 0.9, "
            f"top-p 0.95); the last design's {len(old)} noisy-RM runs lost {loss * lr:.6f} +- {1.96 * se * lr:.6f} a "
            f"step at lr {lr:g} (least-squares slopes of policy/entropy), so {cli.steps} steps lose at most "
            f"{b['lost']:.4f} against the {b['needed']:.4f} ({COLLAPSE_SHARE:g} of it) a collapse needs; that takes "
            f"{b['steps_needed']:.0f} steps: {'pass' if b['can'] else '**fail**'}")
    return line, [] if b["can"] else [f"budget, {cli.steps} steps lose at most {b['lost']:.4f} of the entropy, a "
                                      f"collapse needs {b['needed']:.4f} ({b['steps_needed']:.0f} steps)"]


def outcome_verdict(runs: dict, seeds: list, n: int) -> str:
    """The outcome rules of the module docstring, by the RM and by the verifier."""
    first = {s: evals_of(runs[("ppo", s)])[0] for s in seeds}
    last = {s: evals_of(runs[("ppo", s)])[-1] for s in seeds}
    noise = detectable(0.5, n, against=0.5)
    win = {s: last[s]["eval/win_rate_rm"] for s in seeds}
    acc = {s: (first[s]["eval/greedy_accuracy"], last[s]["eval/greedy_accuracy"]) for s in seeds}
    up = [b - a > margin(a, b, n) for a, b in acc.values()]
    down = [a - b > margin(a, b, n) for a, b in acc.values()]
    harm = any(down) or any(last[s]["eval/win_rate_verifier"] < 0.5 - noise for s in seeds)
    beyond, above = [win[s] - 0.5 > noise for s in seeds], [win[s] > 0.5 for s in seeds]
    verdict = ("shown" if all(beyond) and not harm else "partly shown" if all(above) or any(beyond) else "not shown")
    by_verifier = ("greedy accuracy up beyond the noise on every seed" if all(up) else
                   "greedy accuracy down beyond the noise" if any(down) else
                   "greedy accuracy up beyond the noise on one seed only" if any(up) else "no change beyond the noise")
    wins = ", ".join(f"{win[s]:.3f}" for s in seeds)
    verifier = ", ".join(f"{last[s]['eval/win_rate_verifier']:.3f}" for s in seeds)
    greedy = ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in acc.values())
    return (f"{verdict} (RM win rates {wins}, noise +-{noise:.3f}); by the verifier: {by_verifier} (win rates "
            f"{verifier}; greedy accuracy {greedy})")


def collapse_verdict(runs: dict, seeds: list, n: int, steps: int) -> str:
    col = {(a, s): collapsed(runs[(a, s)], steps) for a in ("noisy_on", "noisy_off") for s in seeds}
    acc = {(a, s): evals_of(runs[(a, s)])[-1]["eval/greedy_accuracy"] for a in ("noisy_on", "noisy_off") for s in seeds}
    if all(col[("noisy_off", s)] and not col[("noisy_on", s)] for s in seeds):
        verdict = "shown"
    elif any(col[("noisy_on", s)] for s in seeds):
        verdict = "not shown (the envelope did not prevent a collapse)"
    elif not any(col.values()) and all(acc[("noisy_on", s)] - acc[("noisy_off", s)] >
                                       margin(acc[("noisy_on", s)], acc[("noisy_off", s)], n) for s in seeds):
        verdict = "partly shown (no collapse either way; the envelope ends higher beyond the noise on each seed)"
    else:
        verdict = "not shown"
    return f"{verdict}. " + "; ".join(f"seed {s}: off {fate(runs[('noisy_off', s)], col[('noisy_off', s)])}, "
                                      f"on {fate(runs[('noisy_on', s)], col[('noisy_on', s)])}" for s in seeds)


def gates(cli, stages: dict, probe: list, counts: dict, runs: dict | None = None) -> dict:
    """The gate of both claims: its lines, what failed of each ({claim: [gate, figures]}), what each lets its verdict
    be ('passes', 'pending (the RM probe)' or 'untestable here: ...') and the chosen RM's name."""
    s0 = evals_of(stages)[0]
    cl = claims(cli, s0["eval/greedy_accuracy"], runs)
    (out_lines, out_failed), (col_lines, col_failed) = (gate(cl[c], {"leaks": 0, "contexts": 0})
                                                        for c in ("outcome", "collapse"))
    rm_line, rm_failed, chosen = rm_gate(probe, counts)
    budget_line, budget_failed = budget_gate(cli, s0["eval/entropy"])
    failed = {"outcome": out_failed + rm_failed, "collapse": col_failed + budget_failed}
    said = {}
    for c, f in failed.items():
        final = [x for x in f if not x.startswith("pending")]
        said[c] = untestable(final) if final else "pending (the RM probe)" if f else "passes"
    return {"lines": [*out_lines, rm_line, *col_lines, budget_line], "failed": failed, "said": said, "chosen": chosen}


def report(cli, stages: dict, probe: list, counts: dict, naive: dict | None, fix: dict | None, runs: dict,
           sigma: float | None, frozen: dict | None = None) -> str:
    n, s0 = cli.num_eval_prompts, evals_of(stages)[0]
    sft_greedy, sft_entropy = s0["eval/greedy_accuracy"], s0["eval/entropy"]
    g = gates(cli, stages, probe, counts, runs)
    failed, said, chosen = g["failed"], g["said"], g["chosen"]
    gated = lambda c, v: f"{said[c]} (the rule alone: {v})" if failed[c] else v  # noqa: E731
    lines = ["# PPO for small LMs on SmolLM2-135M-Instruct (issues 39, 63)", "",
             f"`python -m benchmarks.claims.ppo_slm_smollm2 --steps {cli.steps} --sft-steps {cli.sft_steps} --rm-steps "
             f"{cli.rm_steps} --num-eval-prompts {n}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, "
             f"{torch.get_num_threads()} thread(s), testbed-nl version {GROUND}. Each arm: `python ppo_slm.py "
             f"{' '.join(stage_flags(cli))} --sft-adapter STAGES/sft_adapter --reward-model RM --num-prompts 16 "
             f"--minibatch-size 8 --total-steps {cli.steps} --seed S` plus its arm's flags. Held out: {n} "
             f"level-{LEVEL} prompts, one sample each (T 0.9) for the RM score, win rates and entropy, greedy for "
             f"accuracy; a rate's noise is up to +-{detectable(0.5, n, against=0.5):.3f} at 0.5.", "",
             "## The gate (claim_runs.py, the reward model and the budget, before any arm trains)", "",
             *g["lines"], "",
             f"Gate: outcome: {said['outcome']}; collapse: {said['collapse']}.", "",
             "## The ground", "",
             f"SFT (LoRA r 16, {cli.sft_steps} steps of 16 worked solutions) from SmolLM2-135M-Instruct, seed 1; the "
             f"SFT policy: greedy accuracy {sft_greedy:.3f}, sampled {s0['eval/sampled_accuracy']:.3f}, entropy "
             f"{sft_entropy:.4f} nats a token of its samples (T 0.9, top-p 0.95), mean RM score of its samples "
             f"{s0['eval/rm_score']:.3f} (the stages' RM). The SFT model's own likelihood prefers the chosen solution "
             f"on {stages['measured']['likelihood']:.3f} of the {cli.num_eval_pairs} held-out pairs (by kind: "
             f"{by_kind(stages['measured'], 'likelihood')}): the backbone an RM starts from can tell that much.", "",
             "The reward-model probe (in order, until one tells a wrong answer; pairs of 16 a step, lr 5e-4; minutes: "
             "the process that finished it, a resumed RM's earlier sessions not counted):", "",
             "| RM | steps | training pairs | LoRA r | training loss, first -> last window | held-out pair accuracy | "
             "on its training pairs | tells a wrong answer | minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for name, args, rec in probe:
        row, curve = rec["rows"][0], rec.get("measured", {}).get("rm_loss_curve")
        lines.append(f"| {name} | {args.rm_steps} | {args.num_train_examples} | {args.rm_lora_r} | "
                     + (f"{curve[0]:.3f} -> {curve[-1]:.3f} ({rec['measured']['rm_loss_window']} steps) | " if curve
                        else "not kept | ") +
                     f"{row['rm/pair_accuracy']:.3f} ({by_kind(row, 'rm/pair_accuracy')}) | "
                     f"{row.get('rm/train_pair_accuracy', float('nan')):.3f} "
                     f"({by_kind(row, 'rm/train_pair_accuracy')}) | "
                     f"{'yes' if tells_wrong_answers(row, counts) else 'no'} | {minutes(rec):.0f} |")
    lines += ["", f"Chosen: {chosen}." if chosen else "Chosen: none." if len(probe) == len(RM_PROBE) else
              "Chosen: none yet (the probe goes on: --probe-only)."]
    if frozen is not None:
        beyond = {c: [what for k, what in FROZEN_READS.items()
                      if frozen[f"frozen/{k}/{c}"] - 0.5 > margin(frozen[f"frozen/{k}/{c}"], 0.5, n_c)]
                  for c, n_c in counts.items()}  # the RM rule's margin, kind by kind
        nowhere = [c for c, reads in beyond.items() if not reads]
        lines += ["", f"Why none: the best linear score head on the SFT backbone's frozen last-layer states "
                  f"(`frozen_readout`: Bradley-Terry on {frozen['frozen/train_pairs']} training pairs), held-out pair "
                  "accuracy where it reads: " + "; ".join(
                      f"{what}: {frozen[f'frozen/{k}']:.3f} ({by_kind(frozen, f'frozen/{k}')}; "
                      f"{frozen[f'frozen/fit/{k}']:.3f} on its training pairs)" for k, what in FROZEN_READS.items())
                  + ". Above chance beyond the RM rule's margin: " +
                  "; ".join(f"{c}: {', '.join(reads) or 'nowhere'}" for c, reads in beyond.items()) + ". " +
                  (f"So the {' and '.join(nowhere)} kind{'s are' if len(nowhere) > 1 else ' is'} not linearly in the "
                   "untrained backbone's states where a score head reads; its likelihood tells it on " + ", ".join(
                       f"{stages['measured'][f'likelihood/{c}']:.3f}" for c in nowhere) + " of those pairs."
                   if nowhere else
                   "So the backbone carries every kind at some read, and the trained RMs did not learn to read it.")]
        if "frozen/recipe_head" in frozen:
            lines[-1] += (" The score head alone, trained on the same states at the read position with the RMs' "
                          f"optimiser (AdamW, lr {frozen['frozen/recipe_head_lr']:g}, "
                          f"{frozen['frozen/recipe_head_steps']} steps of {frozen['frozen/recipe_head_batch']} pairs, "
                          "from transformers' initialisation): "
                          f"{frozen['frozen/recipe_head']:.3f} ({by_kind(frozen, 'frozen/recipe_head')}; "
                          f"{frozen['frozen/fit/recipe_head']:.3f} on its training pairs).")
    head = ["", "| run | seed | steps | greedy accuracy | RM score | win rate (RM) | win rate (verifier) | entropy | "
            "KL to ref (last 5) | max ratio | guard skips | rollbacks | minutes |", "|---|---|" + "---|" * 11]
    if naive is not None:
        lines += ["", "## 1. The adapter freeze", "",
                  f"Naive path (`--policy-init naive_adapter`): {naive['trainable_lm_tensors']} trainable of "
                  f"{naive['lora_tensors']} LoRA tensors after PeftModel.from_pretrained; the run: {naive['ended']}"]
        if fix is not None:
            moved = fix["measured"]
            lines += ["", f"Merge-and-reinit (`fix`, 2 steps): {moved['lora_b_moved']} of {moved['lora_b']} LoRA B "
                      "matrices moved off their starting 0."]
            shown = naive["trainable_lm_tensors"] == 0 and "freeze" in naive["ended"] and \
                moved["lora_b_moved"] == moved["lora_b"] > 0
            lines += ["", f"Verdict, freeze: {'shown' if shown else 'not shown'} (rule: module docstring)."]
    lines += ["", "## 2. bfloat16 importance ratios", "",
              "Verdict, bfloat16: needs a GPU. The overflow needs CUDA passes whose old and new log-probs disagree; on "
              "this CPU both come from the same forward (the same dtype and batch size, a float32 log-softmax), so a "
              "ratio moves only with the update, in either dtype (issue 56). On a GPU: `python -m "
              "benchmarks.speed.gpu_check --only ppo_ratio` (ppo_slm.py's short testbed run in both dtypes; not run "
              "yet)."]
    lines += ["", "## 3. Reward-model error", ""]
    noisy = sorted(k for k in runs if k[0].startswith("noisy"))
    if sigma is not None and noisy:
        lines += [f"N(0, ({NOISE_SIGMAS:g} x {sigma:.3f})^2) added to every training score (sigma: RM score std of the "
                  "clean seed-1 run's first 5 steps); evaluation with the clean RM. Envelope off: " +
                  " ".join(f"`{f}`" for f in ENVELOPE_OFF) + ". Collapse: greedy accuracy below half the run's start "
                  "or an early stop.", *head, *(run_row(a, s, runs[(a, s)]) for a, s in noisy)]
    seeds = sorted({s for _, s in noisy if ("noisy_on", s) in runs and ("noisy_off", s) in runs})
    if failed["collapse"]:
        lines += ["", f"Verdict, collapse: {said['collapse']}."] if noisy else [
            f"Not run. Verdict, collapse: {said['collapse']}."]
    elif seeds == sorted(cli.seeds) and len(seeds) >= 2:
        lines += ["", f"Verdict, collapse (seeds {seeds}): {collapse_verdict(runs, seeds, n, cli.steps)}"]
    else:
        lines += ["", f"Incomplete: seeds with both noisy runs {seeds or 'none'} of {list(cli.seeds)}; rerun."]
    lines += ["", "## 4. The outcome: PPO against the SFT policy"]
    outcome = sorted(s for a, s in runs if a == "ppo")
    if outcome:
        lines += [*head, *(run_row("ppo", s, runs[("ppo", s)]) for s in outcome)]
        held = {s: by_kind(runs[("ppo", s)]["rows"][0], "rm/pair_accuracy") for s in outcome}
        if any(held.values()):  # seed 1's pairs chose the RM; another seed's pairs are outside that choice
            lines += ["", "The chosen RM's held-out pair accuracy on each seed's own pairs (seed 1's chose it): "
                      + "; ".join(f"seed {s}: {v}" for s, v in held.items() if v) + "."]
    if outcome == sorted(cli.seeds) and len(outcome) >= 2:
        lines += ["", f"Verdict, outcome: {gated('outcome', outcome_verdict(runs, outcome, n))}."]
    elif failed["outcome"]:
        lines += ["", f"Not run. Verdict, outcome: {said['outcome']}."]
    else:
        lines += ["", f"Incomplete: outcome seeds finished {outcome} of {list(cli.seeds)}; rerun the command."]
    return "\n".join(lines) + "\n"


ARMS = ("ppo", "noisy_on", "noisy_off")
"""The arms made per seed (the stages, the probe and the freeze pair are made once, with seed 1)."""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of the outcome and noisy-RM runs")
    p.add_argument("--steps", type=int, default=40, help="PPO steps of the outcome and noisy-RM runs")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--rm-steps", type=int, default=150, help="the stages' RM steps (the probe's others: multiples)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                   help="the per-seed arms to make (two processes can share a seed's arms; the full report afterwards: "
                        "--report-only)")
    p.add_argument("--num-eval-prompts", type=int, default=160)
    p.add_argument("--num-eval-pairs", type=int, default=200)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "ppo_slm_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join("runs", "ppo_slm_smollm2_v2"), help="run folders")
    p.add_argument("--records", default=os.path.join(RECORDS, "v2"))
    p.add_argument("--probe-only", action="store_true", help="the stages, the RM probe and the gate; no arm")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # the runs' --sft-adapter / --reward-model are relative: records made in one clone read in another
    make = not cli.report_only
    stages_args = run_args(cli, "stages", 1, "--total-steps", "0")  # SFT, the RM and the SFT policy's evaluation
    measures = {"stages": lambda d: {**likelihood_prefers(d, stages_args), **rm_curve(d)},  # by run name
                **{name: rm_curve for name, *_ in RM_PROBE[1:]}}  # the others: lora_b_moved
    state = {"probe": [], "naive": None, "fix": None, "runs": {}, "sigma": None, "frozen": None}

    def write():
        with open(cli.out, "w") as f:
            f.write(report(cli, stages, state["probe"], counts, state["naive"], state["fix"], state["runs"],
                           state["sigma"], state["frozen"]))

    def have(args) -> bool:  # a record finished_run reads back: nothing to make
        try:
            with open(os.path.join(cli.records, f"{args.run_name}.json")) as f:
                rec = json.load(f)
            return same_args(rec["args"], json.loads(json.dumps(dataclasses.asdict(args))),
                             dataclasses.asdict(ppo_slm.Args())) and (not make or rec.get("ground", 1) == GROUND)
        except (OSError, ValueError, KeyError):
            return False

    def run(args, needs=()) -> dict | None:
        """The record of `args` (None where a report from the records has none); when it is to be made, the run
        folders of `needs` (the runs whose weights it starts from) are made first if they are gone."""
        if not make and not have(args):
            return None
        if not have(args):
            for dep in needs:
                finished_run(ppo_slm, dep, cli.records, measures.get(dep.run_name), weights=True)
        return finished_run(ppo_slm, args, cli.records, measures.get(args.run_name), make=make)

    stages = run(stages_args)
    if stages is None:
        raise SystemExit(f"error: no record of the stages in {cli.records}: rerun without --report-only")
    counts = kind_counts(stages_args)
    chosen = None
    for name, times, passes, rank in RM_PROBE:  # in order, until one tells a wrong answer
        args = stages_args if name == "stages" else probe_args(cli, name, times, passes, rank)
        rec = stages if name == "stages" else run(args, [stages_args])
        if rec is None:
            break
        state["probe"].append((name, args, rec))
        write()
        if tells_wrong_answers(rec["rows"][0], counts):
            chosen = args
            break
    frozen_path = os.path.join(cli.records, "frozen_readout.json")
    if chosen is None and len(state["probe"]) == len(RM_PROBE) and (make or os.path.exists(frozen_path)):
        def readout() -> dict:  # the stages' SFT model first, retrained if its folder is gone
            finished_run(ppo_slm, stages_args, cli.records, measures["stages"], weights=True)
            return frozen_readout(os.path.join(stages_args.output_dir, stages_args.run_name), stages_args,
                                  FROZEN_TRAIN_PAIRS)

        state["frozen"] = cached(frozen_path, {"train_pairs": FROZEN_TRAIN_PAIRS, "pairs": cli.num_eval_pairs,
                                               "sft_steps": cli.sft_steps, "recipe_head": True}, readout, make=make)
        write()
    if not cli.probe_only:
        rm = rm_folder(chosen) if chosen else ""
        needs = [stages_args] + ([chosen] if chosen and chosen is not stages_args else [])
        small = ["--num-eval-prompts", "4", "--total-steps", "2"]
        naive_args = run_args(cli, "naive", 1, "--policy-init", "naive_adapter", *small, rm=rm_folder(stages_args))
        naive_path = os.path.join(cli.records, "naive.json")
        if make or os.path.exists(naive_path):
            if make and not os.path.exists(naive_path):
                finished_run(ppo_slm, stages_args, cli.records, measures["stages"], weights=True)
            state["naive"] = cached(naive_path, {"args": naive_args.run_name, "sft_steps": cli.sft_steps},
                                    lambda: naive_freeze(naive_args), make=make)
        fix_args = run_args(cli, "fix", 1, *small, rm=rm_folder(stages_args))
        measures[fix_args.run_name] = lora_b_moved
        state["fix"] = run(fix_args, [stages_args])
        write()
        failed = gates(cli, stages, state["probe"], counts)["failed"]
        for seed in cli.seeds:  # the clean run: the outcome's arm, and (seed 1) the sigma of the noisy ones
            wanted = ("ppo" in cli.arms and not failed["outcome"]) or (seed == 1 and not failed["collapse"])
            args = run_args(cli, "ppo", seed, rm=rm)
            measures[args.run_name] = lora_b_moved
            rec = run(args, needs) if rm and (wanted or not make) else None
            if rec is not None:
                state["runs"][("ppo", seed)] = rec
                write()
        clean = state["runs"].get(("ppo", 1))
        if clean is not None:
            state["sigma"] = float(np.mean([r["rm/score_std"] for r in steps_of(clean)[:5]]))
            for seed in cli.seeds:
                for arm, flags in (("noisy_on", []), ("noisy_off", ENVELOPE_OFF)):
                    if make and (arm not in cli.arms or failed["collapse"]):
                        continue
                    args = run_args(cli, arm, seed, *flags, "--rm-noise-std", f"{NOISE_SIGMAS * state['sigma']:.4f}",
                                    rm=rm)
                    rec = run(args, needs)
                    if rec is not None:
                        state["runs"][(arm, seed)] = rec
                        write()
    write()
    with open(cli.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
