"""Training prompts: load and validate a data set, and stream it in a resumable shuffled order.

Rows (JSONL, one object a line; or parquet when pyarrow is installed):
    math: {"prompt": str, "answer": str | number}
    code: {"prompt": str, "tests": [{"input": str, "output": str}, ...]}  (or that list as a JSON string)
Other fields are ignored. A bad row fails the load with an error naming the file, the line (row)
and the field.

Order: epoch e visits every example once, in the permutation drawn from Random((seed, e)); the
stream's position (epoch, index) is its whole state, so a resumed run continues exactly where the
checkpoint was taken and no prompt is consumed twice within an epoch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import ConfigError

KINDS = ("math", "code")


@dataclass(frozen=True)
class Example:
    index: int
    """Position of the row in its file (0-based, blank lines not counted)."""
    prompt: str
    target: str
    """What the reward compares against: the answer (math) or the tests as JSON (code)."""
    kind: str

    def row(self) -> dict:
        """The row as the controller keeps it: {prompt, answer} or {prompt, tests}."""
        if self.kind == "math":
            return {"prompt": self.prompt, "answer": self.target, "index": self.index}
        return {"prompt": self.prompt, "tests": json.loads(self.target), "index": self.index}


def _check_row(row, where: str, kind: str) -> tuple[str, str]:
    """(prompt, target) of a raw row, or ConfigError naming `where` and the field."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object with 'prompt' and '{_TARGET[kind]}', got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: field 'prompt' must be a non-empty string (got {prompt!r:.60})")
    if kind == "math":
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise ConfigError(f"{where}: field 'answer' must be a non-empty string or number (got {answer!r:.60})")
        return prompt, str(answer)
    tests = row.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: field 'tests' is a string but not JSON: {e}") from None
    if not isinstance(tests, list) or not tests:
        raise ConfigError(f"{where}: field 'tests' must be a non-empty list of {{input, output}} (got {tests!r:.60})")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("output"), str) or not isinstance(t.get("input", ""), str):
            raise ConfigError(f"{where}: field 'tests[{i}]' must be an object with string 'input' and 'output'")
    return prompt, json.dumps([{"input": t.get("input", ""), "output": t["output"]} for t in tests])


_TARGET = {"math": "answer", "code": "tests"}


def _raw_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, raw row) of every row: JSONL lines, or parquet rows."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or use JSONL") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any reader error is a bad file
            raise ConfigError(f"{path}: not a readable parquet file: {e}") from None
        for i, row in enumerate(rows):
            yield f"{path}: row {i}", row
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON: {e}") from None


def load_dataset(path: str | Path, kind: str) -> list[Example]:
    """Every row of the file as an Example, validated; ConfigError on the first bad row."""
    if kind not in KINDS:
        raise ConfigError(f"data kind must be one of {', '.join(KINDS)} (got '{kind}')")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data file not found: {path} (data.train_path)")
    examples = []
    for where, raw in _raw_rows(path):
        prompt, target = _check_row(raw, where, kind)
        examples.append(Example(len(examples), prompt, target, kind))
    if not examples:
        raise ConfigError(f"{path}: no rows (data.train_path must hold at least one {kind} example)")
    return examples


class PromptStream:
    """An endless stream of examples: every epoch a fresh permutation, drawn from (seed, epoch)."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise ValueError("a prompt stream needs at least one example")
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, cfg) -> PromptStream:
        """`data.train_path` (of `reward.kind`), or the synthetic arithmetic task built under the run root."""
        path = cfg.data.train_path
        if not path and cfg.reward.kind != "math":
            raise ConfigError(f"reward.kind {cfg.reward.kind} needs data.train_path (the synthetic task is math)")
        if not path:
            from areal_hpc.tiny import build_arithmetic_data

            d = cfg.data
            path = build_arithmetic_data(
                d.synthetic_size, cfg.experiment.root, cfg.experiment.seed, d.synthetic_max_operand
            )
        return cls(load_dataset(path, cfg.reward.kind), cfg.experiment.seed)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_example(self) -> Example:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        example = self.examples[self._order[self.position]]
        self.position += 1
        return example

    def next(self) -> dict:
        """The next row, as the controller keeps it (`Example.row`)."""
        return self.next_example().row()

    def __iter__(self) -> Iterator[Example]:
        while True:
            yield self.next_example()

    @property
    def consumed(self) -> int:
        """Examples handed out since the start of epoch 0."""
        return self.epoch * len(self.examples) + self.position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the data set and seed must be the ones it was saved with."""
        if state["size"] != len(self.examples) or state["seed"] != self.seed:
            raise ConfigError(
                f"the checkpoint's prompt stream had {state['size']} examples and seed {state['seed']}; "
                f"this run has {len(self.examples)} and seed {self.seed}: resume with the same data.train_path "
                "and experiment.seed, or start a new trial"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
