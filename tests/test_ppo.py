"""The policy losses: the decoupled PPO loss by hand, GSPO and CISPO against references written from their
papers, the behaviour-weight range, the aggregations over micro-batches, invariances; the KL penalty."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.ppo import aggregate, decoupled_ppo_loss, kl_penalty, policy_token_losses


def one_token(logp, prox, behav, adv, **kw):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    lp = t(logp).requires_grad_()
    loss, stats = decoupled_ppo_loss(lp, t(prox), t(behav), t(adv), torch.ones(1, dtype=torch.bool), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), stats


# ratio u = exp(logp - prox); w = exp(prox - behav); eps = 0.2
@pytest.mark.parametrize(
    "u, adv, loss, grad, clipped",
    [
        # inside the trust region: loss = -u * A, d/dlogp = -u * A
        (1.1, 2.0, -2.2, -2.2, False),
        (0.9, -1.0, 0.9, 0.9, False),
        # A > 0 and u above 1 + eps: the clipped term (1.2 * A) is smaller: clipped, no gradient
        (1.5, 2.0, -2.4, 0.0, True),
        # A > 0 and u below 1 - eps: min picks u * A (the pessimistic one): not clipped
        (0.5, 2.0, -1.0, -1.0, False),
        # A < 0 and u below 1 - eps: clip(u) * A = 0.8 * -1 is smaller: clipped, no gradient
        (0.5, -1.0, 0.8, 0.0, True),
        # A < 0 and u above 1 + eps: u * A is smaller: not clipped, gradient -u * A
        (1.5, -1.0, 1.5, 1.5, False),
    ],
)
def test_standard_ppo_by_hand(u, adv, loss, grad, clipped):
    prox = -1.3
    value, g, stats = one_token(prox + math.log(u), prox, prox, adv)
    assert value == pytest.approx(loss)
    assert g == pytest.approx(grad)
    assert stats["clip_frac"].item() == (1.0 if clipped else 0.0)
    assert stats["behav_weight_mean"].item() == pytest.approx(1.0)


def test_behaviour_weight_scales_and_asymmetric_clip():
    # w = exp(0.5) multiplies the whole token loss; eps_high = 0.28 moves the upper edge.
    prox, behav = -1.0, -1.5
    w = math.exp(0.5)
    value, g, stats = one_token(prox + math.log(1.25), prox, behav, 1.0, eps_clip_high=0.28)
    assert value == pytest.approx(-w * 1.25) and g == pytest.approx(-w * 1.25)  # 1.25 < 1.28: inside
    value, g, stats = one_token(prox + math.log(1.25), prox, behav, 1.0)
    assert value == pytest.approx(-w * 1.2) and g == 0.0  # 1.25 > 1.2: clipped
    assert stats["behav_weight_max"].item() == pytest.approx(w)
    # lower edge with eps = 0.1 and A < 0
    value, g, _ = one_token(prox + math.log(0.85), prox, behav, -2.0, eps_clip=0.1)
    assert value == pytest.approx(w * 0.9 * 2.0) and g == 0.0


def test_cap_zeroes_tokens_but_keeps_the_denominator():
    f = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    logp = f([-1.0, -1.0, -1.0, -1.0])
    prox = f([-1.0, -1.0, -1.0, -1.0])
    behav = f([-1.0, -4.0, -1.0, 0.0])  # w = 1, e^3 (capped), 1, e^-1
    adv = f([1.0, 1.0, 2.0, 1.0])
    mask = torch.tensor([1, 1, 1, 1])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=5.0)
    assert loss.item() == pytest.approx(-(1.0 + 0.0 + 2.0 + math.exp(-1)) / 4)
    assert stats["behav_masked_frac"].item() == pytest.approx(0.25)
    assert stats["behav_weight_max"].item() == pytest.approx(math.exp(3))
    # Without the cap the token counts with its weight.
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx(-(1.0 + math.exp(3) + 2.0 + math.exp(-1)) / 4)


def test_equals_standard_ppo_when_behav_is_prox():
    torch.manual_seed(0)
    logp, prox, adv = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64), torch.randn(64)
    mask = torch.rand(64) < 0.7
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask)
    ratio = torch.exp(logp - prox)
    a = adv.double()
    reference = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)[mask].mean()
    assert loss.item() == pytest.approx(reference.item())
    assert stats["behav_weight_mean"].item() == pytest.approx(1.0)


def test_gradcheck():
    torch.manual_seed(1)
    n = 24
    # Keep ratios away from the clip edges, where the objective has kinks.
    prox = torch.randn(n, dtype=torch.float64)
    offsets = torch.tensor([-0.6, -0.1, 0.05, 0.5] * (n // 4), dtype=torch.float64)
    logp = (prox + offsets).requires_grad_()
    behav = prox + 0.3 * torch.randn(n, dtype=torch.float64)
    adv = torch.randn(n, dtype=torch.float64)
    mask = torch.rand(n) < 0.8

    def f(lp):
        return decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_high=0.3, behav_weight_cap=1.3)[0]

    assert torch.autograd.gradcheck(f, (logp,))


def test_garbage_outside_the_mask_is_ignored_even_in_the_gradient():
    logp = torch.tensor([-1.0, 80.0, -0.5], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([-1.0, -900.0, -0.5], dtype=torch.float64)
    behav = torch.tensor([-1.2, 900.0, -0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, float("nan"), -1.0], dtype=torch.float64)
    mask = torch.tensor([True, False, True])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[1] == 0
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_empty_mask_gives_zero_not_nan():
    x = torch.zeros(3, requires_grad=True)
    loss, stats = decoupled_ppo_loss(x, x.detach(), x.detach(), torch.ones(3), torch.zeros(3))
    loss.backward()
    assert loss.item() == 0.0 and stats["n_tokens"].item() == 0 and x.grad.abs().sum() == 0


def test_micro_batch_sums_equal_the_full_mean():
    torch.manual_seed(2)
    n = 40
    logp = torch.randn(n, dtype=torch.float64, requires_grad=True)
    prox = logp.detach() + 0.2 * torch.randn(n, dtype=torch.float64)
    behav = prox + 0.2 * torch.randn(n, dtype=torch.float64)
    adv = torch.randn(n, dtype=torch.float64)
    mask = torch.rand(n) < 0.6
    full, full_stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    (full_grad,) = torch.autograd.grad(full, logp)

    cuts = [0, 3, 25, 40]  # unequal micro-batches
    n_total = int(mask.sum())
    total, stats = 0.0, []
    for a, b in zip(cuts, cuts[1:]):
        s, st_ = decoupled_ppo_loss(logp[a:b], prox[a:b], behav[a:b], adv[a:b], mask[a:b], reduction="sum")
        total = total + s / n_total
        stats.append(st_)
    (acc_grad,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item())
    assert torch.allclose(acc_grad, full_grad)
    # the stats combine over micro-batches as trainer/step.py sums them: means weighted by n_tokens
    n_mb = [float(st["n_tokens"]) for st in stats]
    for key in ("clip_frac", "behav_weight_mean", "behav_masked_frac"):
        merged = sum(float(st[key]) * k for st, k in zip(stats, n_mb)) / n_total
        assert merged == pytest.approx(full_stats[key].item())
    assert max(float(st["behav_weight_max"]) for st in stats) == pytest.approx(full_stats["behav_weight_max"].item())
    assert sum(n_mb) == n_total


def test_half_precision_inputs_compute_in_float32():
    x = torch.full((4,), -1.0, dtype=torch.bfloat16)
    loss, _ = decoupled_ppo_loss(x, x, x, torch.ones(4, dtype=torch.bfloat16), torch.ones(4))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-1.0)


def test_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        decoupled_ppo_loss(x, x, x, torch.zeros(4), x)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(x, x, x, x, x, eps_clip=0.0)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(x, x, x, x, x, reduction="none")


# --- properties -------------------------------------------------------------------------------

floats = st.floats(-3.0, 3.0, allow_nan=False)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 16))
    col = lambda: torch.tensor(draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64)  # noqa: E731
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return col(), col(), col(), col(), mask


@settings(max_examples=100, deadline=None)
@given(batch=batches(), junk=st.lists(st.floats(-1e4, 1e4), min_size=4, max_size=4), cap=st.sampled_from([None, 2.0]))
def test_tokens_outside_the_mask_change_nothing(batch, junk, cap):
    logp, prox, behav, adv, mask = batch
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=cap)
    out = ~mask
    changed = [t.clone() for t in (logp, prox, behav, adv)]
    for t, j in zip(changed, junk):
        t[out] = j
    loss2, stats2 = decoupled_ppo_loss(*changed, mask, behav_weight_cap=cap)
    assert loss2.item() == loss.item()
    for key in stats:
        assert stats2[key].item() == stats[key].item()


@settings(max_examples=100, deadline=None)
@given(batch=batches(), scale=st.floats(0.01, 100.0), cap=st.sampled_from([None, 2.0]))
def test_scaling_the_advantages_scales_the_loss(batch, scale, cap):
    # min(u A, clip(u) A) is positively homogeneous in A, and so is the loss.
    logp, prox, behav, adv, mask = batch
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=cap)
    scaled, _ = decoupled_ppo_loss(logp, prox, behav, adv * scale, mask, behav_weight_cap=cap)
    assert scaled.item() == pytest.approx(scale * loss.item(), rel=1e-9, abs=1e-9)


def test_kl_penalty_is_zero_at_the_reference_and_has_the_formulas_gradient():
    """k3: exp(d) - d - 1 with d = ref - logp, its mean over the mask; gradient (1 - exp(d)) / |mask|."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(3, 7, generator=g) > 0.3
    same = logp.clone().requires_grad_(True)
    at_ref = kl_penalty(same, logp, mask)
    at_ref.backward()
    assert at_ref.item() == 0.0 and same.grad.abs().max().item() == 0.0  # step 0: policy == reference

    ref = logp + torch.randn(3, 7, generator=g, dtype=torch.float64)
    ref[~mask] = 1e4  # outside the mask: ignored, even where exp would overflow
    x = logp.clone().requires_grad_(True)
    kl = kl_penalty(x, ref, mask)
    kl.backward()
    d = (ref - logp)[mask]
    assert kl.item() == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-12) and kl.item() > 0
    want = torch.zeros_like(logp)
    want[mask] = (1 - d.exp()) / mask.sum()
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=0)
    assert kl_penalty(x, ref, torch.zeros_like(mask)).item() == 0.0  # empty mask


