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


def disable_dropout(config, model=None) -> None:
    """Dropout off, as TRL does: the config's *dropout* / *pdrop* rates (some attention code copies them at
    construction, so set them before building the model) and the p of every `nn.Dropout` set to 0. Log-probs
    are computed in train mode; dropout would make the old and new log-probs, and so the ratio, noisy."""
    for name, value in list(vars(config).items()):
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float | int) and not isinstance(value, bool):
            setattr(config, name, 0.0)
    for module in model.modules() if model is not None else ():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """A causal LM in `dtype` on `device`, in train mode, with dropout off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model(name)
    try:
        config = AutoConfig.from_pretrained(path)
        disable_dropout(config)
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"error: could not load model {name!r}: {e}") from None
    disable_dropout(model.config, model)
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
