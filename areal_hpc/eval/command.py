"""`areal-hpc eval`: how good a model is on held-out prompts, with the run's own workflow, generator and rewards.

```
 MODEL_DIR | RUN_DIR --step N -> Hugging Face directory (step 0: the run's initial model; step N: its
                                  checkpoint, exported once to RUN_DIR/hf/step_N); --steps A,B,...: each
                                  in turn on one engine, the next one's weights loaded into it
 --data FILE -> areal_hpc.data.dataset.load_prompts (the run's prompt format and length filter)
 K episodes per prompt of the run's workflow (rollout.workflow, its tools and limits), run by the
   generator's EpisodeRunner on the generator's vLLM engine (allocation.gen_tp, rollout.temperature)
 each episode, as it finishes -> its reward as in training: the workflow's own when finite; 0 when lost
   (the workflow raised: counted); else the reward workers' scorer pool on the final answer (reward.kind)
 -> pass@1 (mean over prompts of c/K), pass@k for k = 1, 2, 4, ... K, episode lengths, turns, tool calls
 -> a table on the terminal and a JSON report
```

So pass@k is measured the way the model is trained: the same episodes, not a single answer. The bookkeeping
(`EvalRound`) is the package's, shared with the evaluation between training steps (areal_hpc.eval.training);
the requests to the runner are the generator's eval requests (GenerateRequest.eval).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

from areal_hpc.config import Config, ConfigError, load_config
from areal_hpc.data.dataset import eval_path, load_prompts
from areal_hpc.eval import EvalRound
from areal_hpc.protocol import EPISODE_STATS, EvalTrajectory, GenerateRequest


def table(report: dict) -> str:
    """The report as the terminal shows it."""
    lines = [f"model    {report['model']}", f"data     {report['data']}"]
    lines.append(f"prompts  {report['prompts']} x {report['samples']} episodes (temperature {report['temperature']})")
    lines.append("")
    lines.append("  ".join(f"{'pass@' + k:>8}" for k in report["pass@k"]) + f"  {'reward':>8}")
    lines.append("  ".join(f"{v:8.3f}" for v in report["pass@k"].values()) + f"  {report['reward_mean']:8.3f}")
    t, e = report["episode_tokens"], report["episodes"]
    lines.append("")
    lines.append(
        f"episode tokens: mean {t['mean']:.1f}, median {t['median']:.0f}, p90 {t['p90']:.0f}, max {t['max']}; "
        f"ended by a limit: {report['truncated_frac']:.1%}; reward errors: {report['reward_errors']}"
    )
    lines.append(
        f"episodes ({report['workflow']}): turns {e['turns_mean']:.2f}, tool calls {e['tool_calls_mean']:.2f} "
        f"({e['tool_errors']} failed, {e['tool_s_mean']:.3f} s each); lost (the workflow raised): {report['workflow_errors']}"
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
        from areal_hpc.data.initial_model import initial_model

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
    from areal_hpc.data.tiny import _build_atomically
    from areal_hpc.trainer.export import ExportError, export_checkpoint

    try:
        return _build_atomically(run_dir / "hf" / f"step_{step}", lambda out: export_checkpoint(run_dir, step, out))
    except ExportError as e:
        raise ConfigError(str(e)) from None


# --- evaluation with a local engine -------------------------------------------------------------


def evaluate(cfg: Config, model_dir: Path, data: str | Path, samples: int, engine=None, progress=print) -> dict:
    """Run `samples` episodes of the run's workflow on every prompt of `data`, as a generator rank runs them
    (its `EpisodeRunner` on its engine), score them as training does, and report (`EvalRound.report`, the
    episodes' counts, and what was evaluated). `engine`: a function that returns the engine to use, called once
    the data and the workflow are known to be good; None for an engine of its own."""
    from transformers import AutoTokenizer

    from areal_hpc.generator import loop_watch
    from areal_hpc.generator.episodes import EpisodeRunner
    from areal_hpc.reward.pool import ScorerPool, pool_size
    from areal_hpc.workflow import load_workflow

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_prompts(cfg, tokenizer, data, setting="--data (eval.data)")
    workflow = load_workflow(cfg.rollout.workflow)()  # a bad one is refused before the engine starts
    scoring = _Scoring(cfg, tokenizer, examples, samples)
    own_engine = engine is None
    engine = _engine(cfg, model_dir) if own_engine else engine()
    runner = EpisodeRunner.from_config(cfg, engine, model_dir, workflow=workflow)
    pool = ScorerPool(pool_size(cfg.reward.processes), timeout_s=cfg.reward.timeout_s)
    requests = [GenerateRequest(i, e.prompt_ids, e.row, samples, eval=True) for i, e in enumerate(examples)]
    started = time.monotonic()

    async def episodes() -> None:
        loop_watch.install(workflow, cfg.rollout.workflow)
        url = await runner.open_endpoint()
        if url:
            progress(f"eval: the episodes' OpenAI endpoint: {url} (rollout.openai_endpoint)")
        for request in requests:
            runner.start(request)
        shown = time.monotonic()
        try:
            while runner.episodes or pool.pending:
                for episode in await runner.advance() if runner.episodes else []:
                    scoring.arrived(episode, pool)
                for (i, j), reward, reason in pool.poll(0 if runner.episodes else 0.01):
                    scoring.round.scored(i, j, reward, reason)
                if time.monotonic() - shown > 10:
                    shown = time.monotonic()
                    progress(f"eval: {scoring.episodes}/{len(requests) * samples} episodes ({shown - started:.0f} s)")
        finally:
            runner.close()
            await runner.close_endpoint()

    try:
        asyncio.run(episodes())
    finally:
        pool.close()
        if own_engine:
            engine.close()
    r = cfg.rollout
    report = {
        "model": str(model_dir),
        "data": str(data),
        "workflow": r.workflow,
        "temperature": r.temperature,
        "max_new_tokens": r.max_new_tokens,
        "max_turns": r.max_turns,
        "max_episode_tokens": r.max_episode_tokens,
        "seconds": round(time.monotonic() - started, 1),
    }
    return {**report, **scoring.round.report(), "episodes": scoring.summary()}


class _Scoring:
    """The episodes of one evaluation as they come back: their rewards as training gets them, and their
    counts (protocol.EPISODE_STATS; the lost ones are the round's `workflow_errors`)."""

    def __init__(self, cfg: Config, tokenizer, examples: list, samples: int):
        self.kind, self.tokenizer, self.examples = cfg.reward.kind, tokenizer, examples
        self.round = EvalRound(examples, samples)
        self.counts = dict.fromkeys(EPISODE_STATS, 0.0)
        self.episodes = 0
        self.lost: list[str] = []
        """The tracebacks of the episodes whose workflow raised."""

    def arrived(self, t: EvalTrajectory, pool) -> None:
        """Record an episode; its reward now (the workflow's own, or 0 when lost, counted as a workflow
        error), or from `pool` later."""
        from areal_hpc.reward import response_text

        i, j = t.prompt_index, t.index
        self.episodes += 1
        self.round.arrived(i, j, t.num_tokens, t.finish_reason == "length")
        for k in EPISODE_STATS:
            self.counts[k] += t.stats.get(k, 0)
        if t.error:
            self.lost.append(t.error)
            self.round.lost(i, j)
        elif math.isfinite(t.reward):
            self.round.scored(i, j, t.reward)
        else:
            pool.submit((i, j), self.kind, response_text(self.tokenizer, t.answer_ids), self.examples[i].target)

    def summary(self) -> dict:
        c, n = self.counts, max(self.episodes, 1)
        return {
            "turns_mean": c["turns"] / n,
            "tool_calls_mean": c["tool_calls"] / n,
            "tool_errors": int(c["tool_errors"]),
            "tool_s_mean": c["tool_s"] / max(c["tool_calls"], 1),
            "template_rewrites": int(c["template_rewrites"]),
            "first_error": self.lost[0] if self.lost else "",
        }


def run(args) -> int:
    """`areal-hpc eval`: one model, or a run's `--steps` one after the other on one engine (`--submit`: a Slurm
    array, one task per step)."""
    if args.submit:
        from areal_hpc.launch.eval_array import submit_eval_array

        return submit_eval_array(args)
    engine = None

    def engine_for(cfg: Config, model_dir: Path):
        """The engine with `model_dir`'s weights: started for the first checkpoint, the next ones' weights
        loaded into it as a weight sync loads them."""
        nonlocal engine
        if engine is None:
            engine = _engine(cfg, model_dir)
        else:
            from areal_hpc.trainer.convert import read_hf

            engine.load_weights(read_hf(model_dir).items(), version=engine.version + 1)
        return engine

    try:
        for step in args.steps or [args.step]:
            cfg, model_dir, step = resolve(args.target, step, list(args.overrides), args.config)
            data = args.data or eval_path(cfg)
            samples = cfg.eval.samples if args.samples is None else args.samples
            if samples < 1:
                raise ConfigError(f"--samples must be at least 1 (got {samples})")
            at_step = functools.partial(engine_for, cfg, model_dir)
            report = {"step": step, **evaluate(cfg, model_dir, data, samples, engine=at_step)}
            out = Path(args.output) if args.output else default_output(args.target, step, data)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")
            print(table(report))
            print(f"report: {out}")
    finally:
        if engine is not None:
            engine.close()
    return 0


def _engine(cfg: Config, model_dir: Path):
    """The generator's engine for `model_dir`. A LoRA run's checkpoint is evaluated as its merged export: an
    engine without vLLM's LoRA serves it."""
    from areal_hpc.device import resolve_device
    from areal_hpc.generator.engine import GenerationEngine

    plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0))
    return GenerationEngine.from_config(plain, model_dir, resolve_device(cfg.cluster.device))


def default_output(target: str | Path, step: int | None, data: str | Path) -> Path:
    """RUN_DIR/eval/step_N-<data>.json for a run; eval-<model>-<data>.json here for a model directory."""
    name = Path(data).stem
    if step is not None:
        return Path(target) / "eval" / f"step_{step}-{name}.json"
    return Path(f"eval-{Path(target).resolve().name}-{name}.json")
