"""MADA-RL: Multi-Agent Debate-Aware RL with LoRA generators and critics (arXiv 2607.18006).

One frozen base model carries N generator and M critic LoRA adapters, switched by name; only the
active adapter receives gradients, and each adapter trains on its own disjoint split of the data.

    Stage 1  generator n: GRPO on R = 2 R_acc + R_len                 (group z-score advantage)
    Stage 2  critic data: the trained generators answer each critic problem; acc_G = mean_n R_acc(y^_n, y)
    Stage 3  critic m: policy gradient on x' = [x ; y^_1 ; ... ; y^_N] with A_C = R_C - 2 acc_G  (counterfactual)
             (--no-counterfactual: the GRPO group z-score of R_C instead)

A proposal shown to a critic is the generator's whole response, cut to its last --proposal-tokens tokens (where its
final answer is) when longer; --critic-sees answers shows only the extracted final answers (the ablation). A critic
prompt is never cut: one over --max-prompt-tokens is a one-line error (`encode_critic_prompts`).

    R_acc = 1[y^ == y]
    lam   = 0.5 - (len(y^) - min_i len(y^_i)) / (max_i len(y^_i) - min_i len(y^_i))    (min/max over the group)
    R_len = lam if correct else min(0, lam)          (0 for the whole group when all lengths are equal)

Deployment (`debate`): round 1 the generators answer x; rounds 2..R the critics answer x with the previous round's
answers shown as proposals; accuracy is the paper's rule, the mean over critics of the final round's correctness.
Stage 2 proposals are sampled at --proposal-temperature (critics train on varied proposals); the debate's are greedy.
A proposal cut at --max-new-tokens scores 0 in acc_G, as in training and in the debate.
Metrics: grpo.py's names for the active agent plus mada/* (docs/mada_rl.md), one step counter across agents.
Left out, on purpose: a KL term and reference model, a separate sampler (vLLM), resume (rerun the script).
A_C is used as is (no running-std rescaling). Length is counted in completion tokens (eos included).

    python mada_rl.py                                    # embedded CPU demo, about 10 minutes on 2 cores
    python mada_rl.py --eval-debate runs/mada_rl__1__X   # the debate again from a finished run's adapters
    python mada_rl.py --no-counterfactual --generators-from runs/mada_rl__1__X   # the ablation on the same generators
    python mada_rl.py --model-name deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --dataset my_math.jsonl \\
        --eval-dataset my_math_test.jsonl --device cuda --dtype bfloat16 --max-new-tokens 4096 --lora-r 16 \\
        --micro-batch-size 4 --gradient-checkpointing --learning-rate 1e-5 --generator-steps 500 --critic-steps 500
    torchrun --nproc-per-node 8 mada_rl.py --device cuda --fsdp ...   # data parallel; --fsdp: base and adapters sharded

Shapes: B rows (= P prompts x G group), T tokens per row, C completion tokens, N generators, M critics.
"""

import json
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

from common.args import TrainArgs, check_run_args, fail


