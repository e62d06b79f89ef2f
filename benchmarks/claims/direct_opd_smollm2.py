"""Direct-OPD's claim on a real model (issue 41): a weak teacher pair's shift onto a stronger student, SmolLM2-135M.

The claim (direct_opd.py): the post-RL / pre-RL log-ratio of a weak teacher pair, applied on a stronger student's own
samples with no verifier, improves the student, where vanilla on-policy distillation (imitating the post teacher)
drags it down toward the teacher (the paper: Qwen3-1.7B 48.3 -> 58.3 on AIME 2024 from a weaker teacher's RL).

The ground, on SmolLM2-135M-Instruct and testbed-nl:
- the teacher pair: the base model (pre) and its 30-step GRPO run on levels 1-2 (post;
  benchmarks/claims/grpo_smollm2.py's recipe, seed 1, `start_args`, the run the other SmolLM2 claims start from);
- the stronger student: the base model fine-tuned on the worked solutions of levels 1-3 (`sft_student`: another
  route than the teacher's RL, the same tokenizer; no larger SmolLM2 installs offline), which must beat the post
  teacher on held-out greedy accuracy over the training levels: measured first, and the claim's arms are run only
  where it does (else the verdict is "premise fails").
Four arms, the same recipe, prompts, steps, seeds and evaluation (levels 1-3): direct OPD, vanilla OPD (the post
teacher as target), the identical-teacher control (post = pre: the shift is 0, so the student must not move beyond
its KL term), and, for scale, GRPO on the student with the verifier. Measured: the trainers' held-out greedy
accuracy per level before and after, and the k3 KL to the student's start on its own samples (direct_opd.py's
loss/kl; grpo.py's policy/approx_kl is to the previous step and it keeps no reference at beta 0, so n/a for GRPO),
and the length of the sampled replies at the start and the end of each run (where the accuracy went).

    python -m benchmarks.claims.direct_opd_smollm2     # the student (30 minutes), 4 arms x 2 seeds (about 5 hours)
    python -m benchmarks.claims.direct_opd_smollm2 --seeds 1 --steps 2 --sft-steps 2 --num-eval-problems 4 \\
        --out /tmp/d.md --output-dir /tmp/d_runs --records /tmp/d_records --start-dir /tmp/d_start   # a smoke run

Budget: a direct-OPD step took 60-100 s on one thread beside another benchmark (the student, its reference and the
two teachers all run forwards), so a 30-step run about 40 minutes and the 8 runs about 5 hours, beyond the 90
minutes of ../shared/CLAIMS.md; kept so because 30 steps is the recipe of the other SmolLM2 claims. Every finished
run and measurement is a record in benchmarks/claims/runs/direct_opd_smollm2/ (benchmarks/claims/claim_runs.py), and an
interrupted run continues from its checkpoint: rerun the command until its report says it is complete. The verdict rule:
shown if direct OPD lifts the student's held-out accuracy (all levels) beyond the noise and ends above vanilla OPD
beyond the noise, on both seeds, with the control inside the noise; partly if direct ends above both its start and
vanilla OPD on both seeds inside the noise, or beyond it on one seed; else not shown.

The gate (benchmarks/claims/claim_runs.py, `claim`), once the pair and the student are measured and before any arm
trains: the pair's log-ratio carries a shift only on the levels where the post teacher beats the pre teacher beyond the
noise, so those are the judged split; the student must leave room there, and its problems must be able to show the
paper's gain. Where it fails, the verdict is "untestable here".
"""

import argparse
import json
import os
import random
import time

import torch
import tyro

import direct_opd
import grpo
from benchmarks import ROOT
from benchmarks.claims.claim_runs import (Claim, cached, finished_run, gate, gate_section, margin, untestable,
                                          verdict_lines)
from benchmarks.claims.grpo_smollm2 import START, start_args
from benchmarks.premises.testbed_premises import nl_accuracy
from common.data import encode_prompts, load_problems, render_prompt
from common.models import load_model, load_tokenizer
from common.rollout import attach, completion_logprobs
from grounds import path_of

MODEL = "smollm2-135m-instruct"
LEVELS = (1, 2, 3)
RECIPE = ["--dataset", "testbed-nl", "--levels", *map(str, LEVELS), "--num-prompts", "4", "--group-size", "8",
          "--max-new-tokens", "64", "--micro-batch-size", "16", "--share-prompt", "--learning-rate", "2e-5",
          "--eval-samples", "0", "--log-samples", "4", "--eval-every", "0", "--save-every", "10"]
