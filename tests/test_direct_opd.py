"""direct_opd.py: the top-K teacher-pair reward on hand-made logits, identical teachers do nothing, a real pair
trains, the vocabulary check, the cached default teacher pair, and a subprocess smoke run."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import tyro

import direct_opd
from common.logger import read_metrics
from conftest import alone_env, assert_flags_documented, assert_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-prompts", "4", "--group-size", "2", "--max-new-tokens", "4", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0", "--micro-batch-size", "4"]
NO_KL = ["--kl-coef", "0", "--kl-coef-min", "0", "--kl-coef-max", "0"]


def _args(tmp_path, *extra) -> direct_opd.Args:
    return tyro.cli(direct_opd.Args, args=["--output-dir", str(tmp_path), *TINY, *extra])


@pytest.fixture(scope="module")
def shifted_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight nudged: a 'post-RL' teacher whose log-probs differ from the tiny one."""
    from common.models import load_model, load_tokenizer

    path = str(tmp_path_factory.mktemp("shifted"))
    model = load_model(tiny_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    load_tokenizer(tiny_model_dir).save_pretrained(path)
    return path


def _weights(run_dir):
    from common.models import load_model

    return load_model(os.path.join(run_dir, "checkpoint")).state_dict()


def test_help_documents_every_flag():
    assert_flags_documented(direct_opd.Args)


def test_topk_weights_and_teacher_logratio_on_hand_made_logits():
    # one position, vocabulary of 5, K = 3
    student = torch.tensor([[[2.0, 0.0, 1.0, -1.0, 0.5]]])
    post = torch.tensor([[[0.0, 3.0, 1.0, 0.0, 0.0]]])
    pre = torch.tensor([[[1.0, 0.0, 1.0, 0.0, 2.0]]])
    slogp, ids = torch.log_softmax(student, -1).topk(3, dim=-1)
    assert ids.tolist() == [[[0, 2, 4]]]  # the student's own top-3, whatever the teachers prefer
    lp = lambda logits, v: logits[v] - math.log(sum(math.exp(x) for x in logits))  # noqa: E731
    s, po, pr = student[0, 0].tolist(), post[0, 0].tolist(), pre[0, 0].tolist()
    z = sum(math.exp(s[v]) for v in (0, 2, 4))
    want_w = [math.exp(s[v]) / z for v in (0, 2, 4)]  # renormalised over the support, not over the vocabulary
    want_d = [lp(po, v) - lp(pr, v) for v in (0, 2, 4)]
    g = lambda logits: torch.log_softmax(logits, -1).gather(-1, ids)  # noqa: E731
    adv, w, d = direct_opd.dense_advantages(slogp, g(post), g(pre))
    assert w[0, 0].tolist() == pytest.approx(want_w, abs=1e-6)
    assert d[0, 0].tolist() == pytest.approx(want_d, abs=1e-6)
    assert adv[0, 0].tolist() == pytest.approx([a * b for a, b in zip(want_w, want_d)], abs=1e-6)
    # vanilla OPD: the same support and weights, but teacher minus student
    adv_v, _, d_v = direct_opd.dense_advantages(slogp, g(post), slogp)
    assert d_v[0, 0].tolist() == pytest.approx([lp(po, v) - lp(s, v) for v in (0, 2, 4)], abs=1e-6)
    # identical teachers: exactly zero, not just small
    adv0, _, _ = direct_opd.dense_advantages(slogp, g(post), g(post))
    assert torch.equal(adv0, torch.zeros_like(adv0))


def test_topk_loss_gradient_is_the_weighted_logratio_policy_gradient():
    """With one on-policy update (ratio 1) the loss gradient is -sum_v A(v) grad log pi(v)."""
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0, 0.5]]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    old, ids = logp.detach().topk(3, dim=-1)
    adv = torch.tensor([[[0.3, -0.2, 0.1]]])
    loss, clipped = direct_opd.topk_clipped_surrogate(logp.gather(-1, ids), old, adv, 0.2, 0.2, 3.0)
    (grad,) = torch.autograd.grad(loss.sum(), logits, retain_graph=True)
    (want,) = torch.autograd.grad(-(adv * logp.gather(-1, ids)).sum(), logits)
    assert torch.allclose(grad, want) and clipped.sum() == 0


