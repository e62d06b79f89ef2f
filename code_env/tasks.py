"""Code-optimisation tasks for RLPF: embedded tasks, a JSONL loader, program extraction and judging (the
embedded default policy `testbed-code` is built in grounds/code_model.py).

A task is a statement, a function signature, hidden correctness tests (argument tuples), timing
inputs (large enough that the slow baseline and the fast reference differ far beyond timing
noise; the first is the warm-up), a slow baseline and a fast reference. Expected outputs are
the fast reference's, computed in the sandbox (a reference from a JSONL file is not trusted
more than a candidate).

    sum_range        solve(n) = sum(range(n))                     loop vs n(n-1)/2
    sum_squares      solve(n) = sum(i*i for i in range(n))         loop vs closed form
    count_multiples  solve(n, k) = #{0 <= i < n : k | i}           loop vs ceil(n/k)
    has_duplicate    solve(xs) = whether a value repeats            O(n^2) scans vs a set
    count_common     solve(xs, ys) = #{x in xs : x occurs in ys}    list membership vs a set

JSONL format, one task per line: {"name", "statement", "signature", "tests": [[args...], ...],
"timing": [[args...], ...] (at least 2: warm-up + timed), "slow": source, "fast": source},
optional "entry" (default "solve").
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import statistics
import time
from dataclasses import dataclass

from code_env import sandbox
from common.args import fail


@dataclass
class CodeTask:
    name: str
    statement: str
    signature: str
    tests: list
    """hidden correctness inputs: argument tuples"""
    timing: list
    """timing inputs: timing[0] is the warm-up, the rest are timed in turn"""
    slow: str
    """slow baseline program (T_b)"""
    fast: str
    """expert/fast reference program (T_r); its outputs are the expected ones"""
    entry: str = "solve"
    broken: tuple = ()
    """wrong, crashing or non-compiling programs (warm-start mix of the embedded model only)"""
    draw_timing: object = None
    """draw_timing(rng, n): a warm-up and n distinct timed inputs, drawn anew for every judging (`judge`), so that a
    program cannot know them ahead and answer from a table; None: the fixed `timing` list (a task file)"""


def _sizes(lo: int, hi: int, warm: int):
    """Inputs (n,): a warm-up about `warm`, then n distinct sizes in [lo, hi)."""
    return lambda rng, n: [(warm + rng.randrange(1000),)] + [(a,) for a in rng.sample(range(lo, hi), n)]


def _multiples(rng: random.Random, n: int) -> list:
    return [(12_000 + rng.randrange(1000), 3)] + [(a, rng.randrange(3, 12)) for a in
                                                   rng.sample(range(1_100_000, 1_300_000), n)]


def _distinct(rng: random.Random, n: int) -> list:
    """A warm-up list of 300 distinct values, then n lists of 3000 (no repeat: the slow scan runs to the end)."""
    return [(rng.sample(range(10**6), 300),)] + [(rng.sample(range(10**6), 3000),) for _ in range(n)]


def _lists(rng: random.Random, n: int) -> list:
    pair = lambda m: tuple([rng.randrange(4 * m) for _ in range(m)] for _ in range(2))  # noqa: E731
    return [pair(240)] + [pair(2400) for _ in range(n)]


def _embedded(draw, **fields) -> CodeTask:
    """An embedded task: its fixed `timing` (shown in the docs and used where no draw is made) is one draw."""
    return CodeTask(**fields, timing=draw(random.Random(0), 10), draw_timing=draw)


TASKS = {t.name: t for t in [
    _embedded(
        _sizes(1_400_000, 1_600_000, 15_000),
        name="sum_range", statement="Return the sum of all integers from 0 to n - 1 (n >= 0).",
        signature="def solve(n: int) -> int",
        tests=[(0,), (1,), (2,), (10,), (7,), (1000,), (12345,)],
        slow="def solve(n):\n t = 0\n for i in range(n):\n  t += i\n return t\n",
        fast="def solve(n):\n return n * (n - 1) // 2\n",
        broken=("def solve(n):\n return n * (n + 1) // 2\n", "def solve(n):\n return sum(range(n)\n",
                "def solve(n):\n return m * (n - 1) // 2\n", "def solve(n):\n return n * (n - 1) / 2\n")),
    _embedded(
        _sizes(900_000, 1_100_000, 10_000),
        name="sum_squares", statement="Return the sum of i * i for i from 0 to n - 1 (n >= 0).",
        signature="def solve(n: int) -> int",
        tests=[(0,), (1,), (2,), (3,), (10,), (999,)],
        slow="def solve(n):\n t = 0\n for i in range(n):\n  t += i * i\n return t\n",
        fast="def solve(n):\n return (n - 1) * n * (2 * n - 1) // 6\n",
        broken=("def solve(n):\n return n * (n + 1) * (2 * n + 1) // 6\n",
                "def solve(n):\n return sum(i * i for i in n)\n",
                "def solve(n)\n return n * n\n")),
    _embedded(
        _multiples,
        name="count_multiples", statement="Return how many i in 0..n-1 are divisible by k (n >= 0, k >= 1).",
        signature="def solve(n: int, k: int) -> int",
        tests=[(0, 1), (1, 1), (10, 3), (9, 3), (100, 7), (5, 10), (12, 12), (13, 12)],
        slow="def solve(n, k):\n c = 0\n for i in range(n):\n  if i % k == 0:\n   c += 1\n return c\n",
        fast="def solve(n, k):\n return (n + k - 1) // k\n",
        broken=("def solve(n, k):\n return n // k\n", "def solve(n, k):\n return (n + k - 1) // j\n",
                "def solve(n, k):\n return (n + k - 1 // k\n")),
    _embedded(
        _distinct,
        name="has_duplicate", statement="Return True if some value occurs twice in the list xs, else False.",
        signature="def solve(xs: list[int]) -> bool",
        tests=[([],), ([1],), ([1, 1],), ([1, 2, 3],), ([3, 1, 2, 3],), ([5, 4, 3, 2, 1, 0, 9, 0],),
               (list(range(50)),)],
        slow="def solve(xs):\n for i in range(len(xs)):\n  if xs[i] in xs[:i]:\n   return True\n return False\n",
        fast="def solve(xs):\n return len(set(xs)) < len(xs)\n",
        broken=("def solve(xs):\n return len(set(xs)) > len(xs)\n", "def solve(xs):\n return len(set(xs) < len(xs)\n",
                "def solve(xs):\n return xs[0] in xs[1:]\n")),
    _embedded(
        _lists,
        name="count_common", statement="Return how many elements of xs also occur in ys.",
        signature="def solve(xs: list[int], ys: list[int]) -> int",
        tests=[([], []), ([1], []), ([], [1]), ([1, 2, 3], [3, 2]), ([1, 1, 2], [1]), ([4, 5], [6, 7]),
               (list(range(30)), list(range(15, 60)))],
        slow="def solve(xs, ys):\n c = 0\n for x in xs:\n  if x in ys:\n   c += 1\n return c\n",
        fast="def solve(xs, ys):\n s = set(ys)\n return sum(x in s for x in xs)\n",
        broken=("def solve(xs, ys):\n return len(set(xs) & set(ys))\n",
                "def solve(xs, ys):\n s = set(ys)\n return sum(x in s for x in xs\n",
                "def solve(xs, ys):\n return sum(x in s for x in xs)\n")),
]}


def load_tasks(path: str) -> dict:
    """Tasks from a JSONL file (format in the module docstring); stops with a one-line error on a bad file."""
    if not os.path.exists(path):
        fail(f"task file {path!r} does not exist")
    tasks = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{where} is not valid JSON ({e.msg})")
            if not isinstance(row, dict):
                fail(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key, kind in (("name", str), ("statement", str), ("signature", str), ("slow", str), ("fast", str),
                              ("tests", list), ("timing", list)):
                if key not in row:
                    fail(f"{where}: missing field {key!r} (fields: {sorted(row)})")
                if not isinstance(row[key], kind):
                    fail(f"{where}: field {key!r} should be a {kind.__name__}, got {type(row[key]).__name__}")
            for key in ("tests", "timing"):
                if not all(isinstance(a, list) for a in row[key]):
                    fail(f"{where}: every entry of {key!r} must be a list of arguments")
            if not row["tests"]:
                fail(f"{where}: 'tests' is empty")
            if len(row["timing"]) < 2:
                fail(f"{where}: 'timing' needs at least 2 inputs (a warm-up and a timed one)")
            if row["name"] in tasks:
                fail(f"{where}: task name {row['name']!r} appears twice")
            tasks[row["name"]] = CodeTask(row["name"], row["statement"], row["signature"],
                                          [tuple(a) for a in row["tests"]], [tuple(a) for a in row["timing"]],
                                          row["slow"], row["fast"], row.get("entry", "solve"))
    if not tasks:
        fail(f"{path}: no tasks in the file")
    return tasks


FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_program(completion: str, entry: str = "solve") -> str | None:
    """The program in a model completion: the first ```python fenced block that mentions `entry`
    (else the first block), or the raw text; None when there is no program (empty, or no `entry`).

    >>> extract_program("Here:\\n```python\\ndef solve(n):\\n    return n\\n```\\nDone.")
    'def solve(n):\\n    return n\\n'
    >>> extract_program("def solve(n):\\n return 1\\n"), extract_program("I do not know."), extract_program("")
    ('def solve(n):\\n return 1\\n', None, None)
    """
    blocks = FENCE.findall(completion)
    if blocks:
        text = next((b for b in blocks if entry in b), blocks[0])
    else:
        text = completion
    if not text.strip() or entry not in text:
        return None
    return text


def render_code_prompt(task: CodeTask, tokenizer=None) -> str:
    """The prompt text: the compact form the embedded model is trained on, or, for a tokenizer with a chat template,
    an instruction through that template."""
    if not getattr(tokenizer, "chat_template", None):
        return f"# {task.name}\n"  # short: the tiny model only has to tell the tasks apart
    instruction = (f"{task.statement}\nWrite a fast Python function `{task.signature}`. Reply with the program only, "
                   f"in one ```python block.")
    return tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                         add_generation_prompt=True)


