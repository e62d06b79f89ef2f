"""Held-out evaluation: greedy accuracy and unbiased pass@k, overall and per level; the evaluations before and after
training, logged."""

from __future__ import annotations

from math import comb

import torch
from tqdm import tqdm

from common.data import encode_prompts, render_prompt
from common.dist import all_reduce_sum, rank_world
from common.logger import bars_off, sample_rows, without_samples
from common.verifiers import format_reward, score


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 4), pass_at_k(4, 0, 2)
    (0.25, 1.0, 0.0)
    """
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def answer_bar(total: int, what: str, max_new_tokens: int) -> tqdm:
    """Rank 0's bar over `total` answers (`what (up to N new tokens an answer): k/total answers`) for an engine's
    `on_answers`; no clock (the answers of one batch end together, the cut ones last), cleared when closed."""
    return tqdm(total=total, desc=f"{what} (up to {max_new_tokens} new tokens an answer)", leave=False,
                bar_format="{desc}: {n}/{total} answers", disable=bars_off(rank_world()[0]))


def evaluate(engine, tokenizer, problems: list, max_new_tokens: int, num_samples: int = 0, temperature: float = 1.0,
             pass_k: int = 0, max_prompt_tokens: int = 0, log_samples: int = 0, top_p: float = 1.0) -> dict:
    """eval/greedy_accuracy (and per level) over eval/num_problems problems, eval/format_rate (greedy answers in the
    task's answer format, common.verifiers.format_reward), eval/truncated_frac (greedy answers cut at max_new_tokens:
    they score 0), eval/sampled_accuracy and eval/pass_at_k when num_samples > 0 (sampled at `temperature` and `top_p`,
    as in training); with log_samples > 0 'samples/eval', that many greedy answers (common.logger.sample_rows). Under
    torchrun each rank answers its share, problems[rank::world], and every rank returns the figures of all `problems`
    (counts summed over ranks); a rank with no share generates for one uncounted problem (under --fsdp every generation
    is a collective). Rank 0's console shows a bar over its answers while they are generated, cleared when done."""
    if not problems:
        return {}
    rank, world = rank_world()
    counted, share = len(problems[rank::world]), problems[rank::world] or problems[:1]
    bar = answer_bar(len(share) * (1 + num_samples), f"held-out evaluation, {len(problems)} problems", max_new_tokens)
    engine.on_answers = bar.update  # common.rollout.HFEngine counts answers as they end (vllm's: none till the end)
    prompt_ids = encode_prompts(tokenizer, [render_prompt(p, tokenizer) for p in share], max_prompt_tokens)
    greedy = engine.generate(prompt_ids, n=1, max_new_tokens=max_new_tokens, greedy=True)
    bar.update(len(share) - bar.n)
    correct, levels = score(greedy.texts, share, greedy.truncated_B)[:counted], sorted({p.level for p in problems})
    in_format = [format_reward(t, p.task) for t, p in zip(greedy.texts[:counted], share)]
    # greedy: correct, problems, in the task's answer format, cut at the cap; then per level; then sampled, pass@k
    sums = [sum(correct), counted, sum(in_format), greedy.truncated_B[:counted].sum().item()]
    for mine in ([c for p, c in zip(share, correct) if p.level == lv] for lv in levels):
        sums += [sum(mine), len(mine)]
    if num_samples > 0:
        sampled = engine.generate(prompt_ids, n=num_samples, temperature=temperature, top_p=top_p,
                                  max_new_tokens=max_new_tokens)
        bar.update(bar.total - bar.n)
        c = score(sampled.texts, [p for p in share for _ in range(num_samples)], sampled.truncated_B)
        # pass@k counts the samples with a full score (a reasoning-gym task's partial credit is not a pass)
        solved = [sum(x >= 1 for x in c[i * num_samples : (i + 1) * num_samples]) for i in range(counted)]
        k = min(pass_k or num_samples, num_samples)
        sums += [sum(c[: counted * num_samples]), counted * num_samples,
                 sum(pass_at_k(num_samples, x, k) for x in solved)]
    bar.close()
    engine.on_answers = None
    total = all_reduce_sum(torch.tensor(sums, dtype=torch.float64)).tolist()
    out = {"eval/greedy_accuracy": total[0] / total[1], "eval/format_rate": total[2] / total[1],
           "eval/truncated_frac": total[3] / total[1], "eval/num_problems": int(total[1])}
    out.update({f"eval/greedy_accuracy/level_{lv}": total[4 + 2 * i] / max(total[5 + 2 * i], 1)
                for i, lv in enumerate(levels) if len(levels) > 1})
    if num_samples > 0:  # sampled accuracy over all the samples, pass@k over the problems
        out.update({"eval/sampled_accuracy": total[-3] / total[-2], "eval/pass_at_k": total[-1] / total[1],
                    "eval/pass_k": k})
    if log_samples > 0 and counted:
        out["samples/eval"] = sample_rows(tokenizer, greedy, share[:counted], log_samples, correct=correct)
    return out


def evaluator(engine, tokenizer, problems: list, args):
    """A trainer's `run_eval()`: `evaluate` on the held-out problems with the run's sampling and evaluation flags."""
    return lambda: evaluate(engine, tokenizer, problems, args.max_new_tokens, args.eval_samples, args.temperature,
                            args.eval_pass_k, args.max_prompt_tokens, args.log_samples, args.top_p)


def first_evaluation(run_eval, state: dict, writer) -> dict:
    """The held-out evaluation before training, logged by `writer` (a RunLogger) at the start step (a resumed run keeps
    the one it had), without its samples."""
    first_eval = state.get("first_eval")
    if first_eval is None:
        first_eval = run_eval()
        writer.log(state["step"], first_eval)
    return without_samples(first_eval)


def final_evaluation(run_eval, writer, first_eval: dict, step: int, what: str = "held-out greedy accuracy") -> dict:
    """The held-out evaluation after training, logged by `writer` at `step` and returned without its samples; rank 0
    (the writer's) prints `what: before -> after (+x points, n=N); run folder ...`. Step 0 (--total-steps 0, an
    evaluation-only run): the weights never changed, so the first evaluation is the last."""
    final_eval = run_eval() if step else first_eval
    if step:
        writer.log(step, final_eval)
    final_eval = without_samples(final_eval)
    if writer.enabled:
        before, after = first_eval.get("eval/greedy_accuracy", 0.0), final_eval.get("eval/greedy_accuracy", 0.0)
        change = f"-> {after:.3f} ({100 * (after - before):+.1f} points, " if step else "(evaluation only, "
        n = final_eval.get("eval/num_problems", "?")
        print(f"{what}: {before:.3f} {change}n={n}); run folder {writer.run_dir}")
    return final_eval
