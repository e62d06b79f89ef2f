"""Does the embedded testbed hold each trainer's premise? Builds the models (two build seeds) and measures, with
greedy decoding on held-out problems (200 per cell), through the prompts the trainers themselves render:

  1. calibration    testbed-weak: level 3 in [0.40, 0.60], level 1 >= 0.85, level 5 <= 0.10
  2. guidance       (OC-GRPO, oc_grpo.solution_prefix and render_guided_prompt) level 5: a 50% solution prefix >= 0.30,
     the full solution >= 0.70
  3. strong student (Direct-OPD) testbed-strong level 3 >= 0.75 and >= 0.10 above the default teacher pair's post
                    model (testbed-weak improved on level 3; grounds.testbed_models.ensure_testbed_teacher_pair)
  4. knowledge      (AdaKP, Problem.hints) level 4: the helpful hints raise accuracy >= 0.15 over no hint;
                    the distractors alone move it by < 0.05
  5. critic format  (MADA-RL, mada_rl.render_critic_prompt) level 3, three proposals: one right raises accuracy
                    >= 0.10 over none; three wrong keep it >= half of none
  6. reward model   (ppo_slm.py) its SFT and reward-model stages with their defaults on testbed-weak: held-out pair
                    accuracy on right-vs-wrong answers >= 0.90 (ppo_slm seed = build seed + 1)

    python -m benchmarks.premises.testbed_premises     # seeds 0 and 1; writes benchmarks/premises/testbed_premises.md
    python -m benchmarks.premises.testbed_premises --seeds 0  # the default models only

The second ground, a real pretrained chat model (--ground smollm2): SmolLM2-135M-Instruct on --dataset testbed-nl,
through the same renderers and the 'nl' verifier, greedy, up to 64 new tokens, --nl-problems held-out problems a cell,
before and (--after CHECKPOINT, e.g. a grpo.py run's checkpoint/) after RL; writes
benchmarks/premises/testbed_premises_smollm2.md, with each cell's leakage: of its problems, how many have an added
context (guidance, knowledge points, proposals) that states the gold answer
(benchmarks/claims/claim_runs.states_answer). A premise measured with the answer in the context measures copying, not
the method (../shared/CLAIMS.md):

  guidance   (OC-GRPO) levels 3 and 5 (zero-shot about 0): a 50% solution prefix >= 0.30, the full prefix >= 0.70
             (oc_grpo.render_guided_prompt: on testbed-nl never past the step before the result)
  knowledge  (AdaKP) levels 2 and 4: the helpful knowledge points raise accuracy >= 0.15 over none; the distractors
             alone move it by < 0.05
  proposals  (MADA-RL) level 2, three proposals: one right raises accuracy >= 0.10 over none; three wrong keep it
             >= half of none; shown as bare answers and as worked responses (what mada_rl.py's critics read)

    python -m benchmarks.premises.testbed_premises --ground smollm2 --after runs/grpo_smollm2/checkpoint

Exits 1 when a premise fails. Build seed 0 is the cached default; other seeds build beside it (about 1.5 minutes a
model on 2 cores). The teacher pair is built from the seed-0 testbed-weak only, so premise 3's second half is
measured once. Premise 6 trains ppo_slm.py's SFT adapter and reward model (about 1.5 minutes a seed).
"""

import argparse
import os
import random
import re
import sys
import time

import torch

from common.data import render_prompt
from common.rollout import HFEngine
from common.testbed import make_suite
from grounds.testbed_models import ensure_testbed_model
from mada_rl import render_critic_prompt
from oc_grpo import render_guided_prompt, solution_prefix

N = 200


def near_miss(answer: int, rng: random.Random) -> str:
    """A plausible wrong answer: off by 1 to 3, never negative."""
    while True:
        wrong = answer + rng.choice((-3, -2, -1, 1, 2, 3))
        if wrong >= 0:
            return str(wrong)


def hinted_prompt(p, tok, helpful: bool) -> str:
    """The trainers' prompt with the problem's helpful (or only its distractor) knowledge points as hints."""
    return render_prompt(p, tok, hints=[h for h, ok in zip(p.hints, p.hint_helpful) if ok == helpful])


