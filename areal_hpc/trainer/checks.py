"""The trainer's checks: what the CPU tests assert and what `tools/gpu_check.sh` reports on a GPU.

Each `*_rank` function runs on every trainer rank through `spawn.run_ranks(fn, world, tp, pp, ...)`
and returns a dict of CPU tensors and numbers (a key only on the rank that holds it: `pick` finds
it). The pure functions beside them build inputs and compare. The tests and the GPU check call the
same functions on the device of `spawn.default_device()`, so a GPU check that passes ran the code
that the CPU tests prove.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from areal_hpc.config import ModelConfig
from areal_hpc.protocol import TrainBatch

MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2)
"""The checks' model: tied embeddings, grouped-query attention (4 query heads share 2 key/value heads)."""
QWEN3 = ModelConfig(
    architecture="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
"""A tiny Qwen3: q/k norms, no QKV bias, heads of size 32 (not 64 / 4), grouped-query, tied embeddings."""
VERSION = 3
MICROBATCHES = [[[0, 1], [2]], [[3], [4, 5]]]
"""Two PPO minibatches of two micro-batches each, over six sequences."""
PROBE_LENGTHS = (7, 13, 4)


def random_batch(vocab: int, n_seqs: int = 6, seed: int = 0, microbatches=MICROBATCHES) -> TrainBatch:
    """Random sequences: prompt tokens (version -1), response tokens of versions VERSION-1 and VERSION,
    random behaviour logprobs and advantages."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(6, 20, n_seqs)
    parts = {k: [] for k in ("tokens", "mask", "behav", "adv", "versions")}
    for n in lens:
        prompt = int(rng.integers(2, 5))
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        parts["tokens"].append(rng.integers(0, vocab, n))
        parts["mask"].append(mask)
        parts["behav"].append(np.where(mask, -rng.random(n) * 3 - 3, 0))
        parts["adv"].append(np.where(mask, rng.normal(size=n), 0))
        parts["versions"].append(np.where(mask, rng.integers(VERSION - 1, VERSION + 1, n), -1))
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return TrainBatch(
        VERSION,
        cat["tokens"].astype(np.int32),
        np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        cat["mask"],
        cat["behav"].astype(np.float32),
        cat["adv"].astype(np.float32),
        cat["versions"].astype(np.int32),
        microbatches=microbatches,
    )


def shard(batch: TrainBatch, seqs: list[int], microbatches: list) -> TrainBatch:
    """The TrainBatch of sequences `seqs` (renumbered 0..): what one data-parallel rank receives."""
    cu = batch.cu_seqlens
    take = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs])
    lens = [cu[i + 1] - cu[i] for i in seqs]
    new = {old: j for j, old in enumerate(seqs)}
    return TrainBatch(
        batch.version,
        batch.tokens[take],
        np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        batch.loss_mask[take],
        batch.behav_logprobs[take],
        batch.advantages[take],
        batch.versions[take],
        microbatches=[[[new[i] for i in mb] for mb in k] for k in microbatches],
    )


def probe_sequences(vocab: int) -> list[torch.Tensor]:
    """Three token sequences of different lengths, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROBE_LENGTHS]


def pick(results: dict, key: str):
    """The value of `key` from the one rank of `run_ranks` results that returned it."""
    found = [r[key] for r in results.values() if key in r]
    if len(found) != 1:
        raise KeyError(f"{key!r} returned by {len(found)} ranks, expected one")
    return found[0]


