"""RLOO with a Self-Evolving Curriculum (SEC, Chen et al. 2025, arXiv 2505.14970; RLOO: Ahmadian et al.
2024, "Back to Basics", arXiv 2402.14740).

RLOO: for each prompt x, sample G completions, score them with a verifier, and use the
leave-one-out baseline as the advantage of every token of a completion (no std scaling):

    A_i = r_i - 1/(G-1) sum_{j != i} r_j                 ( = G/(G-1) (r_i - mean_j r_j) )
    J   = E[ agg_{i,t} min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) ]
    r_i <- r_i - beta sum_t (log pi_old(y_it) - log pi_ref(y_it))       (KL folded into the reward, beta > 0)

With one epoch and one mini-batch rho = 1 and the loss is REINFORCE with the leave-one-out
baseline, -A_i sum_t log pi(y_it) / B with the default `seq_sum` aggregation; with
`num_iterations` > 1 it is PPO-clip on the same advantages.

SEC: the prompt sampler is a non-stationary multi-armed bandit over categories ("arms":
difficulty levels, or success-rate buckets discovered from the rewards). Each prompt slot
draws an arm from a Boltzmann policy over the non-empty arms, then a problem uniformly
from that arm; after the rollouts, every arm in the batch is rewarded with the mean
absolute advantage of ALL its rollouts (all-correct and all-wrong groups count as 0):

    pi(c)    = exp(Q(c)/tau) / sum_c' exp(Q(c')/tau)              (over arms with problems)
    r_t(c)   = mean_{rollouts i of arm c in the batch} |A_i|      (E = 2 p_c (1 - p_c) for RLOO, 0/1 rewards)
    Q(c)    <- alpha r_t(c) + (1 - alpha) Q(c)                    (TD(0), sampled arms only; non-finite skipped)

so the curriculum prefers the arms whose success rate is near 1/2, where RLOO groups are
not degenerate. `--curriculum estimated` needs no labels: a per-problem success-rate EMA
(unseen problems 0.5) puts problems in K buckets (bucket 0 hardest), re-indexed every few
steps (on the small CPU demo it then trains on a handful of bucketed problems and does
worse than uniform: benchmarks/testbed/rloo_sec_benchmark.md). `--curriculum uniform` is the baseline
(arms drawn uniformly, the bandit only logged) and `--arm-signal reward|success` the
paper's ablation (the bandit then chases easy arms).

Left out, on purpose: a value model and entropy bonus (RLOO has none), SEC with a learned
or multi-key category (one key: the level, or the estimated bucket), sharing the
per-problem success rates across ranks under torchrun (Q-values are shared: arm sums and
counts are all-reduced; each rank keeps its own success-rate table), sequence packing.

    python rloo_sec.py                                      # embedded CPU demo, levels 1-5, a few minutes
    python rloo_sec.py --curriculum estimated               # difficulty discovered from rewards
    python rloo_sec.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset-config main \\
        --curriculum estimated --device cuda --dtype bfloat16 --max-new-tokens 512 --num-prompts 64 \\
        --group-size 8 --micro-batch-size 16 --learning-rate 1e-6 --total-steps 200
    python rloo_sec.py --dataset math_train.jsonl --eval-dataset math_test.jsonl ...   # a 'level' field gives the arms
    torchrun --nproc-per-node 8 rloo_sec.py --model-name ... --device cuda   # data parallel, one rank per GPU

With `--rollout-backend vllm` the sampler's log-probs are compared with the trainer's (rollout/mismatch_k1,
rollout/mismatch_k3) and `--tis` weights the policy loss by min(pi_trainer / pi_sampler, C), as in grpo.py.

Shapes: B rows (= P prompts x G group), T tokens per row, C completion tokens, M curriculum arms.
"""

