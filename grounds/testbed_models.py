"""The testbed models: tiny Qwen2-architecture transformers with a byte-level tokenizer (256 byte symbols plus three
specials), built with `transformers` and `tokenizers` only, then warm-started by supervised training on the answers
of the testbed task (common/testbed.py), stopped on a measured level-3 accuracy (`warm_start`): testbed-weak
(4 layers) at about 0.5, so RL has headroom; testbed-strong (8 layers) at 0.80, a student stronger than testbed-weak
after RL. Also direct_opd.py's default teacher pair (testbed-weak before and after rejection-sampling fine-tuning).
Cached by grounds/cache.py, keyed by a hash of the recipe, rebuilt when missing or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

from common.logger import bars_off
from common.rollout import HFEngine, completion_logprobs
from common.problem import Problem
from common.testbed import BOS_CHAT, EOS, PAD, is_calibration, make_suite, render_testbed_prompt
from grounds.cache import build_once, cache_root

TESTBED_MODELS = ("testbed-weak", "testbed-strong")
CODE_MODEL = "testbed-code"
"""rlpf.py's code policy: the testbed models' tokenizer and shape, warm-started on programs (grounds/code_model.py)"""

# ----------------------------------------------------------------------------------------

RECIPES = {
    "testbed-weak": dict(hidden=128, layers=4, heads=4, intermediate=512, sft_steps=450, lr=3e-3, batch=32,
                         target=0.45, check_every=10, max_steps=3000),
    "testbed-strong": dict(hidden=128, layers=8, heads=4, intermediate=512, sft_steps=900, lr=3e-3, batch=32,
                           target=0.80, check_every=10, max_steps=3000, guided=0.0),
}
CALIB_LEVEL, CALIB_PROBLEMS = 3, 200
"""The stopping rule: level-3 greedy accuracy on 200 calibration problems must reach the recipe's target.
testbed-weak stops on the rising part of its curve (about 0.5: headroom for RL); testbed-strong trains twice as
long and stops at 0.80, above testbed-weak after RL (the Direct-OPD setting: a student stronger than its teacher)."""
SFT_LEVEL_WEIGHTS = {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.1, 5: 0.0}
"""Supervised mix: long chains are rare or absent, so the hard levels need RL (or guidance)."""
SFT_GUIDED_FRACTION = 0.25
"""Fraction of supervised examples whose prompt carries hints or a solution prefix (a recipe's `guided` overrides
it: testbed-strong, a plain-prompt student, trains on plain prompts only)."""
RECIPE_VERSION = 3
TYPICAL = {"testbed-weak": dict(steps=470, minutes=3), "testbed-strong": dict(steps=910, minutes=6)}
"""Where a warm start usually stops and how long a build takes (outside the recipe hash: what was measured, not what
is built): the cached builds of 2026-12-02 on 2 busy cores, testbed-weak 470 steps in 3.3 minutes, testbed-strong 910
in 6.0 (an earlier build of testbed-weak: 460 steps in 123 s on one thread, docs/testbed.md)."""


def recipe_hash(name: str) -> str:
    blob = json.dumps(
        dict(v=RECIPE_VERSION, recipe=RECIPES[name], mix=SFT_LEVEL_WEIGHTS, guided=SFT_GUIDED_FRACTION,
             calib=[CALIB_LEVEL, CALIB_PROBLEMS]),
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_dir(name: str, seed: int = 0) -> str:
    return os.path.join(cache_root(), f"{name}-{recipe_hash(name)}" + (f"-seed{seed}" if seed else ""))


def build_tokenizer():
    """Byte-level tokenizer: 256 byte symbols, no merges, pad/chat-start/eos specials.

    The pipeline is exactly the one transformers 5 rebuilds for a `qwen2` folder, so
    ids are identical after `AutoTokenizer.from_pretrained`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # transformers' model classes load slowly:
    from transformers import PreTrainedTokenizerFast  # imported where a build needs them, not with every trainer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS_CHAT, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")


def build_model(name: str, tokenizer, seed: int = 0):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    r = RECIPES[name]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=r["hidden"],
        num_hidden_layers=r["layers"],
        num_attention_heads=r["heads"],
        num_key_value_heads=r["heads"],
        intermediate_size=r["intermediate"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    )
    return model


