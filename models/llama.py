"""Functional Llama / Mistral decoder: parameters as a frozen pytree, layers stacked and run with `lax.scan`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from .attention import causal_attention
from .config import LlamaConfig
from .protocol import KVCache


@struct.dataclass
class LayerParams:
    """One decoder layer's weights, each stacked on a leading `[layers]` axis; projections are `[in, out]`."""

    attn_norm: jax.Array  # [layers, hidden]
    wq: jax.Array  # [layers, hidden, q_heads * head_dim]
    wk: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wv: jax.Array  # [layers, hidden, kv_heads * head_dim]
    wo: jax.Array  # [layers, q_heads * head_dim, hidden]
    mlp_norm: jax.Array  # [layers, hidden]
    w_gate: jax.Array  # [layers, hidden, intermediate]
    w_up: jax.Array  # [layers, hidden, intermediate]
    w_down: jax.Array  # [layers, intermediate, hidden]


@struct.dataclass
class Params:
    """All weights of a model, with its config as a static field."""

    embed: jax.Array  # [vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`
    config: LlamaConfig = struct.field(pytree_node=False)

    @property
    def dtype(self):
        return self.embed.dtype


def param_shapes(cfg: LlamaConfig) -> dict:
    """Shape of every parameter, keyed like `Params` (nested dict for `layers`)."""
    n, e, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "embed": (cfg.vocab_size, e),
        "layers": {
            "attn_norm": (n, e),
            "wq": (n, e, q),
            "wk": (n, e, kv),
            "wv": (n, e, kv),
            "wo": (n, q, e),
            "mlp_norm": (n, e),
            "w_gate": (n, e, f),
            "w_up": (n, e, f),
            "w_down": (n, f, e),
        },
        "final_norm": (e,),
        "lm_head": None if cfg.tie_word_embeddings else (e, cfg.vocab_size),
    }


def params_from_dict(tree: dict, cfg: LlamaConfig) -> Params:
    """Builds `Params` from a nested dict shaped like `param_shapes(cfg)`, checking every shape."""
    shapes = param_shapes(cfg)

    def check(name, arr, shape):
        if shape is None:
            return None
        if arr is None:
            raise ValueError(f"parameter {name} is missing (expected shape {shape})")
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return arr

    layers = LayerParams(**{k: check(f"layers.{k}", tree["layers"].get(k), s) for k, s in shapes["layers"].items()})
    return Params(
        embed=check("embed", tree.get("embed"), shapes["embed"]),
        layers=layers,
        final_norm=check("final_norm", tree.get("final_norm"), shapes["final_norm"]),
        lm_head=check("lm_head", tree.get("lm_head"), shapes["lm_head"]),
        config=cfg,
    )


def params_to_dict(params: Params) -> dict:
    """The inverse of `params_from_dict` (without the config)."""
    return {
        "embed": params.embed,
        "layers": {k: getattr(params.layers, k) for k in param_shapes(params.config)["layers"]},
        "final_norm": params.final_norm,
        "lm_head": params.lm_head,
    }


def init_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights with the config's shapes (tests and synthetic benchmarks); norms start at 1."""
    shapes = param_shapes(cfg)
    flat = [("embed", shapes["embed"]), ("lm_head", shapes["lm_head"])]
    flat += [(f"layers.{k}", s) for k, s in shapes["layers"].items()]
    keys = dict(zip([n for n, _ in flat], jax.random.split(key, len(flat))))
    tree: dict = {"layers": {}}
    for name, shape in flat:
        if shape is None:
            tree[name] = None
            continue
        if name.endswith("norm"):
            value = jnp.ones(shape, dtype)
        else:
            value = (std * jax.random.normal(keys[name], shape, jnp.float32)).astype(dtype)
        if name.startswith("layers."):
            tree["layers"][name[len("layers.") :]] = value
        else:
            tree[name] = value
    tree["final_norm"] = jnp.ones(shapes["final_norm"], dtype)
    return params_from_dict(tree, cfg)


def cast_params(params: Params, dtype) -> Params:
    """The same parameters in another compute dtype."""
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), params)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result in x's dtype (as transformers computes it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies `[head_dim // 2]` (float32), with linear or llama3-style scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return jnp.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates `x [batch, tokens, heads, head_dim]` by `positions [batch, tokens]` (half-split layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, head_dim // 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, tokens, 1, head_dim]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class _NoCache:
    """Stands in for a cache when scoring a whole sequence at once: attention over the given tokens only."""

    def __init__(self, batch: int):
        self.length = jnp.zeros((batch,), jnp.int32)

    def prefill_attend(self, layer, q, k, v, num_new, window):
        return causal_attention(q, k, v, num_new, window), None

    def decode_attend(self, layer, q, k, v, window):
        return causal_attention(q, k, v, jnp.ones(q.shape[:1], jnp.int32), window), None

    def commit(self, updates, num_new):
        return self


def forward(
    params: Params,
    tokens: jax.Array,
    cache: KVCache | None = None,
    num_new: jax.Array | None = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the decoder over `tokens [batch, tokens]` placed after what `cache` holds.

    More than one token a sequence is a prefill and needs an empty cache; one token is a decode step. `num_new
    [batch]` counts the real (not padding) tokens of a right-padded prefill; positions come from `cache.length`.
    `logits_at [batch]` picks one token per sequence to score (e.g. the last real prompt token); otherwise every token
    is scored. Returns float32 logits `[batch, tokens or 1, vocab]` and the updated cache (None when none was given).
    """
    cfg = params.config
    batch, n_tok = tokens.shape
    dtype = params.dtype
    given = cache
    if cache is None:
        cache = _NoCache(batch)
    if num_new is None:
        num_new = jnp.full((batch,), n_tok, jnp.int32)
    positions = cache.length[:, None] + jnp.arange(n_tok, dtype=jnp.int32)[None, :]  # [batch, tokens]
    inv_freq = rope_inv_freq(cfg)
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def layer_step(x, xs):
        lp, layer = xs
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q = (h @ lp.wq).reshape(batch, n_tok, heads, head_dim)
        k = (h @ lp.wk).reshape(batch, n_tok, kv_heads, head_dim)
        v = (h @ lp.wv).reshape(batch, n_tok, kv_heads, head_dim)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if n_tok == 1:
            attn, update = cache.decode_attend(layer, q, k, v, cfg.sliding_window)
        else:
            attn, update = cache.prefill_attend(layer, q, k, v, num_new, cfg.sliding_window)
        x = x + attn.reshape(batch, n_tok, heads * head_dim) @ lp.wo
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ lp.w_gate) * (h @ lp.w_up)) @ lp.w_down
        return x, update

    x = params.embed[tokens].astype(dtype)  # [batch, tokens, hidden]
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    # The cache is only read inside the loop; every layer's update comes out stacked and is written once after it.
    x, updates = jax.lax.scan(layer_step, x, (params.layers, layer_ids))
    cache = cache.commit(updates, num_new)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)  # [batch, 1, hidden]
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    head = params.embed.T if params.lm_head is None else params.lm_head
    logits = jnp.einsum("bte,ev->btv", x, head, preferred_element_type=jnp.float32)
    return logits, (cache if given is not None else None)
