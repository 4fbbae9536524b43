"""The rank map of the one MPI world: which world rank does what, computed here and nowhere else.

```
 world rank:  0            1..R            R+1 .. R+G                        R+G+1 .. end
 role:        controller   reward workers  generators (1 vLLM engine each)   trainers (TP x PP x DP)
```

GPUs: the `cluster.nodes x cluster.gpus_per_node` GPUs are split between generation and training,
`allocation.gen_gpus` of them generating (a number: a launcher resolves `allocation.gen_share` into it
once, with the planner, and the run's config.yaml records it). The GPUs are counted node after node;
the generators take the first gen_gpus (engine i GPUs [i * gen_tp, (i + 1) * gen_tp)), the trainers the
rest, one each, so a node may hold both. The controller and the reward workers run on
`allocation.reward_nodes` CPU nodes of their own, or with reward_nodes 0 (`auto` on up to FEW_GPU_NODES
nodes) on the first GPU node's CPUs. On Slurm these nodes make the components of the job (below); locally
every "node" is a set of cores of this machine.
The layout reads these numbers and nothing else: it neither chooses the split nor checks the parallel
sizes (areal_hpc.parallel does, when the config is loaded).

Each rank asks `Layout.role_of(rank)`; `Layout.split(comm)` gives the role communicators. Nothing
else computes ranks: a trainer's (tp, pp, dp) coordinates (`TrainerGrid`, `Layout.trainer_coords`), the
weight-sync groups' sources (`Layout.sync_sources`), members and sizes, and the cores of each rank on one machine
(`Layout.core_plan`) come from here too.

Trainer ranks follow Megatron's default order, tp fastest, then dp, then pp:

    trainer-local rank = tp + TP * (dp + DP * pp)

so a tensor-parallel group is TP consecutive ranks and a pipeline stage TP * DP consecutive ones.
trainer/engine.py checks this formula (`TrainerGrid.coords`) against Megatron's parallel_state.

Placement (`Layout.placement(rank)`): every rank's node follows from its GPUs (controller and reward
workers: the first node of their component, spread in blocks over its nodes), and a node's tasks are
numbered in world-rank order. The Slurm job's components are the controller's CPU nodes and runs of GPU
nodes that hold as many tasks each (a node that holds the controller, or both generators and trainers,
often differs from its neighbours), so that srun's default block distribution places every component's
ranks, `ntasks_per_node` a node, and each task gets an even share of its node's CPUs (measured on the
local Slurm cluster: in the one `srun --het-group=0,1,...` step SLURM_NODEID counts the nodes of all
components in order and SLURM_LOCALID counts a node's tasks; tests/test_slurm_placement.py). Slurm shows
every task of a node all of the node's `--gpus-per-node` GPUs; within that list a rank takes the node-local
indices of its own GPUs, so no GPU of a node is shared and every one is used. Trainer ranks of a node are
consecutive and start where a tensor-parallel group may (`parallel.tp_alignment`), so Megatron's
tensor-parallel groups stay within a node. A `cpu` run places no GPU: its `gpus_per_node` are process slots.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

from areal_hpc.errors import ConfigError
from areal_hpc.parallel import TrainerCoords, TrainerGrid

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config


class Role(enum.IntEnum):
    CONTROLLER = 0
    REWARD = 1
    GENERATOR = 2
    TRAINER = 3


FEW_GPU_NODES = 4
"""`allocation.reward_nodes: auto`: on up to this many GPU nodes the controller and the reward workers share the
first GPU node's CPUs (no CPU node: a one-node job is one node); on more, they get a CPU node of their own."""


def resolve_reward_nodes(reward_nodes: int | str, nodes: int) -> int:
    """The CPU nodes of the controller component: `allocation.reward_nodes`, `auto` by FEW_GPU_NODES."""
    if reward_nodes == "auto":
        return 0 if nodes <= FEW_GPU_NODES else 1
    return int(reward_nodes)


