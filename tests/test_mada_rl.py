"""mada_rl.py: the length reward, the counterfactual critic advantage on the four agreement buckets,
adapter switching (only the active adapter receives gradients), disjoint data splits, the critic prompt (worked
responses, cut to a budget, or answers only), acc_G with cut proposals,
the debate's final-answer rule, --help, and a short in-process run of all three stages."""

import io
import json
import os
from contextlib import redirect_stdout
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
import tyro

import mada_rl
import mada_rl_agents
from common.data import load_problems
from common.logger import read_metrics
from common.models import load_model
from common.problem import Problem
from conftest import assert_samples


# The length reward: lam = 0.5 - (len - min) / (max - min) within the group; wrong answers never gain
def test_length_reward_cases():
    correct = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    lengths = torch.tensor([[2, 3, 4, 2, 3, 4]])
    r = mada_rl.length_reward(correct, lengths)
    # correct: shortest +0.5, middle 0, longest -0.5; wrong: shortest clipped to 0, middle 0, longest -0.5
    assert torch.allclose(r, torch.tensor([[0.5, 0.0, -0.5, 0.0, 0.0, -0.5]]))


def test_length_reward_never_positive_when_wrong():
    torch.manual_seed(0)
    correct = (torch.rand(50, 8) < 0.5).float()
    lengths = torch.randint(1, 9, (50, 8))
    r = mada_rl.length_reward(correct, lengths)
    assert (r[correct == 0] <= 0).all()
    assert (r >= -0.5).all() and (r <= 0.5).all()


def test_length_reward_equal_lengths_is_zero_and_groups_are_separate():
    correct = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    lengths = torch.tensor([[3, 3, 3], [2, 6, 10]])  # group 0: no spread; group 1 normalised on its own
    r = mada_rl.length_reward(correct, lengths)
    assert torch.equal(r[0], torch.zeros(3))
    assert torch.allclose(r[1], torch.tensor([0.5, 0.0, -0.5]))


def test_mada_reward_weights_correctness_two_to_one():
    correct = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    lengths = torch.tensor([[2, 4, 2, 4]])
    r = mada_rl.mada_reward(correct, lengths)
    assert torch.allclose(r, torch.tensor([[2.5, 1.5, 0.0, -0.5]]))
    # a correct answer always beats a wrong one, whatever the lengths
    assert r[0, :2].min() > r[0, 2:].max()


# The counterfactual critic advantage A_C = R_C - 2 acc_G on the four agreement buckets
@pytest.mark.parametrize("acc_g, right, wrong", [(0.0, 2.0, 0.0), (1 / 3, 4 / 3, -2 / 3),
                                                  (2 / 3, 2 / 3, -4 / 3), (1.0, 0.0, -2.0)])
def test_counterfactual_advantage_buckets(acc_g, right, wrong):
    # one right and one wrong critic answer of equal length (R_len = 0): R_C = 2 and 0
    correct = torch.tensor([[1.0, 0.0]])
    rewards = mada_rl.mada_reward(correct, torch.tensor([[3, 3]]))
    adv = mada_rl.counterfactual_advantages(rewards, torch.tensor([acc_g]))
    assert torch.allclose(adv, torch.tensor([[right, wrong]]), atol=1e-6)


def test_counterfactual_advantage_keeps_length_term_and_differs_from_grpo():
    correct = torch.tensor([[1.0, 1.0, 1.0, 1.0]])  # all right, consensus all right: only the length term remains
    rewards = mada_rl.mada_reward(correct, torch.tensor([[2, 3, 4, 4]]))
    adv = mada_rl.counterfactual_advantages(rewards, torch.tensor([1.0]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, -0.5, -0.5]]))
    # all critics right against generators all wrong: the most credit; GRPO gives a zero-std group nothing
    rewards = mada_rl.mada_reward(correct, torch.tensor([[3, 3, 3, 3]]))
    assert torch.allclose(mada_rl.counterfactual_advantages(rewards, torch.tensor([0.0])), torch.full((1, 4), 2.0))
    g_adv, zero = mada_rl.group_advantages(rewards, 1e-6)
    assert zero.all() and torch.equal(g_adv, torch.zeros(1, 4))