def critic_prompt(p, tok, n_right: int, rng: random.Random, responses: bool = False) -> str:
    """mada_rl's critic prompt with three proposals, n_right of them right, the others near misses: bare answers
    (`--critic-sees answers`) or, with `responses`, worked responses as a critic reads them by default: the problem's
    worked solution, and for a wrong one the same with a near miss in place of the answer (its last step and final
    answer wrong: 'Then 100 + 6 = 107. The answer is 107.')."""
    wrong = [near_miss(int(p.answer), rng) for _ in range(3 - n_right)]
    props = [p.answer] * n_right + wrong
    if responses:
        props = [p.solution] * n_right + [re.sub(rf"\b{p.answer}\b", w, p.solution) for w in wrong]
    rng.shuffle(props)
    return render_critic_prompt(p, props, tok)


def accuracy(model, tok, problems, prompts) -> float:
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    out = HFEngine(model, tok).generate(ids, n=1, max_new_tokens=4, greedy=True)
    return sum(t.strip() == p.answer for t, p in zip(out.texts, problems)) / len(problems)


def reward_model_pair_accuracy(model_dir: str, seed: int) -> float:
    """ppo_slm.py itself with its default flags and no PPO step: its SFT and reward-model stages, then the held-out
    pair accuracy it reports."""
    import tempfile

    import tyro

    import ppo_slm

    with tempfile.TemporaryDirectory() as tmp:
        args = tyro.cli(ppo_slm.Args, args=["--model-name", model_dir, "--seed", str(seed), "--total-steps", "0",
                                            "--output-dir", tmp])
        return ppo_slm.main(args)["rm_accuracy"]


def measure(seed: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)

    m, t0 = {}, time.time()
    weak_dir = ensure_testbed_model("testbed-weak", progress=False, seed=seed)
    weak, tok = load(weak_dir)
    m["build s: weak"] = round(time.time() - t0)
    test = {lv: make_suite("test", levels=(lv,), n_per_level=N, seed=1000) for lv in (1, 2, 3, 4, 5)}
    acc = lambda model, lv, render: accuracy(model, tok, test[lv], [render(p) for p in test[lv]])  # noqa: E731
    plain = lambda p: render_prompt(p, tok)  # noqa: E731
    for lv in test:
        m[f"weak L{lv}"] = acc(weak, lv, plain)
    for frac in (0.5, 1.0):
        m[f"weak L5, {frac:.0%} solution prefix"] = acc(
            weak, 5, lambda p: render_guided_prompt(p, tok, solution_prefix(p.solution, frac)))  # noqa: B023
    m["weak L4, helpful hints"] = acc(weak, 4, lambda p: hinted_prompt(p, tok, True))
    m["weak L4, distractor hints"] = acc(weak, 4, lambda p: hinted_prompt(p, tok, False))
    rng = random.Random(seed)
    m["weak L3, 1 of 3 proposals right"] = acc(weak, 3, lambda p: critic_prompt(p, tok, 1, rng))
    m["weak L3, 0 of 3 proposals right"] = acc(weak, 3, lambda p: critic_prompt(p, tok, 0, rng))
    t0 = time.time()
    m["weak, ppo_slm reward model pair accuracy"] = reward_model_pair_accuracy(weak_dir, seed + 1)
    m["s: ppo_slm SFT + RM"] = round(time.time() - t0)
    t0 = time.time()
    strong, _ = load(ensure_testbed_model("testbed-strong", progress=False, seed=seed))
    m["build s: strong"] = round(time.time() - t0)
    m["strong L3"] = acc(strong, 3, plain)
    if seed == 0:
        from grounds.testbed_models import ensure_testbed_teacher_pair

        t0 = time.time()
        teacher, _ = load(ensure_testbed_teacher_pair(progress=False)[1])
        m["build s: teacher post"] = round(time.time() - t0)
        m["teacher post L3"] = acc(teacher, 3, plain)
    return m


