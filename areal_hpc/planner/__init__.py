"""The planner: a small cost model of one RL step, the plans it chooses with it, and the GPU split a run is
launched on.

```
 synchronous (max_staleness 0)        gen |==longest trajectory==|              train |==|  sync |.|
                                      T0 = T_gen_sync + T_train + T_ws
 asynchronous (max_staleness eta)     gen |=====|=====|=====|=====|   (never waits for the longest)
                                      train   |==|  |==|  |==|  |==|
                                      T(eta) = min(T0, max(T_cap, T0 / (eta + 1)))
```

- Synchronous (eta = 0): the batch of N = prompts_per_step x group_size trajectories is decoded on
  the generator GPUs until the longest trajectory ends, then trained on the trainer GPUs, then the
  weights go to the generators. Decoding is memory-bandwidth bound: every decode step reads the weights
  and the KV cache of the trajectories still running, so the long tail of trajectory lengths keeps the
  generators busy at a small batch, which is the inefficiency asynchronous RL removes.
- Asynchronous: the staleness gate admits at most (eta + 1) batches beyond those trained. By Little's
  law, throughput = (work in flight) / (time in flight): (eta + 1) batches in flight for the time a
  batch takes from admission to the version bump (T0) gives a step every T0 / (eta + 1), until the
  slower of the two sides saturates: T_cap = max(generation at full load, training) per step.
  eta = 0 is exactly synchronous; large eta approaches the pipelined limit T_cap.

Every constant is a documented field of `CostModel`; docs/planner.md says where each comes from and
compares the predictions with the AReaL paper's figures. Pure functions: no MPI, no GPU.

```
 cost.py      the inputs: CostModel's constants, the model's size, the hardware, trajectory lengths, a Plan
 predict.py   one step's cost for a plan: the times above and the memory per GPU (`predict`)
 search.py    the plans the system can run, the fastest that fits (`choose`), the split a run is launched
              on (`resolve_split`, which the launchers call once and record in the run's config.yaml)
 memory.py    whether the ranks fit their GPUs or this host's memory, and what to change when not
 timeouts.py  whether the run's timeouts outlast its predicted drain at an update and training step
 report.py    what `areal-hpc plan` prints
```
"""

from areal_hpc.planner.cost import COST, CostModel, Lengths, ModelSize, Plan, with_plan
from areal_hpc.planner.memory import check_fits, check_host_fits, host_memory_need, memory_advice
from areal_hpc.planner.predict import Prediction, predict, train_memory_parts
from areal_hpc.planner.report import report, search_hint
from areal_hpc.planner.search import ALLOCATION_FIELDS, candidates, choose, resolve_split
from areal_hpc.planner.timeouts import check_timeouts

__all__ = [
    "ALLOCATION_FIELDS",
    "COST",
    "CostModel",
    "Lengths",
    "ModelSize",
    "Plan",
    "Prediction",
    "candidates",
    "check_fits",
    "check_timeouts",
    "check_host_fits",
    "choose",
    "host_memory_need",
    "memory_advice",
    "predict",
    "report",
    "resolve_split",
    "search_hint",
    "train_memory_parts",
    "with_plan",
]
