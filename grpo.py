"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).

For each prompt x, sample a group of G completions, score them with a verifier, and use
the group-normalised reward as the advantage of every token of a completion:

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)                                   (group z-score)
    J   = E[ agg_{i,t} min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) - beta KL_it ]
    rho_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)

Options that matter and are stated, not hidden: the advantage normalisation (group std,
mean only as in Dr. GRPO, or batch std), the loss aggregation `agg` (token mean over the
whole batch, per-sequence mean then mean, or a constant as in Dr. GRPO), separate low/high
clip (DAPO's clip-higher), the KL estimator (k1/k2/k3) and `beta` (0 by default: then no
reference model is loaded), and `num_iterations` PPO epochs over each batch (with one
epoch and one mini-batch the ratio is exactly 1 and the loss reduces to REINFORCE with a
group baseline, so old log-probs are not recomputed).

Left out, on purpose: a value model (GRPO has none), entropy bonuses, dynamic re-sampling
to refill filtered groups (zero-std groups can be dropped, not replaced), sequence packing.

    python grpo.py                                          # embedded CPU demo, a few minutes
    python grpo.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --device cuda --dtype bfloat16 --max-new-tokens 512 \\
        --num-prompts 32 --group-size 8 --micro-batch-size 16 --learning-rate 1e-6 --total-steps 200
    torchrun --nproc-per-node 8 grpo.py --model-name ... --device cuda   # data parallel, one rank per GPU
    python grpo.py --rollout-backend vllm --tis token ...   # colocated vLLM sampler (optional extra, README)

With `--rollout-backend vllm` the sampler is a separate engine, so its log-probs are compared with
the trainer's every step (rollout/mismatch_k1, rollout/mismatch_k3) and, with `--tis`, the policy
loss is weighted by the truncated ratio min(pi_trainer / pi_sampler, C) (Yao et al. 2025).

Shapes: B rows (= P prompts x G group), T tokens per row (prompt then completion), C completion tokens.
"""

import os
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


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))

import torch

from common import checkpoint, data, dist, evaluate, logger, models, rollout, verifiers


# ALGO LOGIC: advantages, KL, the clipped objective and its normalisers (--tis: common.rollout.sampler_correction)
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


def clipped_surrogate(logp_BC, old_logp_BC, adv_B, clip_low: float, clip_high: float):
    """Per-token loss -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), and where the clip is active."""
    ratio_BC = torch.exp(logp_BC - old_logp_BC)
    adv_B1 = adv_B.unsqueeze(1)
    unclipped_BC = -ratio_BC * adv_B1
    clipped_BC = -ratio_BC.clamp(1 - clip_low, 1 + clip_high) * adv_B1
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
    """GRPO loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch whose
    normalisers are `counts` (minibatch_counts: tokens, non-empty sequences, sequences)."""
    device = next(model.parameters()).device
    ids_BT, attn_BT = batch["input_ids_BT"][rows].to(device), batch["attention_mask_BT"][rows].to(device)
    mask_BC = batch["mask_BC"][rows].to(device)
    # completion_logprobs: log_softmax(logits / T) gathered at the completion ids, chunked for memory
    logp_BC, entropy_BC = rollout.completion_logprobs(model, ids_BT, attn_BT, batch["prompt_len"], args.temperature,
                                                      with_entropy=True, share_prompt=args.share_prompt,
                                                      top_p=args.top_p)
    old_logp_BC = batch["old_logp_BC"][rows].to(device) if batch["old_logp_BC"] is not None else logp_BC.detach()
    pg_BC, clipped_BC = clipped_surrogate(logp_BC, old_logp_BC, batch["adv_B"][rows].to(device),
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


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: setup (flags, seeding, run folder, Ctrl-C, model, data, resume)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    check_run_args(args, tis=args.tis, eval_samples=args.eval_samples, eval_pass_k=args.eval_pass_k)
    ckpt = checkpoint.open_checkpoint(args.resume, rank, world)
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
    sampler = data.PromptSampler(train_problems, args.seed + rank)
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)

    run_eval = evaluate.evaluator(engine, tokenizer, eval_problems, args)  # greedy and sampled accuracy, pass@k
    first_eval = evaluate.first_evaluation(run_eval, state, writer)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # 1. Rollouts: G completions for each of num_prompts prompts
        problems = sampler.next(args.num_prompts)
        prompt_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer) for p in problems],
                                         args.max_prompt_tokens)
        with logger.timed(times, "generate"):
            rollouts = engine.generate(prompt_ids, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                       max_new_tokens=args.max_new_tokens,
                                       return_logprobs=args.rollout_backend == "vllm")

        # 2. Rewards from the verifier
        with logger.timed(times, "score"):
            group_problems = [p for p in problems for _ in range(args.group_size)]
            correct_B = torch.tensor(verifiers.score(rollouts.texts, group_problems, rollouts.truncated_B))  # cut: 0
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

        # 4. old and reference log-probs (no grad); with one epoch and one mini-batch, rho = 1 exactly,
        # and the update's own forward gives the trainer's log-probs that a separate sampler (vllm) is
        # compared with, so that comparison costs no extra pass.
        with logger.timed(times, "logprobs"):
            needs_old = not skip and (args.num_iterations > 1 or args.num_minibatches > 1)
            # batched_logprobs: completion_logprobs without grad, micro_batch_size rows at a time, 0 past the end
            batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                         prompt_len=rollouts.prompt_len, mask_BC=mask_BC, adv_B=adv_B,
                         sampler_logp_BC=rollouts.sampler_logp_BC,
                         old_logp_BC=rollout.batched_logprobs(model, rollouts, args.temperature,
                                                              args.micro_batch_size, args.share_prompt, args.top_p)
                         if needs_old else None,
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
        # other sums are over tokens
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(),
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),  # over all ranks' tokens
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device),
        }
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rollouts as text (samples.jsonl): no extra generation
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=rewards_B,
                correct=correct_B,
                format=[verifiers.format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)],
                advantage=adv_B)
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