@dataclass
class Args(TrainArgs):  # common/args.py: run folder, logging, device, sampling, optimiser, data, eval (no resume)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""
    eval_debate: str = ""
    """path of a finished run folder: load its adapters and only run the held-out debate (no training)"""
    generators_from: str = ""
    """path of a finished run folder: take its trained generators and its Stage-2 draw (stage2.jsonl: the generators'
    responses to each critic problem) and start at Stage 2, so that critic ablations (--no-counterfactual,
    --critic-sees) train on the same generators and the very same proposals; its model, data split, agents, LoRA shape
    and --generator-steps must be this run's"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the frozen base weights and of the compute (the LoRA adapters stay float32, peft's default, so their
    updates do not round away)"""
    num_train_problems: int = 1200
    """training problems before the split into N + M disjoint parts (0: all; testbed: 500 per level)"""
    rollout_backend: Literal["hf", "hf_generate"] = "hf"
    """generation engine: 'hf' (a KV-cache sampling loop on the live weights and active adapter) or
    'hf_generate' (plain model.generate)"""

    # Agents
    num_generators: int = 3
    """N: generator adapters (round 1 of the debate)"""
    num_critics: int = 3
    """M: critic adapters (rounds 2..R)"""
    lora_r: int = 8
    """LoRA rank of every adapter (the paper: 16 on a 1.5B model)"""
    lora_alpha: int = 16
    """LoRA alpha (scale alpha / r)"""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """modules that get a LoRA (Qwen2 / LLaMA names: every linear projection, as in the paper)"""

    # Rollouts
    num_prompts: int = 16
    """prompts per step (per rank)"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    proposal_temperature: float = 1.0
    """Stage 2: temperature at which the trained generators answer the critics' problems (0: greedy, as the debate)"""

    # Optimisation
    generator_steps: int = 80
    """Stage 1: GRPO steps per generator"""
    critic_steps: int = 80
    """Stage 3: policy-gradient steps per critic"""
    learning_rate: float = 1e-3
    """AdamW learning rate of the LoRA weights (constant after warmup; each adapter has its own warmup)"""

    # Algorithm
    counterfactual: bool = True
    """critic advantage A_C = R_C - 2 acc_G; --no-counterfactual: GRPO group z-score of R_C (the ablation)"""
    critic_sees: Literal["responses", "answers"] = "responses"
    """what a critic is shown of each proposal: the generator's whole response (the paper's x' = [x ; y^_1 ; ...]),
    cut to --proposal-tokens, or only its extracted final answer (the ablation). A testbed reply is its answer"""
    proposal_tokens: int = 1024
    """token budget of each response shown to a critic: a longer one keeps its last proposal_tokens tokens, where its
    final answer is (0: never cut; a response is at most --max-new-tokens)"""
    acc_weight: float = 2.0
    """weight of R_acc in R = w R_acc + R_len (and of acc_G in the counterfactual baseline); the paper: 2"""
    adv_eps: float = 1e-6
    """eps in the group z-score denominator (std is the biased, numpy-style one)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high"""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """token_mean: sum / tokens in the mini-batch; seq_mean_token_mean: mean over sequences of per-sequence means;
    constant: sum / (sequences x max_new_tokens)"""

    # Evaluation
    debate_rounds: int = 2
    """R: debate rounds at deployment (1: generators only; the paper's main setting: 2)"""
    eval_every: int = 0
    """also run the held-out debate every N global steps (0: only before training, after Stage 1 and at the end)"""

    # Filled in at runtime
    total_steps: int = 0
    """generator_steps * num_generators + critic_steps * num_critics"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(lora_r=a.lora_r, lora_targets=a.lora_target_modules,
                                           adapters=a.num_generators + a.num_critics))  # on one frozen base

import numpy as np
import torch
from tqdm import tqdm

import mada_rl_agents
from common import checkpoint, data, dist, evaluate, logger, models, rollout, verifiers


# ALGO LOGIC: the length reward, the MADA reward, the two advantages, the clipped objective and its normalisers
def length_reward(correct_PG: torch.Tensor, lengths_PG: torch.Tensor) -> torch.Tensor:
    """R_len of each completion, min-max normalised over its group; never positive when wrong.

    >>> length_reward(torch.tensor([[1., 1., 0., 0.]]), torch.tensor([[2, 4, 2, 4]]))
    tensor([[ 0.5000, -0.5000,  0.0000, -0.5000]])
    """
    lengths_PG = lengths_PG.float()
    lo_P1, hi_P1 = lengths_PG.min(1, keepdim=True).values, lengths_PG.max(1, keepdim=True).values
    span_P1 = hi_P1 - lo_P1
    lam_PG = torch.where(span_P1 > 0, 0.5 - (lengths_PG - lo_P1) / span_P1.clamp(min=1e-9), 0.0)
    return torch.where(correct_PG > 0, lam_PG, lam_PG.clamp(max=0.0))


def mada_reward(correct_PG: torch.Tensor, lengths_PG: torch.Tensor, acc_weight: float = 2.0) -> torch.Tensor:
    """R = w R_acc + R_len (w = 2 in the paper), for generators and critics alike."""
    return acc_weight * correct_PG + length_reward(correct_PG, lengths_PG)


def group_advantages(rewards_PG: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantage (r - mean_G) / (std_G + eps) and whether the group had zero reward std."""
    mean_P1 = rewards_PG.mean(1, keepdim=True)
    std_P1 = rewards_PG.std(1, unbiased=False, keepdim=True)
    zero_std_P = (rewards_PG.max(1).values - rewards_PG.min(1).values) == 0
    return (rewards_PG - mean_P1) / (std_P1 + eps), zero_std_P


