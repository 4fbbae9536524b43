"""The architecture of the config's model, read in one place (`model_arch`); the trainer's model build,
the conversion, the planner's sizes, the config's checks, the generator's context length and KV cache,
and the tiny model's build all take it from here, the parameter count and the KV bytes per token too.

```
 model.path                       the architecture                     the config's model.* shape fields
 tiny                             the config's fields                  build it (unset: TINY's value)
 a Hugging Face dir (config.json) its config.json                      unset, or equal to config.json's
 a path not on this machine       the config's fields (all set)        stand in for config.json until the
                                                                       weights are there (plan, render,
                                                                       submit --dry-run on a login node)
```

A shape field the config sets and config.json contradicts is a ConfigError naming both values: neither
is silently preferred. One exception: `model.max_position_embeddings` may be lower than config.json's,
a cap on the context the run serves (the generators' max_model_len, the default prompt limit).

The config's `model` section (`ModelConfig`) is defined here, beside the architecture it gives. A leaf
module (json and the errors only), so config, planner and trainer import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from areal_hpc.errors import ConfigError

ARCHITECTURES = ("qwen2", "qwen3")
"""The Hugging Face `model_type`s the trainer builds."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The values of `model.dtype`, and the bytes of one value of each."""


@dataclass
class ModelConfig:
    """The model. Its architecture (the fields after dtype, null by default) comes from one place,
    `areal_hpc.arch.model_arch`: for a Hugging Face directory its config.json (a field set here must agree
    with it); for `tiny` these fields (null: the tiny default in parentheses); for a path not on this
    machine yet, these fields stand in for its config.json (plan, render and submit --dry-run)."""

    path: str = "tiny"
    """Hugging Face model directory (config.json + safetensors) of a Qwen2 or Qwen3 model, or `tiny`
    for the small model that the project builds itself under the run root (no download)."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32, bfloat16 or float16."""
    architecture: str | None = None
    """qwen2 or qwen3, config.json's `model_type` (tiny: qwen2). Qwen3: RMSNorm on each query and key
    head, no QKV bias, `head_dim` apart from hidden_size / heads."""
    hidden_size: int | None = None
    """Width of the residual stream (Qwen2 `hidden_size`; tiny: 64)."""
    intermediate_size: int | None = None
    """Width of the SwiGLU feed-forward layer (tiny: 256)."""
    num_layers: int | None = None
    """Number of transformer layers (`num_hidden_layers`; tiny: 2)."""
    num_attention_heads: int | None = None
    """Query heads per layer (head size: head_dim, else hidden_size / heads; vLLM's CPU attention needs
    at least 32; tiny: 2)."""
    num_key_value_heads: int | None = None
    """Key/value heads per layer (grouped-query attention when fewer than the query heads; tiny: 2)."""
    head_dim: int | None = None
    """Size of an attention head; 0: hidden_size / num_attention_heads (Qwen3 models set it apart; tiny: 0)."""
    vocab_size: int | None = None
    """Vocabulary size (for `tiny`, at least the 99 tokens of the project's tokenizer; tiny: 128)."""
    max_position_embeddings: int | None = None
    """Longest sequence (prompt + response) the model handles (tiny: 512). For a Hugging Face model it
    comes from config.json and may be set lower: a cap on the context the run serves (the generators'
    max_model_len, the default data.max_prompt_tokens)."""
    rope_theta: float | None = None
    """RoPE base (tiny: 10000)."""
    rms_norm_eps: float | None = None
    """Epsilon of the RMSNorm layers (tiny: 1e-6)."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding and the output projection (tiny: true)."""


@dataclass(frozen=True)
class QwenArch:
    """The architecture fields of a Qwen2 or Qwen3 model, as its config.json has them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool
    """Bias of the query, key and value projections (Qwen2; Qwen3's `attention_bias`, false in its models)."""
    qk_norm: bool
    """RMSNorm of each query and key head before RoPE (Qwen3)."""

    @property
    def model_type(self) -> str:
        return "qwen3" if self.qk_norm else "qwen2"

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> QwenArch:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = c.get("model_type", "qwen2")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"{model_dir}: model_type {model_type!r} is not supported by the trainer ({', '.join(ARCHITECTURES)})"
            )
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{model_dir}: RoPE scaling {rope.get('rope_type')!r} is not supported by the trainer")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            qkv_bias=model_type == "qwen2" or c.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
        )

    @property
    def params(self) -> int:
        """Parameters of the decoder (d: the head size): per layer q, o: h * heads * d each; k, v:
        h * kv_heads * d each; MLP: 3 h f; plus the embedding v h, and the output projection v h unless
        tied (biases and norms left out: under 0.1%)."""
        h, d = self.hidden_size, self.head_dim
        per_layer = 2 * h * self.num_attention_heads * d + 2 * h * self.num_key_value_heads * d
        per_layer += 3 * h * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache of one token on one of `tp` tensor-parallel workers: K and V of every layer,
        2 * layers * kv_heads / tp * head_dim * dtype_bytes (a worker holds at least one KV head)."""
        return 2 * self.num_layers * max(1, self.num_key_value_heads // tp) * self.head_dim * dtype_bytes


TINY = {
    "architecture": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 0,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""The tiny model's shape where the config leaves a `model.*` field unset (null)."""
