"""The episode client as a workflow sees it, driven by a scripted engine (`sample` returns turns whose ids
come from the tokenizer, with made-up logprobs and versions) and a scripted tool: OpenAI-style answers,
the trained arrays, the limits, the counters, and the builtin workflows' tokens.

The tokenizer is the tiny character-level one, with ChatML's two special tokens for the chat tests (so a
text's tokens are its characters) or its own template for the tiny agent task."""

import asyncio
import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.config.schema import RolloutConfig
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.protocol import EPISODE_STATS
from areal_hpc.workflow import tools
from areal_hpc.workflow.builtin import CalculatorAgent, SingleTurn
from areal_hpc.workflow.client import EpisodeClient, Turn
from areal_hpc.workflow.tools import CALCULATOR_SCHEMA, calculator


def chatml_tokenizer():
    root = importlib.util.find_spec("vllm").submodule_search_locations[0]  # read as a file: importing vLLM is slow
    tok = build_tokenizer()
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = (Path(root) / "transformers_utils" / "chat_templates" / "template_chatml.jinja").read_text()
    return tok


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class Engine:
    """A scripted `sample`: each call answers the next text (+ the EOS unless it is cut), at `version`;
    it records what it was asked."""

    def __init__(self, tok, texts, version=5, cut=()):
        self.tok, self.texts, self.version, self.cut = tok, list(texts), version, set(cut)
        self.calls = []  # (context ids, max_tokens)
        self.turns = []

    async def __call__(self, token_ids, max_tokens):
        self.calls.append((list(token_ids), max_tokens))
        await asyncio.sleep(0)  # the turn is in flight, as on the engine: other tasks run meanwhile
        k = len(self.turns)
        cut = k in self.cut
        ids = encode(self.tok, self.texts[k]) + ([] if cut else [self.tok.eos_token_id])
        turn = Turn(
            ids, [-0.5 - 0.01 * i for i in range(len(ids))], [self.version + k] * len(ids), "length" if cut else "stop"
        )
        self.turns.append(turn)
        return turn


class Tools:
    """A scripted `tool`: the calculator, in `seconds` each; its failures as the pool reports them."""

    def __init__(self, seconds=0.25):
        self.seconds, self.calls = seconds, []

    async def __call__(self, name, arguments):
        self.calls.append((name, arguments))
        try:
            return calculator(**arguments), True, self.seconds
        except tools.ToolError as e:
            return f"error: {e}", False, self.seconds


def client_for(tok, engine, tool=None, max_model_len=512, **rollout):
    cfg = RolloutConfig(**{"max_new_tokens": 16, "tool_format": "tiny", **rollout})
    return EpisodeClient(tok, cfg, max_model_len, engine, tool or Tools())


def run(coro):
    return asyncio.run(coro)


def sampled_positions(fields):
    return [i for i, m in enumerate(fields["loss_mask"]) if m]


def test_a_chat_answers_like_openai_and_trains_exactly_the_sampled_tokens():
    tok = chatml_tokenizer()
    engine, tool = Engine(tok, ["<calc>37*48", "\\boxed{1776}"]), Tools()
    client = client_for(tok, engine, tool)
    messages = [{"role": "user", "content": "37*48="}]

    async def agent():
        r1 = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        message = r1.choices[0].message
        call = message.tool_calls[0]
        out = await client.run_tool(call.function.name, call.function.arguments)
        messages.extend([message, {"role": "tool", "tool_call_id": call.id, "content": out}])
        r2 = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        return r1, out, r2

    r1, out, r2 = run(agent())
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.role == "assistant"
    assert choice.message.content is None
    assert [(c.type, c.function.name) for c in choice.message.tool_calls] == [("function", "calculator")]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "37*48"}
    assert out == "1776" and tool.calls == [("calculator", {"expression": "37*48"})]
    assert r1.token_ids == engine.turns[0].token_ids and r1.model == "m" and r1.object == "chat.completion"
    prompt = encode(tok, "<|im_start|>user\n37*48=<|im_end|>\n<|im_start|>assistant\n")
    assert r1.usage.prompt_tokens == len(prompt) and r1.usage.completion_tokens == len(r1.token_ids)
    assert r2.choices[0].message.content == "\\boxed{1776}" and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].finish_reason == "stop"

    # The engine saw the prompt, then the prompt + turn 1 + the tool message's delta: what is trained.
    s1, s2 = engine.turns[0].token_ids, engine.turns[1].token_ids
    delta = encode(tok, "\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n")
    assert [c for c, _ in engine.calls] == [prompt, prompt + s1 + delta]
    f = client.trajectory_fields()
    assert f["tokens"].tolist() == prompt + s1 + delta + s2 and f["seq_lens"].tolist() == [len(f["tokens"])]
    first, second = range(len(prompt), len(prompt) + len(s1)), range(len(f["tokens"]) - len(s2), len(f["tokens"]))
    assert sampled_positions(f) == [*first, *second]
    assert f["versions"].tolist() == [5 if i in first else 6 if i in second else -1 for i in range(len(f["tokens"]))]
    assert f["behav_logprobs"][list(second)].tolist() == pytest.approx(engine.turns[1].behav_logprobs)
    assert not f["behav_logprobs"][[i for i in range(len(f["tokens"])) if not f["loss_mask"][i]]].any()
    assert f["answer_ids"].tolist() == s2 and f["finish_reason"] == "stop"
    assert list(f["stats"]) == list(EPISODE_STATS)
    assert f["stats"] == {
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "tool_s": 0.25,
        "template_rewrites": 0,
        "resumed_tokens": 0,
    }


