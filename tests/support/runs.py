"""Whole runs as a user starts them (`areal-hpc run CONFIG key=value ...`), and what they are judged by:
the e2e tests (tests/test_e2e.py, the tiny model on this machine's CPU) and the GPU check
(tests.support.gpu_checks, configs/gpu-smoke.yaml) start and judge runs with the same functions.

    RunProcess            one `areal-hpc run` in the background, its output collected
    metrics_problems      metrics.jsonl of a run: every step there, finite, generator and trainer agreeing
    stop_and_resume       a run stopped with Ctrl-C (SIGINT) after a few steps, then the same run further
    stop_resume_problems  what that stop and resume got wrong
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.checkpoint.files import checkpoint_version, latest_checkpoint
from areal_hpc.config import load_config
from areal_hpc.metrics import REQUIRED

REPO = Path(__file__).resolve().parents[2]
LOADER_VARIABLES = ("LD_PRELOAD", "LD_LIBRARY_PATH")
LOADER_AT_START = {k: os.environ.get(k) for k in LOADER_VARIABLES}
"""The dynamic loader's variables as the test process began. vLLM's CPU platform sets them in a process that
builds an engine (LD_PRELOAD: torch's libgomp and tcmalloc): a run started afterwards from the same test
process would preload them in every rank (measured: the tiny agent's steps 10-40 s instead of 0.2-1 s)."""


def user_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's), with the dynamic loader's variables as this process began: the
    environment a user's shell gives `areal-hpc`."""
    out = dict(os.environ if env is None else env)
    for k, v in LOADER_AT_START.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


class RunProcess:
    """`areal-hpc run CONFIG OVERRIDES...` in the background, from the repository's root, its output
    (the launcher's console) collected.

    From elsewhere: `cwd` (CONFIG and a relative run root are relative to it), `cli` (the command that is
    `areal-hpc`: an installed console script) and `env` (its environment; default: this one); either way
    with the loader's variables as the test process began (`user_environment`)."""

    def __init__(
        self,
        config: str | Path,
        *overrides: str,
        cwd: Path = REPO,
        cli: Sequence[str] = (sys.executable, "-m", "areal_hpc.cli"),
        env: dict[str, str] | None = None,
    ):
        self.cfg = load_config(cwd / config, list(overrides))
        self.run_dir = cwd / self.cfg.run_dir  # absolute when experiment.root is
        cmd = [*cli, "run", str(config), *overrides]
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=user_environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def wait_rows(self, n: int, timeout: float = 240) -> None:
        """Until metrics.jsonl has `n` steps; raises when the run ended first or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while len(self.rows()) < n:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run ended early ({self.proc.returncode}); {self.last_words()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {n} steps within {timeout} s; {self.last_words()}")
            time.sleep(0.5)

    def wait(self, timeout: float) -> int:
        """The run's exit code once it ends. A run still there after `timeout` is ended (`end`) and
        TimeoutError raised with what it wrote (`last_words`): where it hung, for the failing test to show."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end()
            raise TimeoutError(f"the run did not end within {timeout:.0f} s; {self.last_words()}") from None
        self._reader.join(timeout=10)
        return code

    def end(self) -> None:
        """End the run at once, as a user would (Ctrl-C twice); killed when it is still there 2 minutes later."""
        for _ in range(2):
            self.proc.send_signal(signal.SIGINT)
            time.sleep(1)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)

    def last_words(self, lines: int = 40) -> str:
        """The end of the launcher's output, of each rank's log (RUN_DIR/logs/<role>-<i>.log) and of W&B's
        logs of its latest run (`logging.wandb`: RUN_DIR/wandb/latest-run/logs/, wandb.init's phases)."""
        parts = [f"the launcher's output:\n{_tail(self.output, lines)}"]
        logs = [
            *sorted((self.run_dir / "logs").glob("*.log")),
            *sorted(self.run_dir.glob("wandb/latest-run/logs/*.log")),
        ]
        for log in logs:
            parts.append(f"{log}:\n{_tail(log.read_text(errors='replace'), lines)}")
        return "\n".join(parts)

    def pid_of(self, log_name: str) -> int:
        text = (self.run_dir / "logs" / log_name).read_text()
        return int(re.search(r"\(pid (\d+)\)", text).group(1))


def left_running(run_dir: Path) -> list[str]:
    """Processes whose command line names this run directory."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run_dir) in cmdline:
                found.append(f"{d.name}: {cmdline}")
    return found


def checked_steps(rows: list[dict]) -> list[dict]:
    """The steps that trained on tokens of the weights being trained, whose logprobs the generator and
    the trainer must agree on (`ppo/logp_mismatch` over `ppo/logp_mismatch_tokens`)."""
    return [r for r in rows if r.get("ppo/logp_mismatch_tokens", 0) > 0]


def metrics_problems(rows: list[dict], steps: int, mismatch_tol: float) -> list[str]:
    """What is wrong with a run's metrics.jsonl rows, as sentences (empty: nothing): not exactly the steps
    1..`steps`, a non-finite loss or gradient norm, no step with tokens of its own version (the weight
    sync went unchecked), or generator and trainer disagreeing on logprobs by more than `mismatch_tol`
    (the mean |behav_logp - prox_logp| of a step; a bad weight sync or resume gives 1e-2 and more)."""
    out = []
    if [r.get("step") for r in rows] != list(range(1, steps + 1)):
        out.append(f"steps {[r.get('step') for r in rows]} in metrics.jsonl, expected 1..{steps}")
    for r in rows:
        for key in ("ppo/loss", "ppo/grad_norm"):
            if not math.isfinite(r.get(key, math.nan)):
                out.append(f"step {r.get('step')}: {key} = {r.get(key)}")
    checked = checked_steps(rows)
    if rows and not checked:
        out.append("no step trained on tokens of its own version: the weight sync was never checked")
    worst = max((r["ppo/logp_mismatch"] for r in checked), default=0.0)
    if worst > mismatch_tol:
        out.append(
            f"generator and trainer disagree on logprobs after a weight sync: ppo/logp_mismatch {worst:.2e} "
            f"> {mismatch_tol:.0e}"
        )
    return out


@dataclass
class StopResume:
    """A run stopped with Ctrl-C and resumed (`stop_and_resume`)."""

    run_dir: Path
    first: RunProcess
    first_code: int
    checkpoint: Path | None
    """The newest complete checkpoint after the stop."""
    stopped_rows: list[dict]
    """metrics.jsonl after the stop."""
    left_after_stop: list[str]
    """Processes of the run still there after the stop (`left_running`)."""
    second: RunProcess
    second_code: int
    total: int
    """The resumed run's train.total_steps: the stop's checkpoint version + the steps asked after it."""


def stop_and_resume(
    config, *overrides: str, after: int = 3, stop_after_rows: int = 2, timeout: float = 300, resume_on=()
):
    """`areal-hpc run CONFIG` with many steps, Ctrl-C (SIGINT) once `stop_after_rows` steps are written,
    then the same command with train.total_steps `after` steps past the checkpoint the stop wrote (and the
    overrides `resume_on`: another layout)."""
    first = RunProcess(config, *overrides, "train.total_steps=1000")
    try:
        first.wait_rows(stop_after_rows, timeout)
    except BaseException:
        if first.proc.poll() is None:
            first.end()
        raise
    first.proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal does
    first_code = first.wait(timeout)
    ckpt = latest_checkpoint(first.run_dir)
    stopped_rows, left_after_stop = first.rows(), left_running(first.run_dir)
    total = (checkpoint_version(ckpt) if ckpt else 0) + after
    second = RunProcess(config, *overrides, *resume_on, f"train.total_steps={total}")
    second_code = second.wait(timeout + 60 * after)
    return StopResume(first.run_dir, first, first_code, ckpt, stopped_rows, left_after_stop, second, second_code, total)


def stop_resume_problems(run: StopResume, mismatch_tol: float) -> list[str]:
    """What a stop and resume got wrong, as sentences (empty: nothing). The stop: exit code 130 after a
    checkpoint (trainer state and controller.json) at least 2 steps in, metrics up to it, nothing left
    running. The resume: exit code 0, from that checkpoint; the step count continues (1..total, the
    metrics of docs/design.md every step, the staleness bound kept); generator and trainer agree
    (`metrics_problems`), on resumed steps too; each step trained on its own prompts, none twice across
    the stop (the controller's log); the last checkpoint is the last step's; nothing left running."""
    cfg, out = run.second.cfg, []
    if run.first_code != 130 or "stopped after a checkpoint" not in run.first.output:
        out.append(f"Ctrl-C: exit code {run.first_code}, expected 130 after a checkpoint:\n{_tail(run.first.output)}")
    ckpt = run.checkpoint
    if ckpt is None or not ((ckpt / "trainer").is_dir() and (ckpt / "controller.json").is_file()):
        return [*out, f"no complete checkpoint (trainer/ and controller.json) after the stop: {ckpt}"]
    stopped_at = checkpoint_version(ckpt)
    if stopped_at < 2 or [r["step"] for r in run.stopped_rows] != list(range(1, stopped_at + 1)):
        out.append(f"stopped at checkpoint {stopped_at} with steps {[r['step'] for r in run.stopped_rows]} written")
    if run.left_after_stop:
        out.append("left running after the stop: " + "; ".join(run.left_after_stop))
    if run.second_code != 0 or f"resuming from {ckpt}" not in run.second.output:
        out.append(f"the resumed run: exit code {run.second_code}, from {ckpt}?\n{_tail(run.second.output)}")
    rows = run.second.rows()
    out += metrics_problems(rows, run.total, mismatch_tol)
    for r in rows:
        if missing := [k for k in (*REQUIRED, "ppo/loss", "ppo/logp_mismatch") if k not in r]:
            out.append(f"step {r['step']}: no {', '.join(missing)}")
        if not 0 <= r.get("staleness/max", -1) <= cfg.rollout.max_staleness:
            out.append(f"step {r['step']}: staleness/max {r.get('staleness/max')} > {cfg.rollout.max_staleness}")
    if not any(r["step"] > stopped_at for r in checked_steps(rows)):
        out.append("no resumed step had tokens of its own version: the resumed weight sync went unchecked")
    log = (run.run_dir / "logs" / "controller-0.log").read_text()
    steps = [(int(s), json.loads(p)) for s, p in re.findall(r"step (\d+) trains prompts (\[.*\])", log)]
    if [s for s, _ in steps] != list(range(1, run.total + 1)):
        out.append(f"the controller's log trains steps {[s for s, _ in steps]}, expected 1..{run.total}")
    prompts = [i for _, indices in steps for i in indices]
    if len(prompts) != run.total * cfg.rollout.prompts_per_step or len(set(prompts)) != len(prompts):
        out.append(f"{len(prompts)} prompts trained ({len(set(prompts))} distinct) in {run.total} steps")
    last = latest_checkpoint(run.run_dir)
    if last is None or checkpoint_version(last) != run.total:
        out.append(f"the last checkpoint is {last}, expected step_{run.total}")
    if left := left_running(run.run_dir):
        out.append("left running: " + "; ".join(left))
    return out


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
