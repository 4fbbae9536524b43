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

ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe")
"""The Hugging Face `model_type`s the trainer builds."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The values of `model.dtype`, and the bytes of one value of each."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder layer as Hugging Face (and PEFT, and vLLM) name them: LoRA's targets."""


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
    """qwen2, qwen3 or qwen3_moe, config.json's `model_type` (tiny: qwen2). Qwen3: RMSNorm on each query
    and key head, no QKV bias, `head_dim` apart from hidden_size / heads. qwen3_moe: Qwen3's attention with
    a mixture of experts in place of every layer's MLP (the four expert fields below)."""
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
    num_experts: int | None = None
    """qwen3_moe only (null for the dense architectures): routed experts per layer (tiny: 4)."""
    num_experts_per_tok: int | None = None
    """qwen3_moe only: experts each token is routed to, the router's top-k (tiny: 2)."""
    moe_intermediate_size: int | None = None
    """qwen3_moe only: width of each expert's SwiGLU feed-forward layer (tiny: 64)."""
    norm_topk_prob: bool | None = None
    """qwen3_moe only: renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE's models set
    it; tiny: true)."""


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
    num_experts: int = 0
    """Routed experts per layer; 0: a dense model (an MLP per layer)."""
    num_experts_per_tok: int = 0
    """The router's top-k."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU layer."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities (softmax over all experts, top-k, divide by their sum)."""
    router_aux_loss_coef: float = 0.0
    """config.json's load-balancing loss coefficient (the default of `ppo.load_balancing_coef`)."""

    @property
    def moe(self) -> bool:
        """A mixture of experts in every layer (qwen3_moe)."""
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        if self.moe:
            return "qwen3_moe"
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
        moe = _hf_moe(c, model_dir) if model_type == "qwen3_moe" else {}
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
            qk_norm=model_type != "qwen2",
            **moe,
        )

    @property
    def params(self) -> int:
        """Parameters of the decoder, all of them (d: the head size): per layer q, o: h * heads * d each;
        k, v: h * kv_heads * d each; MLP: 3 h f, or for a MoE the router E h and E experts of 3 h f_e;
        plus the embedding v h, and the output projection v h unless tied (biases and norms left out:
        under 0.1%)."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """The parameters one token uses: `params` with top-k experts per layer in place of all of them
        (the router counted whole). Equal to `params` for a dense model."""
        return self._params(self.num_experts_per_tok)

    @property
    def expert_params(self) -> int:
        """The parameters of all experts of all layers (0 for a dense model): expert parallelism splits these."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def _params(self, experts: int) -> int:
        h, d = self.hidden_size, self.head_dim
        per_layer = 2 * h * self.num_attention_heads * d + 2 * h * self.num_key_value_heads * d
        if self.moe:
            per_layer += self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
        else:
            per_layer += 3 * h * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    def projection_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of a projection's whole weight (`PROJECTIONS`), as Hugging Face stores it."""
        h, d = self.hidden_size, self.head_dim
        return {
            "q_proj": (self.num_attention_heads * d, h),
            "k_proj": (self.num_key_value_heads * d, h),
            "v_proj": (self.num_key_value_heads * d, h),
            "o_proj": (h, self.num_attention_heads * d),
            "gate_proj": (self.intermediate_size, h),
            "up_proj": (self.intermediate_size, h),
            "down_proj": (h, self.intermediate_size),
        }[name]

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """Parameters of LoRA adapters of `rank` on `targets` in every layer: A [r, in] + B [out, r] each."""
        return self.num_layers * sum(rank * sum(self.projection_shape(t)) for t in targets)

    def lora_problem(self, rank: int, targets: tuple[str, ...] | list[str]) -> str | None:
        """Why adapters of `rank` on `targets` do not fit this model (None: they do), naming the fix."""
        if not targets:
            return f"lora.target_modules is empty: name at least one of {list(PROJECTIONS)}"
        if len(set(targets)) < len(targets):
            return f"lora.target_modules {list(targets)} names a layer twice: name each once"
        unknown = [t for t in targets if t not in PROJECTIONS]
        if unknown:
            return (
                f"lora.target_modules {list(targets)}: {unknown} name no layer of a {self.model_type} model; "
                f"its layers: {list(PROJECTIONS)}"
            )
        if self.moe:  # vLLM 0.32 serves a MoE with LoRA only through its Triton MoE kernels
            return (
                f"LoRA (lora.rank) is for dense models (qwen2, qwen3); model.path is a {self.model_type}: vLLM serves "
                "a mixture of experts with LoRA only through its Triton kernels, which its CPU build (the project's "
                "tests) lacks; set lora.rank=0"
            )
        too_small = [t for t in targets if rank > min(self.projection_shape(t))]
        if too_small:
            return (
                f"lora.rank {rank} is larger than the smallest dimension of {too_small} ("
                + ", ".join(f"{t}: {self.projection_shape(t)[1]} -> {self.projection_shape(t)[0]}" for t in too_small)
                + "): lower lora.rank or leave those out of lora.target_modules"
            )
        return None

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
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
"""The tiny model's expert fields where `model.architecture` is qwen3_moe and the config leaves them unset."""
MOE_FIELDS = tuple(TINY_MOE)
"""The `model.*` fields of a mixture of experts: set for qwen3_moe only."""
SHAPE_FIELDS = tuple(TINY) + MOE_FIELDS
"""The `model.*` fields that describe the architecture (all of them null by default)."""


