"""`areal-hpc export`: a Hugging Face directory from a trainer checkpoint of any TP/PP/DP, on one CPU.

    checkpoints/step_<v>/trainer/      Megatron dist_checkpointing, model part only
        -> one CPU stage (TP = PP = 1, gloo)  -> convert.export_stage (Hugging Face names)
        -> model-0000k-of-0000n.safetensors + model.safetensors.index.json (one model.safetensors if small)
    checkpoints/step_<v>/trainer/hf/   config.json (its dtype set to the checkpoint's), tokenizer,
                                       generation config: copied

Why it is built this way:
- Megatron's own resharding loads a checkpoint written at any TP x PP x DP into a world of one rank,
  reading only the model's keys: no DDP and no optimizer, whose fp32 weights and Adam moments would
  cost a 32B model 12 more bytes per parameter. The stage is built in the checkpoint's dtype, so bf16
  checkpoints export bf16.
- The shards are written from the state dict itself (huggingface_hub's split, safetensors), never
  through a transformers model: about the weights once in memory, plus the attention's q/k/v split
  and one shard's serialization.
- The load runs in a process of its own (`spawn.run_ranks`, one CPU rank): torch.distributed, Megatron's
  parallel state and `cpu_compat`'s CPU routes stay out of the caller (`areal-hpc eval` runs vLLM next).
- Everything needed is inside the checkpoint (`checkpoint.trainer.save` keeps the model's small files in
  `hf/`): the run's initial model directory may be gone (not so for a LoRA checkpoint's merged export, below).
- The directory is written under a temporary name and renamed into place when complete: an
  interrupted export leaves nothing that looks like a model.

A LoRA checkpoint (`lora.rank` > 0) holds the adapters, and names its base (checkpoint.trainer's manifest):
the base is loaded from there (checked to be the one it names), the adapters beside it, and the export is
the merged model, each adapted weight plus (alpha / r) B A, in the same Hugging Face directory; or with
`adapter_only` the adapters alone in PEFT's format (adapter_model.safetensors under PEFT's names, and
adapter_config.json written by PEFT's own `LoraConfig`), which `peft.PeftModel.from_pretrained` and vLLM's
`LoRARequest` load on the base. The adapters alone need no base: its weights are never read (the stage's
are left uninitialised, untouched memory).
"""

from __future__ import annotations

import json
import resource
import shutil
from pathlib import Path

import torch

from areal_hpc.checkpoint.files import checkpoint_damage, checkpoint_dir, checkpoint_version, complete_checkpoints
from areal_hpc.trainer import checkpoint as trainer_checkpoint