def test_adaptive_kl_coefficient_moves_with_the_reward_sign_inside_its_range():
    beta = 2.5
    for _ in range(200):
        beta = direct_opd.update_kl_coef(beta, -0.1, 0.01, 0.5, 2.5)
    assert beta == 0.5
    assert direct_opd.update_kl_coef(1.0, 0.1, 0.01, 0.5, 2.5) == pytest.approx(1.01)
    assert direct_opd.update_kl_coef(1.0, 0.0, 0.01, 0.5, 2.5) == 1.0


def test_kl_coefficient_is_updated_from_the_current_batch_before_its_update(tmp_path, tiny_model_dir,
                                                                           shifted_model_dir, monkeypatch):
    """As the official trainer: beta_t = update(beta_{t-1}, mean A of batch t) is set before step t's actor update,
    so step 1's loss already uses the beta moved by step 1's batch (and kl/coef logs that beta)."""
    used = []  # the beta of every micro-batch loss, in order
    loss_fn = direct_opd.micro_batch_loss
    monkeypatch.setattr(direct_opd, "micro_batch_loss",
                        lambda model, batch, rows, args, num_tokens, kl_coef:
                        used.append(kl_coef) or loss_fn(model, batch, rows, args, num_tokens, kl_coef))
    out = direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir,
                                "--teacher-post", shifted_model_dir, "--total-steps", "2", "--run-name", "beta",
                                "--kl-coef", "1.0", "--kl-coef-min", "0.1", "--kl-coef-max", "5.0",
                                "--kl-adapt-rate", "0.5"))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    beta, want = 1.0, []
    for r in rows:
        assert r["delta_opd/weighted_reward_mean"] != 0  # a real shift: beta moves at every step
        beta = direct_opd.update_kl_coef(beta, r["delta_opd/weighted_reward_mean"], 0.5, 0.1, 5.0)
        want.append(beta)
    assert want[0] != 1.0  # step 1 must not use the initial beta
    per_step = len(used) // len(rows)
    assert [used[i * per_step:(i + 1) * per_step] for i in range(len(rows))] == [[b] * per_step for b in want]
    assert [r["kl/coef"] for r in rows] == want


@pytest.mark.parametrize("kl", ["zero", "default"])
def test_identical_teachers_give_zero_advantage_and_no_parameter_change(tmp_path, tiny_model_dir, shifted_model_dir,
                                                                        kl):
    """With KL at zero the loss is exactly 0; with the default KL too, since the student's and the reference's
    log-probs come from the same code path and k3 has zero gradient where they agree."""
    from common.models import load_model

    start = load_model(tiny_model_dir).state_dict()
    out = direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", shifted_model_dir,
                                "--teacher-post", shifted_model_dir, "--total-steps", "2", "--run-name", "same",
                                *(NO_KL if kl == "zero" else [])))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["adv/mean_abs"] for r in rows] == [0.0, 0.0]
    assert [r["delta_opd/weighted_reward_mean"] for r in rows] == [0.0, 0.0]
    end = _weights(out["run_dir"])
    changed = [k for k in start if not torch.equal(start[k], end[k])]
    assert not changed, changed


def test_a_real_teacher_shift_moves_every_parameter(tmp_path, tiny_model_dir, shifted_model_dir):
    """The positive control of the test above: same settings, a pair that differs."""
    from common.models import load_model

    start = load_model(tiny_model_dir).state_dict()
    out = direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir,
                                "--teacher-post", shifted_model_dir, "--total-steps", "2", "--run-name", "shift",
                                *NO_KL))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert all(r["adv/mean_abs"] > 0 and r["optim/grad_norm"] > 0 for r in rows)
    end = _weights(out["run_dir"])
    unchanged = [k for k in start if torch.equal(start[k], end[k])]
    assert not unchanged, unchanged
    samples = assert_samples(out["run_dir"], ("reward", "teacher_logratio"), steps=[2])
    assert any(r["teacher_logratio"] != 0 for r in samples if r["kind"] == "train")


@pytest.mark.parametrize("reward", ["vanilla_opd", "direct_plus_grpo"])
def test_ablation_rewards_run(tmp_path, tiny_model_dir, shifted_model_dir, reward):
    out = direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir,
                                "--teacher-post", shifted_model_dir, "--total-steps", "1", "--reward", reward,
                                "--run-name", reward, *(["--no-eval-teachers"] if reward == "vanilla_opd" else [])))
    last = out["last"]
    # the teachers' step-0 evaluation is on by default, and --no-eval-teachers skips it (a benchmark measures it once)
    assert ("eval/teacher_post_greedy_accuracy" in out["before"]) == (reward != "vanilla_opd")
    assert math.isfinite(last["loss/policy"]) and last["adv/mean_abs"] > 0
    # beta of step 1 is already moved by step 1's batch (vanilla OPD's teacher-minus-student mean is negative)
    assert last["kl/coef"] == direct_opd.update_kl_coef(2.5, last["delta_opd/weighted_reward_mean"], 0.01, 0.5, 2.5)
    assert ("adv/frac_zero_std" in last) == (reward == "direct_plus_grpo")


