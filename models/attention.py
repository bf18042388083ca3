"""Dense causal attention over a sequence of new tokens (prefill), with GQA, an optional sliding window and an
optional logit soft-cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
QUERY_CHUNK = 512  # queries per score tile, bounds the [chunk, tokens] score matrix


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, num_valid: jax.Array, window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal GQA attention of a right-padded sequence over itself.

    q `[batch, tokens, q_heads, head_dim]`, k/v `[batch, tokens, kv_heads, head_dim]`, num_valid `[batch]`: keys at
    positions >= num_valid are padding and never attended; `softcap` caps the scores (`cap * tanh(s / cap)`).
    Returns `[batch, tokens, q_heads, head_dim]` in q's dtype; rows of padded queries hold finite garbage.
    """
    batch, tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    n_rep = q_heads // kv_heads
    scale = head_dim**-0.5
    qg = (q.astype(jnp.float32) * scale).reshape(batch, tokens, kv_heads, n_rep, head_dim)
    key_pos = jnp.arange(tokens)  # [tokens]

    def chunk(start: int, size: int) -> jax.Array:
        q_pos = start + jnp.arange(size)  # [size]
        qc = qg[:, start : start + size]  # [batch, size, kv_heads, n_rep, head_dim]
        scores = jnp.einsum("bqhrd,bkhd->bhrqk", qc, k, preferred_element_type=jnp.float32)
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        allowed = key_pos[None, :] <= q_pos[:, None]  # [size, tokens]
        if window is not None:
            allowed &= q_pos[:, None] - key_pos[None, :] < window
        allowed = allowed[None] & (key_pos[None, None, :] < num_valid[:, None, None])  # [batch, size, tokens]
        # A padded query whose row is all masked sees key 0 instead, so its softmax stays finite.
        allowed = allowed | (~jnp.any(allowed, axis=-1, keepdims=True) & (key_pos[None, None, :] == 0))
        scores = jnp.where(allowed[:, None, None], scores, NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhrqk,bkhd->bqhrd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(batch, size, q_heads, head_dim)

    outs = [chunk(s, min(QUERY_CHUNK, tokens - s)) for s in range(0, tokens, QUERY_CHUNK)]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out.astype(q.dtype)
