"""The embedded default's assets: built without a download, deterministic, cached atomically."""

import json

from areal_hpc.config import ModelConfig
from areal_hpc.tiny import arithmetic_rows, build_arithmetic_data, build_tiny_model, build_tokenizer


def test_tokenizer_round_trips_text_with_boxed_answers():
    tok = build_tokenizer()
    text = "12 - 7 =\n\\boxed{5}"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids).count("\\boxed{") == 1


def test_tiny_model_is_deterministic_and_cached(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = ModelConfig()
    a = build_tiny_model(m, tmp_path / "a", seed=3)
    b = build_tiny_model(m, tmp_path / "b", seed=3)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert build_tiny_model(m, tmp_path / "a", seed=3) == a  # cached: same directory, not rebuilt
    assert build_tiny_model(m, tmp_path / "a", seed=4) != a  # another seed, another model
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.model_type == "qwen2" and model.config.num_key_value_heads == 2
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.decode(tok("3+4=")["input_ids"]) == "3+4="


def test_arithmetic_data_is_deterministic(tmp_path):
    assert arithmetic_rows(50, seed=1) == arithmetic_rows(50, seed=1) != arithmetic_rows(50, seed=2)
    path = build_arithmetic_data(20, tmp_path, seed=1) / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == arithmetic_rows(20, seed=1)
    test = [json.loads(line) for line in (path.parent / "test.jsonl").read_text().splitlines()]
    assert len(test) == 500 and not {r["prompt"] for r in rows} & {r["prompt"] for r in test}
    for row in rows:
        a, op, b = row["prompt"][:-1].partition("+") if "+" in row["prompt"] else row["prompt"][:-1].partition("-")
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
