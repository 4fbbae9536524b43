"""The embedded default's assets, built here with no download: a character-level tokenizer, a small
random Qwen2 or Qwen3 model (`model.architecture`), and a synthetic arithmetic task with boxed answers.

Everything is a pure function of its inputs (architecture, seed, size) and is cached under the run
root in a directory named by a hash of them, so two runs with the same settings share one copy and
a changed setting never reuses a stale one. Writes go to a temporary directory that is renamed into
place, so an interrupted build never leaves a cache that looks complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import string
import tempfile
from pathlib import Path

from areal_hpc.arch import model_arch
from areal_hpc.config import ConfigError, ModelConfig

BOXED = "\\boxed{"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
# Single characters: printable ASCII less the whitespace variants other than space and newline.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TINY_VOCAB = [PAD, EOS, BOXED, *CHARS]
TINY_VOCAB_SIZE = 128
"""The model's vocabulary, padded past len(TINY_VOCAB) (= 103) to a round size."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _build_atomically(target: Path, build) -> Path:
    """Run `build(tmpdir)` and rename the result to `target`, unless `target` already exists."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("")
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first, or a stale incomplete copy is in the way
            if (target / ".complete").exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def build_tokenizer():
    """A character-level fast tokenizer; `\\boxed{` is one token so the answer format is cheap."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    # BPE without merges and without a pre-tokenizer: every character is its own token, spaces too.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=PAD))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS])
    tok.add_tokens([BOXED])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def hf_config(m: ModelConfig):
    """The transformers config (Qwen2Config or Qwen3Config) of a model section (`model_arch(m)`)."""
    from transformers import Qwen2Config, Qwen3Config

    arch = model_arch(m)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch.model_type]
    return cls(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        torch_dtype=m.dtype,
        bos_token_id=TINY_VOCAB.index(EOS),
        eos_token_id=TINY_VOCAB.index(EOS),
        pad_token_id=TINY_VOCAB.index(PAD),
    )


def build_tiny_model(m: ModelConfig, root: str | Path, seed: int) -> Path:
    """The directory of the tiny model (config.json, safetensors, tokenizer), built once per settings."""
    arch = model_arch(m)
    if arch.vocab_size < len(TINY_VOCAB):
        raise ConfigError(
            f"model.vocab_size ({arch.vocab_size}) must be at least {len(TINY_VOCAB)} for the tiny tokenizer"
        )
    key = _digest({"arch": dataclasses.asdict(arch), "dtype": m.dtype, "seed": seed, "vocab": TINY_VOCAB})

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(m)).to(getattr(torch, m.dtype))
        model.save_pretrained(out, safe_serialization=True)
        build_tokenizer().save_pretrained(out)

    return _build_atomically(Path(root) / ".assets" / f"tiny-model-{key}", build)


TEST_SHARE = 5
"""One in this many of the synthetic task's problems is held out of the RL prompts, as its test split
(the warm start, which stands in for a base model's pretraining, sees every problem)."""
TEST_MAX = 500
"""Most problems in the test split."""


def arithmetic_problems(max_operand: int = 99) -> tuple[list[tuple], list[tuple]]:
    """Every problem (a, op, b) with 0 <= a, b <= max_operand, split into (train, test): a fixed
    fifth (at most TEST_MAX) held out, drawn by a seed of its own, so every run agrees."""
    problems = [(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"]
    random.Random(f"arithmetic-split:{max_operand}").shuffle(problems)
    n_test = min(len(problems) // TEST_SHARE, TEST_MAX)
    return problems[n_test:], problems[:n_test]


def _row(problem: tuple) -> dict:
    a, op, b = problem
    return {"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)}


def arithmetic_rows(n: int, seed: int, max_operand: int = 99, held_out: bool = False) -> list[dict]:
    """`{prompt, answer}` rows of the synthetic task: 'a+b=' or 'a-b=' with the answer boxed, drawn
    uniformly (with repeats) from the training split's problems, or with `held_out` from every problem.

    Deterministic in (n, seed). Prompts are plain text; the expected response is `\\boxed{c}`.
    """
    rng = random.Random(seed)
    train, test = arithmetic_problems(max_operand)
    problems = train + test if held_out else train
    return [_row(rng.choice(problems)) for _ in range(n)]


def arithmetic_test_rows(max_operand: int = 99) -> list[dict]:
    """The held-out problems, each once: no row of the RL prompts is one of them."""
    return [_row(p) for p in arithmetic_problems(max_operand)[1]]


def build_arithmetic_data(n: int, root: str | Path, seed: int, max_operand: int = 99) -> Path:
    """The directory of the synthetic task, built once per (n, seed, max_operand): `train.jsonl`
    (n rows of `arithmetic_rows`) and `test.jsonl` (`arithmetic_test_rows`)."""
    key = _digest({"task": "arithmetic", "n": n, "seed": seed, "max_operand": max_operand, "test_share": TEST_SHARE})

    def build(out: Path) -> None:
        for name, rows in (
            ("train", arithmetic_rows(n, seed, max_operand)),
            ("test", arithmetic_test_rows(max_operand)),
        ):
            with open(out / f"{name}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")

    return _build_atomically(Path(root) / ".assets" / f"arithmetic-{key}", build)
