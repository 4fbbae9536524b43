"""The embedded default's assets: built without a download, deterministic, cached atomically."""

import json

import pytest

from areal_hpc.arch import hf_arch, model_arch
from areal_hpc.config import ConfigError, ModelConfig
from areal_hpc.data.synthetic import synthetic_rows
from areal_hpc.data.tiny import build_synthetic_data, build_tiny_model, build_tokenizer
from tests.support.shapes import TINY_MOE


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


def test_tiny_moe_is_a_qwen3_moe_checkpoint_whose_counts_the_architecture_knows(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    m = TINY_MOE
    arch = model_arch(m)
    path = build_tiny_model(m, tmp_path, seed=3)
    assert hf_arch(path) == arch  # config.json reads back as the architecture it was built from
    weights = load_file(path / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights  # per-expert names, as vLLM loads them
    assert weights["model.layers.0.mlp.gate.weight"].shape == (arch.num_experts, arch.hidden_size)
    assert sum(w.numel() for k, w in weights.items() if "norm" not in k) == arch.params
    assert arch.expert_params < arch.params and arch.active_params == arch.params - arch.expert_params // 2
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts_per_tok == 2
    config = json.loads((path / "config.json").read_text())
    with open(path / "config.json", "w") as f:
        json.dump(config | {"decoder_sparse_step": 2}, f)
    with pytest.raises(ConfigError, match="decoder_sparse_step is 2"):
        model_arch(ModelConfig(path=str(path)))


def test_arithmetic_data_is_deterministic(tmp_path):
    assert synthetic_rows(50, seed=1) == synthetic_rows(50, seed=1) != synthetic_rows(50, seed=2)
    path = build_synthetic_data(20, tmp_path, seed=1) / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == synthetic_rows(20, seed=1)
    test = [json.loads(line) for line in (path.parent / "test.jsonl").read_text().splitlines()]
    assert len(test) == 500 and not {r["prompt"] for r in rows} & {r["prompt"] for r in test}
    for row in rows:
        a, op, b = row["prompt"][:-1].partition("+") if "+" in row["prompt"] else row["prompt"][:-1].partition("-")
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_tool_tokens_come_after_every_old_id():
    from areal_hpc.data.tiny import BOXED, CALC, CHARS, EOS, PAD, RESULT, TINY_VOCAB

    tok = build_tokenizer()
    assert TINY_VOCAB[: 3 + len(CHARS)] == [PAD, EOS, BOXED, *CHARS], "an existing id moved"
    assert tok.convert_tokens_to_ids([CALC, RESULT]) == [len(TINY_VOCAB) - 2, len(TINY_VOCAB) - 1]
    ids = tok("<calc>37*48<|endoftext|><result>1776\n")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:2] == [CALC, "3"] and ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "<calc>37*48<result>1776\n", "the tool tokens are text"


def test_chat_template_writes_the_tool_syntax_and_only_appends():
    import pytest
    from jinja2 import TemplateError

    tok = build_tokenizer()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}
    messages = [
        {"role": "user", "content": "37*48="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1776"},
        {"role": "assistant", "content": "\\boxed{1776}"},
    ]
    renders = [tok.apply_chat_template(messages[:k], tokenize=False) for k in range(1, 5)]
    assert renders[-1] == "37*48=<calc>37*48<|endoftext|><result>1776\n\\boxed{1776}<|endoftext|>"
    assert all(b.startswith(a) for a, b in zip(renders, renders[1:])), "a render rewrote an earlier turn"
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == "37*48="
    call["function"]["arguments"] = '{"expression": "37*48"}'  # OpenAI's JSON string: parse it first
    with pytest.raises(TemplateError, match="arguments as a dict"):
        tok.apply_chat_template(messages, tokenize=False)


def test_multiplication_task_holds_out_numbers_of_its_own():
    import pytest

    from areal_hpc.config import ConfigError
    from areal_hpc.data.synthetic import synthetic_problems, synthetic_test_rows

    train, test = synthetic_problems("multiplication", 99)
    assert len(train) + len(test) == 90 * 90 and len(test) == 500 and not set(train) & set(test)
    assert {a for a, _, _ in train + test} == set(range(10, 100)) and {op for _, op, _ in train} == {"*"}
    assert synthetic_problems("multiplication", 99) == (train, test), "the split is fixed"
    rows = synthetic_rows(200, seed=1, task="multiplication")
    assert all(int(r["answer"]) == eval(r["prompt"][:-1]) for r in rows + synthetic_test_rows("multiplication"))
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in synthetic_test_rows("multiplication")}
    assert synthetic_problems("multiplication", 150)[0][0][0] >= 100, "three-digit operands for 150"
    with pytest.raises(ConfigError, match="data.synthetic_task must be one of arithmetic, multiplication"):
        synthetic_problems("division", 99)


