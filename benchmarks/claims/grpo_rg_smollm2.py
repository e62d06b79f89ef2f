"""grpo.py on a reasoning-gym task, SmolLM2-135M-Instruct on this CPU, beside TRL's GRPOTrainer on the same budget.

The task is the one the zero-shot table (benchmarks/premises/rg_zero_shot_smollm2.md) found with headroom:
chain_sum level 0 (sums and differences of two one-digit numbers, scored by reasoning-gym's own score_answer).
Held-out greedy accuracy against step for grpo.py on two seeds, and for TRL 1.16's GRPOTrainer on one seed with the
same model, prompts (common.data.render_prompt, the same strings), training problems, group size, prompts a step,
learning rate, temperature, new tokens, steps, loss (token mean over the batch, no KL, group-std advantages) and the
same held-out evaluation (common.evaluate, greedy). Writes benchmarks/claims/grpo_rg_smollm2.md and
docs/img/grpo_rg_smollm2.png.

    python -m benchmarks.claims.grpo_rg_smollm2                  # grpo.py seeds 1 and 2, TRL seed 1
    python -m benchmarks.claims.grpo_rg_smollm2 --seeds 1 --trl-seeds 1 --steps 2 --eval-every 1 \
        --num-eval-problems 4 --output-dir runs/smoke_rg --records runs/smoke_rg/records   # a smoke run

Every finished run is kept in benchmarks/claims/runs/grpo_rg_smollm2/ (benchmarks/claims/claim_runs.py), so a rerun
reads it back instead of training again. Needs TRL for its peer arm (requirements-bench.txt); `--trl-seeds` with no
seed skips it. Before any run, the gate: the base model's greedy accuracy on each seed's held-out problems (headroom),
and whether the planned problems can show the gain the claim needs (power); GRPO adds nothing to a prompt (leakage 0).
"""

import argparse
import os
import time

import tyro

import grpo
from benchmarks import ROOT
from benchmarks.claims.claim_runs import Claim, cached, finished_run, gate, gate_section, margin
from benchmarks.claims.grpo_smollm2 import greedy_answers

MODEL, DATASET, LEVELS = "smollm2-135m-instruct", "rg:chain_sum", (0,)
PROMPTS, GROUP, MAX_NEW, LR, MICRO = 4, 8, 128, 2e-5, 16
RECIPE = ["--model-name", MODEL, "--dataset", DATASET, "--levels", *map(str, LEVELS), "--num-prompts", str(PROMPTS),
          "--group-size", str(GROUP), "--max-new-tokens", str(MAX_NEW), "--micro-batch-size", str(MICRO),
          "--share-prompt", "--learning-rate", str(LR), "--eval-samples", "0", "--log-samples", "4"]
RECORDS = os.path.join(ROOT, "benchmarks", "claims", "runs", "grpo_rg_smollm2")


def held_out(seed: int, n: int) -> list:
    """The held-out problems a grpo.py run of `seed` evaluates on (common.data.load_train_eval), and its training
    problems: ([train], [held out])."""
    from common.data import load_train_eval

    args = tyro.cli(grpo.Args, args=[*RECIPE, "--seed", str(seed), "--num-eval-problems", str(n)])
    return load_train_eval(args)


def start_accuracy(path: str, n: int, seed: int) -> dict:
    """The base model's held-out greedy accuracy as grpo.py measures it at step 0, kept in the record `path`, with
    "distinct", the distinct questions among the n (level 0 has few: seeds repeat them)."""
    def measure():
        from common.evaluate import evaluate
        from common.models import load_model, load_tokenizer, mask_padded_head
        from common.rollout import HFEngine
        from grounds import path_of

        tok, model = load_tokenizer(path_of(MODEL)), load_model(path_of(MODEL)).eval()
        mask_padded_head(model, len(tok))
        problems = held_out(seed, n)[1]
        return {**evaluate(HFEngine(model, tok), tok, problems, MAX_NEW),
                "distinct": len({p.question for p in problems})}

    return cached(path, {"dataset": DATASET, "levels": list(LEVELS), "n": n, "seed": seed, "max_new_tokens": MAX_NEW},
                  measure)


def claim(seeds, n: int, records: str) -> Claim:
    start = {s: start_accuracy(os.path.join(records, f"start_seed{s}.json"), n, s) for s in seeds}
    return Claim(split=f"held-out chain_sum level 0, {n} problems (the trainer's evaluation)",
                 n=min(r["distinct"] for r in start.values()), seeds=list(seeds),
                 start={s: r["eval/greedy_accuracy"] for s, r in start.items()},
                 start_is="greedy accuracy of the base model (the run's start)", effect=0.235,
                 effect_is="plausible: grpo.py's gain on the embedded testbed's level 3, claims.md")


