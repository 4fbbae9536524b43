"""Which parallel sizes a model and a cluster allow: the one place these rules live. Config validation,
the planner's search, the GPU split, the layout's trainer grid and the trainer's engine all ask here.

```
 size                   must divide                                              why
 allocation.gen_tp      cluster.gpus_per_node                                    a vLLM engine never spans nodes
                        model.num_attention_heads, num_key_value_heads           vLLM splits the heads evenly
 allocation.train_tp    model.num_attention_heads, num_key_value_heads,          Megatron's tensor-parallel layers
                        intermediate_size, vocab_size                            split each of them evenly
 allocation.train_pp    model.num_layers                                         pipeline stages of equal depth
 allocation.train_ep    model.num_experts (MoE models only),                     each expert-parallel rank holds
                        the trainer's data-parallel size                          E / ep whole experts; the experts
                                                                                 split over data-parallel ranks
 allocation.gen_gpus    (is a multiple of) gen_tp, and train_tp                  whole engines; the trainer's GPUs
                        (gpus_per_node when train_tp spans nodes)                start where a TP group may start
 train_tp x train_pp    the trainer's GPUs: nodes x gpus_per_node - gen_gpus     data-parallel replicas are whole
 1 <= allocation.gen_gpus <= nodes x gpus_per_node - 1                           generation and training each
                                                                                 get at least a GPU
```

Each rule is a function returning the problem as a sentence that names the fields (None when there is
none); `check` raises the first as a ConfigError. Numbers in, no config object: the planner asks for
every size it considers. `TrainerGrid` is the trainer ranks' TP x PP x DP (x EP) grid these sizes make,
in Megatron's rank order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from areal_hpc.errors import ConfigError

if TYPE_CHECKING:
    from areal_hpc.arch import QwenArch


def _divides(size: int, name: str, of: list[tuple[str, int]]) -> str | None:
    for what, n in of:
        if size < 1 or n % size:
            return f"{name} ({size}) must divide {what} ({n})"
    return None


def gen_tp_problem(arch: QwenArch, gpus_per_node: int, tp: int) -> str | None:
    """A vLLM engine's tensor-parallel size: within a node, splitting the heads evenly."""
    if tp < 1 or gpus_per_node % tp:
        return f"allocation.gen_tp ({tp}) must divide cluster.gpus_per_node ({gpus_per_node}): one vLLM engine never spans nodes"
    return _divides(tp, "allocation.gen_tp", _heads(arch))


def train_tp_problem(arch: QwenArch, tp: int, name: str = "model") -> str | None:
    """The trainer's tensor-parallel size: Megatron splits the heads, the MLP and the vocabulary evenly.
    `name`: the config section of `arch`, in the problem (`distill.teacher` is split as the model is)."""
    return _divides(
        tp,
        "allocation.train_tp",
        [
            *_heads(arch, name),
            (f"{name}.intermediate_size", arch.intermediate_size),
            (f"{name}.vocab_size", arch.vocab_size),
        ],
    )


def train_pp_problem(arch: QwenArch, pp: int, name: str = "model") -> str | None:
    """The trainer's pipeline-parallel size: stages of equal depth (`name` as train_tp_problem's)."""
    return _divides(pp, "allocation.train_pp", [(f"{name}.num_layers", arch.num_layers)])


def train_ep_problem(arch: QwenArch, ep: int, dp: int | None = None) -> str | None:
    """The trainer's expert-parallel size: whole experts per rank, over the data-parallel ranks (the
    experts are not split by tensor parallelism). `dp`: the trainer's data-parallel size, when known."""
    if ep == 1:
        return None
    if not arch.moe:
        return f"allocation.train_ep ({ep}) applies to mixture-of-experts models only; model.path is a dense {arch.model_type}: set allocation.train_ep=1"
    problem = _divides(ep, "allocation.train_ep", [("model.num_experts", arch.num_experts)])
    if problem or dp is None:
        return problem
    return _divides(ep, "allocation.train_ep", [("the trainer's data-parallel size", dp)])


def gpus_problem(nodes: int, gpus_per_node: int) -> str | None:
    """Generation and training each get at least a GPU, so the job needs two."""
    if nodes * gpus_per_node < 2:
        return (
            f"cluster.nodes x cluster.gpus_per_node ({nodes} x {gpus_per_node}) is {nodes * gpus_per_node} GPU: this "
            "system needs one GPU to generate and one to train, at the same time; use a node with 2 or more GPUs "
            "(cluster.gpus_per_node) or 2 nodes (--nodes 2)"
        )
    return None


