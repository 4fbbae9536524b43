"""A user's first check on a GPU node: PASS, FAIL or SKIP (with why) per check, and a summary to attach
to a bug report. Run it through `tools/gpu_check.sh` (which finds the Python and the checkout).

    tools/gpu_check.sh                  # the trainer checks, then the checks of a run's path
    tools/gpu_check.sh --trainer-only   # no vLLM needed: also from a checkout on PYTHONPATH with the
                                        # machine's own PyTorch (2.11 or newer) and megatron-core
    tools/gpu_check.sh --submit cluster.partition=gpu   # also the short run through Slurm, on 2 nodes
    tools/gpu_check.sh model.path=DIR   # the runs on a real model (its config.json gives the shape;
                                        # the MoE and agent runs keep their tiny models)

Every check calls the functions of tests/support/ that the CPU tests call. Trainer checks (on this
machine's device: AREAL_DEVICE=auto|cpu|cuda, auto by default):
  - logits against transformers on a small Qwen2 built here, and the export round trip, at TP 1;
  - one PPO step, save, resume, and the steps after it equal to an uninterrupted run, in fp32 and bf16;
  - with 2+ GPUs, the same at TP 2.
The path a run takes (vLLM and GPUs: tests/support/gpu_checks.py; a generator and a trainer never
share a GPU over NCCL, so each check needs the GPUs of its layout, and says so when they are not here):
  - 20 steps of configs/gpu-smoke.yaml (a ~0.5B Qwen2 built here, bf16): every step trained with finite
    loss and gradient norm, weights synced to the vLLM engine over NCCL, generator and trainer agreeing
    on logprobs (2 GPUs); from its generator's log, vLLM's resolved settings (the summary) and the
    engine's start time against train.startup_timeout_s;
  - a generator at gen_tp 2 receiving weights over NCCL, and a trainer at PP 2 sending to it (two
    weight-sync groups in their agreed order): one run of 4 GPUs, reported as two lines (with 3 GPUs
    the PP 2 run alone);
  - 5 steps of gpu-smoke as a Qwen3-MoE with the tiny experts (4, top 2), the trainer at EP 2 with
    ppo.routing_replay, synchronous: the experts of both EP ranks synced to vLLM (generator and trainer
    agreeing on logprobs), every step's routing replayed, its agreement (`ppo/routing_agreement`) reported
    (3 GPUs);
  - 5 steps of the tiny agent (configs/tiny-agent-cpu.yaml's calculator episodes, warm start and model,
    at heads of 64) on a GPU engine: every step trained, the episodes calling the tool, how often and
    how many calls failed (2 GPUs);
  - the generator's interruption with the project's engine configuration (the same engine as in a
    run), 256 trajectories in flight, bf16: the logprob mismatch of the tokens before and after a
    resubmission, apart (1 GPU);
  - Qwen's vocabulary (151,936) and 4096 new tokens at the config's ppo.max_tokens_per_mb: the bf16
    mismatch and the trainer's peak memory (`memory/peak_gib`) (2 GPUs);
  - a run stopped with Ctrl-C after a checkpoint, resumed and continued (2 GPUs);
  - with --submit: a short run through `areal-hpc submit configs/gpu-smoke.yaml --nodes 2`, waited for
    with the job's record and judged from its metrics (its run directory under runs/ of this checkout,
    or --keep DIR: every node must see it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.support: the checks' own code, shared with the CPU tests
LOGITS_TOL = 1e-4
"""fp32 logits of the tiny model against transformers' (what the CPU tests assert)."""
RESUME_TOL = {"float32": 1e-5, "bfloat16": 1e-3}
"""A resumed run against the uninterrupted one. The CPU is exact to 1e-7; a GPU may sum in another
order from one run to the next (atomics in attention's backward), which Adam magnifies where a
gradient is near 0. A lost optimizer state moves the weights by about the learning rate (1e-2)."""


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def _run(name: str, fn) -> Result:
    t0 = time.perf_counter()
    print(f"... {name}", flush=True)
    try:
        status, detail = fn()
    except Exception as e:  # a check that crashes is a failed check, with its traceback
        status, detail = "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    result = Result(name, status, f"{detail} ({time.perf_counter() - t0:.0f} s)")
    print(f"{result.status} {result.name}: {result.detail}", flush=True)
    return result


