"""What each role did when, as the controller sees it: `RUN_DIR/timeline.jsonl`, one event per line,
for `tools/plot_run.py`'s timeline of generate / train / sync / idle.

The controller marks the moments it already knows (no message is added for this):

    {"t": 1763782998.12, "event": "gen_start", "rank": 2, "group": 17}    GenerateRequest sent
    {"t": ..., "event": "gen_done", "rank": 2, "group": 17}               the group's last trajectory came
    {"t": ..., "event": "gen_start", "rank": 2, "eval": 3}                the same two for eval prompt 3
    {"t": ..., "event": "train_start", "version": 4}                      TrainBatch sent (step at v=4)
    {"t": ..., "event": "train_end", "version": 5}                        TrainResult received
    {"t": ..., "event": "sync_start", "version": 5}                       WeightSync sent
    {"t": ..., "event": "sync_done", "rank": 2, "version": 5, "seconds": 0.01}   SyncDone received

`t` is wall-clock seconds (time.time(), comparable with the ranks' log timestamps). Phases are derived
from these by the reader: a generator generates while it has groups in flight, syncs from a WeightSync
to its SyncDone; the trainer handles its messages in order, so a step trains from
max(TrainBatch sent, the previous weight sync done) to its TrainResult.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from areal_hpc.jsonl import read_jsonl

FILE = "timeline.jsonl"


class Timeline:
    """Appends events to RUN_DIR/timeline.jsonl (line-buffered: a crash loses at most the last line)."""

    def __init__(self, run_dir: str | Path, now=time.time):
        self.now = now
        self._file = open(Path(run_dir) / FILE, "a", buffering=1)

    def mark(self, event: str, **fields) -> None:
        self._file.write(json.dumps({"t": round(self.now(), 6), "event": event, **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_events(run_dir: str | Path) -> list[dict]:
    """The events of a run, oldest first (a torn last line is skipped); [] without a timeline."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    return sorted((row for *_, row in read_jsonl(path, torn_ok=True)), key=lambda r: r["t"])
