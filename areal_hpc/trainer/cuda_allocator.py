"""A trainer rank's CUDA caching allocator: expandable segments, asked for before it first allocates.

Why: the packer fills each micro-batch up to `ppo.max_tokens_per_mb` with whatever sequences there are,
so the activations and the logprob chunks change size from one micro-batch to the next. The caching
allocator's default segments keep the size they were made with: memory freed at one size serves the
next sizes badly, and reserved memory grows with the fragments until an allocation fails with enough
memory free in pieces. With expandable segments it maps more physical memory onto one growing address
range instead (torch's CUDA memory notes, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").

When: torch reads its allocator settings once, when the allocator first needs them, from
PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF (torch 2.13: `CUDAAllocatorConfig::instance` in
c10/cuda/CUDAAllocatorConfig.h, and the device-generic one in libc10 the same way); importing torch and
`torch.cuda.is_available()` do not read them. `areal_hpc.main` asks on a trainer rank right after the
rank's device is resolved, before the weight-sync set-up or the engine allocates on the GPU; the
trainer ranks that `trainer.spawn` starts (GPU check, benchmarks) ask before `init_parallel`.

Generator ranks are left alone: vLLM manages its engine's memory itself.
"""

from __future__ import annotations

import os
import re

SETTING = "expandable_segments:True"
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where torch reads the allocator settings, in its order: the first one set is the one it uses."""


def expandable_segments(environ=os.environ) -> str:
    """Add expandable segments to the allocator settings torch will read, unless those already say
    (a user's expandable_segments, True or False, stands; so does backend:cudaMallocAsync, which has
    no segments); returns what the settings are, for the rank's log."""
    name = next((v for v in VARIABLES if v in environ), VARIABLES[0])
    current = environ.get(name, "")
    if re.search(r"(^|,)\s*(expandable_segments\s*:|backend\s*:\s*cudaMallocAsync)", current):
        return f"CUDA allocator settings {name}={current} (as given)"
    environ[name] = f"{current},{SETTING}" if current.strip() else SETTING
    return f"CUDA allocator settings {name}={environ[name]} (expandable segments: micro-batch sizes vary)"
