"""The controller's world simulated without MPI, for tests of the controller's loop (tests/test_controller.py,
tests/test_filtering.py, tests/test_eval.py): generators whose episodes take random times and carry the
version of the weights they were sampled with, reward workers, a trainer that checks what it is given.
The real controller runs against it; only the other ranks are simulated.

Episodes come in three shapes, by (group id + index) % 3: one turn; two turns with a tool's output between
them (context: version -1, no loss); two sequences (the agent rewrote its history: the second starts with
`REWRITTEN` and the prompt again, the trainer counts it in `continued`, not as a prompt trained on).
"""

import json
import random
from collections import deque

import numpy as np

from areal_hpc.checkpoint.files import latest_checkpoint
from areal_hpc.checkpoint.in_flight import write_in_flight
from areal_hpc.config import load_config
from areal_hpc.controller import Controller
from areal_hpc.data.dataset import Example
from areal_hpc.data.tiny import BOXED, build_tokenizer
from areal_hpc.layout import Layout, Role
from areal_hpc.protocol import (
    Envelope,
    EvalTrajectory,
    GenerateRequest,
    RewardRequest,
    RewardResult,
    Save,
    Saved,
    SavedTurn,
    Stop,
    SyncDone,
    TrainBatch,
    TrainResult,
    Trajectory,
    WeightSync,
    context_digest,
)
from areal_hpc.rank_context import RankContext
from areal_hpc.reward import response_text
from areal_hpc.rundir import prepare_run_dir


