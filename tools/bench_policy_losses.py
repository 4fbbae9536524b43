"""Does each policy loss and aggregation train? The embedded default (configs/tiny-cpu.yaml) run for
--steps steps once per variant, one after the other, and its reward by fifths of the steps.

    python tools/bench_policy_losses.py [--steps 150] [--only NAME ...]

Variants (`VARIANTS`): the default (decoupled PPO, token_mean), each other `ppo.policy_loss` and
`ppo.loss_agg`, and the two-sided behaviour-weight range. GSPO's eps is its paper's order (1e-3, a
sequence's ratio is a mean of log-ratios); CISPO's has no lower bound, as in its paper.

Prints, per variant, the mean `reward/mean` of each fifth of its steps, the rise (last fifth - first
fifth), its mean `ppo/clip_frac`, its mean `ppo/logp_mismatch` (generator and trainer on the same
weights: a loss must not change it) and, with the range, `ppo/behav_masked_frac`; the headline last:
`variants whose reward rose by fifths: N of M`, a variant counting when each fifth's reward is above the
first's and the last is above it by 0.05 or more (a fifth of 30 steps knows its mean to ~0.02).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.metrics import read_metrics  # noqa: E402
from tools.bench_async_vs_sync import run_mode  # noqa: E402

CONFIG = REPO / "configs" / "tiny-cpu.yaml"
VARIANTS = {
    "decoupled": [],
    "gspo": ["ppo.policy_loss=gspo", "ppo.loss_agg=seq_mean_token_mean", "ppo.eps_clip=0.001"],
    "cispo": ["ppo.policy_loss=cispo", "ppo.eps_clip=1.0", "ppo.eps_clip_high=0.28"],
    "seq_mean_token_mean": ["ppo.loss_agg=seq_mean_token_mean"],
    "seq_mean_token_sum": ["ppo.loss_agg=seq_mean_token_sum"],
    "behav_range": ["ppo.behav_weight_cap=[0.5,2.0]"],
}
"""Each variant's overrides of the embedded default."""
RISE = 0.05
"""The least rise of the last fifth's reward over the first's that counts as learning."""


def fifths(rows: list[dict], key: str) -> list[float]:
    """The mean of `key` over each fifth of the rows (the last fifth takes the remainder)."""
    k = len(rows) // 5
    if k == 0:
        raise ValueError(f"{len(rows)} steps: fewer than five")
    parts = [rows[i * k : (i + 1) * k] for i in range(4)] + [rows[4 * k :]]
    return [sum(r[key] for r in p) / len(p) for p in parts]


def learned(by_fifth: list[float]) -> bool:
    """Every later fifth above the first, and the last by RISE or more."""
    return all(f > by_fifth[0] for f in by_fifth[1:]) and by_fifth[-1] >= by_fifth[0] + RISE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run these variants only")
    args = parser.parse_args()
    names = args.only or list(VARIANTS)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-losses-") as tmp:
        root = Path(tmp)
        for name in names:
            results[name] = read_metrics(run_mode(CONFIG, root, name, VARIANTS[name], args.steps, root / f"{name}.log"))
    print(f"\nreward/mean by fifths of {args.steps} steps, configs/tiny-cpu.yaml:")
    rose = 0
    for name, rows in results.items():
        by_fifth = fifths(rows, "reward/mean")
        rose += learned(by_fifth)
        clip = sum(r["ppo/clip_frac"] for r in rows) / len(rows)
        mismatch = sum(r["ppo/logp_mismatch"] for r in rows) / len(rows)
        masked = [r["ppo/behav_masked_frac"] for r in rows if "ppo/behav_masked_frac" in r]
        extra = f", behav_masked_frac {sum(masked) / len(masked):.4f}" if masked else ""
        print(
            f"  {name:20s} {' '.join(f'{f:.3f}' for f in by_fifth)}  rise {by_fifth[-1] - by_fifth[0]:+.3f}  "
            f"clip_frac {clip:.3f}  logp_mismatch {mismatch:.2e}{extra}"
        )
    print(f"variants whose reward rose by fifths: {rose} of {len(results)}")


if __name__ == "__main__":
    main()
