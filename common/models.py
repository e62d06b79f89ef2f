"""Loading a policy and its tokenizer from a local folder or a Hugging Face id (the embedded names are turned into
folders by grounds.path_of before they reach here)."""

from __future__ import annotations

import contextlib
import copy
import difflib
import glob
import json
import os

import torch

from common.manifest import check_files

EMBEDDED_NAMES = ("testbed-weak", "testbed-strong", "smollm2-135m-instruct", "testbed-code")
"""the models grounds/ builds locally (grounds.EMBEDDED_MODELS): named here for the error messages, and for the
trainers, which import grounds/ only for these names (a fork without it runs on hub ids and local folders)"""


def resolve_model(name: str) -> str:
    """The folder or hub id to load, with a one-line error instead of a hub error or a minute of retries: a name that
    looks like a local path must exist; a hub id not in the local cache needs the hub, which is asked once, with a
    short timeout, whether it answers at all (else: say so, and name HF_HUB_OFFLINE and the embedded names)."""
    looks_local = name.startswith((".", "/", "~")) or os.path.sep in name and os.path.exists(name.split(os.path.sep)[0])
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise SystemExit(f"error: model path {name!r} does not exist (give a local folder, a hub id, "
                         f"or an embedded name: {', '.join(EMBEDDED_NAMES[:3])}){_near(name)}")
    if looks_local or os.path.isdir(name):
        return os.path.expanduser(name)
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id: the loader's own error says why
        return name
    if cached:
        return name
    if constants.HF_HUB_OFFLINE:
        raise SystemExit(f"error: --model-name {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                         f"set; give a local folder or an embedded name ({', '.join(EMBEDDED_NAMES[:3])}){_near(name)}")
    try:
        get_session().head(constants.ENDPOINT, timeout=5.0)
    except Exception as e:  # noqa: BLE001 - DNS, refused, timeout, proxy: the hub cannot be reached
        raise SystemExit(f"error: --model-name {name!r} is not in the local Hugging Face cache and the hub "
                         f"({constants.ENDPOINT}) cannot be reached ({type(e).__name__}); give a local folder or an "
                         f"embedded name ({', '.join(EMBEDDED_NAMES[:3])}){_near(name)}, or set HF_HUB_OFFLINE=1 to "
                         "use cached models only") from None
    return name


def _near(name: str) -> str:
    """'; did you mean ...?' when `name` is close to an embedded model's name, else ''."""
    key = name.lower().split("/")[-1]
    close = [n for n in EMBEDDED_NAMES if key in n] or difflib.get_close_matches(key, EMBEDDED_NAMES, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if key and close else ""


def load_tokenizer(name: str, system_prompt: str | None = None):
    """The tokenizer of model `name`, left-padding, with a pad token (eos when it has none) and `system_prompt`
    stored on it for common.data.render_prompt (None: the chat template's own default, which for SmolLM2 is a
    system turn of its own; "": an empty system turn, so no default is inserted; text: that system turn)."""
    from transformers import AutoTokenizer

    path = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - hub, disk and format errors all mean "cannot load"
        raise SystemExit(f"error: could not load the tokenizer of {name!r}: {_one_line(e)}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many base models have none; eos stays distinct in the mask logic
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of {name!r} has no eos token; generation could not stop")
    tok.stop_token_ids = stop_token_ids(tok, path)
    if system_prompt and not getattr(tok, "chat_template", None):
        raise SystemExit(f"error: --system-prompt needs a chat template, and the tokenizer of {name!r} has none")
    if system_prompt is not None and getattr(tok, "chat_template", None):
        try:  # some templates refuse a system turn; say so now rather than at the first prompt
            tok.apply_chat_template([{"role": "system", "content": system_prompt}, {"role": "user", "content": "x"}],
                                    tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja raises its own TemplateError
            raise SystemExit(f"error: the chat template of {name!r} takes no system turn (--system-prompt): "
                             f"{_one_line(e)}") from None
    tok.system_prompt = system_prompt
    return tok


def stop_token_ids(tokenizer, path: str) -> list[int]:
    """The ids that end a completion: the tokenizer's eos first, then every other eos id in the model's
    generation_config.json (an int or a list; Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>). vLLM stops on
    all of them whatever it is told, so every engine and the completion mask use this one set
    (common.rollout.stop_ids reads it back from the tokenizer)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        listed = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: vLLM then takes the model config's eos ids, and so do we
        try:
            listed = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path)).eos_token_id
        except (OSError, ValueError):
            listed = None
    ids = [tokenizer.eos_token_id]
    for i in [listed] if isinstance(listed, int) else listed or []:
        if i not in ids:
            ids.append(int(i))
    return ids


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


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def check_weight_files(path: str) -> None:
    """Fail, naming the file, when a local safetensors file is empty or shorter than its own header says."""
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as f:
            size, head = os.path.getsize(file), f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            try:
                header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
                end = 8 + n + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                end = None
        if size == 0:
            raise SystemExit(f"error: weights file {file} is empty (an interrupted download or copy?)")
        if end is None or size < end:
            raise SystemExit(f"error: weights file {file} is truncated or not a safetensors file "
                             f"({size} bytes{f', its header says {end}' if end else ''}); copy or download it again")


def tokenizer_size(path: str) -> int | None:
    """Entries of the tokenizer saved at `path` (a folder or hub id), or None when there is none to load."""
    if os.path.isdir(path) and not glob.glob(os.path.join(path, "tokenizer*")):
        return None
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(path))
    except Exception:  # noqa: BLE001 - load_tokenizer reports a tokenizer that cannot load
        return None


def head_rows(model) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.get_input_embeddings().num_embeddings


def check_tokenizer_fits(model, path: str, n_tokens: int | None) -> None:
    """Fail when the tokenizer saved beside a local model has ids the model's embedding or LM head lacks
    (a tokenizer from another model); torch would otherwise stop at the first such id with an index error."""
    if n_tokens is None or not os.path.isdir(path):
        return
    rows = min(model.get_input_embeddings().num_embeddings, head_rows(model))
    if n_tokens > rows:
        raise SystemExit(f"error: the tokenizer in {path} has {n_tokens} tokens but the model there has only {rows} "
                         f"embedding rows: they come from different models (save the model's own tokenizer with it)")


PADDED_ROW_LOGIT = -1e4
"""What a padded LM-head row's logit becomes: exp() of it is exactly 0 in every float type, and unlike -inf it
keeps entropies (p * logit) and temperature divisions finite."""


def mask_padded_head(model, vocab: int) -> None:
    """Every forward of `model` puts no probability on LM-head rows past the tokenizer's `vocab` entries.

    Real models pad the head (Qwen2.5: 151936 rows for 151665 tokens). The samplers never draw those rows
    (common.rollout.mask_padded_vocab; for vLLM, the logits processor of common.rollout.padded_rows_processor), so
    the trainers' log-probs, entropies, KL terms and teacher scores must normalise over the same `vocab` entries;
    masking at the head makes every forward agree, whichever function computes from the logits.

    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> m = Qwen2ForCausalLM(Qwen2Config(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
    ...                                  num_key_value_heads=1, intermediate_size=8))
    >>> mask_padded_head(m, 6)
    >>> m(torch.tensor([[1, 2]])).logits.softmax(-1)[0, -1, 6:].tolist()
    [0.0, 0.0]
    """
    if head_rows(model) <= vocab:
        return

    def hook(module, inputs, logits):
        return logits.index_fill(-1, torch.arange(vocab, logits.shape[-1], device=logits.device), PADDED_ROW_LOGIT)

    model.get_output_embeddings().register_forward_hook(hook)


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """A causal LM in `dtype` on `device`, in train mode, with dropout off; its files checked (a checkpoint's sha256,
    truncated weights, a tokenizer beside it that does not fit). A padded LM head stays as it is: a trainer that
    normalises over the whole head masks it (`mask_padded_head`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model(name)
    if os.path.isdir(path):
        check_files(path, f"could not load model {name!r}", model_only=True)  # a checkpoint: the sha256 of each file
        check_weight_files(path)
    try:
        config = AutoConfig.from_pretrained(path)
        disable_dropout(config)
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"error: could not load model {name!r}: {_one_line(e)}") from None
    disable_dropout(model.config, model)
    check_tokenizer_fits(model, path, tokenizer_size(path))
    return model.to(device).train()


def autocast_forward(model, dtype: torch.dtype) -> None:
    """Every forward of `model` runs under torch.autocast(dtype): matrix products in `dtype`, softmax, norms and
    reductions in float32, while the weights themselves, their gradients and the optimizer state stay float32 (the
    master weights). An update of 1e-6 on a weight of 0.02 is about a hundredth of a bfloat16 step: stored in
    bfloat16, the weight would not move at all. The hooks read only their module argument, so a deepcopy of the
    model (a reference) keeps them and computes the same way."""
    def enter(module, inputs):
        ctx = torch.autocast(next(module.parameters()).device.type, dtype=dtype)
        ctx.__enter__()
        module.autocast_contexts.append(ctx)

    def leave(module, inputs, output):
        module.autocast_contexts.pop().__exit__(None, None, None)

    model.autocast_contexts, model.compute_dtype = [], dtype
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)  # also when the forward raises


def compute_scope(model):
    """One autocast region around many forwards of `model` (generation: the weights are cast to the compute dtype
    once, not at every decoding step); a no-op for a model without `autocast_forward`."""
    dtype = getattr(model, "compute_dtype", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


def load_policy(name: str, args, device: str):
    """The model a trainer updates, in --dtype's compute precision. float32: plain float32. bfloat16 / float16:
    float32 master weights computing under autocast (`autocast_forward`; under --fsdp FSDP2's mixed precision does the
    same, common.dist.shard_models); with --no-master-weights the weights themselves in --dtype, with a warning.
    Loading only: the trainer masks a padded LM head (`mask_padded_head`) and switches on --gradient-checkpointing
    (`enable_gradient_checkpointing`) itself, before any sharding."""
    if args.dtype != "float32" and not args.master_weights:
        print(f"warning: --no-master-weights: the weights are stored in {args.dtype}, so AdamW updates smaller than "
              f"half a {args.dtype} step of a weight (about 1/256 of it for bfloat16) are lost; at learning rates "
              "near 1e-6 most weights never change")
    model = load_model(name, "float32" if args.master_weights else args.dtype, device)
    if args.dtype != "float32" and args.master_weights and not getattr(args, "fsdp", False):
        autocast_forward(model, getattr(torch, args.dtype))
    return model


def frozen_copy(model):
    """A frozen copy of the policy (the reference model) that computes exactly as the policy does, so that the KL
    to it is exactly 0 at step 0: the same weights, dtypes and buffers, and the same forward (a deepcopy keeps the
    hooks of `autocast_forward`; under --fsdp, `shard_models` gives both the same bfloat16 parameter copies).

    Under --dtype bfloat16 / float16 the copy therefore keeps the policy's float32 weights: 4 bytes a parameter
    instead of 2, so a plain run holds 20 bytes a parameter instead of 18, and --fsdp 20/N instead of 18/N
    (docs/fsdp.md). Stored in bfloat16, the copy ran its embeddings, norms and residual stream in bfloat16 where the
    policy's autocast keeps them in float32, and its rotary frequencies (a buffer) in bfloat16 even under --fsdp: at
    step 0 SmolLM2's reference log-probs were up to 0.55 from the policy's (k3 KL 0.011 a token), testbed-weak's
    0.087, and 0.13 under --fsdp, where the rotary frequencies were the only difference (issue 36)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def add_lora(model, names: list[str], r: int, alpha: int, target_modules, **config):
    """`model` wrapped by peft with one fresh LoRA adapter (no dropout; B = 0, so it starts as `model`) per name,
    the first one active; a one-line error when --lora-target-modules names no module of this model."""
    from peft import LoraConfig, get_peft_model

    def make():
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules), **config)

    try:
        wrapped = get_peft_model(model, make(), adapter_name=names[0])
    except ValueError as e:
        raise SystemExit(f"error: --lora-target-modules {' '.join(target_modules)}: {_one_line(e)}") from None
    for name in names[1:]:
        wrapped.add_adapter(name, make())
    return wrapped


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations during backward instead of keeping them from the forward
    (`--gradient-checkpointing`): transformers' `gradient_checkpointing_enable` with the non-reentrant
    `torch.utils.checkpoint`, which needs no input that requires grad (so frozen embeddings and peft-wrapped models
    with a frozen base work) and gives the same gradients. It acts in train mode only, where the trainers compute
    their log-probs (with use_cache=False); generation runs in eval mode with its KV cache, unchanged. Call it on the
    model before `shard_models` (it sets a flag on each decoder layer; FSDP2 then wraps those layers) or on a peft
    model (it reaches the base model underneath)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise SystemExit(f"error: --gradient-checkpointing: {type(base).__name__} does not support gradient "
                         f"checkpointing; run without the flag")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
