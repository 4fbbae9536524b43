"""The typed messages between ranks, and their non-blocking MPI transport.

A message is a dataclass below. On the wire it is a small pickled header (its type and scalar
fields) followed, on a separate tag, by one raw buffer per numpy field: token arrays travel as
buffers, never as pickled lists. MPI keeps messages between two ranks on one tag in order, so the
buffers of a header are the next messages on its data tag.

Every send is non-blocking (`Mailbox.send` returns at once; `Mailbox.flush` completes what has
gone out), and so is every receive: `Mailbox.poll` takes the headers that have arrived, posts a
receive for each of their buffers, and returns the messages whose buffers are all in, in each sender's
order, without waiting. A large buffer moves only while its sender is inside MPI, and a generator is
mostly inside vLLM: a blocking receive would hold the controller, spinning, until the sender's next
MPI call (in tools/bench_controller.py, on 2 cores, that wait was 70% of rank 0's CPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_DATA_TAG = 1000  # buffers of the header sent on tag t travel on tag t + _DATA_TAG


# --- messages ----------------------------------------------------------------------------------
# Controller -> generator -> controller


@dataclass
class GenerateRequest:
    """Run `n` episodes of the workflow (`rollout.workflow`) on one data row (a GRPO group), or with `eval` on one
    eval row (areal_hpc.eval.training, areal_hpc.eval.command): scored, never trained on, never counted by the
    gate, its episodes answered as `EvalTrajectory`."""

    group_id: int  # with `eval`: the row's place among the eval prompts (eval.data), `EvalTrajectory.prompt_index`
    prompt_ids: np.ndarray  # [P] int32, the formatted prompt (areal_hpc.data.dataset.PromptFormat)
    row: dict  # what the workflow gets besides `prompt_ids`: areal_hpc.data.dataset.Example.row (prompt, target, kind, others)
    n: int
    eval: bool = False
    indices: list | None = None
    """The episodes to run, by index among the n (None: all): a group resumed from a checkpoint runs only those
    that had not come back (areal_hpc.checkpoint.in_flight)."""
    resume: dict | None = None
    """Index -> the `SavedTurn`s its episode had sampled when the checkpoint was taken, which the episode meets
    again (areal_hpc.generator.resume); None: none."""


@dataclass
class SavedTurn:
    """One turn of an episode in flight at a checkpoint, as a generator saved it: the digest of the context it was
    sampled after (`context_digest`), what it sampled by then, and its finish reason ("" while it was in flight)."""

    context: bytes
    token_ids: np.ndarray  # int32
    behav_logprobs: np.ndarray  # float32
    versions: np.ndarray  # int32
    finish_reason: str = ""
    routing: np.ndarray | None = None  # a finished turn's, when the engine records routing


def context_digest(token_ids) -> bytes:
    """What identifies a turn's context: a 16-byte BLAKE2 digest of its token ids as int32."""
    import hashlib

    return hashlib.blake2b(np.asarray(token_ids, np.int32).tobytes(), digest_size=16).digest()


EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "tool_s", "template_rewrites", "resumed_tokens")
"""The counters every episode reports (`Trajectory.stats`, `EvalTrajectory.stats`): sampled turns, tool calls,
tool calls that failed or timed out, seconds in tools, tool or user messages whose tokens came from a chat template
that rewrites earlier turns (areal_hpc.workflow.conversation), sampled tokens carried over from before a checkpoint it
was resumed from (areal_hpc.generator.resume)."""


@dataclass
class Trajectory:
    """One finished episode, sent as soon as it finishes: every token the engine saw, in order.

    An episode is one or more sequences (more when the workflow rewrote its history), concatenated: `seq_lens`
    cuts them. Per token, `loss_mask` is 1 on tokens the policy sampled, 0 on context (the prompt, tool and
    environment messages, chat template text), whose `behav_logprobs` are 0 and `versions` -1.
    """

    group_id: int
    index: int  # its place in the group, 0 .. n-1
    tokens: np.ndarray  # [N] int32, all sequences concatenated
    seq_lens: np.ndarray  # [S] int32, S >= 1 (0 only for a lost episode: `error`)
    loss_mask: np.ndarray  # [N] uint8, 1 on sampled tokens
    behav_logprobs: np.ndarray  # [N] float32, logprob of each sampled token under the weights that sampled it
    versions: np.ndarray  # [N] int32, policy version of each sampled token, -1 on context
    answer_ids: np.ndarray  # [A] int32, the final turn's sampled tokens: what `reward.kind` scores
    finish_reason: str  # "stop" (the episode ended by itself) or "length" (a turn or the episode hit its limit)
    reward: float = float("nan")  # the workflow's own reward; NaN: the reward workers score `answer_ids`
    stats: dict = field(default_factory=dict)  # EPISODE_STATS -> number
    error: str = ""  # the workflow raised: its traceback, and the episode is lost (no tokens)
    routing: np.ndarray | None = None
    """[N, L, K] (`routing_dtype`), with `ppo.routing_replay` only: per token and MoE layer, the K experts the
    generator routed it to (areal_hpc.generator.routing says which pass); `routing_unknown` where it computed
    none (the last token of each sequence, context after the last turn)."""


