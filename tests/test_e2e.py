"""The whole system on this machine, as a user runs it: `areal-hpc run` starts one mpirun with the
controller, a reward worker, a vLLM generator and a Megatron trainer, on the tiny model.

- a few steps run, write the run directory (metrics with the DESIGN.md names every step, a log per
  rank, TensorBoard events, checkpoints); Ctrl-C stops after a checkpoint, and the same command
  resumes: the step count continues and no prompt is trained on twice;
- kill -9 of a rank ends the whole run in bounded time, the error names the rank by its role, and
  nothing is left running;
- a rank that stops answering (SIGSTOP) is named by the controller, which ends the run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_hpc.metrics import REQUIRED
from areal_hpc.rundir import checkpoint_version, latest_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_concurrent=8",
    "rollout.max_staleness=1",
    "rollout.max_new_tokens=8",
    "ppo.minibatches=2",
    "train.save_every=100",
    "train.rank_timeout_s=60",
    "train.collective_timeout_s=60",
    "logging.progress_every=1",
]


class Run:
    """`areal-hpc run configs/tiny-cpu.yaml ...` in the background, its output collected."""

    def __init__(self, root: Path, trial: str, *overrides: str):
        self.run_dir = root / "tiny-cpu" / trial
        cmd = [sys.executable, "-m", "areal_hpc.cli", "run", "configs/tiny-cpu.yaml"]
        cmd += [f"experiment.root={root}", f"experiment.trial={trial}", *SMALL, *overrides]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        deadline = time.monotonic() + timeout
        while len(self.rows()) < n:
            assert self.proc.poll() is None, f"the run ended early ({self.proc.returncode}):\n{self.output}"
            assert time.monotonic() < deadline, f"no {n} steps within {timeout} s:\n{self.output}"
            time.sleep(0.5)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

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


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")  # the tiny model and its warm start are built once here


def test_runs_stops_on_ctrl_c_after_a_checkpoint_and_resumes(root):
    first = Run(root, "resume", "train.total_steps=1000")
    first.wait_rows(2)
    first.proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal does
    assert first.wait(timeout=120) == 130, first.output
    assert "stopped after a checkpoint" in first.output
    run_dir = first.run_dir
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and (ckpt / "trainer").is_dir() and (ckpt / "controller.json").is_file()
    stopped_at = checkpoint_version(ckpt)
    assert stopped_at >= 2 and [r["step"] for r in first.rows()] == list(range(1, stopped_at + 1))
    assert not left_running(run_dir)

    total = stopped_at + 3
    second = Run(root, "resume", f"train.total_steps={total}")  # the same run, 3 steps further
    assert second.wait(timeout=300) == 0, second.output
    assert f"resuming from {ckpt}" in second.output
    rows = second.rows()
    assert [r["step"] for r in rows] == list(range(1, total + 1)), "the step count continues across the resume"
    for r in rows:
        assert set(REQUIRED) <= set(r) and "ppo/loss" in r and "ppo/logp_mismatch" in r
        assert 0 <= r["staleness/max"] <= 1
    # Each step trained on its own prompts: none twice, across the stop and the resume.
    log = (run_dir / "logs" / "controller-0.log").read_text()
    steps = [(int(s), json.loads(p)) for s, p in re.findall(r"step (\d+) trains prompts (\[.*\])", log)]
    assert [s for s, _ in steps] == list(range(total))
    prompts = [i for _, indices in steps for i in indices]
    assert len(prompts) == total * 4 and len(set(prompts)) == len(prompts)
    assert sorted(p.name for p in (run_dir / "logs").glob("*.log")) == [
        "controller-0.log",
        "generator-0.log",
        "reward-0.log",
        "trainer-0.log",
    ]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert checkpoint_version(latest_checkpoint(run_dir)) == total
    assert not left_running(run_dir)


@pytest.mark.parametrize("victim", ["controller-0", "reward-0", "generator-0", "trainer-0"])
def test_kill_9_of_a_rank_ends_the_run_naming_it(root, victim):
    run = Run(root, f"kill-{victim}", "train.total_steps=100")
    run.wait_rows(1)
    os.kill(run.pid_of(f"{victim}.log"), signal.SIGKILL)
    t0 = time.monotonic()
    assert run.wait(timeout=60) == 1, run.output
    assert time.monotonic() - t0 < 30
    role, index = victim.split("-")
    assert re.search(rf"{role} {index} \(world rank \d\)", run.output), run.output
    assert not left_running(run.run_dir)


def test_a_rank_that_stops_answering_is_named_and_the_run_ends(root):
    run = Run(root, "hang", "train.total_steps=100", "train.rank_timeout_s=8")
    run.wait_rows(1)
    pid = run.pid_of("reward-0.log")  # nobody waits for it in a collective: the culprit is clear-cut
    os.kill(pid, signal.SIGSTOP)
    try:
        assert run.wait(timeout=90) == 1, run.output
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert "reward 0 (world rank 1) has not answered" in run.output, run.output
    assert not left_running(run.run_dir)