def counterfactual_advantages(rewards_PG: torch.Tensor, acc_g_P: torch.Tensor, acc_weight: float = 2.0) -> torch.Tensor:
    """A_C = R_C - w acc_G: the baseline is the generators' per-instance accuracy, not the group mean.

    >>> counterfactual_advantages(torch.tensor([[2., 0.]]), torch.tensor([1 / 3]))
    tensor([[ 1.3333, -0.6667]])
    """
    return rewards_PG - acc_weight * acc_g_P.unsqueeze(1)


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
    its sequences with at least one such token, all its sequences)."""
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
    """Policy-gradient loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
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
    agg = lambda x: aggregate(x, mask_BC, args.loss_agg, *counts, args.max_new_tokens)  # noqa: E731
    loss = agg(pg_BC)
    with torch.no_grad():
        log_ratio_BC = (logp_BC - old_logp_BC) * mask_BC  # padding: 0, never exp(+large)
        stats = {
            "loss/policy": loss.item(),
            "policy/clip_frac": (clipped_BC * mask_BC).sum().item(),
            "policy/approx_kl": ((torch.expm1(-log_ratio_BC) + log_ratio_BC) * mask_BC).sum().item(),
            "policy/entropy": (entropy_BC * mask_BC).sum().item(),
        }
    return loss, stats


# Agents: one frozen base, N + M LoRA adapters switched by name
def agent_names(num_generators: int, num_critics: int) -> tuple[list[str], list[str]]:
    return [f"gen{n}" for n in range(num_generators)], [f"critic{m}" for m in range(num_critics)]


def make_agents(base, names: list[str], args: Args):
    """The base model with one fresh LoRA adapter per name (B = 0: every agent starts as the base), the first active
    and alone trainable (common/models.py: add_lora; mada_rl_agents.py: use_adapter, adapter_params)."""
    model = models.add_lora(base, names, args.lora_r, args.lora_alpha, args.lora_target_modules)
    mada_rl_agents.use_adapter(model, names[0])
    return model


def split_problems(problems: list, k: int, seed: int) -> list[list]:
    """k disjoint parts (by question text; duplicate questions are dropped first), shuffled with `seed`."""
    seen = set()
    unique = [p for p in problems if not (p.question in seen or seen.add(p.question))]  # first of each question
    random.Random(f"mada-split-{seed}").shuffle(unique)
    return [unique[i::k] for i in range(k)]


def proposal_text(completion: str, problem, tokenizer, critic_sees: str, proposal_tokens: int) -> str:
    """What a critic is shown of one proposal: the whole response, cut to its last `proposal_tokens` tokens when
    longer ('responses'), or its final answer ('answers'; on the testbed, where a reply is its answer, always).

    >>> from common.problem import Problem
    >>> p = Problem(question="What is 40 + 2?", answer="42", task="nl")
    >>> proposal_text("40 + 2 = 42. The answer is 42.", p, None, "answers", 0)
    '42'
    """
    if critic_sees == "answers" or problem.task == "testbed":
        return mada_rl_agents.final_answer(completion, problem)
    ids = tokenizer(completion.strip(), add_special_tokens=False)["input_ids"]
    if proposal_tokens and len(ids) > proposal_tokens:
        return "..." + tokenizer.decode(ids[-proposal_tokens:])
    return completion.strip()


