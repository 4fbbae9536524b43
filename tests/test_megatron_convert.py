"""Hugging Face Qwen2 <-> Megatron GPTModel: same logits as transformers for TP in {1, 2} and PP in
{1, 2}, an exact round trip of the weights, and packed sequences that never see each other."""

from __future__ import annotations

import functools

import pytest
import torch

from areal_hpc.config import ModelConfig
from areal_hpc.tiny import build_tiny_model
from areal_hpc.trainer.launch import run_ranks

pytestmark = pytest.mark.megatron

CONFIGS = {
    # tied embeddings, grouped-query attention (4 query heads share 2 key/value heads)
    "gqa-tied": ModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # untied embeddings, 4 layers, 1 key/value head per 4 query heads... x2 groups, another RoPE base
    "gqa-untied": ModelConfig(
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
    ),
    # plain multi-head attention
    "mha": ModelConfig(
        hidden_size=96, intermediate_size=192, num_layers=2, num_attention_heads=4, num_key_value_heads=4
    ),
}
SEQ_LENS = (7, 13, 4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_model(m, root, seed=3) for name, m in CONFIGS.items()}


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in SEQ_LENS]


def _rank_logits(par, model_dirs):
    """Per model: full-vocabulary logits of each sequence (packed in one row), the exported weights."""
    return {name: _one_model(par, d) for name, d in model_dirs.items()}


def _one_model(par, model_dir):
    from megatron.core import tensor_parallel

    from areal_hpc.trainer.engine import Engine, OptimConfig
    from areal_hpc.trainer.model import pack_rows

    engine = Engine(model_dir, par, OptimConfig())
    seqs = _sequences(engine.arch.vocab_size)
    rows = pack_rows(seqs)
    logits = []

    def forward_step(it, model):
        r = next(it)
        out = r.forward(model)

        def loss(output):
            logits.append(tensor_parallel.gather_from_tensor_model_parallel_region(output).detach())
            return output.sum() * 0, torch.tensor(0, dtype=torch.int), {}

        return out, loss

    engine.forward_backward([rows], forward_step, forward_only=True, seq_length=rows.tokens.shape[1])
    exported = engine.export_full()
    result = {}
    if engine.is_last_stage and par.tp_rank == 0:
        full = logits[0][0]  # [s, V]
        result["logits"] = [full[a : a + n] for _, a, n in rows.seq_slices]
    if exported is not None:
        result["exported"] = exported
    return result


@functools.cache
def _hf_logits(model_dir, name):
    """transformers' logits of each test sequence, alone."""
    from transformers import Qwen2ForCausalLM

    seqs = _sequences(CONFIGS[name].vocab_size)

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(s[None]).logits[0] for s in seqs]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_transformers_and_export_round_trips(models, tp, pp):
    """Packed sequences get the logits transformers gives each sequence alone (max |diff| <= 1e-4)."""
    from areal_hpc.trainer.convert import read_hf

    results = run_ranks(_rank_logits, tp * pp, tp, pp, {k: str(v) for k, v in models.items()})
    for name, model_dir in models.items():
        logits = next(r[name]["logits"] for r in results.values() if "logits" in r[name])
        want = _hf_logits(str(model_dir), name)
        for got, ref in zip(logits, want):
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-4, name
        # export(load(checkpoint)) is the checkpoint, bit for bit and name for name
        exported = results[0][name]["exported"]
        original = read_hf(model_dir)
        assert sorted(exported) == sorted(original), name
        for key, value in original.items():
            assert torch.equal(exported[key], value), (name, key)