def select_tasks(dataset: str, names=()) -> list:
    """The tasks of `dataset` ('embedded' or a JSONL file) named in `names` (all when empty), in the order asked."""
    tasks = TASKS if dataset == "embedded" else load_tasks(dataset)
    unknown = [n for n in names if n not in tasks]
    if unknown:
        fail(f"--tasks {' '.join(unknown)}: no such task in {dataset} (have {sorted(tasks)})")
    return [tasks[n] for n in (names or tasks)]


@functools.lru_cache(maxsize=64)
def _reference_outputs(name: str, fast: str, inputs_json: str, entry: str) -> str:
    return json.dumps(_run_reference(name, fast, [tuple(a) for a in json.loads(inputs_json)], entry))


def _run_reference(name: str, fast: str, inputs: list, entry: str) -> list:
    limits = sandbox.Limits(call_s=30.0, run_s=300.0, cpu_s=300)
    proc, first = sandbox.start(fast, limits, entry)
    try:
        if first.get("status") != "ready":
            fail(f"task {name!r}: the fast reference does not load ({first.get('status')}: {first.get('msg')})")
        outs = []
        for args in inputs:
            reply, _ = sandbox.call(proc, args, limits)
            if reply.get("status") != "ok":
                fail(f"task {name!r}: the fast reference fails on an input ({reply.get('status')}: {reply.get('msg')})")
            outs.append(reply["value"])
    finally:
        sandbox.kill(proc)
    return outs


