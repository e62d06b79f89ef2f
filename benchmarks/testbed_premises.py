"""Does the embedded testbed hold each trainer's premise? Builds the models (two build seeds) and measures, with
greedy decoding on held-out problems (200 per cell), through the prompts the trainers themselves render:

  1. calibration    testbed-weak: level 3 in [0.40, 0.60], level 1 >= 0.85, level 5 <= 0.10
  2. guidance       (OC-GRPO, oc_grpo.solution_prefix and render_guided_prompt) level 5: a 50% solution prefix >= 0.30, the full solution >= 0.70
  3. strong student (Direct-OPD) testbed-strong level 3 >= 0.75 and >= 0.10 above the default teacher pair's post
                    model (testbed-weak improved on level 3; common.testbed.ensure_testbed_teacher_pair)
  4. knowledge      (AdaKP, Problem.hints) level 4: the helpful hints raise accuracy >= 0.15 over no hint;
                    the distractors alone move it by < 0.05
  5. critic format  (MADA-RL, mada_rl.render_critic_prompt) level 3, three proposals: one right raises accuracy
                    >= 0.10 over none; three wrong keep it >= half of none
  6. reward model   (ppo_slm.py) its SFT and reward-model stages with their defaults on testbed-weak: held-out pair
                    accuracy on right-vs-wrong answers >= 0.90 (ppo_slm seed = build seed + 1)

    python benchmarks/testbed_premises.py              # seeds 0 and 1; writes benchmarks/testbed_premises.md
    python benchmarks/testbed_premises.py --seeds 0    # the default models only

Exits 1 when a premise fails. Build seed 0 is the cached default; other seeds build beside it (about 1.5 minutes a
model on 2 cores). The teacher pair is built from the seed-0 testbed-weak only, so premise 3's second half is
measured once. Premise 6 trains ppo_slm.py's SFT adapter and reward model (about 1.5 minutes a seed).
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.data import render_prompt  # noqa: E402
from common.rollout import HFEngine  # noqa: E402
from common.testbed import ensure_testbed_model, make_suite  # noqa: E402
from mada_rl import render_critic_prompt  # noqa: E402
from oc_grpo import render_guided_prompt, solution_prefix  # noqa: E402

N = 200


def near_miss(answer: int, rng: random.Random) -> str:
    """A plausible wrong answer: off by 1 to 3, never negative."""
    while True:
        wrong = answer + rng.choice((-3, -2, -1, 1, 2, 3))
        if wrong >= 0:
            return str(wrong)


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
    m["weak L4, helpful hints"] = acc(weak, 4, lambda p: render_prompt(
        p, tok, hints=[h for h, ok in zip(p.hints, p.hint_helpful) if ok]))
    m["weak L4, distractor hints"] = acc(weak, 4, lambda p: render_prompt(
        p, tok, hints=[h for h, ok in zip(p.hints, p.hint_helpful) if not ok]))
    rng = random.Random(seed)

    def critic(p, n_right):
        props = [p.answer] * n_right + [near_miss(int(p.answer), rng) for _ in range(3 - n_right)]
        rng.shuffle(props)
        return render_critic_prompt(p, props, tok)

    m["weak L3, 1 of 3 proposals right"] = acc(weak, 3, lambda p: critic(p, 1))
    m["weak L3, 0 of 3 proposals right"] = acc(weak, 3, lambda p: critic(p, 0))
    t0 = time.time()
    m["weak, ppo_slm reward model pair accuracy"] = reward_model_pair_accuracy(weak_dir, seed + 1)
    m["s: ppo_slm SFT + RM"] = round(time.time() - t0)
    t0 = time.time()
    strong, _ = load(ensure_testbed_model("testbed-strong", progress=False, seed=seed))
    m["build s: strong"] = round(time.time() - t0)
    m["strong L3"] = acc(strong, 3, plain)
    if seed == 0:
        from common.testbed import ensure_testbed_teacher_pair

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="build seeds")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_premises.md"))
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = {s: measure(s) for s in a.seeds}
    rows = {s: premises(results[s]) for s in a.seeds}
    ok = all(p is not False for s in a.seeds for _, _, p in rows[s])
    verdict = lambda p: "n/a" if p is None else "pass" if p else "**FAIL**"  # noqa: E731
    lines = ["# Testbed premises", "", f"`python benchmarks/testbed_premises.py --seeds {' '.join(map(str, a.seeds))}` "
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
