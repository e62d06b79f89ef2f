"""Problems from the embedded testbed, a local JSONL file, or a Hugging Face dataset; prompts; a resumable sampler.

    --dataset testbed                 the embedded suite (levels from --levels)
    --dataset data/train.jsonl        one JSON object per line
    --dataset openai/gsm8k            any HF dataset (GSM8K, MATH-500 and similar fields)
    --dataset data/                   a local folder of train/test files, read by `datasets`

Field names are detected (question/problem/prompt, answer/ground_truth, solution, level)
or set with the field options. A GSM8K-style answer ("... #### 72") is split into the
final answer and the solution text.
"""

from __future__ import annotations

import json
import os
import random
import re

from common.testbed import Problem, make_suite, render_testbed_prompt

QUESTION_FIELDS = ("question", "problem", "prompt", "query", "input")
ANSWER_FIELDS = ("answer", "ground_truth", "final_answer", "target", "output")
SOLUTION_FIELDS = ("solution", "reasoning", "rationale")
MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def fail(message: str) -> None:
    """Stop with a message in the user's terms (exit status 1, no traceback)."""
    raise SystemExit(f"error: {message}")


def _pick(row: dict, explicit: str | None, candidates: tuple, what: str, source: str, required: bool = True):
    if explicit:
        if explicit not in row:
            fail(f"{source}: field {explicit!r} (given for the {what}) is missing; fields are {sorted(row)}")
        return explicit
    for name in candidates:
        if name in row:
            return name
    if required:
        fail(f"{source}: no {what} field found (tried {list(candidates)}); fields are {sorted(row)}. "
             f"Name it with --{what}-field.")
    return None


def rows_to_problems(rows: list[dict], source: str, question_field=None, answer_field=None, solution_field=None,
                     level_field=None) -> list[Problem]:
    """Map raw records to `Problem`s, checking every record has the fields."""
    if not rows:
        fail(f"{source}: the dataset is empty")
    q_name = _pick(rows[0], question_field, QUESTION_FIELDS, "question", source)
    a_name = _pick(rows[0], answer_field, ANSWER_FIELDS, "answer", source)
    s_name = _pick(rows[0], solution_field, SOLUTION_FIELDS, "solution", source, required=False)
    l_name = level_field or ("level" if "level" in rows[0] else None)
    problems = []
    for i, row in enumerate(rows):
        for name in (q_name, a_name):
            if row.get(name) in (None, ""):
                fail(f"{source}: record {i} has no {name!r} (fields: {sorted(row)})")
        answer, solution = str(row[a_name]), str(row.get(s_name) or "") if s_name else ""
        if "####" in answer:  # GSM8K: "reasoning ... #### 72"
            solution, answer = solution or answer.split("####")[0].strip(), answer.split("####")[-1].strip()
            answer = answer.replace(",", "")
        level = row.get(l_name, 0) if l_name else 0
        if isinstance(level, str):  # MATH: "Level 3"
            digits = re.findall(r"\d+", level)
            level = int(digits[0]) if digits else 0
        problems.append(Problem(question=str(row[q_name]), answer=answer, level=int(level or 0), solution=solution,
                                task="math", uid=str(row.get("id", row.get("unique_id", f"{source}:{i}")))))
    return problems


def load_problems(dataset: str, split: str = "train", levels=(2,), num_problems: int = 0, seed: int = 0,
                  dataset_config: str | None = None, question_field: str | None = None,
                  answer_field: str | None = None, solution_field: str | None = None,
                  level_field: str | None = None) -> list[Problem]:
    """The problems of one split. `num_problems` > 0 keeps the first that many."""
    if dataset == "testbed":
        problems = make_suite("test" if split in ("test", "validation") else "train", levels=tuple(levels),
                              n_per_level=num_problems or 500, seed=seed)
        return problems
    if dataset.endswith((".jsonl", ".json")) and not os.path.isdir(dataset):
        if not os.path.exists(dataset):
            fail(f"dataset file {dataset!r} does not exist")
        rows = []
        with open(dataset) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        fail(f"{dataset}:{n} is not valid JSON ({e.msg})")
        source = dataset
    else:
        try:
            import datasets
        except ImportError:
            fail(f"loading the Hugging Face dataset {dataset!r} needs `pip install datasets`")
        hf_split = split
        try:
            rows = list(datasets.load_dataset(dataset, dataset_config, split=hf_split))
        except Exception as e:  # noqa: BLE001 - the hub/cache raises many types
            fail(f"could not load dataset {dataset!r} (config {dataset_config!r}, split {hf_split!r}): {e}")
        source = dataset
    problems = rows_to_problems(rows, source, question_field, answer_field, solution_field, level_field)
    return problems[:num_problems] if num_problems else problems


def render_prompt(problem: Problem, tokenizer, hints=(), solution_prefix: str | None = None,
                  template: str = MATH_TEMPLATE) -> str:
    """The text the policy sees. Testbed problems use the compact format the testbed models
    were trained on; others use `template` and the tokenizer's chat template when it has one."""
    if problem.task == "testbed":
        return render_testbed_prompt(problem.question, hints, solution_prefix)
    text = template.format(question=problem.question)
    if hints:
        text = "Knowledge points that may help:\n" + "\n".join(f"- {h}" for h in hints) + "\n\n" + text
    if solution_prefix is not None:
        text += f"\n\nPartial reference solution: {solution_prefix}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def encode_prompts(tokenizer, texts: list[str], max_prompt_tokens: int = 0) -> list[list[int]]:
    """Token ids of each prompt (no special tokens added: chat templates carry their own)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_prompt_tokens:
        ids = [x[-max_prompt_tokens:] for x in ids]  # keep the end, where the question is
    return ids


class PromptSampler:
    """Shuffled passes over the problems; its state (epoch, position) is saved in checkpoints."""

    def __init__(self, problems: list, seed: int):
        if not problems:
            fail("no training problems")
        self.problems, self.seed, self.epoch, self.pos = problems, seed, 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list:
        batch = []
        while len(batch) < k:
            if self.pos == len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self._order()
            batch.append(self.problems[self.order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self.order = self._order()