def render_critic_prompt(problem, proposals: list[str], tokenizer) -> str:
    """x' = [x ; y^_1 ; ... ; y^_N], the paper's order: the question, the other agents' proposals (a proposal of
    several lines is one indented list item), then the template's answer instruction. The testbed's compact prompt
    puts its Prop: lines before `Q:...\\nA:`, where its models were trained to read context (Hint:, Ref: lines)."""
    if problem.task == "testbed":  # `Prop:17\nProp:16\nQ:...\nA:`: the answer must follow A: directly
        return "".join(f"Prop:{a}\n" for a in proposals) + data.render_prompt(problem, tokenizer)
    items = ["- " + a.replace("\n", "\n  ") for a in proposals]
    shown = "Answers proposed by other agents:\n" + "\n".join(items) + "\n\n"
    template = "{question}\n\n" + shown.replace("{", "{{").replace("}", "}}") + data.MATH_INSTRUCTION
    return data.render_prompt(problem, tokenizer, template=template)


# Deployment: the multi-round debate
def debate(model, engine, tokenizer, problems: list, generators: list[str], critics: list[str], rounds: int,
           max_new_tokens: int, max_prompt_tokens: int = 0, critic_sees: str = "responses",
           proposal_tokens: int = 0) -> tuple[list[list[list[str]]], list[list[list[bool]]]]:
    """answers[r][a][i]: round r's agent a's greedy answer to problem i (round 0: generators, then critics), and
    cut[r][a][i]: whether that answer ran to max_new_tokens without a stop token (it scores 0, as in training).
    A critic is shown the previous round's answers as `proposal_text` gives them. Rank 0 shows a bar over the
    answers as they end (as common.evaluate does), cleared when done."""
    answers, cut = [], []
    total = len(problems) * (len(generators) + (rounds - 1) * len(critics))
    bar = evaluate.answer_bar(total, f"held-out debate, {len(problems)} problems", max_new_tokens)
    engine.on_answers = bar.update  # HFEngine counts answers as they end
    for r in range(rounds):
        texts = ([data.render_prompt(p, tokenizer) for p in problems] if r == 0 else
                 [render_critic_prompt(p, [proposal_text(a[i], p, tokenizer, critic_sees, proposal_tokens)
                                           for a in answers[-1]], tokenizer)
                  for i, p in enumerate(problems)])
        prompt_ids = (data.encode_prompts(tokenizer, texts, max_prompt_tokens) if r == 0 else
                      mada_rl_agents.encode_critic_prompts(tokenizer, texts, max_prompt_tokens))
        round_answers, round_cut = [], []
        for name in generators if r == 0 else critics:
            mada_rl_agents.use_adapter(model, name)
            out = engine.generate(prompt_ids, n=1, max_new_tokens=max_new_tokens, greedy=True)
            round_answers.append(out.texts)
            round_cut.append([bool(t) for t in out.truncated_B])
            bar.update(len(problems) * (sum(map(len, answers)) + len(round_answers)) - bar.n)  # vllm: none till now
        answers.append(round_answers)
        cut.append(round_cut)
    bar.close()
    engine.on_answers = None
    return answers, cut


