"""AdaKP vs its four baselines (no hints, all hints, a random subset, a static subset), and the proxy's validity.

Part 1, the proxy (initial policy): on --proxy-problems training problems, score(k | {}) of every KP from one batched
no-grad forward per problem batch, against the pass-rate gain of adding k alone, measured with --proxy-samples
rollouts with {k} and with no hint; Spearman correlation over all (problem, KP) pairs, the mean score of helpful
KPs and of distractors, the truncation bound against the median |score|, and the cost (contexts scored in one
forward vs the generations a leave-one-out measurement needs).
Part 2, training: every arm with the same problems, steps, seeds and optimiser; no-hint held-out greedy accuracy
before and after, the zero-correct fraction of training groups, mean |S| over training (first and second half),
proxy forwards. Whether adakp beats the static subset is reported per seed, with the spread; nothing is tuned.

    python -m benchmarks.testbed.adakp_benchmark                # level 4, 2 seeds, 60 steps of 8 x 8
    python -m benchmarks.testbed.adakp_benchmark --steps 200 --seeds 1 2 3 --proxy-problems 100
"""

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import adakp
from benchmarks import ROOT
from common.data import encode_prompts, load_problems, render_prompt
from common.logger import read_metrics
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine, attach, completion_logprobs
from common.verifiers import score
from grounds import path_of

ARMS = ["adakp", "static", "random", "all", "none"]


@dataclass
class Bench:
    model_name: str = "testbed-weak"
    """policy (a testbed name or a local folder)"""
    level: int = 4
    """testbed level"""
    steps: int = 60
    """training steps per run"""
    seeds: tuple[int, ...] = (1, 2)
    """one run per arm and seed"""
    arms: tuple[str, ...] = tuple(ARMS)
    """which --kp-mode values to train"""
    num_prompts: int = 8
    """prompts per step"""
    group_size: int = 8
    """completions per prompt"""
    learning_rate: float = 5e-5
    """AdamW learning rate of every run"""
    num_eval_problems: int = 200
    """held-out problems per evaluation (no hints)"""
    proxy_problems: int = 100
    """training problems for the proxy-validity check (0: skip part 1)"""
    proxy_samples: int = 16
    """rollouts per (problem, hint subset) to measure pass-rate gains"""
    threads: int = 1
    """torch CPU threads"""
    output_dir: str = "runs/adakp_benchmark"
    """run folders"""
    report: str = os.path.join(ROOT, "benchmarks", "testbed", "adakp_benchmark.md")
    """markdown written at the end"""


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for val in np.unique(v):  # ties share their mean rank
            r[v == val] = r[v == val].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def proxy_check(model_dir: str, dataset: str, level: int, num_problems: int, samples: int, max_new_tokens: int,
                batch_size: int = 4096) -> dict:
    """The entropy proxy against measured gains on `num_problems` training problems of `level`: score(k | {}) of
    each KP (top-50 entropy on the 96-token probe, forwards of `batch_size` contexts) and the pass-rate gain of {k}
    over no hint, from `samples` rollouts of each context at temperature 1 (a cut reply scores 0)."""
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, "float32", "cpu")
    engine = HFEngine(model, tok, max_batch=min(batch_size, 512))
    torch.manual_seed(0)
    problems = load_problems(dataset, "train", (level,), num_problems, 0)
    # scores: for each problem, S = {} and {k} for every k, all problems' contexts in one batched forward
    contexts, probes, owner = [], [], []
    for j, p in enumerate(problems):
        for S in [[]] + [[k] for k in range(len(p.hints))]:
            contexts.append(encode_prompts(tok, [render_prompt(p, tok, hints=[p.hints[k] for k in S])])[0])
            probes.append(adakp.probe_tokens(p, tok, 96))
            owner.append(j)
    t0 = time.time()
    h, b, eps, passes = adakp.probe_entropy(model, contexts, probes, tok.pad_token_id, len(tok), 50, batch_size)
    t_proxy = time.time() - t0
    # for comparison (not AdaKP's proxy): the mean NLL of the same probe, which also sees confident wrong answers
    nll = []
    for s in range(0, len(contexts), batch_size):
        rows = attach(contexts[s : s + batch_size], [(z, "", False) for z in probes[s : s + batch_size]],
                      tok.pad_token_id)
        with torch.no_grad():
            logp_BC, _ = completion_logprobs(model, rows.input_ids_BT, rows.attention_mask_BT, rows.prompt_len)
        nll += (-(logp_BC * rows.completion_mask_BC).sum(1) / rows.completion_mask_BC.sum(1)).tolist()
    # measured gains: proxy_samples rollouts per context
    t0 = time.time()
    out = engine.generate(contexts, n=samples, temperature=1.0, max_new_tokens=max_new_tokens)
    t_gen = time.time() - t0
    ok = np.array(score(out.texts, [problems[j] for j in owner for _ in range(samples)], out.truncated_B), dtype=float)
    rate = ok.reshape(len(contexts), samples).mean(1)
    scores, nll_scores, gains, helpful, bounds = [], [], [], [], []
    at = 0
    for p in problems:
        m = len(p.hints)
        base_h, base_r = h[at].item(), rate[at]
        for k in range(m):
            scores.append(base_h - h[at + 1 + k].item())
            nll_scores.append(nll[at] - nll[at + 1 + k])
            gains.append(rate[at + 1 + k] - base_r)
            helpful.append(p.hint_helpful[k] if p.hint_helpful else None)
            bounds.append(max(b[at].item(), b[at + 1 + k].item()))
        at += 1 + m
    scores, gains = np.array(scores), np.array(gains)
    hel = np.array([x is True for x in helpful])
    return {
        "pairs": len(scores), "problems": len(problems), "spearman": spearman(scores, gains),
        "spearman_helpful_label": spearman(scores, hel.astype(float)),
        "spearman_nll": spearman(nll_scores, gains), "spearman_nll_helpful_label": spearman(nll_scores, hel.astype(float)),
        "score_helpful": float(scores[hel].mean()) if hel.any() else float("nan"),
        "score_distractor": float(scores[~hel].mean()) if (~hel).any() else float("nan"),
        "gain_helpful": float(gains[hel].mean()) if hel.any() else float("nan"),
        "gain_distractor": float(gains[~hel].mean()) if (~hel).any() else float("nan"),
        "base_pass_rate": float(rate[[i for i in range(len(contexts)) if i == 0 or owner[i] != owner[i - 1]]].mean()),
        "median_abs_score": float(np.median(np.abs(scores))), "bound_median": float(np.median(bounds)),
        "bound_max": float(np.max(bounds)), "eps_mean": float(eps.mean()),
        "proxy_forwards": passes, "proxy_contexts": len(contexts), "proxy_seconds": t_proxy,
        "loo_generations": samples * len(contexts), "generation_seconds": t_gen,
    }


