"""Is rlpf.py's speed reward a signal? Timing noise of the judge, before and after the change of issue 32.

    python -m benchmarks.premises.rlpf_timing                # every task, 20 scorings, idle and busy; a while
    python -m benchmarks.premises.rlpf_timing --scorings 5 --tasks sum_range --conditions idle  # a quick look

For each task and each condition, the benchmark scores, `--scorings` times each, (a) the slow baseline's own
program against the slow baseline (an equal-speed program: its credited speed-up should be 1 and it should earn no
speed reward) and (b) the fast reference's program against the slow baseline (its speed-up should stay large), by
two methods side by side, one scoring of each in turn:

- before: the judge as it was (code_env/tasks.py `judge(method="legacy")`: wall-clock round trips, each
  program's median of 3 rounds, the old timing inputs below, no noise floor: the credited speed-up is the raw one);
- after: the current judge (`method="paired"`: CPU time of the program's own process, the programs of a round on
  one CPU, median of the per-round ratios over --repeats rounds, the current timing inputs) with the task's noise
  floor calibrated in that condition as rlpf.py does at start (`code_tasks.calibrate`, never below --min-floor),
  credited as rlpf.py credits; the table also counts the speed credit the same timings would earn under the
  calibration's floors alone.

Conditions: idle (nothing started by the benchmark; the 1-minute load average is printed and recorded first, so
that a reader can tell whether the machine was idle) and busy (--busy pure-Python busy loops started beside it,
each bounded in time, stopped when the condition ends). Prints and writes benchmarks/premises/rlpf_timing.md: per task
and method the spread (min / median / max) of the credited speed-ups, how many equal-program scorings earned speed
credit (staged reward above the correct floor 0.15), and the seconds each scoring cost.
"""

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time

import rlpf
from code_env import sandbox
from code_env import tasks as code_tasks


def old_lists(rng: random.Random) -> tuple:
    """Two lists of 2000 values below 8000 (count_common's inputs before issue 32)."""
    return tuple([rng.randrange(8000) for _ in range(2000)] for _ in range(2))