def _verdict(problems: list[str], ok: str) -> tuple[str, str]:
    return ("FAIL", "; ".join(problems)) if problems else ("PASS", ok)


def check_logits(work: Path, tp: int, device: str):
    from areal_hpc.config import PPOConfig
    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.trainer.convert import read_hf
    from areal_hpc.trainer.spawn import run_ranks
    from tests.support.compare import export_problems, logits_problems, max_diff, pick
    from tests.support.shapes import QWEN2
    from tests.support.trainer_runs import hf_logits, logits_and_export_rank

    model_dir = str(build_tiny_model(QWEN2, work / f"logits-tp{tp}", seed=3))
    results = run_ranks(logits_and_export_rank, tp, tp, 1, {"m": model_dir}, PPOConfig(), device=device)
    got, want = pick(results, "m/logits"), hf_logits(model_dir, device)
    problems = logits_problems(got, want, LOGITS_TOL) + export_problems(pick(results, "m/weights"), read_hf(model_dir))
    return _verdict(problems, f"max |logits - transformers'| {max_diff(got, want):.1e}; export equal")


def check_resume(work: Path, tp: int, dtype: str, device: str):
    import torch

    from areal_hpc.config import PPOConfig
    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.trainer.spawn import run_ranks
    from tests.support.compare import max_diff, pick, resume_problems
    from tests.support.shapes import QWEN2
    from tests.support.trainer_runs import resume_rank

    model_dir = str(build_tiny_model(QWEN2, work / f"resume-tp{tp}-{dtype}", seed=5))
    optim = PPOConfig(lr=1e-2, weight_decay=0.01)
    args = (model_dir, work / f"ckpt-tp{tp}-{dtype}" / "step_2", [0, 1], [2, 3], optim, getattr(torch, dtype))
    results = run_ranks(resume_rank, tp, tp, 1, *args, device=device)
    stats = pick(results, "stats")
    diff = max_diff(pick(results, "weights"), pick(results, "resumed_weights"))
    return _verdict(
        resume_problems(results, RESUME_TOL[dtype]),
        f"loss {stats[-1]['ppo/loss']:.6f}, grad norm {stats[-1]['ppo/grad_norm']:.4f}; resumed weights off by {diff:.1e}",
    )


def driver_version(smi: str = "nvidia-smi", proc: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA driver's version: nvidia-smi's, else the kernel module's line in `proc`, else None."""
    try:
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
        found = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", proc.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def environment(device: str) -> dict:
    import torch

    env = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device == "cuda" else [],
        "driver": driver_version(),
    }
    for pkg in ("megatron.core", "vllm", "transformers"):
        try:
            module = __import__(pkg, fromlist=["__version__"])
            env[pkg] = getattr(module, "__version__", "?")
        except ImportError:
            env[pkg] = None
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = None
    return env


def trainer_checks(work: Path, device: str, gpus: int) -> list[Result]:
    results = [_run("trainer logits vs transformers, export round trip (TP 1)", lambda: check_logits(work, 1, device))]
    for dtype in ("float32", "bfloat16"):
        name = f"PPO step, save, resume = uninterrupted ({dtype}, TP 1)"
        results.append(_run(name, lambda dtype=dtype: check_resume(work, 1, dtype, device)))
    if device == "cuda" and gpus < 2:
        return [*results, Result("TP 2 checks", "SKIP", f"needs 2 GPUs, {gpus} visible")]
    results.append(_run("trainer logits vs transformers (TP 2)", lambda: check_logits(work, 2, device)))
    name = "PPO step, save, resume = uninterrupted (bf16, TP 2)"
    return [*results, _run(name, lambda: check_resume(work, 2, "bfloat16", device))]


