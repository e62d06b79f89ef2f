"""common/data.py and common/models.py: local files, their held-out split, field mapping, and clear errors on bad
input."""

import json
import os

import pytest
import tyro

import grpo
from common.args import check_run_args
from common.data import PromptSampler, load_problems, render_prompt
from common.models import load_model
from common.data import load_train_eval


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_style_jsonl_splits_answer_and_solution(tmp_path):
    f = _write(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "Add them.\n#### 1,004"}])
    (p,) = load_problems(f, whole=True)
    assert (p.question, p.answer, p.solution, p.task) == ("2+2?", "1004", "Add them.", "math")


def test_math500_style_jsonl_with_levels(tmp_path):
    rows = [{"problem": "x?", "answer": "\\frac12", "solution": "so \\boxed{\\frac12}", "level": "Level 3",
             "unique_id": "a/1"}]
    (p,) = load_problems(_write(tmp_path / "m.jsonl", rows), whole=True)
    assert (p.question, p.answer, p.level, p.uid) == ("x?", "\\frac12", 3, "a/1")


def test_field_mapping_options(tmp_path):
    f = _write(tmp_path / "c.jsonl", [{"q": "x", "gt": "3", "why": "because"}])
    (p,) = load_problems(f, question_field="q", answer_field="gt", solution_field="why", whole=True)
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


# A local file has two splits: every 10th record held out, the others train


def _twenty(tmp_path, name="p.jsonl"):
    return _write(tmp_path / name, [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)])


def test_a_local_file_holds_out_every_tenth_record(tmp_path):
    f = _twenty(tmp_path)
    train, test = load_problems(f, "train"), load_problems(f, "test")
    assert [p.answer for p in test] == ["0", "20"] and len(train) == 18
    assert {p.question for p in train}.isdisjoint(p.question for p in test)
    assert [p.uid for p in load_problems(f, "validation")] == [p.uid for p in test] == [f"{f}:0", f"{f}:10"]
    # --num-train-problems / --num-eval-problems cut the split, not the file
    assert [p.answer for p in load_problems(f, "train", num_problems=3)] == ["2", "4", "6"]
    assert [p.answer for p in load_problems(f, "test", num_problems=1)] == ["0"]


def test_both_splits_check_every_record_and_name_its_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(open(_twenty(tmp_path)).read() + '{"question": "What is 1 + 1?"}\n')  # record 20: held out
    for split in ("train", "test"):
        with pytest.raises(SystemExit, match=r"p\.jsonl:21: record 20 has no 'answer'"):
            load_problems(str(f), split)


def test_repeated_records_never_put_a_held_out_problem_into_training(tmp_path, capsys):
    """The split is by content: a 30-record file that lists 15 problems twice held out records 0, 10 and 20 while
    their copies (records 15, 25, 5) trained. Repeats (whitespace aside) are dropped before every 10th distinct record
    is held out, and one console line counts them."""
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(15)] * 2
    rows[20] = {"question": "What is  5 +\t5? ", "answer": "11"}  # a copy of record 5 with other spacing and answer
    f = _write(tmp_path / "rep.jsonl", rows)
    train, held_out = load_train_eval(tyro.cli(grpo.Args, args=["--dataset", f]))
    questions = lambda ps: {" ".join(p.question.split()) for p in ps}  # noqa: E731
    assert questions(train).isdisjoint(questions(held_out))
    assert [p.answer for p in held_out] == ["0", "20"] and len(train) == 13  # every 10th of the 15 distinct problems
    assert len(questions(train) | questions(held_out)) == 15
    out = capsys.readouterr().out  # both loads of the file: one line
    assert out == (f"note: {f}: 15 of 30 records repeat an earlier record's question and are dropped (the first: line "
                   "16 repeats line 1; 1 with another answer, the earlier one kept), so no held-out problem is also a "
                   "training one; 15 remain\n")
    assert len(load_problems(f, "test", whole=True)) == 15  # a held-out file read whole: its repeats dropped too
    assert capsys.readouterr().out.endswith("(the first: line 16 repeats line 1; 1 with another answer, the earlier "
                                            "one kept); 15 remain\n")
    assert len(load_problems(_twenty(tmp_path), "train")) == 18 and capsys.readouterr().out == ""  # no repeats: silent


