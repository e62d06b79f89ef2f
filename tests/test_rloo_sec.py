"""rloo_sec.py: the RLOO advantage, the SEC bandit (probabilities, sampling, TD update, estimated buckets),
and the trainer end to end (smoke run with the bandit logged, exact resume)."""

import itertools
import math
import os
import random

import pytest
import torch
import tyro
from PIL import Image

import rloo_sec
from conftest import assert_flags_documented, assert_samples
from common.logger import read_metrics
from common.problem import Problem

TINY = ["--num-prompts", "4", "--group-size", "4", "--max-new-tokens", "16", "--num-eval-problems", "8",
        "--eval-samples", "0", "--eval-every", "0"]


def _args(tmp_path, *extra) -> rloo_sec.Args:
    return tyro.cli(rloo_sec.Args, args=["--output-dir", str(tmp_path), *TINY, *extra])


def test_help_documents_every_flag():
    assert_flags_documented(rloo_sec.Args)


# RLOO advantage


def test_rloo_advantage_matches_hand_computation():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.5]])
    adv, zero = rloo_sec.rloo_advantages(r)
    assert torch.allclose(adv[0], torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]))
    assert torch.allclose(adv[1], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert adv[2].abs().max().item() == 0.0  # degenerate group: exactly no signal
    assert torch.allclose(adv[3], torch.tensor([0.5 - 0.5, 1.0 - 1 / 3, 0.0 - 2 / 3, 0.5 - 0.5]))
    assert zero.tolist() == [False, False, True, False]
    # identity: leave-one-out = G/(G-1) (r - mean)
    assert torch.allclose(adv, 4 / 3 * (r - r.mean(1, keepdim=True)))


def test_mean_abs_rloo_advantage_is_2p_1_minus_p():
    """E[(1/G) sum_i |A_i|] = 2 p (1 - p) for 0/1 rewards, by exact enumeration of all 2^G outcomes."""
    G, p = 4, 0.3
    expected = 0.0
    for outcome in itertools.product([0.0, 1.0], repeat=G):
        prob = math.prod(p if x else 1 - p for x in outcome)
        adv, _ = rloo_sec.rloo_advantages(torch.tensor([outcome]))
        expected += prob * adv.abs().mean().item()
    assert expected == pytest.approx(2 * p * (1 - p), abs=1e-6)


def test_seq_sum_aggregation_is_reinforce_over_sequences():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert rloo_sec.aggregate(loss, mask, "seq_sum", 4, 2, 2, 3).item() == pytest.approx((6 + 4) / 2)
    assert rloo_sec.aggregate(loss, mask, "token_mean", 4, 2, 2, 3).item() == pytest.approx(10 / 4)


# SEC bandit


def test_arm_probabilities_are_softmax_of_q_over_tau():
    probs = rloo_sec.arm_probs([0.0, 0.2, 0.4], [3, 3, 3], tau=0.4)
    z = 1 + math.exp(0.5) + math.exp(1.0)
    assert probs == pytest.approx([1 / z, math.exp(0.5) / z, math.exp(1.0) / z])
    # an empty arm gets 0 and the others are renormalised, whatever its Q
    probs = rloo_sec.arm_probs([0.0, 5.0, 0.4], [3, 0, 3], tau=0.4)
    assert probs == pytest.approx([1 / (1 + math.e), 0.0, math.e / (1 + math.e)])
    assert rloo_sec.arm_probs([0.0, 5.0, 0.4], [3, 0, 3], tau=0.4, uniform=True) == pytest.approx([0.5, 0.0, 0.5])
    assert rloo_sec.arm_probs([100.0, 0.0], [1, 1], tau=0.01) == pytest.approx([1.0, 0.0])  # no overflow


def test_empty_arms_are_never_sampled_and_frequencies_follow_probs():
    problems = [Problem(question=str(i), answer="0", level=lv) for i, lv in enumerate([1, 1, 3, 3, 3])]
    cur = rloo_sec.Curriculum(names=["1", "2", "3"], arms=[[0, 1], [], [2, 3, 4]], q=[0.0, 9.0, 0.4],
                              rng=random.Random(0))
    probs = rloo_sec.arm_probs(cur.q, [len(a) for a in cur.arms], tau=0.4)
    arms, picked = rloo_sec.sample_batch(cur, problems, 4000, probs)
    assert 1 not in arms
    assert all(p.level == {0: 1, 2: 3}[a] for a, p in zip(arms, picked))  # each problem comes from its arm
    assert arms.count(2) / len(arms) == pytest.approx(probs[2], abs=0.03)


def test_only_sampled_arms_are_updated_with_td0():
    arm_B = torch.tensor([0, 0, 0, 0, 2, 2, 2, 2])
    signal_B = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.2, 0.2, 0.2, 0.2])
    sums, counts = rloo_sec.arm_feedback(signal_B, arm_B, 3)
    assert counts.tolist() == [4, 0, 4]
    q = rloo_sec.td_update([0.1, 0.7, 0.3], sums, counts, alpha=0.5)
    assert q == pytest.approx([0.5 * 0.5 + 0.5 * 0.1, 0.7, 0.5 * 0.2 + 0.5 * 0.3])


