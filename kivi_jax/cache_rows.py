"""What every cache shares for writing rows: the attention implementations, bytes of a pytree, the scatter of new
token rows into stacked stores, and the capacity flag (kivi_jax.cache, kivi_jax.cache8)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kivi_jax import sharding
from kivi_jax.models.protocol import PAST_CAPACITY


ATTENTION_IMPLS = ("auto", "xla", "pallas", "native", "native-int8")  # native-int8: the integer mode of the KIVI kernel


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    return impl


def tree_bytes(tree) -> int:
    """Bytes of a pytree's array leaves, concrete or abstract (`jax.eval_shape`): what a cache reports as its size."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


@sharding.per_shard(out="cache", buf="cache", rows="rows", values="cache")  # under a mesh: each shard its own rows
def scatter_rows(buf: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """Writes `values [layers, batch, kv_heads, n, ...]` into `buf [layers, batch, kv_heads, rows, ...]` at token rows
    `rows [batch, n]`, for every layer. Rows out of range (e.g. `buf.shape[3]`) are dropped: a sequence skips a write."""
    batch = rows.shape[0]
    vals = jnp.moveaxis(values, (1, 3), (0, 1)).astype(buf.dtype)  # [batch, n, layers, kv_heads, ...]
    return buf.at[:, jnp.arange(batch)[:, None], :, rows].set(vals, mode="drop")


def heads_first(x: jax.Array) -> jax.Array:
    """New tokens `[batch, tokens, kv_heads, head_dim]` -> `[batch, kv_heads, tokens, head_dim]`."""
    return jnp.swapaxes(x, 1, 2)


def new_rows(length: jax.Array, num_new: jax.Array, tokens: int, max_tokens: int) -> jax.Array:
    """`[batch, tokens]`: the row each new token goes to, `length + i`, or `max_tokens` (dropped) for padding."""
    i = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    return jnp.where(i < num_new[:, None], length[:, None] + i, max_tokens)


def capacity_flags(length: jax.Array, num_new: jax.Array, max_tokens: int) -> jax.Array:
    """`[batch]` int32: PAST_CAPACITY where `length + num_new` exceeds the cache."""
    return jnp.where(length + num_new > max_tokens, PAST_CAPACITY, 0).astype(jnp.int32)
