"""A user's first check on a GPU node: PASS or FAIL per check, with what failed, and a summary to
attach to a bug report. Run it through `tools/gpu_check.sh` (which finds the Python and the checkout).

    tools/gpu_check.sh                  # everything: the trainer, NCCL weight sync to vLLM, a short run
    tools/gpu_check.sh --trainer-only   # no vLLM needed: also from a checkout on PYTHONPATH with the
                                        # machine's own PyTorch (2.11 or newer) and megatron-core

Trainer checks (the functions of areal_hpc/testing/, the ones the CPU tests call, on this
machine's device: AREAL_DEVICE=auto|cpu|cuda, auto by default):
  - logits against transformers on a small Qwen2 built here, and the export round trip, at TP 1;
  - one PPO step, save, resume, and the steps after it equal to an uninterrupted run, in fp32 and bf16;
  - with 2+ GPUs, the same at TP 2.
Run checks (need vLLM and 2+ GPUs: a generator and a trainer never share a GPU over NCCL):
  - 20 steps of configs/gpu-smoke.yaml (a ~0.5B Qwen2 built here, or `model.path=DIR`): every step
    trained with finite loss and gradient norm, weights synced to the vLLM engine over NCCL, and the
    generator's and the trainer's logprobs of the same tokens under the same weights agreeing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOGITS_TOL = 1e-4
"""fp32 logits of the tiny model against transformers' (what the CPU tests assert)."""
RESUME_TOL = {"float32": 1e-5, "bfloat16": 1e-3}
"""A resumed run against the uninterrupted one. The CPU is exact to 1e-7; a GPU may sum in another
order from one run to the next (atomics in attention's backward), which Adam magnifies where a
gradient is near 0. A lost optimizer state moves the weights by about the learning rate (1e-2)."""
MISMATCH_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
"""Largest `ppo/logp_mismatch` (mean |behav_logp - prox_logp| over current-version tokens) in the run."""


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
    from areal_hpc.testing.compare import export_problems, logits_problems, max_diff, pick
    from areal_hpc.testing.inputs import MODEL
    from areal_hpc.testing.trainer_runs import hf_logits, logits_and_export_rank
    from areal_hpc.tiny import build_tiny_model
    from areal_hpc.trainer.convert import read_hf
    from areal_hpc.trainer.spawn import run_ranks

    model_dir = str(build_tiny_model(MODEL, work / f"logits-tp{tp}", seed=3))
    results = run_ranks(logits_and_export_rank, tp, tp, 1, {"m": model_dir}, PPOConfig(), device=device)
    got, want = pick(results, "m/logits"), hf_logits(model_dir, device)
    problems = logits_problems(got, want, LOGITS_TOL) + export_problems(pick(results, "m/weights"), read_hf(model_dir))
    return _verdict(problems, f"max |logits - transformers'| {max_diff(got, want):.1e}; export equal")


def check_resume(work: Path, tp: int, dtype: str, device: str):
    import torch

    from areal_hpc.config import PPOConfig
    from areal_hpc.testing.compare import max_diff, pick, resume_problems
    from areal_hpc.testing.inputs import MODEL
    from areal_hpc.testing.trainer_runs import resume_rank
    from areal_hpc.tiny import build_tiny_model
    from areal_hpc.trainer.spawn import run_ranks

    model_dir = str(build_tiny_model(MODEL, work / f"resume-tp{tp}-{dtype}", seed=5))
    optim = PPOConfig(lr=1e-2, weight_decay=0.01)
    args = (model_dir, work / f"ckpt-tp{tp}-{dtype}" / "step_2", [0, 1], [2, 3], optim, getattr(torch, dtype))
    results = run_ranks(resume_rank, tp, tp, 1, *args, device=device)
    stats = pick(results, "stats")
    diff = max_diff(pick(results, "weights"), pick(results, "resumed_weights"))
    return _verdict(
        resume_problems(results, RESUME_TOL[dtype]),
        f"loss {stats[-1]['ppo/loss']:.6f}, grad norm {stats[-1]['ppo/grad_norm']:.4f}; resumed weights off by {diff:.1e}",
    )


def smoke_overrides(overrides: list[str]) -> list[str]:
    """`overrides` for configs/gpu-smoke.yaml; with `model.path=DIR` the YAML's shape fields (those of the
    model it builds) are cleared, so the shape is DIR's config.json (a field the user sets is kept and checked)."""
    from areal_hpc.arch import SHAPE_FIELDS

    keys = {o.split("=", 1)[0] for o in overrides}
    if "model.path" not in keys:
        return list(overrides)
    return [*(f"model.{f}=null" for f in SHAPE_FIELDS if f"model.{f}" not in keys), *overrides]


