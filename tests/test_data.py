"""Data sets: validated loading with errors that name the file, line and field; a resumable shuffled stream."""

import json
import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import Config, ConfigError, load_config
from areal_hpc.data.dataset import PromptStream, load_dataset, load_prompts
from areal_hpc.data.synthetic import synthetic_rows
from areal_hpc.data.tiny import build_tokenizer


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


def test_code_rows_tests_as_list_or_json_string(tmp_path):
    tests = [{"input": "1 2", "output": "3"}, {"output": "hi"}]
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt": "add", "tests": tests, "extra": 1}, {"prompt": "hi", "tests": json.dumps(tests)}],
    )
    examples = load_dataset(path, "code")
    want = [{"input": "1 2", "output": "3"}, {"input": "", "output": "hi"}]
    assert [e.target for e in examples] == [want, want], "the tests in one form, checked and normalised"


def test_a_rows_other_fields_reach_the_workflows_row_and_old_pickles_load(tmp_path):
    """Fields besides the prompt and its target go to the workflow as they are (`Example.row`), through the
    length filter; a field named as one of the system's row keys is refused; an Example pickled before
    rows kept their other fields (a controller checkpoint's) loads with none."""
    files = {"a.py": "print(1)"}
    rows = [{"prompt": "1+1=", "answer": "2", "env_id": "calc-v1", "files": files}, {"prompt": "2+2=", "answer": 4}]
    cfg, path = config_with(tmp_path, rows)
    a, b = load_prompts(cfg, build_tokenizer(), path)
    assert a.row == {"prompt": "1+1=", "target": "2", "kind": "math", "env_id": "calc-v1", "files": files}
    assert b.row == {"prompt": "2+2=", "target": "4", "kind": "math"}
    assert pickle.loads(pickle.dumps(a)).row == a.row
    for name in ("target", "kind", "prompt_ids"):
        bad = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": "1+1=", "answer": "2", name: "x"}])
        with pytest.raises(ConfigError, match=re.escape(f"{bad}:1: field '{name}' is a name the system gives")):
            load_dataset(bad, "math")
    del a.__dict__["extra"]  # as the code before `extra` pickled it
    assert pickle.loads(pickle.dumps(a)).row == {"prompt": "1+1=", "target": "2", "kind": "math"}


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
    with pytest.raises(ConfigError, match=r"data not found: .*nope.jsonl \(data.train_path\)"):
        load_dataset(tmp_path / "nope.jsonl", "math")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no rows"):
        load_dataset(tmp_path / "empty.jsonl", "math")
    with pytest.raises(ConfigError, match="data kind"):
        load_dataset(tmp_path / "empty.jsonl", "poetry")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_dataset(tmp_path / "latin1.jsonl", "math")


def test_json_list_and_its_bad_rows(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "2"}]))
    assert [e.target for e in load_dataset(tmp_path / "d.json", "math")] == ["1", "2"]
    (tmp_path / "obj.json").write_text(json.dumps({"prompt": "a", "answer": 1}))
    with pytest.raises(ConfigError, match="must hold a list of rows"):
        load_dataset(tmp_path / "obj.json", "math")
    (tmp_path / "lines.json").write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    with pytest.raises(ConfigError, match="use .jsonl for one row a line"):
        load_dataset(tmp_path / "lines.json", "math")
    (tmp_path / "bad.json").write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b"}]))
    with pytest.raises(ConfigError, match=r"bad.json: row 1: field 'answer'"):
        load_dataset(tmp_path / "bad.json", "math")


def test_parquet_rows_and_a_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]), tmp_path / "d.parquet"
    )
    assert [e.prompt for e in load_dataset(tmp_path / "d.parquet", "math")] == ["a", "b"]
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]), tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet: row 1: field 'answer'"):
        load_dataset(tmp_path / "bad.parquet", "math")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        load_dataset(tmp_path / "junk.parquet", "math")