def split_problem(
    nodes: int, gpus_per_node: int, gen_gpus: int, gen_tp: int, train_tp: int, train_pp: int
) -> str | None:
    """`gen_gpus` of the `nodes x gpus_per_node` GPUs generating (from the first node's first GPU on), the rest
    training: each role gets a GPU, the generators whole engines, the trainer whole TP x PP replicas whose
    tensor-parallel groups each lie within a node (`Layout`'s placement gives GPUs in order)."""
    total = nodes * gpus_per_node
    if not 1 <= gen_gpus < total:
        return (
            f"allocation.gen_gpus ({gen_gpus}) must leave each role a GPU: between 1 and cluster.nodes x "
            f"cluster.gpus_per_node - 1 ({nodes} x {gpus_per_node} - 1 = {total - 1})"
        )
    if gen_gpus % gen_tp:
        return (
            f"allocation.gen_gpus ({gen_gpus}) must be a multiple of allocation.gen_tp ({gen_tp}): whole vLLM engines"
        )
    align = tp_alignment(gpus_per_node, train_tp)
    if gen_gpus % align:
        what = f"allocation.train_tp ({train_tp})" if align == train_tp else f"cluster.gpus_per_node ({gpus_per_node})"
        return (
            f"allocation.gen_gpus ({gen_gpus}) must be a multiple of {what}: the trainer's GPUs follow the "
            "generators', and each of its tensor-parallel groups must lie within one node"
        )
    where = f"the trainer GPUs ({nodes} x {gpus_per_node} - {gen_gpus} = {total - gen_gpus})"
    return replicas_problem(total - gen_gpus, train_tp, train_pp, where)


def tp_alignment(gpus_per_node: int, train_tp: int) -> int:
    """Where the trainer's GPUs may start (a multiple of this) so that every tensor-parallel group lies within a
    node: train_tp when it divides a node's GPUs, the node when train_tp spans whole nodes, else 1 (a group that
    straddles nodes whatever the start)."""
    if gpus_per_node % train_tp == 0:
        return train_tp
    return gpus_per_node if train_tp % gpus_per_node == 0 else 1


def replicas_problem(trainers: int, train_tp: int, train_pp: int, where: str = "") -> str | None:
    """The trainer ranks hold whole TP x PP replicas (`where`: how to name them in the message)."""
    group = train_tp * train_pp
    if train_tp >= 1 and train_pp >= 1 and trainers % group == 0:
        return None
    return (
        f"allocation.train_tp x train_pp ({train_tp} x {train_pp} = {group}) must divide "
        f"{where or f'the trainer ranks ({trainers})'}"
    )


def check(
    arch: QwenArch,
    nodes: int,
    gpus_per_node: int,
    gen_tp: int,
    train_tp: int,
    train_pp: int,
    gen_gpus: int | None = None,
    train_ep: int = 1,
) -> None:
    """ConfigError naming the first rule the sizes break; the split, and the expert-parallel size against
    the trainer's data-parallel size, are checked when `gen_gpus` is known."""
    problems = [
        gpus_problem(nodes, gpus_per_node),
        train_tp_problem(arch, train_tp),
        train_pp_problem(arch, train_pp),
        gen_tp_problem(arch, gpus_per_node, gen_tp),
        train_ep_problem(arch, train_ep),
    ]
    if gen_gpus is not None:
        problems.append(split_problem(nodes, gpus_per_node, gen_gpus, gen_tp, train_tp, train_pp))
        if not problems[-1]:
            dp = (nodes * gpus_per_node - gen_gpus) // (train_tp * train_pp)
            problems.append(train_ep_problem(arch, train_ep, dp))
    for problem in problems:
        if problem:
            raise ConfigError(problem)


def check_trainer(arch: QwenArch, train_tp: int, train_pp: int, train_ep: int = 1, dp: int | None = None) -> None:
    """ConfigError when the model cannot be split train_tp x train_pp (x train_ep over `dp` data-parallel
    ranks) ways (the trainer's engine asks)."""
    for problem in (
        train_tp_problem(arch, train_tp),
        train_pp_problem(arch, train_pp),
        train_ep_problem(arch, train_ep, dp),
    ):
        if problem:
            raise ConfigError(problem)


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


def _heads(arch: QwenArch, name: str = "model") -> list[tuple[str, int]]:
    return [
        (f"{name}.num_attention_heads", arch.num_attention_heads),
        (f"{name}.num_key_value_heads", arch.num_key_value_heads),
    ]
