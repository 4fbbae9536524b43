"""A generator rank under mpirun: `generator.worker.serve` with a real vLLM engine, driven by a
scripted controller (world rank 0) and a stand-in trainer rank that sends new weights through the
real weight-sync sender. Checked here: episodes of the default workflow come back one by one (an eval
prompt's as its own reply), a WeightSync mid-way interrupts and resumes them under the broadcast
weights (with rollout.interruptible false: lets them finish under the old ones first, so no answer is
aborted and each carries one version), a request after it runs on the new weights only, a Stop right
after a WeightSync still completes the sync, and every sampled token's behaviour logprob matches
transformers under the weights of its version. And a workflow that cannot be loaded is the rank's
Failure before vLLM starts.
"""

import pickle

import numpy as np
import pytest
import torch

from areal_hpc.data.tiny import build_tiny_model
from tests.support.helpers import MPI_PROGRAMS
from tests.support.shapes import GENERATOR

TEMPERATURE = 0.8
MAX_NEW = 96


PROMPT = 3
"""Prompt tokens of every request of tests/support/mpi/generator_world.py: [5 + group, 6, 7]."""


def _answer(t):
    """The episode's sampled answer: its tokens after the prompt (one turn, one sequence)."""
    assert t.tokens[:PROMPT].tolist() == [5 + t.group_id, 6, 7] and t.seq_lens.tolist() == [len(t.tokens)]
    assert t.loss_mask.tolist() == [0] * PROMPT + [1] * (len(t.tokens) - PROMPT) and not t.error
    assert (t.versions[:PROMPT] == -1).all() and t.answer_ids.tolist() == t.tokens[PROMPT:].tolist()
    return t.tokens[PROMPT:], t.behav_logprobs[PROMPT:], t.versions[PROMPT:]


def _logprobs(model, t) -> np.ndarray:
    ids = torch.tensor([t.tokens.tolist()], dtype=torch.long)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / TEMPERATURE, -1)[PROMPT - 1 : -1]
    return logp.gather(-1, torch.as_tensor(t.tokens[PROMPT:], dtype=torch.long)[:, None])[:, 0].numpy()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.vllm
@pytest.mark.parametrize("interruptible", [True, False])
def test_generator_rank_serves_and_syncs(run_mpi, tmp_path, interruptible):
    from transformers import Qwen2ForCausalLM

    path = build_tiny_model(GENERATOR, tmp_path / "root", seed=1)
    model_a = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model_b = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    torch.save(model_b.state_dict(), tmp_path / "b.pt")
    overrides = [
        "cluster.nodes=2",
        "allocation.gen_gpus=1",
        "train.collective_timeout_s=120",
        f"rollout.temperature={TEMPERATURE}",
        f"rollout.max_new_tokens={MAX_NEW}",
        "rollout.max_concurrent=4",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "ppo.minibatches=1",
        f"rollout.interruptible={str(interruptible).lower()}",
        *(f"model.{k}={v}" for k, v in vars(GENERATOR).items() if k != "path" and v is not None),
    ]
    env = {
        "OVERRIDES": " ".join(overrides),
        "MODEL": str(path),
        "WEIGHTS_B": str(tmp_path / "b.pt"),
        "OUT": str(tmp_path / "out.pkl"),
    }
    proc = run_mpi(
        MPI_PROGRAMS / "generator_world.py", n=4, timeout=300, env=env
    )  # controller, reward (idle), generator, trainer
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = pickle.loads((tmp_path / "out.pkl").read_bytes())

    assert [(s.version, s.seconds > 0) for s in out["syncs"]] == [(1, True), (2, True), (3, True)]
    if interruptible:
        assert all(s.drain_s == 0 for s in out["syncs"])
    assert sorted((t.group_id, t.index) for t in out["first"]) == [(0, i) for i in range(4)]
    assert sorted((t.prompt_index, t.index) for t in out["evals"]) == [(0, 0), (0, 1)], "an eval request's replies"
    assert sorted((t.group_id, t.index) for t in out["rest"]) == [(g, i) for g in (1, 2, 3) for i in range(4)]
    for t in out["first"]:
        _, logprobs, versions = _answer(t)
        assert (versions == 0).all()
        np.testing.assert_allclose(logprobs, _logprobs(model_a, t), atol=1e-3, rtol=0)
    new_tokens, mixed, old = 0, 0, 0
    for t in out["rest"]:
        answer, logprobs, versions = _answer(t)
        k = int((versions == 0).sum())
        assert (np.diff(versions) >= 0).all() and set(versions[k:].tolist()) <= {1, 2}  # weights B from version 1
        assert len(answer) == MAX_NEW or t.finish_reason == "stop"
        np.testing.assert_allclose(logprobs[:k], _logprobs(model_a, t)[:k], atol=1e-3, rtol=0)
        np.testing.assert_allclose(logprobs[k:], _logprobs(model_b, t)[k:], atol=1e-3, rtol=0)
        new_tokens += len(versions) - k
        mixed += 0 < k < len(versions)
        old += k == len(versions)
        if t.group_id == 3:  # requested after the two WeightSyncs
            assert (versions == 2).all()
    assert new_tokens > 0
    if interruptible:
        assert mixed > 0  # answers interrupted mid-way resumed under the new weights
    else:
        assert mixed == 0 and old > 0  # none aborted: those in flight finished under the old weights


class _World:
    """A communicator stand-in that records what the rank sends (`protocol.Mailbox` calls `isend`)."""

    def __init__(self, rank: int):
        self.rank, self.sent = rank, []

    def Get_rank(self):
        return self.rank

    def isend(self, header, dest, tag):
        self.sent.append((dest, header))
        return self

    def Test(self):
        return True


def test_a_workflow_that_cannot_be_loaded_is_the_ranks_failure(tmp_path):
    """rollout.workflow names nothing loadable: the generator rank reports a Failure naming itself and the
    error (ConfigError naming the setting) to the controller, before any engine starts."""
    from areal_hpc.config import load_config
    from areal_hpc.errors import ConfigError
    from areal_hpc.generator.worker import serve
    from areal_hpc.layout import Layout, Role
    from areal_hpc.rank_context import CONTROLLER_RANK, RankContext

    cfg = load_config(
        None, ["cluster.nodes=2", "allocation.gen_gpus=1", "rollout.workflow=areal_hpc.workflow.builtin:Nope"]
    )
    layout = Layout.from_config(cfg)
    rank = layout.ranks(Role.GENERATOR)[0]
    world = _World(rank)
    ctx = RankContext(cfg, layout, world, None, tmp_path, tmp_path / "no-model")
    with pytest.raises(ConfigError, match="rollout.workflow"):
        serve(ctx, sync=None)
    [(dest, (name, fields, arrays))] = world.sent
    assert (dest, name, fields["rank"], arrays) == (CONTROLLER_RANK, "Failure", rank, [])
    assert fields["error"].startswith(f"{layout.describe_rank(rank)}: Traceback")
    assert "ConfigError: rollout.workflow" in fields["error"] and "Nope" in fields["error"]