import math
import os
import random
import time
from dataclasses import dataclass, field
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
    levels: tuple[int, ...] = (1, 2, 3, 4, 5)
    """testbed difficulty levels to train and evaluate on (1 easiest .. 5 hardest); with several, SEC has arms"""

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

    # Optimisation
    num_iterations: int = 1
    """PPO epochs over each rollout batch (1: REINFORCE with the leave-one-out baseline; > 1: PPO-clip)"""

    # Algorithm
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low (active only with several epochs or mini-batches)"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high"""
    loss_agg: Literal["seq_sum", "token_mean", "seq_mean_token_mean", "constant"] = "seq_sum"
    """seq_sum: sum over tokens and sequences / sequences (RLOO paper: -A_i sum_t log pi); token_mean: sum / tokens;
    seq_mean_token_mean: mean of per-sequence means; constant: sum / (sequences x max_new_tokens)"""
    beta: float = 0.0
    """KL coefficient, folded into the reward: r_i - beta sum_t (logp_old - logp_ref) (0: no reference model)"""

    # Curriculum (SEC)
    curriculum: Literal["label", "estimated", "uniform"] = "label"
    """label: one arm per problem level; estimated: arms are success-rate buckets learned from rewards;
    uniform: arms (by level) drawn uniformly, the bandit is only logged (baseline)"""
    arm_signal: Literal["advantage", "reward", "success"] = "advantage"
    """arm reward: mean |A| of the arm's rollouts (SEC); mean reward or success rate (ablations)"""
    sec_tau: float = 0.4
    """Boltzmann temperature tau of the curriculum policy softmax(Q / tau)"""
    sec_alpha: float = 0.5
    """TD(0) step size alpha: Q <- alpha r + (1 - alpha) Q"""
    sec_q_init: float = 0.0
    """initial Q-value of every arm"""
    num_buckets: int = 5
    """K: success-rate buckets in estimated mode (bucket 0 hardest)"""
    reindex_every: int = 5
    """estimated mode: re-bucket problems every N steps"""
    success_ema: float = 0.3
    """estimated mode: per-problem success rate p <- (1 - ema) p + ema s/G (first observation: p = s/G)"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))

import torch

from common import checkpoint, data, dist, evaluate, logger, models, rollout, verifiers


# ALGO LOGIC: RLOO advantages, the clipped objective and its normalisers (--tis: common.rollout.sampler_correction)
def rloo_advantages(rewards_PG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out advantage r_i - mean_{j != i} r_j of each completion, and whether its group had zero reward std.

    >>> a, z = rloo_advantages(torch.tensor([[1., 0., 0.], [1., 1., 1.]])); a, z
    (tensor([[ 1.0000, -0.5000, -0.5000],
            [ 0.0000,  0.0000,  0.0000]]), tensor([False,  True]))
    """
    G = rewards_PG.shape[1]
    baseline_PG = (rewards_PG.sum(1, keepdim=True) - rewards_PG) / (G - 1)
    zero_std_P = (rewards_PG.max(1).values - rewards_PG.min(1).values) == 0
    return rewards_PG - baseline_PG, zero_std_P


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
    if mode == "seq_sum":  # differs from grpo.py: this extra mode (the RLOO paper's); the others are grpo.py's
        return summed_B.sum() / max(num_seqs, 1.0)
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
    """RLOO loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
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
    agg = lambda x: aggregate(x, mask_BC, args.loss_agg, *counts, args.max_new_tokens)  # noqa: E731
    loss = agg(pg_BC)
    with torch.no_grad():
        log_ratio_BC = (logp_BC - old_logp_BC) * mask_BC  # padding: 0, never exp(+large)
        stats = {  # token sums over this micro-batch; divided by the mini-batch token count by the caller
            "loss/policy": loss.item(),
            "policy/clip_frac": (clipped_BC * mask_BC).sum().item(),
            "policy/approx_kl": ((torch.expm1(-log_ratio_BC) + log_ratio_BC) * mask_BC).sum().item(),
            "policy/entropy": (entropy_BC * mask_BC).sum().item(),
            **sampler_stats,
        }
    return loss, stats


# ALGO LOGIC: the SEC curriculum, a Boltzmann bandit over arms of problems
@dataclass
class Curriculum:
    """Arms (lists of indices into the training problems), their Q-values, and in estimated mode
    the success-rate EMA of every problem seen so far (keyed by uid). Saved in checkpoints."""

    names: list
    """arm names: the level (label, uniform) or the bucket index, 0 hardest (estimated)"""
    arms: list
    """problem indices of each arm"""
    q: list
    """Q(c) of each arm"""
    rate: dict = field(default_factory=dict)
    """estimated mode: uid -> success-rate EMA"""
    steps: int = 0
    """feedback steps seen (re-bucketing clock)"""
    rng: random.Random = field(default_factory=random.Random)
    """draws arms and problems (its state is checkpointed)"""

    def state_dict(self) -> dict:
        return {"names": self.names, "arms": self.arms, "q": self.q, "rate": self.rate, "steps": self.steps,
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.names, self.arms, self.q = state["names"], state["arms"], state["q"]
        self.rate, self.steps = state["rate"], state["steps"]
        self.rng.setstate(state["rng"])


def arm_probs(q: list, sizes: list, tau: float, uniform: bool = False) -> list:
    """softmax(Q / tau) over the arms that have problems; empty arms get probability 0.

    >>> [round(p, 4) for p in arm_probs([0.0, 0.4, 9.0], [5, 5, 0], tau=0.4)]
    [0.2689, 0.7311, 0.0]
    """
    live = [i for i, n in enumerate(sizes) if n > 0]
    if not live:
        raise SystemExit("error: every curriculum arm is empty (no training problems)")
    logits = [0.0 if uniform else q[i] / tau for i in live]
    top = max(logits)
    w = [math.exp(x - top) for x in logits]
    probs = [0.0] * len(q)
    for i, wi in zip(live, w):
        probs[i] = wi / sum(w)
    return probs


def sample_batch(cur: Curriculum, problems: list, n: int, probs: list) -> tuple[list, list]:
    """For each of n prompt slots: an arm c ~ probs, then a problem uniformly from that arm."""
    arm_P = cur.rng.choices(range(len(probs)), weights=probs, k=n)
    return arm_P, [problems[cur.rng.choice(cur.arms[c])] for c in arm_P]


def arm_feedback(signal_B: torch.Tensor, arm_B: torch.Tensor, num_arms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the per-rollout signal of each arm (every rollout counts, zero advantages included)."""
    sums_M = torch.zeros(num_arms, dtype=torch.float64).index_add_(0, arm_B, signal_B.double())
    return sums_M, torch.bincount(arm_B, minlength=num_arms).double()


