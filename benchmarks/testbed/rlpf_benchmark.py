"""RLPF reward ablation on the embedded code tasks: correctness-only (RLVR) vs staged (RLPF) vs ungated speed.

    python -m benchmarks.testbed.rlpf_benchmark            # 40 steps per reward, seeds 1 and 2
    python -m benchmarks.testbed.rlpf_benchmark --steps 60 --seeds 1 2 3

For each reward and seed, the same steps and data from the same warm-started `testbed-code` model;
the final evaluation samples --eval-samples programs per task and reports the pass rate, the fraction
of correct programs faster than the slow baseline, Slow/CRR, and the mean speed-up T_b / T_c. It also
measures the timing noise itself: a pool of correct programs (each task's slow and fast references
and intermediate variants) is timed twice, on the tasks' timing inputs and on tiny inputs, and the
Spearman rank correlation of the two measurements is reported (the DMC paper, arXiv 2607.25970, and docs/rlpf.md:
tiny inputs make the speed signal nearly random). Writes benchmarks/testbed/rlpf_benchmark.md.
"""

import argparse
import os
import statistics
import time

import tyro

import rlpf
from code_env import sandbox
from code_env.tasks import TASKS, CodeTask, expected_outputs

REWARDS = ("correctness", "staged", "speed_ungated")
MIDDLE = {  # correct programs between the two references, so that the pool is not just two clusters
    "sum_range": ["def solve(n):\n return sum(range(n))\n"],
    "sum_squares": ["def solve(n):\n return sum(i * i for i in range(n))\n"],
    "count_multiples": ["def solve(n, k):\n return len(range(0, n, k))\n",
                        "def solve(n, k):\n return sum(1 for i in range(0, n, k))\n"],
    "has_duplicate": ["def solve(xs):\n s = set()\n for x in xs:\n  if x in s:\n   return True\n"
                      "  s.add(x)\n return False\n"],
    "count_common": ["def solve(xs, ys):\n s = set(ys)\n c = 0\n for x in xs:\n  if x in s:\n   c += 1\n return c\n"],
}


def spearman(a: list, b: list) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def timing_rank_correlation(tiny: bool) -> tuple[float, int]:
    """Rank correlation between two timings (medians of 3) of the same pool of correct programs, all tasks pooled."""
    runs = []
    for _ in range(2):
        rel = []
        for name, task in TASKS.items():
            if tiny:  # the tests' own small inputs as timing inputs: microsecond calls
                task = CodeTask(task.name, task.statement, task.signature, task.tests, task.tests[:4], task.slow,
                                task.fast)
            pool = [task.slow, task.fast, *MIDDLE[name]]
            tests_out, timing_out = expected_outputs(task)
            v = sandbox.measure(pool, task.tests, tests_out, task.timing, timing_out, sandbox.Limits(), repeats=3)
            assert all(x.status == "correct" for x in v), [(x.status, x.message) for x in v]
            rel += [x.runtime for x in v]
        runs.append(rel)
    return spearman(*runs), len(runs[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rewards", nargs="+", default=list(REWARDS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "rlpf_benchmark.md"))
    cli = p.parse_args()
    noise = {"timing inputs": timing_rank_correlation(False), "tiny inputs": timing_rank_correlation(True)}
    rows = []
    for seed in cli.seeds:
        for reward in cli.rewards:
            t0 = time.time()
            args = tyro.cli(rlpf.Args, args=["--total-steps", str(cli.steps), "--seed", str(seed), "--eval-every", "0",
                                             "--reward", reward, "--run-name", f"rlpf_{reward}_{seed}",
                                             "--output-dir", "runs/benchmarks"])
            out = rlpf.main(args)
            rows.append((reward, seed, out["before"], out["after"], time.time() - t0))
            write(cli, rows, noise)  # after every run, so that a partial benchmark is kept


def write(cli, rows: list, noise: dict) -> None:
    keys = ("eval/pass_rate", "eval/fast_frac", "eval/slow_correct_frac", "eval/mean_speedup")
    lines = [f"# RLPF rewards on the embedded code tasks ({cli.steps} steps of 5 tasks x 8 programs, lr 1e-4, "
             f"testbed-code; eval: 8 sampled programs per task)", "",
             "before -> after. fast_frac: fraction of correct programs at least 2x faster than the slow baseline; "
             "slow/CRR = 1 - fast_frac; speed-up: mean T_b / T_c over correct programs (T_b re-timed in the same "
             "rounds). wall s: seconds for the run (evaluations included) on the machine it ran on; other jobs' load "
             "changes it.", "",
             "| reward | seed | pass rate | fast_frac | slow/CRR | mean speed-up | wall s |",
             "|---|---|---|---|---|---|---|"]
    for reward, seed, b, a, wall in rows:
        cells = [f"{b[k]:.3f} -> {a[k]:.3f}" if "speedup" not in k else f"{b[k]:.1f} -> {a[k]:.1f}" for k in keys]
        lines.append(f"| {reward} | {seed} | " + " | ".join(cells) + f" | {wall:.0f} |")
    after = {(reward, seed): a for reward, seed, b, a, wall in rows}
    before = {seed: b for reward, seed, b, a, wall in rows}
    lines += ["", "Checks (computed from the table, per seed):", ""]
    for seed in sorted(before):
        c, s, u = (after.get((r, seed)) for r in REWARDS)
        if c and s:
            lines.append(f"- seed {seed}: staged vs correctness-only after training: slow/CRR "
                         f"{s['eval/slow_correct_frac']:.3f} vs {c['eval/slow_correct_frac']:.3f} "
                         f"({'lower' if s['eval/slow_correct_frac'] < c['eval/slow_correct_frac'] else 'not lower'}), "
                         f"pass rate {s['eval/pass_rate']:.3f} vs {c['eval/pass_rate']:.3f} "
                         f"({s['eval/pass_rate'] - c['eval/pass_rate']:+.3f})")
        if u:
            lines.append(f"- seed {seed}: ungated speed reward: pass rate {before[seed]['eval/pass_rate']:.3f} -> "
                         f"{u['eval/pass_rate']:.3f}, wrong outputs {before[seed]['eval/status/wrong_output']:.3f} -> "
                         f"{u['eval/status/wrong_output']:.3f}")
    lines += ["", "Each pass rate is over 40 sampled programs (5 tasks x 8), so its standard error is about 0.07.",
              "", "Timing noise: Spearman rank correlation between two measurements of the same correct programs "
              "(each task's slow and fast references and middle variants, median of 3, all tasks pooled):", ""]
    lines += [f"- {k}: {r:.3f} over {n} programs" for k, (r, n) in noise.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