@dataclass
class EvalTrajectory:
    """One finished episode of an eval request (`GenerateRequest.eval`), sent as soon as it finishes: what an
    evaluation reads of it (no per-token arrays)."""

    prompt_index: int  # its request's group_id: the row's place among the eval prompts
    index: int  # its place among the row's n, 0 .. n-1
    answer_ids: np.ndarray  # [A] int32, the final turn's sampled tokens
    num_tokens: int  # the episode's trained tokens, all sequences, each up to its last sampled token
    finish_reason: str  # "stop" or "length"
    reward: float = float("nan")  # as Trajectory.reward
    stats: dict = field(default_factory=dict)
    error: str = ""


# Controller -> reward worker -> controller


@dataclass
class RewardRequest:
    """Score one episode's final answer: the reward worker decodes `answer_ids` (`reward.response_text`)."""

    request_id: int  # the controller's, unique among its requests in flight; the result carries it back
    kind: str  # reward.kind: "math", "code" or "none"
    answer_ids: np.ndarray  # [A] int32, the final turn's sampled tokens (Trajectory.answer_ids)
    target: str | list  # an areal_hpc.data.dataset.Example's target: the answer (math), the tests (code)


@dataclass
class RewardResult:
    request_id: int
    reward: float
    reason: str  # "ok", "timeout", "error: ..." (counted in the metrics)


# Controller -> trainers -> controller


@dataclass
class TrainBatch:
    """One training step's data for one data-parallel replica (sent to its first rank, which relays it to
    the replica's other TP x PP ranks: ReplicaRelay).

    Sequences are concatenated; `cu_seqlens` marks their boundaries. `microbatches[k][j]` lists the
    sequence indices of micro-batch j of PPO minibatch k.
    """

    version: int  # the policy version the step starts from; the step is number version + 1
    tokens: np.ndarray  # [N] int32, every sequence (context and sampled tokens, as in Trajectory), concatenated
    cu_seqlens: np.ndarray  # [S + 1] int32
    loss_mask: np.ndarray  # [N] uint8, 1 on sampled tokens; 0 on context and on episodes ppo.mask_truncated drops
    behav_logprobs: np.ndarray  # [N] float32 (0 on context)
    advantages: np.ndarray  # [N] float32, the episode's on its sampled tokens (0 on context)
    versions: np.ndarray  # [N] int32, policy version of each sampled token (-1 on context)
    microbatches: list = field(default_factory=list)
    routing: np.ndarray | None = None
    """[N, L', K], laid out like `tokens`: the episodes' `Trajectory.routing` (with `ppo.routing_replay`), of
    the L' model layers from `routing_first_layer` on (all of them as the controller sends it; a pipeline
    stage's own as its replica's first rank passes it on: `for_layers`)."""
    routing_first_layer: int = 0
    """The model layer of `routing`'s first column."""

    def for_layers(self, first: int, end: int) -> TrainBatch:
        """This batch with the routing of model layers [first, end) only (a pipeline stage's)."""
        if self.routing is None:
            return self
        start, have = first - self.routing_first_layer, self.routing.shape[1]
        if not 0 <= start < end - self.routing_first_layer <= have:
            raise ValueError(
                f"layers {first}-{end - 1} are not among the routing's "
                f"{self.routing_first_layer}-{self.routing_first_layer + have - 1}"
            )
        routing = np.ascontiguousarray(self.routing[:, start : start + end - first])
        return dataclasses.replace(self, routing=routing, routing_first_layer=first)

    def routing_columns(self, layers: list[int]) -> list[int]:
        """The columns of `routing` that hold model layers `layers`."""
        return [layer - self.routing_first_layer for layer in layers]


def routing_dtype(num_experts: int) -> np.dtype:
    """The dtype of routing arrays for a model of `num_experts` routed experts per layer: the smallest that
    holds every expert index and, as its maximum, `routing_unknown` (uint8 up to 254 experts)."""
    return np.dtype(np.uint8 if num_experts < np.iinfo(np.uint8).max else np.int16)


