"""grpo.py on a real pretrained chat model: SmolLM2-135M-Instruct on --dataset testbed-nl, on this CPU.

Held-out greedy accuracy before and after, per level, for each seed, and what the gain is made of: the share of
greedy answers in the expected format (a reply that ends "The answer is N.", eval/format_rate) and cut at
--max-new-tokens (eval/truncated_frac), and the accuracy among the answers in format. Writes
benchmarks/claims/grpo_smollm2.md and docs/img/grpo_smollm2.png (held-out accuracy and format rate against step).

    python -m benchmarks.claims.grpo_smollm2               # seeds 1 and 2 (the time it took: its report's header)
    python -m benchmarks.claims.grpo_smollm2 --seeds 1 --steps 2 --eval-every 1 --num-eval-problems 4  # a smoke run

The run is grpo.py's own main with the flags printed in the report (the command reproduces one seed); the recipe
is sized to the CPU: 4 prompts x 8 samples, 48 new tokens, --share-prompt, full fine-tuning in float32.

Before the runs, the gate (benchmarks/claims/claim_runs.py, `claim`): the base model's greedy accuracy on each seed's
held-out problems (the trainer's own evaluation at step 0, measured first and kept in
benchmarks/claims/runs/grpo_smollm2/), and whether the planned problems can show the gain the claim needs. `--gate-only`
measures it and writes its section into the existing report, running nothing else.
"""

import argparse
import json
import os
import time

import tyro

import grpo
from benchmarks import ROOT
from benchmarks.claims.claim_runs import Claim, cached, gate, gate_section, with_gate
from common.logger import read_metrics

RECIPE = ["--model-name", "smollm2-135m-instruct", "--dataset", "testbed-nl", "--levels", "1", "2",
          "--num-prompts", "4", "--group-size", "8", "--max-new-tokens", "48", "--micro-batch-size", "16",
          "--share-prompt", "--learning-rate", "2e-5", "--eval-samples", "0", "--log-samples", "4"]


START = os.path.join("runs", "smollm2_start")
"""where the post-GRPO model the other SmolLM2 claims start from is trained (relative to the repository)"""


def start_args(steps: int = 30, output_dir: str = START, max_new_tokens: int = 48,
               run_name: str = "grpo_seed1") -> "grpo.Args":
    """The run whose final weights the SmolLM2 claims start from (MADA-RL's critics, AdaKP): RECIPE, seed 1, `steps`
    steps, greedy evaluation on 40 problems a level before and after, a checkpoint every 10 steps. With
    benchmarks.claims.claim_runs.finished_run(grpo, start_args(), records, weights=True) a checkout without the folder
    trains it again (about 16 minutes on one thread); its weights are <output_dir>/<run_name>/checkpoint. Direct-OPD's
    post teacher is this recipe at another cap (`max_new_tokens`), under its own run name."""
    recipe = list(RECIPE)
    recipe[recipe.index("--max-new-tokens") + 1] = str(max_new_tokens)
    return tyro.cli(grpo.Args, args=[*recipe, "--total-steps", str(steps), "--seed", "1", "--eval-every", "0",
                                     "--num-eval-problems", "40", "--save-every", "10", "--output-dir", output_dir,
                                     "--run-name", run_name])


MODEL, LEVELS = "smollm2-135m-instruct", (1, 2)
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "grpo_smollm2")


def start_accuracy(path: str, levels, n: int, seed: int, max_new_tokens: int = 48, make: bool = True) -> dict:
    """The base model's held-out greedy accuracy as a trainer measures it at step 0 (common.evaluate on the problems
    of `seed`, `max_new_tokens`), kept in the record `path`; with "distinct", the distinct problems it was measured on
    (testbed-nl repeats level 1's sums when asked for more than it has). make=False: the record only (a report)."""
    def measure():
        from common.data import load_problems
        from common.evaluate import evaluate
        from common.models import load_model, load_tokenizer
        from common.rollout import HFEngine
        from grounds import path_of

        tok, model = load_tokenizer(path_of(MODEL)), load_model(path_of(MODEL)).eval()
        problems = load_problems("testbed-nl", "test", levels, n, seed)
        return {**evaluate(HFEngine(model, tok), tok, problems, max_new_tokens),
                "distinct": len({p.question for p in problems})}

    return cached(path, {"levels": list(levels), "n": n, "seed": seed, "max_new_tokens": max_new_tokens}, measure,
                  make)


def claim(seeds, n: int, records: str = RECORDS) -> Claim:
    """The claim's gate declaration: GRPO lifts held-out accuracy on levels 1-2 over its start, by the size grpo.py
    lifted the embedded testbed (no paper figure is for this model: a stated plausible size)."""
    start = {s: start_accuracy(os.path.join(records, f"start_seed{s}.json"), LEVELS, n, s) for s in seeds}
    return Claim(split=f"held-out levels 1-2, {n} problems a level (the trainer's evaluation)",
                 n=min(r["distinct"] for r in start.values()), seeds=list(seeds),
                 start={s: r["eval/greedy_accuracy"] for s, r in start.items()},
                 start_is="greedy accuracy of the base model (the run's start)", effect=0.235,
                 effect_is="plausible: grpo.py's gain on the embedded testbed's level 3, claims.md")


