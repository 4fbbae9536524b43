"""One vLLM engine, interruptible: trajectories with behaviour logprobs and per-token policy versions.

vLLM's `LLMEngine` (v1) is driven step by step: `add` queues the trajectories a request asks for (a
GenerateRequest: a prompt group to train on; an EvalRequest: an eval prompt), `step` runs one
continuous-batching iteration and returns the trajectories that finished in it, each as the reply to
its request (a Trajectory, an EvalTrajectory; each goes back as soon as it finishes, never held for a
batch), `update_weights` interrupts and reloads.

Behaviour logprobs (the convention the trainer matches): vLLM runs with
`logprobs_mode="processed_logprobs"`, so the logprob of each sampled token y_t is taken from the
distribution it was actually sampled from,

    behav_logprob_t = log_softmax(logits_t / temperature)[y_t]       (fp32; top_p = 1)

which is what the trainer computes as `log_softmax(logits / temperature)` gathered at the token.
(vLLM's default, "raw_logprobs", is log_softmax(logits) before temperature: it coincides only at
temperature 1.) With top_p < 1 the distribution is also truncated to the nucleus and renormalised,
so behav_logprob >= the trainer's full-vocabulary logprob; keep top_p = 1 for exact agreement.

Interruption (`update_weights`), nothing lost or duplicated:
  1. abort every in-flight vLLM request; each trajectory keeps the tokens, logprobs and versions
     vLLM has returned so far (a token computed but not yet returned is simply sampled again);
  2. load the new weights bucket by bucket inside vLLM's worker(s), in place where vLLM allows it
     (`WeightLoader` below);
  3. reset the prefix cache (its KV entries were computed by the old weights);
  4. resubmit each trajectory as prompt + partial output with the remaining token budget; tokens
     sampled from then on carry the new version.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.arch import model_arch
from areal_hpc.generator.choices import ENGINE_ARGS, choose_environment, resolved
from areal_hpc.protocol import EvalRequest, EvalTrajectory, GenerateRequest, Trajectory

# vLLM's environment (worker start method, model runner, in-process engine core), set on import: before
# any engine is built (vLLM is only imported inside functions here).
choose_environment()

WORKER_EXTENSION = "areal_hpc.generator.engine.WeightLoader"


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`): runs where the model lives, so with
    gen_tp > 1 every tensor-parallel worker receives the broadcast itself and loads its shard.

    The iterator is lazy, so each bucket is loaded as it arrives; `_areal_load` says how.
    """

    def areal_load_weights(self, buckets: list) -> int:
        """Load buckets of Hugging Face named tensors (the model shards them by its own TP rank)."""
        named = [item for bucket in buckets for item in bucket]
        self._areal_load(iter(named))
        return len(named)

    def _areal_load(self, named: Iterator) -> None:
        """Load Hugging Face named tensors into the running model, straight into its parameters.

        vLLM's own reload (`reload_weights`, layerwise) moves every layer back to its checkpoint
        format on the meta device, records each tensor passed to a weight loader (a dispatch mode
        counting copied elements), loads and post-processes a layer once all its elements arrived,
        and copies the result back into the old storage (kept for CUDA graphs). For an unquantized
        model that is mostly overhead, so per module:
          - unquantized (or no quant method), tensors as vLLM recorded them at load (names, shapes,
            dtypes: `record_metadata_for_reloading`): each tensor goes through its parameter's own
            `weight_loader`, vLLM's name mapping included (q/k/v and gate/up land in their slice of
            the fused parameter), in place;
          - unquantized, but post-processing replaced a tensor (on CPU the linear weights live only
            in oneDNN handles: the parameter is empty): the module first gets fresh tensors of its
            recorded checkpoint format (vLLM's meta helpers), which the loaders then fill;
          - both run the unquantized `process_weights_after_loading` again afterwards: it derives
            only from the weights (on CPU it creates the oneDNN handles of the linear layers and of
            the embedding / lm_head, whose sampling would otherwise stay on the old weights);
          - anything else (quantized): vLLM's layerwise reload, applied to those modules only.
        On GPU an unquantized model loads in place throughout (no post-processing, no copies).
        """
        from torch import nn
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            get_layerwise_info,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        model = self.model_runner.get_model()
        direct, restored, others = [], [], []
        for name, module in model.named_modules():
            if not _has_tensors(module):
                continue
            if not _unquantized(module):
                others.append(module)
                continue
            direct.append(module)
            if not _as_recorded(module):
                info = get_layerwise_info(module)
                restore_layer_on_meta(module, info)
                materialize_layer(module, info)
                restored.append((name, module))
        # vLLM's layerwise functions walk `.modules()`: hand them a container of the others only.
        reloaded = nn.ModuleList(others)
        initialize_layerwise_reload(reloaded)
        loaded = model.load_weights(self._areal_tied(named))
        finalize_layerwise_reload(reloaded, self.model_config)
        missing = [f"{n}.{p}" for n, m in restored for p, _ in m.named_parameters(recurse=False)]
        missing = [p for p in missing if p not in loaded]
        if missing:  # their fresh tensors would hold uninitialised memory
            raise RuntimeError(f"weight update without {', '.join(missing)}: send the whole model")
        for module in direct:
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
                if hasattr(module, "update_param_tp_status"):  # as vLLM does after processing
                    module.update_param_tp_status()
        # What vLLM's model runner does after its own reload.
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()

    def _areal_tied(self, named: Iterator) -> Iterator:
        """With tied embeddings, also load the input embedding as `lm_head.weight`.

        Hugging Face checkpoints of tied models (and the trainer's export) carry no `lm_head.weight`,
        but vLLM's CPU backend keeps the output projection repacked in its own kernel format, which
        an in-place reload refreshes only when `lm_head.weight` itself arrives: without it the
        generator would keep sampling from the old output projection.
        """
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        for name, tensor in named:
            yield name, tensor
            if tied and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor

    def areal_join_weight_sync(self, receiver, timeout_s: float) -> list[str]:
        """Join every stage's weight-sync group as this worker's rank (`WeightReceiver.join`: the
        rendezvous and the start-up check, within `timeout_s`); keeps the connected receiver here."""
        from vllm.distributed import get_tensor_model_parallel_rank

        joined = receiver.join(get_tensor_model_parallel_rank(), timeout_s)
        self._areal_receiver = receiver  # in a worker process, its own unpickled copy holds the groups
        return joined

    def areal_receive_weights(self) -> int:
        """Receive a sync over the groups joined at start and load each bucket as it arrives."""
        receiver = getattr(self, "_areal_receiver", None)
        if receiver is None:
            raise RuntimeError("weight sync before the worker joined its groups (GenerationEngine.join_weight_sync)")
        count = 0

        def stream():
            nonlocal count
            for bucket in receiver.receive():
                count += len(bucket)
                yield from bucket

        self._areal_load(stream())
        return count

    def areal_leave_weight_sync(self) -> None:
        receiver = getattr(self, "_areal_receiver", None)
        if receiver is not None:
            receiver.leave()
        self._areal_receiver = None


