"""OC-GRPO's premise on SmolLM2-135M-Instruct, measured on what the trainer would feed (issue 60): for each testbed-nl
level and prefix fraction, sampled pass@k of the model from oc_grpo.py's own guided prompt, and whether that guidance
states the gold answer.

The premise of the claim (benchmarks/claims/oc_grpo_smollm2.py): a level whose UNGUIDED sampled pass@8 is low but not
zero (in BAND: the groups that fail whole are common, yet the unguided prompt can be learned), whose guided prompt (a
solution prefix that stops before the step stating the final result) lifts pass@8 beyond the noise rule's margin
(benchmarks/claims/claim_runs.margin on the level's problems), with leakage 0 (claim_runs.states_answer on the text
the guidance adds). `passing` is that rule; the claim benchmark reads these records back (`recorded_cells`, never
measuring) and takes its cliff level and --prefix-fractions from them (`cliff_design`).

A cell is (model, level, fraction): the held-out problems of `--dataset testbed-nl --levels L` (seed 1, the problems
the claim judges its seed 1 on), each prompt oc_grpo.render_guided_prompt(p, tok, oc_grpo.solution_prefix(p.solution,
f)) exactly as the trainer's cascade builds it (fraction 0 adds nothing: the plain prompt); `--samples` replies a
problem at temperature 1, top_p 1, up to `--max-new-tokens` tokens (a reply cut there scores 0, as in training),
scored by the 'nl' verifier. Recorded: pass@k (common.evaluate.pass_at_k), mean sampled accuracy, the share of
replies cut, the problems whose prompt has guidance at all, and the leakage. Models: the base model and, when this
checkout holds it, the post-GRPO start of the other SmolLM2 claims (runs/smollm2_start/grpo_seed1/checkpoint,
benchmarks/claims/grpo_smollm2.start_args); only the base model decides the premise, since the claim trains from it.
Every cell is kept with claim_runs.cached in --records (read back on a rerun: an interrupted run continues) and the
report is rewritten after each.

    OMP_NUM_THREADS=2 python -m benchmarks.premises.oc_grpo_premise_smollm2     # both models, 32 cells
    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.premises.oc_grpo_premise_smollm2 --levels 3 --fractions 0.5 \\
        --num-problems 2 --samples 2 --records /tmp/ocp --out /tmp/ocp.md     # a smoke run

Expected time: 35-55 minutes a model on one free core, so 1-2 hours for both (16 cells each), more beside other jobs;
a rerun resumes at the first cell not recorded, and `--models base` measures first what the claim needs. Whence: the
smoke run above took 9 s for its one cell (4 replies, all 64 steps; one thread at nice 19 beside another benchmark on
the 2 cores; 15 s with imports and the model load), but at 4 rows a step costs what reading the weights costs, so it
does not scale up. A full cell decodes 320 replies of up to 64 tokens in two calls of 160 rows and prefills 40 prompts
of 60-120 tokens: about 24,000 tokens at 2 x 135M FLOP each, 6.5 TFLOP. The claim's base-model probe, one call of 160
rows and 48 tokens plus an entropy pass over them (5-8 TFLOP), took 152 s
(benchmarks/claims/runs/oc_grpo_smollm2/base_probe_seed1.json): 35-55 GFLOP/s, so 2-3 minutes a cell.
"""

import argparse
import os
import time

from benchmarks import ROOT
from benchmarks.claims.claim_runs import GROUND, added_text, cached, margin, states_answer