def expected_outputs(task: CodeTask, timing: list | None = None) -> tuple[list, list]:
    """(test outputs, timing outputs) of the fast reference, computed in the sandbox: once per task for the tests
    and the fixed `timing`, anew for drawn `timing` inputs."""
    tests_out = json.loads(_reference_outputs(task.name, task.fast, json.dumps(list(task.tests)), task.entry))
    if timing is None:
        return tests_out, json.loads(_reference_outputs(task.name, task.fast, json.dumps(list(task.timing)),
                                                        task.entry))
    return tests_out, _run_reference(task.name, task.fast, list(timing), task.entry)


def timing_inputs(task: CodeTask, repeats: int) -> list:
    """The warm-up and `repeats` timed inputs of one judging: drawn anew (`draw_timing`) or the task's fixed list."""
    if task.draw_timing is not None:
        return task.draw_timing(random.Random(random.SystemRandom().getrandbits(64)), repeats)
    return list(task.timing)


def check_timing_inputs(tasks: list, repeats: int) -> None:
    """One line for a task file whose tasks have fewer timing inputs than a warm-up and `repeats` new ones."""
    short = [f"{t.name} ({len(t.timing)})" for t in tasks if t.draw_timing is None and len(t.timing) < repeats + 1]
    if short:
        fail(f"--timing-repeats {repeats} needs {repeats + 1} timing inputs a task (a warm-up and a new input for "
             f"every round, so that no round is answered from a cache); these have fewer: {', '.join(short)}")


METHODS = {"paired": dict(clock="cpu", statistic="min", pin_rounds=True),
           "legacy": dict(clock="wall", statistic="median", pin_rounds=False)}
