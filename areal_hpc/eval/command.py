"""`areal-hpc eval`: how good a model is on held-out prompts, with the run's own generator and rewards.

```
 MODEL_DIR | RUN_DIR --step N -> Hugging Face directory (step 0: the run's initial model; step N: its
                                  checkpoint, exported once to RUN_DIR/hf/step_N)
 --data FILE -> areal_hpc.data.load_prompts (the run's prompt format and length filter)
 K trajectories per prompt: the generator's vLLM engine (allocation.gen_tp, rollout.temperature, max_new_tokens)
 each trajectory, as it finishes -> the reward workers' scorer pool (reward.kind, reward.timeout_s)
 -> pass@1 (mean over prompts of c/K), pass@k for k = 1, 2, 4, ... K, trajectory lengths
 -> a table on the terminal and a JSON report
```

The bookkeeping (`EvalRound`) is the package's, shared with the evaluation between training steps
(areal_hpc.eval.training); the requests to the engine are the generator's EvalRequests.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from areal_hpc.config import Config, ConfigError, load_config
from areal_hpc.data import eval_path, load_prompts
from areal_hpc.eval import EvalRound
from areal_hpc.protocol import EvalRequest


def table(report: dict) -> str:
    """The report as the terminal shows it."""
    lines = [f"model    {report['model']}", f"data     {report['data']}"]
    lines.append(
        f"prompts  {report['prompts']} x {report['samples']} trajectories (temperature {report['temperature']})"
    )
    lines.append("")
    lines.append("  ".join(f"{'pass@' + k:>8}" for k in report["pass@k"]) + f"  {'reward':>8}")
    lines.append("  ".join(f"{v:8.3f}" for v in report["pass@k"].values()) + f"  {report['reward_mean']:8.3f}")
    t = report["trajectory_tokens"]
    lines.append("")
    lines.append(
        f"trajectory tokens: mean {t['mean']:.1f}, median {t['median']:.0f}, p90 {t['p90']:.0f}, max {t['max']}; "
        f"cut at max_new_tokens: {report['truncated_frac']:.1%}; reward errors: {report['reward_errors']}"
    )
    return "\n".join(lines)


# --- the model to evaluate ----------------------------------------------------------------------


def resolve(target: str | Path, step: int | None, overrides: list[str], config: str | None = None):
    """(config, Hugging Face directory, step) of what `areal-hpc eval TARGET` names.

    A Hugging Face directory (config.json): itself, with `config` (or the defaults) and the overrides.
    A run directory (config.yaml and checkpoints/): the run's config; step 0 is its initial model,
    step N (default: the latest complete checkpoint) its checkpoint exported once to RUN_DIR/hf/step_N.
    """
    from areal_hpc.checkpoint.files import checkpoint_dir, checkpoint_version, complete_checkpoints, latest_checkpoint

    path = Path(target)
    if (path / "config.json").is_file():
        if step is not None:
            raise ConfigError(f"--step applies to a run directory; {path} is a Hugging Face model directory")
        return load_config(config, overrides), path, None
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"{path} is neither a Hugging Face model directory (config.json) nor a run directory (config.yaml)"
        )
    if config is not None:
        raise ConfigError(f"--config applies to a model directory; {path} is a run: its own config.yaml is used")
    cfg = load_config(path / "config.yaml", overrides)
    if step is None:
        latest = latest_checkpoint(path)
        if latest is None:
            raise ConfigError(f"{path} has no complete checkpoint yet; --step 0 evaluates its initial model")
        step = checkpoint_version(latest)
    if step == 0:
        from areal_hpc.sft import initial_model

        return cfg, initial_model(cfg), 0
    complete = complete_checkpoints(path)
    if checkpoint_dir(path, step) not in complete:
        have = [checkpoint_version(d) for d in complete]
        raise ConfigError(
            f"{path} has no complete checkpoint of step {step} (complete: {have or 'none'}; 0 is the initial model)"
        )
    return cfg, export(path, step), step


def export(run_dir: Path, step: int) -> Path:
    """The Hugging Face directory of a run's checkpoint, exported once (`areal-hpc export`'s function)."""
    from areal_hpc.tiny import _build_atomically
    from areal_hpc.trainer.export import ExportError, export_checkpoint

    try:
        return _build_atomically(run_dir / "hf" / f"step_{step}", lambda out: export_checkpoint(run_dir, step, out))
    except ExportError as e:
        raise ConfigError(str(e)) from None


# --- evaluation with a local engine -------------------------------------------------------------


def evaluate(cfg: Config, model_dir: Path, data: str | Path, samples: int, engine=None, progress=print) -> dict:
    """Generate `samples` trajectories to every prompt of `data` with the generator's engine code, score them
    with the reward workers' pool, and report (`EvalRound.report` plus what was evaluated)."""
    from transformers import AutoTokenizer

    from areal_hpc.device import resolve_device
    from areal_hpc.generator.engine import GenerationEngine
    from areal_hpc.reward import response_text
    from areal_hpc.reward.pool import ScorerPool
    from areal_hpc.reward.worker import pool_size

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_prompts(cfg, tokenizer, data, setting="--data (eval.data)")
    round_ = EvalRound(examples, samples)
    own_engine = engine is None
    if own_engine:
        engine = GenerationEngine.from_config(cfg, model_dir, resolve_device(cfg.cluster.device))
    pool = ScorerPool(pool_size(cfg.reward.processes), timeout_s=cfg.reward.timeout_s)
    total, generated, started, shown = len(examples) * samples, 0, time.monotonic(), time.monotonic()
    try:
        for i, e in enumerate(examples):
            engine.add(EvalRequest(i, e.prompt_ids, samples))
        while engine.in_flight or pool.pending:
            for t in engine.step() if engine.in_flight else []:
                round_.arrived(t.prompt_index, t.index, len(t.output_ids), t.finish_reason == "length")
                text = response_text(tokenizer, t.output_ids)
                pool.submit((t.prompt_index, t.index), cfg.reward.kind, text, examples[t.prompt_index].target)
                generated += 1
            for (i, j), reward, reason in pool.poll(0 if engine.in_flight else 0.01):
                round_.scored(i, j, reward, reason)
            if time.monotonic() - shown > 10:
                shown = time.monotonic()
                progress(f"eval: {generated}/{total} trajectories ({shown - started:.0f} s)")
    finally:
        pool.close()
        if own_engine:
            engine.close()
    report = {
        "model": str(model_dir),
        "data": str(data),
        "temperature": cfg.rollout.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seconds": round(time.monotonic() - started, 1),
    }
    return {**report, **round_.report()}


def run(args) -> int:
    """`areal-hpc eval`: one model (or `--submit`: a Slurm array, one task per step)."""
    if args.submit:
        from launch.eval_array import submit_eval_array

        return submit_eval_array(args)
    cfg, model_dir, step = resolve(args.target, args.step, list(args.overrides), args.config)
    data = args.data or eval_path(cfg)
    samples = cfg.eval.samples if args.samples is None else args.samples
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1 (got {samples})")
    report = {"step": step, **evaluate(cfg, model_dir, data, samples)}
    out = Path(args.output) if args.output else default_output(args.target, step, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"report: {out}")
    return 0


def default_output(target: str | Path, step: int | None, data: str | Path) -> Path:
    """RUN_DIR/eval/step_N-<data>.json for a run; eval-<model>-<data>.json here for a model directory."""
    name = Path(data).stem
    if step is not None:
        return Path(target) / "eval" / f"step_{step}-{name}.json"
    return Path(f"eval-{Path(target).resolve().name}-{name}.json")