def greedy_answers(run_dir: str, step: int) -> list[dict]:
    """The eval samples logged at `step` (samples.jsonl), to read what the answers look like."""
    path = os.path.join(run_dir, "samples.jsonl")
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval" and r["step"] == step]


def plot(runs: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for seed, run_dir in runs.items():
        rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "eval/greedy_accuracy" in r]
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["eval/greedy_accuracy"] for r in rows], "o-", label=f"seed {seed}", markersize=3)
        axes[1].plot(steps, [r["eval/format_rate"] for r in rows], "o-", label=f"seed {seed} format", markersize=3)
        axes[1].plot(steps, [r["eval/truncated_frac"] for r in rows], "x--", label=f"seed {seed} cut", markersize=3)
    axes[0].set_title("held-out greedy accuracy (levels 1-2)", fontsize=9)
    axes[1].set_title("greedy answers in format / cut at the cap", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out problems per level")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "grpo_smollm2.md"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "grpo_smollm2.png"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "grpo_smollm2"))
    p.add_argument("--gate-only", action="store_true", help="measure the gate and write it into the existing report")
    cli = p.parse_args()
    flags = [*RECIPE, "--total-steps", str(cli.steps), "--eval-every", str(cli.eval_every),
             "--num-eval-problems", str(cli.num_eval_problems)]
    section = gate_section([gate(claim(cli.seeds, cli.num_eval_problems), {"leaks": 0, "contexts": 0})])
    print("\n".join(section))
    if cli.gate_only:
        with open(cli.out) as f:
            text = with_gate(f.read(), section)
        with open(cli.out, "w") as f:
            f.write(text)
        return
    results, runs, t_start = {}, {}, time.time()
    for seed in cli.seeds:
        t0 = time.time()
        out = grpo.main(tyro.cli(grpo.Args, args=[*flags, "--seed", str(seed), "--output-dir", cli.output_dir,
                                                  "--run-name", f"seed{seed}"]))
        runs[seed], results[seed] = out["run_dir"], {**out, "wall_s": time.time() - t0}
    lines = ["# grpo.py on SmolLM2-135M-Instruct (testbed-nl levels 1-2)", "",
             f"`python -m benchmarks.claims.grpo_smollm2 --seeds {' '.join(map(str, cli.seeds))} --steps {cli.steps} "
             f"--eval-every {cli.eval_every} --num-eval-problems {cli.num_eval_problems}`, {time.strftime('%Y-%m-%d')},"
             f" {os.cpu_count()}-core CPU, float32, {(time.time() - t_start) / 60:.0f} minutes. Each seed is "
             f"`python grpo.py {' '.join(flags)} --seed S`. Greedy held-out answers, "
             f"{cli.num_eval_problems} problems per level, up to 48 new tokens; a cut answer scores 0.", "",
             *section, "| seed | greedy before | after | level 1 | level 2 | in format (before -> after) | cut at the cap | "
             "accuracy among answers in format | wall min |", "|---|---|---|---|---|---|---|---|---|"]
    for seed, r in results.items():
        b, a = r["before"], r["after"]
        in_fmt = lambda m: (f'{m["eval/greedy_accuracy"] / m["eval/format_rate"]:.3f}'  # noqa: E731
                            if m["eval/format_rate"] else "n/a")  # no answer in format: nothing to divide
        lines.append(
            f"| {seed} | {b['eval/greedy_accuracy']:.3f} | {a['eval/greedy_accuracy']:.3f} | "
            f"{b['eval/greedy_accuracy/level_1']:.3f} -> {a['eval/greedy_accuracy/level_1']:.3f} | "
            f"{b['eval/greedy_accuracy/level_2']:.3f} -> {a['eval/greedy_accuracy/level_2']:.3f} | "
            f"{b['eval/format_rate']:.3f} -> {a['eval/format_rate']:.3f} | "
            f"{b['eval/truncated_frac']:.3f} -> {a['eval/truncated_frac']:.3f} | "
            f"{in_fmt(b)} -> {in_fmt(a)} | {r['wall_s'] / 60:.0f} |")
    lines += ["", "'accuracy among answers in format' is accuracy / format rate: an upper bound on how often an answer "
              "in the expected format is right (a right answer can also be out of format); n/a where no answer is in "
              "format. The reward is correctness alone (--format-reward-weight 0): the answer rule takes the last "
              "number of a reply without the answer line, so the line is not rewarded.", "",
              "Greedy answers of the first held-out problems, before and after (seed "
              f"{cli.seeds[0]}; samples.jsonl of the run):", ""]
    first = results[cli.seeds[0]]
    for label, step in (("before", 0), ("after", cli.steps)):
        for s in greedy_answers(runs[cli.seeds[0]], step)[:3]:
            lines.append(f"- {label}, gold {s['gold']}: `{s['completion'][:160]!r}`")
    lines += ["", f"Per-step metrics: {os.path.relpath(first['run_dir'], ROOT)}/metrics.jsonl (not committed)."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)
    plot(runs, cli.plot)


if __name__ == "__main__":
    main()
