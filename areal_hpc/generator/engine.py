"""One vLLM engine, interruptible: turns sampled with behaviour logprobs and per-token policy versions.

vLLM's `LLMEngine` (v1) is driven step by step in turns: `submit` queues a turn (a key, the token ids the
engine must see, the most tokens it may sample), `step` runs one continuous-batching iteration and returns
the turns that finished in it (the sampled ids, the stop token included, each one's behaviour logprob and
policy version, the finish reason), `update_weights` interrupts and reloads. The engine knows nothing of
episodes or messages: areal_hpc.generator.episodes runs the workflows that submit the turns.

Behaviour logprobs (the convention the trainer matches): vLLM runs with
`logprobs_mode="processed_logprobs"`, so the logprob of each sampled token y_t is taken from the
distribution it was actually sampled from,

    behav_logprob_t = log_softmax(logits_t / temperature)[y_t]       (fp32; top_p = 1)

which is what the trainer computes as `log_softmax(logits / temperature)` gathered at the token.
(vLLM's default, "raw_logprobs", is log_softmax(logits) before temperature: it coincides only at
temperature 1.) With top_p < 1 the distribution is also truncated to the nucleus and renormalised,
so behav_logprob >= the trainer's full-vocabulary logprob; keep top_p = 1 for exact agreement.

Interruption (`update_weights`), nothing lost or duplicated:
  1. abort every in-flight vLLM request; each turn keeps the tokens, logprobs and versions vLLM has
     returned so far (a token computed but not yet returned is simply sampled again);
  2. load the new weights bucket by bucket inside vLLM's worker(s), in place where vLLM allows it
     (`WeightLoader` below); with LoRA (`lora`), the adapter alone, replacing the one loaded;
  3. reset the prefix cache (its KV entries were computed by the old weights);
  4. resubmit each turn as its context + partial output with what is left of its own token budget;
     tokens sampled from then on carry the new version.

Without interruption (`rollout.interruptible` false): `hold` first, so turns submitted from then on wait
outside vLLM; the caller steps until no turn is `running`, then `update_weights` has nothing to interrupt,
and it submits the waiting turns under the new weights. Every token of a turn then carries one version
(but for a turn resumed from a checkpoint: `submit`'s `prefix`).

Routing (a MoE model with `record_routing`, i.e. `ppo.routing_replay`): each finished turn also carries, for
its context and output positions, the experts every MoE layer chose in its final attempt, read from vLLM's
worker right after the step it finished in (areal_hpc.generator.routing).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from areal_hpc.arch import hf_arch, model_arch
from areal_hpc.config.choices import lora_serving_rank
from areal_hpc.generator.choices import ENGINE_ARGS, choose_environment, resolved, step_tokens
from areal_hpc.workflow.client import Turn

# vLLM's environment (worker start method, model runner, in-process engine core), set on import: before
# any engine is built (vLLM is only imported inside functions here).
choose_environment()

WORKER_EXTENSION = "areal_hpc.generator.weight_loader.WeightLoader"
"""vLLM's `worker_extension_cls`: the class its workers mix in (areal_hpc.generator.weight_loader)."""
ADAPTER_ID = 1
"""vLLM's id of the policy's LoRA adapter (ids start at 1): one adapter, replaced in place at each update."""


@dataclass
class EngineTurn:
    """One turn the engine samples, across interruptions: what it was given, what it sampled so far."""

    key: str  # the submitter's name for it, unique among the turns in flight
    context_ids: list[int]  # the tokens the engine sees before the turn
    max_tokens: int  # the most tokens the turn may sample, over all its attempts
    sampled: Turn = field(default_factory=lambda: Turn([], [], [], ""))
    """What it sampled so far, as the workflow gets it once the turn finished (the workflow's `Turn`, handed
    over as is): `token_ids` (the stop token included when it stopped), `behav_logprobs`, `versions` (the
    policy version that sampled each token), `finish_reason` once finished ("stop": a stop token; "length":
    its budget or the model's context) and, when the engine records routing, `routing`:
    [len(context_ids) + len(token_ids), L, K], the experts of each position's KV in the final attempt
    (areal_hpc.generator.routing), the last position unknown."""
    attempt: int = 0  # resubmissions so far (one per weight update it lived through)

    @property
    def request_id(self) -> str:
        """vLLM's id of the current attempt: unique among everything in flight."""
        return f"{self.key}.{self.attempt}"


