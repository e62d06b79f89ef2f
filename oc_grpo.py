"""OC-GRPO: Off-Context GRPO (Learning to Reason on Hard Problems using Privileged Information, arXiv 2607.19313).

GRPO (grpo.py) plus guidance for groups that get no signal. When all G unguided rollouts of a
prompt x fail, roll out again from guided prompts x~_f that carry the first fraction f of the
reference solution (f = 0.2, 0.4, 0.6, 0.8, 1.0 in turn) and replace the WHOLE group by the G
rollouts of the lowest f that produced a success (groups no f rescues keep zero advantage).
Guided responses y are trained as if they answered the UNGUIDED prompt: old log-probs, the ratio
and the loss all use [x|y]; one extra no-grad pass on [x~|y] gives the context-shift weight

    w_it = clip( pi_old(y_it | x, y_i<t) / pi_old(y_it | x~, y_i<t), c_min, 1 )        (c_min = 0.01)
    J    = E[ token_mean_{i,t} min(rho_it w_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) w_it A_i) ]
    rho_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)                 (on-context PPO ratio)

The weight multiplies the detached advantage (not the ratio) and is truncated at 1: tokens the
guidance made more likely (copied from the prefix) are down-weighted, none is up-weighted;
unguided rows have w = 1. Ablations: --correction none (guided rows, no weight) or
per_token_uniform (one weight exp(mean_t(logp_x - logp_x~)) per row), --prompt-mode hinted
(train on [x~|y], BREAD/POPE-style: no context shift, so no weight), and --guidance fixed
(OC-GRPO-Fixed: before training, the base model probes each problem's cascade once; the
training rows are the original problems plus one guided row x~_f* per solvable problem, rolled
out from x~ and trained on x with the same weight).

Left out, on purpose: veRL's dual-clip (c = 3) for negative advantages (grpo.py has none, and
a diff should show only the guidance), the system prompt and "Reference solution:" wording of
the paper's chat prompts (render_guided_prompt builds the guided prompt: testbed
"Ref:<prefix>" line, testbed-nl its first steps before the result, real data "Partial reference
solution: ..." or "Reference solution: ..."), hint (non-prefix)
guidance and the "replacement2" mode that swaps only correct guided samples into a group,
and the is_weight_power knob.

Metrics beyond grpo.py's: guide/* (the cascade), is/* (the weight w over guided tokens) and time/guidance, in
docs/oc_grpo.md. train/accuracy is that of the unguided rollouts only (before any replacement); reward/* and adv/*
describe the batch that is trained on; time/generate counts the cascade's generation too.

    python oc_grpo.py                                       # embedded CPU demo on testbed level 5 (all-fail groups)
    python oc_grpo.py --model-name Qwen/Qwen2.5-1.5B-Instruct --dataset hard_train.jsonl \\
        --eval-dataset hard_test.jsonl --solution-field solution --device cuda --dtype bfloat16 \\
        --max-new-tokens 1024 --num-prompts 32 --group-size 16 --temperature 0.7 --micro-batch-size 8 \\
        --gradient-checkpointing --learning-rate 1e-6 --total-steps 64   # sizes: docs/fsdp.md
    torchrun --nproc-per-node 8 oc_grpo.py --model-name ... --device cuda   # data parallel, one rank per GPU

With `--rollout-backend vllm` the sampler's log-probs are compared with the trainer's and `--tis` weights the
policy loss, as in grpo.py. A guided row is compared in the context it was sampled from, [x~|y] (the hint pass
runs for it), so rollout/mismatch_* and the TIS weight see the sampler's error only; the context shift is w's.

Shapes: B rows (= P prompts x G group), T tokens per row, C completion tokens.
"""

import os
import re
import time
from dataclasses import dataclass
from typing import Literal

from common.args import TrainArgs, check_run_args