def test_without_tools_the_text_is_the_content_and_nothing_is_parsed():
    tok = chatml_tokenizer()
    client = client_for(tok, Engine(tok, ["<calc>1+1"]))
    r = run(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}]))
    assert r.choices[0].message.content == "<calc>1+1" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_max_turns_answers_an_empty_length_turn_without_the_engine():
    tok = chatml_tokenizer()
    engine = Engine(tok, ["one", "two"])
    client = client_for(tok, engine, max_turns=1)

    async def agent():
        messages = [{"role": "user", "content": "go"}]
        r1 = await client.chat.completions.create(messages=messages)
        messages += [r1.choices[0].message, {"role": "user", "content": "again"}]
        return r1, await client.chat.completions.create(messages=messages)

    r1, r2 = run(agent())
    assert len(engine.calls) == 1
    assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.content == "" and r2.token_ids == []
    f = client.trajectory_fields()
    assert f["finish_reason"] == "length" and f["stats"]["turns"] == 1
    assert f["answer_ids"].tolist() == r1.token_ids
    assert f["tokens"][-len(r1.token_ids) :].tolist() == r1.token_ids, "nothing after the last sampled turn is kept"
    assert run(client.generate([1, 2, 3])) == Turn([], [], [], "length") and len(engine.calls) == 1


