"""The small protocol between a model and the cache it is handed (docs/design.md §1, §7).

For each layer the model computes queries (already rotated), raw keys, values and their positions, and hands them
to the cache with the rotary function; the cache rotates the keys itself (so it may store them before or after
RoPE), answers the attention of the new tokens over what it holds plus themselves, and returns what that layer would
store (a typed pytree). After the last layer the cache commits all layers' updates at once. The cache owns the
attention implementation, so the same model code runs over the full-precision cache, the KIVI cache, or none.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

import jax

C = TypeVar("C", bound="KVCache")

Rope = Callable[[jax.Array, jax.Array], jax.Array]  # (x [batch, tokens, heads, head_dim], positions [batch, tokens])

# Bits of a cache's `error_flags [batch]` (sticky): what went wrong for a sequence; its logits come back NaN.
BAD_TOKEN = 1  # bad input: a token id outside [0, vocab), or num_new outside [0, T]
PAST_CAPACITY = 2  # more tokens than the cache holds: the excess was not stored
SCALE_OVERFLOW = 4  # a quantization scale or min overflowed its storage dtype (KIVI; a warning, logits stay)
POISON = BAD_TOKEN | PAST_CAPACITY


class CacheCapacityError(ValueError):
    """More tokens than the cache was allocated for."""


class KVCache(Protocol):
    """A stacked per-layer key/value store with one token counter per sequence.

    Shapes: q `[batch, T, q_heads, head_dim]` (after RoPE; pre-scaled by the model when its scores are not q.k /
    sqrt(head_dim)), k and v `[batch, T, kv_heads, head_dim]` (k before RoPE), positions `[batch, T]` (`length +
    [0, T)`), num_new `[batch]` real tokens of the right-padded T (0 allowed: that sequence is left as it was); the
    answer is `[batch, T, q_heads, head_dim]` in q's dtype.
    """

    length: jax.Array  # [batch] int32: tokens already in the cache per sequence
    error_flags: jax.Array  # [batch] int32: the bits above

    @property
    def max_tokens(self) -> int: ...

    def attend(
        self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, rope: Rope,
        num_new: jax.Array, window: int | None, softcap: float | None = None,
    ) -> tuple[jax.Array, Any]:
        """The new tokens attend to what the cache holds *as stored* plus themselves, causally, in full precision:
        `softmax(cap(q.k / sqrt(head_dim)))` over the keys inside `window` (None: every earlier key), where `cap(s) =
        softcap * tanh(s / softcap)` (None: no cap). Returns the answer and this layer's update, which `commit`
        writes. `window` and `softcap` are static: a model whose layers differ calls each layer with its own."""
        ...

    def commit(self: C, updates: Any, num_new: jax.Array) -> C:
        """Writes the updates of every layer (stacked on a leading layer axis), appends `num_new [batch]` tokens
        exactly as one-at-a-time appends would store them, and advances `length`.

        Layers only read the cache and `commit` writes it once after the layer loop, so XLA updates the donated
        buffers in place."""
        ...

    def attending(self: C, live: jax.Array) -> C:
        """The cache as the attention of a step over only the `live [batch]` rows sees it: the other rows hold no
        tokens, so their attention costs nothing (`commit` is then called on the cache itself, those rows given
        `num_new = 0`)."""
        ...

    def replace(self: C, **changes) -> C: ...