def td_update(q: list, sums_M: torch.Tensor, counts_M: torch.Tensor, alpha: float) -> list:
    """Q(c) <- alpha r(c) + (1 - alpha) Q(c) with r(c) = sum / count, for arms in the batch with a finite r(c).

    >>> td_update([0.0, 1.0, 0.5], torch.tensor([2.0, 0.0, float("nan")]), torch.tensor([4.0, 0.0, 2.0]), 0.5)
    [0.25, 1.0, 0.5]
    """
    new = list(q)
    for c in range(len(q)):
        if counts_M[c] > 0:
            r = (sums_M[c] / counts_M[c]).item()
            if math.isfinite(r):
                new[c] = alpha * r + (1 - alpha) * q[c]
    return new


def update_success_rates(rate: dict, uids: list, success_P: list, ema: float) -> None:
    """Per-problem success-rate EMA: the first observation sets it, later ones move it by `ema`."""
    for uid, s in zip(uids, success_P):
        rate[uid] = s if uid not in rate else (1 - ema) * rate[uid] + ema * s


def bucket_arms(problems: list, rate: dict, num_buckets: int) -> list:
    """Problem indices per success-rate bucket min(floor(p K), K - 1) (bucket 0 hardest; unseen p = 0.5)."""
    arms = [[] for _ in range(num_buckets)]
    for i, p in enumerate(problems):
        arms[min(int(rate.get(p.uid, 0.5) * num_buckets), num_buckets - 1)].append(i)
    return arms