MODEL = "smollm2-135m-instruct"
START = os.path.join("runs", "smollm2_start", "grpo_seed1", "checkpoint")
"""the post-GRPO start of the SmolLM2 claims (benchmarks/claims/grpo_smollm2.start_args), relative to the repository"""
MODELS = {"base": "SmolLM2-135M-Instruct", "start": f"after 30 GRPO steps ({START})"}
LEVELS, FRACTIONS = (2, 3, 4, 5), (0.0, 0.25, 0.5, 0.75)
N, SAMPLES, MAX_NEW_TOKENS, SEED = 40, 8, 96, 1
"""96 new tokens: at 48, 56 % of the base model's level-3 replies were cut (the claim's old probe) and a cut reply
scores 0, so the guided prompts, which need fewer tokens, would gain from the cap alone; the claim trains at this cap"""
BAND = (0.05, 0.30)
"""where the unguided pass@k must lie: all-fail groups common, the unguided prompt not out of reach"""
RECORDS = os.path.join(ROOT, "benchmarks", "premises", "runs", "oc_grpo_premise_smollm2")
COMMAND = "python -m benchmarks.premises.oc_grpo_premise_smollm2"


def settings(model: str, level: int, frac: float, n: int = N, k: int = SAMPLES, max_new_tokens: int = MAX_NEW_TOKENS,
             seed: int = SEED) -> dict:
    """What makes a cell: a record is read back only when made with exactly these."""
    return {"model": model, "level": level, "fraction": frac, "n": n, "k": k, "max_new_tokens": max_new_tokens,
            "seed": seed}


def cell_path(records: str, model: str, level: int, frac: float) -> str:
    return os.path.join(records, f"{model}_L{level}_f{frac:g}.json")


def guided_prompt(problem, tokenizer, frac: float) -> str:
    """The trainer's guided prompt at `frac` (oc_grpo's own functions); fraction 0 gives the plain prompt."""
    import oc_grpo

    return oc_grpo.render_guided_prompt(problem, tokenizer, oc_grpo.solution_prefix(problem.solution, frac))


def measure_cell(model, tokenizer, problems: list, frac: float, k: int, max_new_tokens: int, seed: int,
                 batch_problems: int) -> dict:
    """One cell: k sampled replies a problem from its guided prompt, generated `batch_problems` problems (all their
    k samples, the prompt prefilled once) a call."""
    import torch

    from common.data import encode_prompts, render_prompt
    from common.evaluate import pass_at_k
    from common.rollout import HFEngine
    from common.verifiers import score

    t0 = time.time()
    texts = [guided_prompt(p, tokenizer, frac) for p in problems]
    added = [added_text(render_prompt(p, tokenizer), x) for p, x in zip(problems, texts)]
    ids, engine = encode_prompts(tokenizer, texts), HFEngine(model, tokenizer)
    torch.manual_seed(seed)  # per cell: a cell's numbers do not depend on which cells ran before it
    correct, cut, lengths = [], [], []
    for s in range(0, len(problems), batch_problems):
        out = engine.generate(ids[s : s + batch_problems], n=k, temperature=1.0, top_p=1.0,
                              max_new_tokens=max_new_tokens)
        correct += score(out.texts, [p for p in problems[s : s + batch_problems] for _ in range(k)], out.truncated_B)
        cut += out.truncated_B.tolist()
        lengths += out.lengths_B.tolist()
    per_problem = [int(sum(correct[i * k : (i + 1) * k])) for i in range(len(problems))]
    return {"n": len(problems), "k": k, "correct": per_problem,
            "pass_at_k": sum(pass_at_k(k, c, k) for c in per_problem) / len(problems),
            "sampled_accuracy": sum(per_problem) / (k * len(problems)), "cut": sum(map(bool, cut)) / len(cut),
            "completion_len": sum(lengths) / len(lengths), "guided": sum(bool(x.strip()) for x in added),
            "leaks": sum(states_answer(x, p.answer, tokenizer) for x, p in zip(added, problems)),
            "example": {"added": added[0], "gold": problems[0].answer}, "seconds": time.time() - t0}