# Adapters: switched by name, only the active one receives gradients
def test_switching_adapters_only_active_gets_gradients(tiny_model_dir):
    args = mada_rl.Args()
    gens, critics = mada_rl.agent_names(2, 2)
    model = mada_rl.make_agents(load_model(tiny_model_dir), gens + critics, args)
    ids = torch.randint(3, 200, (2, 6))
    for active in gens + critics:
        mada_rl_agents.use_adapter(model, active)
        assert model.active_adapter == active
        for n, p in model.named_parameters():
            p.grad = None
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        for name in gens + critics:
            ps = mada_rl_agents.adapter_params(model, name)
            assert ps, name
            has = [p.grad is not None and p.grad.abs().sum().item() > 0 for p in ps.values()]
            if name == active:
                assert any(has), f"{active} active but got no gradient"
            else:
                assert not any(has), f"{name} got a gradient while {active} was active"
        base = [p for n, p in model.named_parameters() if "lora_" not in n]
        assert all(p.grad is None for p in base), "the base model must stay frozen"


def test_switching_adapters_drops_the_previous_adapters_gradients(tiny_model_dir):
    """After gen0 trained, its gradients are gone once gen1 is active: nothing stale for data parallel's all-reduce
    to sum again (it summed them on every later step, growing them by the world size each time)."""
    gens = ["gen0", "gen1"]
    model = mada_rl.make_agents(load_model(tiny_model_dir), gens, mada_rl.Args())
    mada_rl_agents.use_adapter(model, "gen0")
    model(input_ids=torch.randint(3, 200, (2, 6))).logits.float().pow(2).mean().backward()
    assert any(p.grad is not None for p in mada_rl_agents.adapter_params(model, "gen0").values())
    mada_rl_agents.use_adapter(model, "gen1")
    assert all(p.grad is None for p in mada_rl_agents.adapter_params(model, "gen0").values())


def test_bfloat16_base_keeps_float32_adapters(tiny_model_dir):
    """--dtype bfloat16 stores the frozen base in bfloat16; the trained LoRA weights stay float32 (their updates would
    round away in bfloat16) and still get gradients."""
    model = mada_rl.make_agents(load_model(tiny_model_dir, "bfloat16"), ["gen0", "critic0"], mada_rl.Args())
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    mada_rl_agents.use_adapter(model, "gen0")
    model(input_ids=torch.randint(3, 200, (2, 6))).logits.float().pow(2).mean().backward()
    assert any(p.grad is not None and p.grad.dtype == torch.float32 for p in lora.values())


def test_switching_adapters_changes_outputs(tiny_model_dir):
    model = mada_rl.make_agents(load_model(tiny_model_dir), ["gen0", "critic0"], mada_rl.Args())
    ids = torch.randint(3, 200, (1, 5))
    with torch.no_grad():
        for p in mada_rl_agents.adapter_params(model, "critic0").values():
            p.add_(0.5)  # give critic0's B a non-zero value: it now differs from the base
        mada_rl_agents.use_adapter(model, "gen0")
        a = model(input_ids=ids).logits
        mada_rl_agents.use_adapter(model, "critic0")
        b = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.allclose(a, base, atol=1e-6)  # gen0 is fresh (B = 0)
    assert not torch.allclose(b, base, atol=1e-3)


# Data splits: disjoint, covering, deterministic
def test_data_splits_are_disjoint():
    problems = load_problems("testbed", "train", (3,), 300, seed=1)
    problems = problems + problems[:40]  # repeated questions must not land in two splits
    splits = mada_rl.split_problems(problems, 6, seed=1)
    qs = [{p.question for p in s} for s in splits]
    for i in range(6):
        for j in range(i + 1, 6):
            assert not qs[i] & qs[j], (i, j)
    assert set().union(*qs) == {p.question for p in problems}
    assert max(map(len, splits)) - min(map(len, splits)) <= 1
    assert [p.question for p in mada_rl.split_problems(problems, 6, 1)[0]] == [p.question for p in splits[0]]


def test_critic_prompt_testbed_format():
    p = Problem(question="7+5+3+2", answer="17", task="testbed")
    text = mada_rl.render_critic_prompt(p, ["17", "16", "19"], tokenizer=None)  # the testbed needs no tokenizer
    assert text == "Prop:17\nProp:16\nProp:19\nQ:7+5+3+2\nA:"


# What a critic sees: the generators' worked responses (Stage 2 and the debate alike), cut to a token budget
WORKED = "Add the tens: 40 + 30 = 70. Add the ones: 7 + 5 = 12. Then 70 + 12 = 82. The answer is 82."
NL_PROBLEM = Problem(question="What is 47 + 35?", answer="82", task="nl")


