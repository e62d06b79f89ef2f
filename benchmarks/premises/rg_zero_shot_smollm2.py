"""Which reasoning-gym tasks can SmolLM2-135M-Instruct learn? Its zero-shot score on `--dataset rg:<task>` (common/
reasoning_gym.py), a cell per task and level: greedy and sampled (temperature 1, top_p 1, `--samples` a problem),
each scored two ways from the same replies:

- ours: the trainers' verifier (common.verifiers.score: `extract_rg_answer`, i.e. the <answer> tags, else the model's
  own "the answer ... is X", else the last number; then the task's score_answer; a reply cut at --max-new-tokens 0);
- tags: reasoning-gym's own format, the last <answer>...</answer> alone (reasoning_gym.utils.extract_answer), the task's
  score_answer on that (cut replies 0 too).

Held-out problems, the trainers' prompt (common.data.render_prompt: the question, then RG_INSTRUCTION), the chat
template's default system prompt. A score is the task's own (partial credit counts its fraction); pass@k counts
only full scores. Each finished cell is appended to --cells (JSON lines, read back on a rerun, so an interrupted run
continues) and the table --output is rewritten.

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.premises.rg_zero_shot_smollm2 > /tmp/rg_zero_shot.log 2>&1 &
    python -m benchmarks.premises.rg_zero_shot_smollm2 --tasks chain_sum --levels 0 --num-problems 4 --samples 2 \\
        --cells /tmp/c.jsonl --output /tmp/t.md                                     # a quick look
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import tyro

TASKS = ("basic_arithmetic", "chain_sum", "leg_counting", "gcd", "count_bits", "letter_counting", "spell_backward",
         "word_sequence_reversal", "word_sorting", "isomorphic_strings", "family_relationships", "countdown", "arc_1d",
         "zebra_puzzles")
"""Arithmetic, counting, string and logic tasks a 135M model might start on, and SEC's three (countdown, arc_1d,
zebra_puzzles)."""


@dataclass
class Bench:
    tasks: tuple[str, ...] = TASKS
    """reasoning-gym tasks"""
    levels: tuple[int, ...] = (0, 1, 2)
    """curriculum levels of each task"""
    num_problems: int = 10
    """held-out problems a cell (greedy and sampled)"""
    samples: int = 3
    """sampled replies a problem (pass@k with k = this)"""
    max_new_tokens: int = 128
    """reply length cap (a reply cut there scores 0, as in training)"""
    batch_size: int = 64
    """prompts per generate call"""
    seed: int = 0
    """seed of the held-out problems and of sampling"""
    cells: str = "benchmarks/premises/runs/rg_zero_shot_smollm2/cells.jsonl"
    """finished cells, one JSON object a line (read back: cells already there are not run again)"""
    output: str = "benchmarks/premises/rg_zero_shot_smollm2.md"
    """where the table goes"""


def tag_scores(texts: list[str], problems: list, cut: list[bool]) -> list[float]:
    """reasoning-gym's own format: the task's score of the last <answer>...</answer> alone (no tags: 0)."""
    from reasoning_gym.utils import extract_answer

    from common.reasoning_gym import rg_score
    from common.verifiers import run_limited

    jobs = {i: (a, p.entry, p.level) for i, (t, p, c) in enumerate(zip(texts, problems, cut))
            if not c and (a := extract_answer(t)) is not None}
    out = [0.0] * len(texts)
    for i, r in run_limited(rg_score, jobs, 5.0, ("reasoning_gym",)).items():
        out[i] = min(max(float(r), 0.0), 1.0) if math.isfinite(float(r)) else 0.0
    return out


def run_cell(model, tok, task: str, level: int, bench: Bench) -> dict:
    import torch

    from common.data import encode_prompts, load_problems, render_prompt
    from common.evaluate import pass_at_k
    from common.rollout import HFEngine
    from common.verifiers import format_reward, score

    t0 = time.time()
    problems = load_problems(f"rg:{task}", "test", (level,), bench.num_problems, bench.seed)
    ids = encode_prompts(tok, [render_prompt(p, tok) for p in problems])
    engine, n, k = HFEngine(model, tok), len(problems), bench.samples
    torch.manual_seed(bench.seed)
    out = {"task": task, "level": level, "n": n, "k": k, "max_new_tokens": bench.max_new_tokens,
           "prompt_tokens": sum(map(len, ids)) / n}
    for mode, reps in (("greedy", 1), ("sampled", k)):
        texts, cut = [], []
        per_call = max(1, bench.batch_size // reps)
        for s in range(0, n, per_call):
            r = engine.generate(ids[s : s + per_call], n=reps, max_new_tokens=bench.max_new_tokens,
                                greedy=mode == "greedy", temperature=1.0, top_p=1.0)
            texts += r.texts
            cut += r.truncated_B.tolist()
        rows = [p for p in problems for _ in range(reps)]
        ours, tags = score(texts, rows, cut), tag_scores(texts, rows, cut)
        out[mode] = {"ours": ours, "tags": tags, "format": [format_reward(t, "rg") for t in texts],
                     "cut": [bool(c) for c in cut]}
        if mode == "greedy":
            out["example"] = {"gold": problems[0].answer, "reply": " ".join(texts[0].split())[:200]}
        else:
            for name, s in (("ours", ours), ("tags", tags)):
                full = [sum(x >= 1 for x in s[i * k : (i + 1) * k]) for i in range(n)]
                out["sampled"][f"pass_{name}"] = sum(pass_at_k(k, c, k) for c in full) / n
    out["seconds"] = time.time() - t0
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error over problems."""
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs)) ** 0.5