def sft_example(rng: random.Random, problems: list[Problem], weights: list[float],
                guided: float = SFT_GUIDED_FRACTION) -> tuple[str, str]:
    """One supervised (prompt, completion) pair; a `guided` fraction carry hints or a solution prefix."""
    p = rng.choices(problems, weights=weights)[0]
    u = rng.random()
    if u < guided / 2:
        prompt = render_testbed_prompt(p.question, hints=[h for h, ok in zip(p.hints, p.hint_helpful) if ok])
    elif u < guided:
        words = p.solution.split(" ")
        prompt = render_testbed_prompt(p.question, solution_prefix=" ".join(words[: rng.randint(1, len(words))]))
    else:
        prompt = render_testbed_prompt(p.question)
    return prompt, p.answer


def supervised_step(model, tokenizer, prompts: list[str], completions: list[str], opt, sched) -> torch.Tensor:
    """One supervised step of a warm start (the testbed models' and grounds/code_model.py's): rows [prompt | completion
    eos], right-padded (positions start at 0), the loss on the completion and its eos only, gradients clipped to norm
    1, then the optimizer and schedule step. Returns the loss."""
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    comp_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    seqs = [a + b + [tokenizer.eos_token_id] for a, b in zip(prompt_ids, comp_ids)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, a) in enumerate(zip(seqs, prompt_ids)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, len(a) : len(s)] = torch.tensor(s[len(a) :])
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def greedy_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int = 4) -> float:
    """Fraction of problems whose greedy completion of the plain prompt is exactly the answer."""
    ids = tokenizer([render_testbed_prompt(p.question) for p in problems], add_special_tokens=False)["input_ids"]
    out = HFEngine(model, tokenizer).generate(ids, n=1, max_new_tokens=max_new_tokens, greedy=True)
    return sum(t.strip() == p.answer for t, p in zip(out.texts, problems)) / len(problems)