def test_a_field_far_longer_than_any_context_is_a_one_line_error_naming_its_line(tmp_path):
    """A 10 MB line was accepted and the run died 84 s later trying to allocate 51 GB. Now a field over
    MAX_FIELD_CHARS is refused while the file is read, before a model loads, naming the file and line."""
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]
    rows[6]["question"] = "What is " + "1 + " * 2_500_000 + "1?"  # 10 MB
    f = _write(tmp_path / "big.jsonl", rows)
    with pytest.raises(SystemExit) as info:
        load_train_eval(tyro.cli(grpo.Args, args=["--dataset", f]))
    message = str(info.value)
    assert message.startswith(f"error: {f}:7: record 6 field 'question' is 10,000,010 characters long, over the limit "
                              "of 100,000") and "\n" not in message, message
    from common.data import MAX_FIELD_CHARS

    rows[0]["solution"] = "0 + 0 = 0"  # the first record names the fields
    rows[6]["question"], rows[3]["solution"] = "What is 6 + 6?", "x" * (MAX_FIELD_CHARS + 1)  # a solution, too
    with pytest.raises(SystemExit, match=r"big\.jsonl:4: record 3 field 'solution' is 100,001 characters long"):
        load_problems(_write(tmp_path / "big.jsonl", rows), "test")
    rows[3]["solution"] = "x" * MAX_FIELD_CHARS  # at the limit: accepted
    assert len(load_problems(_write(tmp_path / "big.jsonl", rows), "train")) == 18