def test_zero_advantage_rollouts_count_in_the_arm_mean():
    # arm 0: one mixed group (|A| = 1, 1/3, 1/3, 1/3) and one all-correct group (|A| = 0 x 4)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, zero = rloo_sec.rloo_advantages(rewards)
    sums, counts = rloo_sec.arm_feedback(adv.flatten().abs(), torch.zeros(8, dtype=torch.long), 1)
    assert counts.item() == 8 and zero.tolist() == [False, True]
    assert (sums / counts).item() == pytest.approx((1 + 3 * (1 / 3)) / 8)  # not / 4


def test_non_finite_signals_are_skipped():
    sums = torch.tensor([float("nan"), float("inf"), 1.0])
    q = rloo_sec.td_update([0.2, 0.3, 0.0], sums, torch.tensor([2.0, 2.0, 2.0]), alpha=0.5)
    assert q == pytest.approx([0.2, 0.3, 0.25])


def _simulate(signal: str, p_arms=(0.02, 0.5, 0.98), steps=80, G=8, slots=16, seed=0):
    """The bandit loop of rloo_sec.main on arms with fixed success rates (no model)."""
    gen = torch.Generator().manual_seed(seed)
    cur = rloo_sec.Curriculum(names=["a", "b", "c"], arms=[[0], [1], [2]], q=[0.0] * 3, rng=random.Random(seed))
    for _ in range(steps):
        probs = rloo_sec.arm_probs(cur.q, [1, 1, 1], tau=0.2)
        arm_P, _ = rloo_sec.sample_batch(cur, [None] * 3, slots, probs)
        correct_PG = (torch.rand(slots, G, generator=gen) < torch.tensor(p_arms)[arm_P].unsqueeze(1)).float()
        adv_PG, _ = rloo_sec.rloo_advantages(correct_PG)
        signal_B = {"advantage": adv_PG.abs(), "reward": correct_PG}[signal].flatten()
        sums, counts = rloo_sec.arm_feedback(signal_B, torch.tensor(arm_P).repeat_interleave(G), 3)
        cur.q = rloo_sec.td_update(cur.q, sums, counts, alpha=0.5)
    return rloo_sec.arm_probs(cur.q, [1, 1, 1], tau=0.2)


def test_advantage_signal_prefers_the_arm_near_half_and_reward_signal_chases_the_easy_arm():
    probs = _simulate("advantage")
    assert probs[1] > 0.6 and probs[1] == max(probs), probs
    probs = _simulate("reward")
    assert probs[2] > 0.6 and probs[2] == max(probs), probs


def test_estimated_buckets_follow_observed_success_rates():
    problems = [Problem(question=f"q{i}", answer="0", uid=f"u{i}") for i in range(5)]
    rate = {}
    rloo_sec.update_success_rates(rate, ["u0", "u1", "u2", "u3"], [0.0, 0.25, 1.0, 0.75], ema=0.3)
    assert rate == {"u0": 0.0, "u1": 0.25, "u2": 1.0, "u3": 0.75}  # first observation is taken as is
    arms = rloo_sec.bucket_arms(problems, rate, 5)
    # bucket = min(floor(p K), K - 1): 0 -> 0, 0.25 -> 1, 1.0 -> 4, 0.75 -> 3, unseen (0.5) -> 2
    assert arms == [[0], [1], [4], [3], [2]]
    rloo_sec.update_success_rates(rate, ["u1", "u2"], [1.0, 0.0], ema=0.3)
    assert rate["u1"] == pytest.approx(0.7 * 0.25 + 0.3) and rate["u2"] == pytest.approx(0.7)
    arms = rloo_sec.bucket_arms(problems, rate, 5)
    assert arms == [[0], [], [1, 4], [2, 3], []]  # u1 got easier, u2 harder
    cur = rloo_sec.make_curriculum(problems, rloo_sec.Args(curriculum="estimated"), seed=0)
    assert [len(a) for a in cur.arms] == [0, 0, 5, 0, 0]  # before any feedback: all unseen, one bucket


