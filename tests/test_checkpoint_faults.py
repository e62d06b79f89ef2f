"""Faults a long run meets in its checkpoints (issue 54): a kill at any point of a save, twice in a row, resumes from
the newest complete checkpoint; a file changed after its save is one line naming it (on --resume and when the folder
is loaded as a model); a full disk during a save is one line saying so and where, with the partial save removed and
the previous checkpoint the one that resumes."""

import errno
import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import types

import pytest
import torch
import tyro
from safetensors import safe_open

import grpo
from common.checkpoint import KILL_AFTER_SAVE, open_checkpoint, save_checkpoint
from common.data import PromptSampler, load_problems
from common.logger import read_metrics
from common.models import load_model, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0", "--log-samples", "0"]


def _steps(run_dir) -> list:
    return [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r]


# ----------------------------------------------------------------------------------------
# a kill at any point of a save, twice in a row
# ----------------------------------------------------------------------------------------


class Killed(BaseException):
    """A kill at a chosen point: no `except Exception` runs, so the folders are left as a SIGKILL there leaves them."""


@pytest.fixture
def parts(tiny_model_dir, monkeypatch):
    """What a trainer hands save_checkpoint: a real model (a step's marker in its final norm weights), tokenizer,
    AdamW with state, scheduler and prompt sampler. `save(run_dir, step, kill)` saves, stopped (Killed) at the
    `kill`-th file operation on run_dir when one is given, and returns whether it was stopped; `resumed_step(run_dir)`
    is the step --resume continues from, checked against the weights it loads."""
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = PromptSampler(load_problems("testbed", "train", [1], 8, 0), 0)
    real = {"save": torch.save, "replace": os.replace, "rename": os.rename, "remove": os.remove,
            "rmtree": shutil.rmtree, "model": model.save_pretrained, "tokenizer": tokenizer.save_pretrained}
    at = types.SimpleNamespace(run_dir="", seen=0, kill=0)

    def point(path, write: bool) -> None:
        """A crash point before a write, or before a rename or removal of a path that exists (one that does not
        exist changes nothing: the crash before the next operation leaves the same folders)."""
        if str(path).startswith(at.run_dir) and (write or os.path.lexists(path)):
            at.seen += 1
            if at.seen == at.kill:
                raise Killed

    def rmtree(path, *a, **kw):
        if str(path).startswith(at.run_dir) and os.path.isdir(path):
            point(path, False)
            files = sorted(glob.glob(os.path.join(glob.escape(str(path)), "**"), recursive=True))
            for f in [f for f in files if os.path.isfile(f)][::2]:  # a kill midway: every other file gone
                real["remove"](f)
            point(path, False)
        real["rmtree"](path, *a, **kw)

    def wrap(name, arg=0, write=False):
        return lambda *a, **kw: (point(a[arg], write), real[name](*a, **kw))[1]

    monkeypatch.setattr(torch, "save", wrap("save", 1, write=True))
    for name in ("replace", "rename", "remove"):
        monkeypatch.setattr(os, name, wrap(name))
    monkeypatch.setattr(os, "unlink", wrap("remove"))
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(model, "save_pretrained", wrap("model", write=True))
    monkeypatch.setattr(tokenizer, "save_pretrained", wrap("tokenizer", write=True))

    def save(run_dir, step: int, kill: int = 0) -> bool:
        at.run_dir, at.seen, at.kill = str(run_dir), 0, kill
        with torch.no_grad():
            model.model.norm.weight.fill_(float(step))
        try:
            save_checkpoint(str(run_dir), step, model, tokenizer, optimizer, scheduler, sampler)
        except Killed:
            return True
        return False

    def resumed_step(run_dir) -> int:
        ckpt = open_checkpoint(str(run_dir), 0, 1)  # (every file checked against the manifest)
        with safe_open(os.path.join(ckpt["path"], "model.safetensors"), "pt") as f:
            assert torch.all(f.get_tensor("model.norm.weight") == ckpt["state"]["step"]), ckpt["path"]
        return ckpt["state"]["step"]

    return types.SimpleNamespace(save=save, resumed_step=resumed_step)


def _layout(run_dir) -> tuple:
    """What a kill left, as far as a resume can tell: each checkpoint folder and whether it has a manifest and a
    trainer state (partial saves that differ only in which weight files they hold lead to the same)."""
    return tuple((name, os.path.exists(run_dir / name / "manifest.json"), os.path.exists(run_dir / name /
                  "trainer_state.pt")) for name in sorted(os.listdir(run_dir)) if name.startswith("checkpoint"))


