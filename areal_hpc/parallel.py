"""Which parallel sizes a model and a cluster allow: the one place these rules live. Config validation,
the planner's search, the node split, the layout's trainer grid and the trainer's engine all ask here.

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
 train_tp x train_pp    the trainer's GPUs: (nodes - gen_nodes) x gpus_per_node  data-parallel replicas are whole
 cluster.nodes >= 2 and 1 <= allocation.gen_nodes <= nodes - 1                   generation and training each
                                                                                 get at least a node
```

Each rule is a function returning the problem as a sentence that names the fields (None when there is
none); `check` raises the first as a ConfigError. Numbers in, no config object: the planner asks for
every size it considers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def train_tp_problem(arch: QwenArch, tp: int) -> str | None:
    """The trainer's tensor-parallel size: Megatron splits the heads, the MLP and the vocabulary evenly."""
    return _divides(
        tp,
        "allocation.train_tp",
        [*_heads(arch), ("model.intermediate_size", arch.intermediate_size), ("model.vocab_size", arch.vocab_size)],
    )


def train_pp_problem(arch: QwenArch, pp: int) -> str | None:
    """The trainer's pipeline-parallel size: stages of equal depth."""
    return _divides(pp, "allocation.train_pp", [("model.num_layers", arch.num_layers)])


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


def nodes_problem(nodes: int) -> str | None:
    """Generation and training each get at least a node."""
    if nodes < 2:
        return f"cluster.nodes ({nodes}) must be at least 2: one for generation and one for training"
    return None


def split_problem(nodes: int, gpus_per_node: int, gen_nodes: int, train_tp: int, train_pp: int) -> str | None:
    """`gen_nodes` generator nodes of `nodes`, the rest for training: each side gets a node, and the
    trainer's GPUs hold whole TP x PP replicas."""
    if not 1 <= gen_nodes < nodes:
        return f"allocation.gen_nodes ({gen_nodes}) must be between 1 and cluster.nodes - 1 ({nodes - 1})"
    trainer_gpus = (nodes - gen_nodes) * gpus_per_node
    where = f"the trainer GPUs ({nodes - gen_nodes} nodes x {gpus_per_node} = {trainer_gpus})"
    return replicas_problem(trainer_gpus, train_tp, train_pp, where)


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
    gen_nodes: int | None = None,
    train_ep: int = 1,
) -> None:
    """ConfigError naming the first rule the sizes break; the split, and the expert-parallel size against
    the trainer's data-parallel size, are checked when `gen_nodes` is known."""
    problems = [
        nodes_problem(nodes),
        train_tp_problem(arch, train_tp),
        train_pp_problem(arch, train_pp),
        gen_tp_problem(arch, gpus_per_node, gen_tp),
        train_ep_problem(arch, train_ep),
    ]
    if gen_nodes is not None:
        problems.append(split_problem(nodes, gpus_per_node, gen_nodes, train_tp, train_pp))
        if not problems[-1]:
            dp = (nodes - gen_nodes) * gpus_per_node // (train_tp * train_pp)
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


def _heads(arch: QwenArch) -> list[tuple[str, int]]:
    return [
        ("model.num_attention_heads", arch.num_attention_heads),
        ("model.num_key_value_heads", arch.num_key_value_heads),
    ]