# The trainer end to end


def test_smoke_run_logs_the_bandit_per_arm(tmp_path, weak_model_dir, capsys):
    out = rloo_sec.main(_args(tmp_path, "--total-steps", "3", "--levels", "1", "2", "3", "--beta", "0.05",
                              "--num-iterations", "2", "--run-name", "smoke"))
    # the curriculum is shown: each step's console line and a panel of curve.png carry the arms' probabilities
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "mean=" in line]
    assert len(steps) == 3 and all(" prob[1/2/3]=" in line for line in steps), steps
    assert steps[0].endswith("prob[1/2/3]=0.333/0.333/0.333"), steps[0]  # Q starts at 0: uniform over levels 1-3
    drawn = Image.open(os.path.join(out["run_dir"], "curve.png")).text["Description"]
    assert all(f"sec/prob/arm_{k}" in drawn for k in (1, 2, 3)), drawn
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert sum(r[f"sec/prob/arm_{k}"] for k in (1, 2, 3)) == pytest.approx(1.0)
        assert sum(r[f"sec/count/arm_{k}"] for k in (1, 2, 3)) == 4  # one arm per prompt slot
        assert sum(r[f"sec/level_frac/level_{k}"] for k in (1, 2, 3)) == pytest.approx(1.0)
        for k in (1, 2, 3):
            assert f"sec/q/arm_{k}" in r and f"sec/mean_abs_adv/arm_{k}" in r and f"sec/success/arm_{k}" in r
        assert 0.0 <= r["adv/frac_zero_std"] <= 1.0
    # beta > 0: zero KL before the first update (up to float noise from batching); after the first step whose groups
    # had a signal (not all zero-std: otherwise nothing moves), the policy is off the reference
    assert abs(rows[0]["loss/kl"]) < 1e-6, rows[0]
    moved = next(i for i, r in enumerate(rows) if r["adv/frac_zero_std"] < 1)
    assert moved < 2, "no step with a learning signal: the check below cannot be made"
    assert abs(rows[moved + 1]["loss/kl"]) > 100 * max(abs(rows[0]["loss/kl"]), 1e-9), rows
    assert rows[0]["sec/prob/arm_1"] == pytest.approx(1 / 3)  # Q starts at 0: uniform
    assert any(r["sec/q/arm_1"] != 0.0 or r["sec/q/arm_2"] != 0.0 or r["sec/q/arm_3"] != 0.0 for r in rows)
    assert "eval/greedy_accuracy/level_3" in out["after"]
    state = torch.load(os.path.join(out["run_dir"], "checkpoint", "rank0_state.pt"), weights_only=False)
    assert state["sampler"]["q"] == [rows[-1][f"sec/q/arm_{k}"] for k in (1, 2, 3)]
    assert_samples(out["run_dir"], ("reward", "correct", "format", "advantage", "arm"), steps=[3])


def test_estimated_mode_resumes_exactly(tmp_path, weak_model_dir):
    common = ["--curriculum", "estimated", "--reindex-every", "1", "--levels", "1", "3"]
    first = rloo_sec.main(_args(tmp_path, *common, "--total-steps", "1", "--run-name", "cut"))
    resumed = rloo_sec.main(_args(tmp_path, *common, "--total-steps", "2", "--resume", first["run_dir"]))
    straight = rloo_sec.main(_args(tmp_path, *common, "--total-steps", "2", "--run-name", "straight"))
    got = [r for r in read_metrics(os.path.join(resumed["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    ref = [r for r in read_metrics(os.path.join(straight["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in got] == [1, 2]
    for key in ("reward/mean", "sec/q/arm_2", "sec/size/arm_0", "sec/size/arm_4", "sec/prob/arm_2"):
        assert got[-1][key] == pytest.approx(ref[-1][key], abs=1e-9), key
    # after feedback the buckets have moved away from the single unseen bucket
    assert ref[-1]["sec/size/arm_2"] < 1000
