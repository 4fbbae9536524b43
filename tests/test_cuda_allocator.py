"""A trainer rank's CUDA allocator settings: expandable segments added to what the user set, never over
a choice of theirs, in the variable torch reads, and read by torch after it is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_hpc.trainer.cuda_allocator import expandable_segments
from tests.support.helpers import REPO


@pytest.mark.parametrize(
    "environ,want",
    [
        ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"},
        ),
        # torch reads PYTORCH_ALLOC_CONF only when PYTORCH_CUDA_ALLOC_CONF is not set
        (
            {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:2]"},
            {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:2],expandable_segments:True"},
        ),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
        ),
    ],
)
def test_expandable_segments_join_the_users_settings(environ, want):
    line = expandable_segments(environ)
    assert environ == want
    assert "expandable_segments:True" in line


@pytest.mark.parametrize(
    "setting",
    ["expandable_segments:False", "max_split_size_mb:64, expandable_segments : True", "backend:cudaMallocAsync"],
)
def test_a_users_own_choice_stands(setting):
    environ = {"PYTORCH_CUDA_ALLOC_CONF": setting}
    assert "as given" in expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": setting}


def test_torch_reads_the_settings_after_it_is_imported():
    """What areal_hpc.main relies on: torch imported and asked for CUDA (`resolve_device`) before the
    settings are set still allocates with them (they are read at the allocator's first use)."""
    code = (
        "import os, torch\n"
        "from areal_hpc.device import resolve_device\n"
        "resolve_device('auto')\n"
        "from areal_hpc.trainer.cuda_allocator import expandable_segments\n"
        "expandable_segments()\n"
        "print(torch._C._accelerator_getAllocatorSettings())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_")} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "expandable_segments:True"
