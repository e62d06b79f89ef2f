"""--dataset rg:<task>: reasoning-gym's tasks by name, their levels as disjoint bands, disjoint seeds for training and
held-out problems, the tasks' own scorers (partial credit, a time limit), the answer extraction, one-line errors, and
two trainer steps on the testbed model and on SmolLM2."""

import os

import pytest
import tyro

import grpo
import rloo_sec
from common.args import check_run_args
from common.data import RG_INSTRUCTION, load_problems, render_prompt
from common.logger import read_metrics
from common.reasoning_gym import num_levels
from common.data import load_train_eval
from common.verifiers import extract_rg_answer, format_reward, score

TINY = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "16", "--num-train-problems", "4",
        "--num-eval-problems", "2", "--eval-samples", "0", "--eval-every", "0"]


def test_a_task_round_trips_through_its_own_scorer():
    """Generated, answered with the gold (in the asked-for tags, or in the model's own words): score 1; a wrong
    answer scores 0; a truncated reply 0."""
    problems = load_problems("rg:basic_arithmetic,leg_counting,spell_backward", "test", (0, 1), 3)
    assert len(problems) == 3 * 2 * 3 and {p.task for p in problems} == {"rg"}
    assert all(p.entry["answer"] == p.answer and p.entry["question"] == p.question for p in problems)
    tagged = [f"Let me think.\n<answer>{p.answer}</answer>" for p in problems]
    assert score(tagged, problems, timeout=60) == [1.0] * 18  # timeout: a cold worker pool starts slowly
    numeric = [p for p in problems if p.entry["metadata"]["source_dataset"] != "spell_backward"]
    said = [f"The final answer to the given problem is {p.answer}." for p in numeric]
    assert score(said, numeric) == [1.0] * len(numeric)
    assert score(["<answer>none</answer>"] * len(numeric), numeric) == [0.0] * len(numeric)
    assert score([f"<answer>{p.answer}</answer>" for p in problems], problems, [True] * 18) == [0.0] * 18


def test_partial_credit_is_the_tasks_own():
    """basic_arithmetic gives len(gold) / len(answer) to an answer that contains the gold: the reward is that
    fraction, not rounded to 0 or 1."""
    (p,) = load_problems("rg:basic_arithmetic", "test", (0,), 1)
    (r,) = score([f"<answer>{p.answer} or so</answer>"], [p])
    assert r == pytest.approx(len(p.answer) / len(p.answer + " or so"))


def test_a_hung_scorer_scores_0_and_the_other_answers_are_still_scored():
    """simple_integration's scorer hands the answer to SymPy, which computes 9**9**9**9 for hours: cut at the time
    limit in its worker, scored 0, and the answer queued behind it still scored."""
    problems = load_problems("rg:simple_integration", "test", (0,), 2)
    answers = ["<answer>9**9**9**9</answer>", f"<answer>{problems[1].answer}</answer>"]
    assert score(answers, problems, timeout=5.0) == [0.0, 1.0]


def test_answer_extraction_tags_then_the_models_own_phrasing():
    assert extract_rg_answer("7 + 2 = 9, so <answer>9</answer>") == "9"
    assert extract_rg_answer("<answer>8</answer> no, <answer> 9 </answer>") == "9"  # the last pair
    assert extract_rg_answer("reasoning...\n<answer>new") == "new"  # never closed: the rest of the reply
    assert extract_rg_answer("The final answer to the given arithmetic problem is 6.") == "6"
    assert extract_rg_answer("The answer is **1,617**.") == "1617"
    assert extract_rg_answer('The answer is "tsoelet".') == "tsoelet"
    assert extract_rg_answer("So there are 4 * 6 = 24 legs.") == "24"  # no answer line: the last number
    assert extract_rg_answer("\\boxed{12}") == "12" and extract_rg_answer("I do not know.") is None
    assert format_reward("so <answer>6</answer>", "rg") == 1.0 and format_reward("The answer is 6.", "rg") == 0.0


def test_levels_are_disjoint_bands():
    """basic_arithmetic's level k has exactly k + 2 terms of k + 1 digits (reasoning-gym's UPPER_BOUND context);
    the default INCLUSIVE context would put 2-term sums at every level."""
    problems = load_problems("rg:basic_arithmetic", "train", (0, 1, 2), 30)
    for level in (0, 1, 2):
        meta = [p.entry["metadata"] for p in problems if p.level == level]
        assert len(meta) == 30
        assert {m["num_terms"] for m in meta} == {level + 2}
        assert {m["difficulty"]["num_digits"] for m in meta} == {(level + 1, level + 1)}
    assert num_levels("basic_arithmetic") == 5 and num_levels("leg_counting") == 36