class ScriptedEngine:
    """Gives every prompt the same reply (cut at max_new_tokens or not) and keeps the prompts it was given."""

    def __init__(self, reply: str, truncated: bool = False):
        self.reply, self.truncated, self.prompts = reply, truncated, []

    def generate(self, prompt_ids, n=1, **kwargs):
        self.prompts.append(prompt_ids)
        rows = len(prompt_ids) * n
        return SimpleNamespace(texts=[self.reply] * rows, truncated_B=torch.tensor([self.truncated] * rows))


def _agents(tiny_model_dir, *flags):
    from common.models import load_tokenizer

    args = tyro.cli(mada_rl.Args, args=["--model-name", tiny_model_dir, "--num-generators", "2", "--num-critics", "1",
                                        "--lora-r", "2", *flags])
    model = mada_rl.make_agents(load_model(tiny_model_dir), ["gen0", "gen1", "critic0"], args)
    return model, load_tokenizer(tiny_model_dir), args


def test_a_worked_response_reaches_the_critic_prompt_in_stage_2_and_in_the_debate(tiny_model_dir, capsys):
    model, tok, args = _agents(tiny_model_dir)
    records = mada_rl.critic_records(model, ScriptedEngine(WORKED), tok, [NL_PROBLEM], ["gen0", "gen1"], args)
    (problem, proposals, acc_g), = records
    assert proposals == [WORKED, WORKED] and acc_g == 1.0
    assert "- " + WORKED in mada_rl.render_critic_prompt(problem, proposals, tok)  # the prompt Stage 3 trains on
    engine = ScriptedEngine(WORKED)
    mada_rl.debate(model, engine, tok, [NL_PROBLEM], ["gen0", "gen1"], ["critic0"], 2, 8,
                   critic_sees=args.critic_sees, proposal_tokens=args.proposal_tokens)
    critic_prompt = tok.decode(engine.prompts[-1][0])  # round 2: the critic's prompt (the last generate)
    assert critic_prompt.count(WORKED) == 2 and NL_PROBLEM.question in critic_prompt
    err = capsys.readouterr().err  # the debate is not silent: a bar over its 2 + 1 answers, cleared when done
    assert "held-out debate, 1 problems (up to 8 new tokens an answer): 0/3 answers" in err and err.endswith("\r")
    assert engine.on_answers is None


def test_critic_sees_answers_only_with_the_ablation_flag_and_long_responses_keep_their_end(tiny_model_dir):
    model, tok, args = _agents(tiny_model_dir, "--critic-sees", "answers")
    (_, proposals, _), = mada_rl.critic_records(model, ScriptedEngine(WORKED), tok, [NL_PROBLEM], ["gen0"], args)
    assert proposals == ["82"]
    cut = mada_rl.proposal_text(WORKED, NL_PROBLEM, tok, "responses", 20)  # byte-level tokenizer: 20 characters
    assert cut == "..." + WORKED[-20:] and cut.endswith("The answer is 82.")
    assert mada_rl.proposal_text(WORKED, NL_PROBLEM, tok, "responses", 0) == WORKED  # 0: never cut


def test_a_proposal_cut_at_max_new_tokens_counts_as_wrong_in_acc_g(tiny_model_dir):
    """As in training and in the debate: a cut reply scores 0 whatever its text says."""
    model, tok, args = _agents(tiny_model_dir)
    (_, _, acc_g), = mada_rl.critic_records(model, ScriptedEngine(WORKED, truncated=True), tok, [NL_PROBLEM],
                                            ["gen0", "gen1"], args)
    assert acc_g == 0.0


def test_critic_prompt_budget_is_a_one_line_error_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --max-prompt-tokens 20: a critic prompt shows 3 responses of up "
                                         r"to 8 tokens"):
        mada_rl.main(tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path), "--max-prompt-tokens", "20"]))
    assert os.listdir(tmp_path) == []


def test_debate_metrics_final_rule_and_buckets():
    problems = [Problem(question=f"q{i}", answer="1", task="testbed") for i in range(4)]
    gens = [["1", "1", "1", "0"], ["1", "0", "1", "0"], ["1", "0", "0", "0"]]  # acc_G: 1, 1/3, 2/3, 0
    critics = [["1", "1", "1", "0"], ["1", "0", "1", "1"], ["0", "1", "1", "0"]]
    m = mada_rl_agents.debate_metrics([gens, critics], problems, 3)
    assert m["mada/eval/single_accuracy"] == pytest.approx(6 / 12)
    assert m["mada/eval/majority_accuracy"] == pytest.approx(2 / 4)  # problems 0 and 2
    assert m["mada/eval/debate_accuracy"] == pytest.approx(8 / 12)  # mean over critics (the paper's rule)
    assert m["mada/eval/debate_majority_accuracy"] == pytest.approx(3 / 4)
    assert m["mada/eval/debate_accuracy/acc_g_0of3"] == pytest.approx(1 / 3)
    assert m["mada/eval/debate_accuracy/acc_g_1of3"] == pytest.approx(2 / 3)
    assert m["mada/eval/improvement_rate"] == pytest.approx(3 / 6)  # problems 1, 3 (majority wrong)
    assert m["mada/eval/break_rate"] == pytest.approx(1 / 6)  # problems 0, 2 (majority right)


