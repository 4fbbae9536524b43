"""Rewards: math answer equivalence (`math.math_reward`) and tests run in a sandbox (`code.code_reward`).

The reward worker rank (`worker.serve`) decodes each episode's final answer (`response_text`) and scores it
in a pool of processes (`pool.ScorerPool`), each call through `score` below, under the time limit
`reward.timeout_s`. Decoding is here, not on the controller: rank 0 has one core for the whole
cluster's trajectories, the reward workers have many.
"""

from __future__ import annotations

REWARD_KINDS = ("math", "code", "none")
"""The values of `reward.kind`: what `score` dispatches on (the config imports this list)."""


def response_text(tokenizer, answer_ids) -> str:
    """The text a reward scores: an episode's final answer (the last turn's sampled tokens, not the tool
    output before it) decoded, special tokens (EOS) left out. Every path that scores episodes (the reward
    worker, `areal-hpc eval`) decodes through this."""
    return tokenizer.decode(answer_ids, skip_special_tokens=True)


def score(kind: str, response: str, target, timeout_s: float | None) -> tuple[float, str]:
    """(reward, reason) of one request; `target` is the answer (math) or the tests, a list of
    {"input", "output"} (code): an `areal_hpc.data.dataset.Example`'s target. none scores 0.

    reason: "ok" (the reward is the verdict), "timeout" (scored 0) or "error: ..." (scored 0)."""
    if kind == "none":
        return 0.0, "ok"
    if kind == "math":
        from areal_hpc.reward.math import math_score

        return math_score(response, target, timeout_s)
    if kind == "code":
        from areal_hpc.reward.code import code_score

        return code_score(response, target, timeout_s)
    return 0.0, f"error: unknown reward kind {kind!r} (expected one of {', '.join(REWARD_KINDS)})"


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to an episode's reward (the workflow's
    own or `reward.kind`'s), L its final answer's tokens (`answer_ids`: `rollout.max_new_tokens` is per turn):
    nothing up to `max_new_tokens - buffer` tokens, then falling linearly to `-penalty` at `max_new_tokens`:

        0                                                   if L <= max_new_tokens - buffer
        -penalty * (L - (max_new_tokens - buffer)) / buffer  otherwise (L <= max_new_tokens)

    (`reward.overlong_penalty`, `reward.overlong_buffer`; 0 when either is 0.)"""
    if penalty <= 0 or buffer <= 0:
        return 0.0
    return -penalty * max(0, length - (max_new_tokens - buffer)) / buffer
