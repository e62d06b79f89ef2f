"""adakp.py: the entropy proxy (batched = one by one), the truncation bound, the greedy selector, smoke runs."""

import io
import math
import os
from contextlib import redirect_stdout
from dataclasses import fields

import pytest
import torch
import tyro

import adakp
from common.data import encode_prompts, render_prompt, rows_to_problems
from common.logger import read_metrics
from common.models import load_model, load_tokenizer
from common.rollout import attach
from common.testbed import make_suite
from conftest import assert_samples

TINY = ["--num-prompts", "4", "--group-size", "4", "--max-new-tokens", "8", "--num-eval-problems", "8",
        "--eval-samples", "0", "--eval-every", "0", "--num-train-problems", "16"]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core CPU two threads per process run the 1M-parameter model ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _args(tmp_path, *extra) -> adakp.Args:
    return tyro.cli(adakp.Args, args=["--output-dir", str(tmp_path), *TINY, *extra])


def test_help_documents_every_flag():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(adakp.Args, args=["--help"])
    for f in fields(adakp.Args):
        assert "--" + f.name.replace("_", "-") in out.getvalue(), f.name


def test_truncation_bound_holds_against_exact_entropy():
    gen = torch.Generator().manual_seed(0)
    for scale in (0.5, 2.0, 8.0):  # flat to peaked distributions
        logits = torch.randn(64, 300, generator=gen) * scale
        exact, zero_bound, _ = adakp.truncated_entropy(logits, 0)
        p = logits.softmax(-1)
        assert torch.allclose(exact, -(p * p.log()).sum(-1), atol=1e-5) and torch.all(zero_bound == 0)
        for k in (1, 10, 50, 299):
            trunc, bound, eps = adakp.truncated_entropy(logits, k)
            gap = exact - trunc
            assert torch.all(gap >= -1e-5), (scale, k)  # (1 - eps) H_K never overestimates
            assert torch.all(gap <= bound + 1e-5), (scale, k, (gap - bound).max())
            top = p.topk(k, -1).values.sum(-1)
            assert torch.allclose(eps, 1 - top, atol=1e-5)
    # the bound is tight when the tail is uniform: all 4 tokens equally likely, K = 2
    h, b, _ = adakp.truncated_entropy(torch.zeros(1, 4), 2)
    assert (h + b).item() == pytest.approx(math.log(4), abs=1e-6)


def test_batched_scoring_equals_one_by_one(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir, "float32", "cpu")
    problems = make_suite("train", levels=(4,), n_per_level=2, seed=0)
    contexts, probes = [], []
    for p in problems:  # S = {} and S + k for every candidate, then S = {0} and {0} + k
        for S in [[]] + [[k] for k in range(len(p.hints))] + [[0, k] for k in range(1, len(p.hints))]:
            contexts.append(encode_prompts(tok, [render_prompt(p, tok, hints=[p.hints[k] for k in S])])[0])
            probes.append(adakp.probe_tokens(p, tok, 96)[: 2 + len(probes) % 2])  # probes of 2 and 3 tokens
    assert len({len(c) for c in contexts}) > 1 and len({len(z) for z in probes}) > 1  # padding is exercised
    for top_k in (0, 50):
        h, b, e, passes = adakp.probe_entropy(model, contexts, probes, tok.pad_token_id, len(tok), top_k, 1024)
        assert passes == 1
        for n, (c, z) in enumerate(zip(contexts, probes)):
            h1, b1, e1, _ = adakp.probe_entropy(model, [c], [z], tok.pad_token_id, len(tok), top_k, 1024)
            assert h[n].item() == pytest.approx(h1.item(), abs=1e-5)
            assert b[n].item() == pytest.approx(b1.item(), abs=1e-5)
        # and against a plain forward over the unpadded row: mean entropy of the next-token distributions at z
        c, z = contexts[-1], probes[-1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([c + z])).logits[0, len(c) - 1 : len(c) + len(z) - 1]
        want = adakp.truncated_entropy(logits[:, : len(tok)], top_k)[0].mean()
        assert h[-1].item() == pytest.approx(want.item(), abs=1e-5)


def _table_entropy(table: dict):
    """An entropy function over a hand-made table of H_bar(S) for one problem (order inside S does not matter)."""
    def entropy_fn(requests):
        h = torch.tensor([table[frozenset(S)] for _, S in requests])
        return h, torch.zeros(len(requests))
    return entropy_fn


