"""The tools a workflow's episodes call, and the pool of processes that runs them off the engine's loop.

A tool takes its arguments and returns the text the model reads next, or raises ToolError, whose
message the model reads as `error: <message>`. `TOOLS` holds their OpenAI-style schemas (the `tools=`
of a chat completion); `run_tool` is what a pool child runs for one call: it never raises, so an
unknown tool, bad arguments or a crash come back as an error text like a ToolError does.

- `calculator` evaluates arithmetic itself, walking the expression's syntax tree (`ast`), instead of
  calling `eval()`: the expression is model output, and `eval` would run any Python it wrote. Only
  numbers, + - * / // % **, unary signs and parentheses are accepted; an exponent or a result too
  large to write in MAX_DIGITS digits is refused before it is computed, so `9**9**9` is an error, not
  an hour of CPU.
- `python` runs a program in the code reward's sandbox (`reward.code.run_program`: bubblewrap, no
  network, limits, nothing left behind) and returns its stdout, then the tail of its stderr, then
  `exit status N` when it is not 0. A program that raises is an answer, not a tool failure (the model
  reads its traceback); a program over its time limit, or a sandbox that cannot start, is an error.

`ToolPool` is `reward.pool.TaskPool` running `run_tool`: the children, deadlines and kill-and-replace
of the reward workers' scorers, on the generator's node (`rollout.tool_processes`). Processes, not
threads: a call stuck in C is killed with its process, and each process has its own sandbox uid
(reward/code.py), so concurrent programs do not share one process limit.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import shutil
import time
from typing import Any

from areal_hpc.reward.code import SandboxLimits, run_program
from areal_hpc.reward.pool import TaskPool, pool_size

log = logging.getLogger(__name__)

MAX_EXPRESSION_CHARS = 500
"""Longest expression the calculator parses (deeper nesting than this allows exhausts the parser)."""
MAX_DIGITS = 100
"""Largest result the calculator returns, in decimal digits."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (37*48) - 5"}},
            "required": ["expression"],
        },
    },
}
"""The calculator as an OpenAI-style tool (the `tools=` of a chat completion)."""

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python program in a sandbox (no network, no files kept, a time limit) and read what it "
            "prints: stdout, then the end of stderr, then its exit status when it is not 0."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a whole program; print what you need"}},
            "required": ["code"],
        },
    },
}
"""The code interpreter as an OpenAI-style tool."""

TOOLS = {"calculator": CALCULATOR_SCHEMA, "python": PYTHON_SCHEMA}
"""Every tool by name: its OpenAI-style schema."""


