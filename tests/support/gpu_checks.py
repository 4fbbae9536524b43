"""The GPU check's checks of the path a run takes (tools/gpu_check.py runs them after its trainer checks):
short runs of configs/gpu-smoke.yaml through `areal-hpc run` (or `submit`), also as a mixture of experts
and as the tiny agent, and the generator's interruption in a process of its own. Each returns (status,
detail): PASS, FAIL or SKIP and why.

Judged by the functions the CPU tests call (tests.support.runs, .generator_runs, .generator_log);
what a check needs is counted from the layout its overrides give (`gpus_needed`), never assumed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import yaml

from areal_hpc.arch import model_arch
from areal_hpc.config import Config, load_config
from areal_hpc.layout import Layout
from tests.support.generator_log import engine_start
from tests.support.runs import (
    REPO,
    RunProcess,
    checked_steps,
    metrics_problems,
    stop_and_resume,
    stop_resume_problems,
)
from tests.support.shapes import INTERRUPTION

SMOKE = "configs/gpu-smoke.yaml"
MISMATCH_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
"""Largest mean |behav_logp - trainer's logp| of a step (`ppo/logp_mismatch`), or of the tokens before
or after a resubmission in the interruption check, by model.dtype."""
RUN_TIMEOUT_S = 1800
"""At most for one short run (the engine's start, CUDA graphs and the model build included)."""
TP_AND_PP = ("cluster.gpus_per_node=4", "allocation.gen_gpus=2", "allocation.gen_tp=2", "allocation.train_pp=2")
"""One node: one generator at gen_tp 2 on its first two GPUs, the trainer at PP 2 on the other two: 4 GPUs."""
PP_ONLY = ("cluster.gpus_per_node=3", "allocation.gen_gpus=1", "allocation.gen_tp=1", "allocation.train_pp=2")
"""One node: the generator on its first GPU, the trainer at PP 2 on the other two: 3 GPUs."""
QWEN_VOCAB = ("model.vocab_size=151936", "model.max_position_embeddings=8192")
"""Qwen2's real vocabulary, and room for 4096 new tokens after a prompt (the built model only)."""
LONG = ("rollout.max_new_tokens=4096",)
MOE_EP2 = (
    "model.architecture=qwen3_moe",
    "ppo.routing_replay=true",
    "rollout.max_staleness=0",
    "cluster.gpus_per_node=3",
    "allocation.gen_gpus=1",
    "allocation.gen_tp=1",
    "allocation.train_ep=2",
)
"""gpu-smoke's model as a Qwen3-MoE with the tiny experts (4 of width 64, top 2), the trainer at EP 2 (2 ranks
at DP 2, two experts of every layer on each) replaying the generator's routing, the generator on the node's
first GPU: 3 GPUs. Synchronous, as tests/test_e2e.py runs the tiny MoE: every token is then of the version
being trained, so every step's logprob mismatch checks the expert weights the generator was sent."""
AGENT_CONFIG = "configs/tiny-agent-cpu.yaml"
EPISODE_FIELDS = ("workflow", "tool_format", "max_turns", "max_episode_tokens", "max_new_tokens", "tool_processes")
"""The `rollout` fields of the agent's episodes (the rest of its rollout is the batch, gpu-smoke's here)."""


def agent_settings() -> tuple[str, ...]:
    """The tiny agent (configs/tiny-agent-cpu.yaml: two-digit multiplications, which its model answers mostly by
    calling the calculator once its warm start showed it the call) as overrides of gpu-smoke, whose machine,
    batch and dtype it keeps: its model's shape (not gpu-smoke's 0.5B: the warm start trains on the launcher's
    CPU, one thread, where that would take hours), at heads of 64, the size every vLLM attention backend
    supports (its YAML's 32 is the smallest vLLM's CPU attention takes), its task, warm start and episodes."""
    own = yaml.safe_load((REPO / AGENT_CONFIG).read_text())
    model = {k: v for k, v in own["model"].items() if k not in ("path", "dtype")}
    model["num_attention_heads"] = model["hidden_size"] // 64
    rollout = {k: own["rollout"][k] for k in EPISODE_FIELDS}
    sections = {"model": model, "data": own["data"], "sft": own["sft"], "rollout": rollout}
    return tuple(f"{section}.{k}={v}" for section, fields in sections.items() for k, v in fields.items())


AGENT = agent_settings()
"""The tiny agent on gpu-smoke's machine: a generator's GPU, a trainer's GPU (`agent_settings`)."""


def smoke_overrides(overrides: list[str]) -> list[str]:
    """`overrides` for configs/gpu-smoke.yaml; with `model.path=DIR` the YAML's shape fields (those of the
    model it builds) are cleared, so the shape is DIR's config.json (a field the user sets is kept and checked)."""
    from areal_hpc.arch import SHAPE_FIELDS

    keys = {o.split("=", 1)[0] for o in overrides}
    if "model.path" not in keys:
        return list(overrides)
    return [*(f"model.{f}=null" for f in SHAPE_FIELDS if f"model.{f}" not in keys), *overrides]


def own_model(overrides: list[str]) -> list[str]:
    """`overrides` less the model's (`model.*`): the MoE and agent checks run the tiny models they name
    (a `model.path=DIR` of the user's is for the other runs)."""
    return [o for o in overrides if not o.startswith("model.")]


def moe_overrides(overrides: list[str]) -> list[str]:
    return [*MOE_EP2, *own_model(overrides)]


def agent_overrides(overrides: list[str]) -> list[str]:
    return [*AGENT, *own_model(overrides)]


def gpus_needed(overrides: list[str]) -> int:
    """GPUs of a gpu-smoke run with `overrides` on one machine: every node of its layout is this one."""
    layout = Layout.from_config(load_config(REPO / SMOKE, smoke_overrides(overrides)))
    return layout.nodes * layout.gpus_per_node


def short_run(work: Path, trial: str, overrides: list[str], steps: int | None = None) -> RunProcess:
    """`areal-hpc run configs/gpu-smoke.yaml` under `work` to its end: `steps` steps (None: the YAML's 20)."""
    args = smoke_overrides([f"experiment.root={work}", f"experiment.trial={trial}", *overrides])
    run = RunProcess(SMOKE, *args, *([f"train.total_steps={steps}"] if steps else []))
    run.wait(RUN_TIMEOUT_S)
    return run


def run_verdict(run: RunProcess, extra: str = "", problems: Sequence[str] = ()) -> tuple[str, str]:
    """A finished run judged from its exit code and its metrics (`rows_verdict`), with a check's own `problems`."""
    exited = []
    if run.proc.returncode != 0:
        tail = "\n".join(run.output.strip().splitlines()[-15:])
        exited.append(f"areal-hpc run exited with {run.proc.returncode}; logs in {run.run_dir / 'logs'}:\n{tail}")
    return rows_verdict(run.rows(), run.cfg, extra, [*exited, *problems])


def rows_verdict(rows: list[dict], cfg: Config, extra: str = "", problems: Sequence[str] = ()) -> tuple[str, str]:
    """The metrics.jsonl rows of a finished run of `cfg` judged (`metrics_problems`, at the mismatch tolerance of
    its dtype) after the `problems` found elsewhere. PASS's detail: steps, the slowest weight sync, the worst
    logprob mismatch, then `extra`."""
    problems = [*problems, *metrics_problems(rows, cfg.train.total_steps, MISMATCH_TOL[cfg.model.dtype])]
    checked = checked_steps(rows)
    detail = (
        f"{len(rows)} steps, weight sync {max((r.get('timing/weight_sync_s', 0) for r in rows), default=0):.2f} s at "
        f"most, logp mismatch {max((r['ppo/logp_mismatch'] for r in checked), default=0):.1e} over "
        f"{sum(r['ppo/logp_mismatch_tokens'] for r in checked):.0f} tokens ({cfg.model.dtype}){extra}"
    )
    return ("FAIL", "; ".join(problems)) if problems else ("PASS", detail)


def generator_settings(run: RunProcess) -> dict[str, str]:
    """vLLM's resolved settings from the run's first generator log ({}: not logged)."""
    log = run.run_dir / "logs" / "generator-0.log"
    return engine_start(log.read_text()).settings if log.exists() else {}


# --- the generator's interruption, in a process of its own --------------------------------------------


def interruption(
    work: Path, device: str, dtype: str, groups: int, n: int, max_new: int, steps=(16, 16), std: float = 0.05
) -> dict:
    """`generator_runs.interrupt_twice` on an engine of the project's configuration
    (`GenerationEngine.create`), `groups` x `n` turns in flight, weights in `dtype`; the
    reference is transformers in fp32 on the same weights rounded to `dtype`, on `device`.

    Weights B are A plus noise of `std`: 0.05 puts them about 1 nat apart per token (so a bad load
    shows) while keeping their activations near A's, and so bf16's error on both alike (vLLM's CPU
    kernels in bf16, 8 x 4 trajectories: mean mismatch 1.6e-3 before a resubmission, 2.6e-3 after;
    with the CPU test's 0.5, B's logits are so large that bf16 errs 10 times more after)."""
    import dataclasses

    import torch
    from transformers import Qwen2ForCausalLM

    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.generator.engine import GenerationEngine
    from tests.support.generator_runs import (
        interrupt_twice,
        interruption_mismatch,
        interruption_problems,
        perturb,
        round_to,
    )

    temperature = 0.8  # != 1: processed (tempered) logprobs are told from vLLM's raw ones
    path = build_tiny_model(dataclasses.replace(INTERRUPTION, dtype=dtype), work, seed=1)
    engine = GenerationEngine.create(
        path, device=device, dtype=dtype, temperature=temperature,
        max_model_len=INTERRUPTION.max_position_embeddings, max_num_seqs=groups * n, seed=0,
    )  # fmt: skip
    try:
        dt = getattr(torch, dtype)

        def model(seed: int | None):
            m = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            return round_to(perturb(m, seed, std) if seed is not None else m, dt).to(device)

        model_a, model_b = model(None), model(5)
        prompts = [[5 + g % 90, 6 + g % 7, 7] for g in range(groups)]
        run = interrupt_twice(engine, model_a, model_b, prompts, n, max_new, steps)
        mismatch = interruption_mismatch(run, model_a, model_b, temperature)
    finally:
        engine.close()
    return {
        "problems": interruption_problems(run, mismatch, MISMATCH_TOL[dtype]),
        "mismatch": mismatch,
        "load_s": run.load_s,
        "through_both": len(run.turns),
    }


def check_interruption(
    work: Path, device: str = "cuda", dtype: str = "bfloat16", groups: int = 64, n: int = 4, max_new: int = 128
) -> tuple[str, str]:
    """`interruption` in a spawned process: its engine and the memory it holds go with it."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        got = pool.submit(interruption, work / "interruption", device, dtype, groups, n, max_new).result()
    m = got["mismatch"]
    loads = ", ".join(f"{s:.2f}" for s in got["load_s"])
    detail = (
        f"{groups * n} turns in flight, {got['through_both']} through both loads; mean |logprob - "
        f"transformers'| {m.before.mean:.1e} before a resubmission ({m.before.tokens} tokens), {m.after.mean:.1e} "
        f"after ({m.after.tokens}), {m.first_after.mean:.1e} at the first token after one; weights A and B "
        f"{m.other.mean:.2f} apart; weight updates took {loads} s"
    )
    return ("FAIL", "; ".join(got["problems"]) + f" ({detail})") if got["problems"] else ("PASS", detail)


# --- long trajectories at Qwen's vocabulary -------------------------------------------------------------


def long_overrides(overrides: list[str]) -> list[str]:
    """Qwen's vocabulary and 4096 new tokens; a model of `model.path=DIR` keeps its own vocabulary."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [*LONG, *(() if "model.path" in keys else QWEN_VOCAB), *overrides]


def check_long(work: Path, overrides: list[str], steps: int = 3) -> tuple[str, str]:
    """A few steps at Qwen's vocabulary, 4096 new tokens, the config's ppo.max_tokens_per_mb: the bf16
    mismatch, and the peak memory of each trainer rank that reports it (`memory/peak_gib`: the trainer
    rank 0's, the only one at gpu-smoke's TP 1 x PP 1 x DP 1)."""
    run = short_run(work, "long", long_overrides(overrides), steps)
    rows, cfg = run.rows(), run.cfg
    trainers = Layout.from_config(cfg).trainers
    peak = max((r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r), default=None)
    memory = (
        f"trainer rank 0 of {trainers}: peak {peak:.1f} GiB allocated" if peak is not None else "no memory/peak_gib"
    )
    truncated = sum(r.get("rollout/truncated", 0) for r in rows)
    status, detail = run_verdict(
        run,
        f"; vocabulary {model_arch(cfg.model).vocab_size}, max_new_tokens {cfg.rollout.max_new_tokens} ({truncated:.0f} "
        f"trajectories reached it), ppo.max_tokens_per_mb {cfg.ppo.max_tokens_per_mb}; {memory}; generator: "
        "vLLM's share of its GPU (gpu_memory_utilization), not measured",
    )
    return status, detail


# --- a mixture of experts at EP 2, agent episodes with a tool ----------------------------------------------


def routing_findings(rows: list[dict]) -> tuple[list[str], str]:
    """(problems, detail) of a run with ppo.routing_replay: every step must report ppo/routing_agreement, which
    the trainer reports only when its routers replayed the generator's experts on some tokens. Its value is
    reported, not judged: on the CPU (fp32) it stays above 0.9 (tests/test_e2e.py), while in bf16 the trainer's
    router may break near-ties otherwise than vLLM's with nothing wrong; a wrong expert or router weight moves
    the logprob mismatch, which is judged."""
    missing = [r.get("step") for r in rows if "ppo/routing_agreement" not in r]
    problems = [f"steps {missing} report no ppo/routing_agreement: the trainer replayed no routing"] if missing else []
    agreement = [r["ppo/routing_agreement"] for r in rows if "ppo/routing_agreement" in r]
    if not agreement:
        return problems, "no routing agreement reported"
    mean = sum(agreement) / len(agreement)
    return problems, f"routing agreement {min(agreement):.3f} at the lowest, {mean:.3f} on average"


def check_moe(work: Path, overrides: list[str], steps: int = 5) -> tuple[str, str]:
    """`MOE_EP2`'s short run: every step trained, generator and trainer agreeing on logprobs after each sync of
    the experts from the two EP ranks, and the routing replayed (`routing_findings`)."""
    run = short_run(work, "moe-ep2", moe_overrides(overrides), steps)
    problems, detail = routing_findings(run.rows())
    arch = model_arch(run.cfg.model)
    layout = f"trainer at EP {run.cfg.allocation.train_ep}, {arch.num_experts} experts, top {arch.num_experts_per_tok}"
    return run_verdict(run, f"; {layout}; {detail}", problems)


def tool_findings(rows: list[dict], episodes_per_step: int) -> tuple[list[str], str]:
    """(problems, detail) of an agent run's episodes: the tool was called (`rollout/tool_calls_mean` times the
    `episodes_per_step` of a step's batch, summed), not every call failed (`rollout/tool_errors`, counted as the
    episodes arrive, so the two agree over a run, not to the call) and no episode was lost to its workflow
    raising (`rollout/workflow_errors`)."""
    calls = round(sum(r.get("rollout/tool_calls_mean", 0) for r in rows) * episodes_per_step)
    failed = sum(r.get("rollout/tool_errors", 0) for r in rows)
    lost = sum(r.get("rollout/workflow_errors", 0) for r in rows)
    problems = []
    if rows and calls == 0:
        problems.append("no episode called the tool: rollout/tool_calls_mean 0 on every step")
    elif failed >= calls > 0:
        problems.append(f"every tool call failed: {failed} rollout/tool_errors, about {calls} calls")
    if lost:
        problems.append(
            f"{lost} episode(s) lost, their workflow raised (rollout/workflow_errors): the generator's log says why"
        )
    per_episode = calls / max(len(rows) * episodes_per_step, 1)
    return problems, f"{calls} tool calls ({per_episode:.2f} per episode), {failed} failed; {lost} episodes lost"


def check_agent(work: Path, overrides: list[str], steps: int = 5) -> tuple[str, str]:
    """`AGENT`'s short run: every step trained, generator and trainer agreeing on logprobs, the episodes calling
    the calculator (`tool_findings`)."""
    run = short_run(work, "agent", agent_overrides(overrides), steps)
    rollout = run.cfg.rollout
    problems, detail = tool_findings(run.rows(), rollout.prompts_per_step * rollout.group_size)
    return run_verdict(run, f"; {rollout.workflow}: {detail}", problems)


# --- stop, resume, continue -------------------------------------------------------------------------------


def check_stop_resume(work: Path, overrides: list[str]) -> tuple[str, str]:
    """Ctrl-C after 2 steps, then the same run 3 steps further (`runs.stop_and_resume`)."""
    args = smoke_overrides([f"experiment.root={work}", "experiment.trial=resume", *overrides])
    run = stop_and_resume(SMOKE, *args, after=3, timeout=RUN_TIMEOUT_S)
    problems = stop_resume_problems(run, MISMATCH_TOL[run.second.cfg.model.dtype])
    if problems:
        return "FAIL", "; ".join(problems) + f" (logs in {run.run_dir / 'logs'})"
    return "PASS", f"stopped at {run.checkpoint.name}, resumed to step {run.total}"


# --- the same short run through Slurm --------------------------------------------------------------------

SUBMIT_WAIT_S = 3600
"""How long `--submit` waits for its job (the queue's wait included)."""


def wait_job(state, timeout_s: float, poll_s: float = 15, clock=time.monotonic, sleep=time.sleep) -> str:
    """The state `state()` (areal_hpc.launch.record.JobRecord.state) reports once the job has ended, or the last
    one seen after `timeout_s`. UNKNOWN, which Slurm's and the record's silence gives, and a squeue that could not
    answer are waited out."""
    from areal_hpc.launch.record import ACTIVE, SqueueError

    def current() -> str:
        try:
            return state()
        except SqueueError:
            return "UNKNOWN"

    deadline = clock() + timeout_s
    while (s := current()) in ACTIVE or s == "UNKNOWN":
        if clock() > deadline:
            return s
        sleep(poll_s)
    return s


def submit_verdict(state: str, rows: list[dict], steps: int, tol: float, run_dir: Path) -> tuple[str, str]:
    """A submitted job judged as a local run: COMPLETED and its metrics (`metrics_problems`); a job the
    queue never started is a SKIP (nothing was checked), one still running after the wait a FAIL."""
    if state == "PENDING":
        return "SKIP", f"the job was still PENDING after the wait; cancel it: areal-hpc cancel {run_dir}"
    problems = ([] if state == "COMPLETED" else [f"job {state} (areal-hpc status {run_dir})"]) + metrics_problems(
        rows, steps, tol
    )
    return ("FAIL", "; ".join(problems)) if problems else ("PASS", f"job COMPLETED, {len(rows)} steps")


def check_submit(root: Path, overrides: list[str], steps: int = 5) -> tuple[str, str]:
    """`areal-hpc submit configs/gpu-smoke.yaml --nodes 1` under `root` (a directory every node sees): one node,
    a GPU generating and one training, waited for with the job's record (areal_hpc.launch.record), judged from
    its metrics."""
    import subprocess
    import sys

    from areal_hpc.launch.record import JobRecord
    from areal_hpc.metrics import read_metrics

    trial = time.strftime("submit-%Y%m%d-%H%M%S")
    args = smoke_overrides([f"experiment.root={root}", f"experiment.trial={trial}", *overrides])
    args.append(f"train.total_steps={steps}")
    cmd = [sys.executable, "-m", "areal_hpc.cli", "submit", str(REPO / SMOKE), "--nodes", "1", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    cfg = load_config(REPO / SMOKE, [*args, "cluster.nodes=1"])
    run_dir = REPO / cfg.run_dir
    record = JobRecord.load(run_dir)
    if proc.returncode != 0 or record is None:
        return "FAIL", f"areal-hpc submit exited with {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    state = wait_job(record.state, SUBMIT_WAIT_S)
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return submit_verdict(state, rows, steps, MISMATCH_TOL[cfg.model.dtype], run_dir)
