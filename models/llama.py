"""Llama and Mistral (docs/design.md §4): GQA, RoPE with theta and linear or llama3-style scaling, RMSNorm, SwiGLU,
tied or untied embeddings, Mistral's sliding window on every layer. Registered as model_type `llama` and `mistral`,
GGUF architecture `llama`.

The shared decoder pieces (`Params`, `forward` of any architecture, `init_params`, norms, RoPE, `NoCache`) live in
models/decoder.py and are importable from here too.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from . import weights
from .config import ModelConfig, UnsupportedModelError, gguf_common, hf_common
from .decoder import (  # noqa: F401 (the shared pieces, importable from here)
    NoCache, Params, Rotary, apply_rope, cast_params, check_inputs, check_value_basis, decode, forward, init_params,
    param_shapes, params_from_dict, params_to_dict, rms_norm, rope_inv_freq,
)
from .registry import Architecture, Param, register


@struct.dataclass
class LayerParams:
    """One decoder layer's weights, each stacked on a leading `[layers]` axis; projections are `[in, out]` float
    arrays or quantized matrices of that shape (models/weights.py)."""

    attn_norm: jax.Array  # [layers, hidden]
    wq: jax.Array  # [layers, hidden, q_heads * head_dim]
    wk: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wv: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wo: jax.Array  # [layers, q_heads * head_dim, hidden]
    mlp_norm: jax.Array  # [layers, hidden]
    w_gate: jax.Array  # [layers, hidden, intermediate]
    w_up: jax.Array  # [layers, hidden, intermediate]
    w_down: jax.Array  # [layers, intermediate, hidden]


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation `[out, in]` (interleaved rotary pairs -> HF's half-split layout)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def embed_param(cfg: ModelConfig) -> Param:
    """The embedding table `[vocab, hidden]`, as every architecture here names it."""
    return Param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "table", "model.embed_tokens.weight",
                 "token_embd.weight")


def lm_head_param(cfg: ModelConfig) -> dict[str, Param]:
    """The untied output head `[hidden, vocab]` (nothing when tied to the embedding table)."""
    if cfg.tie_word_embeddings:
        return {}
    return {"lm_head": Param((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), "matrix", "lm_head.weight",
                             "output.weight")}


def attention_params(cfg: ModelConfig, gguf_fix: bool = False) -> dict[str, Param]:
    """The four attention projections of every layer (HF `self_attn.*_proj`, GGUF `attn_*`); with `gguf_fix` the q
    and k rows of a GGUF are in llama.cpp's interleaved order (its `llama` architecture)."""
    n, e = cfg.num_layers, cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fix = lambda heads: (lambda w, c: unpermute_rope_rows(w, getattr(c, heads))) if gguf_fix else None  # noqa: E731
    hf = lambda name: f"model.layers.{{i}}.self_attn.{name}_proj.weight"  # noqa: E731
    return {
        "layers.wq": Param((n, e, q), ("layers", "embed", "q_heads"), "matrix", hf("q"), "blk.{i}.attn_q.weight",
                           from_gguf=fix("num_heads")),
        "layers.wk": Param((n, e, kv), ("layers", "embed", "kv_heads"), "matrix", hf("k"), "blk.{i}.attn_k.weight",
                           from_gguf=fix("num_kv_heads")),
        "layers.wv": Param((n, e, kv), ("layers", "embed", "kv_heads"), "matrix", hf("v"), "blk.{i}.attn_v.weight",
                           rotate="values"),
        "layers.wo": Param((n, q, e), ("layers", "q_heads", "embed"), "matrix", hf("o"), "blk.{i}.attn_output.weight",
                           rotate="attention_out"),
    }


def mlp_params(cfg: ModelConfig) -> dict[str, Param]:
    """The gated MLP's three projections (HF `mlp.*_proj`, GGUF `ffn_*`)."""
    n, e, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    hf = lambda name: f"model.layers.{{i}}.mlp.{name}_proj.weight"  # noqa: E731
    return {
        "layers.w_gate": Param((n, e, f), ("layers", "embed", "mlp"), "matrix", hf("gate"), "blk.{i}.ffn_gate.weight"),
        "layers.w_up": Param((n, e, f), ("layers", "embed", "mlp"), "matrix", hf("up"), "blk.{i}.ffn_up.weight"),
        "layers.w_down": Param((n, f, e), ("layers", "mlp", "embed"), "matrix", hf("down"), "blk.{i}.ffn_down.weight"),
    }


