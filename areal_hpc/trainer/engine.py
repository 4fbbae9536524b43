"""One trainer rank's Megatron state: the process groups, its model stage, the optimizer.

`init_parallel` starts torch.distributed among the trainer ranks and Megatron's parallel state in
its default rank order, and checks that Megatron placed every rank where the layout's formula
(`areal_hpc.layout.TrainerGrid`) says. `Engine` builds this rank's stage of a Qwen2/Qwen3 model from a
Hugging Face directory, wraps it in Megatron's DistributedDataParallel, builds Megatron's optimizer,
and runs Megatron's forward/backward schedule (1F1B across pipeline stages) over packed micro-batches.

Device: decided once per rank (`areal_hpc.device`) and handed to `init_parallel`; the backend follows
from it (NCCL on cuda, gloo on cpu) and everything the engine allocates lives on it. A trainer rank
sees one GPU, its own (the launcher narrows CUDA_VISIBLE_DEVICES), so its CUDA device is cuda:0.

Optimizer: Megatron's distributed optimizer on every device (fp32 main weights and Adam moments
sharded over the data-parallel ranks; gradients reduce-scattered, weights all-gathered: gloo in torch
2.13 has both collectives). Its step is Megatron's `step()` taken apart so that a non-finite loss or
gradient norm stops the run before any weight changes (`optimizer_step`).

Gradient reduce: overlapped with the backward pass (DDP's `overlap_grad_reduce`): in the last
micro-batch of a minibatch, each bucket of gradients is reduce-scattered as soon as its last gradient
is in, while the layers before it still compute theirs (from the engine's second minibatch on: DDP
learns in the first which gradients each bucket waits for). Megatron's schedule keeps it off for the
other micro-batches (`no_sync`), and `finalize_model_grads` waits for it before the TP and pipeline
all-reduces and the division by the token count. The weights' all-gather after the step is not
overlapped (`overlap_param_gather` would defer it to the next forward pass's hooks): the weight sync
and checkpoints read the weights right after the step, outside any forward pass.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from areal_hpc.arch import QwenArch
from areal_hpc.config import PPOConfig
from areal_hpc.device import backend
from areal_hpc.parallel import TrainerCoords, TrainerGrid, check_trainer
from areal_hpc.trainer import cpu_compat
from areal_hpc.trainer.convert import export_stage, load_hf_into
from areal_hpc.trainer.lora import LoraSpec, add_adapters, base_only, export_adapters
from areal_hpc.trainer.model import build_stage, transformer_config


@dataclass(frozen=True)
class Parallel:
    """This trainer rank: its trainer-local rank, the TP x PP x DP grid it is a place of (sizes and rank
    order are the grid's), and the device it computes on."""

    rank: int
    grid: TrainerGrid
    device: torch.device

    @property
    def coords(self) -> TrainerCoords:
        """This rank's (tp, pp, dp) place in the grid."""
        return self.grid.coords(self.rank)

    @property
    def stage_source(self) -> bool:
        """Whether this rank sends its pipeline stage's dense weights (`TrainerGrid.stage_source`)."""
        return self.rank == self.grid.stage_source(self.coords.pp)

    @property
    def expert_rank(self) -> int:
        """This rank's expert-parallel rank (`TrainerGrid.expert_rank`): it holds that rank's experts."""
        return self.grid.expert_rank(self.rank)

    @property
    def expert_source(self) -> bool:
        """Whether this rank sends its expert rank's experts of its stage (`TrainerGrid.expert_source`)."""
        return self.rank == self.grid.expert_source(self.coords.pp, self.expert_rank)


def init_parallel(
    rank: int, world: int, tp: int, pp: int, store, device: str, timeout_s: float = 300.0, ep: int = 1
) -> Parallel:
    """torch.distributed (gloo on cpu, NCCL on cuda) + Megatron parallel state; checks the rank order.

    `ep`: expert-parallel size (MoE models; experts never split over TP).
    `store`: the world's TCPStore (`areal_hpc.network.world_store` in a run, `spawn.run_ranks`'s here).
    `device` is the rank's resolved device, "cpu" or "cuda" (`areal_hpc.device.resolve_device`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    grid = TrainerGrid.of(world, tp, pp, ep)  # raises when tp x pp does not divide world
    dev = torch.device("cpu") if device == "cpu" else torch.device(device, 0)  # its own GPU: see above
    cpu_compat.enable(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend(device),
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    ps.initialize_model_parallel(
        tp,
        pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    par = Parallel(rank, grid, dev)
    megatron = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
    if megatron != par.coords:
        raise RuntimeError(
            f"Megatron placed trainer rank {rank} at (tp, pp, dp) = {megatron}, "
            f"the layout expects {tuple(par.coords)} (rank = tp + TP * (dp + DP * pp))"
        )
    if ps.get_expert_model_parallel_rank() != par.expert_rank:
        raise RuntimeError(
            f"Megatron placed trainer rank {rank} at expert rank {ps.get_expert_model_parallel_rank()}, "
            f"the layout expects {par.expert_rank} ((tp + TP * dp) % EP)"
        )
    return par


def shutdown_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def adam_step(value: float, param: torch.Tensor) -> torch.Tensor:
    """Adam's step count as fused Adam keeps it: a float32 scalar on the parameter's device."""
    return torch.tensor(float(value), dtype=torch.float32, device=param.device)


class NonFiniteError(RuntimeError):
    """A training step's loss or gradient norm is not finite; raised before any weight changes."""


class Engine:
    """This rank's model stage (in Megatron's DDP), its optimizer, and the forward/backward schedule."""

    def __init__(
        self,
        model_dir: str | Path,
        par: Parallel,
        ppo: PPOConfig,
        dtype: torch.dtype = torch.float32,
        total_steps: int = 1,
        overlap_grad_reduce: bool = True,
        lora: LoraSpec | None = None,
        teacher: str | Path = "",
        teacher_dtype: torch.dtype | None = None,
    ):
        """The stage of the model in `model_dir` for this rank; `ppo` (the config section) gives Adam's
        settings and learning-rate schedule (over `total_steps` training steps), the recompute setting
        and sequence parallelism. `overlap_grad_reduce` False reduces the gradients after the backward
        pass instead of during it (for comparison: the step is the same). `lora`: LoRA adapters on the
        frozen base (`trainer.lora`), the only weights trained. `teacher`: the Hugging Face directory of
        `distill.teacher` (empty: none), run in `teacher_dtype` (None: `dtype`)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import unwrap_model

        self.par = par
        self.model_dir = Path(model_dir)
        self.arch = QwenArch.from_hf(model_dir)
        check_trainer(self.arch, par.grid.tp, par.grid.pp, par.grid.ep, par.grid.dp)
        self.device = par.device
        self.lora = lora
        self.resumed_from: Path | None = None
        """The checkpoint this engine's state was loaded from (named in a non-finite step's error)."""
        grid = par.grid
        self.config = transformer_config(
            self.arch,
            grid.tp,
            grid.pp,
            self.device,
            dtype,
            ppo.recompute,
            ppo.sequence_parallel and grid.tp > 1,
            grid.ep,
            ppo.load_balancing_coef,
        )
        # Micro-batches differ in length: the pipeline sends each activation's shape before it.
        self.config.variable_seq_lengths = True
        stage = self._load_stage(self.model_dir, self.arch, self.config, dtype)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=True
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=stage)
        self.stage = unwrap_model(self.model)
        """This rank's GPTModel stage itself, inside DDP (and Float16Module in bf16/fp16)."""
        self.reference: torch.nn.Module | None = None
        """With ppo.kl_coef > 0: a frozen copy of the initial policy's stage (the weights of `model_dir`,
        whatever checkpoint the engine loads later), same sharding, no gradient, no optimizer; with LoRA the
        model itself, its adapters off during the pass (`reference_pass`): the base is the initial policy."""
        if ppo.kl_coef > 0:
            if lora:
                self.reference = self.model
            else:
                self.reference = self._load_stage(self.model_dir, self.arch, self.config, dtype)
                self.reference.requires_grad_(False).eval()
        self.teacher: torch.nn.Module | None = None
        """With distill.teacher: the teacher's stage, split over TP and PP as the policy is (its own layers
        per stage), frozen: no gradient, no optimizer, no adapters, never saved (its directory is read
        again on a resume)."""
        if teacher:
            arch = QwenArch.from_hf(teacher)
            check_trainer(arch, grid.tp, grid.pp)  # dense: replicated over any expert-parallel ranks
            teacher_dtype = teacher_dtype or dtype
            config = transformer_config(
                arch, grid.tp, grid.pp, self.device, teacher_dtype, "none", self.config.sequence_parallel, grid.ep
            )
            config.variable_seq_lengths = True
            self.teacher = self._load_stage(Path(teacher), arch, config, teacher_dtype, adapters=False)
            self.teacher.requires_grad_(False).eval()
        self.grad_clip = ppo.grad_clip
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=ppo.lr,
                min_lr=ppo.min_lr,
                weight_decay=ppo.weight_decay,
                adam_beta1=ppo.adam_beta1,
                adam_beta2=ppo.adam_beta2,
                clip_grad=ppo.grad_clip,
                adam_eps=ppo.adam_eps,
                params_dtype=dtype,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )
        # torch's fused Adam (CPU and CUDA kernels): Megatron builds a plain torch Adam, whose default
        # implementation allocates temporaries as large as the parameters (gigabytes for a 1.5B model).
        for adam in self.adams:
            for group in adam.param_groups:
                group["fused"], group["foreach"] = True, False
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=ppo.lr,
            min_lr=ppo.min_lr,
            lr_warmup_steps=ppo.lr_warmup_steps,
            lr_decay_steps=max(total_steps, ppo.lr_warmup_steps + 1),
            lr_decay_style=ppo.lr_decay,
            start_wd=ppo.weight_decay,
            end_wd=ppo.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        """Megatron's learning-rate schedule, set from the training step (`set_step`)."""
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss if dtype == torch.float16 else None

    def _load_stage(
        self, model_dir: Path, arch: QwenArch, config, dtype: torch.dtype, adapters: bool = True
    ) -> torch.nn.Module:
        """This rank's stage of the model in `model_dir` with its weights, the engine's LoRA adapters added
        unless `adapters` is False (wrapped in Float16Module in bf16/fp16)."""
        from megatron.core.transformer.module import Float16Module

        grid, coords = self.par.grid, self.par.coords
        stage = build_stage(arch, config, self.device)
        load_hf_into(stage, model_dir, arch, coords.tp, grid.tp, coords.pp, grid.pp, self.par.expert_rank, grid.ep)
        if self.lora and adapters:
            add_adapters(stage, arch, self.lora)
        if dtype != torch.float32:
            # As Megatron's own training does: every parameter in the 16-bit dtype (the local layer
            # spec makes its norms fp32; the distributed optimizer needs one dtype per gradient buffer).
            stage = Float16Module(config, stage)
        return stage

    def reference_pass(self):
        """The context of a pass of `reference`: with LoRA, the adapters off."""
        return base_only(self.model) if self.lora else nullcontext()

    @property
    def adams(self) -> list[torch.optim.Optimizer]:
        """The torch Adams inside Megatron's chain of distributed optimizers: one, or with experts two
        (the dense parameters, reduced over DP; the experts', reduced over the expert-DP ranks)."""
        return [opt.optimizer for opt in self.optimizer.chained_optimizers]

    def init_optimizer_state(self) -> None:
        """Give every parameter Adam's state (zero moments, step 0) before the first step, as Adam
        would at it (Megatron's `init_state_fn` leaves the step out)."""
        for opt in self.optimizer.chained_optimizers:
            opt.init_state_fn(opt.optimizer, opt.config)
            for p, state in opt.optimizer.state.items():
                state.setdefault("step", adam_step(0.0, p))

    @property
    def is_last_stage(self) -> bool:
        return self.par.coords.pp == self.par.grid.pp - 1

    def forward_backward(
        self, microbatches: list, forward_step: Callable, forward_only: bool, seq_length: int, model=None
    ) -> list[dict]:
        """Megatron's schedule over `microbatches` through the policy (or `model`, forward only: the
        reference); the loss dicts of the last stage (else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if model is None:
            model = self.model
            if not forward_only:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            self.model.train(not forward_only)
        elif not forward_only:
            raise ValueError("only the policy trains: a forward-backward pass through another model")
        run = get_forward_backward_func()
        return run(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def set_step(self, version: int) -> float:
        """Set the learning rate of training step `version + 1` (the one that trains version `version`);
        returns it. A function of the step alone: a resumed run takes up the schedule where it was."""
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        self.scheduler.num_steps = 0
        self.scheduler.step(version + 1)
        return float(get_canonical_lr_for_logging(self.optimizer.param_groups))

    def optimizer_step(self, what: str) -> float:
        """Clip the gradients and step; returns the gradient norm before clipping.

        Megatron's `ChainedOptimizer.step()` in its own order (gradients to the main params, the norm
        over every optimizer of the chain, each one's gradients clipped by it, step), with a check
        before the clip: a non-finite norm (or fp16 overflow) raises NonFiniteError naming `what` (the
        step) and leaves every weight as it was. Collective over the trainer ranks (the norm is
        all-reduced).
        """
        from megatron.core.optimizer import optimizer as megatron_optimizer

        opt = self.optimizer
        found_inf = opt.prepare_grads()
        grad_norm = opt.get_grad_norm()
        if found_inf or not math.isfinite(grad_norm):
            raise NonFiniteError(f"{what}: gradient norm is {grad_norm}{self._origin()}; no weight was changed")
        if self.grad_clip > 0:
            for chained in opt.chained_optimizers:
                params = chained.get_parameters()
                if params:  # the module's function: cpu_compat's route on the CPU
                    megatron_optimizer.clip_grad_by_total_norm_fp32(params, self.grad_clip, grad_norm)
        opt.step_with_ready_grads()
        return float(grad_norm)

    def check_finite(self, value: float, name: str, what: str) -> None:
        """Raise NonFiniteError when `value` (a step's `name`) is not finite."""
        if not math.isfinite(value):
            raise NonFiniteError(f"{what}: {name} is {value}{self._origin()}; no weight was changed")

    def _origin(self) -> str:
        return f" (resumed from {self.resumed_from})" if self.resumed_from is not None else ""

    def export(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This stage's weights under Hugging Face names; every rank of the stage iterates it to the end.

        First the dense tensors (all but the experts), TP-gathered within data-parallel replica 0 and
        yielded on the stage source; then this rank's experts (global names), yielded on each expert
        source (`Parallel.expert_source`) without a collective. Other ranks yield nothing. With ep 1
        the stage source is the only source."""
        from megatron.core import parallel_state as ps

        par = self.par
        return export_stage(
            self.model,
            self.arch,
            par.coords.pp,
            par.grid.pp,
            ps.get_tensor_model_parallel_group(),
            dst=ps.get_tensor_model_parallel_src_rank(),
            dense=par.coords.dp == 0,
            experts=par.expert_source,
            ep_rank=par.expert_rank,
            ep=par.grid.ep,
        )

    def export_adapters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """With LoRA, `export` of the adapters alone, under PEFT's names: TP-gathered within data-parallel
        replica 0, yielded on the stage source (`trainer.lora.export_adapters`); other ranks yield nothing."""
        from megatron.core import parallel_state as ps

        if self.par.coords.dp != 0:
            return iter(())
        return export_adapters(
            self.model, ps.get_tensor_model_parallel_group(), dst=ps.get_tensor_model_parallel_src_rank()
        )

    def export_full(self) -> dict[str, torch.Tensor] | None:
        """The whole model under Hugging Face names on trainer rank 0 (None elsewhere); collective
        over the trainer ranks: each source's part (dense tensors, experts) is gathered there."""
        part = {k: v.cpu() for k, v in self.export()}
        if self.par.grid.size == 1:
            return part
        parts = [None] * self.par.grid.size if self.par.rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        if self.par.rank != 0:
            return None
        return {k: v for p in parts for k, v in p.items()}
