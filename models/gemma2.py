"""Gemma 2: GeGLU (gelu-tanh), embeddings scaled by sqrt(hidden), RMSNorm with (1 + w) before and after both
attention and the MLP, attention logits and final logits soft-capped (`cap * tanh(x / cap)`), local (sliding window)
and global layers alternating (`layer_types`), scores scaled by `query_pre_attn_scalar` instead of head_dim.
Registered as model_type `gemma2`, GGUF architecture `gemma2` (llama.cpp stores its norms as 1 + w).

The cache computes `softmax(q.k / sqrt(head_dim))`: the queries are scaled by `sqrt(head_dim /
query_pre_attn_scalar)` first (`ModelConfig.query_scale`), and the soft-cap goes to the cache with each layer's
window (kernels that cannot soft-cap hand the step to the XLA path)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from . import weights
from .config import ModelConfig, UnsupportedModelError, gguf_common, hf_common, hf_layer_types
from .decoder import Params, decode
from .llama import attention_params, embed_param, heads, lm_head_param, mlp_params
from .registry import Architecture, Param, register


@struct.dataclass
class LayerParams:
    """One Gemma 2 layer's weights, stacked on a leading `[layers]` axis; norms hold w of `x * (1 + w)`."""

    attn_norm: jax.Array  # [layers, hidden] (input_layernorm)
    wq: jax.Array  # [layers, hidden, q_heads * head_dim]
    wk: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wv: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wo: jax.Array  # [layers, q_heads * head_dim, hidden]
    post_attn_norm: jax.Array  # [layers, hidden] (post_attention_layernorm)
    mlp_norm: jax.Array  # [layers, hidden] (pre_feedforward_layernorm)
    w_gate: jax.Array  # [layers, hidden, intermediate]
    w_up: jax.Array  # [layers, hidden, intermediate]
    w_down: jax.Array  # [layers, intermediate, hidden]
    post_mlp_norm: jax.Array  # [layers, hidden] (post_feedforward_layernorm)


def gemma_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: `x / rms(x) * (1 + w)` in float32, the result in x's dtype (as transformers computes it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _minus_one(w, cfg):
    """llama.cpp's converter stores Gemma's norm weights as 1 + w."""
    return w - 1.0


def params(cfg: ModelConfig) -> dict[str, Param]:
    """Every leaf of a Gemma 2 model (models/registry.py `Param`); norms start at w = 0 (the identity)."""
    n, e = cfg.num_layers, cfg.hidden_size

    def norm(hf, gguf):
        return Param((n, e), ("layers", "embed"), "vector", f"model.layers.{{i}}.{hf}.weight",
                     f"blk.{{i}}.{gguf}.weight", "zeros", _minus_one)

    return {
        "embed": embed_param(cfg),
        "layers.attn_norm": norm("input_layernorm", "attn_norm"),
        **attention_params(cfg),
        "layers.post_attn_norm": norm("post_attention_layernorm", "post_attention_norm"),
        "layers.mlp_norm": norm("pre_feedforward_layernorm", "ffn_norm"),
        **mlp_params(cfg),
        "layers.post_mlp_norm": norm("post_feedforward_layernorm", "post_ffw_norm"),
        "final_norm": Param((e,), ("embed",), "vector", "model.norm.weight", "output_norm.weight", "zeros",
                            _minus_one),
        **lm_head_param(cfg),
    }


def block(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attend):
    """One Gemma 2 layer: `x + norm(attn(norm(x)))`, then `x + norm(mlp(norm(x)))` with GeGLU."""
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    h = gemma_norm(x, lp.attn_norm, eps)
    q, k, v = weights.dot_many(h, (lp.wq, lp.wk, lp.wv))
    attn, update = attend(heads(q, cfg.num_heads, d), heads(k, cfg.num_kv_heads, d), heads(v, cfg.num_kv_heads, d))
    o = weights.dot(attn.reshape(*x.shape[:2], cfg.num_heads * d), lp.wo)
    x = x + gemma_norm(o, lp.post_attn_norm, eps)
    h = gemma_norm(x, lp.mlp_norm, eps)
    gate, up = weights.dot_many(h, (lp.w_gate, lp.w_up))
    m = weights.dot(jax.nn.gelu(gate, approximate=True) * up, lp.w_down)
    x = x + gemma_norm(m, lp.post_mlp_norm, eps)
    return x, update


def gemma2_forward(params: Params, tokens: jax.Array, cache=None, num_new=None, logits_at=None, rows=None,
                   packed=None):
    """`llama.llama_forward`'s contract over a Gemma 2 model."""
    return decode(params, tokens, cache, num_new, logits_at, block, norm=gemma_norm,
                  embed_scale=math.sqrt(params.config.hidden_size), rows=rows, packed=packed)


def config_from_hf(hf: dict) -> ModelConfig:
    """A Gemma 2 `config.json` dict -> ModelConfig."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"hidden_activation={act!r} is not supported; Gemma 2 uses 'gelu_pytorch_tanh'")
    if hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported for Gemma 2 (its checkpoints have none)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported (a causal decoder only)")
    common = hf_common(hf)
    common["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))  # Gemma 2's default
    window = hf.get("sliding_window", 4096)
    types = hf_layer_types(hf, common["num_layers"],
                           lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    return ModelConfig(
        **common, sliding_window=int(window) if window else None, layer_types=types, hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=_cap(hf.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_cap(hf.get("final_logit_softcapping", 30.0)),
    )


def _cap(value) -> float | None:
    return None if value is None else float(value)


def config_from_gguf(get) -> ModelConfig:
    common = gguf_common(get, "gemma2")
    layers, window = common["num_layers"], get("attention.sliding_window", 4096)
    return ModelConfig(
        **common, sliding_window=int(window) if window else None,
        layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)),
        hidden_act="gelu_tanh", query_pre_attn_scalar=float(common["head_dim"]),
        attn_logit_softcap=_cap(get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_cap(get("final_logit_softcapping", 30.0)),
    )


ARCHITECTURE = register(Architecture(
    name="gemma2", model_types=("gemma2",), hf_classes=("Gemma2ForCausalLM",), gguf_name="gemma2",
    layers=LayerParams, params=params, config_from_hf=config_from_hf, config_from_gguf=config_from_gguf,
    forward=gemma2_forward,
))
