"""ppo_slm.py: the three stages, the freeze check, the logits guard and each safety layer under injected faults."""

import contextlib
import io
import json
import logging
import os

import pytest
import torch
import tyro
from PIL import Image
from safetensors.torch import load_file

import ppo_slm
from conftest import assert_flags_documented, assert_samples
from common.logger import read_metrics

TINY = ["--num-train-examples", "64", "--num-eval-pairs", "16", "--num-eval-prompts", "16", "--num-prompts", "8",
        "--minibatch-size", "4", "--max-new-tokens", "4", "--sft-steps", "3", "--sft-batch-size", "8",
        "--rm-steps", "3", "--rm-batch-size", "8", "--total-steps", "3"]


def _args(tmp_path, model_dir, *extra) -> ppo_slm.Args:
    return tyro.cli(ppo_slm.Args, args=["--output-dir", str(tmp_path), "--model-name", model_dir, *TINY, *extra])


@pytest.fixture(scope="module")
def stages(tmp_path_factory, tiny_model_dir):
    """SFT adapter and reward model trained once (a full pipeline run), reused by path afterwards; out["console"]: what
    it printed, out["hf_warnings"]: the warnings transformers logged."""
    tmp = tmp_path_factory.mktemp("stages")
    warnings, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as console, contextlib.redirect_stderr(io.StringIO()) as err:
            out = ppo_slm.main(_args(tmp, tiny_model_dir, "--run-name", "full"))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    out.update(console=console.getvalue(), stderr=err.getvalue(), hf_warnings=warnings)
    return tiny_model_dir, ["--sft-adapter", out["sft_adapter"], "--reward-model", out["reward_model"]], out


def inject_faults(mp, nonfinite_scores: float = 0.0, inf_weight_step: int = 0, ratio_step: int = 0) -> None:
    """Monkeypatch faults into ppo_slm's real code path (mp: a pytest MonkeyPatch): a fraction of the raw RM scores
    replaced by NaN (even rows) or +inf (odd rows) before the score shaping; one trainable weight set to inf after the
    update of step `inf_weight_step`; the old log-probs of step `ratio_step` lowered by 5 nats (ratios about e^5)."""
    calls = {"old": 0, "finite": 0}
    shape_scores, old_logprobs_values, all_finite = ppo_slm.shape_scores, ppo_slm.old_logprobs_values, ppo_slm.all_finite

    def faulty_scores(raw_B, moments, args):
        hit_B = torch.rand_like(raw_B) < nonfinite_scores
        odd_B = torch.arange(len(raw_B)) % 2 == 1
        return shape_scores(raw_B.masked_fill(hit_B, float("nan")).masked_fill(hit_B & odd_B, float("inf")), moments,
                            args)

    def faulty_old_logprobs(policy, rollouts, args, device):
        calls["old"] += 1  # once per step
        old_logp_BC, values_BC = old_logprobs_values(policy, rollouts, args, device)
        return old_logp_BC - 5.0 * rollouts.completion_mask_BC * (calls["old"] == ratio_step), values_BC

    def finite_after_fault(params):
        calls["finite"] += 1  # once per step, right after the update
        if calls["finite"] == inf_weight_step:
            with torch.no_grad():
                next(p for n, p in params.items() if not n.startswith("v_head")).view(-1)[0] = float("inf")
        return all_finite(params)

    mp.setattr(ppo_slm, "shape_scores", faulty_scores)
    mp.setattr(ppo_slm, "old_logprobs_values", faulty_old_logprobs)
    mp.setattr(ppo_slm, "all_finite", finite_after_fault)


def _steps(out) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r}


def test_help_documents_every_flag():
    assert_flags_documented(ppo_slm.Args)


def test_full_pipeline_runs_and_reports(stages):
    _, _, out = stages
    assert 0.0 <= out["rm_accuracy"] <= 1.0
    assert os.path.exists(os.path.join(out["sft_adapter"], "adapter_config.json"))
    assert os.path.exists(os.path.join(out["reward_model"], "config.json"))
    assert sorted(_steps(out)) == [1, 2, 3]
    for key in ("eval/rm_score", "eval/win_rate_rm", "eval/win_rate_verifier", "eval/greedy_accuracy"):
        assert key in out["after"], key
    # the entropy the policy has to lose, before and after (sampled at T 1.3: above 0, below log of the vocabulary)
    assert 0 < out["before"]["eval/entropy"] < 6 and 0 < out["after"]["eval/entropy"] < 6
    assert 0 <= out["before"]["rm/train_pair_accuracy"] <= 1  # the RM on its own pairs: has it memorised them?
    assert os.path.exists(os.path.join(out["run_dir"], "ppo_adapter", "value_head.pt"))
    assert_samples(out["run_dir"], ("rm_score", "reward", "correct"), ("rm_score", "correct"), steps=[3])


