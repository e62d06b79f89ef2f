"""oc_grpo.py: prefix cut, context-shift weight, [x|y] / [x~|y] alignment, whole-group replacement, smoke runs."""

import io
import math
import os
import random
from contextlib import redirect_stdout
from dataclasses import fields

import pytest
import torch
import tyro

import oc_grpo
from common.logger import read_metrics
from common.rollout import completion_logprobs, finish_rollouts, left_pad
from common.testbed import make_problem
from grounds.testbed_models import build_tokenizer
from conftest import assert_samples

TINY = ["--num-prompts", "4", "--group-size", "4", "--max-new-tokens", "8", "--num-eval-problems", "8",
        "--eval-samples", "0", "--eval-every", "0"]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core CPU two threads per process run the 1M-parameter model ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _args(tmp_path, *extra) -> oc_grpo.Args:
    return tyro.cli(oc_grpo.Args, args=["--output-dir", str(tmp_path), *TINY, *extra])


def test_help_documents_every_flag():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(oc_grpo.Args, args=["--help"])
    for f in fields(oc_grpo.Args):
        assert "--" + f.name.replace("_", "-") in out.getvalue(), f.name


def test_prefix_cut_snaps_back_to_whitespace():
    sol = "7+5=12 12+3=15 15+9=24"  # 22 characters
    assert oc_grpo.solution_prefix(sol, 0.5) == "7+5=12"  # cut at 11 ("7+5=12 12+3"), back to the space
    assert oc_grpo.solution_prefix(sol, 14 / 22) == "7+5=12 12+3=15"  # the cut falls on a space: kept as is
    assert oc_grpo.solution_prefix(sol, 0.1) == "7+"  # no whitespace before the cut: cut at the target
    assert oc_grpo.solution_prefix(sol, 1.0) == sol and oc_grpo.solution_prefix(sol, 0.0) == ""
    assert oc_grpo.solution_prefix("Draw [asy]draw(a b);[/asy] then x = 2.", 1.0) == "Draw  then x = 2."
    for f in (0.2, 0.4, 0.6, 0.8):  # a whole-word prefix, unless the first word is longer than the cut
        cut = oc_grpo.solution_prefix(sol, f)
        assert sol.startswith(cut) and len(cut) <= int(f * len(sol)), (f, cut)
        assert sol[len(cut)] == " " or (" " not in cut and len(cut) == int(f * len(sol))), (f, cut)


