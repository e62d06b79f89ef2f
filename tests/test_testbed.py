"""common/testbed.py and grounds/testbed_models.py: a deterministic suite with disjoint splits, a cached model, and
headroom by level."""

import os

import pytest
import torch

from common import testbed
from grounds import testbed_models
from common.evaluate import evaluate
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine


def test_suite_is_deterministic_and_splits_are_disjoint():
    a, b = testbed.make_suite("train", seed=5), testbed.make_suite("train", seed=5)
    assert [p.question for p in a] == [p.question for p in b]
    assert [p.question for p in testbed.make_suite("train", seed=6)] != [p.question for p in a]
    test_q = {p.question for p in testbed.make_suite("test", n_per_level=300)}
    assert not test_q & {p.question for p in a}
    calib_q = {p.question for p in testbed.make_suite("calib", levels=(3,), n_per_level=200)}
    assert len(calib_q) == 200 and not calib_q & test_q  # the warm start's stopping rule never sees held-out questions


def test_problem_fields_are_consistent():
    for p in testbed.make_suite("test", n_per_level=20):
        total = sum(int(x) for x in p.question.split("+"))
        assert p.answer == str(total) and p.solution.endswith(f"={total}")
        assert len(p.solution.split(" ")) == testbed.OPERANDS[p.level] - 1
        assert any(p.hint_helpful) and not all(p.hint_helpful)
        for hint, helpful in zip(p.hints, p.hint_helpful):
            assert (hint in p.solution) == helpful


def test_model_build_is_deterministic_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path / "a"))
    monkeypatch.setitem(testbed_models.RECIPES, "testbed-weak", dict(testbed_models.RECIPES["testbed-weak"], sft_steps=3, target=0.0))
    path = testbed_models.ensure_testbed_model("testbed-weak", progress=False)
    w1 = load_model(path).state_dict()
    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path / "b"))
    w2 = load_model(testbed_models.ensure_testbed_model("testbed-weak", progress=False)).state_dict()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    # corrupt the cached weights: the next call rebuilds instead of failing
    with open(os.path.join(testbed_models.model_dir("testbed-weak"), "model.safetensors"), "wb") as f:
        f.write(b"")
    path = testbed_models.ensure_testbed_model("testbed-weak", progress=False)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) > 0


def test_warm_start_stops_on_calibration_or_fails_clearly_saying_what_each_check_measured(tmp_path, monkeypatch,
                                                                                           capsys):
    import json

    monkeypatch.setenv("TINYPOST_CACHE", str(tmp_path))
    recipe = dict(testbed_models.RECIPES["testbed-weak"], sft_steps=2, check_every=2, max_steps=6)
    monkeypatch.setitem(testbed_models.RECIPES, "testbed-weak", dict(recipe, target=0.0))
    path = testbed_models.ensure_testbed_model("testbed-weak", progress=False)
    with open(os.path.join(path, "TESTBED_DONE.json")) as f:
        assert json.load(f)["warm_start_steps"] == 2  # the target is met at the first check
    monkeypatch.setitem(testbed_models.RECIPES, "testbed-weak", dict(recipe, target=1.01))  # never met: a clear error
    capsys.readouterr()
    with pytest.raises(SystemExit, match="did not reach level-3 calibration accuracy"):
        testbed_models.ensure_testbed_model("testbed-weak", progress=True)
    out = capsys.readouterr().out
    assert ("a warm start of 2 scheduled steps, then a level-3 calibration check every 2 steps until accuracy 1.01 "
            "(usually by step ~470, about 3 minutes on 2 cores; at most 6 steps)") in out  # the build's first line
    checks = [line for line in out.splitlines() if line.startswith("[testbed] testbed-weak step ")]
    assert len(checks) == 3 and all("on the calibration problems, target 1.01: below it" in c for c in checks)
    assert checks[0].endswith("next check at step 4") and checks[1].endswith("next check at step 6")
    assert checks[2].endswith("below it, and no check is left")


def test_warm_start_progress_runs_to_the_next_calibration_check_not_to_the_step_cap():
    """The bar of a warm start ends at its next calibration check (the end of the 450-step schedule, then every 10
    steps), not at max_steps (3,000), where a bar once showed a 4.5-hour ETA for a build that stops near step 470."""
    assert [testbed_models.next_check("testbed-weak", s) for s in (0, 449, 450, 455, 460)] == [450, 450, 460, 460, 470]
    assert testbed_models.next_check("testbed-strong", 0) == 900
    # the bar's total is where a build usually stops (the line above it says "usually by step ~470"), then the next
    # check: never a total of 450 under a promise of 470 (issue 58)
    assert [testbed_models.bar_end("testbed-weak", s) for s in (0, 450, 469, 470, 475)] == [470, 470, 470, 480, 480]
    assert testbed_models.bar_end("testbed-strong", 0) == 910
    plan = testbed_models.warm_start_plan("testbed-weak")
    assert "450 scheduled steps" in plan and "usually by step ~470, about 3 minutes on 2 cores" in plan