def test_greedy_picks_two_hints_that_only_help_together():
    # KPs 0 and 1 are a pair: 1 alone does nothing (slightly hurts), but given 0 it lowers the entropy by 0.5;
    # KP 2 helps a little alone (more than 1 does) and nothing on top of 0; KP 3 is noise.
    H = {(): 1.00, (0,): 0.95, (1,): 1.01, (2,): 0.96, (3,): 1.00,
         (0, 1): 0.45, (0, 2): 0.95, (0, 3): 0.95, (0, 1, 2): 0.45, (0, 1, 3): 0.45}
    table = {frozenset(k): v for k, v in H.items()}
    subsets, gains, _, rounds = adakp.greedy_select(_table_entropy(table), [4], [2], 0.02)
    assert subsets == [[0, 1]] and gains[0] == pytest.approx([0.05, 0.5]) and rounds == 2
    # scoring each KP alone (not conditional on S) would have ranked 2 above 1 and picked {0, 2}
    alone = sorted(range(4), key=lambda k: table[frozenset()] - table[frozenset([k])], reverse=True)[:2]
    assert sorted(alone) == [0, 2]
    # with budget 3 it stops once nothing adds delta; with delta above every score it picks nothing
    subsets, _, _, rounds = adakp.greedy_select(_table_entropy(table), [4], [3], 0.02)
    assert subsets == [[0, 1]] and rounds == 3
    assert adakp.greedy_select(_table_entropy(table), [4], [2], 0.06)[0] == [[]]
    # several problems at once: each gets its own subset; budget 0 or no KPs: nothing is asked for
    calls = []

    def two(requests):
        calls.append(requests)
        return torch.tensor([table[frozenset(S)] for _, S in requests]), torch.zeros(len(requests))
    subsets, _, _, _ = adakp.greedy_select(two, [4, 4, 0], [2, 0, 3], 0.02)
    assert subsets == [[0, 1], [], []] and all(j == 0 for r in calls for j, _ in r)
    assert len(calls[0]) == 5  # round 1: S = {} and its 4 candidates, in one call


def test_kp_list_is_read_and_rendered_in_a_hint_block():
    rows = [{"problem": "What is 2+2?", "answer": "4", "kp_list": ["Addition is commutative.", "2+2=4"]},
            {"problem": "What is 3+3?", "answer": "6"}]
    problems = rows_to_problems(rows, "t.jsonl")
    assert problems[0].hints == ["Addition is commutative.", "2+2=4"] and problems[1].hints == []
    text = render_prompt(problems[0], tokenizer=None, hints=problems[0].hints)
    assert text.startswith("What is 2+2?\n\n## Hint\nAddition is commutative.\n2+2=4\n\nPlease reason step by step")
    assert render_prompt(problems[0], tokenizer=None).startswith("What is 2+2?\nPlease reason")
    with pytest.raises(SystemExit, match="kp_list"):
        rows_to_problems([{"problem": "q", "answer": "1", "kp_list": "not a list"}], "t.jsonl")


def test_attach_moves_completions_to_another_prompt():
    r = attach([[5, 6, 7], [8]], [([1, 2, 3], "x", False), ([4], "y", True)], pad_id=0, width=4)
    assert r.prompt_len == 3 and r.input_ids_BT.tolist() == [[5, 6, 7, 1, 2, 3, 0], [0, 0, 8, 4, 0, 0, 0]]
    assert r.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0]]
    assert r.lengths_B.tolist() == [3, 1] and r.truncated_B.tolist() == [False, True] and r.texts == ["x", "y"]


@pytest.mark.parametrize("extra", [["--kp-mode", "adakp", "--reselect-every", "1"],
                                   ["--kp-mode", "static", "--correction", "per_token"]])
def test_smoke_run_logs_kp_metrics(tmp_path, weak_model_dir, extra):
    out = adakp.main(_args(tmp_path, "--total-steps", "2", "--run-name", "smoke", *extra))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("kp/mean_size", "kp/proxy_passes", "kp/trunc_bound_max", "kp/zero_correct_frac", "loss/policy"):
            assert math.isfinite(r[k]), k
        assert 0 <= r["kp/mean_size"] <= 3
    samples = assert_samples(out["run_dir"], ("reward", "advantage", "kps_shown"), steps=[2])
    for r in (r for r in samples if r["kind"] == "train"):  # the hinted prompt the rollout came from shows its KPs
        assert all(f"Hint:{k}" in r["prompt_tail"] for k in r["kps_shown"])
    if extra[1] == "adakp":  # every sampled problem is re-selected each step: a few batched forwards, not one per KP
        assert all(r["kp/reselected"] >= 1 and 1 <= r["kp/proxy_passes"] <= 4 for r in rows)
    else:  # static: nothing is re-selected during training; the weight is logged
        assert all(r["kp/reselected"] == 0 and r["kp/proxy_passes"] == 0 for r in rows)
        assert all(0 < r["is/weight_mean"] <= 1 for r in rows)
