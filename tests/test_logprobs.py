"""common/rollout.py token_logprobs: the selective log-softmax in blocks gives the full-softmax log-probs, entropies
and gradients, and holds no float32 copies of the logits; common/models.py enable_gradient_checkpointing gives the
same gradients with fewer saved activations."""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_released_at_exit

from common import rollout
from common.models import PADDED_ROW_LOGIT, enable_gradient_checkpointing
from common.rollout import completion_logits, completion_logprobs, token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_token_logprobs(logits_BCV, targets_BC, temperature=1.0, with_entropy=False):
    """The formulas completion_logprobs used before (full-size float32 tensors), the entropy as -sum p log p: the
    reference."""
    z_BCV = logits_BCV.float() / temperature
    lse_BC = z_BCV.logsumexp(-1)
    logp_BC = z_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1) - lse_BC
    entropy_BC = None
    if with_entropy:
        with torch.no_grad():
            logp_BCV = z_BCV - lse_BC.unsqueeze(-1)
            entropy_BC = -(logp_BCV.exp() * logp_BCV).sum(-1)
    return logp_BC, entropy_BC


def _logits(B=3, C=12, V=1000, padded=0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits_BCV = torch.randn(B, C + 1, V, generator=g) * 3  # one extra position, sliced off as completion_logits does
    if padded:
        logits_BCV[..., V - padded:] = PADDED_ROW_LOGIT  # padded LM-head rows (common.models.mask_padded_head)
    targets_BC = torch.randint(0, V - padded, (B, C), generator=g)
    weights_BC = torch.randn(B, C, generator=g)  # an upstream gradient
    return logits_BCV.to(dtype), targets_BC, weights_BC


def _value_and_grad(fn, logits_BCV, targets_BC, weights_BC, temperature):
    leaf = logits_BCV.clone().requires_grad_(True)
    logp_BC, entropy_BC = fn(leaf[:, :-1], targets_BC, temperature, with_entropy=True)
    (logp_BC * weights_BC).sum().backward()
    return logp_BC.detach(), entropy_BC, leaf.grad


# blocks of whole rows, of several positions within a row, and of one position
@pytest.mark.parametrize("chunk", [2**22, 5000, 1], ids=["rows", "positions", "one_position"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("padded", [0, 24], ids=["plain_head", "padded_head"])
def test_token_logprobs_equal_the_full_softmax_in_float32(monkeypatch, chunk, temperature, padded):
    monkeypatch.setattr(rollout, "LOGPROB_CHUNK", chunk)
    logits_BCV, targets_BC, weights_BC = _logits(padded=padded)
    new = _value_and_grad(token_logprobs, logits_BCV, targets_BC, weights_BC, temperature)
    old = _value_and_grad(old_token_logprobs, logits_BCV, targets_BC, weights_BC, temperature)
    assert new[0].dtype == torch.float32 and new[1].dtype == torch.float32
    for a, b in zip(new, old):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert new[1].requires_grad is False
    if padded:  # no probability and no gradient on the padded rows; the entropy is over the real ones only
        assert (new[2][..., -padded:] == 0).all()
        assert (new[1] <= torch.log(torch.tensor(1000.0 - padded)) + 1e-5).all()


def test_token_logprobs_of_bfloat16_logits_compute_in_float32():
    """Under bf16 autocast the LM head returns bf16 logits: log-probs and entropy come out in float32 as before, the
    gradient in bf16 (the logits' dtype), equal to the old formulas' to bf16 rounding."""
    logits_BCV, targets_BC, weights_BC = _logits(padded=8, dtype=torch.bfloat16)
    new = _value_and_grad(token_logprobs, logits_BCV, targets_BC, weights_BC, 0.7)
    old = _value_and_grad(old_token_logprobs, logits_BCV, targets_BC, weights_BC, 0.7)
    assert new[0].dtype == torch.float32 and new[2].dtype == torch.bfloat16
    assert torch.allclose(new[0], old[0], atol=1e-5, rtol=0) and torch.allclose(new[1], old[1], atol=1e-5, rtol=0)
    assert torch.allclose(new[2].float(), old[2].float(), atol=1e-6, rtol=1e-2)


def test_entropy_is_finite_on_a_minus_inf_logit_and_precise_with_large_logits():
    """The entropy is -sum p log p, not lse - sum p z: a -inf logit (0 log 0 = 0) leaves it finite (the other form
    gave NaN), and logits near 100, where lse - sum p z cancels two numbers of that size, keep it within 5e-5 of
    float64's (measured 1.7e-5; the other form 4.2e-4)."""
    _, entropy_BC = token_logprobs(torch.tensor([[[0.0, 0.0, -torch.inf]]]), torch.tensor([[1]]), with_entropy=True)
    assert entropy_BC.item() == pytest.approx(0.693147, abs=1e-6)  # ln 2
    g = torch.Generator().manual_seed(0)
    z_BCV = torch.randn(4, 16, 5000, dtype=torch.float64, generator=g) * 3 + 100
    logp_BCV = z_BCV.log_softmax(-1)
    exact_BC = -(logp_BCV.exp() * logp_BCV).sum(-1)
    _, entropy_BC = token_logprobs(z_BCV.float(), torch.zeros(4, 16, dtype=torch.long), with_entropy=True)
    assert (entropy_BC.double() - exact_BC).abs().max() < 5e-5


def test_token_logprobs_gradient_passes_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr(rollout, "LOGPROB_CHUNK", 14)  # blocks of two positions
    g = torch.Generator().manual_seed(0)
    logits_BCV = torch.randn(2, 4, 7, dtype=torch.float64, generator=g)
    logits_BCV[..., -1] = PADDED_ROW_LOGIT
    logits_BCV.requires_grad_(True)
    targets_BC = torch.randint(0, 6, (2, 3), generator=g)
    fn = lambda x: token_logprobs(x[:, :-1], targets_BC, 0.7)[0]  # noqa: E731 - a strided view, as in the trainers
    assert fn(logits_BCV).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (logits_BCV,), eps=1e-6, atol=1e-6)


def test_completion_logprobs_values_and_gradients_equal_the_old_formulas(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    ids_BT = torch.randint(0, 256, (4, 14))
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[0, :3] = 0
    results = []
    for new in (True, False):
        model.zero_grad()
        if new:
            logp_BC, entropy_BC = completion_logprobs(model, ids_BT, attn_BT, 6, 0.7, with_entropy=True)
        else:
            logp_BC, entropy_BC = old_token_logprobs(completion_logits(model, ids_BT, attn_BT, 6), ids_BT[:, 6:], 0.7,
                                                     with_entropy=True)
        logp_BC.sum().backward()
        results.append([logp_BC.detach(), entropy_BC] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def _tiny_qwen2(vocab, dtype=torch.float32, tied=True, hidden=16):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg).to(dtype)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages that autograd saves for backward while `fn()` runs."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_completion_logprobs_saves_the_logits_once_in_their_own_dtype(dtype):
    """With V large beside the model, what completion_logprobs keeps for backward is about one copy of the logits
    (B x (C + 1) x V in the LM head's dtype): no float32 copy of bf16 logits (the old code saved one: 2x)."""
    B, L, C, V = 4, 8, 64, 8192
    model = _tiny_qwen2(V, dtype)
    ids_BT = torch.randint(0, V, (B, L + C))
    attn_BT = torch.ones_like(ids_BT)
    logits_bytes = B * (C + 1) * V * dtype.itemsize
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    saved = saved_bytes(lambda: completion_logprobs(model, ids_BT, attn_BT, L, 0.7, with_entropy=True))
    assert saved <= 1.2 * logits_bytes + weights_bytes, saved / logits_bytes


MEASURE = """
import ctypes, gc, json, sys
import torch
sys.path.insert(0, ROOT)
from common import rollout


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def peak(fn, B, C, V):
    leaf = torch.randn(B, C, V).requires_grad_(True)
    targets = torch.randint(0, V, (B, C))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the VmHWM peak
    logp, _ = fn(leaf, targets, 0.7, with_entropy=True)
    logp.sum().backward()
    return status("VmHWM") - base


torch.set_num_threads(1)
rollout.LOGPROB_CHUNK = 2**18
for fn in (rollout.token_logprobs, old_token_logprobs):  # page in the kernels' code first
    peak(fn, 2, 3, 8192)
B, C, V = 4, 256, 8192
print(json.dumps({"logits": B * C * V * 4, "chunk": rollout.LOGPROB_CHUNK * 4,
                  "new": peak(rollout.token_logprobs, B, C, V), "old": peak(old_token_logprobs, B, C, V)}))
"""


def test_token_logprobs_peak_memory_is_one_gradient_not_float32_copies():
    """Peak resident memory of forward + backward on 32 MB of float32 logits, in a fresh process (freed buffers go
    back to the system at once): one tensor of the logits' size (their gradient, which the caller keeps) and a block
    or two, where the old formulas held about five."""
    code = f"ROOT = {ROOT!r}\n" + inspect.getsource(old_token_logprobs) + MEASURE
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["new"] <= 1.1 * m["logits"] + 4 * m["chunk"], m
    assert m["old"] > 3 * m["logits"], m  # the measurement sees the old code's copies


def _gradients(model, ids_BT, attn_BT, L):
    model.zero_grad(set_to_none=True)
    logp_BC, _ = completion_logprobs(model, ids_BT, attn_BT, L, 0.7)
    logp_BC.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False))


def _testbed_tiny(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _peft_tiny(path):
    from common.models import add_lora

    torch.manual_seed(2)  # the random LoRA B (init_lora_weights=False), the same for both models
    return add_lora(_testbed_tiny(path), ["default"], 4, 8, ["q_proj", "v_proj"], init_lora_weights=False)


@pytest.mark.parametrize("build", ["testbed_tiny", "llama", "peft"])
def test_gradient_checkpointing_gives_the_same_gradients_and_saves_less(build, tiny_model_dir):
    """--gradient-checkpointing: the same log-probs' gradients (float tolerance) in train mode, with far fewer
    bytes saved for backward (the decoder layers' inputs only); on a peft model only the LoRA tensors get gradients."""
    make = {"testbed_tiny": lambda: _testbed_tiny(tiny_model_dir), "llama": _tiny_llama,
            "peft": lambda: _peft_tiny(tiny_model_dir)}[build]
    torch.manual_seed(1)
    ids_BT = torch.randint(0, 256, (3, 40))
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[1, :5] = 0
    plain = make().train()
    want = _gradients(plain, ids_BT, attn_BT, 10)
    plain_saved = saved_bytes(lambda: completion_logprobs(plain, ids_BT, attn_BT, 10, 0.7))
    ckpt = make().train()
    enable_gradient_checkpointing(ckpt)
    got = _gradients(ckpt, ids_BT, attn_BT, 10)
    ckpt_saved = saved_bytes(lambda: completion_logprobs(ckpt, ids_BT, attn_BT, 10, 0.7))
    assert want.keys() == got.keys() and want
    if build == "peft":
        assert all("lora_" in n for n in got)
    for n in want:
        assert torch.allclose(want[n], got[n], atol=1e-6, rtol=1e-5), n
    assert ckpt_saved < 0.6 * plain_saved, (ckpt_saved, plain_saved)


def test_gradient_checkpointing_leaves_no_grad_log_probs_and_generation_alone(tiny_model_dir):
    """batched_logprobs (no grad, train mode) and the HF sampling loop (eval mode, KV cache) give the same results
    with checkpointing on."""
    from common.models import load_tokenizer
    from common.rollout import HFEngine, batched_logprobs

    tok = load_tokenizer(tiny_model_dir)
    outs = []
    for ckpt in (False, True):
        model = _testbed_tiny(tiny_model_dir).train()
        if ckpt:
            enable_gradient_checkpointing(model)
        torch.manual_seed(0)
        ro = HFEngine(model, tok).generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=6, return_logprobs=True)
        outs.append((ro.input_ids_BT, ro.sampler_logp_BC, batched_logprobs(model, ro, 1.0, 3), model.training))
    (ids_a, s_a, lp_a, train_a), (ids_b, s_b, lp_b, train_b) = outs
    assert torch.equal(ids_a, ids_b) and torch.allclose(s_a, s_b, atol=1e-6) and torch.allclose(lp_a, lp_b, atol=1e-6)
    assert train_a and train_b


def test_gradient_checkpointing_under_fsdp_gives_the_plain_update(tmp_path):
    """Enabled before shard_models, checkpointing works inside FSDP2's layer units (2 ranks, gloo): the step equals
    the unsharded one and fewer activations are saved."""
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "tests/fsdp_checkpointing_check.py", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert_released_at_exit(r)
    res = json.loads(out.read_text())
    plain, ckpt = res["checkpointing=False"], res["checkpointing=True"]
    assert plain["max_diff"] < 1e-6 and ckpt["max_diff"] < 1e-6, res
    assert ckpt["saved"] < 0.6 * plain["saved"], res
