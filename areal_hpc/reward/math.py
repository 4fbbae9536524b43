"""Math reward: the last `\\boxed{...}` of a response, checked for mathematical equality with the answer.

    reward = 1.0 if verify(parse(answer), parse(last_boxed(response))) else 0.0

Equality is math-verify's (sympy: `\\frac12` = 1/2 = 0.5, x+1 = 1+x, sets, intervals, ...). Two fast
paths skip sympy, which matters for the tiny task (`\\boxed{19}` vs "19"): identical strings, and
two plain integers compared by value. A response without a complete `\\boxed{...}` scores 0.

Time limit. math-verify's own timeout is `signal.alarm` in whole seconds: it only works in the main
thread, and it would clobber an alarm the caller set. We turn it off and put one interval timer
(ITIMER_REAL, fractional seconds) around the whole call, in the main thread. Off the main thread no
signal can interrupt the call and the caller must bound it; the reward worker does (it runs every
call in the main thread of a pool process). A timer cannot interrupt a single long C call either
(`9^{9^{9}}` spends minutes in one big-integer power): killing that process is the worker's job.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

_INT = re.compile(r"[-+]?\d{1,100}")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


class _Timeout(BaseException):
    """Raised by the timer. A BaseException, so that math-verify's and sympy's `except Exception`
    blocks cannot swallow it and carry on past the deadline."""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included;
    None when there is none or the last one is not closed (a truncated response).

    Escaped braces (`\\{`, `\\}`) are literal characters, not grouping: `\\boxed{\\{1,2\\}}` -> `\\{1,2\\}`.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + 1
    while i < len(text) and text[i].isalpha():  # the command name
        i += 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `_Timeout` in the block after `seconds` (main thread only; elsewhere no limit).

    A timer the caller had running is restored afterwards, less the time spent here."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout

    started = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay:
                left = max(old_delay - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def _quiet_math_verify():
    """math-verify warns once per process that its timeouts are off; they are off on purpose."""
    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True


@lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    """The parsed answer; a group of trajectories to one prompt shares one parse."""
    from math_verify import parse

    text = answer.strip().strip("$").strip()
    if last_boxed(text) is None:
        text = "\\boxed{" + text + "}"
    return parse(text, parsing_timeout=None)


def _equal(content: str, answer: str) -> bool:
    a, b = content.strip(), answer.strip()
    if a == b:
        return True
    if _INT.fullmatch(a) and _INT.fullmatch(b):
        return int(a) == int(b)
    from math_verify import parse, verify

    _quiet_math_verify()
    gold = _parse_gold(answer)
    pred = parse("\\boxed{" + content + "}", parsing_timeout=None)
    return bool(verify(gold, pred, timeout_seconds=None))


def math_score(response: str, answer: str, timeout_s: float | None = 10.0) -> tuple[float, str]:
    """(reward, reason): reason is "ok" (the reward is the verdict), "timeout" or "error: ..."."""
    try:
        with time_limit(timeout_s):
            content = last_boxed(str(response))
            if content is None:
                return 0.0, "ok"
            return (1.0 if _equal(content, str(answer)) else 0.0), "ok"
    except _Timeout:
        return 0.0, "timeout"
    except Exception as e:  # noqa: BLE001 - a reward never raises; the reason carries the error
        return 0.0, f"error: {type(e).__name__}: {e}"[:500]


def math_reward(response: str, answer: str, timeout_s: float | None = 10.0) -> float:
    """1.0 when the last `\\boxed{...}` of `response` equals `answer` mathematically, else 0.0; never raises."""
    return math_score(response, answer, timeout_s)[0]
