"""Cache pytrees: the full-precision cache (the baseline) and the KIVI cache.

Both hold every layer stacked on a leading axis, are preallocated at their final size, and keep one counter,
`length [batch]`. Any number of new tokens a sequence (`num_new [batch]`, 0 allowed) goes onto any cache through one
protocol (docs/design.md §7): inside the model's layer scan a cache is only read — `attend` answers the new tokens'
attention and returns that layer's typed update — and `commit` writes all layers' updates at once after the scan.
Reads inside the loop and writes after it let XLA update the donated buffers in place.

Misuse is never silent: a sequence whose tokens would run past the cache's capacity, or whose token ids lie outside
the vocabulary, gets a bit in `error_flags [batch]` (sticky), and its logits come back NaN (`models.decoder.forward`);
`generate` turns a flag into an error. KIVI's float16 scale overflow is a third bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kivi_jax import attention, layout, paged, quant, rotation, sharding
from kivi_jax.cache8 import Dense8Cache, dense8_cache_bytes
from kivi_jax.config import Dense8Config, KIVIConfig, parse_cache_spec
from kivi_jax.mesh_scope import active_mesh
from kivi_jax.models.config import ModelConfig

from kivi_jax.models.protocol import BAD_TOKEN, PAST_CAPACITY, SCALE_OVERFLOW, CacheCapacityError  # noqa: F401

from kivi_jax.cache_rows import (ATTENTION_IMPLS, capacity_flags, check_impl, heads_first, new_rows,  # noqa: F401
                                 scatter_rows, tree_bytes)


@struct.dataclass
class FullUpdate:
    """One layer's new rows for a full-precision cache (stacked over layers after the scan)."""

    k: jax.Array  # [batch, kv_heads, T, head_dim] after RoPE, the cache's dtype
    v: jax.Array  # [batch, kv_heads, T, head_dim]