"""grpo_smollm2's recipe on levels 1-3 (4 prompts x 8 samples, float32, full fine-tuning) with room for the student's
worked solutions: 64 new tokens, not 48 (a level-2 solution is 49-55 tokens of this tokenizer, so at 48 the student
scored 0.000 on level 2 in the trainers' evaluation against 0.925 at 64)"""
ARMS = {"direct": (direct_opd, ["--reward", "direct"]),
        "vanilla_opd": (direct_opd, ["--reward", "vanilla_opd"]),
        "control": (direct_opd, ["--reward", "direct"]),  # --teacher-post is the pre model: set in main
        "grpo_student": (grpo, [])}
"""run names are <arm>_seed<seed>, in the records folder that also holds the post teacher's grpo_seed1: hence not
'grpo' for the student's GRPO arm"""


def sft_student(out_dir: str, steps: int, seed: int = 1, batch: int = 16, lr: float = 2e-5) -> str:
    """SmolLM2-135M-Instruct fine-tuned on `steps` batches of testbed-nl training problems of LEVELS with their worked
    solutions as the reply (next-token loss on the reply and its end-of-turn token; AdamW, float32), saved with its
    tokenizer in out_dir. Built once: a folder holding model.safetensors is returned as it is."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok, model = load_tokenizer(path_of(MODEL)), load_model(path_of(MODEL))
    problems = load_problems("testbed-nl", "train", LEVELS, 0, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0 = time.time()
    for step in range(steps):
        chosen = rng.sample(problems, batch)
        prompts = encode_prompts(tok, [render_prompt(p, tok) for p in chosen])
        replies = [tok(p.solution + tok.eos_token, add_special_tokens=False)["input_ids"] for p in chosen]
        rows = attach(prompts, [(r, "", False) for r in replies], tok.pad_token_id)
        logp_BC, _ = completion_logprobs(model, rows.input_ids_BT, rows.attention_mask_BT, rows.prompt_len)
        loss = -(logp_BC * rows.completion_mask_BC).sum() / rows.completion_mask_BC.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"sft step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def level_cells(model_dir: str, n: int) -> dict:
    """Greedy accuracy on n held-out problems of each level (64 new tokens; a cut reply scores 0) and their mean."""
    tok, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    cells = {}
    for lv in LEVELS:
        problems = load_problems("testbed-nl", "test", (lv,), n, 0)
        cells[f"L{lv}"] = nl_accuracy(model, tok, problems, [render_prompt(p, tok) for p in problems])
    cells["all"] = sum(cells[f"L{lv}"] for lv in LEVELS) / len(LEVELS)
    return cells


def claim(cli, cells: dict) -> Claim:
    """The claim's gate declaration: on the levels the pair's shift lives on, direct OPD lifts the student by the
    paper's gain."""
    n = cli.num_eval_problems
    pre, post = cells["pre teacher (base)"], cells["post teacher"]
    shifted = [lv for lv in LEVELS if post[f"L{lv}"] - pre[f"L{lv}"] > margin(post[f"L{lv}"], pre[f"L{lv}"], n)]
    start = sum(cells["student"][f"L{lv}"] for lv in shifted) / max(len(shifted), 1) if shifted else 0.0
    distinct = min(len({p.question for p in load_problems("testbed-nl", "test", shifted, n, s)}) for s in cli.seeds)
    return Claim(split=f"held-out level{'s' if len(shifted) > 1 else ''} {', '.join(map(str, shifted)) or 'none'} "
                       f"(where the post teacher beats the pre teacher beyond the noise), {n} problems a level",
                 n=distinct if shifted else 0, seeds=list(cli.seeds), start={s: start for s in cli.seeds},
                 start_is="greedy accuracy of the student (every arm's start; the cells)", effect=0.10,
                 effect_is="the paper: Qwen3-1.7B 48.3 -> 58.3 on AIME 2024",
                 contexts_are="none: the teachers score the student's own samples on the same prompt")


def mean_kl(rows: list, last: int = 5) -> float:
    """direct_opd.py's loss/kl (k3 to the student's start, on its samples), averaged over the last `last` steps."""
    kl = [r["loss/kl"] for r in rows if "loss/kl" in r][-last:]
    return sum(kl) / max(len(kl), 1)


def reply_tokens(rows: list, k: int = 5) -> tuple[float, float]:
    """Mean sampled reply length (rollout/completion_len) over a run's first k and last k steps."""
    lens = [r["rollout/completion_len"] for r in rows if "rollout/completion_len" in r]
    return sum(lens[:k]) / max(len(lens[:k]), 1), sum(lens[-k:]) / max(len(lens[-k:]), 1)


