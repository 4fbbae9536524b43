"""The workflows that ship with areal-hpc (`rollout.workflow: areal_hpc.workflow.builtin:Name`).

    SingleTurn           the default: one answer to the formatted prompt (token level)
    CalculatorAgent      the tiny agent task (configs/tiny-agent-cpu.yaml): the calculator in the tiny
                         model's compact syntax (`rollout.tool_format: tiny`)
    CodeInterpreterMath  a Qwen2.5 / Qwen3 model with a Python interpreter on math problems
                         (`rollout.tool_format: hermes`, `data.chat_template: true`)

All three return None: `reward.kind` scores the final assistant turn.
"""

from __future__ import annotations

from areal_hpc.workflow import Workflow, tools


class SingleTurn(Workflow):
    """One turn after the prompt as the data set formats it (`data.PromptFormat`): the trained sequence is
    the prompt and the sampled answer, which `reward.kind` scores."""

    async def arun_episode(self, client, row: dict) -> None:
        await client.generate(row["prompt_ids"])


async def _tool_loop(client, messages: list, tool_schemas: list[dict]) -> None:
    """Chat until an answer without a tool call: each call is run and its output appended as a tool
    message. The client's limits end the loop (`rollout.max_turns`, `rollout.max_episode_tokens`): past
    them it answers an empty turn without calls."""
    while True:
        response = await client.chat.completions.create(messages=messages, tools=tool_schemas)
        message = response.choices[0].message
        if not message.tool_calls:
            return
        messages.append(message)
        for call in message.tool_calls:
            output = await client.run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})


class CalculatorAgent(Workflow):
    """The tiny agent task: the problem (`a*b=`) as the user's message, the calculator as the one tool.
    An episode that calls it is, in tokens (areal_hpc.data.tiny's template; data/initial_model.py's warm start is the same):

        37*48=  <calc>37*48<eos>  <result>1776\\n  \\boxed{1776}<eos>
        prompt  sampled            tool (context)  sampled
    """

    async def arun_episode(self, client, row: dict) -> None:
        await _tool_loop(client, [{"role": "user", "content": row["prompt"]}], [tools.CALCULATOR_SCHEMA])


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
        await _tool_loop(client, messages, [tools.TOOLS["python"]])
