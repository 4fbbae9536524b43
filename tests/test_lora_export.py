"""`areal-hpc export` of a LoRA checkpoint (areal_hpc/trainer/export.py): PPO steps on adapters at TP 2, a
checkpoint as a run writes it (the adapters, the base by reference); merged, the export gives the trainer's
logits in transformers and vLLM; with `adapter_only`, PEFT's two files, which PEFT loads on the base with the
merged model's logits and vLLM's LoRARequest with the trainer's logprobs; what cannot be exported is refused,
naming the fix: the adapters of a full checkpoint, a merge whose base has changed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.config import PPOConfig
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.trainer.export import ExportError, export_checkpoint
from areal_hpc.trainer.lora import LoraSpec
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import logits_problems, max_diff, pick
from tests.support.inputs import probe_sequences
from tests.support.shapes import QWEN2_UNTIED
from tests.support.trainer_runs import hf_logits, train_and_save_rank
from tests.test_export import vllm_logprobs

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

SPEC = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
VOCAB = model_arch(QWEN2_UNTIED).vocab_size


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-export")
    base = str(build_tiny_model(QWEN2_UNTIED, root / "base", seed=3))
    models = {"lora": (base, "float32")}
    results = run_ranks(train_and_save_rank, 2, 2, 1, models, str(root / "runs"), 2, PPOConfig(lr=1e-2), SPEC)
    merged = export_checkpoint(root / "runs" / "lora", None, root / "merged")
    adapter = export_checkpoint(root / "runs" / "lora", None, root / "adapter", adapter_only=True)
    trained = {k: pick(results, f"lora/{k}") for k in ("logits", "weights")}
    return SimpleNamespace(root=root, base=base, merged=merged, adapter=adapter, **trained)


def test_the_merged_export_gives_the_trainers_logits(run):
    assert logits_problems(hf_logits(run.merged), run.logits, tol=1e-4) == []
    assert max_diff(hf_logits(run.base), run.logits) > 1e-2  # the adapters changed the model


def test_the_adapter_export_is_peft_and_loads_on_the_base(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in run.adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((run.adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == sorted(SPEC.targets)
    base = AutoModelForCausalLM.from_pretrained(run.base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run.adapter)).eval()
    with torch.no_grad():
        peft = [model(s[None]).logits[0] for s in probe_sequences(VOCAB)]
    assert max_diff(peft, hf_logits(run.merged)) <= 1e-5


@pytest.mark.vllm
def test_vllm_serves_both_exports_with_the_trainers_logprobs(run):
    """Tolerance as in test_export (vLLM's CPU kernels sum in another order)."""
    want = [torch.log_softmax(x[:-1], -1) for x in run.logits]
    assert max_diff(vllm_logprobs(run.merged, VOCAB), want) <= 1e-3
    assert max_diff(vllm_logprobs(run.base, VOCAB, run.adapter, SPEC.rank), want) <= 1e-3


def test_what_cannot_be_exported_is_refused_naming_the_fix(run, tmp_path):
    full = tmp_path / "full"
    run_ranks(train_and_save_rank, 1, 1, 1, {"full": (run.base, "float32")}, str(full), 1, PPOConfig())
    with pytest.raises(
        ExportError, match="trains the whole model, it has no adapters: export it without --adapter-only"
    ):
        export_checkpoint(full / "full", None, tmp_path / "out", adapter_only=True)
    # the base changed since the run: the merge would be wrong
    weights = next(iter((run.root / "base").rglob("*.safetensors")))
    kept = weights.read_bytes()
    try:
        weights.write_bytes(kept[:-8] + bytes(8))
        with pytest.raises(ExportError, match="is another model .the weight files differ.: the merged export needs"):
            export_checkpoint(run.root / "runs" / "lora", None, tmp_path / "out2")
        assert export_checkpoint(run.root / "runs" / "lora", None, tmp_path / "out3", adapter_only=True).is_dir()
    finally:
        weights.write_bytes(kept)
    # the base gone: only the adapters can be exported, and they need no base
    moved = run.root / "base-moved"
    (run.root / "base").rename(moved)
    try:
        with pytest.raises(
            ExportError, match="its base model is not at .* export the adapters alone with --adapter-only"
        ):
            export_checkpoint(run.root / "runs" / "lora", None, tmp_path / "out4")
        out = export_checkpoint(run.root / "runs" / "lora", None, tmp_path / "out5", adapter_only=True)
        assert (out / "adapter_model.safetensors").read_bytes() == (
            run.adapter / "adapter_model.safetensors"
        ).read_bytes()
    finally:
        moved.rename(run.root / "base")
