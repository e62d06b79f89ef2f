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
"""

import copy
import os
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro
from tqdm import tqdm

from common.data import PromptSampler, encode_prompts, load_problems, render_prompt
from common.dist import all_reduce_grads, all_reduce_mean, all_reduce_sum, init_distributed, shard_models
from common.evaluate import evaluate
from common.logger import RunLogger, check_run_args, open_checkpoint, resume, save_checkpoint
from common.models import load_model, load_tokenizer
from common.rollout import batched_logprobs, completion_logprobs, make_engine, sampler_mismatch, tis_weights
from common.verifiers import format_reward, score


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    seed: int = 1
    """seed of python, numpy and torch (each rank adds its rank)"""
    run_name: str = ""
    """run folder name under --output-dir; default {exp_name}__{seed}__{unix time}"""
    output_dir: str = "runs"
    """where run folders are created"""
    resume: str = ""
    """path of a run folder to continue from its latest checkpoint"""
    save_every: int = 0
    """write a checkpoint every N steps (0: only at the end)"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to keep it local)"""
    wandb_project: str = "tinypost"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    device: str = "cpu"
    """torch device ('cpu', 'cuda')"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the policy weights"""
    fsdp: bool = False
    """shard parameters, gradients and AdamW state over the torchrun ranks with FSDP2 (per decoder layer and the
    root; reference model too); without it every rank holds the whole model (docs/fsdp.md)"""
    fsdp_mixed_precision: bool = False
    """with --fsdp: forward and backward in bfloat16 copies of the parameters, gradients reduced in float32"""

    # Model and data
    model_name: str = "testbed-weak"
    """'testbed-weak', 'testbed-strong' (built locally and cached), a Hugging Face id, or a local folder"""
    dataset: str = "testbed"
    """'testbed', a local .jsonl file, or a Hugging Face dataset name"""
    dataset_config: str | None = None
    """Hugging Face dataset config (e.g. 'main' for openai/gsm8k)"""
    train_split: str = "train"
    """split used for training (Hugging Face datasets)"""
    eval_dataset: str = ""
    """dataset for held-out evaluation (default: --dataset); needed for local files, which have no splits"""
    eval_split: str = "test"
    """split used for held-out evaluation"""
    levels: tuple[int, ...] = (3,)
    """testbed difficulty levels to train and evaluate on (1 easiest .. 5 hardest)"""
    question_field: str | None = None
    """record field holding the question (auto-detected when unset)"""
    answer_field: str | None = None
    """record field holding the final answer (auto-detected when unset)"""
    solution_field: str | None = None
    """record field holding a reference solution (optional)"""
    num_train_problems: int = 0
    """keep only this many training problems (0: all; testbed: 500 per level)"""
    max_prompt_tokens: int = 0
    """truncate prompts to their last N tokens (0: never)"""

    # Rollouts
    rollout_backend: Literal["hf", "hf_generate", "vllm"] = "hf"
    """generation engine: 'hf' (a KV-cache sampling loop on the training weights, each prompt prefilled once
    per group), 'hf_generate' (plain model.generate) or 'vllm' (a colocated vLLM engine that gets the weights
    in place after every update; needs the vllm extra, see README)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory the colocated vLLM engine may take (GPU only)"""
    tis: Literal["none", "token", "sequence"] = "none"
    """truncated importance sampling for the sampler/trainer mismatch: weight the policy loss by
    min(pi_trainer / pi_sampler, tis_cap) per token or per sequence (needs sampler log-probs: vllm)"""
    tis_cap: float = 2.0
    """truncation C of the importance weight"""
    num_prompts: int = 16
    """prompts per step (per rank)"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling (1.0 keeps the sampler exactly on-policy)"""
    max_new_tokens: int = 8
    """completion length cap; completions without eos are 'truncated'"""
    format_reward_weight: float = 0.0
    """weight of the format reward added to the correctness reward"""

    # Optimisation
    total_steps: int = 300
    """number of GRPO steps (rollout + update)"""
    learning_rate: float = 5e-5
    """AdamW learning rate (constant after warmup)"""
    warmup_steps: int = 0
    """linear learning-rate warmup over this many optimizer steps (num_iterations x num_minibatches per step)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_minibatches: int = 1
    """optimizer steps per epoch over each rollout batch"""
    num_iterations: int = 1
    """PPO epochs over each rollout batch (mu in the GRPO paper)"""
    micro_batch_size: int = 32
    """rows per forward/backward; gradients do not depend on it"""

    # Algorithm
    adv_norm: Literal["group_std", "group_mean", "batch_std"] = "group_std"
    """group_std: (r - mean_G) / (std_G + eps); group_mean: r - mean_G (Dr. GRPO); batch_std: / std over the batch"""
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

    # Evaluation
    eval_every: int = 50
    """evaluate every N steps (0: only before and after training)"""
    num_eval_problems: int = 200
    """held-out problems per evaluation"""
    eval_samples: int = 4
    """samples per problem for sampled accuracy and pass@k (0: greedy only)"""
    eval_pass_k: int = 4
    """k of the logged eval/pass_at_k"""

    # Filled in at runtime
    batch_size: int = 0
    """rollouts per step per rank = num_prompts * group_size"""
    minibatch_size: int = 0
    """rollouts per optimizer step = batch_size // num_minibatches"""