@dataclass
class Args(TrainArgs):  # common/args.py: run folder, resume, logging, device, sampling, optimiser, data, eval
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    eval_samples: int = 4
    """samples per problem for sampled accuracy and pass@k (0: greedy only)"""
    eval_pass_k: int = 4
    """k of the logged eval/pass_at_k"""
    levels: tuple[int, ...] = (5,)
    """testbed difficulty levels to train and evaluate on (1 easiest .. 5 hardest)"""

    # Rollouts
    tis: Literal["none", "token", "sequence"] = "none"
    """truncated importance sampling for the sampler/trainer mismatch: weight the policy loss by
    min(pi_trainer / pi_sampler, tis_cap) per token or per sequence (needs sampler log-probs: vllm)"""
    tis_cap: float = 2.0
    """truncation C of the importance weight"""
    num_prompts: int = 16
    """prompts per step (per rank)"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    format_reward_weight: float = 0.0
    """weight of the format reward added to the correctness reward"""

    # Algorithm
    adv_norm: Literal["group_std", "group_mean", "batch_std"] = "group_std"
    """group_std: (r - mean_G) / (std_G + eps); group_mean: r - mean_G (Dr. GRPO); batch_std: / std over the batch
    of all ranks"""
    adv_eps: float = 1e-6
    """eps in the advantage denominator (std is the biased, numpy-style one)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high (0.28 = DAPO clip-higher)"""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """token_mean: sum / tokens in the mini-batch; seq_mean_token_mean: mean over sequences of per-sequence means;
    constant: sum / (sequences x max_new_tokens) (Dr. GRPO)"""
    beta: float = 0.0
    """KL coefficient to the initial policy (0: no reference model is loaded)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator with d = logp - logp_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d"""
    filter_zero_std: bool = False
    """drop groups whose rewards are all equal from the loss (they have zero advantage anyway)"""
    guidance: Literal["adaptive", "fixed"] = "adaptive"
    """adaptive: each step, run the prefix cascade on groups whose rollouts all fail (OC-GRPO-Adaptive);
    fixed: probe the cascade once with the base model, train on original + one guided row per solvable problem"""
    prefix_fractions: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    """the cascade: fractions of the reference solution shown in the guided prompt, tried in this order"""
    correction: Literal["per_token", "per_token_uniform", "none"] = "per_token"
    """weight on guided rows' advantages: per_token clip(exp(logp_x - logp_x~), c_min, 1); per_token_uniform one
    weight per row, clip(exp(mean_t(logp_x - logp_x~)), c_min, 1); none: w = 1"""
    is_clip_min: float = 0.01
    """c_min, the lower clamp of the importance weight (its upper clamp is 1)"""
    prompt_mode: Literal["original", "hinted"] = "original"
    """context guided rows are trained on: original [x|y] (OC-GRPO), or hinted [x~|y] (BREAD/POPE-style; no context
    shift, so no weight whatever --correction says)"""
    fixed_probe_samples: int = 8
    """--guidance fixed: samples per problem and fraction in the offline probe"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))

import numpy as np
import torch

from common import checkpoint, data, dist, evaluate, logger, models, rollout, testbed, verifiers