def test_datasets_directories(tmp_path):
    from datasets import Dataset, DatasetDict

    tests = [{"input": "1", "output": "1"}]
    ds = Dataset.from_list([{"prompt": "echo", "tests": json.dumps(tests), "source": "x"}])
    ds.save_to_disk(str(tmp_path / "one"))
    assert load_dataset(tmp_path / "one", "code")[0].target == tests
    DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(
        ConfigError, match=r"splits train, test of a datasets DatasetDict; set data.train_path to one of .*dict/train"
    ):
        load_dataset(tmp_path / "dict", "code")
    assert len(load_dataset(tmp_path / "dict" / "train", "code")) == 1
    Dataset.from_list([{"prompt": "echo"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"bad: row 0: field 'tests'"):
        load_dataset(tmp_path / "bad", "code")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not one saved by datasets' save_to_disk"):
        load_dataset(tmp_path / "plain", "math")


def stream_of(n: int, seed: int, tmp_path) -> PromptStream:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]
    return PromptStream(load_dataset(write_jsonl(tmp_path / f"s{n}.jsonl", rows), "math"), seed)


def test_every_epoch_is_a_permutation_and_epochs_differ(tmp_path):
    s = stream_of(50, seed=3, tmp_path=tmp_path)
    epochs = [[s.next().prompt for _ in range(50)] for _ in range(3)]
    for e in epochs:
        assert sorted(e) == sorted(f"p{i}" for i in range(50))
    assert epochs[0] != epochs[1] != epochs[2]
    assert s.consumed == 150
    again = stream_of(50, seed=3, tmp_path=tmp_path)
    assert [again.next().prompt for _ in range(50)] == epochs[0], "deterministic in the seed"
    other = stream_of(50, seed=4, tmp_path=tmp_path)
    assert [other.next().prompt for _ in range(50)] != epochs[0]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), before=st.integers(0, 80), after=st.integers(1, 80), seed=st.integers(0, 9))
def test_resume_continues_exactly(tmp_path_factory, n, before, after, seed):
    tmp_path = tmp_path_factory.mktemp("resume")
    uninterrupted = stream_of(n, seed, tmp_path)
    want = [uninterrupted.next().prompt for _ in range(before + after)]
    first = stream_of(n, seed, tmp_path)
    got = [first.next().prompt for _ in range(before)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = stream_of(n, seed, tmp_path)
    resumed.load_state_dict(state)
    got += [resumed.next().prompt for _ in range(after)]
    assert got == want


def test_resume_refuses_another_data_set(tmp_path):
    state = stream_of(10, 1, tmp_path).state_dict()
    with pytest.raises(ConfigError, match="same data.train_path"):
        stream_of(11, 1, tmp_path).load_state_dict(state)


def test_from_config_builds_the_synthetic_task_with_a_held_out_split(tmp_path):
    from areal_hpc.data.dataset import eval_path

    cfg = Config()
    cfg.experiment.root = str(tmp_path)
    cfg.data.synthetic_size, cfg.data.synthetic_max_operand = 300, 9
    tok = build_tokenizer()
    stream = PromptStream.from_config(cfg, tok)
    example = stream.next()
    assert example.prompt.endswith("=") and example.target.lstrip("-").isdigit()
    assert tok.decode(example.prompt_ids) == example.prompt
    train = {e.prompt for e in stream.examples}
    test = [e.prompt for e in load_dataset(eval_path(cfg), "math")]
    assert len(test) == len(set(test)) == 200 // 5, "a fifth of the 200 problems, each once"
    assert not train & set(test), "a held-out problem is in the training split"
    assert not {r["prompt"] for r in synthetic_rows(2000, 7, max_operand=9)} & set(test)
    from areal_hpc.data.initial_model import sft_examples

    cfg.sft.examples = 2000  # the warm start stands in for pretraining: it sees every problem
    prompts = {tok.decode(ids[: mask.index(1)]) for ids, mask in sft_examples(cfg, tok)}
    assert set(test) < prompts, "the warm start skips held-out problems"
    cfg.reward.kind = "code"
    with pytest.raises(ConfigError, match="needs data.train_path"):
        PromptStream.from_config(cfg, tok)
    cfg.data.train_path = str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "tests": [{"output": "1"}]}]))
    assert PromptStream.from_config(cfg, tok).next().target == [{"input": "", "output": "1"}]
    with pytest.raises(ConfigError, match="eval.data is empty"):
        eval_path(cfg)


CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def config_with(tmp_path, rows, *overrides):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    return load_config(None, [f"experiment.root={tmp_path}", f"data.train_path={path}", *overrides]), path


