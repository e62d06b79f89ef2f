"""Run folder, metrics (console, JSONL, wandb), samples and the learning curve (checkpoints: common/checkpoint.py).

    runs/<run_name>/
        args.json          the resolved arguments
        metrics.jsonl      one JSON object per logged step (and per eval)
        samples.jsonl      a few rollouts and greedy held-out answers as text, at evaluation steps and the last step
        curve.png          reward and eval accuracy against step, written at the end
        checkpoint/        latest checkpoint (model, tokenizer, optimizer, RNG, data position)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import numpy as np
import torch

from common.args import fail

CONSOLE_KEYS = ("reward/mean", "train/accuracy", "adv/frac_zero_std", "loss/policy", "policy/entropy",
                "rollout/completion_len", "perf/step_time", "eval/greedy_accuracy")
SAMPLES = "samples/"
"""metrics whose key starts with this hold lists of sample dicts (`sample_rows`): they go to samples.jsonl, not to
metrics.jsonl ('samples/train': the step's rollouts, 'samples/eval': greedy held-out answers)"""
PROMPT_TAIL_CHARS = 200
"""how much of the end of a prompt a sample keeps (the question is at the end; chat headers and hints before it)"""


class RunLogger:
    """Writes every metric to metrics.jsonl, a compact line to the console, and wandb with `track`."""

    def __init__(self, args, run_dir: str, enabled: bool = True):
        self.run_dir, self.enabled, self.wandb, self.samples_file = run_dir, enabled, None, None
        if not enabled:  # non-zero ranks under torchrun
            return
        os.makedirs(run_dir, exist_ok=True)
        path, now = os.path.join(run_dir, "args.json"), json.loads(json.dumps(dataclasses.asdict(args)))
        if getattr(args, "resume", "") and os.path.exists(path):  # a resumed run keeps its original args.json
            try:
                with open(path) as f:
                    saved = dict(json.load(f))
            except (ValueError, TypeError):
                saved = {}
            changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if k != "resume" and saved.get(k) != v]
            if changed:
                print("note: resuming with flags that differ from args.json: " + ", ".join(changed))
        else:
            with open(path, "w") as f:
                json.dump(now, f, indent=2)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=os.path.basename(run_dir),
                                    config=dataclasses.asdict(args), dir=run_dir, resume="allow",
                                    id=os.path.basename(run_dir).replace("/", "_"))

    def log(self, step: int, metrics: dict, bar=None) -> None:
        """One row of metrics.jsonl and a console line; the sample lists among `metrics` (keys 'samples/...') go to
        samples.jsonl, one row per sample, to the console (one compact line each) and to wandb as a Table."""
        if not self.enabled:
            return
        samples = {k: v for k, v in metrics.items() if k.startswith(SAMPLES)}
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items() if k not in samples}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        line = f"step {step:>4} " + " ".join(
            f"{k.split('/')[-1]}={row[k]:.3g}" for k in CONSOLE_KEYS if isinstance(row.get(k), (int, float)))
        write = bar.write if bar is not None else print
        write(line)
        for key, rows in samples.items():
            self.log_samples(step, key[len(SAMPLES):], rows, write)

    def log_samples(self, step: int, kind: str, rows: list[dict], write=print) -> None:
        if not rows:
            return
        if self.samples_file is None:
            self.samples_file = open(os.path.join(self.run_dir, "samples.jsonl"), "a")
        rows = [{k: _plain(v) for k, v in r.items()} for r in rows]
        for i, r in enumerate(rows):
            self.samples_file.write(json.dumps({"step": step, "kind": kind, "index": i, **r}) + "\n")
            write(console_sample(step, kind, i, r))
        self.samples_file.flush()
        if self.wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for r in rows for k in r))
            data = [[r.get(c) if not isinstance(r.get(c), (list, dict)) else json.dumps(r.get(c)) for c in columns]
                    for r in rows]
            table = wandb.Table(columns=["step", *columns], data=[[step, *d] for d in data])
            self.wandb.log({f"{SAMPLES}{kind}": table}, step=step)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.samples_file is not None:
            self.samples_file.close()
        if plot:
            plot_curve(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.run_dir, "curve.png"))
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    """A JSON value: tensors and numpy scalars as Python numbers or lists; NaN and +-inf as null (JSON has none)."""
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.floating, np.integer, np.bool_)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def sample_rows(tokenizer, rollouts, problems: list, k: int, group_size: int = 1, **fields) -> list[dict]:
    """Up to `k` rows of `rollouts` as text for samples.jsonl, the first row of each of the first k groups of
    `group_size` rows: its problem's question (whole), the end of its prompt and its completion as decoded with the
    special tokens shown (so a missing or doubled eos is visible), `truncated` (no stop token within --max-new-tokens: the text is cut), the gold answer
    and level of its problem (`problems` per row), and for each keyword its value at that row (a per-row tensor or
    list: the reward and its parts, the advantage, a trainer's own fields). Costs no generation: the rows are the
    step's (or the evaluation's) own.

    >>> from common.rollout import attach
    >>> from common.testbed import Problem
    >>> from grounds.testbed_models import build_tokenizer
    >>> tok = build_tokenizer()
    >>> r = attach([tok("Q:1+2\\nA:")["input_ids"]] * 2, [(tok("3")["input_ids"] + [tok.eos_token_id], "3", False),
    ...            (tok("4")["input_ids"], "4", True)], tok.pad_token_id)
    >>> rows = sample_rows(tok, r, [Problem("1+2", "3")] * 2, k=4, group_size=1, reward=torch.tensor([1.0, 0.0]))
    >>> [(x["completion"], x["truncated"], x["gold"], x["reward"]) for x in rows]
    [('3<|im_end|>', False, '3', 1.0), ('4', True, '3', 0.0)]
    """
    out = []
    for b in range(0, len(problems), group_size)[:k]:
        L = rollouts.prompt_len
        prompt_L = rollouts.input_ids_BT[b, :L][rollouts.attention_mask_BT[b, :L] > 0]
        completion = rollouts.completion_ids_BC[b, : int(rollouts.lengths_B[b])]
        problem = problems[b]
        out.append({"question": getattr(problem, "question", None),
                    "prompt_tail": tokenizer.decode(prompt_L, skip_special_tokens=False)[-PROMPT_TAIL_CHARS:],
                    "completion": tokenizer.decode(completion, skip_special_tokens=False),
                    "truncated": bool(rollouts.truncated_B[b]), "gold": getattr(problem, "answer", None),
                    "level": getattr(problem, "level", None),
                    **{name: _plain(v[b]) if v is not None else None for name, v in fields.items()}})
    return out


