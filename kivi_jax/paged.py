"""Paged stores (docs/design.md §12): a cache's tokens kept in a pool of fixed-size pages — one array per leaf, a
page axis where a contiguous cache has its batch axis — and read and written through a block table.

Sequence `b`'s token `t` lives in page `table[b, t // page_tokens]`, row `t % page_tokens` of it. A table entry equal
to the pool's page count holds no page: reads there give zeros and writes there are dropped (`unheld_writes` says
which). Rows a sequence has not written yet (at or past the store's `end`) read as zeros, so whatever a page held
before it was handed to this sequence (another request's tokens, poison in a test) never reaches attention, and what
attention reads is bit for bit what a contiguous cache of the same tokens holds (tests/test_paged.py).

Pools are `[layers, pages, kv_heads, page_rows, X]`; a KIVI page is one R-token block (`page_rows` = R for codes and
per-token scales, R / G for per-channel scales), a full-precision page `page_tokens` rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

FULL_PAGE_TOKENS = 16  # tokens a page of a paged full-precision cache (vLLM's block size)


def no_page(pool: jax.Array) -> int:
    """The table entry that holds no page in `pool [layers, pages, ...]`: its page count."""
    return pool.shape[1]


def empty_table(batch: int, pages_per_sequence: int, num_pages: int) -> jax.Array:
    """`[batch, pages_per_sequence]` int32: a block table that holds no page."""
    return jnp.full((batch, pages_per_sequence), num_pages, jnp.int32)


def page_of(table: jax.Array, rows: jax.Array, per_page: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """The page and the row inside it of store rows `rows [batch, n]` (`per_page` rows a page), each `[batch, n]`;
    rows before 0 or past the table get page `num_pages` (none)."""
    idx = rows // per_page
    inside = (rows >= 0) & (idx < table.shape[1])
    page = jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, num_pages), jnp.mod(rows, per_page)


def read_pages(pool: jax.Array, layer, table: jax.Array, first_page, n_pages: int) -> jax.Array:
    """Pages `[first_page, first_page + n_pages)` of every sequence's table, of one layer of `pool [layers, pages,
    kv_heads, m, X]`, as rows `[batch, kv_heads, n_pages * m, X]` (zeros where a table entry holds no page)."""
    pages = jax.lax.dynamic_slice_in_dim(table, first_page, n_pages, axis=1)  # [batch, n_pages]
    got = pool.at[layer, pages].get(mode="fill", fill_value=0)  # [batch, n_pages, kv_heads, m, X]
    batch, n, heads, m, x = got.shape
    return jnp.moveaxis(got, 2, 1).reshape(batch, heads, n * m, x)


def read_rows(pool: jax.Array, layer, table: jax.Array, rows: jax.Array) -> jax.Array:
    """Store rows `rows [batch, n]` of one layer of `pool` through the table -> `[batch, kv_heads, n, X]`."""
    page, off = page_of(table, rows, pool.shape[3], no_page(pool))
    got = pool.at[layer, page, :, off].get(mode="fill", fill_value=0)  # [batch, n, kv_heads, X]
    return jnp.moveaxis(got, 1, 2)


def write_rows(pool: jax.Array, table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """Writes `values [layers, batch, kv_heads, n, X]` at store rows `rows [batch, n]` of every layer through the
    table; rows past the table or on an entry that holds no page are dropped."""
    page, off = page_of(table, rows, pool.shape[3], no_page(pool))
    vals = jnp.moveaxis(values, (1, 3), (0, 1)).astype(pool.dtype)  # [batch, n, layers, kv_heads, X]
    return pool.at[:, page, :, off].set(vals, mode="drop")


def unheld_writes(table: jax.Array, rows: jax.Array, page_tokens: int, num_pages: int) -> jax.Array:
    """`[batch]` bool: a token row of `rows [batch, n]` inside the table (rows past it are padding, dropped) falls on
    an entry that holds no page — the host did not give the sequence the page its tokens need."""
    page, _ = page_of(table, rows, page_tokens, num_pages)
    inside = (rows >= 0) & (rows < table.shape[1] * page_tokens)
    return jnp.any(inside & (page == num_pages), axis=1)


def written(x: jax.Array, rows: jax.Array, end: jax.Array) -> jax.Array:
    """`x [batch, kv_heads, n, X]` with rows at or past `end [batch]` zeroed (`rows [batch or 1, n]` their indices)."""
    return jnp.where((rows < end[:, None])[:, None, :, None], x, jnp.zeros((), x.dtype))


@struct.dataclass
class PagedRows:
    """A full-precision tensor (keys or values) read through a block table: `pool [layers, pages, kv_heads,
    page_tokens, head_dim]`, `table [batch, pages_per_sequence]`, rows `[0, end [batch])` written. What
    `attention.stored_tokens` reads a block at a time."""

    pool: jax.Array
    table: jax.Array
    end: jax.Array

    @property
    def page_tokens(self) -> int:
        return self.pool.shape[3]

    @property
    def shape(self) -> tuple:
        """The shape of the contiguous stack it stands for: `[layers, batch, kv_heads, max_tokens, head_dim]`."""
        layers, _, heads, page, dim = self.pool.shape
        return (layers, self.table.shape[0], heads, self.table.shape[1] * page, dim)

    @property
    def dtype(self):
        return self.pool.dtype

    @property
    def block_multiple(self) -> int:
        return self.page_tokens

    def read(self, layer, start, size: int) -> jax.Array:
        """Tokens `[start, start + size)` of one layer (multiples of the page size) `[batch, kv_heads, size, D]`."""
        x = read_pages(self.pool, layer, self.table, start // self.page_tokens, size // self.page_tokens)
        return written(x, start + jnp.arange(size)[None, :], self.end)

    def write_rows(self, rows: jax.Array, values: jax.Array) -> jax.Array:
        """The pool with `values [layers, batch, kv_heads, n, D]` written at token rows `rows [batch, n]`."""
        return write_rows(self.pool, self.table, rows, values)


def scatter_sequence(pool: jax.Array, seq: jax.Array, row, pages: jax.Array) -> jax.Array:
    """Row `row` of a contiguous store `seq [layers, batch, kv_heads, rows, X]` written page by page into `pool
    [layers, pages, kv_heads, m, X]` at `pages [rows // m]` (an entry that holds no page: that block dropped)."""
    x = jax.lax.dynamic_index_in_dim(seq, row, axis=1, keepdims=False)  # [layers, kv_heads, rows, X]
    layers, heads, rows, width = x.shape
    m = pool.shape[3]
    blocks = jnp.moveaxis(x.reshape(layers, heads, rows // m, m, width), 2, 1)  # [layers, rows // m, kv_heads, m, X]
    return pool.at[:, pages[: rows // m]].set(blocks.astype(pool.dtype), mode="drop")


def copy_row(dst: jax.Array, src: jax.Array, row, slot, axis: int) -> jax.Array:
    """`dst` with its row `slot` along `axis` replaced by `src`'s row `row`."""
    part = jax.lax.dynamic_slice_in_dim(src, row, 1, axis).astype(dst.dtype)
    return jax.lax.dynamic_update_slice_in_dim(dst, part, slot, axis)
