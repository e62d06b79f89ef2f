"""rlpf.py's embedded policy `testbed-code`: a tiny byte-level Qwen2 (the testbed models' tokenizer) warm-started by
supervised training on the embedded code tasks' slow, fast and broken programs, so RL has something to shift.
Built once (up to 9 minutes on 2 busy cores) and cached by grounds/cache.py, keyed by the recipe and the programs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

from code_env.tasks import TASKS, CodeTask, render_code_prompt
from common.logger import bars_off
from grounds.cache import build_once, cache_root
from grounds.testbed_models import CODE_MODEL, build_tokenizer, supervised_step


CODE_RECIPE = dict(hidden=128, layers=4, heads=4, intermediate=512, sft_steps=150, lr=3e-3, batch=32, v=1,
                   mix=dict(slow=0.55, fast=0.15, broken=0.30))
"""Warm-start mix: mostly slow-correct programs, a few fast ones, some broken: RL has something to shift."""
BUILD_MINUTES = 9
"""How long a build can take on 2 busy cores: the cached build of 2026-12-02 took 514 s (its TESTBED_DONE.json)."""


def code_recipe_hash() -> str:
    progs = {n: [t.slow, t.fast, *t.broken, render_code_prompt(t)] for n, t in TASKS.items()}
    blob = json.dumps(dict(recipe=CODE_RECIPE, programs=progs), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def code_model_dir() -> str:
    return os.path.join(cache_root(), f"{CODE_MODEL}-{code_recipe_hash()}")


def sft_program(rng: random.Random, task: CodeTask) -> str:
    mix = CODE_RECIPE["mix"]
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    return {"slow": task.slow, "fast": task.fast}.get(kind) or rng.choice(task.broken)


def ensure_code_model(progress: bool = True) -> str:
    """The folder of the warm-started `testbed-code` model, built once (up to 9 minutes on 2 busy cores) and cached."""
    path = code_model_dir()

    def done():
        weights = os.path.join(path, "model.safetensors")
        return os.path.exists(os.path.join(path, "TESTBED_DONE.json")) and os.path.exists(weights) and \
            os.path.getsize(weights) > 0

    return build_once(path, done, lambda tmp: _build_code_model(tmp, progress), what=CODE_MODEL, minutes=BUILD_MINUTES)


def _build_code_model(tmp: str, progress: bool) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # slow to import: only when building

    print(f"[testbed] building {CODE_MODEL} into {code_model_dir()} (once; cached afterwards): "
          f"{CODE_RECIPE['sft_steps']} supervised steps, up to {BUILD_MINUTES} minutes on 2 busy cores", flush=True)
    r = CODE_RECIPE
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=r["hidden"], num_hidden_layers=r["layers"], num_attention_heads=r["heads"],
        num_key_value_heads=r["heads"], intermediate_size=r["intermediate"], max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None))
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                               do_sample=False)
    rng = random.Random(0)
    tasks = list(TASKS.values())
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.01, betas=(0.9, 0.98))
    steps, warmup = r["sft_steps"], 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / (steps - warmup))))))
    model.train()
    t0 = time.time()
    for _ in tqdm(range(steps), desc=f"warm-starting {CODE_MODEL}", disable=not progress or bars_off(), leave=False):
        batch = [rng.choice(tasks) for _ in range(r["batch"])]
        loss = supervised_step(model, tok, [render_code_prompt(t) for t in batch], [sft_program(rng, t) for t in batch],
                               opt, sched)
    model.eval()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "TESTBED_DONE.json"), "w") as f:
        json.dump(dict(name=CODE_MODEL, recipe_hash=code_recipe_hash(), recipe=CODE_RECIPE, final_loss=loss.item(),
                       seconds=round(time.time() - t0, 1)), f)