# --- GSPO, CISPO, the two-sided behaviour range, the aggregations --------------------------------------


def random_sequences(seed: int, lengths=(5, 1, 9, 4, 7), spread=0.4):
    """Packed sequences whose ratios cross both clip edges: (logp, prox, behav, adv, mask, seq_ids), float64."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = prox + spread * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)
    behav = prox + 0.5 * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.8
    mask[0] = mask[5] = True  # the one-token sequence counts
    return logp, prox, behav, adv, mask, seq_ids


def loss_of(kind, agg, logp, prox, behav, adv, mask, seq_ids, seq_tokens=None, **kw):
    x = logp.clone().requires_grad_()
    losses, stats = policy_token_losses(x, prox, behav, adv, mask, seq_ids, policy_loss=kind, **kw)
    total, count = aggregate(losses, mask, seq_ids, agg, seq_tokens)
    loss = total / count.clamp(min=1)
    loss.backward()
    return loss.item(), x.grad, stats


def sequences(seq_ids, mask):
    """Each sequence's loss-mask token indices (plain Python lists)."""
    out = {}
    for t, (i, m) in enumerate(zip(seq_ids.tolist(), mask.tolist())):
        if m:
            out.setdefault(i, []).append(t)
    return list(out.values())


@pytest.mark.parametrize("seed", range(4))
def test_gspo_is_the_papers_sequence_level_objective(seed):
    """GSPO (arXiv 2507.18071, Eq. 5-7) with one advantage per sequence and behav == prox:
    J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), written per
    sequence with the gradient through s_i itself; equal in value and gradient to the token form."""
    logp, prox, _, adv, mask, seq_ids = random_sequences(seed, spread=0.02)
    seq_adv = torch.randn(int(seq_ids.max()) + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    adv = seq_adv[seq_ids]
    eps, eps_high = 0.004, 0.003
    x = logp.clone().requires_grad_()
    terms = []
    for idx in sequences(seq_ids, mask):
        s_i = torch.exp((x[idx] - prox[idx]).sum() / len(idx))
        a = adv[idx[0]]
        terms.append(-torch.minimum(s_i * a, torch.clamp(s_i, 1 - eps, 1 + eps_high) * a))
    reference = torch.stack(terms).mean()
    reference.backward()
    value, grad, stats = loss_of(
        "gspo", "seq_mean_token_mean", logp, prox, prox, adv, mask, seq_ids, eps_clip=eps, eps_clip_high=eps_high
    )
    assert value == pytest.approx(reference.item(), rel=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-14)
    assert 0 < stats["clip_frac"].item() < 1, "the draw crosses the clip edges"


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_form_with_stale_tokens(seed):
    """GSPO-token (the paper's Eq. 13-14) in the decoupled form: token t's ratio has the value s_i and the
    gradient s_i * dlogp_t, its loss is scaled by its behaviour weight; written token by token."""
    logp, prox, behav, adv, mask, seq_ids = random_sequences(seed, spread=0.3)
    eps = 0.05
    grad = torch.zeros_like(logp)
    total, seqs = 0.0, sequences(seq_ids, mask)
    for idx in seqs:
        s_i = math.exp(sum(logp[t].item() - prox[t].item() for t in idx) / len(idx))
        for t in idx:
            w, a = math.exp(prox[t].item() - behav[t].item()), adv[t].item()
            clipped = min(max(s_i, 1 - eps), 1 + eps) * a
            total += -w * min(s_i * a, clipped) / len(idx)
            if s_i * a <= clipped:  # the unclipped term is active: gradient s_i * a
                grad[t] = -w * s_i * a / len(idx) / len(seqs)
    value, got, _ = loss_of("gspo", "seq_mean_token_mean", logp, prox, behav, adv, mask, seq_ids, eps_clip=eps)
    assert value == pytest.approx(total / len(seqs), rel=1e-12)
    torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", range(4))
def test_cispo_by_its_formula(seed):
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4) in the decoupled form, token mean: every token keeps a
    gradient, -w_t * clip(u_t) * A_t / |mask|, the clipped weight a constant."""
    logp, prox, behav, adv, mask, seq_ids = random_sequences(seed)
    eps, eps_high = 0.1, 0.15
    value, grad, stats = loss_of(
        "cispo", "token_mean", logp, prox, behav, adv, mask, seq_ids, eps_clip=eps, eps_clip_high=eps_high
    )
    n = int(mask.sum())
    want_value, want_grad, clipped = 0.0, torch.zeros_like(logp), 0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        u, w = math.exp(logp[t].item() - prox[t].item()), math.exp(prox[t].item() - behav[t].item())
        c = min(max(u, 1 - eps), 1 + eps_high)
        clipped += c != u
        want_value += -w * c * adv[t].item() * logp[t].item() / n
        want_grad[t] = -w * c * adv[t].item() / n
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert stats["clip_frac"].item() == pytest.approx(clipped / n) and 0 < clipped < n


@pytest.mark.parametrize("kind", ["decoupled", "gspo", "cispo"])
def test_two_sided_behaviour_range_masks_tokens_out_of_it(kind):
    """ppo.behav_weight_cap [lo, hi]: a token whose w is outside adds nothing, value or gradient, and stays
    in the denominator; a number c is the range (0, c]."""
    logp, prox, behav, adv, mask, seq_ids = random_sequences(7)
    w = torch.exp(prox - behav)
    lo, hi = 0.8, 1.25
    out = mask & ((w < lo) | (w > hi))
    assert out.any() and (mask & ~out).any()
    value, grad, stats = loss_of(kind, "token_mean", logp, prox, behav, adv, mask, seq_ids, behav_weight_cap=[lo, hi])
    assert grad[out].abs().max().item() == 0.0 and grad[mask & ~out].abs().max().item() > 0
    assert stats["behav_masked_frac"].item() == pytest.approx(out.sum().item() / mask.sum().item())
    # the same as zeroing those tokens' advantages (every loss is linear in A_t) with the same denominator
    kept, *_ = loss_of(kind, "token_mean", logp, prox, behav, torch.where(out, 0.0, adv), mask, seq_ids)
    if kind != "gspo":  # gspo: the sequence ratio still counts every token's log-ratio, as it should
        assert value == pytest.approx(kept, rel=1e-12)
    one_sided = loss_of(kind, "token_mean", logp, prox, behav, adv, mask, seq_ids, behav_weight_cap=hi)[2]
    assert one_sided["behav_masked_frac"].item() == pytest.approx((mask & (w > hi)).sum().item() / mask.sum().item())


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("kind", ["decoupled", "gspo", "cispo"])
def test_aggregations_by_their_formulas_and_over_micro_batches(kind, agg):
    """token_mean: sum / |mask|; seq_mean_token_mean: the mean over sequences of their token means;
    seq_mean_token_sum: the mean over sequences of their token sums over C. Micro-batches of whole
    sequences summed as Megatron sums them (totals over counts) give the loss and gradient of the whole."""
    logp, prox, behav, adv, mask, seq_ids = random_sequences(3)
    C = 16
    losses, _ = policy_token_losses(logp, prox, behav, adv, mask, seq_ids, policy_loss=kind)
    seqs = sequences(seq_ids, mask)
    if agg == "token_mean":
        want = sum(losses[t].item() for idx in seqs for t in idx) / int(mask.sum())
    elif agg == "seq_mean_token_mean":
        want = sum(sum(losses[t].item() for t in idx) / len(idx) for idx in seqs) / len(seqs)
    else:
        want = sum(sum(losses[t].item() for t in idx) / C for idx in seqs) / len(seqs)
    value, grad, _ = loss_of(kind, agg, logp, prox, behav, adv, mask, seq_ids, seq_tokens=C)
    assert value == pytest.approx(want, rel=1e-12)

    x = logp.clone().requires_grad_()
    totals, counts = [], []
    for a, b in [(0, 6), (6, 15), (15, 26)]:  # sequences (5, 1), (9), (4, 7)
        ids = seq_ids[a:b] - seq_ids[a]
        part, _ = policy_token_losses(x[a:b], prox[a:b], behav[a:b], adv[a:b], mask[a:b], ids, policy_loss=kind)
        total, count = aggregate(part, mask[a:b], ids, agg, C)
        totals.append(total)
        counts.append(count)
    split = sum(totals) / sum(counts)
    split.backward()
    assert split.item() == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(x.grad, grad, rtol=1e-10, atol=1e-14)


def test_policy_loss_and_aggregation_refuse_bad_names_and_missing_sequences():
    logp, prox, behav, adv, mask, seq_ids = random_sequences(0)
    with pytest.raises(ValueError, match="decoupled, gspo, cispo"):
        policy_token_losses(logp, prox, behav, adv, mask, seq_ids, policy_loss="grpo")
    with pytest.raises(ValueError, match="seq_ids"):
        policy_token_losses(logp, prox, behav, adv, mask, policy_loss="gspo")
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        aggregate(logp, mask, seq_ids, "sum")
    with pytest.raises(ValueError, match="seq_tokens"):
        aggregate(logp, mask, seq_ids, "seq_mean_token_sum")


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_garbage_outside_the_mask_is_ignored_by_every_loss(kind):
    logp, prox, behav, adv, mask, seq_ids = random_sequences(5)
    value, grad, _ = loss_of(kind, "seq_mean_token_mean", logp, prox, behav, adv, mask, seq_ids)
    junk = [t.clone() for t in (logp, prox, behav, adv)]
    for t, j in zip(junk, (500.0, -900.0, 900.0, float("nan"))):
        t[~mask] = j
    value2, grad2, stats = loss_of(kind, "seq_mean_token_mean", *junk, mask, seq_ids)
    assert value2 == value and torch.equal(grad2, grad) and grad2[~mask].abs().max() == 0
    assert all(torch.isfinite(v).all() for v in stats.values())
