"""SegmentAttention: each token attends causally within its own segment, whatever the bucketing."""

import math

import pytest
import torch

pytestmark = pytest.mark.megatron


def _dense(q, k, v, seg):
    """Reference: [s, b, h, d] inputs, a block-diagonal causal mask from seg [b, s], GQA by repetition."""
    s, b, h, d = q.shape
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    allowed = (seg[:, :, None] == seg[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * d)


def test_matches_block_diagonal_causal_attention_with_buckets_and_gqa():
    from types import SimpleNamespace

    from areal_hpc.trainer.packed import SegmentAttention, segments

    torch.manual_seed(0)
    # two rows: lengths 9, 1, 3, 12, 5 (several buckets) and a padding tail of 6 in row 1
    seg = torch.tensor([[0] * 9 + [1] + [2] * 3 + [3] * 7, [3] * 5 + [4] * 5 + [5] * 4 + [6] * 6])
    seg[1, :5] = 7  # a segment of its own in row 1 (ids need only differ from their neighbours)
    s, b, h, g, d = seg.shape[1], 2, 4, 2, 8
    q, k, v = torch.randn(s, b, h, d), torch.randn(s, b, g, d), torch.randn(s, b, g, d)
    layout = segments(seg)
    assert len(layout.buckets) > 1
    attn = SegmentAttention(SimpleNamespace(attention_dropout=0.0), 1, None, "self")
    out = attn(q.requires_grad_(), k, v, None, packed_seq_params=layout)
    torch.testing.assert_close(out, _dense(q, k, v, seg), rtol=1e-5, atol=1e-5)
    out.sum().backward()  # the gather/scatter layout is differentiable end to end
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_needs_segments():
    from types import SimpleNamespace

    from areal_hpc.trainer.packed import SegmentAttention

    attn = SegmentAttention(SimpleNamespace(attention_dropout=0.0), 1, None, "self")
    x = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="Segments"):
        attn(x, x, x, None)
