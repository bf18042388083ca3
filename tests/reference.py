"""Dense references for tests: what attention over a KIVI cache must equal, computed the obvious way."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def one_layer(store, layer: int):
    return store.replace(codes=store.codes[layer], scale=store.scale[layer], mn=store.mn[layer])


def seen_tensor(store, ring, length, residual, sink=None, inv_freq=None):
    """float32 `[batch, kv_heads, max_tokens, head_dim]`: the dequantized store below its quantized end, the ring's
    entry (slot t % R) above it, the sinks' entry below S (`sink [batch, kv_heads, S, head_dim]`); what attention must
    read for each token. With `inv_freq` (a pre-RoPE store) the result is rotated by each token's position after."""
    t = jnp.arange(store.codes.shape[2])
    deq = store.dequantize()
    from_ring = ring.astype(jnp.float32)[:, :, t % residual]
    end = store.quantized_end(length, residual)
    seen = jnp.where((t[None, :] < end[:, None])[:, None, :, None], deq, from_ring)
    if sink is not None:
        s = sink.shape[2]
        seen = jnp.where((t < s)[None, None, :, None], sink.astype(jnp.float32)[:, :, jnp.minimum(t, s - 1)], seen)
    if inv_freq is not None:
        from kivi_jax.models.llama import apply_rope

        pos = jnp.broadcast_to(t[None, :], (seen.shape[0], t.shape[0]))
        seen = jnp.swapaxes(apply_rope(jnp.swapaxes(seen, 1, 2), pos, inv_freq), 1, 2)
    return seen


def seen_keys_values(cache, layer: int, inv_freq=None):
    """What attention reads for each token of one layer of a KIVI cache: keys (rotated when the cache is pre-RoPE;
    give `inv_freq`) and values, float32 `[batch, kv_heads, max_tokens, head_dim]` each."""
    r = cache.config.residual_length
    sink = lambda x: None if x is None else x[layer]
    pre = inv_freq if cache.config.pre_rope else None
    k = seen_tensor(one_layer(cache.k, layer), cache.k_ring[layer], cache.length, r, sink(cache.k_sink), pre)
    v = seen_tensor(one_layer(cache.v, layer), cache.v_ring[layer], cache.length, r, sink(cache.v_sink))
    return k, v


def dense_kivi_decode(q, cache, layer: int, k_new, v_new, window=None, inv_freq=None, softcap=None):
    """Decode attention over one layer of a KIVI cache, dequantizing everything (materialized; tests only)."""
    k, v = seen_keys_values(cache, layer, inv_freq)
    return dense_decode(q, k, v, cache.length, k_new, v_new, window, softcap)


def dense_decode(q, k, v, length, k_new, v_new, window=None, softcap=None):
    """q `[batch, 1, q_heads, D]`, k/v `[batch, kv_heads, tokens, D]` holding `length` tokens, plus the new token;
    scores soft-capped by `softcap` (`cap * tanh(s / cap)`) when given."""
    batch, _, q_heads, d = q.shape
    kv_heads, tokens = k.shape[1], k.shape[2]
    k = jnp.concatenate([k, jnp.moveaxis(k_new, 1, 2).astype(jnp.float32)], axis=2)  # new token at index `tokens`
    v = jnp.concatenate([v, jnp.moveaxis(v_new, 1, 2).astype(jnp.float32)], axis=2)
    qg = q[:, 0].astype(jnp.float32).reshape(batch, kv_heads, q_heads // kv_heads, d) / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("bhrd,bhtd->bhrt", qg, k, precision="highest")
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    pos = jnp.concatenate([jnp.arange(tokens)[None, :] + jnp.zeros_like(length)[:, None], length[:, None]], axis=1)
    valid = jnp.concatenate([jnp.arange(tokens)[None, :] < length[:, None], jnp.ones_like(length[:, None], bool)], 1)
    if window is not None:
        valid &= length[:, None] - pos < window
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhrt,bhtd->bhrd", p, v, precision="highest")
    return out.reshape(batch, 1, q_heads, d)
