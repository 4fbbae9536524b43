"""Hugging Face Qwen2/Qwen3/Qwen3-MoE weights <-> one rank's Megatron shard, in both directions.

One table (`hf_names`) says, for each Megatron parameter of a pipeline stage, which Hugging Face
tensors it holds and how it is split over tensor-parallel ranks:

| Megatron (stage-local layer l)                 | Hugging Face (global layer g = offset + l)       | TP split                    |
|------------------------------------------------|--------------------------------------------------|-----------------------------|
| embedding.word_embeddings.weight               | model.embed_tokens.weight                        | rows (vocab)                |
| decoder.layers.l.input_layernorm.weight        | model.layers.g.input_layernorm.weight            | replicated                  |
| decoder.layers.l.self_attention.linear_qkv.*   | model.layers.g.self_attn.{q,k,v}_proj.*          | by key/value group: [q k v] |
| decoder.layers.l.self_attention.q_layernorm.w  | model.layers.g.self_attn.q_norm.weight (Qwen3)   | replicated (one head's)     |
| decoder.layers.l.self_attention.k_layernorm.w  | model.layers.g.self_attn.k_norm.weight (Qwen3)   | replicated (one head's)     |
| decoder.layers.l.self_attention.linear_proj.w  | model.layers.g.self_attn.o_proj.weight           | columns                     |
| decoder.layers.l.pre_mlp_layernorm.weight      | model.layers.g.post_attention_layernorm.weight   | replicated                  |
| decoder.layers.l.mlp.linear_fc1.weight         | model.layers.g.mlp.{gate,up}_proj.weight         | rows of each: [gate; up]    |
| decoder.layers.l.mlp.linear_fc2.weight         | model.layers.g.mlp.down_proj.weight              | columns                     |
| decoder.layers.l.mlp.router.weight (MoE)       | model.layers.g.mlp.gate.weight                   | replicated                  |
| ...mlp.experts.local_experts.i.linear_fc1.w    | model.layers.g.mlp.experts.x.{gate,up}_proj.w    | none: whole [gate; up]      |
| ...mlp.experts.local_experts.i.linear_fc2.w    | model.layers.g.mlp.experts.x.down_proj.weight    | none: whole                 |
| decoder.final_layernorm.weight                 | model.norm.weight                                | replicated                  |
| output_layer.weight                            | lm_head.weight (model.embed_tokens when tied)    | rows (vocab)                |

Megatron's fused QKV interleaves by key/value group: for each group, its query heads, then its key
head, then its value head; a TP rank holds whole groups.

Experts (Qwen3-MoE) are split over the expert-parallel ranks, never over TP: expert rank r of `ep`
holds experts r * E/ep .. (r + 1) * E/ep - 1, its local expert i being the global x = r * E/ep + i
(Megatron's MoELayer). `load_hf_into` reads only this rank's experts; `export_stage` yields the dense
tensors (TP-gathered) and this rank's experts apart, so that each expert rank sends its own experts
without a collective.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from areal_hpc.arch import QwenArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
EXPERT_KINDS = ("expert_gate_up", "expert")
"""The kinds of the expert weights: whole on their expert rank, never TP-split."""


def _hf_layer_names(g: int, rest: str) -> list[str]:
    p = f"model.layers.{g}."
    return {
        "input_layernorm.weight": [p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        "self_attention.linear_qkv.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
        "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
        "mlp.router.weight": [p + "mlp.gate.weight"],
    }[rest]


def hf_names(name: str, arch: QwenArch, layer_offset: int, ep_rank: int = 0, ep: int = 1) -> tuple[list[str], str]:
    """The Hugging Face tensors of Megatron parameter `name`, and its TP split kind; a local expert of
    expert rank `ep_rank` (of `ep`) is named by its global index.

    Kinds: "rows", "cols", "replicated", "qkv", "gate_up", and the EXPERT_KINDS.
    """
    m = _LAYER.match(name)
    if m:
        rest = m.group(2)
        expert = _EXPERT.match(rest)
        if expert:
            x = ep_rank * (arch.num_experts // ep) + int(expert.group(1))
            p = f"model.layers.{layer_offset + int(m.group(1))}.mlp.experts.{x}."
            if expert.group(2) == "linear_fc1":
                return [p + "gate_proj.weight", p + "up_proj.weight"], "expert_gate_up"
            return [p + "down_proj.weight"], "expert"
        kind = {
            "self_attention.linear_qkv.weight": "qkv",
            "self_attention.linear_qkv.bias": "qkv",
            "self_attention.linear_proj.weight": "cols",
            "mlp.linear_fc1.weight": "gate_up",
            "mlp.linear_fc2.weight": "cols",
        }.get(rest, "replicated")
        return _hf_layer_names(layer_offset + int(m.group(1)), rest), kind
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"], "rows"
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"], "replicated"
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"], "rows"
    raise KeyError(f"no Hugging Face name for Megatron parameter {name}")


def shard(hf: list[torch.Tensor], kind: str, arch: QwenArch, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s Megatron tensor from the full Hugging Face tensors `hf`."""
    if kind in ("replicated", "expert"):
        return hf[0]
    if kind == "rows":
        return hf[0].chunk(tp, 0)[tp_rank]
    if kind == "cols":
        return hf[0].chunk(tp, 1)[tp_rank]
    if kind == "gate_up":
        return torch.cat([t.chunk(tp, 0)[tp_rank] for t in hf], 0)
    if kind == "expert_gate_up":
        return torch.cat(hf, 0)
    q, k, v = hf  # [heads*d, (h)]
    groups, d = arch.num_key_value_heads, arch.head_dim
    tail = q.shape[1:]
    qkv = torch.cat(
        [q.reshape(groups, -1, d, *tail), k.reshape(groups, 1, d, *tail), v.reshape(groups, 1, d, *tail)], 1
    )  # [groups, q_per_group + 2, d, (h)]
    return qkv.chunk(tp, 0)[tp_rank].reshape(-1, *tail)


