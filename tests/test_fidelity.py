"""Where the trainers follow the papers' official code, and say where they do not (issue 55): a step without signal
still takes AdamW's step, Direct-OPD's teachers compute as its reference does, MADA's critic prompt counts every
token, --share-prompt keeps the ratio at 1 however the batch is cut, Ctrl-C says what continues a run saved
without its optimizer, and RLPF's expert-match bonus under timing noise is what its docstring says."""

import importlib
import os
from types import SimpleNamespace

import pytest
import torch
import tyro

import grpo
from common.logger import read_metrics


def patch_loop_score(monkeypatch, fn) -> None:
    """grpo.py's own verifier calls (its loop's `verifiers.score`) go to `fn`; the evaluation's, and the verifier's own
    recursive call, keep the real one (patching common.verifiers.score itself would reach those too)."""
    monkeypatch.setattr(grpo, "verifiers", SimpleNamespace(**{**vars(grpo.verifiers), "score": fn}))

TINY = ["--num-prompts", "2", "--group-size", "4", "--max-new-tokens", "8", "--num-eval-problems", "4",
        "--eval-samples", "0", "--eval-every", "0", "--log-samples", "0"]


def _rows(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r}


# ----------------------------------------------------------------------------------------
# 1. a step whose advantages are all 0 still takes its AdamW step (veRL, TRL); the skip is an option