def headroom(cells: list[dict]) -> list[str]:
    """(task, level) cells whose sampled mean score (ours) is between 0.1 and 0.9."""
    return [f"{c['task']} {c['level']}" for c in cells if 0.1 <= mean_se(c["sampled"]["ours"])[0] <= 0.9]


def table(cells: list[dict], bench: Bench, failed: dict | None = None) -> str:
    """The report; `failed`: (task, level) -> why reasoning-gym could not generate that cell."""
    from common.data import RG_INSTRUCTION

    failed = failed or {}
    done = {(c["task"], c["level"]) for c in cells}
    todo = [(t, lv) for t in bench.tasks for lv in bench.levels if (t, lv) not in done and (t, lv) not in failed]
    n, k = (cells[0]["n"], cells[0]["k"]) if cells else (bench.num_problems, bench.samples)
    secs = sum(c["seconds"] for c in cells)
    room = headroom(cells)
    lines = [
        "# SmolLM2-135M-Instruct zero-shot on reasoning-gym tasks", "",
        f"Command: `OMP_NUM_THREADS=1 python -m benchmarks.premises.rg_zero_shot_smollm2 --num-problems {n} --samples {k} "
        f"--max-new-tokens {bench.max_new_tokens}` (reasoning-gym 0.1.25; {len(cells)} cells, {secs / 60:.0f} minutes "
        "of one thread on a loaded 2-core CPU, fp32)" + (f"; still to run: {', '.join(f'{t} {lv}' for t, lv in todo)}"
                                                          if todo else "") + "".join(
            f"; {t} {lv} could not be generated ({why})" for (t, lv), why in failed.items()) + ".", "",
        f"Held-out problems of `--dataset rg:<task> --levels L` (seed {bench.seed}), {n} a cell, the trainers' prompt: "
        f"the question, then `{RG_INSTRUCTION}`, in the chat template with its default system prompt. Greedy: one "
        f"reply a problem; sampled: {k} a problem at temperature 1, top_p 1. Scores are the task's own score_answer "
        "(partial credit counts its fraction), from the same replies read two ways: **ours** is the trainers' "
        "verifier (common.verifiers.extract_rg_answer: the last <answer>...</answer>, else a \\boxed{}, else what "
        "follows \"answer ... is\", else the last number); **tags** is reasoning-gym's own format, the last "
        "<answer>...</answer> alone. A reply cut at the token cap scores 0 both ways, as in training. "
        f"pass@{k} counts only full scores. ± is the standard error over the cell's problems (greedy ours). "
        "fmt: share of greedy replies with <answer> tags; cut: share of greedy replies cut at the cap.", "",
        "**Headroom** (sampled mean score, ours, between 0.1 and 0.9): "
        + (", ".join(room) if room else "none") + ".", "",
        f"| task | level | prompt tokens | greedy ours | greedy tags | fmt | cut | sampled ours | sampled tags | "
        f"pass@{k} ours | pass@{k} tags | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (bench.tasks.index(c["task"]) if c["task"] in bench.tasks else 99,
                                          c["level"])):
        g, s = c["greedy"], c["sampled"]
        m, se = mean_se(g["ours"])
        frac = lambda xs: sum(xs) / len(xs)  # noqa: E731
        lines.append(
            f"| {c['task']} | {c['level']} | {c['prompt_tokens']:.0f} | {m:.2f} ± {se:.2f} | {frac(g['tags']):.2f} | "
            f"{frac(g['format']):.2f} | {frac(g['cut']):.2f} | {frac(s['ours']):.2f} | {frac(s['tags']):.2f} | "
            f"{s['pass_ours']:.2f} | {s['pass_tags']:.2f} | {c['seconds']:.0f} |")
    lines += ["", "One greedy reply a task (level 0):", ""]
    for c in cells:
        if c["level"] == min(bench.levels):
            lines.append(f"- {c['task']}, gold `{c['example']['gold'][:60]}`: `{c['example']['reply']}`")
    return "\n".join(lines) + "\n"


