"""grpo.py's objective pinned to hand-computed values, and micro-batch invariance of its gradients."""

import math

import pytest
import torch

import grpo


def test_group_std_advantages_match_hand_computation():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv, zero = grpo.group_advantages(r, "group_std", 0.0)
    # group 2: mean 0.25, biased std sqrt(0.1875) = 0.4330
    s = math.sqrt(0.1875)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.allclose(adv[1], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]))
    assert zero.tolist() == [False, False]


def test_zero_std_group_gets_exactly_zero_and_is_counted():
    adv, zero = grpo.group_advantages(torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
                                      "group_std", 1e-6)
    assert adv[:2].abs().max().item() == 0.0
    assert zero.tolist() == [True, True, False]


def test_mean_only_and_batch_std_advantages():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv, _ = grpo.group_advantages(r, "group_mean", 1e-6)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    adv, _ = grpo.group_advantages(r, "batch_std", 0.0)
    batch_std = math.sqrt(0.1875)  # rewards 1, 0, 1, 1: mean 0.75
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / batch_std)


def test_kl_estimators_match_formulas():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = logp - ref  # 0.5, -1.0
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k3"), k3)
    assert torch.all(grpo.kl_penalty(logp, ref, "k3") >= 0) and torch.allclose(d, grpo.kl_penalty(logp, ref, "k1"))


def test_clipped_surrogate_uses_separate_low_and_high_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.1]]))  # ratios 1.5, 1.5, 0.5, 1.1
    adv = torch.tensor([1.0])
    loss, clipped = grpo.clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A > 0: min(rho, clip(rho)) -> 1.28 for rho 1.5; rho 0.5 -> 0.5 (the unclipped term is smaller); 1.1 -> 1.1
    assert torch.allclose(loss, -torch.tensor([[1.28, 1.28, 0.5, 1.1]]))
    assert clipped.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    loss, clipped = grpo.clipped_surrogate(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    # A < 0: -min(-rho, -clip(rho)) = max(rho, clip(rho)) -> 1.5, 1.5, 0.8, 1.1
    assert torch.allclose(loss, torch.tensor([[1.5, 1.5, 0.8, 1.1]]))
    assert clipped.tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_loss_aggregations_match_hand_computation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert grpo.aggregate(loss, mask, "token_mean", 4, 2, 3).item() == pytest.approx(10 / 4)
    assert grpo.aggregate(loss, mask, "seq_mean_token_mean", 4, 2, 3).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(loss, mask, "constant", 4, 2, 3).item() == pytest.approx(10 / 6)


def _grads_for_micro_batch(model_dir, micro, loss_agg, filter_rows):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    B, P, C = 6, 3, 5
    ids = torch.randint(0, 256, (B, P + C))
    attn = torch.ones(B, P + C, dtype=torch.long)
    attn[0, :2] = 0  # left padding in the prompt
    mask = torch.ones(B, C)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    attn[:, P:] = mask.long()
    if filter_rows:
        mask[4:] = 0
    batch = dict(input_ids_BT=ids, attention_mask_BT=attn, prompt_len=P, mask_BC=mask,
                 adv_B=torch.tensor([1.0, -0.5, 0.3, -1.2, 0.7, 0.0]),
                 old_logp_BC=-torch.rand(B, C) - 0.5, ref_logp_BC=-torch.rand(B, C) - 0.5)
    args = grpo.Args(loss_agg=loss_agg, beta=0.1, kl_estimator="k3", max_new_tokens=C)
    rows = torch.arange(B)
    norm = {"tokens": mask.sum().item(),
            "seqs": float((mask.sum(1) > 0).sum()) if loss_agg == "seq_mean_token_mean" else float(B)}
    total = 0.0
    for part in rows.split(micro):
        loss, _ = grpo.micro_batch_loss(model, batch, part, args, norm)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "constant"])
def test_gradients_do_not_depend_on_micro_batch_size(tiny_model_dir, loss_agg):
    full_loss, full = _grads_for_micro_batch(tiny_model_dir, 6, loss_agg, filter_rows=True)
    for micro in (1, 4):
        loss, grads = _grads_for_micro_batch(tiny_model_dir, micro, loss_agg, filter_rows=True)
        assert loss == pytest.approx(full_loss, rel=1e-5)
        for name, g in full.items():
            assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-4), name
