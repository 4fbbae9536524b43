#!/usr/bin/env python
"""Controller benchmark: does rank 0 keep up with a cluster? The real `Controller` on rank 0 of a real
MPI world, driven by light simulated ranks that send what the real ones send.

    python tools/bench_controller.py                        # qwen32b on 48 nodes: 512 prompts x 16 trajectories
    python tools/bench_controller.py --mean-tokens 0        # the planner's own trajectory lengths (mean 2,319)
    python tools/bench_controller.py --prompts 8 --group 4 --steps 4 --mean-tokens 300    # CI-sized

The setting comes from the planner (`areal-hpc plan CONFIG --nodes N`): the trajectories of a step
(prompts_per_step x group_size), their lengths (the planner's long-tailed distribution, up to
rollout.max_new_tokens; `--mean-tokens` rescales its median to that mean, 0 keeps the planner's),
and the token rate the cluster produces: its generators at full load, the fastest trajectories can arrive.

```
 rank 0      the real Controller (Mailbox over MPI, gate, buffer, advantages, packer, metrics, checkpoints)
 reward      simulated: RewardResult for each RewardRequest (the trajectory's token ids, as the generator sent
             them: the real reward worker decodes them, rank 0 no longer does) at once; tells the
             generator what rank 0 took
 generator   simulated: for each GenerateRequest its n Trajectory messages (precomputed token ids,
             behaviour logprobs, per-token versions), at most --window trajectories ahead of rank 0; SyncDone,
             Saved (its answers in flight are not simulated)
 trainers    simulated: each data-parallel replica (--tp-pp ranks) gets the controller's messages as a
             real one does (protocol.ReplicaRelay: rank 0 sends its first rank, which passes them on);
             checks each TrainBatch (the step's version, the staleness bound), replies TrainResult, Saved
```

The simulated ranks are few and stand for many (one generator for every engine, `--reward-workers`
reward workers, default one, for all of the cluster's), so they fit on a laptop: the messages rank 0
sees per step, their sizes and their kinds are the cluster's (rank 0 sends a replica's messages once,
to its first rank, whatever its TP x PP); only the tiny per-generator messages (WeightSync, SyncDone,
Stop) are fewer. A replica here has `--tp-pp` ranks (default 1): what its first rank passes on is
counted, apart from rank 0's bytes.
They flood rank 0, which then runs as fast as it can; its CPU time (time.process_time) says what one
core sustains, whatever else the machine runs. The tokenizer rank 0 loads is the project's tiny one.

Printed: the setting, rank 0's sustained trajectories/s and tokens/s (per CPU second and per wall
second), CPU seconds and bytes sent per training step, its CPU per trajectory by part of its loop (where
a regression is), and last `controller headroom: X.Xx` (the
tokens/s rank 0 sustains on one core / the tokens/s the cluster produces). Target: 10x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tools.bench_controller_sim
from tools.bench_controller_sim import Payloads, Prompts, sim_generator, sim_reward, sim_trainer  # noqa: E402

# --- the setting, from the planner ----------------------------------------------------------------


def cluster_config(args):
    """The simulated cluster's config, its node split resolved as a launcher resolves it."""
    from areal_hpc.config import load_config
    from areal_hpc.planner import resolve_split

    over = [f"cluster.nodes={args.nodes}"]
    if args.prompts:
        over.append(f"rollout.prompts_per_step={args.prompts}")
    if args.group:
        over.append(f"rollout.group_size={args.group}")
    return resolve_split(load_config(args.config, over + list(args.overrides)))[0]


def cost_model(cfg, mean_tokens: float):
    """The planner's cost model; with `mean_tokens`, its trajectory-length median set so the mean is that."""
    from areal_hpc.planner import COST, Lengths

    if not mean_tokens:
        return COST
    lo, hi = 1.0, float(cfg.rollout.max_new_tokens)
    for _ in range(60):  # the mean grows with the median: bisect
        mid = (lo + hi) / 2
        lengths = Lengths.from_config(cfg, dataclasses.replace(COST, trajectory_median_tokens=mid))
        lo, hi = (mid, hi) if lengths.mean < mean_tokens else (lo, mid)
    return dataclasses.replace(COST, trajectory_median_tokens=lo)


