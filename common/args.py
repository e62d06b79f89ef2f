"""The flags the trainers share, as dataclasses that a trainer's `Args` extends with its algorithm's own flags:
`ExperimentArgs` (run folder, logging, device), `RunArgs` (ExperimentArgs plus resume, dtype, sharding, sampling
and the optimiser) and `TrainArgs` (RunArgs plus model, data, rollout engine and evaluation). The algorithm's own
hyperparameters (group size, clipping, advantages, KL) stay in the trainer's file. A trainer redeclares a field
to change its default or its help (the field keeps its place in --help)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from common import memory_plan
from common.reasoning_gym import check_spec, is_rg


@dataclass
class ExperimentArgs:
    # Experiment
    exp_name: str = "run"
    """name of this experiment (prefix of the run folder)"""
    seed: int = 1
    """seed of python, numpy and torch (each rank adds its rank)"""
    run_name: str = ""
    """run folder name under --output-dir; default {exp_name}__{seed}__{unix time}"""
    output_dir: str = "runs"
    """where run folders are created"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to keep it local)"""
    wandb_project: str = "tinypost"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    log_samples: int = 4
    """rollouts of the step (one per group) and greedy held-out answers written as text to samples.jsonl, the
    console and wandb (a Table) at every evaluation step and the last step (0: none; docs/runs.md)"""
    log_samples_every: int = 0
    """also write the step's sample rollouts every N steps (0: only at evaluation steps and the last step)"""
    device: str = "cpu"
    """torch device ('cpu', 'cuda')"""
    dist_timeout_minutes: float = 180.0
    """under torchrun: how long a rank waits for the others in a collective before the job fails (NCCL's own default,
    10 minutes, is shorter than the stages rank 0 runs alone, e.g. ppo_slm.py's SFT and reward model)"""
    plan_memory: bool = False
    """print the memory this run needs per rank and phase, from the model's config.json alone (no weights load),
    whether it fits the device and which flag would make it fit, then exit (1: it does not fit; docs/memory.md)"""
    device_memory_gb: float = 0.0
    """--plan-memory: one device's memory in GB (1e9 bytes); 0: the GPU nvidia-smi finds, or the available RAM"""
    plan_ranks: int = 0
    """--plan-memory: the ranks to plan for (0: WORLD_SIZE under torchrun, else 1); --fsdp shards over them"""

    @classmethod
    def parse(cls, argv: list[str] | None = None, holds=None):
        """These flags from the command line (`cli`: with --resume, the run's args.json for every flag not given;
        `holds(args)`: what the run loads, for --plan-memory)."""
        return cli(cls, argv, holds)