def train_agent(model, engine, tokenizer, name: str, records: list, args: Args, writer, step0: int,
                stage: int, agent: int, run_eval=None, ctrl_c=None) -> int:
    """GRPO (stage 1) or the critic policy gradient (stage 3) on one adapter; returns the last global step.
    records: problems (stage 1) or (problem, proposals, acc_G) tuples (stage 3); writer: main()'s RunLogger; run_eval:
    for --eval-every; ctrl_c: main()'s Ctrl-C state (common.checkpoint.catch_ctrl_c), told the step."""
    rank, world = dist.rank_world()
    mada_rl_agents.use_adapter(model, name)
    params = list(mada_rl_agents.adapter_params(model, name).values())  # under --fsdp: this rank's shards
    # ALGO LOGIC: AdamW on this adapter, warmed up linearly over --warmup-steps optimizer steps, then constant
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
    sampler = data.PromptSampler(records, args.seed + 1000 * stage + agent)  # the same on every rank
    steps = args.generator_steps if stage == 1 else args.critic_steps
    bar = tqdm(range(step0 + 1, step0 + steps + 1), desc=f"{args.exp_name} {name}", disable=logger.bars_off(rank))
    for step in bar:
        if ctrl_c is not None:
            ctrl_c.step = step  # mada_rl.py writes no checkpoints: a Ctrl-C quits at once, saying so
        t_step, times = time.time(), {}
        # 1. Rollouts: G completions for each of num_prompts prompts (generator: x; critic: x + proposals), each
        # rank taking its share of the world x num_prompts drawn
        batch_records = sampler.next(args.num_prompts * world)[rank::world]
        problems = batch_records if stage == 1 else [r[0] for r in batch_records]
        texts = ([data.render_prompt(p, tokenizer) for p in problems] if stage == 1 else
                 [render_critic_prompt(p, props, tokenizer) for p, props, _ in batch_records])
        prompt_ids = (data.encode_prompts(tokenizer, texts, args.max_prompt_tokens) if stage == 1 else
                      mada_rl_agents.encode_critic_prompts(tokenizer, texts, args.max_prompt_tokens))
        with logger.timed(times, "generate"):
            rollouts = engine.generate(prompt_ids, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                       max_new_tokens=args.max_new_tokens)

        # 2. Rewards: R = 2 R_acc + R_len, the length term normalised within each group
        with logger.timed(times, "score"):
            group_problems = [p for p in problems for _ in range(args.group_size)]
            correct_B = torch.tensor(verifiers.score(rollouts.texts, group_problems, rollouts.truncated_B))  # cut: 0
            correct_PG = correct_B.view(-1, args.group_size)
            len_PG = length_reward(correct_PG, rollouts.lengths_B.view(-1, args.group_size))
            rewards_PG = args.acc_weight * correct_PG + len_PG

        # ALGO LOGIC: 3. advantages: group z-score (generators, ablated critics) or A_C = R_C - 2 acc_G (critics)
        adv_PG, zero_std_P = group_advantages(rewards_PG, args.adv_eps)
        acc_g_P = torch.tensor([r[2] for r in batch_records], dtype=torch.float32) if stage == 3 else None
        if stage == 3 and args.counterfactual:
            adv_PG = counterfactual_advantages(rewards_PG, acc_g_P, args.acc_weight)
        adv_B = adv_PG.flatten()
        # every advantage 0 on every rank (the loss has no other term): the gradient is 0, yet AdamW's step still moves
        # the adapter (momentum, weight decay); --skip-zero-advantage-steps skips it (update/skipped)
        skip = args.skip_zero_advantage_steps and dist.all_reduce_sum(torch.count_nonzero(adv_B).float()).item() == 0
        mask_BC = rollouts.completion_mask_BC.clone()

        # 4. old log-probs (no grad) only when the ratio can differ from 1
        with logger.timed(times, "logprobs"):
            needs_old = not skip and (args.num_iterations > 1 or args.num_minibatches > 1)
            # batched_logprobs: completion_logprobs without grad, micro_batch_size rows at a time, 0 past the end
            batch = dict(input_ids_BT=rollouts.input_ids_BT, attention_mask_BT=rollouts.attention_mask_BT,
                         prompt_len=rollouts.prompt_len, mask_BC=mask_BC, adv_B=adv_B,
                         old_logp_BC=rollout.batched_logprobs(model, rollouts, args.temperature,
                                                              args.micro_batch_size, args.share_prompt, args.top_p)
                         if needs_old else None)

        # 5. Update of the active adapter only: num_iterations epochs x num_minibatches optimizer steps, micro-batched
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
                    dist.all_reduce_grads(model)  # plain data parallel (nothing to do under --fsdp)
                    grad_norms.append(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item())
                    optimizer.step()
                    lr = scheduler.get_last_lr()[0]  # the rate this optimizer step used
                    scheduler.step()

        # metrics: grpo.py's names plus mada/*; loss/* are means over optimizer steps, the other sums are over tokens
        lengths_PG = rollouts.lengths_B.float().view(-1, args.group_size)
        metrics = {
            "reward/mean": rewards_PG.mean().item(), "reward/std": rewards_PG.std(unbiased=False).item(),
            "train/accuracy": correct_PG.mean().item(),
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, args.device),
            "mada/stage": stage, "mada/agent": agent,
            "mada/len_reward": len_PG.mean().item(), "mada/adv_mean": adv_B.mean().item(),
            "mada/correct_len": (lengths_PG * correct_PG).sum().item() / max(correct_PG.sum().item(), 1.0),
        }
        if stage == 3:
            metrics["mada/acc_g"] = acc_g_P.mean().item()
            metrics["mada/beats_generators"] = (correct_PG.mean(1) - acc_g_P).mean().item()
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step) or (step == step0 + steps and args.log_samples > 0):  # each agent's last too
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=rewards_PG.flatten(),
                correct=correct_PG.flatten(), advantage=adv_B, agent=[name] * len(adv_B),
                proposals=[r[1] for r in batch_records for _ in range(args.group_size)] if stage == 3 else None)
        if run_eval is not None and args.eval_every and step % args.eval_every == 0:
            metrics.update(run_eval())
            mada_rl_agents.use_adapter(model, name)  # the debate switched adapters
        metrics["perf/step_time"] = time.time() - t_step
        writer.log(step, metrics, bar)
        writer.warn_if_stuck(step, metrics, args.max_new_tokens)  # one console line after 3 steps without signal
    return step0 + steps