def test_the_run_explains_its_score_head_plots_and_ends_on_the_training_samples_rm_score(stages):
    _, _, out = stages
    assert "reward model: the SFT model with a new score head" in out["console"]
    assert "held-out evaluation, 16 prompts (up to " in out["stderr"]  # its evaluations show a bar (on stderr)
    assert not [w for w in out["hf_warnings"] if "MISSING" in w], out["hf_warnings"]  # no unexplained load report
    drawn = Image.open(os.path.join(out["run_dir"], "curve.png")).text["Description"]
    assert "reward/mean" in drawn and "rm/score_mean" in drawn, drawn
    scores = [r["rm/score_mean"] for r in _steps(out).values()]  # 3 steps: the first and the last one
    last = out["console"].strip().splitlines()[-1]
    assert last.startswith(f"training samples' RM score {scores[0]:.3f} -> {scores[-1]:.3f} (means of the first and "
                           "last 1 steps); held out (n=16): win rate over SFT (RM) "), last


@pytest.fixture(scope="module")
def faulty_runs(stages, tmp_path_factory):
    """The same faults injected with the safety envelope on and off: NaN/inf scores on every step, an inf
    weight after the update of step 2, old log-probs shifted by 5 nats (ratio ~ e^5) at step 3."""
    model, paths, _ = stages
    tmp = tmp_path_factory.mktemp("faults")
    runs = []
    for name, flags in (("on", []), ("off", ["--no-score-norm", "--no-ratio-guard", "--no-rollback"])):
        with pytest.MonkeyPatch.context() as mp:
            inject_faults(mp, nonfinite_scores=0.5, inf_weight_step=2, ratio_step=3)
            runs.append(ppo_slm.main(_args(tmp, model, *paths, "--total-steps", "4", *flags, "--run-name", name)))
    return runs


def test_roll_back_restores_weights_and_optimizer_state():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    params = {"w": w}
    healthy = ppo_slm.healthy_state(params, opt)
    saved = w.detach().clone()
    w.grad = torch.ones(3)
    opt.step()
    with torch.no_grad():
        w[0] = float("inf")
    assert not ppo_slm.all_finite(params)
    ppo_slm.roll_back(params, opt, healthy)
    assert torch.equal(w.detach(), saved) and opt.state_dict()["state"][0]["step"].item() == 1


def _adapter_finite(out) -> bool:
    adapter = load_file(os.path.join(out["run_dir"], "ppo_adapter", "adapter_model.safetensors"))
    return all(torch.isfinite(t).all() for t in adapter.values())


def test_nan_reward_is_neutralised(faulty_runs):
    raw_B = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0, 40.0])
    args = ppo_slm.Args()
    scores_B, n_bad = ppo_slm.shape_scores(raw_B, ppo_slm.RunningMoments(), args)
    assert n_bad == 3 and torch.isfinite(scores_B).all() and scores_B.abs().max() <= args.score_clip
    # end to end: half of the scores are NaN/inf; before the inf weight (step 1) everything stays finite
    on, _ = faulty_runs
    row = _steps(on)[1]
    assert row["safety/nonfinite_scores"] > 0
    assert all(torch.isfinite(torch.tensor(row[k])) for k in ("reward/mean", "loss/policy", "loss/value"))


