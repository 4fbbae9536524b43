"""What a call over the episodes' HTTP endpoint costs the generator's thread, against the in-process call.

    python tools/bench_endpoint.py [--episodes 300] [--concurrent 1] [--rounds 3]

The tiny agent's episode (two chat calls and a calculator call) on a scripted engine that answers at once,
so what is timed is everything but sampling: `CalculatorAgent` through the episode's client, and
`CalculatorAgentHTTP` through `openai.AsyncOpenAI` on the endpoint, both on one event loop as on a
generator (the agent's client and the server share the thread). `--concurrent N` runs N episodes at a
time, as a generator does (configs/tiny-agent-cpu.yaml: up to 384), so that their calls hold N connections
at once. Rounds alternate the two (the machine's speed drifts). Prints each round's milliseconds per
episode, then the headline: the extra per call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' scripted engine

from areal_hpc.data.tiny import build_tokenizer  # noqa: E402
from areal_hpc.workflow.builtin import CalculatorAgent, CalculatorAgentHTTP  # noqa: E402
from areal_hpc.workflow.endpoint import EpisodeEndpoint  # noqa: E402
from tests.test_workflow_client import Engine, client_for, encode  # noqa: E402
from tests.test_workflow_http import http_client  # noqa: E402

TURNS = ["<calc>37*48", "\\boxed{1776}"]
CALLS = len(TURNS)


async def timed(episodes: int, concurrent: int, over_http: bool, endpoint, tok, row) -> float:
    """Milliseconds per episode, `concurrent` at a time."""
    workflow = CalculatorAgentHTTP() if over_http else CalculatorAgent()

    def client():
        if over_http:
            return http_client(tok, endpoint, Engine(tok, TURNS))
        return client_for(tok, Engine(tok, TURNS), max_turns=3, max_episode_tokens=64)

    await workflow.arun_episode(client(), row)  # warm: the first call builds the HTTP client and connection

    async def episode():
        c = client()
        await workflow.arun_episode(c, row)
        c.close()

    start = time.perf_counter()
    for first in range(0, episodes, concurrent):
        await asyncio.gather(*(episode() for _ in range(min(concurrent, episodes - first))))
    return (time.perf_counter() - start) / episodes * 1e3


async def main(episodes: int, concurrent: int, rounds: int) -> None:
    tok = build_tokenizer()
    row = {"prompt": "37*48=", "prompt_ids": encode(tok, "37*48=")}
    endpoint = EpisodeEndpoint("loopback", "tiny-policy")
    await endpoint.start()
    local, http = [], []
    try:
        for r in range(rounds):
            for over_http in (r % 2 == 0, r % 2 == 1):
                ms = await timed(episodes, concurrent, over_http, endpoint, tok, row)
                (http if over_http else local).append(ms)
                print(f"round {r + 1}: {'http' if over_http else 'in-process'} {ms:.2f} ms per episode", flush=True)
    finally:
        await endpoint.close()
    extra = (statistics.median(http) - statistics.median(local)) / CALLS
    print(f"in-process {statistics.median(local):.2f} ms, over HTTP {statistics.median(http):.2f} ms per episode")
    print(f"extra per call over HTTP (median of {rounds} rounds): {extra:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--concurrent", type=int, default=1, help="episodes at a time (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if min(args.episodes, args.concurrent, args.rounds) < 1:
        parser.error("--episodes, --concurrent and --rounds must be at least 1")
    asyncio.run(main(args.episodes, args.concurrent, args.rounds))