def test_chain_task_is_deterministic_correct_and_long_tailed():
    """The chain task: rows the same for a seed; each answer is a mod b and its worked steps the countdown
    to it; no row is a test problem; the answers' lengths in tokens (steps, `\\boxed{`, the answer, `}`,
    EOS) follow the documented shape: median about 190, one in 10 past about 680, a few % past 1,024."""
    from statistics import median

    from areal_hpc.data.synthetic import synthetic_problems, synthetic_test_rows, worked_steps

    rows = synthetic_rows(4000, seed=1, task="chain", max_operand=999)
    assert rows == synthetic_rows(4000, seed=1, task="chain", max_operand=999)
    assert rows != synthetic_rows(4000, seed=2, task="chain", max_operand=999)
    train, test = synthetic_problems("chain", 999)
    assert len(test) == 500 and not set(train) & set(test) and synthetic_problems("chain", 999) == (train, test)
    test_rows = synthetic_test_rows("chain", 999)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in test_rows}
    assert worked_steps("chain", "23%7=") == "16,9,2," and worked_steps("chain", "5%7=") == ""
    assert worked_steps("arithmetic", "2+3=") == ""
    for row in rows + test_rows:
        a, b = map(int, row["prompt"].removesuffix("=").split("%"))
        steps = [int(n) for n in worked_steps("chain", row["prompt"]).split(",")[:-1]]
        assert 2 <= b <= 9 and b <= a <= 999 and int(row["answer"]) == a % b == steps[-1]
        assert steps == [a - i * b for i in range(1, a // b + 1)]
    for sample in (rows, test_rows):
        lengths = sorted(len(worked_steps("chain", r["prompt"])) + len(r["answer"]) + 3 for r in sample)
        p90, past_cap = lengths[len(lengths) * 9 // 10], sum(n > 1024 for n in lengths) / len(lengths)
        assert 160 < median(lengths) < 220 and 580 < p90 < 800 and 0.02 < past_cap < 0.06, (p90, past_cap)
    with pytest.raises(ConfigError, match="synthetic_max_operand must be at least 9 for the chain task"):
        synthetic_problems("chain", 5)


def test_chain_warm_start_writes_the_steps_and_stops_at_the_answer_limit(tmp_path):
    """A chain warm-start example is the prompt, then the countdown and the boxed remainder; one longer
    than rollout.max_new_tokens is cut there (no EOS), as a rollout is."""
    from areal_hpc.config import load_config
    from areal_hpc.data.initial_model import sft_examples
    from areal_hpc.data.synthetic import worked_steps

    tok = build_tokenizer()
    cfg = load_config(
        "configs/tiny-reasoning-cpu.yaml",
        [f"experiment.root={tmp_path}", "sft.examples=200", "rollout.max_new_tokens=300"],
    )
    examples = sft_examples(cfg, tok)
    assert len(examples) == 200
    cut = 0
    for ids, mask in examples:
        start = mask.index(1)
        prompt, response = tok.decode(ids[:start]), ids[start:]
        a, b = map(int, prompt.removesuffix("=").split("%"))
        full = tok(f"{worked_steps('chain', prompt)}\\boxed{{{a % b}}}")["input_ids"] + [tok.eos_token_id]
        assert response == full[:300] and set(mask[start:]) == {1}
        cut += len(full) > 300
    assert 0 < cut < 100


def test_warm_start_batches_hold_every_example_once_with_similar_lengths():
    """`sft._batches`: an epoch is every example once, in batches of the size (the last run's last one
    shorter), each sorted run padded to far less than random batches are; without `by_length` the
    shuffled examples cut in order (what the embedded default's warm start was tuned on)."""
    import random

    from areal_hpc.data.initial_model import _batches
    from areal_hpc.data.synthetic import worked_steps

    rows = synthetic_rows(1000, seed=3, task="chain", max_operand=999)
    lengths = [min(1030, 9 + len(worked_steps("chain", r["prompt"]))) for r in rows]
    examples = [([0] * n, i) for i, n in enumerate(lengths)]  # (ids, a tag in the place of the mask)

    def padded(batches):
        return sum(len(b) * max(len(x) for x, _ in b) for b in batches)

    batches = _batches(list(examples), 16, random.Random(0), by_length=True)
    assert sorted(e[1] for b in batches for e in b) == list(range(1000))
    assert all(len(b) == 16 for b in batches if len(b) != 1000 % 16) and len(batches) == -(-1000 // 16)
    assert padded(batches) < 1.5 * sum(len(x) for x, _ in examples)
    shuffled = list(examples)
    random.Random(0).shuffle(shuffled)
    plain = _batches(list(examples), 16, random.Random(0), by_length=False)
    assert plain == [shuffled[i : i + 16] for i in range(0, 1000, 16)] and padded(plain) > 2 * padded(batches)
