"""tools/gpu_check.sh as a user runs it on a GPU node, here on this machine's device (AREAL_DEVICE resolved
as the trainer tests resolve it): every trainer check passes and the summary counts them. And the parts
of its run checks that need no GPU: the layouts they ask for and the GPUs those need, and the judges
(metrics, the MoE run's routing replay, the agent run's tool calls, generator log, interruption, a submitted
job, the driver's version) on made-up inputs. The same judges run on real runs in tests/test_e2e.py and
tests/test_generator.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import stat
import subprocess

import numpy as np
import pytest

from areal_hpc.arch import model_arch
from areal_hpc.config import Config, load_config
from areal_hpc.controller.batch import BatchInfo
from areal_hpc.controller.step_metrics import StepMetrics
from areal_hpc.device import visible_gpus
from areal_hpc.launch.record import SqueueError
from areal_hpc.layout import Layout, Role
from areal_hpc.metrics import read_metrics
from areal_hpc.protocol import Trajectory
from areal_hpc.trainer.spawn import default_device
from tests.support import gpu_checks
from tests.support.generator_log import ENGINE_LINE, engine_start, startup_verdict
from tests.support.generator_runs import Interrupted, InterruptionMismatch, Mismatch, interruption_problems
from tests.support.helpers import REPO
from tests.support.runs import metrics_problems

SMOKE = REPO / "configs" / "gpu-smoke.yaml"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    return gpu_check


@pytest.mark.megatron
@pytest.mark.slow
def test_trainer_checks_pass_and_are_summarised():
    device = default_device()
    proc = subprocess.run(
        [str(REPO / "tools" / "gpu_check.sh"), "--trainer-only"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "AREAL_DEVICE": device},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    summary = out[out.index("== areal-hpc gpu_check summary") :].splitlines()
    checks = [line for line in summary if line.startswith(("PASS", "FAIL", "SKIP"))]
    two_tp = device == "cpu" or len(visible_gpus()) >= 2
    assert [c.split(":")[0] for c in checks if c.startswith("PASS")] == [
        "PASS trainer logits vs transformers, export round trip (TP 1)",
        "PASS PPO step, save, resume = uninterrupted (float32, TP 1)",
        "PASS PPO step, save, resume = uninterrupted (bfloat16, TP 1)",
        *(
            ["PASS trainer logits vs transformers (TP 2)", "PASS PPO step, save, resume = uninterrupted (bf16, TP 2)"]
            if two_tp
            else []
        ),
    ]
    assert not any(c.startswith("FAIL") for c in checks)
    assert summary[-1] == f"{5 if two_tp else 3} passed, 0 failed, {len(checks) - (5 if two_tp else 3)} skipped"
    assert '"driver": ' in summary[1]  # the environment line records the driver (null without one)


def test_a_model_directory_replaces_the_smoke_configs_shape(tmp_path):
    """`tools/gpu_check.sh model.path=DIR`: the shape is DIR's config.json, not gpu-smoke.yaml's tiny one
    (which, given as it is, contradicts DIR and is a config error)."""
    from areal_hpc.arch import model_arch
    from areal_hpc.config import ConfigError
    from areal_hpc.data.tiny import hf_config
    from tests.support.shapes import QWEN2

    model = model_arch(QWEN2)  # the trainer checks' model: another shape than gpu-smoke.yaml's
    hf_config(QWEN2).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(SMOKE, [f"model.path={tmp_path}"])
    arch = model_arch(load_config(SMOKE, gpu_checks.smoke_overrides([f"model.path={tmp_path}"])).model)
    assert arch == model
    assert gpu_checks.smoke_overrides(["rollout.group_size=4"]) == ["rollout.group_size=4"]
    # the long check keeps DIR's vocabulary rather than contradict it
    longer = dataclasses.replace(QWEN2, max_position_embeddings=8192)
    hf_config(longer).save_pretrained(tmp_path / "longer")
    overrides = gpu_checks.long_overrides([f"model.path={tmp_path / 'longer'}"])
    long = load_config(SMOKE, gpu_checks.smoke_overrides(overrides))
    assert model_arch(long.model).vocab_size == model.vocab_size and long.rollout.max_new_tokens == 4096


def test_the_run_checks_ask_for_the_layouts_they_name():
    """gen_tp 2 and PP 2 in one run of 4 GPUs (a generator's two TP workers in both stages' weight-sync
    groups), PP 2 alone on 3, the others on gpu-smoke's 2; the long run at Qwen's vocabulary."""
    assert gpu_checks.gpus_needed([]) == 2
    assert gpu_checks.gpus_needed(list(gpu_checks.TP_AND_PP)) == 4
    assert gpu_checks.gpus_needed(list(gpu_checks.PP_ONLY)) == 3
    assert gpu_checks.gpus_needed(gpu_checks.long_overrides([])) == 2

    both = Layout.from_config(load_config(SMOKE, list(gpu_checks.TP_AND_PP)))
    [generator] = both.ranks(Role.GENERATOR)
    assert both.weight_sync_ranks(generator) == (1, 2) and both.weight_sync_size == 3
    assert [both.stage_source_rank(s) for s in range(2)] == list(both.ranks(Role.TRAINER))  # two groups
    assert both.machine_gpus(generator) == (0, 1)
    pp = Layout.from_config(load_config(SMOKE, list(gpu_checks.PP_ONLY)))
    assert (pp.generators, pp.trainers, pp.train_pp, pp.gen_tp) == (1, 2, 2, 1)

    long = load_config(SMOKE, gpu_checks.long_overrides([]))
    assert (long.model.vocab_size, long.rollout.max_new_tokens) == (151936, 4096)
    assert long.ppo.max_tokens_per_mb == load_config(SMOKE).ppo.max_tokens_per_mb  # the config's


def test_the_moe_and_agent_checks_ask_for_the_layouts_they_name(tmp_path):
    """The MoE check: the generator on a GPU of its own, 2 trainer ranks at EP 2 (DP 2: two of the 4 experts on
    each), routing replay on, synchronous: 3 GPUs. The agent check: configs/tiny-agent-cpu.yaml's episodes,
    warm start and model (heads of 64) on gpu-smoke's 2 GPUs. Both keep their tiny models when the user's
    runs are on `model.path=DIR`."""
    moe = load_config(SMOKE, gpu_checks.moe_overrides([]))
    layout = Layout.from_config(moe)
    assert gpu_checks.gpus_needed(gpu_checks.moe_overrides([])) == 3
    assert (layout.generators, layout.trainers, layout.train_dp, layout.train_ep) == (1, 2, 2, 2)
    gpus = [layout.machine_gpus(r) for r in (*layout.ranks(Role.GENERATOR), *layout.ranks(Role.TRAINER))]
    assert gpus == [(0,), (1,), (2,)]
    arch = model_arch(moe.model)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.num_layers) == (4, 2, 24)
    assert moe.ppo.routing_replay and moe.rollout.max_staleness == 0 and moe.cluster.device == "cuda"

    agent = load_config(SMOKE, gpu_checks.agent_overrides([]))
    recipe = load_config(REPO / "configs" / "tiny-agent-cpu.yaml")
    assert gpu_checks.gpus_needed(gpu_checks.agent_overrides([])) == 2
    for field in ("workflow", "tool_format", "max_turns", "max_episode_tokens", "max_new_tokens", "tool_processes"):
        assert getattr(agent.rollout, field) == getattr(recipe.rollout, field), field
    assert agent.data == recipe.data and agent.sft == recipe.sft  # the multiplication task, the warm start to call
    got, want = model_arch(agent.model), model_arch(recipe.model)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.head_dim, want.head_dim) == (64, 32) and agent.cluster.device == "cuda"

    from areal_hpc.data.tiny import hf_config
    from tests.support.shapes import QWEN2

    hf_config(QWEN2).save_pretrained(tmp_path)
    user = [f"model.path={tmp_path}", "model.dtype=float32"]
    for overrides in (gpu_checks.moe_overrides(user), gpu_checks.agent_overrides(user)):
        cfg = load_config(SMOKE, gpu_checks.smoke_overrides(overrides))
        assert (cfg.model.path, cfg.model.dtype) == ("tiny", "bfloat16")
    assert gpu_checks.gpus_needed(gpu_checks.moe_overrides(user)) == 3


def row(step: int, **kw) -> dict:
    base = {"step": step, "ppo/loss": 0.1, "ppo/grad_norm": 1.0, "ppo/logp_mismatch": 1e-3}
    return base | {"ppo/logp_mismatch_tokens": 10} | kw


def test_metrics_problems_name_what_is_wrong():
    rows = [row(1), row(2), row(3, **{"ppo/logp_mismatch_tokens": 0, "ppo/logp_mismatch": 0.0})]
    assert metrics_problems(rows, 3, 5e-2) == []
    assert metrics_problems(rows[:2], 3, 5e-2) == ["steps [1, 2] in metrics.jsonl, expected 1..3"]
    assert metrics_problems([row(1, **{"ppo/loss": float("nan")})], 1, 5e-2) == ["step 1: ppo/loss = nan"]
    [problem] = metrics_problems([row(1, **{"ppo/logp_mismatch": 0.3})], 1, 5e-2)
    assert "disagree on logprobs" in problem and "3.00e-01" in problem
    [problem] = metrics_problems([row(1, **{"ppo/logp_mismatch_tokens": 0})], 1, 5e-2)
    assert "weight sync was never checked" in problem


def arrival(tool_errors: int = 0, error: str = "") -> Trajectory:
    """An episode as it reaches the controller, with what its counts read: its failed tool calls, or the
    traceback of a workflow that raised (a lost episode: no tokens)."""
    empty = np.zeros(0, np.int32)
    no_tokens = (empty, empty, empty.astype(np.uint8), empty.astype(np.float32), empty, empty)
    return Trajectory(0, 0, *no_tokens, "stop", stats={"tool_errors": tool_errors}, error=error)


def written_rows(run_dir, cfg: Config, steps: list[tuple[float, dict, list[Trajectory]]]) -> list[dict]:
    """metrics.jsonl as the controller writes it (StepMetrics) for `steps`, each (the mean tool calls of its
    batch's episodes, the trainer's figures, the episodes that arrived since the step before)."""
    run_dir.mkdir()
    writer = StepMetrics(run_dir, cfg, None, generators=1)
    for version, (tool_calls_mean, stats, arrived) in enumerate(steps, 1):
        for episode in arrived:
            writer.arrived(episode)
        info = BatchInfo(reward_mean=0.5, response_tokens=500, sequences=64, tool_calls_mean=tool_calls_mean)
        writer.write(version, info, stats, rollouts={}, sync_s=0.2, drain_s=0.0, sync_bytes=0, save_s=0.0, evals={})
    writer.close()
    return read_metrics(run_dir)


TRAINED = {"ppo/loss": 0.1, "ppo/grad_norm": 1.0, "ppo/logp_mismatch": 2e-3, "ppo/logp_mismatch_tokens": 40}
"""The trainer's figures of a step that went well (areal_hpc.trainer.step)."""


