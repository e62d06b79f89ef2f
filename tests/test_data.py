"""common/data.py and common/models.py: local files, field mapping, and clear errors on bad input."""

import json

import pytest

from common.data import PromptSampler, load_problems, render_prompt
from common.models import load_model


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_style_jsonl_splits_answer_and_solution(tmp_path):
    f = _write(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "Add them.\n#### 1,004"}])
    (p,) = load_problems(f)
    assert (p.question, p.answer, p.solution, p.task) == ("2+2?", "1004", "Add them.", "math")


def test_math500_style_jsonl_with_levels(tmp_path):
    rows = [{"problem": "x?", "answer": "\\frac12", "solution": "so \\boxed{\\frac12}", "level": "Level 3",
             "unique_id": "a/1"}]
    (p,) = load_problems(_write(tmp_path / "m.jsonl", rows))
    assert (p.question, p.answer, p.level, p.uid) == ("x?", "\\frac12", 3, "a/1")


def test_field_mapping_options(tmp_path):
    f = _write(tmp_path / "c.jsonl", [{"q": "x", "gt": "3", "why": "because"}])
    (p,) = load_problems(f, question_field="q", answer_field="gt", solution_field="why")
    assert (p.question, p.answer, p.solution) == ("x", "3", "because")


def test_missing_field_names_the_field(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [{"question": "x"}])
    with pytest.raises(SystemExit, match="no answer field"):
        load_problems(f)
    with pytest.raises(SystemExit, match="'gt'.*missing"):
        load_problems(f, answer_field="gt")
    f = _write(tmp_path / "hole.jsonl", [{"question": "x", "answer": "1"}, {"question": "y", "answer": ""}])
    with pytest.raises(SystemExit, match="record 1"):
        load_problems(f)


def test_empty_and_missing_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        load_problems(str(empty))
    with pytest.raises(SystemExit, match="does not exist"):
        load_problems(str(tmp_path / "nope.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"question": \n')
    with pytest.raises(SystemExit, match="broken.jsonl:1"):
        load_problems(str(tmp_path / "broken.jsonl"))


def test_nonexistent_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        load_model(str(tmp_path / "no-model-here"))


def test_math_prompt_uses_chat_template_when_present(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (p,) = load_problems(_write(tmp_path / "g.jsonl", [{"question": "What is 2+2?", "answer": "4"}]))
    assert render_prompt(p, tok).startswith("What is 2+2?") and "\\boxed{}" in render_prompt(p, tok)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}A:"
    assert render_prompt(p, tok).startswith("<|im_start|>What is 2+2?")


def test_sampler_resumes_at_the_same_position():
    problems = list(range(10))
    a = PromptSampler(problems, seed=3)
    a.next(7)
    state = a.state_dict()
    expected = a.next(8)  # crosses an epoch boundary
    b = PromptSampler(problems, seed=3)
    b.load_state_dict(state)
    assert b.next(8) == expected


def test_local_folder_goes_through_hf_datasets_with_splits(tmp_path):
    """The Hugging Face loading path (datasets.load_dataset), offline, on a folder of split files."""
    folder = tmp_path / "mathset"
    folder.mkdir()
    _write(folder / "train.jsonl", [{"problem": f"p{i}", "answer": str(i), "level": "Level 2"} for i in range(3)])
    _write(folder / "test.jsonl", [{"problem": "q", "answer": "7", "level": "Level 5"}])
    train, test = load_problems(str(folder), "train"), load_problems(str(folder), "test")
    assert [p.question for p in train] == ["p0", "p1", "p2"] and [p.level for p in train] == [2, 2, 2]
    assert [(p.question, p.answer, p.level) for p in test] == [("q", "7", 5)]
    with pytest.raises(SystemExit, match="could not load dataset"):
        load_problems(str(folder), "validation")