def verdict(acc: dict, seeds: list, n: int) -> tuple[str, list[str]]:
    """The rule of the module docstring on {(arm, seed): (before, after)} held-out accuracies over n problems."""
    beyond, ahead, notes = [], [], []
    for s in seeds:
        (b, d), v, c = acc[("direct", s)], acc[("vanilla_opd", s)][1], acc[("control", s)]
        still = abs(c[1] - c[0]) <= margin(c[0], c[1], n)
        beyond.append(d - b > margin(d, b, n) and d - v > margin(d, v, n) and still)
        ahead.append(d > b and d > v)
        notes.append(f"seed {s}: direct {b:.3f} -> {d:.3f} ({d - b:+.3f}, noise +-{margin(d, b, n):.3f}); vanilla "
                     f"OPD -> {v:.3f} (direct {d - v:+.3f} above it, noise +-{margin(d, v, n):.3f}); control "
                     f"{c[0]:.3f} -> {c[1]:.3f} ({'still' if still else 'moved beyond the noise'})")
    if all(beyond):
        return "shown", notes
    if all(ahead) or any(beyond):
        return "partly shown", notes
    return "not shown", notes


def report(cli, cells: dict, runs: dict, teacher: dict, section: list, failed: list) -> str:
    done = [s for s in cli.seeds if all((a, s) in runs for a in ("direct", "vanilla_opd", "control"))]
    n = cli.num_eval_problems * len(LEVELS)
    ev = lambda rec: [r for r in rec["rows"] if "eval/greedy_accuracy" in r]  # noqa: E731
    lines = ["# Direct-OPD on SmolLM2-135M-Instruct (issue 41)", "",
             f"`python -m benchmarks.claims.direct_opd_smollm2 --seeds {' '.join(map(str, cli.seeds))} "
             f"--steps {cli.steps} --sft-steps {cli.sft_steps} --num-eval-problems {cli.num_eval_problems}`, "
             f"{time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()}-core CPU, float32, {torch.get_num_threads()} thread(s). Held-out greedy accuracy on "
             f"{cli.num_eval_problems} testbed-nl problems a level, levels {', '.join(map(str, LEVELS))} ('all': their "
             f"mean, {n} problems; a difference of two such is noise up to +-{margin(0.5, 0.5, n):.2f} at 0.5).", "",
             *section, "## The ground", "",
             f"The pair: pre = {MODEL}, post = its GRPO run (benchmarks/claims/grpo_smollm2.py's recipe, seed 1, 30 "
             f"steps on levels 1-2; {teacher['seconds'] / 60:.0f} minutes). The student: {MODEL} after "
             f"{cli.sft_steps} steps of 16 worked solutions of levels 1-3 (supervised, `sft_student`). Cells: 64 new "
             "tokens.", "",
             "| model | " + " | ".join(f"L{lv}" for lv in LEVELS) + " | all |", "|---|" + "---|" * (len(LEVELS) + 1)]
    for name, c in cells.items():
        lines.append(f"| {name} | " + " | ".join(f"{c[f'L{lv}']:.3f}" for lv in LEVELS) + f" | {c['all']:.3f} |")
    holds = cells["student"]["all"] > cells["post teacher"]["all"]
    lines += ["", f"The student {'beats' if holds else 'does not beat'} the post teacher "
              f"({cells['student']['all']:.3f} against {cells['post teacher']['all']:.3f})."]
    if not holds:
        lines += ["", "## Verdict: premise fails", "", "The arms were not run: the student is not the stronger model."]
        return "\n".join(lines) + "\n"
    lines += ["", "## The arms", "",
              f"Each arm: `python direct_opd.py --model-name STUDENT --teacher-pre {MODEL} --teacher-post POST "
              f"{' '.join(RECIPE)} --total-steps {cli.steps} --num-eval-problems {cli.num_eval_problems} --seed S "
              "--reward direct|vanilla_opd` (control: --teacher-post the pre model), and `python grpo.py --model-name "
              "STUDENT` with the same flags. Accuracy: the trainers' own held-out evaluation (64 new tokens). KL: "
              "k3 to the student's start on its own samples, mean of the last 5 steps (direct_opd.py's loss/kl; "
              "GRPO: n/a, it has no reference model at beta 0). Reply tokens: the sampled replies' mean length over the "
              "first and the last 5 steps.", "",
              "| arm | seed | " + " | ".join(f"L{lv} before -> after" for lv in LEVELS) + " | all before -> after | "
              "KL to start | reply tokens | minutes |", "|---|---|" + "---|" * len(LEVELS) + "---|---|---|---|"]
    acc = {}
    for (arm, seed), rec in runs.items():
        e = ev(rec)
        acc[(arm, seed)] = (e[0]["eval/greedy_accuracy"], e[-1]["eval/greedy_accuracy"])
        per = " | ".join(f"{e[0][f'eval/greedy_accuracy/level_{lv}']:.3f} -> {e[-1][f'eval/greedy_accuracy/level_{lv}']:.3f}"
                         for lv in LEVELS)
        kl = f"{mean_kl(rec['rows']):.4f}" if arm != "grpo_student" else "n/a"
        first, last = reply_tokens(rec["rows"])
        lines.append(f"| {arm} | {seed} | {per} | {acc[(arm, seed)][0]:.3f} -> {acc[(arm, seed)][1]:.3f} | {kl} | "
                     f"{first:.0f} -> {last:.0f} | {rec['seconds'] / 60:.0f} |")
    first, last = reply_tokens(teacher["rows"])
    lines += ["", f"The post teacher's own GRPO run went from {first:.0f} to {last:.0f} reply tokens: what its RL "
              "learned, and what the pair's log-ratio carries, includes the length of the reply."]
    def judge(done):
        status, notes = verdict(acc, done, n)
        fell = [s for s in done if ("grpo_student", s) in acc and acc[("grpo_student", s)][0] - acc[("grpo_student", s)][1]
                > margin(*acc[("grpo_student", s)], n)]
        if fell:  # ../shared/CLAIMS.md: a learning rate that breaks the control voids every arm
            notes.append(f"GRPO on the student with the true verifier fell beyond the noise on seed(s) "
                         f"{', '.join(map(str, fell))}: the learning rate breaks the control, which voids every arm")
        return (f"{untestable(failed)} (the rule alone: {status})" if failed else status), notes

    lines += verdict_lines(done, cli.seeds, judge,
                           "The rule (module docstring): direct OPD lifts the student beyond the noise and ends above "
                           "vanilla OPD beyond it, on both seeds, with the control still: shown; above both on both "
                           "seeds inside the noise, or beyond it on one seed: partly; else not shown.")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30, help="training steps of every arm (and of the post teacher)")
    p.add_argument("--sft-steps", type=int, default=60, help="supervised steps (16 solutions each) of the student")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--num-eval-problems", type=int, default=40, help="held-out problems a level")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "claims", "direct_opd_smollm2.md"))
    p.add_argument("--output-dir", default=os.path.join("runs", "direct_opd_smollm2"), help="run folders")
    p.add_argument("--start-dir", default=START, help="the post teacher's run folder (shared with the other claims)")
    p.add_argument("--records", default=os.path.join(ROOT, "benchmarks", "claims", "runs", "direct_opd_smollm2"))
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing new")
    cli = p.parse_args()
    os.chdir(ROOT)  # relative model paths in the runs' arguments: records made in one clone are read in another
    n = cli.num_eval_problems
    teacher = finished_run(grpo, start_args(cli.steps, cli.start_dir), cli.records, weights=not cli.report_only,
                           make=not cli.report_only)
    post = os.path.join(cli.start_dir, "grpo_seed1", "checkpoint")
    student = os.path.join(cli.output_dir, f"student_sft{cli.sft_steps}")
    if not cli.report_only:
        sft_student(student, cli.sft_steps)
    cells = {name: cached(os.path.join(cli.records, f"cells_{key}.json"), {"n": n, "sft_steps": cli.sft_steps,
                                                                           "start_steps": cli.steps},
                          lambda path=path: level_cells(path, n), make=not cli.report_only)
             for name, key, path in (("pre teacher (base)", "pre", path_of(MODEL)), ("post teacher", "post", post),
                                     ("student", "student", student))}
    lines, failed = gate(claim(cli, cells), {"leaks": 0, "contexts": 0})
    section = gate_section([(lines, failed)])
    print("\n".join(section))
    runs = {}
    if cells["student"]["all"] > cells["post teacher"]["all"]:
        for seed in cli.seeds:
            for arm in cli.arms:
                module, flags = ARMS[arm]
                pair = ([] if module is grpo else
                        ["--teacher-pre", MODEL, "--teacher-post", MODEL if arm == "control" else post])
                args = tyro.cli(module.Args, args=["--model-name", student, *RECIPE, *flags, *pair,
                                                   "--total-steps", str(cli.steps), "--num-eval-problems", str(n),
                                                   "--seed", str(seed), "--output-dir", cli.output_dir,
                                                   "--run-name", f"{arm}_seed{seed}"])
                if cli.report_only and not os.path.exists(os.path.join(cli.records, f"{args.run_name}.json")):
                    continue
                runs[(arm, seed)] = finished_run(module, args, cli.records, make=not cli.report_only)
                with open(cli.out, "w") as f:
                    f.write(report(cli, cells, runs, teacher, section, failed))
    text = report(cli, cells, runs, teacher, section, failed)
    with open(cli.out, "w") as f:
        f.write(text)
    print(text)
    print(json.dumps({k: v for k, v in cells.items()}))


if __name__ == "__main__":
    main()
