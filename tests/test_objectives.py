"""grpo.py's objective pinned to hand-computed values (advantages, KL, clip, aggregation, normalisers, the sampler's
importance weight), micro-batch invariance of its gradients, and its copies in the other trainers."""

import math

import pytest
import torch

import grpo
from common import rollout


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
    logp, ref, ones = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), torch.ones(2)
    d = logp - ref  # 0.5, -1.0
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k1", ones), torch.tensor([0.5, -1.0]))
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k2", ones), torch.tensor([0.125, 0.5]))
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    assert torch.allclose(grpo.kl_penalty(logp, ref, "k3", ones), k3)
    assert torch.all(grpo.kl_penalty(logp, ref, "k3", ones) >= 0)
    assert torch.allclose(d, grpo.kl_penalty(logp, ref, "k1", ones))


@pytest.mark.parametrize("module", ["grpo", "oc_grpo", "adakp", "rlpf", "direct_opd"])
def test_k3_kl_is_finite_at_padding(module):
    """A padded position: the reference log-prob is 0 there (batched_logprobs masks it) and the policy's log-prob of
    the pad token can be -100, so exp(-d) overflows; masked before the exponential it is 0, and so is its gradient."""
    import importlib

    trainer = importlib.import_module(module)
    logp = torch.tensor([[-1.0, -100.0]], requires_grad=True)
    ref, mask = torch.tensor([[-1.5, 0.0]]), torch.tensor([[1.0, 0.0]])
    kl = trainer.kl_penalty(logp, ref, "k3", mask)
    assert torch.isfinite(kl).all() and kl[0, 1] == 0
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    (kl * mask).sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


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
    # normalisers: 4 tokens, 2 sequences with tokens, 2 sequences, max_new_tokens 3
    assert grpo.aggregate(loss, mask, "token_mean", 4, 2, 2, 3).item() == pytest.approx(10 / 4)
    assert grpo.aggregate(loss, mask, "seq_mean_token_mean", 4, 2, 2, 3).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(loss, mask, "constant", 4, 2, 2, 3).item() == pytest.approx(10 / 6)
    # an empty sequence counts in the constant normaliser, not in the per-sequence mean
    loss3, mask3 = torch.cat([loss, torch.zeros(1, 3)]), torch.cat([mask, torch.zeros(1, 3)])
    assert grpo.aggregate(loss3, mask3, "seq_mean_token_mean", 4, 2, 3, 3).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(loss3, mask3, "constant", 4, 2, 3, 3).item() == pytest.approx(10 / 9)


def test_minibatch_counts_are_tokens_nonempty_sequences_and_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert grpo.minibatch_counts(mask) == (3.0, 2.0, 3.0)  # one process: nothing to sum over ranks


def test_tis_weights_truncate_per_token_and_per_sequence():
    p = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.1, 0.2, 0.3]]))
    q = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.2, 0.4, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the 3x ratio of row 0 is masked out
    tok = rollout.tis_weights(p, q, mask, "token", 1.5)
    assert torch.allclose(tok, torch.tensor([[1.5, 1.0, 1.0], [0.5, 0.5, 1.0]]))
    seq = rollout.tis_weights(p, q, mask, "sequence", 1.5)  # row 0: 2 x 1 -> 1.5; row 1: 0.5 x 0.5 x 1
    assert torch.allclose(seq, torch.tensor([[1.5] * 3, [0.25] * 3]))
    assert torch.equal(rollout.tis_weights(p, q, mask, "none", 1.5), torch.ones(2, 3))


def test_sampler_correction_gives_token_sums_the_trainers_divide_by_their_tokens():
    p = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.1, 0.2, 0.3]]))
    q = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.2, 0.4, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # 5 tokens
    w, stats = rollout.sampler_correction(p, q, mask, "token", 1.5)
    assert torch.equal(w, rollout.tis_weights(p, q, mask, "token", 1.5))
    assert abs(stats["rollout/tis_weight_mean"] - (1.5 + 1.0 + 0.5 + 0.5 + 1.0)) < 1e-6  # a sum over the 5 tokens
    d = torch.tensor([0.5, 1.0, 2.0, 2.0, 1.0]).log()  # log q - log p on the 5 tokens
    assert abs(stats["rollout/mismatch_k1"] - d.sum().item()) < 1e-5
    assert abs(stats["rollout/mismatch_k3"] - (torch.expm1(-d) + d).sum().item()) < 1e-5