# ALGO LOGIC: advantages, KL, the context-shift weight, the clipped objective and its normalisers (--tis:
# common.rollout.sampler_correction)
def group_advantages(rewards_PG: torch.Tensor, mode: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage of each completion and whether its group had zero reward std.

    >>> a, z = group_advantages(torch.tensor([[1., 0.], [1., 1.]]), "group_std", 1e-6); a.round(decimals=3), z
    (tensor([[ 1., -1.],
            [ 0.,  0.]]), tensor([False,  True]))
    """
    mean_P1 = rewards_PG.mean(1, keepdim=True)
    std_P1 = rewards_PG.std(1, unbiased=False, keepdim=True)
    zero_std_P = (rewards_PG.max(1).values - rewards_PG.min(1).values) == 0
    centred_PG = rewards_PG - mean_P1
    if mode == "group_std":
        return centred_PG / (std_P1 + eps), zero_std_P
    if mode == "group_mean":
        return centred_PG, zero_std_P
    if mode == "batch_std":
        return centred_PG / (dist.global_std(rewards_PG) + eps), zero_std_P  # the std of all ranks' rewards
    raise ValueError(f"unknown advantage normalisation {mode!r}")


def kl_penalty(logp_BC: torch.Tensor, ref_logp_BC: torch.Tensor, estimator: str,
               mask_BC: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate on sampled tokens (http://joschu.net/blog/kl-approx.html)."""
    d_BC = (logp_BC - ref_logp_BC) * mask_BC  # masked before exp(-d): padding (ref log-prob 0) gives 0, not inf
    if estimator == "k1":
        return d_BC
    if estimator == "k2":
        return 0.5 * d_BC**2
    if estimator == "k3":
        return torch.expm1(-d_BC) + d_BC
    raise ValueError(f"unknown KL estimator {estimator!r}")


def solution_prefix(solution: str, frac: float) -> str:
    """The first int(frac * len) characters of the reference solution, cut back to the previous whitespace
    (at the target when there is none); frac >= 1 gives the whole text. [asy] figures are dropped first.

    >>> solution_prefix("7+5=12 12+3=15", 0.5), solution_prefix("7+5=12 12+3=15", 0.2), solution_prefix("a b", 1.0)
    ('7+5=12', '7+', 'a b')
    """
    text = re.sub(r"\[asy\].*?\[/asy\]", "", solution, flags=re.S).strip()
    if frac >= 1:
        return text
    cut = int(frac * len(text))
    head = text[:cut]
    if cut < len(text) and not text[cut].isspace():  # mid-word: go back to the last whitespace in the head
        spaces = [m.start() for m in re.finditer(r"\s", head)]
        head = head[: spaces[-1]] if spaces else head
    return head.rstrip()


def importance_weights(old_logp_BC, hint_logp_BC, mask_BC, mode: str, c_min: float) -> torch.Tensor:
    """Context-shift weight of guided tokens, w = clip(pi_old(y|x) / pi_old(y|x~), c_min, 1); padding gets 1.

    >>> importance_weights(torch.tensor([[-1., -5., -1.]]), torch.tensor([[-2., -0.1, -1.]]),
    ...                    torch.tensor([[1., 1., 0.]]), "per_token", 0.01)
    tensor([[1.0000, 0.0100, 1.0000]])
    """
    log_w_BC = old_logp_BC - hint_logp_BC
    if mode == "per_token":
        w_BC = log_w_BC.exp().clamp(c_min, 1.0)
    elif mode == "per_token_uniform":  # one weight per row: exp of the mean per-token log-ratio
        mean_B = (log_w_BC * mask_BC).sum(1) / mask_BC.sum(1).clamp(min=1)
        w_BC = mean_B.exp().clamp(c_min, 1.0).unsqueeze(1).expand_as(log_w_BC)
    elif mode == "none":
        w_BC = torch.ones_like(log_w_BC)
    else:
        raise ValueError(f"unknown correction {mode!r}")
    return torch.where(mask_BC > 0, w_BC, torch.ones_like(w_BC))


def weight_metrics(w_N: torch.Tensor, c_min: float) -> dict:
    """is/weight_mean, is/weight_min and is/frac_at_clamp (the share at the lower clamp c_min) of the context-shift
    weights of the N tokens they apply to: 1, 1 and 0 when there are none."""
    if not len(w_N):
        return {"is/weight_mean": 1.0, "is/weight_min": 1.0, "is/frac_at_clamp": 0.0}
    return {"is/weight_mean": w_N.mean().item(), "is/weight_min": w_N.min().item(),
            "is/frac_at_clamp": (w_N <= c_min * (1 + 1e-6)).float().mean().item()}


def clipped_surrogate(logp_BC, old_logp_BC, adv_BC, clip_low: float, clip_high: float):
    """Per-token loss -min(rho wA, clip(rho, 1 - eps_low, 1 + eps_high) wA), and where the clip is active.
    adv_BC is the per-token advantage w_it * A_i (OC-GRPO section 2.4: the weight scales A, not rho)."""
    # differs from grpo.py: a per-token advantage adv_BC instead of adv_B; equal when adv_BC = adv_B[:, None]
    ratio_BC = torch.exp(logp_BC - old_logp_BC)
    unclipped_BC = -ratio_BC * adv_BC
    clipped_BC = -ratio_BC.clamp(1 - clip_low, 1 + clip_high) * adv_BC
    return torch.maximum(unclipped_BC, clipped_BC), (clipped_BC > unclipped_BC).float()


def aggregate(token_loss_BC, mask_BC, mode: str, num_tokens: float, num_nonempty: float, num_seqs: float,
              max_new_tokens: int):
    """Reduce per-token losses of one micro-batch with normalisers of the whole mini-batch (its tokens in the loss,
    its sequences with at least one such token, all its sequences), so that summing micro-batch gradients gives the
    mini-batch gradient whatever the split."""
    summed_B = (token_loss_BC * mask_BC).sum(1)
    if mode == "token_mean":
        return summed_B.sum() / max(num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        return (summed_B / mask_BC.sum(1).clamp(min=1)).sum() / max(num_nonempty, 1.0)
    if mode == "constant":
        return summed_B.sum() / max(num_seqs * max_new_tokens, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def minibatch_counts(mask_BC: torch.Tensor) -> tuple[float, float, float]:
    """Loss normalisers of a whole mini-batch, summed over ranks: (completion tokens in the loss, sequences with at
    least one such token, sequences). Fixed before gradient accumulation, so micro-batch gradients sum to the
    mini-batch gradient whatever the split."""
    counts = dist.all_reduce_sum(torch.tensor([mask_BC.sum().item(), float((mask_BC.sum(1) > 0).sum()),
                                               float(len(mask_BC))]))
    return counts[0].item(), counts[1].item(), counts[2].item()


def micro_batch_loss(model, batch: dict, rows: torch.Tensor, args: Args, counts: tuple[float, float, float]):
    """GRPO loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
    device = next(model.parameters()).device
    ids_BT, attn_BT = batch["input_ids_BT"][rows].to(device), batch["attention_mask_BT"][rows].to(device)
    mask_BC = batch["mask_BC"][rows].to(device)
    # completion_logprobs: log_softmax(logits / T) gathered at the completion ids, chunked for memory
    logp_BC, entropy_BC = rollout.completion_logprobs(model, ids_BT, attn_BT, batch["prompt_len"], args.temperature,
                                                      with_entropy=True, share_prompt=args.share_prompt,
                                                      top_p=args.top_p)
    old_logp_BC = batch["old_logp_BC"][rows].to(device) if batch["old_logp_BC"] is not None else logp_BC.detach()
    pg_BC, clipped_BC = clipped_surrogate(logp_BC, old_logp_BC, batch["adv_BC"][rows].to(device),
                                          args.clip_low, args.clip_high)
    sampler_stats = {}
    if batch.get("sampler_logp_BC") is not None:  # a separate sampler (vllm): its mismatch with the trainer, --tis
        tis_w_BC, sampler_stats = rollout.sampler_correction(
            old_logp_BC, batch["sampler_logp_BC"][rows].to(device), mask_BC, args.tis, args.tis_cap)
        pg_BC = pg_BC * tis_w_BC  # w = min(pi_trainer / pi_sampler, C) per token or sequence (--tis none: 1)
    token_loss_BC = pg_BC
    kl_BC = torch.zeros_like(pg_BC)
    if args.beta > 0:
        kl_BC = kl_penalty(logp_BC, batch["ref_logp_BC"][rows].to(device), args.kl_estimator, mask_BC)
        token_loss_BC = pg_BC + args.beta * kl_BC
    agg = lambda x: aggregate(x, mask_BC, args.loss_agg, *counts, args.max_new_tokens)  # noqa: E731
    loss = agg(token_loss_BC)
    with torch.no_grad():
        log_ratio_BC = (logp_BC - old_logp_BC) * mask_BC  # padding: 0, never exp(+large)
        stats = {  # token sums over this micro-batch; divided by the mini-batch token count by the caller
            "loss/policy": agg(pg_BC).item(), "loss/kl": agg(kl_BC).item(),
            "policy/clip_frac": (clipped_BC * mask_BC).sum().item(),
            "policy/approx_kl": ((torch.expm1(-log_ratio_BC) + log_ratio_BC) * mask_BC).sum().item(),
            "policy/entropy": (entropy_BC * mask_BC).sum().item(),
            **sampler_stats,
        }
    return loss, stats


# ALGO LOGIC: guided prompts and rollouts (common.rollout.attach re-attaches a completion to another prompt)
def before_result(solution: str, answer: str) -> str:
    """The solution's sentences before the first that states the answer as a whole number: a partial solution that
    stops before the result ('First 47 + 35 = 82.' of '... Then 82 + 16 = 98. The answer is 98.')."""
    m = re.search(rf"(?<![\d.,]){re.escape(answer)}(?!\d|[.,]\d)", solution)
    return solution if m is None else solution[: solution.rfind(". ", 0, m.start()) + 1]


def render_guided_prompt(problem, tokenizer, prefix: str) -> str:
    """The guided prompt x~: the question and the first part of its reference solution, labelled as what it is, after
    the question's template (the paper puts "Reference solution:" in its system prompt). Testbed: the "Ref:<prefix>"
    line the testbed models were warm-started with; testbed-nl: never past the steps before the one that states the
    result (before_result: the guidance teaches, it does not hand over the answer), "First steps of a solution,
    without its final result: <prefix>", none when no step comes before it; other data: "Reference solution:
    <prefix>" when the prefix is all of it, else "Partial reference solution: <prefix>"."""
    if problem.task == "testbed":
        return testbed.render_testbed_prompt(problem.question, solution_prefix=prefix)
    if problem.task == "nl":
        prefix = prefix[: len(before_result(problem.solution, problem.answer))].rstrip()
        return data.render_prompt(problem, tokenizer, suffix=f"\n\nFirst steps of a solution, without its final "
                                  f"result: {prefix}" if prefix else "")
    label = "Reference solution" if prefix == solution_prefix(problem.solution, 1.0) else "Partial reference solution"
    return data.render_prompt(problem, tokenizer, suffix=f"\n\n{label}: {prefix}")


def guidance_cascade(engine, tokenizer, problems: list, todo: list[int], n: int, args: Args,
                     model=None) -> tuple[dict, int, float]:
    """For each problem index in `todo`, the lowest prefix fraction whose n guided rollouts contain a success:
    {index: (fraction, guided prompt ids, completions, correct, sampler log-probs)}. Indices no fraction rescues
    are absent.
    Also the completion tokens the cascade generated, and the seconds its generation took. With a sharded `model`
    every rank generates once per fraction until no rank has a problem pending (generation gathers the layers, a
    collective): a rank with none left generates one token from one prompt, discarded."""
    rescued, pending, tokens, seconds = {}, [i for i in todo if problems[i].solution], 0, 0.0
    for frac in args.prefix_fractions:
        if dist.agree(not pending, model):
            break
        if not pending:
            engine.generate(data.encode_prompts(tokenizer, [data.render_prompt(problems[0], tokenizer)],
                                                args.max_prompt_tokens), n=1, max_new_tokens=1)
            continue
        prompts = data.encode_prompts(tokenizer, [render_guided_prompt(problems[i], tokenizer, solution_prefix(
            problems[i].solution, frac)) for i in pending], args.max_prompt_tokens)
        t0 = time.time()
        out = engine.generate(prompts, n=n, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, return_logprobs=args.rollout_backend == "vllm")
        tokens, seconds = tokens + out.lengths_B.sum().item(), seconds + time.time() - t0
        correct = verifiers.score(out.texts, [problems[i] for i in pending for _ in range(n)], out.truncated_B)
        completions, logps = rollout.split_completions(out), sampler_rows(out)
        for k, i in enumerate(pending):
            if any(correct[k * n : (k + 1) * n]):
                rescued[i] = (frac, prompts[k], completions[k * n : (k + 1) * n], correct[k * n : (k + 1) * n],
                              logps[k * n : (k + 1) * n])
        pending = [i for i in pending if i not in rescued]
    return rescued, tokens, seconds


def sampler_rows(out) -> list:
    """Per row of the rollouts `out`, the sampler's log-probs of its completion tokens (vllm), else None."""
    if out.sampler_logp_BC is None:
        return [None] * len(out.texts)
    return [out.sampler_logp_BC[b, : int(n)] for b, n in enumerate(out.lengths_B)]


def hint_weights(model, old_logp_BC, rows: list, guided: list[int], width: int, args: Args, pad_id: int):
    """The context-shift weight w of the `guided` rows and their log-probs log pi_old(y | x~) (rows: (sampled
    prompt x~, completion, ...) per batch row), from one no-grad pass on [x~|y], whose completion columns are those
    of [x|y]. Under --fsdp every rank passes as many rows as the busiest one (copies of row 0, discarded), since
    each forward is a collective."""
    padded = guided + [0] * (dist.max_over_ranks(len(guided), model) - len(guided))
    hint = rollout.attach([rows[b][0] for b in padded], [rows[b][1] for b in padded], pad_id, width)
    hint_logp_BC = rollout.batched_logprobs(model, hint, args.temperature,
                                            args.micro_batch_size, args.share_prompt, args.top_p)[: len(guided)]
    return importance_weights(old_logp_BC[guided], hint_logp_BC, hint.completion_mask_BC[: len(guided)],
                              args.correction, args.is_clip_min), hint_logp_BC


def replace_groups(rows: list, rescued: dict, group_size: int) -> list:
    """Rows of the batch with every rescued group replaced WHOLE by its guided rows (rescued: {group: rows})."""
    rows = list(rows)
    for g, guided in rescued.items():
        assert len(guided) == group_size, "a rescued group must bring exactly group_size rows"
        rows[g * group_size : (g + 1) * group_size] = guided
    return rows


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: setup (flags, seeding, run folder, Ctrl-C, model, data, resume)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    check_run_args(args, tis=args.tis, eval_samples=args.eval_samples, eval_pass_k=args.eval_pass_k)
    ckpt = checkpoint.open_checkpoint(args.resume, rank, world)
    if not args.prefix_fractions or not all(0 <= f <= 1 for f in args.prefix_fractions):
        raise SystemExit(f"error: --prefix-fractions {args.prefix_fractions}: give one or more fractions in [0, 1]")
    if not 0 < args.is_clip_min <= 1:
        raise SystemExit(f"error: --is-clip-min {args.is_clip_min} must be in (0, 1]")
    dist.seed_everything(args.seed + rank)  # python, numpy and torch: each rank its own random stream
    run_dir = logger.run_folder(args, rank)
    ctrl_c = checkpoint.catch_ctrl_c(run_dir, rank, __file__, args.save_optimizer)  # Ctrl-C: one line, status 130
    model_path = args.model_name  # a hub id or a local folder
    if model_path.lower() in models.EMBEDDED_NAMES:  # an embedded model, built once and cached by grounds/
        import grounds  # only then: a fork without grounds/ runs on hub ids and local folders
        model_path = grounds.path_of(model_path)
    tokenizer = models.load_tokenizer(model_path, args.system_prompt)
    train_problems, eval_problems = data.load_train_eval(args)
    model = models.load_policy(model_path, args, device)  # float32 master weights; --dtype: compute precision
    models.mask_padded_head(model, len(tokenizer))  # no probability on LM-head rows the tokenizer lacks
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)  # each layer recomputed in backward (set before sharding)
    ref_model = models.frozen_copy(model) if args.beta > 0 else None
    model, ref_model = dist.shard_models(args, model, ref_model)  # --fsdp: FSDP2; otherwise unchanged
    # ALGO LOGIC: the batch sizes; AdamW, warmed up linearly over --warmup-steps optimizer steps, then constant
    args.batch_size = args.num_prompts * args.group_size  # rollouts per step (per rank)
    args.minibatch_size = args.batch_size // args.num_minibatches  # rollouts per optimizer step (check_run_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
    # TRY NOT TO MODIFY: the prompt sampler, the rollout engine, resume and the logger
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    if not any(p.solution for p in train_problems):
        raise SystemExit("error: no training problem has a reference solution, so there is nothing to guide with; "
                         "name the field with --solution-field")
    # ALGO LOGIC: training rows (problem, prefix fraction or None). OC-GRPO-Fixed probes the cascade once with the base
    # model (before any resume, so a resumed run rebuilds the same rows); one guided row per solvable problem is added
    rows = [(p, None) for p in train_problems]
    if args.guidance == "fixed":
        probe = guidance_cascade(engine, tokenizer, train_problems, list(range(len(train_problems))),
                                 args.fixed_probe_samples, args, model)[0]
        rows += [(train_problems[i], probe[i][0]) for i in sorted(probe)]
        if rank == 0:
            print(f"fixed guidance: {len(probe)}/{len(train_problems)} problems solvable with a prefix")
    sampler = data.PromptSampler(rows, args.seed + rank)
    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)

    run_eval = evaluate.evaluator(engine, tokenizer, eval_problems, args)  # greedy and sampled accuracy, pass@k
    first_eval = evaluate.first_evaluation(run_eval, state, writer)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # 1. Rollouts: G completions for each of num_prompts prompts (fixed guidance: guided rows sample from x~)
        G = args.group_size
        items = sampler.next(args.num_prompts)
        problems, fracs = [p for p, _ in items], [f for _, f in items]
        prompt_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer) for p in problems],
                                         args.max_prompt_tokens)
        sample_ids = [x if f is None else data.encode_prompts(tokenizer, [render_guided_prompt(
            p, tokenizer, solution_prefix(p.solution, f))], args.max_prompt_tokens)[0]
            for x, p, f in zip(prompt_ids, problems, fracs)]
        with logger.timed(times, "generate"):
            sampled = engine.generate(sample_ids, n=G, temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens,
                                      return_logprobs=args.rollout_backend == "vllm")

        # 2. Rewards from the verifier
        with logger.timed(times, "score"):
            group_problems = [p for p in problems for _ in range(args.group_size)]
            correct = verifiers.score(sampled.texts, group_problems, sampled.truncated_B)  # cut at the cap: 0
            unguided_B = torch.tensor([f is None for f in fracs]).repeat_interleave(G)
            first_correct_B = torch.tensor(correct)

        # ALGO LOGIC: 2b. the cascade: each unguided group whose G rollouts all fail is replaced WHOLE by the G
        # rollouts of the lowest prefix fraction with a success (no success at any fraction: it stays all-zero)
        with logger.timed(times, "guidance"):
            failed = [g for g in range(len(problems)) if fracs[g] is None and not any(correct[g * G : (g + 1) * G])]
            rescued, guide_tokens, t_guide_gen = (guidance_cascade(engine, tokenizer, problems, failed, G, args, model)
                                                  if args.guidance == "adaptive" else ({}, 0, 0.0))
            fracs = [rescued[g][0] if g in rescued else f for g, f in enumerate(fracs)]
            batch_rows = [(sample_ids[b // G], c, correct[b], lp)  # lp: the sampler's log-probs (vllm), else None
                          for b, (c, lp) in enumerate(zip(rollout.split_completions(sampled), sampler_rows(sampled)))]
            batch_rows = replace_groups(batch_rows, {g: [(r[1], c, ok, lp) for c, ok, lp in zip(r[2], r[3], r[4])]
                                                     for g, r in rescued.items()}, G)
            guided_B = torch.tensor([f is not None for f in fracs]).repeat_interleave(G)
        times["generate"] += t_guide_gen  # time/generate counts the cascade's generation too

        # guided rows are re-attached to the unguided prompt x ([x|y]); --prompt-mode hinted keeps x~ ([x~|y])
        completions = [c for _, c, _, _ in batch_rows]
        width = max(len(c[0]) for c in completions)
        hinted = args.prompt_mode == "hinted"
        rollouts = rollout.attach([s if hinted else prompt_ids[b // G] for b, (s, *_) in enumerate(batch_rows)],
                                  completions, tokenizer.pad_token_id, width)
        correct_B = torch.tensor([ok for _, _, ok, _ in batch_rows])
        sampler_logp_BC = None  # vllm: the sampler's log-probs of each row's tokens, in the completion columns
        if sampled.sampler_logp_BC is not None:
            sampler_logp_BC = torch.zeros_like(rollouts.completion_mask_BC)
            for b, (*_, lp) in enumerate(batch_rows):
                sampler_logp_BC[b, : len(lp)] = lp
        rewards_B = correct_B.clone()
        if args.format_reward_weight:
            rewards_B += args.format_reward_weight * torch.tensor(
                [verifiers.format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)])

        # ALGO LOGIC: 3. group-relative advantages (zero-std groups get exactly 0)
        adv_PG, zero_std_P = group_advantages(rewards_B.view(-1, args.group_size), args.adv_norm, args.adv_eps)
        adv_B = adv_PG.flatten()
        # every advantage 0 on every rank and no KL term: the gradient is 0, yet AdamW's step still moves the weights
        # (momentum, weight decay), as in veRL and TRL; --skip-zero-advantage-steps skips it (update/skipped)
        skip = (args.skip_zero_advantage_steps and args.beta <= 0
                and dist.all_reduce_sum(torch.count_nonzero(adv_B).float()).item() == 0)
        mask_BC = rollouts.completion_mask_BC.clone()
        if args.filter_zero_std:
            mask_BC *= (~zero_std_P).repeat_interleave(args.group_size).float().unsqueeze(1)

        # 4. old and reference log-probs on [x|y] (no grad), hint log-probs on [x~|y] for guided rows, and the
        # context-shift weight w (1 on unguided rows); with one epoch and one mini-batch, rho = 1 exactly, and the
        # update's own forward gives the trainer's log-probs that a separate sampler (vllm) is compared with
        with logger.timed(times, "logprobs"):
            needs_old = not skip and (args.num_iterations > 1 or args.num_minibatches > 1)
            guided_rows = guided_B.nonzero().flatten()
            shifted = not skip and not hinted and dist.max_over_ranks(len(guided_rows), model) > 0  # off the prompt
            hint_pass = shifted and (args.correction != "none" or sampler_logp_BC is not None)
            # batched_logprobs: completion_logprobs without grad, micro_batch_size rows at a time, 0 past the end
            old_logp_BC = (rollout.batched_logprobs(model, rollouts, args.temperature, args.micro_batch_size,
                                                    args.share_prompt, args.top_p)
                           if needs_old or hint_pass else None)
            w_BC = torch.ones_like(mask_BC)
            if hint_pass:  # --fsdp: on every rank when any rank has guided rows
                w_BC[guided_rows], hint_logp_BC = hint_weights(model, old_logp_BC, batch_rows, guided_rows.tolist(),
                                                               width, args, tokenizer.pad_token_id)
                if sampler_logp_BC is not None:  # vllm drew the guided rows from x~; the loss compares it on [x|y]:
                    # shifted by log pi_old(y|x) - log pi_old(y|x~), the difference the loss takes is the sampler's
                    # against the trainer in the sampler's own context (the context shift is w's, not --tis's)
                    sampler_logp_BC[guided_rows] += old_logp_BC[guided_rows] - hint_logp_BC
            adv_BC = adv_B.unsqueeze(1) * w_BC  # the weight multiplies the (detached) advantage, not the ratio
            batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                         prompt_len=rollouts.prompt_len, mask_BC=mask_BC, adv_BC=adv_BC,
                         sampler_logp_BC=sampler_logp_BC,
                         old_logp_BC=old_logp_BC if needs_old else None,
                         ref_logp_BC=rollout.batched_logprobs(ref_model, rollouts, args.temperature,
                                                              args.micro_batch_size, args.share_prompt, args.top_p)
                         if ref_model is not None else None)

        # 5. Update: num_iterations epochs x num_minibatches optimizer steps, micro-batched
        with logger.timed(times, "update"):
            sums, grad_norms, lr = {}, [], scheduler.get_last_lr()[0]
            for _ in range(0 if skip else args.num_iterations):  # skipped: no optimizer step, the schedule stays
                order = rollout.minibatch_order(args)  # --share-prompt: whole groups, as the log-prob passes took them
                for mb in order.split(args.minibatch_size):
                    counts = minibatch_counts(mask_BC[mb])  # normalisers of the whole mini-batch, all ranks
                    optimizer.zero_grad(set_to_none=True)
                    for rows in mb.split(args.micro_batch_size):
                        loss, stats = micro_batch_loss(model, batch, rows, args, counts)
                        loss.backward()
                        for k, v in stats.items():
                            sums[k] = sums.get(k, 0.0) + v
                    dist.all_reduce_grads(model)
                    grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item())
                    optimizer.step()
                    lr = scheduler.get_last_lr()[0]  # the rate this optimizer step used
                    scheduler.step()  # per optimizer step: --warmup-steps counts optimizer steps
            optimizer.zero_grad(set_to_none=True)  # gradients freed before a vllm engine wakes
            engine.sync_weights(model)

        # TRY NOT TO MODIFY: metrics (names documented in docs/runs.md); loss/* are means over optimizer steps, the
        # other sums (the vllm sampler's rollout/* included) are over tokens
        gen_tokens = sampled.lengths_B.sum().item() + guide_tokens  # the cascade's included
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": first_correct_B[unguided_B].float().mean().item() if unguided_B.any() else 0.0,
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),  # over all ranks' tokens
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device, gen_tokens),
        }
        # guidance and importance-weight statistics (weights over guided tokens; 1, 1, 0 when no row is guided)
        metrics.update({
            "guide/zero_reward_groups": float(len(failed)), "guide/rescued_groups": float(len(rescued)),
            "guide/frac_rescued": len(rescued) / max(len(failed), 1),
            "guide/guided_groups": float(sum(f is not None for f in fracs)),
            "guide/fraction_mean": float(np.mean([f for f in fracs if f is not None] or [0.0])),
            **{f"guide/groups_at_f{f:g}": float(sum(x == f for x in fracs)) for f in args.prefix_fractions},
            **weight_metrics(w_BC[guided_rows][rollouts.completion_mask_BC[guided_rows] > 0], args.is_clip_min),
        })
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rows as text (samples.jsonl), guided ones as trained
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=rewards_B,
                correct=correct_B,
                format=[verifiers.format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)],
                advantage=adv_B, guidance_fraction=[f for f in fracs for _ in range(G)],
                is_weight=(w_BC * mask_BC).sum(1) / mask_BC.sum(1).clamp(min=1))
        if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
            metrics.update(run_eval())
        metrics["perf/step_time"] = time.time() - t_step
        writer.log(step, metrics, bar)
        writer.warn_if_stuck(step, metrics, args.max_new_tokens)  # one console line after 3 steps without signal
        stop = ctrl_c.stop_asked()  # a Ctrl-C on any rank: every rank stops after this step (one all-reduce)
        if stop or step == args.total_steps or args.save_every and step % args.save_every == 0:
            checkpoint.save_checkpoint(run_dir, step, model, tokenizer, optimizer if args.save_optimizer else None,
                                       scheduler, sampler, {"first_eval": first_eval})
        if stop:
            ctrl_c.exit_saved(bar)  # "stopped after step N (checkpoint saved); continue with: ...", status 130

    ctrl_c.step = None  # the final evaluation: a Ctrl-C quits at once
    final_eval = evaluate.final_evaluation(run_eval, writer, first_eval, args.total_steps)  # logged, printed
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir}


if __name__ == "__main__":
    main(ARGS)