# ALGO LOGIC: advantages, KL and the clipped objective
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
        return centred_PG / (rewards_PG.std(unbiased=False) + eps), zero_std_P
    raise ValueError(f"unknown advantage normalisation {mode!r}")


def kl_penalty(logp_BC: torch.Tensor, ref_logp_BC: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate on sampled tokens (http://joschu.net/blog/kl-approx.html)."""
    d = logp_BC - ref_logp_BC
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}")


def clipped_surrogate(logp_BC, old_logp_BC, adv_B, clip_low: float, clip_high: float):
    """Per-token loss -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), and where the clip is active."""
    ratio_BC = torch.exp(logp_BC - old_logp_BC)
    adv_B1 = adv_B.unsqueeze(1)
    unclipped = -ratio_BC * adv_B1
    clipped = -ratio_BC.clamp(1 - clip_low, 1 + clip_high) * adv_B1
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def aggregate(token_loss_BC, mask_BC, mode: str, num_tokens: float, num_seqs: float, max_new_tokens: int):
    """Reduce per-token losses of one micro-batch with normalisers of the whole mini-batch,
    so that summing micro-batch gradients gives the mini-batch gradient whatever the split."""
    summed_B = (token_loss_BC * mask_BC).sum(1)
    if mode == "token_mean":
        return summed_B.sum() / max(num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        return (summed_B / mask_BC.sum(1).clamp(min=1)).sum() / max(num_seqs, 1.0)
    if mode == "constant":
        return summed_B.sum() / max(num_seqs * max_new_tokens, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def micro_batch_loss(model, batch: dict, rows: torch.Tensor, args: Args, norm: dict):
    """GRPO loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
    device = next(model.parameters()).device
    ids, attn = batch["input_ids_BT"][rows].to(device), batch["attention_mask_BT"][rows].to(device)
    mask_BC = batch["mask_BC"][rows].to(device)
    logp_BC, entropy_BC = completion_logprobs(model, ids, attn, batch["prompt_len"], args.temperature,
                                              with_entropy=True)
    old_logp_BC = batch["old_logp_BC"][rows].to(device) if batch["old_logp_BC"] is not None else logp_BC.detach()
    pg_BC, clipped_BC = clipped_surrogate(logp_BC, old_logp_BC, batch["adv_B"][rows].to(device),
                                          args.clip_low, args.clip_high)
    sampler_stats = {}
    if batch.get("sampler_logp_BC") is not None:  # a separate sampler (vllm): its mismatch with the trainer, --tis
        sampler_logp_BC = batch["sampler_logp_BC"][rows].to(device)
        tis_w_BC = tis_weights(old_logp_BC, sampler_logp_BC, mask_BC, args.tis, args.tis_cap)
        pg_BC = pg_BC * tis_w_BC
        n_tok = mask_BC.sum().item()
        sampler_stats = {k: v * n_tok for k, v in sampler_mismatch(old_logp_BC, sampler_logp_BC, mask_BC).items()}
        sampler_stats["rollout/tis_weight_mean"] = (tis_w_BC * mask_BC).sum().item()
    token_loss_BC = pg_BC
    kl_BC = torch.zeros_like(pg_BC)
    if args.beta > 0:
        kl_BC = kl_penalty(logp_BC, batch["ref_logp_BC"][rows].to(device), args.kl_estimator)
        token_loss_BC = pg_BC + args.beta * kl_BC
    agg = lambda x: aggregate(x, mask_BC, args.loss_agg, norm["tokens"], norm["seqs"], args.max_new_tokens)  # noqa
    loss = agg(token_loss_BC)
    with torch.no_grad():
        log_ratio = logp_BC - old_logp_BC
        stats = {  # token sums over this micro-batch; divided by the mini-batch token count by the caller
            "loss/policy": agg(pg_BC).item(), "loss/kl": agg(kl_BC).item(),
            "policy/clip_frac": (clipped_BC * mask_BC).sum().item(),
            "policy/approx_kl": ((torch.expm1(-log_ratio) + log_ratio) * mask_BC).sum().item(),
            "policy/entropy": (entropy_BC * mask_BC).sum().item(),
            **sampler_stats,
        }
    return loss, stats


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: sizes, seeding, run folder
    rank, world, device = init_distributed(args.device)
    check_run_args(args)  # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    ckpt = open_checkpoint(args.resume, rank, world)
    args.batch_size = args.num_prompts * args.group_size
    args.minibatch_size = args.batch_size // args.num_minibatches
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    run_dir = args.resume.rstrip("/") or os.path.join(
        args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}")

    tokenizer = load_tokenizer(args.model_name)
    fields_ = dict(dataset_config=args.dataset_config, question_field=args.question_field,
                   answer_field=args.answer_field, solution_field=args.solution_field)
    train_problems = load_problems(args.dataset, args.train_split, args.levels, args.num_train_problems, args.seed,
                                   **fields_)
    eval_problems = load_problems(args.eval_dataset or args.dataset, args.eval_split, args.levels,
                                  args.num_eval_problems, args.seed, **fields_)
    model = load_model(args.model_name, args.dtype, device)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    model, ref_model = shard_models(args, model, ref_model)  # --fsdp: FSDP2; otherwise unchanged
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
    sampler = PromptSampler(train_problems, args.seed + rank)
    engine = make_engine(args.rollout_backend, model, tokenizer, args.seed + rank, args.vllm_gpu_memory_utilization)

    start_step, first_eval = 0, None
    if ckpt:  # weights, optimizer, scheduler, and this rank's own RNG states and sampler position
        state = resume(ckpt, model, optimizer, scheduler, sampler, args.dtype, device)
        start_step, first_eval = state["step"], state.get("first_eval")
        engine.sync_weights(model)
    logger = RunLogger(args, run_dir, enabled=rank == 0)

    def run_eval():
        return evaluate(engine, tokenizer, eval_problems, args.max_new_tokens, args.eval_samples,
                        args.temperature, args.eval_pass_k, args.max_prompt_tokens)

    if first_eval is None:
        first_eval = run_eval()
        logger.log(start_step, first_eval)
    bar = tqdm(range(start_step + 1, args.total_steps + 1), desc=args.exp_name, disable=rank != 0,
               initial=start_step, total=args.total_steps)
    metrics = {}
    for step in bar:
        t_step = time.time()
        # 1. Rollouts: G completions for each of num_prompts prompts
        problems = sampler.next(args.num_prompts)
        prompt_ids = encode_prompts(tokenizer, [render_prompt(p, tokenizer) for p in problems], args.max_prompt_tokens)
        t0 = time.time()
        rollouts = engine.generate(prompt_ids, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                   max_new_tokens=args.max_new_tokens, return_logprobs=args.rollout_backend == "vllm")
        t_gen = time.time() - t0

        # 2. Rewards from the verifier
        t0 = time.time()
        group_problems = [p for p in problems for _ in range(args.group_size)]
        correct_B = torch.tensor(score(rollouts.texts, group_problems))
        rewards_B = correct_B.clone()
        if args.format_reward_weight:
            rewards_B += args.format_reward_weight * torch.tensor(
                [format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)])
        t_score = time.time() - t0

        # ALGO LOGIC: 3. group-relative advantages (zero-std groups get exactly 0)
        adv_PG, zero_std_P = group_advantages(rewards_B.view(-1, args.group_size), args.adv_norm, args.adv_eps)
        adv_B = adv_PG.flatten()
        mask_BC = rollouts.completion_mask_BC.clone()
        if args.filter_zero_std:
            mask_BC *= (~zero_std_P).repeat_interleave(args.group_size).float().unsqueeze(1)

        # 4. old and reference log-probs (no grad); with one epoch and one mini-batch, rho = 1 exactly,
        # and the update's own forward gives the trainer's log-probs that a separate sampler (vllm) is
        # compared with, so that comparison costs no extra pass.
        t0 = time.time()
        needs_old = args.num_iterations > 1 or args.num_minibatches > 1
        batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                     prompt_len=rollouts.prompt_len, mask_BC=mask_BC, adv_B=adv_B,
                     sampler_logp_BC=rollouts.sampler_logp_BC,
                     old_logp_BC=batched_logprobs(model, rollouts, args.temperature, args.micro_batch_size)
                     if needs_old else None,
                     ref_logp_BC=batched_logprobs(ref_model, rollouts, args.temperature, args.micro_batch_size)
                     if ref_model is not None else None)
        t_logp = time.time() - t0

        # 5. Update: num_iterations epochs x num_minibatches optimizer steps, micro-batched
        t0 = time.time()
        sums, grad_norms = {}, []
        for _ in range(args.num_iterations):
            order = torch.randperm(args.batch_size) if args.num_minibatches > 1 else torch.arange(args.batch_size)
            for mb in order.split(args.minibatch_size):
                # normalisers of the whole mini-batch, summed over ranks, fixed before accumulation
                norm_t = all_reduce_sum(torch.tensor([mask_BC[mb].sum().item(),
                                                      float((mask_BC[mb].sum(1) > 0).sum()), float(len(mb))]))
                norm = {"tokens": norm_t[0].item(),
                        "seqs": norm_t[1].item() if args.loss_agg == "seq_mean_token_mean" else norm_t[2].item()}
                optimizer.zero_grad(set_to_none=True)
                for rows in mb.split(args.micro_batch_size):
                    loss, stats = micro_batch_loss(model, batch, rows, args, norm)
                    loss.backward()
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                all_reduce_grads(model)
                grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item())
                optimizer.step()
                lr = scheduler.get_last_lr()[0]  # the rate this optimizer step used
                scheduler.step()  # per optimizer step: --warmup-steps counts optimizer steps
        engine.sync_weights(model)
        t_update = time.time() - t0

        # TRY NOT TO MODIFY: metrics (names documented in README.md)
        n_updates = args.num_iterations * args.num_minibatches
        n_tok = max(mask_BC.sum().item() * args.num_iterations, 1.0)
        gen_tokens = rollouts.lengths_B.sum().item()
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(),
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            "loss/policy": sums["loss/policy"] / n_updates, "loss/kl": sums["loss/kl"] / n_updates,
            "policy/clip_frac": sums["policy/clip_frac"] / n_tok, "policy/approx_kl": sums["policy/approx_kl"] / n_tok,
            "policy/entropy": sums["policy/entropy"] / n_tok,
            "optim/grad_norm": float(np.mean(grad_norms)), "optim/lr": lr,
            "rollout/completion_len": rollouts.lengths_B.float().mean().item(),
            "rollout/truncated_frac": rollouts.truncated_B.float().mean().item(),
            "perf/gen_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
            "perf/train_tokens_per_s": args.num_iterations * rollouts.attention_mask_BT.sum().item() / max(t_update, 1e-9),
            "time/generate": t_gen, "time/score": t_score, "time/logprobs": t_logp, "time/update": t_update,
            "perf/peak_mem_gb": (torch.cuda.max_memory_allocated() if device.startswith("cuda")
                                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
        }
        metrics.update({k: v / n_tok for k, v in sums.items() if k.startswith("rollout/")})  # vllm sampler only
        metrics = all_reduce_mean(metrics)
        if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
            metrics.update(run_eval())
        metrics["perf/step_time"] = time.time() - t_step
        logger.log(step, metrics, bar)
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps:  # every rank: its own state
            save_checkpoint(run_dir, step, model, tokenizer, optimizer, scheduler, sampler, {"first_eval": first_eval})

    final_eval = run_eval()
    logger.log(args.total_steps, final_eval)
    logger.close()
    if rank == 0:
        before, after = first_eval.get("eval/greedy_accuracy", 0.0), final_eval.get("eval/greedy_accuracy", 0.0)
        print(f"held-out greedy accuracy: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points); "
              f"run folder {run_dir}")
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir}


if __name__ == "__main__":
    main(tyro.cli(Args))