def model_arch(m: ModelConfig, name: str = "model") -> QwenArch:
    """The architecture of `m` (the table in the module docstring); ConfigError when the config's shape
    fields contradict the model's config.json, or cannot stand in for it. `name`: the section, in the errors
    (`distill.teacher` is a model too)."""
    given = {k: getattr(m, k) for k in SHAPE_FIELDS if getattr(m, k) is not None}
    config_json = Path(m.path) / "config.json"
    if m.path != "tiny" and config_json.is_file():
        try:
            arch = hf_arch(m.path)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{name}.path {m.path}: {e}") from None
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
                "; ".join(f"{name}.{k} is {given[k]!r} but {config_json} has {have[k]!r}" for k in wrong)
                + " (the architecture of a Hugging Face model comes from its config.json: remove those fields "
                "from the config or correct them, e.g. " + " ".join(f"{name}.{k}=null" for k in wrong) + ")"
            )
        return dataclasses.replace(arch, max_position_embeddings=context)
    architecture = given.get("architecture", TINY["architecture"])
    needed = SHAPE_FIELDS if architecture == "qwen3_moe" else tuple(TINY)
    if m.path != "tiny":
        missing = [f"{name}.{k}" for k in needed if k not in given and k not in ("head_dim", "architecture")]
        if missing:
            raise ConfigError(
                f"{name}.path {m.path} is not a Hugging Face model directory here (no config.json), so the config "
                f"must give its architecture: set {', '.join(missing)}"
            )
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"{name}.architecture must be one of {', '.join(ARCHITECTURES)} (got '{architecture}')")
    if architecture != "qwen3_moe":
        stray = [f"{name}.{k}" for k in MOE_FIELDS if k in given]
        if stray:
            raise ConfigError(
                f"{', '.join(stray)} apply to {name}.architecture qwen3_moe only (it is {architecture}): "
                f"remove them, or set {name}.architecture=qwen3_moe"
            )
    s = TINY | (TINY_MOE if architecture == "qwen3_moe" else {}) | given
    if s["head_dim"] < 0:
        raise ConfigError(f"{name}.head_dim must be >= 0 (got {s['head_dim']}); 0 is hidden_size / num_attention_heads")
    for k in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if s[k] < 1:
            raise ConfigError(f"{name}.{k} must be at least 1 (got {s[k]})")
    if s["num_attention_heads"] % s["num_key_value_heads"]:
        raise ConfigError(
            f"{name}.num_key_value_heads ({s['num_key_value_heads']}) must divide {name}.num_attention_heads "
            f"({s['num_attention_heads']})"
        )
    if not s["head_dim"] and s["hidden_size"] % s["num_attention_heads"]:
        raise ConfigError(
            f"{name}.num_attention_heads ({s['num_attention_heads']}) must divide {name}.hidden_size "
            f"({s['hidden_size']}), or set {name}.head_dim"
        )
    if architecture == "qwen3_moe":
        for k in ("num_experts", "moe_intermediate_size"):
            if s[k] < 1:
                raise ConfigError(f"{name}.{k} must be at least 1 (got {s[k]})")
        if not 1 <= s["num_experts_per_tok"] <= s["num_experts"]:
            raise ConfigError(
                f"{name}.num_experts_per_tok ({s['num_experts_per_tok']}) must be between 1 and {name}.num_experts "
                f"({s['num_experts']})"
            )
        s["router_aux_loss_coef"] = QWEN3_MOE_AUX_LOSS_COEF
    qwen3 = s.pop("architecture") != "qwen2"
    s["head_dim"] = s["head_dim"] or s["hidden_size"] // s["num_attention_heads"]
    return QwenArch(qkv_bias=not qwen3, qk_norm=qwen3, **s)


QWEN3_MOE_AUX_LOSS_COEF = 0.001
"""The load-balancing loss coefficient of Qwen3-MoE's config.json (`router_aux_loss_coef`), for a model built
from the config's fields (tiny, or a path not on this machine yet)."""


def _hf_moe(c: dict, model_dir: str | Path) -> dict:
    """The expert fields of a qwen3_moe config.json; ValueError naming the field this trainer cannot build
    (it builds routed experts in every layer, softmax top-k, no shared expert)."""
    unsupported = [  # (field, its value, the one value supported, what another value means)
        ("shared_expert_intermediate_size", c.get("shared_expert_intermediate_size") or 0, 0, "a shared expert"),
        ("mlp_only_layers", c.get("mlp_only_layers") or [], [], "dense MLP layers among the MoE ones"),
        ("decoder_sparse_step", c.get("decoder_sparse_step", 1), 1, "experts only every few layers"),
        ("scoring_func", c.get("scoring_func", "softmax"), "softmax", "a router other than softmax top-k"),
        ("topk_method", c.get("topk_method", "greedy"), "greedy", "a router other than softmax top-k"),
    ]
    for name, value, supported, what in unsupported:
        if value != supported:
            raise ValueError(
                f"{model_dir}: config.json's {name} is {value!r} ({what}): the trainer builds routed experts in every layer, "
                f"softmax top-k, no shared expert ({name} {supported!r})"
            )
    return {
        "num_experts": c["num_experts"]
        if "num_experts" in c
        else c["num_local_experts"],  # transformers 5 writes the latter
        "num_experts_per_tok": c["num_experts_per_tok"],
        "moe_intermediate_size": c["moe_intermediate_size"],
        "norm_topk_prob": c.get("norm_topk_prob", False),
        "router_aux_loss_coef": c.get("router_aux_loss_coef", QWEN3_MOE_AUX_LOSS_COEF),
    }


def teacher_arch(teacher: ModelConfig) -> QwenArch | None:
    """The architecture of `distill.teacher` (None: its path empty, off), by `model_arch`'s rules: its
    config.json, or for a path not on this machine yet its shape fields."""
    if not teacher.path:
        return None
    if teacher.path == "tiny":
        raise ConfigError("distill.teacher.path is tiny: a teacher is a trained model's directory")
    return model_arch(teacher, "distill.teacher")


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