def path_checks(work: Path, overrides: list[str], gpus: int, submit_root: Path | None, env: dict) -> list[Result]:
    """The checks of the path a run takes (the module docstring), each SKIP without the GPUs it needs."""
    from tests.support import gpu_checks as g
    from tests.support.generator_log import engine_start, startup_verdict

    results = []

    def check(name: str, needed: int, fn) -> Result:
        result = _run(name, fn) if gpus >= needed else Result(name, "SKIP", f"needs {needed} GPUs, {gpus} visible")
        results.append(result)
        return result

    smoke = {}

    def smoke_run():
        smoke["run"] = g.short_run(work, "smoke", overrides)
        return g.run_verdict(smoke["run"])

    check("NCCL weight sync + 20 steps of gpu-smoke", g.gpus_needed(overrides), smoke_run)
    startup = "engine start within train.startup_timeout_s"
    if "run" in smoke:
        run = smoke["run"]
        env["vllm_engine"] = g.generator_settings(run) or "not in the generator's log (no 'vLLM engine:' line)"
        log = run.run_dir / "logs" / "generator-0.log"
        check(startup, 0, lambda: startup_verdict(engine_start(log.read_text()), run.cfg.train.startup_timeout_s))
    else:
        results.append(Result(startup, "SKIP", "read from the gpu-smoke run's generator log: no such run"))

    tp_name, pp_name = "generator at gen_tp 2: NCCL weight sync, logprobs agree", "trainer at PP 2 -> generator"
    both, pp_only = (g.gpus_needed([*layout, *overrides]) for layout in (g.TP_AND_PP, g.PP_ONLY))
    if gpus >= both:
        tp = check(tp_name, both, lambda: g.run_verdict(g.short_run(work, "tp2-pp2", [*g.TP_AND_PP, *overrides], 5)))
        results.append(Result(f"{pp_name} (two weight-sync groups)", tp.status, f"the same run: {tp.detail}"))
    else:
        check(tp_name, both, None)
        check(pp_name, pp_only, lambda: g.run_verdict(g.short_run(work, "pp2", [*g.PP_ONLY, *overrides], 5)))

    check(
        "tiny MoE at EP 2: expert weight sync to vLLM with routing replay",
        g.gpus_needed(g.moe_overrides(overrides)),
        lambda: g.check_moe(work, overrides),
    )
    check(
        "agent episodes with a tool on a GPU engine",
        g.gpus_needed(g.agent_overrides(overrides)),
        lambda: g.check_agent(work, overrides),
    )
    check(
        "interruption, 256 trajectories in flight (bf16, the project's engine)", 1, lambda: g.check_interruption(work)
    )
    check(
        "Qwen's vocabulary, 4096 new tokens: peak memory, bf16 mismatch",
        g.gpus_needed(g.long_overrides(overrides)),
        lambda: g.check_long(work, overrides),
    )
    check(
        "stop (Ctrl-C), resume, continue a run", g.gpus_needed(overrides), lambda: g.check_stop_resume(work, overrides)
    )
    name = "20 steps through areal-hpc submit --nodes 1"
    if submit_root is None:
        results.append(Result(name, "SKIP", "not asked for: --submit (on a Slurm cluster's login node)"))
    else:
        results.append(_run(name, lambda: g.check_submit(submit_root, overrides)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer-only", action="store_true", help="only the checks that need no vLLM")
    parser.add_argument("--submit", action="store_true", help="also a short run through areal-hpc submit (Slurm)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides of configs/gpu-smoke.yaml (e.g. model.path=DIR)"
    )
    args = parser.parse_args(argv)

    from areal_hpc.device import visible_gpus
    from areal_hpc.trainer.spawn import default_device

    device = default_device()
    env = environment(device)
    print("areal-hpc gpu_check:", json.dumps(env), flush=True)
    gpus = len(visible_gpus()) if device == "cuda" else 0
    results = []
    with tempfile.TemporaryDirectory(prefix="areal-gpu-check-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if os.environ.get("AREAL_DEVICE") == "cpu":
            results.append(Result("GPU visible", "SKIP", "AREAL_DEVICE=cpu: the checks ran on the CPU"))
        elif device != "cuda":
            results.append(Result("GPU visible", "FAIL", "torch sees no GPU; the checks below ran on the CPU"))
        results += trainer_checks(work, device, gpus)
        if args.trainer_only:
            pass
        elif env["vllm"] is None:
            results.append(Result("run checks", "FAIL", "vLLM is not installed (AREAL_DEVICE=cuda tools/setup.sh)"))
        elif device != "cuda":
            results.append(
                Result("run checks", "SKIP", "they need GPUs (configs/gpu-smoke.yaml is cluster.device cuda)")
            )
        else:
            submit_root = (Path(args.keep).resolve() if args.keep else REPO / "runs") if args.submit else None
            results += path_checks(work, args.overrides, gpus, submit_root, env)

    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print("\n== areal-hpc gpu_check summary (attach to a bug report) ==")
    print(json.dumps(env))
    for r in results:
        print(f"{r.status} {r.name}: {r.detail.splitlines()[0]}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
