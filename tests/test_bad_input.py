"""Bad input through the trainers' real `main()`: a data file that is empty, not JSON, not UTF-8, of the wrong
shape or types, and a model folder that is missing, truncated or paired with another model's tokenizer. Each
stops before training with one line, `error: ...`, naming the file (and line) and what is wrong."""

import os
import re
import shutil

import pytest
import tyro

import direct_opd
import grpo
import mada_rl
import oc_grpo
import ppo_slm
import rloo_sec

OK = '{"question": "What is 1+1?", "answer": "2"}\n'

# name: (file name, bytes, the error it must give); the record with the problem is on line 2 (record 1)
DATA_CASES = {
    "empty": ("d.jsonl", b"", r"d\.jsonl: the file is empty"),
    "blank_lines": ("d.jsonl", b"\n  \n", r"d\.jsonl: the file is empty"),
    "not_json": ("d.jsonl", (OK + "{question: 1+1}\n").encode(), r"d\.jsonl:2 is not valid JSON"),
    "not_utf8": ("d.jsonl", OK.encode() + b'{"question": "caf\xe9 1+1", "answer": "2"}\n',
                 r"d\.jsonl:2 is not UTF-8 text \(byte 0xe9 at column 18\)"),
    "not_an_object": ("d.jsonl", (OK + '["1+1", "2"]\n').encode(), r"d\.jsonl:2: record 1 is a list"),
    "missing_answer": ("d.jsonl", (OK + '{"question": "2+2"}\n').encode(), r"d\.jsonl:2: record 1 has no 'answer'"),
    "question_is_a_list": ("d.jsonl", (OK + '{"question": ["2", "+2"], "answer": "4"}\n').encode(),
                           r"d\.jsonl:2: record 1 field 'question' is a list; expected a string"),
    "answer_is_a_dict": ("d.jsonl", (OK + '{"question": "2+2", "answer": {"value": 4}}\n').encode(),
                         r"d\.jsonl:2: record 1 field 'answer' is an object; expected a string or a number"),
    "json_array_bad_item": ("d.json", ("[" + OK + ', {"question": "2+2", "answer": null}]').encode(),
                            r"d\.json: record 1 has no 'answer'"),
    "json_not_json": ("d.json", b'[{"question": "2+2", "answer": 4}', r"d\.json:1 is not valid JSON"),
    # a dataset folder (--dataset data/) with its train split in data/train.jsonl
    "folder_not_utf8": ("data/train.jsonl", OK.encode() + b'{"question": "\xff", "answer": "2"}\n',
                        r"data/train\.jsonl:2 is not UTF-8 text \(byte 0xff at column 15\)"),
    "folder_answer_is_a_list": ("data/train.jsonl", (OK + '{"question": "2+2", "answer": [4]}\n').encode(),
                                r"data/train\.jsonl:2: record 1 field 'answer' is a list"),
}
DATA_TRAINERS = ["grpo", "rloo_sec", "oc_grpo", "direct_opd"]  # ppo_slm builds its own pairs (testbed or texts)
TRAINERS = {"grpo": grpo, "rloo_sec": rloo_sec, "oc_grpo": oc_grpo, "direct_opd": direct_opd, "ppo_slm": ppo_slm}


def _run(trainer: str, model: str, tmp_path, *extra):
    """The trainer's main() on these flags; the SystemExit message it stops with."""
    flags = ["--output-dir", str(tmp_path / "runs"), "--model-name", model]
    if trainer == "direct_opd":
        flags += ["--teacher-pre", model, "--teacher-post", model]
    if trainer == "ppo_slm":
        flags += ["--num-train-examples", "8", "--num-eval-pairs", "4", "--num-eval-prompts", "4"]
    module = TRAINERS[trainer]
    with pytest.raises(SystemExit) as info:
        module.main(tyro.cli(module.Args, args=[*flags, *extra]))
    return str(info.value)


def _assert_one_line_error(message: str, pattern: str):
    assert message.startswith("error: ") and "\n" not in message, message
    assert re.search(pattern, message), message


@pytest.mark.parametrize("case", DATA_CASES)
@pytest.mark.parametrize("trainer", DATA_TRAINERS)
def test_bad_data_file_is_a_one_line_error_naming_file_and_line(trainer, case, tmp_path, tiny_model_dir):
    name, content, pattern = DATA_CASES[case]
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    dataset = path.parent if name.startswith("data/") else path
    _assert_one_line_error(_run(trainer, tiny_model_dir, tmp_path, "--dataset", str(dataset)), pattern)
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")  # stopped before any run folder


