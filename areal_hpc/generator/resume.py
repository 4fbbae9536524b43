"""An episode's turns across a checkpoint: what a generator saves of an episode in flight, and how the episode,
started again from its row after the resume, meets the turns it had sampled.

A workflow's Python state cannot be saved, so a resumed episode runs its workflow again from the start; its
turns are what is kept. The k-th time it samples, its k-th saved turn is met if that turn was sampled after the
same context (`protocol.context_digest`): a finished one comes back at once, as sampled then (tokens, behaviour
logprobs, versions, routing), without the engine; the one that was in flight goes on from its tokens, exactly as
a turn interrupted by a weight update goes on (`GenerationEngine.submit`'s `prefix`). The default single-turn
workflow resumes mid-answer; a multi-turn workflow whose steps between turns are deterministic (its tools, its
parsing) meets every turn again, and its tools run again. At the first turn whose context differs (a workflow
that draws at random, a tool whose answer changed), the saved turns from there on are dropped and sampled anew
(counted: `discarded`), so what is trained is always a sequence the workflow really produced.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.protocol import SavedTurn, context_digest
from areal_hpc.workflow.client import Turn


def saved_turn(context_ids, turn: Turn, finished: bool = True) -> SavedTurn:
    """A turn as a checkpoint keeps it: the digest of its context, its tokens as arrays."""
    return SavedTurn(
        context_digest(context_ids),
        np.asarray(turn.token_ids, np.int32),
        np.asarray(turn.behav_logprobs, np.float32),
        np.asarray(turn.versions, np.int32),
        turn.finish_reason if finished else "",
        turn.routing if finished else None,
    )


class EpisodeResume:
    """The saved turns an episode is still to meet, and what meeting them kept and dropped (sampled tokens)."""

    def __init__(self, saved: list[SavedTurn]):
        self.saved = list(saved)
        self.kept = 0
        self.discarded = 0

    def meet(self, context_ids: list[int], max_tokens: int) -> tuple[Turn | None, Turn | None]:
        """For the episode's next turn after `context_ids`, of at most `max_tokens`: (finished, prefix): the
        saved turn as a finished Turn (nothing to sample: it had finished, or its tokens fill `max_tokens`),
        or the tokens to go on from (a Turn to resubmit), or (None, None) to sample anew."""
        if not self.saved:
            return None, None
        turn = self.saved.pop(0)
        if turn.context != context_digest(context_ids):
            self.discarded += sum(len(t.token_ids) for t in [turn, *self.saved])
            self.saved.clear()
            return None, None
        n = min(len(turn.token_ids), max_tokens)
        cut = len(turn.token_ids) - n
        self.kept += n
        self.discarded += cut
        routing = turn.routing
        if routing is not None and cut:  # [context + output, L, K]: the cut tokens' rows go
            routing = routing[: len(routing) - cut]
        tokens = (turn.token_ids[:n].tolist(), turn.behav_logprobs[:n].tolist(), turn.versions[:n].tolist())
        if turn.finish_reason or n == max_tokens:  # a turn cut by its budget ends as "length"
            finish = turn.finish_reason if not cut and turn.finish_reason else "length"
            return Turn(*tokens, finish, routing), None
        return None, Turn(*tokens, "")
