"""LoRA adapters on the tensor-parallel linear layers of a Megatron stage (`trainer.model.build_stage`).

A target is named as Hugging Face and PEFT name it (`q_proj` ... `down_proj`); each is a pair A [r, in],
B [out, r] whose product, times alpha / r, is added to the layer's output: y = W x + (alpha / r) B A x.
Megatron fuses some targets into one layer, and each keeps its own pair there (PEFT's and vLLM's format
is one pair per Hugging Face module):

| target                     | Megatron layer (under a decoder layer) | kind   | split over TP           |
|----------------------------|----------------------------------------|--------|-------------------------|
| q_proj, k_proj, v_proj     | self_attention.linear_qkv              | column | B's rows by key/value group; A replicated |
| o_proj                     | self_attention.linear_proj             | row    | A's columns; B replicated |
| gate_proj, up_proj         | mlp.linear_fc1 ([gate; up])            | column | B's rows; A replicated  |
| down_proj                  | mlp.linear_fc2                         | row    | A's columns; B replicated |

A subset of a fused layer's targets is supported: the others' part of its output gets nothing. Dense models
only: a mixture of experts is refused (`QwenArch.lora_problem`, which the config's validation asks too: vLLM
serves one with LoRA only through Triton kernels, which its CPU build lacks).

Communication follows the base layer's: a column layer's input is the sequence shard under sequence
parallelism (gathered for A, whose gradient Megatron then sums over TP: the parameter is marked
`sequence_parallel`), else whole (A's output is all-reduced in the backward pass, so A's gradient is whole on
every rank). A row layer's A x is partial over TP: all-reduced, or reduce-scattered over the sequence
under sequence parallelism (B marked `sequence_parallel` then). The base weights are frozen (no gradient, no
optimizer state); the adapters are the stage's only trainable parameters.

Why by hand: megatron-core 0.16.1 has no LoRA module; Megatron-Bridge's needs TransformerEngine; PEFT's
`LoraParallelLinear` fails on these layers (it expects a tensor where they return (output, bias), looks up
config keys they lack, overrides `params_dtype` and leaves its replicated halves unmarked for sequence
parallelism). PEFT stays the format of an exported adapter.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from areal_hpc.arch import PROJECTIONS

TARGETS = {
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", None),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", None),
}
"""Each target's Megatron layer and its part of the fused output (None: the whole output); the keys are
`arch.PROJECTIONS`."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters a trainer gives its model: rank r, alpha (the update is scaled by alpha / r), targets."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = PROJECTIONS

    @classmethod
    def of(cls, lora) -> LoraSpec | None:
        """The adapters of a config's `lora` section (None when lora.rank is 0), or of a checkpoint's manifest
        (`as_dict`)."""
        if isinstance(lora, dict):
            return cls(lora["rank"], lora["alpha"], tuple(lora["targets"]))
        return cls(lora.rank, lora.alpha, tuple(lora.target_modules)) if lora.rank else None

    def as_dict(self) -> dict:
        """As a checkpoint's manifest keeps it."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def same_parameters(self, other: LoraSpec | None) -> bool:
        """Whether `other`'s adapters are these parameters (the same rank and targets; alpha may differ)."""
        return other is not None and (self.rank, sorted(self.targets)) == (other.rank, sorted(other.targets))


class LoraError(ValueError):
    """Targets or a rank that this model cannot take."""


