"""common/rollout.py: masks, chunked log-probs, and trainer log-probs equal to the sampler's."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.args import TrainArgs
from common.rollout import (HFEngine, batched_logprobs, completion_logits, completion_logprobs, completion_mask, left_pad,
                            make_engine, process_logits, prompt_groups)


def test_completion_mask_keeps_first_eos_and_drops_the_rest():
    mask, has_eos = completion_mask(torch.tensor([[5, 9, 9, 3], [9, 4, 4, 4], [5, 6, 7, 8]]), 9)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert has_eos.tolist() == [True, True, False]


def test_left_pad_aligns_prompts_on_the_right():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_chunked_logprobs_equal_naive_full_logits(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    B, P, C, T = 5, 4, 6, 0.7
    ids = torch.randint(0, 256, (B, P + C))
    attn = torch.ones_like(ids)
    attn[0, :2] = 0
    attn[3, :3] = 0
    logp, entropy = completion_logprobs(model, ids, attn, P, T, with_entropy=True)
    # naive: every position's full logits, one row at a time without padding
    for b in range(B):
        real = ids[b, attn[b].bool()]
        logits = model(input_ids=real[None]).logits[0] / T
        n_prompt = int(attn[b, :P].sum())
        lp = F.log_softmax(logits, -1)[n_prompt - 1 : -1].gather(-1, real[n_prompt:, None]).squeeze(-1)
        assert torch.allclose(logp[b], lp, atol=1e-5), b
        p = F.softmax(logits[n_prompt - 1 : -1], -1)
        assert torch.allclose(entropy[b], -(p * p.clamp_min(1e-30).log()).sum(-1), atol=1e-4)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.9), (1.5, 0.6)])
def test_trainer_logprobs_equal_sampler_logprobs(weak_model_dir, temperature, top_p):
    """Sampler and trainer score the same distribution, so the importance ratio of an on-policy batch is 1 at any
    temperature and top-p: under a nucleus the trainer renormalises over the top-p set as the sampler does (scored
    over the whole vocabulary, the ratio carried the kept mass as a bias: a mean log-ratio of -0.19 at top-p 0.6)."""
    model = AutoModelForCausalLM.from_pretrained(weak_model_dir)
    tok = AutoTokenizer.from_pretrained(weak_model_dir)
    engine = HFEngine(model, tok)
    prompts = [tok("Q:3+4+5\nA:")["input_ids"], tok("Hint:7+5=12\nQ:1+2\nA:")["input_ids"]]  # unequal lengths
    torch.manual_seed(0)
    ro = engine.generate(prompts, n=4, temperature=temperature, top_p=top_p, max_new_tokens=24, return_logprobs=True)
    assert ro.input_ids_BT.shape[0] == 8 and ro.prompt_len == max(map(len, prompts))
    trainer = batched_logprobs(model, ro, temperature=temperature, micro_batch_size=3, top_p=top_p)
    m = ro.completion_mask_BC.bool()
    assert m.sum() > 8
    assert (trainer - ro.sampler_logp_BC)[m].abs().max().item() < 1e-4
    if top_p < 1:  # the nucleus cut something on this batch, so the check above could fail
        full = batched_logprobs(model, ro, temperature=temperature, micro_batch_size=3)
        assert (full - ro.sampler_logp_BC)[m].min().item() < -1e-3


def test_nucleus_logprobs_gradient_is_the_renormalised_softmax():
    """Under top-p the gradient of log p(y) over the logits is onehot(y) - softmax over the nucleus (0 outside it),
    the derivative of the renormalised log-prob with the nucleus held fixed; and the drawn token is scored even at
    the nucleus's edge (another batching's rounding must not give it -inf)."""
    from common.rollout import token_logprobs

    z = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).requires_grad_()
    logp, _ = token_logprobs(z, torch.tensor([[1]]), top_p=0.75)
    logp.sum().backward()
    assert torch.allclose(z.grad, torch.tensor([[[-0.625, 0.625, 0.0, 0.0]]]))  # 1 - 0.3 / 0.8, -0.5 / 0.8
    edge, _ = token_logprobs(z.detach(), torch.tensor([[2]]), top_p=0.75)  # outside the nucleus: kept beside it
    assert torch.isfinite(edge).all() and abs(edge.exp().item() - 0.15 / 0.95) < 1e-6


@pytest.mark.parametrize("loop", [True, False], ids=["hf", "hf_generate"])
def test_engine_ignores_the_models_generation_config(weak_model_dir, loop):
    """A real model's generation_config (top_k, repetition penalty) must not change on-policy sampling."""
    model = AutoModelForCausalLM.from_pretrained(weak_model_dir)
    tok = AutoTokenizer.from_pretrained(weak_model_dir)
    model.generation_config.top_k = 1  # would make sampling greedy if it leaked through
    engine = HFEngine(model, tok, loop=loop)
    torch.manual_seed(0)
    ro = engine.generate([tok("Q:3+4+5\nA:")["input_ids"]], n=32, temperature=1.5, max_new_tokens=16)
    assert len(set(ro.texts)) > 1


