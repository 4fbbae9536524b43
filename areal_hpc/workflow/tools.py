"""The tools a workflow's episodes call: each takes its arguments and returns the text the model reads
next, or raises ToolError, whose message the model reads as `error: <message>`.

The calculator evaluates arithmetic itself, walking the expression's syntax tree (`ast`), instead of
calling `eval()`: the expression is model output, and `eval` would run any Python it wrote. Only
numbers, + - * / // % **, unary signs and parentheses are accepted; an exponent or a result too large
to write in MAX_DIGITS digits is refused before it is computed, so `9**9**9` is an error, not an hour
of CPU.
"""

from __future__ import annotations

import ast
import math
import operator

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
