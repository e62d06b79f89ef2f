"""The testbed's problems as natural-language questions (`--dataset testbed-nl`), for pretrained chat models.

Five levels, built locally and offline, each problem with a step-by-step reference solution and knowledge points:

    1  What is 3 + 5?                                          two one-digit numbers
    2  What is 47 + 35?                                        two two-digit numbers
    3  What is 47 + 35 + 16?                                   three two-digit numbers
    4  Tom has 47 apples. He buys 35 more. How many apples     a one-step word problem (add or take away)
       does he have now?
    5  Tom has 47 apples. He buys 35 more and then gives 18    a two-step word problem
       away. How many apples does he have now?

The reference solution works it out in sentences and ends with the answer line the prompt asks for, e.g. level 2:
"Add the tens: 40 + 30 = 70. Add the ones: 7 + 5 = 12. Then 70 + 12 = 82. The answer is 82." OC-GRPO's guidance is
its steps before the one that states the result (oc_grpo.render_guided_prompt). The knowledge points (AdaKP's hints)
teach without stating the result: helpful ones are the operation's rule or a partial sum that is not the answer,
distractors true facts of the same kind that the solution does not use. The train/test split is disjoint by the
arithmetic (the numbers and operations, whatever the names and objects), a fixed quarter held out by
common.testbed.is_heldout.

Answers are checked by common.verifiers (task 'nl'): the last \\boxed{} if there is one, else the number after the
last "answer is", else the last number of the reply; format_reward asks for a reply that ends with "The answer is N."
"""

from __future__ import annotations

import random
import re

from common.problem import Problem
from common.testbed import is_heldout

NL_LEVELS = (1, 2, 3, 4, 5)
VERSION = 2
"""which problems and contexts this file builds, kept in claim records (benchmarks/claims/claim_runs.py) so that a
run made on others is never read back. 1: knowledge points stated the answer, held-out level 1 repeated its sums;
2: neither (the same problems otherwise)"""
NL_INSTRUCTION = 'First write the sum with its result. Then end with "The answer is" and that number.'
"""The answer-format instruction common.data.render_prompt puts after every testbed-nl question (chosen on measured
zero-shot replies of SmolLM2-135M-Instruct: benchmarks/smollm2_zero_shot.md)."""
NAMES = (("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"), ("Lily", "she"))
THINGS = ("apples", "marbles", "stickers", "books", "coins", "cards")
EVENTS = {  # verb phrase (with {n}), the rule in words, and the sign of the change
    "buys": ("buys {n} more", "Buying more means adding.", +1),
    "finds": ("finds {n} more", "Finding more means adding.", +1),
    "gets": ("gets {n} more from a friend", "Getting more means adding.", +1),
    "gives": ("gives {n} away", "Giving some away means taking away.", -1),
    "loses": ("loses {n}", "Losing some means taking away.", -1),
    "sells": ("sells {n}", "Selling some means taking away.", -1),
}


