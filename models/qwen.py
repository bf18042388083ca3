"""Qwen2 and Qwen3: Llama's layer with biases on the q, k, v projections (Qwen2; Qwen3 with `attention_bias`, which
also biases the output projection) and RMSNorm over each query and key head before RoPE (Qwen3); sliding windows on
the layers `layer_types` marks (`use_sliding_window`: the layers from `max_window_layers` on). Registered as
model_type `qwen2` and `qwen3`, GGUF architectures `qwen2` and `qwen3` (llama.cpp keeps their q/k rows in HF's
order)."""

from __future__ import annotations

import jax
from flax import struct

from . import weights
from .config import ModelConfig, UnsupportedModelError, gguf_common, hf_common, hf_layer_types
from .decoder import Params, decode, rms_norm
from .llama import attention_params, embed_param, final_norm_param, heads, lm_head_param, mlp_params, norm_param
from .registry import Architecture, Param, register


@struct.dataclass
class LayerParams:
    """One Qwen layer's weights, stacked on a leading `[layers]` axis; a leaf the config does not have is None."""

    attn_norm: jax.Array  # [layers, hidden]
    wq: jax.Array  # [layers, hidden, q_heads * head_dim]
    wk: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wv: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wo: jax.Array  # [layers, q_heads * head_dim, hidden]
    mlp_norm: jax.Array  # [layers, hidden]
    w_gate: jax.Array  # [layers, hidden, intermediate]
    w_up: jax.Array  # [layers, hidden, intermediate]
    w_down: jax.Array  # [layers, intermediate, hidden]
    bq: jax.Array | None = None  # [layers, q_heads * head_dim] (qkv_bias)
    bk: jax.Array | None = None  # [layers, kv_heads * head_dim]
    bv: jax.Array | None = None  # [layers, kv_heads * head_dim]
    bo: jax.Array | None = None  # [layers, hidden] (o_bias)
    q_norm: jax.Array | None = None  # [layers, head_dim] (Qwen3)
    k_norm: jax.Array | None = None  # [layers, head_dim] (Qwen3)


def params(cfg: ModelConfig) -> dict[str, Param]:
    """Every leaf of a Qwen2 / Qwen3 model for this config (models/registry.py `Param`)."""
    n, e, d = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    hf = lambda name: f"model.layers.{{i}}.self_attn.{name}"  # noqa: E731
    out = {"embed": embed_param(cfg), "layers.attn_norm": norm_param(cfg, "input_layernorm", "attn_norm"),
           **attention_params(cfg)}
    if cfg.qkv_bias:
        out["layers.bq"] = Param((n, q), ("layers", "q_heads"), "vector", hf("q_proj.bias"), "blk.{i}.attn_q.bias",
                                 "zeros")
        out["layers.bk"] = Param((n, kv), ("layers", "kv_heads"), "vector", hf("k_proj.bias"), "blk.{i}.attn_k.bias",
                                 "zeros")
        out["layers.bv"] = Param((n, kv), ("layers", "kv_heads"), "vector", hf("v_proj.bias"), "blk.{i}.attn_v.bias",
                                 "zeros", rotate="values")
    if cfg.o_bias:
        out["layers.bo"] = Param((n, e), ("layers", "embed"), "vector", hf("o_proj.bias"),
                                 "blk.{i}.attn_output.bias", "zeros")
    if cfg.model_type == "qwen3":
        out["layers.q_norm"] = Param((n, d), ("layers", "head_dim"), "vector", hf("q_norm.weight"),
                                     "blk.{i}.attn_q_norm.weight", "ones")
        out["layers.k_norm"] = Param((n, d), ("layers", "head_dim"), "vector", hf("k_norm.weight"),
                                     "blk.{i}.attn_k_norm.weight", "ones")
    out["layers.mlp_norm"] = norm_param(cfg, "post_attention_layernorm", "ffn_norm")
    out.update(mlp_params(cfg))
    out["final_norm"] = final_norm_param(cfg)
    out.update(lm_head_param(cfg))
    return out


def block(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attend):
    """One Qwen layer: Llama's, with the projections' biases and the per-head q/k norms where the config has them."""
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    h = rms_norm(x, lp.attn_norm, eps)
    q, k, v = weights.dot_many(h, (lp.wq, lp.wk, lp.wv))
    if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    q, k, v = heads(q, cfg.num_heads, d), heads(k, cfg.num_kv_heads, d), heads(v, cfg.num_kv_heads, d)
    if lp.q_norm is not None:  # [batch, T, heads, head_dim]: each head normalized alone
        q, k = rms_norm(q, lp.q_norm, eps), rms_norm(k, lp.k_norm, eps)
    attn, update = attend(q, k, v)
    o = weights.dot(attn.reshape(*x.shape[:2], cfg.num_heads * d), lp.wo)
    x = x + (o if lp.bo is None else o + lp.bo)
    h = rms_norm(x, lp.mlp_norm, eps)
    gate, up = weights.dot_many(h, (lp.w_gate, lp.w_up))
    x = x + weights.dot(jax.nn.silu(gate) * up, lp.w_down)
    return x, update


def qwen_forward(params: Params, tokens: jax.Array, cache=None, num_new=None, logits_at=None, rows=None,
                 packed=None):
    """`llama.llama_forward`'s contract over a Qwen2 / Qwen3 model."""
    return decode(params, tokens, cache, num_new, logits_at, block, rows=rows, packed=packed)


def config_from_hf(hf: dict) -> ModelConfig:
    """A Qwen2 / Qwen3 `config.json` dict -> ModelConfig."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported; Qwen2/Qwen3 use 'silu'")
    qwen3 = hf["model_type"] == "qwen3"
    bias = bool(hf.get("attention_bias", False)) if qwen3 else True  # Qwen2's q, k, v always have biases
    common = hf_common(hf)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first_windowed = hf.get("max_window_layers", common["num_layers"])
    types = hf_layer_types(hf, common["num_layers"], lambda i: "sliding_attention" if window is not None and
                           i >= first_windowed else "full_attention")
    return ModelConfig(**common, sliding_window=int(window) if window else None, layer_types=types, qkv_bias=bias,
                       o_bias=bias and qwen3)


def config_from_gguf(get) -> ModelConfig:
    common = gguf_common(get, get.arch)
    bias = get.arch == "qwen2" or "blk.0.attn_q.bias" in get.tensors
    return ModelConfig(**common, qkv_bias=bias, o_bias=get.arch == "qwen3" and bias)


for _name, _cls in (("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
    register(Architecture(
        name=_name, model_types=(_name,), hf_classes=(_cls,), gguf_name=_name, layers=LayerParams, params=params,
        config_from_hf=config_from_hf, config_from_gguf=config_from_gguf, forward=qwen_forward,
    ))
