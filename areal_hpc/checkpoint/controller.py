"""The controller's side of a checkpoint, from the Save it sends to COMPLETE, off its event loop, and its own
state in the checkpoint (`controller.pkl`, summarised in `controller.json`).

```
 begin(v, state, ranks)     the directory of version v is made ready (a damaged one of that version stops
                            counting); the controller sends Save(v) to every trainer rank and generator
 arrived(src, traj)         an episode of a group running at the save, back from a generator that has not
                            saved yet: into the saved state (the generator's file holds only those in flight)
 rank_saved(v, rank)        the last rank's Saved: the controller's state at v goes beside theirs,
                            then FILES.json (every file read back for its CRC-32) on the checkpoint thread
 finish()                   on the loop, in version order: a save whose files are recorded gets COMPLETE,
                            then the checkpoints beyond train.keep_checkpoints go (on the thread)
```

Reading back a 32B run's ~600 GB takes minutes; on the controller's loop it would stall every role.
The thread does it (zlib's CRC-32 releases the GIL), one save at a time, in order. Measured on the way:
how long the last save took to COMPLETE (for the stop decision) and how long the trainers spent saving
since the last step (`timing/save_s`: what training waited).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.checkpoint.files import checkpoint_dir, clear_complete, mark_complete, prune_checkpoints, record_files
from areal_hpc.checkpoint.in_flight import IN_FLIGHT_FILES

log = logging.getLogger(__name__)


@dataclass
class _Save:
    waiting: set[int]  # trainer and generator ranks still writing
    state: dict  # the controller's, at the version saved
    started: float
    record: Future | None = None  # record_files, once every rank has saved
    running: dict = field(default_factory=dict)  # group id -> its saved state, among `state`'s running groups


class Checkpoints:
    def __init__(self, run_dir: Path, keep: int, resume_from: Path | None):
        self.run_dir, self.keep, self.resume_from = Path(run_dir), keep, resume_from
        self.saving: dict[int, _Save] = {}  # version -> its checkpoint on its way
        self.saved_version = -1  # the newest COMPLETE checkpoint
        self.last_start = time.monotonic()  # for train.save_interval_min
        self.last_save_s = 0.0  # Save sent -> COMPLETE, the last one measured
        self.stall_s = 0.0  # trainers busy saving since the last step
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

    def begin(self, version: int, state: dict, ranks: list[int]) -> Path:
        """A save of `state` at `version`, complete once every rank of `ranks` (trainers, generators) saved."""
        path = checkpoint_dir(self.run_dir, version)
        path.mkdir(parents=True, exist_ok=True)
        clear_complete(path)  # a damaged checkpoint of this version, skipped on resume
        for old in path.glob(IN_FLIGHT_FILES):  # an unfinished save's, perhaps by other generator ranks
            old.unlink()
        self.last_start = time.monotonic()
        running = {g["group_id"]: g for g in state.get("running", [])}
        self.saving[version] = _Save(set(ranks), state, self.last_start, running=running)
        return path

    def arrived(self, src: int, traj) -> None:
        """A trajectory from generator `src`: if a save waits for that generator's answers in flight and its
        group was running at the save, it goes into the saved state (it finished before the generator saved,
        so its file does not hold it)."""
        for save in self.saving.values():
            group = save.running.get(traj.group_id) if src in save.waiting else None
            if group is not None:
                group["trajectories"][traj.index] = vars(traj).copy()

    def rank_saved(self, version: int, rank: int) -> None:
        save = self.saving[version]
        save.waiting.discard(rank)
        if save.waiting:
            return
        self.stall_s += time.monotonic() - save.started
        path = checkpoint_dir(self.run_dir, version)
        write_state(path, save.state)
        save.record = self._thread.submit(record_files, path, min(8, len(os.sched_getaffinity(0))))

    def finish(self) -> bool:
        """COMPLETE for each checkpoint whose files are recorded, in version order; True if any."""
        done = False
        for version in sorted(self.saving):
            save = self.saving[version]
            if save.record is None or not save.record.done():
                break
            record = save.record.result()  # a failure to read back the checkpoint ends the run here
            del self.saving[version]
            path = checkpoint_dir(self.run_dir, version)
            mark_complete(path)  # last: only now does the checkpoint count
            self.saved_version = max(self.saved_version, version)
            self.last_save_s = time.monotonic() - save.started
            gb = sum(f["size"] for f in record["files"].values()) / 1e9
            log.info("checkpoint of version %d complete: %s (%.2f GB, %.1f s)", version, path, gb, self.last_save_s)
            protect = [self.resume_from, *(checkpoint_dir(self.run_dir, v) for v in self.saving)]
            self._thread.submit(prune_checkpoints, self.run_dir, self.keep, protect)
            done = True
        return done

    def take_stall(self) -> float:
        """The trainers' time in saves since the last call (timing/save_s)."""
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    def close(self, wait: bool = True) -> None:
        self._thread.shutdown(wait=wait)


def write_state(path: Path, state: dict) -> None:
    with open(path / "controller.pkl.tmp", "wb") as f:
        pickle.dump(state, f)
    (path / "controller.pkl.tmp").rename(path / "controller.pkl")
    (path / "controller.json").write_text(json.dumps(state_summary(state), indent=1))


def state_summary(state: dict) -> dict:
    """What `controller.json` shows of a state, and a resumed controller logs as carried over: the version,
    the gate's counts, the next group id, how many groups are buffered and how many prompts are to be
    generated again, how many groups were running, and the layout it was written at (`Layout.summary`). None
    of it depends on the layout: groups are whole, their answers in flight are by group and episode
    (areal_hpc.checkpoint.in_flight), so a run resumes at any number of generators and trainer ranks."""
    summary = {k: state[k] for k in ("version", "gate", "next_group_id")}
    summary["buffered_groups"], summary["requeued_prompts"] = len(state["buffer"]), len(state["requeued"])
    summary["running_groups"] = len(state.get("running", []))
    summary["layout"] = state.get("layout", "not recorded")  # checkpoints from before it was
    return summary


MOVED = {("areal_hpc.data", "Example"): ("areal_hpc.data.dataset", "Example")}
"""Classes a checkpoint's pickle may name where they were before a move (module, name) -> where they are:
a run checkpointed before the move resumes after it."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(*MOVED.get((module, name), (module, name)))


def read_state(path: Path) -> dict:
    with open(Path(path) / "controller.pkl", "rb") as f:
        return _Unpickler(f).load()


def read_summary(path: Path) -> dict:
    """`controller.json` of the checkpoint at `path` (`state_summary`): what a launcher shows without
    unpickling the state."""
    summary = json.loads((Path(path) / "controller.json").read_text())
    return {"layout": "not recorded", **summary}