def test_sampler_mismatch_hand_values_and_zero_for_the_trainer_itself():
    # sampler log q, trainer log p on two real tokens and one masked one
    q = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    p = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    _, m = rollout.sampler_correction(p, q, torch.tensor([[1.0, 1.0, 0.0]]), "none", 2.0)
    d = torch.tensor([math.log(2.0), 0.0])  # log q - log p
    assert m["rollout/mismatch_k1"] == pytest.approx(d.sum().item(), abs=1e-6)
    assert m["rollout/mismatch_k3"] == pytest.approx((torch.expm1(-d) + d).sum().item(), abs=1e-6)  # 0.5 - 1 + ln 2
    _, m = rollout.sampler_correction(p, p, torch.ones(1, 3), "token", 2.0)
    assert m == {"rollout/mismatch_k1": 0.0, "rollout/mismatch_k3": 0.0, "rollout/tis_weight_mean": 3.0}


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
    counts = grpo.minibatch_counts(mask)
    total = 0.0
    for part in rows.split(micro):
        loss, _ = grpo.micro_batch_loss(model, batch, part, args, counts)
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


# ----------------------------------------------------------------------------------------
# The copies of these functions in the other trainers: equal to grpo.py's wherever they are meant to be, and
# every difference marked in the source ("# differs from grpo.py: ...") and showing exactly where stated.
# ----------------------------------------------------------------------------------------

import ast  # noqa: E402
import inspect  # noqa: E402
import textwrap  # noqa: E402

import adakp  # noqa: E402
import direct_opd  # noqa: E402
import mada_rl  # noqa: E402
import oc_grpo  # noqa: E402
import ppo_slm  # noqa: E402
import rlpf  # noqa: E402
import rloo_sec  # noqa: E402

COPIES = [  # (name in grpo.py, module, its name there)
    ("group_advantages", oc_grpo, "group_advantages"), ("group_advantages", direct_opd, "group_advantages"),
    ("kl_penalty", oc_grpo, "kl_penalty"), ("kl_penalty", direct_opd, "kl_penalty"),
    ("clipped_surrogate", rloo_sec, "clipped_surrogate"), ("clipped_surrogate", oc_grpo, "clipped_surrogate"),
    ("clipped_surrogate", direct_opd, "topk_clipped_surrogate"), ("clipped_surrogate", ppo_slm, "ppo_loss"),
    ("aggregate", rloo_sec, "aggregate"), ("aggregate", oc_grpo, "aggregate"), ("aggregate", direct_opd, "aggregate"),
    *[("minibatch_counts", m, "minibatch_counts") for m in (oc_grpo, rloo_sec, adakp, direct_opd, mada_rl, rlpf)],
]
MARK = "# differs from grpo.py"


def _code(fn) -> str:
    """The function's code without its docstring and comments."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    return "\n".join(ast.dump(node) for node in tree.body)


@pytest.mark.parametrize("name, module, copy", COPIES, ids=[f"{m.__name__}.{c}" for _, m, c in COPIES])
def test_copies_that_differ_from_grpo_say_so(name, module, copy):
    fn = getattr(module, copy)
    same = copy == name and _code(fn) == _code(getattr(grpo, name))
    assert (MARK in inspect.getsource(fn)) == (not same), f"{module.__name__}.{copy}: mark it iff it differs"


def test_oc_grpo_and_adakp_share_the_context_shift_weights_statistics():
    assert _code(oc_grpo.weight_metrics) == _code(adakp.weight_metrics)


SETUP_LINES = """\
    args.batch_size = args.num_prompts * args.group_size  # rollouts per step (per rank)
    args.minibatch_size = args.batch_size // args.num_minibatches  # rollouts per optimizer step (check_run_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
