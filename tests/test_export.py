"""`areal-hpc export`: Hugging Face model -> PPO steps -> checkpoint -> export -> transformers and vLLM
load the directory and give the trainer's logits, for Qwen2 and Qwen3, from checkpoints written at TP 2
and at PP 2, and for Qwen3-MoE from one written at EP 2; a bf16 checkpoint exports its bf16 weights bit for bit; export refuses, naming the fix,
what it cannot do.

Cost: three trainings of two local ranks (every dense model in two, the MoE in one), six exports of one
local rank each, the CLI's one more, and one vLLM engine per fp32 export (only the first start is slow).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.checkpoint.files import checkpoint_dir, mark_complete
from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer.convert import read_hf
from areal_hpc.trainer.export import ExportError, export_checkpoint
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import export_problems, logits_problems, max_diff, pick
from tests.support.inputs import probe_sequences
from tests.support.shapes import QWEN2_UNTIED, QWEN3
from tests.support.trainer_runs import hf_logits, train_and_save_rank
from tests.test_moe_trainer import build_moe_model

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

MODELS = {
    # untied embeddings (an lm_head of its own), QKV bias, head size 64 / 2
    "qwen2": QWEN2_UNTIED,
    "qwen3": QWEN3,  # tied embeddings, q/k norms, no QKV bias, heads of size 32 (not 64 / 4)
}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
STEPS = 2
OPTIM = PPOConfig(lr=1e-2)
FP32 = [(layout, name) for layout in LAYOUTS for name in MODELS]
BF16 = ("tp2", "qwen3-bf16")
SHARD = "100KB"
"""Small enough that every tiny model exports in several shards with an index, as a real one does."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    initial = {name: str(build_tiny_model(m, root / "models", seed=3)) for name, m in MODELS.items()}
    trained, exported = {}, {}
    for layout, (tp, pp) in LAYOUTS.items():
        models = {name: (d, "float32") for name, d in initial.items()}
        if layout == BF16[0]:
            models[BF16[1]] = (initial["qwen3"], "bfloat16")
        results = run_ranks(train_and_save_rank, tp * pp, tp, pp, models, str(root / layout), STEPS, OPTIM)
        for name in models:
            trained[layout, name] = {k: pick(results, f"{name}/{k}") for k in ("logits", "weights")}
            out = root / "hf" / layout / name
            exported[layout, name] = export_checkpoint(root / layout / name, None, out, max_shard_size=SHARD)
    return SimpleNamespace(root=root, initial=initial, trained=trained, exported=exported)


@pytest.mark.parametrize("case", [*FP32, BF16], ids="-".join)
def test_export_holds_the_trainers_weights(runs, case):
    from transformers import AutoTokenizer

    out, trained = runs.exported[case], runs.trained[case]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and all((out / f).is_file() for f in index["weight_map"].values())
    weights = read_hf(out)
    assert export_problems(weights, trained["weights"]) == []  # name for name, bit for bit
    dtype = "bfloat16" if case == BF16 else "float32"
    assert {str(t.dtype) for t in weights.values()} == {f"torch.{dtype}"}
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == dtype and config["model_type"] == case[1][:5]
    assert (out / "generation_config.json").is_file()
    assert AutoTokenizer.from_pretrained(out).decode([17, 18, 19]) == AutoTokenizer.from_pretrained(
        runs.initial["qwen3"]
    ).decode([17, 18, 19])


@pytest.mark.parametrize("case", FP32, ids="-".join)
def test_transformers_logits_equal_the_trainers(runs, case):
    want = runs.trained[case]["logits"]
    assert logits_problems(hf_logits(runs.exported[case]), want, tol=1e-4) == []
    assert max_diff(hf_logits(runs.initial[case[1]]), want) > 1e-2  # the steps moved the model


