"""What the generator checks run: a `GenerationEngine` driven step by step and interrupted by weight
loads, held to transformers' logprobs of the same tokens under the same weights; and `run_episodes`,
an `EpisodeRunner`'s episodes pumped to the end outside the generator's loop.

The interruption check (`interrupt_twice`, then `interruption_mismatch` and `interruption_problems`):
weights A (version v0), then B (v0 + 1) loaded while every turn is in flight, then A again
(v0 + 2), so each turn that lived through both loads has three segments,

    output:    [ 0 .. k1 )          [ k1 .. k2 )          [ k2 .. n )
    version:   v0 (A)               v0 + 1 (B)            v0 + 2 (A)
               before the first     after a resubmission (context + partial output, prefix cache reset)
               resubmission

where k1 and k2 are its lengths when the loads interrupted it (`engine.partial()`). The mismatch
against transformers is measured apart for the tokens before and after a resubmission: a stale KV
cache, a token sampled under the old weights but returned after the load, or a load that did not
reach every tensor shows in the second only. tests/test_generator.py runs it on the CPU in fp32; the
GPU check (tests.support.gpu_checks) with many more turns in flight, bf16, on cuda.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


def drain(engine, steps: int | None = None) -> list:
    """Step the engine until nothing is in flight (or `steps` steps): the turns that finished."""
    out = []
    while engine.in_flight and (steps is None or steps > 0):
        out += engine.step()
        steps = None if steps is None else steps - 1
    return out


def run_episodes(runner, requests) -> list:
    """Every request's episodes run to the end by an `EpisodeRunner` on a loop of its own, pumped as the
    generator pumps it; their replies, in the order they finished."""

    async def main():
        for request in requests:
            runner.start(request)
        replies = []
        while runner.episodes:
            replies += await runner.advance()
        return replies

    return asyncio.run(main())


def perturb(model, seed: int, std: float = 0.5):
    """`model` with noise (`std`) added to every weight, the norms' too (transformers sets them to one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((std * torch.randn(p.shape, generator=g)).to(p.device))
    return model


def round_to(model, dtype: torch.dtype):
    """`model`'s weights rounded to `dtype` and kept in fp32: what an engine in `dtype` holds after
    loading them, so that a reference computed from it differs from the engine by arithmetic only."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def load(engine, model, version: int) -> float:
    """Load `model`'s weights as the trainer sends them: in the engine's dtype, a tied model without
    `lm_head.weight` (as in a Hugging Face checkpoint); returns the seconds of the update."""
    tied, dtype = model.config.tie_word_embeddings, engine.engine.model_config.dtype
    named = [(k, v.to(dtype)) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")]
    return engine.load_weights(named, version)


def reference_logprobs(model, prompt, output, temperature: float) -> np.ndarray:
    """[T] transformers' log_softmax(logits / temperature) of each output token given its prefix, in
    the model's dtype (fp32 in the checks), on the model's device."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [P + T, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]  # [T, V]
    index = torch.as_tensor(np.asarray(output), dtype=torch.long, device=device)[:, None]
    return logp.gather(-1, index)[:, 0].cpu().numpy()


@dataclass
class Interrupted:
    """What `interrupt_twice` saw."""

    v0: int
    """The version of weights A; B is v0 + 1, A again v0 + 2."""
    first: dict[str, list[int]]
    """Turn key -> output ids when the load of B interrupted it."""
    second: dict[str, list[int]]
    """Turn key -> output ids when the load of A again interrupted it."""
    early: list
    """Turns (`EngineTurn`) that finished before the last load."""
    turns: list
    """Turns that finished after the last load: in flight through both interruptions."""
    load_s: tuple[float, float, float]
    """Seconds of each weight update (interrupt, load, reset the prefix cache, resubmit)."""


def interrupt_twice(
    engine, model_a, model_b, prompts: list[list[int]], n: int, max_tokens: int, steps=(8, 5)
) -> Interrupted:
    """Load A, submit `n` turns of at most `max_tokens` tokens per prompt (keys `p{prompt}.{i}`), step
    `steps[0]` times, load B, step `steps[1]` times, load A again, and finish everything."""
    v0 = engine.version + 1
    load_a = load(engine, model_a, v0)
    for p, prompt in enumerate(prompts):
        for i in range(n):
            engine.submit(f"p{p}.{i}", prompt, max_tokens)
    early = drain(engine, steps=steps[0])
    first = {t.key: t.sampled.token_ids for t in engine.partial()}
    load_b = load(engine, model_b, v0 + 1)
    early += drain(engine, steps=steps[1])
    second = {t.key: t.sampled.token_ids for t in engine.partial()}
    load_a_again = load(engine, model_a, v0 + 2)
    turns = drain(engine)
    return Interrupted(v0, first, second, early, turns, (load_a, load_b, load_a_again))


