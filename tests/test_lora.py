"""LoRA adapters on the trainer's Megatron layers (areal_hpc/trainer/lora.py), on local trainer ranks (trainer.spawn):

- the adapted model's logits equal those of the base with (alpha / r) B A merged into its weights, the merge
  laid out by the weight conversion's own table (trainer.convert.shard): each target's pair lands on its
  part of the fused QKV and gate/up layers, at TP 1 and at TP 2 with sequence parallelism;
- one PPO step trains the adapters alone (the base weights come out as they went in) and gives the same
  loss and the same adapters at TP 2 with sequence parallelism, at TP 2 without it, at PP 2, and with full
  activation recompute as at TP 1;
- with ppo.kl_coef the reference is the base (the adapters off): no second copy of the model;
- targets that name no layer, and a rank too large, are errors naming them.
"""

from __future__ import annotations

import pytest
import torch

from areal_hpc.arch import PROJECTIONS, model_arch
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer.lora import TARGETS, LoraError, LoraSpec, add_adapters
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import max_diff
from tests.support.inputs import probe_sequences, random_batch
from tests.support.shapes import QWEN2, TINY_MOE

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

VOCAB = model_arch(QWEN2).vocab_size
SPEC = LoraSpec(rank=4, alpha=8.0)
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(QWEN2, tmp_path_factory.mktemp("model"), seed=7))


def _whole_b(layer: int, target: str, arch) -> torch.Tensor:
    out, _ = arch.projection_shape(target)
    g = torch.Generator().manual_seed(100 * layer + list(TARGETS).index(target))
    return torch.randn(out, SPEC.rank, generator=g) * 0.2


def _nonzero_b(engine) -> None:
    """Every B random (they start at zero), the same whole tensors at every layout."""
    from areal_hpc.trainer.lora import adapters_of

    tp, tp_rank = engine.par.grid.tp, engine.par.coords.tp
    with torch.no_grad():
        for m in adapters_of(engine.model):
            for t in m.targets:
                b = _whole_b(m.layer, t, engine.arch)
                m.get_submodule(t).lora_B.copy_(b.chunk(tp, 0)[tp_rank] if m.column else b)


def _merge(engine) -> None:
    """Add (alpha / r) B A of every target to the base weight it adapts, in Megatron's layout."""
    from areal_hpc.trainer.convert import shard
    from areal_hpc.trainer.lora import Adapters, initial_pair

    tp, tp_rank, arch = engine.par.grid.tp, engine.par.coords.tp, engine.arch
    with torch.no_grad():
        for linear in engine.stage.modules():
            m = getattr(linear, "lora", None)
            if not isinstance(m, Adapters):
                continue
            deltas = {}
            for t in TARGETS:
                if TARGETS[t][0] != m.path:
                    continue
                out, inp = arch.projection_shape(t)
                a = initial_pair(m.layer, t, SPEC.rank, inp, out)[0]
                deltas[t] = SPEC.alpha / SPEC.rank * _whole_b(m.layer, t, arch) @ a
            parts = list(deltas.values())
            kind = {"self_attention.linear_qkv": "qkv", "mlp.linear_fc1": "gate_up"}.get(m.path, "cols")
            linear.weight.add_(shard(parts, kind, arch, tp_rank, tp).to(linear.weight.dtype))


def _merged_rank(par, model_dir):
    from areal_hpc.config import PPOConfig
    from areal_hpc.trainer.engine import Engine
    from tests.support.trainer_runs import logits

    engine = Engine(model_dir, par, PPOConfig(sequence_parallel=True), lora=SPEC)
    _nonzero_b(engine)
    seqs = probe_sequences(VOCAB)
    adapted = logits(engine, seqs)
    with engine.reference_pass():
        base = logits(engine, seqs)
    _merge(engine)
    with engine.reference_pass():
        merged = logits(engine, seqs)
    if adapted is None:
        return None
    return {"adapted": adapted, "base": base, "merged": merged}


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_equal_their_merge_into_the_fused_layers(model_dir, tp):
    got = run_ranks(_merged_rank, tp, tp, 1, model_dir)[0]
    assert max_diff(got["adapted"], got["merged"]) < TOL
    assert max_diff(got["adapted"], got["base"]) > 1e-2, "the adapters changed nothing"


