"""The synthetic tasks with boxed answers (`data.synthetic_task`): their problems, the fixed split of
them into training and held-out problems, and their `{prompt, answer}` rows. `areal_hpc.tiny` writes
them to files. This module imports nothing of the project but its errors, so that config validation
can name the tasks.
"""

from __future__ import annotations

import operator
import random

from areal_hpc.errors import ConfigError

SYNTHETIC_TASKS = ("arithmetic", "multiplication")
"""The synthetic tasks (`data.synthetic_task`), with `max_operand` (`data.synthetic_max_operand`):

    arithmetic:     'a+b=' and 'a-b=', 0 <= a, b <= max_operand; the tiny model learns it by itself
    multiplication: 'a*b=', a and b of as many digits as max_operand (10..99 for 99); the tiny model
                    gets few right by itself, nearly all with the calculator (`<calc>a*b`)
"""
TEST_SHARE = 5
"""One in this many of a synthetic task's problems is held out of the RL prompts, as its test split."""
TEST_MAX = 500
"""Most problems in the test split."""


def synthetic_problems(task: str = "arithmetic", max_operand: int = 99) -> tuple[list[tuple], list[tuple]]:
    """Every problem (a, op, b) of a task, split into (train, test): a fixed fifth (at most TEST_MAX)
    held out, drawn by a seed of its own, so every run agrees."""
    if task == "arithmetic":
        problems = [(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"]
    elif task == "multiplication":
        operands = range(10 ** (len(str(max_operand)) - 1), max_operand + 1)
        problems = [(a, "*", b) for a in operands for b in operands]
    else:
        raise ConfigError(f"data.synthetic_task must be one of {', '.join(SYNTHETIC_TASKS)} (got '{task}')")
    random.Random(f"{task}-split:{max_operand}").shuffle(problems)
    n_test = min(len(problems) // TEST_SHARE, TEST_MAX)
    return problems[n_test:], problems[:n_test]


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _row(problem: tuple) -> dict:
    a, op, b = problem
    return {"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))}


def synthetic_rows(
    n: int, seed: int, task: str = "arithmetic", max_operand: int = 99, held_out: bool = False
) -> list[dict]:
    """`{prompt, answer}` rows of a synthetic task ('a+b=', 'a-b=' or 'a*b='; the expected response is
    `\\boxed{c}`), drawn uniformly (with repeats) from the training split's problems, or with `held_out`
    from every problem. Deterministic in (n, seed)."""
    rng = random.Random(seed)
    train, test = synthetic_problems(task, max_operand)
    problems = train + test if held_out else train
    return [_row(rng.choice(problems)) for _ in range(n)]


def synthetic_test_rows(task: str = "arithmetic", max_operand: int = 99) -> list[dict]:
    """The held-out problems, each once: no row of the RL prompts is one of them."""
    return [_row(p) for p in synthetic_problems(task, max_operand)[1]]
