"""What a user sees when a run is stopped or cannot learn (issue 43): Ctrl-C prints one line, not a traceback, and
(in a trainer with checkpoints) saves the step it stops after and prints the command that continues the run exactly;
with --skip-zero-advantage-steps a step whose advantages are all 0 with no other loss term skips its update
(update/skipped; by default AdamW steps on the zero gradient: tests/test_fidelity.py), and three steps in a row
without signal print one warning saying why."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
import tyro

import grpo
from common.logger import read_metrics
from common.models import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-prompts", "2", "--group-size", "4", "--max-new-tokens", "8", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0", "--log-samples", "0"]


def _rows(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r}


def _ctrl_c_after_first_step(cmd: list[str], run_dir: str) -> tuple[int, str]:
    """Run `cmd`, press Ctrl-C (SIGINT) once its metrics.jsonl holds a training step, and return its exit status and
    its stdout and stderr together."""
    # SIGINT as a terminal has it: a shell runs a background job (CI's, say) with SIGINT ignored, which the child
    # would inherit and, rightly, keep
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    path, deadline = os.path.join(run_dir, "metrics.jsonl"), time.time() + 300
    while child.poll() is None and time.time() < deadline:
        if os.path.exists(path) and any('"reward/mean"' in line for line in open(path)):
            child.send_signal(signal.SIGINT)
            break
        time.sleep(0.01)
    out, _ = child.communicate(timeout=300)
    return child.returncode, out


def test_ctrl_c_saves_the_step_and_its_resume_command_continues_as_if_never_stopped(tmp_path, weak_model_dir):
    flags = [*TINY, "--total-steps", "4", "--output-dir", str(tmp_path), "--run-name", "stopped"]
    run_dir = str(tmp_path / "stopped")
    code, out = _ctrl_c_after_first_step([sys.executable, "grpo.py", *flags], run_dir)
    assert code == 130 and "Traceback" not in out, out[-3000:]
    stopping = [line for line in out.splitlines() if line.startswith("stopping after step")]
    assert len(stopping) == 1 and stopping[0].endswith("and saving a checkpoint; Ctrl-C again to quit at once"), out
    stopped = [line for line in out.splitlines() if line.startswith("stopped after step")]
    assert len(stopped) == 1, out[-3000:]
    head, command = stopped[0].split("; continue with: ")
    step = int(head.split()[3])
    assert head == f"stopped after step {step} (checkpoint saved)" and 1 <= step < 4
    assert out.rstrip().endswith(command), out[-500:]  # the last thing printed
    # the checkpoint of the step it stopped after, and that step's metrics, nothing later
    assert torch.load(os.path.join(run_dir, "checkpoint", "trainer_state.pt"), weights_only=False)["step"] == step
    assert sorted(_rows(run_dir)) == list(range(1, step + 1))
    # the printed command: this interpreter, the same script and flags, and --resume <run folder>
    argv = shlex.split(command)
    assert os.path.realpath(os.path.join(ROOT, argv[0])) == os.path.realpath(sys.executable)
    assert argv[1:] == ["grpo.py", *flags, "--resume", run_dir]
    resumed = grpo.main(tyro.cli(grpo.Args, args=argv[2:]))
    straight = grpo.main(tyro.cli(grpo.Args, args=[*flags[:-1], "straight"]))
    got, ref = _rows(run_dir), _rows(straight["run_dir"])
    assert sorted(got) == list(range(1, 5))
    for s in range(step + 1, 5):
        assert [got[s][k] for k in ("reward/mean", "update/skipped")] == [ref[s][k] for k in ("reward/mean",
                                                                                             "update/skipped")], s
        assert got[s]["loss/policy"] == pytest.approx(ref[s]["loss/policy"], abs=1e-6), s
        assert got[s]["optim/grad_norm"] == pytest.approx(ref[s]["optim/grad_norm"], rel=1e-5), s
    assert resumed["after"] == straight["after"]


def test_ctrl_c_in_a_trainer_without_checkpoints_is_one_line(tmp_path, tiny_model_dir):
    """mada_rl.py writes no checkpoints: Ctrl-C in its training stops it at once, with one line saying so."""
    cmd = [sys.executable, "mada_rl.py", "--model-name", tiny_model_dir, "--num-generators", "1", "--num-critics", "0",
           "--debate-rounds", "1", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
           "--num-eval-problems", "2", "--num-train-problems", "8", "--generator-steps", "200", "--lora-r", "2",
           "--output-dir", str(tmp_path), "--run-name", "mada"]
    code, out = _ctrl_c_after_first_step(cmd, str(tmp_path / "mada"))
    assert code == 130 and "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("interrupted")]
    assert lines == ["interrupted: mada_rl.py writes no checkpoints (its stages are short): nothing is kept; rerun the "
                     "script"], out[-3000:]


SECOND_CTRL_C = """
import os, signal, sys, time, torch
from common.checkpoint import catch_ctrl_c
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal has it, even under a background pytest
ctrl_c = catch_ctrl_c(sys.argv[1], 0, "grpo.py")
ctrl_c.step = 3
os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: stop after the step
time.sleep(0.5)
torch.set_num_threads(1)
a = torch.randn(4000, 4000) / 70
print("long call", flush=True)
torch.linalg.matrix_power(a, 2 ** 62)  # one torch call of 62 products of 4000 x 4000: minutes on one thread
print("returned", flush=True)
"""


def test_a_second_ctrl_c_quits_at_once_even_inside_a_long_torch_call(tmp_path):
    """The second Ctrl-C while the main thread is inside one long torch call (a forward, a generation): before, Python
    ran the handler only when the call returned (about 10 s into a SmolLM2 step, issue 58); now a thread woken by the
    interpreter's wakeup fd quits at once with the usual line and status 130."""
    proc = subprocess.Popen([sys.executable, "-c", SECOND_CTRL_C, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline() == "long call\n"
    time.sleep(1.0)  # inside matrix_power
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    waited = time.time() - sent
    assert proc.returncode == 130 and "returned" not in out, (out, err)
    assert "stopping after step 3 finishes" in err and "interrupted at step 3: no checkpoint was written yet" in err
    assert waited < 20, waited  # the call itself runs for a minute or more


AFTER_THE_RUN = """
import gc, os, signal, sys, time
from common.checkpoint import catch_ctrl_c
signal.signal(signal.SIGINT, signal.default_int_handler)
ctrl_c = catch_ctrl_c(sys.argv[1], 0, "grpo.py")
ctrl_c.step = 1
os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C in the loop: the watcher of a second one starts
time.sleep(0.2)
del ctrl_c  # main() has returned: a SIGINT is no longer this run's
gc.collect()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)
except KeyboardInterrupt:
    pass
time.sleep(0.5)  # the watcher thread has read the signal by now
print("still here")
"""


def test_the_watcher_of_a_second_ctrl_c_leaves_a_signal_after_the_loop_alone(tmp_path):
    """A main() called from Python that was stopped by Ctrl-C returns to its caller: a later SIGINT of that process is
    not a second Ctrl-C of the finished run (before, the watcher thread quit the whole process with status 130: it
    killed the test suite)."""
    r = subprocess.run([sys.executable, "-c", AFTER_THE_RUN, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == "still here\n", (r.returncode, r.stdout, r.stderr[-2000:])


class Count:
    """Calls to `fn`, passed through to it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C as a terminal session has it (KeyboardInterrupt), even where pytest runs as a background job with SIGINT
    ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_steps_without_learning_signal_skip_their_update_and_warn_once(tmp_path, tiny_model_dir, capsys,
                                                                         monkeypatch, python_ctrl_c):
    """--max-new-tokens 1: every completion is cut or empty, so every reward is 0 and every advantage 0. With beta 0
    and --skip-zero-advantage-steps no step runs a log-prob pass, a forward or an optimizer step: the weights, AdamW's state and the schedule stay as
    they were; three such steps in a row print one warning. With beta > 0 the KL term has a gradient: no skip."""
    logprobs, losses = Count(grpo.rollout.batched_logprobs), Count(grpo.micro_batch_loss)
    monkeypatch.setattr(grpo.rollout, "batched_logprobs", logprobs)
    monkeypatch.setattr(grpo, "micro_batch_loss", losses)
    flags = [*TINY, "--model-name", tiny_model_dir, "--max-new-tokens", "1", "--total-steps", "4", "--num-iterations",
             "2", "--warmup-steps", "4", "--learning-rate", "1e-3", "--output-dir", str(tmp_path),
             "--skip-zero-advantage-steps"]
    out = grpo.main(tyro.cli(grpo.Args, args=[*flags, "--run-name", "flat"]))
    console = capsys.readouterr().out
    rows = _rows(out["run_dir"])
    assert [rows[s]["update/skipped"] for s in (1, 2, 3, 4)] == [1.0] * 4
    assert all(rows[s]["reward/mean"] == 0 and rows[s]["adv/frac_zero_std"] == 1 for s in rows)
    assert all(rows[s]["optim/grad_norm"] == 0 and rows[s]["optim/lr"] == 1e-3 / 4 for s in rows)  # warm-up stays
    assert all(rows[s]["loss/policy"] == 0 and "policy/entropy" not in rows[s] for s in rows)  # no forward
    assert logprobs.calls == 0 and losses.calls == 0  # no old log-probs (2 epochs), no forward/backward
    ckpt = os.path.join(out["run_dir"], "checkpoint")
    start, end = load_model(tiny_model_dir).state_dict(), load_model(ckpt).state_dict()
    assert all(torch.equal(start[k], end[k]) for k in start)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert state["optimizer"]["state"] == {} and state["scheduler"]["last_epoch"] == 0  # AdamW never stepped
    warnings = [line for line in console.splitlines() if line.startswith("warning: steps")]  # (and the step-0 cut
    cut = rows[3]["rollout/truncated_frac"]  # warning: tests/test_logger.py)
    assert warnings == ["warning: steps 1-3 had no learning signal (every advantage 0; updates skipped); every group's "
                        "rewards were equal; none correct; " + (
                            f"{100 * cut:.0f} % of completions were cut at --max-new-tokens 1: raise it" if cut >= 0.5
                            else "too hard, or answers in a wrong format? (samples.jsonl)")], console
    lines = console.splitlines()
    assert lines.index(warnings[0]) == next(i for i, ln in enumerate(lines) if ln.startswith("step    3")) + 1
    # main() has returned: Ctrl-C is Python's KeyboardInterrupt again
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)

    kl = grpo.main(tyro.cli(grpo.Args, args=[*flags, "--beta", "0.1", "--run-name", "kl"]))
    rows = _rows(kl["run_dir"])
    assert [rows[s]["update/skipped"] for s in (1, 2, 3, 4)] == [0.0] * 4
    assert [rows[s]["optim/lr"] for s in (1, 2, 3, 4)] == pytest.approx([0.5e-3, 1e-3, 1e-3, 1e-3])  # 2 steps each
    state = torch.load(os.path.join(kl["run_dir"], "checkpoint", "trainer_state.pt"), weights_only=False)
    assert state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == 8


@pytest.mark.parametrize("trainer", ["rloo_sec", "oc_grpo", "adakp", "mada_rl"])
def test_the_other_group_trainers_skip_a_step_without_signal_too(tmp_path, tiny_model_dir, capsys, trainer):
    import importlib

    module = importlib.import_module(trainer)
    flags = ["--model-name", tiny_model_dir, "--num-prompts", "2", "--group-size", "4", "--max-new-tokens", "1",
             "--num-eval-problems", "4", "--eval-every", "0", "--log-samples", "0", "--output-dir", str(tmp_path)]
    flags += (["--num-generators", "1", "--num-critics", "0", "--debate-rounds", "1", "--generator-steps", "3",
               "--num-train-problems", "8", "--lora-r", "2"] if trainer == "mada_rl"
              else ["--eval-samples", "0", "--total-steps", "3"])
    out = module.main(tyro.cli(module.Args, args=[*flags, "--skip-zero-advantage-steps"]))
    rows = _rows(out["run_dir"])
    assert sorted(rows) == [1, 2, 3]
    assert all(r["update/skipped"] == 1 and r["optim/grad_norm"] == 0 and r["loss/policy"] == 0 for r in rows.values())
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: steps")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: steps 1-3 had no learning signal (every advantage "
                                                         "0; updates skipped)"), warnings


BUILD = """
import os, sys, time
from grounds.cache import build_once
def build(tmp):
    os.makedirs(tmp)
    open(os.path.join(tmp, "half"), "w").close()
    print("building", flush=True)
    time.sleep(120)
build_once(sys.argv[1], lambda: os.path.exists(os.path.join(sys.argv[1], "half")), build, what="a test model")
"""


def test_ctrl_c_during_a_model_build_is_one_line_and_keeps_nothing_half_built(tmp_path):
    path = str(tmp_path / "model")
    child = subprocess.Popen([sys.executable, "-c", BUILD, path], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert child.stdout.readline() == "building\n"
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 130 and "Traceback" not in out, out
    assert out.strip() == "interrupted while building or waiting for a test model; nothing of it is kept (the next " \
                          "run builds it)"
    assert sorted(os.listdir(tmp_path)) == ["model.lock"]  # no folder, no temporary one
