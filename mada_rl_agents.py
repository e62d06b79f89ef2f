"""What mada_rl.py needs beside its algorithm: its flag checks (critic prompts are never cut, so they must fit); its
agents as LoRA adapters on one frozen base, switched by name; the agents of a finished run folder reused
(--eval-debate: its adapters; --generators-from: its trained generators, checked against this run's flags, and its
Stage-2 draw); the model folder of an embedded name; each rank's share of a list gathered under torchrun; and the
debate's figures (final answers, majority votes, accuracies by acc_G bucket, samples, the console table)."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import torch
import torch.distributed

from common import data, dist, models, verifiers
from common.args import check_at_least, fail


def model_folder(name: str) -> str:
    """A hub id or a local folder as it is; an embedded name (common.models.EMBEDDED_NAMES) its cached folder, built
    once by grounds/, imported only then: a fork without grounds/ runs on hub ids and local folders."""
    if name.lower() not in models.EMBEDDED_NAMES:
        return name
    import grounds

    return grounds.path_of(name)


def check_flags(args) -> tuple[int, int]:
    """mada_rl.py's own flags that cannot work: a one-line error before any work. Returns the number of proposals a
    critic prompt shows and the token budget of each shown response (a critic prompt is never cut, so the two must
    leave room under --max-prompt-tokens; mada_rl.main checks the whole prompt once the tokenizer is loaded)."""
    if args.resume or args.save_every or not args.save_optimizer:
        flag = "resume" if args.resume else "save-every" if args.save_every else "no-save-optimizer"
        fail(f"--{flag}: mada_rl.py writes no checkpoints (its three stages are "
             "short; rerun the script, or --eval-debate RUN_DIR for the debate of a finished run)")
    check_at_least(args, 1, "num_generators", "debate_rounds")
    if args.num_critics < 1 and args.debate_rounds > 1:
        fail(f"--num-critics {args.num_critics}: rounds 2..{args.debate_rounds} of the debate need critics")
    check_at_least(args, 0, "generator_steps", "critic_steps", "proposal_tokens")
    shown = max(args.num_generators, args.num_critics if args.debate_rounds > 2 else 0)  # proposals in a critic prompt
    budget = min(args.proposal_tokens or args.max_new_tokens, args.max_new_tokens)  # tokens of one shown response
    if args.critic_sees == "responses" and args.max_prompt_tokens and shown * budget >= args.max_prompt_tokens:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: a critic prompt shows {shown} responses of up to {budget} "
             f"tokens each (--proposal-tokens {args.proposal_tokens}, --max-new-tokens {args.max_new_tokens}) beside "
             "its question, and is never cut: raise --max-prompt-tokens, lower --proposal-tokens, or pass "
             "--critic-sees answers")
    if args.generators_from and args.eval_debate:
        fail("--generators-from trains critics on a run's generators, --eval-debate only evaluates a run: pass one")
    return shown, budget


def check_critic_room(tokenizer, frames: list[str], shown: int, budget: int, args) -> None:
    """Before any training: the longest critic prompt with its proposals left empty (`frames`: its question and
    template) plus `shown` responses of `budget` tokens each must fit --max-prompt-tokens (critic prompts are never
    cut)."""
    frame = max(map(len, data.encode_prompts(tokenizer, frames)), default=0)
    if frames and frame + shown * budget > args.max_prompt_tokens:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: a critic prompt holds its question and template (up "
             f"to {frame} tokens) and {shown} responses of up to {budget} tokens each (--proposal-tokens "
             f"{args.proposal_tokens}, --max-new-tokens {args.max_new_tokens}), and is never cut: raise "
             "--max-prompt-tokens, lower --proposal-tokens, or pass --critic-sees answers")


def adapter_params(model, name: str) -> dict:
    """The LoRA tensors of adapter `name` (peft names them `...lora_A.<name>.weight`)."""
    return {n: p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n}


def use_adapter(model, name: str) -> None:
    """Make adapter `name` the active one (generation and forward use it) and its tensors the only trainable ones;
    the other adapters' gradients are dropped (left in place, data parallel would keep all-reducing them)."""
    model.set_adapter(name)
    mine = set(adapter_params(model, name))
    for n, p in model.named_parameters():
        p.requires_grad_(n in mine)
        if n not in mine:
            p.grad = None


