"""AdaKP: adaptive knowledge-point selection by an entropy proxy, re-chosen online during RL (docs/adakp.md).

The AdaKP paper is not public; this follows the design in docs/adakp.md (inferred, not from a paper), on KnowRL
(arXiv 2604.12627: GRPO on prompts that carry a minimal subset of a problem's candidate knowledge points, KPs).
Each training problem x has candidate KPs k_1..k_m (testbed: `Problem.hints`; real data: a `kp_list` field).
The policy is trained on the hinted prompt x (+) S, held-out evaluation is on the plain prompt. S is chosen per
problem by how much each KP lowers the policy's entropy on a fixed probe continuation z (teacher forcing):

    H_bar(c)     = (1/L) sum_l H( pi_theta(. | c, z_<l) )                 (mean next-token entropy on the probe)
    score(k | S) = H_bar(x (+) S) - H_bar(x (+) S (+) k)                  (entropy reduction k brings, given S)
    w_it         = clip( pi_old(y_it | x, y_<t) / pi_old(y_it | x~, y_<t), c_min, 1 )     (--correction per_token)

S and every S + k of every problem being (re)selected are scored in one batched no-grad forward per greedy
round: add argmax_k score(k | S) while it is >= delta and |S| < budget; re-chosen when a sampled problem's
selection is older than R steps; a group passing at >= p_hi drops its lowest-scoring KP, an all-wrong one raises
its budget. Top-K truncation gives (1 - eps) H_K, at most h_b(eps) + eps log(|V| - K) below H per position
(eps: the tail mass). The update is GRPO (grpo.py) with clip-higher 0.28 and token-mean loss, on the hinted
prompt x~ (KnowRL) or, with --correction, on [x|y] with OC-GRPO's weight w on the advantage. Ours, each a flag:
the proxy and its probe, the truncation, greedy selection, re-selection, fading, growing and the --kp-mode
baselines. Left out: KnowRL's dynamic sampling, clip-high annealing and rollout-based CSS/LOO selectors.
Metrics beyond grpo.py's: kp/*, is/* (with --correction) and time/proxy, described in docs/adakp.md.

    python adakp.py                                         # embedded CPU demo on testbed level 4, a few minutes
    python adakp.py --kp-mode static                        # the baselines: none, all, random, static
    python adakp.py --model-name Qwen/Qwen2.5-1.5B-Instruct --dataset knowrl_train.jsonl --eval-dataset test.jsonl \\
        --solution-field solution --device cuda --dtype bfloat16 --max-new-tokens 2048 --probe-len 96 \\
        --num-prompts 32 --group-size 8 --micro-batch-size 8 --gradient-checkpointing --learning-rate 1e-6 \\
        --total-steps 200                                   # 80 GB: fp32 masters 25 GB + ~14 GB a micro-batch
    torchrun --nproc-per-node 8 adakp.py --device cuda --fsdp ...   # one rank per GPU; --fsdp: FSDP2 sharding

Shapes: B rows (= P prompts x G group), T tokens per row, C completion tokens, V vocabulary, N probe contexts
scored in one forward, K the entropy proxy's top-k.
"""

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

from common.args import TrainArgs, check_at_least, check_run_args