SHAPE_FIELDS = tuple(TINY)
"""The `model.*` fields that describe the architecture (all of them null by default)."""


def model_arch(m: ModelConfig) -> QwenArch:
    """The architecture of `m` (the table in the module docstring); ConfigError when the config's shape
    fields contradict the model's config.json, or cannot stand in for it."""
    given = {k: getattr(m, k) for k in SHAPE_FIELDS if getattr(m, k) is not None}
    config_json = Path(m.path) / "config.json"
    if m.path != "tiny" and config_json.is_file():
        try:
            arch = hf_arch(m.path)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"model.path {m.path}: {e}") from None
        have = _shape(arch)
        if given.get("head_dim") == 0:  # hidden_size / num_attention_heads
            given["head_dim"] = given.get("hidden_size", arch.hidden_size) // given.get(
                "num_attention_heads", arch.num_attention_heads
            )
        context = given.pop("max_position_embeddings", have["max_position_embeddings"])
        wrong = [k for k, v in given.items() if v != have[k]]
        if context > have["max_position_embeddings"]:
            wrong.append("max_position_embeddings")
            given["max_position_embeddings"] = context
        if wrong:
            raise ConfigError(
                "; ".join(f"model.{k} is {given[k]!r} but {config_json} has {have[k]!r}" for k in wrong)
                + " (the architecture of a Hugging Face model comes from its config.json: remove those fields "
                "from the config or correct them, e.g. " + " ".join(f"model.{k}=null" for k in wrong) + ")"
            )
        return dataclasses.replace(arch, max_position_embeddings=context)
    if m.path != "tiny":
        missing = [f"model.{k}" for k in SHAPE_FIELDS if k not in given and k not in ("head_dim", "architecture")]
        if missing:
            raise ConfigError(
                f"model.path {m.path} is not a Hugging Face model directory here (no config.json), so the config "
                f"must give its architecture: set {', '.join(missing)}"
            )
    s = TINY | given
    if s["architecture"] not in ARCHITECTURES:
        raise ConfigError(f"model.architecture must be {' or '.join(ARCHITECTURES)} (got '{s['architecture']}')")
    if s["head_dim"] < 0:
        raise ConfigError(f"model.head_dim must be >= 0 (got {s['head_dim']}); 0 is hidden_size / num_attention_heads")
    for k in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if s[k] < 1:
            raise ConfigError(f"model.{k} must be at least 1 (got {s[k]})")
    if s["num_attention_heads"] % s["num_key_value_heads"]:
        raise ConfigError(
            f"model.num_key_value_heads ({s['num_key_value_heads']}) must divide model.num_attention_heads "
            f"({s['num_attention_heads']})"
        )
    if not s["head_dim"] and s["hidden_size"] % s["num_attention_heads"]:
        raise ConfigError(
            f"model.num_attention_heads ({s['num_attention_heads']}) must divide model.hidden_size "
            f"({s['hidden_size']}), or set model.head_dim"
        )
    qwen3 = s.pop("architecture") == "qwen3"
    s["head_dim"] = s["head_dim"] or s["hidden_size"] // s["num_attention_heads"]
    return QwenArch(qkv_bias=not qwen3, qk_norm=qwen3, **s)


def _shape(arch: QwenArch) -> dict:
    """`arch` as the config's shape fields."""
    shape = {k: v for k, v in dataclasses.asdict(arch).items() if k in SHAPE_FIELDS}
    return shape | {"architecture": arch.model_type}


def hf_arch(model_dir: str | Path) -> QwenArch:
    """The architecture in a Hugging Face directory's config.json (`QwenArch.from_hf`), read once per version
    of the file (the planner asks for the shape of every plan it considers)."""
    config_json = Path(model_dir) / "config.json"
    return _read_hf(str(config_json.parent), config_json.stat().st_mtime_ns)


@cache
def _read_hf(model_dir: str, mtime_ns: int) -> QwenArch:
    return QwenArch.from_hf(model_dir)
