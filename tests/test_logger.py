"""What a user reads from a run: metrics.jsonl is valid JSON whatever the values, and a sample's console line shows
its question, not the prompt's end (which a chat template makes the same on every line)."""

import json

import torch

from common.logger import RunLogger, console_sample, sample_rows
from common.rollout import attach
from common.testbed import Problem


def strict_rows(path: str) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_metrics_rows_are_strict_json_with_nan_and_inf_as_null(tmp_path):
    from common.args import ExperimentArgs

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