class Prompts:
    """A resumable stream of distinct prompts (stands in for areal_hpc.data.dataset's)."""

    def __init__(self):
        self.position = 0
        self.tok = build_tokenizer()

    def next(self) -> Example:
        a, b = divmod(self.position, 100)
        self.position += 1
        prompt = f"{a}+{b}="
        return Example(self.position - 1, prompt, str(a + b), "math", prompt_ids=self.tok(prompt)["input_ids"])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class World:
    """The ranks other than the controller, one tick per controller poll."""

    def __init__(
        self, layout: Layout, tok, seed=0, max_ticks=12, hang: int | None = None, hold=None, lose=None, reward=None
    ):
        """`hold(controller, version)`: while true, the trainer's answer that makes `version` waits (a test
        waits for the state it means, not for a race with the checkpoint thread). `lose(group_id, index)`:
        true for the training episodes whose workflow raises (lost); `reward(group_id, index)`: the
        workflow's own reward of a training episode, or None (the reward workers score it)."""
        self.layout, self.tok, self.rng = layout, tok, random.Random(seed)
        self.max_ticks, self.hang, self.hold = max_ticks, hang, hold
        self.lose, self.reward = lose or (lambda g, i: False), reward or (lambda g, i: None)
        self.controller = None  # set by `run`
        self.out: deque = deque()  # envelopes for the controller
        self.gen_version = dict.fromkeys(layout.ranks(Role.GENERATOR), 0)
        self.generating: list = []  # [generator, request, index, tokens left, ids, versions]
        self.later: list = []  # (ticks left, envelope)
        self.trained_prompts: list[str] = []
        self.continued: list[str] = []  # the prompts of trained second sequences (REWRITTEN + prompt)
        self.steps: list[list[str]] = []  # per TrainBatch: the prompts it trains
        self.episodes: dict[str, list] = {}  # prompt -> the training episodes sent for it
        self.reward_requests = 0
        self.trainer_version = 0
        self.batch_dests: list[tuple[int, int]] = []  # (version, rank) of each TrainBatch
        self.stopped: set[int] = set()
        self.resumed: dict[
            tuple[str, int], tuple[list, list]
        ] = {}  # (prompt, index) -> the ids, versions it resumed with

    # Mailbox interface
    def send(self, dest: int, msg) -> None:
        if dest == self.hang:
            return  # this rank has stopped answering
        replica = [dest]  # who gets the message: a trainer's whole replica (protocol.ReplicaRelay)
        if dest in self.layout.ranks(Role.TRAINER):
            replica = self.layout.replica_ranks(self.layout.replica_of(dest))
            assert dest == replica[0], f"{msg} sent to trainer {dest}, not its replica's first rank"
        if isinstance(msg, GenerateRequest):
            for i in range(msg.n) if msg.indices is None else msg.indices:
                saved = (msg.resume or {}).get(i)  # one turn in flight at the checkpoint: it goes on from there
                ids, versions = ([], []) if saved is None else (saved[0].token_ids.tolist(), saved[0].versions.tolist())
                if saved:
                    self.resumed[(msg.row["prompt"], i)] = (list(ids), list(versions))
                self.generating.append([dest, msg, i, self.rng.randint(1, self.max_ticks), ids, versions])
        elif isinstance(msg, WeightSync):
            if dest in self.gen_version:
                self.gen_version[dest] = msg.version
                # the first generator loads slowest: 0.01 s x the generators from it on; each drains 0.03 s or
                # 0.06 s, every other generator the slower one, from one version to the next; each receives
                # 1000 bytes per version
                i = list(self.gen_version).index(dest)
                seconds, drain_s = 0.01 * (len(self.gen_version) - i), 0.03 * (1 + (msg.version + i) % 2)
                self.later.append((1, Envelope(dest, SyncDone(msg.version, seconds, drain_s, 1000 * msg.version))))
        elif isinstance(msg, RewardRequest):
            self.reward_requests += 1
            response = response_text(self.tok, msg.answer_ids)  # as the reward worker decodes
            a, b = msg.target, response.removeprefix(BOXED).removesuffix("}")
            result = RewardResult(msg.request_id, float(a == b), "ok")
            if msg.request_id % 17 == 0:  # now and then a reward call times out: scored 0, counted
                result = RewardResult(msg.request_id, 0.0, "timeout")
            self.later.append((self.rng.randint(0, 2), Envelope(dest, result)))
        elif isinstance(msg, TrainBatch):
            self.batch_dests.append((msg.version, dest))
            self.on_train_batch(dest, msg)
        elif isinstance(msg, Save):
            if dest in self.gen_version:  # its answers in flight, as a generator saves them
                in_flight = {
                    (req.group_id, i): [
                        SavedTurn(context_digest(req.prompt_ids), np.array(ids, np.int32), -np.ones(len(ids), np.float32),
                                  np.array(versions, np.int32))
                    ]
                    for gen, req, i, _, ids, versions in self.generating
                    if gen == dest and ids and not req.eval
                }  # fmt: skip
                write_in_flight(msg.path, dest, msg.version, in_flight)
            for rank in replica:  # a generator answers at once, as the real one does after writing its file
                self.later.append((0 if dest in self.gen_version else 1, Envelope(rank, Saved(msg.version))))
        elif isinstance(msg, Stop):
            self.stopped.update(replica)

    def on_train_batch(self, dest, batch: TrainBatch) -> None:
        assert batch.version == self.trainer_version, "a step was trained twice or skipped"
        assert (batch.versions[batch.loss_mask == 1] >= batch.version - self.eta).all()
        self.steps.append([])
        for k in range(len(batch.cu_seqlens) - 1):
            seq = slice(batch.cu_seqlens[k], batch.cu_seqlens[k + 1])
            sampled = batch.versions[seq] >= 0
            assert sampled.any() and ((batch.loss_mask[seq] == 1) <= sampled).all(), "loss on a context token"
            prompt = self.tok.decode(batch.tokens[seq][: np.argmax(sampled)])  # the context before the first turn
            if prompt.startswith(REWRITTEN):
                self.continued.append(prompt.removeprefix(REWRITTEN))
            else:
                self.trained_prompts.append(prompt)
                self.steps[-1].append(prompt)
        if dest != self.layout.replica_ranks(self.layout.train_dp - 1)[0]:
            return  # the step's last replica's batch, sent last, ends the step
        self.trainer_version += 1
        stats = {"ppo/loss": 0.1, "ppo/logp_mismatch": 0.0}
        first = self.layout.ranks(Role.TRAINER)[0]  # trainer-local rank 0 answers
        self.later.append((self.rng.randint(1, 4), Envelope(first, TrainResult(self.trainer_version, stats))))

    def poll(self, source=None) -> list[Envelope]:
        self.tick()
        out, self.out = list(self.out), deque()
        return out

    def flush(self, timeout_s=60.0):
        pass

    def held(self, msg) -> bool:
        return isinstance(msg, TrainResult) and self.hold is not None and self.hold(self.controller, msg.version)

    def tick(self) -> None:
        waiting = []
        for ticks, env in self.later:
            if self.held(env.msg):
                waiting.append((ticks, env))
            else:
                (self.out.append(env) if ticks <= 0 else waiting.append((ticks - 1, env)))
        self.later = waiting
        going = []
        for item in self.generating:
            gen, req, index, left, ids, versions = item
            if gen in self.stopped:
                continue
            # one token per tick, sampled by the weights the generator has now
            ids.append(self.tok.convert_tokens_to_ids("7"))
            versions.append(self.gen_version[gen])
            item[3] -= 1
            if item[3] > 0:
                going.append(item)
                continue
            answer = str(int(req.prompt_ids.size) % 10)  # right for some prompts, wrong for others
            out = np.array(self.tok(f"{BOXED}{answer}}}")["input_ids"] + ids, np.int32)[: max(len(ids), 3)]
            vers = np.array((versions + [versions[-1]] * len(out))[: len(out)], np.int32)
            if req.eval:
                episode = self.episode(req.prompt_ids, (req.group_id + index) % 3, ids, versions, out, vers)
                num_tokens = len(episode["tokens"])
                self.out.append(Envelope(gen, EvalTrajectory(req.group_id, index, out, num_tokens, "stop")))
                continue
            if self.lose(req.group_id, index):
                trajectory = lost(req.group_id, index, f"Traceback ...\nZeroDivisionError: group {req.group_id}")
            else:
                episode = self.episode(req.prompt_ids, (req.group_id + index) % 3, ids, versions, out, vers)
                reward = self.reward(req.group_id, index)
                trajectory = Trajectory(
                    req.group_id, index, **episode, reward=float("nan") if reward is None else reward
                )
                carried = self.resumed.get((req.row["prompt"], index))
                trajectory.stats["resumed_tokens"] = len(carried[0]) if carried else 0
            self.episodes.setdefault(req.row["prompt"], []).append(trajectory)
            self.out.append(Envelope(gen, trajectory))
        self.generating = going

    def episode(self, prompt_ids, shape: int, turn_ids: list, turn_versions: list, answer, answer_versions) -> dict:
        """The Trajectory fields of an episode of `shape` (the module's docstring): its final answer
        `answer`, and in two-turn shapes a first turn `turn_ids` (the 7s of the ticks)."""
        prompt = [np.asarray(prompt_ids, np.int32), 0, -1]  # tokens, loss mask, versions
        first = [np.asarray(turn_ids, np.int32), 1, np.asarray(turn_versions, np.int32)]
        final = [answer, 1, answer_versions]
        tool = [np.array(self.tok("=9\n")["input_ids"], np.int32), 0, -1]
        rewritten = [np.array(self.tok(REWRITTEN)["input_ids"], np.int32), 0, -1]
        sequences = [[prompt, final], [prompt, first, tool, final], [prompt, first], [rewritten, prompt, final]]
        sequences = [sequences[0]] if shape == 0 else [sequences[1]] if shape == 1 else sequences[2:]
        parts = [p for seq in sequences for p in seq]
        ids = np.concatenate([p[0] for p in parts])
        mask = np.concatenate([np.full(len(p[0]), p[1], np.uint8) for p in parts])
        versions = np.concatenate([np.broadcast_to(np.asarray(p[2], np.int32), len(p[0])) for p in parts])
        return {
            "tokens": ids,
            "seq_lens": np.array([sum(len(p[0]) for p in seq) for seq in sequences], np.int32),
            "loss_mask": mask,
            "behav_logprobs": np.where(mask == 1, -1.0, 0.0).astype(np.float32),
            "versions": versions,
            "answer_ids": answer,
            "finish_reason": "stop",
            "stats": {
                "turns": 1 + (shape > 0),
                "tool_calls": int(shape == 1),
                "tool_errors": int(shape == 1 and len(turn_ids) % 2 == 0),
                "tool_s": 0.5 * (shape == 1),
                "template_rewrites": int(shape == 2),
            },
        }