def setting(args) -> dict:
    """What the cluster does per step and per second (planner), and its layout (areal_hpc.layout)."""
    from areal_hpc.layout import Layout
    from areal_hpc.planner import Lengths, predict

    cfg = cluster_config(args)
    cost = cost_model(cfg, args.mean_tokens)
    lengths = Lengths.from_config(cfg, cost)
    p = predict(cfg, cost=cost)
    lay = Layout.from_config(cfg)
    r = cfg.rollout
    gen_rate = p.tokens / p.t_gen_full  # tokens/s of every generator at full load
    return {
        "config": str(args.config),
        "nodes": cfg.cluster.nodes,
        "prompts": r.prompts_per_step,
        "group": r.group_size,
        "trajectories": r.prompts_per_step * r.group_size,
        "cap": r.max_new_tokens,
        "prompt_tokens": lengths.prompt,
        "median": lengths.median,
        "sigma": lengths.sigma,
        "p_cap": lengths.p_cap,
        "mean_tokens": lengths.mean,
        "cluster_tokens_s": max(gen_rate, p.tokens_per_s()),
        "cluster_step_s": p.t_async(),
        "generators": lay.generators,
        "reward_workers": lay.reward_workers,
        "trainers": lay.trainers,
        "train_tp": lay.train_tp,
        "train_pp": lay.train_pp,
        "train_dp": lay.train_dp,
        "max_staleness": r.max_staleness,
        "max_concurrent": r.max_concurrent,
    }


def bench_config(args, s: dict, root: Path):
    """The config rank 0 runs: the cluster's rollout, ppo and train sections, on the simulated world
    (one generator, `--reward-workers` reward workers, the cluster's data-parallel replicas of `--tp-pp`
    ranks each)."""
    from areal_hpc.config import load_config

    dp, per = s["train_dp"], args.tp_pp
    over = [
        f"experiment.root={root}",
        "experiment.name=bench-controller",
        "cluster.device=cpu",
        f"cluster.nodes={1 + dp * per}",
        "cluster.gpus_per_node=1",
        "allocation.gen_gpus=1",
        "allocation.gen_tp=1",
        f"allocation.train_tp={per}",
        "allocation.train_pp=1",
        f"allocation.reward_workers={args.reward_workers}",
        f"train.total_steps={args.warmup + args.steps}",
        f"train.save_every={args.save_every}",
        "logging.tensorboard=false",
        "eval.every_steps=0",
    ]
    if args.prompts:
        over.append(f"rollout.prompts_per_step={args.prompts}")
    if args.group:
        over.append(f"rollout.group_size={args.group}")
    return load_config(args.config, over + list(args.overrides))


# --- rank 0 -------------------------------------------------------------------------------------------


