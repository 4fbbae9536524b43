"""The vLLM settings that would otherwise differ between a GPU and the CPU, chosen here, once, so that a GPU
runs the engine the tests run; and `resolved`, what a running engine actually uses (`GenerationEngine.settings`,
logged by every generator at start).

Left to itself, vLLM 0.32 runs another engine on CUDA than on the CPU: its V2 model runner, asynchronous
scheduling (a second batch queued while one runs) and forked tensor-parallel workers there; the V1 runner,
no asynchronous scheduling and spawned workers here. The interruption (abort with a batch in flight, load,
reset the prefix cache, resubmit) is tested on the CPU; a GPU must run it the same way, and an engine that
starts again must find its compiled graphs the same way on both. `ENVIRONMENT` is read by vLLM from the
environment, `ENGINE_ARGS` are `EngineArgs` fields. CUDA graphs are the one choice that differs by device,
because the CPU has none: they stay on, for speed, and the interruption with them is checked by
tools/gpu_check.sh on a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_USE_AOT_COMPILE": "0",
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
- VLLM_USE_AOT_COMPILE=0: vLLM's compile cache (Inductor's compiled graphs, found by their content) rather
  than its ahead-of-time artifact, which vLLM 0.32 turns on with torch 2.10 and later, keyed by a hash of
  the whole configuration, the model's path included. On the CPU loading that artifact fails every time
  ("'function' object has no attribute 'finalize_loading'", measured) and vLLM compiles again. Off, an
  engine whose graphs were compiled before (an earlier run, the run before a requeue, the same model at
  another path) starts from the cache: its compilation takes 5 s here instead of 12-19 s. On CUDA the
  artifact would also spare Dynamo's tracing; off, both platforms start alike.
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
  attention backend supports: `resolved` reads the outcome.
"""

PREFILL_CHUNK_TOKENS = 16384
"""The prefill an engine step may add to its decode tokens (`step_tokens`): vLLM 0.32's own offline default
on an H100 or H200 (`EngineArgs.get_batch_defaults`, usage context LLM_CLASS)."""


def step_tokens(max_num_seqs: int, max_model_len: int) -> int:
    """vLLM's `max_num_batched_tokens`, the most tokens one engine step computes: a decode token for each of
    the `max_num_seqs` trajectories it runs plus a `PREFILL_CHUNK_TOKENS` prefill chunk, no more than all of
    them at `max_model_len`.

    Left unset it would be 2,048 on both devices: the engine is built with `LLMEngine.from_engine_args`,
    whose usage context (ENGINE_CONTEXT) has no default of its own, so vLLM falls back to
    `SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`. After every weight update an interrupted engine
    prefills all its running trajectories again (the prefix cache is reset), and in 2,048-token steps a
    step's fixed cost (scheduling, sampling, launches) would be paid hundreds of times over; a GPU
    computes a 16k-token chunk of a small model in a few tens of milliseconds. The planner's
    interruption uses the same number (areal_hpc.planner.predict.interruption_s)."""
    return min(max_num_seqs + PREFILL_CHUNK_TOKENS, max_num_seqs * max_model_len)


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


def resolved(llm_engine) -> dict[str, str]:
    """What a running vLLM `LLMEngine` uses, after vLLM's own resolution of `ENVIRONMENT`, `ENGINE_ARGS` and
    its platform defaults: read from its first worker (`_worker_settings`) and the engine itself."""
    from vllm import __version__

    inproc = type(llm_engine.engine_core).__name__ == "InprocClient"
    worker = llm_engine.collective_rpc(_worker_settings, args=(os.getpid(),))[0]
    return {"vllm": __version__, "engine_core": "in-process" if inproc else "process", **worker}


def _worker_settings(worker, engine_pid: int) -> dict[str, str]:
    """Run inside a vLLM worker (`collective_rpc`): its resolved configuration, and how it was started."""
    import multiprocessing

    from vllm import envs

    c = worker.vllm_config
    cache, model = c.cache_config, c.model_config
    start = getattr(multiprocessing.current_process(), "_start_method", None)
    kv = (
        {"kv_cache_bytes": str(cache.kv_cache_memory_bytes)}
        if cache.kv_cache_memory_bytes
        else {"gpu_memory_utilization": str(cache.gpu_memory_utilization)}
    )
    return {
        "model_runner": "V2" if c.use_v2_model_runner else "V1",
        "worker_start_method": "in-process" if os.getpid() == engine_pid else str(start),
        "async_scheduling": _on(c.scheduler_config.async_scheduling),
        "cudagraph_mode": c.compilation_config.cudagraph_mode.name,
        "compilation_mode": c.compilation_config.mode.name,
        "aot_compile": _on(envs.VLLM_USE_AOT_COMPILE),
        "enforce_eager": _on(model.enforce_eager),
        "tensor_parallel_size": str(c.parallel_config.tensor_parallel_size),
        "dtype": str(model.dtype).removeprefix("torch."),
        **kv,
        "kv_cache_tokens": str((cache.num_gpu_blocks or 0) * cache.block_size),
        "prefix_caching": _on(cache.enable_prefix_caching),
        "logprobs_mode": str(model.logprobs_mode),
        "max_num_seqs": str(c.scheduler_config.max_num_seqs),
        "max_num_batched_tokens": str(c.scheduler_config.max_num_batched_tokens),
        "max_model_len": str(model.max_model_len),
        # vLLM's CPU platform runs a LoRA engine uncompiled (compilation_mode NONE); a GPU keeps compiling it
        "lora": f"max_rank {c.lora_config.max_lora_rank}" if c.lora_config else "off",
    }


def _on(flag) -> str:
    return "on" if flag else "off"