@dataclass
class Args(TrainArgs):  # common/args.py: run folder, resume, logging, device, sampling, optimiser, data, eval
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    eval_samples: int = 4
    """samples per problem for sampled accuracy and pass@k (0: greedy only)"""
    eval_pass_k: int = 4
    """k of the logged eval/pass_at_k"""
    levels: tuple[int, ...] = (4,)
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
    clip_high: float = 0.28
    """ratio clipped above at 1 + clip_high (0.28: DAPO's clip-higher, KnowRL's paper value before its annealing to
    0.26 at step 2,590; its released train/knowrl.sh sets 0.26)"""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """token_mean: sum / tokens in the mini-batch; seq_mean_token_mean: mean over sequences of per-sequence means;
    constant: sum / (sequences x max_new_tokens) (Dr. GRPO)"""
    beta: float = 0.0
    """KL coefficient to the initial policy (0: no reference model is loaded)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator with d = logp - logp_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d"""
    filter_zero_std: bool = False
    """drop groups whose rewards are all equal from the loss (they have zero advantage anyway)"""
    kp_mode: Literal["adakp", "none", "all", "random", "static"] = "adakp"
    """which knowledge points the training prompt shows: adakp (proxy-greedy, re-chosen online), none (plain GRPO),
    all, random (--budget random KPs per problem, drawn once), static (proxy-greedy once before training)"""
    budget: int = 3
    """B_max: the most KPs chosen per problem at first (adakp: fading lowers it, --grow-budget raises it)"""
    delta: float = 0.02
    """greedy stops when the best remaining KP lowers the probe entropy by less than this (nats)"""
    reselect_every: int = 0
    """R: a sampled problem whose selection is older than R steps is re-selected (0: one epoch of training prompts)"""
    probe: Literal["reference", "rollout"] = "reference"
    """probe continuation z: reference (testbed: answer + eos; real data: the reference solution's first --probe-len
    tokens, else the answer) or rollout (the latest correct training rollout of the problem, else the reference)"""
    probe_len: int = 96
    """L: the probe is cut to its first L tokens"""
    entropy_top_k: int = 50
    """K: entropy over the top-K tokens only, (1 - eps) H_K, with its bias bound logged (0: exact entropy)"""
    proxy_batch_size: int = 256
    """contexts per no-grad proxy forward (a greedy round over more contexts takes several)"""
    fade_pass_rate: float = 0.75
    """p_hi: a group whose hinted pass rate is at least this drops its lowest-scoring KP (above 1: never fade)"""
    grow_budget: bool = True
    """an all-wrong group raises its problem's budget by one (up to its number of KPs) and forces a re-selection"""
    correction: Literal["none", "per_token"] = "none"
    """none: train on the hinted prompt (KnowRL); per_token: train on the plain prompt with OC-GRPO's weight
    clip(pi_old(y|x) / pi_old(y|x~), c_min, 1) on the advantage"""
    is_clip_min: float = 0.01
    """c_min, the lower clamp of the --correction weight (its upper clamp is 1)"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))

import numpy as np
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


def clipped_surrogate(logp_BC, old_logp_BC, adv_BC, clip_low: float, clip_high: float):
    """Per-token loss -min(rho wA, clip(rho, 1 - eps_low, 1 + eps_high) wA), and where the clip is active.
    adv_BC is the per-token advantage w_it * A_i (w = 1 without --correction)."""
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


def importance_weights(old_logp_BC, hint_logp_BC, mask_BC, c_min: float) -> torch.Tensor:
    """OC-GRPO's context-shift weight, w = clip(pi_old(y|x) / pi_old(y|x~), c_min, 1); padding gets 1.

    >>> importance_weights(torch.tensor([[-1., -5., -1.]]), torch.tensor([[-2., -0.1, -1.]]),
    ...                    torch.tensor([[1., 1., 0.]]), 0.01)
    tensor([[1.0000, 0.0100, 1.0000]])
    """
    w_BC = (old_logp_BC - hint_logp_BC).exp().clamp(c_min, 1.0)
    return torch.where(mask_BC > 0, w_BC, torch.ones_like(w_BC))


def weight_metrics(w_N: torch.Tensor, c_min: float) -> dict:
    """is/weight_mean, is/weight_min and is/frac_at_clamp (the share at the lower clamp c_min) of the context-shift
    weights of the N tokens they apply to: 1, 1 and 0 when there are none."""
    if not len(w_N):
        return {"is/weight_mean": 1.0, "is/weight_min": 1.0, "is/frac_at_clamp": 0.0}
    return {"is/weight_mean": w_N.mean().item(), "is/weight_min": w_N.min().item(),
            "is/frac_at_clamp": (w_N <= c_min * (1 + 1e-6)).float().mean().item()}


# ALGO LOGIC: the entropy proxy, its truncation bound, and the greedy interaction-aware selector
def truncated_entropy(logits_NV: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy of softmax(logits) per row over the top-K tokens, (1 - eps) H_K (H_K: entropy of the renormalised top
    K, eps: the tail mass). As H = h_b(eps) + (1 - eps) H_K + eps H(tail / eps), the exact entropy exceeds it by 0
    to h_b(eps) + eps log(|V| - K). Returns (entropy, bound, eps); top_k <= 0 or >= |V|: exact, bound and eps 0.

    >>> h, b, e = truncated_entropy(torch.zeros(1, 4), 2); h.item(), round(b.item(), 4), e.item()
    (0.3465735912322998, 1.0397, 0.5)
    """
    logp_NV = logits_NV.float().log_softmax(-1)
    V = logp_NV.shape[-1]
    if top_k <= 0 or top_k >= V:
        zero_N = torch.zeros(logp_NV.shape[:-1])
        return -(logp_NV.exp() * logp_NV).sum(-1), zero_N, zero_N
    top_logp_NK = logp_NV.topk(top_k, -1).values
    log_mass_N = top_logp_NK.logsumexp(-1)
    eps_N = (1 - log_mass_N.exp()).clamp(0, 1)
    q_logp_NK = top_logp_NK - log_mass_N.unsqueeze(-1)
    h_k_N = -(q_logp_NK.exp() * q_logp_NK).sum(-1)
    h_b_N = -(torch.xlogy(eps_N, eps_N) + torch.xlogy(1 - eps_N, 1 - eps_N))  # binary entropy h_b(eps), nats
    return (1 - eps_N) * h_k_N, h_b_N + eps_N * math.log(V - top_k), eps_N


