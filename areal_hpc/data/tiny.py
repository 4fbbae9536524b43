"""The embedded default's assets, built here with no download: a character-level tokenizer with a chat
template of its own, a small random Qwen2, Qwen3 or Qwen3-MoE model (`model.architecture`), and the files of the
synthetic tasks (`areal_hpc.data.synthetic`).

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
import shutil
import string
import tempfile
from pathlib import Path

from areal_hpc.arch import model_arch
from areal_hpc.config import ConfigError, ModelConfig
from areal_hpc.data.synthetic import TEST_SHARE, synthetic_rows, synthetic_test_rows

BOXED = "\\boxed{"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
CALC = "<calc>"
"""Starts a calculator call: `<calc>37*48<eos>` (the tiny model's tool syntax; a JSON call would cost
it about 80 tokens)."""
RESULT = "<result>"
"""Starts a tool's answer: `<result>1776\\n`."""
# Single characters: printable ASCII less the whitespace variants other than space and newline.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TINY_VOCAB = [PAD, EOS, BOXED, *CHARS, CALC, RESULT]
"""The tokens in id order; new ones go at the end, so that no existing id moves."""
TINY_VOCAB_SIZE = 128
"""The model's vocabulary, padded past len(TINY_VOCAB) (= 101) to a round size."""

TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- m.content or '' -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set args = call.function.arguments if call.function is defined else call.arguments -%}"
    "{%- if args is not mapping -%}"
    "{{- raise_exception('the tiny chat template needs tool call arguments as a dict, not a JSON string') -}}"
    "{%- endif -%}"
    "<calc>{{- args.expression -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- elif m.role == 'tool' -%}"
    "<result>{{- m.content -}}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- m.content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""The tiny tokenizer's chat template: a user or system message is its content; an assistant message its
content, `<calc>expression` per calculator call and EOS; a tool message `<result>content\\n`. No
generation prompt (after a prompt or a tool's answer the assistant simply goes on), and no turn is ever
rewritten, so each render extends the one before it:

    37*48=<calc>37*48<eos><result>1776\\n\\boxed{1776}<eos>
"""


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
    """A character-level fast tokenizer with TINY_CHAT_TEMPLATE; `\\boxed{`, `<calc>` and `<result>` are
    one token each, so the answer and tool formats are cheap."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    # BPE without merges and without a pre-tokenizer: every character is its own token, spaces too.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=PAD))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS])
    tok.add_tokens([BOXED, CALC, RESULT])  # not special: a decoded answer keeps its tool calls
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=PAD,
        clean_up_tokenization_spaces=False,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def hf_config(m: ModelConfig):
    """The transformers config (Qwen2Config, Qwen3Config or Qwen3MoeConfig) of a model section
    (`model_arch(m)`). A MoE has routed experts in every layer (no dense layers, no shared expert)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    arch = model_arch(m)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch.model_type]
    experts = (
        {
            "num_experts": arch.num_experts,
            "num_experts_per_tok": arch.num_experts_per_tok,
            "moe_intermediate_size": arch.moe_intermediate_size,
            "norm_topk_prob": arch.norm_topk_prob,
            "router_aux_loss_coef": arch.router_aux_loss_coef,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        if arch.moe
        else {}
    )
    return cls(
        **experts,
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
    key = _digest(
        {
            "arch": dataclasses.asdict(arch),
            "dtype": m.dtype,
            "seed": seed,
            "vocab": TINY_VOCAB,
            "template": TINY_CHAT_TEMPLATE,
        }
    )

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(m)).to(getattr(torch, m.dtype))
        model.save_pretrained(out, safe_serialization=True)
        build_tokenizer().save_pretrained(out)

    return _build_atomically(Path(root) / ".assets" / f"tiny-model-{key}", build)


def build_synthetic_data(n: int, root: str | Path, seed: int, task: str = "arithmetic", max_operand: int = 99) -> Path:
    """The directory of a synthetic task, built once per (task, n, seed, max_operand): `train.jsonl`
    (n rows of `synthetic_rows`) and `test.jsonl` (`synthetic_test_rows`)."""
    key = _digest({"task": task, "n": n, "seed": seed, "max_operand": max_operand, "test_share": TEST_SHARE})

    def build(out: Path) -> None:
        for name, rows in (
            ("train", synthetic_rows(n, seed, task, max_operand)),
            ("test", synthetic_test_rows(task, max_operand)),
        ):
            with open(out / f"{name}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")

    return _build_atomically(Path(root) / ".assets" / f"{task}-{key}", build)