def test_mismatched_tokenizers_fail_fast_naming_the_culprit(tmp_path, tiny_model_dir):
    from common.models import load_model, load_tokenizer

    other = tmp_path / "other_vocab"
    tok = load_tokenizer(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(other)
    load_model(tiny_model_dir).save_pretrained(other)
    with pytest.raises(SystemExit, match=r"teacher_post \(.*other_vocab\) have different tokenizers"):
        direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir,
                              "--teacher-post", str(other)))
    with pytest.raises(SystemExit, match=r"teacher_pre \(.*other_vocab\) have different tokenizers"):
        direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", str(other)))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("direct_opd")]  # failed before any run folder


def test_default_teacher_pair_is_built_without_grpo_once_then_cached(tmp_path, weak_model_dir, monkeypatch):
    """The demo pair comes from common.testbed (a short rejection-sampling fine-tuning of testbed-weak), not grpo.py."""
    from common.models import load_model
    from grounds.testbed_models import TEACHER_RFT, ensure_testbed_teacher_pair

    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(weak_model_dir, cache / os.path.basename(weak_model_dir))  # the cached testbed-weak, not rebuilt
    monkeypatch.setenv("TINYPOST_CACHE", str(cache))
    recipe = {**TEACHER_RFT, "steps": 2, "eval_problems": 8}
    assert ensure_testbed_teacher_pair(recipe, progress=False, build=False) is None
    pre, post = ensure_testbed_teacher_pair(recipe, progress=False)
    assert os.path.realpath(pre) == os.path.realpath(weak_model_dir)
    meta = json.load(open(os.path.join(post, "TEACHER_DONE.json")))
    assert meta["recipe"]["steps"] == 2 and len(meta["kept_frac"]) == 2
    stamp = os.path.getmtime(os.path.join(post, "model.safetensors"))
    assert ensure_testbed_teacher_pair(recipe, progress=False) == (pre, post)  # second call: no training
    assert os.path.getmtime(os.path.join(post, "model.safetensors")) == stamp
    assert ensure_testbed_teacher_pair({**recipe, "steps": 3}, build=False) is None  # keyed by the recipe
    before, after = load_model(pre).state_dict(), load_model(post).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_teacher_post_is_required_for_other_teacher_pre(tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit, match="--teacher-post is required with --teacher-pre"):
        direct_opd.main(_args(tmp_path, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir))


def test_token_level_tis_is_refused_in_one_line_before_any_model_loads(tmp_path, monkeypatch):
    """The loss at a position averages over the top-K support under the trainer's own probabilities: the sampled
    token's ratio does not weight it (--tis sequence does, through the states the row was sampled through)."""
    monkeypatch.setattr(direct_opd, "model_folder", lambda name: pytest.fail(f"{name} was looked up"))
    with pytest.raises(SystemExit, match="^error: --tis token: .* use --tis sequence"):
        direct_opd.main(_args(tmp_path, "--rollout-backend", "vllm", "--tis", "token"))


def test_subprocess_smoke_run(tmp_path, tiny_model_dir, shifted_model_dir, copy_alone):
    """Run from a folder holding only direct_opd.py and common/."""
    r = subprocess.run([sys.executable, "direct_opd.py", *TINY, "--model-name", tiny_model_dir, "--teacher-pre",
                        tiny_model_dir, "--teacher-post", shifted_model_dir, "--total-steps", "2", "--output-dir",
                        str(tmp_path), "--run-name", "smoke"], cwd=copy_alone("direct_opd.py"), env=alone_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out greedy accuracy" in r.stdout and "teacher pair" in r.stdout
    rows = read_metrics(tmp_path / "smoke" / "metrics.jsonl")
    assert [x["step"] for x in rows if "reward/mean" in x] == [1, 2]
    assert "eval/teacher_post_greedy_accuracy" in rows[0]
    assert os.path.exists(tmp_path / "smoke" / "checkpoint" / "model.safetensors")
