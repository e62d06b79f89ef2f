"""What a run writes and shows: its folder, its metrics (console, JSONL, wandb; the shared ones computed here, so that
every trainer logs them under the same names), samples, the progress bar and the learning curve (checkpoints:
common/checkpoint.py).

    runs/<run_name>/
        args.json          the resolved arguments
        metrics.jsonl      one JSON object per step (the final evaluation joins the last step's row)
        samples.jsonl      a few rollouts and greedy held-out answers as text, at evaluation steps and the last step
        curve.png          reward and eval accuracy against step (and a trainer's `extra` metrics), written at the end
        checkpoint/        latest checkpoint (model, tokenizer, optimizer, RNG, data position)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from common.args import fail
from common.dist import all_reduce_sum

CONSOLE_KEYS = ("reward/mean", "train/accuracy", "adv/frac_zero_std", "loss/policy", "policy/entropy",
                "rollout/completion_len", "rollout/truncated_frac", "perf/step_time", "eval/greedy_accuracy")
SAMPLES = "samples/"
"""metrics whose key starts with this hold lists of sample dicts (`sample_rows`): they go to samples.jsonl, not to
metrics.jsonl ('samples/train': the step's rollouts, 'samples/eval': greedy held-out answers)"""
PROMPT_TAIL_CHARS = 1000
"""how much of the end of a prompt a sample keeps: a GSM8K prompt whole, with its chat template and system turn"""


def run_folder(args, rank: int) -> str:
    """The run folder: the --resume folder, or output_dir/{run_name or exp_name__seed__unix time}, with rank 0's time
    under torchrun (one folder for all ranks). Created by RunLogger."""
    stamp = [int(time.time())]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return getattr(args, "resume", "").rstrip("/") or os.path.join(
        args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}__{stamp[0]}")


class RunLogger:
    """Writes every metric to metrics.jsonl (one row per step), a compact line to the console, and wandb with `track`.
    `extra`: prefixes of a trainer's own metrics also on the console (`prob=0.2/0.5/0.3`) and in curve.png, below."""

    def __init__(self, args, run_dir: str, enabled: bool = True, extra: tuple[str, ...] = ()):
        self.run_dir, self.enabled, self.extra, self.stuck = run_dir, enabled, extra, []
        self.max_new_tokens, self.cut_warned = getattr(args, "max_new_tokens", None), False
        self.wandb = self.samples_file = self.last = None  # last: the last row of metrics.jsonl (resumed: checkpoint's)
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
        self.last = read_metrics(self.file.name)[-1] if getattr(args, "resume", "") and self.file.tell() else None
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity,
                                    name=os.path.basename(run_dir), config=dataclasses.asdict(args), dir=run_dir,
                                    resume="allow", id=os.path.basename(run_dir).replace("/", "_"))

    def log(self, step: int, metrics: dict, bar=None) -> None:
        """The step's row of metrics.jsonl (a second log at a step, the final evaluation, joins it) and a console line;
        the sample lists among `metrics` (keys 'samples/...') go to samples.jsonl, the console and a wandb Table."""
        if not self.enabled:
            return
        samples = {k: v for k, v in metrics.items() if k.startswith(SAMPLES)}
        new = {k: _plain(v) for k, v in metrics.items() if k not in samples}
        row = {"step": step, "time": time.time(), **new}
        if self.last and self.last["step"] == step:  # one row per step: the step's last line is rewritten with these
            self.file.truncate(self.file.seek(0, os.SEEK_END) - len(json.dumps(self.last)) - 1)
            row = {**self.last, **row}
        self.last = row
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        shown = [(k.split("/")[-1], [new[k]]) for k in CONSOLE_KEYS if k in new]
        for p in self.extra:  # a group of keys (rloo_sec's sec/prob/arm_<name>) is labelled by its members' names
            keys = [k for k in new if k.startswith(p)]
            names = "/".join(k[len(p):].removeprefix("arm_") for k in keys)
            shown.append((p.strip("/").split("/")[-1] + (f"[{names}]" if names else ""), [new[k] for k in keys]))
        line = f"step {step:>4} " + " ".join(name + "=" + "/".join(f"{v:.3g}" for v in vs) for name, vs in shown
                                             if vs and all(isinstance(v, (int, float)) for v in vs))
        write = bar.write if bar is not None else print
        write(line)
        cut = new.get("eval/truncated_frac")
        if cut is not None and cut >= 0.5 and not self.cut_warned:  # at the first evaluation, before any training
            self.cut_warned = True
            write(f"warning: {100 * cut:.0f} % of the held-out greedy answers reached --max-new-tokens "
                  f"{self.max_new_tokens} and were cut (a cut answer scores 0, and training rollouts will be cut "
                  "alike): raise --max-new-tokens")
        for key, rows in samples.items():
            self.log_samples(step, key[len(SAMPLES):], rows, write)

    def warn_if_stuck(self, step: int, m: dict, max_new_tokens: int, patience: int = 3) -> None:
        """One console line when `patience` steps in a row had no learning signal (adv/mean_abs 0 in the metrics `m`:
        every advantage on every rank 0), saying why from the step's metrics; a step with signal resets the count."""
        self.stuck = self.stuck + [step] if m.get("adv/mean_abs") == 0 else []
        if len(self.stuck) == patience and self.enabled:
            acc, cut = m.get("train/accuracy"), m.get("rollout/truncated_frac", 0.0)
            why = ["every group's rewards were equal"] if m.get("adv/frac_zero_std") == 1 else []
            why += ["none correct"] if acc == 0 else ["all correct: the problems are too easy"] if acc == 1 else []
            why += ([f"{100 * cut:.0f} % of completions were cut at --max-new-tokens {max_new_tokens}: raise it"]
                    if cut >= 0.5 else ["too hard, or answers in a wrong format? (samples.jsonl)"] if acc == 0 else [])
            tqdm.write("; ".join([f"warning: steps {self.stuck[0]}-{step} had no learning signal (every advantage 0"
                                  + ("; updates skipped)" if m.get("update/skipped") else ")"), *why]))

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
            data = [[step, *(json.dumps(r[c]) if isinstance(r.get(c), (list, dict)) else r.get(c) for c in columns)]
                    for r in rows]
            self.wandb.log({f"{SAMPLES}{kind}": wandb.Table(columns=["step", *columns], data=data)}, step=step)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.samples_file is not None:
            self.samples_file.close()
        if plot:
            plot_curve(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.run_dir, "curve.png"), self.extra)
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    """A JSON value: tensors and numpy scalars as Python numbers or lists; NaN and +-inf as null (JSON has none)."""
    v = (v.item() if v.numel() == 1 else v.tolist()) if isinstance(v, torch.Tensor) else v
    v = v.item() if isinstance(v, (np.floating, np.integer, np.bool_)) else v
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def bars_off(rank: int = 0) -> bool:
    """tqdm's `disable` for every progress bar: on rank 0 only, and only when stderr is a terminal, where a bar redraws
    itself in place; written to a file its redraws would run into the step lines, which say the same. The environment
    variable TINYPOST_PROGRESS=1 shows the bars anyway, 0 never."""
    wanted = os.environ.get("TINYPOST_PROGRESS", "auto")
    return rank != 0 or wanted == "0" or (wanted != "1" and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()))


