"""Verifiable rewards: the testbed checker, a math checker on math-verify, reasoning-gym's own scorers, a format reward.

The final answer of a reply (`extract_answer`): for math, the last `\\boxed{}`, else what follows the last `####`;
for testbed-nl (task 'nl', replies of a small chat model) the last `\\boxed{}` if the reply has one, else the
number after the last "answer is", else the last number of the reply; for reasoning-gym (task 'rg') the
`extract_rg_answer` rule: its `<answer>` tags, else the model's own phrasing.

Every reward function returns a float and never raises on model output: garbage, empty strings and pathological
expressions score 0. A reasoning-gym score is the task's own, in [0, 1]: some tasks give partial credit.

math-verify's timeouts use `signal.alarm` (main thread only), SymPy can hang for minutes on `9^{9^{9^{9}}}`, and
reasoning-gym's scorers parse model output too (some with `eval`): so both run in a small pool of worker processes,
each answer under a wall-clock limit; an overrun kills its worker (score 0) and the pool is rebuilt. Thread-safe.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import importlib
import math
import multiprocessing as mp
import re
import signal
import sys
import threading

from common.reasoning_gym import rg_score

_TESTBED_FORMAT = re.compile(r"^-?\d+$")
# a whole answer that is one number written with thousands separators: 1,234,567 or LaTeX's 1{,}234 and 1\,234
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:(?:,|\{,\}|\\,)\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
# "answer is" and the number right after it (markdown bold, '$' and ':' allowed between); group 1 None if none follows
_ANSWER_IS = re.compile(r"answer is(?:[\s:*$=]*(-?\d+(?:,\d{3})*(?:\.\d+)?))?", re.IGNORECASE)
# testbed-nl's format: the reply ends with "The answer is N." (N a number; bold or '$' around it allowed)
_NL_FORMAT = re.compile(r"the answer is:?\s*[*$]*-?\d+(?:,\d{3})*(?:\.\d+)?[*$]*\.?[*]*\s*$", re.IGNORECASE)
_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# "answer" and, within its sentence, "is" / ":" / "=", then the rest of the line: "The final answer to the given
# problem is 6.", "Answer: new"
_ANSWER_SAID = re.compile(r"\banswer\b[^.\n<]{0,80}?(?:\bis\b|:|=)[\s*$:]*([^\n]*)", re.IGNORECASE)
_LEADING_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?![\w/^.]|\s*[-+*/x×^]\s*\d)")


def testbed_reward(completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the answer (surrounding whitespace ignored).

    >>> testbed_reward("15", "15"), testbed_reward(" 15", "15"), testbed_reward("15 or 16", "15")
    (1.0, 1.0, 0.0)
    """
    return float(completion.strip() == answer.strip())


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None.

    >>> last_boxed(r"so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    """
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
            return None  # unbalanced: the answer was cut off
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(text: str, task: str = "math") -> str | None:
    """The final answer of a completion: the last `\\boxed{}`, else what follows the last `####` (task 'nl':
    `extract_nl_answer`; task 'rg': `extract_rg_answer`)."""
    if task == "nl":
        return extract_nl_answer(text)
    if task == "rg":
        return extract_rg_answer(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return strip_thousands(tail.split("\n")[0].strip().rstrip(".")) or None
    return None


def extract_nl_answer(text: str) -> str | None:
    """The answer of a testbed-nl reply: the last `\\boxed{}` when the reply has one (None when it is cut off),
    else the number right after the last "answer is" (None when none follows: a reply cut there), else the last
    number of the reply; thousands separators dropped.

    >>> extract_nl_answer("40 + 30 = 70, 7 + 5 = 12. The answer is: **82** apples."), extract_nl_answer("so 1,234")
    ('82', '1234')
    >>> extract_nl_answer("First 47 + 35 = 82. The answer is"), extract_nl_answer(r"\\boxed{8"), extract_nl_answer("no")
    (None, None, None)
    """
    if "\\boxed" in text:
        boxed = last_boxed(text)
        return boxed.strip() if boxed is not None else None
    said = list(_ANSWER_IS.finditer(text))
    if said:
        return strip_thousands(said[-1].group(1)) if said[-1].group(1) else None
    numbers = _NUMBER.findall(text)
    return strip_thousands(numbers[-1]) if numbers else None


def extract_rg_answer(text: str) -> str | None:
    """The answer of a reply to a reasoning-gym question, which asks for `<answer>` tags: the inside of the last
    `<answer>...</answer>` (or all after a last `<answer>` never closed); else the last `\\boxed{}`; else what
    follows the last "answer ... is" (or "answer:", "answer ="), to the end of its sentence, after its last "=" if it
    has one (quotes, bold and '$' dropped; a number that starts it, not an expression: the number alone); else the
    last number of the reply; thousands separators dropped from a number.

    >>> extract_rg_answer("so <answer> 6 </answer>"), extract_rg_answer("The final answer to the sum is **1,617**.")
    ('6', '1617')
    >>> extract_rg_answer('Answer: "wen".'), extract_rg_answer("It is 5 - -4 = 9."), extract_rg_answer("answer = 1 + 2 = 3")
    ('wen', '9', '3')
    >>> extract_rg_answer("The answer is 2 + 3."), extract_rg_answer("<answer>7"), extract_rg_answer("hm")
    ('2 + 3', '7', None)
    """
    tagged = _ANSWER_TAGS.findall(text)
    if tagged:
        return tagged[-1].strip()
    if "<answer>" in text.lower():
        return text[text.lower().rindex("<answer>") + len("<answer>"):].strip() or None
    if "\\boxed" in text:
        boxed = last_boxed(text)
        return boxed.strip() if boxed is not None else None
    said = list(_ANSWER_SAID.finditer(text))
    if said:
        rest = re.sub(r"\.(\s|$).*", "", said[-1].group(1)).rsplit("=", 1)[-1].strip().strip("*$`'\"").strip()
        number = _LEADING_NUMBER.match(rest)
        return strip_thousands(number.group()) if number else rest or None
    numbers = _NUMBER.findall(text)
    return strip_thousands(numbers[-1]) if numbers else None


def strip_thousands(s: str) -> str:
    """Drop the separators of a number written in digit groups of three; leave every other comma,
    so a tuple, interval or list keeps its elements apart.

    >>> strip_thousands("1,234,567"), strip_thousands("-1{,}234.5"), strip_thousands("1,2"), strip_thousands("(1,234)")
    ('1234567', '-1234.5', '1,2', '(1,234)')
    """
    if _THOUSANDS.fullmatch(s):
        return s.replace("{,}", "").replace("\\,", "").replace(",", "")
    return s


def _normalise(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace("\\!", "")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    return strip_thousands(s.rstrip("."))


def _symbolic_equal(pred: str, gold: str) -> bool:
    """Runs inside a worker process: math-verify with its own (signal-based) timeouts off."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we disabled its alarms
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _start_worker(modules: tuple) -> None:
    """A verifier worker ignores Ctrl-C (the trainer stops it at exit) and imports its scorers before its first
    answer, whose time limit is not the import's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed: each answer's own import fails and scores 0 (a worker must not die)
            pass


UNGUARDED = "a script that scores answers needs its top-level code under `if __name__ == '__main__':`"


class _Pool:
    """A lazily created process pool that can be killed and rebuilt after a timeout; its workers import `modules`."""

    def __init__(self, workers: int = 2):
        self.workers, self.lock, self.pool, self.modules = workers, threading.Lock(), None, ()

    def get(self, modules: tuple = ()) -> cf.ProcessPoolExecutor:
        """The pool, whose workers have imported `modules` (one that has not is replaced, its queued answers kept)."""
        with self.lock:
            if self.pool is not None and not set(modules) <= set(self.modules):
                self.pool.shutdown(wait=False)
                self.pool = None
            if self.pool is None:
                frame = sys._getframe()
                while frame:  # an unguarded script re-run by a worker
                    if frame.f_globals.get("__name__") == "__mp_main__":
                        raise RuntimeError(UNGUARDED)
                    frame = frame.f_back
                self.modules = tuple(sorted(set(self.modules) | set(modules)))
                # forkserver: never fork a process holding torch's thread pools
                self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("forkserver"),
                                                   initializer=_start_worker, initargs=(self.modules,))
                try:  # wait for a worker to be up: starting one is not an answer's time
                    self.pool.submit(int).result(timeout=300)
                except cf.process.BrokenProcessPool as e:  # no worker can start: every answer would score 0
                    self.pool = None
                    raise RuntimeError(f"no verifier worker could start (the error above); {UNGUARDED}") from e
                except Exception:  # noqa: BLE001 - a slow start: answers may time out
                    pass
            return self.pool

    def kill(self, pool: cf.ProcessPoolExecutor) -> None:
        with self.lock:
            if self.pool is not pool:
                return  # another thread already rebuilt it
            for proc in list((pool._processes or {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def close(self) -> None:
        """Shut the pool down at exit, before module teardown (which prints an ignored AttributeError)."""
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


_POOL = _Pool()
atexit.register(_POOL.close)


def run_limited(fn, jobs: dict, timeout: float, modules: tuple = ()) -> dict:
    """`fn(*args)` for every job {key: args} in the worker pool (workers that import `modules`): {key: result}, without
    the jobs that raised or ran past `timeout` seconds of wall clock. A job that overruns has its worker killed; the
    pool is rebuilt and the jobs still queued run again."""
    results, pending = {}, dict(jobs)
    while pending:
        pool = _POOL.get(modules)
        try:
            futures = {k: pool.submit(fn, *args) for k, args in pending.items()}
        except RuntimeError:  # the pool broke (a worker died): rebuild and retry
            _POOL.kill(pool)
            continue
        hung = None
        for k, fut in futures.items():
            try:
                results[k] = fut.result(timeout=timeout)
            except cf.TimeoutError:
                hung = k
                break
            except Exception:  # noqa: BLE001 - garbage in, no result out
                pass
            del pending[k]
        if hung is None:
            break
        del pending[hung]  # no result; kill its worker and re-run the jobs still queued
        for k, fut in futures.items():
            if k in pending and fut.done() and fut.exception() is None:
                results[k] = fut.result()
                del pending[k]
        _POOL.kill(pool)
    return results


def math_rewards(completions: list[str], answers: list[str], timeout: float = 5.0, task: str = "math") -> list[float]:
    """1.0 where the completion's final answer (`extract_answer(text, task)`) equals the gold answer (symbolically),
    else 0.0.

    Exact string matches (after light normalisation) skip SymPy. Each symbolic check
    gets `timeout` seconds of wall clock; overruns and errors score 0.
    """
    rewards, pending = [0.0] * len(completions), {}
    for i, (text, gold) in enumerate(zip(completions, answers)):
        pred = extract_answer(text or "", task)
        if pred is None or gold is None or len(pred) > 1000:
            continue
        if _normalise(pred) == _normalise(str(gold)):
            rewards[i] = 1.0
        else:
            pending[i] = (pred, str(gold))
    for i, equal in run_limited(_symbolic_equal, pending, timeout, ("math_verify",)).items():
        rewards[i] = float(equal)
    return rewards


def rg_rewards(completions: list[str], problems: list, timeout: float = 5.0) -> list[float]:
    """reasoning-gym's own score (in [0, 1]; partial credit where the task gives it) of each completion's answer
    (`extract_rg_answer`) for its problem's item (`Problem.entry`); 0 without an answer, for an error, or past
    `timeout` seconds of wall clock."""
    jobs = {}
    for i, (text, p) in enumerate(zip(completions, problems)):
        pred = extract_rg_answer(text or "")
        if pred is not None and len(pred) <= 100_000:  # no reply is longer; 20,000 characters are a level-3 grid
            jobs[i] = (pred, p.entry, p.level)
    rewards = [0.0] * len(completions)
    for i, r in run_limited(rg_score, jobs, timeout, ("reasoning_gym",)).items():
        r = float(r) if isinstance(r, (int, float)) else 0.0
        rewards[i] = min(max(r, 0.0), 1.0) if math.isfinite(r) else 0.0
    return rewards


def format_reward(completion: str, task: str) -> float:
    """1.0 when the completion has the task's answer format (testbed: a bare integer; math: a `\\boxed{}`;
    nl: it ends with "The answer is N."; rg: an `<answer>...</answer>`).

    >>> format_reward("7 + 5 = 12. The answer is 12.", "nl"), format_reward("The answer is 12. Hope it helps!", "nl")
    (1.0, 0.0)
    """
    if task == "testbed":
        return float(bool(_TESTBED_FORMAT.match(completion.strip())))
    if task == "nl":
        return float(bool(_NL_FORMAT.search(completion)))
    if task == "rg":
        return float(bool(_ANSWER_TAGS.search(completion)))
    return float(last_boxed(completion) is not None)


def score(completions: list[str], problems: list, truncated=None, timeout: float = 5.0) -> list[float]:
    """Correctness reward for each (completion, problem) pair, dispatched on `problem.task`; 0 where `truncated` (a
    completion cut at --max-new-tokens, per row: a rollout's truncated_B) is true, whatever it says before the cut.
    In [0, 1]: 0 or 1, but for reasoning-gym tasks that give partial credit (docs/runs.md says what each trainer
    makes of a score between)."""
    rewards = [0.0] * len(completions)
    if truncated is not None:
        keep = [i for i, t in enumerate(truncated) if not bool(t)]
        for i, r in zip(keep, score([completions[i] for i in keep], [problems[i] for i in keep], timeout=timeout)):
            rewards[i] = r
        return rewards
    for i, p in enumerate(problems):
        if p.task == "testbed":
            rewards[i] = testbed_reward(completions[i], p.answer)
    rg = [i for i, p in enumerate(problems) if p.task == "rg"]
    for i, r in zip(rg, rg_rewards([completions[i] for i in rg], [problems[i] for i in rg], timeout) if rg else []):
        rewards[i] = r
    rule = ["testbed" if p.task == "testbed" else "nl" if p.task == "nl" else "rg" if p.task == "rg" else "math"
            for p in problems]
    for task in ("math", "nl"):  # math: every task but the testbed, nl and rg
        idx = [i for i, r in enumerate(rule) if r == task]
        if idx:
            for i, r in zip(idx, math_rewards([completions[i] for i in idx], [problems[i].answer for i in idx],
                                              timeout, task)):
                rewards[i] = r
    return rewards