def test_the_agent_and_moe_verdicts_name_what_is_wrong(tmp_path):
    """Judged as check_agent and check_moe judge a run: rows as the controller writes them with the trainer's
    figures. Episodes that called the calculator pass, the count in the detail; none calling it, every call
    failing, a lost episode or a logprob mismatch fail saying so; a MoE step without its routing agreement
    fails naming the step."""
    base = [f"experiment.root={tmp_path}", "logging.tensorboard=false", "train.total_steps=2"]
    agent = load_config(SMOKE, [*base, *gpu_checks.AGENT])
    episodes = agent.rollout.prompts_per_step * agent.rollout.group_size  # 64 a step

    def agent_verdict(name, steps):
        rows = written_rows(tmp_path / name, agent, steps)
        problems, detail = gpu_checks.tool_findings(rows, episodes)
        return gpu_checks.rows_verdict(rows, agent, f"; {detail}", problems)

    status, detail = agent_verdict("calls", [(0.25, TRAINED, [arrival(1)]), (0.75, TRAINED, [arrival()])])
    assert status == "PASS" and detail.endswith("; 64 tool calls (0.50 per episode), 1 failed; 0 episodes lost")
    assert detail.startswith("2 steps, weight sync 0.20 s at most, logp mismatch 2.0e-03 over 80 tokens (bfloat16)")
    assert agent_verdict("none", [(0.0, TRAINED, [])] * 2) == (
        "FAIL",
        "no episode called the tool: rollout/tool_calls_mean 0 on every step",
    )
    all_failed = [(0.25, TRAINED, [arrival(8)] * 2), (0.0, TRAINED, [])]
    assert agent_verdict("failed", all_failed) == (
        "FAIL",
        "every tool call failed: 16 rollout/tool_errors, about 16 calls",
    )
    status, detail = agent_verdict("lost", [(0.5, TRAINED, [arrival(error="Traceback ...")]), (0.5, TRAINED, [])])
    assert status == "FAIL" and detail.startswith("1 episode(s) lost, their workflow raised (rollout/workflow_errors)")
    off = TRAINED | {"ppo/logp_mismatch": 0.3}
    status, detail = agent_verdict("mismatch", [(0.5, TRAINED, []), (0.5, off, [])])
    assert status == "FAIL" and "disagree on logprobs" in detail and "3.00e-01 > 5e-02" in detail

    moe = load_config(SMOKE, [*base, *gpu_checks.MOE_EP2])

    def moe_verdict(name, agreements):
        steps = [(0.0, TRAINED | ({"ppo/routing_agreement": a} if a is not None else {}), []) for a in agreements]
        rows = written_rows(tmp_path / name, moe, steps)
        problems, detail = gpu_checks.routing_findings(rows)
        return gpu_checks.rows_verdict(rows, moe, f"; {detail}", problems)

    status, detail = moe_verdict("replayed", [0.95, 0.97])
    assert status == "PASS" and detail.endswith("; routing agreement 0.950 at the lowest, 0.960 on average")
    assert moe_verdict("not-replayed", [0.95, None]) == (
        "FAIL",
        "steps [2] report no ppo/routing_agreement: the trainer replayed no routing",
    )


