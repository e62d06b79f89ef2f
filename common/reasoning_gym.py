"""reasoning-gym's procedural tasks behind `--dataset rg:<task>[,<task>...]` (pip `reasoning-gym`, Apache-2.0).

    --dataset rg:basic_arithmetic --levels 0 1 2     one task, its curriculum levels 0, 1 and 2
    --dataset rg:chain_sum,leg_counting --levels 0    two tasks, level 0 of each

Levels are the task's curriculum levels, from 0, each a band of its own: `set_global_level(k)` read in reasoning-gym's
UPPER_BOUND context, so a range attribute at level k is its k-th value alone (basic_arithmetic level 1: exactly 3
terms of 2 digits), or for an attribute reasoning-gym keeps an interval, its k-th to (k+1)-th values (adjacent levels
meet at that one value). A task has as many levels as its configuration keeps changing (basic_arithmetic 5,
leg_counting 36, zebra_puzzles 6); a level past that would repeat the last, so it is refused.

Item i of a split comes from reasoning-gym's seed base + i, the held-out and training bases 100,000 apart (the
held-out block first), so the two splits never share a seed and the held-out set is fixed by --seed. Small levels
repeat questions under other seeds (basic_arithmetic level 0 has a few hundred), so a training problem whose question
is also held out is dropped (common.data.load_train_eval).

Each Problem carries the item (`Problem.entry`: question, answer, metadata naming its task) so that the task's own
`score_answer` scores it (common.verifiers, in a worker process with a time limit). Items have no reference
solution and no knowledge points: oc_grpo's guidance and adakp's hints have nothing to show on them.
"""

from __future__ import annotations

import difflib
import functools
import os

from common.problem import Problem

PREFIX = "rg:"
SPLIT_SEEDS = 100_000
"""Seeds reserved to one split of one --seed: its problems per level are at most this many."""


def fail(message: str):
    """common.args.fail, which imports this module to check --dataset rg:... before any model work."""
    raise SystemExit(f"error: {message}")


def _rg():
    try:
        import reasoning_gym.factory as factory
    except ImportError:
        fail("--dataset rg:... needs reasoning-gym: pip install reasoning-gym==0.1.25 (requirements.txt)")
    return factory


def is_rg(dataset: str) -> bool:
    return dataset.startswith(PREFIX)


@functools.cache
def num_levels(task: str) -> int:
    """How many levels the task's curriculum has: the global levels whose configuration differs from the one below."""
    configs = []
    curriculum = _rg().create_curriculum(task)
    for level in range(max(len(a.levels) for a in curriculum.attributes.values())):
        configs.append(repr(config_at(task, level, 0, 1)))
        if len(configs) > 1 and configs[-1] == configs[-2]:
            return level
    return len(configs)


def config_at(task: str, level: int, seed: int, size: int):
    """The task's dataset configuration at curriculum `level`, a band of its own (UPPER_BOUND), for items
    seed .. seed + size - 1."""
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode

    curriculum = _rg().create_curriculum(task)
    curriculum.set_global_level(level)
    return curriculum.generate_configuration({"seed": seed, "size": size},
                                             DefaultCurriculumContext(mode=RangeAttributeMode.UPPER_BOUND))


def check_spec(dataset: str, levels) -> list[str]:
    """The task names of `rg:<task>[,<task>...]`; a one-line error for a missing or unknown task, one without a
    curriculum, or a level a task does not have (none of these needs a model)."""
    factory = _rg()
    tasks = [t.strip() for t in dataset[len(PREFIX):].split(",")]
    with_levels = sorted(factory.CURRICULA)
    for task in tasks:
        if task not in with_levels:
            close = difflib.get_close_matches(task, with_levels, n=1)
            why = ("a task name is missing" if not task else f"reasoning-gym's {task} has no curriculum (no levels)"
                   if task in factory.DATASETS else f"reasoning-gym has no task {task!r}")
            fail(f"--dataset {dataset}: {why}{f' (did you mean {close[0]}?)' if close else ''}; the tasks with levels "
                 f"are {', '.join(with_levels)}")
        bad = [lv for lv in levels if not 0 <= lv < num_levels(task)]
        if bad:
            fail(f"--levels {' '.join(map(str, bad))}: reasoning-gym's {task} has levels "
                 f"{' '.join(map(str, range(num_levels(task))))}")
    return tasks


def make_rg_problems(dataset: str, split: str, levels, n_per_level: int = 500, seed: int = 0) -> list[Problem]:
    """`n_per_level` problems of each task at each level from the `split` ('train', or 'test'/'validation': held out)
    seeds, in the order task, level, seed. Deterministic in its arguments."""
    if not 0 < n_per_level <= SPLIT_SEEDS:
        fail(f"reasoning-gym: {n_per_level} problems a level; at most {SPLIT_SEEDS:,} (common/reasoning_gym.py)")
    held_out = split in ("test", "validation")
    base = (2 * (seed % 10_000) + (not held_out)) * SPLIT_SEEDS  # below 2**31: pool_matrix seeds numpy with it
    problems = []
    for task in check_spec(dataset, levels):
        dataset_cls = _rg().DATASETS[task][0]
        for level in levels:
            try:  # a few levels fail in reasoning-gym itself (countdown 3, knight_swap 0: docs/runs.md)
                data = dataset_cls(config=config_at(task, level, base, n_per_level))
                items = [data[i] for i in range(n_per_level)]
            except Exception as e:  # noqa: BLE001
                fail(f"reasoning-gym could not generate {task} at level {level}: {type(e).__name__}: "
                     f"{' '.join(str(e).split())}; use another level")
            problems += [Problem(item["question"], str(item["answer"]), level, task="rg", entry=item,
                                 uid=f"rg:{task}:L{level}:{base + i}") for i, item in enumerate(items)]
    return problems


def without_held_out(train: list[Problem], held_out: list[Problem]) -> list[Problem]:
    """The training problems whose question is not also a held-out one (a small level repeats questions)."""
    seen = {p.question for p in held_out}
    kept = [p for p in train if p.question not in seen]
    if len(kept) < len(train) and os.environ.get("RANK", "0") == "0":
        print(f"note: reasoning-gym: {len(train) - len(kept)} of {len(train)} training problems ask a held-out "
              f"question and are dropped; {len(kept)} remain")
    if not kept:
        fail(f"reasoning-gym: all {len(train)} training problems are also held-out questions (the levels are too "
             "small for --num-eval-problems); lower it or use higher levels")
    return kept


@functools.lru_cache(maxsize=64)
def _scorer(task: str, level: int):
    return _rg().DATASETS[task][0](config=config_at(task, level, 0, 1))


def rg_score(answer: str, entry: dict, level: int) -> float:
    """The task's own score of `answer` for the item `entry` (in [0, 1]; partial credit where the task gives it), by
    the dataset of the item's level (a few scorers read their configuration). Runs in a verifier worker."""
    return float(_scorer(entry["metadata"]["source_dataset"], level).score_answer(answer, entry))
