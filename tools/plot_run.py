"""A picture of one run: `python tools/plot_run.py RUN_DIR [-o OUT.png]` (default RUN_DIR/run.png).

Top, over training steps (from metrics.jsonl): reward/mean; staleness/max and staleness/dropped;
throughput/effective_tokens_per_s; timing/gen_idle_frac and timing/train_idle_frac.
Bottom, over wall time (from timeline.jsonl, written by the controller; areal_hpc.controller.timeline): one row
per generator and one for the trainer, coloured by what it did: generate, train, weight sync, or idle
(nothing to do). Only the last `--timeline-steps` training steps are shown, so each one is readable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_hpc.controller.timeline import read_events  # noqa: E402
from areal_hpc.metrics import read_metrics  # noqa: E402

COLORS = {"generate": "#4c9be8", "train": "#e8744c", "sync": "#7a3fb0", "idle": "#e6e6e6"}
Interval = tuple[float, float]


def phases(events: list[dict]) -> dict[str, dict[str, list[Interval]]]:
    """Busy intervals per role row from the controller's events:
    {"generator 2": {"generate": [...], "sync": [...]}, "trainer": {"train": [...], "sync": [...]}}.

    A generator generates while it has groups in flight (gen_start .. its last gen_done) and syncs from
    sync_start to its own sync_done. The trainer handles messages in order: it sends version v's weights
    from sync_start(v) until the last generator's sync_done(v), and trains a step from
    max(train_start, the weight sync before it ends) to train_end. Idle is the rest.
    """
    rows: dict[str, dict[str, list[Interval]]] = {}
    load: dict[int, int] = {}
    gen_since: dict[int, float] = {}
    sync_start: dict[int, float] = {}  # version -> WeightSync sent
    sync_end: dict[int, float] = {}  # version -> last SyncDone so far
    gen_sync_open: dict[tuple[int, int], float] = {}  # (rank, version) -> start
    train_open: tuple[int, float] | None = None
    steps: list[tuple[int, float, float]] = []  # (version, TrainBatch sent, TrainResult back)
    trainer = rows.setdefault("trainer", {"train": [], "sync": []})

    def gen_row(rank: int) -> dict[str, list[Interval]]:
        return rows.setdefault(f"generator {rank}", {"generate": [], "sync": []})

    for e in events:
        kind, t = e["event"], e["t"]
        if kind == "gen_start":
            r = e["rank"]
            gen_row(r)
            if load.get(r, 0) == 0:
                gen_since[r] = t
            load[r] = load.get(r, 0) + 1
        elif kind == "gen_done":
            r = e["rank"]
            load[r] = max(0, load.get(r, 0) - 1)
            if load[r] == 0 and r in gen_since:
                gen_row(r)["generate"].append((gen_since.pop(r), t))
        elif kind == "sync_start":
            sync_start[e["version"]] = t
            for r in list(rows):
                if r.startswith("generator "):
                    gen_sync_open[(int(r.split()[1]), e["version"])] = t
        elif kind == "sync_done":
            r, v = e["rank"], e["version"]
            start = gen_sync_open.pop((r, v), sync_start.get(v, t))
            gen_row(r)["sync"].append((start, t))
            sync_end[v] = max(sync_end.get(v, t), t)
        elif kind == "train_start":
            train_open = (e["version"], t)
        elif kind == "train_end" and train_open is not None:
            steps.append((*train_open, t))
            train_open = None
    for v, start in sync_start.items():
        if v in sync_end:
            trainer["sync"].append((start, sync_end[v]))
    for v, sent, end in steps:  # the sync's end may come after the step was sent: resolved at the end
        start = max(sent, sync_end[v]) if v in sync_end and sync_start[v] <= sent else sent
        trainer["train"].append((min(start, end), end))
    return rows


def _window(events: list[dict], last_steps: int) -> tuple[float, float]:
    """Wall-time span of the last `last_steps` training steps (from the train_start before them)."""
    if not events:
        return 0.0, 1.0
    starts = [e["t"] for e in events if e["event"] == "train_start"]
    begin = starts[-last_steps] if len(starts) >= last_steps else events[0]["t"]
    return begin, events[-1]["t"]


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo) - lo, min(b, hi) - max(a, lo)) for a, b in intervals if b > lo and a < hi]


def plot(run_dir: Path, out: Path, timeline_steps: int = 6) -> Path:
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    fig = plt.figure(figsize=(12, 9), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 1.1])
    fig.suptitle(f"{run_dir}  ({len(rows)} steps)", fontsize=10)

    ax = fig.add_subplot(grid[0, 0])
    ax.plot(steps, [r["reward/mean"] for r in rows], color="#2a8a3e")
    ax.set(title="reward/mean", xlabel="step", ylim=(-0.02, 1.02))

    ax = fig.add_subplot(grid[0, 1])
    ax.step(steps, [r["staleness/max"] for r in rows], where="mid", label="staleness/max (versions)")
    ax.bar(
        steps, [r["staleness/dropped"] for r in rows], color="#c33", alpha=0.6, label="staleness/dropped (trajectories)"
    )
    top = max([1] + [r["staleness/max"] for r in rows] + [r["staleness/dropped"] for r in rows])
    ax.set(title="staleness", xlabel="step", ylim=(-0.05 * top, 1.25 * top))
    ax.legend(fontsize=8, loc="upper left")

    ax = fig.add_subplot(grid[1, 0])
    ax.plot(steps, [r["throughput/effective_tokens_per_s"] for r in rows], color="#555")
    ax.set(title="throughput/effective_tokens_per_s", xlabel="step", ylim=(0, None))

    ax = fig.add_subplot(grid[1, 1])
    ax.plot(steps, [r["timing/gen_idle_frac"] for r in rows], color=COLORS["generate"], label="generators")
    ax.plot(steps, [r["timing/train_idle_frac"] for r in rows], color=COLORS["train"], label="trainer")
    ax.set(title="idle fraction (timing/*_idle_frac)", xlabel="step", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8, loc="upper right")

    ax = fig.add_subplot(grid[2, :])
    events = read_events(run_dir)
    if not events:
        ax.text(0.5, 0.5, "no timeline.jsonl in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        lo, hi = _window(events, timeline_steps)
        lanes = phases(events)
        names = sorted(lanes, key=lambda n: (n == "trainer", n))  # generators on top, trainer below
        for y, name in enumerate(names):
            ax.broken_barh([(0, hi - lo)], (y - 0.4, 0.8), color=COLORS["idle"])
            for phase, intervals in lanes[name].items():
                ax.broken_barh(_clip(intervals, lo, hi), (y - 0.4, 0.8), color=COLORS[phase])
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set(xlim=(0, hi - lo), xlabel="seconds", title=f"what each role did: the last {timeline_steps} steps")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
        ax.legend(handles, list(COLORS), ncols=4, fontsize=8, loc="upper right", bbox_to_anchor=(1, 1.18))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--out", type=Path, help="PNG to write (default RUN_DIR/run.png)")
    p.add_argument("--timeline-steps", type=int, default=6, help="training steps shown in the timeline")
    args = p.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").exists():
        print(f"{args.run_dir}: no metrics.jsonl (not a run directory, or no step finished yet)", file=sys.stderr)
        return 2
    out = plot(args.run_dir, args.out or args.run_dir / "run.png", args.timeline_steps)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
