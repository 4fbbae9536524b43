"""What the trainer checks run: each `*_rank` function runs on every trainer rank through
`spawn.run_ranks(fn, world, tp, pp, ...)` and returns a dict of CPU tensors and numbers (a key only on
the rank that holds it: `compare.pick` finds it).

The references they are held to: `full_logits`, the whole vocabulary's logits at once (what the chunked
`trainer.logprobs.token_logprobs` must equal), and `hf_logits`, transformers' logits of the same probe
sequences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from areal_hpc.protocol import TrainBatch
from tests.support.compare import max_diff
from tests.support.inputs import probe_sequences, random_batch


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, V] logits of the whole vocabulary (gathered over TP) from the last stage's hidden states,
    all at once: for checks on short sequences."""
    from megatron.core import tensor_parallel

    from areal_hpc.trainer.logprobs import output_input

    # the last stage's hidden states are fp32 under Float16Module: the product in the weight's dtype, as in training
    logits = (output_input(hidden, sequence_parallel).to(weight.dtype) @ weight.t()).float()  # [s, b, V / TP]
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits).transpose(0, 1)


def logits(engine, seqs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Full-vocabulary logits of each sequence, packed in one row (last stage's TP rank 0; else None)."""
    from areal_hpc.trainer.packed import pack_rows

    sp = engine.config.sequence_parallel
    rows = pack_rows(seqs, multiple=engine.par.grid.tp if sp else 1).to(engine.device)
    out = []

    def forward_step(it, model):
        r = next(it)

        def keep(output):
            out.append(full_logits(output, engine.stage.output_weight(), sp).detach())
            return output.sum() * 0, torch.tensor(0, dtype=torch.int, device=output.device), {}

        return r.forward(model), keep

    engine.forward_backward([rows], forward_step, forward_only=True, seq_length=rows.tokens.shape[1])
    if not (engine.is_last_stage and engine.par.coords.tp == 0):
        return None
    full = out[0][0].float().cpu()  # [s, V]
    return [full[a : a + n] for _, a, n in rows.seq_slices]


def optimizer_state(engine) -> list[torch.Tensor]:
    """This rank's optimizer state (fp32 main weights, Adam moments and steps), in a fixed order."""
    out = []
    for adam in engine.adams:
        for group in adam.param_groups:
            for p in group["params"]:
                out.append(p.detach().float().cpu())
                state = adam.state[p]
                out.extend(state[k].detach().float().cpu().reshape(-1) for k in sorted(state))
    return out


def logits_and_export_rank(par, model_dirs: dict, optim) -> dict:
    """Per model: each probe sequence's logits, and the exported Hugging Face weights."""
    from areal_hpc.trainer.engine import Engine

    result = {}
    for name, model_dir in model_dirs.items():
        result.update(_logits_and_weights(Engine(model_dir, par, optim), name))
    return result


def _logits_and_weights(engine, name: str) -> dict:
    """`name/logits` (the probe sequences', on the last stage's ranks) and `name/weights` (`trained`: the
    whole model under Hugging Face names, or the adapters, on rank 0) of an engine; collective."""
    out = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        out[f"{name}/logits"] = got
    weights = trained(engine)
    if weights is not None:
        out[f"{name}/weights"] = {k: v.cpu() for k, v in weights.items()}
    return out


def trained(engine) -> dict | None:
    """What the engine trains, whole, on rank 0 (None elsewhere): the model under Hugging Face names, or with
    LoRA its adapters under PEFT's; collective."""
    import torch.distributed as dist

    if not engine.lora:
        return engine.export_full()
    stage = {k: v.cpu() for k, v in engine.export_adapters()}
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    return {k: v for s in stages for k, v in s.items()} if engine.par.rank == 0 else None


def _steps(engine, seeds: list[int], step_cfg) -> list[dict]:
    from areal_hpc.trainer.step import ppo_step

    vocab = engine.arch.vocab_size
    # every data-parallel rank its own sequences
    return [ppo_step(engine, random_batch(vocab, seed=100 * s + engine.par.coords.dp), step_cfg) for s in seeds]


def resume_rank(
    par, model_dir, ckpt_dir, before: list[int], after: list[int], optim, dtype=torch.float32, lora=None
) -> dict:
    """`before` steps, save, `after` steps (uninterrupted); then a fresh engine loads the checkpoint and
    takes the same `after` steps (resumed). Batches come from the seeds; every rank returns the
    largest difference of its own optimizer state between the two runs. `lora`: the engines' `LoraSpec`
    (the weights compared are then the adapters)."""
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    cfg = StepConfig()
    engine = Engine(model_dir, par, optim, dtype, lora=lora)
    _steps(engine, before, cfg)
    trainer_checkpoint.save(engine, ckpt_dir)
    saved = optimizer_state(engine)
    uninterrupted = _steps(engine, after, cfg)
    weights = trained(engine)
    state = optimizer_state(engine)

    resumed = Engine(model_dir, par, optim, dtype, lora=lora)
    trainer_checkpoint.load(resumed, Path(ckpt_dir) / "trainer")
    loaded = optimizer_state(resumed)
    resumed_stats = _steps(resumed, after, cfg)
    result = {
        "load_diff": max_diff(saved, loaded),
        "optimizer_diff": max_diff(state, optimizer_state(resumed)),
    }
    resumed_weights = trained(resumed)
    if weights is not None:
        result.update(
            stats=uninterrupted,
            resumed_stats=resumed_stats,
            weights={k: v.float().cpu() for k, v in weights.items()},
            resumed_weights={k: v.float().cpu() for k, v in resumed_weights.items()},
        )
    return result


def save_rank(par, model_dir, ckpt_dir, before: list[int], after: list[int], optim, lora=None) -> dict:
    """`before` steps, the probe logits, save, then `after` steps: the weights at the end (`trained`)."""
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    engine = Engine(model_dir, par, optim, lora=lora)
    _steps(engine, before, StepConfig())
    result = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        result["logits"] = got
    trainer_checkpoint.save(engine, ckpt_dir)
    _steps(engine, after, StepConfig())
    weights = trained(engine)
    if weights is not None:
        result["weights"] = {k: v.float().cpu() for k, v in weights.items()}
    return result


def load_rank(par, model_dir, ckpt_dir, after: list[int], optim, lora=None) -> dict:
    """Load a checkpoint (written at any TP/PP/DP): the probe logits, then `after` steps' weights (`trained`)."""
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    engine = Engine(model_dir, par, optim, lora=lora)
    trainer_checkpoint.load(engine, Path(ckpt_dir) / "trainer")
    result = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        result["logits"] = got
    _steps(engine, after, StepConfig())
    weights = trained(engine)
    if weights is not None:
        result["weights"] = {k: v.float().cpu() for k, v in weights.items()}
    return result


def nonfinite_rank(par, model_dir, ckpt_dir, optim) -> dict:
    """One step, save, load into a fresh engine, then a step whose advantages are NaN: its error
    message and how much any weight moved (nothing may)."""
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine, NonFiniteError
    from areal_hpc.trainer.step import StepConfig, ppo_step

    engine = Engine(model_dir, par, optim)
    _steps(engine, [0], StepConfig())
    trainer_checkpoint.save(engine, ckpt_dir)
    resumed = Engine(model_dir, par, optim)
    trainer_checkpoint.load(resumed, Path(ckpt_dir) / "trainer")
    before = resumed.export_full()
    batch = random_batch(resumed.arch.vocab_size, seed=1)
    bad = TrainBatch(**{**batch.__dict__, "advantages": np.full_like(batch.advantages, np.nan)})
    message = None
    try:
        ppo_step(resumed, bad, StepConfig())
    except NonFiniteError as e:
        message = str(e)
    after = resumed.export_full()
    return {"message": message, "moved": max_diff(before, after)} if before is not None else {}


def train_and_save_rank(par, models: dict, run_root, steps: int, optim, lora=None) -> dict:
    """Per model (name -> (model directory, dtype name)): `steps` PPO steps, then the probe logits, the
    weights under Hugging Face names (`trained`: with `lora`, a `LoraSpec`, the adapters), and a complete
    checkpoint of version `steps` in the run directory `run_root/<name>/` (`checkpoints/step_<steps>/`, as a
    run writes it: what export reads)."""
    from areal_hpc.checkpoint.files import checkpoint_dir, mark_complete
    from areal_hpc.trainer import checkpoint as trainer_checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    result = {}
    for name, (model_dir, dtype) in models.items():
        engine = Engine(model_dir, par, optim, getattr(torch, dtype), lora=lora)
        _steps(engine, list(range(steps)), StepConfig())
        result.update(_logits_and_weights(engine, name))
        step_dir = checkpoint_dir(Path(run_root) / name, steps)
        trainer_checkpoint.save(engine, step_dir)
        if par.rank == 0:
            mark_complete(step_dir)  # the controller's part in a run
    return result


def hf_logits(model_dir, device: str = "cpu") -> list[torch.Tensor]:
    """transformers' logits of each probe sequence, alone (fp32), on `device`; returned on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return [model(s[None].to(device)).logits[0].cpu() for s in probe_sequences(model.config.vocab_size)]