def same_prompts(cells: dict, problems: list, tokenizer, level: int, frac: float):
    """The fraction of a recorded cell of `level` in `cells` whose guided prompts are, problem by problem, exactly
    those at `frac` (testbed-nl's guidance stops before the step that states the result, so on two-step solutions
    0.5 and 0.75 give the same text), else None: such a cell is the same measurement (measure_cell seeds per cell)."""
    texts = [guided_prompt(p, tokenizer, frac) for p in problems]
    return next((g for (lv, g) in sorted(cells) if lv == level and g != frac
                 and [guided_prompt(p, tokenizer, g) for p in problems] == texts), None)


# --- the rule, and what the claim benchmark reads ------------------------------------------------------------------
def lifts(cells: dict, level: int) -> list[tuple[float, float, float, bool]]:
    """(fraction, lift of pass@k over the unguided cell, the noise margin at their problems, beyond the noise and
    leakage 0) for each guided fraction of `level` in `cells` ({(level, fraction): cell})."""
    base = cells[(level, 0.0)]
    out = []
    for (lv, f), c in sorted(cells.items()):
        if lv == level and f > 0:
            m = margin(c["pass_at_k"], base["pass_at_k"], min(c["n"], base["n"]))
            d = c["pass_at_k"] - base["pass_at_k"]
            out.append((f, d, m, d > m and c["leaks"] == 0))
    return out


def passing(cells: dict, band: tuple = BAND) -> dict:
    """{level: [the guided fractions that pass]} for the levels of `cells` ({(level, fraction): {"pass_at_k",
    "leaks", "n"}}) that hold the premise: the unguided cell (fraction 0) within `band`, and at least one guided
    fraction whose pass@k is above it by more than claim_runs.margin, with no problem whose guidance states the answer.

    >>> cell = lambda p, leaks=0: {"pass_at_k": p, "leaks": leaks, "n": 40}
    >>> passing({(3, 0.0): cell(0.1), (3, 0.5): cell(0.4), (3, 0.75): cell(0.5, leaks=1), (4, 0.0): cell(0.0),
    ...          (4, 0.5): cell(0.6)})
    {3: [0.5]}
    """
    out = {}
    for lv in sorted({lv for lv, f in cells if f == 0}):
        if band[0] - 1e-9 <= cells[(lv, 0.0)]["pass_at_k"] <= band[1] + 1e-9:
            fracs = [f for f, _, _, ok in lifts(cells, lv) if ok]
            if fracs:
                out[lv] = fracs
    return out


def cliff_design(cells: dict) -> tuple[int, list[float]] | None:
    """The claim's cliff level and its --prefix-fractions: of the passing levels, the one whose best passing fraction
    lifts pass@k most (the lowest level on a tie), with all its passing fractions; None when no level passes.

    >>> cell = lambda p: {"pass_at_k": p, "leaks": 0, "n": 40}
    >>> cliff_design({(2, 0.0): cell(0.1), (2, 0.5): cell(0.4), (3, 0.0): cell(0.1), (3, 0.25): cell(0.5),
    ...               (3, 0.5): cell(0.6)})
    (3, [0.25, 0.5])
    """
    ok = passing(cells)
    if not ok:
        return None
    gain = {lv: max(d for f, d, _, good in lifts(cells, lv) if good) for lv in ok}
    level = max(sorted(ok), key=lambda lv: gain[lv])
    return level, ok[level]


def level_figures(cells: dict, level: int) -> str:
    """A level's premise in figures: the unguided pass@k, each guided fraction's lift with its noise and leakage."""
    base = cells[(level, 0.0)]
    k = base.get("k", "k")
    guided = [f"f {f:g} {cells[(level, f)]['pass_at_k']:.3f} ({d:+.3f}, noise +-{m:.3f}, leakage "
              f"{cells[(level, f)]['leaks']})" for f, d, m, _ in lifts(cells, level)]
    return f"L{level} unguided pass@{k} {base['pass_at_k']:.3f}" + (f"; {'; '.join(guided)}" if guided else "")


