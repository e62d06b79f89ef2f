"""What the claim benchmarks share (benchmarks/*_smollm2.py): a training run that outlives its session.

A claim's arms take hours of this CPU, more than a session has, and a new session's checkout has no run folders. So
every finished run is kept as a record in the repository, benchmarks/claims/runs/<benchmark>/<run name>.json (its
args.json, its metric rows, its own seconds, and what the benchmark measured on its final weights), and
`finished_run` returns, in this order: the record of a run with the same arguments; a finished run folder (recorded
now); an interrupted run continued from its last checkpoint by the trainer's own --resume (the same numbers as a run
never stopped); a fresh run. A benchmark is then one command, rerun until its report says it is complete.

Before any arm trains, a claim benchmark runs the gate (`Claim`, `gate`): can the claim fail for the right reason on
this ground? Three lines at the top of its report: leakage (the contexts the method adds that state the gold answer:
0 to pass), headroom (the control's start on the judged split within HEADROOM) and power (the smallest difference
the planned problems can show under ../shared/CLAIMS.md's noise rule, no larger than the effect the claim needs). A
failed gate makes the verdict "untestable here: <gate, figure>", never "not shown".
"""

import dataclasses
import json
import os
import shutil
import time

from common.checkpoint import find_checkpoint
from common.logger import read_metrics
from common.testbed_nl import VERSION as GROUND

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


def stage_in_progress(module, args, run_dir: str) -> bool:
    """Whether run_dir holds a run of these arguments stopped in its supervised stages (ppo_slm_stages.py, before
    args.json is written): a stage's saved training state (<stage>.state.pt) or a finished stage (<stage>/stage.json),
    which its rerun continues or skips."""
    import glob

    import torch

    for path in glob.glob(os.path.join(run_dir, "*.state.pt")) + glob.glob(os.path.join(run_dir, "*", "stage.json")):
        try:
            if path.endswith(".pt"):
                saved = torch.load(path, map_location="cpu", weights_only=True)["fingerprint"]["args"]
            else:
                with open(path) as f:
                    saved = json.load(f)["args"]
        except Exception:  # unreadable: the stage's own check says so and starts it afresh
            continue
        if same_args(saved, _as_json(args), _as_json(module.Args())):
            return True
    return False


def folder_state(module, args) -> str:
    """What output_dir/run_name holds for these arguments: 'finished' (its final evaluation is logged at
    --total-steps, after the first; or the one of a run of 0 steps), 'resume' (a checkpoint of this run, or a run
    stopped in its supervised stages: stage_in_progress), 'stale' (another run, or one stopped before its first
    checkpoint) or 'fresh' (nothing)."""
    run_dir = os.path.join(args.output_dir, args.run_name)
    if not os.path.exists(run_dir):
        return "fresh"
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            saved = json.load(f)
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    except (OSError, ValueError, SystemExit):
        return "resume" if stage_in_progress(module, args, run_dir) else "stale"
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
    make=False (a report written from the records): never run; no record of these arguments is a one-line error.
    A record made on another version of testbed-nl (its "ground"; 1 when absent) is a run on other problems or
    contexts: read back for a report, never in place of a run."""
    path = os.path.join(record_dir, f"{args.run_name}.json")
    try:
        if weights and folder_state(module, args) != "finished":
            raise OSError("the record has no weights")
        with open(path) as f:
            record = json.load(f)
        if same_args(record["args"], _as_json(args), _as_json(module.Args())):
            if not make or record.get("ground", 1) == GROUND:
                print(f"{args.run_name}: read back from {os.path.relpath(path)}")
                return record
            print(f"{args.run_name}: {os.path.relpath(path)} was made on testbed-nl version {record.get('ground', 1)}, "
                  f"not {GROUND}; running it again")
        else:
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
        print(f"{args.run_name}: continuing the interrupted run in {run_dir} from its checkpoint or saved stage")
        args.resume = run_dir  # the trainer keeps args.json and drops the metric rows after the checkpoint
    if state != "finished":
        module.main(args)
    with open(os.path.join(run_dir, "args.json")) as f:
        saved = json.load(f)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    record = {"args": saved, "rows": rows, "seconds": run_seconds(run_dir, rows),
              "measured": measure(run_dir) if measure else {}, "ground": GROUND}
    os.makedirs(record_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)
    print(f"{args.run_name}: recorded in {os.path.relpath(path)}")
    return record


def cached(path: str, settings: dict, measure, make: bool = True, grow: bool = False) -> dict:
    """`measure()` with "settings" added, read back from the record `path` when it was made with the same `settings`
    on this testbed-nl version (any version with make=False: a report), else measured and written there (atomically):
    a measurement of a model that a rerun need not repeat. make=False and no such record: a one-line error.
    grow=True: a record of cells that later candidates add to; `measure(cells)` gets the recorded cells ({} without a
    record) and returns them with the ones it lacks, so a rerun measures only what was added."""
    saved = None
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["settings"] != settings or (make and saved.get("ground", 1) != GROUND):
            saved = None
    except (OSError, ValueError, KeyError):
        saved = None
    if saved is not None and not (grow and make):
        return saved
    if not make:
        raise SystemExit(f"error: no record of this measurement in {os.path.relpath(path)} (a report from the records "
                         "measures nothing: rerun without --report-only)")
    have = {k: v for k, v in (saved or {}).items() if k not in ("settings", "ground")}
    cells = measure(have) if grow else measure()
    if saved is not None and cells == have:
        return saved
    res = {**cells, "settings": settings, "ground": GROUND}
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


# --- the gate: can the claim fail for the right reason on this ground? ---------------------------------------------
HEADROOM = (0.10, 0.90)
"""where the control's start must lie on the judged split (../shared/CLAIMS.md)"""


