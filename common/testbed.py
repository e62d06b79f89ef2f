"""The embedded, offline testbed task: a synthetic multi-level reasoning task, and the problem record every source
(testbed, testbed-nl, Hugging Face datasets, JSONL) is read into.

The task is mental addition of single digits, one character per token:

    prompt      Q:7+5+3\\nA:
    completion  15<eos>
    solution    7+5=12 12+3=15

Level L sums more operands (2, 3, 4, 6 and 9 of them). The model answers directly, so longer sums are harder to do
"in its head"; the warm start rarely sees 6 operands and never 9, so accuracy falls from near-perfect at level 1 to
about zero at level 5. The step-by-step solution is what guidance reveals (a prefix gives away partial sums). Every
problem also carries its reference solution (used as a solution prefix for guidance) and candidate knowledge points:
the facts the solution uses (helpful) and true facts it does not use (distractors). The models trained on it are
built in grounds/testbed_models.py."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

LEVELS = (1, 2, 3, 4, 5)
OPERANDS = {1: 2, 2: 3, 3: 4, 4: 6, 5: 9}
"""Level -> number of single-digit operands (the chain has one step fewer)."""
PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


@dataclass
class Problem:
    """One verifiable problem, whatever its source (testbed, HF dataset, JSONL)."""

    question: str
    """the question text, before any prompt template"""
    answer: str
    """the verifiable final answer"""
    level: int = 0
    """difficulty level (testbed: number of addition steps; 0 when unknown)"""
    solution: str = ""
    """a step-by-step reference solution ('' when the source has none)"""
    hints: list = field(default_factory=list)
    """candidate knowledge points (short facts)"""
    hint_helpful: list = field(default_factory=list)
    """for each hint, whether the reference solution uses it"""
    task: str = "testbed"
    """'testbed' (compact prompt, exact integer check), 'math' (chat prompt, math-verify), 'nl' (testbed-nl: chat
    prompt, its own answer rule and format, math-verify) or 'rg' (a reasoning-gym task: chat prompt asking for
    <answer> tags, the task's own scorer)"""
    uid: str = ""
    """stable identifier of the problem"""
    entry: dict | None = None
    """the source's own record, for a verifier that reads more than the answer (task 'rg': the reasoning-gym item, its
    metadata naming the task, for that task's score_answer)"""


# ----------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------


def is_heldout(question: str) -> bool:
    """A fixed quarter of all possible questions is held out for evaluation, at every level."""
    return zlib.crc32(question.encode()) % 4 == 0


def is_calibration(question: str) -> bool:
    """Another fixed quarter: at level 3 the warm start never trains on it and measures its stopping
    rule there (disjoint from the held-out evaluation quarter)."""
    return zlib.crc32(question.encode()) % 4 == 1


def make_problem(operands: list[int], rng: random.Random, level: int = 0) -> Problem:
    """Build the question, reference solution and knowledge points for one operand list.

    >>> make_problem([7, 5, 3], random.Random(0)).solution
    '7+5=12 12+3=15'
    """
    steps, total = [], operands[0]
    for x in operands[1:]:
        steps.append(f"{total}+{x}={total + x}")
        total += x
    question = "+".join(str(x) for x in operands)
    distractors = []
    while len(distractors) < 2:
        a, b = rng.randint(1, 9 * len(operands)), rng.randint(1, 9)
        fact = f"{a}+{b}={a + b}"
        if fact not in steps and fact not in distractors:
            distractors.append(fact)
    helpful = steps[-2:]  # the late steps are where long chains go wrong
    hints = [(h, True) for h in helpful] + [(d, False) for d in distractors]
    rng.shuffle(hints)
    return Problem(
        question=question,
        answer=str(total),
        level=level,
        solution=" ".join(steps),
        hints=[h for h, _ in hints],
        hint_helpful=[u for _, u in hints],
        task="testbed",
        uid=f"L{level}:{question}",
    )


def make_suite(split: str, levels=LEVELS, n_per_level: int = 500, seed: int = 0) -> list[Problem]:
    """`n_per_level` problems per level from the `split` ('train' or 'test') side of the fixed split.

    Deterministic in (split, levels, n_per_level, seed). A level with fewer distinct
    questions than asked for (level 1 has 81 in all) repeats them.
    """
    if split not in ("train", "test", "calib"):
        raise ValueError(f"split must be 'train', 'test' or 'calib', got {split!r}")
    want_test = split == "test"
    problems = []
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"testbed level {level} does not exist; levels are {LEVELS}")
        rng = random.Random(f"{seed}-{split}-{level}")
        seen, count, tries = set(), 0, 0
        while count < n_per_level:
            operands = [rng.randint(1, 9) for _ in range(OPERANDS[level])]
            question = "+".join(map(str, operands))
            tries += 1
            if is_heldout(question) != want_test or split == "calib" and not is_calibration(question):
                continue
            if question in seen and tries < 20 * n_per_level:
                continue
            seen.add(question)
            problems.append(make_problem(operands, rng, level))
            count += 1
    return problems


def render_testbed_prompt(question: str, hints=(), solution_prefix: str | None = None) -> str:
    """The compact prompt the testbed models are trained on; hints and a solution prefix are optional."""
    lines = [f"Hint:{h}\n" for h in hints]
    if solution_prefix is not None:
        lines.append(f"Ref:{solution_prefix}\n")
    return "".join(lines) + f"Q:{question}\nA:"