def test_help_documents_every_flag():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(mada_rl.Args, args=["--help"])
    text = out.getvalue()
    for f in fields(mada_rl.Args):
        if f.name == "counterfactual":
            assert "--no-counterfactual" in text
            continue
        assert "--" + f.name.replace("_", "-") in text, f.name


def test_bad_eval_debate_folder_is_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --eval-debate .*adapters"):
        mada_rl.main(tyro.cli(mada_rl.Args, args=["--eval-debate", str(tmp_path)]))


@pytest.mark.parametrize("flag", [["--resume", "runs/x"], ["--save-every", "2"], ["--no-save-optimizer"]])
def test_checkpoint_flags_are_one_line_errors_before_any_work(tmp_path, flag):
    with pytest.raises(SystemExit, match=rf"^error: {flag[0]}: mada_rl.py writes no checkpoints"):
        mada_rl.main(tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path), *flag]))
    assert os.listdir(tmp_path) == []


def tiny_flags(model_dir: str) -> list[str]:
    return ["--model-name", model_dir, "--num-generators", "2", "--num-critics", "2", "--num-prompts", "4",
            "--group-size", "4", "--max-new-tokens", "4", "--num-eval-problems", "12", "--num-train-problems", "80",
            "--generator-steps", "2", "--critic-steps", "2", "--lora-r", "4"]


# All three stages in process on a tiny random model, then --eval-debate from the run folder
def test_three_stages_smoke_and_eval_debate(tiny_model_dir, tmp_path):
    tiny = tiny_flags(tiny_model_dir)
    args = tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path), "--run-name", "r", "--eval-every", "3", *tiny])
    out = mada_rl.main(args)
    run_dir = out["run_dir"]
    for name in ("gen0", "gen1", "critic0", "critic1"):
        assert os.path.isfile(os.path.join(run_dir, "adapters", name, "adapter_config.json")), name
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    stages = [r["mada/stage"] for r in rows if "mada/stage" in r]
    assert stages == [1] * 4 + [3] * 4
    assert all("mada/acc_g" in r for r in rows if r.get("mada/stage") == 3)
    # the debate before training, every 3 steps (--eval-every 3), after Stage 1 and at the end
    assert [r["step"] for r in rows if "mada/eval/debate_accuracy" in r] == [0, 3, 4, 6, 8]
    assert out["params"]["mada/trainable_params_per_agent"] < out["params"]["mada/base_params"]
    for c in ("critic0", "critic1"):  # Stage 2: acc_G of each critic's problems, by how many of the 2 generators right
        fracs = [out["stage2"][f"mada/critic_data/{c}/frac_acc_g_{k}of2"] for k in range(3)]
        assert sum(fracs) == pytest.approx(1.0)
        assert out["stage2"][f"mada/critic_data/{c}/acc_g_mean"] == pytest.approx(fracs[1] / 2 + fracs[2])
    # --eval-debate reproduces the final held-out figures from the saved adapters
    again = mada_rl.main(tyro.cli(mada_rl.Args, args=["--eval-debate", run_dir, *tiny]))
    for k in ("mada/eval/single_accuracy", "mada/eval/majority_accuracy", "mada/eval/debate_accuracy"):
        assert again["after"][k] == pytest.approx(out["after"][k]), k
    with open(os.path.join(run_dir, "args.json")) as f:
        assert json.load(f)["counterfactual"] is True
    samples = assert_samples(run_dir, ("reward", "advantage", "agent", "proposals"), ("correct", "proposals"))
    train = [r for r in samples if r["kind"] == "train"]
    assert {r["agent"] for r in train} == {"gen0", "gen1", "critic0", "critic1"}  # each agent's last step at least
    assert all((r["proposals"] is None) == r["agent"].startswith("gen") for r in train)


