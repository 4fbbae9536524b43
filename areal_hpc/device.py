"""The compute device, decided once per rank and handed down (docs/design.md, Devices and placement).

`cluster.device` is auto, cpu or cuda. Each rank resolves it once at start, after its
`CUDA_VISIBLE_DEVICES` is set, and passes the result to whatever it builds; this is the one module
that asks torch whether CUDA is there. Everything below takes a device: the torch.distributed backend
follows from it (`backend`), and so do the megatron-core CPU routes (`trainer/cpu_compat.py`).

`visible_gpus` says which GPUs a process may use before torch is imported (the rank narrows
`CUDA_VISIBLE_DEVICES` from it, and CUDA reads that variable only once, when it starts).
"""

from __future__ import annotations

import os

CHOICES = ("auto", "cpu", "cuda")
DRIVER_GPUS = "/proc/driver/nvidia/gpus"
"""One directory per GPU that the NVIDIA driver manages (Linux)."""


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them (indices or UUIDs).

    The variable's entries when it is set (Slurm sets it for each task of a job with GPUs), else one
    index per GPU of the NVIDIA driver, else none. Read without torch or NVML: torch must not be
    imported before the rank has narrowed the variable, and NVML's Python binding is not always there.
    """
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir(DRIVER_GPUS)))]
    except OSError:
        return []


def resolve_device(requested: str = "auto", gpus: bool = True) -> str:
    """'cpu' or 'cuda' for this process.

    `gpus`: whether the rank map gives this rank any GPU. A rank without GPUs (the controller, a
    reward worker, any rank of a CPU run) is on the CPU whatever is asked. auto: cuda when torch sees
    a GPU. cuda without a visible GPU is an error that says what this process sees.
    """
    if requested not in CHOICES:
        raise ValueError(f"cluster.device must be one of {', '.join(CHOICES)} (got {requested!r})")
    if requested == "cpu" or not gpus:
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise RuntimeError(
            "cluster.device is cuda but torch sees no GPU here "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, "
            f"torch {torch.__version__} built for CUDA {torch.version.cuda})"
        )
    return "cuda"


def backend(device: str) -> str:
    """The torch.distributed backend of a device: nccl on cuda, gloo on cpu."""
    return "nccl" if device == "cuda" else "gloo"
