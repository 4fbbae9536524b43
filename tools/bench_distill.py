"""On-policy distillation on the embedded default's task: does the student learn from the teacher alone, and
with the task's reward beside it?

    python tools/bench_distill.py [--teacher RUN_DIR] [--steps 300]

The teacher is the latest checkpoint of RUN_DIR, exported (default: configs/tiny-cpu.yaml's 600 steps of RL,
run first). Three students start from the same warm start, --steps steps each, one after the other, fresh:

    distill       configs/tiny-distill-cpu.yaml: reward.kind none, the teacher alone
    distill+task  the same with reward.kind math: the task's reward and the teacher together
    task          configs/tiny-cpu.yaml: RL alone, for comparison

Prints per student `distill/reverse_kl` (with a teacher) and `reward/mean` (with the task's reward) by fifths
of its steps, and its held-out pass@1 before and after (`areal-hpc eval`, scored as math, 32 samples a
prompt): after is the mean over its last LATE checkpoints (a sixth of --steps apart), since one checkpoint's
pass@1 swings by 0.02 to 0.03; the teacher's pass@1; the headline last: `gap closed by distillation alone: X%
(pass@1 a -> b, the teacher's c)`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.checkpoint.files import checkpoint_version, complete_checkpoints, latest_checkpoint  # noqa: E402
from areal_hpc.metrics import read_metrics  # noqa: E402
from tools.bench_async_vs_sync import run_mode  # noqa: E402
from tools.bench_policy_losses import fifths  # noqa: E402

TEACHER_CONFIG = REPO / "configs" / "tiny-cpu.yaml"
DISTILL_CONFIG = REPO / "configs" / "tiny-distill-cpu.yaml"
SAMPLES = 32
LATE = 3


def cli(*args: str, log: Path) -> None:
    """`areal-hpc ARGS`, its output to `log`; exits naming the log when it fails."""
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "areal_hpc.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    if code.returncode != 0:
        sys.exit(f"areal-hpc {args[0]} failed (exit {code.returncode}); its output: {log}")


def pass_at_1(run_dir: Path, steps: list[int], log: Path) -> list[float]:
    """Held-out pass@1 of each of `run_dir`'s checkpoints `steps`, scored as math (one `areal-hpc eval`)."""
    listed = ",".join(map(str, steps))
    cli("eval", str(run_dir), "--steps", listed, "--samples", str(SAMPLES), "reward.kind=math", log=log)
    return [json.loads(next((run_dir / "eval").glob(f"step_{s}-*.json")).read_text())["pass@k"]["1"] for s in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, help="a run directory of the embedded default (default: run one)")
    parser.add_argument("--steps", type=int, default=300, help="steps of each student (the config's)")
    args = parser.parse_args()
    if args.steps < 6 or args.steps % 6:
        parser.error(f"--steps {args.steps}: a multiple of 6 (the figures are by fifths, checkpoints a sixth apart)")
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        root = Path(tmp)
        teacher_run = args.teacher or run_mode(TEACHER_CONFIG, root, "teacher", [], 600, root / "teacher.log")
        latest = latest_checkpoint(teacher_run)
        if latest is None:
            sys.exit(f"--teacher {teacher_run}: no complete checkpoint")
        steps = checkpoint_version(latest)
        teacher = root / "teacher-model"
        cli("export", str(teacher_run), "--step", str(steps), "-o", str(teacher), log=root / "export.log")
        students = {
            "distill": (DISTILL_CONFIG, []),
            "distill+task": (DISTILL_CONFIG, ["reward.kind=math"]),
            "task": (TEACHER_CONFIG, []),
        }
        kept = [f"train.save_every={args.steps // 6}", f"train.keep_checkpoints={LATE}"]  # the last LATE: `late`
        results = {}
        for name, (config, overrides) in students.items():
            overrides = [*overrides, f"distill.teacher.path={teacher}"] if config == DISTILL_CONFIG else overrides
            run_dir = run_mode(config, root, name, [*overrides, *kept], args.steps, root / f"{name}.log")
            late = [checkpoint_version(c) for c in complete_checkpoints(run_dir)]
            start, *ends = pass_at_1(run_dir, [0, *late], root / f"eval-{name}.log")
            end = sum(ends) / len(ends)
            results[name] = (read_metrics(run_dir), start, end)
        (theirs,) = pass_at_1(teacher_run, [steps], root / "eval-teacher.log")
    print(
        f"\nby fifths of {args.steps} steps; held-out pass@1 ({SAMPLES} samples a prompt) before -> after (the mean "
        f"of the last {LATE} checkpoints):"
    )
    for name, (rows, start, end) in results.items():
        figures = []
        for key in ("distill/reverse_kl", "reward/mean"):
            if key in rows[0] and any(r[key] for r in rows):
                figures.append(f"{key} {' '.join(f'{f:.3f}' for f in fifths(rows, key))}")
        print(f"  {name:13s} {'  '.join(figures)}  pass@1 {start:.3f} -> {end:.3f}")
    print(f"  teacher       pass@1 {theirs:.3f} (step {steps} of {teacher_run})")
    rows, start, end = results["distill"]
    closed = (end - start) / (theirs - start) if theirs > start else float("nan")
    print(
        f"gap closed by distillation alone: {closed:.0%} (pass@1 {start:.3f} -> {end:.3f}, the teacher's {theirs:.3f})"
    )


if __name__ == "__main__":
    main()