def step_bar(args, start_step: int, rank: int):
    """The progress bar over steps start_step + 1 .. total_steps (rank 0 only): tqdm over that range."""
    return tqdm(range(start_step + 1, args.total_steps + 1), desc=args.exp_name, disable=bars_off(rank),
                initial=start_step, total=args.total_steps)


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name] (logged as time/<name>)."""
    t0 = time.time()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.time() - t0


def update_metrics(sums: dict, grad_norms: list[float], lr: float, n_updates: int, n_tok: float) -> dict:
    """The update's statistics, for the union batch of all ranks: the loss/* sums (each rank's share of the loss, its
    normalisers being global) summed over ranks as means over its n_updates optimizer steps, the other sums (per-token
    statistics) summed over ranks and divided by all ranks' n_tok tokens (as they are on one process), optim/grad_norm
    (mean over steps), optim/lr, update/skipped (1: no update, and loss/*, clip_frac, approx_kl the 0 it would log)."""
    keys = sorted(sums)
    total = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(n_tok)], dtype=torch.float64))
    n_tok = total[-1].item()
    skipped = dict.fromkeys(("loss/policy", "loss/kl", "policy/clip_frac", "policy/approx_kl"), 0.0)  # A = 0, ratio 1
    return {**({} if grad_norms else skipped), **{k: total[i].item() / (n_updates if k.startswith("loss/") else
                                                                        max(n_tok, 1.0)) for i, k in enumerate(keys)},
            "optim/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0, "optim/lr": lr,
            "update/skipped": float(not grad_norms)}


def peak_mem_gb(device: str) -> float:
    return (torch.cuda.max_memory_allocated() if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30


def rollout_perf_metrics(rollouts, times: dict, train_passes: int, device: str, gen_tokens: float | None = None,
                         train_rollouts=None) -> dict:
    """Completion length and truncation of the sampled `rollouts`, time/<phase> for each timed phase, generation
    throughput (gen_tokens: default, the rollouts' completion tokens), training throughput (train_passes passes, e.g.
    PPO epochs, over train_rollouts, default the rollouts), and peak memory."""
    gen_tokens = rollouts.lengths_B.sum().item() if gen_tokens is None else gen_tokens
    train_rollouts = rollouts if train_rollouts is None else train_rollouts
    return {"rollout/completion_len": rollouts.lengths_B.float().mean().item(),
            "rollout/truncated_frac": rollouts.truncated_B.float().mean().item(),
            **{f"time/{k}": v for k, v in times.items()},
            "perf/gen_tokens_per_s": gen_tokens / max(times.get("generate", 0.0), 1e-9),
            "perf/train_tokens_per_s": train_passes * train_rollouts.attention_mask_BT.sum().item()
            / max(times.get("update", 0.0), 1e-9),
            "perf/peak_mem_gb": peak_mem_gb(device)}


def sample_step(args, step: int) -> bool:
    """Whether the rollouts of `step` are written as samples (samples.jsonl): with --log-samples > 0, at evaluation
    steps (--eval-every), the last step, and every --log-samples-every steps."""
    every, extra = getattr(args, "eval_every", 0), args.log_samples_every
    return args.log_samples > 0 and (step == args.total_steps or bool(every and step % every == 0)
                                     or bool(extra and step % extra == 0))


def without_samples(metrics: dict) -> dict:
    """The metrics without their sample lists (SAMPLES), as kept in checkpoints and returned by main."""
    return {k: v for k, v in metrics.items() if not k.startswith(SAMPLES)}


def sample_rows(tokenizer, rollouts, problems: list, k: int, group_size: int = 1, **fields) -> list[dict]:
    """Up to `k` rows of `rollouts` as text for samples.jsonl, the first row of each of the first k groups of
    `group_size` rows: its problem's question (whole), the end of its prompt and its completion as decoded with the
    special tokens shown (so a missing or doubled eos is visible), `truncated` (no stop token within
    --max-new-tokens: the text is cut), the gold answer and level of its problem (`problems` per row), and for each
    keyword its value at that row (a per-row tensor or list: the reward and its parts, the advantage, a trainer's own
    fields). Costs no generation: the rows are the step's (or the evaluation's) own.

    >>> from common.rollout import attach
    >>> from common.problem import Problem
    >>> from grounds.testbed_models import build_tokenizer
    >>> tok = build_tokenizer()
    >>> r = attach([tok("Q:1+2\\nA:")["input_ids"]] * 2, [(tok("3")["input_ids"] + [tok.eos_token_id], "3", False),
    ...            (tok("4")["input_ids"], "4", True)], tok.pad_token_id)
    >>> rows = sample_rows(tok, r, [Problem("1+2", "3")] * 2, k=4, group_size=1, reward=torch.tensor([1.0, 0.0]))
    >>> [(x["completion"], x["truncated"], x["gold"], x["reward"]) for x in rows]
    [('3<|im_end|>', False, '3', 1.0), ('4', True, '3', 0.0)]
    """
    out = []
    for b, problem in list(enumerate(problems))[::group_size][:k]:  # the first row of each of the first k groups
        L = rollouts.prompt_len
        prompt_L = rollouts.input_ids_BT[b, :L][rollouts.attention_mask_BT[b, :L] > 0]
        completion = rollouts.completion_ids_BC[b, : int(rollouts.lengths_B[b])]
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


def plot_curve(metrics_path: str, out_path: str, extra: tuple[str, ...] = ()) -> None:
    """Reward (train) and greedy accuracy (held-out) against step; below them, with `extra` (metric key prefixes),
    every metric under those prefixes. The PNG's Description names the curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2 if extra else 1, 1, figsize=(6, 6 if extra else 3.5), sharex=True, squeeze=False)
    curves = [(0, k, s) for k, s in (("reward/mean", "-"), ("eval/greedy_accuracy", "o-"), ("eval/pass_at_k", "s--"))]
    curves += [(1, k, "-") for k in dict.fromkeys(k for r in rows for k in r if extra and k.startswith(extra))]
    k = next((r["eval/pass_k"] for r in rows if "eval/pass_k" in r), None)
    for panel, key, style in curves:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            label = f"{key} (k = {k})" if key == "eval/pass_at_k" and k else key
            axes[panel, 0].plot(*zip(*pts), style, label=label, markersize=3)
    axes[0, 0].set_ylim(min(axes[0, 0].get_ylim()[0], -0.02), max(axes[0, 0].get_ylim()[1], 1.02))  # 0 to 1 at least
    run = os.path.dirname(os.path.abspath(metrics_path))
    axes[0, 0].set_title(os.path.basename(run) + ": reward on training rollouts, accuracy on held-out problems",
                         fontsize=9)
    axes[0, 0].set_ylabel("reward / accuracy")
    if extra:
        axes[1, 0].set_ylabel(", ".join(p.strip("/") for p in extra), fontsize=8)
    axes[-1, 0].set_xlabel("step")
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    drawn = [line.get_label() for ax in axes[:, 0] for line in ax.lines]
    fig.savefig(out_path, dpi=100, metadata={"Title": axes[0, 0].get_title(),
                                             "Description": "curves: " + ", ".join(drawn)})
    plt.close(fig)