def unshard(shards: list[torch.Tensor], kind: str, arch: QwenArch) -> list[torch.Tensor]:
    """The full Hugging Face tensors from every TP rank's Megatron tensor (inverse of `shard`)."""
    if kind in ("replicated", "expert"):
        return [shards[0]]
    if kind == "rows":
        return [torch.cat(shards, 0)]
    if kind == "cols":
        return [torch.cat(shards, 1)]
    if kind == "expert_gate_up":
        return list(shards[0].chunk(2, 0))
    if kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
    groups, d = arch.num_key_value_heads, arch.head_dim
    tail = shards[0].shape[1:]
    qkv = torch.cat(shards, 0).reshape(groups, -1, d, *tail)
    q_per_group = qkv.shape[1] - 2
    return [
        qkv[:, :q_per_group].reshape(-1, *tail),
        qkv[:, q_per_group].reshape(-1, *tail),
        qkv[:, q_per_group + 1].reshape(-1, *tail),
    ]


def stage_params(model) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters by Megatron name (unwrapping DDP and Float16Module), without the tied duplicate
    and without LoRA adapters (`trainer.lora`: PEFT's names, their own export).

    With tied embeddings and several stages the last stage holds a copy of the embedding as
    output_layer.weight; Hugging Face has one tensor, sent by the first stage.
    """
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    out = []
    for name, p in inner.named_parameters():
        if name == "output_layer.weight" and getattr(inner, "share_embeddings_and_output_weights", False):
            continue
        if ".lora." in name:
            continue
        out.append((name, p))
    return out


def layer_offset(arch: QwenArch, pp_rank: int, pp: int) -> int:
    return pp_rank * (arch.num_layers // pp)


def stage_layers(arch: QwenArch, pp_rank: int, pp: int) -> tuple[int, int]:
    """[first, end) model layers of pipeline stage `pp_rank` of `pp`."""
    return layer_offset(arch, pp_rank, pp), layer_offset(arch, pp_rank + 1, pp) if pp_rank + 1 < pp else arch.num_layers


def load_hf_into(
    model,
    model_dir: str | Path,
    arch: QwenArch,
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
    ep_rank: int = 0,
    ep: int = 1,
) -> None:
    """Copy this rank's shard of the Hugging Face checkpoint in `model_dir` into `model` (of the experts,
    only expert rank `ep_rank`'s)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    where = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    for h in handles:
        for key in h.keys():
            where[key] = h
    from megatron.core.utils import unwrap_model

    offset = layer_offset(arch, pp_rank, pp)
    inner = unwrap_model(model)
    with torch.no_grad():
        for name, p in inner.named_parameters():
            names, kind = hf_names(name, arch, offset, ep_rank, ep)
            missing = [n for n in names if n not in where]
            if missing:
                raise KeyError(f"{model_dir}: missing tensors {missing} (for Megatron {name})")
            value = shard([where[n].get_tensor(n) for n in names], kind, arch, tp_rank, tp)
            if value.shape != p.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(value.shape)} != parameter {tuple(p.shape)}")
            p.copy_(value)


def export_stage(
    model,
    arch: QwenArch,
    pp_rank: int,
    pp: int,
    tp_group,
    dst: int,
    dense: bool = True,
    experts: bool = True,
    ep_rank: int = 0,
    ep: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's weights under Hugging Face names, full (TP-gathered) tensors, one at a time.

    First the dense tensors (everything but the experts) when `dense`: collective over `tp_group`,
    every TP rank of the group iterates them, they are gathered to global rank `dst` (the group's TP
    rank 0) and only there yielded. Then, when `experts`, this rank's experts (expert rank `ep_rank`
    of `ep`) under their global names, with no collective.
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    me = dist.get_rank() if dist.is_initialized() else dst
    offset = layer_offset(arch, pp_rank, pp)
    named = [(name, p, *hf_names(name, arch, offset, ep_rank, ep)) for name, p in stage_params(model)]
    for _, p, names, kind in named:
        if not dense or kind in EXPERT_KINDS:
            continue
        local = p.detach().contiguous()
        if tp == 1:
            shards = [local]
        elif kind == "replicated":
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp)] if me == dst else None
            dist.gather(local, shards, dst=dst, group=tp_group)
        if me == dst:
            yield from zip(names, unshard(shards, kind, arch))
    if experts:
        for _, p, names, kind in named:
            if kind in EXPERT_KINDS:
                yield from zip(names, unshard([p.detach()], kind, arch))


def read_hf(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def save_hf(state: dict[str, torch.Tensor], model_dir: str | Path, src_dir: str | Path | None = None) -> None:
    """Write `state` as model.safetensors (+ config and tokenizer files copied from `src_dir`)."""
    import shutil

    from safetensors.torch import save_file

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src_dir is not None:
        for f in Path(src_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