@dataclasses.dataclass
class Claim:
    """What a claim benchmark declares before any arm trains, for `gate`.

    split: the judged split in words; n: its distinct problems (one seed's evaluation); seeds: the seeds planned.
    start: {seed: the control arm's starting figure on the split}; start_is: what that figure is, greedy accuracy or,
    where the claim is about discovering solutions, sampled pass@k. effect: the difference the claim needs;
    effect_is: whence (the paper's effect, or a stated plausible one); fall: the claim is a fall from the start (a
    collapse), not a rise; against: a fixed rate the method is compared with instead of the control (a win rate's
    0.5). contexts_are: what the method adds to a judged problem's prompt (a hint, a knowledge point, guidance, a
    proposal, a teacher's text), or why nothing."""
    split: str
    n: int
    seeds: list
    start: dict
    start_is: str
    effect: float
    effect_is: str
    contexts_are: str = "none: the method adds nothing to the prompt"
    fall: bool = False
    against: float | None = None
    name: str = ""


def _whole(text: str, a: int, b: int) -> bool:
    """text[a:b] is not part of a longer number or word: no letter or digit beside it, nor a decimal point or a
    thousands comma between it and a digit."""
    before, after = text[a - 1 : a], text[b : b + 1]
    if before.isalnum() or after.isalnum():
        return False
    return not (before in ".," and text[a - 2 : a - 1].isdigit() or after in ".," and text[b + 1 : b + 2].isdigit())


def states_answer(text: str, answer: str, tokenizer) -> bool:
    """Whether `text` holds the gold `answer` as the model reads it: the answer's token ids (alone, or after a space,
    for tokenizers that merge the two) as a contiguous run of the text's, where that run is a whole number or word of
    the text (on SmolLM2 every digit is a token, so '68' is a run of '168' too: not counted)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_T, spans = enc["input_ids"], enc["offset_mapping"]
    for form in (answer, " " + answer):
        want = tokenizer(form, add_special_tokens=False)["input_ids"]
        for i in range(len(ids_T) - len(want) + 1):
            if ids_T[i : i + len(want)] == want:
                a, b = spans[i][0], spans[i + len(want) - 1][1]
                a += len(text[a:b]) - len(text[a:b].lstrip())  # a leading space is not part of the number
                if _whole(text, a, b):
                    return True
    return False


def leakage(contexts: list, tokenizer) -> dict:
    """Of the (added text, gold answer) pairs, how many texts state their answer: {"leaks", "contexts"}."""
    return {"leaks": sum(states_answer(text, answer, tokenizer) for text, answer in contexts),
            "contexts": len(contexts)}


def records_ground(record_dir: str) -> int:
    """The testbed-nl version the runs recorded in `record_dir` were made on (the oldest where they differ), this
    checkout's where none is recorded."""
    grounds = []
    for name in sorted(os.listdir(record_dir)) if os.path.isdir(record_dir) else []:
        with open(os.path.join(record_dir, name)) as f:
            record = json.load(f) if name.endswith(".json") else {}
        if "args" in record:
            grounds.append(record.get("ground", 1))
    return min(grounds, default=GROUND)


def recorded_leakage(path: str, settings: dict, contexts, tokenizer, ground: int = GROUND) -> dict:
    """`leakage(contexts(), tokenizer)` kept as a record at `path`: measured for runs on this testbed-nl version, or,
    for a report of runs made on an older one (`ground`), read from the record made with them (this checkout renders
    other contexts)."""
    return cached(path, settings, lambda: leakage(contexts(), tokenizer), make=ground == GROUND)


def added_text(plain: str, guided: str) -> str:
    """What a method's prompt adds to the plain one: `guided` without the head and tail it shares with `plain`.

    >>> added_text("<u>Q?</u><a>", "<u>Q? Hint: 3 + 4 = 7.</u><a>")
    ' Hint: 3 + 4 = 7.'
    """
    head = len(os.path.commonprefix([plain, guided]))
    tail = len(os.path.commonprefix([plain[head:][::-1], guided[head:][::-1]]))
    return guided[head : len(guided) - tail]