"""How `judge` times. paired: each call counts the CPU time of the program's own process, the programs of a round
share one CPU, and a program's speed against the slow baseline is the median over rounds of the two programs'
ratio in that round. legacy (the method before, kept to compare with): the wall-clock round trip, each program's
median over rounds, then one ratio of medians."""


def paired_speedup(base_times: list, times: list) -> float:
    """Median over rounds r of base_times[r] / times[r] (for an even count, the geometric mean of the middle two, so
    that swapping the programs inverts it exactly); the rounds both programs were timed in.

    >>> paired_speedup([10, 10, 10], [5, 20, 9]), paired_speedup([4, 4], [1, 4]), paired_speedup([2.0], [8.0])
    (1.1111111111111112, 2.0, 0.25)
    """
    logs = [math.log(b / t) for b, t in zip(base_times, times) if b > 0 and t > 0]
    if not logs:
        raise ValueError("paired_speedup needs at least one round with positive times for both programs")
    return math.exp(statistics.median(logs))


def in_confirm_band(speedup: float, floor: float, band: float = 3.0) -> bool:
    """Whether a speed-up is close enough to the noise floor `floor` to be judged again: within (floor, band x
    floor) or as far below 1, (1 / (band x floor), 1 / floor).

    >>> [in_confirm_band(s, 1.2) for s in (1.0, 1.3, 3.5, 50.0, 0.9, 0.5, 0.2)]
    [False, True, True, False, False, True, False]
    """
    return floor < speedup < band * floor or 1 / (band * floor) < speedup < 1 / floor


def judge(task: CodeTask, programs: list, limits: sandbox.Limits | None = None, repeats: int = 5,
          time_wrong_outputs: bool = False, method: str = "paired", confirm_floor: float | None = None,
          confirm_band: float = 3.0) -> dict:
    """Verdicts for `programs` (sources or None) with the slow and fast references timed in the same rounds.

    Returns {"verdicts": [...], "slow": Verdict, "fast": Verdict}; identical programs are judged once. With the
    paired method every timed verdict's runtime is on the slow baseline's scale, T_b / paired_speedup(slow, it)
    with T_b the baseline's fastest round, so that T_b / runtime is the paired speed-up (one clock for all: if
    a reference had to be timed by wall clock, every program is); with legacy it is the program's median.

    Two rules keep work the rounds do not see from paying (paired method): (1) CPU a program spends before its
    first timed round beyond twice what the slow baseline spends there (`Verdict.setup_cpu`: a table built at import
    or in the warm-up call; twice, so that the few ms by which two equal programs differ there are not charged) is
    added to each of its rounds; (2) its speed-up is at most its first round's: every later
    round could use state kept from earlier calls (an answer, a partial sum to extend, a table built lazily), the
    first cannot (the warm-up inputs are about 1 % of the timed ones), and for an honest program taking the smaller
    only withholds credit within the noise (a stateful program's first round lands beyond the noise floor by noise
    alone, and then the second judging of the confirmation band must land there too). Timing inputs are drawn anew
    for each judging where the task can (`timing_inputs`).

    With `confirm_floor` (the task's noise floor against the slow baseline), a timed program whose speed-up lands
    in the confirmation band (`in_confirm_band`) is judged once more with the references, in fresh sandboxes, and
    keeps the speed-up of the two that is closer to 1 (`second_speedup` records the second). Why: a sandbox
    process can run the same code persistently faster or slower than another for a whole judging (seen here as a
    median of 9 rounds at 0.44x and 1.30x for a copy of the baseline, under load), which more rounds in the same
    processes cannot remove; a second set of processes can.
    """
    limits = limits or sandbox.Limits()
    timing = timing_inputs(task, repeats)
    tests_out, timing_out = expected_outputs(task, timing)
    unique = list(dict.fromkeys(p for p in programs if p))
    verdicts = sandbox.measure(unique + [task.slow, task.fast], task.tests, tests_out, timing, timing_out,
                               limits, repeats=repeats, entry=task.entry, time_wrong_outputs=time_wrong_outputs,
                               **METHODS[method])
    by_source = dict(zip(unique, verdicts))
    no_program = sandbox.Verdict("no_program", "no program found in the completion")
    slow, fast = verdicts[-2], verdicts[-1]
    if slow.status != "correct" or fast.status != "correct":
        raise RuntimeError(f"task {task.name!r}: a reference failed ({slow.status}: {slow.message}; "
                           f"{fast.status}: {fast.message}); raise the limits or check the task")
    if method == "paired" and slow.times:
        timed = [v for v in verdicts if v.times]
        if any(v.clock == "wall" for v in (slow, fast)):
            for v in timed:
                v.times, v.clock = list(v.wall_times), "wall"
        t_b = min(slow.times)
        for v in timed:
            if v.setup_cpu is not None and slow.setup_cpu is not None and v.clock == slow.clock == "cpu":
                v.times = [t + max(0.0, v.setup_cpu - 2 * slow.setup_cpu) for t in v.times]  # rule (1)
            speedup = paired_speedup(slow.times, v.times)
            if v.times[0] > 0 and slow.times[0] > 0:
                speedup = min(speedup, slow.times[0] / v.times[0])  # rule (2)
            v.runtime = t_b / speedup
        again = [p for p in unique if confirm_floor and by_source[p].runtime
                 and in_confirm_band(t_b / by_source[p].runtime, confirm_floor, confirm_band)]
        if again:
            second = judge(task, again, limits, repeats, time_wrong_outputs, method)
            for p, v2 in zip(again, second["verdicts"]):
                v = by_source[p]
                if v2.runtime:
                    v.second_speedup = second["slow"].runtime / v2.runtime
                    if abs(math.log(v.second_speedup)) < abs(math.log(t_b / v.runtime)):
                        v.runtime = t_b / v.second_speedup
    return {"verdicts": [by_source[p] if p else no_program for p in programs], "slow": slow, "fast": fast}