def norm_param(cfg: ModelConfig, hf: str, gguf: str, init: str = "ones", from_gguf=None) -> Param:
    """A per-layer norm over the hidden size."""
    return Param((cfg.num_layers, cfg.hidden_size), ("layers", "embed"), "vector", f"model.layers.{{i}}.{hf}.weight",
                 f"blk.{{i}}.{gguf}.weight", init, from_gguf)


def final_norm_param(cfg: ModelConfig, init: str = "ones", from_gguf=None) -> Param:
    return Param((cfg.hidden_size,), ("embed",), "vector", "model.norm.weight", "output_norm.weight", init, from_gguf)


def params(cfg: ModelConfig) -> dict[str, Param]:
    """Every leaf of a Llama / Mistral model (models/registry.py `Param`)."""
    return {
        "embed": embed_param(cfg),
        "layers.attn_norm": norm_param(cfg, "input_layernorm", "attn_norm"),
        **attention_params(cfg, gguf_fix=True),
        "layers.mlp_norm": norm_param(cfg, "post_attention_layernorm", "ffn_norm"),
        **mlp_params(cfg),
        "final_norm": final_norm_param(cfg),
        **lm_head_param(cfg),
    }


def heads(x: jax.Array, n: int, head_dim: int) -> jax.Array:
    """`[batch, T, n * head_dim]` -> `[batch, T, n, head_dim]`."""
    return x.reshape(*x.shape[:2], n, head_dim)


def block(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attend):
    """One Llama layer: `x + attn(norm(x))`, then `x + mlp(norm(x))` with SwiGLU."""
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q, k, v = weights.dot_many(h, (lp.wq, lp.wk, lp.wv))
    d = cfg.head_dim
    attn, update = attend(heads(q, cfg.num_heads, d), heads(k, cfg.num_kv_heads, d), heads(v, cfg.num_kv_heads, d))
    x = x + weights.dot(attn.reshape(*x.shape[:2], cfg.num_heads * d), lp.wo)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gate, up = weights.dot_many(h, (lp.w_gate, lp.w_up))
    x = x + weights.dot(jax.nn.silu(gate) * up, lp.w_down)
    return x, update


def llama_forward(params: Params, tokens: jax.Array, cache=None, num_new=None, logits_at=None, rows=None,
                  packed=None):
    """Runs the decoder over `tokens [batch, T]` placed after what `cache` holds (any T, any cache state).

    `num_new [batch]` counts the real tokens of a right-padded `tokens` (default all T; 0 leaves a sequence as it
    was); positions are `cache.length + [0, T)`. `logits_at [batch]` picks one token per sequence to score (e.g. the
    last real one); otherwise every token is scored. Returns float32 logits `[batch, T or 1, vocab]` and the updated
    cache (None when none was given). A sequence with an out-of-range token id, or more tokens than the cache
    holds, gets NaN logits and a bit in `cache.error_flags` (raised at once when called outside `jit`).
    """
    return decode(params, tokens, cache, num_new, logits_at, block, rows=rows, packed=packed)


def config_from_hf(hf: dict) -> ModelConfig:
    """A Llama / Mistral `config.json` dict -> ModelConfig, refusing what these models do not have."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UnsupportedModelError(f"{flag}=true is not supported (Llama/Mistral checkpoints have no biases)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported; Llama/Mistral use 'silu'")
    if hf.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError("pretraining_tp != 1 is not supported")
    window = hf.get("sliding_window") if hf["model_type"] == "mistral" else None
    if hf.get("use_sliding_window") is False:
        window = None
    return ModelConfig(**hf_common(hf), sliding_window=int(window) if window else None)


def config_from_gguf(get) -> ModelConfig:
    return ModelConfig(**gguf_common(get, "llama"))


ARCHITECTURE = register(Architecture(
    name="llama", model_types=("llama", "mistral"), hf_classes=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_name="llama", layers=LayerParams, params=params, config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf, forward=llama_forward,
))