def premises(m: dict) -> list[tuple[str, str, bool | None]]:
    rows = [
        ("1. weak L3 in [0.40, 0.60]", f"{m['weak L3']:.3f}", 0.40 <= m["weak L3"] <= 0.60),
        ("1. weak L1 >= 0.85", f"{m['weak L1']:.3f}", m["weak L1"] >= 0.85),
        ("1. weak L5 <= 0.10", f"{m['weak L5']:.3f}", m["weak L5"] <= 0.10),
        ("2. L5 with a 50% solution prefix >= 0.30", f"{m['weak L5, 50% solution prefix']:.3f}",
         m["weak L5, 50% solution prefix"] >= 0.30),
        ("2. L5 with the full solution >= 0.70", f"{m['weak L5, 100% solution prefix']:.3f}",
         m["weak L5, 100% solution prefix"] >= 0.70),
        ("3. strong L3 >= 0.75", f"{m['strong L3']:.3f}", m["strong L3"] >= 0.75),
        ("3. strong L3 >= teacher post L3 + 0.10",
         f"{m['strong L3']:.3f} vs {m['teacher post L3']:.3f}" if "teacher post L3" in m else "not measured",
         m["strong L3"] >= m["teacher post L3"] + 0.10 if "teacher post L3" in m else None),
        ("4. L4 helpful hints - none >= 0.15", f"{m['weak L4, helpful hints']:.3f} - {m['weak L4']:.3f}",
         m["weak L4, helpful hints"] - m["weak L4"] >= 0.15),
        ("4. L4 abs(distractors - none) < 0.05", f"{m['weak L4, distractor hints']:.3f} - {m['weak L4']:.3f}",
         abs(m["weak L4, distractor hints"] - m["weak L4"]) < 0.05),
        ("5. L3 1 of 3 proposals right - none >= 0.10",
         f"{m['weak L3, 1 of 3 proposals right']:.3f} - {m['weak L3']:.3f}",
         m["weak L3, 1 of 3 proposals right"] - m["weak L3"] >= 0.10),
        ("5. L3 0 of 3 right >= none / 2", f"{m['weak L3, 0 of 3 proposals right']:.3f} vs {m['weak L3']:.3f}",
         m["weak L3, 0 of 3 proposals right"] >= m["weak L3"] / 2),
        ("6. reward model pair accuracy >= 0.90", f"{m['weak, ppo_slm reward model pair accuracy']:.3f}",
         m["weak, ppo_slm reward model pair accuracy"] >= 0.90),
    ]
    return rows


NL_GUIDED, NL_KP, NL_PROPOSALS = (3, 5), (2, 4), (2,)
"""testbed-nl levels of each premise: guidance where the model fails alone, hints and proposals where it sometimes
succeeds (benchmarks/premises/smollm2_zero_shot.md)"""


def nl_accuracy(model, tok, problems, prompts, batch: int = 32) -> float:
    """Greedy accuracy with the 'nl' verifier, at most 64 new tokens (a cut reply scores 0)."""
    from common.verifiers import score

    ids, correct = tok(prompts, add_special_tokens=False)["input_ids"], []
    for s in range(0, len(ids), batch):
        out = HFEngine(model, tok).generate(ids[s : s + batch], n=1, max_new_tokens=64, greedy=True)
        correct += score(out.texts, problems[s : s + batch], out.truncated_B)
    return sum(correct) / len(correct)


def measure_pretrained(path: str, n: int, seed: int = 0) -> tuple[dict, dict]:
    """The premise cells for a pretrained chat model on testbed-nl (the same renderers as the trainers), and each
    cell's leakage: {cell: problems whose added context states the answer}."""
    from common.data import load_problems
    from common.models import load_model, load_tokenizer

    tok, model = load_tokenizer(path), load_model(path).eval()
    test = {lv: load_problems("testbed-nl", "test", (lv,), n, seed) for lv in (1, 2, 3, 4, 5)}
    m, leaks, t0 = {}, {}, time.time()

    def cell(name: str, lv: int, render) -> None:
        prompts = [render(p) for p in test[lv]]
        m[name], leaks[name] = nl_accuracy(model, tok, test[lv], prompts), leaked(test[lv], prompts, tok)

    for lv in test:
        cell(f"L{lv}", lv, lambda p: render_prompt(p, tok))
    for lv in NL_GUIDED:
        for frac in (0.5, 1.0):
            cell(f"L{lv}, {frac:.0%} solution prefix", lv,
                 lambda p: render_guided_prompt(p, tok, solution_prefix(p.solution, frac)))  # noqa: B023
    for lv in NL_KP:
        cell(f"L{lv}, helpful hints", lv, lambda p: hinted_prompt(p, tok, True))
        cell(f"L{lv}, distractor hints", lv, lambda p: hinted_prompt(p, tok, False))
    for lv in NL_PROPOSALS:
        m.update(proposal_cells(model, tok, test[lv], lv, seed, leaks))
    m["s: all cells"] = round(time.time() - t0)
    return m, {**leaks, "problems": {f"L{lv}": len(test[lv]) for lv in test}}


