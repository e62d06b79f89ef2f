"""Preference pairs and the two supervised stages that come before RLHF's PPO (ppo_slm.py): a LoRA adapter
fine-tuned on the chosen completions (SFT), and a Bradley-Terry reward model on the SFT backbone; how a reward model
is loaded and scores a batch (ppo_slm.py's PPO scores its rollouts with it).

    SFT:  minimise -log pi(y_w | x) over the completion tokens, LoRA with alpha = 2r
    RM:   minimise -log sigmoid(r(x, y_w) - r(x, y_l)), LoRA with alpha = 2r and a fully trained score head

Pairs come from the testbed (chosen: the answer; rejected: a corrupted one), from testbed-nl (chosen: the worked
solution; rejected: the same with one arithmetic slip carried forward to a wrong final answer) or from a text dataset
(chosen: a record's next words; rejected: them shuffled, truncated or taken from another record, as in arXiv
2607.25091).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from common.args import fail
from common.data import load_problems, read_json_records, render_prompt
from common.logger import bars_off
from common.models import add_lora, disable_dropout, load_model, mask_padded_head
from common.rollout import left_pad, position_ids
from common.testbed import render_testbed_prompt


@dataclass
class Pair:
    prompt: str
    chosen: str
    rejected: str
    problem: object = None  # the testbed Problem (verifiable), None for text
    kind: str = ""  # testbed-nl: where `rejected`'s slip is, an earlier 'step' or the last ('answer')


def corrupt_answer(answer: str, rng: random.Random) -> str:
    """A wrong or malformed answer: '15' -> '14' (near miss), '22' (far off), '151', '1' or '15+4'."""
    u = rng.random()
    if u < 0.4:
        return str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
    if u < 0.7:
        return str(max(0, int(answer) + rng.choice([-1, 1]) * rng.randint(4, 10)))
    if u < 0.8:
        return answer + str(rng.randint(0, 9))
    if u < 0.9:
        return answer[:-1] or str(rng.randint(0, 9))
    return f"{answer}+{rng.randint(1, 9)}"


def near_miss(n: int, rng: random.Random) -> int:
    """A plausible wrong number: off by 1 to 3, never negative."""
    return rng.choice([m for m in (n - 3, n - 2, n - 1, n + 1, n + 2, n + 3) if m >= 0])


def wrong_solution(solution: str, answer: str, rng: random.Random) -> tuple[str, str]:
    """A testbed-nl worked solution made wrong by one arithmetic slip, carried forward, and where the slip is: 'step'
    (an intermediate result 1 to 3 too high, where there are several steps) or 'answer' (the last step's result off
    by 1 to 3). Every later step computes right from the wrong figure, so the final answer is wrong either way and no
    string cue (a result that the next step does not use) tells the rejected solution apart: only its arithmetic.

    >>> wrong_solution("First 2 + 3 = 5. Then 5 + 4 = 9. The answer is 9.", "9", random.Random(0))
    ('First 2 + 3 = 5. Then 5 + 4 = 10. The answer is 10.', 'answer')
    >>> wrong_solution("First 2 + 3 = 5. Then 5 + 4 = 9. The answer is 9.", "9", random.Random(1))
    ('First 2 + 3 = 7. Then 7 + 4 = 11. The answer is 11.', 'step')
    """
    steps = list(re.finditer(r"(\d+) ([+-]) (\d+) = (\d+)", solution))
    slip = rng.randrange(len(steps) - 1) if len(steps) > 1 and rng.random() < 0.5 else len(steps) - 1
    carried, out, end = {}, [], 0  # carried: a true result -> the wrong one, used once by a later step
    for i, m in enumerate(steps[slip:], start=slip):
        a, b = carried.pop(int(m[1]), int(m[1])), carried.pop(int(m[3]), int(m[3]))
        result = a + b if m[2] == "+" else a - b
        if i == slip:  # an earlier step's slip is upward: the running total it feeds never falls below 0
            result = near_miss(result, rng) if i == len(steps) - 1 else result + rng.randint(1, 3)
        if result != int(m[4]):
            carried[int(m[4])] = result
        out += [solution[end : m.start()], f"{a} {m[2]} {b} = {result}"]
        end = m.end()
    text = re.sub(rf"The answer is {answer}\b", f"The answer is {result}", "".join(out) + solution[end:])
    return text, "step" if slip < len(steps) - 1 else "answer"


def read_texts(dataset: str, split: str, field: str, n: int = 0) -> list[str]:
    """Plain texts (ppo_slm.py's text datasets): the lines of a local .txt file, the `field` of each record of a
    local .jsonl/.json file (every 10th line or record is the held-out split, the others 'train'), or the `field`
    of a Hugging Face dataset's 'train' or 'validation' split. `n` > 0 keeps the first n."""
    if os.path.exists(dataset):
        if dataset.endswith((".jsonl", ".json")):
            rows, where = read_json_records(dataset)
            for row, at in zip(rows, where):
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    found = f"an object with fields {sorted(row)}" if isinstance(row, dict) else "a list or value"
                    fail(f"{at}: expected an object with a string field {field!r} (--text-field); got {found}")
            texts = [row[field] for row in rows]
        else:
            try:
                with open(dataset, encoding="utf-8") as f:
                    texts = [ln.strip() for ln in f if ln.strip()]
            except (UnicodeDecodeError, IsADirectoryError) as e:
                fail(f"{dataset}: cannot read it as UTF-8 text lines ({type(e).__name__})")
        texts = [t for i, t in enumerate(texts) if (i % 10 == 0) == (split != "train")]
    else:
        import datasets
        try:
            ds = datasets.load_dataset(dataset, split="train" if split == "train" else "validation")
        except Exception as e:  # noqa: BLE001 - hub, disk and format errors all mean "cannot load"
            fail(f"could not load dataset {dataset!r} (not a local file, and loading it by name failed: "
                 f"{type(e).__name__})")
        if field not in ds.column_names:
            fail(f"dataset {dataset!r} has no field {field!r} (--text-field); fields are {ds.column_names}")
        texts = ds[:n][field] if n else ds[field]
    return texts[:n] if n else texts


def build_pairs(args, split: str, n: int, seed: int, tokenizer=None) -> list[Pair]:
    """Prompts with a chosen (correct / real) and a rejected (corrupted) completion, from --dataset: 'testbed' or
    'testbed-nl' (its --levels; testbed-nl's prompt in the tokenizer's chat template, as grpo.py renders it) or text
    (--text-field, cut into --prompt-words and --continuation-words)."""
    rng = random.Random(f"{seed}-{split}")
    if args.dataset == "testbed":
        problems = load_problems("testbed", split, args.levels, n, seed)
        return [Pair(render_testbed_prompt(p.question), p.answer, corrupt_answer(p.answer, rng), p) for p in problems]
    if args.dataset == "testbed-nl":
        problems = load_problems("testbed-nl", split, args.levels, n, seed)
        pairs = []
        for p in problems:
            rejected, kind = wrong_solution(p.solution, p.answer, rng)
            pairs.append(Pair(render_prompt(p, tokenizer), p.solution, rejected, p, kind))
        return pairs
    need = args.prompt_words + args.continuation_words
    cuts = [t.split() for t in read_texts(args.dataset, split, args.text_field, n) if len(t.split()) >= need]
    if len(cuts) < 2:
        fail(f"{args.dataset!r} ({split}) has fewer than 2 texts with {need} words; lower --prompt-words / "
             "--continuation-words")
    out = []
    for i, w in enumerate(cuts):
        prompt, cont = " ".join(w[: args.prompt_words]), w[args.prompt_words: need]
        u, other = rng.random(), cuts[(i + 1 + rng.randrange(len(cuts) - 1)) % len(cuts)]
        bad = (rng.sample(cont, len(cont)) if u < 1 / 3 else cont[: len(cont) // 4] if u < 2 / 3
               else other[args.prompt_words: need])  # shuffled / truncated / mismatched, as in the paper
        out.append(Pair(prompt, " " + " ".join(cont), " " + " ".join(bad)))
    return out


# The reward model: loading, scoring, and the rows it scores
def load_score_model(path: str, dtype: str = "float32"):
    """A sequence-classification model with one score head (a reward or value model) from a causal LM's folder,
    with dropout off: its Bradley-Terry loss and PPO's rewards would otherwise be noisy in train mode."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        disable_dropout(config)
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"error: could not load a score model from {path!r}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    disable_dropout(model.config, model)
    return model


def encode_pairs(tokenizer, prompts: list[str], completions: list[str]):
    """Left-padded rows [prompt | completion eos] of texts: ids, attention mask and completion mask (eos included).

    >>> from grounds.testbed_models import build_tokenizer
    >>> ids_BT, attn_BT, comp_BT = encode_pairs(build_tokenizer(), ["ab", "a"], ["c", "cd"])
    >>> attn_BT.tolist(), comp_BT.tolist()
    ([[1, 1, 1, 1], [1, 1, 1, 1]], [[0, 0, 1, 1], [0, 1, 1, 1]])
    """
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    ids_BT, attn_BT = left_pad([p + c + [tokenizer.eos_token_id] for p, c in zip(p_ids, c_ids)],
                               tokenizer.pad_token_id)
    comp_BT = torch.zeros_like(attn_BT)
    for i, c in enumerate(c_ids):
        comp_BT[i, ids_BT.shape[1] - len(c) - 1:] = 1
    return ids_BT, attn_BT, comp_BT


@torch.no_grad()
def sequence_scores(model, input_ids_BT, attention_mask_BT, pad_id: int, chunk: int = 64) -> torch.Tensor:
    """The scalar of a sequence-classification model (a reward model) for each row, read at its last real token;
    rows are re-packed to left padding and scored `chunk` at a time."""
    device = next(model.parameters()).device
    ids_BT, attn_BT = left_pad([row[m.bool()].tolist() for row, m in zip(input_ids_BT, attention_mask_BT)], pad_id)
    out = [model(input_ids=ids_BT[s:s + chunk].to(device), attention_mask=attn_BT[s:s + chunk].to(device),
                 position_ids=position_ids(attn_BT[s:s + chunk]).to(device)).logits[:, 0].float().cpu()
           for s in range(0, len(ids_BT), chunk)]
    return torch.cat(out)


STATE_EVERY = 25
"""the SFT and RM stages save their training state every this many steps (see fit_lora)"""


def stage_fingerprint(args, stage: str) -> dict:
    """What a stage's saved state must match to be continued: the stage and the run's arguments, as args.json holds
    them (the same command, so the same pairs, backbone and settings)."""
    return {"stage": stage, "args": json.loads(json.dumps(dataclasses.asdict(args)))}


def read_stage_state(path: str, fingerprint: dict) -> dict | None:
    """The state fit_lora saved at `path`, if there is one with this fingerprint; else None (said when one is
    there but belongs to another run or cannot be read)."""
    if not path or not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated file cannot come from fit_lora's atomic save, but a copied folder may hold one
        print(f"{path}: unreadable ({type(e).__name__}); the stage starts afresh")
        return None
    if state.get("fingerprint") != fingerprint:
        print(f"{path}: the saved state of another run's {state.get('fingerprint', {}).get('stage', 'stage')}; "
              "the stage starts afresh")
        return None
    return state


def state_file(out_dir: str) -> str:
    """Where the stage writing `out_dir` keeps its training state while it runs."""
    return out_dir.rstrip("/") + ".state.pt"


def fit_lora(model, pairs: list[Pair], loss_fn, steps: int, batch_size: int, lr: float, seed: int, desc: str,
             state_path: str = "", fingerprint: dict | None = None) -> list[float]:
    """AdamW on the trainable (LoRA, score head) parameters: `steps` batches drawn from `pairs`. With `state_path`,
    the trainable tensors, AdamW's state and the batch sampler's are saved there (atomically) every STATE_EVERY steps,
    and a state with the same `fingerprint` is read back first: an interrupted stage continues from its last save with
    the batches and updates of a run that never stopped. mark_done removes the file once the stage's output is saved.
    Returns the loss curve: the mean training loss of each STATE_EVERY-step window (the saved windows included)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=lr)
    rng, start, window = random.Random(seed), 0, []
    saved = read_stage_state(state_path, fingerprint)
    curve = list(saved.get("curve", [])) if saved is not None else []
    if saved is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(saved["params"][n])
        opt.load_state_dict(saved["optimizer"])
        rng.setstate(saved["sampler"])
        torch.set_rng_state(saved["torch_rng"])
        start = saved["step"]
        print(f"{desc}: continuing from step {start} of {steps}, saved in {state_path}")
    for step in tqdm(range(start, steps), desc=desc, leave=False, disable=bars_off(), initial=start, total=steps):
        loss = loss_fn(rng.sample(pairs, min(batch_size, len(pairs))))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        if (step + 1) % STATE_EVERY and step + 1 < steps:
            continue
        curve.append(sum(window) / len(window))
        window = []
        if state_path and step + 1 < steps:
            state = {"fingerprint": fingerprint, "step": step + 1, "optimizer": opt.state_dict(),
                     "params": {n: p.detach().cpu() for n, p in trainable.items()},
                     "sampler": rng.getstate(), "torch_rng": torch.get_rng_state(), "curve": curve}
            torch.save(state, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
    if curve:
        print(f"{desc}: training loss {curve[0]:.4f} -> {curve[-1]:.4f} (means of the first and last "
              f"{STATE_EVERY}-step windows; the curve: loss_curve.json)")
    return curve


def stage_done(out_dir: str, fingerprint: dict) -> bool:
    """Whether `out_dir` holds this stage's output, finished by an earlier run of the same command (its stage.json,
    written last, holds the fingerprint): a rerun after an interruption in a later stage skips it."""
    try:
        with open(os.path.join(out_dir, "stage.json")) as f:
            done = json.load(f) == fingerprint
    except (OSError, ValueError):
        return False
    if done:
        print(f"{fingerprint['stage']}: finished by an earlier run of this command, read from {out_dir}")
    return done


def mark_done(out_dir: str, fingerprint: dict, curve: list[float]) -> None:
    """After the stage's output is saved: its loss curve (loss_curve.json), stage.json, and its training state (no
    longer needed) removed."""
    with open(os.path.join(out_dir, "loss_curve.json"), "w") as f:
        json.dump({"window_steps": STATE_EVERY, "mean_loss": curve}, f)
    with open(os.path.join(out_dir, "stage.json"), "w") as f:
        json.dump(fingerprint, f)
    if os.path.exists(state_file(out_dir)):
        os.remove(state_file(out_dir))


def train_sft(args, base: str, tokenizer, pairs: list[Pair], out_dir: str, device: str) -> None:
    """Stage 1: LoRA (alpha = 2r) on the chosen completions, next-token loss on the completion tokens."""
    fingerprint = stage_fingerprint(args, "sft")
    if stage_done(out_dir, fingerprint):
        return
    backbone = load_model(base, "float32", device)
    mask_padded_head(backbone, len(tokenizer))  # the loss normalises over the tokenizer's rows only
    model = add_lora(backbone, ["default"], args.sft_lora_r, 2 * args.sft_lora_r, args.lora_target_modules)

    def loss_fn(batch):
        ids_BT, attn_BT, comp_BT = encode_pairs(tokenizer, [e.prompt for e in batch], [e.chosen for e in batch])
        return model(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device),
                     position_ids=position_ids(attn_BT).to(device),
                     labels=ids_BT.masked_fill(comp_BT == 0, -100).to(device)).loss

    curve = fit_lora(model, pairs, loss_fn, args.sft_steps, args.sft_batch_size, args.sft_lr, args.seed, "sft",
                     state_file(out_dir), fingerprint)
    model.save_pretrained(out_dir)
    mark_done(out_dir, fingerprint, curve)


def train_reward_model(args, sft_dir: str, tokenizer, pairs: list[Pair], out_dir: str, device: str) -> None:
    """Stage 2: the SFT backbone (adapter merged) with a scalar head, Bradley-Terry loss; saved merged."""
    from transformers.utils import logging as hf_logging

    fingerprint = stage_fingerprint(args, "reward model")
    if stage_done(out_dir, fingerprint):
        return

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would list score.weight as MISSING (expected: said below)
    try:
        rm = load_score_model(sft_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
    print("reward model: the SFT model with a new score head (score.weight, initialised at random), trained below")
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm = add_lora(rm, ["default"], args.rm_lora_r, 2 * args.rm_lora_r, args.lora_target_modules,
                  task_type="SEQ_CLS").to(device)

    def loss_fn(batch):
        ids_BT, attn_BT, _ = encode_pairs(tokenizer, [e.prompt for e in batch] * 2,
                                          [e.chosen for e in batch] + [e.rejected for e in batch])
        r_2B = rm(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device),
                  position_ids=position_ids(attn_BT).to(device)).logits[:, 0]
        return -torch.nn.functional.logsigmoid(r_2B[: len(batch)] - r_2B[len(batch):]).mean()

    curve = fit_lora(rm, pairs, loss_fn, args.rm_steps, args.rm_batch_size, args.rm_lr, args.seed + 1, "reward model",
                     state_file(out_dir), fingerprint)
    rm.merge_and_unload().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    mark_done(out_dir, fingerprint, curve)


def pair_accuracy(rm, tokenizer, pairs: list[Pair], name: str = "rm/pair_accuracy") -> dict:
    """{name: fraction of `pairs` where the RM scores the chosen completion above the rejected one} and, where the
    pairs have kinds (testbed-nl), name/<kind> for each kind's pairs; every pair is scored once."""
    ids_BT, attn_BT, _ = encode_pairs(tokenizer, [e.prompt for e in pairs] * 2,
                                      [e.chosen for e in pairs] + [e.rejected for e in pairs])
    r_2B = sequence_scores(rm, ids_BT, attn_BT, tokenizer.pad_token_id)
    right_B = (r_2B[: len(pairs)] > r_2B[len(pairs):]).float()
    out = {name: right_B.mean().item()}
    for kind in sorted({e.kind for e in pairs} - {""}):
        out[f"{name}/{kind}"] = right_B[[e.kind == kind for e in pairs]].mean().item()
    return out


def supervised_stages(args, base: str, tokenizer, pairs: list[Pair], run_dir: str, rank: int, device: str):
    """Stages 1 and 2 on rank 0 (the other ranks wait): the SFT adapter (unless --sft-adapter), the SFT model with it
    merged into the base, saved, and the reward model on that (unless --reward-model). Returns their three paths."""
    from peft import PeftModel

    sft_adapter = args.sft_adapter or os.path.join(run_dir, "sft_adapter")
    rm_dir = args.reward_model or os.path.join(run_dir, "reward_model")
    sft_dir = os.path.join(run_dir, "sft_merged")
    if rank == 0:
        if not args.sft_adapter:
            train_sft(args, base, tokenizer, pairs, sft_adapter, device)
        PeftModel.from_pretrained(load_model(base), sft_adapter).merge_and_unload().save_pretrained(sft_dir)
        tokenizer.save_pretrained(sft_dir)
        if not args.reward_model:
            train_reward_model(args, sft_dir, tokenizer, pairs, rm_dir, device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return sft_adapter, sft_dir, rm_dir
