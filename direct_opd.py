"""Direct-OPD: Direct On-Policy Distillation (Feng et al. 2026, "Weak-to-Strong Generalization via
Direct On-Policy Distillation", arXiv 2607.05394; official code BytedTsinghua-SIA/Direct-OPD).

A weak teacher was improved by RL: pi_T_pre before, pi_T_post after. Under KL-regularised RL,
pi_T_post ∝ pi_T_pre exp(r / beta), so the teacher pair's log-ratio is the RL run's implicit dense
reward. Direct-OPD transfers that *shift*, not the teacher itself, to a stronger student, on the
student's own rollouts (s_t = (x, y_<t), y ~ pi_theta):

    Delta_T(v | s_t) = log pi_T_post(v | s_t) - log pi_T_pre(v | s_t)
    J(theta)         = E_y [ sum_t E_{v ~ pi_theta(.|s_t)} Delta_T(v | s_t) ] - beta KL(pi_theta || pi_ref)

estimated on the student's top-K support V_t (K = 16) with renormalised, detached student weights:

    w_t(v) = softmax_{v in V_t} log pi_old(v | s_t)        A_t(v) = w_t(v) Delta_T(v | s_t)

and optimised with a PPO-clip loss summed over the K entries of each position, plus a k3 KL on the
sampled token to the student's initial weights whose coefficient adapts in [0.5, 2.5], moved by each batch's
mean A before that batch's update, as in the official trainer (see `topk_clipped_surrogate` and `update_kl_coef`).
No verifier enters the loss: its accuracy is only logged. Per position, the KL-regularised optimum is
pi_ref (pi_T_post / pi_T_pre)^(1 / beta): beta = 1 copies the teacher's shift; the official beta in [0.5, 2.5]
takes between its square and its 0.4th power.

This is NOT vanilla on-policy distillation, whose reward log pi_T_post - log pi_theta pulls the student
toward the weak teacher's endpoint; `--reward vanilla_opd` runs that for comparison. `--reward
direct_plus_grpo` adds the verifier's group-normalised outcome advantage, weighted by w_t(v) (our reading
of the official `token_reward_direct_plus_grpo` estimator, off by default there too).

Four models: the student (trained), a frozen copy of it (pi_ref), and the frozen teacher pair. All
three must share one vocabulary: the student's token ids go to the teachers unchanged; this is
checked before anything is loaded. The demo's weak pair is testbed-weak before and after a short
rejection-sampling fine-tuning on level 3 (grounds.testbed_models.ensure_testbed_teacher_pair: built once,
about a minute, and cached); with any other --teacher-pre, --teacher-post is required.

Left out, on purpose: the official recipe's several sequential shifts (run the script again with the
next pair), teacher-side top-K strategies other than the student's own support (`only_stu`), and
dynamic batch sizes and sequence packing (a throughput matter). The loss aggregation is veRL's
token mean; the ratio is clamped to exp(+-20) and dual-clipped at c = 3 for negative advantages.

With `--rollout-backend vllm` the sampler's mismatch with the student is logged as in grpo.py, and `--tis sequence`
weights each row's loss by min(prod_t pi_trainer / pi_sampler, C). `--tis token` is refused: the loss at a position
is an expectation over the top-K support under the trainer's own probabilities, so the sampled token enters only
through the states after it, which the whole row's ratio corrects.

Metrics beyond grpo.py's (same names where the meaning is the same):
    reward/mean, reward/std            per rollout: sum over its tokens of sum_v A_t(v) (the dense return)
    train/accuracy                     verifier accuracy of the rollouts (logged only, never in the loss)
    adv/mean_abs                       mean |A_t(v)| over valid top-K entries
    adv/frac_zero_std                  (direct_plus_grpo only) groups whose verifier rewards are all equal
    loss/policy                        top-K clipped loss; at ratio 1 it is minus the token-mean dense reward (no
                                       baseline, so unlike grpo.py it is not about 0)
    delta_opd/weighted_reward_mean     mean A_t(v) over valid top-K entries (its sign drives the KL coefficient)
    delta_opd/sampled_logratio         mean teacher log-ratio on the sampled tokens (teacher vs student for vanilla_opd)
    delta_opd/topk_mass                mean student probability mass inside the top-K support
    kl/coef                            the KL coefficient beta used at this step (already moved by this step's batch)
    eval/teacher_{pre,post}_greedy_accuracy   held-out greedy accuracy of each teacher (step 0; --eval-teachers)

    python direct_opd.py                    # CPU demo: builds the weak pair once (~2 min), then 200 steps (~3.5 min)
    python direct_opd.py --reward vanilla_opd
    python direct_opd.py --teacher-post testbed-weak    # control: identical teachers, Delta = 0, no change
    # real models on a GPU: the weak pair is your own GRPO run, then its shift goes to a larger student
    python grpo.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset-config main \\
        --device cuda --dtype bfloat16 --max-new-tokens 512 --num-prompts 32 --group-size 8 \\
        --micro-batch-size 16 --learning-rate 1e-6 --total-steps 200 --run-name weak_grpo
    python direct_opd.py --model-name Qwen/Qwen2.5-1.5B-Instruct --teacher-pre Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher-post runs/weak_grpo/checkpoint --dataset openai/gsm8k --dataset-config main --device cuda \\
        --dtype bfloat16 --max-new-tokens 512 --num-prompts 32 --group-size 4 --micro-batch-size 8 \\
        --learning-rate 1e-6 --total-steps 200 --eval-every 20
    torchrun --nproc-per-node 8 direct_opd.py --teacher-post runs/weak_grpo/checkpoint --device cuda ...

Shapes: B rows (= P prompts x G group), T tokens per row, C completion tokens, V vocabulary, K top-K support.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

from common.args import TrainArgs, check_run_args, fail


@dataclass
class Args(TrainArgs):  # common/args.py: run folder, resume, logging, device, sampling, optimiser, data, eval
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    eval_samples: int = 4
    """samples per problem for sampled accuracy and pass@k (0: greedy only)"""
    eval_pass_k: int = 4
    """k of the logged eval/pass_at_k"""
    eval_teachers: bool = True
    """greedy held-out accuracy of both teachers at step 0, where the pair stands (two more evaluations; a benchmark
    that measured the pair once passes --no-eval-teachers)"""
    model_name: str = "testbed-strong"
    """the student: 'testbed-weak', 'testbed-strong' (built locally and cached), a Hugging Face id, or a local folder"""

    # Model and data
    teacher_pre: str = "testbed-weak"
    """the weak teacher before its RL run (pi_T_pre); same forms as --model-name"""
    teacher_post: str = ""
    """the weak teacher after its RL run (pi_T_post); '' with --teacher-pre testbed-weak: the demo pair's post model
    (testbed-weak after rejection-sampling fine-tuning on level 3, built once and cached)"""

    # Rollouts
    tis: Literal["none", "token", "sequence"] = "none"
    """truncated importance sampling for the sampler/trainer mismatch: weight the policy loss by
    min(pi_trainer / pi_sampler, tis_cap) per sequence (needs sampler log-probs: vllm); token is refused, as the loss
    at a position is an expectation over the top-K support, not a function of the token sampled there"""
    tis_cap: float = 2.0
    """truncation C of the importance weight"""
    num_prompts: int = 16
    """prompts per step (per rank)"""
    group_size: int = 4
    """completions sampled per prompt (the paper uses 4; no group baseline is needed unless direct_plus_grpo)"""
    temperature: float = 1.0
    """sampling temperature (student log-probs and top-K weights are computed at the same temperature)"""

    # Optimisation
    total_steps: int = 200
    """number of Direct-OPD steps (rollout + update)"""
    num_iterations: int = 1
    """PPO epochs over each rollout batch (the official recipe: 1)"""
    micro_batch_size: int = 64
    """rows per forward/backward; gradients do not depend on it"""

    # Algorithm
    reward: Literal["direct", "vanilla_opd", "direct_plus_grpo"] = "direct"
    """direct: log pi_T_post - log pi_T_pre; vanilla_opd: log pi_T_post - log pi_student (ablation);
    direct_plus_grpo: direct plus outcome_weight x the verifier's GRPO advantage, weighted by w_t(v)"""
    top_k: int = 16
    """K: size of the student's top-K support at every position"""
    teacher_temperature: float = 1.0
    """temperature of both teachers' log-probs"""
    outcome_weight: float = 1.0
    """weight of the GRPO outcome advantage (direct_plus_grpo only)"""
    adv_eps: float = 1e-6
    """eps in the GRPO advantage denominator (direct_plus_grpo only)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high"""
    clip_ratio_c: float = 3.0
    """dual clip: for negative advantages the per-entry loss is capped at -A * c"""
    kl_coef: float = 2.5
    """initial KL coefficient beta (k3 on the sampled token, to the student's initial weights)"""
    kl_coef_min: float = 0.5
    """lower bound of the adaptive beta"""
    kl_coef_max: float = 2.5
    """upper bound of the adaptive beta"""
    kl_adapt_rate: float = 0.01
    """beta <- beta (1 + rate) when the mean weighted reward is positive, beta (1 - rate) when negative"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator with d = logp - logp_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d (clamped to +-10)"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(  # the built-in --teacher-post has --teacher-pre's shape; the teachers
        reference=True, frozen=tuple((t, "float32" if a.master_weights else a.dtype)  # are stored as the reference
                                     for t in (a.teacher_pre, a.teacher_post or a.teacher_pre))))

import torch
import torch.nn.functional as F

from common import checkpoint, data, dist, evaluate, logger, models, rollout, verifiers


def check_same_vocab(tokenizers: dict) -> None:
    """Fail fast, naming the culprits, when models that must share a vocabulary do not."""
    names = list(tokenizers)
    ref = tokenizers[names[0]]
    for other in names[1:]:
        tok = tokenizers[other]
        if len(tok) != len(ref) or tok.get_vocab() != ref.get_vocab():
            raise SystemExit(f"error: {names[0]} and {other} have different tokenizers "
                             f"({len(ref)} vs {len(tok)} tokens); they must share one vocabulary")


def load_teacher(name: str, args: Args, device: str):
    """A frozen teacher stored and computing as the reference is (common.models.frozen_copy): float32 weights (the
    official recipe's model dtype for actor, reference and both teachers) whose forward runs under --dtype's autocast
    (under --fsdp, FSDP2's --dtype copies of them). Stored in bfloat16, they also ran their norms and residual stream
    in bfloat16: on SmolLM2 the pair's log-ratio was 0.086 from float32's on average, 0.069 now (its mean size 0.28;
    the rest is bfloat16's matrix products: docs/direct_opd.md). With --no-master-weights the policy, and so the
    reference, is stored in --dtype: the teachers too."""
    low = args.dtype != "float32"
    teacher = models.load_model(name, args.dtype if low and not args.master_weights else "float32", device)
    if low and args.master_weights and not args.fsdp:
        models.autocast_forward(teacher, getattr(torch, args.dtype))
    return teacher.eval().requires_grad_(False)


def default_teacher_post(teacher_pre: str) -> str:
    """The demo pair's post model (cached; built on first use, by rank 0 under torchrun)."""
    if teacher_pre != "testbed-weak":
        raise SystemExit(f"error: --teacher-post is required with --teacher-pre {teacher_pre} (the built-in pair is "
                         "for testbed-weak only): pass the folder of the teacher after its RL run")
    import grounds  # only for the embedded pair: a fork without grounds/ passes both teachers as folders

    return grounds.testbed_models.ensure_testbed_teacher_pair()[1]


def model_folder(name: str) -> str:
    """A hub id or a local folder as it is; an embedded name (common.models.EMBEDDED_NAMES) its cached folder, built
    once by grounds/, imported only then: a fork without grounds/ runs on hub ids and local folders."""
    if name.lower() not in models.EMBEDDED_NAMES:
        return name
    import grounds

    return grounds.path_of(name)


# ALGO LOGIC: top-K support, the teacher-pair reward, the top-K clipped objective, the adaptive KL coefficient and the
# loss normalisers (--tis: common.rollout.sampler_correction)
def completion_logp_BCV(model, input_ids_BT, attention_mask_BT, prompt_len: int, temperature: float, vocab: int):
    """Log-softmax over the shared vocabulary at every completion position: row t predicts completion token t.
    Only the last C+1 hidden states go through the LM head; padded LM-head rows beyond `vocab` are dropped
    before normalisation, as the sampler masks them (common.rollout.mask_padded_vocab), and the teachers may lack
    them."""
    # Deliberately the plain full forward, not common.rollout.completion_logits (which shares the prompt across a
    # group): that path rounds differently with and without grad (~1e-7), and the identical-teacher control needs
    # the no-grad reference and the trained student to agree bit for bit, or Adam blows the noise up into steps.
    C = input_ids_BT.shape[1] - prompt_len
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                position_ids=rollout.position_ids(attention_mask_BT), logits_to_keep=C + 1, use_cache=False)
    return F.log_softmax(out.logits[:, :-1, :vocab].float() / temperature, -1)


@torch.no_grad()
def batched_support_logprobs(model, batch: dict, temperature: float, micro_batch_size: int, vocab: int,
                             k: int = 0, ids_BCK: torch.Tensor | None = None):
    """No-grad pass: log-probs of the sampled tokens (B, C) and of a K-token support per position (B, C, K).
    With `k` the support is this model's own top-k (the student); with `ids_BCK`, the given ids (the teachers).
    Also returns the probability mass of the support. Returns (logp_BC, ids_BCK, logp_BCK, mass_BC)."""
    device = next(model.parameters()).device
    outs = []
    for s in range(0, batch["input_ids_BT"].shape[0], micro_batch_size):
        rows = slice(s, s + micro_batch_size)
        ids = batch["input_ids_BT"][rows].to(device)
        logp_BCV = completion_logp_BCV(model, ids, batch["attention_mask_BT"][rows].to(device), batch["prompt_len"],
                                       temperature, vocab)
        logp_BC = logp_BCV.gather(-1, ids[:, batch["prompt_len"]:, None]).squeeze(-1)
        if ids_BCK is None:
            logp_BCK, sup_BCK = logp_BCV.topk(k, dim=-1)
        else:
            sup_BCK = ids_BCK[rows].to(device)
            logp_BCK = logp_BCV.gather(-1, sup_BCK)
        outs.append((logp_BC.cpu(), sup_BCK.cpu(), logp_BCK.cpu(), logp_BCK.exp().sum(-1).cpu()))
    return tuple(torch.cat(x) for x in zip(*outs))


def dense_advantages(old_logp_BCK: torch.Tensor, post_logp_BCK: torch.Tensor, base_logp_BCK: torch.Tensor):
    """A_t(v) = w_t(v) * (log pi_T_post(v) - log pi_base(v)) with w = softmax of the student's top-K log-probs.
    base is pi_T_pre for Direct-OPD and the student itself for vanilla OPD. Everything here is detached.

    >>> a, w, d = dense_advantages(torch.log(torch.tensor([[[0.6, 0.2]]])), torch.tensor([[[-1.0, -2.0]]]),
    ...                            torch.tensor([[[-1.5, -1.0]]])); w, d, a
    (tensor([[[0.7500, 0.2500]]]), tensor([[[ 0.5000, -1.0000]]]), tensor([[[ 0.3750, -0.2500]]]))
    """
    weight_BCK = torch.softmax(old_logp_BCK, -1)
    delta_BCK = post_logp_BCK - base_logp_BCK
    return weight_BCK * delta_BCK, weight_BCK, delta_BCK


def group_advantages(rewards_PG: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (r - mean_G) / (std_G + eps), and whether each group had zero std (direct_plus_grpo)."""
    # differs from grpo.py: group_std only (no mode argument); equal to grpo.py's "group_std"
    mean_P1, std_P1 = rewards_PG.mean(1, keepdim=True), rewards_PG.std(1, unbiased=False, keepdim=True)
    zero_std_P = (rewards_PG.max(1).values - rewards_PG.min(1).values) == 0
    return (rewards_PG - mean_P1) / (std_P1 + eps), zero_std_P


def kl_penalty(logp_BC: torch.Tensor, ref_logp_BC: torch.Tensor, estimator: str,
               mask_BC: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate on sampled tokens (http://joschu.net/blog/kl-approx.html);
    k3 is clamped to [-10, 10] as veRL's low_var_kl is."""
    d_BC = (logp_BC - ref_logp_BC) * mask_BC  # masked before exp(-d): padding (ref log-prob 0) gives 0, not inf
    if estimator == "k1":
        return d_BC
    if estimator == "k2":
        return 0.5 * d_BC**2
    if estimator == "k3":  # differs from grpo.py: clamped to [-10, 10] (veRL low_var_kl)
        return (torch.expm1(-d_BC) + d_BC).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def topk_clipped_surrogate(logp_BCK, old_logp_BCK, adv_BCK, clip_low: float, clip_high: float, clip_c: float):
    """Per-entry PPO loss over the top-K support, dual-clipped for negative advantages, and where the clip is active.

        rho = exp(clamp(log pi_theta(v) - log pi_old(v), -20, 20))
        l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high));  l = min(l, -A c) where A < 0
    """
    # differs from grpo.py (clipped_surrogate): one loss per top-K entry, the log-ratio clamped to [-20, 20], and the
    # dual clip min(l, -A c) where A < 0; the clip indicator is the same
    ratio_BCK = torch.exp((logp_BCK - old_logp_BCK).clamp(-20.0, 20.0))
    unclipped_BCK = -adv_BCK * ratio_BCK
    clipped_BCK = -adv_BCK * ratio_BCK.clamp(1 - clip_low, 1 + clip_high)
    loss_BCK = torch.maximum(unclipped_BCK, clipped_BCK)
    loss_BCK = torch.where(adv_BCK < 0, torch.minimum(loss_BCK, -adv_BCK * clip_c), loss_BCK)
    return loss_BCK, (clipped_BCK > unclipped_BCK).float()


def update_kl_coef(kl_coef: float, weighted_reward_mean: float, rate: float, lo: float, hi: float) -> float:
    """The official adaptive controller: grow beta while the mean weighted reward is positive, shrink it while
    negative, keep it in [lo, hi].

    >>> update_kl_coef(2.5, 0.1, 0.01, 0.5, 2.5), update_kl_coef(1.0, -0.1, 0.01, 0.5, 2.5)
    (2.5, 0.99)
    """
    if weighted_reward_mean > 0:
        kl_coef *= 1 + rate
    elif weighted_reward_mean < 0:
        kl_coef *= 1 - rate
    return min(max(kl_coef, lo), hi)


def aggregate(token_loss_BC, mask_BC, num_tokens: float):
    """veRL token mean with the normaliser of the whole mini-batch, so micro-batch gradients sum to its gradient."""
    # differs from grpo.py: token_mean only (no mode argument); equal to grpo.py's "token_mean"
    return (token_loss_BC * mask_BC).sum() / max(num_tokens, 1.0)


def minibatch_counts(mask_BC: torch.Tensor) -> tuple[float, float, float]:
    """Loss normalisers of a whole mini-batch, summed over ranks: (completion tokens in the loss, sequences with at
    least one such token, sequences). Fixed before gradient accumulation, so micro-batch gradients sum to the
    mini-batch gradient whatever the split."""
    counts = dist.all_reduce_sum(torch.tensor([mask_BC.sum().item(), float((mask_BC.sum(1) > 0).sum()),
                                               float(len(mask_BC))]))
    return counts[0].item(), counts[1].item(), counts[2].item()


def micro_batch_loss(model, batch: dict, rows: torch.Tensor, args: Args, num_tokens: float, kl_coef: float):
    """Direct-OPD loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
    device = next(model.parameters()).device
    ids_BT, attn_BT = batch["input_ids_BT"][rows].to(device), batch["attention_mask_BT"][rows].to(device)
    mask_BC = batch["mask_BC"][rows].to(device)
    logp_BCV = completion_logp_BCV(model, ids_BT, attn_BT, batch["prompt_len"], args.temperature, batch["vocab"])
    logp_BC = logp_BCV.gather(-1, ids_BT[:, batch["prompt_len"]:, None]).squeeze(-1)
    logp_BCK = logp_BCV.gather(-1, batch["topk_ids_BCK"][rows].to(device))
    with torch.no_grad():
        entropy_BC = -(logp_BCV.exp() * logp_BCV).sum(-1)
    old_logp_BCK, old_logp_BC = batch["old_logp_BCK"][rows].to(device), batch["old_logp_BC"][rows].to(device)
    # J = E[ sum_t sum_{v in V_t} w_t(v) Delta_T(v|s_t) ] - beta KL: per position, the clipped loss summed over K
    pg_BCK, clipped_BCK = topk_clipped_surrogate(logp_BCK, old_logp_BCK, batch["adv_BCK"][rows].to(device),
                                                 args.clip_low, args.clip_high, args.clip_ratio_c)
    pg_BC = pg_BCK.sum(-1)
    sampler_stats = {}
    if batch.get("sampler_logp_BC") is not None:  # a separate sampler (vllm): its mismatch with the trainer, --tis
        tis_w_BC, sampler_stats = rollout.sampler_correction(
            old_logp_BC, batch["sampler_logp_BC"][rows].to(device), mask_BC, args.tis, args.tis_cap)
        pg_BC = pg_BC * tis_w_BC  # w = min(pi_trainer / pi_sampler, C) per sequence (--tis none: 1)
    kl_BC = kl_penalty(logp_BC, batch["ref_logp_BC"][rows].to(device), args.kl_estimator, mask_BC)
    loss = aggregate(pg_BC + kl_coef * kl_BC, mask_BC, num_tokens)
    with torch.no_grad():
        log_ratio_BC = (logp_BC - old_logp_BC) * mask_BC  # padding: 0
        stats = {  # token sums over this micro-batch; divided by the mini-batch token count by the caller
            "loss/policy": aggregate(pg_BC, mask_BC, num_tokens).item(),
            "loss/kl": aggregate(kl_BC, mask_BC, num_tokens).item(),
            "policy/clip_frac": (clipped_BCK.mean(-1) * mask_BC).sum().item(),
            "policy/approx_kl": ((torch.expm1(-log_ratio_BC) + log_ratio_BC) * mask_BC).sum().item(),
            "policy/entropy": (entropy_BC * mask_BC).sum().item(),
            **sampler_stats,
        }
    return loss, stats


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: setup (flags, teachers, seeding, run folder, Ctrl-C, model, data, resume)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    check_run_args(args, min_group_size=2 if args.reward == "direct_plus_grpo" else 1, tis=args.tis,
                   eval_samples=args.eval_samples, eval_pass_k=args.eval_pass_k)
    if args.tis == "token":  # the loss at position t averages over the top-K support under the trainer's own
        # probabilities: the token drawn at t only decides the states after it, whose distribution the ratio of the
        # whole row corrects (--tis sequence); a per-token weight would reweight a term that does not depend on it
        fail("--tis token: Direct-OPD's loss at a position is an expectation over the student's top-K tokens under "
             "the trainer's own probabilities, so the sampled token's ratio corrects nothing there; use --tis sequence "
             "(the whole completion's ratio corrects the states it was sampled through)")
    if args.top_p < 1:  # the top-K support, its weights and the teachers' log-ratio live on the whole softmax
        fail(f"--top-p {args.top_p}: Direct-OPD's top-K support, its weights and the teachers' log-ratio are over the "
             "whole vocabulary's softmax, which a nucleus sampler does not draw from; keep --top-p 1")
    ckpt = checkpoint.open_checkpoint(args.resume, rank, world)
    # the student's token ids go to the teachers unchanged: one vocabulary, checked before any model loads
    model_path = model_folder(args.model_name)
    teacher_pre_path = model_folder(args.teacher_pre)
    tokenizer = models.load_tokenizer(model_path, args.system_prompt)
    vocab_check = {f"student ({args.model_name})": tokenizer, f"teacher_pre ({args.teacher_pre})":
                   models.load_tokenizer(teacher_pre_path)}
    if args.teacher_post:
        vocab_check[f"teacher_post ({args.teacher_post})"] = models.load_tokenizer(model_folder(args.teacher_post))
    check_same_vocab(vocab_check)
    teacher_post = model_folder(args.teacher_post) if args.teacher_post else default_teacher_post(args.teacher_pre)
    dist.seed_everything(args.seed + rank)  # after the teacher build, which seeds its own run
    run_dir = logger.run_folder(args, rank)
    ctrl_c = checkpoint.catch_ctrl_c(run_dir, rank, __file__, args.save_optimizer)  # Ctrl-C: one line, status 130
    train_problems, eval_problems = data.load_train_eval(args)
    model = models.load_policy(model_path, args, device)  # float32 master weights; --dtype: compute precision
    models.mask_padded_head(model, len(tokenizer))  # no probability on LM-head rows the tokenizer lacks
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)  # each layer recomputed in backward (set before sharding)
    ref_model = models.frozen_copy(model)
    post_model, pre_model = load_teacher(teacher_post, args, device), load_teacher(teacher_pre_path, args, device)
    model, ref_model, post_model, pre_model = dist.shard_models(args, model, ref_model, post_model, pre_model)  # --fsdp
    # ALGO LOGIC: the batch sizes; AdamW, warmed up linearly over --warmup-steps optimizer steps, then constant
    args.batch_size = args.num_prompts * args.group_size  # rollouts per step (per rank)
    args.minibatch_size = args.batch_size // args.num_minibatches  # rollouts per optimizer step (check_run_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
    # TRY NOT TO MODIFY: the prompt sampler, the rollout engine, resume and the logger
    sampler = data.PromptSampler(train_problems, args.seed + rank)
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    kl_coef = state.get("kl_coef", args.kl_coef)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)

    run_eval = evaluate.evaluator(engine, tokenizer, eval_problems, args)  # greedy and sampled accuracy, pass@k
    first_eval = state.get("first_eval")
    if first_eval is None:
        first_eval = run_eval()
        for name, teacher in (("pre", pre_model), ("post", post_model)) if args.eval_teachers else ():  # greedy
            acc = evaluate.evaluate(rollout.HFEngine(teacher, tokenizer), tokenizer, eval_problems, args.max_new_tokens,
                                    max_prompt_tokens=args.max_prompt_tokens)["eval/greedy_accuracy"]
            first_eval[f"eval/teacher_{name}_greedy_accuracy"] = acc
        writer.log(state["step"], first_eval)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    vocab = len(tokenizer)
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # 1. Rollouts: group_size completions for each of num_prompts prompts, from the student
        problems = sampler.next(args.num_prompts)
        prompt_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer) for p in problems],
                                         args.max_prompt_tokens)
        with logger.timed(times, "generate"):
            rollouts = engine.generate(prompt_ids, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                       max_new_tokens=args.max_new_tokens,
                                       return_logprobs=args.rollout_backend == "vllm")

        # 2. The verifier: logged only (and the outcome term of direct_plus_grpo)
        with logger.timed(times, "score"):
            group_problems = [p for p in problems for _ in range(args.group_size)]
            correct_B = torch.tensor(verifiers.score(rollouts.texts, group_problems, rollouts.truncated_B))  # cut: 0

        mask_BC = rollouts.completion_mask_BC.clone()
        # 3. no-grad passes on the student's own tokens: its top-K support (pi_old), both teachers, the reference;
        # the student's log-probs of the sampled tokens are what a separate sampler (vllm) is compared with
        with logger.timed(times, "logprobs"):
            batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                         prompt_len=rollouts.prompt_len, mask_BC=mask_BC, vocab=vocab,
                         sampler_logp_BC=rollouts.sampler_logp_BC)
            old_logp_BC, topk_ids_BCK, old_logp_BCK, topk_mass_BC = batched_support_logprobs(
                model, batch, args.temperature, args.micro_batch_size, vocab, k=args.top_k)
            post_logp_BC, _, post_logp_BCK, _ = batched_support_logprobs(
                post_model, batch, args.teacher_temperature, args.micro_batch_size, vocab, ids_BCK=topk_ids_BCK)
            if args.reward == "vanilla_opd":  # log pi_T_post - log pi_student: the teacher's endpoint, not its shift
                base_logp_BC, base_logp_BCK = old_logp_BC, old_logp_BCK
            else:
                base_logp_BC, _, base_logp_BCK, _ = batched_support_logprobs(
                    pre_model, batch, args.teacher_temperature, args.micro_batch_size, vocab, ids_BCK=topk_ids_BCK)
            ref_logp_BC, _, _, _ = batched_support_logprobs(  # the student's code path: KL is exactly 0 at init
                ref_model, batch, args.temperature, args.micro_batch_size, vocab, ids_BCK=topk_ids_BCK)

        # ALGO LOGIC: 4. dense advantages A_t(v) = w_t(v) * Delta_T(v | s_t) on the student's top-K support
        adv_BCK, weight_BCK, delta_BCK = dense_advantages(old_logp_BCK, post_logp_BCK, base_logp_BCK)
        zero_std_P = None
        if args.reward == "direct_plus_grpo":
            outcome_PG, zero_std_P = group_advantages(correct_B.view(-1, args.group_size), args.adv_eps)
            adv_BCK = adv_BCK + args.outcome_weight * weight_BCK * outcome_PG.flatten()[:, None, None]
        adv_BCK = adv_BCK * mask_BC.unsqueeze(-1)
        batch.update(topk_ids_BCK=topk_ids_BCK, old_logp_BCK=old_logp_BCK, old_logp_BC=old_logp_BC,
                     ref_logp_BC=ref_logp_BC, adv_BCK=adv_BCK)
        # the adaptive KL coefficient from this batch's mean of A over valid top-K entries (all ranks), set BEFORE
        # this batch's update, as the official trainer sets kl_loss_coef before update_actor: step t uses beta_t
        valid_BCK = mask_BC.unsqueeze(-1).expand_as(adv_BCK)
        wr = dist.all_reduce_sum(torch.tensor([adv_BCK.sum().item(), valid_BCK.sum().item()], dtype=torch.float64))
        weighted_reward_mean = (wr[0] / wr[1].clamp(min=1)).item()
        kl_coef = update_kl_coef(kl_coef, weighted_reward_mean, args.kl_adapt_rate, args.kl_coef_min, args.kl_coef_max)

        # 5. Update: num_iterations epochs x num_minibatches optimizer steps, micro-batched
        with logger.timed(times, "update"):
            sums, grad_norms = {}, []
            for _ in range(args.num_iterations):
                order = rollout.minibatch_order(args)  # --share-prompt: whole groups, as the log-prob passes took them
                for mb in order.split(args.minibatch_size):
                    num_tokens = minibatch_counts(mask_BC[mb])[0]  # tokens in the whole mini-batch, all ranks
                    optimizer.zero_grad(set_to_none=True)
                    for rows in mb.split(args.micro_batch_size):
                        loss, stats = micro_batch_loss(model, batch, rows, args, num_tokens, kl_coef)
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

        # TRY NOT TO MODIFY: metrics (grpo.py's names where they mean the same; new ones in the module docstring);
        # loss/* are means over optimizer steps, the other sums (the vllm sampler's rollout/* included) are over
        # tokens
        n_valid = max(mask_BC.sum().item(), 1.0)
        return_B = adv_BCK.sum((1, 2))
        metrics = {
            "reward/mean": return_B.mean().item(), "reward/std": return_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(),
            "adv/mean_abs": (adv_BCK.abs().sum() / valid_BCK.sum().clamp(min=1)).item(),
            "delta_opd/weighted_reward_mean": weighted_reward_mean,
            "delta_opd/sampled_logratio": ((post_logp_BC - base_logp_BC) * mask_BC).sum().item() / n_valid,
            "delta_opd/topk_mass": (topk_mass_BC * mask_BC).sum().item() / n_valid,
            "kl/coef": kl_coef,
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),  # over all ranks' tokens
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device),
        }
        if zero_std_P is not None:
            metrics["adv/frac_zero_std"] = zero_std_P.float().mean().item()
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rollouts as text (samples.jsonl): no extra generation
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=return_B,
                correct=correct_B, teacher_logratio=((post_logp_BC - base_logp_BC) * mask_BC).sum(1))
        if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
            metrics.update(run_eval())
        metrics["perf/step_time"] = time.time() - t_step
        writer.log(step, metrics, bar)
        writer.warn_if_stuck(step, metrics, args.max_new_tokens)  # one console line after 3 steps without signal
        stop = ctrl_c.stop_asked()  # a Ctrl-C on any rank: every rank stops after this step (one all-reduce)
        if stop or step == args.total_steps or args.save_every and step % args.save_every == 0:
            checkpoint.save_checkpoint(run_dir, step, model, tokenizer, optimizer if args.save_optimizer else None,
                                       scheduler, sampler, {"first_eval": first_eval, "kl_coef": kl_coef})
        if stop:
            ctrl_c.exit_saved(bar)  # "stopped after step N (checkpoint saved); continue with: ...", status 130

    ctrl_c.step = None  # the final evaluation: a Ctrl-C quits at once
    if rank == 0 and args.eval_teachers:
        print(f"teacher pair held-out greedy accuracy: pre {first_eval['eval/teacher_pre_greedy_accuracy']:.3f}, "
              f"post {first_eval['eval/teacher_post_greedy_accuracy']:.3f} ({args.reward} reward, no verifier in the "
              "loss)")
    final_eval = evaluate.final_evaluation(run_eval, writer, first_eval, args.total_steps)  # logged, printed
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir,
            "teacher_post": teacher_post}


if __name__ == "__main__":
    main(ARGS)