@torch.no_grad()
def probe_entropy(model, contexts: list[list[int]], probes: list[list[int]], pad_id: int, vocab: int, top_k: int,
                  batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """H_bar of each context: the mean next-token entropy over its probe continuation, teacher-forced, in no-grad
    forwards of `batch_size` rows. Returns (H_bar_N, bound_N, eps_N, forwards): each row's mean per-position
    truncation bound and tail mass, and the forwards run. --fsdp: as many rows as the busiest rank (padding)."""
    device, was_training, n = next(model.parameters()).device, model.training, len(contexts)
    pad = dist.max_over_ranks(n, model) - n
    rows = rollout.attach(contexts + [[pad_id]] * pad, [(z, "", False) for z in probes + [[pad_id]] * pad], pad_id)
    model.eval()
    out = []
    for s in range(0, n + pad, batch_size):
        ids_BT, attn_BT = (x[s : s + batch_size].to(device) for x in (rows.input_ids_BT, rows.attention_mask_BT))
        # completion_logits: the model's logits at the positions that predict the probe's tokens
        logits_BCV = rollout.completion_logits(model, ids_BT, attn_BT, rows.prompt_len)[..., :vocab]  # padded rows out
        out.append([x.cpu() for x in truncated_entropy(logits_BCV, top_k)])
    model.train(was_training)
    mask_BC = rows.completion_mask_BC[:n]
    n_B = mask_BC.sum(1).clamp(min=1)
    h_N, b_N, eps_N = ((torch.cat(x)[:n] * mask_BC).sum(1) / n_B for x in zip(*out))
    return h_N, b_N, eps_N, len(out)


def greedy_select(entropy_fn, num_kps: list[int], budgets: list[int], delta: float, model=None):
    """Greedy interaction-aware KP subsets for several problems at once. `entropy_fn(requests)` maps (problem j,
    subset S as KP indices) pairs to their H_bar values and bounds, scored together. Each round asks for S_j and
    every S_j + k of each problem j still growing, then adds argmax_k score(k | S_j) if it is >= delta and |S_j| <
    budget_j. Returns (subsets, each chosen KP's score when added, the largest truncation bound seen per problem,
    the number of rounds). A sharded `model`: rounds go on while any rank has a problem growing."""
    J = len(num_kps)
    subsets, gains, bound = [[] for _ in range(J)], [[] for _ in range(J)], [0.0] * J
    active, rounds = [j for j in range(J) if budgets[j] > 0 and num_kps[j] > 0], 0
    while not dist.agree(not active, model):
        cands = {j: [k for k in range(num_kps[j]) if k not in subsets[j]] for j in active}
        h_N, b_N = entropy_fn([(j, subsets[j] + add) for j in active for add in [[]] + [[k] for k in cands[j]]])
        rounds, at, still = rounds + 1, 0, []
        for j in active:  # rows at..at+n of h_N: S_j, then S_j + k for each candidate k
            n = 1 + len(cands[j])
            h_S, h_k = h_N[at].item(), h_N[at + 1 : at + n].tolist()
            bound[j], at = max(bound[j], *b_N[at : at + n].tolist()), at + n
            best = max(range(len(h_k)), key=lambda i: h_S - h_k[i])  # first of ties: lowest KP index
            if h_S - h_k[best] >= delta:
                subsets[j].append(cands[j][best])
                gains[j].append(h_S - h_k[best])
                if len(subsets[j]) < min(budgets[j], num_kps[j]):
                    still.append(j)
        active = still
    return subsets, gains, bound, rounds


def probe_tokens(problem, tokenizer, probe_len: int, cached: list[int] | None = None) -> list[int]:
    """The probe continuation z of a problem: a cached correct rollout when given, else the reference (testbed: the
    answer and eos, which is the whole completion; real data: the solution, else the answer), cut to probe_len."""
    if cached:
        return cached[:probe_len]
    if problem.task == "testbed":
        return (tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:probe_len]
    return tokenizer(problem.solution or problem.answer, add_special_tokens=False)["input_ids"][:probe_len]


def initial_kps(problems: list, args: Args) -> dict:
    """The KP state of every problem: the subset S (indices into p.hints, in the order chosen), the score each KP had
    when it was added, the step S was chosen at (None: choose when next sampled), and the budget. --kp-mode all: every
    KP; random: a budget-sized random subset; none: no KP; adakp and static choose S with `select_kps`."""
    n_kps = [len(p.hints) for p in problems]
    kp = {"S": [[] for _ in problems], "gain": [[] for _ in problems], "chosen_at": [None] * len(problems),
          "budget": [min(args.budget, m) for m in n_kps]}
    if args.kp_mode == "all":
        kp["S"] = [list(range(m)) for m in n_kps]
    elif args.kp_mode == "random":
        rng = random.Random(f"kp-{args.seed}")
        kp["S"] = [sorted(rng.sample(range(m), min(args.budget, m))) for m in n_kps]
    return kp


def select_kps(model, tokenizer, problems: list, idx: list[int], step: int, kp: dict, probe_cache: dict, proxy: dict,
               args: Args) -> tuple[list[float], list[float]]:
    """Choose S for the problems `idx` with the current policy (`greedy_select` on the entropy proxy), recorded in `kp`
    as chosen at `step`; returns the chosen KPs' scores and the truncation bounds. `proxy` counts the forwards, the
    contexts scored and their tail mass; `probe_cache`: --probe rollout's latest correct rollout of each problem."""
    def entropy_fn(requests):  # H_bar and truncation bound of (j, S) requests: one batched no-grad forward
        probs = [problems[idx[j]] for j, _ in requests]
        texts = [data.render_prompt(p, tokenizer, hints=[p.hints[k] for k in S]) for p, (_, S) in zip(probs, requests)]
        probes = [probe_tokens(p, tokenizer, args.probe_len, probe_cache.get(idx[j]) if args.probe == "rollout"
                               else None) for p, (j, _) in zip(probs, requests)]
        contexts = data.encode_prompts(tokenizer, texts, args.max_prompt_tokens) if texts else []  # --fsdp: maybe none
        h_N, b_N, eps_N, passes = probe_entropy(model, contexts, probes, tokenizer.pad_token_id, len(tokenizer),
                                                args.entropy_top_k, args.proxy_batch_size)
        proxy.update(passes=proxy["passes"] + passes, rows=proxy["rows"] + len(requests),
                     eps=proxy["eps"] + eps_N.sum().item())
        return h_N, b_N

    subsets, gains, bounds, _ = greedy_select(entropy_fn, [len(problems[i].hints) for i in idx],
                                              [kp["budget"][i] for i in idx], args.delta, model)
    for i, S, g in zip(idx, subsets, gains):
        kp["S"][i], kp["gain"][i], kp["chosen_at"][i] = S, g, step
    return [x for g in gains for x in g], bounds


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: setup (flags, seeding, run folder, Ctrl-C, model, data, resume)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    check_run_args(args, tis=args.tis, eval_samples=args.eval_samples, eval_pass_k=args.eval_pass_k)
    ckpt = checkpoint.open_checkpoint(args.resume, rank, world)
    check_at_least(args, 0, "budget", "reselect_every", "entropy_top_k")
    check_at_least(args, 1, "probe_len", "proxy_batch_size")
    if not 0 < args.is_clip_min <= 1:
        raise SystemExit(f"error: --is-clip-min {args.is_clip_min} must be in (0, 1]")
    if args.correction != "none" and args.tis != "none":
        raise SystemExit("error: --tis weighs the sampler's own context; with --correction the rows are trained on "
                         "another prompt, so use one of them")
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
    sampler = data.PromptSampler(list(range(len(train_problems))), args.seed + rank)  # yields problem indices
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    if args.kp_mode != "none" and not any(p.hints for p in train_problems):
        raise SystemExit(f"error: --kp-mode {args.kp_mode}: no training problem has knowledge points "
                         "(a 'kp_list' field in the data, or the testbed's hints)")

    # ALGO LOGIC: the KP state of every problem (initial_kps); static: chosen once with the initial policy (before
    # any resume), never changed; --probe rollout caches a correct rollout per problem
    kp, probe_cache, proxy = initial_kps(train_problems, args), {}, {"passes": 0, "rows": 0, "eps": 0.0}
    reselect_every = args.reselect_every or max(1, math.ceil(len(train_problems) / args.num_prompts))
    if args.kp_mode == "static":
        select_kps(model, tokenizer, train_problems, list(range(len(train_problems))), 0, kp, probe_cache, proxy, args)
        if rank == 0:
            print(f"static KP selection: mean |S| {np.mean([len(S) for S in kp['S']]):.2f} "
                  f"({proxy['passes']} forwards over {proxy['rows']} contexts)")

    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    kp, probe_cache = state.get("kp", kp), state.get("probe_cache", probe_cache)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)

    run_eval = evaluate.evaluator(engine, tokenizer, eval_problems, args)  # greedy and sampled accuracy, pass@k
    first_eval = evaluate.first_evaluation(run_eval, state, writer)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # ALGO LOGIC: 0. (re)select S for sampled problems whose selection is missing or older than R steps
        idx = sampler.next(args.num_prompts)
        problems = [train_problems[i] for i in idx]
        with logger.timed(times, "proxy"):
            proxy.update(passes=0, rows=0, eps=0.0)
            stale = [i for i in dict.fromkeys(idx) if args.kp_mode == "adakp"
                     and (kp["chosen_at"][i] is None or step - kp["chosen_at"][i] >= reselect_every)]
            chosen_scores, bounds = select_kps(model, tokenizer, train_problems, stale, step, kp, probe_cache, proxy,
                                               args)  # on every rank: --fsdp keeps the proxy passes in step

        # 1. Rollouts: G completions for each of num_prompts hinted prompts x~ = x (+) S
        shown = [list(kp["S"][i]) for i in idx]
        prompt_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer, hints=[p.hints[k] for k in S])
                                                     for p, S in zip(problems, shown)], args.max_prompt_tokens)
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

        # ALGO LOGIC: 2b. fade (pass rate >= p_hi: drop the lowest-scoring KP, the budget shrinks to what is left)
        # and grow (all wrong: budget + 1, re-selected when next sampled); --probe rollout caches a correct rollout
        G = args.group_size
        pass_P = correct_B.view(-1, G).float().mean(1)
        faded = grown = 0
        completions = (rollout.split_completions(rollouts) if args.probe == "rollout" or args.correction != "none"
                       else None)
        for g, i in enumerate(idx):
            if args.probe == "rollout" and pass_P[g] > 0:
                probe_cache[i] = completions[g * G + int(correct_B[g * G : (g + 1) * G].float().argmax())][0]
            if args.kp_mode != "adakp":
                continue
            if pass_P[g] >= args.fade_pass_rate and kp["S"][i]:
                drop = min(range(len(kp["S"][i])), key=lambda n: kp["gain"][i][n])  # the lowest-scoring KP
                del kp["S"][i][drop], kp["gain"][i][drop]
                kp["budget"][i], faded = len(kp["S"][i]), faded + 1
            elif pass_P[g] == 0 and args.grow_budget and kp["budget"][i] < len(problems[g].hints):
                kp["budget"][i], kp["chosen_at"][i], grown = kp["budget"][i] + 1, None, grown + 1

        # 2c. --correction: the rollouts are trained on the plain prompt [x|y] (same completion columns as [x~|y])
        plain_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer) for p in problems],
                                        args.max_prompt_tokens)
        train_rollouts = rollouts if args.correction == "none" else rollout.attach(
            [plain_ids[b // G] for b in range(len(completions))], completions, tokenizer.pad_token_id,
            rollouts.completion_ids_BC.shape[1])

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

        # 4. old and reference log-probs (no grad); with one epoch and one mini-batch, rho = 1 exactly, and the update's
        # own forward gives the trainer's log-probs that a separate sampler (vllm) is compared with (no extra pass).
        # --correction: the weight w = clip(pi_old(y|x) / pi_old(y|x~), c_min, 1) on rows shown KPs (1 elsewhere)
        with logger.timed(times, "logprobs"):
            needs_old = not skip and (args.num_iterations > 1 or args.num_minibatches > 1)
            weigh = not skip and args.correction != "none"  # the context-shift weights (none for a skipped update)
            # batched_logprobs: completion_logprobs without grad, micro_batch_size rows at a time, 0 past the end
            old_logp_BC = (rollout.batched_logprobs(model, train_rollouts, args.temperature,
                                                    args.micro_batch_size, args.share_prompt, args.top_p)
                           if needs_old or weigh else None)
            w_BC = torch.ones_like(mask_BC)
            hinted_B = torch.tensor([len(S) > 0 for S in shown]).repeat_interleave(G)
            if weigh and dist.max_over_ranks(int(hinted_B.any()), model):  # --fsdp: on every rank if any shows KPs
                hint_logp_BC = rollout.batched_logprobs(model, rollouts, args.temperature,
                                                        args.micro_batch_size, args.share_prompt, args.top_p)
                w_BC = torch.where(hinted_B.unsqueeze(1), importance_weights(old_logp_BC, hint_logp_BC, mask_BC,
                                                                             args.is_clip_min), w_BC)
            batch = dict(input_ids_BT=train_rollouts.input_ids_BT, attention_mask_BT=train_rollouts.attention_mask_BT,
                         prompt_len=train_rollouts.prompt_len, mask_BC=mask_BC, adv_BC=adv_B.unsqueeze(1) * w_BC,
                         sampler_logp_BC=rollouts.sampler_logp_BC if not weigh else None,
                         old_logp_BC=old_logp_BC if needs_old else None,
                         ref_logp_BC=rollout.batched_logprobs(ref_model, train_rollouts, args.temperature,
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
        helpful = [p.hint_helpful[k] for p, S in zip(problems, shown) for k in S if p.hint_helpful]
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(),
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device, train_rollouts=train_rollouts),
            # knowledge-point statistics (docs/adakp.md)
            "kp/mean_size": float(np.mean([len(S) for S in shown])),
            "kp/budget_mean": float(np.mean([kp["budget"][i] for i in idx])),
            "kp/helpful_frac": float(np.mean(helpful)) if helpful else 0.0, "kp/reselected": float(len(stale)),
            "kp/proxy_passes": float(proxy["passes"]), "kp/proxy_rows": float(proxy["rows"]),
            "kp/score_mean": float(np.mean(chosen_scores)) if chosen_scores else 0.0,
            "kp/trunc_eps_mean": proxy["eps"] / max(proxy["rows"], 1), "kp/trunc_bound_max": max(bounds, default=0.0),
            "kp/faded": float(faded), "kp/grown": float(grown),
            "kp/zero_correct_frac": (pass_P == 0).float().mean().item(),
        }
        if args.correction != "none":  # over the tokens of rows shown KPs (a skipped update's: all 1, none computed)
            metrics.update(weight_metrics(w_BC[hinted_B][mask_BC[hinted_B] > 0], args.is_clip_min))
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rollouts as text (samples.jsonl), with the KPs shown
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, G, reward=rewards_B, correct=correct_B,
                format=[verifiers.format_reward(t, p.task) for t, p in zip(rollouts.texts, group_problems)],
                advantage=adv_B,
                kps_shown=[[p.hints[k] for k in S] for p, S in zip(problems, shown) for _ in range(G)])
        if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
            metrics.update(run_eval())
        metrics["perf/step_time"] = time.time() - t_step
        writer.log(step, metrics, bar)
        writer.warn_if_stuck(step, metrics, args.max_new_tokens)  # one console line after 3 steps without signal
        stop = ctrl_c.stop_asked()  # a Ctrl-C on any rank: every rank stops after this step (one all-reduce)
        if stop or step == args.total_steps or args.save_every and step % args.save_every == 0:
            checkpoint.save_checkpoint(run_dir, step, model, tokenizer, optimizer if args.save_optimizer else None,
                                       scheduler, sampler, {"first_eval": first_eval},
                                       rank_extra={"kp": kp, "probe_cache": probe_cache})  # each rank's own
        if stop:
            ctrl_c.exit_saved(bar)  # "stopped after step N (checkpoint saved); continue with: ...", status 130

    ctrl_c.step = None  # the final evaluation: a Ctrl-C quits at once
    final_eval = evaluate.final_evaluation(run_eval, writer, first_eval, args.total_steps,
                                           what="held-out no-hint greedy accuracy")  # logged, printed
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir}


if __name__ == "__main__":
    main(ARGS)
