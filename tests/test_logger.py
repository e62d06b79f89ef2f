"""What a user reads from a run: metrics.jsonl is valid JSON whatever the values, with one row per step; a sample's
console line shows its question, not the prompt's end (which a chat template makes the same on every line), and the
sample keeps a real prompt whole; the final line says how many held-out problems its accuracy is over; curve.png
draws a trainer's own metrics when asked."""

import contextlib
import io
import json
import os

import pytest
import torch
import tyro
from PIL import Image

import grpo
from common.args import ExperimentArgs, RunArgs
from common.logger import RunLogger, console_sample, read_metrics, sample_rows
from common.rollout import attach
from common.problem import Problem


def strict_rows(path: str) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_metrics_rows_are_strict_json_with_nan_and_inf_as_null(tmp_path):
    logger = RunLogger(ExperimentArgs(), str(tmp_path))
    logger.log(1, {"sec/mean_abs_adv/arm_3": float("nan"), "policy/ratio_max": float("inf"), "reward/mean": 0.5,
                   "x/tensor": torch.tensor(float("-inf")), "x/list": [1.0, float("nan")]}, bar=None)
    logger.close(plot=False)
    (row,) = strict_rows(tmp_path / "metrics.jsonl")
    assert row["sec/mean_abs_adv/arm_3"] is None and row["policy/ratio_max"] is None and row["x/tensor"] is None
    assert row["x/list"] == [1.0, None] and row["reward/mean"] == 0.5


def test_console_sample_shows_the_question_of_a_chat_prompt(smollm2_dir):
    from common.data import render_prompt
    from common.models import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    problems = [Problem("Tom has 3 apples and gets 4 more. How many now?", "7", task="nl"),
                Problem("Anna has 9 cards and gives away 2. How many now?", "7", task="nl")]
    prompts = [tok(render_prompt(p, tok), add_special_tokens=False)["input_ids"] for p in problems]
    answer = tok("3 + 4 = 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rollouts = attach(prompts, [(answer, "3 + 4 = 7", False)] * 2, tok.pad_token_id)
    rows = sample_rows(tok, rollouts, problems, k=2)
    lines = [console_sample(1, "train", i, r) for i, r in enumerate(rows)]
    assert [r["question"] for r in rows] == [p.question for p in problems]  # whole, in samples.jsonl
    assert "Tom has 3 apples" in lines[0] and "Anna has 9 cards" in lines[1]
    assert all(r["prompt_tail"].endswith("<|im_start|>assistant\n") for r in rows)  # the prompt's end is kept too


def test_a_second_log_at_a_step_joins_that_steps_row_also_after_a_resume(tmp_path, capsys):
    logger = RunLogger(ExperimentArgs(), str(tmp_path))
    logger.log(0, {"eval/greedy_accuracy": 0.25})
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.75, "perf/step_time": 1.0})
    logger.log(2, {"eval/greedy_accuracy": 0.5})  # the final evaluation, at the last step
    logger.close(plot=False)
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows == read_metrics(tmp_path / "metrics.jsonl")
    assert rows[2]["reward/mean"] == 0.75 and rows[2]["eval/greedy_accuracy"] == 0.5
    assert capsys.readouterr().out.splitlines()[-1] == "step    2 greedy_accuracy=0.5"  # the console: what is new
    # a run resumed from the checkpoint of step 2 evaluates at step 2 again: the same row, rewritten
    logger = RunLogger(RunArgs(resume=str(tmp_path)), str(tmp_path))
    logger.log(2, {"eval/greedy_accuracy": 0.625})
    logger.close(plot=False)
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["reward/mean"] == 0.75
    assert rows[2]["eval/greedy_accuracy"] == 0.625


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model_dir):
    """A 2-step grpo.py run on the testbed (evaluated at step 1 and at the end), with its console output."""
    tmp = tmp_path_factory.mktemp("run")
    with contextlib.redirect_stdout(io.StringIO()) as console:
        out = grpo.main(tyro.cli(grpo.Args, args=[
            "--model-name", tiny_model_dir, "--total-steps", "2", "--eval-every", "1", "--num-prompts", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "3", "--eval-samples", "0",
            "--output-dir", str(tmp), "--run-name", "r"]))
    return out, console.getvalue()


