"""The workflows that ship with areal-hpc (`rollout.workflow: areal_hpc.workflow.builtin:Name`).

    SingleTurn           the default: one answer to the formatted prompt (token level)
    CalculatorAgent      the tiny agent task (configs/tiny-agent-cpu.yaml): the calculator in the tiny
                         model's compact syntax (`rollout.tool_format: tiny`)
    CalculatorAgentHTTP  the same loop as agent code that takes a base URL: `openai.AsyncOpenAI` on the
                         episode's endpoint (`rollout.openai_endpoint`)
    CodeInterpreterMath  a Qwen2.5 / Qwen3 model with a Python interpreter on math problems
                         (`rollout.tool_format: hermes`, `data.chat_template: true`)

All four return None: `reward.kind` scores the final assistant turn.
"""

from __future__ import annotations

import asyncio

from areal_hpc.workflow import Workflow, tools


class SingleTurn(Workflow):
    """One turn after the prompt as the data set formats it (`data.PromptFormat`): the trained sequence is
    the prompt and the sampled answer, which `reward.kind` scores."""

    async def arun_episode(self, client, row: dict) -> None:
        await client.generate(row["prompt_ids"])


async def _tool_loop(chat, run_tool, messages: list, tool_schemas: list[dict], **call) -> None:
    """Chat until an answer without a tool call: each call is run (`run_tool(name, arguments)`) and its output
    appended as a tool message. `chat`: the episode's client, or an `openai` client on its endpoint (`call`:
    what that one needs, its `model`). The episode's limits end the loop (`rollout.max_turns`,
    `rollout.max_episode_tokens`): past them it answers an empty turn without calls."""
    while True:
        response = await chat.chat.completions.create(messages=messages, tools=tool_schemas, **call)
        message = response.choices[0].message
        if not message.tool_calls:
            return
        messages.append(message)
        for tool_call in message.tool_calls:
            output = await run_tool(tool_call.function.name, tool_call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": output})


class CalculatorAgent(Workflow):
    """The tiny agent task: the problem (`a*b=`) as the user's message, the calculator as the one tool.
    An episode that calls it is, in tokens (areal_hpc.data.tiny's template; data/initial_model.py's warm start is the same):

        37*48=  <calc>37*48<eos>  <result>1776\\n  \\boxed{1776}<eos>
        prompt  sampled            tool (context)  sampled
    """

    async def arun_episode(self, client, row: dict) -> None:
        messages = [{"role": "user", "content": row["prompt"]}]
        await _tool_loop(client, client.run_tool, messages, [tools.CALCULATOR_SCHEMA])


class CalculatorAgentHTTP(Workflow):
    """CalculatorAgent's loop through `openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)`:
    what an agent that takes a base URL does (docs/agents.md, "Agents over HTTP"). The same episode, turn for
    turn and token for token; the calculator still runs in the tool pool (`client.run_tool`).

    One `AsyncOpenAI` per event loop, each episode's a copy with its URL and key: building one costs about
    25 ms of CPU (its HTTP client), which the generator's thread would pay for every episode."""

    def __init__(self):
        self._api = None  # (event loop, AsyncOpenAI)

    async def arun_episode(self, client, row: dict) -> None:
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        if self._api is None or self._api[0] is not loop:
            self._api = (loop, AsyncOpenAI(api_key="unused", max_retries=0, timeout=3600))
        api = self._api[1].with_options(base_url=client.base_url, api_key=client.api_key)
        messages = [{"role": "user", "content": row["prompt"]}]
        await _tool_loop(api, client.run_tool, messages, [tools.CALCULATOR_SCHEMA], model="policy")


CODE_INTERPRETER_PROMPT = (
    "Solve the math problem step by step. You can run Python code with the `python` tool: use it for any "
    "calculation you are not sure of; the tool answers with what the code printed. Put the final answer "
    "in \\boxed{}."
)
"""CodeInterpreterMath's system message."""


class CodeInterpreterMath(Workflow):
    """A math problem for a Qwen2.5 / Qwen3 chat model with a Python interpreter (`python`, run in the
    code reward's sandbox): a system message asking for a `\\boxed{}` answer, the problem as the user's
    message, the tool calls in Qwen's `<tool_call>` JSON (`rollout.tool_format: hermes`)."""

    async def arun_episode(self, client, row: dict) -> None:
        messages = [
            {"role": "system", "content": CODE_INTERPRETER_PROMPT},
            {"role": "user", "content": row["prompt"]},
        ]
        await _tool_loop(client, client.run_tool, messages, [tools.TOOLS["python"]])
