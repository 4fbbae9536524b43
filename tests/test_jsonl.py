"""The one JSONL reader: user data with `file:line` errors, and the files a run appends to (torn lines)."""

import json

import pytest

from areal_hpc.jsonl import JSONLError, read_jsonl
from areal_hpc.launch.local import _Tail
from areal_hpc.metrics import drop_rows_after


def test_user_data_names_the_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n')
    with pytest.raises(JSONLError, match=f"{path}:4: not valid JSON"):
        list(read_jsonl(path))
    path.write_text('{"a": 1}\n\n{"a": 2}')  # a last line without its newline is a row of user data
    assert [(n, row) for n, _, row in read_jsonl(path)] == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(JSONLError, match=f"{path}:2: not UTF-8"):
        list(read_jsonl(path))


def test_a_run_file_skips_torn_lines_and_stops_before_the_one_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n{"step": 4')
    rows = list(read_jsonl(path, torn_ok=True))
    assert [row for *_, row in rows] == [{"step": 1}, {"step": 3}]
    assert rows[-1][1] == len('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n'), "the offset after the last row read"


def test_following_a_file_reads_each_row_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = _Tail(path)
    assert tail.rows() == []
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1}) + "\n" + '{"step": ')
        f.flush()
        assert tail.rows() == [{"step": 1}]
        f.write('2}\n{"step": 3}\n')
        f.flush()
        assert tail.rows() == [{"step": 2}, {"step": 3}]
        assert tail.rows() == []


def test_a_resume_cuts_later_steps_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    path.write_text(rows + '{"step": 4, "re')
    drop_rows_after(path, 3)
    assert path.read_text() == rows, "the torn line goes, or the next row would be glued to it"
    drop_rows_after(path, 1)
    assert path.read_text() == json.dumps({"step": 1}) + "\n"