def test_a_first_evaluation_of_cut_answers_is_said_before_training_and_the_step_line_shows_the_cut_fraction(grpo_run):
    """A random model never ends an answer within 4 tokens: the step-0 evaluation already knows every answer was cut
    (they score 0), and one line says so before the first step, naming --max-new-tokens (issue 58: before, a short
    run never said why it learned nothing). Each step's line shows rollout/truncated_frac."""
    out, console = grpo_run
    cut = strict_rows(os.path.join(out["run_dir"], "metrics.jsonl"))[0]["eval/truncated_frac"]
    lines = console.splitlines()
    warned = [i for i, ln in enumerate(lines) if ln.startswith("warning: ") and "--max-new-tokens 4 " in ln]
    assert cut >= 0.5 and len(warned) == 1, console  # once, though the step-1 evaluation is cut as well
    assert lines[warned[0]].startswith(f"warning: {100 * cut:.0f} % of the held-out greedy answers reached "
                                       "--max-new-tokens 4 and were cut")
    steps = [i for i, ln in enumerate(lines) if ln.startswith("step ") and "mean=" in ln]
    assert len(steps) == 2 and warned[0] < steps[0] and all(" truncated_frac=" in lines[i] for i in steps)


def test_answers_mostly_ended_give_no_cut_warning(tmp_path, capsys):
    logger = RunLogger(RunArgs(max_new_tokens=48), str(tmp_path))
    logger.log(0, {"eval/greedy_accuracy": 0.3, "eval/truncated_frac": 0.45})
    logger.close(plot=False)
    assert "warning" not in capsys.readouterr().out


def test_a_run_writes_one_metrics_row_per_step(grpo_run):
    out, _ = grpo_run
    rows = strict_rows(os.path.join(out["run_dir"], "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "reward/mean" in rows[2] and rows[2]["eval/greedy_accuracy"] == out["after"]["eval/greedy_accuracy"]


def test_the_final_line_says_how_many_held_out_problems(grpo_run):
    out, console = grpo_run
    last = console.strip().splitlines()[-1]
    assert last.startswith("held-out greedy accuracy: ") and "points, n=3); run folder" in last, last


def test_curve_draws_a_trainers_own_metrics_in_a_second_panel(tmp_path, capsys):
    logger = RunLogger(ExperimentArgs(), str(tmp_path), extra=("sec/prob/",))
    for step, p in ((1, 0.5), (2, 0.75)):
        logger.log(step, {"reward/mean": p, "sec/prob/arm_1": p, "sec/prob/arm_2": 1 - p, "sec/q/arm_1": 0.1})
    logger.close()
    assert capsys.readouterr().out.splitlines()[-1] == "step    2 mean=0.75 prob[1/2]=0.75/0.25"  # labelled by arm
    drawn = Image.open(tmp_path / "curve.png").text["Description"]
    assert drawn == "curves: reward/mean, sec/prob/arm_1, sec/prob/arm_2", drawn


def test_curve_names_its_run_and_the_k_of_pass_at_k(tmp_path):
    run = tmp_path / "grpo_seed3"
    logger = RunLogger(ExperimentArgs(), str(run))
    for step in (0, 10):
        logger.log(step, {"reward/mean": 0.5, "eval/greedy_accuracy": 0.4, "eval/pass_at_k": 0.7, "eval/pass_k": 4})
    logger.close()
    png = Image.open(run / "curve.png").text
    assert png["Title"] == "grpo_seed3: reward on training rollouts, accuracy on held-out problems", png
    assert png["Description"] == "curves: reward/mean, eval/greedy_accuracy, eval/pass_at_k (k = 4)", png


def test_a_sample_keeps_a_gsm8k_prompt_whole(smollm2_dir):
    from common.data import render_prompt
    from common.models import load_tokenizer

    tok = load_tokenizer(smollm2_dir)  # the template's default system turn: about 100 characters
    question = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
                "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
                "duck egg. ") * 3 + "How much in dollars does she make every day at the farmers' market?"
    prompt = render_prompt(Problem(question, "18", task="math"), tok)
    assert len(prompt) > 700
    rollouts = attach([tok(prompt, add_special_tokens=False)["input_ids"]], [([tok.eos_token_id], "", False)],
                      tok.pad_token_id)
    (row,) = sample_rows(tok, rollouts, [Problem(question, "18", task="math")], k=1)
    assert row["prompt_tail"] == prompt and row["prompt_tail"].startswith("<|im_start|>system")