REWRITTEN = "#"
"""What the second sequence of a two-sequence episode starts with, before the prompt."""


def lost(group_id: int, index: int, error: str) -> Trajectory:
    """A lost episode: its workflow raised `error`; no tokens."""
    empty = np.zeros(0, np.int32)
    return Trajectory(
        group_id, index, empty, empty, empty.astype(np.uint8), empty.astype(np.float32), empty, empty, "stop",
        error=error,
    )  # fmt: skip


def make(tmp_path, *overrides):
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"experiment.root={tmp_path}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=3",
            "rollout.max_concurrent=32",
            "ppo.minibatches=2",
            "train.total_steps=12",
            "train.save_every=5",
            "sft.examples=0",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    run_dir = prepare_run_dir(cfg)
    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_dir)
    layout = Layout.from_config(cfg)
    return cfg, layout, run_dir, tok_dir


def run(cfg, layout, run_dir, tok_dir, world, prompts, stop_at=None, signal="SIGUSR2", stop_when=None):
    ctx = RankContext(cfg, layout, None, None, run_dir, tok_dir, latest_checkpoint(run_dir))
    world.eta = cfg.rollout.max_staleness
    holder = {}
    if stop_at is not None:
        stop_when = stop_when or (lambda c: c.version >= stop_at)

    def stop_signal():
        return signal if stop_when is not None and stop_when(holder["c"]) else None

    c = holder["c"] = world.controller = Controller(ctx, stop_signal=stop_signal, mailbox=world, prompts=prompts)
    code = c.run()
    return c, code


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
