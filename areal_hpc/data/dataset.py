"""Prompts: one validated loader for every path that reads user data (the RL run, the warm start,
`areal-hpc eval`), the prompt format, and a resumable shuffled stream.

```
 file -> rows --check--> Example(prompt, target) --format + tokenize--> prompt_ids --length filter--> examples
         JSONL, JSON list,   bad row: ConfigError      data.chat_template,          > data.max_prompt_tokens:
         parquet, datasets   `file:line: field ...`    system_prompt, prompt_suffix  skipped, counted, named
         directory
```

Rows:
    math: {"prompt": str, "answer": str | number}
    code: {"prompt": str, "tests": [{"input": str, "output": str}, ...]}  (or that list as a JSON string)
A row's other fields go to the rollout workflow as they are (`Example.extra`, `Example.row`): an agent task's
environment, files or tool settings. `tools/prepare_data.py` converts other layouts into these.

Prompts are tokenized once, here, for the whole data set: the length filter needs the count anyway,
and a prompt longer than the model's context must never reach the warm start (one 15,000-token
sequence padded into a batch kept it busy for many minutes) or a generator (vLLM refuses it).

Order: epoch e visits every example once, in the permutation drawn from Random((seed, e)); the
stream's position (epoch, index) is its whole state, so a resumed run continues exactly where the
checkpoint was taken and no prompt is consumed twice within an epoch.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from areal_hpc.arch import model_arch
from areal_hpc.config import Config, ConfigError
from areal_hpc.jsonl import JSONLError, read_jsonl
from areal_hpc.reward import REWARD_KINDS
from areal_hpc.reward.code import parse_tests

log = logging.getLogger(__name__)

NAMED_SKIPS = 5
"""How many skipped rows the log names."""
ROW_KEYS = ("prompt", "target", "kind", "prompt_ids")
"""The keys the system writes into the row a workflow gets (`Example.row`; the generator adds `prompt_ids`).
A data row's own field of one of these names but `prompt` would be hidden by the system's: refused at load."""


@dataclass(frozen=True)
class Example:
    index: int
    """Position of the row in its file (0-based, blank lines not counted)."""
    prompt: str
    """The prompt as the data set has it (before formatting)."""
    target: str | list[dict]
    """What the reward compares against, as the reward worker gets it: the answer (math), or the tests,
    a list of {"input", "output"} checked by `reward.code.parse_tests` (code)."""
    kind: str
    where: str = ""
    """The row's place in its file (`file:line` or `file: row i`), for messages."""
    prompt_ids: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The formatted prompt's tokens (`load_prompts`); None from `load_dataset` alone."""
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    """The row's other fields (all but `prompt` and its target's), as read: for the workflow (`row`). Sent
    with every request for the row, and saved with it in checkpoints."""

    @property
    def row(self) -> dict:
        """What a rollout workflow gets of the row besides `prompt_ids` (GenerateRequest.row):
        the row's other fields (`extra`) and its `prompt` (as the data set has it), `target` and `kind`."""
        return {**self.extra, "prompt": self.prompt, "target": self.target, "kind": self.kind}

    def __setstate__(self, state: dict) -> None:
        # Controller checkpoints written before rows kept their other fields saved Examples without `extra`.
        self.__dict__.update({"extra": {}, **state})


# --- reading and checking rows -----------------------------------------------------------------


