"""What a run logged to W&B offline, read back from its files (`RUN_DIR/wandb/offline-run-*/run-<id>.wandb`)
without a W&B server: what `wandb sync` would upload, for the tests of areal_hpc.wandb_log.

A .wandb file is W&B's transaction log: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then
32 KiB blocks of records in LevelDB's log format (a 7-byte header: CRC-32C, length, type FULL / FIRST /
MIDDLE / LAST; a block's tail shorter than a header is zero padding), each record a
`wandb_internal_pb2.Record`. wandb 0.31 has no Python reader of its own (wandb-core, in Go, reads them).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """One offline W&B run's file: one per process that opened the W&B run."""

    path: Path
    run_id: str = ""
    resumed: bool = False
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    """The logged rows, in order, each with W&B's own `_step`."""
    summary: dict = field(default_factory=dict)


def offline_runs(run_dir: str | Path) -> list[OfflineRun]:
    """The offline W&B runs under RUN_DIR/wandb, oldest first."""
    dirs = sorted(Path(run_dir, "wandb").glob("offline-run-*"))  # offline-run-<YYYYmmdd_HHMMSS>-<id>
    return [read_offline_run(f) for d in dirs for f in d.glob("run-*.wandb")]


def read_offline_run(path: str | Path) -> OfflineRun:
    out = OfflineRun(Path(path))
    for record in _records(Path(path).read_bytes()):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.resumed = record.run.run_id, record.run.resume
            out.config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            out.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            out.summary |= {_key(u): json.loads(u.value_json) for u in record.summary.update}
    if not out.run_id:
        raise ValueError(
            f"{path} holds no run record: not written out yet? (W&B's service writes a run's file out when it "
            "closes the run, after `finish` returns; `wandb.teardown()` or the process's end waits for that)"
        )
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _records(data: bytes):
    from wandb.proto import wandb_internal_pb2

    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"not a W&B transaction log (header {data[:HEADER]!r})")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if left < HEADER or (kind == 0 and length == 0):  # the rest of the block is padding
            pos += left
            continue
        parts.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
        elif kind == FIRST:
            parts = parts[-1:]