def run_controller(ctx, side, payloads: Payloads, profile: bool, warmup: int, steps: int) -> dict:
    from areal_hpc.controller import Controller
    from areal_hpc.protocol import Mailbox, TrainResult

    marks = []  # per step: (tokens, trajectories, wall s, cpu s)
    parts = Counter()  # CPU seconds of each part of the loop, over the measured steps (`measuring`)
    measuring = [warmup == 0]

    def timed(part: str, fn):
        def wrapped(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                if measuring[0]:
                    parts[part] += time.process_time() - t0

        return wrapped

    trained = []  # the BatchInfo of the step whose TrainResult is being handled

    class Timed(Controller):
        def on_train_result(self, res):
            trained.append(self.trainers.step)
            super().on_train_result(res)

        def handle(self, src, msg):
            timed(f"handle {type(msg).__name__}", super().handle)(src, msg)
            if isinstance(msg, TrainResult):  # marked once its handling is over: in the window whole, or out
                info = trained.pop()
                marks.append((info.response_tokens, info.sequences, time.perf_counter(), time.process_time()))
                measuring[0] = warmup < len(marks) <= warmup + steps  # from the first measured step's end

    ctl = Timed(ctx, mailbox=Mailbox(ctx.world), prompts=Prompts(payloads))
    ctl.box.poll = timed("receive (Mailbox.poll)", ctl.box.poll)
    for name in ("admit", "train"):
        setattr(ctl, name, timed(name, getattr(ctl, name)))
    marks.append((0, 0, time.perf_counter(), time.process_time()))
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile(time.process_time)  # CPU time: other work on the machine does not count
        prof.runcall(ctl.run)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    else:
        ctl.run()
    done = side.Ibarrier()  # the simulated generator's last trajectories are unread: take them in
    while not done.Test():
        ctl.box.poll()
        time.sleep(0.001)
    t0 = time.process_time()
    state = pickle.dumps(ctl.state())
    state_s = time.process_time() - t0
    return {
        "marks": marks, "parts": dict(parts), "state_bytes": len(state), "state_s": state_s,
        "buffered": len(ctl.rollouts.buffer),
    }  # fmt: skip


def rank_main(args) -> None:
    from mpi4py import MPI

    from areal_hpc.layout import Layout, Role
    from areal_hpc.protocol import arrive
    from areal_hpc.rank_context import RankContext

    s = json.loads(args.setting)
    world = MPI.COMM_WORLD
    side = world.Dup()
    root = Path(args.workdir)
    cfg = bench_config(args, s, root)
    layout = Layout.from_config(cfg)
    if world.Get_size() != layout.world_size:
        raise SystemExit(f"the bench world needs {layout.world_size} ranks, mpirun started {world.Get_size()}")
    rank, role = world.Get_rank(), layout.role_of(world.Get_rank())
    role_comm = layout.split(world)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:  # rank 0 on a core of its own, the simulated ranks on the others
        os.sched_setaffinity(0, cores[:1] if rank == 0 else cores[1:])
    payloads = Payloads(s, seed=args.seed)
    generator = layout.ranks(Role.GENERATOR)[0]
    if role == Role.CONTROLLER:
        from areal_hpc.data.tiny import build_tokenizer
        from areal_hpc.rundir import prepare_run_dir

        run_dir = prepare_run_dir(cfg, fresh=True)
        build_tokenizer().save_pretrained(root / "tokenizer")
        ctx = RankContext(cfg, layout, world, None, run_dir, root / "tokenizer", None, "cpu")
        report = run_controller(ctx, side, payloads, args.profile, args.warmup, args.steps)
    elif role == Role.REWARD:
        report = sim_reward(world, side, generator)
    elif role == Role.GENERATOR:
        report = sim_generator(world, side, payloads, args.window)
    else:
        first = rank == layout.ranks(Role.TRAINER)[0]
        replica = layout.split_replica(role_comm)
        report = sim_trainer(world, replica, first, cfg.rollout.max_staleness, args.train_s)
    if rank != 0:  # after this rank's sends are done (rank 0 reads until every rank is here)
        arrive(side, idle_s=0.001)  # nonblocking, as rank 0's: a blocking barrier would not match it
    reports = world.gather((int(role), report), root=0)
    if rank == 0:
        Path(args.workdir, "result.json").write_text(json.dumps(summarise(args, s, cfg, layout, reports)))


def summarise(args, s: dict, cfg, layout, reports) -> dict:
    """Rank 0's figures over the measured steps, and the checks on what the simulated ranks saw."""
    from areal_hpc.layout import Role

    ctl = reports[0][1]
    marks = ctl["marks"]
    measured = marks[1 + args.warmup :]
    start = marks[args.warmup]
    tokens = sum(m[0] for m in measured)
    trajectories = sum(m[1] for m in measured)
    wall = measured[-1][2] - start[2]
    cpu = measured[-1][3] - start[3]
    cpu_steps = [b[3] - a[3] for a, b in zip(marks[args.warmup :], measured)]

    received, relayed = Counter(), Counter()
    for _, rep in reports[1:]:
        for kind, what, n in rep["received"]:
            received[kind, what] += n
        for kind, what, n in rep.get("relayed", []):
            relayed[kind, what] += n
    steps = args.warmup + args.steps
    per_step = {
        kind: received[kind, "bytes"] / received[kind, "n"] * per
        for kind, per in (
            ("GenerateRequest", s["prompts"]),
            ("RewardRequest", s["trajectories"]),
            ("TrainBatch", received["TrainBatch", "n"] / steps),
        )
        if received[kind, "n"]
    }

    # What the replicas' first ranks pass on to their other TP x PP ranks (--tp-pp ranks a replica here)
    relayed_per_step = relayed["TrainBatch", "bytes"] / steps

    generated = {}
    trained = []
    errors = []
    for role, rep in reports[1:]:
        if role == Role.GENERATOR:
            for p, _, n in rep["generated"]:
                generated.setdefault(p, []).append(n)
        elif role == Role.TRAINER:
            trained += rep["trained"]
            errors += rep["errors"]
    errors += check_trained(generated, trained, steps, cfg.rollout.prompts_per_step, cfg.rollout.group_size)
    return {
        "setting": s,
        "world": layout.world_size,
        "tp_pp": args.tp_pp,
        "steps": args.steps,
        "trajectories_s_cpu": trajectories / cpu,
        "tokens_s_cpu": tokens / cpu,
        "trajectories_s_wall": trajectories / wall,
        "tokens_s_wall": tokens / wall,
        "cpu_s_per_step": cpu / args.steps,
        "cpu_s_per_step_max": max(cpu_steps),
        "tokens_per_step": tokens / args.steps,
        "bytes_per_step": per_step,
        "trainbatch_sends_per_step": received["TrainBatch", "n"] / steps,
        "relayed_bytes_per_step": relayed_per_step,
        "state_bytes": ctl["state_bytes"],
        "state_s": ctl["state_s"],
        "buffered_groups": ctl["buffered"],
        "trained_trajectories": len(trained),
        "errors": errors[:20],
        "cpu_us_per_trajectory": {
            **{part: sec / trajectories * 1e6 for part, sec in sorted(ctl["parts"].items(), key=lambda p: -p[1])},
            "the rest of the loop": (cpu - sum(ctl["parts"].values())) / trajectories * 1e6,
        },
        "headroom": tokens / cpu / s["cluster_tokens_s"],
    }


def check_trained(generated: dict, trained: list, steps: int, prompts_per_step: int, group: int) -> list[str]:
    """What is wrong with what the trainers got: each prompt's trajectories trained together in one
    step, each trajectory the generator sent exactly once (matched by length), `prompts_per_step`
    prompts a step. `generated`: prompt index -> the lengths of its trajectories; `trained`: (version,
    prompt index, length)."""
    errors = []
    by_prompt = {}
    for version, p, n in trained:
        by_prompt.setdefault(p, []).append((version, n))
    for p, seqs in by_prompt.items():
        if len({v for v, _ in seqs}) != 1 or sorted(n for _, n in seqs) != sorted(generated.get(p, [])):
            errors.append(f"prompt {p}: trained {seqs}, generated {sorted(generated.get(p, []))}")
    if len(by_prompt) != steps * prompts_per_step or len(trained) != len(by_prompt) * group:
        errors.append(f"{len(trained)} trajectories of {len(by_prompt)} prompts trained in {steps} steps")
    return errors


# --- the launch -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "qwen32b.yaml"))
    ap.add_argument("--nodes", type=int, default=48, help="the cluster's accelerator nodes (the planner's --nodes)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (default: the config's)")
    ap.add_argument("--group", type=int, default=0, help="trajectories per prompt (default: the config's)")
    ap.add_argument("--mean-tokens", type=float, default=10000, help="mean trajectory length; 0: the planner's")
    ap.add_argument("--steps", type=int, default=6, help="training steps measured")
    ap.add_argument("--warmup", type=int, default=2, help="training steps before the measured ones")
    ap.add_argument("--save-every", type=int, default=4, help="train.save_every of the run")
    ap.add_argument("--reward-workers", type=int, default=1, help="simulated reward workers")
    ap.add_argument("--tp-pp", type=int, default=1, help="simulated trainer ranks per data-parallel replica")
    ap.add_argument("--window", type=int, default=1024, help="trajectories the generator sends ahead of rank 0")
    ap.add_argument("--train-s", type=float, default=0.0, help="seconds the simulated trainer takes per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0 (top functions to stderr)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("overrides", nargs="*", help="config overrides, section.field=value")
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.setting:
        try:
            rank_main(args)
        except BaseException:
            import traceback

            from mpi4py import MPI

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)  # the other ranks would wait for this one forever
        return

    s = setting(args)
    print(
        f"cluster: {s['config']} on {s['nodes']} nodes: {s['generators']} generators, {s['reward_workers']} reward "
        f"workers, trainer TP {s['train_tp']} x PP {s['train_pp']} x DP {s['train_dp']}; {s['prompts']} prompts x "
        f"{s['group']} trajectories per step, each up to {s['cap']:,} tokens, mean {s['mean_tokens']:,.0f}; "
        f"max_staleness {s['max_staleness']}"
    )
    print(
        f"cluster rate (planner): {s['cluster_tokens_s'] / 1e3:,.1f}k tokens/s = "
        f"{s['cluster_tokens_s'] / s['mean_tokens']:,.1f} trajectories/s (generators at full load); "
        f"a step every {s['cluster_step_s']:,.0f} s"
    )
    with tempfile.TemporaryDirectory(prefix="bench-controller-") as work:
        layout_size = 1 + args.reward_workers + 1 + s["train_dp"] * args.tp_pp
        cmd = ["mpirun", "-n", str(layout_size), "--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += [sys.executable, __file__, *sys.argv[1:], "--setting", json.dumps(s), "--workdir", work]
        env = {
            **os.environ,
            "OMPI_MCA_btl": os.environ.get("OMPI_MCA_btl", "self,tcp"),
            "OMPI_MCA_mpi_yield_when_idle": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        }
        print(f"simulated world: {layout_size} ranks; {args.warmup} + {args.steps} steps ...", flush=True)
        proc = subprocess.run(cmd, env=env)
        result_file = Path(work, "result.json")
        if proc.returncode or not result_file.exists():
            sys.exit(f"the benchmark world failed (mpirun exit code {proc.returncode})")
        r = json.loads(result_file.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    report(r)
    if r["errors"]:
        sys.exit("checks failed:\n  " + "\n  ".join(r["errors"]))


def report(r: dict) -> None:
    s = r["setting"]
    print(
        f"rank 0 over {r['steps']} steps ({r['tokens_per_step'] / 1e6:,.2f}M generated tokens each): "
        f"{r['trajectories_s_cpu']:,.0f} trajectories/s and {r['tokens_s_cpu'] / 1e6:,.2f}M tokens/s per CPU "
        f"second, {r['trajectories_s_wall']:,.0f} trajectories/s and {r['tokens_s_wall'] / 1e6:,.2f}M tokens/s "
        "per wall second"
    )
    print(
        f"rank 0 CPU per training step: {r['cpu_s_per_step']:.2f} s (slowest step {r['cpu_s_per_step_max']:.2f} s); "
        f"the cluster's step: {s['cluster_step_s']:,.0f} s"
    )
    total = sum(r["bytes_per_step"].values())
    parts = ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in r["bytes_per_step"].items())
    print(f"rank 0 sends per training step: {total / 2**20:,.1f} MiB ({parts})")
    print(
        f"  one TrainBatch per data-parallel replica ({r['trainbatch_sends_per_step']:.0f} a step); their first "
        f"ranks pass on {r['relayed_bytes_per_step'] / 2**20:,.1f} MiB to the replicas' other ranks "
        f"({r['tp_pp']} ranks a replica here, TP {s['train_tp']} x PP {s['train_pp']} = "
        f"{s['train_tp'] * s['train_pp']} on the cluster)"
    )
    print(
        f"checkpoint state: {r['state_bytes'] / 2**20:,.1f} MiB pickled in {r['state_s']:.2f} s CPU "
        f"({r['buffered_groups']} groups buffered at the end)"
    )
    per = r["cpu_us_per_trajectory"]
    print(
        f"rank 0 CPU per trajectory: {sum(per.values()):,.0f} us, by part of its loop: "
        + ", ".join(f"{part} {us:,.0f}" for part, us in per.items())
    )
    print(
        f"checks: {r['trained_trajectories']} trajectories trained, each once; staleness bound held"
        if not r["errors"]
        else ""
    )
    print(f"controller headroom: {r['headroom']:.1f}x")


if __name__ == "__main__":
    main()