LOG = """\
2026-11-24 10:00:00,000 generator INFO generator 0 (world rank 2) on host n1: generator node 0, GPUs 0,1 of 0,1 (pid 7)
(EngineCore pid=9) INFO 11-24 10:00:20 [core.py:403] init engine (profile, create kv cache, warmup model) took 9.1 s
2026-11-24 10:00:41,500 generator INFO generator 0 (world rank 2) vLLM engine: vllm=0.32.0 model_runner=V1 \
async_scheduling=off worker_start_method=spawn tensor_parallel_size=2
2026-11-24 10:09:00,000 generator INFO generator 0 (world rank 2) on host n1: generator node 0, GPUs 0,1 of 0,1 (pid 8)
2026-11-24 10:09:05,000 generator INFO generator 0 (world rank 2) vLLM engine: vllm=0.32.0 model_runner=V1
"""


def test_the_generator_log_gives_the_engine_settings_and_its_start_time():
    start = engine_start(LOG)  # the first start of a log appended to across a resume
    assert start.started == dt.datetime(2026, 11, 24, 10, 0, 0)
    assert start.seconds == 41.5
    assert start.settings == {
        "vllm": "0.32.0",
        "model_runner": "V1",
        "async_scheduling": "off",
        "worker_start_method": "spawn",
        "tensor_parallel_size": "2",
    }
    status, detail = startup_verdict(start, 600)
    assert status == "PASS" and "42 s: 7% of train.startup_timeout_s (600 s" in detail
    assert startup_verdict(start, 60)[0] == "FAIL"  # 69% of the limit leaves a real model no room

    without = "\n".join(line for line in LOG.splitlines() if ENGINE_LINE not in line)
    start = engine_start(without)
    assert start.started is not None and start.seconds is None and start.settings == {}
    assert startup_verdict(start, 600) == (
        "SKIP",
        f"no '{ENGINE_LINE}' line in the generator's log: its start time is not logged",
    )
    assert startup_verdict(engine_start(""), 600)[0] == "FAIL"