def _check_row(row, where: str, kind: str) -> tuple[str, str | list[dict], dict]:
    """(prompt, target, the other fields) of a raw row, or ConfigError naming `where` and the field."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object with 'prompt' and '{_TARGET[kind]}', got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: field 'prompt' must be a non-empty string (got {prompt!r:.60})")
    extra = {k: v for k, v in row.items() if k not in ("prompt", _TARGET[kind])}
    if clash := sorted(extra.keys() & set(ROW_KEYS)):
        raise ConfigError(
            f"{where}: field '{clash[0]}' is a name the system gives the row a workflow gets "
            f"({', '.join(ROW_KEYS)}); rename it in the data set"
        )
    if kind == "none":  # nothing scores it: an answer is kept for `areal-hpc eval ... reward.kind=math`
        answer = row.get("answer")
        return prompt, "" if answer is None else str(answer), extra
    if kind == "math":
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise ConfigError(f"{where}: field 'answer' must be a non-empty string or number (got {answer!r:.60})")
        return prompt, str(answer), extra
    try:
        return prompt, parse_tests(row.get("tests")), extra
    except ValueError as e:
        raise ConfigError(f"{where}: field {e}") from None


_TARGET = {"math": "answer", "code": "tests", "none": "answer"}


def read_rows(path: str | Path, setting: str = "data.train_path") -> Iterator[tuple[str, object]]:
    """(where, raw row) of every row of a data set: JSONL lines, a JSON list, parquet rows, or the rows
    of a `datasets` directory (`save_to_disk`). ConfigError, naming `setting`, when it cannot be read."""
    path = Path(path)
    if path.is_dir():
        yield from _dataset_dir_rows(path, setting)
        return
    if not path.is_file():
        raise ConfigError(f"data not found: {path} ({setting})")
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"{path}: not valid JSON: {e} (a .json file holds one list of rows; use .jsonl for one row a line)"
            ) from None
        if not isinstance(rows, list):
            raise ConfigError(f"{path}: a .json data file must hold a list of rows (got {type(rows).__name__})")
        for i, row in enumerate(rows):
            yield f"{path}: row {i}", row
        return
    try:
        for lineno, _, row in read_jsonl(path):
            yield f"{path}:{lineno}", row
    except JSONLError as e:
        raise ConfigError(str(e)) from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - any reader error is a bad file
        raise ConfigError(f"{path}: not a readable parquet file: {e}") from None
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def _dataset_dir_rows(path: Path, setting: str) -> Iterator[tuple[str, object]]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(
            f"{path} holds the splits {', '.join(splits)} of a datasets DatasetDict; set {setting} to one of "
            + ", ".join(str(path / s) for s in splits)
        )
    if not (path / "dataset_info.json").is_file() or not (path / "state.json").is_file():
        raise ConfigError(
            f"{path} is a directory but not one saved by datasets' save_to_disk (no dataset_info.json and "
            f"state.json); {setting} takes such a directory, a JSONL, JSON or parquet file"
        )
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any reader error is a bad directory
        raise ConfigError(f"{path}: datasets could not load it: {e}") from None
    for i, row in enumerate(dataset):
        yield f"{path}: row {i}", row


def load_dataset(path: str | Path, kind: str, setting: str = "data.train_path") -> list[Example]:
    """Every row of the data set as an Example, validated; ConfigError on the first bad row."""
    if kind not in REWARD_KINDS:
        raise ConfigError(f"data kind must be one of {', '.join(REWARD_KINDS)} (got '{kind}')")
    examples = []
    for where, raw in read_rows(path, setting):
        prompt, target, extra = _check_row(raw, where, kind)
        examples.append(Example(len(examples), prompt, target, kind, where, extra=extra))
    if not examples:
        raise ConfigError(f"{path}: no rows ({setting} must hold at least one {kind} example)")
    return examples


# --- the prompt format and the length filter ----------------------------------------------------


@dataclass(frozen=True)
class PromptFormat:
    """How a data set's prompt becomes the model's input (`data.chat_template`, `system_prompt`,
    `prompt_suffix`):

        chat_template: apply_chat_template([system?, user: prompt + suffix], add_generation_prompt)
        otherwise:     prompt + suffix, tokenized as the tokenizer does by default
    """

    chat_template: bool = False
    system_prompt: str = ""
    prompt_suffix: str = ""

    @classmethod
    def from_config(cls, cfg: Config) -> PromptFormat:
        d = cfg.data
        return cls(d.chat_template, d.system_prompt, d.prompt_suffix)

    def encode(self, tokenizer, prompts: list[str]) -> list[np.ndarray]:
        """The token ids of each formatted prompt ([P] int32 each)."""
        texts = [p + self.prompt_suffix for p in prompts]
        special = True
        if self.chat_template:
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(
                    f"data.chat_template is true but the tokenizer of {tokenizer.name_or_path} has no chat "
                    "template; set data.chat_template=false, or use a model directory whose tokenizer has one"
                )
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            texts = [
                tokenizer.apply_chat_template(
                    [*system, {"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            special = False  # the template writes the special tokens itself
        ids = tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []
        return [np.asarray(x, np.int32) for x in ids]


def max_prompt_tokens(cfg: Config) -> int:
    """`data.max_prompt_tokens`, or by default the longest prompt that leaves its episode room for one whole
    turn: the episode's budget (`rollout.max_episode_tokens`, or the model's context) less
    `rollout.max_new_tokens`. A longer prompt would leave a turn no room at all under a small budget: the
    episode would sample nothing and be lost."""
    if cfg.data.max_prompt_tokens:
        return cfg.data.max_prompt_tokens
    context = model_arch(cfg.model).max_position_embeddings
    return min(context, cfg.rollout.max_episode_tokens or context) - cfg.rollout.max_new_tokens


def load_prompts(cfg: Config, tokenizer, path: str | Path, setting: str = "data.train_path") -> list[Example]:
    """The examples of a data set, formatted and tokenized (`prompt_ids`), less those over
    `max_prompt_tokens(cfg)` tokens, which are counted and the first few named in the log."""
    examples = load_dataset(path, cfg.reward.kind, setting)
    ids = PromptFormat.from_config(cfg).encode(tokenizer, [e.prompt for e in examples])
    limit = max_prompt_tokens(cfg)
    kept, skipped = [], []
    for e, p in zip(examples, ids):
        if len(p) > limit:
            skipped.append(f"{e.where} ({len(p)} tokens)")
        else:
            kept.append(replace(e, index=len(kept), prompt_ids=p))
    if skipped:
        named = ", ".join(skipped[:NAMED_SKIPS]) + (", ..." if len(skipped) > NAMED_SKIPS else "")
        log.warning(
            "%s: skipped %d of %d prompts longer than %d tokens (data.max_prompt_tokens): %s",
            path,
            len(skipped),
            len(examples),
            limit,
            named,
        )
    if not kept:
        raise ConfigError(
            f"{path}: every prompt is longer than {limit} tokens (data.max_prompt_tokens); raise it (with "
            "model.max_position_embeddings) or shorten the prompts"
        )
    return kept


def train_path(cfg: Config) -> Path:
    """`data.train_path`, or the synthetic task's training split built under the run root."""
    if cfg.data.train_path:
        return Path(cfg.data.train_path)
    if cfg.reward.kind not in ("math", "none"):
        raise ConfigError(f"reward.kind {cfg.reward.kind} needs data.train_path (the synthetic task is math)")

    return _synthetic(cfg) / "train.jsonl"