def test_unknown_backend_and_missing_vllm_fail_clearly(tiny_model_dir):
    import importlib.util

    import pytest

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(SystemExit, match="unknown rollout backend"):
        make_engine(TrainArgs(rollout_backend="sglang"), model, tok)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(SystemExit, match="requirements-vllm-cpu.txt"):
            make_engine(TrainArgs(rollout_backend="vllm"), model, tok)


def _grouped_batch(G=4, C=5):
    """Three prompts of unequal length, G rows each, random completions: the layout engines return."""
    torch.manual_seed(1)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    ids_UP, mask_UP = left_pad(prompts, pad_id=0)
    ids = torch.cat([ids_UP.repeat_interleave(G, 0), torch.randint(1, 256, (3 * G, C))], 1)
    attn = torch.cat([mask_UP.repeat_interleave(G, 0), torch.ones(3 * G, C, dtype=torch.long)], 1)
    attn[1, -2:] = 0  # a row that ended early
    return ids, attn, ids_UP.shape[1]


def test_prompt_groups_finds_adjacent_runs():
    ids, attn, P = _grouped_batch()
    starts, counts = prompt_groups(ids[:, :P], attn[:, :P])
    assert starts.tolist() == [0, 4, 8] and counts.tolist() == [4, 4, 4]


