"""A held-out evaluation is not silent: rank 0 shows a bar over the answers it generates (counted as they end, so it
moves within one batch), says how many problems and how long an answer may be, and clears it when done; nothing of
it reaches the metrics (so nor metrics.jsonl). The build lock's waiting lines and the warm start's bar are tested in
tests/test_testbed.py."""

import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

from common.evaluate import evaluate
from common.logger import step_bar
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine
from common.testbed import make_suite
from conftest import ROOT, assert_released_at_exit


def test_an_evaluation_shows_a_bar_over_its_answers_and_clears_it(tiny_model_dir, capsys):
    tok = load_tokenizer(tiny_model_dir)
    problems = make_suite("test", levels=(1, 2), n_per_level=2)
    out = evaluate(HFEngine(load_model(tiny_model_dir), tok), tok, problems, max_new_tokens=2, num_samples=3)
    console = capsys.readouterr()
    bar = "held-out evaluation, 4 problems (up to 2 new tokens an answer)"
    assert f"{bar}: 0/16 answers" in console.err  # 4 greedy answers and 3 samples of each, said at the start
    assert console.err.rstrip(" \r").endswith("answers")  # then blanked out: leave=False
    assert console.err.endswith("\r") and console.out == ""  # the console's lines (stdout) are untouched
    assert all(k.startswith("eval/") for k in out) and out["eval/num_problems"] == 4  # no progress in the metrics


@pytest.mark.parametrize("setting", ["auto", "0"])
def test_no_bar_where_stderr_is_a_file_or_bars_are_turned_off(tiny_model_dir, capsys, monkeypatch, setting):
    """Written to a file (pytest's capture is not a terminal), a bar's redraws would run into the step lines (issue
    58): by default the bars show only on a terminal; TINYPOST_PROGRESS=0 turns them off there too (=1, on: the other
    tests here)."""
    monkeypatch.setenv("TINYPOST_PROGRESS", setting)
    tok = load_tokenizer(tiny_model_dir)
    out = evaluate(HFEngine(load_model(tiny_model_dir), tok), tok, make_suite("test", levels=(1,), n_per_level=2), 2)
    assert out["eval/num_problems"] == 2 and "held-out evaluation" not in capsys.readouterr().err
    assert step_bar(types.SimpleNamespace(total_steps=3, exp_name="x"), 0, 0).disable


def test_the_sampler_counts_answers_as_they_end_so_an_evaluation_bar_moves_within_one_batch(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine, calls = HFEngine(load_model(tiny_model_dir), tok), []
    engine.on_answers = calls.append
    torch.manual_seed(0)
    out = engine.generate([[5, 6, 7], [8, 9]], n=16, max_new_tokens=40)  # a random model: some rows stop early
    ended_at = [int(n) - 1 for n, cut in zip(out.lengths_B, out.truncated_B) if not cut]
    expected = [ended_at.count(t) for t in range(len(calls))]
    expected[-1] += int(out.truncated_B.sum())  # the rows cut at the cap end at the last token
    assert calls == expected and sum(calls) == 32 and 0 < len(ended_at) < 32 and len(set(ended_at)) > 1
    evaluate(engine, tok, make_suite("test", levels=(1,), n_per_level=2), max_new_tokens=2)
    assert engine.on_answers is None  # the evaluation's bar is not fed by later training rollouts


RANK_EVAL = """
import json, sys
from common.dist import init_distributed
from common.evaluate import evaluate
from common.models import load_model, load_tokenizer
from common.rollout import HFEngine
from common.testbed import make_suite
init_distributed("cpu")  # as a trainer starts under torchrun (and frees the group at exit as it does)
tok = load_tokenizer(sys.argv[1])
out = evaluate(HFEngine(load_model(sys.argv[1]), tok), tok, make_suite("test", levels=(1,), n_per_level=3), 2)
print(json.dumps(out))
"""


def test_under_torchrun_only_rank_0_shows_the_evaluation_bar(tiny_model_dir):
    with socket.socket() as sock:  # a free port for the two ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_EVAL, tiny_model_dir], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), (err0[-2000:], err1[-2000:])
    for p, err in zip(procs, (err0, err1)):
        assert_released_at_exit(subprocess.CompletedProcess(p.args, p.returncode, "", err))
    assert "held-out evaluation, 3 problems (up to 2 new tokens an answer): 0/2 answers" in err0  # rank 0's share
    assert "held-out evaluation" not in err1
    assert json.loads(out0) == json.loads(out1) and json.loads(out0)["eval/num_problems"] == 3