def test_a_step_without_signal_still_moves_the_weights_by_adamw_momentum_unless_skipped(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    """Step 1 has a signal (the first rollout of each group scores 1, the others 0), steps 2 and 3 none (every reward
    0, so every advantage 0, and beta is 0). By default steps 2 and 3 still step AdamW, as veRL and TRL do: the
    gradient is 0, but the momentum of step 1 moves the weights. --skip-zero-advantage-steps keeps them exactly as
    step 1 left them, and AdamW's step count stays 1."""
    calls = []

    def scripted_score(texts, problems, truncated):  # the verifier's place in the loop, scored by hand
        calls.append(len(texts))
        return [float(len(calls) == 1 and i % 4 == 0) for i in range(len(texts))]

    patch_loop_score(monkeypatch, scripted_score)
    saved, real_save = {}, grpo.checkpoint.save_checkpoint

    def snapshot(run_dir, step, model, *rest, **kw):  # the weights at the end of every step
        saved.setdefault(run_dir, {})[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return real_save(run_dir, step, model, *rest, **kw)

    monkeypatch.setattr(grpo.checkpoint, "save_checkpoint", snapshot)
    flags = [*TINY, "--model-name", tiny_model_dir, "--total-steps", "3", "--save-every", "1", "--learning-rate",
             "1e-3", "--output-dir", str(tmp_path)]
    for name, extra in (("default", []), ("skip", ["--skip-zero-advantage-steps"])):
        calls.clear()
        run_dir = grpo.main(tyro.cli(grpo.Args, args=[*flags, "--run-name", name, *extra]))["run_dir"]
        rows, w = _rows(run_dir), saved[run_dir]
        assert rows[1]["adv/mean_abs"] > 0 and rows[1]["optim/grad_norm"] > 0, name
        assert all(rows[s]["adv/mean_abs"] == 0 for s in (2, 3)), name
        moved = [max((w[s][k] - w[s - 1][k]).abs().max().item() for k in w[s]) for s in (2, 3)]
        state = torch.load(os.path.join(run_dir, "checkpoint", "trainer_state.pt"), weights_only=False)
        steps = {int(v["step"]) for v in state["optimizer"]["state"].values()}
        if name == "default":
            assert [rows[s]["update/skipped"] for s in (2, 3)] == [0.0, 0.0]
            assert [rows[s]["optim/grad_norm"] for s in (2, 3)] == [0.0, 0.0]  # a zero gradient ...
            assert min(moved) > 1e-5, moved  # ... and yet the weights move (here by up to 6.7e-4, then 5.2e-4)
            assert steps == {3}
        else:
            assert [rows[s]["update/skipped"] for s in (2, 3)] == [1.0, 1.0]
            assert moved == [0.0, 0.0]
            assert steps == {1}


@pytest.mark.parametrize("trainer", ["rloo_sec", "oc_grpo", "adakp", "mada_rl"])
def test_the_other_group_trainers_step_adamw_on_a_step_without_signal_by_default(tmp_path, tiny_model_dir, trainer):
    """--max-new-tokens 1: every reward and advantage is 0 (the random tiny model). By default every step still runs
    its update, an AdamW step on a zero gradient (update/skipped 0, optim/grad_norm 0)."""
    module = importlib.import_module(trainer)
    flags = ["--model-name", tiny_model_dir, "--num-prompts", "2", "--group-size", "4", "--max-new-tokens", "1",
             "--num-eval-problems", "4", "--eval-every", "0", "--log-samples", "0", "--output-dir", str(tmp_path)]
    flags += (["--num-generators", "1", "--num-critics", "0", "--debate-rounds", "1", "--generator-steps", "2",
               "--num-train-problems", "8", "--lora-r", "2"] if trainer == "mada_rl"
              else ["--eval-samples", "0", "--total-steps", "2"])
    rows = _rows(module.main(tyro.cli(module.Args, args=flags))["run_dir"])
    assert sorted(rows) == [1, 2]
    assert all(r["adv/mean_abs"] == 0 and r["update/skipped"] == 0 and r["optim/grad_norm"] == 0
               for r in rows.values()), rows


# ----------------------------------------------------------------------------------------
# 2. Direct-OPD's teachers: float32 weights computing under --dtype's autocast, as the reference (and the official
# recipe's fp32 teachers under veRL's mixed precision)


def test_under_bfloat16_the_teachers_are_float32_and_compute_exactly_as_the_student(tmp_path, tiny_model_dir,
                                                                                   monkeypatch):
    """--dtype bfloat16 with both teachers the student's own weights: they are stored in float32, as the policy's
    master weights and the reference are, and compute as the student does, so vanilla OPD's reward log pi_post -
    log pi_student is exactly 0 at step 1 (stored in bfloat16, they computed their norms and residual stream in
    bfloat16: not 0)."""
    import direct_opd

    stored, real_shard = {}, direct_opd.dist.shard_models

    def record(args, *models):
        stored.update(zip(("student", "ref", "post", "pre"), ({p.dtype for p in m.parameters()} for m in models)))
        return real_shard(args, *models)

    monkeypatch.setattr(direct_opd.dist, "shard_models", record)
    args = tyro.cli(direct_opd.Args, args=[*TINY, "--model-name", tiny_model_dir, "--teacher-pre", tiny_model_dir,
                                           "--teacher-post", tiny_model_dir, "--reward", "vanilla_opd", "--dtype",
                                           "bfloat16", "--total-steps", "1", "--output-dir", str(tmp_path)])
    out = direct_opd.main(args)
    assert stored == dict.fromkeys(("student", "ref", "post", "pre"), {torch.float32})
    row = _rows(out["run_dir"])[1]
    assert row["delta_opd/sampled_logratio"] == 0.0 and row["adv/mean_abs"] == 0.0, row


# ----------------------------------------------------------------------------------------
# 3. MADA: the critic reads x' = [x ; y^_1 ; ... ; y^_N] (the paper's order), and its prompt is never cut

WORKED = "Add the tens: 40 + 30 = 70. Add the ones: 7 + 5 = 12. Then 70 + 12 = 82. The answer is 82."


class ScriptedEngine:
    """Gives every prompt the same reply and keeps the prompts it was given."""

    def __init__(self, reply: str):
        self.reply, self.prompts = reply, []

    def generate(self, prompt_ids, n=1, **kwargs):
        from types import SimpleNamespace

        self.prompts.append(prompt_ids)
        rows = len(prompt_ids) * n
        return SimpleNamespace(texts=[self.reply] * rows, truncated_B=torch.tensor([False] * rows))


def _mada_agents(tiny_model_dir):
    import mada_rl
    from common.models import load_model, load_tokenizer

    args = tyro.cli(mada_rl.Args, args=["--model-name", tiny_model_dir, "--num-generators", "2", "--num-critics", "1",
                                        "--lora-r", "2"])
    return mada_rl.make_agents(load_model(tiny_model_dir), ["gen0", "gen1", "critic0"], args), load_tokenizer(
        tiny_model_dir)


def test_a_critic_reads_the_question_first_then_the_proposals_then_the_instruction(tiny_model_dir):
    import mada_rl
    from common.problem import Problem

    model, tok = _mada_agents(tiny_model_dir)
    problem = Problem(question="What is 47 + 35?", answer="82", task="nl")
    engine = ScriptedEngine(WORKED)
    mada_rl.debate(model, engine, tok, [problem], ["gen0", "gen1"], ["critic0"], 2, 8, max_prompt_tokens=0)
    critic = tok.decode(engine.prompts[-1][0])  # round 2: the critic's prompt
    instruction = mada_rl.data.render_prompt(problem, tok).split(problem.question + "\n", 1)[1]  # the template's last line
    q, first, last = critic.index(problem.question), critic.index(WORKED), critic.rindex(WORKED)
    assert q < first < last < critic.index(instruction) and critic.endswith(instruction)  # x, y^_1, y^_2, instruction
    assert critic.count(WORKED) == 2


def test_a_critic_prompt_over_max_prompt_tokens_is_a_one_line_error_not_cut(tiny_model_dir):
    """Cut from the left, the critic's prompt would lose its question (before: its first proposal), silently."""
    import mada_rl
    from common.problem import Problem

    model, tok = _mada_agents(tiny_model_dir)
    problem = Problem(question="What is 47 + 35?", answer="82", task="nl")
    whole = len(encode := tok(mada_rl.render_critic_prompt(problem, [WORKED, WORKED], tok), add_special_tokens=False)
                ["input_ids"])
    assert encode and whole > 200  # byte-level: two worked responses and the question
    engine = ScriptedEngine(WORKED)
    with pytest.raises(SystemExit, match=rf"^error: --max-prompt-tokens {whole - 1}: a critic prompt \(question, "
                                         rf"template and proposals\) has {whole} tokens and is never cut") as e:
        mada_rl.debate(model, engine, tok, [problem], ["gen0", "gen1"], ["critic0"], 2, 8, max_prompt_tokens=whole - 1)
    assert "\n" not in str(e.value.code) and len(engine.prompts) == 2  # the generators answered; no critic ran
    mada_rl.debate(model, engine, tok, [problem], ["gen0", "gen1"], ["critic0"], 2, 8, max_prompt_tokens=whole)
    assert len(engine.prompts[-1][0]) == whole  # at the limit: whole


def test_the_critic_budget_counts_the_question_and_template_before_any_training(tmp_path, tiny_model_dir):
    """3 proposals of up to 8 tokens (24) fit a limit of 40, but not with the question and template around them
    (`Prop:..` lines, `Q:...`, `A:`): a one-line error before any step. Before, the early check counted the
    proposals only, and the critic's prompts were silently cut from the left."""
    import mada_rl

    flags = ["--model-name", tiny_model_dir, "--max-prompt-tokens", "40", "--num-train-problems", "24",
             "--num-prompts", "2", "--group-size", "2", "--generator-steps", "1", "--critic-steps", "1", "--lora-r", "2",
             "--num-eval-problems", "4", "--log-samples", "0", "--output-dir", str(tmp_path), "--run-name", "budget"]
    with pytest.raises(SystemExit, match=r"^error: --max-prompt-tokens 40: a critic prompt holds its question and "
                                         r"template \(up to \d+ tokens\) and 3 responses of up to 8 tokens each") as e:
        mada_rl.main(tyro.cli(mada_rl.Args, args=flags))
    assert "\n" not in str(e.value.code)
    assert not os.path.exists(tmp_path / "budget" / "metrics.jsonl")  # no evaluation, no step


# ----------------------------------------------------------------------------------------
# 4. --share-prompt: the ratio is exactly 1 at lr 0 however the update cuts the batch, or the flags are refused


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "4", "--micro-batch-size", "3"], "--micro-batch-size 3 is not a multiple of --group-size 4"),
    (["--num-prompts", "5", "--num-minibatches", "4"], "--num-minibatches 4 does not divide --num-prompts 5"),
])
def test_share_prompt_refuses_a_batch_cut_that_splits_a_group(tmp_path, flags, message):
    """A group split between two forwards can leave a row with fewer than two of its group, which takes the plain
    forward while the old log-probs' pass shared the prompt: at lr 0 the ratio was not 1 (micro-batch 3 with G = 4
    on SmolLM2: approx_kl 4.8e-7, issue 55; mini-batches of 5 rows, a group and a row of the next, on the tiny model:
    4.9e-9 in bfloat16). One line, before any model loads."""
    args = tyro.cli(grpo.Args, args=["--output-dir", str(tmp_path), "--model-name", str(tmp_path / "no-model"),
                                     "--group-size", "4", "--micro-batch-size", "4", "--share-prompt", *flags])
    with pytest.raises(SystemExit, match="^error: --share-prompt needs each group in one micro-batch and mini-batch: "
                                         + message) as e:
        grpo.main(args)
    assert "\n" not in str(e.value.code)


