"""Tool calls parsed from a sampled turn's text, returned as the `openai` package's types
(`rollout.tool_format`):

    hermes   Qwen2.5 / Qwen3 (and Hermes) models: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
             parsed by vLLM's own Hermes2ProToolParser, so a call reads as vLLM's server would read it
    tiny     the tiny agent task's compact call, a few tokens instead of ~80 for JSON: <calc>EXPR up to the
             next "<" (the turn end) or the end of the text, a call to `calculator` with
             {"expression": EXPR}; one call per <calc>

The text is the turn decoded with `skip_special_tokens=False` (<tool_call> is a special token in some
models) and without its turn-end token. Unparsable calls (invalid JSON) make no call: the whole text is
the content, as vLLM's server answers.
"""

from __future__ import annotations

import json
import re
import uuid

FORMATS = ("hermes", "tiny")

_TINY_CALL = re.compile(r"<calc>([^<]*)")


def parse_tool_calls(tool_format: str, tokenizer, text: str):
    """(content, tool_calls): the text before the first call (None when empty; the whole text when there
    is no call) and a list of `openai.types.chat.ChatCompletionMessageFunctionToolCall`."""
    from openai.types.chat import ChatCompletionMessageFunctionToolCall as ToolCall

    if tool_format == "hermes":
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        # The request is never read by extract_tool_calls (vllm/tool_parsers/hermes_tool_parser.py:70-120).
        found = Hermes2ProToolParser(tokenizer).extract_tool_calls(text, request=None)
        calls = [
            ToolCall(id=c.id, type="function", function={"name": c.function.name, "arguments": c.function.arguments})
            for c in found.tool_calls
        ]
        return found.content, calls
    if tool_format == "tiny":
        matches = list(_TINY_CALL.finditer(text))
        if not matches:
            return text, []
        calls = [
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                type="function",
                function={"name": "calculator", "arguments": json.dumps({"expression": m.group(1).strip()})},
            )
            for m in matches
        ]
        return text[: matches[0].start()] or None, calls
    raise ValueError(f"rollout.tool_format must be one of {', '.join(FORMATS)}, got {tool_format!r}")
