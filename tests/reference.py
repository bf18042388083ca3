"""Dense references for tests: what attention over a KIVI cache must equal, computed the obvious way."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def one_layer(store, layer: int):
    return store.replace(codes=store.codes[layer], scale=store.scale[layer], mn=store.mn[layer])


def seen_tensor(store, ring, length, residual):
    """float32 `[batch, kv_heads, max_tokens, head_dim]`: the dequantized store below its quantized end, the ring's
    entry (slot t % R) above it; what decode attention must read for each token."""
    t = jnp.arange(store.codes.shape[2])
    deq = store.dequantize()
    from_ring = ring.astype(jnp.float32)[:, :, t % residual]
    end = store.quantized_end(length, residual)
    return jnp.where((t[None, :] < end[:, None])[:, None, :, None], deq, from_ring)


def dense_kivi_decode(q, cache, layer: int, k_new, v_new, window=None):
    """Decode attention over one layer of a KIVI cache, dequantizing everything (materialized; tests only)."""
    r = cache.config.residual_length
    k = seen_tensor(one_layer(cache.k, layer), cache.k_ring[layer], cache.length, r)
    v = seen_tensor(one_layer(cache.v, layer), cache.v_ring[layer], cache.length, r)
    return dense_decode(q, k, v, cache.length, k_new, v_new, window)


def dense_decode(q, k, v, length, k_new, v_new, window=None):
    """q `[batch, 1, q_heads, D]`, k/v `[batch, kv_heads, tokens, D]` holding `length` tokens, plus the new token."""
    batch, _, q_heads, d = q.shape
    kv_heads, tokens = k.shape[1], k.shape[2]
    k = jnp.concatenate([k, jnp.moveaxis(k_new, 1, 2).astype(jnp.float32)], axis=2)  # new token at index `tokens`
    v = jnp.concatenate([v, jnp.moveaxis(v_new, 1, 2).astype(jnp.float32)], axis=2)
    qg = q[:, 0].astype(jnp.float32).reshape(batch, kv_heads, q_heads // kv_heads, d) / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("bhrd,bhtd->bhrt", qg, k, precision="highest")
    pos = jnp.concatenate([jnp.arange(tokens)[None, :] + jnp.zeros_like(length)[:, None], length[:, None]], axis=1)
    valid = jnp.concatenate([jnp.arange(tokens)[None, :] < length[:, None], jnp.ones_like(length[:, None], bool)], 1)
    if window is not None:
        valid &= length[:, None] - pos < window
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhrt,bhtd->bhrd", p, v, precision="highest")
    return out.reshape(batch, 1, q_heads, d)
