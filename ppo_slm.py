"""Stable PPO for small language models: SFT (LoRA) -> Bradley-Terry reward model -> PPO with a value head.

Paper: "Towards Robust Reinforcement Learning for Small-Scale Language Model Agents" (arXiv 2607.25091;
code github.com/rezwanh001/slm-rl-agent, built on TRL 0.9.6). Three stages, the first two skipped when their
output is given by path (`--sft-adapter`, `--reward-model`); 1 and 2 are the standard SFT and reward model of
ppo_slm_stages.py, 3 and the paper's fixes are this file:

1. SFT: a LoRA adapter (alpha = 2r) trained on (prompt, chosen) pairs.
2. Reward model: the SFT backbone (adapter merged) with a scalar head, LoRA + trained head, Bradley-Terry loss
   -log sigmoid(r(x, y_w) - r(x, y_l)); its held-out pair accuracy is reported.
3. PPO against the reward model with a frozen reference (the merged SFT model):

    r_t   = -beta * (log pi_old(y_t) - log pi_ref(y_t)) + 1[t = last] * clip(whiten(RM(x, y)), -3, 3)
    A_t   = GAE(gamma, lambda) of r_t with the value head's V_t, whitened over the batch; R_t = A_t + V_t
    L     = E_t[ max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps)) ]                       (policy)
          + c_v E_t[ max((V_t - R_t)^2, (clip(V_t, V_old - eps_v, V_old + eps_v) - R_t)^2) / 2 ]   (value)
    beta  <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * batch / horizon)   (adaptive KL controller)

The paper's three fixes for small models (docs/ppo_slm.md): the SFT adapter merged and a fresh LoRA (B = 0)
attached, with a check that the first update moves it (`--policy-init naive_adapter` reproduces the silent freeze);
PPO in float32 with a logits guard; a safety envelope (score whitening and clip, ratio guard, rollback). Default:
testbed-weak on level-3 sums, rejected = a corrupted answer; or the paper's pairs from a TinyStories-style dataset.
Left out: NEFTune, mixed precision in SFT/RM, the agentic extension, PPO-step resume, reward whitening across ranks.

    python ppo_slm.py                                    # embedded CPU demo: testbed-weak, a few minutes
    python ppo_slm.py --model-name EleutherAI/pythia-410m-deduped --dataset roneneldan/TinyStories \\
        --lora-target-modules query_key_value dense --sft-lora-r 32 --lora-r 32 --device cuda \\
        --max-new-tokens 96 --temperature 0.9 --top-p 0.95 --num-prompts 32 --minibatch-size 4 \\
        --learning-rate 5e-6 --total-steps 250 --num-train-examples 10000 --sft-steps 6000 --sft-lr 2e-5 \\
        --rm-steps 2500 --rm-lr 1e-5     # SmolLM2-360M: --lora-target-modules q_proj v_proj o_proj gate_proj up_proj
    python ppo_slm.py --sft-adapter runs/X/sft_adapter --reward-model runs/X/reward_model   # PPO only
    torchrun --nproc-per-node 8 ppo_slm.py --device cuda --fsdp ...  # PPO sharded (FSDP2); SFT and RM on rank 0

Shapes: B rows (one completion per prompt), T tokens per row, C completion tokens, V vocabulary.
"""

import copy
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

from common.args import ExperimentArgs, check_at_least, check_sampling_args


