"""The run's starting weights: the model directory (built for `tiny`), optionally warm-started by a short
supervised phase, built once before the ranks start and cached under the run root.

Why a warm start: RL only sharpens what the policy already does sometimes. A freshly initialised tiny
model never writes `\\boxed{...}`, so every reward is 0, every GRPO advantage is 0, and nothing is
learned. A few epochs of plain supervised fine-tuning on `prompt -> \\boxed{answer}<eos>` examples
(seconds on one CPU core) bring the sampled accuracy to a few tenths; from there the asynchronous RL
run raises it.

Both steps are pure functions of their settings and cached like `areal_hpc.tiny`'s assets: the
directory name is a hash of (base model, settings, data), written atomically.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.tiny import BOXED, _build_atomically, _digest, arithmetic_rows, build_tiny_model


def initial_model(cfg: Config) -> Path:
    """The Hugging Face directory every generator and trainer starts from (policy version 0).

    Builds what is missing (the tiny model, the warm start); cheap when both are cached. Call it from
    one process at a time per run root (the launcher, or world rank 0 before the others look).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if cfg.model.path == "tiny":
        base = build_tiny_model(cfg.model, cfg.experiment.root, cfg.experiment.seed)
    else:
        base = Path(cfg.model.path)
        if not (base / "config.json").is_file():
            from areal_hpc.config import ConfigError

            raise ConfigError(f"model.path {base} is not a Hugging Face model directory (no config.json)")
    if cfg.sft.examples <= 0:
        return base
    return warm_start(cfg, base)


def sft_rows(cfg: Config) -> list[dict]:
    """`{prompt, answer}` rows of the warm start: fresh synthetic rows (a seed the RL prompts do not
    use), or the first `sft.examples` rows of `data.train_path`."""
    if not cfg.data.train_path:
        return arithmetic_rows(cfg.sft.examples, cfg.experiment.seed + 7919, cfg.data.synthetic_max_operand)
    rows = []
    with open(cfg.data.train_path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == cfg.sft.examples:
                break
    return rows


def warm_start(cfg: Config, base: Path) -> Path:
    """Fine-tune `base` on `sft_rows(cfg)`; the loss is on the response tokens only.

        loss = - mean over response tokens of log p(token | prompt, earlier response tokens)

    with the response `\\boxed{answer}` followed by EOS, AdamW, `sft.epochs` passes of shuffled
    batches of `sft.batch_size`.
    """
    s, d = cfg.sft, cfg.data
    key = _digest(
        {
            "base": str(Path(base).resolve()),
            "sft": vars(s),
            "data": [d.train_path, d.synthetic_max_operand],
            "seed": cfg.experiment.seed,
        }
    )

    def build(out: Path) -> None:
        import torch

        # One thread: a model this small gains nothing from more, and on a busy machine (the ranks of
        # another run, a test suite) extra threads make it 25x slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _train(cfg, base, out)
        finally:
            torch.set_num_threads(threads)

    return _build_atomically(Path(cfg.experiment.root) / ".assets" / f"sft-{key}", build)


def _train(cfg: Config, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    s = cfg.sft
    hf_logging.disable_progress_bar()
    torch.manual_seed(cfg.experiment.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = []
    for row in sft_rows(cfg):
        prompt = tok(row["prompt"])["input_ids"]
        response = tok(f"{BOXED}{row['answer']}}}")["input_ids"] + [tok.eos_token_id]
        examples.append((prompt, response))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    rng = random.Random(cfg.experiment.seed)
    model.train()
    for _ in range(s.epochs):
        rng.shuffle(examples)
        for i in range(0, len(examples), s.batch_size):
            batch = examples[i : i + s.batch_size]
            width = max(len(p) + len(r) for p, r in batch)
            ids = torch.full((len(batch), width), tok.pad_token_id)  # [batch, width]
            labels = torch.full((len(batch), width), -100)  # -100: no loss (prompt, padding)
            for j, (p, r) in enumerate(batch):
                ids[j, : len(p) + len(r)] = torch.tensor(p + r)
                labels[j, len(p) : len(p) + len(r)] = torch.tensor(r)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.to(getattr(torch, cfg.model.dtype)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
