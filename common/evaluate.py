"""Held-out evaluation: greedy accuracy and unbiased pass@k, overall and per level."""

from __future__ import annotations

from collections import defaultdict
from math import comb

from common.data import encode_prompts, render_prompt
from common.logger import sample_rows
from common.verifiers import score


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
    (0.25, 1.0, 0.0)
    """
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(engine, tokenizer, problems: list, max_new_tokens: int, num_samples: int = 0,
             temperature: float = 1.0, pass_k: int = 0, max_prompt_tokens: int = 0, log_samples: int = 0) -> dict:
    """eval/greedy_accuracy (and per level), eval/sampled_accuracy and eval/pass_at_k when num_samples > 0; with
    log_samples > 0 also 'samples/eval': that many greedy answers as text (common.logger.sample_rows)."""
    if not problems:
        return {}
    prompt_ids = encode_prompts(tokenizer, [render_prompt(p, tokenizer) for p in problems], max_prompt_tokens)
    greedy = engine.generate(prompt_ids, n=1, max_new_tokens=max_new_tokens, greedy=True)
    correct = score(greedy.texts, problems)
    out = {"eval/greedy_accuracy": sum(correct) / len(correct)}
    if log_samples > 0:
        out["samples/eval"] = sample_rows(tokenizer, greedy, problems, log_samples, correct=correct)
    by_level = defaultdict(list)
    for p, c in zip(problems, correct):
        by_level[p.level].append(c)
    if len(by_level) > 1:
        out.update({f"eval/greedy_accuracy/level_{lv}": sum(v) / len(v) for lv, v in sorted(by_level.items())})
    if num_samples > 0:
        sampled = engine.generate(prompt_ids, n=num_samples, temperature=temperature, max_new_tokens=max_new_tokens)
        c = score(sampled.texts, [p for p in problems for _ in range(num_samples)])
        per_problem = [sum(c[i * num_samples : (i + 1) * num_samples]) for i in range(len(problems))]
        k = min(pass_k or num_samples, num_samples)
        out["eval/sampled_accuracy"] = sum(c) / len(c)
        out["eval/pass_at_k"] = sum(pass_at_k(num_samples, int(x), k) for x in per_problem) / len(problems)
    return out


def evaluator(engine, tokenizer, problems: list, args):
    """A trainer's `run_eval()`: `evaluate` on the held-out problems with the run's sampling and evaluation flags."""
    return lambda: evaluate(engine, tokenizer, problems, args.max_new_tokens, args.eval_samples, args.temperature,
                            args.eval_pass_k, args.max_prompt_tokens, args.log_samples)