def proxy_lines(proxy: dict, level: int, samples: int, probe: str) -> list[str]:
    """The proxy check's table (proxy_check's dict)."""
    return [f"{proxy['problems']} level-{level} training problems, {proxy['pairs']} (problem, KP) pairs; "
            f"score(k | {{}}) from top-50 truncated entropy on the probe ({probe}); gain = pass rate with "
            f"{{k}} minus pass rate with no hint, {samples} samples each (no-hint pass rate "
            f"{proxy['base_pass_rate']:.3f}).", "",
            "| quantity | value |", "|---|---|",
            f"| Spearman(score, measured gain) | {proxy['spearman']:.3f} |",
            f"| Spearman(score, helpful label) | {proxy['spearman_helpful_label']:.3f} |",
            f"| for comparison, probe-NLL reduction instead of entropy: Spearman with gain / with label | "
            f"{proxy['spearman_nll']:.3f} / {proxy['spearman_nll_helpful_label']:.3f} |",
            f"| mean score: helpful / distractor (nats) | {proxy['score_helpful']:.4f} / "
            f"{proxy['score_distractor']:.4f} |",
            f"| mean gain: helpful / distractor | {proxy['gain_helpful']:.3f} / {proxy['gain_distractor']:.3f} |",
            f"| median abs score / median truncation bound / max bound | {proxy['median_abs_score']:.4f} / "
            f"{proxy['bound_median']:.2e} / {proxy['bound_max']:.2e} |",
            f"| cost: contexts scored / no-grad forwards | {proxy['proxy_contexts']} / {proxy['proxy_forwards']} "
            f"({proxy['proxy_seconds']:.1f} s) |",
            f"| cost of measuring the same gains by rollouts (G x contexts) | {proxy['loo_generations']} "
            f"generations ({proxy['generation_seconds']:.1f} s) |"]


