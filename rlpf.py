"""RLPF: RL from Performance Feedback (Jing et al. 2026, arXiv 2607.27271), GRPO with a staged code-speed reward.

The policy writes a program for a code-optimisation task; the sandbox (code_env/sandbox.py) runs it
on hidden tests and times it against the task's slow baseline (T_b) and fast reference (T_r),
re-timed in the same interleaved rounds. The reward never pays for speed without correctness:

    failure ladder   s(no program) = -0.05 < s(compile error) = 0 < s(crash/timeout) = 0.05 < s(wrong) = 0.10
    if correct       R = max(0.15, CGRE + 0.16 [s > 1] + 0.10 [T_c <= 1.02 T_r]),
                     CGRE = clip((T_b - T_b/s) / (T_b - T_r), 0, 1)
                     s = credit(T_b / T_c, f_b)   (the credited speed-up)
                     credit(x, f) = 1 if 1/f <= x <= f, else x / f (x > f) or x f (x < 1/f)

so every correct program (>= 0.15) outranks every failure (<= 0.10). With f_b = 1 these are the papers' terms
(FBR = [T_c < T_b], RBR = [T_c <= 1.02 T_r]); f_b is the task's noise floor, measured at start. In FBR and CGRE noise
only withholds credit: the floor shrinks the speed-up. The expert-match term RBR keeps the paper's unfloored 2 %, so
there noise decides both ways: timing noise wider than 2 % pays a program at the expert's speed about half the time,
and now and then one a little slower (a floor there would pay a program up to that floor slower, every time).

Timing (code_env/tasks.py `judge`, code_env/sandbox.py `measure`), so that the speed terms hold under load and
cannot be gamed: each program of a task, and the two references, run in their own sandbox (one process, one
thread, a read-only filesystem but for private scratch folders); after the tests and one warm-up call,
--timing-repeats rounds each call every program once on an input drawn anew for this judging and new to the
process, in a shuffled order, all on one CPU drawn for the round; a call counts the CPU time of the program's own
process, read by the judge from the kernel (waiting for a CPU is not counted). A program's speed-up T_b / T_c is
the median over rounds of the per-round ratio to the slow baseline, so that what slows a round slows both, at most
its first round's ratio (later rounds could reuse state from earlier calls), with CPU spent before the first round
beyond twice the baseline's charged to every round (a table built at import); a speed-up that lands near the noise
floor (between f and --confirm-band x f, or as far below 1) is judged once more in fresh sandboxes and the one
closer to 1 is kept. The timing inputs make the slow baseline run ~55-100 ms a call here. Noise floor: at start,
each task
judges a copy of each reference --calibration-scorings times against the references, exactly as a candidate;
f = max(--min-noise-floor, exp(--noise-floor-margin x max |log self-speed-up|)) (logged as `timing calibration
...` and timing/noise_floor), so that an equal program is credited 1 and earns no speed reward; the least floor,
1.2, covers the rare outlier a few calibration judgings miss.
Cost: per judging of a task, (1 + repeats) calls of every distinct correct program and of both references, about
10 x 55-100 ms of CPU for each one as slow as the baseline, plus a sandbox start per program; at start, calibration
judgings per task (seconds per scoring and per calibration: benchmarks/premises/rlpf_timing.md).

The group-relative advantage and the clipped objective are GRPO's (grpo.py), unchanged:

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)
    J   = E[ agg_{i,t} min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) - beta KL_it ]

`--reward dmc` uses the DMC-Optim collapsed reward (Chambon et al. 2026, arXiv 2607.25970),
R = (1 + c)(1 + g)/2 - 1 with c, g in {-1, +1} (correct; fast); `--reward correctness` is plain
RLVR (1 if correct) and `--reward speed_ungated` pays speed whether or not the output is right
(the ablation that collapses correctness in both papers).

Left out, on purpose: DMC's pool of human solutions (speed is judged against the two references),
its affine drift recalibration (references are re-timed in the same rounds instead), dynamic re-sampling.

    python rlpf.py                                          # embedded CPU demo, a few minutes
    python rlpf.py --score-file candidate.py --task sum_range   # judge one program, print one JSON line
    python rlpf.py --reward correctness                     # RLVR ablation (also: dmc, speed_ungated)
    python rlpf.py --model-name Qwen/Qwen2.5-Coder-0.5B-Instruct --dataset my_tasks.jsonl --device cuda \\
        --dtype bfloat16 --max-new-tokens 512 --num-prompts 16 --group-size 8 --learning-rate 1e-6
    torchrun --nproc-per-node 8 rlpf.py --device cuda --fsdp ...    # one rank per GPU; --fsdp: FSDP2 sharding

Shapes: B rows (= P tasks x G group), T tokens per row, C completion tokens.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

from common.args import RunArgs, check_run_args


@dataclass
class Args(RunArgs):  # common/args.py: run folder, resume, logging, device, sampling, optimiser
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (prefix of the run folder)"""

    # Model and data
    model_name: str = "testbed-code"
    """'testbed-code' (built locally and cached: warm-started on slow, fast and broken programs), a Hugging Face id,
    or a local folder"""
    dataset: str = "embedded"
    """'embedded' (the tasks of code_env/tasks.py) or a local .jsonl of code tasks (format in that file)"""
    tasks: tuple[str, ...] = ()
    """train and evaluate on these task names only (default: all)"""

    # Judging (code_env/sandbox.py)
    score_file: str = ""
    """judge this program file on --task and print one JSON line (status, runtime, speed-up); no training"""
    task: str = "sum_range"
    """the task of --score-file"""
    call_timeout: float = 2.0
    """wall-clock seconds a program may take for one call (a timeout fails the program)"""
    memory_mb: int = 256
    """address-space limit of a program, MiB"""
    timing_repeats: int = 9
    """timed rounds per program, after a warm-up round; each round times every program of a task once, on one
    CPU, counting the CPU time of its own process; its speed-up is the median over rounds of the per-round ratio
    to the slow baseline (docs/rlpf.md, "Timing")"""
    calibration_scorings: int = 5
    """per task, at start: judge a copy of each reference this many times against the references themselves"""
    noise_floor_margin: float = 3.0
    """noise floor = exp(margin * the largest |log speed-up| of the copies): speed-ups within it earn no credit"""
    confirm_band: float = 3.0
    """a program whose speed-up lands between the noise floor f and this x f (or as far below 1) is judged once
    more in fresh sandboxes and keeps the speed-up closer to 1 (a sandbox process can be persistently faster or
    slower than another); 1 turns the second judging off"""
    min_noise_floor: float = 1.2
    """the noise floor is never below this factor: a few calibration judgings miss the rare outlier (an equal
    program reached 1.10-1.12x in about 1 of 100 scorings here, benchmarks/premises/rlpf_timing.md); 1 = the calibration
    alone"""

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
    num_prompts: int = 5
    """prompts (tasks) per step (per rank)"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    max_new_tokens: int = 96
    """completion length cap; completions without eos are 'truncated'"""

    # Reward
    reward: Literal["staged", "dmc", "correctness", "speed_ungated"] = "staged"
    """staged: RLPF ladder + correctness-gated speed terms; dmc: collapsed (1+c)(1+g)/2-1; correctness: 1 if
    correct (RLVR); speed_ungated: the speed terms without the correctness gate (ablation)"""
    rbr_tolerance: float = 1.02
    """'matches the reference' means T_c <= rbr_tolerance * T_r (the RLPF code's undocumented 2 %)"""

    # Optimisation
    total_steps: int = 40
    """number of GRPO steps (rollout + update)"""
    learning_rate: float = 1e-4
    """AdamW learning rate (constant after warmup)"""
    micro_batch_size: int = 40
    """rows per forward/backward; gradients do not depend on it"""

    # Algorithm
    adv_norm: Literal["group_std", "group_mean", "batch_std"] = "group_std"
    """group_std: (r - mean_G) / (std_G + eps); group_mean: r - mean_G (Dr. GRPO); batch_std: / std over the batch
    of all ranks"""
    adv_eps: float = 1e-4
    """eps in the advantage denominator (std is the biased, numpy-style one); 1e-4 keeps timing jitter in
    near-constant groups from being blown up into full-size advantages"""
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
    eval_every: int = 20
    """evaluate every N steps (0: only before and after training)"""
    eval_samples: int = 8
    """programs sampled per task for the evaluation (plus one greedy)"""


if __name__ == "__main__":  # the flags parse, and --help answers, before torch loads (a fraction of a second)
    # with --resume: the run's args.json for every flag not given; --plan-memory: print what the run loads, exit
    ARGS = Args.parse(holds=lambda a: dict(reference=a.beta > 0))

import torch

from code_env import judge, tasks
from common import checkpoint, data, dist, evaluate, logger, models, rollout


# ALGO LOGIC: rewards (RLPF, arXiv 2607.27271; DMC-Optim, arXiv 2607.25970; docs/rlpf.md "The reward and the objective")
LADDER = {"no_program": -0.05, "compile_error": 0.0, "runtime_error": 0.05, "timeout": 0.05, "memory_limit": 0.05,
          "wrong_output": 0.10}
"""s(sigma): failures ranked by how far the program got (no program < does not compile < fails to run < wrong)."""
CORRECT_FLOOR = 0.15
"""s(WO) + 0.05: the least a correct program earns, above every failure."""


def credited_speedup(speedup: float, floor: float = 1.0) -> float:
    """The speed-up the reward credits: 1 within the noise floor [1/floor, floor], beyond it shrunk by the floor
    (on a log scale, |log s| - log floor), so that a program as fast as the reference earns no speed credit.

    >>> credited_speedup(1.08, 1.1), credited_speedup(0.95, 1.1), credited_speedup(2.2, 1.1)
    (1.0, 1.0, 2.0)
    >>> credited_speedup(0.5, 1.25), credited_speedup(1.3, 1.0)
    (0.625, 1.3)
    """
    if floor < 1:
        raise ValueError(f"a noise floor is a factor >= 1, got {floor}")
    if speedup > floor:
        return speedup / floor
    if speedup < 1 / floor:
        return speedup * floor
    return 1.0


def speed_terms(t_c: float, t_b: float, t_r: float, tol: float = 1.02, floors=(1.0, 1.0)) -> tuple:
    """(CGRE, FBR, RBR) from the credited speed-up s = credited(T_b / T_c, floor_b): CGRE = clip((T_b - T_b/s) /
    (T_b - T_r), 0, 1), FBR = [s > 1] = [T_c floor_b < T_b], RBR = [T_c <= tol T_r] (the paper's term: widening it
    by the fast reference's noise floor, floors[1], would pay a program up to that factor slower than the expert).
    With floors (1, 1) they are the papers' terms exactly.

    >>> speed_terms(0.025, 1.0, 0.01, floors=(1.2, 2.59))[2], speed_terms(0.0101, 1.0, 0.01, floors=(1.2, 2.59))[2]
    (0.0, 1.0)
    """
    s = credited_speedup(t_b / t_c, floors[0])
    cgre = min(max((t_b - t_b / s) / max(t_b - t_r, 1e-12), 0.0), 1.0)
    return cgre, float(t_c * floors[0] < t_b), float(t_c <= tol * t_r)


def staged_reward(status: str, t_c: float | None, t_b: float, t_r: float, tol: float = 1.02,
                  floors=(1.0, 1.0)) -> float:
    """RLPF: R = s(sigma) if incorrect; max(s(WO) + 0.05, CGRE + 0.16 FBR + 0.10 RBR) if correct (speed terms from
    the credited speed-ups, `speed_terms`).

    >>> staged_reward("wrong_output", 0.001, 1.0, 0.01), staged_reward("correct", 1.5, 1.0, 0.01)
    (0.1, 0.15)
    >>> round(staged_reward("correct", 0.01, 1.0, 0.01), 2)   # CGRE 1 + FBR 0.16 + RBR 0.10
    1.26
    >>> staged_reward("correct", 0.95, 1.0, 0.01, floors=(1.1, 1.5))   # 1.05x faster: within the noise floor
    0.15
    """
    if status != "correct":
        return LADDER[status]
    cgre, fbr, rbr = speed_terms(t_c, t_b, t_r, tol, floors)  # FBR: faster than the baseline; RBR: matches T_r
    return max(CORRECT_FLOOR, cgre + 0.16 * fbr + 0.10 * rbr)


def dmc_reward(status: str, t_c: float | None, t_b: float, t_r: float, floors=(1.0, 1.0)) -> float:
    """DMC collapsed reward R = (1 + c)(1 + g)/2 - 1: +1 if correct and fast, else -1.

    c = +1 if correct else -1; g = +1 if T_c <= sqrt(T_b T_r) (the program closes at least half of the
    baseline-to-reference gap on a log scale; our stand-in [I] for DMC's "faster than the top 50 % of
    human solutions", as the tasks carry two references, not a pool), else -1; the speed-up T_b / T_c is the
    credited one.

    >>> dmc_reward("correct", 0.01, 1.0, 0.01), dmc_reward("correct", 0.9, 1.0, 0.01), dmc_reward("timeout", None, 1, 1)
    (1.0, -1.0, -1.0)
    """
    c = 1.0 if status == "correct" else -1.0
    fast = t_c is not None and credited_speedup(t_b / t_c, floors[0]) >= (t_b / t_r) ** 0.5
    g = 1.0 if fast else -1.0
    return (1 + c) * (1 + g) / 2 - 1


def correctness_reward(status: str, t_c: float | None, t_b: float, t_r: float) -> float:
    """RLVR: 1 if correct, else 0 (no speed term)."""
    return float(status == "correct")


def speed_ungated_reward(status: str, t_c: float | None, t_b: float, t_r: float, tol: float = 1.02,
                         floors=(1.0, 1.0)) -> float:
    """The staged speed terms without the correctness gate: CGRE + 0.16 FBR + 0.10 RBR for any program that
    ran on the timing inputs (right or wrong output), 0 for one that did not (the ablation that collapses)."""
    if t_c is None:
        return 0.0
    cgre, fbr, rbr = speed_terms(t_c, t_b, t_r, tol, floors)
    return cgre + 0.16 * fbr + 0.10 * rbr


def program_reward(kind: str, status: str, t_c: float | None, t_b: float, t_r: float, tol: float = 1.02,
                   floors=(1.0, 1.0)) -> float:
    if kind == "staged":
        return staged_reward(status, t_c, t_b, t_r, tol, floors)
    if kind == "dmc":
        return dmc_reward(status, t_c, t_b, t_r, floors)
    if kind == "correctness":
        return correctness_reward(status, t_c, t_b, t_r)
    if kind == "speed_ungated":
        return speed_ungated_reward(status, t_c, t_b, t_r, tol, floors)
    raise ValueError(f"unknown reward {kind!r}")


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
    """GRPO loss of `rows` of the rollout batch, scaled for gradient accumulation over the mini-batch."""
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
    judge.check_timing_args(args)
    if args.score_file:  # the side mode: judge one program (code_env/judge.py), print one JSON line
        return judge.score_file(args, staged_reward, credited_speedup)
    # TRY NOT TO MODIFY: setup (flags, seeding, run folder, Ctrl-C, tasks, model, resume)
    rank, world, device = dist.init_distributed(args.device, args.dist_timeout_minutes)
    # contradicting flags and a --resume folder that cannot be resumed fail here, before any work
    check_run_args(args, tis=args.tis)
    ckpt = checkpoint.open_checkpoint(args.resume, rank, world)
    dist.seed_everything(args.seed + rank)  # python, numpy and torch: each rank its own random stream
    run_dir = logger.run_folder(args, rank)
    ctrl_c = checkpoint.catch_ctrl_c(run_dir, rank, __file__, args.save_optimizer)  # Ctrl-C: one line, status 130
    model_path = args.model_name  # a hub id or a local folder
    if model_path.lower() in models.EMBEDDED_NAMES:  # an embedded model, built once and cached by grounds/
        import grounds  # only then: a fork without grounds/ runs on hub ids and local folders
        model_path = grounds.path_of(model_path)
    tokenizer = models.load_tokenizer(model_path)
    train_tasks = tasks.select_tasks(args.dataset, args.tasks)
    tasks.check_timing_inputs(train_tasks, args.timing_repeats)
    eval_tasks = train_tasks  # the same tasks: the evaluation measures the policy, not generalisation
    judge.calibrate_timing(train_tasks, args)  # each task's noise floors, measured once before any program is judged
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
    sampler = data.PromptSampler(train_tasks, args.seed + rank)
    engine = rollout.make_engine(args, model, tokenizer, args.seed + rank)
    state = checkpoint.resume_state(ckpt, model, optimizer, scheduler, sampler, engine, device)
    writer = logger.RunLogger(args, run_dir, enabled=rank == 0)

    def run_eval():  # one greedy and --eval-samples sampled programs per task, judged (code_env/judge.py)
        return judge.evaluate_code(engine, tokenizer, eval_tasks, args)

    first_eval = evaluate.first_evaluation(run_eval, state, writer)
    bar = logger.step_bar(args, state["step"], rank)  # tqdm over range(start + 1, total_steps + 1), on rank 0
    metrics = {}
    for step in bar:
        ctrl_c.step = step  # a first Ctrl-C from here on stops the run after this step, saved
        t_step, times = time.time(), {}
        # 1. Rollouts: G programs for each of num_prompts tasks
        problems = sampler.next(args.num_prompts)
        prompt_ids = data.encode_prompts(tokenizer, [tasks.render_code_prompt(t, tokenizer) for t in problems])
        with logger.timed(times, "generate"):
            rollouts = engine.generate(prompt_ids, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                       max_new_tokens=args.max_new_tokens,
                                       return_logprobs=args.rollout_backend == "vllm")

        # 2. Rewards from the sandbox: run, check and time every program against the re-timed references
        with logger.timed(times, "score"):
            group_problems = [t for t in problems for _ in range(args.group_size)]
            programs = [tasks.extract_program(x, t.entry) for x, t in zip(rollouts.texts, group_problems)]
            judged, timing_stats = judge.judge_programs(group_problems, programs, args)
            rewards_B = torch.tensor([program_reward(args.reward, v.status, v.runtime, t_b, t_r, args.rbr_tolerance,
                                                     v.floors) for v, t_b, t_r in judged])
            correct_B = torch.tensor([float(v.status == "correct") for v, _, _ in judged])

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
        # other sums (the vllm sampler's rollout/* included) are over tokens
        metrics = {
            "reward/mean": rewards_B.mean().item(), "reward/std": rewards_B.std(unbiased=False).item(),
            "train/accuracy": correct_B.mean().item(), **judge.code_metrics(judged, "train/"), **timing_stats,
            "adv/frac_zero_std": zero_std_P.float().mean().item(), "adv/mean_abs": adv_B.abs().mean().item(),
            **logger.update_metrics(sums, grad_norms, lr, args.num_iterations * args.num_minibatches,
                                    mask_BC.sum().item() * args.num_iterations),
            **logger.rollout_perf_metrics(rollouts, times, args.num_iterations, device),
        }
        metrics = dist.all_reduce_mean(metrics)
        if logger.sample_step(args, step):  # a few of the step's programs as text (samples.jsonl), with their verdicts
            metrics["samples/train"] = logger.sample_rows(
                tokenizer, rollouts, group_problems, args.log_samples, args.group_size, reward=rewards_B,
                correct=correct_B, advantage=adv_B, task=[t.name for t in group_problems],
                **judge.verdict_fields(judged))
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
    final_eval = run_eval()
    writer.log(args.total_steps, final_eval)
    final_eval = logger.without_samples(final_eval)
    writer.close()  # metrics.jsonl, samples.jsonl and curve.png complete
    if rank == 0:
        for key, what in (("eval/pass_rate", "sampled pass rate"),
                          ("eval/fast_frac", "correct programs at least 2x faster than the slow baseline"),
                          ("eval/mean_speedup", "mean speed-up of correct programs over the baseline"),
                          ("eval/greedy_pass_rate", "greedy pass rate")):
            print(f"{what}: {first_eval.get(key, 0.0):.3f} -> {final_eval.get(key, 0.0):.3f}")
        print(f"run folder {run_dir}")
    return {"before": first_eval, "after": final_eval, "last": metrics, "run_dir": run_dir}


if __name__ == "__main__":
    main(ARGS)