@dataclass
class RunArgs(ExperimentArgs):
    resume: str = ""
    """path of a run folder to continue from its latest checkpoint; the flags not given take that run's args.json
    values (a trainer's command line: common.args.cli)"""
    new_eval_set: bool = False
    """with --resume: allow flags that change the held-out evaluation set (the run's curve then mixes two sets)"""
    save_every: int = 0
    """write a checkpoint every N steps (0: only at the end)"""
    save_optimizer: bool = True
    """keep the AdamW state in checkpoints, for --resume; --no-save-optimizer: weights, tokenizer and schedule only,
    a third of the size (SmolLM2-135M: 0.54 GB, not 1.6 GB), which --resume refuses"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """compute precision. bfloat16 / float16: forward and backward in that dtype (autocast; under --fsdp, FSDP2's
    bfloat16 copies of the parameters with gradients reduced in float32) over float32 master weights, gradients and
    AdamW state; the reference is stored as the policy is, so that the two agree exactly at step 0, and direct_opd's
    teachers so too (common.models.frozen_copy; docs/fsdp.md: bytes per parameter)"""
    master_weights: bool = True
    """with --dtype bfloat16 / float16, keep the trained weights in float32; --no-master-weights stores them in
    --dtype (half their memory, but AdamW updates below half a bfloat16 step round away: a warning is printed)"""
    fsdp: bool = False
    """shard parameters, gradients and AdamW state over the torchrun ranks with FSDP2 (per decoder layer and the
    root; reference, teacher and reward models too); without it every rank holds the whole model (docs/fsdp.md)"""

    # Sampling
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling: the sampler draws from the top-p set renormalised, and the update scores the same
    distribution (common.rollout.sampler_support), so the importance ratio stays 1 on-policy; 1: the whole vocabulary"""
    max_new_tokens: int = 8
    """completion length cap; completions without eos are 'truncated'"""

    # Optimisation
    total_steps: int = 300
    """training steps, each one rollout batch and its update"""
    learning_rate: float = 5e-5
    """AdamW learning rate (constant after warmup)"""
    warmup_steps: int = 0
    """linear learning-rate warmup over this many optimizer steps (num_iterations x num_minibatches per step)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    skip_zero_advantage_steps: bool = False
    """group trainers: no update (update/skipped 1) in a step whose advantages are all 0 on every rank and no KL term:
    saves its time, but changes the run, as AdamW (veRL, TRL) still moves the weights on the zero gradient (momentum
    of earlier steps, --weight-decay) and counts a warmup step. direct_opd.py never skips (its loss has a KL term)"""
    num_minibatches: int = 1
    """optimizer steps per epoch over each rollout batch"""
    num_iterations: int = 1
    """PPO epochs over each rollout batch (mu in the GRPO paper; with 1 epoch of 1 mini-batch the ratio is exactly 1)"""
    micro_batch_size: int = 32
    """rows per forward/backward; gradients do not depend on it"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in backward instead of keeping them: far less activation memory
    per micro-batch for about one more forward's time (common.models.enable_gradient_checkpointing)"""
    share_prompt: bool = False
    """the update and the no-grad log-prob passes take each group's prompt through the model once and repeat its KV
    cache for the group's rows: the prompt costs 1/G of a forward and backward (on SmolLM2 with 80-token prompts,
    benchmarks/speed/trl_throughput_smollm2.md). Equal to the plain forward to float rounding, not bit for bit, so every
    pass of a step takes the same path: with several mini-batches the update shuffles whole groups
    (common.rollout.minibatch_order). It needs a group's rows in one micro-batch and one mini-batch (--micro-batch-size
    a multiple of --group-size, --num-minibatches a divisor of --num-prompts), else a piece of one row takes the plain
    forward (ratio not 1 at lr 0); with --gradient-checkpointing it could not share (no KV cache). Both are errors"""

    # Filled in at runtime (derived: set --num-prompts, --group-size, --num-minibatches; another value is an error)
    batch_size: int = 0
    """rollouts per step per rank = num_prompts * group_size"""
    minibatch_size: int = 0
    """rollouts per optimizer step = batch_size // num_minibatches"""