def _step_rank(par, model_dir, sequence_parallel, kl_coef=0.0, recompute="none"):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from areal_hpc.config import PPOConfig
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.lora import export_adapters
    from areal_hpc.trainer.step import StepConfig, ppo_step

    # Adam with eps = 1 makes the update ~ lr * gradient: the adapters after a step show any gradient error
    ppo = PPOConfig(
        lr=1.0,
        weight_decay=0.0,
        adam_eps=1.0,
        grad_clip=1.0,
        sequence_parallel=sequence_parallel,
        kl_coef=kl_coef,
        recompute=recompute,
    )
    engine = Engine(model_dir, par, ppo, lora=SPEC)
    trainable = [n for n, p in engine.stage.named_parameters() if p.requires_grad]
    _nonzero_b(engine)
    before = engine.export_full()
    stats = ppo_step(engine, random_batch(VOCAB), StepConfig(kl_coef=kl_coef))
    tp_group = ps.get_tensor_model_parallel_group()
    stage = {k: v.cpu() for k, v in export_adapters(engine.model, tp_group, dist.get_global_rank(tp_group, 0))}
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    after = engine.export_full()
    if par.rank != 0:
        return None
    adapters = {k: v for s in stages for k, v in s.items()}
    return {"stats": stats, "adapters": adapters, "base_moved": max_diff(before, after), "trainable": trainable}


@pytest.fixture(scope="module")
def tp1_step(model_dir):
    return run_ranks(_step_rank, 1, 1, 1, model_dir, False)[0]


def test_the_targets_are_the_projections_as_hugging_face_names_them():
    assert tuple(TARGETS) == PROJECTIONS == SPEC.targets


def test_a_step_trains_the_adapters_alone(tp1_step):
    assert tp1_step["base_moved"] == 0.0
    assert tp1_step["trainable"] and all(".lora." in n for n in tp1_step["trainable"])
    # 2 layers x (q, k, v, o, gate, up, down) x (A, B)
    assert len(tp1_step["adapters"]) == 2 * len(TARGETS) * 2
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in tp1_step["adapters"]


@pytest.mark.parametrize(
    ("tp", "pp", "sp", "recompute"),
    [(2, 1, True, "none"), (2, 1, False, "none"), (1, 2, False, "none"), (1, 1, False, "full")],
)
def test_a_step_at_tp_and_pp_equals_tp_1(model_dir, tp1_step, tp, pp, sp, recompute):
    got = run_ranks(_step_rank, tp * pp, tp, pp, model_dir, sp, 0.0, recompute)[0]
    assert got["base_moved"] == 0.0
    assert abs(got["stats"]["ppo/loss"] - tp1_step["stats"]["ppo/loss"]) < TOL
    assert max_diff(got["adapters"], tp1_step["adapters"]) < TOL


def test_the_kl_reference_is_the_base(model_dir, tp1_step):
    got = run_ranks(_step_rank, 1, 1, 1, model_dir, False, 0.1)[0]
    # B is not zero: the adapted policy is not the base, so the KL term is not zero and the step differs
    assert got["stats"]["ppo/kl"] > 0
    assert max_diff(got["adapters"], tp1_step["adapters"]) > 0


def _errors_rank(par, dense_dir, moe_dir):
    from areal_hpc.arch import QwenArch
    from areal_hpc.config import PPOConfig
    from areal_hpc.trainer.engine import Engine

    out = {}
    for name, (path, spec) in {
        "unknown": (dense_dir, LoraSpec(4, 8.0, ("q_proj", "qkv_proj"))),
        "moe": (moe_dir, LoraSpec(4, 8.0, ("q_proj",))),
        "rank": (dense_dir, LoraSpec(QwenArch.from_hf(dense_dir).hidden_size + 1, 8.0, ("o_proj",))),
    }.items():
        try:
            Engine(path, par, PPOConfig(), lora=spec)
            out[name] = "no error"
        except LoraError as e:
            out[name] = str(e)
    return out


def test_targets_that_name_no_layer_and_a_rank_too_large_are_errors(model_dir, tmp_path):
    moe_dir = str(build_tiny_model(TINY_MOE, tmp_path / "moe", seed=1))
    got = run_ranks(_errors_rank, 1, 1, 1, model_dir, moe_dir)[0]
    assert "['qkv_proj']" in got["unknown"] and "q_proj" in got["unknown"], got
    assert "is for dense models" in got["moe"] and "qwen3_moe" in got["moe"], got
    assert "lora.rank 65" in got["rank"] and "o_proj" in got["rank"], got
    with pytest.raises(LoraError, match="name no layer"):
        add_adapters(torch.nn.Module(), model_arch(QWEN2), LoraSpec(2, 2.0, ("lm_head",)))
