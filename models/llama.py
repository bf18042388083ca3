"""Functional Llama / Mistral decoder: parameters as a frozen pytree, layers stacked and run with `lax.scan`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import weights
from .attention import causal_attention
from .config import LlamaConfig
from .protocol import BAD_TOKEN, POISON, CacheCapacityError, KVCache


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


@struct.dataclass
class Params:
    """All weights of a model, with its config as a static field. Weights are float arrays in the compute dtype or
    quantized matrices (`kivi_jax.weights`: GGUF blocks, int8, int4); norms are always float."""

    embed: jax.Array  # [vocab, hidden] (a quantized table: one row a token)
    layers: LayerParams
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`
    config: LlamaConfig = struct.field(pytree_node=False)
    value_basis: str = struct.field(pytree_node=False, default="")  # "hadamard": wv/wo rotated (kivi_jax.rotation)

    @property
    def dtype(self):
        """The compute dtype (of the activations and every float leaf; norms are never quantized)."""
        return self.final_norm.dtype


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
    """The same parameters in another compute dtype (quantized matrices keep their codes and scales)."""
    return jax.tree_util.tree_map(lambda a: a if weights.is_quantized(a) else a.astype(dtype), params,
                                  is_leaf=weights.is_quantized)


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


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The rotary function a layer hands its cache: `rope(x, positions)`; `inv_freq [head_dim // 2]` for a cache that
    rotates stored keys itself (a pre-RoPE store)."""

    inv_freq: jax.Array

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, self.inv_freq)


class NoCache:
    """Stands in for a cache when scoring a whole sequence at once: attention over the given tokens only (also the
    base of test and diagnostic stand-ins that override `attend`)."""

    def __init__(self, batch: int, tokens: int):
        self.length = jnp.zeros((batch,), jnp.int32)
        self.error_flags = jnp.zeros((batch,), jnp.int32)
        self.max_tokens = tokens

    def attend(self, layer, q, k, v, positions, rope, num_new, window):
        return causal_attention(q, rope(k, positions), v, num_new, window), None

    def commit(self, updates, num_new):
        return self

    def replace(self, **changes):
        for name, value in changes.items():
            setattr(self, name, value)
        return self


