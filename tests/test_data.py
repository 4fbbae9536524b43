"""Data sets: validated loading with errors that name the file, line and field; a resumable shuffled stream."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import Config, ConfigError
from areal_hpc.data import PromptStream, load_dataset


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


def test_math_rows(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2*3=", "answer": 6}])
    examples = load_dataset(path, "math")
    assert [(e.prompt, e.target, e.index) for e in examples] == [("1+1=", "2", 0), ("2*3=", "6", 1)]
    assert examples[1].row() == {"prompt": "2*3=", "answer": "6", "index": 1}


def test_code_rows_tests_as_list_or_json_string(tmp_path):
    tests = [{"input": "1 2", "output": "3"}, {"output": "hi"}]
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt": "add", "tests": tests, "extra": 1}, {"prompt": "hi", "tests": json.dumps(tests)}],
    )
    examples = load_dataset(path, "code")
    want = [{"input": "1 2", "output": "3"}, {"input": "", "output": "hi"}]
    assert [json.loads(e.target) for e in examples] == [want, want]
    assert examples[0].row()["tests"] == want


@pytest.mark.parametrize(
    "kind, bad_line, message",
    [
        ("math", '{"prompt": "x", "answer": ', "not valid JSON"),
        ("math", '["prompt", "answer"]', "expected an object"),
        ("math", '{"answer": "1"}', "field 'prompt'"),
        ("math", '{"prompt": "", "answer": "1"}', "field 'prompt'"),
        ("math", '{"prompt": "x"}', "field 'answer'"),
        ("math", '{"prompt": "x", "answer": true}', "field 'answer'"),
        ("code", '{"prompt": "x", "answer": "1"}', "field 'tests'"),
        ("code", '{"prompt": "x", "tests": []}', "field 'tests'"),
        ("code", '{"prompt": "x", "tests": "[oops"}', "field 'tests' is a string but not JSON"),
        ("code", '{"prompt": "x", "tests": [{"input": "1", "output": 2}]}', "field 'tests[0]'"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, kind, bad_line, message):
    good = {"prompt": "p", "answer": "1"} if kind == "math" else {"prompt": "p", "tests": [{"output": "1"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good], raw_lines=["", bad_line])
    with pytest.raises(ConfigError) as e:
        load_dataset(path, kind)
    assert f"{path}:4:" in str(e.value), "the line number counts blank lines of the file"
    assert message in str(e.value)


def test_missing_empty_and_wrong_kind(tmp_path):
    with pytest.raises(ConfigError, match="data file not found"):
        load_dataset(tmp_path / "nope.jsonl", "math")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no rows"):
        load_dataset(tmp_path / "empty.jsonl", "math")
    with pytest.raises(ConfigError, match="data kind"):
        load_dataset(tmp_path / "empty.jsonl", "poetry")


def test_parquet_needs_pyarrow_or_reads_rows(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="needs pyarrow"):
            load_dataset(tmp_path / "d.parquet", "math")
        return
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=r"d.parquet: row 1: field 'answer'"):
        load_dataset(tmp_path / "d.parquet", "math")


def stream_of(n: int, seed: int, tmp_path) -> PromptStream:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]
    return PromptStream(load_dataset(write_jsonl(tmp_path / f"s{n}.jsonl", rows), "math"), seed)


def test_every_epoch_is_a_permutation_and_epochs_differ(tmp_path):
    s = stream_of(50, seed=3, tmp_path=tmp_path)
    epochs = [[s.next()["prompt"] for _ in range(50)] for _ in range(3)]
    for e in epochs:
        assert sorted(e) == sorted(f"p{i}" for i in range(50))
    assert epochs[0] != epochs[1] != epochs[2]
    assert s.consumed == 150
    again = stream_of(50, seed=3, tmp_path=tmp_path)
    assert [again.next()["prompt"] for _ in range(50)] == epochs[0], "deterministic in the seed"
    other = stream_of(50, seed=4, tmp_path=tmp_path)
    assert [other.next()["prompt"] for _ in range(50)] != epochs[0]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), before=st.integers(0, 80), after=st.integers(1, 80), seed=st.integers(0, 9))
def test_resume_continues_exactly(tmp_path_factory, n, before, after, seed):
    tmp_path = tmp_path_factory.mktemp("resume")
    uninterrupted = stream_of(n, seed, tmp_path)
    want = [uninterrupted.next()["prompt"] for _ in range(before + after)]
    first = stream_of(n, seed, tmp_path)
    got = [first.next()["prompt"] for _ in range(before)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = stream_of(n, seed, tmp_path)
    resumed.load_state_dict(state)
    got += [resumed.next()["prompt"] for _ in range(after)]
    assert got == want


def test_resume_refuses_another_data_set(tmp_path):
    state = stream_of(10, 1, tmp_path).state_dict()
    with pytest.raises(ConfigError, match="same data.train_path"):
        stream_of(11, 1, tmp_path).load_state_dict(state)


def test_from_config_builds_the_synthetic_task(tmp_path):
    cfg = Config()
    cfg.experiment.root = str(tmp_path)
    cfg.data.synthetic_size = 64
    stream = PromptStream.from_config(cfg)
    row = stream.next()
    assert row["prompt"].endswith("=") and row["answer"].lstrip("-").isdigit()
    cfg.reward.kind = "code"
    with pytest.raises(ConfigError, match="needs data.train_path"):
        PromptStream.from_config(cfg)
    cfg.data.train_path = str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "tests": [{"output": "1"}]}]))
    assert PromptStream.from_config(cfg).next()["tests"] == [{"input": "", "output": "1"}]