def test_generators_from_trains_only_critics_on_the_same_generators(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    tiny = tiny_flags(tiny_model_dir)
    first = mada_rl.main(tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path), "--run-name", "a", *tiny]))
    with pytest.raises(SystemExit, match=r"^error: --generators-from .*: its --seed 1 differ"):
        mada_rl.main(tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path / "c"), "--seed", "2",
                                                  "--generators-from", first["run_dir"], *tiny]))
    assert not os.path.exists(tmp_path / "c")  # refused before any work
    # the first run's Stage-2 draw, with critic0's proposals made recognisable: the ablation must read this file,
    # not draw again (a draw from the same seed matches only where the sampler's floats match, issue 62)
    path = os.path.join(first["run_dir"], "stage2.jsonl")
    with open(path) as f:
        drawn = [json.loads(line) for line in f]
    assert [r["critic"] for r in drawn] == ["critic0"] * first["params"]["mada/split_sizes"][2] + ["critic1"] * first[
        "params"]["mada/split_sizes"][3]
    for r in drawn[: first["params"]["mada/split_sizes"][2]]:
        r.update(responses=["777", "777"], correct=[0.0, 0.0], proposals=["777", "777"], acc_g=0.0)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in drawn)
    again = mada_rl.main(tyro.cli(mada_rl.Args, args=["--output-dir", str(tmp_path), "--run-name", "b",
                                                      "--no-counterfactual", "--generators-from", first["run_dir"],
                                                      *tiny]))
    rows = read_metrics(os.path.join(again["run_dir"], "metrics.jsonl"))
    assert [r["mada/stage"] for r in rows if "mada/stage" in r] == [3] * 4  # Stage 1 not trained again
    assert rows[0]["step"] == 4  # the step counter goes on from the other run's Stage 1 (2 generators x 2 steps)
    for g in ("gen0", "gen1"):
        saved, now = (load_file(os.path.join(r["run_dir"], "adapters", g, "adapter_model.safetensors"))
                      for r in (first, again))
        assert saved.keys() == now.keys() and all(torch.equal(saved[k], now[k]) for k in saved), g
        assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k), g  # trained, not the B = 0 start
    for k in ("mada/eval/single_accuracy", "mada/eval/majority_accuracy", "mada/eval/debate_accuracy"):
        assert again["generators"][k] == pytest.approx(first["generators"][k]), k  # the same generators, fresh critics
    # and the same Stage-2 data: the plain critics read the very proposals of the first run's stage2.jsonl (issue 62;
    # before, they drew their own: from wherever the random stream stood, then from a seed of their own)
    kept = [open(os.path.join(r["run_dir"], "stage2.jsonl")).read() for r in (first, again)]
    assert kept[0] == kept[1]
    assert again["stage2"]["mada/critic_data/critic0/acc_g_mean"] == 0.0
    trained = [r for r in assert_samples(again["run_dir"], ("proposals",)) if r["kind"] == "train"]
    assert {tuple(r["proposals"]) for r in trained if r["agent"] == "critic0"} == {("777", "777")}  # what it trained on
    assert all(r["proposals"] != ["777", "777"] for r in trained if r["agent"] == "critic1")


def test_generators_from_refuses_a_run_without_its_stage_2_draw(tmp_path):
    p, q = (Problem(question=f"What is {a} + 1?", answer=str(a + 1), task="nl") for a in (1, 2))
    with pytest.raises(SystemExit, match=r"^error: --generators-from .*: no Stage-2 draw to read in its stage2.jsonl"):
        mada_rl_agents.saved_stage_2(str(tmp_path), {"critic0": [p]})
    (tmp_path / "stage2.jsonl").write_text(json.dumps({"critic": "critic0", "question": p.question, "answer": "2",
                                                       "proposals": ["2"], "acc_g": 1.0}) + "\n")  # no responses
    with pytest.raises(SystemExit, match=r"^error: --generators-from .*: no Stage-2 draw"):
        mada_rl_agents.saved_stage_2(str(tmp_path), {"critic0": [p]})
    (tmp_path / "stage2.jsonl").write_text(json.dumps({"critic": "critic0", "question": p.question, "answer": "2",
                                                       "responses": ["2"], "correct": [1.0]}) + "\n")
    assert mada_rl_agents.saved_stage_2(str(tmp_path), {"critic0": [p]}) == {
        "critic0": [{"question": p.question, "answer": "2", "responses": ["2"], "correct": [1.0]}]}
    with pytest.raises(SystemExit, match=r"^error: --generators-from .*: its stage2.jsonl holds other problems for "
                                         r"critic0"):
        mada_rl_agents.saved_stage_2(str(tmp_path), {"critic0": [q]})
