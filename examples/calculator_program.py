"""An agent in a process of its own, trained unchanged: the tiny agent task's calculator loop as a program
that knows nothing of areal-hpc but the `openai` package and two environment variables.

    rollout.workflow: examples/calculator_program.py:CalculatorProgram   (configs/tiny-agent-cpu.yaml's task)

Run as a program (`python calculator_program.py "37*48="`) it is the agent: the synchronous `openai.OpenAI`
client reads OPENAI_BASE_URL and OPENAI_API_KEY, asks for a turn, runs the calculator calls it gets, and
asks again until an answer comes without one. Imported, it is the workflow that runs that program for each
episode (`client.run_command` sets the two variables to the episode's) and leaves the reward to
`reward.kind` (the final turn's \\boxed{} answer). Any program works the same way: a CLI coding agent, a
harness in a container (with `rollout.openai_endpoint: cluster`).
"""

import json
import sys

from areal_hpc.workflow import Workflow
from areal_hpc.workflow.tools import CALCULATOR_SCHEMA, ToolError, calculator

TIME_LIMIT_S = 300
"""Past it the program is killed and its episode lost (counted in rollout/workflow_errors)."""


class CalculatorProgram(Workflow):
    async def arun_episode(self, client, row: dict) -> None:
        result = await client.run_command([sys.executable, __file__, row["prompt"]], TIME_LIMIT_S)
        if result.returncode != 0:
            raise RuntimeError(f"the agent exited with status {result.returncode}:\n{result.stderr[-2000:]}")


def calculate(arguments: str) -> str:
    """The calculator's output for a call's JSON arguments, or the error the model reads instead."""
    try:
        return calculator(**json.loads(arguments))
    except (ToolError, TypeError, ValueError) as e:
        return f"error: {e}"


def main(prompt: str) -> None:
    from openai import OpenAI

    api = OpenAI(max_retries=0, timeout=3600)  # a turn can wait for weight loads: no retry, a long timeout
    messages = [{"role": "user", "content": prompt}]
    while True:
        response = api.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
        message = response.choices[0].message
        if not message.tool_calls:
            print(message.content)
            return
        messages.append(message.model_dump(exclude_none=True))  # sent back as it came: the sampled turn
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})


if __name__ == "__main__":
    main(sys.argv[1])
