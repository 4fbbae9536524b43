"""The synthetic tasks with boxed answers (`data.synthetic_task`): their problems, the fixed split of
them into training and held-out problems, their `{prompt, answer}` rows, and the steps a response
works before its boxed answer (the chain task's). `areal_hpc.data.tiny` writes them to files.

The tasks (their names: areal_hpc.config.choices.SYNTHETIC_TASKS), with `max_operand` (`data.synthetic_max_operand`):

    arithmetic:     'a+b=' and 'a-b=', 0 <= a, b <= max_operand; the tiny model learns it by itself
    multiplication: 'a*b=', a and b of as many digits as max_operand (10..99 for 99); the tiny model
                    gets few right by itself, nearly all with the calculator (`<calc>a*b`)
    chain:          'a%b=', 2 <= b <= 9, b <= a <= max_operand, answered by the countdown a - b,
                    a - 2b, ... down to a mod b, then that remainder boxed ('23%7=16,9,2,\\boxed{2}'):
                    a reasoning-shaped task whose answers are long-tailed (`chain_steps`)
"""

from __future__ import annotations

import math
import operator
import random

from areal_hpc.config.choices import SYNTHETIC_TASKS
from areal_hpc.errors import ConfigError

TEST_SHARE = 5
"""One in this many of a synthetic task's problems is held out of the RL prompts, as its test split."""
TEST_MAX = 500
"""Most problems in the test split."""
CHAIN_MEDIAN_SHARE = 1 / 20
"""The chain task's median count of steps, as a share of `max_operand`."""
CHAIN_SIGMA = 1.0
"""The spread (log-space standard deviation) of the chain task's counts of steps: the planner's spread
of reasoning answers (`planner.cost.COST`). With max_operand 999 a step is about 3.5 tokens (its digits
and a comma), so the median answer is about 185 tokens and about one in 20 runs past 1,024 tokens."""


def synthetic_problems(task: str = "arithmetic", max_operand: int = 99) -> tuple[list[tuple], list[tuple]]:
    """Every problem (a, op, b) of a task, split into (train, test): a fixed fifth (at most TEST_MAX)
    held out, drawn by a seed of its own, so every run agrees."""
    if task == "arithmetic":
        problems = [(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"]
    elif task == "multiplication":
        operands = range(10 ** (len(str(max_operand)) - 1), max_operand + 1)
        problems = [(a, "*", b) for a in operands for b in operands]
    elif task == "chain":
        return _chain_split(max_operand)
    else:
        raise ConfigError(f"data.synthetic_task must be one of {', '.join(SYNTHETIC_TASKS)} (got '{task}')")
    random.Random(f"{task}-split:{max_operand}").shuffle(problems)
    n_test = min(len(problems) // TEST_SHARE, TEST_MAX)
    return problems[n_test:], problems[:n_test]


def _chain_split(max_operand: int) -> tuple[list[tuple], list[tuple]]:
    """The chain task's split: its test problems are the first distinct ones of a fixed `_chain_draw`
    sequence, so the test split's lengths follow the training rows' long tail (a uniform fifth of the
    problems would be mostly long: most of them have a large a and a small b)."""
    if max_operand < 9:
        raise ConfigError(f"data.synthetic_max_operand must be at least 9 for the chain task (got {max_operand})")
    problems = [(a, "%", b) for b in range(2, 10) for a in range(b, max_operand + 1)]
    n_test = min(len(problems) // TEST_SHARE, TEST_MAX)
    rng, test = random.Random(f"chain-split:{max_operand}"), {}
    while len(test) < n_test:
        test.setdefault(_chain_draw(rng, max_operand), None)
    return [p for p in problems if p not in test], list(test)


def _chain_draw(rng: random.Random, max_operand: int) -> tuple:
    """One chain problem: its count of steps k from the lognormal (median CHAIN_MEDIAN_SHARE *
    max_operand, spread CHAIN_SIGMA; drawn again until some b fits), then b in 2..9 and r in [0, b)
    drawn again until a = k * b + r <= max_operand."""
    median = max(1.0, CHAIN_MEDIAN_SHARE * max_operand)
    while (k := round(rng.lognormvariate(math.log(median), CHAIN_SIGMA))) < 1 or 2 * k > max_operand:
        pass
    while (a := k * (b := rng.randint(2, 9)) + rng.randrange(b)) > max_operand:
        pass
    return a, "%", b


def chain_steps(a: int, b: int) -> list[int]:
    """The chain task's countdown for 'a%b=': a - b, a - 2b, ..., down to a mod b."""
    return list(range(a - b, -1, -b))


def worked_steps(task: str, prompt: str) -> str:
    """The text a response writes before its boxed answer: for the chain task the countdown, each number
    followed by a comma ('23%7=' -> '16,9,2,'); nothing for the other tasks."""
    if task != "chain":
        return ""
    a, b = prompt.removesuffix("=").split("%")
    return "".join(f"{n}," for n in chain_steps(int(a), int(b)))


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "%": operator.mod}


def _row(problem: tuple) -> dict:
    a, op, b = problem
    return {"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))}


def synthetic_rows(
    n: int, seed: int, task: str = "arithmetic", max_operand: int = 99, held_out: bool = False
) -> list[dict]:
    """`{prompt, answer}` rows of a synthetic task ('a+b=', 'a-b=', 'a*b=' or 'a%b='; the expected
    response is `worked_steps` then `\\boxed{c}`), drawn with repeats from the training split's
    problems, or with `held_out` from every problem: uniformly, or for the chain task by `_chain_draw`.
    Deterministic in (n, seed)."""
    rng = random.Random(seed)
    train, test = synthetic_problems(task, max_operand)
    if task != "chain":
        problems = train + test if held_out else train
        return [_row(rng.choice(problems)) for _ in range(n)]
    skip = set() if held_out else set(test)
    rows = []
    while len(rows) < n:
        if (problem := _chain_draw(rng, max_operand)) not in skip:
            rows.append(_row(problem))
    return rows


def synthetic_test_rows(task: str = "arithmetic", max_operand: int = 99) -> list[dict]:
    """The held-out problems, each once: no row of the RL prompts is one of them."""
    return [_row(p) for p in synthetic_problems(task, max_operand)[1]]