def test_max_episode_tokens_caps_a_turn_then_refuses_the_next():
    tok = chatml_tokenizer()
    engine = Engine(tok, ["abc", "de"])  # the second turn (2 + EOS) takes the last 3 tokens
    prompt = encode(tok, "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")
    user = encode(tok, "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    limit = len(prompt) + 4 + len(user) + 3  # the first turn (3 + EOS), the user message, 3 more tokens
    client = client_for(tok, engine, max_episode_tokens=limit)

    async def agent():
        messages = [{"role": "user", "content": "go"}]
        r1 = await client.chat.completions.create(messages=messages)
        messages += [r1.choices[0].message, {"role": "user", "content": "x"}]
        r2 = await client.chat.completions.create(messages=messages)
        messages += [r2.choices[0].message, {"role": "user", "content": "y"}]
        return await client.chat.completions.create(messages=messages)

    r3 = run(agent())
    assert [m for _, m in engine.calls] == [16, 3], "the second turn gets what is left of the episode's tokens"
    assert len(engine.calls[1][0]) == limit - 3
    assert r3.choices[0].finish_reason == "length" and r3.token_ids == [] and len(engine.calls) == 2
    f = client.trajectory_fields()
    assert f["finish_reason"] == "length" and f["answer_ids"].tolist() == engine.turns[1].token_ids
    assert engine.turns[1].finish_reason == "stop"
    assert len(f["tokens"]) == limit, "the refused call's context is not trained"


def test_the_model_context_bounds_each_turn():
    tok = build_tokenizer()
    engine = Engine(tok, ["\\boxed{4}"], cut={0})
    client = client_for(tok, engine, max_model_len=10, max_episode_tokens=100)
    turn = run(client.generate(encode(tok, "2+2=")))
    assert engine.calls == [(encode(tok, "2+2="), 6)] and turn.finish_reason == "length"
    assert run(client.generate(encode(tok, "1234567890"))) == Turn([], [], [], "length")
    assert len(engine.calls) == 1
    assert client.trajectory_fields()["finish_reason"] == "length"


def test_messages_that_do_not_extend_the_conversation_start_a_second_sequence():
    tok = chatml_tokenizer()
    engine = Engine(tok, ["long answer", "short"])
    client = client_for(tok, engine)

    async def agent():
        await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
        summary = [{"role": "user", "content": "q (summarised)"}]  # the agent rewrote its history
        return await client.chat.completions.create(messages=summary)

    r2 = run(agent())
    f = client.trajectory_fields()
    first = encode(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n") + engine.turns[0].token_ids
    second = encode(tok, "<|im_start|>user\nq (summarised)<|im_end|>\n<|im_start|>assistant\n") + r2.token_ids
    assert f["seq_lens"].tolist() == [len(first), len(second)]
    assert f["tokens"].tolist() == first + second and engine.calls[1][0] == second[: -len(r2.token_ids)]
    assert f["answer_ids"].tolist() == r2.token_ids


def test_an_agent_whose_template_drops_earlier_think_blocks_trains_what_was_sampled():
    """Item 3 through the client: the next call's template render lacks the earlier <think> block, the
    trained sequence (and what the engine was given) keeps it."""
    from tests.test_workflow_conversation import THINK_DROPPING

    tok = chatml_tokenizer()
    tok.chat_template = THINK_DROPPING
    engine = Engine(tok, ["<think>plan</think>4", "yes"])
    client = client_for(tok, engine)

    async def agent():
        messages = [{"role": "user", "content": "2+2?"}]
        r1 = await client.chat.completions.create(messages=messages)
        messages += [r1.choices[0].message, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(messages=messages)
        return messages

    messages = run(agent())
    assert "plan" not in tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    f = client.trajectory_fields()
    trained = [t for t, m in zip(f["tokens"].tolist(), f["loss_mask"]) if m]
    assert trained == engine.turns[0].token_ids + engine.turns[1].token_ids
    assert "plan" in tok.decode(engine.calls[1][0]) and f["seq_lens"].tolist() == [len(f["tokens"])]
    assert f["stats"]["template_rewrites"] == 1


def test_sampling_settings_other_than_the_runs_are_refused():
    tok = chatml_tokenizer()
    engine = Engine(tok, ["ok"])
    client = client_for(tok, engine, temperature=1.0, top_p=0.9)
    create = client.chat.completions.create
    messages = [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=r"temperature=0.5 differs from rollout.temperature \(1.0\)"):
        run(create(messages=messages, temperature=0.5))
    with pytest.raises(ValueError, match=r"top_p=1.0 differs from rollout.top_p \(0.9\)"):
        run(create(messages=messages, top_p=1.0))
    with pytest.raises(ValueError, match="n=4"):
        run(create(messages=messages, n=4))
    with pytest.raises(ValueError, match="stop"):
        run(create(messages=messages, stop=["\n"]))
    with pytest.raises(ValueError, match="stream"):
        run(create(messages=messages, stream=True))
    for forced in ("required", {"type": "function", "function": {"name": "calculator"}}):
        with pytest.raises(ValueError, match="tool_choice=.* does not force tool calls"):
            run(create(messages=messages, tools=[CALCULATOR_SCHEMA], tool_choice=forced))
    assert engine.calls == []
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    r = run(create(messages=messages, temperature=1.0, top_p=0.9, n=1, max_tokens=4, seed=None, extra_body=kwargs))
    assert r.choices[0].message.content == "ok" and engine.calls[0][1] == 4
    assert client.conversation.template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="chat_template_kwargs.. must stay the same within an episode"):
        run(create(messages=messages))


def test_token_level_turns_build_the_sequence_and_extend_it():
    tok = build_tokenizer()
    engine = Engine(tok, ["<calc>2*3", "\\boxed{6}"])
    client = client_for(tok, engine)
    prompt = encode(tok, "2*3=")
    t1 = run(client.generate(prompt, max_tokens=40))
    tool = encode(tok, "<result>6\n")
    t2 = run(client.generate(prompt + t1.token_ids + tool))
    assert [m for _, m in engine.calls] == [16, 16], "max_tokens is capped by rollout.max_new_tokens"
    f = client.trajectory_fields()
    assert f["tokens"].tolist() == prompt + t1.token_ids + tool + t2.token_ids and f["seq_lens"].tolist() == [16]
    assert f["loss_mask"].tolist() == [0] * 4 + [1] * 5 + [0] * 3 + [1] * 4
    assert f["versions"].tolist() == [-1] * 4 + [5] * 5 + [-1] * 3 + [6] * 4
    assert f["answer_ids"].tolist() == t2.token_ids and f["stats"]["turns"] == 2


def test_one_call_to_the_policy_at_a_time_per_episode():
    """Two calls in flight on one client would record both turns into one sequence: the second raises,
    the first completes as if alone."""
    tok = chatml_tokenizer()
    messages = [{"role": "user", "content": "q"}]
    for second in ("generate", "chat"):
        engine = Engine(tok, ["ab", "cd"])
        client = client_for(tok, engine)

        async def both(client, second):
            first = asyncio.ensure_future(client.chat.completions.create(messages=messages))
            await asyncio.sleep(0)  # the first call is now awaiting its turn
            if second == "generate":
                await client.generate(encode(tok, "q"))
            else:
                await client.chat.completions.create(messages=messages)
            return await first

        with pytest.raises(RuntimeError, match="one call to the policy at a time per episode"):
            run(both(client, second))
        assert len(engine.calls) == 1
        f = client.trajectory_fields()
        assert f["tokens"].tolist()[-3:] == engine.turns[0].token_ids and f["stats"]["turns"] == 1

    engine = Engine(tok, ["ab", "cd"])
    client = client_for(tok, engine)

    async def gathered():
        return await asyncio.gather(client.generate([1, 2]), client.generate([1, 2]), return_exceptions=True)

    first, second = run(gathered())
    assert isinstance(first, Turn) and isinstance(second, RuntimeError)
    run(client.generate([1, 2]))  # after the first came back, the next call is free
    assert client.trajectory_fields()["seq_lens"].tolist() == [5, 5], "each call its own sequence, none mixed"


def test_tool_calls_are_counted_and_failures_reach_the_model_as_errors():
    tok = build_tokenizer()
    tool = Tools(seconds=0.5)
    client = client_for(tok, Engine(tok, []), tool)
    assert run(client.run_tool("calculator", '{"expression": "1/0"}')) == "error: division by zero"
    assert run(client.run_tool("calculator", {"expression": "3**60"})) == str(3**60), "the pool's text as it is"
    assert run(client.run_tool("calculator", '{"expression": ')).startswith("error: the arguments of calculator")
    assert len(tool.calls) == 2, "arguments that are not a JSON object never reach the tool"
    stats = client.trajectory_fields()["stats"]
    assert (stats["tool_calls"], stats["tool_errors"], stats["tool_s"]) == (3, 2, 1.0)


def test_single_turn_is_the_prompt_and_its_answer():
    tok = build_tokenizer()
    engine = Engine(tok, ["\\boxed{5}"])
    client = client_for(tok, engine)
    prompt = encode(tok, "2+3=")
    assert run(SingleTurn().arun_episode(client, {"prompt": "2+3=", "prompt_ids": prompt})) is None
    answer = engine.turns[0].token_ids
    f = client.trajectory_fields()
    assert engine.calls == [(prompt, 16)]
    assert f["tokens"].tolist() == prompt + answer and f["seq_lens"].tolist() == [len(prompt) + len(answer)]
    assert f["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)
    assert f["answer_ids"].tolist() == answer and f["finish_reason"] == "stop"


def test_the_calculator_agent_writes_the_warm_starts_tokens(tmp_path):
    """An episode of the tiny agent task that calls the calculator is, token for token and mask for
    mask, the warm start's tool example for the same problem (areal_hpc.data.initial_model)."""
    from areal_hpc.data.initial_model import sft_examples

    tok = build_tokenizer()
    cfg = load_config(
        None,
        [
            f"experiment.root={tmp_path}",
            "data.synthetic_task=multiplication",
            "sft.examples=2",
            "sft.tool_share=1.0",
        ],
    )
    for ids, mask in sft_examples(cfg, tok):
        prompt = tok.decode(ids[: mask.index(1)])
        a, b = map(int, prompt[:-1].split("*"))
        engine, tool = Engine(tok, [f"<calc>{a}*{b}", f"\\boxed{{{a * b}}}"]), Tools()
        client = client_for(tok, engine, tool, max_turns=3, max_episode_tokens=64)
        row = {"prompt": prompt, "prompt_ids": ids[: mask.index(1)], "target": str(a * b), "kind": "math"}
        assert run(CalculatorAgent().arun_episode(client, row)) is None
        f = client.trajectory_fields()
        assert f["tokens"].tolist() == ids and f["loss_mask"].tolist() == mask
        assert tool.calls == [("calculator", {"expression": f"{a}*{b}"})]
        assert f["stats"]["turns"] == 2 and f["finish_reason"] == "stop"


def test_the_calculator_agent_stops_at_max_turns():
    tok = build_tokenizer()
    engine = Engine(tok, ["<calc>1+1", "<calc>2+2", "<calc>3+3"])
    client = client_for(tok, engine, max_turns=2)
    run(CalculatorAgent().arun_episode(client, {"prompt": "9*9=", "prompt_ids": encode(tok, "9*9=")}))
    f = client.trajectory_fields()
    assert len(engine.calls) == 2 and f["finish_reason"] == "length"
    assert f["stats"]["tool_calls"] == 2 and tok.decode(f["answer_ids"]) == "<calc>2+2<|endoftext|>"


def readme_workflow(tmp_path: Path):
    """docs/agents.md's example workflow ("Writing a workflow"), saved and loaded as a user would: the class and
    its system prompt."""
    from areal_hpc.workflow import load_workflow

    guide = Path(__file__).resolve().parents[1] / "docs" / "agents.md"
    section = guide.read_text().split("## Writing a workflow", 1)[1]
    path = tmp_path / "math_agent.py"
    path.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    cls = load_workflow(f"{path}:MathAgent")
    return cls, inspect.getmodule(cls).SYSTEM


@pytest.mark.slow  # the hermes parser imports vLLM: ~10 s here
@pytest.mark.vllm
@pytest.mark.parametrize("agent", ["builtin", "readme"])
def test_the_code_interpreter_agent_chats_in_qwens_format(agent, tmp_path):
    """CodeInterpreterMath, and docs/agents.md's example agent (the same loop), in Qwen's format."""
    from areal_hpc.workflow.builtin import CODE_INTERPRETER_PROMPT, CodeInterpreterMath
    from tests.test_workflow_conversation import QWEN25_STYLE

    workflow, system = (
        (CodeInterpreterMath, CODE_INTERPRETER_PROMPT) if agent == "builtin" else readme_workflow(tmp_path)
    )

    tok = chatml_tokenizer()
    tok.chat_template = QWEN25_STYLE
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(37*48)"}}\n</tool_call>'
    engine = Engine(tok, [call, "It is \\boxed{1776}."])
    seen = []

    async def python(name, arguments):  # the sandbox is tested apart: here only what the agent sends and reads
        seen.append((name, arguments))
        return "1776\n", True, 0.1

    client = EpisodeClient(tok, RolloutConfig(max_new_tokens=64, tool_format="hermes"), 4096, engine, python)
    run(workflow().arun_episode(client, {"prompt": "What is 37*48?", "prompt_ids": []}))
    assert seen == [("python", {"code": "print(37*48)"})]
    schema = [tools.TOOLS["python"]]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is 37*48?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "python", "arguments": {"code": "print(37*48)"}}}],
        },
        {"role": "tool", "content": "1776\n"},
    ]
    first = tok.apply_chat_template(messages[:2], tools=schema, tokenize=False, add_generation_prompt=True)
    second = tok.apply_chat_template(messages, tools=schema, tokenize=False, add_generation_prompt=True)
    assert [c for c, _ in engine.calls] == [encode(tok, first), encode(tok, second)]
    f = client.trajectory_fields()
    assert f["tokens"].tolist() == encode(tok, second) + engine.turns[1].token_ids
    assert tok.decode(f["answer_ids"]) == "It is \\boxed{1776}.<|im_end|>" and f["finish_reason"] == "stop"
    assert f["stats"]["turns"] == 2 and f["stats"]["tool_calls"] == 1 and f["stats"]["template_rewrites"] == 0
