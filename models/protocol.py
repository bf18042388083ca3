"""The small protocol between a model and the cache it is handed (docs/design.md §1).

The model computes queries, keys and values for one layer and hands them to the cache; the cache answers the
attention and returns what that layer would store; after the last layer the cache commits all layers' updates. The cache owns the attention implementation, so the same model code runs over the
full-precision cache, the KIVI cache, or no cache at all.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import jax

C = TypeVar("C", bound="KVCache")


class KVCache(Protocol):
    """A stacked per-layer key/value store with one token counter per sequence.

    Shapes: q `[batch, new_tokens, q_heads, head_dim]`, k and v `[batch, new_tokens, kv_heads, head_dim]` (after RoPE,
    unscaled); the answer is `[batch, new_tokens, q_heads, head_dim]` in q's dtype.
    """

    length: jax.Array  # [batch] int32: tokens already in the cache per sequence

    def prefill_attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, num_new: jax.Array, window: int | None
    ) -> tuple[jax.Array, Any]:
        """Causal attention over the new tokens of an empty cache (`num_new [batch]` real tokens); returns the
        answer and this layer's update (a pytree), which `commit` writes."""
        ...

    def decode_attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, window: int | None
    ) -> tuple[jax.Array, Any]:
        """One new token a sequence: attends to the cache plus the new token itself; returns the answer and this
        layer's update."""
        ...

    def commit(self: C, updates: Any, num_new: jax.Array) -> C:
        """Writes the updates of every layer (stacked on a leading layer axis) and adds `num_new [batch]` to `length`.

        Layers only read the cache and `commit` writes it once after the layer loop, so XLA updates the donated
        buffers in place."""
        ...
