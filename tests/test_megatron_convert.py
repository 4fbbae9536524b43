"""Hugging Face Qwen2 and Qwen3 <-> Megatron GPTModel: same logits as transformers for TP in {1, 2} and
PP in {1, 2}, an exact round trip of the weights, and packed sequences that never see each other."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import export_problems, logits_problems, pick
from tests.support.inputs import random_norms
from tests.support.shapes import QWEN2, QWEN2_DEEP_UNTIED, QWEN2_MHA, QWEN3
from tests.support.trainer_runs import hf_logits, logits_and_export_rank

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

CONFIGS = {
    # tied embeddings, grouped-query attention (4 query heads share 2 key/value heads)
    "gqa-tied": QWEN2,
    # untied embeddings, 4 layers, 1 key/value head per 4 query heads... x2 groups, another RoPE base
    "gqa-untied": QWEN2_DEEP_UNTIED,
    # plain multi-head attention
    "mha": QWEN2_MHA,
    # Qwen3 (q/k norms, no QKV bias, heads of size 32, not 64 / 4), untied
    "qwen3": dataclasses.replace(QWEN3, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {name: build_tiny_model(m, root, seed=3) for name, m in CONFIGS.items()}
    for i, d in enumerate(dirs.values()):
        random_norms(d, seed=i)
    return dirs


@functools.cache
def _hf_logits(model_dir):
    return hf_logits(model_dir)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_transformers_and_export_round_trips(models, tp, pp):
    """Packed sequences get the logits transformers gives each sequence alone (max |diff| <= 1e-4)."""
    from areal_hpc.trainer.convert import read_hf

    results = run_ranks(logits_and_export_rank, tp * pp, tp, pp, {k: str(v) for k, v in models.items()}, PPOConfig())
    for name, model_dir in models.items():
        assert logits_problems(pick(results, f"{name}/logits"), _hf_logits(str(model_dir)), tol=1e-4) == [], name
        # export(load(checkpoint)) is the checkpoint, bit for bit and name for name
        assert export_problems(pick(results, f"{name}/weights"), read_hf(model_dir)) == [], name