class ToolError(Exception):
    """A tool could not do what it was asked; the message is told to the model, the run goes on."""


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as text: an int as its digits ('1776'), a float by
    `repr` ('0.5'). ToolError for anything else: a name, a call, a string, division by zero, a result
    over MAX_DIGITS digits or not finite."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string (got {type(expression).__name__})")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"not an arithmetic expression: {expression.strip()[:60]!r}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError):
        raise ToolError(f"result larger than {MAX_DIGITS} digits") from None
    return str(value) if isinstance(value, int) else repr(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"unsupported in an arithmetic expression: {ast.unparse(node)[:60]!r}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse base ** exponent before computing it when the result would exceed MAX_DIGITS digits."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise ToolError(f"result larger than {MAX_DIGITS} digits")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # a negative base to a fractional power
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * math.log2(10) + 1:
        raise ToolError(f"result larger than {MAX_DIGITS} digits")
    return value


def python(code: str, timeout_s: float) -> str:
    """Run `code` in the sandbox for at most `timeout_s` seconds: stdout, then the tail of stderr, then
    `exit status N` when it is not 0. ToolError when it runs over its time or output limit, or when the
    sandbox fails (no bubblewrap on this node)."""
    if not isinstance(code, str):
        raise ToolError(f"code must be a string (got {type(code).__name__})")
    # CPU seconds above the wall limit: a busy loop ends as a timeout, not as a signal's exit status
    limits = SandboxLimits(cpu_s=math.ceil(timeout_s) + 1, wall_s=timeout_s)
    run = run_program(code, "", limits)
    output = "".join(part if part.endswith("\n") else part + "\n" for part in (run.stdout, run.stderr) if part)
    if run.status == "timeout":
        so_far = f"; its output until then:\n{output}" if output else ""
        raise ToolError(f"the program ran over its {timeout_s:g} s limit{so_far}")
    if run.status == "output-limit":
        raise ToolError(f"the program wrote more than {limits.output_bytes} bytes")
    if run.status != "ok":
        raise ToolError(run.status.removeprefix("error: "))
    return output + (f"exit status {run.exit_code}" if run.exit_code else "")


def _call(name: str, arguments: dict, timeout_s: float) -> str:
    if name not in TOOLS:
        raise ToolError(f"unknown tool {name!r} (tools: {', '.join(TOOLS)})")
    if not isinstance(arguments, dict):
        raise ToolError(f"the arguments of {name} must be a JSON object (got {type(arguments).__name__})")
    params = TOOLS[name]["function"]["parameters"]
    missing = [k for k in params["required"] if k not in arguments]
    unknown = [k for k in arguments if k not in params["properties"]]
    if missing or unknown:
        wants = ", ".join(params["properties"])
        found = "missing " + ", ".join(missing) if missing else "unknown " + ", ".join(map(str, unknown))
        raise ToolError(f"{name} takes the arguments {wants} ({found})")
    if name == "calculator":
        return calculator(arguments["expression"])
    return python(arguments["code"], timeout_s)


def cut(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: its head and its tail around a note of what was cut."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = limit - len(note)
    if keep < 2:
        return text[:limit]
    return text[: keep - keep // 2] + note + text[len(text) - keep // 2 :]


def run_tool(name: str, arguments: dict, timeout_s: float, output_chars: int) -> tuple[str, bool, float]:
    """(text, ok, seconds) of one tool call; never raises: a failure is `error: ...` with ok False. The
    text is cut to `output_chars`. What a `ToolPool` child runs."""
    started = time.monotonic()
    try:
        text, ok = _call(name, arguments, timeout_s), True
    except ToolError as e:
        text, ok = f"error: {e}", False
    except Exception as e:  # noqa: BLE001 - a tool's failure is told to the model, it never ends the run
        text, ok = f"error: {type(e).__name__}: {e}", False
    return cut(text, output_chars), ok, time.monotonic() - started


class ToolPool(TaskPool):
    """Processes running tool calls: `submit(key, name, arguments)`, then `poll(wait_s)` gives
    `(key, text, ok, seconds)` for each call as it finishes, each exactly once. A call over `timeout_s`
    (plus the pool's grace) is killed with its process, which is replaced; it comes back as an error,
    as does a process that dies. Nothing here raises for a tool's failure."""

    def __init__(self, processes: int, timeout_s: float, output_chars: int, **limits):
        self.output_chars = output_chars
        super().__init__(
            "areal_hpc.workflow.tools:run_tool",
            processes,
            timeout_s,
            failed=self._failed,
            warm_up=("calculator", {"expression": "1+1"}, timeout_s, output_chars),
            name="tool",
            **limits,
        )

    @classmethod
    def from_config(cls, rollout) -> ToolPool:
        """The pool of `rollout.tool_processes` (0: one per CPU this rank may run on). Without bubblewrap
        on this node it says so once: every python tool call will then answer an error."""
        if shutil.which("bwrap") is None:
            log.warning(
                "bubblewrap (bwrap) is not installed on this node: every call of the python tool will answer "
                "'error: bwrap (bubblewrap) is not installed' (tools/setup.sh says how to get it)"
            )
        return cls(pool_size(rollout.tool_processes), rollout.tool_timeout_s, rollout.tool_output_chars)

    def submit(self, key: Any, name: str, arguments: dict) -> None:
        super().submit(key, name, arguments, self.timeout_s, self.output_chars)

    def _failed(self, reason: str, seconds: float) -> tuple[str, bool, float]:
        if reason == "timeout":
            reason = f"the tool ran over its {self.timeout_s:g} s limit"
        return cut(f"error: {reason.removeprefix('error: ')}", self.output_chars), False, seconds