def run_trl(seed: int, steps: int, eval_every: int, n: int) -> dict:
    """TRL's GRPOTrainer on grpo.py's recipe: {"curve": {step: held-out greedy accuracy}, "rewards": [train reward
    mean a step], "seconds": training and evaluation, "step_seconds": [a step's time]}."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import render_prompt
    from common.evaluate import evaluate
    from common.models import load_model, load_tokenizer, mask_padded_head
    from common.rollout import HFEngine
    from common.verifiers import score
    from grounds import path_of

    torch.manual_seed(seed)
    tok, model = load_tokenizer(path_of(MODEL)), load_model(path_of(MODEL))
    mask_padded_head(model, len(tok))
    train, test = held_out(seed, n)
    by_question = {p.question: p for p in train}
    ds = Dataset.from_dict({"prompt": [render_prompt(p, tok) for p in train], "question": [p.question for p in train]})

    def reward(completions, question, **kwargs):
        return score(completions, [by_question[q] for q in question])

    curve, rewards, step_seconds, t_start = {}, [], [], time.time()

    def held_out_accuracy(step):
        was_training = model.training
        model.eval()
        curve[step] = evaluate(HFEngine(model, tok), tok, test, MAX_NEW)["eval/greedy_accuracy"]
        model.train(was_training)
        print(f"trl seed {seed} step {step}: held-out greedy accuracy {curve[step]:.3f}", flush=True)

    class Probe(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **k):
            step_seconds.append(time.perf_counter() - self.t0)
            if eval_every and state.global_step % eval_every == 0 or state.global_step == steps:
                held_out_accuracy(state.global_step)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    held_out_accuracy(0)
    cfg = GRPOConfig(
        output_dir=os.path.join(ROOT, "runs", f"trl_rg_{os.getpid()}"), use_cpu=True, bf16=False,
        gradient_checkpointing=False, per_device_train_batch_size=MICRO, num_generations=GROUP,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO, max_completion_length=MAX_NEW, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=steps,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1,
        disable_dropout=True, logging_steps=1, report_to="none", save_strategy="no", seed=seed,
        dataloader_num_workers=0)
    GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                callbacks=[Probe()]).train()
    return {"curve": curve, "rewards": rewards, "seconds": time.time() - t_start, "step_seconds": step_seconds}


def curve_of(rows: list) -> dict:
    return {r["step"]: r["eval/greedy_accuracy"] for r in rows if "eval/greedy_accuracy" in r}


def plot(curves: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for label, curve in curves.items():
        steps = sorted(curve, key=int)
        ax.plot([int(s) for s in steps], [curve[s] for s in steps], "o-" if "grpo.py" in label else "s--",
                label=label, markersize=3)
    ax.set_title("SmolLM2-135M-Instruct, reasoning-gym chain_sum level 0", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="grpo.py's seeds")
    p.add_argument("--trl-seeds", type=int, nargs="*", default=[1], help="TRL's seeds (none: skip TRL)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--num-eval-problems", type=int, default=80, help="held-out problems (level 0 repeats some)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "grpo_rg_smollm2.md"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "grpo_rg_smollm2.png"))
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "grpo_rg_smollm2"))
    p.add_argument("--records", default=RECORDS, help="where finished runs are kept (read back by a rerun)")
    p.add_argument("--gate-only", action="store_true", help="measure the gate, print it and stop")
    cli = p.parse_args()
    n = cli.num_eval_problems
    flags = [*RECIPE, "--total-steps", str(cli.steps), "--eval-every", str(cli.eval_every), "--num-eval-problems",
             str(n)]
    the_claim = claim(cli.seeds, n, cli.records)
    section = gate_section([gate(the_claim, {"leaks": 0, "contexts": 0})])
    print("\n".join(section))
    if cli.gate_only:
        return
    t_start, ours, trl = time.time(), {}, {}
    for seed in cli.seeds:
        args = tyro.cli(grpo.Args, args=[*flags, "--seed", str(seed), "--output-dir", cli.output_dir,
                                         "--run-name", f"seed{seed}"])
        ours[seed] = finished_run(grpo, args, cli.records)
    for seed in cli.trl_seeds:
        settings = {"seed": seed, "steps": cli.steps, "eval_every": cli.eval_every, "n": n, "prompts": PROMPTS,
                    "group": GROUP, "max_new_tokens": MAX_NEW, "lr": LR}
        trl[seed] = cached(os.path.join(cli.records, f"trl_seed{seed}.json"), settings,
                           lambda: run_trl(seed, cli.steps, cli.eval_every, n))
    curves = {**{f"grpo.py seed {s}": curve_of(r["rows"]) for s, r in ours.items()},
              **{f"TRL seed {s}": {int(k): v for k, v in r["curve"].items()} for s, r in trl.items()}}
    steps = sorted({k for c in curves.values() for k in c})
    lines = ["# grpo.py on reasoning-gym chain_sum (SmolLM2-135M-Instruct), beside TRL's GRPOTrainer", "",
             f"`python -m benchmarks.claims.grpo_rg_smollm2 --seeds {' '.join(map(str, cli.seeds))} --trl-seeds "
             f"{' '.join(map(str, cli.trl_seeds))} --steps {cli.steps} --eval-every {cli.eval_every} "
             f"--num-eval-problems {n}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, float32 "
             f"({(time.time() - t_start) / 60:.0f} minutes in this call; runs read back from "
             f"{os.path.relpath(cli.records, ROOT)}/ count none). A grpo.py seed is `python grpo.py {' '.join(flags)} "
             f"--seed S`. TRL 1.16 GRPOTrainer: the same model, prompt strings, training problems, {PROMPTS} prompts x "
             f"{GROUP} samples a step, lr {LR} constant, temperature 1, {MAX_NEW} new tokens, loss_type dapo (token "
             "mean over the batch, as --loss-agg token_mean), scale_rewards group, beta 0, micro-batches of "
             f"{MICRO}; HF generate. Held-out: greedy, {n} problems of level 0 drawn by the seed, scored by "
             "reasoning-gym's score_answer on the extracted answer.", "", *section,
             "| run | " + " | ".join(f"step {s}" for s in steps) + " | s a step (median) | minutes |",
             "|---|" + "---|" * len(steps) + "---|---|"]
    seconds = {**{f"grpo.py seed {s}": (sorted(x["perf/step_time"] for x in r["rows"] if "perf/step_time" in x),
                                        r["seconds"]) for s, r in ours.items()},
               **{f"TRL seed {s}": (sorted(r["step_seconds"]), r["seconds"]) for s, r in trl.items()}}
    for label, curve in curves.items():
        per, total = seconds[label]
        med = per[len(per) // 2] if per else float("nan")
        lines.append(f"| {label} | " + " | ".join(f"{curve[s]:.3f}" if s in curve else "" for s in steps)
                     + f" | {med:.1f} | {total / 60:.0f} |")
    final = {label: c[max(c)] for label, c in curves.items() if c}
    first = {label: c[min(c)] for label, c in curves.items() if c}
    notes = [f"{label}: {first[label]:.3f} -> {final[label]:.3f} ({final[label] - first[label]:+.3f}; beyond the noise "
             f"when above {margin(final[label], first[label], the_claim.n):.3f})" for label in final]
    for s in set(cli.seeds) & set(cli.trl_seeds):
        a, b = final[f"grpo.py seed {s}"], final[f"TRL seed {s}"]
        notes.append(f"seed {s}, grpo.py against TRL at the last step: {a:.3f} against {b:.3f} ({a - b:+.3f}; the "
                     f"noise rule's margin at {the_claim.n} distinct problems: {margin(a, b, the_claim.n):.3f})")
    lines += ["", "Step times and minutes are as measured, on a machine shared with other jobs (helpers, other benchmarks, "
              "a test run), not side by side: they do not compare speed. The alternating side-by-side throughput of the "
              "two on this model is benchmarks/speed/trl_throughput_smollm2.md."]
    lines += ["", "Noise: each figure is one seed's greedy accuracy on its held-out problems; a difference between two "
              "figures is beyond the noise when above the margin given (95 %, two proportions, ../shared/CLAIMS.md, "
              "at the smallest seed's distinct questions).", "", *[f"- {x}" for x in notes]]
    if ours:
        run_dir = os.path.join(cli.output_dir, f"seed{cli.seeds[0]}")
        if os.path.exists(os.path.join(run_dir, "samples.jsonl")):
            lines += ["", f"Greedy answers of the first held-out problems, before and after (grpo.py seed {cli.seeds[0]}):",
                      ""]
            for label, step in (("before", 0), ("after", cli.steps)):
                lines += [f"- {label}, gold {r['gold']}: `{r['completion'][:160]!r}`"
                          for r in greedy_answers(run_dir, step)[:3]]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(cli.out, "w") as f:
        f.write(text)
    plot(curves, cli.plot)


if __name__ == "__main__":
    main()
