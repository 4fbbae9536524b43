"""The controller (world rank 0): moves data between the roles, keeps the staleness bound, orders weight
syncs and checkpoints, writes the metrics. One thread, one event loop, no blocking receive.

```
 loop (until version == train.total_steps, or a stop request, then checkpoint and Stop everyone):
   poll every message that has arrived                                  never waits
    Trajectory     -> its group (rollouts) (an episode: areal_hpc.protocol); its reward: the workflow's own
                      when finite, else a RewardRequest (its final answer's token ids, the Example's target)
                      to the least-loaded reward worker; a lost episode (its workflow raised) gets none,
                      and more than half of a step's worth lost ends the run with the first traceback
    EvalTrajectory -> the evaluation between steps (evals); its reward likewise
    RewardResult   -> to whom it scores: an eval trajectory's to evals; a group's to the rollouts, where
                      the group's last reward finishes it into the buffer (gate.finish), or with
                      rollout.filter_uniform_groups, all its rewards equal, leaves it out
                      (gate.finish(accepted=False): its slot admits another prompt)
    TrainResult    -> version v+1: WeightSync(v+1) to trainers + generators, then every
                      eval.every_steps the eval prompts (GenerateRequest.eval: never buffered, not gated),
                      Save every save_every steps or save_interval_min minutes, the metrics row
    SyncDone       -> generator g runs version v+1 (timing/weight_sync_s, timing/sync_drain_s,
                      timing/weight_sync_bytes)
    Saved          -> all trainer ranks and generators saved (timing/save_s): controller state, then the files'
                      sizes and checksums on the checkpoint thread (areal_hpc.checkpoint)
    Failure        -> end the run, naming the rank
   saves    the checkpoint thread is done with a save -> COMPLETE, then old checkpoints go
   stop?    a stop signal or STOP file: no new step; checkpoint once the running one is back, or
            stop at once when that cannot finish before Slurm's kill (cluster.grace_s for SIGTERM)
   admit    while the gate has room: next prompt -> GenerateRequest to the least-loaded generator
            (waits for: room = (eta + v + 1) * B - accepted - running > 0; TrainResult or a dropped
            group makes room)
   train    when no step is running: stale groups dropped and, if B fresh ones are buffered and no
            older group still running must be trained now, the oldest B (rollouts.take_batch:
            gate.consume, the schedule); advantages, pack, one TrainBatch per
            data-parallel replica, to its first rank (which passes every message on to the replica's
            other TP x PP ranks: protocol.ReplicaRelay)
            (waits for: the previous TrainResult, B finished groups, and an old group still running)
   watch    a rank with work outstanding that has said nothing for train.rank_timeout_s -> error
```

Generators never wait for the trainer: they have up to `rollout.max_concurrent` groups to work on
while the gate is open, and a WeightSync interrupts them only while the weights load. The trainer does
not wait for each step's longest rollout: the B oldest finished groups make a step, unless an older
group still running could not be trained by a later one (the schedule). While it waits, finished groups
hold gate slots: with (eta + 1) * B not well above `max_concurrent` the generators run below it.

The invariant: every consumed token has `v - token version <= eta` (B = `rollout.prompts_per_step`,
eta = `rollout.max_staleness`). The gate (areal_hpc.algo.staleness) bounds how far ahead generation runs;
the schedule holds a step back for a group still running that the step after could no longer train; the
consumption check drops what neither could hold; docs/design.md (The algorithm) says why this holds.
The worked example, B = 3, eta = 1 (room = (eta + v + 1) * B - accepted - running):

```
 v  event                                                   running  accepted  consumed  room
 0  admit g0 .. g5                                          6        0         0         0
 0  g0, g1, g2 done; step 1 takes them (age 0)              3        3         3         0
 1  WeightSync(1); admit g6, g7, g8                         6        3         3         0
 1  g3, g4, g6 done; step 2 waits: g5 (admitted at v0)      3        6         3         0
    is running, and step 3 could not train it
 1  g5 done (interrupted: tokens of v0 and v1); step 2      2        7         6         0
    takes g3, g4, g5 (age 1)
 2  admit g9, g10, g11                                      5        7         6         0
 2  g7, g8, g9 done; step 3 takes g6, g7, g8 (age 1)        2        10        9         0
```

g6..g8 are sampled by version-1 weights: the WeightSync is sent before their requests, and generators
handle messages in order. Without the schedule, step 2 would have taken g3, g4, g6 and step 3 dropped g5
(0 < 2 - 1), generated and never trained. The check still drops a group the schedule could not hold (one
restored from an older checkpoint, or B changed at a resume): counted in `staleness/dropped`, it
leaves `accepted`, so its slot admits another prompt. `rollout.max_staleness = 0` is synchronous RL on
this same path: B groups in flight, train, sync, B more.

Who keeps what (under areal_hpc/; the controller routes between them):

    controller/rollouts.py        the prompt groups: running, buffered, and the staleness gate's counts
    controller/batch.py           a step's data: advantages, minibatches, packed batches per replica
    controller/dispatch.py        generation and rewards to the least-loaded ranks; whom a reward is for
    controller/trainers.py        steps to the replicas, weight syncs, saves; their timings
    controller/stop.py            stop signals, the STOP file, whether a checkpoint fits before the kill
    controller/step_metrics.py    each step's metrics row, the idle clocks
    controller/liveness.py        who owes work and has gone silent
    controller/timeline.py        what each role did when (timeline.jsonl)
    eval/training.py              the evaluation between steps: its rounds and figures
    checkpoint/                   a save from its Save to COMPLETE, off the loop; the files' record
"""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial

import numpy as np

from areal_hpc.checkpoint.controller import Checkpoints, read_state, state_summary
from areal_hpc.checkpoint.files import checkpoint_version
from areal_hpc.checkpoint.in_flight import read_in_flight
from areal_hpc.controller.dispatch import Dispatch
from areal_hpc.controller.liveness import Liveness
from areal_hpc.controller.rollouts import Rollouts
from areal_hpc.controller.step_metrics import StepMetrics
from areal_hpc.controller.stop import StopRequest, install_stop_signals, received_stop_signal
from areal_hpc.controller.timeline import Timeline
from areal_hpc.controller.trainers import Trainers
from areal_hpc.errors import RankFailure
from areal_hpc.eval.training import TrainingEval
from areal_hpc.exit_codes import EXIT_DONE, EXIT_STOPPED
from areal_hpc.layout import Role
from areal_hpc.protocol import (
    EvalTrajectory,
    Failure,
    GenerateRequest,
    Mailbox,
    RewardResult,
    Saved,
    Stop,
    SyncDone,
    TrainResult,
    Trajectory,
)
from areal_hpc.reward import overlong_penalty
from areal_hpc.rundir import changes_at

__all__ = ["Controller", "install_stop_signals", "serve"]  # main.py: install_stop_signals(), then serve(ctx)

log = logging.getLogger(__name__)

IDLE_S = 0.002


def serve(ctx) -> int:
    """Run the controller until the run ends; returns EXIT_DONE or EXIT_STOPPED. Stop signals are read
    from the handlers `install_stop_signals` installed."""
    controller = Controller(ctx, stop_signal=received_stop_signal)
    code = controller.run()
    if controller.stop.at_once:
        # The other ranks may be inside a step for minutes: end every rank now. The launcher sees an
        # aborted run; the batch script sees the stop (or the preemption) and requeues the job.
        ctx.world.Abort(EXIT_STOPPED)
    return code