def leaked(problems: list, prompts: list, tok) -> int:
    """How many of the prompts add to the plain one a context that states the problem's gold answer."""
    from benchmarks.claims.claim_runs import added_text, states_answer

    return sum(states_answer(added_text(render_prompt(p, tok), x), p.answer, tok) for p, x in zip(problems, prompts))


def proposal_cells(model, tok, problems: list, lv: int, seed: int = 0, leaks: dict | None = None) -> dict:
    """MADA-RL's critic premise on level `lv`'s `problems`: greedy accuracy with 1 and with 0 of 3 proposals right,
    shown as bare answers and as worked responses (critic_prompt); each cell's leakage into `leaks` if given."""
    rng, m = random.Random(seed), {}
    for shown, responses in (("proposals", False), ("responses", True)):
        for right in (1, 0):
            prompts, name = [critic_prompt(p, tok, right, rng, responses) for p in problems], \
                f"L{lv}, {right} of 3 {shown} right"
            m[name] = nl_accuracy(model, tok, problems, prompts)
            if leaks is not None:
                leaks[name] = leaked(problems, prompts, tok)
    return m


def premises_pretrained(m: dict) -> list[tuple[str, str, bool, str]]:
    """(premise, figures, holds, the cell with the context) for each premise."""
    rows = []
    for lv in NL_GUIDED:
        for frac, need in ((0.5, 0.30), (1.0, 0.70)):
            key = f"L{lv}, {frac:.0%} solution prefix"
            rows.append((f"guidance: L{lv} with a {frac:.0%} solution prefix (to the step before the result) >= "
                         f"{need:.2f} (none: L{lv})",
                         f"{m[key]:.3f} (none {m[f'L{lv}']:.3f})", m[key] >= need, key))
    for lv in NL_KP:
        h, d, none = m[f"L{lv}, helpful hints"], m[f"L{lv}, distractor hints"], m[f"L{lv}"]
        rows.append((f"knowledge: L{lv} helpful hints - none >= 0.15", f"{h:.3f} - {none:.3f}", h - none >= 0.15,
                     f"L{lv}, helpful hints"))
        rows.append((f"knowledge: L{lv} abs(distractors - none) < 0.05", f"{d:.3f} - {none:.3f}", abs(d - none) < 0.05,
                     f"L{lv}, distractor hints"))
    for lv in NL_PROPOSALS:
        rows += proposal_premises(m, lv)
    return rows


def proposal_premises(m: dict, lv: int) -> list[tuple[str, str, bool, str]]:
    rows, none = [], m[f"L{lv}"]
    for shown in ("proposals", "responses"):
        one, zero = f"L{lv}, 1 of 3 {shown} right", f"L{lv}, 0 of 3 {shown} right"
        rows.append((f"{shown}: L{lv} 1 of 3 right - none >= 0.10", f"{m[one]:.3f} - {none:.3f}",
                     m[one] - none >= 0.10, one))
        rows.append((f"{shown}: L{lv} 0 of 3 right >= none / 2", f"{m[zero]:.3f} vs {none:.3f}", m[zero] >= none / 2,
                     zero))
    return rows