def test_prompt_format_plain_suffix_and_chat_template(tmp_path):
    tok = build_tokenizer()
    rows = [{"prompt": "1+2=", "answer": "3"}]
    cfg, _ = config_with(tmp_path, rows)
    cfg.data.prompt_suffix = "\n Box it."  # as YAML gives it ("\n Box it."); a command line strips spaces
    (e,) = load_prompts(cfg, tok, cfg.data.train_path)
    assert tok.decode(e.prompt_ids) == "1+2=\n Box it." and e.prompt == "1+2="
    cfg, _ = config_with(tmp_path, rows, "data.chat_template=true", "data.system_prompt=Be brief.")
    tok.chat_template = None  # the tiny tokenizer has one of its own
    with pytest.raises(ConfigError, match="has no chat template; set data.chat_template=false"):
        load_prompts(cfg, tok, cfg.data.train_path)
    tok.chat_template = CHAT
    (e,) = load_prompts(cfg, tok, cfg.data.train_path)
    assert tok.decode(e.prompt_ids) == "<system>Be brief.\n<user>1+2=\n<assistant>"
    with pytest.raises(ConfigError, match="data.system_prompt needs data.chat_template: true"):
        config_with(tmp_path, rows, "data.system_prompt=Be brief.")


def test_overlong_prompts_are_skipped_counted_and_named(tmp_path, caplog):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    rows[3]["prompt"] = rows[8]["prompt"] = "9" * 15000 + "="
    cfg, path = config_with(tmp_path, rows)  # default limit: 512 positions - 32 new tokens
    with caplog.at_level("WARNING"):
        examples = load_prompts(cfg, build_tokenizer(), path)
    assert [e.prompt for e in examples] == [r["prompt"] for i, r in enumerate(rows) if i not in (3, 8)]
    assert [e.index for e in examples] == list(range(8))
    assert (
        f"skipped 2 of 10 prompts longer than 480 tokens (data.max_prompt_tokens): {path}:4 (15001 tokens), {path}:9"
        in caplog.text
    )
    cfg, path = config_with(tmp_path, rows, "data.max_prompt_tokens=3")
    with pytest.raises(ConfigError, match="every prompt is longer than 3 tokens"):
        load_prompts(cfg, build_tokenizer(), path)
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \(500\) \+ rollout.max_new_tokens \(32\) must fit"):
        config_with(tmp_path, rows, "data.max_prompt_tokens=500")


def test_prompt_limit_leaves_a_whole_turn_within_max_episode_tokens(tmp_path, caplog):
    """With rollout.max_episode_tokens below the context, a prompt must leave the episode room for one turn
    of rollout.max_new_tokens: the default limit is the episode's budget less that, and an explicit
    data.max_prompt_tokens over it is refused at load."""
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 80 + "=", "answer": "0"}]
    cfg, path = config_with(tmp_path, rows, "rollout.max_episode_tokens=100")  # 512 positions, 32 new tokens
    with caplog.at_level("WARNING"):
        examples = load_prompts(cfg, build_tokenizer(), path)
    assert [e.prompt for e in examples] == ["1+1="]
    assert f"skipped 1 of 2 prompts longer than 68 tokens (data.max_prompt_tokens): {path}:2 (81 tokens)" in caplog.text
    with pytest.raises(
        ConfigError,
        match=r"data.max_prompt_tokens \(81\) \+ rollout.max_new_tokens \(32\) must fit rollout.max_episode_tokens \(100\)",
    ):
        config_with(tmp_path, rows, "rollout.max_episode_tokens=100", "data.max_prompt_tokens=81")
    cfg, _ = config_with(tmp_path, rows, "rollout.max_episode_tokens=100", "data.max_prompt_tokens=68")
    assert len(load_prompts(cfg, build_tokenizer(), path)) == 1


def test_warm_start_reads_through_the_loader(tmp_path, caplog):
    """The issue's cases: a malformed line and a row without its answer end in the loader's errors,
    not tracebacks; a 15,000-character prompt is skipped (and named), not trained on for minutes."""
    from areal_hpc.data.initial_model import sft_examples

    tok = build_tokenizer()
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    cfg, path = config_with(tmp_path, good + [{"prompt": "9" * 15000 + "=", "answer": "1"}], "sft.examples=4")
    with caplog.at_level("WARNING"):
        examples = sft_examples(cfg, tok)
    assert len(examples) == 4 and f"{path}:7 (15001 tokens)" in caplog.text
    ids, mask = examples[0]
    assert tok.decode(ids) == "0+1=\\boxed{1}<|endoftext|>" and mask == [0] * 4 + [1] * 4
    path.write_text(json.dumps(good[0]) + "\n" + '{"prompt": "2+2=", "answer": \n')
    with pytest.raises(ConfigError, match=f"{path}:2: not valid JSON"):
        sft_examples(cfg, tok)
    path.write_text(json.dumps(good[0]) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    with pytest.raises(ConfigError, match=f"{path}:2: field 'answer'"):
        sft_examples(cfg, tok)
    with pytest.raises(ConfigError, match="sft.examples > 0 needs math rows"):
        config_with(tmp_path, good, "sft.examples=4", "reward.kind=code")


def test_warm_start_leaves_the_unboxed_share_bare(tmp_path):
    """`sft.unboxed`: that share of the warm-start responses is the bare answer (the math reward scores it
    0), the rest boxed; the same examples every time; out of [0, 1) it is a config error."""
    from areal_hpc.data.initial_model import sft_examples
    from areal_hpc.reward.math import math_reward

    tok = build_tokenizer()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(400)]
    cfg, _ = config_with(tmp_path, rows, "sft.examples=400", "sft.unboxed=0.5")
    responses = [tok.decode(ids[mask.index(1) :], skip_special_tokens=True) for ids, mask in sft_examples(cfg, tok)]
    bare = [text for text, row in zip(responses, rows) if text == row["answer"]]
    boxed = [text for text, row in zip(responses, rows) if text == f"\\boxed{{{row['answer']}}}"]
    assert len(bare) + len(boxed) == 400 and 160 < len(bare) < 240
    assert math_reward(bare[0], bare[0]) == 0.0 and math_reward(boxed[0], boxed[0][7:-1]) == 1.0
    assert sft_examples(cfg, tok) == sft_examples(cfg, tok)
    for bad in ("1", "-0.1"):
        with pytest.raises(ConfigError, match=f"sft.unboxed must be in \\[0, 1\\) \\(got {bad}"):
            config_with(tmp_path, rows, f"sft.unboxed={bad}")


