"""The record every dataset is read into: the testbed, testbed-nl, a local JSONL file and a Hugging Face dataset all
give `Problem`s (common/data.py reads them; common/verifiers.py checks answers against them)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