def test_share_prompt_keeps_the_ratio_at_1_over_several_minibatches_and_epochs(tmp_path, tiny_model_dir):
    """bfloat16, lr 0, one group a mini-batch (4 a step) and 2 epochs, each epoch shuffling the groups anew: every
    update's forward shares each prompt as the old log-probs' pass did, so the ratio is exactly 1."""
    out = grpo.main(tyro.cli(grpo.Args, args=[
        *TINY, "--model-name", tiny_model_dir, "--num-prompts", "4", "--max-new-tokens", "16", "--temperature", "2",
        "--dtype", "bfloat16", "--share-prompt", "--micro-batch-size", "4", "--num-minibatches", "4",
        "--num-iterations", "2", "--learning-rate", "0", "--total-steps", "1", "--output-dir", str(tmp_path)]))
    row = _rows(out["run_dir"])[1]
    assert row["policy/approx_kl"] == 0.0 and row["policy/clip_frac"] == 0.0 and row["rollout/completion_len"] > 8


# ----------------------------------------------------------------------------------------
# 5. Ctrl-C in a run saved without its optimizer names what continues it


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C as a terminal session has it (KeyboardInterrupt), even where pytest runs as a background job with SIGINT
    ignored."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_run_without_optimizer_state_names_the_weights_to_start_from(tmp_path, tiny_model_dir, capfd,
                                                                              monkeypatch, python_ctrl_c):
    """--no-save-optimizer: the checkpoint holds weights only, which --resume refuses, so the line printed after
    Ctrl-C names what works instead: a new run from those weights with --model-name (before: the --resume command)."""
    import signal

    real_score = grpo.verifiers.score

    def score_then_ctrl_c(*a, **k):  # Ctrl-C in the middle of step 1
        signal.raise_signal(signal.SIGINT)
        return real_score(*a, **k)

    patch_loop_score(monkeypatch, score_then_ctrl_c)
    flags = [*TINY, "--model-name", tiny_model_dir, "--total-steps", "3", "--no-save-optimizer", "--output-dir",
             str(tmp_path), "--run-name", "stopped"]
    with pytest.raises(SystemExit) as e:
        grpo.main(tyro.cli(grpo.Args, args=flags))
    assert e.value.code == 130
    weights = os.path.join(str(tmp_path), "stopped", "checkpoint")
    (line,) = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("stopped after step")]
    assert line == ("stopped after step 1 (checkpoint saved); it holds weights only (--no-save-optimizer): start a new "
                    f"run from them with --model-name {weights}")
    patch_loop_score(monkeypatch, real_score)
    with pytest.raises(SystemExit, match="holds weights only"):  # what the line used to suggest
        grpo.main(tyro.cli(grpo.Args, args=[*flags, "--resume", os.path.join(str(tmp_path), "stopped")]))
    out = grpo.main(tyro.cli(grpo.Args, args=[*TINY, "--model-name", weights, "--total-steps", "1", "--output-dir",
                                              str(tmp_path), "--run-name", "next"]))
    assert sorted(_rows(out["run_dir"])) == [1]


