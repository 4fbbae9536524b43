"""Run megatron-core on a machine without CUDA: its few CUDA-only calls, routed to the CPU.

megatron-core 0.16.1 assumes a GPU in a handful of places on the trainer's path. Without CUDA each of
them raises; with these routes the same Megatron code (GPTModel, tensor/pipeline parallel layers, the
1F1B schedule, DDP, the optimizer) runs on the CPU over gloo. Every route:

| megatron-core call                                   | where                                     | on CPU            |
|------------------------------------------------------|-------------------------------------------|-------------------|
| `torch.cuda.current_device()` as a device argument   | global memory buffer, p2p shapes, layers, | `"cpu"`           |
|                                                      | rotary embeddings, DDP buffers            |                   |
| `tensor.cuda()`                                      | language_module (tied embedding copy)     | the tensor itself |
| `torch.cuda.synchronize()`                           | pipeline_parallel.p2p_communication       | no-op             |
| the CUDA RNG tracker (`torch.cuda.get_rng_state`...) | tensor_parallel.random                    | CPU RNG states    |
| `torch.zeros/tensor(..., device="cuda")` literals    | pipeline_parallel.schedules (token count),| `device="cpu"`    |
|                                                      | optimizer (loss scale, grad-norm buffers),|                   |
|                                                      | utils (local multi-tensor l2 norm)        |                   |
| `clip_grad_by_total_norm_fp32` asserts CUDA grads    | optimizer.clip_grads                      | same math, CPU    |
| `param.type()` must name a `torch.cuda.*Tensor`       | DistributedOptimizer and Float16Optimizer | CPU tensors named |
|                                                      | constructors (the main-param setup)       | as CUDA ones      |
| a `torch.cuda.Stream` for device-to-host copies of   | moe.token_dispatcher, the all-to-all      | none: the counts  |
| the token counts, and its event synchronized         | dispatcher (MoE; the trainer's only one)  | are on the CPU    |

`enable(device)` installs them once, and only for a CPU device. The device comes from
`areal_hpc.device` (decided once per rank); call this before building any Megatron object.

One more route is installed on every device, because it is about TransformerEngine, not the CPU
(`te_less_routes`, called by `enable`): the trainer builds Megatron's local layer spec, which runs on a
machine without TransformerEngine, and megatron-core 0.16.1 has one call that fails there:

| megatron-core call                                   | where                                     | without TE        |
|------------------------------------------------------|-------------------------------------------|-------------------|
| `te_general_gemm` (the MoE router's gate)            | moe_utils.RouterGatingLinearFunction      | None: its torch   |
|                                                      | (imported only when TE is, then tested    | mm/addmm branch,  |
|                                                      | against None: a NameError without TE)     | the same math     |
"""

from __future__ import annotations

import contextlib
import types

import torch

_enabled = False


def enabled() -> bool:
    """Whether the CPU routes are installed in this process."""
    return _enabled


def enable(device: torch.device) -> bool:
    """Install the CPU routes when `device` is the CPU (idempotent); returns whether they are active.
    The TransformerEngine-less routes (`te_less_routes`) are installed on every device."""
    global _enabled
    te_less_routes()
    if _enabled or torch.device(device).type != "cpu":
        return _enabled
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.utils as mutils

    # Megatron passes `torch.cuda.current_device()` as `device=` when it allocates; "cpu" works there.
    torch.cuda.current_device = lambda: "cpu"
    # Without CUDA, `.cuda()` can only fail; Megatron calls it to move a weight it already placed.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # p2p calls synchronize against a race of batched isend/irecv on CUDA streams; CPU ops are synchronous.
    torch.cuda.synchronize = lambda device=None: None
    # The tracker's class is looked up at `initialize_rng_tracker` time, so this one is used from then on.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # These modules create small tensors with a literal device="cuda": give each a torch whose factory
    # functions map "cuda" to the CPU (every other attribute is the real torch).
    for module in (schedules, optimizer, clip_grads, grad_scaler, mutils):
        module.torch = _CpuTorch()
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    # The mixed-precision and distributed optimizers sort parameters by `param.type()`, a string that
    # names the CUDA tensor types only; while they are built, CPU tensors answer with those names.
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # The all-to-all dispatcher copies its token counts to the host on a side CUDA stream (made once per
    # process, kept on the class) and waits for that copy's event; on the CPU they are there already.
    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    alltoall.cuda_dtoh_stream = "cpu"  # any value but None: the constructor makes no CUDA stream
    alltoall._maybe_dtoh_and_synchronize = _counts_on_host
    _enabled = True
    return True


def te_less_routes() -> None:
    """Without TransformerEngine: the MoE router's gate through torch (idempotent; any device)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None


class CpuRNGStatesTracker:
    """Megatron's named RNG states (`get_cuda_rng_tracker().add/fork`) kept as CPU generator states.

    `fork(name)` runs its body with the named state and stores the advanced state back, leaving the
    default RNG as it was: the semantics of Megatron's CudaRNGStatesTracker on the CPU generator.
    """

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _with_cuda_type_names(init):
    """`init` run with `Tensor.type()` (no arguments) naming CPU float tensors as their CUDA types."""

    def wrapped(self, *args, **kwargs):
        real = torch.Tensor.type

        def type_(tensor, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw:
                name = real(tensor)
                return _CUDA_TYPE_NAMES.get(name, name)
            return real(tensor, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real

    return wrapped


def _cpu(dev):
    return "cpu" if dev is not None and torch.device(dev).type == "cuda" else dev


class _CpuTorch(types.ModuleType):
    """`torch` with `device="cuda"` in its tensor factories mapped to the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *args, device=None, **kwargs):
        return torch.zeros(*args, device=_cpu(device), **kwargs)

    def ones(self, *args, device=None, **kwargs):
        return torch.ones(*args, device=_cpu(device), **kwargs)

    def empty(self, *args, device=None, **kwargs):
        return torch.empty(*args, device=_cpu(device), **kwargs)

    def tensor(self, *args, device=None, **kwargs):
        return torch.tensor(*args, device=_cpu(device), **kwargs)


def _counts_on_host(self, point: str, tokens_per_expert=None):
    """The all-to-all dispatcher's device-to-host step on the CPU: at the copy point its split sizes
    become numpy arrays, as the GPU path leaves them; there is nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's grad clip (scale every grad by max_norm / total_norm when that is < 1), without its
    assertion that the grads are CUDA tensors."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)
