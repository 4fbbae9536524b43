"""Rewards: math answer equivalence (`math.math_reward`) and tests run in a sandbox (`code.code_reward`).

The reward worker rank (`worker.serve`) scores requests in a pool of processes (`pool.ScorerPool`),
each call through `score` below, under the time limit `reward.timeout_s`.
"""

from __future__ import annotations

KINDS = ("math", "code")


def score(kind: str, response: str, target: str, timeout_s: float | None) -> tuple[float, str]:
    """(reward, reason) of one request; `target` is the answer (math) or the tests as JSON (code).

    reason: "ok" (the reward is the verdict), "timeout" (scored 0) or "error: ..." (scored 0)."""
    if kind == "math":
        from areal_hpc.reward.math import math_score

        return math_score(response, target, timeout_s)
    if kind == "code":
        from areal_hpc.reward.code import code_score

        return code_score(response, target, timeout_s)
    return 0.0, f"error: unknown reward kind {kind!r} (expected one of {', '.join(KINDS)})"