def vllm_logprobs(model_dir, vocab: int, adapter=None, rank: int = 0) -> list[torch.Tensor]:
    """vLLM's log-softmax over the whole vocabulary at each probe sequence's positions 1..n-1; with `adapter`
    (a PEFT adapter directory of `rank`), on the base `model_dir` with the adapter, as vLLM's LoRARequest
    loads it."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    from areal_hpc.generator.engine import GenerationEngine

    args = GenerationEngine.engine_args(
        model_dir, device="cpu", max_model_len=64, max_num_seqs=4, enforce_eager=True, lora_rank=rank
    )
    engine = LLMEngine.from_engine_args(dataclasses.replace(args, max_logprobs=-1))
    request = LoRARequest("exported", 1, str(adapter)) if adapter else None
    try:
        seqs = probe_sequences(vocab)
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False)
        for i, s in enumerate(seqs):
            engine.add_request(str(i), {"prompt_token_ids": s.tolist()}, params, lora_request=request)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.prompt_logprobs for o in engine.step() if o.finished})
    finally:
        engine.engine_core.shutdown()
    return [
        torch.tensor([[done[str(i)][j][t].logprob for t in range(vocab)] for j in range(1, len(s))])
        for i, s in enumerate(seqs)
    ]


@pytest.mark.vllm
@pytest.mark.parametrize("case", FP32, ids="-".join)
def test_vllm_logprobs_equal_the_trainers(runs, case):
    """Tolerance as in test_generator (vLLM's CPU kernels sum in another order; measured ~1e-6)."""
    want = [torch.log_softmax(x[:-1], -1) for x in runs.trained[case]["logits"]]
    got = vllm_logprobs(runs.exported[case], model_arch(MODELS[case[1]]).vocab_size)
    assert max_diff(got, want) <= 1e-3


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """PPO steps on Qwen3-MoE at EP 2 (2 data-parallel ranks), a checkpoint as a run writes it, its export
    (one CPU rank: EP 1)."""
    root = tmp_path_factory.mktemp("moe")
    models = {"moe": (str(build_moe_model(root / "models", norm_topk_prob=True, seed=3)), "float32")}
    results = run_ranks(train_and_save_rank, 2, 1, 1, models, str(root / "run"), STEPS, OPTIM, ep=2)
    out = export_checkpoint(root / "run" / "moe", None, root / "hf", max_shard_size=SHARD)
    return SimpleNamespace(out=out, logits=results[0]["moe/logits"], weights=pick(results, "moe/weights"))


def test_moe_checkpoint_at_ep2_exports_the_trainers_model(moe_run):
    """Every expert of every expert rank, under its global name, bit for bit; transformers' logits."""
    assert json.loads((moe_run.out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert export_problems(read_hf(moe_run.out), moe_run.weights) == []
    assert logits_problems(hf_logits(moe_run.out), moe_run.logits, tol=1e-5) == []


@pytest.mark.vllm
def test_vllm_logprobs_of_the_moe_export_equal_the_trainers(moe_run):
    want = [torch.log_softmax(x[:-1], -1) for x in moe_run.logits]
    vocab = json.loads((moe_run.out / "config.json").read_text())["vocab_size"]
    assert max_diff(vllm_logprobs(moe_run.out, vocab), want) <= 1e-3


def test_export_refuses_with_the_fix(runs, tmp_path):
    run = runs.root / "pp2" / "qwen2"
    with pytest.raises(ExportError, match=r"no complete checkpoint of step 7; complete: 2$"):
        export_checkpoint(run, 7, tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="full exists and is not empty; choose another -o or remove it"):
        export_checkpoint(run, 2, tmp_path / "full")
    with pytest.raises(ExportError, match="no run directory"):
        export_checkpoint(tmp_path / "nowhere", None, tmp_path / "a")
    fake = tmp_path / "run"
    checkpoint_dir(fake, 3).mkdir(parents=True)  # a save that never finished
    with pytest.raises(ExportError, match="no complete checkpoint under checkpoints/"):
        export_checkpoint(fake, None, tmp_path / "a")
    old = checkpoint_dir(fake, 4) / "trainer"  # complete, from before checkpoints kept the model's files
    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    mark_complete(old.parent)
    with pytest.raises(ExportError, match=r"no complete checkpoint of step 3 \(its save did not finish\); complete: 4"):
        export_checkpoint(fake, 3, tmp_path / "a")
    with pytest.raises(ExportError, match="has no hf/ .* resume the run for a step"):
        export_checkpoint(fake, None, tmp_path / "a")
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.partial"))


def test_cli_exports_one_file_and_shows_progress(runs, tmp_path, capfd):
    from areal_hpc.cli import main

    run, out = runs.root / "pp2" / "qwen3", tmp_path / "model"
    assert main(["export", str(run), "--step", str(STEPS), "-o", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "export: model.safetensors (1/1," in printed and f"wrote {out}" in printed
    assert not (out / "model.safetensors.index.json").exists()
    assert export_problems(read_hf(out), read_hf(runs.exported["pp2", "qwen3"])) == []
    assert main(["export", str(run), "-o", str(out)]) == 1
    assert "is not empty; choose another -o" in capfd.readouterr().err
