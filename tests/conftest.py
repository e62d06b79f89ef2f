import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 with the testbed tokenizer (not warm-started)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.testbed import build_tokenizer

    path = str(tmp_path_factory.mktemp("tiny"))
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def weak_model_dir():
    """The warm-started testbed model (built once per machine, then cached)."""
    from common.testbed import ensure_testbed_model

    return ensure_testbed_model("testbed-weak", progress=False)


@pytest.fixture(scope="session")
def wide_head_model_dir(tmp_path_factory):
    """A tiny Qwen2 whose LM head has 64 rows more than its tokenizer (as Qwen2.5's does), with the padded rows
    biased to win: one residual dimension is held at +100 (embeddings only, no layer writes it), and only the
    padded rows read it, so they carry nearly all the probability mass unless masked."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.testbed import build_tokenizer

    path = str(tmp_path_factory.mktemp("wide_head"))
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok) + 64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[len(tok):, 0] = 1.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