def routing_bytes_per_token(arch) -> int:
    """What a position's routing takes (`Trajectory.routing`): the top-k ids of every MoE layer of `arch`
    (a `QwenArch`), in `routing_dtype`."""
    return arch.num_layers * arch.num_experts_per_tok * routing_dtype(arch.num_experts).itemsize


def routing_unknown(dtype) -> int:
    """The entry of a routing array (`Trajectory.routing`) at a position the generator never computed: the
    dtype's maximum (255 for uint8); the trainer routes such positions itself."""
    return int(np.iinfo(dtype).max)


@dataclass
class TrainResult:
    version: int  # the policy version after the step
    stats: dict  # metric name (docs/design.md, The run directory and metrics) -> float


# Orchestration


@dataclass
class WeightSync:
    """Controller -> trainers and generators: move the weights of `version` now."""

    version: int


@dataclass
class SyncDone:
    """Generator -> controller: it runs the weights of `version` now."""

    version: int
    seconds: float  # receiving and loading them
    drain_s: float = 0.0  # before that, waiting for the turns in its engine to finish (rollout.interruptible false)
    nbytes: int = 0  # what it received: the tensors' bytes (the adapters only, with LoRA)


@dataclass
class Save:
    """Controller -> trainers and generators: checkpoint to `path` (a generator its episodes in flight:
    areal_hpc.checkpoint.in_flight; the controller writes its own state beside them)."""

    version: int
    path: str


@dataclass
class Saved:
    version: int


@dataclass
class Stop:
    reason: str


@dataclass
class Failure:
    """A rank reports an error it cannot recover from; the controller ends the run with it."""

    rank: int
    error: str


MESSAGES = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        Trajectory,
        EvalTrajectory,
        RewardRequest,
        RewardResult,
        TrainBatch,
        TrainResult,
        WeightSync,
        SyncDone,
        Save,
        Saved,
        Stop,
        Failure,
    )
}
TAGS = {name: i + 1 for i, name in enumerate(MESSAGES)}


# --- transport ---------------------------------------------------------------------------------


@dataclass
class Envelope:
    source: int
    msg: Any


