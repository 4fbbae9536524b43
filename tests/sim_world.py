"""The controller's world simulated without MPI, for tests of the controller's loop (tests/test_controller.py,
tests/test_filtering.py, tests/test_eval.py): generators whose trajectories take random times and carry the
version of the weights they were sampled with, reward workers, a trainer that checks what it is given.
The real controller runs against it; only the other ranks are simulated.
"""

import json
import random
from collections import deque

import numpy as np

from areal_hpc.checkpoint.files import latest_checkpoint
from areal_hpc.config import load_config
from areal_hpc.controller import Controller
from areal_hpc.data import Example
from areal_hpc.layout import Layout, Role
from areal_hpc.protocol import (
    Envelope,
    EvalRequest,
    EvalTrajectory,
    GenerateRequest,
    RewardRequest,
    RewardResult,
    Save,
    Saved,
    Stop,
    SyncDone,
    TrainBatch,
    TrainResult,
    Trajectory,
    WeightSync,
)
from areal_hpc.reward import response_text
from areal_hpc.rundir import prepare_run_dir
from areal_hpc.runtime import RankContext
from areal_hpc.tiny import BOXED, build_tokenizer


class Prompts:
    """A resumable stream of distinct prompts (stands in for areal_hpc.data's)."""

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

    def __init__(self, layout: Layout, tok, seed=0, max_ticks=12, hang: int | None = None, hold=None):
        """`hold(controller, version)`: while true, the trainer's answer that makes `version` waits (a test
        waits for the state it means, not for a race with the checkpoint thread)."""
        self.layout, self.tok, self.rng = layout, tok, random.Random(seed)
        self.max_ticks, self.hang, self.hold = max_ticks, hang, hold
        self.controller = None  # set by `run`
        self.out: deque = deque()  # envelopes for the controller
        self.gen_version = dict.fromkeys(layout.ranks(Role.GENERATOR), 0)
        self.generating: list = []  # [generator, request, index, tokens left, ids, versions]
        self.later: list = []  # (ticks left, envelope)
        self.trained_prompts: list[str] = []
        self.trainer_version = 0
        self.batch_dests: list[tuple[int, int]] = []  # (version, rank) of each TrainBatch
        self.stopped: set[int] = set()

    # Mailbox interface
    def send(self, dest: int, msg) -> None:
        if dest == self.hang:
            return  # this rank has stopped answering
        replica = [dest]  # who gets the message: a trainer's whole replica (protocol.ReplicaRelay)
        if dest in self.layout.ranks(Role.TRAINER):
            replica = self.layout.replica_ranks(self.layout.replica_of(dest))
            assert dest == replica[0], f"{msg} sent to trainer {dest}, not its replica's first rank"
        if isinstance(msg, GenerateRequest | EvalRequest):
            for i in range(msg.n):
                self.generating.append([dest, msg, i, self.rng.randint(1, self.max_ticks), [], []])
        elif isinstance(msg, WeightSync):
            if dest in self.gen_version:
                self.gen_version[dest] = msg.version
                # the first generator loads slowest: 0.01 s x the generators from it on
                seconds = 0.01 * (len(self.gen_version) - list(self.gen_version).index(dest))
                self.later.append((1, Envelope(dest, SyncDone(msg.version, seconds))))
        elif isinstance(msg, RewardRequest):
            response = response_text(self.tok, msg.output_ids)  # as the reward worker decodes
            a, b = msg.target, response.removeprefix(BOXED).removesuffix("}")
            result = RewardResult(msg.request_id, float(a == b), "ok")
            if msg.request_id % 17 == 0:  # now and then a reward call times out: scored 0, counted
                result = RewardResult(msg.request_id, 0.0, "timeout")
            self.later.append((self.rng.randint(0, 2), Envelope(dest, result)))
        elif isinstance(msg, TrainBatch):
            self.batch_dests.append((msg.version, dest))
            self.on_train_batch(dest, msg)
        elif isinstance(msg, Save):
            for rank in replica:
                self.later.append((1, Envelope(rank, Saved(msg.version))))
        elif isinstance(msg, Stop):
            self.stopped.update(replica)

    def on_train_batch(self, dest, batch: TrainBatch) -> None:
        assert batch.version == self.trainer_version, "a step was trained twice or skipped"
        assert (batch.versions[batch.loss_mask == 1] >= batch.version - self.eta).all()
        for k in range(len(batch.cu_seqlens) - 1):
            seq = slice(batch.cu_seqlens[k], batch.cu_seqlens[k + 1])
            prompt = batch.tokens[seq][batch.loss_mask[seq] == 0]
            self.trained_prompts.append(self.tok.decode(prompt))
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
            if isinstance(req, EvalRequest):
                self.out.append(Envelope(gen, EvalTrajectory(req.prompt_index, index, out, "stop")))
            else:
                trajectory = Trajectory(req.group_id, index, out, np.full(len(out), -1.0, np.float32), vers, "stop")
                self.out.append(Envelope(gen, trajectory))
        self.generating = going


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