@struct.dataclass
class FullCache:
    """Keys and values in the compute dtype: the baseline every KIVI number is compared against."""

    k: jax.Array  # [layers, batch, kv_heads, max_tokens, head_dim]
    v: jax.Array  # [layers, batch, kv_heads, max_tokens, head_dim]
    length: jax.Array  # [batch] int32
    error_flags: jax.Array  # [batch] int32, bits BAD_TOKEN | PAST_CAPACITY
    impl: str = struct.field(pytree_node=False, default="auto")
    # Paged (`pages=P` at create): `k` and `v` are pools `[layers, P, kv_heads, page_tokens, head_dim]` read and
    # written through this block table `[batch, max_tokens // page_tokens]` int32 (entry P: no page).
    table: jax.Array | None = None

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto",
               pages: int | None = None, page_tokens: int = paged.FULL_PAGE_TOKENS) -> "FullCache":
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be positive")
        shape, table = (cfg.num_layers, batch, cfg.num_kv_heads, max_tokens, cfg.head_dim), None
        if pages is not None:
            check_pages(pages)
            if max_tokens % page_tokens:
                raise ValueError(f"max_tokens={max_tokens}: a paged full-precision cache holds whole pages of "
                                 f"{page_tokens} tokens; round it up to {-(-max_tokens // page_tokens) * page_tokens}")
            shape = (cfg.num_layers, pages, cfg.num_kv_heads, page_tokens, cfg.head_dim)
            table = paged.empty_table(batch, max_tokens // page_tokens, pages)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            length=jnp.zeros((batch,), jnp.int32),
            error_flags=jnp.zeros((batch,), jnp.int32),
            impl=check_impl(impl),
            table=table,
        )

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence may hold (a paged cache: its table's pages)."""
        return self.k.shape[3] if self.table is None else self.table.shape[1] * self.k.shape[3]

    @property
    def num_pages(self) -> int | None:
        """Pages in a paged cache's pool (None: contiguous)."""
        return None if self.table is None else self.k.shape[1]

    def with_table(self, table: jax.Array) -> "FullCache":
        """The paged cache reading and writing through `table [batch, max_tokens // page_tokens]`."""
        return self.replace(table=jnp.asarray(table, jnp.int32).reshape(self.table.shape))

    def pages_needed(self, tokens: int) -> int:
        """Pages a sequence of `tokens` tokens holds in a paged cache: every page a token of it is in."""
        return -(-tokens // self.k.shape[3])

    def with_sequence(self, seq: "FullCache", row, slot) -> "FullCache":
        """A paged cache with row `slot` (its table row already set) holding row `row` of the contiguous `seq`:
        its tokens written into the row's pages, its length and flags copied."""
        pages = self.table[slot]
        return self.replace(k=paged.scatter_sequence(self.k, seq.k, row, pages),
                            v=paged.scatter_sequence(self.v, seq.v, row, pages),
                            length=paged.copy_row(self.length, seq.length, row, slot, 0),
                            error_flags=paged.copy_row(self.error_flags, seq.error_flags, row, slot, 0))

    def stores(self) -> tuple:
        """Keys and values as attention reads them: the stacks, or the pools through the table (rows past each
        sequence's length read as zeros)."""
        if self.table is None:
            return self.k, self.v
        return paged.PagedRows(self.k, self.table, self.length), paged.PagedRows(self.v, self.table, self.length)

    @property
    def nbytes(self) -> int:
        return tree_bytes(self)

    @property
    def spec(self) -> str:
        return "full"

    @property
    def dtype(self):
        """The compute dtype the cache holds keys and values in."""
        return self.k.dtype

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        """New tokens' attention over this layer (keys rotated here, then stored after RoPE) and their rows."""
        k = rope(k, positions).astype(self.k.dtype)
        v = v.astype(self.v.dtype)
        k_cache, v_cache = self.stores()
        out = attention.attend_full(self.impl, q, positions, k_cache, v_cache, layer, self.length, k, v, num_new,
                                    window, softcap)
        return out, FullUpdate(heads_first(k), heads_first(v))

    def commit(self, updates: FullUpdate, num_new: jax.Array) -> "FullCache":
        num_new = num_new.astype(jnp.int32)
        rows = new_rows(self.length, num_new, updates.k.shape[3], self.max_tokens)
        flags = capacity_flags(self.length, num_new, self.max_tokens)
        if self.table is None:
            k, v = scatter_rows(self.k, rows, updates.k), scatter_rows(self.v, rows, updates.v)
        else:
            k_pages, v_pages = self.stores()
            k, v = k_pages.write_rows(rows, updates.k), v_pages.write_rows(rows, updates.v)
            unheld = paged.unheld_writes(self.table, rows, k_pages.page_tokens, self.num_pages)
            flags = flags | jnp.where(unheld, PAST_CAPACITY, 0)
        return self.replace(k=k, v=v, length=self.length + num_new, error_flags=self.error_flags | flags)

    def attending(self, live: jax.Array) -> "FullCache":
        """The cache as a step over only the `live [batch]` rows attends to it (the others empty)."""
        return self.replace(length=jnp.where(live, self.length, 0))

    def grown(self, max_tokens: int) -> "FullCache":
        """The same contents with room for `max_tokens` tokens (a new allocation; same numbers)."""
        if self.table is not None:  # more table entries, holding no page yet
            page = self.k.shape[3]
            extra = paged.empty_table(self.table.shape[0], -(-max_tokens // page) - self.table.shape[1], self.num_pages)
            return self.replace(table=jnp.concatenate([self.table, extra], axis=1))
        pad = [(0, 0)] * 3 + [(0, max_tokens - self.max_tokens), (0, 0)]
        return self.replace(k=jnp.pad(self.k, pad), v=jnp.pad(self.v, pad))


# ---------------------------------------------------------------------------------------------------------------------
# KIVI


@struct.dataclass
class Quantized:
    """Codes, scales and mins of some tokens of one store (what `QuantStore.quantize` gives)."""

    codes: jax.Array  # [..., tokens, head_dim * bits / 8] uint8
    scale: jax.Array  # [..., groups along tokens or tokens, head_dim or groups along channels]
    mn: jax.Array

    def bad(self, groups: jax.Array) -> jax.Array:
        """`[batch]`: a scale or min is not finite in a group selected by `groups [batch, scale rows]`."""
        finite = jnp.isfinite(self.scale.astype(jnp.float32)) & jnp.isfinite(self.mn.astype(jnp.float32))
        return jnp.any(~jnp.all(finite, axis=-1) & groups[:, None, :], axis=(1, 2))


@struct.dataclass
class QuantStore:
    """One quantized tensor (keys or values) of the KIVI cache, for all layers or for one.

    `axis="channel"`: groups of G tokens per channel, quantized in whole R-token blocks (scale `[..., tokens // G, D]`).
    `axis="token"`: groups of G channels per token, quantized one token at a time (scale `[..., tokens, D // G]`).
    `levels`: the codebook of non-uniform codes (`kivi_jax.codebook`), None for uniform ones.
    """

    codes: jax.Array  # [(layers,) batch, kv_heads, max_tokens, head_dim * bits / 8] uint8, planar-packed
    scale: jax.Array  # [(layers,) batch, kv_heads, groups along tokens or tokens, head_dim or groups along channels]
    mn: jax.Array  # like scale
    bits: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    axis: str = struct.field(pytree_node=False)
    levels: tuple | None = struct.field(pytree_node=False, default=None)
    paged = False  # a PagedStore reads through a block table

    @classmethod
    def zeros(cls, lead: tuple, max_tokens: int, head_dim: int, bits: int, group_size: int, axis: str, scale_dtype,
              levels: tuple | None = None):
        if axis == "channel":
            scale_shape = lead + (max_tokens // group_size, head_dim)
        else:
            scale_shape = lead + (max_tokens, head_dim // group_size)
        return cls(
            codes=jnp.zeros(lead + (max_tokens, quant.packed_width(bits, head_dim)), jnp.uint8),
            scale=jnp.zeros(scale_shape, scale_dtype),
            mn=jnp.zeros(scale_shape, scale_dtype),
            bits=bits,
            group_size=group_size,
            axis=axis,
            levels=quant.check_levels(levels, bits),
        )

    @property
    def max_tokens(self) -> int:
        return self.codes.shape[-2]

    @property
    def kv_heads(self) -> int:
        return self.codes.shape[-3]

    @property
    def block_multiple(self) -> int:
        """Attention's blocks of this store are a multiple of this many tokens (whole groups)."""
        return self.group_size

    def quantized_end(self, length: jax.Array, residual: int) -> jax.Array:
        """Tokens `[0, end)` are quantized once `length` tokens are in (`layout.quantized_end` on this axis)."""
        return layout.quantized_end(self.axis, length, residual)

    def quantize(self, x: jax.Array) -> Quantized:
        """`x [..., tokens, head_dim]` -> codes, scales and mins on this store's axis."""
        fn = quant.quantize_per_channel if self.axis == "channel" else quant.quantize_per_token
        return Quantized(*fn(x, self.bits, self.group_size, self.scale.dtype, self.levels))

    def append_start(self, length: jax.Array, residual: int) -> jax.Array:
        """`[batch]`: the first token position an append onto `length` tokens may quantize: the token leaving the ring
        (per-token, `length - R`) or the current partial R-block (per-channel, `(length // R) * R`)."""
        return length - residual if self.axis == "token" else layout.quantized_end("channel", length, residual)

    def append_positions(self, length: jax.Array, tokens: int, residual: int) -> jax.Array:
        """`[batch, n]`: the token positions an append of up to `tokens` new tokens onto `length` may quantize: `n =
        tokens` leaving the ring (per-token) or the R-blocks that many tokens can complete (per-channel). Which of them
        are written follows from the new length (`write_mask`); positions below 0 or past the new tokens never are."""
        n = tokens if self.axis == "token" else layout.appended_blocks(tokens, residual) * residual
        return self.append_start(length, residual)[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]

    def write_mask(self, positions: jax.Array, length: jax.Array, new_length: jax.Array, residual: int) -> jax.Array:
        """`[batch, n]`: positions that become quantized when `length` grows to `new_length`."""
        old = self.quantized_end(length, residual)[:, None]
        new = self.quantized_end(new_length, residual)[:, None]
        return (positions >= old) & (positions < new)

    def group_mask(self, token_mask: jax.Array) -> jax.Array:
        """Per-token masks `[batch, n]` -> per scale row (one per G tokens for per-channel; rows are whole groups)."""
        return token_mask if self.axis == "token" else token_mask[:, :: self.group_size]

    def dequantize(self) -> jax.Array:
        """Every token of a one-layer store in float32 `[batch, kv_heads, max_tokens, head_dim]` (references, tests)."""
        fn = quant.dequantize_per_channel if self.axis == "channel" else quant.dequantize_per_token
        return fn(self.codes, self.scale, self.mn, self.bits, self.group_size, self.levels)

    def token_slice(self, start: jax.Array, size: int, layer=None) -> "QuantStore":
        """Tokens `[start, start + size)` of one layer (`layer` of a stacked store, or all of a one-layer store) as a
        one-layer store; `start` a multiple of G for per-channel. Only the slice is read."""
        codes = attention.layer_tokens(self.codes, layer, start, size)
        if self.axis == "channel":
            g = self.group_size
            scale = attention.layer_tokens(self.scale, layer, start // g, size // g)
            mn = attention.layer_tokens(self.mn, layer, start // g, size // g)
        else:
            scale = attention.layer_tokens(self.scale, layer, start, size)
            mn = attention.layer_tokens(self.mn, layer, start, size)
        return self.replace(codes=codes, scale=scale, mn=mn)

    def gather_rows(self, layer, rows: jax.Array) -> "QuantStore":
        """Token rows `[batch, n]` (whole groups for per-channel) of one layer of a stacked store, as a one-layer store."""
        srows = self.scale_rows(rows)
        return self.replace(
            codes=attention.gather_tokens(self.codes, layer, rows),
            scale=attention.gather_tokens(self.scale, layer, srows),
            mn=attention.gather_tokens(self.mn, layer, srows),
        )

    def scale_rows(self, rows: jax.Array) -> jax.Array:
        """Scale/min rows for token rows `[batch, n]` (one per G tokens for per-channel; rows are whole groups)."""
        if self.axis == "token":
            return rows
        g = self.group_size
        return rows[:, ::g] // g

    def write_rows(self, rows: jax.Array, q: Quantized) -> "QuantStore":
        """Writes quantized rows `q` (stacked over layers) at token rows `rows [batch, n]` into every layer; rows at
        `max_tokens` or beyond are dropped."""
        srows = self.scale_rows(rows)
        return self.replace(
            codes=scatter_rows(self.codes, rows, q.codes),
            scale=scatter_rows(self.scale, srows, q.scale),
            mn=scatter_rows(self.mn, srows, q.mn),
        )

    def grown(self, max_tokens: int) -> "QuantStore":
        """The same store with room for `max_tokens` tokens (zeros appended along the token axis)."""
        extra = max_tokens - self.max_tokens
        g = self.group_size if self.axis == "channel" else 1
        pad = lambda x, n: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, n), (0, 0)])
        return self.replace(codes=pad(self.codes, extra), scale=pad(self.scale, extra // g), mn=pad(self.mn, extra // g))


@struct.dataclass
class PagedStore(QuantStore):
    """A KIVI store (keys or values) read through a block table: `codes`, `scale`, `mn` are the pool (`[layers, pages,
    kv_heads, page rows, X]`, a page one R-token block), `table [batch, pages_per_sequence]` int32, and `end [batch]`
    the rows `[0, end)` each sequence has quantized (the rest read as zeros). Built by the cache for a step (never a
    leaf of it); what attention reads of it are plain one-layer `QuantStore`s, bit-identical to a contiguous cache's."""

    table: jax.Array = None
    end: jax.Array = None
    paged = True

    @classmethod
    def of(cls, pool: QuantStore, table: jax.Array, end: jax.Array) -> "PagedStore":
        return cls(pool.codes, pool.scale, pool.mn, pool.bits, pool.group_size, pool.axis, pool.levels, table, end)

    @property
    def page_tokens(self) -> int:
        return self.codes.shape[-2]

    @property
    def max_tokens(self) -> int:
        return self.table.shape[1] * self.page_tokens

    @property
    def block_multiple(self) -> int:
        return self.page_tokens

    def pool(self) -> QuantStore:
        return QuantStore(self.codes, self.scale, self.mn, self.bits, self.group_size, self.axis, self.levels)

    def plain(self, codes, scale, mn) -> QuantStore:
        return QuantStore(codes, scale, mn, self.bits, self.group_size, self.axis, self.levels)

    def token_slice(self, start, size: int, layer=None) -> QuantStore:
        """Tokens `[start, start + size)` of one layer (both multiples of the page size) as a one-layer store."""
        page, n = start // self.page_tokens, size // self.page_tokens
        g = self.group_size if self.axis == "channel" else 1
        codes = paged.read_pages(self.codes, layer, self.table, page, n)  # finite whatever they hold: not masked
        srows = start // g + jnp.arange(size // g)[None, :]
        end = self.end // g
        scale = paged.written(paged.read_pages(self.scale, layer, self.table, page, n), srows, end)
        mn = paged.written(paged.read_pages(self.mn, layer, self.table, page, n), srows, end)
        return self.plain(codes, scale, mn)

    def gather_rows(self, layer, rows: jax.Array) -> QuantStore:
        """Token rows `[batch, n]` (whole groups for per-channel) of one layer as a one-layer store."""
        srows = self.scale_rows(rows)
        end = self.end // (self.group_size if self.axis == "channel" else 1)
        return self.plain(paged.read_rows(self.codes, layer, self.table, rows),
                          paged.written(paged.read_rows(self.scale, layer, self.table, srows), srows, end),
                          paged.written(paged.read_rows(self.mn, layer, self.table, srows), srows, end))

    def write_rows(self, rows: jax.Array, q) -> "PagedStore":
        """Writes quantized rows `q` (stacked over layers) at token rows `rows [batch, n]` through the table."""
        srows = self.scale_rows(rows)
        return self.replace(codes=paged.write_rows(self.codes, self.table, rows, q.codes),
                            scale=paged.write_rows(self.scale, self.table, srows, q.scale),
                            mn=paged.write_rows(self.mn, self.table, srows, q.mn))



@struct.dataclass
class KIVIUpdate:
    """One layer's writes for a KIVI cache (stacked over layers after the scan)."""

    k: Quantized  # the key store's candidate rows (`QuantStore.append_positions`)
    v: Quantized  # the value store's
    k_new: jax.Array  # [batch, kv_heads, T, head_dim]: the new tokens as stored, for their ring slots
    v_new: jax.Array
    bad: jax.Array  # [batch] bool: a written scale or min overflowed
    k_sink: jax.Array | None = None  # [batch, kv_heads, min(T, S), head_dim]: the first new tokens, for sink rows
    v_sink: jax.Array | None = None


@struct.dataclass
class KIVICache:
    """The KIVI cache of docs/design.md §2: quantized keys and values, a full-precision residual ring, one length counter.

    Keys `[0, k.quantized_end)` and values `[0, v.quantized_end)` are read from the quantized stores; ring slot `t % R`
    holds token t's key and value for the newest R tokens. With `config.sinks = S`, tokens `[0, S)` are read from
    the full-precision sinks instead (their codes are written but never read, and never widen a group's range). With
    `config.pre_rope` every stored key (codes, ring, sinks) is the key before RoPE.
    """

    k: QuantStore
    v: QuantStore
    k_ring: jax.Array  # [layers, batch, kv_heads, R, head_dim] compute dtype
    v_ring: jax.Array  # [layers, batch, kv_heads, R, head_dim] compute dtype
    length: jax.Array  # [batch] int32
    error_flags: jax.Array  # [batch] int32, bits BAD_TOKEN | PAST_CAPACITY | SCALE_OVERFLOW
    config: KIVIConfig = struct.field(pytree_node=False)
    impl: str = struct.field(pytree_node=False, default="auto")
    k_sink: jax.Array | None = None  # [layers, batch, kv_heads, S, head_dim] compute dtype (None without sinks)
    v_sink: jax.Array | None = None
    # Per-layer bits (`config.first_layers = n`): layers [0, n) live in `first`, a KIVI cache of n layers at the first
    # layers' bits, and this cache's stores hold layers [n, L). `first` keeps its own copy of length and flags; the
    # top level's are the ones read.
    first: "KIVICache | None" = None
    # Paged (`pages=P` at create): `k` and `v` are pools of P pages of one R-token block each (their batch axis is
    # the page axis, their token axis R), read and written through this block table `[batch, max_tokens // R]` int32
    # (entry P: no page; the host hands pages out, `with_table`). Rings, sinks and counters stay a row a sequence.
    table: jax.Array | None = None
    compute: str = struct.field(pytree_node=False, default="")  # the compute dtype where the ring's differs (-ringf16)

    @classmethod
    def create(
        cls, cfg: ModelConfig, kivi: KIVIConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto",
        pages: int | None = None,
    ) -> "KIVICache":
        if kivi.first_layers:
            n = kivi.first_layers
            if n >= cfg.num_layers:
                raise ValueError(f"{kivi.spec} sets the first {n} layers apart, but the model has {cfg.num_layers}; "
                                 f"choose fewer than {cfg.num_layers} (or plain k{kivi.first_k_bits}v{kivi.first_v_bits})")
            first = cls.create(dataclasses.replace(cfg, num_layers=n), kivi.first(), batch, max_tokens, dtype, impl,
                               pages)
            rest = cls.create(dataclasses.replace(cfg, num_layers=cfg.num_layers - n), kivi.rest(), batch, max_tokens,
                              dtype, impl, pages)
            return rest.replace(config=kivi, first=first)
        kivi.check_shapes(cfg.head_dim, max_tokens)
        lead = (cfg.num_layers, batch, cfg.num_kv_heads)
        sd = quant.SCALE_DTYPES[kivi.scale_dtype]
        d, r = cfg.head_dim, kivi.residual_length
        sink = (lambda: jnp.zeros(lead + (kivi.sinks, d), dtype)) if kivi.sinks else (lambda: None)
        store_lead, store_tokens, table = lead, max_tokens, None
        if pages is not None:  # pools of R-token pages and a table that holds none of them yet
            check_pages(pages)
            store_lead, store_tokens = (cfg.num_layers, pages, cfg.num_kv_heads), r
            table = paged.empty_table(batch, max_tokens // r, pages)
        return cls(
            k=QuantStore.zeros(store_lead, store_tokens, d, kivi.k_bits, kivi.store_group(kivi.key_axis, d),
                               kivi.key_axis, sd, kivi.levels("key")),
            v=QuantStore.zeros(store_lead, store_tokens, d, kivi.v_bits, kivi.store_group(kivi.value_axis, d),
                               kivi.value_axis, sd, kivi.levels("value")),
            k_ring=jnp.zeros(lead + (r, d), kivi.ring_dtype or dtype),
            v_ring=jnp.zeros(lead + (r, d), kivi.ring_dtype or dtype),
            length=jnp.zeros((batch,), jnp.int32),
            error_flags=jnp.zeros((batch,), jnp.int32),
            config=kivi,
            compute=jnp.dtype(dtype).name if kivi.ring_dtype else "",
            impl=check_impl(impl),
            k_sink=sink(),
            v_sink=sink(),
            table=table,
        )

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence may hold (a paged cache: its table's pages)."""
        return self.k.max_tokens if self.table is None else self.table.shape[1] * self.residual

    @property
    def num_pages(self) -> int | None:
        """Pages in a paged cache's pool (None: contiguous)."""
        return None if self.table is None else self.k.codes.shape[1]

    def with_table(self, table: jax.Array) -> "KIVICache":
        """The paged cache reading and writing through `table [batch, max_tokens // R]` (the host's allocation)."""
        first = None if self.first is None else self.first.with_table(table)
        return self.replace(table=jnp.asarray(table, jnp.int32).reshape(self.table.shape), first=first)

    def pages_needed(self, tokens: int) -> int:
        """Pages a sequence of `tokens` tokens holds in a paged cache: its whole R-token blocks (the ring holds the
        rest)."""
        return tokens // self.residual

    def with_sequence(self, seq: "KIVICache", row, slot) -> "KIVICache":
        """A paged cache with row `slot` (its table row already set) holding row `row` of the contiguous `seq` of the
        same spec: its quantized blocks written into the row's pages, its ring, sinks, length and flags copied."""
        pages = self.table[slot]
        stores = {}
        for name in ("k", "v"):
            pool, src = getattr(self, name), getattr(seq, name)
            stores[name] = pool.replace(**{leaf: paged.scatter_sequence(getattr(pool, leaf), getattr(src, leaf), row,
                                                                        pages)
                                           for leaf in ("codes", "scale", "mn")})
        rows = {leaf: paged.copy_row(getattr(self, leaf), getattr(seq, leaf), row, slot, 1)
                for leaf in ("k_ring", "v_ring", "k_sink", "v_sink") if getattr(self, leaf) is not None}
        first = None if self.first is None else self.first.with_sequence(seq.first, row, slot)
        return self.replace(**stores, **rows, first=first,
                            length=paged.copy_row(self.length, seq.length, row, slot, 0),
                            error_flags=paged.copy_row(self.error_flags, seq.error_flags, row, slot, 0))

    def stores(self) -> tuple:
        """The key and value stores as attention reads them: the pools through the table for a paged cache (rows
        past what each sequence has quantized read as zeros)."""
        if self.table is None:
            return self.k, self.v
        r = self.residual
        return tuple(PagedStore.of(s, self.table, s.quantized_end(self.length, r)) for s in (self.k, self.v))

    @property
    def value_basis(self) -> str:
        """The basis the params must produce values in (`models.decoder.check_value_basis`)."""
        return "hadamard" if self.config.rotate_values else ""

    @property
    def residual(self) -> int:
        return self.config.residual_length

    @property
    def nbytes(self) -> int:
        return tree_bytes(self)

    @property
    def spec(self) -> str:
        return self.config.spec

    @property
    def dtype(self):
        """The compute dtype: attention's full-precision part, the sinks, and the ring unless it has its own."""
        return jnp.dtype(self.compute) if self.compute else self.k_ring.dtype

    @property
    def overflow(self) -> jax.Array:
        """`[batch]` bool: a stored scale or min was not finite (see KIVIConfig.scale_dtype)."""
        return (self.error_flags & SCALE_OVERFLOW) != 0

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        """New tokens' attention over this layer as it is stored (KIVI's order: the new tokens themselves in full
        precision), and the update that appends them as one-at-a-time appends would. With per-layer bits the layer
        is answered by the part that holds it (a `lax.cond` on the layer index; the other part's update is zeros)."""
        if self.first is None:
            return self.attend_here(layer, q, k, v, positions, rope, num_new, window, softcap)
        n = self.config.first_layers
        args = (q, k, v, positions, rope, num_new, window, softcap)
        in_first = lambda: self.first.attend_here(jnp.minimum(layer, n - 1), *args)
        in_rest = lambda: self.attend_here(jnp.maximum(layer - n, 0), *args)
        zeros = lambda f: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(f)[1])

        def branch_first():
            out, up = in_first()
            return out, (up, zeros(in_rest))

        def branch_rest():
            out, up = in_rest()
            return out, (zeros(in_first), up)

        return jax.lax.cond(layer < n, branch_first, branch_rest)

    def attend_here(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        """`attend` over this cache's own stores (`layer` indexes them)."""
        kivi, dtype = self.config, self.dtype
        k_rot = rope(k, positions).astype(dtype)  # the new tokens attend to each other after RoPE
        if kivi.rotate_keys:  # q . k unchanged: both in the basis H
            basis = rotation.key_basis(k.shape[-1], dtype)
            q, k_rot = (q @ basis.astype(q.dtype)), k_rot @ basis
        stored = k.astype(dtype) if kivi.pre_rope else k_rot
        v = v.astype(dtype)  # the new tokens attend in the compute dtype; the ring stores them in its own
        sinks = None if self.k_sink is None else (self.k_sink, self.v_sink)
        k_store, v_store = self.stores()
        out = attention.attend_kivi(self.impl, q, positions, k_store, v_store, layer, self.k_ring, self.v_ring,
                                    self.length, k_rot, v, num_new, window, sinks=sinks,
                                    inv_freq=rope.inv_freq if kivi.pre_rope else None,
                                    softcap=softcap)  # stacks read in place
        return out, self.append_update(self.k_ring, self.v_ring, heads_first(stored), heads_first(v), num_new, layer)

    def append_update(self, k_ring: jax.Array, v_ring: jax.Array, k: jax.Array, v: jax.Array,
                      num_new: jax.Array, layer: jax.Array | None = None) -> KIVIUpdate:
        """One layer's writes when new tokens `k, v [batch, kv_heads, T, head_dim]` (`num_new [batch]` real; keys as
        stored, before RoPE for a pre-RoPE cache) arrive at `length`: the candidate rows of each store quantized from
        the ring and the new tokens, the new ring, and the first new tokens for the sink rows. The rings are one
        layer's, or (`layer` given) the stacks, read at that layer (only the rows quantized: slicing a layer out of
        the stack first copied it, a seventh of a 32-row decode step).

        Every quantized group is computed from the same values in the same order as one-token appends would, so the
        stores come out bit-identical whatever the chunking (tests/test_chunked.py).
        """
        r, tokens = self.residual, k.shape[2]
        length, new_length = self.length, self.length + num_new.astype(jnp.int32)
        update, bad = {}, jnp.zeros(length.shape, bool)
        for name, store, ring, new in (("k", self.k, k_ring, k), ("v", self.v, v_ring, v)):
            pos = store.append_positions(length, tokens, r)  # [batch, n]
            mask = store.write_mask(pos, length, new_length, r)

            def quantize(store=store, pos=pos, ring=ring, new=new):
                return store.quantize(without_sinks(store, pos, tokens_at(sink_stand_in(store, pos, self.config.sinks),
                                                                          ring, new, length, layer), self.config.sinks))

            # Only when some sequence quantizes a row now: a decode step completes a key block once in R steps, and
            # quantizing a whole R-block every step (then dropping it) was a third of a SmolLM2 step at batch 8.
            # Otherwise zeros, which `commit` drops (no row is in the write mask).
            nothing = lambda: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(quantize))
            q = jax.lax.cond(jnp.any(mask), quantize, nothing)
            bad = bad | q.bad(store.group_mask(mask))
            update[name] = q
        n = min(self.config.sinks, tokens)  # the new tokens that may land in a sink row
        return KIVIUpdate(update["k"], update["v"], k, v, bad, *((k[:, :, :n], v[:, :, :n]) if n else ()))

    def commit(self, updates: KIVIUpdate, num_new: jax.Array) -> "KIVICache":
        """Writes every layer's update (stacked on a leading layer axis) and advances `length` by `num_new`."""
        if self.first is not None:  # (first part's updates, the rest's), each stacked over all layers
            n = self.config.first_layers
            first = self.first.commit(jax.tree_util.tree_map(lambda x: x[:n], updates[0]), num_new)
            rest = self.replace(first=None).commit(jax.tree_util.tree_map(lambda x: x[n:], updates[1]), num_new)
            return rest.replace(first=first, error_flags=rest.error_flags | first.error_flags)
        r = self.residual
        num_new = num_new.astype(jnp.int32)
        length, new_length = self.length, self.length + num_new
        stores, unheld = {}, jnp.zeros(length.shape, bool)
        for name, store in zip(("k", "v"), self.stores()):
            q = getattr(updates, name)  # rows for append_positions: as many as the update carries
            pos = store.append_start(length, r)[:, None] + jnp.arange(q.codes.shape[3], dtype=jnp.int32)[None, :]
            mask = store.write_mask(pos, length, new_length, r)
            rows = jnp.where(mask, pos, self.max_tokens)
            # Skipped when no row is written (a decode step writes key rows once in R steps): even a scatter whose
            # rows are all dropped walks every update element
            store = jax.lax.cond(jnp.any(mask), lambda store=store, rows=rows, q=q: store.write_rows(rows, q),
                                 lambda store=store: store)
            stores[name] = store if self.table is None else store.pool()
            if self.table is not None:
                unheld = unheld | paged.unheld_writes(self.table, rows, r, self.num_pages)
        flags = capacity_flags(length, num_new, self.max_tokens) | jnp.where(unheld, PAST_CAPACITY, 0)
        flags = flags | jnp.where(jnp.any(updates.bad, axis=0), SCALE_OVERFLOW, 0).astype(jnp.int32)
        # The ring: the new tokens among the newest R after the append go to their slots, in place (a decode step
        # writes one row a layer, not the whole ring)
        slots = layout.ring_slots(length, num_new, updates.k_new.shape[3], r)  # [batch, T]
        sinks = {}
        if self.k_sink is not None:  # rows past S are dropped
            rows = new_rows(length, num_new, updates.k_sink.shape[3], self.config.sinks)
            sinks = dict(k_sink=scatter_rows(self.k_sink, rows, updates.k_sink),
                         v_sink=scatter_rows(self.v_sink, rows, updates.v_sink))
        return self.replace(
            k=stores["k"],
            v=stores["v"],
            k_ring=scatter_rows(self.k_ring, slots, updates.k_new),
            v_ring=scatter_rows(self.v_ring, slots, updates.v_new),
            length=new_length,
            error_flags=self.error_flags | flags,
            **sinks,
        )

    def attending(self, live: jax.Array) -> "KIVICache":
        """The cache as a step over only the `live [batch]` rows attends to it (the others empty, their ring and
        sinks masked with them; the per-layer-bits part alike)."""
        first = None if self.first is None else self.first.attending(live)
        return self.replace(length=jnp.where(live, self.length, 0), first=first)

    def grown(self, max_tokens: int) -> "KIVICache":
        """The same contents with room for `max_tokens` tokens (a new allocation; same numbers)."""
        self.config.check_shapes(self.k_ring.shape[-1], max_tokens)
        first = None if self.first is None else self.first.grown(max_tokens)
        if self.table is not None:  # more table entries, holding no page yet
            extra = paged.empty_table(self.table.shape[0], max_tokens // self.residual - self.table.shape[1],
                                      self.num_pages)
            return self.replace(table=jnp.concatenate([self.table, extra], axis=1), first=first)
        return self.replace(k=self.k.grown(max_tokens), v=self.v.grown(max_tokens), first=first)


def check_pages(pages) -> None:
    if not isinstance(pages, int) or isinstance(pages, bool) or pages <= 0:
        raise ValueError(f"pages={pages!r}: a paged cache's pool needs a positive whole number of pages")


def tokens_at(pos: jax.Array, ring: jax.Array, new: jax.Array, length: jax.Array, layer=None) -> jax.Array:
    """`[batch, kv_heads, n, head_dim]`: the key or value of token `pos [batch, n]` from one layer's ring (`pos <
    length`: slot `pos % R`; with `layer`, the stacked rings `[layers, ...]` read at it) or the new tokens `new
    [batch, kv_heads, T, head_dim]` (`pos >= length`). Positions outside both give some entry of them (never
    written)."""
    if layer is not None and active_mesh() is not None:
        ring, layer = ring[layer], None  # SPMD splits a slice by heads, but gathers the heads of an indexed read
    r, tokens = ring.shape[-2], new.shape[2]
    is_new = (pos >= length[:, None])[:, None, :, None]
    # two gathers of the n rows and a select (concatenating ring and new tokens first copied the whole ring)
    if layer is None:
        from_ring = jnp.take_along_axis(ring, jnp.mod(pos, r)[:, None, :, None], axis=2)
    else:
        batch, heads = ring.shape[1], ring.shape[2]
        from_ring = ring[layer, jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None],
                         jnp.mod(pos, r)[:, None, :]]  # [batch, kv_heads, n, head_dim]
    new_idx = jnp.clip(pos - length[:, None], 0, tokens - 1)
    from_new = jnp.take_along_axis(new.astype(ring.dtype), new_idx[:, None, :, None], axis=2)
    return jnp.where(is_new, from_new, from_ring)


def sink_stand_in(store: QuantStore, pos: jax.Array, sinks: int) -> jax.Array:
    """Positions `[batch, n]` to quantize in place of `pos`: a sink token of a per-channel store (read from the sinks,
    never from its codes) stands in as the first non-sink token of its G-token group, or the group's last token
    when the whole group is sinks, so it never widens the group's range; the group is complete when it is
    quantized, so that token is in the ring or among the new ones."""
    if not sinks or store.axis != "channel":
        return pos
    g = store.group_size
    return jnp.where(pos < sinks, jnp.minimum(sinks, (pos // g) * g + g - 1), pos)


def without_sinks(store: QuantStore, pos: jax.Array, x: jax.Array, sinks: int) -> jax.Array:
    """`x [batch, kv_heads, n, head_dim]` with a per-token store's sink tokens zeroed (their own group: codes never
    read, and a huge sink value cannot overflow a scale)."""
    if not sinks or store.axis != "token":
        return x
    return jnp.where((pos < sinks)[:, None, :, None], 0, x).astype(x.dtype)


def kivi_cache_bytes(
    cfg: ModelConfig, kivi: KIVIConfig, batch: int, max_tokens: int, compute_bytes: int, pages: int | None = None
) -> dict[str, int]:
    """docs/design.md §2's byte formula for a KIVI cache, by part (codes, scales and mins, ring, sinks,
    bookkeeping); per-layer bits add the first layers' part (with its own copy of the bookkeeping). `pages`: a paged
    cache, whose codes, scales and mins are a pool of that many R-token pages and whose bookkeeping adds the block
    table (`[batch, max_tokens // R]` int32)."""
    if kivi.first_layers:
        n = kivi.first_layers
        first = kivi_cache_bytes(dataclasses.replace(cfg, num_layers=n), kivi.first(), batch, max_tokens,
                                 compute_bytes, pages)
        rest = kivi_cache_bytes(dataclasses.replace(cfg, num_layers=cfg.num_layers - n), kivi.rest(), batch,
                                max_tokens, compute_bytes, pages)
        return {name: first[name] + rest[name] for name in first}
    lbh = cfg.num_layers * batch * cfg.num_kv_heads
    d, r = cfg.head_dim, kivi.residual_length
    ring_bytes = jnp.dtype(kivi.ring_dtype).itemsize if kivi.ring_dtype else compute_bytes
    # the quantized part holds `stored` tokens for each of `rows` (sequences, or pages of R tokens)
    rows, stored = (batch, max_tokens) if pages is None else (pages, r)
    lrh = cfg.num_layers * rows * cfg.num_kv_heads
    scale_bytes = jnp.dtype(quant.SCALE_DTYPES[kivi.scale_dtype]).itemsize
    # (scale, min) per group: G tokens x 1 channel (per-channel) or 1 token x channel_group channels (per-token)
    groups = sum(stored * d // kivi.store_group(axis, d) for axis in (kivi.key_axis, kivi.value_axis))
    table = 0 if pages is None else batch * (max_tokens // r) * 4
    parts = {
        "codes": lrh * stored * d * (kivi.k_bits + kivi.v_bits) // 8,
        "scales": 2 * lrh * groups * scale_bytes,  # (scale, min) for keys and values
        "ring": 2 * lbh * r * d * ring_bytes,
        "sinks": 2 * lbh * kivi.sinks * d * compute_bytes,
        "bookkeeping": batch * (4 + 4) + table,  # length and error_flags, int32 (and the block table)
    }
    parts["total"] = sum(parts.values())
    return parts


def full_cache_bytes(cfg: ModelConfig, batch: int, max_tokens: int, compute_bytes: int,
                     pages: int | None = None) -> int:
    """Bytes of a full-precision cache: keys and values in the compute dtype plus length and error flags (`pages`: a
    pool of that many `FULL_PAGE_TOKENS`-token pages plus the block table)."""
    if pages is None:
        return 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_tokens * cfg.head_dim * compute_bytes + 8 * batch
    page = paged.FULL_PAGE_TOKENS
    return (2 * cfg.num_layers * pages * cfg.num_kv_heads * page * cfg.head_dim * compute_bytes + 8 * batch
            + 4 * batch * (max_tokens // page))


def make_cache(spec, cfg: ModelConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto", mesh=None,
               pages: int | None = None):
    """A fresh cache for a parsed or unparsed spec ('full', 'kivi2', 'k4v2-g64-r128', 'int8', a KIVIConfig); with
    `mesh` (a Mesh or 'data=2,model=4') allocated sharded by kivi_jax.sharding's table; with `pages` a paged cache
    (a pool of that many pages, `batch` block tables of `max_tokens` tokens each: docs/design.md §12; on a mesh of
    data=1 only, its pool's heads split over model and every page on every device)."""
    spec = parse_cache_spec(spec)
    if pages is not None and isinstance(spec, Dense8Config):
        raise ValueError(f"a paged cache is not offered for {spec.spec} yet: use the full-precision or a KIVI spec, "
                         "or drop pages")
    if mesh is not None:
        if pages is not None:  # the pool's heads split over model, its pages on every device (data=1 only)
            sharding.check_paged_mesh(sharding.resolve_mesh(mesh))
        return sharding.make_cache(lambda: make_cache(spec, cfg, batch, max_tokens, dtype, impl, pages=pages), mesh)
    if isinstance(spec, KIVIConfig):
        return KIVICache.create(cfg, spec, batch, max_tokens, dtype, impl, pages)
    if isinstance(spec, Dense8Config):
        return Dense8Cache.create(cfg, spec, batch, max_tokens, dtype, impl)
    return FullCache.create(cfg, batch, max_tokens, dtype, impl, pages)


def cache_bytes(spec, cfg: ModelConfig, batch: int, max_tokens: int, compute_bytes: int,
                pages: int | None = None) -> int:
    """The byte formula (docs/design.md §2) of a cache of any spec (`pages`: paged, §12)."""
    spec = parse_cache_spec(spec)
    if isinstance(spec, KIVIConfig):
        return kivi_cache_bytes(cfg, spec, batch, max_tokens, compute_bytes, pages)["total"]
    if isinstance(spec, Dense8Config):
        return dense8_cache_bytes(cfg, spec, batch, max_tokens)["total"]
    return full_cache_bytes(cfg, batch, max_tokens, compute_bytes, pages)