def test_importance_weight_is_clipped_ratio_truncated_at_one():
    old = torch.tensor([[-1.0, -3.0, -0.5, -2.0], [-1.0, -1.0, -1.0, -1.0]])
    hint = torch.tensor([[-2.0, -0.1, -0.5, -9.0], [-1.5, -0.5, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    w = oc_grpo.importance_weights(old, hint, mask, "per_token", 0.01)
    # row 0: exp(1) -> truncated to 1; exp(-2.9) = 0.055; exp(0) = 1; padding -> 1 (not exp(7))
    assert torch.allclose(w[0], torch.tensor([1.0, math.exp(-2.9), 1.0, 1.0]), atol=1e-6)
    assert torch.allclose(w[1], torch.tensor([1.0, math.exp(-0.5), 1.0, 1.0]), atol=1e-6)
    w = oc_grpo.importance_weights(old, hint, mask, "per_token", 0.3)
    assert w[0, 1].item() == pytest.approx(0.3)  # clamped at c_min
    u = oc_grpo.importance_weights(old, hint, mask, "per_token_uniform", 0.01)
    # row 0: mean over the 3 real tokens of (1, -2.9, 0) = -0.6333; row 1: mean(0.5, -0.5, 0, 0) = 0 -> 1
    assert torch.allclose(u[0, :3], torch.full((3,), math.exp(-1.9 / 3)), atol=1e-6) and u[0, 3] == 1.0
    assert torch.allclose(u[1], torch.ones(4))
    assert torch.equal(oc_grpo.importance_weights(old, hint, mask, "none", 0.01), torch.ones(2, 4))


def test_weight_multiplies_the_advantage_not_the_ratio():
    logp, old = torch.log(torch.tensor([[1.5, 0.5]])), torch.zeros(1, 2)  # ratios 1.5 and 0.5
    w = torch.tensor([[0.5, 0.5]])
    loss, _ = oc_grpo.clipped_surrogate(logp, old, w * 1.0, 0.2, 0.2)
    # -min(rho w A, clip(rho) w A): 1.5 -> clipped 1.2 * 0.5 = 0.6; 0.5 -> 0.5 * 0.5 = 0.25
    assert torch.allclose(loss, -torch.tensor([[0.6, 0.25]]))
    # weighting the ratio instead, (w rho) = 0.75 would escape the clip: the loss would be -0.75
    loss, _ = oc_grpo.clipped_surrogate(logp, old, -w, 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[0.75, 0.4]]))  # A < 0: max(rho, clip(rho)) * 0.5


def test_x_y_and_hinted_x_y_share_completion_columns_and_logprobs(tiny_model_dir):
    from common.models import load_model

    model = load_model(tiny_model_dir)
    x = [[5, 6, 7], [8, 9]]  # unguided prompts (different lengths: left padding differs per row)
    xh = [[11, 12, 13, 5, 6, 7], [14, 8, 9]]  # guided prompts, longer
    ys = [([20, 21, 2], "a", False), ([22, 2], "b", False)]  # completions (eos id 2 included)
    a, b = oc_grpo.rollout.attach(x, ys, 0, 3), oc_grpo.rollout.attach(xh, ys, 0, 3)
    assert a.prompt_len == 3 and b.prompt_len == 6
    assert torch.equal(a.completion_ids_BC, b.completion_ids_BC)  # token t of y at column P + t in both
    assert torch.equal(a.completion_mask_BC, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    assert a.input_ids_BT[1].tolist() == [0, 8, 9, 22, 2, 0] and a.attention_mask_BT[1].tolist() == [0, 1, 1, 1, 1, 0]
    # log-probs of the padded batch equal those of each unpadded sequence alone (position ids follow left padding)
    with torch.no_grad():
        for rows, prompts in ((a, x), (b, xh)):
            lp, _ = completion_logprobs(model, rows.input_ids_BT, rows.attention_mask_BT, rows.prompt_len)
            for i, (ids, _, _) in enumerate(ys):
                alone = torch.tensor([prompts[i] + ids])
                ref, _ = completion_logprobs(model, alone, torch.ones_like(alone), len(prompts[i]))
                assert torch.allclose(lp[i, : len(ids)], ref[0], atol=1e-5)
        # and the guided context really changes them (else the weight would be trivially 1)
        la, _ = completion_logprobs(model, a.input_ids_BT, a.attention_mask_BT, a.prompt_len)
        lb, _ = completion_logprobs(model, b.input_ids_BT, b.attention_mask_BT, b.prompt_len)
        assert not torch.allclose(la, lb)


class ScriptedEngine:
    """Answers correctly only when the prompt shows at least `min_words` words of the reference solution."""

    def __init__(self, tokenizer, min_words: int):
        self.tok, self.min_words, self.prompts = tokenizer, min_words, []

    def generate(self, prompt_ids, n=1, **kw):
        texts = []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            self.prompts.append(text)
            ref = text.split("Ref:")[1].split("\n")[0] if "Ref:" in text else ""
            answer = text.split("Q:")[1].split("\n")[0]
            good = str(sum(map(int, answer.split("+")))) if len(ref.split()) >= self.min_words else "0"
            texts += [good] + ["1"] * (n - 1)  # one sample right (when the prefix is long enough), the rest wrong
        rows = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        width = max(map(len, rows))
        comp = torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])
        ids, mask = left_pad([p for p in prompt_ids for _ in range(n)], self.tok.pad_token_id)
        return finish_rollouts(ids, mask, comp, self.tok)