class Mailbox:
    """Non-blocking typed send and receive on one communicator."""

    def __init__(self, comm):
        self.comm = comm
        self._pending: list = []  # (request, keep-alive buffer)
        self._arriving: dict[int, deque] = {}
        """Sender -> its messages whose header is in, in order: (arrival number, type name, fields, the
        receives of its buffers)."""
        self._numbers = itertools.count()

    def send(self, dest: int, msg) -> None:
        name = type(msg).__name__
        tag = TAGS[name]
        scalars, arrays = {}, []
        for f in dataclasses.fields(msg):
            value = getattr(msg, f.name)
            if isinstance(value, np.ndarray):
                value = np.ascontiguousarray(value)
                arrays.append((f.name, value))
            else:
                scalars[f.name] = value
        header = (name, scalars, [(k, v.dtype.str, v.shape) for k, v in arrays])
        self._pending.append((self.comm.isend(header, dest=dest, tag=tag), header))
        for _, value in arrays:
            self._pending.append((self.comm.Isend(value, dest=dest, tag=tag + _DATA_TAG), value))
        self._reap()

    def poll(self, source: int | None = None) -> list[Envelope]:
        """Every message that has arrived whole (from `source`, or anyone), without waiting: each sender's in
        the order it sent them, the senders' interleaved in the order their headers came."""
        self._take_headers(source)
        arrived = []
        for sender in self._senders(source):
            arrived += self._arrived(sender)
        self._reap()
        return [envelope for _, envelope in sorted(arrived, key=lambda a: a[0])]

    def recv(self, source: int | None = None, timeout_s: float | None = None, idle_s: float = 0.001) -> Envelope:
        """Wait for one message (polling, so a timeout is possible); raises TimeoutError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._take_headers(source)
            for sender in self._senders(source):
                first = self._arrived(sender, most=1)
                if first:
                    return first[0][1]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no message within {timeout_s} s")
            self._reap()
            time.sleep(idle_s)

    def _take_headers(self, source: int | None) -> None:
        """Receive every header that has arrived and post a receive for each of its buffers (the next
        messages on its data tag from its sender: MPI keeps them in order)."""
        from mpi4py import MPI

        status = MPI.Status()
        src = MPI.ANY_SOURCE if source is None else source
        while self.comm.iprobe(source=src, tag=MPI.ANY_TAG, status=status):
            sender, tag = status.Get_source(), status.Get_tag()
            if tag >= _DATA_TAG:
                raise RuntimeError(f"protocol error: buffer without header from rank {sender}")
            name, scalars, specs = self.comm.recv(source=sender, tag=tag)
            receives = []
            for key, dtype, shape in specs:
                buf = np.empty(shape, dtype=np.dtype(dtype))
                receives.append(self.comm.Irecv(buf, source=sender, tag=tag + _DATA_TAG))
                scalars[key] = buf
            self._arriving.setdefault(sender, deque()).append((next(self._numbers), name, scalars, receives))

    def _senders(self, source: int | None) -> list[int]:
        """The senders with messages arriving: `source`'s only, when given."""
        return [s for s, queue in self._arriving.items() if queue and source in (None, s)]

    def _arrived(self, sender: int, most: int | None = None) -> list[tuple[int, Envelope]]:
        """(arrival number, envelope) of `sender`'s messages whose buffers are all in, from its first on."""
        queue, out = self._arriving[sender], []
        while queue and (most is None or len(out) < most) and (not queue[0][3] or _testall(queue[0][3])):
            number, name, scalars, _ = queue.popleft()
            out.append((number, Envelope(sender, MESSAGES[name](**scalars))))
        return out

    def _reap(self) -> None:
        self._pending = [(r, keep) for r, keep in self._pending if not r.Test()]

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every send has completed, and every buffer of a header taken has arrived (before
        exiting: MPI must not finalize with receives outstanding); a receive still open then is cancelled."""
        from mpi4py import MPI

        deadline = time.monotonic() + timeout_s
        receives = [r for queue in self._arriving.values() for *_, rs in queue for r in rs]
        while self._pending or not MPI.Request.Testall(receives):
            self._reap()
            if time.monotonic() > deadline:
                for r in receives:
                    r.Cancel()
                MPI.Request.Waitall(receives)  # a cancelled receive completes
                if self._pending:
                    raise TimeoutError(f"{len(self._pending)} sends not completed within {timeout_s} s")
                break
            time.sleep(0.001)


def arrive(comm, timeout_s: float | None = None, idle_s: float = 0.01) -> bool:
    """Return once every rank of `comm` has called this (collective; False if `timeout_s` passed first), asleep
    between looks. A rank waiting in a blocking MPI collective polls its core flat out (OpenMPI's progress
    loop; mpi_yield_when_idle does not help under srun): where ranks share cores (the one-node job, a login
    node's test cluster) the ranks that start first would take the cores from those still starting, a vLLM
    engine or Megatron importing. Called before each collective of the start-up and at the end."""
    request = comm.Ibarrier()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(idle_s)
    return True


def _testall(requests: list) -> bool:
    """MPI's Testall (mpi4py imported here, not at this module's import: see areal_hpc.main)."""
    from mpi4py import MPI

    return MPI.Request.Testall(requests)


class ReplicaRelay:
    """A trainer rank's messages from the controller, which addresses each data-parallel replica once,
    at its first rank (`Layout.replica_ranks`): that rank passes every message on to the replica's
    other TP x PP ranks over the replica communicator (`Layout.split_replica`), in the order it came,
    and the others read only from it. So every rank of a replica handles the same messages in the same
    order (their collectives line up), and rank 0 sends a step's batch once per replica, not TP x PP
    times (a point-to-point fan-out, not a broadcast: non-blocking, ordered with the small messages,
    and the same MPI code on CPU and GPU nodes).

    The first rank waits until its peers have each message before it handles it: the collectives it
    starts next do not enter MPI, and MPI moves a large buffer only while its sender is inside MPI.
    """

    def __init__(self, box: Mailbox, replica_comm, source: int, timeout_s: float, for_peer=None):
        self.box, self.source, self.timeout_s = box, source, timeout_s
        self.for_peer = for_peer or (lambda peer, msg: msg)
        """(peer's rank in the replica, message) -> what that peer gets of it (the first rank's own copy whole)."""
        self.peers = Mailbox(replica_comm)
        self.first = replica_comm.Get_rank() == 0
        self.size = replica_comm.Get_size()

    def poll(self) -> list[Envelope]:
        """The controller's messages that have arrived, without waiting (the first rank: once its peers
        have them too)."""
        if not self.first:
            return [Envelope(self.source, env.msg) for env in self.peers.poll(source=0)]
        envelopes = self.box.poll(source=self.source)
        for env in envelopes:
            for peer in range(1, self.size):
                self.peers.send(peer, self.for_peer(peer, env.msg))
        self.peers.flush(self.timeout_s)
        return envelopes