def test_shared_prompt_logprobs_and_gradients_equal_full_forward(tiny_model_dir):
    """share_prompt=True (each prompt prefilled once, its cache repeated) gives the plain forward's log-probs and
    gradients up to rounding; it is off unless asked for."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, attn, L = _grouped_batch()

    def logp(share):
        logits = completion_logits(model, ids, attn, L, share_prompt=share).float() / 0.7
        return logits.gather(-1, ids[:, L:, None]).squeeze(-1) - logits.logsumexp(-1)

    shared, full = logp(True), logp(False)
    g_shared = torch.autograd.grad((shared * attn[:, L:]).sum(), list(model.parameters()))
    g_full = torch.autograd.grad((full * attn[:, L:]).sum(), list(model.parameters()))
    assert torch.allclose(shared, full, atol=1e-5)
    for a, b in zip(g_shared, g_full):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # the default is the plain forward, bit for bit
    assert torch.equal(completion_logprobs(model, ids, attn, L, 0.7)[0], full)


def test_sampling_loop_greedy_equals_model_generate(weak_model_dir):
    model = AutoModelForCausalLM.from_pretrained(weak_model_dir)
    tok = AutoTokenizer.from_pretrained(weak_model_dir)
    prompts = [tok(q)["input_ids"] for q in ["Q:3+4+5\nA:", "Q:1+2\nA:", "Hint:7+5=12\nQ:9+9+9+1\nA:"]]
    loop = HFEngine(model, tok, loop=True).generate(prompts, n=2, greedy=True, max_new_tokens=12)
    ref = HFEngine(model, tok, loop=False).generate(prompts, n=2, greedy=True, max_new_tokens=12)
    assert loop.texts == ref.texts and torch.equal(loop.input_ids_BT, ref.input_ids_BT)
    assert torch.equal(loop.completion_mask_BC, ref.completion_mask_BC)


def test_sampling_at_temperature_zero_is_a_clear_error_not_a_nan_inside_torch(weak_model_dir):
    model = AutoModelForCausalLM.from_pretrained(weak_model_dir)
    tok = AutoTokenizer.from_pretrained(weak_model_dir)
    for loop in (True, False):
        with pytest.raises(ValueError, match="temperature 0.0: sampling needs a temperature > 0"):
            HFEngine(model, tok, loop=loop).generate([tok("Q:1+2\nA:")["input_ids"]], temperature=0.0)


def test_sampling_loop_draws_from_the_model_distribution(weak_model_dir):
    """First-token frequencies over many samples match softmax(logits / T) (total variation)."""
    model = AutoModelForCausalLM.from_pretrained(weak_model_dir)
    tok = AutoTokenizer.from_pretrained(weak_model_dir)
    prompt = tok("Q:3+4+5+6\nA:")["input_ids"]
    with torch.no_grad():
        probs = F.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / 1.5, -1)
    torch.manual_seed(0)
    ro = HFEngine(model, tok).generate([prompt], n=4000, temperature=1.5, max_new_tokens=1)
    freq = torch.bincount(ro.completion_ids_BC[:, 0], minlength=len(probs)).float() / 4000
    assert 0.5 * (freq - probs).abs().sum() < 0.05
    assert (probs > 0.05).sum() >= 2  # a real choice, not a near-deterministic case


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = process_logits(logits, 1.0, 0.75).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.75 <= 0.5 + 0.3
    assert process_logits(logits, 1.0, 0.5).isfinite().tolist() == [[True, False, False, False]]
    assert process_logits(logits, 2.0, 1.0).isfinite().all()


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "generate"])
def test_padded_lm_head_rows_are_never_sampled(wide_head_model_dir, loop):
    from common.models import load_model, load_tokenizer

    tok = load_tokenizer(wide_head_model_dir)
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    ids_BT, mask_BT = left_pad(prompts, tok.pad_token_id)
    raw = AutoModelForCausalLM.from_pretrained(wide_head_model_dir)  # the fixture works: padded rows would win
    with torch.no_grad():
        logits_BTV = raw(input_ids=ids_BT, attention_mask=mask_BT).logits
    assert (logits_BTV[..., len(tok):].logsumexp(-1) - logits_BTV[..., : len(tok)].logsumexp(-1) > 5).all()

    engine = HFEngine(raw, tok, loop=loop)  # the sampler masks them itself, whoever loaded the model
    sampled = engine.generate(prompts, n=8, temperature=1.0, max_new_tokens=6, return_logprobs=True)
    greedy = engine.generate(prompts, n=1, greedy=True, max_new_tokens=6)
    for ro in (sampled, greedy):
        assert ro.completion_ids_BC.max().item() < len(tok)
    assert torch.isfinite(sampled.sampler_logp_BC).all()


def test_direct_opd_scores_the_sampled_vocabulary(wide_head_model_dir):
    """direct_opd normalises over the tokenizer's entries, the distribution the sampler drew from, and its loss
    path runs on a model whose LM head is wider than the tokenizer."""
    import tyro

    import direct_opd
    from common.models import load_model, load_tokenizer

    tok, model = load_tokenizer(wide_head_model_dir), load_model(wide_head_model_dir)
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    ro = HFEngine(model, tok).generate(prompts, n=2, max_new_tokens=6, return_logprobs=True)
    vocab, mask_BC = len(tok), ro.completion_mask_BC
    batch = dict(input_ids_BT=ro.input_ids_BT, attention_mask_BT=ro.attention_mask_BT, prompt_len=ro.prompt_len,
                 mask_BC=mask_BC, vocab=vocab)
    old_logp_BC, topk_ids_BCK, old_logp_BCK, mass_BC = direct_opd.batched_support_logprobs(model, batch, 1.0, 4, vocab,
                                                                                           k=4)
    assert torch.allclose(old_logp_BC * mask_BC, ro.sampler_logp_BC, atol=1e-4)
    assert (topk_ids_BCK < vocab).all() and (mass_BC <= 1 + 1e-5).all()
    args = tyro.cli(direct_opd.Args, args=["--top-k", "4"])
    batch.update(topk_ids_BCK=topk_ids_BCK, old_logp_BCK=old_logp_BCK, old_logp_BC=old_logp_BC,
                 ref_logp_BC=old_logp_BC, adv_BCK=torch.randn_like(old_logp_BCK) * mask_BC[..., None])
    loss, _ = direct_opd.micro_batch_loss(model, batch, torch.arange(4), args, mask_BC.sum().item(), 1.0)
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad is not None


def test_trainer_logprobs_normalise_over_the_sampled_vocabulary(wide_head_model_dir):
    """A trainer masks the padded head rows (common.models.mask_padded_head, one line after it loads the policy), so
    every forward (log-probs, entropies, reference and teacher scores) normalises over the entries the sampler draws
    from: the trainer's log-probs equal the sampler's."""
    from common.models import load_model, load_tokenizer, mask_padded_head

    tok, model = load_tokenizer(wide_head_model_dir), load_model(wide_head_model_dir)
    mask_padded_head(model, len(tok))
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    ro = HFEngine(model, tok).generate(prompts, n=4, temperature=0.7, max_new_tokens=6, return_logprobs=True)
    logp_BC, entropy_BC = completion_logprobs(model, ro.input_ids_BT, ro.attention_mask_BT, ro.prompt_len, 0.7,
                                              with_entropy=True)
    mask_BC = ro.completion_mask_BC
    assert torch.allclose(logp_BC * mask_BC, ro.sampler_logp_BC, atol=1e-4)
    assert torch.isfinite(entropy_BC).all() and (entropy_BC <= math.log(len(tok)) + 1e-4).all()


def test_grpo_runs_on_a_padded_head(tmp_path, wide_head_model_dir):
    """The whole loop on a model whose head is wider than its tokenizer: its entropy is over the tokenizer's
    entries (before the head mask, the padded rows held nearly all the mass and the entropy was far lower)."""
    import tyro

    import grpo
    from common.models import load_tokenizer

    out = grpo.main(tyro.cli(grpo.Args, args=[
        "--model-name", wide_head_model_dir, "--output-dir", str(tmp_path), "--total-steps", "2", "--num-prompts", "4",
        "--group-size", "4", "--num-eval-problems", "4", "--eval-samples", "0", "--eval-every", "0",
        "--beta", "0.01"]))  # a KL term: the update (and its entropy) runs even if every reward is 0
    entropy = [v for k, v in out["last"].items() if "entropy" in k]
    assert entropy and all(math.log(len(load_tokenizer(wide_head_model_dir))) - 0.5 < e < 5.6 for e in entropy), out


def test_completion_mask_stops_at_the_first_of_several_stop_ids():
    mask, has_stop = completion_mask(torch.tensor([[5, 7, 9, 3], [9, 4, 7, 4], [5, 6, 8, 8]]), [9, 7])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert has_stop.tolist() == [True, True, False]


def test_stop_set_is_the_tokenizer_eos_then_the_generation_configs(chat_config_model_dir, tiny_model_dir):
    from common.models import load_tokenizer

    tok = load_tokenizer(chat_config_model_dir)
    assert tok.stop_token_ids == [tok.eos_token_id, tok.pad_token_id]  # <|im_end|>, then <|endoftext|>
    one = load_tokenizer(tiny_model_dir)  # its generation_config.json lists the tokenizer's eos only
    assert one.stop_token_ids == [one.eos_token_id]


def _chat_model(path):
    from common.models import load_model, load_tokenizer

    tok, model = load_tokenizer(path), load_model(path)
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3*4=", add_special_tokens=False)["input_ids"]]
    return tok, model, prompts


@pytest.mark.parametrize("loop", [True, False], ids=["hf", "hf_generate"])
def test_engines_stop_at_every_eos_of_the_generation_config(chat_config_model_dir, loop):
    """The model emits the generation config's second eos id (not the tokenizer's) about half the time: rows end
    there, with that token in the loss and nothing after it, and the engine stops once every row has ended."""
    from conftest import assert_ends_at_first_stop

    tok, model, prompts = _chat_model(chat_config_model_dir)
    torch.manual_seed(0)
    ro = HFEngine(model, tok, loop=loop).generate(prompts, n=8, temperature=1.0, max_new_tokens=32)
    ended_on = assert_ends_at_first_stop(ro, [tok.eos_token_id, tok.pad_token_id], 32)  # generation_config's
    assert tok.pad_token_id in ended_on and (ro.lengths_B > 1).any()  # the second eos, after some tokens


@pytest.mark.parametrize("loop", [True, False], ids=["hf", "hf_generate"])
def test_sampler_logprobs_ignore_the_models_sampling_defaults(chat_config_model_dir, loop):
    """generation_config.json sets repetition_penalty 1.3, top_k 3 and min_p 0.2: the sampler still draws from the
    plain distribution at the temperature, so its log-probs are the trainer's; the model's config is left as is."""
    tok, model, prompts = _chat_model(chat_config_model_dir)
    torch.manual_seed(0)
    ro = HFEngine(model, tok, loop=loop).generate(prompts, n=8, temperature=1.3, max_new_tokens=32,
                                                  return_logprobs=True)
    trainer = batched_logprobs(model, ro, temperature=1.3, micro_batch_size=16)
    m = ro.completion_mask_BC.bool()
    assert m.sum() > 32 and (trainer - ro.sampler_logp_BC)[m].abs().max().item() < 1e-4
    assert (model.generation_config.repetition_penalty, model.generation_config.top_k) == (1.3, 3)


@pytest.mark.parametrize("loop", [True, False], ids=["hf", "hf_generate"])
def test_first_tokens_follow_the_plain_softmax_whatever_the_generation_config(chat_config_model_dir, loop):
    """4,000 first tokens: the second eos id comes at its softmax probability (about 0.5; standard error 0.008), and
    the rest is spread over many tokens (top_k 3 would leave at most 3 distinct tokens, min_p 0.2 only one)."""
    tok, model, prompts = _chat_model(chat_config_model_dir)
    with torch.no_grad():
        p_stop = F.softmax(model(input_ids=torch.tensor(prompts[:1])).logits[0, -1], -1)[tok.pad_token_id].item()
    torch.manual_seed(0)
    first = HFEngine(model, tok, loop=loop).generate(prompts[:1], n=4000, max_new_tokens=1).completion_ids_BC[:, 0]
    assert abs((first == tok.pad_token_id).float().mean().item() - p_stop) < 0.04, p_stop
    assert len(first.unique()) > 50


def test_vllm_settings_from_the_trainers_flags():
    from transformers import Qwen2Config

    from common.rollout import DEFAULT_PROMPT_BUDGET, vllm_settings

    config = Qwen2Config(max_position_embeddings=4096)
    s = vllm_settings(TrainArgs(max_new_tokens=100), config)
    assert (s["dtype"], s["max_model_len"], s["gpu_memory_utilization"]) == ("float32", DEFAULT_PROMPT_BUDGET + 100,
                                                                              0.3)
    assert vllm_settings(TrainArgs(device="cuda"), config)["dtype"] == "bfloat16"  # auto: bf16 on CUDA
    assert vllm_settings(TrainArgs(device="cuda", vllm_dtype="float32"), config)["dtype"] == "float32"
    assert vllm_settings(TrainArgs(dtype="float16"), config)["dtype"] == "float16"  # auto: --dtype on CPU
    assert vllm_settings(TrainArgs(max_prompt_tokens=300, max_new_tokens=100), config)["max_model_len"] == 400
    assert vllm_settings(TrainArgs(max_prompt_tokens=4000, max_new_tokens=1000), config)["max_model_len"] == 4096
    assert vllm_settings(TrainArgs(vllm_max_model_len=8192), config)["max_model_len"] == 8192  # as asked