@dataclass(frozen=True)
class Component:
    """One component of the Slurm job: nodes that run the same number of tasks each (the controller's CPU
    nodes may hold one fewer on the last ones), world ranks first_rank onwards, consecutive."""

    name: str
    roles: tuple[Role, ...]
    nodes: int
    ntasks: int
    gpus_per_node: int
    """GPUs asked of Slurm per node (0 for CPU nodes and in a cpu run)."""
    first_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.ntasks)

    @property
    def ntasks_per_node(self) -> int:
        """Tasks on each node (at most, for the controller's CPU nodes)."""
        return -(-self.ntasks // self.nodes)

    @property
    def cpu_nodes(self) -> bool:
        """Whether these are the controller's CPU nodes (allocation.reward_nodes), not GPU nodes."""
        return self.name == "controller"


@dataclass(frozen=True)
class RankPlacement:
    """Where one world rank runs: `Layout.placement(rank)`."""

    rank: int
    role: Role
    component: str
    node: int
    """Index of its node within its component (0 .. component.nodes - 1)."""
    job_node: int
    """Index of its node among all nodes of the job, components in order (SLURM_NODEID in the one step)."""
    slot: int
    """Its task index on that node (SLURM_LOCALID)."""
    gpus: tuple[int, ...]
    """Indices into the GPUs Slurm shows every task of the node (CUDA_VISIBLE_DEVICES); empty for the
    controller, the reward workers and every rank of a cpu run."""


class Cores(NamedTuple):
    """Where a rank runs on one machine (`Layout.core_plan`)."""

    cores: list[int]
    threads: int
    """Its compute threads (OMP_NUM_THREADS)."""


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    reward_workers: int
    gen_gpus: int
    gen_tp: int
    train_tp: int
    train_pp: int
    uses_gpus: bool
    """Whether generator and trainer ranks hold GPUs: cluster.device is auto or cuda (in a cpu run
    `gpus_per_node` counts process slots and nothing asks Slurm for GPUs)."""
    reward_nodes: int = 0
    """CPU nodes of the controller component (the controller and the reward workers); 0: they run on the
    first GPU node (`resolve_reward_nodes`)."""
    train_ep: int = 1
    """Expert-parallel size of the trainer (allocation.train_ep): each trainer holds 1/train_ep of every
    MoE layer's experts, so each stage has train_ep weight-sync sources (`sync_sources`)."""

    # --- derived sizes ---
    @property
    def gpus(self) -> int:
        """Every GPU of the job (process slots in a cpu run)."""
        return self.nodes * self.gpus_per_node

    # Counts, as allocation.reward_workers is one: `generators`, `trainers`, `reward_workers`. Their world
    # ranks are `ranks(role)`; a list of ranks is named *_ranks (Controller.generator_ranks, ...).
    @property
    def generators(self) -> int:
        """vLLM engines (generator ranks), each on gen_tp GPUs."""
        return self.gen_gpus // self.gen_tp

    @property
    def trainers(self) -> int:
        """Trainer ranks, one per GPU."""
        return self.gpus - self.gen_gpus

    @property
    def train_dp(self) -> int:
        return self.trainers // (self.train_tp * self.train_pp)

    @property
    def world_size(self) -> int:
        return 1 + self.reward_workers + self.generators + self.trainers

    # --- ranks ---
    def ranks(self, role: Role) -> range:
        r, g = self.reward_workers, self.generators
        return {
            Role.CONTROLLER: range(0, 1),
            Role.REWARD: range(1, 1 + r),
            Role.GENERATOR: range(1 + r, 1 + r + g),
            Role.TRAINER: range(1 + r + g, 1 + r + g + self.trainers),
        }[role]

    def role_of(self, rank: int) -> Role:
        for role in Role:
            if rank in self.ranks(role):
                return role
        raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    # --- trainer grid and weight sync ---
    @property
    def trainer_grid(self) -> TrainerGrid:
        return TrainerGrid(self.train_tp, self.train_pp, self.train_dp, self.train_ep)

    def trainer_coords(self, rank: int) -> TrainerCoords:
        """(tp, pp, dp) of trainer world rank `rank`: `dp` is the data-parallel replica whose batch it
        trains on, `pp` the pipeline stage whose weights it holds."""
        if self.role_of(rank) != Role.TRAINER:
            raise ValueError(f"{self.describe_rank(rank)} is not a trainer")
        return self.trainer_grid.coords(rank - self.ranks(Role.TRAINER).start)

    def stage_source_rank(self, stage: int) -> int:
        """World rank of the trainer that sends pipeline stage `stage`'s weights: its (tp 0, dp 0) rank,
        rank 0 of the stage's weight-sync group."""
        return self.ranks(Role.TRAINER).start + self.trainer_grid.stage_source(stage)

    def sync_sources(self) -> list[tuple[int, int, int]]:
        """(stage, expert rank, world rank) of every weight-sync group's source, in the order every rank
        opens and joins the groups: stages in index order, expert ranks in order within a stage.

        Group (s, e)'s source is the first trainer of stage s whose expert rank is e
        (`TrainerGrid.expert_source`); (s, 0)'s is the stage's (tp 0, dp 0) rank (`stage_source_rank`),
        which also sends the stage's dense tensors. With train_ep 1 that is one group per stage.
        TP 2, PP 2, DP 2, EP 2, trainers from world rank 4: [(0, 0, 4), (0, 1, 5), (1, 0, 8), (1, 1, 9)]."""
        first, grid = self.ranks(Role.TRAINER).start, self.trainer_grid
        return [(s, e, first + grid.expert_source(s, e)) for s in range(self.train_pp) for e in range(self.train_ep)]

    @property
    def weight_sync_size(self) -> int:
        """Members of each weight-sync group: its source and every generator engine's gen_tp workers."""
        return 1 + self.generators * self.gen_tp

    def weight_sync_ranks(self, rank: int) -> tuple[int, ...]:
        """Weight-sync group ranks of generator world rank `rank`'s engine workers, by their TP rank, the
        same in every group: 1 + generator index * gen_tp + tp (group rank 0 is the group's source)."""
        if self.role_of(rank) != Role.GENERATOR:
            raise ValueError(f"{self.describe_rank(rank)} is not a generator")
        first = 1 + (rank - self.ranks(Role.GENERATOR).start) * self.gen_tp
        return tuple(range(first, first + self.gen_tp))

    def replica_ranks(self, replica: int) -> list[int]:
        """World ranks of data-parallel replica `replica`: its TP x PP trainers in world-rank order, so its
        (tp 0, pp 0) rank, the one the controller sends to, first."""
        if not 0 <= replica < self.train_dp:
            raise ValueError(f"data-parallel replica {replica} outside 0..{self.train_dp - 1}")
        first, grid = self.ranks(Role.TRAINER).start, self.trainer_grid
        return [first + grid.rank(t, pp, replica) for pp in range(self.train_pp) for t in range(self.train_tp)]

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of a trainer world rank."""
        return self.trainer_coords(rank).dp

    def split_replica(self, role_comm):
        """The communicator of this trainer rank's data-parallel replica (`role_comm.Split`, collective
        over the trainers), ranked as `replica_ranks`: the replica's first rank is its rank 0."""
        rank = self.ranks(Role.TRAINER).start + role_comm.Get_rank()
        return role_comm.Split(color=self.replica_of(rank), key=rank)

    def summary(self) -> str:
        """The split in one line: what a checkpoint records of the layout it was written at, and how a resumed
        run names both ('1 node(s) x 4 GPUs: 2 generator(s) at TP 1, 2 trainer rank(s) at TP 2 x PP 1 x DP 1')."""
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} GPUs: {self.generators} generator(s) at TP {self.gen_tp}, "
            f"{self.trainers} trainer rank(s) at TP {self.train_tp} x PP {self.train_pp} x DP {self.train_dp}"
        )

    def describe_rank(self, rank: int) -> str:
        """'generator 2 (world rank 5)': how errors and logs name a rank."""
        role = self.role_of(rank)
        return f"{role.name.lower()} {rank - self.ranks(role).start} (world rank {rank})"

    def first_gpu(self, rank: int) -> int:
        """The job-wide index of a generator's or trainer's first GPU: GPUs counted node after node, the
        generators' first."""
        role = self.role_of(rank)
        if role == Role.GENERATOR:
            return (rank - self.ranks(role).start) * self.gen_tp
        if role == Role.TRAINER:
            return self.gen_gpus + rank - self.ranks(role).start
        raise ValueError(f"{self.describe_rank(rank)} holds no GPU")

    @cached_property
    def components(self) -> tuple[Component, ...]:
        """The Slurm job's components, in world-rank order: the controller's CPU nodes (none with reward_nodes 0),
        then the GPU nodes in runs of nodes that run as many tasks each (`_gpu_components`)."""
        comps = []
        if self.reward_nodes:
            comps.append(
                Component(
                    "controller", (Role.CONTROLLER, Role.REWARD), self.reward_nodes, 1 + self.reward_workers, 0, 0
                )
            )
        g = self.gpus_per_node if self.uses_gpus else 0
        for name, _, nodes, ranks in self._gpu_components:
            roles = tuple(sorted({self.role_of(r) for r in ranks}))
            comps.append(Component(name, roles, nodes, len(ranks), g, ranks[0]))
        return tuple(comps)

    @property
    def busiest_gpu_node(self) -> int:
        """The most tasks a GPU node runs: each needs a CPU of the node (`cluster.cpus_per_node`)."""
        return max(comp.ntasks_per_node for comp in self.components if not comp.cpu_nodes)

    @cached_property
    def _gpu_node(self) -> list[int | None]:
        """Each world rank's GPU node (None on the controller's CPU nodes)."""
        on_cpu_nodes = Role.CONTROLLER, Role.REWARD
        return [
            (None if self.reward_nodes else 0)
            if self.role_of(r) in on_cpu_nodes
            else self.first_gpu(r) // self.gpus_per_node
            for r in range(self.world_size)
        ]

    @cached_property
    def _gpu_components(self) -> list[tuple[str, int, int, list[int]]]:
        """(name, first GPU node, nodes, world ranks) of each GPU component: consecutive GPU nodes running as
        many tasks each, so that every task of a component gets the same share of its node (`cpus_per_task`).
        Named by the role they run, 'generator' or 'trainer', or 'shared' when they run several; a name that
        recurs numbered ('shared-2')."""
        on_node: list[list[int]] = [[] for _ in range(self.nodes)]  # each GPU node's ranks, in rank order
        for rank, node in enumerate(self._gpu_node):
            if node is not None:
                on_node[node].append(rank)
        runs: list[list[int]] = []
        for node in range(self.nodes):
            if runs and len(on_node[runs[-1][0]]) == len(on_node[node]):
                runs[-1].append(node)
            else:
                runs.append([node])
        out, seen = [], Counter()
        for run in runs:
            ranks = [r for node in run for r in on_node[node]]
            roles = {self.role_of(r) for r in ranks}
            name = roles.pop().name.lower() if len(roles) == 1 else "shared"
            seen[name] += 1
            out.append((name if seen[name] == 1 else f"{name}-{seen[name]}", run[0], len(run), ranks))
        return out

    def placement(self, rank: int) -> RankPlacement:
        """Component, node, task slot and node-local GPUs of a world rank (see the module docstring)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return self._placements[rank]

    @cached_property
    def _placements(self) -> tuple[RankPlacement, ...]:
        out, slots = [], Counter()
        per_cpu_node = -(-(1 + self.reward_workers) // max(self.reward_nodes, 1))  # block distribution
        for rank in range(self.world_size):
            role, gnode = self.role_of(rank), self._gpu_node[rank]
            if gnode is None:
                component, node, job_node = "controller", rank // per_cpu_node, rank // per_cpu_node
            else:
                name, start = next((n, s) for n, s, k, _ in self._gpu_components if s <= gnode < s + k)
                component, node, job_node = name, gnode - start, self.reward_nodes + gnode
            gpus = ()
            if role in (Role.GENERATOR, Role.TRAINER) and self.uses_gpus:
                local = self.first_gpu(rank) % self.gpus_per_node
                gpus = tuple(range(local, local + (self.gen_tp if role == Role.GENERATOR else 1)))
            out.append(RankPlacement(rank, role, component, node, job_node, slots[job_node], gpus))
            slots[job_node] += 1
        return tuple(out)

    def machine_gpus(self, rank: int) -> tuple[int, ...]:
        """A rank's GPUs when every node of the job is this one machine (`areal-hpc run`): the job-wide
        indices of its GPUs (indices into the machine's)."""
        p = self.placement(rank)
        return tuple((p.job_node - self.reward_nodes) * self.gpus_per_node + i for i in p.gpus)

    def core_plan(self, cores: list[int]) -> dict[int, Cores]:
        """World rank -> where a generator or trainer rank runs when every rank shares this machine's
        `cores` (the controller and reward workers float: absent).

        Enough cores: disjoint equal shares, one thread per core, so each rank has its own "device", as
        on a cluster. 2 cores, 1 generator (rank 2) + 1 trainer (rank 3): {2: ([c0], 1), 3: ([c1], 1)}.
        Fewer cores than these ranks: every one of them runs anywhere with one thread, and the kernel's
        scheduler shares the cores (a core a generator leaves idle goes to a trainer). Several threads
        per rank would be worse than none pinned: a rank's parallel regions wait for threads that are not
        running.
        """
        ranks = [*self.ranks(Role.GENERATOR), *self.ranks(Role.TRAINER)]
        if len(cores) < len(ranks):
            return {r: Cores(list(cores), 1) for r in ranks}
        share = len(cores) // len(ranks)
        return {r: Cores(cores[i * share : (i + 1) * share], share) for i, r in enumerate(ranks)}

    def rank_table(self) -> str:
        """One row per world rank: rank, role, component, node (within the component), gpus."""
        rows = [("rank", "role", "component", "node", "gpus")]
        for r in range(self.world_size):
            p = self.placement(r)
            gpus = ",".join(map(str, p.gpus)) or "-"
            rows.append((str(r), p.role.name.lower(), p.component, str(p.node), gpus))
        return _columns(rows)

    def split(self, comm):
        """The role communicator of this rank: `comm.Split` by role, ordered by world rank."""
        rank = comm.Get_rank()
        if comm.Get_size() != self.world_size:
            raise RuntimeError(f"the MPI world has {comm.Get_size()} ranks; the layout needs {self.world_size}")
        return comm.Split(color=int(self.role_of(rank)), key=rank)

    # --- construction ---
    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        """The rank map of a config whose split is resolved (`allocation.gen_gpus` a number)."""
        c, a = cfg.cluster, cfg.allocation
        if a.gen_gpus is None:
            raise ConfigError(
                "allocation.gen_gpus is not set: the GPU split (allocation.gen_share) is resolved when a run is "
                "launched and recorded in the run's config.yaml (areal_hpc.planner.resolve_split)"
            )
        return cls(
            c.nodes, c.gpus_per_node, a.reward_workers, a.gen_gpus, a.gen_tp, a.train_tp, a.train_pp,
            uses_gpus=c.device != "cpu", reward_nodes=resolve_reward_nodes(a.reward_nodes, c.nodes),
            train_ep=a.train_ep,
        )  # fmt: skip

    def table(self, why: str = "") -> str:
        """The split as a table that adds up, and `why` it is this split (from the planner's
        `resolve_split`)."""
        gen, train = self.ranks(Role.GENERATOR), self.ranks(Role.TRAINER)
        cpu_nodes = f"{self.reward_nodes} (CPU)" if self.reward_nodes else "on node 0"
        rows = [
            ("role", "nodes", "GPUs", "ranks", "world ranks", "what"),
            (
                "controller",
                cpu_nodes,
                "0",
                str(1 + self.reward_workers),
                f"0-{self.reward_workers}",
                f"controller + {self.reward_workers} reward worker(s)",
            ),
            (
                "generator",
                self._node_span(gen),
                str(self.gen_gpus),
                str(self.generators),
                span(gen),
                f"{self.generators} vLLM engine(s), TP {self.gen_tp}",
            ),
            (
                "trainer",
                self._node_span(train),
                str(self.trainers),
                str(self.trainers),
                span(train),
                f"Megatron TP {self.train_tp} x PP {self.train_pp} x DP {self.train_dp}"
                + (f", EP {self.train_ep}" if self.train_ep > 1 else ""),
            ),
            (
                "total",
                f"{self.nodes}" + (f" + {self.reward_nodes} CPU" if self.reward_nodes else ""),
                str(self.gpus),
                str(self.world_size),
                "",
                "",
            ),
        ]
        split = (
            f"generation gets {self.gen_gpus} of {self.gpus} GPUs ({self.gen_gpus / self.gpus:.0%}) on "
            f"{self.nodes} node(s) of {self.gpus_per_node}"
        )
        return _columns(rows) + "\n" + split + (f": {why}" if why else "")

    def _node_span(self, ranks: range) -> str:
        """'0-8': the GPU nodes a role's ranks run on."""
        return span(sorted({self.placement(r).job_node - self.reward_nodes for r in ranks}))


def _columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def span(values: Sequence[int]) -> str:
    """'2-5' for consecutive values (a range of ranks, GPUs), '2' for one."""
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