def _unquantized(module) -> bool:
    """No quant method, or vLLM's unquantized one, whose `process_weights_after_loading` derives
    only from the checkpoint-format weights (so it can run again after any load)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    quant = getattr(module, "quant_method", None)
    return quant is None or type(quant) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def _as_recorded(module) -> bool:
    """Whether `module`'s parameters and buffers are still as vLLM recorded them before
    post-processing (names, shapes, dtypes), i.e. in the format their weight loaders write."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    recorded = get_layerwise_info(module).restore_metadata
    current = (dict(module.named_parameters(recurse=False)), dict(module.named_buffers(recurse=False)))
    for was, now in zip(recorded, current):
        now = {k: t for k, t in now.items() if k not in SKIP_TENSORS}
        if was.keys() != now.keys() or any(t.shape != now[k].shape or t.dtype != now[k].dtype for k, t in was.items()):
            return False
    return True


def _has_tensors(module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


@dataclass
class _InFlight:
    """One trajectory a request asked for, across interruptions."""

    request: GenerateRequest | EvalRequest
    index: int  # its place among the request's n, 0 .. n-1
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    behav_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempt: int = 0

    @property
    def request_id(self) -> str:
        """vLLM's id of the current attempt: unique among everything in flight, eval prompts included."""
        r = self.request
        name = f"eval{r.prompt_index}" if isinstance(r, EvalRequest) else f"group{r.group_id}"
        return f"{name}.{self.index}.{self.attempt}"


class GenerationEngine:
    """A vLLM engine serving prompt groups and eval prompts, interruptible for weight updates.

    `engine` is a vLLM v1 `LLMEngine` built with `engine_args(...)` (or `GenerationEngine.create`).
    """

    def __init__(self, engine, temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 32):
        self.engine = engine
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.version = 0
        """Policy version of the loaded weights (0: the initial model)."""
        self._running: dict[str, _InFlight] = {}  # vLLM request id -> its trajectory

    # --- construction ---
    @staticmethod
    def engine_args(
        model_path: str,
        *,
        device: str,
        dtype: str = "float32",
        tp: int = 1,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
    ):
        """vLLM `EngineArgs` for a generator: processed logprobs (see the module doc), our worker extension,
        the project's choices where vLLM's defaults differ by platform (`choices.ENGINE_ARGS`).
        `device`: 'cpu' or 'cuda', the rank's (`RankContext.device`); vLLM's own platform is never asked."""
        from vllm import EngineArgs

        kv_bytes = _cpu_setup(model_path, tp, max_num_seqs, max_model_len) if device == "cpu" else None
        return EngineArgs(
            model=str(model_path),
            dtype=dtype,
            tensor_parallel_size=tp,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
            disable_log_stats=True,
            kv_cache_memory_bytes=kv_bytes,
            **ENGINE_ARGS,
        )

    @classmethod
    def create(cls, model_path, *, temperature=1.0, top_p=1.0, max_new_tokens=32, **engine_kwargs):
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(cls.engine_args(model_path, **engine_kwargs))
        return cls(engine, temperature, top_p, max_new_tokens)

    @classmethod
    def from_config(cls, cfg, model_path, device: str, seed_offset: int = 0) -> GenerationEngine:
        """The engine of a generator rank, from the run config (model, allocation.gen_tp, rollout)."""
        r, m = cfg.rollout, cfg.model
        return cls.create(
            model_path,
            device=device,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            dtype=m.dtype,
            tp=cfg.allocation.gen_tp,
            seed=cfg.experiment.seed + seed_offset,
            max_model_len=model_arch(m).max_position_embeddings,
            max_num_seqs=r.engine_seqs,
        )

    def settings(self) -> dict[str, str]:
        """The engine's resolved settings, as vLLM runs them (`choices.resolved`): model runner, async
        scheduling, CUDA graphs, worker start method, tensor parallel size, dtype, KV cache, prefix caching,
        logprobs mode, ..."""
        return resolved(self.engine)

    def join_weight_sync(self, receiver, timeout_s: float) -> list[str]:
        """Join the weight-sync groups inside vLLM's workers, each as its own group rank (with gen_tp > 1
        every tensor-parallel worker is a member), and check the start-up broadcast: at start, before
        the first prompt. `receiver`: this rank's `weight_sync.WeightReceiver`. Returns a log line per
        worker and group."""
        joined = self.engine.collective_rpc("areal_join_weight_sync", args=(receiver, timeout_s))
        return [line for worker in joined for line in worker]

    def leave_weight_sync(self) -> None:
        """Every worker leaves its ends of the weight-sync groups (at Stop)."""
        self.engine.collective_rpc("areal_leave_weight_sync")

    def close(self) -> None:
        """Shut the engine down (its worker processes too, when gen_tp > 1)."""
        self.interrupt()
        self.engine.engine_core.shutdown()

    # --- serving ---
    def add(self, request: GenerateRequest | EvalRequest) -> None:
        """Queue the request's `n` trajectories to its prompt (a GRPO group, or an eval prompt)."""
        prompt = [int(t) for t in request.prompt_ids]
        for i in range(request.n):
            self._submit(_InFlight(request, i, prompt))

    def step(self) -> list[Trajectory | EvalTrajectory]:
        """One engine iteration; returns the trajectories that finished in it, each its request's reply."""
        finished = []
        for out in self.engine.step():
            traj = self._running.pop(out.request_id, None)
            if traj is None:  # a request aborted by an interruption
                continue
            completion = out.outputs[0]
            # FINAL_ONLY: the whole attempt at once; flat logprobs with logprobs=0 hold exactly the
            # sampled token's logprob at each position. An attempt never spans a weight update.
            _extend(traj, completion.token_ids, completion.logprobs.logprobs, self.version)
            finished.append(_reply(traj, completion.finish_reason))
        return finished

    @property
    def in_flight(self) -> int:
        """Trajectories queued or being generated."""
        return len(self._running)

    def partial(self) -> list[_InFlight]:
        """A copy of each in-flight trajectory with everything it produced so far (`request`, `index`: which)."""
        out = []
        for request_id, traj in self._running.items():
            copy = dataclasses.replace(
                traj,
                output_ids=list(traj.output_ids),
                behav_logprobs=list(traj.behav_logprobs),
                versions=list(traj.versions),
            )
            _extend(copy, *self._attempt_output(request_id), self.version)
            out.append(copy)
        return out

    def interrupt(self) -> list[_InFlight]:
        """Abort every in-flight request, keeping what each trajectory produced so far."""
        trajectories = list(self._running.values())
        for request_id, traj in self._running.items():
            _extend(traj, *self._attempt_output(request_id), self.version)
        if trajectories:
            self.engine.abort_request(list(self._running))
        self._running.clear()
        return trajectories

    def _attempt_output(self, request_id: str) -> tuple[list[int], list[float]]:
        """Tokens and behaviour logprobs of a running request's current attempt, read from vLLM's
        output processor. Requests ask for FINAL_ONLY outputs, so nothing is materialised per step
        (per-step DELTA outputs cost 10-20% throughput on small models); the processor's request
        state holds what has been returned so far. vLLM 0.32 internals: test_generator checks them."""
        processor = self.engine.output_processor
        internal = processor.external_req_ids.get(request_id)  # vLLM suffixes our ids internally
        state = processor.request_states.get(internal[0]) if internal else None
        if state is None:
            return [], []
        ids = list(state.detokenizer.output_token_ids)
        return ids, list(state.logprobs_processor.logprobs.logprobs[: len(ids)])

    def update_weights(self, weights, version: int) -> float:
        """Interrupt, load `weights`, reset the prefix cache, resume; returns the seconds it took.

        `weights` is the `weight_sync.WeightReceiver` that joined at start (`join_weight_sync`: the
        broadcast is received and loaded inside vLLM's workers) or an iterable of buckets, each a list
        of (hf_name, tensor).
        """
        t0 = time.perf_counter()
        paused = self.interrupt()
        if hasattr(weights, "receive"):
            self.engine.collective_rpc("areal_receive_weights")
        else:
            self.engine.collective_rpc("areal_load_weights", args=([list(b) for b in weights],))
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight update")
        self.version = version
        for traj in paused:
            traj.attempt += 1
            self._submit(traj)
        return time.perf_counter() - t0

    def load_weights(self, named_tensors: Iterable, version: int) -> float:
        """`update_weights` with one bucket of in-memory tensors (tests, benchmarks)."""
        return self.update_weights([list(named_tensors)], version)

    def _submit(self, traj: _InFlight) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        remaining = self.max_new_tokens - len(traj.output_ids)
        params = SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=remaining,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # partial output is read on interruption
        )
        prompt = {"prompt_token_ids": traj.prompt_ids + traj.output_ids}
        self.engine.add_request(traj.request_id, prompt, params)
        self._running[traj.request_id] = traj


