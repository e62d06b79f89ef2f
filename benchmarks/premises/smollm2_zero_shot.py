"""Zero-shot SmolLM2-135M-Instruct on --dataset testbed-nl: accuracy per level, the share of replies in the expected
format and the share cut at --max-new-tokens, greedy and sampled (temperature 1, top_p 1, one sample a problem), with
the chat template's default system prompt (system_prompt None) and with an empty one (""), for the prompt wording of
common/testbed_nl.py (NL_INSTRUCTION); then, greedy and with the default system prompt only, for the alternative
wordings below. Held-out problems, the trainers' own renderer (common.data.render_prompt) and verifier
(common.verifiers.score, the 'nl' answer rule). Writes benchmarks/premises/smollm2_zero_shot.md.

    python -m benchmarks.premises.smollm2_zero_shot                       # 100 problems a level
    python -m benchmarks.premises.smollm2_zero_shot --num-problems 4 --sampled-problems 0 --alt-problems 0 \\
        --output /tmp/z.md
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import tyro


ALTERNATIVES = {
    "end-with": ('{question}\nEnd with "The answer is N." where N is the number.', "nl"),
    "boxed": ("{question}\nPut your final answer within \\boxed{{}}.", "math"),
}
"""Alternative wordings tried: template, and the task whose format_reward is the expected format."""


@dataclass
class Bench:
    num_problems: int = 100
    """held-out problems per level for the final wording, greedy"""
    sampled_problems: int = 100
    """held-out problems per level for the final wording, sampled (the first of the greedy ones; 0: skip)"""
    alt_problems: int = 30
    """held-out problems per level for each alternative wording (greedy, default system prompt; 0: skip them)"""
    levels: tuple[int, ...] = (1, 2, 3, 4, 5)
    """testbed-nl levels"""
    max_new_tokens: int = 64
    """reply length cap"""
    batch_size: int = 100
    """prompts per generate call"""
    seed: int = 0
    """seed of the problems and of sampling"""
    output: str = "benchmarks/premises/smollm2_zero_shot.md"
    """where the table goes"""


def run(model, tok, problems, template, fmt_task, greedy, bench, seed):
    import torch

    from common.data import encode_prompts, render_prompt
    from common.rollout import HFEngine
    from common.verifiers import format_reward, score

    kwargs = {} if template is None else {"template": template}
    ids = encode_prompts(tok, [render_prompt(p, tok, **kwargs) for p in problems])
    torch.manual_seed(seed)
    engine, texts, cut = HFEngine(model, tok), [], []
    for s in range(0, len(ids), bench.batch_size):
        out = engine.generate(ids[s : s + bench.batch_size], n=1, max_new_tokens=bench.max_new_tokens, greedy=greedy)
        texts += out.texts
        cut += out.truncated_B.tolist()
    correct = score(texts, problems)
    rows = {}
    for level in bench.levels:
        idx = [i for i, p in enumerate(problems) if p.level == level]
        rows[level] = tuple(sum(v[i] for i in idx) / len(idx) for v in
                            (correct, [format_reward(texts[i], fmt_task) for i in range(len(texts))], cut))
    prompt_tokens = sum(map(len, ids)) / len(ids)
    return rows, prompt_tokens, texts


def main(bench: Bench) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from common.data import load_problems
    from common.models import load_model, load_tokenizer
    from common.testbed_nl import NL_INSTRUCTION
    from grounds import path_of

    model = load_model(path_of("smollm2-135m-instruct"))
    problems = load_problems("testbed-nl", "test", bench.levels, bench.num_problems, bench.seed)
    first = lambda k: [p for lv in bench.levels for p in [q for q in problems if q.level == lv][:k]]  # noqa: E731
    results, examples = [], {}
    runs = [("final", None, "nl", sp, True, problems) for sp in (None, "")]
    if bench.sampled_problems:
        runs += [("final", None, "nl", sp, False, first(bench.sampled_problems)) for sp in (None, "")]
    runs += [(name, t, f, None, True, first(bench.alt_problems)) for name, (t, f) in ALTERNATIVES.items()
             if bench.alt_problems]
    for name, template, fmt_task, system, greedy, probs in runs:
        t0 = time.time()
        rows, prompt_tokens, texts = run(model, load_tokenizer(path_of("smollm2-135m-instruct"), system), probs, template,
                                         fmt_task, greedy, bench, bench.seed)
        results.append((name, system, greedy, len(probs) // len(bench.levels), prompt_tokens, rows, time.time() - t0))
        if greedy:
            examples.setdefault(name, [next((p, t) for p, t in zip(probs, texts) if p.level == lv)
                                       for lv in (2, 4) if lv in bench.levels])
        print(f"{name} system={system!r} {'greedy' if greedy else 'sampled'}: "
              + " ".join(f"L{lv} {a:.2f}/{f:.2f}/{c:.2f}" for lv, (a, f, c) in rows.items())
              + f" ({time.time() - t0:.0f} s)", flush=True)

    wording = {"final": f"`{NL_INSTRUCTION}`"}
    for k, (t, _) in ALTERNATIVES.items():
        wording[k] = "`" + t.replace("{question}\n", "").replace("{{}}", "{}") + "`"
    lines = ["# SmolLM2-135M-Instruct zero-shot on testbed-nl", "",
             f"Command: `python -m benchmarks.premises.smollm2_zero_shot --num-problems {bench.num_problems} "
             f"--sampled-problems {bench.sampled_problems} --alt-problems {bench.alt_problems}`. Held-out problems, "
             f"{bench.max_new_tokens} new tokens at most, fp32 on the CPU. "
             "Each cell: accuracy / share in the expected format / share cut at the token cap. "
             "Accuracy uses the 'nl' answer rule (the last \\boxed{}, else the number after the last \"answer is\", "
             "else the last number); the expected format is a reply ending \"The answer is N.\" (format_reward "
             "'nl'), for the boxed wording a \\boxed{} (format_reward 'math'). Sampled: temperature 1, top_p 1, "
             "one sample a problem. System prompt None: the chat template's default (\"You are a helpful AI "
             "assistant named SmolLM, trained by Hugging Face\"); \"\": an empty system turn.", "",
             "Wordings (after the question, on the next line): "
             + "; ".join(f"{k} {v}" for k, v in wording.items()) + ".", "",
             "| wording | system prompt | decoding | problems/level | prompt tokens | "
             + " | ".join(f"level {lv}" for lv in bench.levels) + " | seconds |",
             "|---|---|---|---|---|" + "---|" * len(bench.levels) + "---|"]
    for name, system, greedy, n, prompt_tokens, rows, secs in results:
        lines.append(f"| {name} | {'default' if system is None else 'empty'} | {'greedy' if greedy else 'sampled'} | "
                     f"{n} | {prompt_tokens:.0f} | "
                     + " | ".join(f"{a:.2f} / {f:.2f} / {c:.2f}" for a, f, c in rows.values()) + f" | {secs:.0f} |")
    lines += ["", "Example replies (greedy, levels 2 and 4):", ""]
    for name, pairs in examples.items():
        for p, text in pairs[:2]:
            lines.append(f"- {name}, level {p.level}, answer {p.answer}: `{' '.join(text.split())[:240]}`")
    with open(bench.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {bench.output}")


if __name__ == "__main__":
    main(tyro.cli(Bench))
