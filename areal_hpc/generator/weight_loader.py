"""The code that runs inside vLLM's worker processes: `WeightLoader`, mixed into vLLM's worker class
(`worker_extension_cls`), loads each weight update where the model lives, so with gen_tp > 1 every
tensor-parallel worker receives the broadcast itself and loads its own shard. Kept apart from
areal_hpc.generator.engine, which runs in the rank's own process: nothing here may assume that process's
state (its MPI world, its logging), only vLLM's worker.
"""

from __future__ import annotations

from collections.abc import Iterator


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`): runs where the model lives, so with
    gen_tp > 1 every tensor-parallel worker receives the broadcast itself and loads its shard.

    The iterator is lazy, so each bucket is loaded as it arrives; `_areal_load` says how.
    """

    def areal_load_weights(self, buckets: list) -> int:
        """Load buckets of Hugging Face named tensors (the model shards them by its own TP rank); returns their
        bytes."""
        named = [item for bucket in buckets for item in bucket]
        self._areal_load(iter(named))
        return _nbytes(t for _, t in named)

    def areal_load_adapter(self, tensors: dict, rank: int, alpha: float, adapter_id: int) -> int:
        """Replace the LoRA adapter `adapter_id` by `tensors` (PEFT's names, whole: vLLM's LoRA layers take
        this worker's TP slice), in memory: the pair vLLM would read from an adapter directory, built by
        its own `LoRAModel.from_lora_tensors` and put in the worker's adapter cache, where a request's
        `LoRARequest` of that id finds it loaded (vLLM reads its path only for an id it does not hold).
        vLLM folds alpha / r into B in place, so it gets copies. Returns their bytes."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        targets = sorted({name.split(".")[-3] for name in tensors})
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": targets})
        helper.validate_legal(manager.lora_config)
        lora = LoRAModel.from_lora_tensors(
            adapter_id,
            {name: t.clone() for name, t in tensors.items()},
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
        )
        adapters = manager._adapter_manager  # vLLM 0.32: the worker's cache of adapters (LRU)
        adapters.remove_adapter(adapter_id)
        adapters.add_adapter(lora)
        return _nbytes(tensors.values())

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
          - unquantized MoE experts whose kernel repacks the weights after loading (on CPU into its
            grouped-GEMM layout, of the checkpoint's shape, so the check above cannot see it): vLLM's
            method repacks only at the first load (while it has no kernel), and its own reload
            skips that step, leaving the experts unpacked in the packed layout; so such a module
            gets fresh tensors as above and loses its kernel, and its post-processing runs as at the
            first load (a new kernel, the repacking);
          - all of them run the unquantized `process_weights_after_loading` again afterwards: it
            derives only from the weights (on CPU it creates the oneDNN handles of the linear layers
            and of the embedding / lm_head, whose sampling would otherwise stay on the old weights);
          - anything else (quantized): vLLM's layerwise reload, applied to those modules only.
        On GPU an unquantized model loads in place throughout (no post-processing, no copies; its
        Triton experts repack nothing).
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
            repacked = _repacked_experts(module)
            if repacked or not _as_recorded(module):
                info = get_layerwise_info(module)
                restore_layer_on_meta(module, info)
                materialize_layer(module, info)
                restored.append((name, module))
            if repacked:
                module.quant_method.moe_kernel = None
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
        rendezvous and the start-up check, within `timeout_s`); keeps the connected receiver here. On a
        GPU one more line: the GPU memory the groups' communicators took, against what
        areal_hpc.generator.memory budgets for them."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_rank

        from areal_hpc.generator.memory import NCCL_COMMUNICATOR_BYTES

        tp_rank = get_tensor_model_parallel_rank()
        on_gpu = receiver.specs[0].backend == "nccl"
        free = torch.cuda.mem_get_info()[0] if on_gpu else 0
        joined = receiver.join(tp_rank, timeout_s)
        self._areal_receiver = receiver  # in a worker process, its own unpickled copy holds the groups
        if on_gpu:
            took, groups = free - torch.cuda.mem_get_info()[0], len(receiver.specs)
            joined.append(
                f"worker tp {tp_rank}: the {groups} weight-sync group(s) took {took / 1e9:.2f} GB of GPU memory "
                f"(budgeted: {groups * NCCL_COMMUNICATOR_BYTES / 1e9:.2f} GB, areal_hpc.generator.memory)"
            )
        return joined

    def areal_receive_weights(self) -> int:
        """Receive a sync over the groups joined at start and load each bucket as it arrives, on one stream
        (`WeightReceiver.receive`: the race a payload's memory would otherwise be open to); returns its bytes."""
        nbytes = 0

        def stream():
            nonlocal nbytes
            for bucket in self._areal_receive():
                nbytes += _nbytes(t for _, t in bucket)
                yield from bucket

        self._areal_load(stream())
        return nbytes

    def areal_receive_adapter(self, rank: int, alpha: float, adapter_id: int) -> int:
        """`areal_load_adapter` of a sync received over the groups joined at start (the adapter's tensors,
        whole: loaded once all have arrived); returns its bytes."""
        return self.areal_load_adapter(
            {name: t for bucket in self._areal_receive() for name, t in bucket}, rank, alpha, adapter_id
        )

    def _areal_receive(self) -> Iterator:
        """The buckets of one sync (`WeightReceiver.receive`), on the stream vLLM runs the model on."""
        receiver = getattr(self, "_areal_receiver", None)
        if receiver is None:
            raise RuntimeError("weight sync before the worker joined its groups (GenerationEngine.join_weight_sync)")
        loading = None
        if receiver.device.type == "cuda":  # the stream vLLM runs the model and loads the weights on, here
            from vllm.utils.torch_utils import current_stream

            loading = current_stream()
        return receiver.receive(loading)

    def areal_leave_weight_sync(self) -> None:
        receiver = getattr(self, "_areal_receiver", None)
        if receiver is not None:
            receiver.leave()
        self._areal_receiver = None

    def areal_record_routing(self) -> None:
        """Record the experts of every token this worker computes from now on (`routing.RoutingRecorder`)."""
        from areal_hpc.generator.routing import RoutingRecorder

        self._areal_routing = RoutingRecorder(self.model_runner)

    def areal_take_routing(self, requests: list[tuple[str, int]]) -> list | None:
        """`RoutingRecorder.take`: [n, L, K] per (vLLM request id, n) of requests finished in the last step;
        on tensor-parallel rank 0 only (every rank routes every token alike: the router is not split)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return self._areal_routing.take(requests) if get_tensor_model_parallel_rank() == 0 else None


def _unquantized(module) -> bool:
    """No quant method, or one of vLLM's unquantized ones (linear, embedding, MoE experts), whose
    `process_weights_after_loading` derives only from the checkpoint-format weights (so it can run
    again after any load)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    quant = getattr(module, "quant_method", None)
    return quant is None or type(quant) in (
        UnquantizedLinearMethod,
        UnquantizedEmbeddingMethod,
        UnquantizedFusedMoEMethod,
    )


def _repacked_experts(module) -> bool:
    """Whether `module` is MoE experts whose kernel transforms the weights after loading (its
    `process_weights_after_loading` is more than the base class's no-op: vLLM's CPU experts prepack)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if kernel is None:
        return False
    return type(kernel.fused_experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading


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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _has_tensors(module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