def _extend(traj: _InFlight, token_ids, logprobs, version: int) -> None:
    traj.output_ids += token_ids
    traj.behav_logprobs += logprobs
    traj.versions += [version] * len(token_ids)


def _reply(traj: _InFlight, finish_reason: str | None) -> Trajectory | EvalTrajectory:
    """A finished trajectory as its request's reply: an eval prompt's needs no logprobs or versions."""
    output_ids = np.asarray(traj.output_ids, dtype=np.int32)
    reason = "stop" if finish_reason == "stop" else "length"
    if isinstance(traj.request, EvalRequest):
        return EvalTrajectory(traj.request.prompt_index, traj.index, output_ids, reason)
    return Trajectory(
        group_id=traj.request.group_id,
        index=traj.index,
        output_ids=output_ids,
        behav_logprobs=np.asarray(traj.behav_logprobs, dtype=np.float32),
        versions=np.asarray(traj.versions, dtype=np.int32),
        finish_reason=reason,
    )


def _cpu_setup(model_path, tp: int, max_num_seqs: int, max_model_len: int | None) -> int:
    """On CPU, the KV cache this engine can use at most (`generator.kv_cache.cpu_kv_cache_bytes`: every
    trajectory at full length, within bounds). (On GPU vLLM sizes it from gpu_memory_utilization.)

    Also fails at start, with the fix, on a head size vLLM's CPU attention does not support, rather
    than at the first step; and lets the workers' threads float (no auto-binding) with tp > 1 (vLLM's
    CPU auto-binding wants one NUMA node per worker, which a single machine does not have) and when
    OMP_NUM_THREADS asks for fewer threads than the cores this process may use (auto-binding would put
    a thread on each of them: areal_hpc.layout.Layout.core_plan's ranks that share the cores).
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from areal_hpc.arch import hf_arch
    from areal_hpc.generator.kv_cache import cpu_kv_cache_bytes

    threads = os.environ.get("OMP_NUM_THREADS")
    if tp > 1 or (threads and int(threads) < len(os.sched_getaffinity(0))):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    arch = hf_arch(model_path)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if arch.head_dim not in supported:
        raise ValueError(
            f"head size {arch.head_dim} (model.hidden_size {arch.hidden_size} / model.num_attention_heads "
            f"{arch.num_attention_heads}) is not supported by vLLM's CPU attention; supported: "
            f"{', '.join(map(str, supported))} (e.g. fewer attention heads)"
        )
    return cpu_kv_cache_bytes(arch, tp, max_num_seqs, max_model_len or arch.max_position_embeddings)