def eval_path(cfg: Config) -> Path:
    """`eval.data`, or with neither it nor `data.train_path` set, the synthetic task's held-out test split."""
    if cfg.eval.data:
        return Path(cfg.eval.data)
    if cfg.data.train_path:
        raise ConfigError("eval.data is empty: name the held-out prompts to evaluate on (eval.data=FILE, or --data)")
    return _synthetic(cfg) / "test.jsonl"


def _synthetic(cfg: Config) -> Path:
    from areal_hpc.data.tiny import build_synthetic_data

    d = cfg.data
    return build_synthetic_data(
        d.synthetic_size, cfg.experiment.root, cfg.experiment.seed, d.synthetic_task, d.synthetic_max_operand
    )


# --- the stream ---------------------------------------------------------------------------------


class PromptStream:
    """An endless stream of examples: every epoch a fresh permutation, drawn from (seed, epoch)."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise ValueError("a prompt stream needs at least one example")
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer) -> PromptStream:
        """The training prompts (`train_path(cfg)`), formatted and filtered by `load_prompts`."""
        return cls(load_prompts(cfg, tokenizer, train_path(cfg)), cfg.experiment.seed)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> Example:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        example = self.examples[self._order[self.position]]
        self.position += 1
        return example

    def __iter__(self) -> Iterator[Example]:
        while True:
            yield self.next()

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