TIMEOUT_S = 4 * 3600
"""The longest an export may take (a 32B model: minutes, mostly reading and writing its 64 GB)."""


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked; the message names the fix."""


def export_checkpoint(
    run_dir: str | Path,
    step: int | None,
    out_dir: str | Path,
    max_shard_size: int | str = "5GB",
    adapter_only: bool = False,
) -> Path:
    """Write the Hugging Face directory of checkpoint `step` of `run_dir` (None: the latest complete
    one) to `out_dir`, which must not exist or be empty; returns `out_dir`. Prints a line per shard.
    `adapter_only`: a LoRA checkpoint's adapters alone, in PEFT's format."""
    from areal_hpc.trainer.spawn import run_ranks

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    ckpt = _find(run_dir, step)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output directory {out_dir} exists and is not empty; choose another -o or remove it")
    saved = trainer_checkpoint.manifest(ckpt)
    _check_lora(saved, ckpt, adapter_only)
    print(
        f"export: {ckpt.parent.name} of {run_dir} (written at TP {saved['tp']} x PP {saved['pp']} x "
        f"DP {saved['dp']}, {saved['dtype']}) -> {out_dir}",
        flush=True,
    )
    partial = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted export's leftovers
    partial.mkdir(parents=True)
    try:
        run_ranks(
            _export_rank, 1, 1, 1, str(ckpt), str(partial), max_shard_size, adapter_only,
            device="cpu", timeout_s=TIMEOUT_S,
        )  # fmt: skip
        if not adapter_only:
            _copy_hf_files(ckpt / trainer_checkpoint.HF_FILES, partial, saved["dtype"])
        if out_dir.exists():
            out_dir.rmdir()
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"export: wrote {out_dir}", flush=True)
    return out_dir


def _check_lora(saved: dict, ckpt: Path, adapter_only: bool) -> None:
    """ExportError unless the checkpoint can be exported as asked: `adapter_only` needs adapters, and a LoRA
    checkpoint its base where the manifest names it."""
    if adapter_only and "lora" not in saved:
        raise ExportError(f"{ckpt} trains the whole model, it has no adapters: export it without --adapter-only")
    if "lora" in saved and not adapter_only:
        if problem := trainer_checkpoint.base_problem(saved["base"], saved["base"]["path"]):
            raise ExportError(
                f"{ckpt} holds LoRA adapters and {problem}: the merged export needs that base (put it back), or "
                "export the adapters alone with --adapter-only"
            )


def _find(run_dir: Path, step: int | None) -> Path:
    """The `trainer/` directory of checkpoint `step` (None: the latest), or ExportError naming the ones there are."""
    if not run_dir.is_dir():
        raise ExportError(f"no run directory at {run_dir}")
    found = {
        checkpoint_version(d): d / "trainer"
        for d in complete_checkpoints(run_dir)
        if trainer_checkpoint.is_complete(d / "trainer")
    }
    if not found:
        raise ExportError(
            f"{run_dir} has no complete checkpoint under checkpoints/ (a run saves one every train.save_every "
            "steps and when it stops)"
        )
    if step is None:
        step = max(found)
    if step not in found:
        why = " (its save did not finish)" if checkpoint_dir(run_dir, step).exists() else ""
        raise ExportError(
            f"{run_dir} has no complete checkpoint of step {step}{why}; complete: {', '.join(map(str, found))}"
        )
    ckpt = found[step]
    damage = checkpoint_damage(ckpt.parent)  # sizes of every file; checksums up to the resume bound
    if damage is not None:
        raise ExportError(f"checkpoint {ckpt.parent} is damaged: {damage}; complete: {', '.join(map(str, found))}")
    if not (ckpt / trainer_checkpoint.HF_FILES).is_dir():
        raise ExportError(
            f"{ckpt} has no {trainer_checkpoint.HF_FILES}/ (the model's config and tokenizer): it was written before "
            "checkpoints kept them; resume the run for a step to save one that has them"
        )
    return ckpt


def _copy_hf_files(src: Path, out_dir: Path, dtype: str) -> None:
    """The model's config, tokenizer and generation config, with config.json's dtype the weights'."""
    for f in src.iterdir():
        shutil.copy2(f, out_dir / f.name)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:  # the key of configs written before transformers 5
        config["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _export_rank(par, ckpt_dir: str, out_dir: str, max_shard_size: int | str, adapter_only: bool) -> None:
    """On the one export rank: load the checkpoint's model into a CPU stage and write its shards (with LoRA the
    base's weights with the adapters merged, or the adapters alone)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from areal_hpc.arch import QwenArch
    from areal_hpc.trainer.convert import export_stage, load_hf_into
    from areal_hpc.trainer.lora import LoraSpec, add_adapters, export_adapters, merge_into
    from areal_hpc.trainer.model import build_stage, transformer_config

    before = _peak_memory_gib()
    saved = trainer_checkpoint.manifest(ckpt_dir)
    arch, dtype = QwenArch(**saved["arch"]), getattr(torch, saved["dtype"])
    config = transformer_config(arch, 1, 1, par.device, dtype)
    config.perform_initialization = False  # every weight comes from the checkpoint (or, with LoRA, its base)
    stage = build_stage(arch, config, par.device)
    spec = LoraSpec.of(saved["lora"]) if "lora" in saved else None
    if spec:
        if not adapter_only:
            load_hf_into(stage, saved["base"]["path"], arch, 0, 1, 0, 1)
        add_adapters(stage, arch, spec)
    stage.to(dtype)  # as Engine's Float16Module does: every parameter (the norms too) in the checkpoint's dtype
    trainer_checkpoint.load_model(stage, ckpt_dir, with_adapters=spec is not None)
    adapters = {k: v.contiguous() for k, v in export_adapters(stage, None, 0)} if spec else {}
    if adapter_only:
        _write_adapter(adapters, spec, saved["base"]["path"], Path(out_dir))
        return
    state = dict(export_stage(stage, arch, pp_rank=0, pp=1, tp_group=None, dst=0))
    if spec:
        merge_into(state, adapters, spec.alpha, spec.rank)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    out = Path(out_dir)
    n = len(split.filename_to_tensors)
    for i, (filename, names) in enumerate(split.filename_to_tensors.items(), 1):
        shard = {name: state[name].contiguous() for name in names}
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        print(f"export: {filename} ({i}/{n}, {len(names)} tensors, {_nbytes(shard) / 2**20:.1f} MiB)", flush=True)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    weights = _nbytes(state) / 2**30
    print(
        f"export: {weights:.2f} GiB of weights; memory of the export process: peak {_peak_memory_gib():.2f} GiB, "
        f"{before:.2f} GiB before loading",
        flush=True,
    )


def _write_adapter(tensors: dict, spec, base: str, out: Path) -> None:
    """The adapters (`tensors`, PEFT's names) in PEFT's format: adapter_model.safetensors and PEFT's
    adapter_config.json."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        inference_mode=True,
    )
    config.save_pretrained(str(out))
    size = _nbytes(tensors) / 2**20
    print(f"export: adapter_model.safetensors ({len(tensors)} tensors, {size:.1f} MiB), adapter_config.json")


def _nbytes(tensors: dict) -> int:
    """The bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _peak_memory_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