@dataclass
class TrainArgs(RunArgs):
    # Model and data
    model_name: str = "testbed-weak"
    """'testbed-weak', 'testbed-strong' (built locally and cached), 'smollm2-135m-instruct' (converted once from an
    installed package, see docs/testbed.md), a Hugging Face id, or a local folder"""
    dataset: str = "testbed"
    """'testbed', 'testbed-nl' (the testbed's problems in words, for chat models), 'rg:<task>[,<task>...]'
    (reasoning-gym's procedural tasks, levels from --levels), a local .jsonl/.json file (every
    10th distinct record is held out for evaluation, the others train; repeated questions are dropped), a folder of <split>.jsonl files, or a Hugging Face
    dataset name"""
    dataset_config: str | None = None
    """Hugging Face dataset config (e.g. 'main' for openai/gsm8k)"""
    train_split: str = "train"
    """split used for training (Hugging Face datasets)"""
    eval_dataset: str = ""
    """dataset for held-out evaluation (default: --dataset, its --eval-split; a local file's every 10th distinct record). A
    different local file is read whole, and so is --dataset's file then"""
    eval_split: str = "test"
    """split used for held-out evaluation"""
    levels: tuple[int, ...] = (3,)
    """difficulty levels to train and evaluate on: testbed and testbed-nl 1 (easiest) .. 5 (hardest); rg: the task's
    curriculum levels, from 0 (common/reasoning_gym.py)"""
    question_field: str | None = None
    """record field holding the question (auto-detected when unset)"""
    answer_field: str | None = None
    """record field holding the final answer (auto-detected when unset)"""
    solution_field: str | None = None
    """record field holding a reference solution (optional)"""
    num_train_problems: int = 0
    """keep only this many training problems (0: all; testbed, testbed-nl and rg: this many per level, 0: 500)"""
    max_prompt_tokens: int = 0
    """truncate prompts to their last N tokens (0: never)"""
    system_prompt: str | None = None
    """the chat template's system turn: None keeps the template's default (SmolLM2's inserts "You are a helpful AI
    assistant named SmolLM..."), "" an empty system turn (no default inserted), other text that system turn"""
    rollout_backend: Literal["hf", "hf_generate", "vllm"] = "hf"
    """generation engine: 'hf' (a KV-cache sampling loop on the training weights, each prompt prefilled once
    per group), 'hf_generate' (plain model.generate) or 'vllm' (a colocated vLLM engine that gets the weights
    in place after every update; needs the vllm extra, see README)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory the colocated vLLM engine may take (GPU only)"""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the vLLM engine's weights: auto = bfloat16 on CUDA (whatever --dtype the trainer's master weights
    have), --dtype on CPU"""
    vllm_max_model_len: int = 0
    """vLLM's context length, prompt + completion (0: --max-prompt-tokens + --max-new-tokens when
    --max-prompt-tokens is set, else 2048 + --max-new-tokens; capped at the model's max_position_embeddings)"""

    # Evaluation
    eval_every: int = 50
    """evaluate every N steps (0: only before and after training)"""
    num_eval_problems: int = 200
    """held-out problems per evaluation (testbed, testbed-nl and rg: per level)"""


EVAL_SET = ("seed", "dataset", "dataset_config", "eval_dataset", "eval_split", "levels", "num_eval_problems")
"""the flags that decide which problems the held-out evaluation asks (--seed: which testbed problems are held out)"""


def cli(Args, argv: list[str] | None = None, holds=None):
    """A trainer's flags from its command line; `holds(args)`: what the run loads, the fields of
    common.memory_plan.Holds, for --plan-memory, which prints the run's memory plan and exits here."""
    args = parse_flags(Args, argv)
    if getattr(args, "plan_memory", False) and holds is not None:
        memory_plan.plan(args, memory_plan.Holds(**holds(args)))
    return args


def parse_flags(Args, argv: list[str] | None = None):
    """A trainer's flags from its command line (tyro). With --resume <run folder>: every flag not given takes the value
    in that run's args.json, so the resumed steps run, and are evaluated, as the first ones were; a given flag that
    changes the evaluation set (EVAL_SET) is a one-line error unless --new-eval-set. main() called from Python takes
    its Args as they are."""
    import dataclasses
    import json

    import tyro

    args = tyro.cli(Args, args=argv)
    path = os.path.join(getattr(args, "resume", ""), "args.json")  # ppo_slm.py has no --resume
    if not getattr(args, "resume", "") or not os.path.isfile(path):  # a folder without args.json: open_checkpoint says what is wrong
        return args
    with open(path) as f:
        saved = json.load(f)
    fields = {f.name: f for f in dataclasses.fields(Args) if f.init}
    base, kept = Args(), {}
    for name, value in saved.items():
        if name in fields and name not in ("resume", "new_eval_set"):
            kept[name] = tuple(value) if isinstance(getattr(base, name), tuple) and isinstance(value, list) else value
    args = tyro.cli(Args, args=argv, default=dataclasses.replace(base, **kept))
    changed = [n for n in EVAL_SET if n in kept and getattr(args, n) != kept[n]]
    if changed and not args.new_eval_set:
        fail(f"--resume {args.resume}: " + ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)!r} (the run had "
             f"{kept[n]!r})" for n in changed) + " would change the held-out evaluation set mid-run; drop the flag, "
             "or add --new-eval-set")
    return args


def check_at_least(args, lo: int, *names: str) -> None:
    """A one-line error for the first of the flags `names` whose value is below `lo`."""
    for name in names:
        if getattr(args, name) < lo:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)} must be at least {lo}")


