"""Benchmark of `areal-hpc export` on this machine: its memory per byte of weights, and its speed.

A Qwen3 model built here (bf16, ~420M parameters by default) takes a PPO step on a trainer rank and
is saved as a run's checkpoint; then `areal-hpc export` (the real command, in a subprocess) writes it
as a Hugging Face directory. The export process reports its peak memory and its memory before it
loads anything (imports, torch.distributed, Megatron's parallel state): the baseline. The design keeps
the export near one copy of the weights: no optimizer state (12 bytes a parameter more), no
transformers model.

    python tools/bench_export.py                       # last line: export memory per byte of weights
    python tools/bench_export.py --hidden 1024 --layers 8   # smaller, quicker
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from areal_hpc.config import ModelConfig, PPOConfig  # noqa: E402
from areal_hpc.data.tiny import build_tiny_model  # noqa: E402
from areal_hpc.trainer.spawn import run_ranks  # noqa: E402
from tests.support.trainer_runs import train_and_save_rank  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--root", default=None, help="where to build the model and the run (default: a temporary dir)")
    args = ap.parse_args()
    model = ModelConfig(
        architecture="qwen3",
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=128,
        vocab_size=args.vocab,
        dtype="bfloat16",
    )
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=args.root) as tmp:
        root = Path(tmp)
        model_dir = str(build_tiny_model(model, root, seed=1))
        run_ranks(
            train_and_save_rank, 1, 1, 1, {"run": (model_dir, "bfloat16")}, str(root), 1, PPOConfig(), timeout_s=3600
        )
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "areal_hpc.cli", "export", str(root / "run"), "-o", str(root / "hf")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        seconds = time.perf_counter() - t0
        weights = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors")) / 2**30
    print(out, end="")
    peak, baseline = map(float, re.search(r"peak ([\d.]+) GiB, ([\d.]+) GiB before loading", out).groups())
    print(f"model: Qwen3, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, bf16: {weights:.3f} GiB")
    print(f"export process: baseline {baseline:.2f} GiB, peak {peak:.2f} GiB; {seconds:.1f} s (whole command)")
    print(f"export memory per byte of weights (peak over the baseline): {(peak - baseline) / weights:.2f}")


if __name__ == "__main__":
    main()