def interrupted(versions: list[int], first: int, second: int) -> Interrupted:
    from areal_hpc.generator.engine import EngineTurn
    from areal_hpc.workflow.client import Turn

    ids = list(range(len(versions)))
    t = EngineTurn("p1.0", [3], len(ids), Turn(ids, [0.0] * len(ids), list(versions), "length"))
    return Interrupted(5, {"p1.0": ids[:first]}, {"p1.0": ids[:second]}, [], [t], (0.1, 0.1, 0.1))


def test_interruption_problems_name_a_misplaced_switch_and_a_bad_token_after_a_resubmission():
    good = Mismatch(1e-3, 1e-2, 100)
    ok = InterruptionMismatch(good, good, good, Mismatch(1.0, 4.0, 300))
    assert interruption_problems(interrupted([5, 5, 6, 6, 7], 2, 4), ok, 5e-2) == []
    [problem] = interruption_problems(interrupted([5, 6, 6, 6, 7], 2, 4), ok, 5e-2)
    assert "do not switch at tokens 2 and 4" in problem
    stale = ok._replace(first_after=Mismatch(0.8, 2.0, 2))
    [problem] = interruption_problems(interrupted([5, 5, 6, 6, 7], 2, 4), stale, 5e-2)
    assert problem.startswith("the first token after each resubmission: mean |logprob - transformers'| 8.00e-01")
    alike = ok._replace(other=Mismatch(0.1, 0.2, 300))
    assert "would pass unseen" in interruption_problems(interrupted([5, 5, 6, 6, 7], 2, 4), alike, 5e-2)[0]