def noise_floor(self_speedups: list, margin: float = 3.0, least: float = 1.0) -> float:
    """The factor within which a speed-up is noise: exp(margin * max |log s|) over the speed-ups s that a program
    measured against itself got, and never below `least` (a handful of self-scorings misses the tail: on this
    machine an equal program reached 1.10-1.12x in 1 to 3 of 100 scorings whose calibration said 1.03-1.06).

    >>> round(noise_floor([1.02, 0.95, 1.01], 2.0), 4), noise_floor([1.0], 3.0)   # 0.95 is the worst: 1 / 0.95^2
    (1.108, 1.0)
    >>> noise_floor([1.01, 0.99], 3.0, least=1.2)
    1.2
    """
    if not self_speedups or min(self_speedups) <= 0 or margin < 1 or least < 1:
        raise ValueError(f"noise_floor needs positive speed-ups, a margin >= 1 and a least floor >= 1, got "
                         f"{self_speedups}, {margin}, {least}")
    return max(least, math.exp(margin * max(abs(math.log(s)) for s in self_speedups)))


_CALIBRATION: dict = {}


def calibrate(task: CodeTask, limits: sandbox.Limits | None = None, repeats: int = 5, scorings: int = 5,
              margin: float = 3.0, method: str = "paired", cached: bool = True, least: float = 1.0) -> dict:
    """The task's timing noise, measured once per process (cached; `cached=False` measures it again): `scorings`
    judgings of a copy of each reference against the references themselves, exactly as a candidate is judged.

    Returns {"slow_self": speed-ups T_b / T_c of the slow copy, "fast_self": T_r / T_c of the fast copy,
    "floors": (noise_floor(slow_self, margin, least), noise_floor(fast_self, margin, least)), "seconds": wall
    time of the calibration}.
    """
    limits = limits or sandbox.Limits()
    key = (task.name, task.slow, task.fast, repr(task.timing), repr(limits), repeats, scorings, margin, method, least)
    if key not in _CALIBRATION or not cached:
        t0, slow_self, fast_self = time.perf_counter(), [], []
        for _ in range(scorings):
            r = judge(task, [task.slow, task.fast], limits, repeats, method=method)
            copy_slow, copy_fast = r["verdicts"]
            if copy_slow.runtime is None or copy_fast.runtime is None:
                raise RuntimeError(f"task {task.name!r}: a copy of a reference failed while calibrating the timing "
                                   f"({copy_slow.status}: {copy_slow.message}; {copy_fast.status}: "
                                   f"{copy_fast.message}); raise the limits or check the task")
            slow_self.append(r["slow"].runtime / copy_slow.runtime)
            fast_self.append(r["fast"].runtime / copy_fast.runtime)
        _CALIBRATION[key] = {"slow_self": slow_self, "fast_self": fast_self, "seconds": time.perf_counter() - t0,
                             "floors": (noise_floor(slow_self, margin, least),
                                        noise_floor(fast_self, margin, least))}
    return _CALIBRATION[key]
