"""Loading a policy and its tokenizer: a testbed name, a Hugging Face id, or a local folder."""

from __future__ import annotations

import os

import torch

from common.testbed import TESTBED_MODELS, ensure_testbed_model


def resolve_model(name: str) -> str:
    """The folder or hub id to load; builds a testbed model on first use."""
    if name in TESTBED_MODELS:
        return ensure_testbed_model(name)
    looks_local = name.startswith((".", "/", "~")) or os.path.sep in name and os.path.exists(name.split(os.path.sep)[0])
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise SystemExit(f"error: model path {name!r} does not exist (give a local folder, a hub id, "
                         f"or one of {list(TESTBED_MODELS)})")
    return os.path.expanduser(name) if looks_local else name


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - hub, disk and format errors all mean "cannot load"
        raise SystemExit(f"error: could not load the tokenizer of {name!r}: {e}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many base models have none; eos stays distinct in the mask logic
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of {name!r} has no eos token; generation could not stop")
    return tok


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """A causal LM in `dtype` on `device`, in train mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"error: could not load model {name!r}: {e}") from None
    return model.to(device).train()


def check_same_vocab(tokenizers: dict) -> None:
    """Fail fast, naming the culprits, when models that must share a vocabulary do not."""
    names = list(tokenizers)
    ref = tokenizers[names[0]]
    for other in names[1:]:
        tok = tokenizers[other]
        if len(tok) != len(ref) or tok.get_vocab() != ref.get_vocab():
            raise SystemExit(f"error: {names[0]} and {other} have different tokenizers "
                             f"({len(ref)} vs {len(tok)} tokens); they must share one vocabulary")