def load_adapters(base, adapter_dir: str, names: list[str]):
    """`base` with the LoRA adapters saved in adapter_dir/<name> (peft's layout for several adapters), by name."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, os.path.join(adapter_dir, names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(os.path.join(adapter_dir, name), adapter_name=name)
    return model


SAME_STAGE_1 = ("model_name", "dataset", "dataset_config", "train_split", "levels", "num_train_problems", "seed",
                "num_generators", "num_critics", "generator_steps", "lora_r", "lora_alpha", "lora_target_modules")
"""what --generators-from requires of its run: the data split (critics must not train on the generators' problems),
the shape of the adapters and the step counter"""


def stage_1_weights(run_dir: str, args) -> list[dict]:
    """The generators' adapter weights of a finished run (--generators-from), checked against this run's arguments."""
    from safetensors.torch import load_file

    generators = [f"gen{n}" for n in range(args.num_generators)]  # mada_rl.agent_names
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            saved = json.load(f)
        weights = [load_file(os.path.join(run_dir, "adapters", g, "adapter_model.safetensors")) for g in generators]
    except (OSError, ValueError) as e:
        fail(f"--generators-from {run_dir}: not a finished mada_rl.py run folder with adapters/gen* "
             f"({type(e).__name__})")
    now = json.loads(json.dumps({k: getattr(args, k) for k in SAME_STAGE_1}))
    differ = [k for k in SAME_STAGE_1 if saved.get(k) != now[k]]
    if differ:
        fail(f"--generators-from {run_dir}: its " + ", ".join(f"--{k.replace('_', '-')} {saved.get(k)}"
                                                              for k in differ) + " differ from this run's")
    return weights


def saved_stage_2(run_dir: str, splits: dict) -> dict:
    """The Stage-2 draw of a finished run (--generators-from), {critic: its rows in split order}, from its stage2.jsonl
    (mada_rl.proposal_rows' fields): an ablation's critics read the very proposals that run's critics read, whatever
    the sampler would draw on another machine or thread count. `splits`: {critic: this run's problems for it}."""
    rows = {name: [] for name in splits}
    try:
        with open(os.path.join(run_dir, "stage2.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                rows[r["critic"]].append({k: r[k] for k in ("question", "answer", "responses", "correct")})
    except (OSError, ValueError, KeyError) as e:
        fail(f"--generators-from {run_dir}: no Stage-2 draw to read in its stage2.jsonl ({type(e).__name__}; a run "
             "made before the file kept the generators' responses): run its Stage 1 again")
    for name, problems in splits.items():
        if [r["question"] for r in rows[name]] != [p.question for p in problems]:
            fail(f"--generators-from {run_dir}: its stage2.jsonl holds other problems for {name} than this run's split")
    return rows


def copy_generators(model, weights: list[dict], generators: list[str]) -> None:
    """Stage 1 of another run: its generators' weights (`stage_1_weights`) into this run's fresh adapters."""
    from peft import set_peft_model_state_dict

    for g, sd in zip(generators, weights):
        if set_peft_model_state_dict(model, sd, adapter_name=g).unexpected_keys:
            fail(f"--generators-from: adapters/{g} does not fit this model's adapters")


def load_run_agents(run_dir: str, args, device: str):
    """The base model of a finished run (args.json's --model-name, set in `args`) with its saved adapters."""
    adir = os.path.join(run_dir, "adapters")
    if not os.path.isdir(adir):
        fail(f"--eval-debate {run_dir}: no adapters/ folder (not a finished mada_rl.py run folder)")
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            args.model_name = json.load(f)["model_name"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        fail(f"--eval-debate {run_dir}: cannot read args.json ({type(e).__name__})")
    names = sorted(d for d in os.listdir(adir) if os.path.isfile(os.path.join(adir, d, "adapter_config.json")))
    generators = sorted((n for n in names if n.startswith("gen")), key=lambda s: int(s[3:]))
    critics = sorted((n for n in names if n.startswith("critic")), key=lambda s: int(s[6:]))
    if not generators or (args.debate_rounds > 1 and not critics):
        fail(f"--eval-debate {run_dir}: adapters/ holds {names or 'nothing'}; need gen* and critic* adapters")
    model = load_adapters(models.load_model(model_folder(args.model_name), args.dtype, device), adir,
                          generators + critics)
    return model, generators, critics


def gather_shares(share: list) -> list:
    """Every rank passes its share items[rank::world] of one list and gets the whole list back, in its original order
    (all_gather_object: the items are pickled). The share itself on one process.

    >>> gather_shares(["a", "b"])
    ['a', 'b']
    """
    world = dist.rank_world()[1]
    if world == 1:
        return share
    shares = [None] * world
    torch.distributed.all_gather_object(shares, share)
    out = [None] * sum(len(s) for s in shares)
    for r, s in enumerate(shares):
        out[r::world] = s
    return out


def print_table(rows: dict) -> None:
    keys = ("single_accuracy", "majority_accuracy", "debate_accuracy", "debate_majority_accuracy",
            "improvement_rate", "break_rate")
    print(f"{'held-out (greedy)':<28}" + "".join(f"{k:>14}" for k in rows))
    for k in keys:
        print(f"{k:<28}" + "".join(f"{r[f'mada/eval/{k}']:>14.3f}" for r in rows.values()))


# The debate's figures
def final_answer(completion: str, problem) -> str:
    """The final answer of a reply (what the votes count): the testbed's whole one-line reply, the extracted final
    answer else."""
    if problem.task == "testbed":
        return " ".join(completion.split())[:16]
    return verifiers.extract_answer(completion, problem.task) or "(no final answer)"


def encode_critic_prompts(tokenizer, texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of critic prompts, whole: cut from the left, one would lose its question (or, on the testbed, its
    first proposal), so one longer than --max-prompt-tokens on any rank is a one-line error on every rank."""
    ids = data.encode_prompts(tokenizer, texts)
    rank, world = dist.rank_world()
    longest_R = torch.zeros(world).index_fill_(0, torch.tensor([rank]), float(max(map(len, ids), default=0)))
    longest = int(dist.all_reduce_sum(longest_R).max().item())
    if max_prompt_tokens and longest > max_prompt_tokens:
        fail(f"--max-prompt-tokens {max_prompt_tokens}: a critic prompt (question, template and proposals) has "
             f"{longest} tokens and is never cut; raise --max-prompt-tokens or lower --proposal-tokens")
    return ids


def majority(answers: list[str], problem) -> str:
    """The most common answer (ties: the one given first)."""
    keys = [final_answer(a, problem) for a in answers]
    best = Counter(keys).most_common(1)[0][1]
    return next(a for a, k in zip(answers, keys) if keys.count(k) == best)


def debate_samples(answers: list[list[list[str]]], cut: list[list[list[bool]]], problems: list,
                   k: int) -> list[dict]:
    """The debate of the first k problems as text for samples.jsonl: the generators' answers, the proposals the first
    critic saw in the last round, its final answer, whether it was cut and whether it is right (with one round: the
    first generator's)."""
    final, final_cut = answers[-1][0][:k], cut[-1][0][:k]
    correct = verifiers.score(final, problems[:k], final_cut)
    return [{"question": p.question, "prompt_tail": p.question[-1000:], "completion": final[i],
             "truncated": final_cut[i], "gold": p.answer, "level": p.level, "correct": correct[i],
             "generator_answers": [final_answer(a[i], p) for a in answers[0]],
             "proposals": [final_answer(a[i], p) for a in answers[-2]] if len(answers) > 1 else None}
            for i, p in enumerate(problems[:k])]


def debate_metrics(answers: list[list[list[str]]], problems: list, num_generators: int,
                   cut: list[list[list[bool]]] | None = None) -> dict:
    """Held-out accuracy of a single generator, the generators' majority vote and the debate, by acc_G bucket. An
    answer cut at max_new_tokens (`cut`, as `debate` returns it) scores 0; the votes count its text as it is.

    acc_G (round 1) buckets are named acc_g_{k}of{N}: k of the N generators right.
    improvement rate: among problems whose generator majority is wrong, the fraction of final critic answers
    that are right; break rate: among problems whose majority is right, the fraction of final answers wrong.
    """
    cut = cut or [[[False] * len(problems) for _ in rnd] for rnd in answers]
    gen_correct_NP = np.array([verifiers.score(a, problems, c) for a, c in zip(answers[0], cut[0])])
    final_correct_MP = np.array([verifiers.score(a, problems, c) for a, c in zip(answers[-1], cut[-1])])
    maj_gen_P = np.array(verifiers.score([majority([a[i] for a in answers[0]], p) for i, p in enumerate(problems)],
                                         problems))
    maj_final_P = np.array(verifiers.score([majority([a[i] for a in answers[-1]], p) for i, p in enumerate(problems)],
                                           problems))
    debate_P = final_correct_MP.mean(0)
    out = {
        "mada/eval/single_accuracy": float(gen_correct_NP.mean()),
        "mada/eval/majority_accuracy": float(maj_gen_P.mean()),
        "mada/eval/debate_accuracy": float(debate_P.mean()),
        "mada/eval/debate_majority_accuracy": float(maj_final_P.mean()),
        "mada/eval/improvement_rate": float(debate_P[maj_gen_P == 0].mean()) if (maj_gen_P == 0).any() else 0.0,
        "mada/eval/break_rate": float(1 - debate_P[maj_gen_P == 1].mean()) if (maj_gen_P == 1).any() else 0.0,
    }
    out.update({f"mada/eval/single_accuracy/gen{n}": float(gen_correct_NP[n].mean()) for n in range(num_generators)})
    k_P = gen_correct_NP.sum(0).round().astype(int)
    for k in range(num_generators + 1):
        sel = k_P == k
        out[f"mada/eval/frac/acc_g_{k}of{num_generators}"] = float(sel.mean())
        if sel.any():
            out[f"mada/eval/debate_accuracy/acc_g_{k}of{num_generators}"] = float(debate_P[sel].mean())
    out["eval/greedy_accuracy"] = out["mada/eval/debate_accuracy"]  # the curve plot's key
    out["mada/eval/problems"] = len(problems)
    return out