class GenerationEngine:
    """A vLLM engine sampling turns, interruptible for weight updates.

    `engine` is a vLLM v1 `LLMEngine` built with `engine_args(...)` (or `GenerationEngine.create`). With
    `record_routing` (an engine built with `engine_args(..., record_routing=True)`) every finished turn
    carries its routing (`Turn.routing` of `EngineTurn.sampled`).
    """

    def __init__(
        self,
        engine,
        temperature: float = 1.0,
        top_p: float = 1.0,
        record_routing: bool = False,
        lora: tuple[int, float] | None = None,
    ):
        self.engine = engine
        self.temperature, self.top_p = temperature, top_p
        self.version = 0
        """Policy version of the loaded weights (0: the initial model)."""
        self._running: dict[str, EngineTurn] = {}  # turn key -> the turn
        self._vllm_ids: dict[str, str] = {}  # turn key -> vLLM's id of its current attempt (it suffixes ours)
        self._held: dict[str, EngineTurn] | None = None  # while holding (`hold`): the turns submitted since
        self.record_routing = record_routing
        self.lora = lora
        """(rank, alpha) of the LoRA adapter each update brings (an engine built with vLLM's LoRA); None: the
        updates bring whole weights."""
        self.lora_request = None
        """vLLM's `LoRARequest` of every request once an adapter is loaded (`update_weights`); before, the base
        serves alone (an initial adapter, B = 0, adds nothing)."""
        self.synced_bytes = 0
        """What the last update brought: its tensors' bytes (timing/weight_sync_bytes)."""
        self.memory = None
        """On a GPU engine built `from_config`: its `memory.GeneratorMemory` budget."""
        if record_routing:
            engine.collective_rpc("areal_record_routing")

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
        record_routing: bool = False,
        gpu_memory_utilization: float | None = None,
        lora_rank: int = 0,
    ):
        """vLLM `EngineArgs` for a generator: processed logprobs (see the module doc), our worker extension,
        the project's choices where vLLM's defaults differ by platform (`choices.ENGINE_ARGS`).
        `device`: 'cpu' or 'cuda', the rank's (`RankContext.device`); vLLM's own platform is never asked.
        `record_routing`: an engine whose routing is recorded runs eagerly (areal_hpc.generator.routing).
        The step's token budget is the project's (`choices.step_tokens`), from `max_num_seqs` and the
        context (`max_model_len`, default the model's). `gpu_memory_utilization`: vLLM's share of a GPU
        (areal_hpc.generator.memory; None: vLLM's default); on the CPU the KV cache is sized in bytes.
        `lora_rank` > 0: vLLM's LoRA, one adapter of that rank (vLLM's `max_lora_rank` the next it allows:
        `lora_serving_rank`), loaded in memory (`update_weights`)."""
        from vllm import EngineArgs

        max_len = max_model_len or hf_arch(model_path).max_position_embeddings
        kv_bytes = _cpu_setup(model_path, tp, max_num_seqs, max_len) if device == "cpu" else None
        return EngineArgs(
            model=str(model_path),
            dtype=dtype,
            tensor_parallel_size=tp,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=step_tokens(max_num_seqs, max_len),
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager or record_routing,
            disable_log_stats=True,
            kv_cache_memory_bytes=kv_bytes,
            **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}),
            **(
                {"enable_lora": True, "max_lora_rank": lora_serving_rank(lora_rank), "max_loras": 1, "max_cpu_loras": 1}
                if lora_rank
                else {}
            ),
            **ENGINE_ARGS,
        )

    @classmethod
    def create(cls, model_path, *, temperature=1.0, top_p=1.0, record_routing=False, lora=None, **engine_kwargs):
        """An engine (`engine_args`' keywords); `lora`: (rank, alpha) of the adapter its updates bring."""
        from vllm.v1.engine.llm_engine import LLMEngine

        lora_rank = lora[0] if lora else 0
        args = cls.engine_args(model_path, record_routing=record_routing, lora_rank=lora_rank, **engine_kwargs)
        return cls(LLMEngine.from_engine_args(args), temperature, top_p, record_routing, lora)

    @classmethod
    def from_config(cls, cfg, model_path, device: str, seed_offset: int = 0) -> GenerationEngine:
        """The engine of a generator rank, from the run config (model, allocation.gen_tp, rollout; it records
        routing with ppo.routing_replay). On a GPU vLLM gets the share the project's additions leave
        (`memory.GeneratorMemory`, kept as `memory` for the log)."""
        r, m = cfg.rollout, cfg.model
        memory = None
        if device == "cuda":
            import torch

            from areal_hpc.generator.memory import GeneratorMemory

            memory = GeneratorMemory.of(cfg, torch.cuda.get_device_properties(0).total_memory)
            if problem := memory.problem():
                raise ValueError(problem)
        engine = cls.create(
            model_path,
            device=device,
            temperature=r.temperature,
            top_p=r.top_p,
            dtype=m.dtype,
            tp=cfg.allocation.gen_tp,
            seed=cfg.experiment.seed + seed_offset,
            max_model_len=model_arch(m).max_position_embeddings,
            max_num_seqs=r.engine_seqs,
            record_routing=cfg.ppo.routing_replay,
            gpu_memory_utilization=memory.utilization if memory else None,
            lora=(cfg.lora.rank, cfg.lora.alpha) if cfg.lora.rank else None,
        )
        engine.memory = memory
        return engine

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
        self._held = None
        self.engine.engine_core.shutdown()

    @property
    def max_model_len(self) -> int:
        """The most tokens one turn's context and output may hold together (vLLM ends a turn there)."""
        return self.engine.model_config.max_model_len

    # --- serving ---
    def submit(self, key: str, token_ids: list[int], max_tokens: int, prefix: Turn | None = None) -> None:
        """Queue a turn: sample at most `max_tokens` tokens after `token_ids`. `key` names it among the
        turns in flight (the finished turn carries it). `prefix`: what the turn had sampled before a
        checkpoint (areal_hpc.generator.resume): it goes on from there, as after a weight update."""
        if max_tokens < 1:
            raise ValueError(f"turn {key!r}: max_tokens must be at least 1, got {max_tokens}")
        if key in self._running or key in (self._held or {}):
            raise ValueError(f"turn {key!r} is already in flight")
        turn = EngineTurn(key, [int(t) for t in token_ids], max_tokens)
        if prefix is not None:
            if len(prefix.token_ids) >= max_tokens:
                raise ValueError(
                    f"turn {key!r}: a prefix of {len(prefix.token_ids)} tokens leaves none of {max_tokens}"
                )
            turn.sampled = Turn(list(prefix.token_ids), list(prefix.behav_logprobs), list(prefix.versions), "")
            turn.attempt = 1
        if self._held is None:
            self._submit(turn)
        else:
            self._held[key] = turn

    def hold(self) -> None:
        """Until the next `update_weights`, keep the turns submitted out of vLLM: they start under the new
        weights. The turns running meanwhile finish under the old ones (step until `running` is 0)."""
        if self._held is None:
            self._held = {}

    def step(self) -> list[EngineTurn]:
        """One engine iteration; returns the turns that finished in it."""
        finished = []
        for out in self.engine.step():
            turn = self._running.get(out.request_id.rpartition(".")[0])
            if turn is None or turn.request_id != out.request_id:  # an attempt aborted by an interruption
                continue
            del self._running[turn.key]
            vllm_id = self._vllm_ids.pop(turn.key)
            completion = out.outputs[0]
            # FINAL_ONLY: the whole attempt at once; flat logprobs with logprobs=0 hold exactly the
            # sampled token's logprob at each position. An attempt never spans a weight update.
            _extend(turn, completion.token_ids, completion.logprobs.logprobs, self.version)
            turn.sampled.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
            finished.append((turn, vllm_id))
        if self.record_routing and finished:
            # Now: the worker forgets a finished request, and its blocks may be reused, from the next step on.
            requests = [(vllm_id, len(t.context_ids) + len(t.sampled.token_ids)) for t, vllm_id in finished]
            routings = self.engine.collective_rpc("areal_take_routing", args=(requests,))[0]
            for (turn, _), routing in zip(finished, routings):
                turn.sampled.routing = routing
        return [turn for turn, _ in finished]

    @property
    def in_flight(self) -> int:
        """Turns submitted and not finished: running, or held for the next weights (`hold`)."""
        return len(self._running) + len(self._held or {})

    @property
    def running(self) -> int:
        """Turns in vLLM (queued or being sampled there): what `step` advances."""
        return len(self._running)

    def partial(self) -> list[EngineTurn]:
        """A copy of each in-flight turn with everything it sampled so far (a held turn: what it was submitted
        with, nothing unless it resumed a checkpoint's turn)."""
        out = []
        for turn in [*self._running.values(), *(self._held or {}).values()]:
            sampled = turn.sampled
            copy = dataclasses.replace(
                turn,
                sampled=dataclasses.replace(
                    sampled,
                    token_ids=list(sampled.token_ids),
                    behav_logprobs=list(sampled.behav_logprobs),
                    versions=list(sampled.versions),
                ),
            )
            if turn.key in self._running:
                _extend(copy, *self._attempt_output(turn.request_id), self.version)
            out.append(copy)
        return out

    def interrupt(self) -> list[EngineTurn]:
        """Abort every in-flight request, keeping what each turn sampled so far."""
        turns = list(self._running.values())
        for turn in turns:
            _extend(turn, *self._attempt_output(turn.request_id), self.version)
        if turns:
            self.engine.abort_request([turn.request_id for turn in turns])
        self._running.clear()
        self._vllm_ids.clear()
        return turns

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
        """Interrupt, load `weights`, reset the prefix cache, resume, then start the turns held (`hold`);
        returns the seconds it took (`synced_bytes`: what it brought).

        `weights` is the `weight_sync.WeightReceiver` that joined at start (`join_weight_sync`: the
        broadcast is received and loaded inside vLLM's workers) or an iterable of buckets, each a list
        of (hf_name, tensor). With LoRA (`lora`) they are the adapter's tensors, under PEFT's names: it
        replaces the one loaded, in memory, and every request from then on runs with it.
        """
        received = hasattr(weights, "receive")
        buckets = None if received else [list(b) for b in weights]
        if self.lora:
            from vllm.lora.request import LoRARequest

            args = (*self.lora, ADAPTER_ID)
            rpc = (
                ("areal_receive_adapter", args)
                if received
                else ("areal_load_adapter", ({k: t for b in buckets for k, t in b}, *args))
            )
        else:
            rpc = ("areal_receive_weights", ()) if received else ("areal_load_weights", (buckets,))

        def load():
            self.synced_bytes = self.engine.collective_rpc(rpc[0], args=rpc[1])[0]
            if self.lora:  # loaded: every request from now on runs with it
                # the path is never read while the worker holds the adapter; were it gone, this one fails at
                # once (a relative path would be tried as a Hugging Face Hub repository)
                self.lora_request = LoRARequest("areal-policy", ADAPTER_ID, "/nonexistent/areal-hpc-in-memory-adapter")

        return self._reload(load, version)

    def _reload(self, load, version: int) -> float:
        """Interrupt, `load()`, reset the prefix cache, resume, then start the turns held; the seconds it took."""
        t0 = time.perf_counter()
        paused = self.interrupt()
        load()
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight update")
        self.version = version
        for turn in paused:
            turn.attempt += 1
            self._submit(turn)
        held, self._held = self._held or {}, None
        for turn in held.values():
            self._submit(turn)
        return time.perf_counter() - t0

    def load_weights(self, named_tensors: Iterable, version: int) -> float:
        """`update_weights` with one bucket of in-memory tensors (tests, benchmarks)."""
        return self.update_weights([list(named_tensors)], version)

    def _submit(self, turn: EngineTurn) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=turn.max_tokens - len(turn.sampled.token_ids),  # the turn's own budget, what is left of it
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # partial output is read on interruption
        )
        prompt = {"prompt_token_ids": turn.context_ids + turn.sampled.token_ids}
        self._vllm_ids[turn.key] = self.engine.add_request(
            turn.request_id, prompt, params, lora_request=self.lora_request
        )
        self._running[turn.key] = turn


def _extend(turn: EngineTurn, token_ids, logprobs, version: int) -> None:
    sampled = turn.sampled
    sampled.token_ids += token_ids
    sampled.behav_logprobs += logprobs
    sampled.versions += [version] * len(token_ids)


def _cpu_setup(model_path, tp: int, max_num_seqs: int, max_model_len: int) -> int:
    """On CPU, the KV cache this engine can use at most (`generator.kv_cache.cpu_kv_cache_bytes`: every
    trajectory at full length, within bounds). (On GPU vLLM sizes it from gpu_memory_utilization.)

    Also fails at start, with the fix, on a head size vLLM's CPU attention does not support, rather
    than at the first step; and lets the workers' threads float (no auto-binding) with tp > 1 (vLLM's
    CPU auto-binding wants one NUMA node per worker, which a single machine does not have) and when
    OMP_NUM_THREADS asks for fewer threads than the cores this process may use (auto-binding would put
    a thread on each of them: areal_hpc.layout.Layout.core_plan's ranks that share the cores).
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

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
    return cpu_kv_cache_bytes(arch, tp, max_num_seqs, max_model_len)