def test_tokenizer_roundtrips_through_autotokenizer(weak_model_dir):
    tok = load_tokenizer(weak_model_dir)
    text = "Hint:12+3=15\nQ:7+5+3\nA:15 é"
    assert tok(text)["input_ids"] == testbed_models.build_tokenizer()(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text and tok.pad_token_id != tok.eos_token_id


def test_warm_started_model_lands_in_the_calibrated_band(weak_model_dir):
    """The warm start stops when level-3 accuracy on the calibration quarter reaches 0.45, so on any machine
    the held-out level-3 accuracy (200 problems, binomial sd 0.035) lands near it: RL has headroom there, the
    easy level is mostly mastered and the hardest is out of reach.

    Only level 3 is held by the stop: the build is a different model on another CPU (AVX2 or AVX-512 kernels),
    torch version or thread count, as with another build seed (docs/testbed.md). Over 11 builds (2 CPUs, 1-4
    threads, build seeds 0-5) these problems gave level 1 0.765-1.000 (0.8 failed one of them), level 3
    0.425-0.530, level 4 0.060-0.255, level 5 0.000-0.020: the bounds below hold with room on each."""
    model, tok = load_model(weak_model_dir), load_tokenizer(weak_model_dir)
    acc = {}
    for level in testbed.LEVELS:
        problems = testbed.make_suite("test", levels=(level,), n_per_level=200)
        acc[level] = evaluate(HFEngine(model, tok), tok, problems, max_new_tokens=64)["eval/greedy_accuracy"]
    print(acc)
    assert 0.35 <= acc[3] <= 0.70
    assert acc[1] >= 0.7 and acc[5] <= 0.1
    assert acc[1] > acc[3] > acc[4] >= acc[5]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_process_waiting_for_anothers_build_says_so_until_the_lock_is_released(tmp_path, monkeypatch, capsys, rank):
    """A second run that needs a model another process is building says at once what it waits for, where, on whom and
    for how long such a build takes, then how long it has waited, every `every` seconds; it goes on as soon as the
    builder releases the lock, without building again. Under torchrun only rank 0 talks (torchrun sets RANK)."""
    import threading
    import time

    from grounds.cache import build_once

    monkeypatch.setenv("RANK", rank)
    entry, started, release, finished = tmp_path / "entry", threading.Event(), threading.Event(), []
    done = lambda: os.path.exists(entry / "ok")  # noqa: E731

    def slow_build(tmp):  # the other process's build, holding the lock until released
        started.set()
        release.wait(30)
        os.makedirs(tmp)
        open(os.path.join(tmp, "ok"), "w").close()
        finished.append(time.time())

    holder = threading.Thread(target=build_once, args=(str(entry), done, slow_build, "the fake model", 3))
    holder.start()
    assert started.wait(30)
    threading.Timer(1.5, release.set).start()
    path = build_once(str(entry), done, lambda tmp: pytest.fail("built twice"), "the fake model", 3, every=0.4)
    returned = time.time()
    holder.join()
    out = capsys.readouterr().err
    assert path == str(entry) and 0 <= returned - finished[0] < 2.0  # the wait ends when the lock is released
    if rank == "1":
        assert "[cache]" not in out
        return
    first = out.splitlines()[0]
    assert first.startswith(f"[cache] waiting for another process to finish building the fake model in {entry} "
                            "(lock held since ")
    assert f"by process {os.getpid()}; it takes about 3 minutes on 2 cores)" in first
    assert out.count("[cache] still waiting for the fake model: ") >= 2  # every 0.4 s for 1.5 s
    last = out.splitlines()[-1]
    assert last.startswith("[cache] waited ") and last.endswith("for the fake model: built by the other process")


BUILD_WORKER = """
import os, sys, time
from grounds.cache import build_once
path, log = sys.argv[1:3]

def build(tmp):
    with open(log, "a") as f:
        f.write("built\\n")
    time.sleep(1.0)
    os.makedirs(tmp)
    open(os.path.join(tmp, "ok"), "w").close()

print(build_once(path, lambda: os.path.exists(os.path.join(path, "ok")), build))
"""


RANK_WORKER = """
import os, sys, time
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM
from grounds.cache import build_once
rank, path, log, store = int(sys.argv[1]), *sys.argv[2:5]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
while rank == 0 and not os.path.exists(path + ".lock"):
    time.sleep(0.05)  # rank 1 reaches the lock first, whatever the speed of either process

def build(tmp):
    with open(log, "a") as f:
        f.write(f"built on rank {rank}\\n")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                 intermediate_size=8)).save_pretrained(tmp)

out = build_once(path, lambda: os.path.exists(os.path.join(path, "model.safetensors")), build)
print(out, os.path.exists(os.path.join(out, "model.safetensors")))
dist.destroy_process_group()
"""


def test_build_once_under_torchrun_builds_on_rank_0(tmp_path):
    """With a process group up, transformers' save_pretrained writes weights on rank 0 only, so a cache entry built
    on rank 1 had no weights (rank 0 then deleted it to rebuild, and rank 1 failed to load it: a flaky cold-cache
    torchrun). Rank 1 here reaches the lock first; it must wait for rank 0's build, and both find the weights."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entry, log, store = tmp_path / "entry", tmp_path / "log", tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_WORKER, str(r), str(entry), str(log), str(store)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert [o.strip() for o, _ in outs] == [f"{entry} True"] * 2
    assert log.read_text() == "built on rank 0\n"


def test_build_once_lets_one_process_build_and_the_others_load(tmp_path):
    """Processes that need the same cache entry at once (torchrun ranks on a cold cache) build it once: the others
    wait on the lock, then find it done; the entry appears whole, by one rename."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entry, log = tmp_path / "entry", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_WORKER, str(entry), str(log)], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs == [str(entry)] * 3
    assert log.read_text() == "built\n"  # one build in all
    assert os.path.exists(entry / "ok") and not [f for f in os.listdir(tmp_path) if ".tmp" in f]
