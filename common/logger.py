"""Run folder, metrics (console, JSONL, wandb), learning curve, checkpoints and resume.

    runs/<run_name>/
        args.json          the resolved arguments
        metrics.jsonl      one JSON object per logged step (and per eval)
        curve.png          reward and eval accuracy against step, written at the end
        checkpoint/        latest checkpoint (model, tokenizer, optimizer, RNG, data position)
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time

import numpy as np
import torch

CONSOLE_KEYS = ("reward/mean", "train/accuracy", "adv/frac_zero_std", "loss/policy", "policy/entropy",
                "rollout/completion_len", "perf/step_time", "eval/greedy_accuracy")


class RunLogger:
    """Writes every metric to metrics.jsonl, a compact line to the console, and wandb with `track`."""

    def __init__(self, args, run_dir: str, enabled: bool = True):
        self.run_dir, self.enabled, self.wandb = run_dir, enabled, None
        if not enabled:  # non-zero ranks under torchrun
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=2)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=os.path.basename(run_dir),
                                    config=dataclasses.asdict(args), dir=run_dir, resume="allow",
                                    id=os.path.basename(run_dir).replace("/", "_"))

    def log(self, step: int, metrics: dict, bar=None) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        line = f"step {step:>4} " + " ".join(
            f"{k.split('/')[-1]}={row[k]:.3g}" for k in CONSOLE_KEYS if isinstance(row.get(k), (int, float)))
        (bar.write if bar is not None else print)(line)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        self.file.close()
        if plot:
            plot_curve(os.path.join(self.run_dir, "metrics.jsonl"), os.path.join(self.run_dir, "curve.png"))
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    return v


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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


# ----------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, extra: dict | None = None) -> str:
    """Write run_dir/checkpoint atomically: a crash mid-write leaves the previous one intact."""
    final = os.path.join(run_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), **(extra or {})},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(run_dir: str) -> str | None:
    """The checkpoint folder of a run, or the previous one if a save was interrupted mid-swap."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(run_dir, name)
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            return path
    return None


def load_trainer_state(path: str) -> dict:
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Drop metric rows logged after the checkpoint we resume from (they will be logged again)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        rows = [r for r in read_metrics(path) if r["step"] <= last_step]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