class Mismatch(NamedTuple):
    """|behaviour logprob - transformers'| over a set of tokens."""

    mean: float
    max: float
    tokens: int

    @classmethod
    def of(cls, diffs: list[np.ndarray]) -> Mismatch:
        d = np.concatenate(diffs) if diffs else np.zeros(0)
        return cls(float(d.mean()) if d.size else 0.0, float(d.max()) if d.size else 0.0, int(d.size))


class InterruptionMismatch(NamedTuple):
    before: Mismatch
    """Tokens sampled before the first resubmission (under A)."""
    after: Mismatch
    """Tokens sampled after it (under B, then A again)."""
    first_after: Mismatch
    """The first token after each resubmission (positions k1 and k2), where a token sampled under the
    old weights but returned after the load would be."""
    other: Mismatch
    """Every token against the other weights' logprobs: how far apart A and B are, i.e. what a load
    that did not take (or a token given the wrong version) would cost."""


def interruption_mismatch(run: Interrupted, model_a, model_b, temperature: float) -> InterruptionMismatch:
    """The mismatch of the turns that lived through both interruptions, each token held to the
    weights of its version."""
    before, after, first_after, other = [], [], [], []
    for t in run.turns:
        a, b = (reference_logprobs(m, t.context_ids, t.sampled.token_ids, temperature) for m in (model_a, model_b))
        under_b = np.asarray(t.sampled.versions) == run.v0 + 1
        want, unwanted = np.where(under_b, b, a), np.where(under_b, a, b)
        k1, k2 = len(run.first[t.key]), len(run.second[t.key])
        diff = np.abs(np.asarray(t.sampled.behav_logprobs) - want)
        before.append(diff[:k1])
        after.append(diff[k1:])
        first_after.append(diff[[k for k in (k1, k2) if k < len(diff)]])
        other.append(np.abs(np.asarray(t.sampled.behav_logprobs) - unwanted))
    return InterruptionMismatch(*map(Mismatch.of, (before, after, first_after, other)))


def interruption_problems(run: Interrupted, mismatch: InterruptionMismatch, tol: float) -> list[str]:
    """What went wrong, as sentences (empty: nothing): tokens lost or duplicated at a resubmission,
    versions not switching exactly where the loads interrupted, a mean mismatch before or after a
    resubmission (or at its first token) above `tol`, and a check that could not have seen a bad load (A and B closer than
    10 x `tol`, or no turn lived through both loads)."""
    out = []
    for t in run.turns:
        k1, k2 = len(run.first[t.key]), len(run.second[t.key])
        if list(t.sampled.token_ids[:k2]) != run.second[t.key] or list(t.sampled.token_ids[:k1]) != run.first[t.key]:
            out.append(f"turn {t.key}: tokens lost or duplicated at a resubmission")
            continue
        want = [run.v0] * k1 + [run.v0 + 1] * (k2 - k1) + [run.v0 + 2] * (len(t.sampled.token_ids) - k2)
        if list(t.sampled.versions) != want:
            out.append(f"turn {t.key}: versions {list(t.sampled.versions)} do not switch at tokens {k1} and {k2}")
    if not any(len(run.first[t.key]) < len(t.sampled.token_ids) for t in run.turns):
        out.append("no turn sampled tokens after a resubmission: nothing was checked")
    for name, m in (
        ("tokens before a resubmission", mismatch.before),
        ("tokens after a resubmission", mismatch.after),
        ("the first token after each resubmission", mismatch.first_after),
    ):
        if m.mean > tol:
            out.append(f"{name}: mean |logprob - transformers'| {m.mean:.2e} > {tol:.0e}")
    if mismatch.other.mean < 10 * tol:
        out.append(
            f"weights A and B give logprobs only {mismatch.other.mean:.2e} apart (< 10 x {tol:.0e}): a load that "
            "did not take would pass unseen"
        )
    return out
