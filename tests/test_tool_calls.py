"""Tool calls parsed from a turn's text into the openai package's types, as agent code reads them."""

import json

import pytest

from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.workflow.tool_calls import parse_tool_calls


@pytest.mark.slow  # importing vLLM's parser imports vLLM: ~10 s here
@pytest.mark.vllm
def test_hermes_reads_qwen_tool_calls_with_vllms_parser():
    from openai.types.chat import ChatCompletionMessage

    text = (
        "I will compute.\n"
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(37*48)"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10"}}'  # cut by max_tokens
    )
    content, calls = parse_tool_calls("hermes", build_tokenizer(), text)
    assert content == "I will compute.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("python", {"code": "print(37*48)"}),
        ("calculator", {"expression": "2**10"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    # What agent code appends to its messages next.
    ChatCompletionMessage(role="assistant", content=content, tool_calls=calls)
    plain = "The answer is \\boxed{1776}."
    assert parse_tool_calls("hermes", build_tokenizer(), plain) == (plain, [])
    broken = '<tool_call>\n{"name": python}\n</tool_call>'
    assert parse_tool_calls("hermes", build_tokenizer(), broken) == (broken, [])


def test_tiny_reads_compact_calculator_calls():
    tok = build_tokenizer()
    content, calls = parse_tool_calls("tiny", tok, "<calc>37*48")
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "37*48"}
    content, calls = parse_tool_calls("tiny", tok, "let me see<calc> 3+4 <calc>5*6<|endoftext|>")
    assert content == "let me see"
    assert [json.loads(c.function.arguments)["expression"] for c in calls] == ["3+4", "5*6"]
    assert calls[0].id != calls[1].id
    assert parse_tool_calls("tiny", tok, "\\boxed{1776}") == ("\\boxed{1776}", [])


def test_an_unknown_format_names_the_setting():
    with pytest.raises(ValueError, match="rollout.tool_format must be one of hermes, tiny, got 'json'"):
        parse_tool_calls("json", build_tokenizer(), "x")