def test_inf_weight_is_rolled_back_and_counted(faulty_runs):
    on, off = faulty_runs
    rows = _steps(on)
    assert [rows[s]["safety/rollbacks"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert rows[4]["safety/logit_fixes"] == 0 and _adapter_finite(on)
    # the fault is real: without rollback the weight stays non-finite and generation needs the logits guard
    rows = _steps(off)
    assert rows[4]["safety/rollbacks"] == 0 and rows[4]["safety/logit_fixes"] > 0 and not _adapter_finite(off)


def test_huge_ratio_trips_the_guard(faulty_runs):
    on, off = faulty_runs
    per_step = 2 * (8 // 4)  # ppo_epochs x mini-batches: every mini-batch of the faulty step is skipped
    rows = _steps(on)
    assert rows[3]["safety/ratio_guard_skips"] == per_step and rows[3]["safety/max_ratio"] > 100
    assert rows[3]["safety/ratio_above_10"] > 0.9  # e^5 on every token, less what the updates moved
    assert rows[1]["safety/ratio_guard_skips"] == 0 and rows[4]["safety/ratio_guard_skips"] == 0
    assert rows[1]["safety/ratio_above_10"] == 0 == rows[4]["safety/ratio_above_10"]
    assert _steps(off)[3]["safety/ratio_guard_skips"] == 0


def test_ratio_guard_zeroes_the_loss_and_still_steps_as_trl(stages, tmp_path, monkeypatch):
    """TRL 0.9.6 semantics: a guarded mini-batch's loss is multiplied by 0 and the optimizer still steps, so at step 2,
    where every mini-batch is guarded, Adam's momentum from step 1 still moves the weights."""
    model, paths, _ = stages
    one = ppo_slm.main(_args(tmp_path, model, *paths, "--total-steps", "1", "--run-name", "one"))
    inject_faults(monkeypatch, ratio_step=2)
    two = ppo_slm.main(_args(tmp_path, model, *paths, "--total-steps", "2", "--run-name", "two"))
    row = _steps(two)[2]
    assert row["safety/ratio_guard_skips"] == 2 * (8 // 4) and row["optim/grad_norm"] == 0.0  # zero gradients
    a, b = (load_file(os.path.join(o["run_dir"], "ppo_adapter", "adapter_model.safetensors")) for o in (one, two))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_rollbacks_stop_training_after_the_limit(stages, tmp_path, monkeypatch):
    model, paths, _ = stages
    inject_faults(monkeypatch, inf_weight_step=1)
    out = ppo_slm.main(_args(tmp_path, model, *paths, "--max-rollbacks", "1",
                             "--run-name", "stop"))
    assert out["steps"] == 1 and out["rollbacks"] == 1


class Interrupted(Exception):
    pass


def test_an_interrupted_reward_model_continues_where_it_saved(tiny_model_dir, tmp_path, monkeypatch):
    # a stage killed mid-way keeps its last save; the same flags and run folder skip the finished SFT stage and end
    # with the reward model of a run never stopped; a claim benchmark sees the folder as one to continue, not stale
    import ppo_slm_stages as stages
    from benchmarks.claims import claim_runs

    flags = ["--rm-steps", "6", "--total-steps", "0"]
    monkeypatch.setattr(stages, "STATE_EVERY", 2)  # saves at RM steps 2 and 4, a loss window of 2 steps
    whole = ppo_slm.main(_args(tmp_path, tiny_model_dir, *flags, "--run-name", "whole"))
    real_tqdm = stages.tqdm

    def killed_after_5_rm_steps(it, desc="", **kw):
        for i, x in enumerate(real_tqdm(it, desc=desc, **kw)):
            if desc == "reward model" and i == 5:
                raise Interrupted
            yield x

    args = _args(tmp_path, tiny_model_dir, *flags, "--run-name", "cut")
    monkeypatch.setattr(stages, "tqdm", killed_after_5_rm_steps)
    with pytest.raises(Interrupted):
        ppo_slm.main(args)
    run_dir = tmp_path / "cut"
    assert (run_dir / "reward_model.state.pt").exists() and (run_dir / "sft_adapter" / "stage.json").exists()
    assert torch.load(run_dir / "reward_model.state.pt", weights_only=True)["step"] == 4
    assert claim_runs.folder_state(ppo_slm, args) == "resume"
    assert claim_runs.folder_state(ppo_slm, _args(tmp_path, tiny_model_dir, "--rm-steps", "7", "--total-steps", "0",
                                                  "--run-name", "cut")) == "stale"
    monkeypatch.setattr(stages, "tqdm", real_tqdm)
    with contextlib.redirect_stdout(io.StringIO()) as console:
        again = ppo_slm.main(args)
    assert "sft: finished by an earlier run" in console.getvalue()
    assert "reward model: continuing from step 4 of 6" in console.getvalue()
    assert not (run_dir / "reward_model.state.pt").exists()
    done, fresh = (load_file(os.path.join(o["reward_model"], "model.safetensors")) for o in (again, whole))
    assert done.keys() == fresh.keys() and all(torch.equal(done[k], fresh[k]) for k in done)
    curves = [json.load(open(os.path.join(o["reward_model"], "loss_curve.json"))) for o in (again, whole)]
    assert curves[0] == curves[1] and len(curves[0]["mean_loss"]) == 3  # the windows before the cut kept
    assert "reward model: training loss " in console.getvalue()


def test_a_stage_state_of_other_flags_is_not_continued(tiny_model_dir, tmp_path, monkeypatch):
    import ppo_slm_stages as stages

    args = _args(tmp_path, tiny_model_dir, "--rm-steps", "4", "--total-steps", "0", "--run-name", "r")
    other = stages.stage_fingerprint(_args(tmp_path, tiny_model_dir, "--rm-lr", "1e-3"), "reward model")
    os.makedirs(tmp_path / "r")
    torch.save({"fingerprint": other, "step": 2}, tmp_path / "r" / "reward_model.state.pt")
    with contextlib.redirect_stdout(io.StringIO()) as console:
        ppo_slm.main(args)
    assert "the saved state of another run's reward model; the stage starts afresh" in console.getvalue()
    assert "continuing" not in console.getvalue()


def test_naive_adapter_load_freezes_and_the_check_catches_it(stages, tmp_path):
    model, paths, _ = stages
    with pytest.raises(SystemExit, match="silent LoRA freeze: the policy has no trainable"):
        ppo_slm.main(_args(tmp_path, model, *paths, "--policy-init", "naive_adapter", "--run-name", "naive"))
    with pytest.raises(SystemExit, match="did not change"):  # the check also fires when a LoRA exists but is stuck
        ppo_slm.main(_args(tmp_path, model, *paths, "--learning-rate", "0", "--run-name", "stuck"))


def test_merge_reinit_starts_at_sft_and_trains(stages):
    _, _, out = stages
    adapter = load_file(os.path.join(out["run_dir"], "ppo_adapter", "adapter_model.safetensors"))
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and sum(t.abs().sum().item() for t in lora_b) > 0  # fresh B = 0 has moved
    # the fresh LoRA (B = 0) leaves the merged SFT model unchanged at step 0
    from peft import LoraConfig, get_peft_model

    from common.models import load_model
    merged = load_model(os.path.join(out["run_dir"], "sft_merged")).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        fresh = get_peft_model(merged, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        assert torch.equal(fresh(input_ids=ids).logits, want)


def test_pair_accuracy_scores_each_pair_once_and_splits_it_by_kind(stages):
    import ppo_slm_stages
    from common.models import load_tokenizer

    model, _, out = stages
    tokenizer, rm = load_tokenizer(model), ppo_slm_stages.load_score_model(out["reward_model"]).eval()
    pairs = ppo_slm_stages.build_pairs(_args(".", model), "test", 12, 1, tokenizer)
    for i, e in enumerate(pairs):
        e.kind = "step" if i % 3 == 0 else "answer"  # 4 and 8 (testbed pairs have no kind of their own)
    acc = ppo_slm_stages.pair_accuracy(rm, tokenizer, pairs, "x")
    assert sorted(acc) == ["x", "x/answer", "x/step"]
    assert abs(acc["x"] - (4 * acc["x/step"] + 8 * acc["x/answer"]) / 12) < 1e-6
    assert acc["x/step"] == ppo_slm_stages.pair_accuracy(rm, tokenizer, pairs[::3])["rm/pair_accuracy"]


def test_logits_guard_makes_logits_finite():
    guard = ppo_slm.FiniteLogits()
    out = guard(None, torch.tensor([[float("nan"), float("inf"), -float("inf"), 500.0, 1.5]]))
    assert torch.equal(out, torch.tensor([[-100.0, 100.0, -100.0, 100.0, 1.5]])) and guard.fixed == 3


def test_gae_matches_the_recursion():
    rewards_BC = torch.tensor([[0.0, 1.0, 5.0]])
    values_BC = torch.tensor([[0.5, 0.2, 9.0]])
    mask_BC = torch.tensor([[1.0, 1.0, 0.0]])  # two real tokens: nothing flows from the padded column
    adv_BC, ret_BC = ppo_slm.gae(rewards_BC, values_BC, mask_BC, gamma=0.9, lam=0.5)
    d1 = 1.0 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    assert torch.allclose(adv_BC, torch.tensor([[d0 + 0.45 * d1, d1, 0.0]]))
    assert torch.allclose(ret_BC[:, :2], adv_BC[:, :2] + values_BC[:, :2])
