"""tools/gpu_check.sh --trainer-only, as a user runs it on a GPU node, here on this machine's device
(AREAL_DEVICE resolved as the trainer tests resolve it): every trainer check passes and the summary
counts them."""

from __future__ import annotations

import os
import subprocess

import pytest

from areal_hpc.device import visible_gpus
from areal_hpc.trainer.spawn import default_device
from tests.helpers import REPO

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_trainer_checks_pass_and_are_summarised():
    device = default_device()
    proc = subprocess.run(
        [str(REPO / "tools" / "gpu_check.sh"), "--trainer-only"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "AREAL_DEVICE": device},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    summary = out[out.index("== areal-hpc gpu_check summary") :].splitlines()
    checks = [line for line in summary if line.startswith(("PASS", "FAIL", "SKIP"))]
    two_tp = device == "cpu" or len(visible_gpus()) >= 2
    assert [c.split(":")[0] for c in checks if c.startswith("PASS")] == [
        "PASS trainer logits vs transformers, export round trip (TP 1)",
        "PASS PPO step, save, resume = uninterrupted (float32, TP 1)",
        "PASS PPO step, save, resume = uninterrupted (bfloat16, TP 1)",
        *(
            ["PASS trainer logits vs transformers (TP 2)", "PASS PPO step, save, resume = uninterrupted (bf16, TP 2)"]
            if two_tp
            else []
        ),
    ]
    assert not any(c.startswith("FAIL") for c in checks)
    assert summary[-1] == f"{5 if two_tp else 3} passed, 0 failed, {len(checks) - (5 if two_tp else 3)} skipped"


def test_a_model_directory_replaces_the_smoke_configs_shape(tmp_path, monkeypatch):
    """`tools/gpu_check.sh model.path=DIR`: the shape is DIR's config.json, not gpu-smoke.yaml's tiny one
    (which, given as it is, contradicts DIR and is a config error)."""
    from areal_hpc.arch import model_arch
    from areal_hpc.config import ConfigError, load_config
    from areal_hpc.testing.inputs import MODEL
    from areal_hpc.tiny import hf_config

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    model = model_arch(MODEL)  # the trainer checks' model: another shape than gpu-smoke.yaml's
    hf_config(MODEL).save_pretrained(tmp_path)
    smoke = REPO / "configs" / "gpu-smoke.yaml"
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(smoke, [f"model.path={tmp_path}"])
    arch = model_arch(load_config(smoke, gpu_check.smoke_overrides([f"model.path={tmp_path}"])).model)
    assert arch == model
    assert gpu_check.smoke_overrides(["rollout.group_size=4"]) == ["rollout.group_size=4"]
