"""The rank map of the one MPI world: which world rank does what, computed here and nowhere else.

```
 world rank:  0            1..R            R+1 .. R+G                        R+G+1 .. end
 role:        controller   reward workers  generators (1 vLLM engine each)   trainers (TP x PP x DP)
```

Nodes: `cluster.nodes` accelerator nodes are split between generation and training, `allocation.gen_nodes`
of them generating (a number: a launcher resolves `allocation.gen_share` into it once, with the planner,
and the run's config.yaml records it); the controller and the reward workers share
`allocation.reward_nodes` more nodes, CPU nodes. On Slurm these are the three components of the
heterogeneous job; locally every "node" is a set of cores of this machine. The layout reads these numbers
and nothing else: it neither chooses the split nor checks the parallel sizes (areal_hpc.parallel does,
when the config is loaded).

Each rank asks `Layout.role_of(rank)`; `Layout.split(comm)` gives the role communicators. Nothing
else computes ranks: a trainer's (tp, pp, dp) coordinates (`TrainerGrid`, `Layout.trainer_coords`), the
weight-sync groups' sources (`Layout.sync_sources`), members and sizes, and the cores of each rank on one machine
(`Layout.core_plan`) come from here too.

Trainer ranks follow Megatron's default order, tp fastest, then dp, then pp:

    trainer-local rank = tp + TP * (dp + DP * pp)

so a tensor-parallel group is TP consecutive ranks and a pipeline stage TP * DP consecutive ones.
trainer/engine.py checks this formula (`TrainerGrid.coords`) against Megatron's parallel_state.

Placement (`Layout.placement(rank)`): a component's ranks fill its nodes in world-rank order,
`ntasks_per_node` each, which is what srun's default block distribution does (measured on the local
Slurm cluster: in the one `srun --het-group=0,1,2` step SLURM_NODEID counts the nodes of all
components in order and SLURM_LOCALID counts a node's tasks; tests/test_slurm_placement.py). Slurm
shows every task of a node all of the node's `--gpus-per-node` GPUs; within that list generator
engine i of a node holds GPUs [i * gen_tp, (i + 1) * gen_tp) and trainer rank i of a node holds GPU
i, so no GPU of a node is shared and every one is used. Trainer ranks of a node are consecutive, so
Megatron's tensor-parallel groups (consecutive ranks) stay within a node. A `cpu` run places no GPU:
its `gpus_per_node` are process slots.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from areal_hpc.errors import ConfigError
from areal_hpc.parallel import replicas_problem

if TYPE_CHECKING:
    from areal_hpc.config.schema import Config


class Role(enum.IntEnum):
    CONTROLLER = 0
    REWARD = 1
    GENERATOR = 2
    TRAINER = 3


@dataclass(frozen=True)
class Component:
    """One component of the heterogeneous job: a set of identical nodes running one kind of rank."""

    name: str
    roles: tuple[Role, ...]
    nodes: int
    ntasks: int
    gpus_per_node: int
    gpus_per_task: int
    first_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.ntasks)

    @property
    def ntasks_per_node(self) -> int:
        return self.ntasks // self.nodes


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


class TrainerCoords(NamedTuple):
    """A trainer rank's place in the TP x PP x DP grid."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class TrainerGrid:
    """The trainer ranks' TP x PP x DP grid, in trainer-local ranks (the trainers' own communicator and
    torch.distributed world): rank = tp + TP * (dp + DP * pp), Megatron's default order. A mixture of
    experts adds expert parallelism over the TP x DP ranks of a stage (Megatron's expert grid with expert
    tensor parallelism 1): expert rank = (tp + TP * dp) % EP."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    @classmethod
    def of(cls, world: int, tp: int, pp: int, ep: int = 1) -> TrainerGrid:
        """The grid of `world` trainer ranks with parallel sizes tp, pp and ep (dp follows)."""
        problem = replicas_problem(world, tp, pp)
        if not problem and ep != 1 and (ep < 1 or world // (tp * pp) % ep):
            problem = f"allocation.train_ep ({ep}) must divide the trainer's data-parallel size ({world // (tp * pp)})"
        if problem:
            raise ValueError(problem)
        return cls(tp, pp, world // (tp * pp), ep)

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> TrainerCoords:
        """(tp, pp, dp) of trainer-local rank `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"trainer rank {rank} outside 0..{self.size - 1}")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return TrainerCoords(tp, pp, dp)

    def rank(self, tp: int, pp: int, dp: int) -> int:
        """The trainer-local rank at (tp, pp, dp): the inverse of `coords`."""
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp):
            raise ValueError(f"(tp, pp, dp) = {(tp, pp, dp)} outside the grid {self.tp} x {self.pp} x {self.dp}")
        return tp + self.tp * (dp + self.dp * pp)

    def stage_source(self, stage: int) -> int:
        """The trainer-local rank that sends pipeline stage `stage`'s weights: its (tp 0, dp 0) rank."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"pipeline stage {stage} outside 0..{self.pp - 1}")
        return self.rank(0, stage, 0)

    def expert_rank(self, rank: int) -> int:
        """The expert-parallel rank of trainer-local rank `rank`: which E / EP experts of each layer it holds."""
        tp, _, dp = self.coords(rank)
        return (tp + self.tp * dp) % self.ep

    def expert_source(self, stage: int, expert_rank: int) -> int:
        """The trainer-local rank that sends the experts of expert rank `expert_rank` in stage `stage`: the
        stage's first rank holding them (expert rank 0: the stage source)."""
        if not 0 <= expert_rank < self.ep:
            raise ValueError(f"expert rank {expert_rank} outside 0..{self.ep - 1}")
        return self.rank(expert_rank % self.tp, stage, expert_rank // self.tp)


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
    gen_nodes: int
    gen_tp: int
    train_tp: int
    train_pp: int
    uses_gpus: bool
    """Whether generator and trainer ranks hold GPUs: cluster.device is auto or cuda (in a cpu run
    `gpus_per_node` counts process slots and nothing asks Slurm for GPUs)."""
    reward_nodes: int = 1
    """CPU nodes of the controller component (the controller and the reward workers)."""
    train_ep: int = 1
    """Expert-parallel size of the trainer (allocation.train_ep): each trainer holds 1/train_ep of every
    MoE layer's experts, so each stage has train_ep weight-sync sources (`sync_sources`)."""

    # --- derived sizes ---
    @property
    def train_nodes(self) -> int:
        return self.nodes - self.gen_nodes

    @property
    def engines_per_node(self) -> int:
        return self.gpus_per_node // self.gen_tp

    # Counts, as allocation.reward_workers is one: `generators`, `trainers`, `reward_workers`. Their world
    # ranks are `ranks(role)`; a list of ranks is named *_ranks (Controller.generator_ranks, ...).
    @property
    def generators(self) -> int:
        """vLLM engines (generator ranks), each on gen_tp GPUs."""
        return self.gen_nodes * self.engines_per_node

    @property
    def trainers(self) -> int:
        """Trainer ranks, one per GPU."""
        return self.train_nodes * self.gpus_per_node

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
        run names both ('2 nodes: 2 generator(s) at TP 1, 2 trainer rank(s) at TP 2 x PP 1 x DP 1')."""
        return (
            f"{self.nodes} nodes: {self.generators} generator(s) at TP {self.gen_tp}, "
            f"{self.trainers} trainer rank(s) at TP {self.train_tp} x PP {self.train_pp} x DP {self.train_dp}"
        )

    def describe_rank(self, rank: int) -> str:
        """'generator 2 (world rank 5)': how errors and logs name a rank."""
        role = self.role_of(rank)
        return f"{role.name.lower()} {rank - self.ranks(role).start} (world rank {rank})"

    @property
    def components(self) -> tuple[Component, ...]:
        """The heterogeneous job's components, in world-rank order."""
        g = self.gpus_per_node if self.uses_gpus else 0
        return (
            Component(
                "controller", (Role.CONTROLLER, Role.REWARD), self.reward_nodes, 1 + self.reward_workers, 0, 0, 0
            ),
            Component(
                "generator",
                (Role.GENERATOR,),
                self.gen_nodes,
                self.generators,
                g,
                self.gen_tp if g else 0,
                self.ranks(Role.GENERATOR).start,
            ),
            Component(
                "trainer",
                (Role.TRAINER,),
                self.train_nodes,
                self.trainers,
                g,
                1 if g else 0,
                self.ranks(Role.TRAINER).start,
            ),
        )

    def placement(self, rank: int) -> RankPlacement:
        """Component, node, task slot and node-local GPUs of a world rank (see the module docstring)."""
        role = self.role_of(rank)  # raises for a rank outside the world
        nodes_before = 0
        for comp in self.components:
            if rank in comp.ranks:
                break
            nodes_before += comp.nodes
        node, slot = divmod(rank - comp.first_rank, comp.ntasks_per_node)
        first = slot * comp.gpus_per_task
        gpus = tuple(range(first, first + comp.gpus_per_task))
        return RankPlacement(rank, role, comp.name, node, nodes_before + node, slot, gpus)

    def machine_gpus(self, rank: int) -> tuple[int, ...]:
        """A rank's GPUs when every node of the job is this one machine (`areal-hpc run`): the
        accelerator nodes' GPUs laid end to end, generator nodes first (indices into the machine's)."""
        p = self.placement(rank)
        before = 0  # accelerator nodes of the components before this rank's
        for comp in self.components:
            if comp.name == p.component:
                break
            before += comp.nodes if comp.gpus_per_node else 0
        return tuple((before + p.node) * self.gpus_per_node + i for i in p.gpus)

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
        """The rank map of a config whose split is resolved (`allocation.gen_nodes` a number)."""
        c, a = cfg.cluster, cfg.allocation
        if a.gen_nodes is None:
            raise ConfigError(
                "allocation.gen_nodes is not set: the node split (allocation.gen_share) is resolved when a run is "
                "launched and recorded in the run's config.yaml (areal_hpc.planner.resolve_split)"
            )
        return cls(
            c.nodes, c.gpus_per_node, a.reward_workers, a.gen_nodes, a.gen_tp, a.train_tp, a.train_pp,
            uses_gpus=c.device != "cpu", reward_nodes=a.reward_nodes, train_ep=a.train_ep,
        )  # fmt: skip

    def table(self, why: str = "") -> str:
        """The split as a table that adds up, and `why` it is this split (from the planner's
        `resolve_split`)."""
        g = self.gpus_per_node
        rows = [
            ("component", "nodes", "GPUs", "ranks", "world ranks", "what"),
            (
                "controller",
                f"{self.reward_nodes} (CPU)",
                "0",
                str(1 + self.reward_workers),
                f"0-{self.reward_workers}",
                f"controller + {self.reward_workers} reward worker(s)",
            ),
            (
                "generator",
                str(self.gen_nodes),
                str(self.gen_nodes * g),
                str(self.generators),
                _span(self.ranks(Role.GENERATOR)),
                f"{self.generators} vLLM engine(s), TP {self.gen_tp}",
            ),
            (
                "trainer",
                str(self.train_nodes),
                str(self.trainers),
                str(self.trainers),
                _span(self.ranks(Role.TRAINER)),
                f"Megatron TP {self.train_tp} x PP {self.train_pp} x DP {self.train_dp}"
                + (f", EP {self.train_ep}" if self.train_ep > 1 else ""),
            ),
            ("total", f"{self.nodes} + {self.reward_nodes} CPU", str(self.nodes * g), str(self.world_size), "", ""),
        ]
        gen_share = self.gen_nodes * g / (self.nodes * g)
        split = f"generation gets {self.gen_nodes}/{self.nodes} nodes ({gen_share:.0%} of the GPUs)"
        return _columns(rows) + "\n" + split + (f": {why}" if why else "")


def _columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