def run_one(bench: Bench, arm: str, seed: int) -> dict:
    cli = ["--model-name", bench.model_name, "--levels", str(bench.level), "--total-steps", str(bench.steps),
           "--seed", str(seed), "--num-prompts", str(bench.num_prompts), "--group-size", str(bench.group_size),
           "--learning-rate", str(bench.learning_rate), "--num-eval-problems", str(bench.num_eval_problems),
           "--eval-samples", "0", "--eval-every", "0", "--kp-mode", arm, "--output-dir", bench.output_dir,
           "--run-name", f"{arm}__{seed}__{int(time.time())}"]
    t0 = time.time()
    out = adakp.main(tyro.cli(adakp.Args, args=cli))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "kp/mean_size" in r]
    half = len(rows) // 2
    mean = lambda key, rs: float(np.mean([r[key] for r in rs])) if rs else float("nan")  # noqa: E731
    return {"arm": arm, "seed": seed, "before": out["before"]["eval/greedy_accuracy"],
            "after": out["after"]["eval/greedy_accuracy"], "zero_correct": mean("kp/zero_correct_frac", rows),
            "size_first": mean("kp/mean_size", rows[:half]), "size_second": mean("kp/mean_size", rows[half:]),
            "size": mean("kp/mean_size", rows), "helpful": mean("kp/helpful_frac", rows),
            "proxy_passes": float(sum(r["kp/proxy_passes"] for r in rows)), "seconds": time.time() - t0}


def main(bench: Bench) -> None:
    torch.set_num_threads(bench.threads)
    lines = ["# AdaKP benchmark", "", f"`python -m benchmarks.testbed.adakp_benchmark` with {bench}", ""]
    proxy = (proxy_check(path_of(bench.model_name), "testbed", bench.level, bench.proxy_problems,
                         bench.proxy_samples, 8) if bench.proxy_problems else None)
    if proxy:
        print(json.dumps(proxy, indent=1))
        lines += ["## The proxy (initial policy)", "", *proxy_lines(proxy, bench.level, bench.proxy_samples,
                                                                     "answer + eos"), ""]
    results = []
    for seed in bench.seeds:
        for arm in bench.arms:
            results.append(run_one(bench, arm, seed))
            print(json.dumps(results[-1]))
    lines += ["## Training", "",
              "No-hint held-out greedy accuracy (the evaluation never shows hints); zero-correct = share of training "
              "groups whose G hinted rollouts all fail; |S| = KPs shown per training prompt.", "",
              "| arm | seed | no-hint acc before | after | zero-correct frac | mean |S| (1st half / 2nd half) | "
              "helpful share of shown KPs | proxy forwards | time (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | {r['zero_correct']:.3f} | "
                     f"{r['size_first']:.2f} / {r['size_second']:.2f} | {r['helpful']:.2f} | {r['proxy_passes']:.0f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "| arm | mean no-hint acc after (min..max over seeds) | mean zero-correct frac |", "|---|---|---|"]
    for arm in bench.arms:
        rs = [r for r in results if r["arm"] == arm]
        acc = [r["after"] for r in rs]
        lines.append(f"| {arm} | {np.mean(acc):.3f} ({min(acc):.3f}..{max(acc):.3f}) | "
                     f"{np.mean([r['zero_correct'] for r in rs]):.3f} |")
    if "adakp" in bench.arms and "static" in bench.arms:
        diffs = [a["after"] - s["after"] for a in results if a["arm"] == "adakp"
                 for s in results if s["arm"] == "static" and s["seed"] == a["seed"]]
        verdict = "beats" if all(d > 0 for d in diffs) else "does not beat"
        lines += ["", f"adakp minus static, per seed: {', '.join(f'{d:+.3f}' for d in diffs)} "
                  f"(mean {np.mean(diffs):+.3f}): adakp {verdict} the static subset on every seed at this scale."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(bench.report, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main(tyro.cli(Bench))