OLD_TIMING = {  # the timing inputs before issue 32 (timing[0] is the warm-up), to time the old method on its data
    "sum_range": [(400_000 + i,) for i in range(4)],
    "sum_squares": [(300_000 + i,) for i in range(4)],
    "count_multiples": [(400_000, 3), (400_001, 7), (400_002, 5), (400_003, 11)],
    "has_duplicate": [(random.Random(s).sample(range(10**6), 2000),) for s in range(4)],
    "count_common": [old_lists(random.Random(s)) for s in range(4)],
}
BUSY_LOOP = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
EQUAL_RANGE = {"idle": (0.9, 1.1), "busy": (0.8, 1.25)}  # the acceptance ranges for the equal program


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def start_busy(n: int, seconds: float) -> list:
    """n busy loops in their own processes, each ending by itself after `seconds` at the latest."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=seconds)]) for _ in range(n)]


def stop_busy(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


def one_scoring(task, source: str, method: str, repeats: int, floors: tuple, limits,
                alone: tuple = (1.0, 1.0), band: float = 3.0) -> dict:
    """Judge `source` on `task` as rlpf.py does; its raw and credited speed-ups, staged reward and cost, and the
    staged reward the same timing would get under the floors `alone` (the calibration without --min-floor)."""
    t0 = time.perf_counter()
    confirm = {"confirm_floor": floors[0], "confirm_band": band} if method == "paired" else {}
    r = code_tasks.judge(task, [source], limits, repeats, method=method, **confirm)
    seconds = time.perf_counter() - t0
    v, t_b, t_r = r["verdicts"][0], r["slow"].runtime, r["fast"].runtime
    if v.status != "correct":
        raise RuntimeError(f"{task.name}: a reference's copy was judged {v.status} ({v.message})")
    raw = t_b / v.runtime
    return {"raw": raw, "credited": rlpf.credited_speedup(raw, floors[0]), "seconds": seconds,
            "reward": rlpf.staged_reward(v.status, v.runtime, t_b, t_r, 1.02, floors), "clock": v.clock,
            "second_speedup": v.second_speedup,
            "reward_alone": rlpf.staged_reward(v.status, v.runtime, t_b, t_r, 1.02, alone)}


def run_condition(name: str, tasks: list, cli, limits) -> dict:
    print(f"\n== {name}: 1-minute load average {load1():.2f} before it", flush=True)
    out = {"load_before": load1(), "tasks": {}}
    busy = start_busy(cli.busy, cli.busy_limit_s) if name == "busy" else []
    try:
        time.sleep(1.0 if busy else 0.0)
        for task in tasks:
            old_task = (dataclasses.replace(task, timing=OLD_TIMING[task.name], draw_timing=None)
                        if task.name in OLD_TIMING else None)
            cal = code_tasks.calibrate(task, limits, cli.repeats, cli.calibration_scorings, cli.margin, cached=False,
                                       least=cli.min_floor)
            alone = tuple(code_tasks.noise_floor(cal[k], cli.margin) for k in ("slow_self", "fast_self"))
            res = {"before": {"equal": [], "fast": []}, "after": {"equal": [], "fast": []},
                   "floors": cal["floors"], "floors_alone": alone, "calibration_s": cal["seconds"]}
            for _ in range(cli.scorings):
                if old_task is not None:
                    res["before"]["equal"].append(one_scoring(old_task, task.slow, "legacy", 3, (1.0, 1.0), limits))
                    res["before"]["fast"].append(one_scoring(old_task, task.fast, "legacy", 3, (1.0, 1.0), limits))
                for kind, source in (("equal", task.slow), ("fast", task.fast)):
                    res["after"][kind].append(one_scoring(task, source, "paired", cli.repeats, cal["floors"], limits,
                                                          alone, cli.confirm_band))
            out["tasks"][task.name] = res
            for method in ("before", "after"):
                if res[method]["equal"]:
                    print(f"{name} {task.name} {method}: " + summary(res[method], name), flush=True)
            print(f"{name} {task.name} after: noise floors {cal['floors'][0]:.3f} / {cal['floors'][1]:.3f}, "
                  f"calibration alone {alone[0]:.3f} / {alone[1]:.3f} "
                  f"(calibration {cal['seconds']:.1f} s)", flush=True)
    finally:
        stop_busy(busy)
    out["load_after"] = load1()
    return out


def spread(xs: list, fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def summary(res: dict, condition: str) -> str:
    eq, fa = res["equal"], res["fast"]
    lo, hi = EQUAL_RANGE[condition]
    inside = sum(lo <= x["credited"] <= hi for x in eq)
    paid = sum(x["reward"] > rlpf.CORRECT_FLOOR for x in eq)
    return (f"equal credited {spread([x['credited'] for x in eq])} (in [{lo}, {hi}]: {inside}/{len(eq)}; speed "
            f"credit: {paid}/{len(eq)}); fast credited {spread([x['credited'] for x in fa], '{:.0f}')}; "
            f"s/scoring {statistics.mean(x['seconds'] for x in eq):.2f} (equal), "
            f"{statistics.mean(x['seconds'] for x in fa):.2f} (fast)")


def alone_paid(rows: list, method: str) -> str:
    if method != "after" or "reward_alone" not in rows[0]:
        return ""
    return f" ({sum(x['reward_alone'] > rlpf.CORRECT_FLOOR for x in rows)} with the calibration alone)"


def write(cli, results: dict) -> str:
    lines = ["# rlpf.py timing: an equal program and the fast reference against the slow baseline", "",
             f"`{' '.join(['python -m benchmarks.premises.rlpf_timing'] + sys.argv[1:])}`", "",
             f"{cli.scorings} scorings per task, program and method; after: {cli.repeats} rounds, noise floor "
             f"calibrated from {cli.calibration_scorings} self-scorings with margin {cli.margin}, at least "
             f"{cli.min_floor}, a second judging within --confirm-band {cli.confirm_band} of it; busy: {cli.busy} "
             f"busy loops beside it. Machine: {os.cpu_count()} CPUs, sandbox isolation {sandbox.isolation()}.", "",
             "Load (1-minute average, /proc/loadavg) at the start and end of each condition: " +
             "; ".join(f"{c} {r['load_before']:.2f} -> {r['load_after']:.2f}" for c, r in results.items()) +
             ". An \"idle\" condition with a load average near or above the CPU count was not idle.", "",
             "equal: the slow baseline's program scored against the slow baseline (raw: the measured speed-up; "
             "credited: what the reward uses, the raw one before, the noise-floored one after); in range: the "
             "issue's acceptance range of the condition; speed credit: scorings whose staged reward exceeds the "
             "correct floor 0.15 (FBR or CGRE paid), and in brackets how many would have with the floors of the "
             "calibration alone (no least floor; the same timings); fast: the fast reference's program against "
             "the slow baseline "
             "(the two methods use different inputs and clocks, so their raw speed-ups differ). "
             "Spreads are min / median / max; s/scoring: wall seconds of one judging (the candidate and both "
             "references, process starts included).", "",
             "| condition | task | method | equal: raw speed-up | equal: credited | in range | speed credit | "
             "fast: raw speed-up | fast: credited | s/scoring (equal, fast) | noise floors (slow, fast) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cond, r in results.items():
        lo, hi = EQUAL_RANGE[cond]
        for name, res in r["tasks"].items():
            for method in ("before", "after"):
                eq, fa = res[method]["equal"], res[method]["fast"]
                if not eq:
                    continue
                floors = (f"{res['floors'][0]:.3f}, {res['floors'][1]:.3f} (alone {res['floors_alone'][0]:.3f}, "
                          f"{res['floors_alone'][1]:.3f})" if method == "after" else "none")
                lines.append(
                    f"| {cond} | {name} | {method} | {spread([x['raw'] for x in eq])} | "
                    f"{spread([x['credited'] for x in eq])} | "
                    f"{sum(lo <= x['credited'] <= hi for x in eq)}/{len(eq)} in [{lo}, {hi}] | "
                    f"{sum(x['reward'] > rlpf.CORRECT_FLOOR for x in eq)}/{len(eq)}{alone_paid(eq, method)} | "
                    f"{spread([x['raw'] for x in fa], '{:.0f}')} | {spread([x['credited'] for x in fa], '{:.0f}')} | "
                    f"{statistics.mean(x['seconds'] for x in eq):.2f}, {statistics.mean(x['seconds'] for x in fa):.2f}"
                    f" | {floors} |")
    costs = [f"{cond} {name} {res['calibration_s']:.1f} s" for cond, r in results.items()
             for name, res in r["tasks"].items()]
    lines += ["", "Calibration cost per task (after; once per training run, at start): " + "; ".join(costs) + "."]
    lines += ["", "Acceptance (issue 32), from the rows above: the equal program's credited speed-up within [0.9, 1.1] "
              "in every idle scoring and within [0.8, 1.25] in every busy scoring:", ""]
    for cond, r in results.items():
        lo, hi = EQUAL_RANGE[cond]
        for method in ("before", "after"):
            rows = [x for res in r["tasks"].values() for x in res[method]["equal"]]
            if rows:
                ok = sum(lo <= x["credited"] <= hi for x in rows)
                paid = sum(x["reward"] > rlpf.CORRECT_FLOOR for x in rows)
                fast = [x["raw"] for res in r["tasks"].values() for x in res[method]["fast"]]
                second = sum(x.get("second_speedup") is not None for x in rows)
                lines.append(f"- {cond}, {method}: {ok}/{len(rows)} scorings in range "
                             f"({'met' if ok == len(rows) else 'not met'}); {paid}/{len(rows)} earned speed credit"
                             f"{alone_paid(rows, method)}"
                             f"{f'; {second} judged a second time' if method == 'after' else ''}; "
                             f"the fast reference's raw speed-up {spread(fast, '{:.0f}')} over all tasks")
    text = "\n".join(lines) + "\n"
    with open(cli.out, "w") as f:
        f.write(text)
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(results, f)
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scorings", type=int, default=20, help="scorings per task, program, method and condition")
    p.add_argument("--tasks", nargs="+", default=list(code_tasks.TASKS), help="embedded task names")
    p.add_argument("--conditions", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    p.add_argument("--busy", type=int, default=2, help="busy loops beside the judge in the busy condition")
    p.add_argument("--busy-limit-s", type=float, default=3600.0, help="each busy loop ends by itself after this")
    p.add_argument("--repeats", type=int, default=rlpf.Args.timing_repeats, help="rounds of the after method")
    p.add_argument("--calibration-scorings", type=int, default=rlpf.Args.calibration_scorings)
    p.add_argument("--margin", type=float, default=rlpf.Args.noise_floor_margin, help="noise floor margin")
    p.add_argument("--min-floor", type=float, default=rlpf.Args.min_noise_floor, help="least noise floor")
    p.add_argument("--confirm-band", type=float, default=rlpf.Args.confirm_band,
                   help="second judging near the floor (rlpf.py --confirm-band; 1: off)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "rlpf_timing.md"))
    p.add_argument("--json", default="", help="also write every scoring here (raw data)")
    cli = p.parse_args()
    unknown = [t for t in cli.tasks if t not in code_tasks.TASKS]
    if unknown or cli.scorings < 1 or cli.repeats < 1 or cli.calibration_scorings < 1 or cli.margin < 1 \
            or cli.min_floor < 1 or cli.confirm_band < 1:
        raise SystemExit(f"error: unknown task {unknown} or --scorings/--repeats/--calibration-scorings < 1 or "
                         f"--margin, --min-floor or --confirm-band < 1 (have tasks {sorted(code_tasks.TASKS)})")
    limits = sandbox.Limits()  # rlpf.py's defaults: 2 s a call, 256 MiB
    tasks = [code_tasks.TASKS[t] for t in cli.tasks]
    t0 = time.time()
    results = {c: run_condition(c, tasks, cli, limits) for c in cli.conditions}
    print("\n" + write(cli, results))
    print(f"wrote {cli.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