def proposal_rows(model, engine, tokenizer, problems: list, generators: list[str], args: Args) -> list[dict]:
    """Stage 2's draw: each generator's whole response to each critic problem at --proposal-temperature, and whether
    it is right (a response cut at max_new_tokens is wrong, as in training and in the debate), a dict a problem."""
    prompt_ids = data.encode_prompts(tokenizer, [data.render_prompt(p, tokenizer) for p in problems],
                                     args.max_prompt_tokens)
    outs = []
    for name in generators:
        mada_rl_agents.use_adapter(model, name)
        outs.append(engine.generate(prompt_ids, n=1, temperature=max(args.proposal_temperature, 1e-6), top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, greedy=args.proposal_temperature <= 0))
    correct_NP = np.array([verifiers.score(o.texts, problems, o.truncated_B) for o in outs])
    return [{"question": p.question, "answer": p.answer, "responses": [o.texts[i] for o in outs],
             "correct": correct_NP[:, i].tolist()} for i, p in enumerate(problems)]


def critic_record(problem, row: dict, tokenizer, args: Args) -> tuple:
    """(problem, the proposals as this run's critic sees them, acc_G = mean_n R_acc(y^_n, y)) from a `proposal_rows`
    row, drawn in this run or read from the --generators-from run's stage2.jsonl."""
    return (problem, [proposal_text(r, problem, tokenizer, args.critic_sees, args.proposal_tokens)
                      for r in row["responses"]], float(np.mean(row["correct"])))


def critic_records(model, engine, tokenizer, problems: list, generators: list[str], args: Args) -> list[tuple]:
    """Stage 2: (problem, the generators' proposals as a critic sees them, acc_G) for each critic problem; a proposal
    cut at max_new_tokens counts as wrong in acc_G, as in training and in the debate."""
    rows = proposal_rows(model, engine, tokenizer, problems, generators, args)
    return [critic_record(p, row, tokenizer, args) for p, row in zip(problems, rows)]