def test_a_kill_at_any_point_of_a_save_twice_in_a_row_resumes_the_newest_complete_checkpoint(tmp_path, parts):
    """A run with the checkpoint of step 1 is killed during the save of step 2, at each file operation in turn (a file
    written, renamed or removed, or a folder half removed); whatever it left, --resume continues from step 1 or 2,
    never from nothing, and once a kill point gives step 2 every later one does. From each different thing left, the
    resumed run is killed again at each point of its next save, with the same rule; and from each different thing
    both kills left, a save completes and resumes."""
    base, layouts, after_two = tmp_path / "base", set(), set()
    parts.save(base, 1)
    for k1 in range(1, 100):
        once = tmp_path / f"once{k1}"
        shutil.copytree(base, once)
        if not parts.save(once, 2, kill=k1):
            break
        s1 = parts.resumed_step(once)
        assert s1 in (1, 2) and (k1 == 1 or s1 >= last1), (k1, s1)
        last1 = s1
        if _layout(once) in layouts:
            continue
        layouts.add(_layout(once))
        for k2 in range(1, 100):
            twice = tmp_path / f"twice{k1}_{k2}"
            shutil.copytree(once, twice)
            if not parts.save(twice, s1 + 1, kill=k2):
                break
            s2 = parts.resumed_step(twice)
            assert s2 in (s1, s1 + 1) and (k2 == 1 or s2 >= last2), (k1, s1, k2, s2)
            last2 = s2
            if (s2, _layout(twice)) not in after_two:
                after_two.add((s2, _layout(twice)))
                assert not parts.save(twice, s2 + 1)
                assert parts.resumed_step(twice) == s2 + 1
        assert 2 < k2 < 100
    assert last1 == 2 and k1 > 6  # the kills reached past the point where step 2 is complete


def test_a_real_kill_after_the_previous_checkpoint_is_removed_resumes_the_new_one(tmp_path, tiny_model_dir, capsys):
    """A trainer process killed (SIGKILL) in its save of step 2, after it removed the checkpoint of step 1 and before
    it renamed the new one into place: --resume continues from step 2, and the run ends with every step logged once."""
    flags = [*TINY, "--model-name", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "run",
             "--save-every", "1"]
    run_dir = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "grpo.py", *flags, "--total-steps", "3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", KILL_AFTER_SAVE: "2:swap"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not os.path.exists(os.path.join(run_dir, "checkpoint")) and _steps(run_dir) == [1, 2]
    grpo.main(tyro.cli(grpo.Args, args=[*flags, "--total-steps", "3", "--resume", run_dir]))
    assert f"resumed {run_dir} from step 2" in capsys.readouterr().out
    assert _steps(run_dir) == [1, 2, 3]
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint")) == ["checkpoint"]


# ----------------------------------------------------------------------------------------
# a file changed after its save
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("finished")
    out = grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", tiny_model_dir, "--output-dir", str(tmp),
                                              "--total-steps", "2", "--run-name", "done", "--beta", "0.01"]))
    return out["run_dir"]


def _overwrite(path: str, size: int, byte: bytes) -> None:
    """`size` bytes in the middle of the file (inside its tensor data) replaced by `byte` repeated."""
    n = os.path.getsize(path)
    assert n > 2 * size
    with open(path, "r+b") as f:
        f.seek(n // 2)
        f.write(byte * size)


NAN = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian
CORRUPTIONS = [("trainer_state.pt", 4096, b"\xff"),  # the AdamW moments read 3.4e38
               ("model.safetensors", 65536, b"\x11"),
               ("model.safetensors", 65536 // 4, NAN),
               ("rank0_state.pt", 64, b"\x00"),
               ("tokenizer.json", 16, b"x")]


@pytest.mark.parametrize("name, size, byte", CORRUPTIONS)
def test_a_file_changed_after_its_save_stops_resume_with_one_line_naming_it(tmp_path, finished_run, tiny_model_dir,
                                                                            name, size, byte):
    run_dir = str(tmp_path / "run")
    shutil.copytree(finished_run, run_dir)
    path = os.path.join(run_dir, "checkpoint", name)
    _overwrite(path, size, byte)
    with pytest.raises(SystemExit) as e:
        grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", tiny_model_dir, "--total-steps", "3",
                                            "--beta", "0.01", "--resume", run_dir]))
    text = str(e.value.code)
    assert text == f"error: --resume {run_dir}: {path} is corrupt (its sha256 differs from the one saved with it)"
    assert _steps(run_dir) == [1, 2]


