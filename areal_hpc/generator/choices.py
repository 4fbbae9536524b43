"""The vLLM settings that would otherwise differ between a GPU and the CPU, chosen here, once, so that a GPU
runs the engine the tests run.

Left to itself, vLLM 0.32 runs another engine on CUDA than on the CPU: its V2 model runner, asynchronous
scheduling (a second batch queued while one runs) and forked tensor-parallel workers there; the V1 runner,
no asynchronous scheduling and spawned workers here. The interruption (abort with a batch in flight, load,
reset the prefix cache, resubmit) is tested on the CPU; a GPU must run it the same way. `ENVIRONMENT` is
read by vLLM from the environment, `ENGINE_ARGS` are `EngineArgs` fields. CUDA graphs are the one choice
that differs by device, because the CPU has none: they stay on, for speed, and the interruption with them
is checked by tools/gpu_check.sh on a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
"""vLLM's environment, set by `choose_environment` whatever the user exported:

- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the generator's process. A weight update hands
  the weight-sync receiver to vLLM's workers through `collective_rpc`, whose arguments reach an engine core
  in another process only through vLLM's msgpack encoder, which turns the receiver into a dict (measured:
  "'dict' object has no attribute 'receive'"); and one process fewer starts.
- VLLM_WORKER_MULTIPROC_METHOD=spawn: with gen_tp > 1 vLLM starts a process per tensor-parallel worker,
  by default with fork, and spawns only when torch has already initialised CUDA in this process
  (`_maybe_force_spawn` in vllm/utils/system_utils.py). A rank that asked torch whether it has a GPU
  (`device.resolve_device`) has initialised the CUDA driver but not torch's CUDA state, so vLLM would fork,
  and a forked worker cannot use the driver its parent initialised (vLLM issues #6152, #14535). vLLM's CPU
  platform spawns whatever is set (vllm/platforms/cpu.py), so spawn is also the method the tests run. A
  spawned worker imports the rank's main module (areal_hpc.main) again, which imports no mpi4py: it never
  joins the MPI world.
- VLLM_USE_V2_MODEL_RUNNER=0: the V1 model runner. vLLM 0.32 picks its V2 runner wherever Triton works
  (`VllmConfig.use_v2_model_runner`), so on CUDA; the CPU build has no Triton backend and runs V1.
"""

ENGINE_ARGS = {
    "async_scheduling": False,
    "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
}
"""`EngineArgs` fields every generator engine gets:

- async_scheduling=False: left unset, vLLM 0.32 turns it on wherever nothing rules it out
  (`VllmConfig.__post_init__`), so on CUDA, and schedules the next batch while one runs (two batches in
  flight); its CPU platform turns it off (vllm/platforms/cpu.py). Off, an interruption aborts with at most
  one batch in flight, as tested.
- cudagraph_mode FULL_AND_PIECEWISE: vLLM's CUDA default at its default optimisation level (O2), named
  here so that an upgrade cannot change it unseen; CUDA graphs make small decode batches fast. Weights
  are loaded in place (`engine.WeightLoader`), so the captured graphs stay valid across updates. vLLM
  resolves it to NONE on the CPU (no static graphs) and with `enforce_eager`, and may lower it to what the
  attention backend supports.
"""

log = logging.getLogger(__name__)


def choose_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `ENVIRONMENT` in `environ`, logging each value the user had set otherwise. Before vLLM builds an
    engine: vLLM reads these variables when it builds one, and freezes its view of the environment once an
    engine core has started in the process (`enable_envs_cache` in vllm/envs.py)."""
    for name, value in ENVIRONMENT.items():
        given = environ.get(name)
        if given is not None and given != value:
            log.warning("%s=%s in the environment: areal-hpc sets %s (areal_hpc.generator.choices)", name, given, value)
        environ[name] = value