"""


@pytest.mark.parametrize("module", [grpo, oc_grpo, rloo_sec, adakp, direct_opd, rlpf], ids=lambda m: m.__name__)
def test_batch_sizes_optimizer_and_warmup_are_grpos_lines(module):
    """The step's sizes, AdamW and its warm-up are written out in each trainer, the same lines as grpo.py's."""
    assert SETUP_LINES in inspect.getsource(module)


def _inputs():
    g = torch.Generator().manual_seed(0)
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 0.0, 0.0]])
    logp_BC = -torch.rand(4, 6, generator=g) * 3
    old_BC = logp_BC + torch.randn(4, 6, generator=g) * 0.4
    old_BC[0, 0] = logp_BC[0, 0] + 30.0  # a ratio of e^-30, outside direct_opd's clamp of the log-ratio
    old_BC[1, 0] = logp_BC[1, 0] - 2.0  # a ratio of e^2 > 3 with a negative advantage: direct_opd's dual clip
    ref_BC = logp_BC + torch.linspace(-4, 4, 24).view(4, 6)  # d = logp - ref in [-4, 4]: k3 up to e^4 - 5 = 49.6
    adv_B = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask_BC = (torch.rand(4, 6, generator=g) > 0.3).float()
    return rewards_PG, logp_BC, old_BC, ref_BC, adv_B, mask_BC


def test_group_advantages_agree():
    r = _inputs()[0]
    for mode in ("group_std", "group_mean", "batch_std"):
        a, z = grpo.group_advantages(r, mode, 1e-6)
        b, y = oc_grpo.group_advantages(r, mode, 1e-6)
        assert torch.equal(a, b) and torch.equal(z, y), mode
    a, z = grpo.group_advantages(r, "group_std", 1e-6)
    b, y = direct_opd.group_advantages(r, 1e-6)  # marked: group_std only
    assert torch.equal(a, b) and torch.equal(z, y)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_agrees_except_direct_opds_k3_clamp(estimator):
    _, logp, _, ref, _, _ = _inputs()
    mask = torch.ones_like(logp)
    want = grpo.kl_penalty(logp, ref, estimator, mask)
    assert torch.equal(oc_grpo.kl_penalty(logp, ref, estimator, mask), want)
    got = direct_opd.kl_penalty(logp, ref, estimator, mask)
    if estimator != "k3":
        assert torch.equal(got, want)
    else:  # marked: clamped to [-10, 10], and equal wherever the estimate is inside that range
        assert (want > 10).any()
        assert torch.equal(got, want.clamp(-10, 10))
        assert torch.equal(got[want <= 10], want[want <= 10])


@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.2), (0.2, 0.28)])
def test_clipped_surrogate_agrees(clip_low, clip_high):
    _, logp, old, _, adv, mask = _inputs()
    want, want_clip = grpo.clipped_surrogate(logp, old, adv, clip_low, clip_high)
    for got, clip in (rloo_sec.clipped_surrogate(logp, old, adv, clip_low, clip_high),
                      oc_grpo.clipped_surrogate(logp, old, adv[:, None].expand_as(logp), clip_low, clip_high)):
        assert torch.equal(got, want) and torch.equal(clip, want_clip)
    # direct_opd (marked): per top-K entry (K = 1 here); the log-ratio clamp and the dual clip (c = 3) where A < 0
    got, clip = direct_opd.topk_clipped_surrogate(logp[..., None], old[..., None], adv[:, None, None].expand(4, 6, 1),
                                                  clip_low, clip_high, 3.0)
    got, clip = got[..., 0], clip[..., 0]
    ratio = torch.exp(logp - old)
    adv_BC = adv[:, None].expand_as(logp)
    dual = (adv_BC < 0) & (want > -adv_BC * 3.0)
    clamped = (logp - old).abs() > 20
    assert dual.any() and clamped.any()
    plain = ~dual & ~clamped
    assert torch.allclose(got[plain], want[plain], rtol=1e-6, atol=0) and torch.equal(clip[plain], want_clip[plain])
    assert torch.allclose(got[dual], (-adv_BC * 3.0)[dual])
    small = torch.exp(torch.tensor(-20.0))  # the ratio e^-30 counts as e^-20
    assert torch.allclose(got[clamped], torch.maximum(-adv_BC * small, -adv_BC * small.clamp(1 - clip_low))[clamped])
    assert ratio[clamped].max() < small


def test_ppo_slm_policy_loss_is_grpos_surrogate():
    """ppo_slm's policy term is grpo.py's clipped surrogate with one clip range, summed over tokens / tokens;
    its policy/clip_frac (marked) is TRL's |rho - 1| > eps."""
    _, logp, old, _, adv, mask = _inputs()
    adv_BC = adv[:, None] * torch.linspace(0.5, 1.5, 6)  # per-token advantages (GAE)
    values = torch.zeros_like(logp)
    batch = dict(mask_BC=mask, adv_BC=adv_BC, returns_BC=values, values_BC=values, old_logp_BC=old)
    args = ppo_slm.Args(clip_range=0.2)
    n_tok = mask.sum().item()
    loss, stats = ppo_slm.ppo_loss(logp, values, batch, torch.arange(4), args, n_tok)
    want, want_clip = oc_grpo.clipped_surrogate(logp, old, adv_BC, 0.2, 0.2)
    assert loss.item() == pytest.approx((want * mask).sum().item() / n_tok, rel=1e-6)
    trl_clip = ((torch.exp(logp - old) - 1).abs() > 0.2).float()
    assert stats["policy/clip_frac"] == pytest.approx((trl_clip * mask).sum().item())
    assert (trl_clip * mask).sum() > (want_clip * mask).sum()  # the two definitions differ on these inputs


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "constant"])
def test_aggregate_agrees(mode):
    _, logp, _, _, _, mask = _inputs()
    want = grpo.aggregate(logp, mask, mode, 17.0, 3.0, 4.0, 6)
    assert torch.equal(oc_grpo.aggregate(logp, mask, mode, 17.0, 3.0, 4.0, 6), want)
    assert torch.equal(rloo_sec.aggregate(logp, mask, mode, 17.0, 3.0, 4.0, 6), want)
    if mode == "token_mean":  # direct_opd (marked): token_mean only
        assert torch.equal(direct_opd.aggregate(logp, mask, 17.0), want)
    # rloo_sec's extra mode (marked): sum over tokens and sequences / sequences
    assert rloo_sec.aggregate(logp, mask, "seq_sum", 17.0, 3.0, 4.0, 6).item() == pytest.approx(
        (logp * mask).sum().item() / 4.0)
