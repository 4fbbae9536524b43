"""The workflow tools: the calculator evaluates arithmetic and refuses everything else with a ToolError."""

import time

import pytest

from areal_hpc.workflow.tools import MAX_DIGITS, ToolError, calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("37*48", "1776"),
        (" 37 * 48 ", "1776"),
        ("(2+3)*-4", "-20"),
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        ("1_000 + 0.25", "1000.25"),
        ("+5", "5"),
        ("-" * 499 + "1", "-1"),  # deep, within the length limit
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("__import__('os').system('true')", "unsupported"),
        ("x + 1", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("True + 1", "unsupported"),
        ("1j * 2", "unsupported"),
        ("[1, 2]", "unsupported"),
        ("3 < 4", "unsupported"),
        ("1 << 10", "unsupported"),
        ("37*", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("2.0 ** 5000", f"larger than {MAX_DIGITS} digits"),
        ("10 ** 101", f"larger than {MAX_DIGITS} digits"),
        ("1" + "0" * 60 + " * 1" + "0" * 60, f"larger than {MAX_DIGITS} digits"),
        ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression"),
        ("1+" * 300 + "1", "longer than"),
    ],
)
def test_calculator_refuses_with_a_message(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_calculator_refuses_a_tower_of_powers_at_once():
    started = time.monotonic()
    for expression in ("9**9**9", "(10**50)**(10**50)", "2**2**2**2**2**2"):
        with pytest.raises(ToolError, match="larger than"):
            calculator(expression)
    assert time.monotonic() - started < 1.0


def test_calculator_refuses_what_is_not_a_string():
    with pytest.raises(ToolError, match="must be a string"):
        calculator(1776)
