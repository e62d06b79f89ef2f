"""What the claim benchmarks share (benchmarks/*_smollm2.py): a training run that outlives its session.

A claim's arms take hours of this CPU, more than a session has, and a new session's checkout has no run folders. So
every finished run is kept as a record in the repository, benchmarks/runs/<benchmark>/<run name>.json (its
args.json, its metric rows, its own seconds, and what the benchmark measured on its final weights), and
`finished_run` returns, in this order: the record of a run with the same arguments; a finished run folder (recorded
now); an interrupted run continued from its last checkpoint by the trainer's own --resume (the same numbers as a run
never stopped); a fresh run. A benchmark is then one command, rerun until its report says it is complete.
"""

import dataclasses
import json
import os
import shutil
import time

from common.checkpoint import find_checkpoint
from common.logger import read_metrics

DERIVED = ("batch_size", "minibatch_size", "resume", "save_every", "output_dir")
"""args.json fields that do not make a run different: filled in after the start, or without effect on its numbers
(output_dir: a clone elsewhere, or another benchmark's folder of the same run, is the same run)"""


def same_args(saved: dict, now: dict, defaults: dict) -> bool:
    """Whether a run's saved arguments are the run `now` asks for. A flag added to Args since the run was made counts
    as the same while it keeps its default; the DERIVED fields are not compared.

    >>> same_args({"a": 1, "batch_size": 32}, {"a": 1, "b": 0, "batch_size": 0}, {"a": 0, "b": 0, "batch_size": 0})
    True
    >>> same_args({"a": 1}, {"a": 1, "b": 2}, {"a": 0, "b": 0})
    False
    """
    return saved.keys() <= now.keys() and all(saved.get(k, defaults[k]) == v for k, v in now.items()
                                              if k not in DERIVED)


def _as_json(args) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(args)))


def folder_state(module, args) -> str:
    """What output_dir/run_name holds for these arguments: 'finished' (its final evaluation is logged at
    --total-steps, after the first; or the one of a run of 0 steps), 'resume' (a checkpoint of this run), 'stale'
    (another run, or one stopped before its first checkpoint) or 'fresh' (nothing)."""
    run_dir = os.path.join(args.output_dir, args.run_name)
    if not os.path.exists(run_dir):
        return "fresh"
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            saved = json.load(f)
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    except (OSError, ValueError, SystemExit):
        return "stale"
    if not same_args(saved, _as_json(args), _as_json(module.Args())):
        return "stale"
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    if evals and evals[-1]["step"] == args.total_steps and (len(evals) >= 2 or args.total_steps == 0):
        return "finished"  # a run of no steps (ppo_slm's stages alone) logs its one evaluation at step 0
    return "resume" if find_checkpoint(run_dir) else "stale"


def run_seconds(run_dir: str, rows: list) -> float:
    """The run's own time from its metric rows: the first evaluation (counted from args.json, written at the start,
    so with the model's load), the steps' perf/step_time and the final evaluation (with the last checkpoint). Steps
    lost to an interruption and the model loads of later sessions are not counted."""
    steps = [r for r in rows if "perf/step_time" in r]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    start = os.path.getmtime(os.path.join(run_dir, "args.json"))
    seconds = (evals[0]["time"] - start if evals else 0.0) + sum(r["perf/step_time"] for r in steps)
    if len(evals) >= 2 and steps:
        seconds += evals[-1]["time"] - steps[-1]["time"]
    return seconds


def finished_run(module, args, record_dir: str, measure=None, weights: bool = False, make: bool = True) -> dict:
    """The record of the run `module.main(args)` makes: {"args", "rows", "seconds", "measured"}, read back from
    record_dir/<run_name>.json when it holds a run with the same arguments, else made from the run folder (finished,
    continued from its checkpoint, or run from the start; a stale folder is kept beside it as <name>.stale-<time>).
    `measure(run_dir) -> dict` runs once on the finished folder (its checkpoint holds the final weights) and its
    result is kept in the record. weights=True: the caller needs the final weights too (a benchmark that starts
    from them), so the record is read back only beside a finished run folder; without one the run is made again.
    make=False (a report written from the records): never run; no record of these arguments is a one-line error."""
    path = os.path.join(record_dir, f"{args.run_name}.json")
    try:
        if weights and folder_state(module, args) != "finished":
            raise OSError("the record has no weights")
        with open(path) as f:
            record = json.load(f)
        if same_args(record["args"], _as_json(args), _as_json(module.Args())):
            print(f"{args.run_name}: read back from {os.path.relpath(path)}")
            return record
        print(f"{args.run_name}: {os.path.relpath(path)} is a run with other arguments; running this one")
    except (OSError, ValueError, KeyError):
        pass
    if not make:
        raise SystemExit(f"error: {args.run_name}: no record of a run with these arguments in {record_dir} (a report "
                         "from the records runs nothing: rerun without --report-only)")
    run_dir = os.path.join(args.output_dir, args.run_name)
    state = folder_state(module, args)
    if state == "stale":
        aside = f"{run_dir}.stale-{int(time.time())}"
        print(f"{args.run_name}: {run_dir} holds another or an unsaved run; moved to {aside}, starting afresh")
        shutil.move(run_dir, aside)
    elif state == "resume":
        print(f"{args.run_name}: continuing the interrupted run in {run_dir} from its checkpoint")
        args.resume = run_dir  # the trainer keeps args.json and drops the metric rows after the checkpoint
    if state != "finished":
        module.main(args)
    with open(os.path.join(run_dir, "args.json")) as f:
        saved = json.load(f)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    record = {"args": saved, "rows": rows, "seconds": run_seconds(run_dir, rows),
              "measured": measure(run_dir) if measure else {}}
    os.makedirs(record_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)
    print(f"{args.run_name}: recorded in {os.path.relpath(path)}")
    return record


def cached(path: str, settings: dict, measure) -> dict:
    """`measure()` with "settings" added, read back from the record `path` when it was made with the same `settings`,
    else measured and written there (atomically): a measurement of a model that a rerun need not repeat."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["settings"] == settings:
            return saved
    except (OSError, ValueError, KeyError):
        pass
    res = {**measure(), "settings": settings}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    return res


def margin(a: float, b: float, n: int) -> float:
    """Half-width of the 95 % interval of the difference of two accuracies on n problems each, at their pooled
    accuracy (a two-proportion z-test): a difference beyond it is 'beyond the noise'.

    >>> round(margin(0.1, 0.0, 40), 3), margin(0.0, 0.0, 40)
    (0.096, 0.0)
    """
    p = (a + b) / 2
    return 1.96 * (2 * p * (1 - p) / n) ** 0.5


def verdict_lines(done: list, seeds, judge, rule: str) -> list[str]:
    """A claim report's last lines: once every seed asked for (two at least) has all its verdict arms recorded,
    `judge(done) -> (verdict, notes)` with its `rule` and a note a line; before that, which seeds are missing.

    >>> verdict_lines([1], [1, 2], None, "")[-1]
    'Incomplete: seeds finished [1] of [1, 2]; rerun the command.'
    >>> verdict_lines([1, 2], (1, 2), lambda d: ("shown", ["a"]), "rule")
    ['', '## Verdict: shown', '', 'rule', '', '- a']
    """
    if done != list(seeds) or len(done) < 2:
        then = "; rerun the command." if len(list(seeds)) >= 2 else "; a verdict needs two seeds: rerun with both."
        return ["", f"Incomplete: seeds finished {done or 'none'} of {list(seeds)}{then}"]
    verdict, notes = judge(done)
    return ["", f"## Verdict: {verdict}", "", rule, "", *[f"- {x}" for x in notes]]
