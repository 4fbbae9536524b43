"""The trainer's side of a checkpoint: Megatron's `dist_checkpointing` of the model and the distributed optimizer.

Layout of `<step dir>/trainer/`: what `dist_checkpointing.save` writes (`metadata.json`, `common.pt`,
the torch_dist shard files), `hf/` (the model directory's files other than its weights: config.json,
tokenizer, generation config; what `areal_hpc.trainer.export` needs beside the weights, so that a
checkpoint of full training exports without the run's initial model) and `manifest.json` (parallel sizes,
dtype and architecture, with LoRA the adapters and the base, below; written last).

With experts (Qwen3-MoE) Megatron's optimizer is a chain of two distributed optimizers (dense and
expert parameters); their states are saved side by side under `chained_0.` / `chained_1.` and each
loads as below. Expert weights are stored by global expert index, so a checkpoint written at one
expert-parallel size loads at another. The model must be the same: a checkpoint of a MoE model
resumed as a dense one, the other way round, or with another expert count, is refused before
anything loads (`load`).

    {"model": model.sharded_state_dict(),
     "optimizer": optimizer.sharded_state_dict(model, metadata={"distrib_optim_sharding_type": "fully_reshardable"})}

Every tensor is stored by its global name and position, not by rank: the fp32 main weights and both
Adam moments are in model space (`fully_reshardable`), so a checkpoint written at one TP x PP x DP
loads at another. The device does not matter either: CPU and GPU runs write the same files.

Adam's step, handled here: with torch's Adam (no TransformerEngine or Apex, as on the CPU and on a
bare GPU machine) megatron-core 0.16.1 keeps the step in the saved parameter groups but cannot load
it back with `fully_reshardable` (its parameter-state load copies every key of the live state,
`step` included, from a state that has none: KeyError). `load` therefore restores the parameter
groups (the step among them) first, then the parameter state without the step, then gives every
parameter its own step tensor again (Megatron's group load hands one shared CPU tensor to all; fused
Adam keeps one per parameter on its device).

With LoRA (`Engine.lora`) the model part is the adapters alone (`trainer.lora.sharded_state_dict`, split
over TP as in training, so they too load at any layout) and the optimizer holds only theirs: the base is
kept by reference, its path and an identity cheap to compute at every save (`base_identity`: not a checksum
of its tens of gigabytes) in the manifest with the adapters' rank, alpha and targets. Loading checks both:
adapters of another rank or targets, or trained on another base, are refused by name.

Atomicity: all ranks write into `<step dir>/.trainer.partial/`; after a barrier, trainer rank 0
writes the manifest and renames the directory to `trainer/`. A crash before the rename leaves only
the `.partial` directory, which `load` never reads; a `trainer/` directory always has every file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from areal_hpc.arch import QwenArch
from areal_hpc.trainer import lora
from areal_hpc.trainer.engine import adam_step

MANIFEST = "manifest.json"
HF_FILES = "hf"
"""The subdirectory holding the model directory's files other than the weights."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
"""Files of a Hugging Face directory that hold (or index) the weights: not kept, the checkpoint has its own."""
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def sharded_state_dict(engine, is_loading: bool) -> dict:
    """The engine's model (with LoRA its adapters) and optimizer as Megatron ShardedTensors (global names and
    offsets)."""
    # the GPTModel itself: names without "module."
    model = lora.sharded_state_dict(engine.stage) if engine.lora else engine.stage.sharded_state_dict()
    optimizer = engine.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=SHARDING)
    return {"model": model, "optimizer": optimizer}


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(engine, step_dir: str | Path) -> Path:
    """Write the checkpoint under `step_dir/trainer/` (collective over the trainer ranks)."""
    from megatron.core import dist_checkpointing

    step_dir = Path(step_dir)
    final, partial = step_dir / "trainer", step_dir / ".trainer.partial"
    par = engine.par
    if par.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
        partial.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(engine, is_loading=False), str(partial))
    dist.barrier()
    if par.rank == 0:
        _keep_hf_files(engine.model_dir, partial / HF_FILES)
        dtype = str(engine.config.params_dtype).removeprefix("torch.")
        manifest = {
            "tp": par.grid.tp,
            "pp": par.grid.pp,
            "dp": par.grid.dp,
            "ep": par.grid.ep,
            "world": par.grid.size,
            "dtype": dtype,
            "arch": asdict(engine.arch),
        }
        if engine.lora:
            spec = engine.lora
            manifest["lora"] = spec.as_dict()
            manifest["base"] = base_identity(engine.model_dir)
        _fsync_write(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
        if final.exists():  # overwrite a complete checkpoint: move it aside first, drop it after
            old = step_dir / ".trainer.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, final)
        fd = os.open(step_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dist.barrier()
    return final


def _keep_hf_files(model_dir: Path, dest: Path) -> None:
    """Copy the files of `model_dir` other than the weights (and hidden files) into `dest`."""
    dest.mkdir()
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, dest / f.name)


def base_identity(model_dir: str | Path) -> dict:
    """The base model of a LoRA checkpoint, by reference: its path, and what tells it from another model
    cheaply enough for every save: config.json's SHA-256 and, per weight file, its name, size and the SHA-256
    of its first and last MiB (a safetensors file starts with every tensor's name, dtype and offsets)."""
    model_dir = Path(model_dir)
    files = []
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            size, digest = f.stat().st_size, hashlib.sha256()
            with open(f, "rb") as fh:
                digest.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                digest.update(fh.read(1 << 20))
            files.append([f.name, size, digest.hexdigest()])
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    return {"path": str(model_dir.resolve()), "config_sha256": config, "weights": files}


def base_problem(saved: dict, model_dir: str | Path) -> str | None:
    """Why `model_dir` is not the base a LoRA checkpoint's manifest names (`saved`: its "base"), or None."""
    if not (Path(model_dir) / "config.json").is_file():
        elsewhere = "" if str(Path(model_dir).resolve()) == saved["path"] else f", trained on {saved['path']},"
        return f"its base model{elsewhere} is not at {model_dir} (no config.json there)"
    now = base_identity(model_dir)
    differ = [k for k in ("config_sha256", "weights") if now[k] != saved[k]]
    if not differ:
        return None
    return (
        f"its adapters were trained on the base at {saved['path']}, and {now['path']} is another model "
        f"({' and '.join('config.json' if k == 'config_sha256' else 'the weight files' for k in differ)} differ)"
    )


def is_complete(ckpt_dir: str | Path) -> bool:
    """Whether `ckpt_dir` (a `trainer/` directory) is a complete checkpoint."""
    return (Path(ckpt_dir) / MANIFEST).is_file()


def manifest(ckpt_dir: str | Path) -> dict:
    """The manifest of a complete checkpoint: {tp, pp, dp, ep (absent before MoE), world, dtype, arch}."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: not a complete trainer checkpoint (no {MANIFEST})")
    return json.loads((ckpt_dir / MANIFEST).read_text())


def load(engine, ckpt_dir: str | Path) -> dict:
    """Restore the model and optimizer state from a `trainer/` directory written at any TP/PP/DP; returns
    its manifest (the parallel sizes it was written at, for the log)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    written = manifest(ckpt_dir)
    _check_same_model(written["arch"], engine.arch, ckpt_dir, engine.model_dir)
    _check_same_adapters(written, engine, ckpt_dir)
    chain = engine.optimizer.chained_optimizers  # Megatron wraps even one optimizer in a chain
    if not any(
        opt.optimizer.state for opt in chain
    ):  # a fresh engine: the loading state dict comes from the live state
        engine.init_optimizer_state()
    loaded = dist_checkpointing.load(sharded_state_dict(engine, is_loading=True), str(ckpt_dir))
    if engine.lora:
        lora.load_state_dict(engine.stage, loaded["model"])
    else:
        engine.stage.load_state_dict(loaded["model"])
    parts = [loaded["optimizer"]] if len(chain) == 1 else [loaded["optimizer"][i] for i in range(len(chain))]
    for opt, part in zip(chain, parts, strict=True):
        groups = dict(part)
        param_state = groups.pop("param_state")
        if groups.pop("param_state_sharding_type") != SHARDING["distrib_optim_sharding_type"]:
            raise ValueError(f"{ckpt_dir}: optimizer state not in the {SHARDING} format")
        opt.load_state_dict(groups)  # parameter groups, Adam's step among them (see the module docstring)
        adam = opt.optimizer
        steps = {p: state.pop("step") for p, state in adam.state.items()}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, state in adam.state.items():
            state["step"] = adam_step(steps[p].item(), p)
    engine.resumed_from = ckpt_dir
    return written


def _check_same_model(saved: dict, arch: QwenArch, ckpt_dir: Path, model_dir: Path) -> None:
    """ValueError unless the checkpoint's architecture (its manifest's `saved`) is this run's `arch`.

    Fields added since a checkpoint was written are absent from its manifest: they had their default
    then (no experts), or were Qwen2's (the attention fields, which have no default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(QwenArch) if f.default is not dataclasses.MISSING}
    was = dataclasses.replace(arch, **(defaults | saved))
    if was.model_type != arch.model_type or was.num_experts != arch.num_experts:
        raise ValueError(
            f"checkpoint {ckpt_dir} is {_describe(was)} but model.path {model_dir} is {_describe(arch)}: resume "
            "with the model the checkpoint was trained from (model.path, model.architecture)"
        )
    current = asdict(arch)
    changed = {k: (v, current[k]) for k, v in asdict(was).items() if current[k] != v}
    if changed:
        raise ValueError(f"{ckpt_dir} holds another model: {changed} (checkpoint, this run)")


def _check_same_adapters(written: dict, engine, ckpt_dir: Path) -> None:
    """ValueError unless the checkpoint trains what `engine` trains: the whole model, or adapters of the same
    rank and targets on the same base."""
    saved, spec = written.get("lora"), engine.lora
    theirs = lora.LoraSpec.of(saved) if saved else None
    if (spec is None) != (theirs is None) or (spec and not spec.same_parameters(theirs)):

        def what(x):
            return f"LoRA adapters of rank {x.rank} on {list(x.targets)}" if x else "the whole model"

        raise ValueError(
            f"checkpoint {ckpt_dir} trains {what(theirs)} but this run trains {what(spec)}: resume with the "
            "lora.rank and lora.target_modules it was written with"
        )
    if saved and (problem := base_problem(written["base"], engine.model_dir)):
        raise ValueError(f"checkpoint {ckpt_dir}: {problem}; resume with model.path the base it was trained on")


def _describe(arch: QwenArch) -> str:
    return f"{arch.model_type} ({arch.num_experts} experts)" if arch.moe else arch.model_type


def load_model(stage, ckpt_dir: str | Path, with_adapters: bool = False) -> None:
    """Load only the model part of a checkpoint (written at any TP/PP/DP) into `stage`, a GPTModel of
    this rank (its optimizer state is not read: no memory for it); `with_adapters`: a LoRA checkpoint's
    adapters, into a stage that has them (`trainer.lora.add_adapters`) on its base."""
    from megatron.core import dist_checkpointing

    if with_adapters:
        loaded = dist_checkpointing.load({"model": lora.sharded_state_dict(stage)}, str(ckpt_dir))
        lora.load_state_dict(stage, loaded["model"])
        return
    loaded = dist_checkpointing.load({"model": stage.sharded_state_dict()}, str(ckpt_dir))
    stage.load_state_dict(loaded["model"])