@dataclass
class Args(ExperimentArgs):  # common/args.py: run folder, logging, device
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    ppo_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of policy and reference in PPO (float32 is the fix; bfloat16 reproduces the ratio overflow)"""
    fsdp: bool = False
    """FSDP2 sharding of PPO (docs/fsdp.md): policy (frozen base; its LoRA and value head train), reference and reward
    model, per decoder layer; SFT and RM training run unsharded on rank 0"""

    # Model and data
    model_name: str = "testbed-weak"
    """base model: 'testbed-weak', 'testbed-strong', a Hugging Face id or a local folder"""
    dataset: str = "testbed"
    """'testbed' (sums; rejected = corrupted answer), 'testbed-nl' (worked sums in the chat template; rejected = the
    solution with one wrong step or a wrong answer), or text: a local .jsonl/.txt or a HF dataset (TinyStories)"""
    text_field: str = "text"
    """field holding the text of a record (text datasets)"""
    levels: tuple[int, ...] = (3,)
    """testbed difficulty levels (1 easiest .. 5 hardest)"""
    num_train_examples: int = 2000
    """training prompts / preference pairs (text datasets: records read)"""
    prompt_words: int = 24
    """text datasets: words of a record used as the prompt"""
    continuation_words: int = 24
    """text datasets: following words used as the chosen continuation"""
    lora_target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
    """LoRA targets (Qwen2 / SmolLM2 / LLaMA names; Pythia: query_key_value dense)"""

    # Stage 1: SFT
    sft_adapter: str = ""
    """path of a trained SFT LoRA adapter: skips SFT"""
    sft_steps: int = 60
    """SFT optimizer steps"""
    sft_batch_size: int = 32
    """SFT pairs per step"""
    sft_lr: float = 5e-4
    """SFT learning rate"""
    sft_lora_r: int = 8
    """SFT LoRA rank (alpha = 2r, as in the paper)"""

    # Stage 2: reward model
    reward_model: str = ""
    """path of a trained reward model (sequence-classification folder): skips RM training"""
    rm_steps: int = 900
    """reward-model optimizer steps"""
    rm_batch_size: int = 32
    """preference pairs per RM step"""
    rm_lr: float = 5e-4
    """reward-model learning rate (testbed pair accuracy: 0.96-0.98 at 5e-4 x 900 steps, 0.79 at 2e-3 x 300)"""
    rm_lora_r: int = 16
    """reward-model LoRA rank (alpha = 2r; the score head is trained in full)"""
    num_eval_pairs: int = 400
    """held-out preference pairs for the RM's pair accuracy"""

    # Stage 3: PPO
    policy_init: Literal["merge_reinit", "naive_adapter"] = "merge_reinit"
    """merge_reinit: merge SFT adapter, fresh LoRA (the fix); naive_adapter: load the adapter as is (the bug)"""
    lora_r: int = 8
    """PPO LoRA rank (alpha = r)"""
    total_steps: int = 150
    """PPO steps (rollout + update)"""
    num_prompts: int = 32
    """rollouts per step per rank (one completion per prompt)"""
    minibatch_size: int = 8
    """rollouts per optimizer step"""
    ppo_epochs: int = 2
    """passes over each rollout batch"""
    gradient_checkpointing: bool = False
    """recompute the policy's decoder layers in the PPO backward instead of keeping their activations"""
    learning_rate: float = 2e-4
    """AdamW learning rate for the LoRA and value head (constant; the paper: 5e-6 on 70-410M models)"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    temperature: float = 1.3
    """sampling temperature (log-probs at the same temperature); the paper: 0.9. On the testbed 1.3, so that
    the SFT policy makes the malformed answers the reward model can tell apart"""
    top_p: float = 1.0
    """nucleus sampling (the paper: 0.95)"""
    max_new_tokens: int = 8
    """completion length cap"""
    clip_range: float = 0.2
    """policy ratio clip eps"""
    vf_clip: float = 0.2
    """value clip eps around the rollout-time value"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    gamma: float = 1.0
    """GAE discount"""
    lam: float = 0.95
    """GAE lambda"""
    init_kl_coef: float = 0.5
    """initial beta of the per-token KL penalty (the paper: 0.2; 0.5 limits RM exploitation on the testbed)"""
    adaptive_kl: bool = True
    """adapt beta towards --target-kl (Ziegler et al. 2019)"""
    target_kl: float = 6.0
    """target summed KL(old || ref) per sequence"""
    kl_horizon: int = 10000
    """horizon of the adaptive KL controller"""

    # Safety envelope
    score_norm: bool = True
    """whiten RM scores with running mean/std and clip to +-score_clip"""
    score_clip: float = 3.0
    """clip of the whitened score, in standard deviations"""
    whiten_rewards: bool = True
    """scale per-token rewards by their batch std before GAE (no mean shift, as TRL)"""
    ratio_guard: bool = True
    """multiply a mini-batch's policy and value loss by 0 when its mean ratio > --ratio-threshold (TRL: still steps)"""
    ratio_threshold: float = 5.0
    """ratio guard threshold"""
    rollback: bool = True
    """restore the last healthy trainable weights when any becomes NaN/inf"""
    max_rollbacks: int = 5
    """stop training after this many rollbacks"""

    rm_noise_std: float = 0.0
    """Gaussian noise added to every raw RM score (a deliberately noisy RM, as in
    benchmarks/testbed/ppo_slm_benchmark.py)"""

    # Evaluation
    num_eval_prompts: int = 200
    """held-out prompts for RM score, win rate and accuracy before and after PPO"""

    # Filled in at runtime
    num_minibatches: int = 0
    """optimizer steps per epoch = num_prompts // minibatch_size"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # tyro; --plan-memory: print what PPO loads (the SFT and reward model stages load less), exit
    ARGS = Args.parse(holds=lambda a: dict(
        lora_r=a.lora_r if a.policy_init == "merge_reinit" else a.sft_lora_r, lora_targets=a.lora_target_modules,
        reference=True, value_head=True, frozen=((a.reward_model or a.model_name, "float32"),),
        dtype=a.ppo_dtype, rows=a.num_prompts, micro_batch=a.minibatch_size))

import numpy as np
import torch
import torch.distributed

import ppo_slm_stages as stages
from common import checkpoint, dist, evaluate, logger, models, rollout, verifiers


# ALGO LOGIC: scores, GAE and the PPO loss
def verify(texts: list[str], pairs: list) -> torch.Tensor:
    """Exact-match verifier (testbed): 1.0 where the completion is the answer."""
    return torch.tensor(verifiers.score(texts, [e.problem for e in pairs]))


class RunningMoments:
    """Running mean and std of all scores seen so far (TRL's score scaling)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, x_B: torch.Tensor) -> None:
        n, m, v = len(x_B), x_B.mean().item(), x_B.var(unbiased=False).item()
        total = self.count + n
        delta = m - self.mean
        self.var = (self.var * self.count + v * n + delta**2 * self.count * n / total) / total
        self.mean, self.count = self.mean + delta * n / total, total


def shape_scores(raw_B: torch.Tensor, moments: RunningMoments, args: Args) -> tuple[torch.Tensor, int]:
    """NaN/inf scores -> 0, then (optionally) whiten with running moments and clip to +-score_clip."""
    bad_B = ~torch.isfinite(raw_B)
    scores_B = raw_B.masked_fill(bad_B, 0.0)
    if args.score_norm:
        moments.update(scores_B)
        scores_B = ((scores_B - moments.mean) / (math.sqrt(moments.var) + 1e-8)).clamp(-args.score_clip,
                                                                                       args.score_clip)
    return scores_B, int(bad_B.sum())


def masked_whiten(x_BC: torch.Tensor, mask_BC: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    n = mask_BC.sum().clamp(min=1)
    mean = (x_BC * mask_BC).sum() / n
    var = (((x_BC - mean) * mask_BC) ** 2).sum() / n
    out = (x_BC - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask_BC


def gae(rewards_BC, values_BC, mask_BC, gamma: float, lam: float):
    """A_t = sum_l (gamma lambda)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t; nothing flows past eos."""
    adv_BC, last_B = torch.zeros_like(rewards_BC), torch.zeros_like(rewards_BC[:, 0])
    C = rewards_BC.shape[1]
    for t in reversed(range(C)):
        keep_B = mask_BC[:, t + 1] if t + 1 < C else torch.zeros_like(last_B)
        next_v_B = values_BC[:, t + 1] * keep_B if t + 1 < C else keep_B
        delta_B = rewards_BC[:, t] + gamma * next_v_B - values_BC[:, t]
        last_B = delta_B + gamma * lam * keep_B * last_B
        adv_BC[:, t] = last_B
    return adv_BC * mask_BC, (adv_BC + values_BC) * mask_BC


def policy_forward(model, ids_BT, attn_BT, prompt_len: int, temperature: float, top_p: float = 1.0):
    """Completion-token log-probs (at the sampling temperature, over the top-p nucleus the sampler drew from),
    values V_t from the model's value head
    (`model.v_head` on the last hidden state) and entropies (no grad)."""
    C = ids_BT.shape[1] - prompt_len
    out = model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=rollout.position_ids(attn_BT),
                output_hidden_states=True, use_cache=False, logits_to_keep=C + 1)  # the LM head on completions only
    # token_logprobs: log_softmax(logits / T) over the sampler's support, gathered at the completion ids, chunked
    logp_BC, entropy_BC = rollout.token_logprobs(out.logits[:, :-1], ids_BT[:, prompt_len:], temperature,
                                                 with_entropy=True, top_p=top_p)
    values_BC = model.v_head(out.hidden_states[-1][:, prompt_len - 1:-1].float()).squeeze(-1)
    return logp_BC, values_BC, entropy_BC


def ppo_loss(logp_BC, values_BC, batch: dict, rows, args: Args, n_tok: float):
    """Clipped policy loss + vf_coef * clipped value loss, token sums divided by the mini-batch's tokens."""
    # L = sum_t m_t [ max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))
    #                 + c_v max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -eps_v, eps_v) - R_t)^2) / 2 ] / sum_t m_t
    b = {k: v[rows].to(logp_BC.device) for k, v in batch.items()}
    mask_BC, adv_BC, ret_BC, old_values_BC = b["mask_BC"], b["adv_BC"], b["returns_BC"], b["values_BC"]
    ratio_BC = torch.exp(logp_BC - b["old_logp_BC"])  # pg_BC: grpo.py's clipped_surrogate with clip_low = clip_high
    pg_BC = torch.maximum(-adv_BC * ratio_BC, -adv_BC * ratio_BC.clamp(1 - args.clip_range, 1 + args.clip_range))
    v_clipped_BC = old_values_BC + (values_BC - old_values_BC).clamp(-args.vf_clip, args.vf_clip)
    vf_BC = 0.5 * torch.maximum((values_BC - ret_BC) ** 2, (v_clipped_BC - ret_BC) ** 2)
    pg_loss, vf_loss = (pg_BC * mask_BC).sum() / n_tok, (vf_BC * mask_BC).sum() / n_tok
    with torch.no_grad():
        log_ratio = (logp_BC - b["old_logp_BC"]) * mask_BC  # padding: 0, never exp(+large)
        stats = {"ratio_sum": (ratio_BC * mask_BC).sum().item(),
                 "max_ratio": (ratio_BC * mask_BC).max().item(),
                 "safety/ratio_above_10": ((~(ratio_BC <= 10)).float() * mask_BC).sum().item(),  # NaN, inf too
                 "loss/policy": pg_loss.item(), "loss/value": vf_loss.item(),
                 # differs from grpo.py: TRL's clip fraction |rho - 1| > eps, whatever the sign of A
                 "policy/clip_frac": (((ratio_BC - 1).abs() > args.clip_range).float() * mask_BC).sum().item(),
                 "value/clip_frac": (((values_BC - old_values_BC).abs() > args.vf_clip).float() * mask_BC).sum().item(),
                 "policy/approx_kl": ((torch.expm1(-log_ratio) + log_ratio) * mask_BC).sum().item()}
    return pg_loss + args.vf_coef * vf_loss, stats


@torch.no_grad()
def old_logprobs_values(policy, rollouts, args: Args, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and values of the rollouts under the policy that sampled them, minibatch_size rows at a time."""
    parts = [policy_forward(policy, rollouts.input_ids_BT[r].to(device), rollouts.attention_mask_BT[r].to(device),
                            rollouts.prompt_len, args.temperature, args.top_p)
             for r in torch.arange(len(rollouts.input_ids_BT)).split(args.minibatch_size)]
    mask_BC = rollouts.completion_mask_BC
    return torch.cat([p[0] for p in parts]).cpu() * mask_BC, torch.cat([p[1] for p in parts]).cpu() * mask_BC


# Safety: finite logits in sampling, rollback of non-finite weights, and the silent-freeze check
class FiniteLogits:
    """A logits guard for HFEngine (a transformers LogitsProcessor too): NaN -> -bound, +-inf -> +-bound, then clamp
    to [-bound, bound]; `fixed` counts the non-finite logits it replaced."""

    def __init__(self, bound: float = 100.0):
        self.bound, self.fixed = bound, 0

    def __call__(self, input_ids, scores):
        self.fixed += int((~torch.isfinite(scores)).sum())
        return torch.nan_to_num(scores, nan=-self.bound, posinf=self.bound, neginf=-self.bound).clamp(
            -self.bound, self.bound)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP2 (DTensor) parameter, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(params: dict) -> bool:
    """Whether every weight is finite on every rank (--fsdp: each rank checks its own shards)."""
    n_bad = sum((~torch.isfinite(local_part(p))).sum().item() for p in params.values())
    return dist.all_reduce_sum(torch.tensor([float(n_bad)])).item() == 0


def healthy_state(params: dict, optimizer) -> tuple[dict, dict]:
    """A copy of the trainable weights and the optimizer state, to roll back to."""
    return {n: p.detach().clone() for n, p in params.items()}, copy.deepcopy(optimizer.state_dict())


@torch.no_grad()
def roll_back(params: dict, optimizer, healthy: tuple[dict, dict]) -> None:
    """Restore the weights (and, when given, the optimizer state) of the last healthy_state."""
    weights, opt_state = healthy
    for n, p in params.items():
        p.copy_(weights[n])
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)


def check_not_frozen(lm_params: dict, before: dict) -> float:
    """The silent-freeze check: trainable LM (LoRA) parameters exist and moved in the first update."""
    if not lm_params:
        raise SystemExit("error: silent LoRA freeze: the policy has no trainable language-model parameters "
                         "(only the value head trains, so the policy can never change). Loading a PEFT adapter "
                         "with PeftModel.from_pretrained leaves it frozen; use --policy-init merge_reinit.")
    moved = dist.all_reduce_sum(torch.tensor([sum((local_part(p.detach()) - local_part(before[n])).square().sum().item()
                                             for n, p in lm_params.items())])).item() ** 0.5  # all ranks' shards
    if not moved > 0:
        raise SystemExit(f"error: silent LoRA freeze: {len(lm_params)} trainable LM tensors did not change in "
                         "the first PPO update (check the learning rate and that the LoRA receives gradients)")
    return moved


def broadcast_trainable(model) -> None:
    """Give every rank rank 0's values of the trainable parameters (the fresh LoRA and value head draw different values
    from each rank's seed); call before `shard_models`. Nothing to do on one process."""
    if dist.rank_world()[1] > 1:
        for p in (p for p in model.parameters() if p.requires_grad):
            torch.distributed.broadcast(p.data, src=0)


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: setup (flags, seeding, run folder, Ctrl-C); stages 1 and 2 (ppo_slm_stages.py)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    check_sampling_args(args)
    check_at_least(args, 0, "sft_lr", "rm_lr")  # here, before a model loads, not by AdamW after it
    if args.num_prompts % args.minibatch_size:
        raise SystemExit(f"error: num_prompts {args.num_prompts} is not divisible by minibatch_size "
                         f"{args.minibatch_size}")
    if args.num_minibatches not in (0, args.num_prompts // args.minibatch_size):  # derived: never silently replaced
        raise SystemExit(f"error: --num-minibatches {args.num_minibatches} is derived, not set: --num-prompts / "
                         f"--minibatch-size = {args.num_prompts // args.minibatch_size} here; change those")
    args.num_minibatches = args.num_prompts // args.minibatch_size
    dist.seed_everything(args.seed + rank)  # python, numpy and torch: each rank its own random stream
    run_dir = logger.run_folder(args, rank)
    ctrl_c = checkpoint.catch_ctrl_c(run_dir, rank, no_resume=(  # Ctrl-C quits at once, one line
        f"PPO steps have no resume; the same flags and --run-name {os.path.basename(run_dir)} skip a finished stage "
        f"and continue SFT or RM from its last save (every {stages.STATE_EVERY} steps)"))
    from peft import PeftModel
    os.makedirs(run_dir, exist_ok=True)
    base = args.model_name  # a hub id or a local folder
    if base.lower() in models.EMBEDDED_NAMES:  # an embedded model, built once and cached by grounds/
        import grounds  # only then: a fork without grounds/ runs on hub ids and local folders
        base = grounds.path_of(base)
    tokenizer = models.load_tokenizer(base)
    train_ex = stages.build_pairs(args, "train", args.num_train_examples, args.seed, tokenizer)
    heldout = stages.build_pairs(args, "test", max(args.num_eval_pairs, args.num_eval_prompts), args.seed, tokenizer)
    t0 = time.time()  # stages 1 and 2; sft_dir holds the SFT adapter merged into the base (reference, policy start)
    sft_adapter, sft_dir, rm_dir = stages.supervised_stages(args, base, tokenizer, train_ex, run_dir, rank, device)
    t_stages = time.time() - t0

    # Stage 3 models: the RM (no dropout), the reference = merged SFT, the policy = merged SFT + a fresh LoRA (or the
    # naive load that freezes the SFT adapter) with a zero value head, so that it starts exactly at the SFT model
    rm = stages.load_score_model(rm_dir).to(device).eval().requires_grad_(False)
    ref_model = models.load_model(sft_dir, args.ppo_dtype, device).eval().requires_grad_(False)
    backbone = models.load_model(sft_dir if args.policy_init == "merge_reinit" else base, args.ppo_dtype, device)
    for m in (ref_model, backbone):  # their log-probs normalise over the tokenizer's rows only
        models.mask_padded_head(m, len(tokenizer))
    if args.policy_init == "merge_reinit":
        policy = models.add_lora(backbone, ["default"], args.lora_r, args.lora_r, args.lora_target_modules)
    else:
        policy = PeftModel.from_pretrained(backbone, sft_adapter)
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    policy.v_head = torch.nn.Linear(policy.config.hidden_size, 1).to(device)
    torch.nn.init.zeros_(policy.v_head.weight)
    torch.nn.init.zeros_(policy.v_head.bias)
    broadcast_trainable(policy)  # the fresh LoRA draws from each rank's seed: rank 0's on every rank
    policy, ref_model, rm = dist.shard_models(args, policy.train(), ref_model, rm)  # --fsdp: FSDP2; otherwise unchanged
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    lm_params = {n: p for n, p in trainable.items() if not n.startswith("v_head")}
    optimizer = torch.optim.AdamW(trainable.values(), lr=args.learning_rate)
    healthy = healthy_state(trainable, optimizer)
    guard, moments, beta = FiniteLogits(), RunningMoments(), args.init_kl_coef
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0, extra=("rm/score_mean",))  # curve.png: RM scores too
    is_testbed = args.dataset in ("testbed", "testbed-nl")  # verifiable: a final answer to check
    eval_ex = heldout[: args.num_eval_prompts]
    eval_ids = tokenizer([e.prompt for e in eval_ex], add_special_tokens=False)["input_ids"]

    def generate(model, prompt_ids, guard, greedy=False, bar=None):  # one completion per prompt, through the guard
        engine = rollout.HFEngine(model, tokenizer, logits_guard=guard)
        engine.on_answers = bar.update if bar is not None else None  # a progress bar's answers, as they end
        return engine.generate(prompt_ids, n=1, temperature=args.temperature, top_p=args.top_p,
                               max_new_tokens=args.max_new_tokens, greedy=greedy)

    def run_eval(model) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
        """RM score, entropy and verifier correctness of one sample per held-out prompt, and greedy accuracy."""
        bar = evaluate.answer_bar(len(eval_ids) * (1 + is_testbed), f"held-out evaluation, {len(eval_ids)} prompts",
                                  args.max_new_tokens)
        rollouts = generate(model, eval_ids, FiniteLogits(), bar=bar)
        s_B = stages.sequence_scores(rm, rollouts.input_ids_BT, rollouts.attention_mask_BT, tokenizer.pad_token_id)
        out, c_B = {"eval/rm_score": s_B.mean().item()}, None
        _, entropy_BC = rollout.batched_logprobs(model, rollouts, args.temperature, args.minibatch_size,
                                                 top_p=args.top_p, with_entropy=True)  # what PPO has left to lose
        out["eval/entropy"] = entropy_BC.sum().item() / max(rollouts.completion_mask_BC.sum().item(), 1.0)
        if is_testbed:
            c_B = verify(rollouts.texts, eval_ex)
            out["eval/sampled_accuracy"] = c_B.mean().item()
            out["eval/greedy_accuracy"] = verify(generate(model, eval_ids, FiniteLogits(), True, bar).texts,
                                                 eval_ex).mean().item()
        bar.close()
        if args.log_samples > 0:  # the sampled answers the scores are of, as text (samples.jsonl)
            out["samples/eval"] = logger.sample_rows(tokenizer, rollouts, [e.problem for e in eval_ex],
                                                     args.log_samples, rm_score=s_B, correct=c_B)
        return out, s_B, c_B

    # the RM's pair accuracy (testbed-nl: by kind, step and answer) held out, and on as many of its own training pairs:
    # far above the held-out figure, it memorised them; at it, more steps or capacity are the way up
    rm_fit = {**stages.pair_accuracy(rm, tokenizer, heldout[: args.num_eval_pairs]),
              **stages.pair_accuracy(rm, tokenizer, train_ex[: args.num_eval_pairs], "rm/train_pair_accuracy")}
    rm_acc = rm_fit["rm/pair_accuracy"]
    sft_eval, sft_s_B, sft_c_B = run_eval(ref_model)
    first_eval = {**rm_fit, "time/stages": t_stages, **sft_eval}
    writer.log(0, first_eval)
    first_eval, sft_eval = logger.without_samples(first_eval), logger.without_samples(sft_eval)
    if rank == 0:
        print(f"reward model held-out pair accuracy {rm_acc:.3f} ({t_stages:.0f} s for SFT + RM)")
    rollbacks, checked, metrics, step = 0, False, {}, 0
    bar = logger.step_bar(args, 0, rank)  # tqdm over range(1, total_steps + 1), on rank 0
    for step in bar:
        ctrl_c.step = step  # no resume: a Ctrl-C quits at once, saying where the finished stages are
        t_step, times = time.time(), {}
        # 1. Rollouts: one completion per prompt, through the logits guard
        batch_ex = random.sample(train_ex, args.num_prompts)
        prompt_ids = tokenizer([e.prompt for e in batch_ex], add_special_tokens=False)["input_ids"]
        fixes0 = guard.fixed
        with logger.timed(times, "generate"):
            rollouts = generate(policy, prompt_ids, guard)

        # 2. Reward-model scores (plus --rm-noise-std noise), then NaN/inf -> 0, whitening, 3-sigma clip
        with logger.timed(times, "score"):
            raw_B = stages.sequence_scores(rm, rollouts.input_ids_BT, rollouts.attention_mask_BT,
                                           tokenizer.pad_token_id)
            raw_B = raw_B + args.rm_noise_std * torch.randn_like(raw_B)
            scores_B, n_bad = shape_scores(raw_B, moments, args)
            correct_B = verify(rollouts.texts, batch_ex) if is_testbed else None

        # 3. Old log-probs and values, reference log-probs (no grad)
        mask_BC, ids_BT, attn_BT = rollouts.completion_mask_BC, rollouts.input_ids_BT, rollouts.attention_mask_BT
        with logger.timed(times, "logprobs"):
            old_logp_BC, values_BC = old_logprobs_values(policy, rollouts, args, device)
            # batched_logprobs: the reference's log_softmax(logits / T) at the completion ids, no grad, 0 past the end
            ref_logp_BC = rollout.batched_logprobs(ref_model, rollouts, args.temperature, args.minibatch_size,
                                                   top_p=args.top_p)

        # ALGO LOGIC: 4. per-token rewards (KL penalty + score at the last token), GAE, whitened advantages
        kl_BC = (old_logp_BC - ref_logp_BC) * mask_BC
        rewards_BC = -beta * kl_BC
        rewards_BC[torch.arange(len(scores_B)), rollouts.lengths_B - 1] += scores_B
        if args.whiten_rewards:
            rewards_BC = masked_whiten(rewards_BC, mask_BC, shift_mean=False)
        adv_BC, returns_BC = gae(rewards_BC, values_BC, mask_BC, args.gamma, args.lam)
        adv_BC = masked_whiten(adv_BC, mask_BC)
        batch = dict(mask_BC=mask_BC, adv_BC=adv_BC, returns_BC=returns_BC, values_BC=values_BC,
                     old_logp_BC=old_logp_BC)

        # 5. Update: ppo_epochs x num_minibatches optimizer steps, with the ratio guard
        with logger.timed(times, "update"):
            before = {n: p.detach().clone() for n, p in lm_params.items()}
            sums, grad_norms, skips, max_ratio, n_updates = {}, [], 0, 0.0, 0
            for _ in range(args.ppo_epochs):
                for rows in torch.randperm(args.num_prompts).split(args.minibatch_size):
                    n_tok_t = dist.all_reduce_sum(torch.tensor([mask_BC[rows].sum().item()]))  # all ranks' tokens
                    logp_BC, new_values_BC, entropy_BC = policy_forward(
                        policy, ids_BT[rows].to(device), attn_BT[rows].to(device), rollouts.prompt_len,
                        args.temperature, args.top_p)
                    loss, stats = ppo_loss(logp_BC, new_values_BC, batch, rows, args, max(n_tok_t.item(), 1.0))
                    stats["policy/entropy"] = (entropy_BC.cpu() * mask_BC[rows]).sum().item()
                    mean_ratio = (dist.all_reduce_sum(torch.tensor([stats.pop("ratio_sum")])) / n_tok_t).item()
                    max_ratio = max(max_ratio, stats.pop("max_ratio"))
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    guarded = args.ratio_guard and not mean_ratio <= args.ratio_threshold
                    skips += guarded  # as TRL: policy and value loss x 0, the step still taken (Adam's momentum moves)
                    optimizer.zero_grad(set_to_none=True)
                    (loss * 0.0 if guarded else loss).backward()
                    dist.all_reduce_grads(policy)
                    grad_norms.append(torch.nn.utils.clip_grad_norm_(trainable.values(), args.max_grad_norm).item())
                    optimizer.step()
                    n_updates += not guarded

        # Safety: roll back non-finite weights (to the last healthy ones); check once that the LoRA is not frozen
        stop, finite = "", all_finite(trainable)
        if args.rollback and not finite:
            roll_back(trainable, optimizer, healthy)
            rollbacks += 1
            if rollbacks >= args.max_rollbacks:
                stop = f"stopping: {rollbacks} rollbacks (non-finite weights after {rollbacks} updates)"
        elif finite:
            healthy = healthy_state(trainable, optimizer)
            if not checked and n_updates:
                check_not_frozen(lm_params, before)
                checked = True

        # 6. Adaptive KL controller on the summed per-sequence KL to the reference
        kl_ref = dist.all_reduce_mean({"k": kl_BC.sum(1).mean().item()})["k"]
        if args.adaptive_kl:
            error = float(np.clip(kl_ref / args.target_kl - 1, -0.2, 0.2))
            beta *= 1 + error * args.num_prompts * world / args.kl_horizon
        if kl_ref < -50:
            stop = stop or f"stopping: KL to the reference is {kl_ref:.1f} < -50"

        # TRY NOT TO MODIFY: metrics (docs/runs.md, docs/ppo_slm.md); loss/* are means over optimizer steps, the
        # other sums are over tokens
        total_B, finite_raw = (rewards_BC * mask_BC).sum(1), raw_B[torch.isfinite(raw_B)]
        metrics = {
            "reward/mean": total_B.mean().item(), "reward/std": total_B.std(unbiased=False).item(),
            "rm/score_mean": finite_raw.mean().item() if len(finite_raw) else 0.0,
            "rm/score_std": finite_raw.std(unbiased=False).item() if len(finite_raw) else 0.0,
            "adv/mean_abs": (adv_BC.abs() * mask_BC).sum().item() / max(mask_BC.sum().item(), 1.0),
            **logger.update_metrics(sums, grad_norms, args.learning_rate, args.ppo_epochs * args.num_minibatches,
                                    mask_BC.sum().item() * args.ppo_epochs),
            "policy/kl_ref": kl_ref, "kl/beta": beta,
            "safety/nonfinite_scores": n_bad, "safety/logit_fixes": guard.fixed - fixes0,
            "safety/max_ratio": max_ratio, "safety/ratio_guard_skips": skips, "safety/rollbacks": rollbacks,
            **logger.rollout_perf_metrics(rollouts, times, args.ppo_epochs, device),
        }
        if correct_B is not None:
            metrics["train/accuracy"] = correct_B.mean().item()
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's rollouts as text (samples.jsonl): no extra generation
            metrics["samples/train"] = logger.sample_rows(tokenizer, rollouts, [e.problem for e in batch_ex],
                                                          args.log_samples, rm_score=raw_B, reward=total_B,
                                                          correct=correct_B)
        metrics["perf/step_time"] = time.time() - t_step
        writer.log(step, metrics, bar)
        if stop:
            if rank == 0:
                print(stop)
            break

    # Final evaluation against the SFT samples on the same prompts (never of non-finite weights); the PPO adapter and
    # the value head are saved
    if args.rollback:
        roll_back(trainable, None, healthy)
    final_eval, s_B, c_B = run_eval(policy)
    final_eval["eval/win_rate_rm"] = ((s_B > sft_s_B).float() + 0.5 * (s_B == sft_s_B).float()).mean().item()
    delta, spread = (s_B.mean() - sft_s_B.mean()).item(), math.sqrt(s_B.var().item() + sft_s_B.var().item())
    final_eval["eval/win_rate_rm_analytic"] = 0.5 * (1 + math.erf(delta / max(spread, 1e-12) / math.sqrt(2)))
    if is_testbed:
        final_eval["eval/win_rate_verifier"] = ((c_B > sft_c_B).float() + 0.5 * (c_B == sft_c_B).float()).mean().item()
    final_eval["safety/rollbacks"] = rollbacks
    writer.log(step, final_eval)
    final_eval = logger.without_samples(final_eval)
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    trained = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu()  # every rank: each gather a collective
               for n, t in policy.state_dict().items() if "lora_" in n or n.startswith("v_head.")}
    if rank == 0:
        policy.save_pretrained(os.path.join(run_dir, "ppo_adapter"), state_dict=trained)
        torch.save({n[len("v_head."):]: t for n, t in trained.items() if n.startswith("v_head.")},
                   os.path.join(run_dir, "ppo_adapter", "value_head.pt"))
        # the training samples' RM score (means of the first and last 30 steps, as in docs/ppo_slm.md), then held out
        rows = logger.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        scores = [r["rm/score_mean"] for r in rows if "rm/score_mean" in r] or [math.nan]
        k = max(1, min(30, len(scores) // 2))
        line = (f"training samples' RM score {np.mean(scores[:k]):.3f} -> {np.mean(scores[-k:]):.3f} (means of the "
                f"first and last {k} steps); held out (n={len(eval_ex)}): win rate over SFT (RM) "
                f"{final_eval['eval/win_rate_rm']:.3f}")
        if is_testbed:
            line += (f", verifier win rate {final_eval['eval/win_rate_verifier']:.3f}, greedy accuracy "
                     f"{sft_eval['eval/greedy_accuracy']:.3f} -> {final_eval['eval/greedy_accuracy']:.3f}")
        print(f"{line}; run folder {run_dir}")
    return {"rm_accuracy": rm_acc, "before": first_eval, "after": final_eval, "last": metrics, "steps": step,
            "rollbacks": rollbacks, "run_dir": run_dir, "sft_adapter": sft_adapter, "reward_model": rm_dir}


if __name__ == "__main__":
    main(ARGS)