def _concrete(x):
    """x as a numpy array, or None when it is traced (under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_inputs(tokens: jax.Array, num_new: jax.Array, logits_at, cache: KVCache, vocab: int) -> jax.Array:
    """`[batch]` bool: sequences given bad input (a real token id outside `[0, vocab)`, `num_new` outside `[0, T]`).
    With concrete inputs (no jit) bad input, or more tokens than the cache holds, raises at once; traced, the
    caller flags the sequence instead."""
    n_tok = tokens.shape[1]
    real = jnp.arange(n_tok)[None, :] < num_new[:, None]
    bad = jnp.any(real & ((tokens < 0) | (tokens >= vocab)), axis=1) | (num_new < 0) | (num_new > n_tok)  # [batch]
    length, n, at = _concrete(cache.length), _concrete(num_new), None if logits_at is None else _concrete(logits_at)
    if n is not None and ((n < 0) | (n > n_tok)).any():
        raise ValueError(f"num_new={n.tolist()} must count real tokens of each sequence, between 0 and {n_tok}")
    if at is not None and ((at < 0) | (at >= n_tok)).any():
        raise ValueError(f"logits_at={at.tolist()} must pick a token index in [0, {n_tok})")
    bad_now = _concrete(bad)
    if bad_now is not None and bad_now.any():
        ids = np.asarray(tokens)[np.asarray(real)]
        wrong = sorted({int(t) for t in ids if not 0 <= t < vocab})
        raise ValueError(f"token ids {wrong[:5]} in sequences {np.flatnonzero(bad_now).tolist()} are outside the "
                         f"vocabulary [0, {vocab})")
    if length is not None and n is not None:
        over = np.flatnonzero(length + n > cache.max_tokens)
        if over.size:
            b = int(over[0])
            raise CacheCapacityError(
                f"sequence {b} holds {int(length[b])} tokens and gets {int(n[b])} more, past the cache's "
                f"{cache.max_tokens}; allocate a larger cache (make_cache(..., max_tokens>={int(length[b] + n[b])})) "
                "or grow it (cache.grown(max_tokens))")
    return bad


def check_value_basis(params: Params, cache) -> None:
    """A cache that quantizes values in a rotated basis needs params whose projections carry it, and a cache that
    does not needs params that do not (else the stored values silently differ); the full cache takes either."""
    wanted = getattr(cache, "value_basis", None)
    if wanted is not None and wanted != params.value_basis:
        basis = lambda name: f"the {name} basis" if name else "the model's own basis"
        raise ValueError(
            f"the cache quantizes values in {basis(wanted)} but the params produce values in "
            f"{basis(params.value_basis)}; prepare them for this cache with "
            "kivi_jax.rotation.prepare_params(params, spec) from the unrotated params")


def forward(
    params: Params,
    tokens: jax.Array,
    cache: KVCache | None = None,
    num_new: jax.Array | None = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the decoder over `tokens [batch, T]` placed after what `cache` holds (any T, any cache state).

    `num_new [batch]` counts the real tokens of a right-padded `tokens` (default all T; 0 leaves a sequence as it
    was); positions are `cache.length + [0, T)`. `logits_at [batch]` picks one token per sequence to score (e.g. the
    last real one); otherwise every token is scored. Returns float32 logits `[batch, T or 1, vocab]` and the updated
    cache (None when none was given). A sequence with an out-of-range token id, or more tokens than the cache
    holds, gets NaN logits and a bit in `cache.error_flags` (raised at once when called outside `jit`).
    """
    cfg = params.config
    batch, n_tok = tokens.shape
    dtype = params.dtype
    given = cache
    if cache is None:
        cache = NoCache(batch, n_tok)
    check_value_basis(params, cache)
    num_new = jnp.full((batch,), n_tok, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    bad_tokens = check_inputs(tokens, num_new, logits_at, cache, cfg.vocab_size)
    num_new = jnp.clip(num_new, 0, n_tok)
    positions = cache.length[:, None] + jnp.arange(n_tok, dtype=jnp.int32)[None, :]  # [batch, T]
    rope = Rotary(rope_inv_freq(cfg))
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    dot = weights.dot
    # Float leaves are sliced by the scan; quantized ones stay whole and are read at the layer index (no copy).
    sliced, whole = weights.split_stacked(params.layers)

    def layer_step(x, xs):
        lp, layer = xs
        lp = weights.join_layer(lp, whole, layer)
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q, k, v = weights.dot_many(h, (lp.wq, lp.wk, lp.wv))
        q = q.reshape(batch, n_tok, heads, head_dim)
        k = k.reshape(batch, n_tok, kv_heads, head_dim)
        v = v.reshape(batch, n_tok, kv_heads, head_dim)
        attn, update = cache.attend(layer, rope(q, positions), k, v, positions, rope, num_new, cfg.sliding_window)
        x = x + dot(attn.reshape(batch, n_tok, heads * head_dim), lp.wo)
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        gate, up = weights.dot_many(h, (lp.w_gate, lp.w_up))
        x = x + dot(jax.nn.silu(gate) * up, lp.w_down)
        return x, update

    x = weights.table_rows(params.embed, jnp.clip(tokens, 0, cfg.vocab_size - 1), dtype)  # [batch, T, hidden]
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    # The cache is only read inside the loop; every layer's update comes out stacked and is written once after it.
    x, updates = jax.lax.scan(layer_step, x, (sliced, layer_ids))
    cache = cache.commit(updates, num_new)
    cache = cache.replace(error_flags=cache.error_flags | jnp.where(bad_tokens, BAD_TOKEN, 0).astype(jnp.int32))
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)  # [batch, 1, hidden]
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        logits = weights.dot_table(x, params.embed)  # [batch, T, vocab] float32
    else:
        logits = weights.dot_head(x, params.lm_head)
    poisoned = (cache.error_flags & POISON) != 0  # [batch]
    logits = jnp.where(poisoned[:, None, None], jnp.nan, logits)
    return logits, (cache if given is not None else None)