def fail(message: str):
    """Stop with a message in the user's terms (exit status 1, no traceback)."""
    raise SystemExit(f"error: {message}")


def check_sampling_args(args) -> None:
    """Flags that would fail deep inside torch or after the model loads: a one-line error first. Greedy decoding is
    what the evaluation does; a training sampler needs a temperature above 0 (its log-probs are divided by it).
    A testbed model on other data is a warning (tests do it on purpose): its rewards would be about 0, unexplained."""
    if not args.temperature > 0:
        fail(f"--temperature {args.temperature} must be above 0 (log-probs are computed at the sampling temperature; "
             "greedy answers are what the evaluation reports)")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p {args.top_p} must be in (0, 1] (1 keeps the sampler exactly on-policy)")
    check_at_least(args, 1, "max_new_tokens")
    check_at_least(args, 0, "learning_rate")  # here, before a model loads, not by AdamW after it; 0 is allowed: a
    # frozen run (tests measure the ratio at 1 that way)
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        fail(f"--output-dir {args.output_dir} is a file; run folders are created inside a folder")
    for dataset in (args.dataset, getattr(args, "eval_dataset", "")):  # (ppo_slm and rlpf have no --eval-dataset)
        if is_rg(dataset):  # its tasks and levels, before a model loads
            check_spec(dataset, getattr(args, "levels", ()))
    if args.model_name in ("testbed-weak", "testbed-strong") and args.dataset != "testbed":
        print(f"warning: --model-name {args.model_name} reads only the testbed's own compact problems (--dataset "
              f"testbed), not {args.dataset}; pass --model-name (e.g. smollm2-135m-instruct, a hub id or a folder)")


def check_run_args(args, min_group_size: int = 2, tis: str = "none", eval_samples: int = 0,
                   eval_pass_k: int = 0) -> None:
    """Flags that contradict each other, shared by the group-sampling trainers: a one-line error before any work.
    The flags a trainer declares itself come as arguments (--tis, --eval-samples, --eval-pass-k), where it has them."""
    check_sampling_args(args)
    batch = args.num_prompts * args.group_size
    check_at_least(args, 1, "num_prompts", "group_size", "num_iterations", "num_minibatches", "micro_batch_size")
    check_at_least(args, 0, "total_steps")
    if args.group_size < min_group_size:
        fail(f"--group-size {args.group_size} must be at least {min_group_size} (a group baseline needs two samples)")
    if batch % args.num_minibatches:
        fail(f"--num-minibatches {args.num_minibatches} does not divide the batch of {batch} rollouts "
             "(--num-prompts x --group-size)")
    for name, derived in (("batch_size", batch), ("minibatch_size", batch // args.num_minibatches)):
        if getattr(args, name) not in (0, derived):  # a derived value: honoured or refused, never silently replaced
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is derived, not set: --num-prompts x --group-size"
                 f"{' / --num-minibatches' if name == 'minibatch_size' else ''} = {derived} here; change those")
    if eval_samples > 0 and eval_pass_k > eval_samples:
        fail(f"--eval-pass-k {eval_pass_k} is larger than --eval-samples {eval_samples} "
             "(pass@k is estimated from that many samples per problem)")
    if args.share_prompt and (args.micro_batch_size % args.group_size or args.num_prompts % args.num_minibatches):
        fail("--share-prompt needs each group in one micro-batch and mini-batch: " + (
            f"--micro-batch-size {args.micro_batch_size} is not a multiple of --group-size {args.group_size}"
            if args.micro_batch_size % args.group_size else
            f"--num-minibatches {args.num_minibatches} does not divide --num-prompts {args.num_prompts}"))
    if args.share_prompt and args.gradient_checkpointing:
        fail("--share-prompt cannot share under --gradient-checkpointing: checkpointed layers keep no KV cache, so the "
             "policy's passes would take the plain forward and only the reference's would share; drop one of the two")
    if tis != "none" and args.rollout_backend != "vllm":
        fail(f"--tis {tis} corrects a separate sampler's mismatch; --rollout-backend {args.rollout_backend} "
             "samples from the trainer itself (use --rollout-backend vllm)")