def main(bench: Bench) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from common.models import load_model, load_tokenizer
    from common.reasoning_gym import check_spec
    from grounds import path_of

    check_spec("rg:" + ",".join(bench.tasks), bench.levels)
    cells = []
    if os.path.exists(bench.cells):
        with open(bench.cells) as f:
            cells = [json.loads(line) for line in f if line.strip()]
        cells = [c for c in cells if (c["n"], c["k"], c["max_new_tokens"]) ==
                 (bench.num_problems, bench.samples, bench.max_new_tokens)]
    os.makedirs(os.path.dirname(bench.cells) or ".", exist_ok=True)
    path = path_of("smollm2-135m-instruct")
    model, tok = load_model(path), load_tokenizer(path)
    failed = {}
    for task in bench.tasks:
        for level in bench.levels:
            if any((c["task"], c["level"]) == (task, level) for c in cells):
                continue
            try:
                cell = run_cell(model, tok, task, level, bench)
            except SystemExit as e:  # a level reasoning-gym cannot generate (common.reasoning_gym's one-line error)
                failed[(task, level)] = str(e.code).removeprefix("error: ")
                print(f"{task} {level}: {failed[(task, level)]}", flush=True)
                with open(bench.output, "w") as f:
                    f.write(table(cells, bench, failed))
                continue
            cells.append(cell)
            with open(bench.cells, "a") as f:
                f.write(json.dumps(cell) + "\n")
            with open(bench.output, "w") as f:
                f.write(table(cells, bench, failed))
            g, s = cell["greedy"], cell["sampled"]
            print(f"{task} {level}: greedy ours {mean_se(g['ours'])[0]:.2f} tags {sum(g['tags']) / len(g['tags']):.2f}"
                  f" fmt {sum(g['format']) / len(g['format']):.2f} cut {sum(g['cut']) / len(g['cut']):.2f}; sampled "
                  f"ours {sum(s['ours']) / len(s['ours']):.2f} pass ours {s['pass_ours']:.2f} tags {s['pass_tags']:.2f}"
                  f" ({cell['seconds']:.0f} s)", flush=True)
    print(f"wrote {bench.output}")


if __name__ == "__main__":
    main(tyro.cli(Bench))