def check_run(work: Path, overrides: list[str]):
    """20 steps of configs/gpu-smoke.yaml through `areal-hpc run`, judged from its metrics."""
    from areal_hpc.config import load_config
    from areal_hpc.metrics import read_metrics

    root = work / "runs"
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(REPO / "configs" / "gpu-smoke.yaml")]
    cmd += [f"experiment.root={root}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    cfg = load_config(REPO / "configs" / "gpu-smoke.yaml", [f"experiment.root={root}", *overrides])
    lines = read_metrics(cfg.run_dir) if (cfg.run_dir / "metrics.jsonl").exists() else []
    problems = []
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        problems.append(f"areal-hpc run exited with {proc.returncode}; logs in {cfg.run_dir / 'logs'}:\n{tail}")
    if len(lines) != cfg.train.total_steps:
        problems.append(f"{len(lines)} of {cfg.train.total_steps} steps in metrics.jsonl")
    for m in lines:
        for key in ("ppo/loss", "ppo/grad_norm"):
            if not math.isfinite(m.get(key, math.nan)):
                problems.append(f"step {m.get('step')}: {key} = {m.get(key)}")
    synced = [m for m in lines if m.get("ppo/logp_mismatch_tokens", 0) > 0]
    if lines and not synced:
        problems.append("no step trained on tokens of its own version: the weight sync was never checked")
    worst = max((m["ppo/logp_mismatch"] for m in synced), default=0.0)
    if worst > MISMATCH_TOL[cfg.model.dtype]:
        problems.append(
            f"generator and trainer disagree on logprobs after a weight sync: ppo/logp_mismatch {worst:.2e} "
            f"> {MISMATCH_TOL[cfg.model.dtype]:.0e} ({cfg.model.dtype})"
        )
    detail = (
        f"{len(lines)} steps, weight sync {max((m.get('timing/weight_sync_s', 0) for m in lines), default=0):.2f} s at most, "
        f"logp mismatch {worst:.1e} over {sum(m['ppo/logp_mismatch_tokens'] for m in synced):.0f} tokens"
    )
    return _verdict(problems, detail)


def environment(device: str) -> dict:
    import torch

    env = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device == "cuda" else [],
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer-only", action="store_true", help="only the checks that need no vLLM")
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
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if os.environ.get("AREAL_DEVICE") == "cpu":
            results.append(Result("GPU visible", "SKIP", "AREAL_DEVICE=cpu: the checks ran on the CPU"))
        elif device != "cuda":
            results.append(Result("GPU visible", "FAIL", "torch sees no GPU; the checks below ran on the CPU"))
        results.append(
            _run("trainer logits vs transformers, export round trip (TP 1)", lambda: check_logits(work, 1, device))
        )
        for dtype in ("float32", "bfloat16"):
            name = f"PPO step, save, resume = uninterrupted ({dtype}, TP 1)"
            results.append(_run(name, lambda dtype=dtype: check_resume(work, 1, dtype, device)))
        if device == "cuda" and gpus < 2:
            results.append(Result("TP 2 checks", "SKIP", f"need 2 GPUs, {gpus} visible"))
        else:
            results.append(_run("trainer logits vs transformers (TP 2)", lambda: check_logits(work, 2, device)))
            results.append(
                _run(
                    "PPO step, save, resume = uninterrupted (bf16, TP 2)",
                    lambda: check_resume(work, 2, "bfloat16", device),
                )
            )
        if args.trainer_only:
            pass
        elif env["vllm"] is None:
            results.append(
                Result(
                    "NCCL weight sync + 20 steps of gpu-smoke",
                    "FAIL",
                    "vLLM is not installed (AREAL_DEVICE=cuda tools/setup.sh)",
                )
            )
        elif device == "cuda" and gpus < 2:
            results.append(
                Result(
                    "NCCL weight sync + 20 steps of gpu-smoke",
                    "SKIP",
                    f"needs 2 GPUs (a generator and a trainer), {gpus} visible",
                )
            )
        else:
            results.append(
                _run(
                    "NCCL weight sync + 20 steps of gpu-smoke", lambda: check_run(work, smoke_overrides(args.overrides))
                )
            )

    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print("\n== areal-hpc gpu_check summary (attach to a bug report) ==")
    print(json.dumps(env))
    for r in results:
        print(f"{r.status} {r.name}: {r.detail.splitlines()[0]}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
