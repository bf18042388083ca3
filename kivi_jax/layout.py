"""The token ranges of a cache, in one place (docs/design.md §2, §7): which tokens a store holds quantized, which
sit in the full-precision ring, which a query may see.

Everything derives from one counter, `length [batch]` (tokens in the cache), and the residual length R:
- a per-channel store (KIVI's keys) quantizes whole R-token blocks: tokens `[0, (length // R) * R)`;
- a per-token store (KIVI's values) quantizes every token but the newest R: tokens `[0, max(length - R, 0))`;
- ring slot `s` holds the newest token `t < length` with `t % R == s` (the newest `min(length, R)` tokens);
- a query at position `p` sees keys at positions `k <= p` with `p - k < window` (Mistral's sliding window).
The XLA attention path, the caches' appends, the kernel wrappers and the test references all call these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AXES = ("channel", "token")


def quantized_end(axis: str, length: jax.Array, residual: int) -> jax.Array:
    """`[batch]`: a store on `axis` holds tokens `[0, end)` quantized once `length` tokens are in."""
    if axis == "channel":
        return (length // residual) * residual
    if axis == "token":
        return jnp.maximum(length - residual, 0)
    raise ValueError(f"axis {axis!r} is not one of {AXES}")


def both_quantized_end(key_axis: str, value_axis: str, length: jax.Array, residual: int) -> jax.Array:
    """`[batch]`: tokens `[0, end)` have their key *and* value quantized (the codes-only segment of attention)."""
    return jnp.minimum(quantized_end(key_axis, length, residual), quantized_end(value_axis, length, residual))


def ring_tokens(length: jax.Array, residual: int) -> jax.Array:
    """`[batch, R]`: the token each ring slot holds once `length` tokens are in; negative where never written."""
    last = length[:, None] - 1
    return last - jnp.mod(last - jnp.arange(residual)[None, :], residual)


def ring_slots(length: jax.Array, num_new: jax.Array, tokens: int, residual: int) -> jax.Array:
    """`[batch, tokens]`: the ring slot new token `i` (position `length + i`) lands in when `num_new [batch]` of
    `tokens` are appended, or R (dropped) for a token that is padding or not among the newest R after the append.
    Slots are distinct within a row, and after the writes every slot holds what `ring_tokens` says."""
    i = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    lands = (i < num_new[:, None]) & (i >= num_new[:, None] - residual)
    return jnp.where(lands, jnp.mod(length[:, None] + i, residual), residual)


def last_flushed_block(length: jax.Array, residual: int) -> jax.Array:
    """`[batch]`: first row of the newest quantized R-block of a per-channel store (0 before the first flush). Ring
    slot `s` and row `start + s` of that block hold the same token while it is in the ring."""
    return jnp.maximum(length // residual - 1, 0) * residual


def visible(key_pos: jax.Array, query_pos: jax.Array, window: int | None) -> jax.Array:
    """`[batch, queries, keys]` bool: causal and inside the sliding window, for key positions `[batch or 1, keys]`
    and query positions `[batch, queries]`."""
    ok = key_pos[:, None, :] <= query_pos[:, :, None]
    if window is not None:
        ok &= query_pos[:, :, None] - key_pos[:, None, :] < window
    return ok


def window_start(query_pos: jax.Array, window: int | None) -> jax.Array:
    """The first key position a query at `query_pos` sees (0 without a sliding window)."""
    if window is None:
        return jnp.zeros_like(query_pos)
    return jnp.maximum(query_pos - window + 1, 0)


def appended_blocks(tokens: int, residual: int) -> int:
    """Most R-blocks that appending `tokens` new tokens can complete (static): `(R - 1 + tokens) // R`."""
    return (residual - 1 + tokens) // residual