@pytest.mark.parametrize("name, size, byte", [c for c in CORRUPTIONS if not c[0].endswith(".pt")])
def test_a_checkpoint_loaded_as_a_model_checks_its_files(tmp_path, finished_run, name, size, byte):
    ckpt = str(tmp_path / "checkpoint")
    shutil.copytree(os.path.join(finished_run, "checkpoint"), ckpt)
    assert load_model(ckpt) is not None
    path = os.path.join(ckpt, name)
    _overwrite(path, size, byte)
    with pytest.raises(SystemExit) as e:
        load_model(ckpt)
    assert str(e.value.code) == (f"error: could not load model {ckpt!r}: {path} is corrupt (its sha256 differs from "
                                 "the one saved with it)")


def test_a_checkpoint_without_checksums_resumes_and_says_it_is_not_checked(tmp_path, finished_run, tiny_model_dir,
                                                                          capsys):
    """A checkpoint written before checksums (no manifest.json) still resumes, unchecked, and the run says so."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(finished_run, run_dir)
    os.remove(os.path.join(run_dir, "checkpoint", "manifest.json"))
    grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", tiny_model_dir, "--total-steps", "3",
                                        "--beta", "0.01", "--resume", run_dir]))
    out = capsys.readouterr().out
    assert f"{run_dir}/checkpoint has no manifest.json (saved before checksums): its files are not checked" in out
    assert _steps(run_dir) == [1, 2, 3]
    assert os.path.exists(os.path.join(run_dir, "checkpoint", "manifest.json"))  # the new save has one


# ----------------------------------------------------------------------------------------
# a full disk
# ----------------------------------------------------------------------------------------


def _full_at(monkeypatch, name: str, error: Exception) -> None:
    """torch.save of `name` fails as it does on a full disk."""
    save = torch.save

    def full(obj, path, *a, **kw):
        if os.path.basename(str(path)) == name:
            open(path, "wb").write(b"\0" * 1000)  # a partial file, as a short write leaves
            raise error
        return save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", full)


def _torch_disk_full_error() -> RuntimeError:
    """What torch.save raises on a full disk (the errno is lost: `unexpected pos`), written to /dev/full."""
    if not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)):
        pytest.skip("no /dev/full device to produce torch's own error")  # (a plain file there would be written)
    with pytest.raises(RuntimeError) as e:
        torch.save({"x": torch.zeros(10_000)}, "/dev/full")
    assert "unexpected pos" in str(e.value)
    return e.value


@pytest.mark.parametrize("error", ["oserror", "torch"])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, tiny_model_dir, monkeypatch, capsys,
                                                                     error):
    """The save of step 2 meets a full disk (an OSError ENOSPC, or torch's own RuntimeError, the disk at 0 bytes
    free until the partial save is removed): one line says the disk is full and where, the partial save is gone at once, and --resume continues from
    step 1."""
    flags = [*TINY, "--model-name", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "run",
             "--save-every", "1"]
    run_dir = str(tmp_path / "run")
    grpo.main(tyro.cli(grpo.Args, args=[*flags, "--total-steps", "1"]))
    if error == "oserror":
        _full_at(monkeypatch, "trainer_state.pt", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    else:
        _full_at(monkeypatch, "trainer_state.pt", _torch_disk_full_error())
        usage, partial = shutil.disk_usage, os.path.join(run_dir, "checkpoint.tmp")  # the partial save filled the disk
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=0) if os.path.exists(partial) else
                            usage(p))
    with pytest.raises(SystemExit) as e:
        grpo.main(tyro.cli(grpo.Args, args=[*flags, "--total-steps", "2", "--resume", run_dir]))
    assert str(e.value.code) == (f"error: the disk is full: the checkpoint of step 2 could not be written in "
                                 f"{run_dir}; the partial save was removed and the checkpoint of step 1 is kept: free "
                                 f"some space and continue with --resume {run_dir}")
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint")) == ["checkpoint"]
    monkeypatch.undo()
    capsys.readouterr()
    grpo.main(tyro.cli(grpo.Args, args=[*flags, "--total-steps", "2", "--resume", run_dir]))
    assert f"resumed {run_dir} from step 1" in capsys.readouterr().out
    assert _steps(run_dir) == [1, 2]