def test_a_submitted_job_is_waited_for_and_judged_as_a_run(tmp_path):
    states = iter(["PENDING", "UNKNOWN", SqueueError("a busy controller"), "RUNNING", "COMPLETED"])

    def state():
        if isinstance(s := next(states), Exception):
            raise s
        return s

    assert gpu_checks.wait_job(state, 60, sleep=lambda s: None) == "COMPLETED"
    clock = iter(range(0, 1000, 100))
    assert gpu_checks.wait_job(lambda: "PENDING", 250, clock=lambda: next(clock), sleep=lambda s: None) == "PENDING"

    rows = [row(1), row(2)]
    assert gpu_checks.submit_verdict("COMPLETED", rows, 2, 5e-2, tmp_path) == ("PASS", "job COMPLETED, 2 steps")
    assert gpu_checks.submit_verdict("PENDING", [], 2, 5e-2, tmp_path)[0] == "SKIP"
    status, detail = gpu_checks.submit_verdict("FAILED (exit code 1)", rows[:1], 2, 5e-2, tmp_path)
    assert status == "FAIL" and detail.startswith(f"job FAILED (exit code 1) (areal-hpc status {tmp_path}); steps [1]")


def test_the_driver_version_from_nvidia_smi_else_the_kernel_module(tmp_path, gpu_check):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '550.54.15\\n550.54.15\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder@U16)  "
        "Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert gpu_check.driver_version(str(smi), proc) == "550.54.15"
    assert gpu_check.driver_version(str(tmp_path / "absent"), proc) == "535.104.05"
    assert gpu_check.driver_version(str(tmp_path / "absent"), tmp_path / "absent") is None


def test_without_the_gpus_each_run_check_says_what_it_needs(tmp_path, gpu_check):
    env = {}
    results = gpu_check.path_checks(tmp_path, [], 0, None, env)
    assert [(r.name, r.status, r.detail) for r in results] == [
        ("NCCL weight sync + 20 steps of gpu-smoke", "SKIP", "needs 2 GPUs, 0 visible"),
        (
            "engine start within train.startup_timeout_s",
            "SKIP",
            "read from the gpu-smoke run's generator log: no such run",
        ),
        ("generator at gen_tp 2: NCCL weight sync, logprobs agree", "SKIP", "needs 4 GPUs, 0 visible"),
        ("trainer at PP 2 -> generator", "SKIP", "needs 3 GPUs, 0 visible"),
        ("tiny MoE at EP 2: expert weight sync to vLLM with routing replay", "SKIP", "needs 3 GPUs, 0 visible"),
        ("agent episodes with a tool on a GPU engine", "SKIP", "needs 2 GPUs, 0 visible"),
        ("interruption, 256 trajectories in flight (bf16, the project's engine)", "SKIP", "needs 1 GPUs, 0 visible"),
        ("Qwen's vocabulary, 4096 new tokens: peak memory, bf16 mismatch", "SKIP", "needs 2 GPUs, 0 visible"),
        ("stop (Ctrl-C), resume, continue a run", "SKIP", "needs 2 GPUs, 0 visible"),
        (
            "20 steps through areal-hpc submit --nodes 1",
            "SKIP",
            "not asked for: --submit (on a Slurm cluster's login node)",
        ),
    ]
    assert env == {}


@pytest.mark.vllm
@pytest.mark.slow
def test_the_interruption_check_runs_in_a_process_of_its_own(tmp_path):
    """The GPU check's interruption (bf16, in a spawned process), here on the CPU with a few trajectories."""
    status, detail = gpu_checks.check_interruption(tmp_path, "cpu", "bfloat16", groups=4, n=4, max_new=48)
    assert status == "PASS", detail
    assert detail.startswith("16 turns in flight, ") and "before a resubmission" in detail
