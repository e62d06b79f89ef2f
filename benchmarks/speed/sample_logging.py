"""What logging samples (samples.jsonl, the console lines, issue 31) costs on the default `python grpo.py` demo:
the same run three ways, side by side, alternating, `--repeats` times each:

- off: `--log-samples 0`;
- default: `--log-samples 4` at the evaluation steps and the last step (the default);
- every step: `--log-samples 4 --log-samples-every 1` (the most it can cost: every step decodes and writes rows).

Reports the run's wall time, the sum and the median of `perf/step_time`, the median step time of the steps that
are not evaluation steps (where `every step` logs and the others do not), and whether the learning curve is the same
in all three (sample logging reuses the step's rows and draws no random numbers, so it must not change training).
Writes benchmarks/speed/sample_logging.md.

    python -m benchmarks.speed.sample_logging            # 3 x 2 runs of the 300-step demo, ~8 minutes here
    python -m benchmarks.speed.sample_logging --steps 60 --repeats 1
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT

ARMS = {"off": ["--log-samples", "0"], "default": [], "every step": ["--log-samples-every", "1"]}


def run(arm: str, steps: int | None, out_dir: str, name: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--output-dir", out_dir, "--run-name", name, *ARMS[arm]]
    if steps:
        cmd += ["--total-steps", str(steps)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    samples = os.path.join(out_dir, name, "samples.jsonl")
    n_samples = sum(1 for _ in open(samples)) if os.path.exists(samples) else 0
    evals = {r["step"] for r in rows if any(k.startswith("eval/") for k in r)}
    plain = [r["perf/step_time"] for r in rows if r["step"] not in evals and "perf/step_time" in r]
    curve = [(r["step"], r.get("reward/mean"), r.get("loss/policy"), r.get("eval/greedy_accuracy")) for r in rows]
    return {"wall": wall, "sum": sum(r.get("perf/step_time", 0.0) for r in rows),
            "median": statistics.median(r["perf/step_time"] for r in rows if "perf/step_time" in r),
            "plain_median": statistics.median(plain), "samples": n_samples, "curve": curve,
            "final": next((r["eval/greedy_accuracy"] for r in reversed(rows) if "eval/greedy_accuracy" in r), None)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="--total-steps of each run (default: the demo's own)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "speed", "sample_logging.md"))
    cli = p.parse_args()
    results = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(cli.repeats):
            for arm in ARMS:
                r = run(arm, cli.steps, tmp, f"{arm.replace(' ', '_')}_{rep}")
                results[arm].append(r)
                print(f"{arm} repeat {rep}: wall {r['wall']:.1f} s, step median {r['median'] * 1e3:.1f} ms, "
                      f"{r['samples']} samples", flush=True)
    same = all(r["curve"] == results["off"][0]["curve"] for rs in results.values() for r in rs)
    med = lambda arm, key: statistics.median(r[key] for r in results[arm])  # noqa: E731
    lines = ["# Sample logging's cost on the default grpo.py demo", "",
             f"`python -m benchmarks.speed.sample_logging{'' if cli.steps is None else f' --steps {cli.steps}'}"
             f"{'' if cli.repeats == 2 else f' --repeats {cli.repeats}'}`, {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} CPUs; {cli.repeats} runs per arm, arms alternating; figures are medians over the "
             "runs. Step times are `perf/step_time` (evaluation included); plain steps are the steps without an "
             "evaluation (where only `every step` logs samples).", "",
             "| arm | samples written | run wall s | sum of step times s | median step ms | median plain step ms "
             "| plain step vs off |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {results[arm][0]['samples']} | {med(arm, 'wall'):.1f} | {med(arm, 'sum'):.2f} | "
                     f"{med(arm, 'median') * 1e3:.1f} | {med(arm, 'plain_median') * 1e3:.1f} | "
                     f"{med(arm, 'plain_median') / med('off', 'plain_median'):.3f}x |")
    lines += ["", f"Same learning curve (reward/mean, loss/policy and eval/greedy_accuracy at every step) in all "
              f"{cli.repeats * len(ARMS)} runs: {'yes' if same else 'NO'}; final held-out greedy accuracy "
              f"{results['off'][0]['final']}."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