def _missing(src, dst):
    return os.path.join(dst, "not-here")


def _empty_weights(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    open(os.path.join(dst, "model.safetensors"), "wb").close()
    return dst


def _cut_weights(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = os.path.join(dst, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    return dst


def _no_weights(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    os.remove(os.path.join(dst, "model.safetensors"))
    return dst


def _other_tokenizer(src, dst):
    """The model with a tokenizer that has one token more than the model has embedding rows."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(dst)
    return dst


# name: (how to spoil a copy of the tiny model's folder, the error it must give)
MODEL_CASES = {
    "missing": (_missing, r"model path '.*not-here' does not exist"),
    "empty_weights": (_empty_weights, r"weights file .*model\.safetensors is empty"),
    "truncated_weights": (_cut_weights, r"weights file .*model\.safetensors is truncated"),
    "no_weights": (_no_weights, r"could not load model '.*model': .*no file named model\.safetensors"),
    "other_tokenizer": (_other_tokenizer, r"the tokenizer in .*model has 260 tokens but the model there has only 259 "
                                          r"embedding rows"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_bad_model_folder_is_a_one_line_error_naming_it(trainer, case, tmp_path, tiny_model_dir):
    spoil, pattern = MODEL_CASES[case]
    model = spoil(tiny_model_dir, str(tmp_path / "model"))
    _assert_one_line_error(_run(trainer, model, tmp_path), pattern)


# ppo_slm.py's text data (--dataset FILE --text-field F): the same one-line errors through its own reader
TEXT_CASES = {
    "empty": ("t.jsonl", b"", r"t\.jsonl: the file is empty"),
    "not_json": ("t.jsonl", b'{"text": "once upon a time"}\n{text: 1}\n', r"t\.jsonl:2 is not valid JSON"),
    "not_utf8": ("t.jsonl", b'{"text": "caf\xe9"}\n', r"t\.jsonl:1 is not UTF-8 text"),
    "missing_field": ("t.jsonl", b'{"text": "a b c"}\n{"story": "d e f"}\n',
                      r"t\.jsonl:2: expected an object with a string field 'text' \(--text-field\); got an object "
                      r"with fields \['story'\]"),
    "txt_not_utf8": ("t.txt", b"once upon a time\n\xff\xfe there\n", r"t\.txt: cannot read it as UTF-8 text lines"),
    "too_few_texts": ("t.txt", b"one two\nthree four\n", r"has fewer than 2 texts with \d+ words"),
}


@pytest.mark.parametrize("case", TEXT_CASES)
def test_bad_text_file_for_ppo_slm_is_a_one_line_error(case, tmp_path, tiny_model_dir):
    name, content, pattern = TEXT_CASES[case]
    (tmp_path / name).write_bytes(content)
    message = _run("ppo_slm", tiny_model_dir, tmp_path, "--dataset", str(tmp_path / name), "--text-field", "text")
    _assert_one_line_error(message, pattern)


@pytest.mark.parametrize("trainer", ["ppo_slm", "mada_rl"])
def test_lora_targets_the_model_lacks_are_a_one_line_error(trainer, tmp_path, tiny_model_dir):
    """Pythia's module names on a Qwen2 model: both LoRA trainers stop, naming the flag, before any training."""
    flags = ["--output-dir", str(tmp_path / "runs"), "--model-name", tiny_model_dir,
             "--lora-target-modules", "query_key_value", "dense"]
    if trainer == "ppo_slm":
        flags += ["--num-train-examples", "8", "--num-eval-pairs", "4", "--num-eval-prompts", "4"]
    else:
        flags += ["--num-train-problems", "60", "--num-prompts", "2", "--num-eval-problems", "4"]
    module = {"ppo_slm": ppo_slm, "mada_rl": mada_rl}[trainer]
    with pytest.raises(SystemExit) as info:
        module.main(tyro.cli(module.Args, args=flags))
    _assert_one_line_error(str(info.value), r"--lora-target-modules query_key_value dense: .*not found in the base model")


@pytest.mark.parametrize("trainer",
                         ["grpo", "rloo_sec", "oc_grpo", "direct_opd", "ppo_slm", "mada_rl", "rlpf", "adakp"])
@pytest.mark.parametrize("case", ["learning_rate", "output_dir_is_a_file"])
def test_flag_errors_come_before_any_model_loads(trainer, case, tmp_path):
    """A flag that is wrong on its face stops the run in one line before anything loads: the model named here does
    not exist, so a check made after loading would report the missing model instead (or a traceback from AdamW)."""
    import adakp
    import rlpf

    module = {**TRAINERS, "mada_rl": mada_rl, "rlpf": rlpf, "adakp": adakp}[trainer]
    flags = ["--model-name", str(tmp_path / "no_such_model")]
    if case == "learning_rate":
        flags += ["--output-dir", str(tmp_path / "runs"), "--learning-rate", "-1e-5"]
        pattern = r"--learning-rate -1e-05 must be at least 0"
    else:
        (tmp_path / "a_file").write_text("")
        flags += ["--output-dir", str(tmp_path / "a_file")]
        pattern = r"--output-dir .*a_file is a file"
    if trainer == "direct_opd":
        flags += ["--teacher-pre", flags[1], "--teacher-post", flags[1]]
    with pytest.raises(SystemExit) as info:
        module.main(tyro.cli(module.Args, args=flags))
    _assert_one_line_error(str(info.value), pattern)


def test_a_derived_batch_size_on_the_command_line_is_refused_not_replaced(tmp_path):
    """--batch-size is filled in from --num-prompts x --group-size; a different value given is an error, not lost."""
    flags = ["--model-name", str(tmp_path / "no_such_model"), "--output-dir", str(tmp_path / "runs")]
    for extra, pattern in ((["--batch-size", "999"], r"--batch-size 999 is derived, not set: .* = 128 here"),
                           (["--minibatch-size", "5", "--num-minibatches", "2"],
                            r"--minibatch-size 5 is derived.* = 64")):
        with pytest.raises(SystemExit) as info:
            grpo.main(tyro.cli(grpo.Args, args=[*flags, *extra]))
        _assert_one_line_error(str(info.value), pattern)


@pytest.mark.parametrize("module, extra, pattern", [
    (ppo_slm, ["--num-minibatches", "3"], r"--num-minibatches 3 is derived, not set: .* = 4 here"),
    (mada_rl, ["--total-steps", "10"], r"--total-steps 10 is derived, not set: .* = 480 here"),
], ids=["ppo_slm", "mada_rl"])
def test_a_derived_count_on_the_command_line_is_refused_not_replaced(tmp_path, module, extra, pattern):
    """ppo_slm's --num-minibatches (--num-prompts / --minibatch-size) and mada_rl's --total-steps (each agent's steps,
    summed) are derived: a different value given is a one-line error before any model loads, never overwritten."""
    flags = ["--model-name", str(tmp_path / "no_such_model"), "--output-dir", str(tmp_path / "runs"), *extra]
    with pytest.raises(SystemExit) as info:
        module.main(tyro.cli(module.Args, args=flags))
    _assert_one_line_error(str(info.value), pattern)


def test_an_embedded_name_matches_without_regard_to_case(smollm2_dir):
    """The README's prose spelling `SmolLM2-135M-Instruct` is the embedded model, not a hub id that costs a minute
    of connection retries."""
    from grounds import EMBEDDED_MODELS, path_of

    from common.models import EMBEDDED_NAMES

    assert path_of("SmolLM2-135M-Instruct") == path_of("smollm2-135m-instruct") == smollm2_dir
    assert set(EMBEDDED_NAMES) == set(EMBEDDED_MODELS)  # the error messages name what grounds/ builds


def test_a_hub_id_not_cached_fails_at_once_naming_the_way_out(monkeypatch):
    """Not in the local cache: offline, one line naming HF_HUB_OFFLINE (and the nearest embedded name); online with
    the hub out of reach, one try with a short timeout, then one line saying so (it printed six connection errors
    over about a minute before saying it could not load the tokenizer)."""
    import time

    from huggingface_hub import constants

    from common.models import load_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit, match=r"^error: --model-name 'SmolLM2' is not in the local Hugging Face cache and "
                                         r"HF_HUB_OFFLINE is set; .*did you mean 'smollm2-135m-instruct'\?$"):
        load_tokenizer("SmolLM2")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    start = time.time()
    with pytest.raises(SystemExit, match=r"^error: --model-name 'not-a/model-xyz' is not in the local Hugging Face "
                                         r"cache and the hub \(http://127.0.0.1:9\) cannot be reached .* set "
                                         r"HF_HUB_OFFLINE=1 to use cached models only$") as e:
        load_tokenizer("not-a/model-xyz")
    assert "\n" not in str(e.value.code) and time.time() - start < 30