def max_diff(a, b) -> float:
    """Largest |a - b| over two equal structures (dicts by key, lists in order) of tensors."""
    if isinstance(a, dict):
        if sorted(a) != sorted(b):
            raise KeyError(f"different keys: {sorted(set(a) ^ set(b))}")
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            raise ValueError(f"{len(a)} != {len(b)} entries")
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if a.shape != b.shape:
        raise ValueError(f"shapes {tuple(a.shape)} != {tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# --- judgements: what is wrong, as sentences (empty: nothing) -------------------------------------


def logits_problems(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> list[str]:
    """The probe sequences whose logits differ from `want` (transformers') by more than `tol`."""
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            out.append(f"sequence {i}: logits of shape {tuple(g.shape)}, transformers {tuple(w.shape)}")
        elif (d := max_diff(g, w)) > tol:
            out.append(f"sequence {i}: logits differ from transformers' by {d:.2e} > {tol:.0e}")
    return out


def export_problems(exported: dict, original: dict) -> list[str]:
    """Where the exported Hugging Face weights are not the checkpoint's, name for name and bit for bit."""
    if sorted(exported) != sorted(original):
        return [f"exported names differ from the checkpoint's: {sorted(set(exported) ^ set(original))}"]
    return [
        f"{k}: exported tensor differs from the checkpoint's"
        for k, v in original.items()
        if not torch.equal(exported[k], v)
    ]


def resume_problems(results: dict, tol: float) -> list[str]:
    """What a resumed run (`resume_rank`) got wrong against the uninterrupted one."""
    out = []
    for rank, r in sorted(results.items()):
        if r["load_diff"] != 0.0:
            out.append(f"rank {rank}: the loaded optimizer state differs from the saved one by {r['load_diff']:.2e}")
        if r["optimizer_diff"] > tol:
            out.append(
                f"rank {rank}: optimizer state after the resumed steps off by {r['optimizer_diff']:.2e} > {tol:.0e}"
            )
    for k, (a, b) in enumerate(zip(pick(results, "stats"), pick(results, "resumed_stats"), strict=True)):
        for key in a:
            if not all(map(math.isfinite, (a[key], b[key]))):
                out.append(f"step {k + 1} after the save: {key} is {a[key]} uninterrupted, {b[key]} resumed")
            elif abs(a[key] - b[key]) > tol * max(1.0, abs(a[key])):
                out.append(f"step {k + 1} after the save: {key} {a[key]:.9g} uninterrupted, {b[key]:.9g} resumed")
    if (d := max_diff(pick(results, "weights"), pick(results, "resumed_weights"))) > tol:
        out.append(f"weights after the resumed steps off by {d:.2e} > {tol:.0e}")
    return out


# --- rank functions (run under spawn.run_ranks) ----------------------------------------------------


def logits(engine, seqs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Full-vocabulary logits of each sequence, packed in one row (last stage's TP rank 0; else None)."""
    from areal_hpc.trainer.logprobs import full_logits
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
    adam = engine.adam
    out = []
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
    """`name/logits` (the probe sequences', on the last stage's ranks) and `name/weights` (the whole
    model under Hugging Face names, on rank 0) of an engine; collective."""
    out = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        out[f"{name}/logits"] = got
    weights = engine.export_full()
    if weights is not None:
        out[f"{name}/weights"] = {k: v.cpu() for k, v in weights.items()}
    return out


def _steps(engine, seeds: list[int], step_cfg) -> list[dict]:
    from areal_hpc.trainer.step import ppo_step

    vocab = engine.arch.vocab_size
    # every data-parallel rank its own sequences
    return [ppo_step(engine, random_batch(vocab, seed=100 * s + engine.par.coords.dp), step_cfg) for s in seeds]


def resume_rank(par, model_dir, ckpt_dir, before: list[int], after: list[int], optim, dtype=torch.float32) -> dict:
    """`before` steps, save, `after` steps (uninterrupted); then a fresh engine loads the checkpoint and
    takes the same `after` steps (resumed). Batches come from the seeds; every rank returns the
    largest difference of its own optimizer state between the two runs."""
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    cfg = StepConfig()
    engine = Engine(model_dir, par, optim, dtype)
    _steps(engine, before, cfg)
    checkpoint.save(engine, ckpt_dir)
    saved = optimizer_state(engine)
    uninterrupted = _steps(engine, after, cfg)
    weights = engine.export_full()
    state = optimizer_state(engine)

    resumed = Engine(model_dir, par, optim, dtype)
    checkpoint.load(resumed, Path(ckpt_dir) / "trainer")
    loaded = optimizer_state(resumed)
    resumed_stats = _steps(resumed, after, cfg)
    result = {
        "load_diff": max_diff(saved, loaded),
        "optimizer_diff": max_diff(state, optimizer_state(resumed)),
    }
    resumed_weights = resumed.export_full()
    if weights is not None:
        result.update(
            stats=uninterrupted,
            resumed_stats=resumed_stats,
            weights={k: v.float().cpu() for k, v in weights.items()},
            resumed_weights={k: v.float().cpu() for k, v in resumed_weights.items()},
        )
    return result


def save_rank(par, model_dir, ckpt_dir, before: list[int], after: list[int], optim) -> dict:
    """`before` steps, the probe logits, save, then `after` steps: the weights at the end."""
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    engine = Engine(model_dir, par, optim)
    _steps(engine, before, StepConfig())
    result = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        result["logits"] = got
    checkpoint.save(engine, ckpt_dir)
    _steps(engine, after, StepConfig())
    weights = engine.export_full()
    if weights is not None:
        result["weights"] = {k: v.float().cpu() for k, v in weights.items()}
    return result


def load_rank(par, model_dir, ckpt_dir, after: list[int], optim) -> dict:
    """Load a checkpoint (written at any TP/PP/DP): the probe logits, then `after` steps' weights."""
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    engine = Engine(model_dir, par, optim)
    checkpoint.load(engine, Path(ckpt_dir) / "trainer")
    result = {}
    got = logits(engine, probe_sequences(engine.arch.vocab_size))
    if got is not None:
        result["logits"] = got
    _steps(engine, after, StepConfig())
    weights = engine.export_full()
    if weights is not None:
        result["weights"] = {k: v.float().cpu() for k, v in weights.items()}
    return result


def nonfinite_rank(par, model_dir, ckpt_dir, optim) -> dict:
    """One step, save, load into a fresh engine, then a step whose advantages are NaN: its error
    message and how much any weight moved (nothing may)."""
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.engine import Engine, NonFiniteError
    from areal_hpc.trainer.step import StepConfig, ppo_step

    engine = Engine(model_dir, par, optim)
    _steps(engine, [0], StepConfig())
    checkpoint.save(engine, ckpt_dir)
    resumed = Engine(model_dir, par, optim)
    checkpoint.load(resumed, Path(ckpt_dir) / "trainer")
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


def train_and_save_rank(par, models: dict, run_root, steps: int, optim) -> dict:
    """Per model (name -> (model directory, dtype name)): `steps` PPO steps, then the probe logits, the
    weights under Hugging Face names, and a complete checkpoint of version `steps` in the run
    directory `run_root/<name>/` (`checkpoints/step_<steps>/`, as a run writes it: what export reads)."""
    from areal_hpc.rundir import checkpoint_dir, mark_complete
    from areal_hpc.trainer import checkpoint
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig

    result = {}
    for name, (model_dir, dtype) in models.items():
        engine = Engine(model_dir, par, optim, getattr(torch, dtype))
        _steps(engine, list(range(steps)), StepConfig())
        result.update(_logits_and_weights(engine, name))
        step_dir = checkpoint_dir(Path(run_root) / name, steps)
        checkpoint.save(engine, step_dir)
        if par.rank == 0:
            mark_complete(step_dir)  # the controller's part in a run
    return result


def hf_logits(model_dir, device: str = "cpu") -> list[torch.Tensor]:
    """transformers' logits of each probe sequence, alone (fp32), on `device`; returned on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return [model(s[None].to(device)).logits[0].cpu() for s in probe_sequences(model.config.vocab_size)]