class Controller:
    def __init__(self, ctx, stop_signal=lambda: None, mailbox=None, prompts=None):
        """`stop_signal()` returns the name of a stop signal received, or None; `mailbox` and `prompts`
        default to the real ones (MPI, the data set); tests pass others."""
        self.ctx, self.cfg, self.layout = ctx, ctx.cfg, ctx.layout
        cfg, layout = self.cfg, self.layout
        self.box = mailbox or Mailbox(ctx.world)
        self.version = 0
        self.rollouts = Rollouts.from_config(cfg.rollout, version=lambda: self.version)  # groups, buffer, gate
        self.tokenizer = _tokenizer(ctx.model_path)
        self.prompts = prompts or _prompt_stream(cfg, self.tokenizer)
        self.evals = TrainingEval.from_config(cfg, self.tokenizer)  # eval.every_steps: never trained on
        r = cfg.reward
        self.overlong_penalty = partial(
            overlong_penalty,
            max_new_tokens=cfg.rollout.max_new_tokens,
            buffer=r.overlong_buffer,
            penalty=r.overlong_penalty,
        )

        generators = len(layout.ranks(Role.GENERATOR))
        self.metrics = StepMetrics(ctx.run_dir, cfg, ctx.resume_from, generators)
        self.timeline = Timeline(ctx.run_dir)  # phases of every role, for tools/plot_run.py
        # A rank's start (engine, weight-sync joins) ends by train.startup_timeout_s, its start-up broadcast
        # within collective_timeout_s more; its own error, naming what it waited for, comes before this limit.
        t = cfg.train
        self.liveness = Liveness(layout, t.rank_timeout_s, t.startup_timeout_s + t.collective_timeout_s)
        self.dispatch = Dispatch(self.box, layout, r.kind, self.liveness, self.timeline, self.metrics.gen_idle)
        self.trainers = Trainers(self.box, layout, cfg, self.liveness, self.timeline, self.metrics.train_idle)
        self.ckpt = Checkpoints(ctx.run_dir, cfg.train.keep_checkpoints, ctx.resume_from)
        self.stop = StopRequest(cfg.cluster, ctx.run_dir, stop_signal)

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        self.restore()
        self.start_eval()
        while not self.finished():
            progressed = False
            for env in self.box.poll():
                self.handle(env.source, env.msg)
                progressed = True
            progressed |= self.ckpt.finish()
            self.check_stop()
            progressed |= self.admit()
            progressed |= self.train()
            self.liveness.check(time.monotonic())
            if not progressed:
                time.sleep(IDLE_S)
        self.shutdown()
        return EXIT_STOPPED if self.stop.reason else EXIT_DONE

    def finished(self) -> bool:
        """The last checkpoint is complete and nothing else is to be done (or a stop without time for one)."""
        if self.stop.at_once:
            return True
        done = not self.more_steps() and not self.trainers.busy
        return done and not self.ckpt.saving and self.ckpt.saved_version == self.version

    def more_steps(self) -> bool:
        """Steps are still to come: the version is below train.total_steps and no stop was asked for."""
        return self.version < self.cfg.train.total_steps and self.stop.reason is None

    def handle(self, src: int, msg) -> None:
        self.liveness.heard(src, time.monotonic())
        if isinstance(msg, Trajectory):
            self.on_trajectory(src, msg)
        elif isinstance(msg, EvalTrajectory):
            self.on_eval_trajectory(src, msg)
        elif isinstance(msg, RewardResult):
            self.on_reward(msg)
        elif isinstance(msg, TrainResult):
            self.on_train_result(msg)
        elif isinstance(msg, SyncDone):
            self.trainers.synced(src, msg)
        elif isinstance(msg, Saved):
            self.liveness.done(src)
            self.ckpt.rank_saved(msg.version, src)
        elif isinstance(msg, Failure):
            log.error("%s reports a failure:\n%s", self.layout.describe_rank(msg.rank), msg.error)
            last = msg.error.strip().splitlines()[-1] if msg.error.strip() else "(no message)"
            raise RankFailure(f"{self.layout.describe_rank(msg.rank)} failed: {last} (see its log)")
        else:
            raise RuntimeError(f"controller got an unexpected {type(msg).__name__} from rank {src}")

    # --- generation and rewards -------------------------------------------------------------

    def admit(self) -> bool:
        """Start prompt groups while the staleness gate has room (requeued ones are already counted)."""
        if not self.more_steps():
            return False
        groups = self.rollouts.admit(self.prompts)
        for group in groups:
            prompt_ids = np.asarray(
                group.example.prompt_ids, np.int32
            )  # formatted and tokenized by areal_hpc.data.dataset
            missing = [i for i, t in enumerate(group.trajectories) if t is None]  # carried over: some came back
            if missing:
                indices = None if len(missing) == group.n else missing
                request = GenerateRequest(group.group_id, prompt_ids, group.example.row, group.n, indices=indices)
                request.resume, group.resume = group.resume or None, {}  # the answers in flight at the checkpoint
                self.dispatch.generate(request)
            for t, reward in zip(group.trajectories, group.rewards):
                if t is not None and not t.error and reward is None:  # came back before the checkpoint, unscored
                    self.reward_for(t, group)
        return bool(groups)

    def start_eval(self) -> None:
        """The eval prompts of this version to the generators, when an evaluation is due (eval.every_steps)."""
        for request in self.evals.start(self.version):
            self.dispatch.generate(request)

    def on_trajectory(self, src: int, traj: Trajectory) -> None:
        """An episode: a lost one is only counted; the workflow's own finite reward wins (no RewardRequest);
        otherwise `reward.kind` scores its final answer."""
        self.metrics.generating()
        self.metrics.arrived(traj)
        group = self.rollouts.add_trajectory(traj)  # lost: recorded, and may finish its group
        if group.generated:  # the generator is done with this group
            self.dispatch.generated(src, traj)
        self.ckpt.arrived(src, traj)  # a save waiting for src's answers in flight keeps it
        if traj.error:
            last = traj.error.strip().splitlines()[-1] if traj.error.strip() else "(no message)"
            log.warning(
                "episode %d of group %d lost: %s (its traceback: the generator's log)", traj.index, traj.group_id, last
            )
            return
        self.reward_for(traj, group)

    def reward_for(self, traj: Trajectory, group) -> None:
        """The workflow's own finite reward, or `reward.kind`'s score of its final answer."""
        if math.isfinite(traj.reward):
            self.rollouts.add_reward(
                traj.group_id, traj.index, traj.reward + self.overlong_penalty(len(traj.answer_ids))
            )
        else:
            self.dispatch.score(traj, group.example.target)

    def on_eval_trajectory(self, src: int, traj: EvalTrajectory) -> None:
        """As `on_trajectory`; a lost eval episode scores 0, counted as the round's workflow error."""
        if self.evals.arrived(traj):
            self.dispatch.generated(src, traj)
        if traj.error:
            self.evals.lost(traj)
        elif math.isfinite(traj.reward):
            self.evals.scored(traj, traj.reward, "ok")
        else:
            self.dispatch.score(traj, self.evals.target(traj))

    def on_reward(self, res: RewardResult) -> None:
        traj = self.dispatch.scored(res)
        if isinstance(traj, EvalTrajectory):
            self.evals.scored(traj, res.reward, res.reason)
            return
        if res.reason != "ok":
            self.metrics.reward_errors += 1
            log.warning(
                "reward of trajectory %d of group %d: %s (scored %s)", traj.index, traj.group_id, res.reason, res.reward
            )
        reward = res.reward + self.overlong_penalty(len(traj.answer_ids))
        self.rollouts.add_reward(traj.group_id, traj.index, reward)  # the last one: into the buffer, or left out

    # --- training ---------------------------------------------------------------------------

    def train(self) -> bool:
        """Send the next step when the trainers are free and B fresh groups are buffered."""
        if self.trainers.busy or not self.more_steps():
            return False
        groups = self.rollouts.take_batch()  # stale groups dropped first (counted, slots freed)
        if not groups:
            return False
        log.info("step %d trains prompts %s", self.version + 1, [g.example.index for g in groups])
        self.trainers.train(groups, self.version)
        return True

    def on_train_result(self, res: TrainResult) -> None:
        info = self.trainers.trained(res)
        self.version = res.version
        if self.more_steps():
            self.trainers.sync(self.version)
            self.start_eval()  # after the WeightSync: the generators load this version first
        t = self.cfg.train
        on_time = t.save_interval_min and time.monotonic() - self.ckpt.last_start >= 60 * t.save_interval_min
        if self.version % t.save_every == 0 or self.version >= t.total_steps or on_time:
            self.save()
        self.metrics.write(
            self.version,
            info,
            res.stats,
            rollouts=self.rollouts.take_metrics(),
            sync_s=self.trainers.last_sync_s,
            drain_s=self.trainers.last_drain_s,
            sync_bytes=self.trainers.last_sync_bytes,
            save_s=self.ckpt.take_stall(),
            evals=self.evals.take_metrics(),
        )

    # --- checkpoints and stopping -----------------------------------------------------------

    def save(self) -> None:
        """Ask every trainer rank to save version v, and snapshot the controller's state now (the
        trainers save exactly this version: a later TrainBatch queues behind the Save)."""
        path = self.ckpt.begin(self.version, self.state(), self.trainers.ranks + self.dispatch.generator_ranks)
        self.trainers.save(self.version, path)
        self.dispatch.save(self.version, path)  # the generators' answers in flight

    def state(self) -> dict:
        """Everything a resumed controller needs to go on as if uninterrupted."""
        layout = self.layout.summary()  # for the resumed run's log: a run may resume at another one
        return {
            "version": self.version,
            "prompts": self.prompts.state_dict(),
            "layout": layout,
            **self.rollouts.state_dict(),
        }

    def restore(self) -> None:
        path = self.ctx.resume_from
        if path is None:
            return
        state = read_state(path)
        if state["version"] != checkpoint_version(path):
            raise RuntimeError(f"{path}: controller state is of version {state['version']}")
        self.version = self.ckpt.saved_version = state["version"]
        self.prompts.load_state_dict(state["prompts"])
        carried_over = self.rollouts.load_state_dict(state, read_in_flight(path, self.version))
        if self.version < self.cfg.train.total_steps:
            self.trainers.sync(self.version)  # the generators start from the initial weights
        carried = state_summary(state)
        log.info(
            "resumed from %s at version %d, written on %s, now on %s",
            path,
            self.version,
            carried.pop("layout"),
            self.layout.summary(),
        )
        log.info("carried over: %s", json.dumps(carried))
        c = carried_over
        log.info(
            "carried over from the running groups (%d): %d answers in flight (%d tokens) and %d episodes that had come "
            "back; dropped as too old to train at the next step (rollout.max_staleness): %d answers (%d tokens), "
            "%d episodes",
            c["groups"], c["answers"], c["tokens"], c["episodes"], c["answers_dropped"], c["tokens_dropped"],
            c["episodes_dropped"],
        )  # fmt: skip
        changed = changes_at(self.ctx.run_dir, self.version)
        if changed:
            log.info("settings changed since this checkpoint:\n  %s", "\n  ".join(changed))

    def check_stop(self) -> None:
        """A stop asked for (controller/stop.py): no new step; checkpoint once the running one is back,
        unless it stops at once."""
        if not self.stop.check(self.checkpoint_eta_s, self.ckpt.saved_version) or self.stop.at_once:
            return
        if not self.trainers.busy and self.ckpt.saved_version < self.version and self.version not in self.ckpt.saving:
            self.save()

    def checkpoint_eta_s(self, now: float) -> float | None:
        """Seconds until a checkpoint of the running step would be complete: the rest of the step and a
        save, each as long as the last one measured (nothing yet measured counts 0); None when there is
        nothing new to save."""
        if not self.trainers.busy and self.ckpt.saved_version == self.version:
            return None
        return self.trainers.step_left_s(now) + self.ckpt.last_save_s

    def shutdown(self) -> None:
        """Everyone stops; the pending sends go out before this rank leaves (unless it stops at once:
        `serve` ends every rank then)."""
        self.metrics.close()
        self.timeline.close()
        self.ckpt.close(wait=not self.stop.at_once)  # the last old checkpoints go
        if self.stop.at_once:
            return
        # every rank the controller addresses; a replica's other ranks hear it from its first (ReplicaRelay)
        for rank in self.dispatch.reward_ranks + self.dispatch.generator_ranks + self.trainers.first_ranks:
            self.box.send(rank, Stop(self.stop.reason or "done"))
        self.box.flush()


# --- helpers -----------------------------------------------------------------------------------


def _prompt_stream(cfg, tokenizer):
    from areal_hpc.data.dataset import PromptStream

    return PromptStream.from_config(cfg, tokenizer)


def _tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