class Adapters(torch.nn.Module):
    """The LoRA pairs of one linear layer, in the layer's TP shard; added to its output by a forward hook."""

    def __init__(self, layer, path: str, targets: list[str], arch, rank: int, alpha: float, global_layer: int):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes as mark

        super().__init__()
        self.column = isinstance(layer, ColumnParallelLinear)
        self.sp = layer.sequence_parallel
        self.tp, self.tp_rank = _tp()
        self.scale = alpha / rank
        self.enabled = True
        self.parts = [TARGETS[t][1] for t in targets]
        self.targets = targets
        self.path = path
        self.arch = arch
        self.layer = global_layer
        device, dtype = layer.weight.device, layer.weight.dtype
        for target in targets:
            out, inp = arch.projection_shape(target)
            a, b = initial_pair(global_layer, target, rank, inp, out)
            pair = torch.nn.Module()
            if self.column:  # whole key/value groups of q, k, v (the fused QKV holds whole groups), rows of the others
                b = b.chunk(self.tp, 0)[self.tp_rank]
            else:
                a = a.chunk(self.tp, 1)[self.tp_rank]
            pair.lora_A = torch.nn.Parameter(a.to(device, dtype).contiguous())
            pair.lora_B = torch.nn.Parameter(b.to(device, dtype).contiguous())
            for matrix, axis in self.split_axes.items():
                if axis is None:  # its gradient is partial over TP under sequence parallelism
                    getattr(pair, matrix).sequence_parallel = self.sp
                else:
                    mark(getattr(pair, matrix), True, axis, 1)
            self.add_module(target, pair)
        layer.register_forward_hook(self._add)

    @property
    def split_axes(self) -> dict[str, int | None]:
        """The axis of each matrix split over TP (None: replicated): a column layer's B by rows, a row
        layer's A by columns."""
        return {"lora_A": None, "lora_B": 0} if self.column else {"lora_A": 1, "lora_B": None}

    def _add(self, layer, args, output):
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) B A x in the layer's output shard and layout."""
        from megatron.core import tensor_parallel as tpl

        pairs = [self.get_submodule(t) for t in self.targets]
        if self.column:
            if self.sp:
                x = tpl.gather_from_sequence_parallel_region(x)
            h = x @ torch.cat([p.lora_A for p in pairs]).t()  # [s, b, n * r]
            if not self.sp:
                h = tpl.copy_to_tensor_model_parallel_region(h)
            parts = {part: hi @ p.lora_B.t() for part, hi, p in zip(self.parts, h.chunk(len(pairs), -1), pairs)}
            return self.scale * self._fuse(parts, x.shape[:-1], x)
        (p,) = pairs
        h = x @ p.lora_A.t()  # partial over TP
        if self.sp:
            h = tpl.reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = tpl.reduce_from_tensor_model_parallel_region(h)
        return self.scale * (h @ p.lora_B.t())

    def _fuse(self, parts: dict, lead: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """The column layer's output shard from its targets' parts (zeros for the parts not targeted)."""
        fused = [
            (part, self.arch.projection_shape(t)[0] // self.tp)
            for t, (path, part) in TARGETS.items()
            if path == self.path
        ]
        full = {k: parts.get(k, like.new_zeros(*lead, w)) for k, w in fused}
        if self.path.endswith("linear_fc1"):
            return torch.cat([full["gate"], full["up"]], -1)
        groups = self.arch.num_key_value_heads // self.tp  # per group: its query heads, its key, its value
        q, k, v = (full[x].reshape(*lead, groups, -1) for x in "qkv")
        return torch.cat([q, k, v], -1).reshape(*lead, -1)


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def initial_pair(layer: int, target: str, rank: int, inp: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's initial (A, B), whole: A as PEFT draws it (Kaiming uniform, a = sqrt(5)), B zero, so the
    adapted model starts as the base. Seeded by layer and target: the same at every parallel layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{target}".encode()))
    bound = 1 / math.sqrt(inp)  # kaiming_uniform_ with a = sqrt(5): sqrt(6 / ((1 + 5) * fan_in))
    a = (torch.rand(rank, inp, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros(out, rank)


def add_adapters(stage: torch.nn.Module, arch, spec: LoraSpec) -> list[Adapters]:
    """Give every decoder layer of `stage` (before Float16Module and DDP wrap it) the adapters of `spec`,
    and freeze everything else. Raises LoraError with `QwenArch.lora_problem`'s reason when they do not fit."""
    rank, alpha, targets = spec.rank, spec.alpha, list(spec.targets)
    if problem := arch.lora_problem(rank, targets):
        raise LoraError(problem)
    stage.requires_grad_(False)
    if getattr(stage, "embedding", None) is not None:
        # The frozen embedding's output needs no gradient, so a layer recomputed by Megatron's checkpoint (a
        # reentrant autograd.Function) would return one that needs none either: its adapters would get none.
        stage.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    by_path: dict[str, list[str]] = {}
    for t in targets:
        by_path.setdefault(TARGETS[t][0], []).append(t)
    adapters = []
    for layer in stage.decoder.layers:
        for path, ts in by_path.items():
            linear = layer.get_submodule(path)
            module = Adapters(linear, path, ts, arch, rank, alpha, layer.layer_number - 1)
            linear.lora = module
            adapters.append(module)
    return adapters


def adapters_of(model: torch.nn.Module) -> Iterator[Adapters]:
    return (m for m in model.modules() if isinstance(m, Adapters))


@contextmanager
def base_only(model: torch.nn.Module):
    """The model without its adapters, for the duration (the KL reference: the base itself)."""
    mods = list(adapters_of(model))
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def peft_name(layer: int, target: str, matrix: str) -> str:
    """A pair's tensor as PEFT saves it (and vLLM reads it): `matrix` is lora_A or lora_B."""
    module = "self_attn" if TARGETS[target][0].startswith("self_attention") else "mlp"
    return f"base_model.model.model.layers.{layer}.{module}.{target}.{matrix}.weight"


def _matrices(model: torch.nn.Module) -> Iterator[tuple[Adapters, str, str, torch.nn.Parameter, int | None]]:
    """Every adapter matrix of `model`, in a fixed order: (its `Adapters`, target, lora_A or lora_B, the
    parameter, the axis it is split on over TP or None)."""
    for m in adapters_of(model):
        for target in m.targets:
            pair = m.get_submodule(target)
            for matrix, axis in m.split_axes.items():
                yield m, target, matrix, getattr(pair, matrix), axis


def export_adapters(model: torch.nn.Module, tp_group, dst: int) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's adapters under PEFT's names, whole (TP-gathered) tensors, one at a time: collective over
    `tp_group`, whose every rank iterates them to the end; yielded on global rank `dst` (its TP rank 0)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    me = dist.get_rank() if dist.is_initialized() else dst
    for m, target, matrix, param, split in _matrices(model):
        local = param.detach().contiguous()
        if split is not None and tp > 1:
            shards = [torch.empty_like(local) for _ in range(tp)] if me == dst else None
            dist.gather(local, shards, dst=dst, group=tp_group)
            local = torch.cat(shards, split) if me == dst else None
        if me == dst:
            yield peft_name(m.layer, target, matrix), local


def _checkpoint_key(m: Adapters, target: str, matrix: str) -> str:
    return f"lora.layers.{m.layer}.{target}.{matrix}"


def sharded_state_dict(model: torch.nn.Module) -> dict:
    """The adapters as Megatron ShardedTensors (of the parameters themselves, by which the distributed
    optimizer finds their state), each keyed by its global layer and target and split over TP as in
    training: Megatron's `dist_checkpointing` loads them at any TP x PP x DP."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for m, target, matrix, param, axis in _matrices(model):
        key = _checkpoint_key(m, target, matrix)
        out[key] = (
            make_sharded_tensor_for_checkpoint(param, key)
            if axis is None
            else make_tp_sharded_tensor_for_checkpoint(param, key, axis)
        )
    return out


def load_state_dict(model: torch.nn.Module, loaded: dict) -> None:
    """Copy what `dist_checkpointing.load` returned for `sharded_state_dict(model)` into the adapters."""
    with torch.no_grad():
        for m, target, matrix, param, _ in _matrices(model):
            param.copy_(loaded[_checkpoint_key(m, target, matrix)])


def merge_into(weights: dict, adapters: dict, alpha: float, rank: int) -> None:
    """Add (alpha / r) B A of each pair in `adapters` (PEFT's names) to the Hugging Face weight it adapts in
    `weights`, in place: the merged model. The sum is taken in fp32 and stored in the weight's dtype."""
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        w = weights[target]
        weights[target] = (w.float() + alpha / rank * (b.float() @ a.float())).to(w.dtype)
