"""JSONL, read in one place: the user's data (`data.read_rows`, with `file:line` errors) and the files a
run appends to (metrics.jsonl, timeline.jsonl, slurm/attempts.jsonl), read while they are written.

A file a run appends to may hold a torn line: the one being written now (no newline yet), or the last
one of a crash (a resumed run cuts that one off: `metrics.drop_rows_after`). Such a reader skips a
line that is not JSON and stops before a last line without its newline; the byte offset after each
line it returns is where a reader that follows the file (`areal_hpc.launch.local`) goes on, or where a writer
may cut it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class JSONLError(ValueError):
    """A line of user data that is not JSON, or a file that is not UTF-8 text; the message names `file:line`."""


def read_jsonl(path: str | Path, torn_ok: bool = False, start: int = 0) -> Iterator[tuple[int, int, object]]:
    """(line number, byte offset after the line, value) of each non-blank line of `path`, from byte `start`
    (line numbers count from there, 1-based).

    torn_ok=False (user data): a line that is not JSON, or not UTF-8, raises JSONLError.
    torn_ok=True (a file a run appends to): such a line is skipped, and a last line without its newline
    (being written) is not read."""
    with open(path, "rb") as f:
        f.seek(start)
        end = start
        for number, raw in enumerate(f, 1):
            end += len(raw)
            if torn_ok and not raw.endswith(b"\n"):
                return
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                if torn_ok:
                    continue
                raise JSONLError(f"{path}:{number}: not UTF-8 text ({e}); JSONL is one JSON object a line") from None
            except json.JSONDecodeError as e:
                if torn_ok:
                    continue
                raise JSONLError(f"{path}:{number}: not valid JSON: {e}") from None
            yield number, end, value
