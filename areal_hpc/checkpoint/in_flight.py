"""The answers in flight at a checkpoint: what each generator writes beside the trainers' files, and what a
resumed controller reads back.

At a Save, every generator writes `in-flight-<rank>.pkl`: for each training episode it is running, by (group
id, index), the turns it has sampled so far (`protocol.SavedTurn`: the finished ones and the one in flight,
read from vLLM without stopping it). The controller's state (areal_hpc.checkpoint.controller) holds the
groups that were running and the episodes of theirs that had already come back; together they are every
token generated for those groups. The files are recorded in FILES.json with the rest, but a resume can do
without them (files.OPTIONAL): one missing, damaged or unreadable is left out with a warning, its episodes
run again from their rows. The controller reads all of them, whatever the number of generators now,
and hands each running group's saved turns to the generator that runs it next (areal_hpc.generator.resume).

Written by the generators themselves, each its own share in parallel: at the scale of the qwen configs an
answer in flight averages a few thousand tokens, 12 bytes each (id, logprob, version), some 0.2 to 1 GB a
run, which through the controller's one loop would stall every role while it is written. With
`ppo.routing_replay` a finished turn also keeps its routing (L x K bytes a position of its context and
output), so a multi-turn MoE episode's file is larger.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

from areal_hpc.checkpoint.files import OPTIONAL, file_damage, recorded_files
from areal_hpc.protocol import SavedTurn

log = logging.getLogger(__name__)

FILE = OPTIONAL + "{rank}.pkl"
IN_FLIGHT_FILES = OPTIONAL + "*"
"""Every generator's file of a checkpoint directory, and what an interrupted write left (`.tmp`)."""


def write_in_flight(path: Path, rank: int, version: int, episodes: dict[tuple[int, int], list[SavedTurn]]) -> int:
    """Write a generator's episodes in flight into the checkpoint directory `path`; returns the file's bytes."""
    target = Path(path) / FILE.format(rank=rank)
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"version": version, "episodes": episodes}, f, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.rename(target)
    return target.stat().st_size


def read_in_flight(path: Path, version: int) -> dict[tuple[int, int], list[SavedTurn]]:
    """Every generator's episodes in flight in the checkpoint at `path` (of `version`), by (group id, index);
    none for a checkpoint written before they were saved. A file that is missing, damaged (against
    FILES.json) or unreadable is left out with a warning naming it: its episodes run again from their rows;
    the resume goes on."""
    path = Path(path)
    try:
        record = recorded_files(path)
        names = sorted(n for n in record if n.startswith(OPTIONAL))
    except (OSError, ValueError, KeyError):  # a checkpoint from before files were recorded
        names, record = sorted(p.name for p in path.glob(FILE.format(rank="*"))), {}
    episodes = {}
    for name in names:  # written at this save only (Checkpoints.begin)
        damage = file_damage(path, name, record[name], checksums_up_to=None) if name in record else None
        try:
            if damage is None:
                with open(path / name, "rb") as f:
                    saved = pickle.load(f)
                if saved["version"] != version:
                    damage = f"{name} holds answers of version {saved['version']}"
        except Exception as e:  # noqa: BLE001 - any unreadable file is left out, never the resume
            damage = f"{name} is unreadable ({type(e).__name__}: {e})"
        if damage:
            log.warning("checkpoint %s: %s; its answers in flight are left out and run again", path, damage)
            continue
        episodes.update(saved["episodes"])
    return episodes


def sampled_tokens(turns: list[SavedTurn]) -> int:
    return sum(len(t.token_ids) for t in turns)