def main_pretrained(a) -> None:
    from benchmarks.claims.claim_runs import cached
    from grounds.pretrained import ensure_pretrained_model

    models = {"SmolLM2-135M-Instruct": ensure_pretrained_model("smollm2-135m-instruct")}
    if a.after:
        models[f"after RL ({a.after})"] = a.after
    records = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs", "testbed_premises_smollm2")
    results = {}
    for (name, path), key in zip(models.items(), ("base", "after")):  # a column kept: measured once a version
        measure = lambda path=path: dict(zip(("cells", "leaks"), measure_pretrained(path, a.nl_problems)))  # noqa: E731
        results[name] = cached(os.path.join(records, f"{key}.json"), {"model": path, "n": a.nl_problems}, measure)
    leaks = results[next(iter(models))]["leaks"]  # the contexts do not depend on the model
    rows = {name: premises_pretrained(r["cells"]) for name, r in results.items()}
    verdict = lambda p: "pass" if p else "**fail**"  # noqa: E731
    leak = lambda key: f"{leaks[key]} of {leaks['problems'][key.split(',')[0]]}"  # noqa: E731
    cols = list(models)
    lines = ["# Premises on a real pretrained model: SmolLM2-135M-Instruct on testbed-nl", "",
             f"`python -m benchmarks.premises.testbed_premises --ground smollm2 --nl-problems {a.nl_problems}"
             + (f" --after {a.after}`" if a.after else "`") + f" (greedy, up to 64 new tokens, {a.nl_problems} "
             "held-out problems a cell, fewer where a level has fewer (level 1: 20 sums), the trainers' renderers and "
             "the 'nl' verifier; a cut reply scores 0), testbed-nl version "
             f"{results[cols[0]]['ground']}, {time.strftime('%Y-%m-%d')}. Measured on a 2-core CPU; the figures, not "
             "the thresholds, decide what the papers' benchmarks can show. Leakage: of a cell's problems, those whose "
             "added context (guidance, knowledge points, proposals) states the gold answer as tokens "
             "(benchmarks/claims/claim_runs.states_answer); a premise measured with the answer in its context measures "
             "copying. A proposal cell with one right proposal states it by design: the premise is whether the critic "
             "picks it out of three.", "",
             "| premise | leakage | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for i, (name, _, _, key) in enumerate(rows[cols[0]]):
        lines.append(f"| {name} | {leak(key)} | " + " | ".join(f"{rows[c][i][1]} {verdict(rows[c][i][2])}"
                                                              for c in cols) + " |")
    if not a.after:
        lines += ["", "After RL: not measured in this run (--after CHECKPOINT: the 30-step GRPO start of "
                  "benchmarks/claims/grpo_smollm2.py's start_args, which this checkout does not hold)."]
    lines += ["", "| measurement | leakage | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for k in results[cols[0]]["cells"]:
        lines.append(f"| {k} | {leak(k) if k in leaks else ''} | " + " | ".join(
            f"{results[c]['cells'][k]:.3f}" if isinstance(results[c]["cells"][k], float)
            else str(results[c]["cells"][k]) for c in cols) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_premises_smollm2.md"),
              "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ground", choices=["testbed", "smollm2"], default="testbed",
                    help="testbed: the embedded models; smollm2: the real pretrained model on testbed-nl")
    ap.add_argument("--after", default="", help="--ground smollm2: a checkpoint folder to measure beside the model")
    ap.add_argument("--nl-problems", type=int, default=50, help="--ground smollm2: held-out problems a cell")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="build seeds")
    ap.add_argument("--out", default="", help="report file (default benchmarks/premises/testbed_premises[_smollm2].md)")
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if a.ground == "smollm2":
        return main_pretrained(a)
    a.out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_premises.md")
    results = {s: measure(s) for s in a.seeds}
    rows = {s: premises(results[s]) for s in a.seeds}
    ok = all(p is not False for s in a.seeds for _, _, p in rows[s])
    verdict = lambda p: "n/a" if p is None else "pass" if p else "**FAIL**"  # noqa: E731
    lines = ["# Testbed premises", "",
             f"`python -m benchmarks.premises.testbed_premises --seeds {' '.join(map(str, a.seeds))}` "
             f"(greedy, {N} held-out problems per cell). All premises hold: **{'yes' if ok else 'no'}**.", "",
             "| premise | " + " | ".join(f"build seed {s}" for s in a.seeds) + " |",
             "|---|" + "---|" * len(a.seeds)]
    for i, (name, _, _) in enumerate(rows[a.seeds[0]]):
        lines.append(f"| {name} | " + " | ".join(f"{rows[s][i][1]} {verdict(rows[s][i][2])}" for s in a.seeds) + " |")
    lines += ["", "| measurement | " + " | ".join(f"build seed {s}" for s in a.seeds) + " |",
              "|---|" + "---|" * len(a.seeds)]
    for k in results[a.seeds[0]]:
        vals = [results[s].get(k, "") for s in a.seeds]
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