def next_check(name: str, step: int) -> int:
    """The step of the first calibration check after `step` (the end of the fixed schedule, then every `check_every`
    steps): where the warm start's progress bar ends until that check is passed.

    >>> next_check("testbed-weak", 0), next_check("testbed-weak", 450), next_check("testbed-weak", 455)
    (450, 460, 460)
    """
    r = RECIPES[name]
    if step < r["sft_steps"]:
        return r["sft_steps"]
    return r["sft_steps"] + ((step - r["sft_steps"]) // r["check_every"] + 1) * r["check_every"]


def bar_end(name: str, step: int) -> int:
    """Where the warm start's bar ends at `step`: the step a build usually stops at (TYPICAL), and once past it the
    next calibration check, never past max_steps (so the bar never shows a total the line above it calls short).

    >>> bar_end("testbed-weak", 0), bar_end("testbed-weak", 460), bar_end("testbed-weak", 470)
    (470, 470, 480)
    """
    usual = TYPICAL.get(name, {}).get("steps", 0)
    return min(max(next_check(name, step), usual), RECIPES[name]["max_steps"])


def warm_start_plan(name: str) -> str:
    """What a build of testbed model `name` does and how long it takes, for the line that starts it."""
    r, typical = RECIPES[name], TYPICAL.get(name, {})
    usually = f"usually by step ~{typical['steps']}, about {typical['minutes']} minutes on 2 cores; " if typical else ""
    return (f"a warm start of {r['sft_steps']} scheduled steps, then a level-{CALIB_LEVEL} calibration check every "
            f"{r['check_every']} steps until accuracy {r['target']} ({usually}at most {r['max_steps']} steps)")


def warm_start(model, tokenizer, name: str, seed: int = 0, progress: bool = True) -> int:
    """Supervised training on the answers (loss on completion tokens only), stopped on a measured property.

    A fixed number of steps is not reproducible across machines: the run ends on the steep part of the
    learning curve, where CPU-specific float rounding (and the thread count) moves level-3 accuracy by
    tens of points (0.49 on one machine, 0.21-0.24 on others). So after the fixed `sft_steps` schedule
    (warmup, cosine down to a tenth of the rate) training continues at that low rate, and every
    `check_every` steps level-3 greedy accuracy is measured on the calibration quarter (never trained
    on, disjoint from the held-out one); the first check that reaches `target` ends the warm start.
    Between machines (CPU kernels, torch version, thread count) the step count differs and so do the other levels'
    accuracies (docs/testbed.md: level 1 0.765-1.000 over 11 builds); level 3 lands in its band. Returns the steps taken;
    fails with a clear error at `max_steps`. With `progress`, a bar runs to where a build usually stops and then to
    the next check (`bar_end`, so its ETA is for that, not for `max_steps`) and each check prints one line with the
    accuracy it measured.
    """
    r = RECIPES[name]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    problems = [p for p in make_suite("train", n_per_level=2000, seed=seed)
                if not (p.level == CALIB_LEVEL and is_calibration(p.question))]
    calib = make_suite("calib", levels=(CALIB_LEVEL,), n_per_level=CALIB_PROBLEMS, seed=seed)
    weights = [SFT_LEVEL_WEIGHTS[p.level] for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 30

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / (r["sft_steps"] - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t0 = time.time()
    bar = tqdm(total=bar_end(name, 0), desc=f"warm-starting {name} (stops when calibrated, usually by step "
               f"~{TYPICAL.get(name, {}).get('steps', r['sft_steps'])})", disable=not progress or bars_off(), leave=False)
    for step in range(1, r["max_steps"] + 1):
        model.train()
        pairs = [sft_example(rng, problems, weights, r.get("guided", SFT_GUIDED_FRACTION)) for _ in range(r["batch"])]
        loss = supervised_step(model, tokenizer, [p for p, _ in pairs], [c for _, c in pairs], opt, sched)
        bar.update()
        if step >= r["sft_steps"] and (step - r["sft_steps"]) % r["check_every"] == 0:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, calib)
            ok, following = acc >= r["target"], next_check(name, step)
            bar.total = bar_end(name, step)  # the usual end, then the next check; and so does its ETA
            bar.set_postfix(loss=f"{loss.item():.3f}", calib=f"{acc:.3f}")
            if progress:
                tqdm.write(f"[testbed] {name} step {step} ({time.time() - t0:.0f} s): level-{CALIB_LEVEL} accuracy "
                           f"{acc:.3f} on the calibration problems, target {r['target']}: " + (
                               "calibrated, warm start done" if ok else "below it, and no check is left" if
                               following > r["max_steps"] else f"below it; next check at step {following}"))
            if ok:
                bar.close()
                return step
    bar.close()
    raise SystemExit(f"error: warm-starting {name} did not reach level-{CALIB_LEVEL} calibration accuracy "
                     f"{r['target']} within {r['max_steps']} steps; the recipe in grounds/testbed_models.py needs "
                     "changing")


def _is_valid(path: str, name: str) -> bool:
    try:
        with open(os.path.join(path, "TESTBED_DONE.json")) as f:
            meta = json.load(f)
        if meta.get("recipe_hash") != recipe_hash(name):
            return False
        return all(
            os.path.getsize(os.path.join(path, fn)) > 0
            for fn in ("config.json", "model.safetensors", "tokenizer.json")
        )
    except (OSError, ValueError):
        return False


def ensure_testbed_model(name: str, progress: bool = True, seed: int = 0) -> str:
    """Return the folder of a warm-started testbed model, building it once if missing or corrupt. `seed` (build
    seed: initial weights and the supervised data order) other than 0 is for measuring how much builds vary."""
    if name not in RECIPES:
        raise ValueError(f"unknown testbed model {name!r}; choose one of {sorted(RECIPES)}")
    path = model_dir(name, seed)

    def build(tmp):
        print(f"[testbed] building {name} into {path} (once; cached afterwards): {warm_start_plan(name)}", flush=True)
        t0, threads = time.time(), torch.get_num_threads()
        tokenizer = build_tokenizer()
        model = build_model(name, tokenizer, seed=seed)
        steps = warm_start(model, tokenizer, name, seed=seed, progress=progress)
        torch.set_num_threads(threads)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "TESTBED_DONE.json"), "w") as f:
            json.dump(dict(name=name, recipe_hash=recipe_hash(name), recipe=RECIPES[name], seed=seed,
                           warm_start_steps=steps, seconds=round(time.time() - t0, 1)), f)

    return build_once(path, lambda: _is_valid(path, name), build, what=name,
                      minutes=TYPICAL.get(name, {}).get("minutes", 0))


# ----------------------------------------------------------------------------------------
# The default weak teacher pair of direct_opd.py: testbed-weak before and after a short RL-style improvement
# ----------------------------------------------------------------------------------------

