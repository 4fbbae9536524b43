"""Token-in-token-out: the trained tokens are the prompt, the sampled ids as sampled, and each message's
template delta, whatever the chat template does to earlier turns.

The tokenizer is the tiny character-level one with ChatML's two special tokens added, so a text's
tokens are exactly its characters and `encode(render(...))` can be compared with the sequence."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.workflow.conversation import Conversation, EpisodeTokens

# Qwen2.5's published template in short: the tools header in the first system turn, calls as
# <tool_call> JSON, consecutive tool results merged into one user turn, "\n" after every <|im_end|>.
QWEN25_STYLE = """
{%- if tools -%}
{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'You are helpful.') -}}
{{- '\\n# Tools\\n<tools>' -}}{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{{- '\\n</tools><|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}{%- if m.content -%}{{- '\\n' + m.content -}}{%- endif -%}
{%- for c in m.tool_calls -%}
{{- '\\n<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# A template that rewrites history, as Qwen3's does: assistant turns before the last user turn lose
# their <think> block.
THINK_DROPPING = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- set content = m.content -%}
{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# The tiny agent task's template (areal_hpc/data/tiny.py's TINY_CHAT_TEMPLATE on branch i28-tiny, copied until
# it is merged): no headers, a call is <calc>expr before the EOS, a tool result is <result>text\n.
TINY = """
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- m.content or '' -}}
{%- for c in m.tool_calls or [] -%}
{%- set args = c.function.arguments if c.function is defined else c.arguments -%}
{%- if args is not mapping -%}{{ raise_exception('tool call arguments must be a dict') }}{%- endif -%}
<calc>{{- args.expression -}}
{%- endfor -%}
{{- eos_token -}}
{%- elif m.role == 'tool' -%}
<result>{{- m.content -}}{{ '\\n' }}
{%- else -%}
{{- m.content -}}
{%- endif -%}
{%- endfor -%}
"""


def vllm_template(name: str) -> str:
    """A chat template vLLM ships (read as a file: importing vLLM is slow)."""
    root = importlib.util.find_spec("vllm").submodule_search_locations[0]
    return (Path(root) / "transformers_utils" / "chat_templates" / name).read_text()


def chatml_tokenizer(template: str):
    tok = build_tokenizer()
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = template
    return tok


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def sample(conv: Conversation, text: str, *, version=7, closed=True, tool_calls=None, content=None):
    """Feed the conversation a scripted sampled turn: `text` (+ the turn end), as the engine would give it,
    and its message (with tool calls, `content` is the text before them, as the parsers return it)."""
    tok = conv.tokenizer
    ids = encode(tok, text) + ([conv.turn_end_id] if closed else [])
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    message = (
        {"role": "assistant", "content": content, "tool_calls": tool_calls}
        if tool_calls
        else {"role": "assistant", "content": text}
    )
    conv.add_turn(ids, logprobs, [version] * len(ids), message)
    return ids, logprobs


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def calc_call(expression: str, name="calculator"):
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": f'{{"expression": "{expression}"}}'},
    }


def test_a_tool_result_is_the_template_delta_with_its_glue():
    tok = chatml_tokenizer(QWEN25_STYLE)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    conv = Conversation(tok, EpisodeTokens())
    messages = [{"role": "user", "content": "37*48?"}]
    prompt = conv.prompt_ids(messages, tools)
    assert prompt == encode(tok, render(tok, messages, tools=tools))
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'
    sampled, _ = sample(conv, call_text, tool_calls=[calc_call("37*48")])
    messages = [*conv.messages, {"role": "tool", "tool_call_id": "call_1", "content": "1776"}]
    ids = conv.prompt_ids(messages, tools)
    # The sampled turn renders as it was sampled here, so the whole sequence is the template's render.
    assert ids == encode(tok, render(tok, messages, tools=tools))
    delta = tok.decode(ids[len(prompt) + len(sampled) :])
    assert delta == "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert conv.rewrites == 0 and len(conv.episode.sequences) == 1


def test_the_arrays_mark_exactly_the_sampled_tokens():
    tok = chatml_tokenizer(QWEN25_STYLE)
    episode = EpisodeTokens()
    conv = Conversation(tok, episode)
    prompt = conv.prompt_ids([{"role": "user", "content": "hi"}])
    first, lp1 = sample(conv, "hello", version=3)
    ids = conv.prompt_ids([*conv.messages, {"role": "user", "content": "more"}])
    second, lp2 = sample(conv, "bye", version=4)
    a = episode.arrays()
    n = len(ids) + len(second)
    assert [len(a[k]) for k in ("tokens", "loss_mask", "behav_logprobs", "versions")] == [n] * 4
    assert a["seq_lens"].tolist() == [n]
    assert a["tokens"].tolist() == ids + second
    at = (len(prompt), len(prompt) + len(first))
    sampled = [i for i in range(n) if at[0] <= i < at[1] or i >= len(ids)]
    assert [i for i in range(n) if a["loss_mask"][i]] == sampled
    assert a["versions"].tolist() == [(3 if i < at[1] else 4) if i in sampled else -1 for i in range(n)]
    assert a["behav_logprobs"][at[0] : at[1]].tolist() == pytest.approx(lp1)
    assert a["behav_logprobs"][len(ids) :].tolist() == pytest.approx(lp2)
    assert not a["behav_logprobs"][: at[0]].any() and not a["behav_logprobs"][at[1] : len(ids)].any()
    assert a["answer_ids"].tolist() == second


def test_a_template_that_drops_earlier_think_blocks_still_trains_the_sampled_ids():
    tok = chatml_tokenizer(THINK_DROPPING)
    conv = Conversation(tok, EpisodeTokens())
    prompt = conv.prompt_ids([{"role": "user", "content": "2+2?"}])
    sampled, _ = sample(conv, "<think>plan</think>answer 4")
    messages = [*conv.messages, {"role": "user", "content": "sure?"}]
    ids = conv.prompt_ids(messages)
    rerendered = render(tok, messages)
    assert "plan" not in rerendered  # the template rewrote the earlier turn ...
    assert ids[: len(prompt) + len(sampled)] == prompt + sampled  # ... the sequence keeps what was sampled
    assert "plan" in tok.decode(ids)
    assert (
        tok.decode(ids[len(prompt) + len(sampled) :]) == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conv.rewrites == 1 and len(conv.episode.sequences) == 1


def test_qwen3_structure_merges_tool_results_and_rewrites_on_a_user_turn():
    """vLLM's MiniCPM-V 4.5 template has Qwen3's structure: the tools header, merged tool results, and
    reasoning kept only after the last user query."""
    tok = chatml_tokenizer(vllm_template("template_minicpmv45.jinja"))
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    conv = Conversation(tok, EpisodeTokens(), template_kwargs={"enable_thinking": True})
    prompt = conv.prompt_ids([{"role": "user", "content": "Compute."}], tools)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    calls = [calc_call("1+1", "python"), {**calc_call("2+2", "python"), "id": "call_2"}]
    text = 'steps\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"expression": "1+1"}}\n</tool_call>'
    turn1, _ = sample(conv, text, tool_calls=calls, content="steps\n</think>\n\n")
    results = [{"role": "tool", "tool_call_id": "call_1", "content": "2"}, {"role": "tool", "content": "4"}]
    ids = conv.prompt_ids([*conv.messages, *results], tools)
    delta = tok.decode(ids[len(prompt) + len(turn1) :])
    assert conv.rewrites == 0  # tool results leave the history as it is
    assert delta == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    turn2, _ = sample(conv, "more\n</think>\n\nIt is 2 and 4.")
    before = len(ids) + len(turn2)
    messages = [*conv.messages, {"role": "user", "content": "Why?"}]
    ids = conv.prompt_ids(messages, tools)
    assert "steps" not in render(tok, messages, tools=tools, enable_thinking=True)
    assert ids[:before] == prompt + turn1 + encode(tok, delta) + turn2
    assert tok.decode(ids[before:]) == "\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert conv.rewrites == 1 and len(conv.episode.sequences) == 1


def test_a_template_that_closes_a_turn_only_before_the_next_is_not_closed_twice():
    """vLLM's ChatML template writes <|im_end|> after the last message only with a generation prompt."""
    tok = chatml_tokenizer(vllm_template("template_chatml.jinja"))
    conv = Conversation(tok, EpisodeTokens())
    prompt = conv.prompt_ids([{"role": "user", "content": "hi"}])
    sampled, _ = sample(conv, "hello")
    ids = conv.prompt_ids([*conv.messages, {"role": "user", "content": "again"}])
    assert (
        tok.decode(ids[len(prompt) + len(sampled) :]) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert conv.rewrites == 0


def test_a_turn_cut_by_length_is_closed_with_context():
    tok = chatml_tokenizer(QWEN25_STYLE)
    conv = Conversation(tok, EpisodeTokens())
    prompt = conv.prompt_ids([{"role": "user", "content": "hi"}])
    sampled, _ = sample(conv, "hel", closed=False)
    ids = conv.prompt_ids([*conv.messages, {"role": "user", "content": "go on"}])
    tail = ids[len(prompt) + len(sampled) :]
    assert tail[0] == tok.eos_token_id  # the turn end the template expects, as context
    assert tok.decode(tail) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert conv.episode.current.loss_mask[-len(tail) :] == [0] * len(tail)


def test_messages_that_do_not_extend_the_conversation_start_a_second_sequence():
    tok = chatml_tokenizer(QWEN25_STYLE)
    episode = EpisodeTokens()
    conv = Conversation(tok, episode)
    conv.prompt_ids([{"role": "user", "content": "long task"}])
    first, _ = sample(conv, "step one")
    summary = [{"role": "user", "content": "summary: step one done. next?"}]
    ids = conv.prompt_ids(summary)
    assert ids == encode(tok, render(tok, summary)) and len(episode.sequences) == 2
    second, _ = sample(conv, "step two")
    a = episode.arrays()
    lens = a["seq_lens"].tolist()
    assert len(lens) == 2 and sum(lens) == len(a["tokens"])
    assert a["tokens"][lens[0] - len(first) : lens[0]].tolist() == first
    assert a["tokens"][-len(second) :].tolist() == second and a["answer_ids"].tolist() == second
    assert int(a["loss_mask"].sum()) == len(first) + len(second)


def test_an_edited_assistant_turn_or_other_tools_start_a_new_sequence():
    tok = chatml_tokenizer(QWEN25_STYLE)
    conv = Conversation(tok, EpisodeTokens())
    conv.prompt_ids([{"role": "user", "content": "q"}])
    sample(conv, "<think>x</think>a")
    edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    conv.prompt_ids(edited)
    assert len(conv.episode.sequences) == 2
    sample(conv, "b")
    tools = [{"type": "function", "function": {"name": "f"}}]
    conv.prompt_ids([*conv.messages, {"role": "user", "content": "s"}], tools)
    assert len(conv.episode.sequences) == 3


@pytest.mark.parametrize("as_object", [True, False])
def test_the_returned_message_appended_as_object_or_dict_extends_the_conversation(as_object):
    """Agent code appends `resp.choices[0].message` (an openai object, arguments a JSON string), or a
    dict of its own without the call ids."""
    from openai.types.chat import ChatCompletionMessage

    tok = chatml_tokenizer(QWEN25_STYLE)
    conv = Conversation(tok, EpisodeTokens())
    conv.prompt_ids([{"role": "user", "content": "q"}])
    message = ChatCompletionMessage(role="assistant", content=None, tool_calls=[calc_call("1+2")])
    ids = encode(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>')
    ids.append(tok.eos_token_id)
    conv.add_turn(ids, [0.0] * len(ids), [0] * len(ids), message)
    call = {"function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    reply = message if as_object else {"role": "assistant", "content": None, "tool_calls": [call]}
    conv.prompt_ids([{"role": "user", "content": "q"}, reply, {"role": "tool", "content": "3"}])
    assert len(conv.episode.sequences) == 1 and conv.rewrites == 0


def test_tiny_template_result_delta_has_no_glue():
    tok = build_tokenizer()
    tok.add_tokens(["<calc>", "<result>"])
    tok.chat_template = TINY
    conv = Conversation(tok, EpisodeTokens())
    prompt = conv.prompt_ids([{"role": "user", "content": "37*48="}])
    assert tok.decode(prompt) == "37*48="
    call, _ = sample(conv, "<calc>37*48", tool_calls=[calc_call("37*48")])
    assert tok.decode(call) == "<calc>37*48<|endoftext|>"
    ids = conv.prompt_ids([*conv.messages, {"role": "tool", "content": "1776"}])
    assert tok.decode(ids[len(prompt) + len(call) :]) == "<result>1776\n"
    assert conv.rewrites == 0


def test_token_level_turns_extend_or_start_sequences():
    episode = EpisodeTokens()
    assert episode.extend_to([1, 2, 3]) == [1, 2, 3]
    episode.add_sampled([4, 5], [-0.5, -0.25], [2, 2])
    assert episode.extend_to([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6]  # extends: 6 is context
    assert episode.extend_to([9, 9]) == [9, 9] and len(episode.sequences) == 2  # does not: a new one
    a = episode.arrays()  # trailing context is cut and a sequence with nothing sampled is left out
    assert a["seq_lens"].tolist() == [5] and a["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    assert a["versions"].tolist() == [-1, -1, -1, 2, 2]
    with pytest.raises(ValueError, match="one logprob and one version per token"):
        episode.add_sampled([1, 2], [0.0], [1, 1])


def test_an_empty_reasoning_rewritten_after_a_tool_call_takes_the_stub_delta():
    """Qwen3 without thinking: the generation prompt holds an empty <think></think>, which the template
    writes for the last assistant turn only; the next render drops it, so the stub gives the delta."""
    tok = chatml_tokenizer(vllm_template("template_minicpmv45.jinja"))
    conv = Conversation(tok, EpisodeTokens(), template_kwargs={"enable_thinking": False})
    prompt = conv.prompt_ids([{"role": "user", "content": "Compute."}])
    text = '<tool_call>\n{"name": "python", "arguments": {"expression": "1+1"}}\n</tool_call>'
    turn, _ = sample(conv, text, tool_calls=[calc_call("1+1", "python")])
    ids = conv.prompt_ids([*conv.messages, {"role": "tool", "content": "2"}])
    assert ids[: len(prompt) + len(turn)] == prompt + turn and conv.rewrites == 1
    assert tok.decode(ids[len(prompt) + len(turn) :]) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_a_turn_end_the_template_never_writes_starts_a_new_sequence():
    tok = chatml_tokenizer(QWEN25_STYLE)
    conv = Conversation(tok, EpisodeTokens(), turn_end="<|endoftext|>")
    conv.prompt_ids([{"role": "user", "content": "hi"}])
    sample(conv, "hello")
    messages = [*conv.messages, {"role": "user", "content": "again"}]
    assert conv.prompt_ids(messages) == encode(tok, render(tok, messages))
    assert len(conv.episode.sequences) == 2


def test_a_sequence_keeps_its_latest_turns_routing_cut_like_its_tokens():
    """Routing replay: each turn's routing covers its sequence so far and replaces the earlier turn's (the
    engine computed every earlier position again, or found it in its prefix cache); the arrays cut it like
    the tokens, context after the latest turn unknown; no routing at all: None."""

    def routing(n: int, fill: int) -> np.ndarray:
        r = np.full((n, 2, 2), fill, np.uint8)
        r[-1] = 255  # the turn's last token: never computed
        return r

    episode = EpisodeTokens()
    episode.extend_to([1, 2, 3])
    episode.add_sampled([4, 5], [-0.5, -0.25], [2, 2], routing(5, 1))
    episode.extend_to([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="routing covers its context and output"):
        episode.add_sampled([7], [-0.1], [3], routing(6, 2))
    episode.add_sampled([7, 8], [-0.1, -0.2], [3, 3], routing(8, 2))  # replaces the first turn's
    episode.extend_to([9])  # a second sequence: its own routing
    episode.add_sampled([10], [-0.3], [3], routing(2, 3))
    episode.add_context([11, 12])  # trailing context: cut, like the tokens
    a = episode.arrays()
    assert a["seq_lens"].tolist() == [8, 2]
    assert a["routing"].shape == (10, 2, 2)
    assert a["routing"][:, 0, 0].tolist() == [2] * 7 + [255] + [3, 255]

    plain = EpisodeTokens()
    plain.extend_to([1, 2])
    plain.add_sampled([3], [-0.5], [1])
    assert plain.arrays()["routing"] is None
