"""Packed rows: several sequences share one row of a micro-batch and never see each other.

    one row:  seq 0             seq 1       seq 2         pad
    tokens    t t t t t t t t   t t t t t   t t t t t t   0 0   [b, s]
    position  0 1 2 3 4 5 6 7   0 1 2 3 4   0 1 2 3 4 5   0 1   [3, b, s] (mrope: three equal components)
    segment   0 0 0 0 0 0 0 0   1 1 1 1 1   2 2 2 2 2 2   3 3   a token attends to its segment's earlier ones

Two things make packing exact, and keep the cost of attention that of the sequences, not of the row:
- `SegmentAttention`, the layers' core attention: it gathers each sequence of the rows into a
  padded batch and runs causal `scaled_dot_product_attention` on it (cost: sequences x longest
  sequence squared; a dense block-diagonal mask over a row of s tokens costs s squared, some 40 times
  more for a 4096-token row of 100-token sequences). Where the sequences lie reaches it through
  Megatron's `packed_seq_params` argument, as a `Segments` (a `PackedSeqParams` in the `sbhd` layout,
  which Megatron passes to the core attention untouched);
- per-sequence positions for RoPE. Megatron's plain `rope` embedding always rotates position 0..s-1
  of the row, and its per-sequence variant needs the THD layout with transformer-engine or flash
  attention (neither runs on the CPU). So the model is built with Megatron's `mrope` rotary embedding
  (`trainer.model`), which rotates explicit `position_ids`; with the three position components equal
  (text tokens) it is exactly standard RoPE at those positions (Qwen2-VL's property), which is what
  Qwen2 and Qwen3 compute.

Written by hand: megatron-core 0.16.1's local core attention (DotProductAttention) refuses packed
sequences, and its packed path (THD with cu_seqlens) needs transformer-engine, absent on the CPU and on
a bare GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule


@dataclass
class Segments(PackedSeqParams):
    """Where the sequences of a micro-batch's rows lie, for `SegmentAttention`.

    The rows' tokens are numbered row by row (`row * width + column`); every token belongs to exactly
    one segment: a sequence, or a row's padding tail. Segments of similar length share a bucket, padded
    to its longest: bucket k is a [n_k, L_k] table of token numbers (a segment's start past its end).
    """

    buckets: list[torch.Tensor] | None = None
    scatter: torch.Tensor | None = None  # [b * s] place of each token in the buckets' padded layouts, end to end

    def to(self, device) -> Segments:
        return Segments(
            qkv_format=self.qkv_format, buckets=[g.to(device) for g in self.buckets], scatter=self.scatter.to(device)
        )


BUCKET_RATIO = 0.7
"""A bucket holds segments longer than this fraction of its longest: padding at most doubles the
attention cost of a segment (cost ~ length squared)."""


def segments(seg_ids: torch.Tensor) -> Segments:
    """The Segments of rows labelled `seg_ids` ([b, s]: one id per segment, its tokens contiguous in one row)."""
    flat = seg_ids.reshape(-1)
    starts = torch.cat([torch.tensor([True]), flat[1:] != flat[:-1]]).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([flat.numel()]))
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    buckets, place, offset, i = [], torch.empty(flat.numel(), dtype=torch.long), 0, 0
    while i < len(order):
        longest = int(lengths[order[i]])
        k = i
        while k < len(order) and lengths[order[k]] > BUCKET_RATIO * longest:
            k += 1
        members = torch.tensor(order[i:k])
        j = torch.arange(longest)
        buckets.append(starts[members, None] + torch.where(j < lengths[members, None], j, 0))
        for row, seg in enumerate(order[i:k]):
            a, n = int(starts[seg]), int(lengths[seg])
            place[a : a + n] = offset + row * longest + torch.arange(n)
        offset += (k - i) * longest
        i = k
    return Segments(qkv_format="sbhd", buckets=buckets, scatter=place)


class SegmentAttention(MegatronModule):
    """Megatron core attention (the local spec's DotProductAttention's place) in which each token attends
    causally within its own segment only, as `packed_seq_params` (a Segments) gives them.

    Query/key/value come as [s, b, heads, head_dim] (key/value with the query groups of GQA); the
    output is [s, b, heads * head_dim], as Megatron expects.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__(config=config)
        if config.attention_dropout:
            raise ValueError("SegmentAttention has no attention dropout (the config asks for some)")
        self.scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if not isinstance(packed_seq_params, Segments) or attention_bias is not None:
            raise ValueError("SegmentAttention needs the rows' Segments as packed_seq_params, and no attention bias")
        s, b, heads, dim = query.shape
        q, k, v = (x.transpose(0, 1).reshape(b * s, x.shape[2], dim) for x in (query, key, value))
        outs = []
        for gather in packed_seq_params.buckets:  # [n, L] -> [n, h, L, d] per input
            # Positions past a segment's end come after all of its tokens: the causal mask hides them.
            out = F.scaled_dot_product_attention(
                *(x[gather].transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=self.scale, enable_gqa=True
            )
            outs.append(out.transpose(1, 2).reshape(-1, heads * dim))
        out = torch.cat(outs)[packed_seq_params.scatter]  # [b * s, h * d]
        return out.view(b, s, heads * dim).transpose(0, 1).contiguous()


@dataclass
class PackedRows:
    """A micro-batch: sequences packed into rows, with what the model needs to keep them apart."""

    tokens: torch.Tensor  # [b, s] int64 (pad 0)
    position_ids: torch.Tensor  # [3, b, s] int64, position within its own sequence (mrope layout)
    segments: Segments  # which tokens attend to which (each to its own sequence's earlier ones)
    seq_slices: list  # per sequence: (row, start, length) in the rows

    def forward(self, model) -> torch.Tensor:
        """The model stage's output on these rows ([s, b, h] hidden states, on the last stage too)."""
        return model(self.tokens, self.position_ids, None, packed_seq_params=self.segments)

    def to(self, device) -> PackedRows:
        return PackedRows(
            self.tokens.to(device), self.position_ids.to(device), self.segments.to(device), self.seq_slices
        )


def pack_rows(seqs: list[torch.Tensor], padded: bool = False, multiple: int = 1) -> PackedRows:
    """Put `seqs` (1-D token tensors) in one row (packing), or one row each padded to the longest; the
    width padded up to a multiple of `multiple` (sequence parallelism splits it over the TP ranks).

    A row's padding tail is its own segment: it never attends to, or is attended by, a sequence.
    """
    groups = [[i] for i in range(len(seqs))] if padded else [list(range(len(seqs)))]
    width = -(-max(sum(len(seqs[i]) for i in g) for g in groups) // multiple) * multiple
    rows = len(groups)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    pos = torch.zeros(rows, width, dtype=torch.long)
    seg = torch.full((rows, width), -1, dtype=torch.long)
    slices = [None] * len(seqs)
    for r, group in enumerate(groups):
        a = 0
        for i in group:
            n = len(seqs[i])
            tokens[r, a : a + n] = seqs[i]
            pos[r, a : a + n] = torch.arange(n)
            seg[r, a : a + n] = i
            slices[i] = (r, a, n)
            a += n
        pos[r, a:] = torch.arange(width - a)
        seg[r, a:] = len(seqs) + r
    return PackedRows(tokens, pos.unsqueeze(0).expand(3, -1, -1).contiguous(), segments(seg), slices)