def test_cascade_picks_the_lowest_rescuing_fraction_and_replaces_the_whole_group():
    tok = build_tokenizer()
    problems = [make_problem(ops, random.Random(0), 4) for ops in ([1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9])]
    problems.append(make_problem([1, 1], random.Random(0), 1))  # a one-step solution: "1+1=2"
    args = tyro.cli(oc_grpo.Args, args=["--group-size", "3"])
    engine = ScriptedEngine(tok, min_words=3)  # 5-step solutions: 0.2 -> 1 word, 0.4 -> 1, 0.6 -> 3
    rescued, tokens, _ = oc_grpo.guidance_cascade(engine, tok, problems, [0, 1, 2], 3, args)
    assert tokens > 0
    assert sorted(rescued) == [0, 1]  # problem 2 never shows 3 words: stays unrescued (zero advantage)
    for i in (0, 1):
        frac, prompt, completions, correct, logps = rescued[i]
        assert frac == 0.6 and correct == [1.0, 0.0, 0.0] and len(completions) == 3 and logps == [None] * 3
        assert "Ref:" in tok.decode(prompt) and completions[0][1] == problems[i].answer
    assert sum("Ref:" not in p for p in engine.prompts) == 0  # every cascade prompt is guided
    # the whole group of G rows is replaced; the other groups are untouched
    rows = [("x", g, k) for g in range(3) for k in range(3)]
    new = oc_grpo.replace_groups(rows, {1: [("x~", "guided", k) for k in range(3)]}, 3)
    assert new[:3] == rows[:3] and new[6:] == rows[6:] and new[3:6] == [("x~", "guided", k) for k in range(3)]
    with pytest.raises(AssertionError):
        oc_grpo.replace_groups(rows, {0: rows[:2]}, 3)  # never a partial group


def test_smoke_run_guides_failed_groups_and_trains_on_the_unguided_prompt(tmp_path, weak_model_dir, monkeypatch):
    # the real engine, watched: the completion tokens of every training generation (the first one and the cascade's)
    gen_tokens, make_engine = [], oc_grpo.rollout.make_engine

    def watched_engine(*a, **k):
        engine = make_engine(*a, **k)
        generate = engine.generate

        def watch(prompts, n=1, **kw):
            out = generate(prompts, n=n, **kw)
            if not kw.get("greedy"):  # not the greedy evaluation
                gen_tokens.append(out.lengths_B.sum().item())
            return out
        engine.generate = watch
        return engine

    monkeypatch.setattr(oc_grpo.rollout, "make_engine", watched_engine)
    out = oc_grpo.main(_args(tmp_path, "--total-steps", "2", "--levels", "4", "--run-name", "smoke"))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # perf/gen_tokens_per_s x time/generate: every token generated, not the trained (re-attached) batch's tokens
    assert len(gen_tokens) > 2  # the cascade ran
    logged = sum(r["perf/gen_tokens_per_s"] * r["time/generate"] for r in rows)
    assert logged == pytest.approx(sum(gen_tokens), rel=1e-6)
    assert sum(r["guide/rescued_groups"] for r in rows) > 0  # level 4 with G=4: some groups fail, some are rescued
    for r in rows:
        assert r["guide/rescued_groups"] <= r["guide/zero_reward_groups"] <= 4
        assert r["guide/rescued_groups"] == sum(r[f"guide/groups_at_f{f:g}"] for f in (0.2, 0.4, 0.6, 0.8, 1.0))
        assert 0.01 <= r["is/weight_min"] <= r["is/weight_mean"] <= 1.0
    assert any(r["is/weight_mean"] < 1.0 for r in rows if r["guide/rescued_groups"])
    assert os.path.exists(os.path.join(out["run_dir"], "checkpoint", "model.safetensors"))
    assert 0.0 <= out["after"]["eval/greedy_accuracy"] <= 1.0
    samples = assert_samples(out["run_dir"], ("reward", "advantage", "guidance_fraction", "is_weight"), steps=[2])
    for r in samples:  # guided rows are shown as trained: on the plain prompt, with their fraction and weight
        if r["kind"] == "train":
            assert r["is_weight"] == 1.0 if r["guidance_fraction"] is None else 0.01 <= r["is_weight"] <= 1.0
            assert "Ref:" not in r["prompt_tail"]


def test_fixed_guidance_adds_guided_rows_from_an_offline_probe(tmp_path, weak_model_dir, capsys):
    out = oc_grpo.main(_args(tmp_path, "--total-steps", "1", "--levels", "4", "--guidance", "fixed",
                             "--num-train-problems", "4", "--num-prompts", "8", "--fixed-probe-samples", "4",
                             "--correction", "per_token_uniform", "--num-eval-problems", "4", "--run-name", "fixed"))
    solvable = int(capsys.readouterr().out.split("fixed guidance: ")[1].split("/")[0])
    row = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r][0]
    # 8 prompts >= 4 original + `solvable` guided rows: the first pass over the rows holds every guided row
    assert 0 < solvable <= 4 and row["guide/rescued_groups"] == 0 and row["guide/guided_groups"] >= solvable
    assert 0.01 <= row["is/weight_min"] <= row["is/weight_mean"] <= 1.0
