"""The small protocol between a model and the cache it is handed (DESIGN §1).

The model computes queries, keys and values for one layer and hands them to the cache; the cache stores the keys and
values and answers the attention. The cache owns the attention implementation, so the same model code runs over the
full-precision cache, the KIVI cache, or no cache at all.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import jax

C = TypeVar("C", bound="KVCache")


class KVCache(Protocol):
    """A stacked per-layer key/value store with one token counter per sequence.

    Shapes: q `[batch, new_tokens, q_heads, head_dim]`, k and v `[batch, new_tokens, kv_heads, head_dim]` (after RoPE,
    unscaled); the answer is `[batch, new_tokens, q_heads, head_dim]` in q's dtype.
    """

    length: jax.Array  # [batch] int32: tokens already in the cache per sequence

    def prefill_attend(
        self: C, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, num_new: jax.Array, window: int | None
    ) -> tuple[jax.Array, C]:
        """Causal attention over the new tokens of an empty cache, then stores them. `num_new [batch]`: real tokens."""
        ...

    def decode_attend(
        self: C, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, window: int | None
    ) -> tuple[jax.Array, C]:
        """One new token a sequence: attends to the cache plus the new token itself, then stores it."""
        ...

    def advance(self: C, num_new: jax.Array) -> C:
        """Adds `num_new [batch]` tokens to `length` once every layer has stored them."""
        ...