def test_a_file_too_small_to_split_is_a_one_line_error(tmp_path, tiny_model_dir):
    one = _write(tmp_path / "one.jsonl", [{"question": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(SystemExit) as info:
        grpo.main(tyro.cli(grpo.Args, args=["--model-name", tiny_model_dir, "--dataset", one,
                                            "--output-dir", str(tmp_path / "runs")]))
    message = str(info.value)
    assert message.startswith(f"error: {one}: 1 record, too few to split") and "\n" not in message, message
    assert "--eval-dataset" in message
    assert len(load_problems(one, whole=True)) == 1  # read whole (the held-out problems from another file), it is fine


def test_a_separate_eval_file_is_read_whole_and_the_same_file_is_split(tmp_path):
    f, g = _twenty(tmp_path), _twenty(tmp_path, "other.jsonl")
    args = tyro.cli(grpo.Args, args=["--dataset", f, "--eval-dataset", g])
    train, held_out = load_train_eval(args)
    assert len(train) == 20 and len(held_out) == 20 and held_out[0].uid == f"{g}:0"
    same = os.path.relpath(f)  # the same file under another name: still one file, split
    train, held_out = load_train_eval(tyro.cli(grpo.Args, args=["--dataset", f, "--eval-dataset", same]))
    assert len(train) == 18 and [p.answer for p in held_out] == ["0", "20"]


def test_a_run_on_a_local_file_evaluates_on_its_held_out_records(tmp_path, tiny_model_dir, capsys):
    f = _twenty(tmp_path)
    out = grpo.main(tyro.cli(grpo.Args, args=[
        "--model-name", tiny_model_dir, "--dataset", f, "--total-steps", "1", "--num-prompts", "4", "--group-size",
        "2", "--max-new-tokens", "4", "--eval-samples", "0", "--output-dir", str(tmp_path / "runs"), "--run-name", "r"]))
    assert out["before"]["eval/num_problems"] == out["after"]["eval/num_problems"] == 2
    with open(os.path.join(out["run_dir"], "samples.jsonl")) as fh:
        samples = [json.loads(line) for line in fh]
    held_out = {"What is 0 + 0?", "What is 10 + 10?"}
    assert {s["question"] for s in samples if s["kind"] == "eval"} == held_out
    assert {s["question"] for s in samples if s["kind"] == "train"}.isdisjoint(held_out)
    assert "points, n=2); run folder" in capsys.readouterr().out


def test_a_testbed_model_on_other_data_warns_early(tmp_path, capsys):
    check_run_args(tyro.cli(grpo.Args, args=["--dataset", _twenty(tmp_path)]))
    out = capsys.readouterr().out
    assert out.startswith("warning: --model-name testbed-weak reads only the testbed's own compact problems")
    assert "pass --model-name" in out and out.count("\n") == 1
    check_run_args(tyro.cli(grpo.Args, args=[]))  # the testbed itself: no warning
    check_run_args(tyro.cli(grpo.Args, args=["--dataset", "x.jsonl", "--model-name", "some/model"]))
    assert capsys.readouterr().out == ""


def test_nonexistent_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        load_model(str(tmp_path / "no-model-here"))


def test_math_prompt_uses_chat_template_when_present(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (p,) = load_problems(_write(tmp_path / "g.jsonl", [{"question": "What is 2+2?", "answer": "4"}]), whole=True)
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


# testbed-nl: the testbed's problems in words (common/testbed_nl.py)


def test_testbed_nl_is_deterministic_with_disjoint_splits_and_graded_levels():
    from common.testbed_nl import split_key

    train = load_problems("testbed-nl", "train", (1, 2, 3, 4, 5), 200, seed=0)
    again = load_problems("testbed-nl", "train", (1, 2, 3, 4, 5), 200, seed=0)
    assert [(p.question, p.answer, p.solution, p.hints, p.uid) for p in train] == [
        (p.question, p.answer, p.solution, p.hints, p.uid) for p in again]
    test = load_problems("testbed-nl", "test", (1, 2, 3, 4, 5), 200, seed=0)
    assert {split_key(p) for p in train}.isdisjoint(split_key(p) for p in test)  # also across names and levels
    assert {p.question for p in train}.isdisjoint(p.question for p in test)
    assert [sum(p.level == lv for p in train) for lv in (1, 2, 3, 4, 5)] == [200] * 5
    assert len({p.question for p in test if p.level == 1}) < 30 < len({p.question for p in test if p.level == 2})
    assert len({p.question for p in test}) == len(test)  # held out: each problem once (level 1 has about 20 sums)
    assert [sum(p.level == lv for p in test) for lv in (2, 3, 4, 5)] == [200] * 4
    assert load_problems("testbed-nl", "train", (2,), 5, seed=1)[0].question != train[200].question
    by_level = {lv: [p for p in train if p.level == lv] for lv in (1, 2, 3, 4, 5)}
    assert all(p.question.count("+") == 1 and int(p.answer) <= 18 for p in by_level[1])
    assert all(p.question.count("+") == 1 and 20 <= int(p.answer) <= 198 for p in by_level[2])
    assert all(p.question.count("+") == 2 for p in by_level[3])
    assert all(p.solution.count(" means ") == 1 for p in by_level[4])
    assert all(p.solution.count(" means ") == 2 and " and then " in p.question for p in by_level[5])
    with pytest.raises(SystemExit, match="^error: --levels 6: testbed-nl has levels"):
        load_problems("testbed-nl", "train", (6,), 1)


def test_testbed_nl_solutions_compute_the_answer_and_knowledge_points_teach_without_the_answer():
    import re

    states = lambda text, answer: answer in re.findall(r"\d+", text)  # noqa: E731 - as a whole number

    for p in load_problems("testbed-nl", "train", (1, 2, 3, 4, 5), 100):
        assert p.task == "nl" and p.solution.endswith(f"The answer is {p.answer}.")
        for a, op, b, c in re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", p.solution):  # every step is true arithmetic
            assert int(a) + (1 if op == "+" else -1) * int(b) == int(c)
        assert len(p.hints) == len(p.hint_helpful) and 1 <= sum(p.hint_helpful) and p.hint_helpful.count(False) == 2
        for hint, helpful in zip(p.hints, p.hint_helpful):
            assert not states(hint, p.answer), (hint, p.answer)  # no knowledge point hands over the answer
            facts = re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", hint)
            assert all(int(a) + (1 if op == "+" else -1) * int(b) == int(c) for a, op, b, c in facts)  # true facts
            if helpful:  # the operation's rule, or a partial sum: a step of the solution, or one from the question
                assert not facts or hint in p.solution or facts[0][0] in p.question, (hint, p.solution)



def test_testbed_nl_prompts_ask_for_the_answer_line_in_every_trainer_renderer(smollm2_dir):
    from benchmarks.claims.claim_runs import added_text, states_answer
    from common.models import load_tokenizer
    from common.testbed_nl import NL_INSTRUCTION
    from grounds import path_of
    from mada_rl import render_critic_prompt
    from oc_grpo import before_result, render_guided_prompt, solution_prefix

    tok = load_tokenizer(path_of("smollm2-135m-instruct"), "")
    p = load_problems("testbed-nl", "test", (4,), 1)[0]
    plain = render_prompt(p, tok)
    assert plain == (f"<|im_start|>system\n<|im_end|>\n<|im_start|>user\n{p.question}\n{NL_INSTRUCTION}<|im_end|>\n"
                     "<|im_start|>assistant\n")
    hinted = render_prompt(p, tok, hints=p.hints)  # AdaKP
    guided = render_guided_prompt(p, tok, solution_prefix(p.solution, 0.5))  # OC-GRPO
    critic = render_critic_prompt(p, ["82", "64"], tok)  # MADA-RL
    for text in (hinted, guided, critic):
        assert p.question in text and text.count(NL_INSTRUCTION) == 1 and "boxed" not in text
    assert all(h in hinted for h in p.hints)
    label = "First steps of a solution, without its final result: "  # testbed-nl: never past the step before it
    assert label + solution_prefix(p.solution, 0.5) in guided or label + before_result(p.solution, p.answer) in guided
    for q in load_problems("testbed-nl", "test", (1, 2, 3, 4, 5), 10):  # no fraction of the guidance states it
        for f in (0.3, 0.6, 1.0):
            added = added_text(render_prompt(q, tok), render_guided_prompt(q, tok, solution_prefix(q.solution, f)))
            assert not states_answer(added, q.answer, tok), (added, q.answer)
            assert added == "" or added.startswith("\n\nFirst steps of a solution, without its final result: ")
    assert "- 82\n- 64\n" in critic