# ----------------------------------------------------------------------------------------
# 6. RLPF: the unfloored 2 % of the expert-match bonus lets timing noise pay it, not only withhold it


def test_timing_noise_wider_than_2_percent_pays_the_expert_match_bonus_about_half_the_time():
    """T_c / T_r measured with 10 % log-normal noise (the per-round spread docs/rlpf.md reports is wider): a program at
    the expert's speed is paid RBR in about half of 2,000 draws (exactly: P(z < ln 1.02 / 0.1) = 0.58), one 5 %
    slower in about 0.39 of them, while the floored terms never pay a program as slow as the baseline. The module
    docstring says so (before issue 55 it said noise only ever withholds credit)."""
    import random

    import rlpf

    rng, t_b, t_r = random.Random(0), 1.0, 0.01
    paid = {slow: [rlpf.speed_terms(t_r * slow * rng.lognormvariate(0, 0.1), t_b, t_r, 1.02, (1.2, 2.0))[2]
                   for _ in range(2000)] for slow in (1.0, 1.05)}
    assert 0.5 < sum(paid[1.0]) / 2000 < 0.66 and 0.3 < sum(paid[1.05]) / 2000 < 0.48
    equal = [rlpf.speed_terms(t_b * rng.lognormvariate(0, 0.04), t_b, t_r, 1.02, (1.2, 2.0)) for _ in range(2000)]
    assert all(cgre == 0 and fbr == 0 for cgre, fbr, _ in equal)  # within the floor: no speed credit
    assert "only ever withholds credit" not in rlpf.__doc__ and "about half the time" in rlpf.__doc__