def make_curriculum(problems: list, args: Args, seed: int) -> Curriculum:
    """Arms by level (label, uniform) or all problems in the unseen-problem bucket (estimated)."""
    if args.curriculum == "estimated":
        names, arms = [str(b) for b in range(args.num_buckets)], bucket_arms(problems, {}, args.num_buckets)
    else:
        levels = sorted({p.level for p in problems})
        names = [str(lv) for lv in levels]
        arms = [[i for i, p in enumerate(problems) if p.level == lv] for lv in levels]
    return Curriculum(names, arms, [args.sec_q_init] * len(arms), rng=random.Random(seed))


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
    sampler = make_curriculum(train_problems, args, args.seed + rank)
    train_levels = sorted({p.level for p in train_problems})
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0, extra=("sec/prob/",))  # the curriculum: console, plot

    run_eval = evaluate.evaluator(engine, tokenizer, eval_problems, args)  # greedy and sampled accuracy, pass@k
    first_eval = evaluate.first_evaluation(run_eval, state, writer)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # ALGO LOGIC: 1. SEC batch: an arm per prompt slot from softmax(Q / tau), a problem uniformly from it
        probs = arm_probs(sampler.q, [len(a) for a in sampler.arms], args.sec_tau, args.curriculum == "uniform")
        arm_P, problems = sample_batch(sampler, train_problems, args.num_prompts, probs)
        # 1. Rollouts: G completions for each of num_prompts prompts
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

        # ALGO LOGIC: 3. leave-one-out advantages (all-equal groups get exactly 0); beta > 0 folds the KL in (4a)
        G = args.group_size
        adv_PG, zero_std_P = rloo_advantages(rewards_B.view(-1, G))
        # every advantage 0 on every rank and no KL term: the gradient is 0, yet AdamW's step still moves the weights
        # (momentum, weight decay), as in veRL and TRL; --skip-zero-advantage-steps skips it (update/skipped)
        skip = (args.skip_zero_advantage_steps and args.beta <= 0
                and dist.all_reduce_sum(torch.count_nonzero(adv_PG).float()).item() == 0)

        # 4. old and reference log-probs (no grad); with one epoch and one mini-batch, rho = 1 exactly,
        # and the update's own forward gives the trainer's log-probs that a separate sampler (vllm) is
        # compared with, so that comparison costs no extra pass.
        mask_BC = rollouts.completion_mask_BC.clone()
        with logger.timed(times, "logprobs"):
            needs_old = not skip and (args.num_iterations > 1 or args.num_minibatches > 1 or args.beta > 0)
            # batched_logprobs: completion_logprobs without grad, micro_batch_size rows at a time, 0 past the end
            old_logp_BC = (rollout.batched_logprobs(model, rollouts, args.temperature, args.micro_batch_size,
                                                    args.share_prompt, args.top_p)
                           if needs_old else None)
            ref_logp_BC = (rollout.batched_logprobs(ref_model, rollouts, args.temperature,
                                                    args.micro_batch_size, args.share_prompt, args.top_p)
                           if ref_model is not None else None)

        # ALGO LOGIC: 4a. the KL to the reference folded into the reward, and the advantages of that reward
        seq_kl_B = torch.zeros_like(rewards_B)
        if ref_model is not None:  # r_i - beta sum_t (logp_old - logp_ref); zero_std stays the verifier's
            seq_kl_B = ((old_logp_BC - ref_logp_BC) * mask_BC).sum(1)
            adv_PG = rloo_advantages((rewards_B - args.beta * seq_kl_B).view(-1, G))[0]
        adv_B = adv_PG.flatten()
        batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                     prompt_len=rollouts.prompt_len, mask_BC=mask_BC, adv_B=adv_B,
                     sampler_logp_BC=rollouts.sampler_logp_BC, old_logp_BC=old_logp_BC)

        # ALGO LOGIC: 4b. SEC: arm reward = mean signal over ALL the arm's rollouts; TD(0) on the sampled arms only
        arm_B = torch.tensor(arm_P).repeat_interleave(G)
        signal_B = {"advantage": adv_B.abs(), "reward": rewards_B, "success": correct_B}[args.arm_signal]
        num_arms = len(sampler.arms)
        sums_M, counts_M = arm_feedback(signal_B, arm_B, num_arms)
        abs_adv_M = arm_feedback(adv_B.abs(), arm_B, num_arms)[0]
        success_M = arm_feedback(correct_B, arm_B, num_arms)[0]
        sums_M, counts_M, abs_adv_M, success_M = dist.all_reduce_sum(torch.stack([sums_M, counts_M, abs_adv_M,
                                                                                  success_M]))
        sampler.q = td_update(sampler.q, sums_M, counts_M, args.sec_alpha)
        sampler.steps += 1
        if args.curriculum == "estimated":  # difficulty from the rewards already computed: no extra rollouts
            update_success_rates(sampler.rate, [p.uid for p in problems], correct_B.view(-1, G).mean(1).tolist(),
                                 args.success_ema)
            if sampler.steps % args.reindex_every == 0:
                sampler.arms = bucket_arms(train_problems, sampler.rate, args.num_buckets)

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
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(),
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),  # over all ranks' tokens
            "loss/kl": seq_kl_B.mean().item(),
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device),
        }
        for c, name in enumerate(sampler.names):  # SEC: where the bandit puts its mass, and what each arm returns
            n = counts_M[c].item()
            metrics.update({f"sec/q/arm_{name}": sampler.q[c], f"sec/prob/arm_{name}": probs[c],
                            f"sec/count/arm_{name}": n / G, f"sec/size/arm_{name}": float(len(sampler.arms[c])),
                            f"sec/mean_abs_adv/arm_{name}": abs_adv_M[c].item() / n if n else float("nan"),
                            f"sec/success/arm_{name}": success_M[c].item() / n if n else float("nan")})
        metrics.update({f"sec/level_frac/level_{lv}": sum(p.level == lv for p in problems) / len(problems)
                        for lv in train_levels})
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rollouts as text (samples.jsonl): no extra generation
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=rewards_B,
                correct=correct_B,
                format=[verifiers.format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)],
                advantage=adv_B, arm=[sampler.names[a] for a in arm_B.tolist()])
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
    if rank == 0:
        per_level = [k for k in final_eval if k.startswith("eval/greedy_accuracy/level_")]
        if per_level:
            print("per level: " + ", ".join(
                f"L{k.rsplit('_', 1)[1]} {first_eval.get(k, 0.0):.2f} -> {final_eval[k]:.2f}" for k in per_level))
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir}


if __name__ == "__main__":
    main(ARGS)