def console_sample(step: int, kind: str, index: int, row: dict, width: int = 100) -> str:
    """One compact console line of a sample: its scalar fields, the question (or, where a sample has none, the end of
    the prompt) and the completion, newlines shown as '\\n', cut to `width` characters each ('[cut]' marks a
    completion cut at --max-new-tokens). The question, not the prompt's end: with a chat template the end of every
    prompt is the same instruction and assistant header.

    >>> console_sample(3, "train", 0, {"question": "1+2", "prompt_tail": "Q:1+2\\nA:", "completion": "3",
    ...                                "truncated": False, "gold": "3", "reward": 1.0, "level": 1})
    "  sample step 3 train #0: gold=3 reward=1 | '1+2' -> '3'"
    """
    def short(text: str, keep_end: bool = False) -> str:
        text = repr(text)[1:-1]
        return ("..." + text[-width:] if keep_end else text[:width] + "...") if len(text) > width else text

    fields = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                      if k not in ("question", "prompt_tail", "completion", "truncated", "level") and v is not None
                      and not isinstance(v, (list, dict)))
    cut = " [cut]" if row.get("truncated") else ""
    shown = short(row["question"]) if row.get("question") else short(row.get("prompt_tail", ""), keep_end=True)
    return f"  sample step {step} {kind} #{index}: {fields} | '{shown}' -> '{short(row.get('completion', ''))}'{cut}"


def read_metrics(path: str, where: str = "") -> list[dict]:
    """Rows of a metrics.jsonl. A last line cut short by a crash (no newline) is skipped; any other bad line is a
    one-line error."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = "bad"
        if row is None or (row == "bad" and i == len(lines)):
            continue
        if not (isinstance(row, dict) and "step" in row):
            fail(f"{where + ': ' if where else ''}{path} line {i} is not a metrics row")
        rows.append(row)
    return rows


def plot_curve(metrics_path: str, out_path: str) -> None:
    """Reward (train) and greedy accuracy (held-out) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style in (("reward/mean", "-"), ("eval/greedy_accuracy", "o-"), ("eval/pass_at_k", "s--")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=key, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