def premise_lines(cells: dict, band: tuple = BAND) -> list[str]:
    """A line a level: whether it holds the premise and why, in figures."""
    ok, lines = passing(cells, band), []
    for lv in sorted({lv for lv, f in cells if f == 0}):
        base, k = cells[(lv, 0.0)]["pass_at_k"], cells[(lv, 0.0)].get("k", "k")
        if lv in ok:
            why = f"passes with --prefix-fractions {' '.join(f'{f:g}' for f in ok[lv])}"
        elif not band[0] - 1e-9 <= base <= band[1] + 1e-9:
            why = f"fails: unguided pass@{k} {base:.3f} outside [{band[0]:.2f}, {band[1]:.2f}]"
        else:
            why = f"fails: no guided fraction lifts pass@{k} beyond the noise with leakage 0"
        lines.append(f"- level {lv} {why} ({level_figures(cells, lv)})")
    return lines


def untestable_figures(cells: dict) -> str:
    """The figures of the verdict 'untestable here: premise, ...' when no level passes: each level's unguided pass@k
    and its best guided one, and the guidance that states the answer.

    >>> cell = lambda p, leaks=0: {"pass_at_k": p, "leaks": leaks, "n": 40, "k": 8}
    >>> print(untestable_figures({(3, 0.0): cell(0.0), (3, 0.5): cell(0.05), (4, 0.0): cell(0.5),
    ...                           (4, 0.5): cell(0.5, leaks=1)}))  # doctest: +NORMALIZE_WHITESPACE
    no level passes (unguided pass@8 -> the best guided one: L3 0.000 -> 0.050 at f 0.5, noise +-0.068; L4 0.500 ->
    0.500 at f 0.5, noise +-0.219; guidance states the answer in 1 of 80 guided problems)
    """
    parts, k = [], next(iter(cells.values())).get("k", "k")
    for lv in sorted({lv for lv, f in cells if f == 0}):
        best = max(lifts(cells, lv), key=lambda x: x[1], default=None)
        parts.append(f"L{lv} {cells[(lv, 0.0)]['pass_at_k']:.3f}" + (
            f" -> {cells[(lv, best[0])]['pass_at_k']:.3f} at f {best[0]:g}, noise +-{best[2]:.3f}" if best else ""))
    guided = [c for (lv, f), c in cells.items() if f > 0]
    return (f"no level passes (unguided pass@{k} -> the best guided one: {'; '.join(parts)}; guidance states the "
            f"answer in {sum(c['leaks'] for c in guided)} of {sum(c['n'] for c in guided)} guided problems)")


def recorded_cells(records: str = RECORDS, levels=LEVELS, fractions=FRACTIONS, models=tuple(MODELS),
                   required: str = "base") -> dict:
    """{model: {(level, fraction): cell}} read back from the premise's records at their default settings, never
    measured: a cell of the `required` model that is missing (or made on another testbed-nl version) is a one-line
    error naming the premise's command; another model's missing cells are left out."""
    out = {}
    for model in models:
        for lv in levels:
            for f in fractions:
                path = cell_path(records, model, lv, f)
                try:
                    cell = cached(path, settings(model, lv, f), None, make=False)
                except SystemExit:  # no record made with these settings
                    cell = None
                stale = cell is not None and cell.get("ground", 1) != GROUND
                if cell is None or stale:
                    if model != required:
                        continue
                    why = f" (made on testbed-nl version {cell.get('ground', 1)}, not {GROUND})" if stale else ""
                    shown = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path
                    raise SystemExit(f"error: OC-GRPO's premise cell {shown} is not recorded at its default "
                                     f"settings{why}: run `{COMMAND}` first (a claim report reads the premise, it "
                                     "never measures it)")
                out.setdefault(model, {})[(lv, f)] = cell
    return out


