"""Local models for the speed benchmarks (no hub access needed).

`random_model` builds a Qwen2 of a chosen size with the testbed's byte tokenizer; its weights are
random, which is all a throughput benchmark needs. `forced_length` copies a model folder and makes
`<|im_start|>` its eos: no model here ever emits that token, so every completion runs to
max_new_tokens in every framework, without touching any framework's sampling settings.
"""

import os
import shutil

from grounds.cache import cache_root
from grounds.testbed_models import build_tokenizer, ensure_testbed_model


def random_model(hidden: int, layers: int, heads: int, seed: int = 0) -> str:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = os.path.join(cache_root(), f"bench-random-h{hidden}-l{layers}-s{seed}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=4 * hidden,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def forced_length(src: str) -> str:
    """A copy of `src` whose eos is a token the model never produces."""
    import json

    from transformers import AutoTokenizer

    path = src.rstrip("/") + "-forced"
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tmp = path + f".tmp{os.getpid()}"
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.eos_token = "<|im_start|>"
    tok.save_pretrained(tmp)
    for name in ("config.json", "generation_config.json"):
        f = os.path.join(tmp, name)
        if os.path.exists(f):
            cfg = json.load(open(f))
            cfg["eos_token_id"] = tok.eos_token_id
            json.dump(cfg, open(f, "w"), indent=2)
    os.replace(tmp, path)
    return path


def bench_models() -> dict:
    """name -> folder: the ~1M testbed model and a ~10M random model, both with forced-length copies."""
    weak = ensure_testbed_model("testbed-weak", progress=False)
    big = random_model(384, 4, 6)
    return {"1M": weak, "1M-forced": forced_length(weak), "10M-forced": forced_length(big)}