def _sum_steps(a: int, b: int) -> list[str]:
    """The sentences that add two numbers: a one-digit sum at once, larger ones by tens and ones."""
    if a < 10 and b < 10:
        return [f"{a} + {b} = {a + b}."]
    tens, ones = (a // 10 + b // 10) * 10, a % 10 + b % 10
    return [f"Add the tens: {a // 10 * 10} + {b // 10 * 10} = {tens}.", f"Add the ones: {a % 10} + {b % 10} = {ones}.",
            f"Then {tens} + {ones} = {a + b}."]


def _knowledge(level: int, terms: list, steps: list, moves: list) -> list[str]:
    """Knowledge points that teach without stating the result, most telling first: the operation's rule or a partial
    sum (`moves`: a word problem's (start, rule, sign, n) a change). Level 1 has one, as in VERSION 1."""
    if level == 1:
        return [f"To add {min(terms)}, count on {min(terms)} from {max(terms)}."]
    if level == 2:
        return [*steps[:2], "Add the tens, then the ones, then put the two sums together."]
    if level == 3:
        return [steps[0].removeprefix("First "), "Add the first two numbers, then add the third to their sum."]
    (start, rule, sign, n), tens = moves[0], moves[0][3] // 10 * 10  # a change's tens first: a partial result
    return [rule, f"{start} {'+' if sign > 0 else '-'} {tens} = {start + sign * tens}.",
            f"{'Add' if sign > 0 else 'Take away'} the tens first, then the ones."] if level == 4 else \
        [steps[1], moves[1][1], rule]  # level 5: the first change's result, the second change's rule, the first's


def _fact(rng: random.Random, digits: int) -> str:
    """A true sum of the same shape as the solution's (a distractor when the solution does not use it)."""
    a, b = (rng.randint(1, 9), rng.randint(1, 9)) if digits == 1 else (rng.randint(1, 9) * 10, rng.randint(1, 9) * 10)
    return f"{a} + {b} = {a + b}."


def make_nl_problem(level: int, rng: random.Random) -> Problem:
    """One problem of `level`, drawn with `rng`; `uid` is 'nl-L{level}:' plus its arithmetic (its split key).

    >>> p = make_nl_problem(2, random.Random(0))
    >>> p.question, p.answer
    ('What is 59 + 63?', '122')
    >>> p.solution
    'Add the tens: 50 + 60 = 110. Add the ones: 9 + 3 = 12. Then 110 + 12 = 122. The answer is 122.'
    """
    if level in (1, 2, 3):
        lo, hi = (1, 9) if level == 1 else (10, 99)
        terms = [rng.randint(lo, hi) for _ in range(3 if level == 3 else 2)]
        question = "What is " + " + ".join(map(str, terms)) + "?"
        if level == 3:
            steps = [f"First {terms[0]} + {terms[1]} = {terms[0] + terms[1]}.",
                     f"Then {terms[0] + terms[1]} + {terms[2]} = {sum(terms)}."]
        else:
            steps = _sum_steps(*terms)
        total, key, moves = sum(terms), "+".join(map(str, terms)), []
    else:
        (name, pronoun), things = rng.choice(NAMES), rng.choice(THINGS)
        events = rng.sample(sorted(EVENTS), 2 if level == 5 else 1)
        start = rng.randint(20, 99)
        total, key, clauses, steps, moves = start, str(start), [], [], []
        for event in events:
            phrase, rule, sign = EVENTS[event]
            n = rng.randint(10, 99) if sign > 0 else rng.randint(10, max(10, total - 10))
            clauses.append(phrase.format(n=n))
            new = total + sign * n
            steps += [rule, f"{total} {'+' if sign > 0 else '-'} {n} = {new}."]
            moves.append((total, rule, sign, n))
            total, key = new, key + f"{'+' if sign > 0 else '-'}{n}"
        question = (f"{name} has {start} {things}. {pronoun.capitalize()} {' and then '.join(clauses)}. "
                    f"How many {things} does {pronoun} have now?")
    solution, answer = " ".join(steps + [f"The answer is {total}."]), str(total)
    states = lambda text: answer in re.findall(r"\d+", text)  # noqa: E731 - as a whole number
    helpful = [k for k in _knowledge(level, terms if level <= 3 else [], steps, moves) if not states(k)][:2]
    # word problems: a rule the solution does not use; then facts (these draws as in VERSION 1: the same problems)
    distractors = [rng.choice([r for _, r, _ in EVENTS.values() if r not in [m[1] for m in moves]])] if moves else []
    while len(distractors) < 2:
        fact = _fact(rng, 1 if level == 1 else 2)
        if fact not in solution and fact not in distractors:
            distractors.append(fact)
    spare = random.Random(f"{level}-{solution}")  # a distractor that states the answer is drawn again, from here
    for i, d in enumerate(distractors):
        while states(d) or d in solution or d in distractors[:i] + helpful:
            d = distractors[i] = _fact(spare, 1 if level == 1 else 2)
    hints = [(h, True) for h in helpful] + [(d, False) for d in distractors]
    rng.shuffle(hints)
    return Problem(question=question, answer=answer, level=level, solution=solution,
                   hints=[h for h, _ in hints], hint_helpful=[u for _, u in hints], task="nl", uid=f"nl-L{level}:{key}")


def split_key(problem: Problem) -> str:
    """What decides a problem's split: its arithmetic ('47+35', '47+35-18'), held out at every level, under any name."""
    return problem.uid.split(":", 1)[1]


def make_nl_suite(split: str, levels=NL_LEVELS, n_per_level: int = 500, seed: int = 0) -> list[Problem]:
    """`n_per_level` problems per level from the `split` ('train' or 'test') side of the fixed split, deterministic in
    its arguments. A level with fewer (level 1: 81 sums, 20 held out) repeats training ones, never held-out ones."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    problems = []
    for level in levels:
        if level not in NL_LEVELS:
            raise SystemExit(f"error: --levels {level}: testbed-nl has levels {list(NL_LEVELS)}")
        rng = random.Random(f"nl-{seed}-{split}-{level}")
        seen, tries = set(), 0
        while sum(p.level == level for p in problems) < n_per_level:
            p = make_nl_problem(level, rng)
            tries += 1
            if is_heldout(split_key(p)) != (split == "test"):
                continue
            if split == "test" and tries > 20 * n_per_level:
                break
            if p.question in seen and (tries < 20 * n_per_level or split == "test"):
                continue
            seen.add(p.question)
            problems.append(p)
    return problems