def test_training_and_held_out_problems_come_from_disjoint_seeds():
    """The held-out set is fixed by --seed; no training seed is a held-out seed, and a question drawn by both (level 0
    of basic_arithmetic has a few hundred) is dropped from training."""
    args = tyro.cli(grpo.Args, args=["--dataset", "rg:basic_arithmetic", "--levels", "0", "--num-train-problems",
                                     "300", "--num-eval-problems", "100"])
    train, held_out = load_train_eval(args)
    seeds = lambda ps: {p.uid.rsplit(":", 1)[1] for p in ps}  # noqa: E731
    assert len(held_out) == 100 and seeds(train).isdisjoint(seeds(held_out))
    assert {p.question for p in train}.isdisjoint(p.question for p in held_out)
    assert 0 < len(train) < 300  # some training questions were also held out, and were dropped
    again = load_problems("rg:basic_arithmetic", "test", (0,), 100, seed=args.seed)
    assert [p.question for p in again] == [p.question for p in held_out]
    other = load_problems("rg:basic_arithmetic", "test", (0,), 100, seed=args.seed + 1)
    assert seeds(other).isdisjoint(seeds(held_out))


@pytest.mark.parametrize("dataset, levels, says", [
    ("rg:basic_arithmatic", "0", "has no task 'basic_arithmatic' (did you mean basic_arithmetic?)"),
    ("rg:", "0", "a task name is missing"),
    ("rg:chain_sum,", "0", "a task name is missing"),
    ("rg:acre", "0", "acre has no curriculum"),
    ("rg:basic_arithmetic", "5", "--levels 5: reasoning-gym's basic_arithmetic has levels 0 1 2 3 4"),
])
def test_a_bad_task_or_level_is_one_line_before_any_model_work(dataset, levels, says, tmp_path):
    args = tyro.cli(grpo.Args, args=["--dataset", dataset, "--levels", levels, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        check_run_args(args)  # what every trainer calls first, before a tokenizer or a model loads
    message = str(e.value)
    assert says in message and "\n" not in message
    if "levels 0 1" not in says:
        assert "basic_arithmetic, bf, binary_alternation" in message  # the tasks that exist


def test_a_level_reasoning_gym_cannot_generate_is_one_line():
    with pytest.raises(SystemExit, match=r"could not generate knight_swap at level 0: AssertionError: min_nodes") as e:
        load_problems("rg:knight_swap", "test", (0,), 2)  # its level-0 band has 5 nodes, its validation wants 6
    assert "\n" not in str(e.value)


def test_the_prompt_asks_for_the_answer_tags(smollm2_dir):
    from common.models import load_tokenizer

    (p,) = load_problems("rg:gcd", "test", (0,), 1)
    text = render_prompt(p, load_tokenizer(smollm2_dir))
    assert p.question + "\n" + RG_INSTRUCTION in text and "<answer>" in RG_INSTRUCTION
    assert text.endswith("<|im_start|>assistant\n")


def test_two_steps_on_the_testbed_model_with_levels_as_arms(tmp_path, weak_model_dir):
    """The testbed model cannot read these problems (its rewards are about 0), but the run goes through: rloo_sec's
    arms are the task's levels."""
    out = rloo_sec.main(tyro.cli(rloo_sec.Args, args=[
        "--output-dir", str(tmp_path), *TINY, "--dataset", "rg:leg_counting", "--levels", "0", "1",
        "--total-steps", "2"]))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sec/level_frac/level_0"] + r["sec/level_frac/level_1"] == pytest.approx(1.0) for r in rows)
    assert {"eval/greedy_accuracy/level_0", "eval/greedy_accuracy/level_1"} <= set(out["after"])


def test_two_steps_on_smollm2(tmp_path, smollm2_dir):
    out = grpo.main(tyro.cli(grpo.Args, args=[
        "--output-dir", str(tmp_path), *TINY, "--model-name", "smollm2-135m-instruct", "--dataset", "rg:chain_sum",
        "--levels", "0", "--num-prompts", "1", "--total-steps", "2"]))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert out["after"]["eval/num_problems"] == 2


def test_a_scorer_module_that_is_not_installed_does_not_break_the_worker_pool():
    """Workers import their scorers when they start; one that is missing must not kill them (a pool whose workers
    die is rebuilt, again and again): the job runs, and a job needing the module raises and has no result."""
    import importlib

    from common.verifiers import run_limited

    assert run_limited(int, {0: ("7",)}, 30.0, ("no_such_scorer_module",)) == {0: 7}
    assert run_limited(importlib.import_module, {1: ("no_such_scorer_module",)}, 30.0) == {}