def main(args: Args) -> dict:
    # setup: flags checked before any work, seeding and the run folder, Ctrl-C, data, agents
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    shown, budget = mada_rl_agents.check_flags(args)  # proposals a critic prompt shows, and each one's token budget
    stage_1 = mada_rl_agents.stage_1_weights(args.generators_from.rstrip("/"), args) if args.generators_from else None
    # ALGO LOGIC: the step counter and the batch sizes (derived: another given value is an error, never replaced)
    total_steps = args.generator_steps * args.num_generators + args.critic_steps * args.num_critics
    if args.total_steps not in (0, total_steps):
        fail(f"--total-steps {args.total_steps} is derived, not set: --generator-steps x --num-generators + "
             f"--critic-steps x --num-critics = {total_steps} here; change those")
    args.total_steps = total_steps
    check_run_args(args)
    args.batch_size = args.num_prompts * args.group_size  # rollouts per step (per rank)
    args.minibatch_size = args.batch_size // args.num_minibatches  # rollouts per optimizer step (check_run_args)
    dist.seed_everything(args.seed + rank)  # python, numpy and torch: each rank its own random stream
    run_dir = logger.run_folder(args, rank)
    ctrl_c = checkpoint.catch_ctrl_c(run_dir, rank, no_resume="mada_rl.py writes no checkpoints (its stages are "
                                     "short): nothing is kept; rerun the script")  # Ctrl-C: one line, at once
    train_problems, eval_problems = data.load_train_eval(args)
    if len(eval_problems) < world:  # the debate and Stage 2 give every rank a share of at least one problem
        fail(f"--num-eval-problems {args.num_eval_problems}: {len(eval_problems)} held-out problems for {world} ranks")
    if args.eval_debate:  # deployment only, from a finished run folder (its --model-name, from its args.json)
        model, generators, critics = mada_rl_agents.load_run_agents(args.eval_debate.rstrip("/"), args, device)
        tokenizer = models.load_tokenizer(mada_rl_agents.model_folder(args.model_name), args.system_prompt)
    else:
        model_path = mada_rl_agents.model_folder(args.model_name)  # grounds/ builds an embedded name's folder
        tokenizer = models.load_tokenizer(model_path, args.system_prompt)
        generators, critics = agent_names(args.num_generators, args.num_critics)
        splits = split_problems(train_problems, args.num_generators + args.num_critics, args.seed)
        if min(len(s) for s in splits) < max(args.num_prompts, world):
            fail(f"--num-train-problems {args.num_train_problems}: {len(train_problems)} problems split {len(splits)} "
                 f"ways leave {min(len(s) for s in splits)} per agent, fewer than --num-prompts {args.num_prompts}"
                 + (f" or the {world} ranks" if world > args.num_prompts else ""))
        stage_2 = (mada_rl_agents.saved_stage_2(args.generators_from.rstrip("/"), dict(zip(
            critics, splits[args.num_generators:]))) if args.generators_from else None)  # before the model loads
        with torch.random.fork_rng():  # the same initial adapters on every rank
            torch.manual_seed(args.seed)
            base = models.load_model(model_path, args.dtype, device)
            models.mask_padded_head(base, len(tokenizer))  # no probability on LM-head rows the tokenizer lacks
            model = make_agents(base, generators + critics, args)
        if stage_1 is not None:
            mada_rl_agents.copy_generators(model, stage_1, generators)
        if args.gradient_checkpointing:  # the frozen base's layers recomputed in backward (LoRA gradients only)
            models.enable_gradient_checkpointing(model)
    (model,) = dist.shard_models(args, model)  # --fsdp: FSDP2 per decoder layer (frozen base and adapters)
    if args.critic_sees == "responses" and args.max_prompt_tokens:  # before any training: the longest question and
        # template of a critic prompt, with every proposal at its full budget, must fit (critic prompts are never cut)
        critic_problems = (eval_problems if args.debate_rounds > 1 else []) + [
            p for s in ([] if args.eval_debate else splits[args.num_generators:]) for p in s]
        mada_rl_agents.check_critic_room(tokenizer, [render_critic_prompt(p, [""] * shown, tokenizer)
                                                     for p in critic_problems], shown, budget, args)
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)

    def run_eval():  # each rank debates its share of the problems; every rank gets every answer
        answers, cut = debate(model, engine, tokenizer, eval_problems[rank::world], generators, critics,
                              args.debate_rounds, args.max_new_tokens, args.max_prompt_tokens, args.critic_sees,
                              args.proposal_tokens)
        answers, cut = ([[mada_rl_agents.gather_shares(a) for a in rnd] for rnd in x] for x in (answers, cut))
        return {**mada_rl_agents.debate_metrics(answers, eval_problems, len(generators), cut),
                "samples/eval": mada_rl_agents.debate_samples(answers, cut, eval_problems, args.log_samples)}

    if args.eval_debate:
        res = logger.without_samples(run_eval())
        if rank == 0:
            mada_rl_agents.print_table({"trained": res})
        return {"after": res, "run_dir": args.eval_debate}
    per_agent = sum(p.numel() for p in mada_rl_agents.adapter_params(model, generators[0]).values())
    base_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    params_info = {"mada/trainable_params_per_agent": per_agent,
                   "mada/trainable_params_total": per_agent * (args.num_generators + args.num_critics),
                   "mada/base_params": base_params, "mada/split_sizes": [len(s) for s in splits]}
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)
    t_start = time.time()
    step = args.generator_steps * args.num_generators if args.generators_from else 0  # one step counter
    first_eval = run_eval()  # untrained adapters (B = 0): every agent is the base model (--generators-from: critics)
    writer.log(step, {**first_eval, **params_info})
    first_eval = mid_eval = logger.without_samples(first_eval)

    # Stage 1: generators, each on its own split (--generators-from: done in that run)
    if not args.generators_from:
        for n, name in enumerate(generators):
            step = train_agent(model, engine, tokenizer, name, splits[n], args, writer, step, 1, n, run_eval, ctrl_c)
        mid_eval = run_eval()  # trained generators, untrained critics
        writer.log(step, mid_eval)
        mid_eval = logger.without_samples(mid_eval)

    # Stage 2: critic data from the trained generators; Stage 3: critics, each on its own split
    stage2 = {}
    for m, name in enumerate(critics):
        problems = splits[args.num_generators + m]
        if stage_2 is not None:  # --generators-from: the very proposals that run drew and gave its critics
            rows = stage_2[name]
        else:  # drawn from a seed of their own (the HF sampler draws from torch's generator), whatever Stage 1 drew
            torch.manual_seed(args.seed + 10_000 * (m + 1) + rank)
            rows = mada_rl_agents.gather_shares(  # each rank's share of the split, then all of it on every rank
                proposal_rows(model, engine, tokenizer, problems[rank::world], generators, args))
        records = [critic_record(p, row, tokenizer, args) for p, row in zip(problems, rows)]
        if rank == 0:  # what this critic trains on, kept with the run (stage2.jsonl; --generators-from reads it)
            with open(os.path.join(run_dir, "stage2.jsonl"), "a" if m else "w") as f:
                for row, (_, proposals, acc_g) in zip(rows, records):
                    f.write(json.dumps({"critic": name, **row, "proposals": proposals, "acc_g": acc_g}) + "\n")
        acc, N = np.array([r[2] for r in records]), args.num_generators
        stage2[f"mada/critic_data/{name}/acc_g_mean"] = float(acc.mean())
        stage2.update({f"mada/critic_data/{name}/frac_acc_g_{k}of{N}": float((np.round(acc * N) == k).mean())
                       for k in range(N + 1)})
        step = train_agent(model, engine, tokenizer, name, records, args, writer, step, 3, m, run_eval, ctrl_c)
    ctrl_c.step = None  # the final evaluation
    final_eval = run_eval()
    final_eval["mada/train_time_s"] = time.time() - t_start
    writer.log(step, {**final_eval, **stage2})
    final_eval = logger.without_samples(final_eval)
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    adapters = {n: t.full_tensor() if dist.is_sharded(model) else t  # every rank gathers; rank 0 writes
                for n, t in model.state_dict().items() if "lora_" in n}
    if rank != 0:
        return {"after": final_eval, "run_dir": run_dir}
    model.save_pretrained(os.path.join(run_dir, "adapters"), state_dict=adapters)  # adapters/gen0, ..., critic{M-1}
    mada_rl_agents.print_table({"generators": mid_eval, "trained": final_eval} if args.generators_from else
                               {"base": first_eval, "generators": mid_eval, "trained": final_eval})
    print(f"trainable parameters: {per_agent:,} per agent, {params_info['mada/trainable_params_total']:,} in all "
          f"({args.num_generators + args.num_critics} adapters) vs {base_params:,} for full fine-tuning of one model; "
          f"{final_eval['mada/train_time_s']:.0f} s; run folder {run_dir}")
    return {"before": first_eval, "generators": mid_eval, "after": final_eval, "stage2": stage2,
            "params": params_info, "run_dir": run_dir}


if __name__ == "__main__":
    main(ARGS)
