"""The simulated ranks of tools/bench_controller.py, and what they send: light stand-ins for the reward
workers, the generators and the trainers around the real Controller on rank 0, each sending the
messages the real one sends (a reward for each request, a generator's trajectories, a trainer's
results), and counting what rank 0 sent them.

Payloads: the trajectories, their lengths drawn from the planner's distribution, made once; each prompt
carries its index in its first DIGITS token ids, so a trainer can tell which prompt a trained sequence
is. The simulated trainers check each batch against the staleness bound as they get it.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections import Counter, deque

import numpy as np

DIGITS, BASE, FIRST_ID = 4, 80, 10  # prompt index -> the first prompt tokens (ids 10..89 of the tiny vocabulary)
ACK_TAG = 7  # simulated reward worker -> simulated generator: trajectories rank 0 has taken in (side communicator)

# --- payloads ---------------------------------------------------------------------------------------


class Payloads:
    """Everything the simulated ranks send, made once: trajectory lengths drawn from the planner's
    distribution, one array of token ids and one of logprobs of the longest trajectory (the others are
    views)."""

    def __init__(self, s: dict, seed: int = 0):
        from areal_hpc.planner import Lengths

        rng = np.random.default_rng(seed)
        lengths = Lengths(s["cap"], s["median"], s["sigma"], s["p_cap"], s["prompt_tokens"])  # the planner's
        u = rng.random(1 << 16)
        self.lengths = np.maximum(1, np.searchsorted(-lengths.survival, -u)).astype(np.int64)  # P(L > k) = S(k)
        self.cap, self.group = s["cap"], s["group"]
        self.output_ids = rng.integers(FIRST_ID, FIRST_ID + BASE, self.cap).astype(np.int32)
        self.behav_logprobs = -rng.random(self.cap).astype(np.float32)
        self.prompt = rng.integers(FIRST_ID, FIRST_ID + BASE, s["prompt_tokens"]).astype(np.int32)

    def length(self, prompt_index: int, traj_index: int) -> int:
        return int(self.lengths[(prompt_index * self.group + traj_index) % len(self.lengths)])

    def prompt_ids(self, index: int) -> np.ndarray:
        ids = self.prompt.copy()
        for k in range(DIGITS):
            ids[k] = FIRST_ID + index // BASE**k % BASE
        return ids


def prompt_index(prompt_ids: np.ndarray) -> int:
    return sum(int(prompt_ids[k] - FIRST_ID) * BASE**k for k in range(DIGITS))


class Prompts:
    """The controller's prompt stream (`areal_hpc.data.dataset.PromptStream`'s interface), numbered prompts."""

    def __init__(self, payloads: Payloads):
        self.payloads, self.position = payloads, 0

    def next(self):
        from areal_hpc.data.dataset import Example

        i, self.position = self.position, self.position + 1
        return Example(i, f"prompt {i}", "0", "math", prompt_ids=self.payloads.prompt_ids(i))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def wire_bytes(msg) -> int:
    """Bytes of a message on the wire: its arrays, and its other fields pickled."""
    arrays = scalars = 0
    other = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, np.ndarray):
            arrays += v.nbytes
        else:
            other[f.name] = v
    scalars = len(pickle.dumps((type(msg).__name__, other), protocol=5))
    return arrays + scalars


# --- the simulated ranks ----------------------------------------------------------------------------


def sim_reward(world, side, generator: int) -> dict:
    from areal_hpc.protocol import Mailbox, RewardRequest, RewardResult, Stop

    box, received, acks = Mailbox(world), Counter(), []
    while True:
        envs = box.poll(source=0)
        taken = 0
        for env in envs:
            msg = env.msg
            received[type(msg).__name__, "n"] += 1
            received[type(msg).__name__, "bytes"] += wire_bytes(msg)
            if isinstance(msg, RewardRequest):
                assert msg.answer_ids.dtype == np.int32 and msg.answer_ids.ndim == 1, "token ids, not text"
                box.send(0, RewardResult(msg.request_id, float(msg.request_id * 2654435761 >> 9 & 1), "ok"))
                taken += 1
            elif isinstance(msg, Stop):
                box.flush()
                return {"received": _plain(received)}
        if taken:
            acks.append(side.isend(taken, dest=generator, tag=ACK_TAG))
            acks = [r for r in acks if not r.Test()]
        if not envs:
            time.sleep(0.0005)


def sim_generator(world, side, payloads: Payloads, window: int) -> dict:
    from mpi4py import MPI

    from areal_hpc.controller.rollouts import single_turn
    from areal_hpc.protocol import GenerateRequest, Mailbox, Save, Saved, Stop, SyncDone, WeightSync

    box, received = Mailbox(world), Counter()
    queue: deque = deque()  # (group_id, prompt index, prompt ids, trajectory index)
    versions = np.zeros(payloads.cap, np.int32)
    sent = taken = 0
    generated = []  # (prompt index, trajectory index, length)
    while True:
        busy = False
        for env in box.poll(source=0):
            msg, busy = env.msg, True
            received[type(msg).__name__, "n"] += 1
            received[type(msg).__name__, "bytes"] += wire_bytes(msg)
            if isinstance(msg, GenerateRequest):
                assert not msg.eval, "the benchmark runs with eval.every_steps=0: no evaluation is simulated"
                p = prompt_index(msg.prompt_ids)
                queue.extend((msg.group_id, p, msg.prompt_ids, i) for i in range(msg.n))
            elif isinstance(msg, WeightSync):
                versions = np.full(payloads.cap, msg.version, np.int32)
                box.send(0, SyncDone(msg.version, 0.0))
            elif isinstance(msg, Save):  # its answers in flight are not simulated: none to write
                box.send(0, Saved(msg.version))
            elif isinstance(msg, Stop):
                box.flush()
                return {"received": _plain(received), "generated": generated}
        while side.iprobe(source=MPI.ANY_SOURCE, tag=ACK_TAG):
            taken += side.recv(source=MPI.ANY_SOURCE, tag=ACK_TAG)
        while queue and sent - taken < window:
            group_id, p, prompt_ids, i = queue.popleft()
            n = payloads.length(p, i)
            reason = "length" if n == payloads.cap else "stop"
            out, logp, vers = payloads.output_ids[:n], payloads.behav_logprobs[:n], versions[:n]
            box.send(0, single_turn(group_id, i, prompt_ids, out, logp, vers, reason))  # a one-turn episode
            generated.append((p, i, n))
            sent, busy = sent + 1, True
        if not busy:
            time.sleep(0.0005)


def sim_trainer(world, replica_comm, first_trainer: bool, eta: int, train_s: float) -> dict:
    """A trainer rank as the real one (areal_hpc.trainer.worker.serve): the controller's messages through
    the replica relay; the replica's first rank counts what rank 0 sent it, the others what it relayed."""
    from areal_hpc.protocol import Mailbox, ReplicaRelay, Save, Saved, Stop, TrainBatch, TrainResult
    from areal_hpc.rank_context import CONTROLLER_RANK

    box, received = Mailbox(world), Counter()
    inbox = ReplicaRelay(box, replica_comm, CONTROLLER_RANK, timeout_s=600.0)
    trained = []  # (version, prompt index, trajectory length)
    errors = []
    version = None
    while True:
        envs = inbox.poll()
        for env in envs:
            msg = env.msg
            received[type(msg).__name__, "n"] += 1
            received[type(msg).__name__, "bytes"] += wire_bytes(msg)
            if isinstance(msg, TrainBatch):
                if version is not None and msg.version != version + 1:
                    errors.append(f"step {msg.version + 1} after step {version + 1}")
                version = int(msg.version)
                if inbox.first:  # each replica's batch checked once
                    trained += _check_batch(msg, eta, errors)
                if first_trainer:
                    time.sleep(train_s)
                    box.send(0, TrainResult(version + 1, {"ppo/loss": 0.0}))
            elif isinstance(msg, Save):
                box.send(0, Saved(msg.version))
            elif isinstance(msg, Stop):
                box.flush()
                counts = {"received": _plain(received), "relayed": []}
                if not inbox.first:
                    counts = {"received": [], "relayed": _plain(received)}
                return {**counts, "trained": trained, "errors": errors}
        if not envs:
            time.sleep(0.0005)


def _check_batch(b, eta: int, errors: list) -> list:
    mask = b.loss_mask.astype(bool)
    if mask.any() and int(b.versions[mask].min()) < b.version - eta:
        errors.append(f"step {b.version + 1} trains a token of version {int(b.versions[mask].min())} (bound {eta})")
    out = []
    cu = b.cu_seqlens
    for k in range(len(cu) - 1):
        seq = slice(int(cu[k]), int(cu[k + 1]))
        out.append((int(b.version), prompt_index(b.tokens[seq]), int(b.loss_mask[seq].sum())))
    return out


def _plain(counter: Counter) -> list:
    return [[kind, what, n] for (kind, what), n in counter.items()]
