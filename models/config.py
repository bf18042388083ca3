"""ModelConfig: the static description of a decoder, read from an HF `config.json` or GGUF metadata by its
architecture (models/registry.py); `LlamaConfig` is the same class (its first name)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from .registry import UnsupportedModelError, for_gguf, for_hf, param_table

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names for a layer's attention

__all__ = ["LAYER_TYPES", "LlamaConfig", "ModelConfig", "SUPPORTED_ROPE_TYPES", "UnsupportedModelError"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder; hashable, so it can be a static jit argument. `model_type` names its
    architecture (models/registry.py); options other architectures do not have keep Llama's defaults."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # a query sees keys with q_pos - k_pos < sliding_window (on the layers below)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    model_type: str = "llama"
    # Per layer "full_attention" or "sliding_attention" (Qwen's upper layers, Gemma 2's alternation); None: every
    # layer is windowed by `sliding_window` when that is set (Mistral)
    layer_types: tuple[str, ...] | None = None
    qkv_bias: bool = False  # q, k, v projections carry biases (Qwen2; `attention_bias` of Qwen3)
    o_bias: bool = False  # the output projection carries a bias (`attention_bias` of Qwen3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    query_pre_attn_scalar: float | None = None  # scores are q.k / sqrt(this) (Gemma 2); None: head_dim
    attn_logit_softcap: float | None = None  # scores s become cap * tanh(s / cap) before the softmax (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits (Gemma 2)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"hidden_act={self.hidden_act!r} is not supported; kivi_jax runs silu and "
                                        "gelu_tanh (gelu_pytorch_tanh)")
        bad = sorted(set(self.layer_types or ()) - set(LAYER_TYPES))
        if bad:
            raise UnsupportedModelError(f"layer types {bad} are not supported; supported: {', '.join(LAYER_TYPES)}")

    @property
    def n_rep(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def pad_id(self) -> int:
        """Token id used to pad batches: pad, else the first EOS, else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def layer_attention(self) -> tuple[tuple[int | None, float | None], ...]:
        """Each layer's attention options `(window, softcap)`: its sliding window (None: global) and its logit
        soft-cap (None: none)."""
        types = self.layer_types or (("sliding_attention",) * self.num_layers)
        return tuple((self.sliding_window if t == "sliding_attention" else None, self.attn_logit_softcap)
                     for t in types[: self.num_layers])

    @property
    def query_scale(self) -> float:
        """The factor the model multiplies its queries by so that the cache's `q.k / sqrt(head_dim)` is the
        architecture's score (1.0 unless `query_pre_attn_scalar` is set)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    def with_layers(self, num_layers: int) -> "ModelConfig":
        """The config of the first `num_layers` layers."""
        types = None if self.layer_types is None else self.layer_types[:num_layers]
        return dataclasses.replace(self, num_layers=num_layers, layer_types=types)

    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in param_table(self).values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; the options other architectures add are left out at their defaults, so a Llama config
        reads as it did before they existed (checkpoints and cache fingerprints saved then still match)."""
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {k: v for k, v in d.items() if not (k in ARCHITECTURE_OPTIONS and v == defaults[k])}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict` (our own checkpoints)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UnsupportedModelError(f"unknown ModelConfig fields {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Reads a transformers `config.json` dict (4.x or 5.x) by the architecture it names."""
        return for_hf(hf).config_from_hf(hf)

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON ({e})") from e
        return cls.from_hf(hf)

    @classmethod
    def from_gguf(cls, arch: str | None, get) -> "ModelConfig":
        """Reads GGUF metadata by its `general.architecture` (`get` as `Architecture.config_from_gguf` takes it)."""
        return for_gguf(arch, get.source).config_from_gguf(get)


LlamaConfig = ModelConfig

# The fields added for architectures beyond Llama (`to_dict` leaves them out at their defaults)
ARCHITECTURE_OPTIONS = ("layer_types", "qkv_bias", "o_bias", "hidden_act", "query_pre_attn_scalar",
                        "attn_logit_softcap", "final_logit_softcap")


# ---------------------------------------------------------------------------------------------------------------------
# Reading what every architecture shares (used by each one's reader)


def hf_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields of a `config.json`: transformers 5.x `rope_parameters {rope_type, rope_theta, ...}` or 4.x
    `rope_theta` + `rope_scaling {type | rope_type, ...}`."""
    rope = dict(hf.get("rope_parameters") or {})
    if "rope_scaling" in hf and hf["rope_scaling"]:
        rope = {**rope, **hf["rope_scaling"]}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError("per-layer rope parameters are not supported")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
    max_pos = hf.get("max_position_embeddings", 4096)
    return dict(
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope.get("rope_type", rope.get("type", "default")),
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", max_pos)),
    )


def hf_common(hf: dict[str, Any], rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The ModelConfig fields every architecture reads the same way from a `config.json` (shapes, RoPE, special
    tokens, tying), as keyword arguments."""
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    eos = hf.get("eos_token_id")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", rms_norm_eps),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        pad_token_id=hf.get("pad_token_id"),
        model_type=hf["model_type"],
        **hf_rope(hf),
    )


def hf_layer_types(hf: dict[str, Any], num_layers: int, default) -> tuple[str, ...]:
    """The per-layer attention types of a `config.json`: its `layer_types` list (transformers 5.x writes it),
    else `default(i)` for layer i (the rule the architecture's transformers config applies)."""
    types = hf.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(num_layers))
    if len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types names {len(types)} layers, but num_hidden_layers={num_layers}")
    return tuple(types)


def gguf_common(get, model_type: str) -> dict[str, Any]:
    """The ModelConfig fields every architecture reads the same way from GGUF metadata, as keyword arguments."""
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(get.file("tokenizer.ggml.tokens", []))
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UnsupportedModelError(f"{get.source}: GGUF rope scaling {scaling!r} is not supported")
    eos = get.file("tokenizer.ggml.eos_token_id")
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_type="linear" if scaling == "linear" else "default",
        rope_factor=float(get("rope.scaling.factor", 1.0)),
        tie_word_embeddings="output.weight" not in get.tensors,
        max_position_embeddings=int(get("context_length", 4096)),
        bos_token_id=get.file("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=get.file("tokenizer.ggml.padding_token_id"),
        model_type=model_type,
    )