def detectable(p0: float, n: int, against: float | None = None) -> float:
    """The smallest difference the noise rule calls an effect with n problems: d = margin(p0 + d, p0, n), a method
    above a control at p0 (on a 0.001 grid; inf where none fits below 1), or, against a fixed rate, the 95 % half-width
    of one rate of n problems at it.

    >>> detectable(0.5, 40), detectable(0.25, 40), detectable(0.4, 10_000), round(detectable(0.5, 80, against=0.5), 3)
    (0.215, 0.21, 0.014, 0.11)
    """
    if against is not None:
        return 1.96 * (against * (1 - against) / n) ** 0.5
    for k in range(1, 1001):
        d = k / 1000
        if p0 + d > 1:
            break
        if d > margin(p0 + d, p0, n):
            return d
    return float("inf")


def gate(claim: Claim, leaks: dict) -> tuple[list[str], list[str]]:
    """The gate's three lines for the report, from the claim and its `leakage`, and the gates that failed with their
    figures ([] when it passes)."""
    lo, hi = HEADROOM
    shown = lambda d: f"{d:.3f}" if d < float("inf") else "none (no room)"  # noqa: E731
    starts = [claim.start[s] for s in claim.seeds]
    p0 = sum(starts) / len(starts)
    d = detectable(1 - p0 if claim.fall else p0, claim.n, claim.against)
    ok = {"leakage": leaks["leaks"] == 0, "headroom": all(lo <= x <= hi for x in starts),
          "power": d <= claim.effect and len(claim.seeds) >= 2}
    figures = {"leakage": f"{leaks['leaks']} of {leaks['contexts']} added contexts state the answer",
               "headroom": f"the control starts at {' / '.join(f'{x:.3f}' for x in starts)}",
               "power": f"detectable {shown(d)} > needed {claim.effect:.3f}" if len(claim.seeds) >= 2
               else f"{len(claim.seeds)} seed"}
    verdict = lambda g: "pass" if ok[g] else "**fail**"  # noqa: E731
    who = f" ({claim.name})" if claim.name else ""
    base = f"{claim.against:.2f}" if claim.against is not None else f"the control's {p0:.3f}"
    lines = [f"- leakage{who}: {leaks['leaks']} of {leaks['contexts']} contexts the method adds to the judged problems "
             f"state the gold answer ({claim.contexts_are}): {verdict('leakage')}",
             f"- headroom{who}: {claim.start_is}, on {claim.split}: {' / '.join(f'{x:.3f}' for x in starts)} (seeds "
             f"{' / '.join(map(str, claim.seeds))}), to lie in [{lo:.2f}, {hi:.2f}]: {verdict('headroom')}",
             f"- power{who}: {claim.n} distinct problems a seed, {len(claim.seeds)} seeds, each judged on its own: the "
             f"noise rule detects a {'fall' if claim.fall else 'difference'} of {shown(d)} from {base}; the claim "
             f"needs {claim.effect:.3f} ({claim.effect_is}): {verdict('power')}"]
    return lines, [f"{g}, {figures[g]}" for g in ok if not ok[g]]


def untestable(failed: list[str]) -> str:
    """The verdict of a failed gate.

    >>> untestable(["power, detectable 0.200 > needed 0.100"])
    'untestable here: power, detectable 0.200 > needed 0.100'
    """
    return "untestable here: " + "; ".join(failed)


def gate_section(gates: list[tuple[list[str], list[str]]], names: list[str] = ()) -> list[str]:
    """The report's top section: each gate's lines, then what each lets its verdict be (`names`: of each claim)."""
    said = [untestable(failed) if failed else "passes" for _, failed in gates]
    said = "; ".join(f"{name}: {x}" for name, x in zip(names, said)) if names else said[0]
    return ["## The gate (benchmarks/claims/claim_runs.py, before any arm trains)", "",
            *[line for lines, _ in gates for line in lines], "", f"Gate: {said}.", ""]


def with_gate(report: str, section: list[str]) -> str:
    """`report` with its gate section replaced by `section`, or put after its first two paragraphs (the title and
    the command) where it has none: a report whose runs are not recorded gets its gate without a rerun."""
    parts = report.split("\n\n")
    start = next((i for i, x in enumerate(parts) if x.startswith("## The gate")), None)
    if start is None:
        head, tail = parts[:2], parts[2:]
    else:
        end = next(i for i in range(start, len(parts)) if parts[i].startswith("Gate: "))  # its last paragraph
        head, tail = parts[:start], parts[end + 1:]
    return "\n\n".join([*head, "\n".join(section).strip(), *tail])
