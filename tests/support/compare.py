"""The trainer checks' judgements: a result from the ranks that hold it (`pick`), the largest difference
between two results (`max_diff`), whether two PPO steps trained the same (`assert_same_step`), and what is wrong as sentences (`*_problems`: empty when nothing is),
which the tests assert empty and the GPU check prints.
"""

from __future__ import annotations

import math

import torch


def pick(results: dict, key: str):
    """The value of `key` from the one rank of `run_ranks` results that returned it."""
    found = [r[key] for r in results.values() if key in r]
    if len(found) != 1:
        raise KeyError(f"{key!r} returned by {len(found)} ranks, expected one")
    return found[0]


def max_diff(a, b) -> float:
    """Largest |a - b| over two equal structures (dicts by key, lists in order) of tensors."""
    if isinstance(a, dict):
        if sorted(a) != sorted(b):
            raise KeyError(f"different keys: {sorted(set(a) ^ set(b))}")
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            raise ValueError(f"{len(a)} != {len(b)} entries")
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if a.shape != b.shape:
        raise ValueError(f"shapes {tuple(a.shape)} != {tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# --- judgements: what is wrong, as sentences (empty: nothing) -------------------------------------


def assert_same_step(got: dict, want: dict) -> None:
    """Two PPO steps from the same weights, each {"stats": ppo_step's, "weights": the exported ones},
    trained the same: the same loss and figures, the same weights after."""
    import pytest

    for key in ("ppo/loss", "ppo/clip_frac", "ppo/grad_norm", "ppo/behav_weight_mean", "ppo/logp_mismatch"):
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-4, abs=1e-6), key
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=2e-6, msg=name)


def logits_problems(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> list[str]:
    """The probe sequences whose logits differ from `want` (transformers') by more than `tol`."""
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            out.append(f"sequence {i}: logits of shape {tuple(g.shape)}, transformers {tuple(w.shape)}")
        elif (d := max_diff(g, w)) > tol:
            out.append(f"sequence {i}: logits differ from transformers' by {d:.2e} > {tol:.0e}")
    return out


def export_problems(exported: dict, original: dict) -> list[str]:
    """Where the exported Hugging Face weights are not the checkpoint's, name for name and bit for bit."""
    if sorted(exported) != sorted(original):
        return [f"exported names differ from the checkpoint's: {sorted(set(exported) ^ set(original))}"]
    return [
        f"{k}: exported tensor differs from the checkpoint's"
        for k, v in original.items()
        if not torch.equal(exported[k], v)
    ]


def resume_problems(results: dict, tol: float) -> list[str]:
    """What a resumed run (`resume_rank`) got wrong against the uninterrupted one."""
    out = []
    for rank, r in sorted(results.items()):
        if r["load_diff"] != 0.0:
            out.append(f"rank {rank}: the loaded optimizer state differs from the saved one by {r['load_diff']:.2e}")
        if r["optimizer_diff"] > tol:
            out.append(
                f"rank {rank}: optimizer state after the resumed steps off by {r['optimizer_diff']:.2e} > {tol:.0e}"
            )
    for k, (a, b) in enumerate(zip(pick(results, "stats"), pick(results, "resumed_stats"), strict=True)):
        for key in a:
            if not all(map(math.isfinite, (a[key], b[key]))):
                out.append(f"step {k + 1} after the save: {key} is {a[key]} uninterrupted, {b[key]} resumed")
            elif abs(a[key] - b[key]) > tol * max(1.0, abs(a[key])):
                out.append(f"step {k + 1} after the save: {key} {a[key]:.9g} uninterrupted, {b[key]:.9g} resumed")
    if (d := max_diff(pick(results, "weights"), pick(results, "resumed_weights"))) > tol:
        out.append(f"weights after the resumed steps off by {d:.2e} > {tol:.0e}")
    return out
