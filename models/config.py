"""LlamaConfig: the static description of a Llama / Mistral model, read from an HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this library does not implement."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and options of a Llama-family decoder; hashable, so it can be a static jit argument."""

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
    sliding_window: int | None = None  # Mistral: a query sees keys with q_pos - k_pos < sliding_window
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    model_type: str = "llama"

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

    def num_params(self) -> int:
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * per_layer + e + head

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Inverse of `to_dict` (our own checkpoints)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UnsupportedModelError(f"unknown LlamaConfig fields {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Reads a transformers `config.json` dict (4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                f"kivi_jax runs model_type in {SUPPORTED_MODEL_TYPES} ({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise UnsupportedModelError(f"{flag}=true is not supported (Llama/Mistral checkpoints have no biases)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; Llama/Mistral use 'silu'")
        if hf.get("pretraining_tp", 1) != 1:
            raise UnsupportedModelError("pretraining_tp != 1 is not supported")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads

        # transformers 5.x: rope_parameters {rope_type, rope_theta, ...}; 4.x: rope_theta + rope_scaling {type|rope_type}
        rope = dict(hf.get("rope_parameters") or {})
        if "rope_scaling" in hf and hf["rope_scaling"]:
            rope = {**rope, **hf["rope_scaling"]}
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise UnsupportedModelError("per-layer rope parameters are not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        window = hf.get("sliding_window") if model_type == "mistral" else None
        if hf.get("use_sliding_window") is False:
            window = None
        max_pos = hf.get("max_position_embeddings", 4096)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", max_pos)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(max_pos),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            model_type=model_type,
        )

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike) -> "LlamaConfig":
        with open(path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON ({e})") from e
        return cls.from_hf(hf)