def table_lines(results: dict) -> list[str]:
    """The premise table: a row a model, level and fraction; `results` as recorded_cells returns it."""
    lines = ["| model | level | fraction | problems guided | pass@k | lift (noise) | sampled accuracy | replies cut | "
             "mean reply tokens | leakage | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, cells in results.items():
        for (lv, f), c in sorted(cells.items()):
            lift = next((f"{d:+.3f} (+-{m:.3f})" for g, d, m, _ in lifts(cells, lv) if g == f), "") \
                if (lv, 0.0) in cells else ""
            lines.append(f"| {MODELS.get(model, model)} | {lv} | {f:g}{' (unguided)' if f == 0 else ''} | "
                         f"{c['guided']} of {c['n']} | {c['pass_at_k']:.3f} | {lift} | {c['sampled_accuracy']:.3f} | "
                         f"{c['cut']:.2f} | {c['completion_len']:.1f} | {c['leaks']} of {c['n']} | "
                         + (f"0 (the prompts of f {c['same_prompts_as']:g}) |" if "same_prompts_as" in c
                            else f"{c['seconds']:.0f} |"))
    return lines


def report(results: dict, a, todo: list, seconds: float) -> str:
    k, n = a.samples, a.num_problems
    base = results.get("base", {})
    complete = not todo
    lines = ["# OC-GRPO's premise on SmolLM2-135M-Instruct: sampled pass@k at several solution prefixes", "",
             f"`{COMMAND} --levels {' '.join(map(str, a.levels))} --fractions {' '.join(f'{f:g}' for f in a.fractions)}"
             f" --num-problems {n} --samples {k} --max-new-tokens {a.max_new_tokens} --seed {a.seed}`, testbed-nl "
             f"version {GROUND}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU (shared), float32, "
             f"{seconds / 60:.0f} minutes of measurement"
             + ("" if complete else f"; still to measure: {', '.join(todo)}") + ".", "",
             f"Held-out problems of each level (seed {a.seed}: those the claim judges its seed 1 on), {k} replies a "
             f"problem at temperature 1, top_p 1, up to {a.max_new_tokens} new tokens (a cut reply scores 0), the 'nl' "
             "verifier. The prompt at fraction f is oc_grpo.render_guided_prompt(p, tok, solution_prefix(p.solution, "
             "f)), what the trainer's cascade feeds: the first f of the worked solution's characters (back to a whole "
             "word), never past the steps before the one that states the result (at 0.75 every problem already gets "
             "all of those, so 1.0 would add nothing). pass@k: the share of problems with a right reply among the k. "
             "Lift: over the unguided cell, beside the noise rule's margin (benchmarks/claims/claim_runs.margin at "
             f"{n} problems). Leakage: problems whose added guidance states the gold answer "
             "(claim_runs.states_answer). Problems guided: those whose prompt has guidance at all.", "",
             f"**The premise** (judged on the base model, which the claim trains from): unguided pass@{k} in "
             f"[{BAND[0]:.2f}, {BAND[1]:.2f}], a guided fraction lifting it beyond the margin, leakage 0.", ""]
    if any(f == 0 for _, f in base):
        design = cliff_design(base)
        lines += [*premise_lines(base), "", (f"The claim's cliff: level {design[0]}, --prefix-fractions "
                                             f"{' '.join(f'{f:g}' for f in design[1])} (the passing level with the "
                                             "largest lift)" if design else f"Cliff level: none, "
                                             f"{untestable_figures(base)}") + ("." if not any(t.startswith("base ") for t in todo) else " (so far)."), ""]
    else:
        lines += ["No unguided cell of the base model measured yet.", ""]
    if "start" not in a.models:
        lines += ["The post-GRPO start: not measured (--models).", ""]
    elif a.start_absent:
        lines += [f"The post-GRPO start: not measured, this checkout has no {START} (benchmarks/claims/grpo_smollm2.py "
                  "trains it: its start run), rerun then.", ""]
    lines += table_lines(results)
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                   help="prefix fractions; 0 is the unguided prompt")
    p.add_argument("--num-problems", type=int, default=N, help="held-out problems a level")
    p.add_argument("--samples", type=int, default=SAMPLES, help="replies a problem (pass@k with k = this)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--seed", type=int, default=SEED, help="of the held-out problems and of sampling")
    p.add_argument("--batch-problems", type=int, default=20, help="problems a generate call (each with its samples)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--records", default=RECORDS, help="a JSON file a cell (read back on a rerun)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "premises", "oc_grpo_premise_smollm2.md"))
    p.add_argument("--report-only", action="store_true",
                   help="write the report from the recorded cells, measuring none (those not recorded are listed)")
    a = p.parse_args()
    if not all(0 <= f < 1 for f in a.fractions):
        raise SystemExit(f"error: --fractions {a.fractions}: give fractions in [0, 1) (0: the unguided prompt; from "
                         "0.75 on, every problem already gets all the steps before its result)")
    if min(a.num_problems, a.samples, a.max_new_tokens, a.batch_problems) < 1:
        raise SystemExit("error: --num-problems, --samples, --max-new-tokens and --batch-problems must be >= 1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from common.data import load_problems
    from common.models import load_model, load_tokenizer
    from grounds import path_of

    tokenizer = load_tokenizer(path_of(MODEL))  # the trainers' tokenizer for both models (as the claim's probe)
    paths = {"base": path_of(MODEL), "start": os.path.join(ROOT, START)}
    a.start_absent = "start" in a.models and not os.path.isdir(paths["start"])
    models = [m for m in a.models if not (m == "start" and a.start_absent)]
    if a.start_absent:
        print(f"the post-GRPO start: {paths['start']} is absent; measuring the base model only")
    problems = {lv: load_problems("testbed-nl", "test", (lv,), a.num_problems, a.seed) for lv in a.levels}
    # the unguided cells first, on the base model first: they decide the most
    order = [(m, lv, f) for m in models for f in sorted(a.fractions) for lv in a.levels]
    results, loaded, seconds, missing, text = {}, {}, 0.0, [], ""
    for i, (m, lv, f) in enumerate(order):
        def measure(m=m, lv=lv, f=f):
            twin = same_prompts(results.get(m, {}), problems[lv], tokenizer, lv, f)
            if twin is not None:  # the same prompts at the same seed sample the same replies: copied, not re-measured
                return {**results[m][(lv, twin)], "same_prompts_as": twin, "seconds": 0.0}
            if m not in loaded:
                loaded.clear()  # one model in memory at a time
                loaded[m] = load_model(paths[m]).eval()
            return measure_cell(loaded[m], tokenizer, problems[lv], f, a.samples, a.max_new_tokens, a.seed,
                                a.batch_problems)

        path = cell_path(a.records, m, lv, f)
        if a.report_only and not os.path.exists(path):
            missing.append(f"{m} L{lv} f{f:g}")
            continue
        cell = cached(path, settings(m, lv, f, len(problems[lv]), a.samples, a.max_new_tokens, a.seed), measure,
                      make=not a.report_only)
        results.setdefault(m, {})[(lv, f)] = cell
        seconds += cell["seconds"]
        print(f"{MODELS[m]}, level {lv}, fraction {f:g}: pass@{a.samples} {cell['pass_at_k']:.3f}, sampled "
              f"{cell['sampled_accuracy']:.3f}, cut {cell['cut']:.2f}, leakage {cell['leaks']}, "
              f"{cell['seconds']:.0f} s", flush=True)
        todo = missing + [f"{x} L{y} f{z:g}" for x, y, z in order[i + 1 :]]
        text = report(results, a, todo, seconds)
        with open(a.out, "w") as fh:
            fh.write(text)
    if missing and a.report_only:  # the last recorded cell came before a missing one: the list is complete only here
        text = report(results, a, missing, seconds)
        with open(a.out, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
