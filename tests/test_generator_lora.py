"""The generator with vLLM's LoRA (`GenerationEngine.create(lora=(rank, alpha))`: its updates are adapters) against
transformers, on the tiny Qwen2 of tests/test_generator.py: vLLM serves rank 4 at its next allowed rank, 8,
logged; before an adapter is loaded the base serves; an
adapter sent as tensors under PEFT's names (what the trainer's `trainer.lora.export_adapters` yields), loaded
in memory, makes the behaviour logprobs those of transformers with (alpha / r) B A merged into its weights;
a second update replaces it, the turns in flight interrupted and resumed as for full weights; the caller's
tensors come back as they went (vLLM folds the scale into B in place); the trainer's own adapters (a Megatron
rank with LoRA, `export_adapters`) make vLLM sample with the logprobs the trainer gives the same tokens."""

import numpy as np
import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import resolve_device
from areal_hpc.trainer.lora import TARGETS, peft_name
from tests.support.generator_runs import drain, reference_logprobs
from tests.support.shapes import GENERATOR

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8
RANK, ALPHA = 4, 16.0  # vLLM allows max_lora_rank 1 or 8, not 4: served at 8
TOL = 1e-3  # as tests/test_generator.py: summation order only


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """Random A and B (B not zero) of every target, under PEFT's names."""
    arch = model_arch(GENERATOR)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(arch.num_layers):
        for t in TARGETS:
            o, i = arch.projection_shape(t)
            out[peft_name(layer, t, "lora_A")] = torch.randn(RANK, i, generator=g) * 0.1
            out[peft_name(layer, t, "lora_B")] = torch.randn(o, RANK, generator=g) * 0.1
    return out


def merged(path, tensors):
    """transformers' model with (alpha / r) B A added to each target's weight."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = model.state_dict()
    for name, a in tensors.items():
        if ".lora_A." in name:
            base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[base] = weights[base] + ALPHA / RANK * tensors[name.replace("lora_A", "lora_B")] @ a
    model.load_state_dict(weights)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from areal_hpc.generator.engine import GenerationEngine

    path = build_tiny_model(GENERATOR, tmp_path_factory.mktemp("gen"), seed=1)
    engine = GenerationEngine.create(
        path,
        device=resolve_device(),
        temperature=TEMPERATURE,
        max_model_len=256,
        max_num_seqs=16,
        seed=0,
        lora=(RANK, ALPHA),
    )
    yield engine, path
    engine.close()


def sample(engine, n=8, max_tokens=16):
    for i in range(n):
        engine.submit(f"g{i}", [5 + i, 6, 7, 8], max_tokens)
    return drain(engine)


def worst(turns, model) -> float:
    return max(
        np.abs(
            np.asarray(t.sampled.behav_logprobs)
            - reference_logprobs(model, t.context_ids, t.sampled.token_ids, TEMPERATURE)
        ).max()
        for t in turns
    )


def test_the_loaded_adapter_gives_the_merged_models_logprobs(setup):
    engine, path = setup
    base = merged(path, {})
    assert engine.settings()["lora"] == "max_rank 8"
    assert engine.settings()["compilation_mode"] == "NONE"  # vLLM's CPU platform with LoRA (a GPU compiles)
    assert worst(sample(engine), base) < TOL  # no adapter yet: the base
    first = adapter(1)
    kept = {k: v.clone() for k, v in first.items()}
    engine.load_weights(first.items(), version=1)
    assert all(torch.equal(first[k], kept[k]) for k in kept), "the caller's tensors changed"
    assert engine.synced_bytes == sum(t.numel() * 4 for t in first.values())
    turns = sample(engine)
    assert all(set(t.sampled.versions) == {1} for t in turns)
    assert worst(turns, merged(path, first)) < TOL
    assert worst(turns, base) > 10 * TOL, "the adapter changed nothing"


def test_an_update_mid_answer_replaces_the_adapter(setup):
    engine, path = setup
    engine.load_weights(adapter(1).items(), version=1)
    for i in range(4):
        engine.submit(f"h{i}", [9, 6 + i, 7], 200)
    turns = engine.step()
    second = adapter(2)
    engine.load_weights(second.items(), version=2)
    turns += drain(engine)
    assert len(turns) == 4
    # every token sampled after the update is the second adapter's
    model = merged(path, second)
    resumed = [t for t in turns if 2 in t.sampled.versions]
    assert resumed, "no turn lived through the update"
    for t in resumed:
        late = [k for k, v in enumerate(t.sampled.versions) if v == 2]
        ref = reference_logprobs(model, t.context_ids, t.sampled.token_ids, TEMPERATURE)
        np.testing.assert_allclose(np.asarray(t.sampled.behav_logprobs)[late], ref[late], atol=TOL, rtol=0)


def _trainer_rank(par, path, seqs):
    """The trainer's side at TP 1: its adapters (every B random) under PEFT's names, and the full logits of
    `seqs` under the adapted model."""
    from areal_hpc.config import PPOConfig
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.lora import LoraSpec, adapters_of, export_adapters
    from tests.support.trainer_runs import logits

    engine = Engine(path, par, PPOConfig(), lora=LoraSpec(RANK, ALPHA))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in adapters_of(engine.model):
            for t in m.targets:
                b = m.get_submodule(t).lora_B
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return {"adapters": dict(export_adapters(engine.model, None, 0)), "logits": logits(engine, seqs) if seqs else None}


def test_the_trainers_adapters_give_the_trainers_logprobs(setup):
    """What the weight sync will carry: the trainer's exported adapters, loaded by vLLM, sample with the
    logprobs the trainer gives the same tokens (Megatron and vLLM in fp32; measured below 1e-5)."""
    from areal_hpc.trainer.spawn import run_ranks

    engine, path = setup
    adapters = run_ranks(_trainer_rank, 1, 1, 1, str(path), None)[0]["adapters"]
    engine.load_weights(adapters.items(), version=engine.version + 1)
    turns = sample(engine, n=4)
    seqs = [torch.tensor(list(t.context_ids) + list(t.sampled.token_ids)) for t in turns]
    logits = run_ranks(_trainer_rank, 1, 1, 1, str(path), seqs)[0]["logits"]
    for t, full in zip(turns, logits):
        p = len(t.context_ids)
        lp = torch.log_softmax(full[p - 1 : -1] / TEMPERATURE, -1)
        ref = lp.gather(-1, torch.tensor(t.sampled.token_ids)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(t.sampled.behav_logprobs, ref, atol=1e-4, rtol=0)
