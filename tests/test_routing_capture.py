"""The generator's routing record (areal_hpc.generator.routing) against transformers, on the tiny MoE.

A vLLM engine with `record_routing` on the tiny Qwen3-MoE (`model.architecture=qwen3_moe`: 2 layers, 4
experts, top-2): each finished turn's routing is, at every position the engine computed, the top-k of
transformers' own router logits (`output_router_logits`) on the same tokens and weights; a prefix-cache
hit finds the routing of the pass that computed the prefix; after a weight update a resubmitted turn
carries the new weights' routing at every position (generator/routing.py: which routing a position carries).
"""

import numpy as np
import pytest
import torch

from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import resolve_device
from areal_hpc.protocol import routing_unknown
from areal_hpc.workflow import Workflow
from tests.support.generator_runs import drain, load, perturb
from tests.support.shapes import GENERATOR_MOE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from areal_hpc.generator.engine import GenerationEngine

    path = build_tiny_model(GENERATOR_MOE, tmp_path_factory.mktemp("moe"), seed=1)
    engine = GenerationEngine.create(
        path, device=resolve_device(), temperature=1.0, max_model_len=256, max_num_seqs=16, record_routing=True
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, model
    engine.close()


def hf_routing(model, ids) -> np.ndarray:
    """[T, L, K] transformers' top-k experts of every position of `ids`, sorted per row."""
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), output_router_logits=True)
    logits = torch.stack([r.reshape(len(ids), -1) for r in out.router_logits], dim=1)  # [T, L, E]
    return np.sort(logits.topk(TOP_K, dim=-1).indices.numpy(), axis=-1)


def check_routing(turn, model) -> None:
    """The turn's routing equals transformers' at every computed position; the last one is unknown."""
    ids = turn.context_ids + turn.sampled.token_ids
    routing = turn.sampled.routing
    assert routing.shape == (len(ids), LAYERS, TOP_K) and routing.dtype == np.uint8
    assert (routing[-1] == routing_unknown(np.uint8)).all()
    np.testing.assert_array_equal(np.sort(routing[:-1], axis=-1), hf_routing(model, ids)[:-1])


def test_routing_of_every_position_equals_transformers(setup):
    engine, model = setup
    for g in range(3):
        engine.submit(f"a{g}", [5 + g, 6, 7, 8, 9], 12)
    turns = drain(engine)
    assert len(turns) == 3
    for turn in turns:
        check_routing(turn, model)
    # The routing varies over positions and layers (else the comparison would prove little).
    assert len({tuple(r.ravel()) for t in turns for r in t.sampled.routing[:-1]}) > 3


def test_a_prefix_cache_hit_finds_the_routing_of_the_pass_that_computed_it(setup, monkeypatch):
    """A second turn on the same long prompt (more than one KV block) reads the prompt's KV from the cache:
    its routing there is the first turn's, and transformers'."""
    engine, model = setup
    cached = []
    step = engine.engine.step

    def recording_step():
        outs = step()
        cached.extend(out.num_cached_tokens for out in outs if out.finished)
        return outs

    monkeypatch.setattr(engine.engine, "step", recording_step)
    block = engine.engine.vllm_config.cache_config.block_size
    prompt = [int(x) for x in np.random.default_rng(0).integers(2, 100, block + 20)]
    engine.submit("first", prompt, 8)
    [first] = drain(engine)
    engine.submit("second", prompt, 8)
    [second] = drain(engine)
    assert cached[-1] >= block  # the second turn's prompt came from the prefix cache
    np.testing.assert_array_equal(second.sampled.routing[: len(prompt) - 1], first.sampled.routing[: len(prompt) - 1])
    check_routing(first, model)
    check_routing(second, model)


class TwoTurns(Workflow):
    """A turn, three context tokens (a tool's output, say), a second turn after all of it."""

    async def arun_episode(self, client, row):
        first = await client.generate(row["prompt_ids"])
        await client.generate(row["prompt_ids"] + first.token_ids + [40, 41, 42])


def test_an_episodes_trajectory_carries_the_routing_of_every_position(setup):
    """Through the episode runner: the Trajectory's routing [N, L, K] is transformers' at every position of
    the sequence but its last (the latest turn computed or cached all of them)."""
    from transformers import AutoTokenizer

    from areal_hpc.config import RolloutConfig
    from areal_hpc.generator.episodes import EpisodeRunner
    from areal_hpc.protocol import GenerateRequest
    from tests.support.generator_runs import run_episodes

    engine, model = setup
    tokenizer = AutoTokenizer.from_pretrained(engine.engine.vllm_config.model_config.model)
    runner = EpisodeRunner(engine, TwoTurns(), tokenizer, RolloutConfig(max_new_tokens=8), lambda: None)
    request = GenerateRequest(0, np.array([5, 6, 7], np.int32), {"prompt": "", "target": "", "kind": "math"}, 3)
    replies = run_episodes(runner, [request])
    assert len(replies) == 3
    for t in replies:
        assert not t.error and len(t.seq_lens) == 1
        assert t.routing.shape == (len(t.tokens), LAYERS, TOP_K)
        assert (t.routing[-1] == routing_unknown(np.uint8)).all()
        np.testing.assert_array_equal(np.sort(t.routing[:-1], -1), hf_routing(model, t.tokens)[:-1])


def test_after_a_weight_update_a_resubmitted_turn_carries_the_new_routing(setup):
    """Turns interrupted mid-way by a weight update: at the end every position of each (the prompt and the
    tokens sampled before the update included) has the new weights' routing, which differs from the old's.
    Last in the module: the engine keeps the new weights."""
    from transformers import AutoModelForCausalLM

    engine, model = setup
    path = engine.engine.vllm_config.model_config.model
    new = perturb(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seed=3)
    with torch.no_grad():  # new attention, norms and routers; the experts as they were (reloading experts
        for name, p in new.named_parameters():  # into vLLM is test_weight_sync's)
            if ".mlp.experts." in name:
                p.copy_(model.get_parameter(name))
    for g in range(4):
        engine.submit(f"u{g}", [9 + g, 10, 11, 12], 16)
    early = drain(engine, steps=4)
    assert engine.in_flight  # the update catches turns mid-way
    load(engine, new, engine.version + 1)
    turns = drain(engine)
    assert turns and all(t.attempt == 1 for t in turns)
    changed = 0
    for turn in turns:
        check_routing(turn, new)
        ids = turn.context_ids + turn.sampled.token_ids
        changed += (np.sort(turn.sampled.routing[:-1], -1) != hf_routing(model, ids)[:-1]).any(axis=(1, 2)).sum()
    assert changed > 0
    for turn in early:
        check_routing(turn, model)