@pytest.mark.slow
def test_run_reports_bad_data_in_one_line(tmp_path):
    """`areal-hpc run` with a malformed data file: exit 2 and the loader's message, no traceback, before any rank."""
    import subprocess
    import sys

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", "configs/tiny-cpu.yaml", f"experiment.root={tmp_path}"]
    cmd += [f"data.train_path={path}", "sft.examples=10"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"config error: {path}:2: not valid JSON" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_warm_start_calls_the_calculator_in_the_tool_share(tmp_path):
    """`sft.tool_share`: that share of the multiplication warm start calls the calculator, in the tiny
    tokenizer's tool syntax, with its answer as context (mask 0); no held-out problem is trained on."""
    from areal_hpc.data.dataset import eval_path
    from areal_hpc.data.initial_model import sft_examples

    tok = build_tokenizer()
    overrides = ["data.synthetic_task=multiplication", "sft.examples=400", "sft.tool_share=0.3"]
    cfg = load_config(None, [f"experiment.root={tmp_path}", *overrides])
    examples = sft_examples(cfg, tok)
    calls = [(ids, mask) for ids, mask in examples if tok.convert_tokens_to_ids("<calc>") in ids]
    assert len(examples) == 400 and 90 < len(calls) < 150
    ids, mask = calls[0]
    prompt = tok.decode(ids[: mask.index(1)])
    a, b = map(int, prompt[:-1].split("*"))
    assert tok.decode(ids) == f"{a}*{b}=<calc>{a}*{b}<|endoftext|><result>{a * b}\n\\boxed{{{a * b}}}<|endoftext|>"
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == f"<calc>{a}*{b}<|endoftext|>\\boxed{{{a * b}}}<|endoftext|>", "the tool's answer is context"
    test = {e.prompt for e in load_dataset(eval_path(cfg), "math")}
    assert len(test) == 500 and not test & {tok.decode(i[: m.index(1)]) for i, m in examples}
    with pytest.raises(ConfigError, match="sft.tool_share > 0 needs the synthetic multiplication task"):
        load_config(None, [f"experiment.root={tmp_path}", "sft.tool_share=0.3"])
    with pytest.raises(ConfigError, match=r"sft.tool_share must be in \[0, 1\] \(got 1.5\)"):
        load_config(None, [f"experiment.root={tmp_path}", *overrides, "sft.tool_share=1.5"])
    with pytest.raises(ConfigError, match="data.synthetic_task must be arithmetic, multiplication or chain"):
        load_config(None, [f"experiment.root={tmp_path}", "data.synthetic_task=division"])


def test_rows_for_no_reward_need_a_prompt_only_and_keep_an_answer(tmp_path):
    """reward.kind none (distillation alone): nothing is scored, so a row needs its prompt only; an answer it
    has is kept, for `areal-hpc eval RUN_DIR reward.kind=math`."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    assert [(e.prompt, e.target) for e in load_dataset(path, "none")] == [("1+1=", "2"), ("2+2=", "")]
    with pytest.raises(ConfigError, match="field 'prompt' must be a non-empty string"):
        path.write_text(json.dumps({"answer": 2}) + "\n")
        load_dataset(path, "none")