TEACHER_RFT = dict(level=3, steps=100, prompts=16, samples=8, lr=1e-4, max_new_tokens=4, eval_problems=200, seed=1)
"""Rejection-sampling fine-tuning (RFT) of testbed-weak on one level: each step samples `samples` completions
(temperature 1) for each of `prompts` training problems from the current model, keeps the correct ones and takes
one AdamW step on their mean token negative log-likelihood (eos included). Training on the policy's own successes is
REINFORCE with a 0/1 reward and no baseline, so the pair's log-ratio is an RL shift, as Direct-OPD assumes.
Measured here (2 cores, loaded): level-3 held-out greedy accuracy 0.52 -> 0.66; lr 1e-3 collapses it (0.15)."""


def teacher_pair_hash(recipe: dict) -> str:
    blob = json.dumps(dict(base=recipe_hash("testbed-weak"), rft=recipe), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def rft_improve(model, tokenizer, recipe: dict, progress: bool = True) -> list[float]:
    """Improve `model` in place by rejection-sampling fine-tuning (TEACHER_RFT); returns the kept fraction per step."""
    torch.manual_seed(recipe["seed"])
    rng = random.Random(recipe["seed"])
    problems = make_suite("train", levels=(recipe["level"],), n_per_level=500, seed=recipe["seed"])
    engine = HFEngine(model, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
    kept_frac = []
    for _ in tqdm(range(recipe["steps"]), desc="teacher RFT", disable=not progress or bars_off(), leave=False):
        batch = rng.sample(problems, recipe["prompts"])
        ids = tokenizer([render_testbed_prompt(p.question) for p in batch], add_special_tokens=False)["input_ids"]
        out = engine.generate(ids, n=recipe["samples"], max_new_tokens=recipe["max_new_tokens"])
        answers = [p.answer for p in batch for _ in range(recipe["samples"])]
        keep_B = torch.tensor([t.strip() == a and not cut for t, a, cut in zip(out.texts, answers, out.truncated_B)])
        kept_frac.append(keep_B.float().mean().item())
        if not keep_B.any():
            continue
        model.train()
        logp_BC, _ = completion_logprobs(model, out.input_ids_BT[keep_B], out.attention_mask_BT[keep_B],
                                         out.prompt_len)
        mask_BC = out.completion_mask_BC[keep_B]
        loss = -(logp_BC * mask_BC).sum() / mask_BC.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return kept_frac


def _teacher_done(path: str, recipe: dict) -> bool:
    try:
        with open(os.path.join(path, "TEACHER_DONE.json")) as f:
            return json.load(f).get("hash") == teacher_pair_hash(recipe)
    except (OSError, ValueError):
        return False


def ensure_testbed_teacher_pair(recipe: dict | None = None, progress: bool = True, build: bool = True):
    """(pre, post) folders of the default teacher pair: testbed-weak and testbed-weak improved by `recipe`
    (TEACHER_RFT by default) on its level. Cached under the testbed cache keyed by the recipe and testbed-weak's own
    recipe; built once (about a minute on 2 cores). With build=False, None when it is not built yet."""
    recipe = recipe or TEACHER_RFT
    pre = ensure_testbed_model("testbed-weak", progress=progress)
    path = os.path.join(cache_root(), f"testbed-weak-rft-{teacher_pair_hash(recipe)}")
    if _teacher_done(path, recipe):
        return pre, path
    if not build:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(tmp):
        print(f"[testbed] building the teacher pair's post model into {path} (once; cached afterwards): "
              f"{recipe['steps']} steps of rejection-sampling fine-tuning, about a minute on 2 cores", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(pre)
        threads = torch.get_num_threads()
        model = AutoModelForCausalLM.from_pretrained(pre, dtype=torch.float32)
        test = make_suite("test", levels=(recipe["level"],), n_per_level=recipe["eval_problems"], seed=recipe["seed"])
        before = greedy_accuracy(model, tokenizer, test)
        kept_frac = rft_improve(model, tokenizer, recipe, progress)
        after = greedy_accuracy(model, tokenizer, test)
        torch.set_num_threads(threads)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "TEACHER_DONE.json"), "w") as f:
            json.dump(dict(hash=teacher_pair_hash(recipe), recipe=recipe, pre=pre, kept_frac=kept_frac,
                           heldout_greedy_accuracy=dict(pre=before, post=after)), f, indent=2)
        print(f"[testbed] teacher pair: level-{recipe['level']} held-out greedy accuracy {before:.3f} -> {after:.3f}")

    return pre, build_once(path, lambda: _teacher_done(path, recipe), build, what="the teacher pair's post model",
                           minutes=1)
