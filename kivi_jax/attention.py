"""Attention over a cache for any number of new tokens (docs/design.md §3, §7): the blockwise XLA path and the
dispatch that picks a decode kernel.

One path serves every case. `T >= 1` new tokens a sequence (right-padded, `num_new [batch]` real) at positions
`length + [0, T)` attend to what the cache holds *as stored* (quantized tokens from their codes, the ring in full
precision) and to themselves, causally, in full precision. A prefill is the empty-cache case; decode is `T = 1`.
Queries are grouped by kv head (GQA: query head `h * n_rep + r` reads kv head `h`) into rows `t * n_rep + r`, and
every segment (quantized blocks, the ring, the new tokens) updates one online softmax per row, a block of tokens at
a time: memory is bounded by the chunk and block sizes, and no dequantized cache is ever built.

Dispatch: a decode step (`T = 1`) may take a kernel (`decode_kivi`, `decode_full`: Pallas on GPU, and for the KIVI
cache on TPU, C++ on the CPU); a chunk of more than one token takes the XLA path, except that on the CPU its dense
segments (its own tokens, stored blocks dequantized, the ring, sinks; bfloat16 rows on a CPU with AMX, float32 ones
with AVX-512) may go to the native chunk kernel (`segment`, `chunk_native`; docs/kernels.md "Chunk attention"), and
over a KIVI cache whose stores it reads in place, the whole chunk in one call of it (`chunk_in_one_call`, twin:
`segments`).
Shapes: q `[batch, T, q_heads, head_dim]`; cache tensors stacked `[layers, batch, kv_heads, tokens, ...]`, read one
block of one layer at a time (`layer=None` takes tensors that hold one layer already).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kivi_jax import layout, quant, sharding

BLOCK_TOKENS = 256  # tokens per block of the XLA path's loop (fastest on the 2-core CPU, see docs/benchmarks.md)
DEQUANTIZE_ROWS = 64  # query rows (new tokens x query heads a kv head) that make a chunk's many rows (`many_rows`)


# ---------------------------------------------------------------------------------------------------------------------
# Reading one layer without copying it


def layer_tokens(a: jax.Array, layer, start, size: int) -> jax.Array:
    """Token rows `[start, start + size)` of one layer: `a [layers, batch, kv_heads, tokens, X]` (or without the
    layer axis when `layer` is None) -> `[batch, kv_heads, size, X]`."""
    if layer is None:
        return jax.lax.dynamic_slice_in_dim(a, start, size, axis=-2)
    sizes = (1,) + a.shape[1:3] + (size, a.shape[4])
    return jax.lax.dynamic_slice(a, (layer, 0, 0, start, 0), sizes)[0]


def stored_tokens(a, layer, start, size: int) -> jax.Array:
    """`layer_tokens` of a full-precision stack, or the rows a store reads itself (`cache8.Store8.read`: 8-bit
    codes widened to float32 a block at a time)."""
    return layer_tokens(a, layer, start, size) if isinstance(a, jax.Array) else a.read(layer, start, size)


def gather_tokens(a: jax.Array, layer, rows: jax.Array) -> jax.Array:
    """Token rows `rows [batch, n]` of one layer, per sequence -> `[batch, kv_heads, n, X]`."""
    batch = rows.shape[0]
    a = a if layer is None else a[layer]  # a gather of a gather: XLA reads only the rows
    got = a[jnp.arange(batch)[:, None], :, rows]  # [batch, n, kv_heads, X]
    return jnp.moveaxis(got, 1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Query rows and the online softmax


def many_rows(rows: int) -> bool:
    """Whether `rows` query rows a kv head are a prefill chunk's many, as against a decode step's few: its stored
    blocks are dequantized once, bfloat16 queries dot in bfloat16 (`Rows.dot_dtype`), an empty ring is skipped."""
    return rows >= DEQUANTIZE_ROWS


class Rows(NamedTuple):
    """The new tokens' queries grouped by kv head: `q [batch, kv_heads, T * n_rep, head_dim]` float32, scaled by
    1/sqrt(head_dim); `pos [batch, T * n_rep]` the position of each row's token; `dot_dtype` the operands of their
    dots with keys and of the probabilities with values (sums, scores and the softmax float32 either way).
    `token_major`: the native chunk kernel's form instead (`as_token_major`), which groups and scales the rows
    itself: `q [batch, T, q_heads, head_dim]` as the model gives it, `pos [batch, T]`, and a softmax state laid out
    as q (`[batch, T, q_heads(, head_dim)]`), so that no transpose is made on the way in or out."""

    q: jax.Array
    pos: jax.Array
    dot_dtype: type = jnp.float32
    token_major: bool = False


def query_positions(positions: jax.Array, num_new: jax.Array) -> jax.Array:
    """The new tokens' positions `[batch, T]` as their queries see them: past `num_new [batch]` (padding: a packed
    prefill's row holds a short prompt in 128 tokens) -1, before every key, so that a chunk's causal segments skip
    those rows (the kernel's work items of padding only do nothing); their output is never read."""
    return jnp.where(jnp.arange(positions.shape[1])[None, :] < num_new[:, None], positions, -1)


def group_queries(q: jax.Array, positions: jax.Array, kv_heads: int) -> Rows:
    """q `[batch, T, q_heads, head_dim]`, positions `[batch, T]` -> `Rows` (row `t * n_rep + r`). A chunk of
    bfloat16 queries (`many_rows`) dots in bfloat16 (the model's matmuls do: a bfloat16 prefill or bfloat16 weights,
    docs/serving.md); a decode step's few rows stay float32."""
    batch, tokens, q_heads, head_dim = q.shape
    n_rep = q_heads // kv_heads
    qg = (q.astype(jnp.float32) * head_dim**-0.5).reshape(batch, tokens, kv_heads, n_rep, head_dim)
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, tokens * n_rep, head_dim)
    bf16 = q.dtype == jnp.bfloat16 and many_rows(tokens * n_rep)
    return Rows(qg, jnp.repeat(positions.astype(jnp.int32), n_rep, axis=1), jnp.bfloat16 if bf16 else jnp.float32)


def scores_of(rows: Rows, keys: jax.Array) -> jax.Array:
    """float32 scores `[batch, kv_heads, rows, tokens]` of `rows` against keys `[batch, kv_heads, tokens, D]`, both
    in `rows.dot_dtype` (float32: the keys widened as einsum would promote them)."""
    return jnp.einsum("bhrd,bhtd->bhrt", rows.q.astype(rows.dot_dtype), keys.astype(rows.dot_dtype),
                      preferred_element_type=jnp.float32)


def as_token_major(q: jax.Array, positions: jax.Array, rows: Rows) -> Rows:
    """The kernel's form of `rows` (grouped from `q [batch, T, q_heads, head_dim]` at `positions [batch, T]`)."""
    return Rows(q, positions, rows.dot_dtype, token_major=True)


def regrouped(state: "Softmax", kv_heads: int, tokens: int, back: bool = False) -> "Softmax":
    """A softmax state of token-major rows `[batch, T, q_heads(, D)]` in the grouped form `[batch, kv_heads, T *
    n_rep(, D)]` (`back`: the other way)."""
    def one(a):
        if back:
            batch, heads, rows = a.shape[:3]
            a = a.reshape((batch, heads, tokens, rows // tokens) + a.shape[3:])
            a = jnp.swapaxes(a, 1, 2)
            return a.reshape((batch, tokens, -1) + a.shape[4:])
        batch, _, q_heads = a.shape[:3]
        a = a.reshape((batch, tokens, kv_heads, q_heads // kv_heads) + a.shape[3:])
        return jnp.swapaxes(a, 1, 2).reshape((batch, kv_heads, -1) + a.shape[4:])
    return Softmax(*map(one, state))


def rows_out(state: "Softmax", rows: Rows, q: jax.Array) -> jax.Array:
    """The attention `[batch, T, q_heads, head_dim]` in q's dtype from the rows' final softmax state."""
    out = state.result()
    return out.astype(q.dtype) if rows.token_major else ungroup(out, q.shape[1], q.dtype)


def ungroup(out: jax.Array, tokens: int, dtype) -> jax.Array:
    """`[batch, kv_heads, T * n_rep, head_dim]` -> `[batch, T, q_heads, head_dim]` in `dtype`."""
    batch, kv_heads, rows, head_dim = out.shape
    n_rep = rows // tokens
    out = out.reshape(batch, kv_heads, tokens, n_rep, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, tokens, kv_heads * n_rep, head_dim).astype(dtype)


class Softmax(NamedTuple):
    """Online-softmax state for `[batch, kv_heads, rows]` query rows."""

    m: jax.Array  # [batch, kv_heads, rows] running max (-inf before any score)
    l: jax.Array  # [batch, kv_heads, rows] running sum of exp(score - m)
    acc: jax.Array  # [batch, kv_heads, rows, head_dim] running sum of exp(score - m) * value

    @classmethod
    def empty(cls, q: jax.Array) -> "Softmax":
        rows = q.shape[:-1]
        return cls(jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q.shape, jnp.float32))

    def update(self, scores: jax.Array, weigh_values: Callable[[jax.Array], jax.Array]) -> "Softmax":
        """Adds a segment: `scores [..., tokens]` (-inf where masked) and `weigh_values(p) -> [..., head_dim]`."""
        m_new = jnp.maximum(self.m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # all masked so far: nothing to rescale
        alpha = jnp.exp(self.m - m_safe)
        p = jnp.exp(scores - m_safe[..., None])
        l = self.l * alpha + jnp.sum(p, axis=-1)
        acc = self.acc * alpha[..., None] + weigh_values(p)
        return Softmax(m_new, l, acc)

    def result(self) -> jax.Array:
        """Normalized rows; a row that saw no token (a padded query of an empty cache) is 0, never NaN."""
        return self.acc / jnp.where(self.l > 0, self.l, 1.0)[..., None]


def stored_range(pos: jax.Array, begin, end: jax.Array) -> jax.Array:
    """`[batch, tokens]`: stored positions `pos [tokens]` in `[begin, end)` per sequence (`begin` a scalar or
    `[batch]`)."""
    return (pos[None, :] < end[:, None]) & (pos[None, :] >= jnp.asarray(begin).reshape(-1, 1))


def stored_mask(pos: jax.Array, begin, end: jax.Array, rows: Rows, window: int | None) -> jax.Array:
    """`[batch, rows or 1, tokens]`: stored positions `pos [tokens]` in `[begin, end)` per sequence (`begin` a scalar
    or `[batch]`) and inside each row's sliding window. Stored tokens precede every new token: no causal test."""
    return key_mask(rows, pos[None, :], stored_range(pos, begin, end), window, causal=False)


def masked(scores: jax.Array, valid: jax.Array, softcap: float | None = None) -> jax.Array:
    """Scores `[batch, kv_heads, rows, tokens]` soft-capped (`cap * tanh(s / cap)`, Gemma 2; None: as they are), with
    invalid tokens (`valid [batch, rows or 1, tokens]`) at -inf."""
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    return jnp.where(valid[:, None], scores, -jnp.inf)


def segment(state: Softmax, rows: Rows, keys: jax.Array, values: jax.Array, key_pos: jax.Array, key_ok: jax.Array,
            window: int | None, softcap: float | None = None, causal: bool = False, native: bool = False,
            keys_token_major: bool = False) -> Softmax:
    """Adds keys and values `[batch, kv_heads, tokens, head_dim]` (`[batch, tokens, kv_heads, head_dim]` with
    `keys_token_major`, token-major rows only) at positions `key_pos [batch or 1, tokens]` to the rows' online
    softmax: a key counts where `key_ok [batch or 1, tokens]`, at or before the row when `causal` (new tokens; stored
    ones precede every row), inside the sliding `window`. `native`: the C++ kernel computes it (a chunk's rows on
    the CPU, `chunk_native`, token-major rows); the XLA path (`dense_segment`) is its twin."""
    if rows.token_major:  # the kernel's form; XLA's path groups them (a program lowered for a GPU or TPU)
        def xla() -> Softmax:
            kv_heads, tokens = keys.shape[2 if keys_token_major else 1], rows.q.shape[1]
            k, v = (jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)) if keys_token_major else (keys, values)
            grouped = group_queries(rows.q, rows.pos, kv_heads)._replace(dot_dtype=rows.dot_dtype)
            out = dense_segment(regrouped(state, kv_heads, tokens), grouped, k, v, key_pos, key_ok, window, softcap,
                                causal)
            return regrouped(out, kv_heads, tokens, back=True)
    else:
        xla = functools.partial(dense_segment, state, rows, keys, values, key_pos, key_ok, window, softcap, causal)
    if not native:
        return xla()
    if not rows.token_major:
        raise ValueError("the native kernel takes token-major rows (`as_token_major`)")

    def kernel() -> Softmax:
        from kivi_jax.native import attend

        return Softmax(*attend.segment(state.m, state.l, state.acc, rows.q, rows.pos, keys, values, key_pos, key_ok,
                                       window, causal, scale=rows.q.shape[-1] ** -0.5,
                                       kv_tokens_first=keys_token_major, dot_dtype=rows.dot_dtype))

    return jax.lax.platform_dependent(cpu=kernel, default=xla)  # a program lowered for a GPU or TPU: XLA's


def dense_segment(state: Softmax, rows: Rows, keys: jax.Array, values: jax.Array, key_pos: jax.Array,
                  key_ok: jax.Array, window: int | None, softcap: float | None, causal: bool) -> Softmax:
    """`segment`'s XLA path for grouped rows: scores, the mask, the softmax update, probabilities times values."""
    valid = key_mask(rows, key_pos, key_ok, window, causal)
    return state.update(masked(scores_of(rows, keys), valid, softcap), lambda p: dense_values(p, values, rows.dot_dtype))


def key_mask(rows: Rows, key_pos: jax.Array, key_ok: jax.Array, window: int | None, causal: bool) -> jax.Array:
    """`[batch, rows or 1, tokens]`: which keys (at `key_pos [batch or 1, tokens]`, those with `key_ok [batch or 1,
    tokens]`) each grouped row sees: at or before it when `causal`, inside its sliding `window`."""
    valid = jnp.broadcast_to(key_ok, (rows.pos.shape[0], key_ok.shape[-1]))[:, None, :]  # [batch, 1, tokens]
    if causal:
        return valid & layout.visible(key_pos, rows.pos, window)
    if window is not None:
        return valid & (rows.pos[:, :, None] - key_pos[:, None, :] < window)
    return valid


def chunk_native(impl: str, rows: Rows, softcap: float | None) -> bool:
    """Whether a chunk's segments take the native kernel: `auto` or `native` on the CPU backend with the kernels
    built, rows whose dots it serves on this CPU (`Rows.dot_dtype`: bfloat16 with AMX, float32 with AVX-512), no
    soft-cap, a head dim the kernel takes, no device mesh (XLA partitions the XLA path); a forced `native` says why
    not."""
    if jax.default_backend() != "cpu" or not use_native(impl):  # (a failed build has warned once already)
        return False
    from kivi_jax.mesh_scope import active_mesh
    from kivi_jax.native import attend

    reason = attend.unsupported(rows.dot_dtype, rows.q.shape[-1], softcap)
    if reason is None and active_mesh() is not None:
        reason = "a device mesh is active"
    if reason is not None:
        fall_back(impl, f"a chunk's attention: {reason}")
    return reason is None


def blockwise(
    state: Softmax, num_tokens: int, block: int, end: jax.Array, step: Callable[[Softmax, jax.Array, jax.Array], Softmax]
) -> Softmax:
    """Runs `step(state, start, first_new)` over `block`-token blocks covering `[0, max(end))` of `num_tokens`.

    The last block may start early so that it fits: `first_new` is the first position the block owns; positions
    below it were counted by the previous block and must be masked.
    """
    n_blocks = (jnp.max(end) + block - 1) // block

    def body(i, state):
        first_new = i * block
        return step(state, jnp.minimum(first_new, num_tokens - block), first_new)

    return jax.lax.fori_loop(0, n_blocks, body, state)


def block_size(num_tokens: int, multiple: int = 1, block: int = BLOCK_TOKENS) -> int:
    """The loop's block: at most `block` tokens and all of a short cache, a multiple of `multiple` (G)."""
    block = min(block, num_tokens)
    return block - block % multiple


def dense_values(p: jax.Array, v: jax.Array, dot_dtype=jnp.float32) -> jax.Array:
    """Probabilities `[batch, kv_heads, rows, tokens]` times full-precision values `[batch, kv_heads, tokens, D]`
    (both rounded to `dot_dtype` first unless it is float32)."""
    if dot_dtype != jnp.float32:
        p, v = p.astype(dot_dtype), v.astype(dot_dtype)
    return jnp.einsum("bhrt,bhtd->bhrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def new_tokens(state: Softmax, rows: Rows, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
               num_new: jax.Array, window: int | None, block: int = BLOCK_TOKENS,
               softcap: float | None = None, native: bool = False) -> Softmax:
    """Adds the new tokens themselves, causally, in full precision: k_new, v_new `[batch, T, kv_heads, head_dim]` at
    `positions [batch, T]`, of which the first `num_new [batch]` are real. Up to `NEW_TILE` tokens in one block;
    a longer chunk in query tiles, each reading only the keys at or before it (`causal_tiles`); `native`: all of
    them in one call of the kernel, which skips what no row sees itself."""
    tokens = k_new.shape[1]
    real = jnp.arange(tokens)[None, :] < num_new[:, None]  # [batch, T]
    if native:  # token-major rows, and the keys as they come
        return segment(state, rows, k_new, v_new, positions, real, window, causal=True, native=True,
                       keys_token_major=True)
    k = jnp.swapaxes(k_new, 1, 2)  # [batch, kv_heads, T, head_dim]
    v = jnp.swapaxes(v_new, 1, 2)
    if tokens > NEW_TILE:
        return causal_tiles(state, rows, k, v, positions, num_new, window, softcap)
    block = block_size(tokens, 1, block)

    def step(state: Softmax, start, first_new) -> Softmax:
        kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2)  # [batch, kv_heads, block, head_dim]
        vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2)
        idx = start + jnp.arange(block)
        pos = jax.lax.dynamic_slice_in_dim(positions, start, block, axis=1)  # [batch, block]
        ok = (idx[None, :] < num_new[:, None]) & (idx[None, :] >= first_new)  # [batch, block]
        return segment(state, rows, kb, vb, pos, ok, window, softcap, causal=True)

    if block == tokens:  # one block: no loop
        return step(state, 0, 0)
    return blockwise(state, tokens, block, jnp.full((1,), tokens), step)


NEW_TILE = 128  # new tokens a query tile of a chunk's attention over itself (and a key tile); shorter: one block
MAX_NEW_TILES = 16  # a longer chunk takes wider tiles, so that its unrolled tiles stay few


def new_tile(tokens: int) -> int:
    """The query (and key) tile of a chunk of `tokens` new tokens' attention over itself."""
    return max(NEW_TILE, -(-tokens // MAX_NEW_TILES))


def causal_tiles(state: Softmax, rows: Rows, k: jax.Array, v: jax.Array, positions: jax.Array, num_new: jax.Array,
                 window: int | None, softcap: float | None = None) -> Softmax:
    """`new_tokens` of a long chunk, k, v `[batch, kv_heads, T, head_dim]`: the rows of query tile i (its tokens)
    attend to keys `[0, end of tile i)` only, in one segment, since every later key is a later token."""
    tokens = k.shape[2]
    n_rep = rows.q.shape[2] // tokens
    tile = new_tile(tokens)
    outs = []
    for a in range(0, tokens, tile):
        b = min(a + tile, tokens)
        r = slice(a * n_rep, b * n_rep)
        part = Softmax(state.m[:, :, r], state.l[:, :, r], state.acc[:, :, r])
        tile_rows = rows._replace(q=rows.q[:, :, r], pos=rows.pos[:, r])
        real = jnp.arange(b)[None, :] < num_new[:, None]  # [batch, b]
        outs.append(segment(part, tile_rows, k[:, :, :b], v[:, :, :b], positions[:, :b], real, window, softcap,
                            causal=True))
    return Softmax(*(jnp.concatenate(x, axis=2) for x in zip(*outs)))


# ---------------------------------------------------------------------------------------------------------------------
# Full precision


def attend_full_xla(q, positions, k_cache, v_cache, layer, length, k_new, v_new, num_new, window,
                    block: int = BLOCK_TOKENS, softcap: float | None = None, impl: str = "xla") -> jax.Array:
    """New tokens `q [batch, T, q_heads, head_dim]` at `positions [batch, T]` over one layer of a full-precision
    cache `[(layers,) batch, kv_heads, tokens, head_dim]` (or an 8-bit store, `stored_tokens`) holding `length [batch]` tokens, plus the new keys and
    values `[batch, T, kv_heads, head_dim]` (`num_new [batch]` real), scores soft-capped by `softcap` (None: not).
    `impl`: a chunk's segments may take the native kernel (`chunk_native`; "xla": never). Returns `[batch, T,
    q_heads, head_dim]`."""
    kv_heads, num_tokens = k_cache.shape[-3], k_cache.shape[-2]
    q_positions = query_positions(positions, num_new)  # padding at -1: the chunk's own causal segment skips its rows
    rows = group_queries(q, q_positions, kv_heads)
    block = block_size(num_tokens, getattr(k_cache, "block_multiple", 1), block)  # whole pages of a paged cache
    native = chunk_native(impl, rows, softcap)
    if native:
        rows = as_token_major(q, q_positions, rows)

    def step(state: Softmax, start, first_new) -> Softmax:
        kb = stored_tokens(k_cache, layer, start, block)  # [batch, kv_heads, block, head_dim]
        vb = stored_tokens(v_cache, layer, start, block)
        pos = start + jnp.arange(block)
        return segment(state, rows, kb, vb, pos[None, :], stored_range(pos, first_new, length), window, softcap,
                       native=native)

    state = blockwise(Softmax.empty(rows.q), num_tokens, block, length, step)
    state = new_tokens(state, rows, k_new, v_new, positions, num_new, window, block, softcap, native)
    return rows_out(state, rows, q)


def decode_full_xla(q, k_cache, v_cache, layer, length, k_new, v_new, window, block: int = BLOCK_TOKENS,
                    softcap: float | None = None) -> jax.Array:
    """One new token a sequence (`q [batch, 1, q_heads, head_dim]`, k_new/v_new `[batch, 1, kv_heads, head_dim]` at
    position `length`) over one layer of a full-precision cache: `attend_full_xla` with T = 1, the kernels' twin."""
    return attend_full_xla(q, length[:, None], k_cache, v_cache, layer, length, k_new, v_new,
                           jnp.ones_like(length), window, block, softcap)


# ---------------------------------------------------------------------------------------------------------------------
# KIVI: scores and weighted values straight from codes, scales and mins folded in (never a dequantized cache)


def unpack_codes(store) -> jax.Array:
    """float32 `[batch, kv_heads, tokens, head_dim]`: a store block's codes in channel order, in one fused loop per
    plane (3-bit codes: the 2-bit plane plus 4 times the 1-bit plane; quant's module doc); with a codebook, the
    level each code stands for (`code_levels`)."""
    out, start, shift = None, 0, 0
    width = store.codes.shape[-1]
    head_dim = width * 8 // store.bits
    for b in quant.PLANES[store.bits]:
        n = head_dim * b // 8
        plane = unpack_plane(store.codes[..., start : start + n], b)
        out = plane if out is None else out + plane * float(2**shift)
        start, shift = start + n, shift + b
    return out if store.levels is None else code_levels(out, store.levels)


def code_levels(codes: jax.Array, levels: tuple) -> jax.Array:
    """float32 codes `0 .. n-1` (exact) -> the levels they stand for, by `n - 1` selects (elementwise, fused; a gather
    from a table is a slow loop on XLA:CPU)."""
    out = jnp.full(codes.shape, levels[0], jnp.float32)
    for j in range(1, len(levels)):
        out = jnp.where(codes >= j - 0.5, jnp.float32(levels[j]), out)
    return out


def unpack_plane(codes: jax.Array, bits: int) -> jax.Array:
    """float32 codes in channel order from one planar plane of `bits`-bit codes (bits in {1, 2, 4, 8}).

    The shifts and masks run on 32-bit words of four packed bytes (SWAR): shifting a word right by `bits * i` and
    masking every byte leaves slab i's codes of those four bytes in place, and the words read back as bytes lay the
    slabs out as `[p, D/p]`, which is channel order for planar packing; no concatenation, no byte-wide variable
    shifts (both are slow loops on XLA:CPU; see docs/benchmarks.md). Rows of D/p bytes not a multiple of 4 use
    16-bit or 8-bit words.
    """
    p = 8 // bits
    if p == 1:
        return codes.astype(jnp.float32)
    lead, width = codes.shape[:-1], codes.shape[-1]
    n = next(k for k in (4, 2, 1) if width % k == 0)  # bytes a word
    word = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[n]
    words = codes if n == 1 else jax.lax.bitcast_convert_type(codes.reshape(lead + (width // n, n)), word)
    mask = jnp.asarray(int.from_bytes(bytes([2**bits - 1]) * n, "little"), word)  # the low `bits` of every byte
    shifts = (bits * jnp.arange(p, dtype=word))[:, None]  # [p, 1]
    slabs = (words[..., None, :] >> shifts) & mask  # [..., p, width / n] words
    if n > 1:
        slabs = jax.lax.bitcast_convert_type(slabs, jnp.uint8)  # [..., p, width / n, n] bytes
    return slabs.reshape(lead + (p * width,)).astype(jnp.float32)


def quantized_scores(q: jax.Array, store, int8_dots: bool = False) -> jax.Array:
    """q `[batch, kv_heads, n_rep, head_dim]` against the keys of a store block -> `[batch, kv_heads, n_rep, tokens]`.

    Per-channel keys fold their scale into q (one scaled q per token group); per-token keys scale the partial dots
    of each channel group. `int8_dots` (per-channel 2-bit uniform keys, the native kernel's integer mode): each
    folded q is rounded to int8 codes `rint(qs * 127 / max|qs|)` and the dot scaled back by `max|qs| / 127`.
    """
    codes = unpack_codes(store)  # [batch, kv_heads, tokens, head_dim]
    batch, kv_heads, tokens, head_dim = codes.shape
    g = store.group_size
    scale, mn = store.scale.astype(jnp.float32), store.mn.astype(jnp.float32)
    if store.axis == "channel":  # scale, mn [batch, kv_heads, tokens // G, head_dim]
        q_scaled = q[:, :, :, None, :] * scale[:, :, None]  # [batch, kv_heads, n_rep, groups, head_dim]
        grouped = codes.reshape(batch, kv_heads, tokens // g, g, head_dim)
        if int8_dots and int8_store(store):
            amax = jnp.max(jnp.abs(q_scaled), axis=-1, keepdims=True)  # [batch, kv_heads, n_rep, groups, 1]
            q8 = jnp.round(q_scaled * jnp.where(amax > 0, 127.0 / amax, 0.0))
            scores = jnp.einsum("bhgtd,bhrgd->bhrgt", grouped, q8) * (amax / 127.0)
        else:
            scores = jnp.einsum("bhgtd,bhrgd->bhrgt", grouped, q_scaled)
        scores = scores + jnp.einsum("bhrd,bhgd->bhrg", q, mn)[..., None]  # the mins' part, per group
        return scores.reshape(q.shape[:3] + (tokens,))
    # per-token: scale, mn [batch, kv_heads, tokens, head_dim // G]
    q_sums = q.reshape(q.shape[:3] + (head_dim // g, g)).sum(-1)  # [batch, kv_heads, n_rep, groups]
    scores = jnp.einsum("bhrg,bhtg->bhrt", q_sums, mn)
    for i in range(head_dim // g):
        dots = jnp.einsum("bhrj,bhtj->bhrt", q[..., i * g : (i + 1) * g], codes[..., i * g : (i + 1) * g])
        scores = scores + dots * scale[:, :, None, :, i]
    return scores


def int8_store(store) -> bool:
    """Whether the native kernel's integer mode (`int8_dots`) dots this store in integers: 2-bit uniform codes."""
    return store.bits == 2 and store.levels is None


def quantized_values(p: jax.Array, store, int8_chunk: int = 0) -> jax.Array:
    """Probabilities `[batch, kv_heads, n_rep, tokens]` times a store block's values -> `[..., n_rep, head_dim]`.

    Per-token values fold their scale into p (one scaled p per channel group); per-channel values scale the partial
    sums of each token group. `int8_chunk` (per-token 2-bit uniform values, the native kernel's integer mode): the
    scaled p of each run of that many tokens are rounded to 8-bit codes `rint(w * 255 / max w)` and the sums scaled
    back by `max w / 255`.
    """
    codes = unpack_codes(store)  # [batch, kv_heads, tokens, head_dim]
    batch, kv_heads, tokens, head_dim = codes.shape
    g = store.group_size
    scale, mn = store.scale.astype(jnp.float32), store.mn.astype(jnp.float32)
    if store.axis == "token":  # scale, mn [batch, kv_heads, tokens, head_dim // G]
        mins = jnp.repeat(jnp.einsum("bhrt,bhtg->bhrg", p, mn), g, axis=-1)  # [batch, kv_heads, n_rep, head_dim]
        pieces = [
            jnp.einsum("bhrt,bhtj->bhrj", weights_8bit(p * scale[:, :, None, :, i], int8_chunk)
                       if int8_chunk and int8_store(store) else p * scale[:, :, None, :, i],
                       codes[..., i * g : (i + 1) * g])
            for i in range(head_dim // g)
        ]
        return jnp.concatenate(pieces, axis=-1) + mins
    # per-channel: scale, mn [batch, kv_heads, tokens // G, head_dim]
    pg = p.reshape(p.shape[:3] + (tokens // g, g))  # [batch, kv_heads, n_rep, groups, G]
    acc = jnp.einsum("bhrg,bhgd->bhrd", pg.sum(-1), mn)
    sums = jnp.einsum("bhrgt,bhgtd->bhrgd", pg, codes.reshape(batch, kv_heads, tokens // g, g, head_dim))
    return acc + jnp.einsum("bhrgd,bhgd->bhrd", sums, scale)


def weights_8bit(w: jax.Array, chunk: int) -> jax.Array:
    """Non-negative weights `[..., tokens]` rounded to 8 bits per run of `chunk` tokens (scaled back)."""
    runs = w.reshape(w.shape[:-1] + (w.shape[-1] // chunk, chunk))
    wmax = jnp.max(runs, axis=-1, keepdims=True)
    codes = jnp.round(runs * jnp.where(wmax > 0, 255.0 / wmax, 0.0))
    return (codes * (wmax / 255.0)).reshape(w.shape)


def dequantized(store) -> jax.Array:
    """float32 `[batch, kv_heads, tokens, head_dim]`: a store block's values (a pre-RoPE key block before rotating),
    scales and mins broadcast over their groups (never repeated into a tensor of their own)."""
    codes = unpack_codes(store)
    batch, kv_heads, tokens, head_dim = codes.shape
    g = store.group_size
    scale, mn = store.scale.astype(jnp.float32), store.mn.astype(jnp.float32)
    if store.axis == "channel":  # scale, mn [batch, kv_heads, tokens // G, head_dim]
        grouped = codes.reshape(batch, kv_heads, tokens // g, g, head_dim)
        return (grouped * scale[:, :, :, None, :] + mn[:, :, :, None, :]).reshape(codes.shape)
    grouped = codes.reshape(batch, kv_heads, tokens, head_dim // g, g)  # scale, mn [..., tokens, head_dim // G]
    return (grouped * scale[..., None] + mn[..., None]).reshape(codes.shape)


def rotated(keys: jax.Array, pos: jax.Array, inv_freq: jax.Array | None) -> jax.Array:
    """Stored keys `[batch, kv_heads, tokens, head_dim]` at positions `pos [batch or 1, tokens]` after RoPE (a
    pre-RoPE store, `inv_freq` given), or as they are (`inv_freq` None: stored after RoPE). The same arithmetic as
    `models.llama.apply_rope` (half-split layout), laid out for stored keys: no transposes, and one cos/sin table for
    a block whose positions do not depend on the sequence."""
    if inv_freq is None:
        return keys
    angles = jnp.maximum(pos, 0).astype(jnp.float32)[:, None, :, None] * inv_freq  # [batch or 1, 1, tokens, D / 2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = keys.shape[-1] // 2
    x1, x2 = keys[..., :half], keys[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sink_tokens(state: Softmax, rows: Rows, k_sink: jax.Array, v_sink: jax.Array, length: jax.Array,
                window: int | None, inv_freq: jax.Array | None, softcap: float | None = None,
                native: bool = False) -> Softmax:
    """Adds the stored sink tokens `[0, min(S, length))` in full precision: k_sink, v_sink `[batch, kv_heads, S,
    head_dim]` of one layer (keys rotated here for a pre-RoPE cache)."""
    pos = jnp.arange(k_sink.shape[2], dtype=jnp.int32)
    keys = rotated(k_sink.astype(jnp.float32), pos[None, :], inv_freq)
    return segment(state, rows, keys, v_sink.astype(jnp.float32), pos[None, :], stored_range(pos, 0, length), window,
                   softcap, native=native)


def window_tensor(store, layer, ring: jax.Array, held: jax.Array, length: jax.Array, lazy: bool = False) -> jax.Array:
    """float32 `[batch, kv_heads, R, head_dim]`: what attention sees for each ring slot's token `held [batch, R]`.

    The ring's own entry, unless the token is already quantized (a per-channel store's last flushed block), in which
    case its dequantized value: ring slot s and row s of that R-block hold the same token. `lazy`: the block is
    gathered and dequantized only when some written slot's token is quantized (a `lax.cond`: a chunk's call, where a
    short prompt's never is); a never-written slot (negative token, never counted) may then read the ring's entry.
    """
    residual = ring.shape[2]
    ring = ring.astype(jnp.float32)
    if store.axis == "token":  # a per-token store quantizes a token exactly when it leaves the ring
        return ring
    end = layout.quantized_end(store.axis, length, residual)  # [batch]
    quantized = held < end[:, None]  # [batch, R]

    def with_block() -> jax.Array:
        rows = layout.last_flushed_block(length, residual)[:, None] + jnp.arange(residual)[None, :]
        block = store.gather_rows(layer, rows).dequantize()  # [batch, kv_heads, R, head_dim]
        return jnp.where(quantized[:, None, :, None], block, ring)

    if not lazy:
        return with_block()
    return jax.lax.cond(jnp.any(quantized & (held >= 0)), with_block, lambda: ring)


def ring_window(k_store, v_store, layer, k_ring, v_ring, length, main_end, num_sinks: int, inv_freq=None,
                lazy: bool = False):
    """The ring segment of a KIVI cache's layer: keys and values `[batch, kv_heads, R, head_dim]` float32
    (`window_tensor`, `lazy` or not; keys rotated for a pre-RoPE cache), the token each slot holds `[batch, R]`, and
    which slots count (tokens not yet quantized in both stores, past the sinks; never-written slots hold negative
    tokens)."""
    held = layout.ring_tokens(length, k_ring.shape[2])  # [batch, R]
    k_win = rotated(window_tensor(k_store, layer, k_ring, held, length, lazy), held, inv_freq)
    v_win = window_tensor(v_store, layer, v_ring, held, length, lazy)
    return k_win, v_win, held, (held >= main_end[:, None]) & (held >= num_sinks)


def attend_kivi_xla(q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new, window,
                    block: int = BLOCK_TOKENS, sinks=None, inv_freq=None, softcap: float | None = None,
                    int8_dots: bool = False, impl: str = "xla") -> jax.Array:
    """New tokens over one layer of a KIVI cache (docs/design.md §3, §7), blockwise with an online softmax.

    Four segments: the sink tokens (full precision, with `sinks`); tokens whose key and value are both quantized
    (walked in blocks, scales folded into q and p, or a pre-RoPE key block dequantized and rotated); the newest
    up-to-R stored tokens (ring, or the last flushed key block); the new tokens themselves (full precision, causal).
    Stores are stacked over layers (or one layer with `layer=None`); rings `[batch, kv_heads, R, head_dim]` and
    `sinks = (k_sink, v_sink)` `[batch, kv_heads, S, head_dim]` of that layer. `inv_freq [head_dim // 2]`: the cache
    holds keys before RoPE (stores, ring, sinks), rotated here by their positions. q `[batch, T, q_heads, head_dim]`
    at `positions [batch, T]`; k_new (after RoPE), v_new `[batch, T, kv_heads, head_dim]`, the first `num_new
    [batch]` real; scores soft-capped by `softcap` (None: not); `int8_dots`: the quantized tokens dotted as the
    native kernel's integer mode does (`quantized_scores`, `quantized_values` with the key group as the chunk);
    `impl`: a chunk's dense segments may take the native kernel (`chunk_native`; "xla": never). Returns `[batch, T,
    q_heads, head_dim]` in q's dtype.
    """
    q_positions = query_positions(positions, num_new)  # padding at -1: the one kernel call skips its rows
    rows = group_queries(q, q_positions, k_store.kv_heads)
    many = many_rows(rows.q.shape[2])
    # a chunk's many rows may take the kernel; few (a short chunk's) fold the scales into q and p on XLA's path
    native = many and chunk_native(impl, rows, softcap) and not int8_dots
    if native:
        rows = as_token_major(q, q_positions, rows)
        from kivi_jax.native import attend

        if attend.unsupported_store(k_store, v_store, inv_freq) is None:  # every segment in one call of the kernel
            def walk() -> jax.Array:
                return segments(q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new,
                                num_new, window, block, sinks, inv_freq, softcap, rows, many, native)

            def one_call() -> jax.Array:
                return chunk_in_one_call(rows, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new,
                                         positions, num_new, window, sinks).astype(q.dtype)

            return jax.lax.platform_dependent(cpu=one_call, default=walk)  # a GPU or TPU lowering: the segments
    return segments(q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new, window,
                    block, sinks, inv_freq, softcap, rows, many, native, int8_dots)


def chunk_in_one_call(rows: Rows, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, positions, num_new,
                      window, sinks) -> jax.Array:
    """A chunk's attention `[batch, T, q_heads, head_dim]` float32 over a KIVI cache in one call of the native kernel
    (`attend.segment(..., store=...)`, token-major rows): the stores read in place (their tokens with both key and
    value quantized, past the sinks), then the sinks, the ring and the new tokens as dense keys, all under one causal
    rule (every stored token precedes every new one); the kernel starts the softmax and normalizes it itself. The
    same keys, positions and masks as `segments`' walk, which is its twin."""
    from kivi_jax.native import attend

    residual = k_ring.shape[2]
    batch = length.shape[0]
    num_sinks = 0 if sinks is None else sinks[0].shape[2]
    main_end = layout.both_quantized_end(k_store.axis, v_store.axis, length, residual)
    k_win, v_win, held, in_ring = ring_window(k_store, v_store, layer, k_ring, v_ring, length, main_end, num_sinks,
                                              lazy=True)
    tokens_first = lambda a: jnp.swapaxes(a.astype(jnp.float32), 1, 2)  # noqa: E731  [batch, tokens, kv_heads, D]
    keys, values, pos, ok = [tokens_first(k_win)], [tokens_first(v_win)], [held], [in_ring]
    if num_sinks:
        sink_pos = jnp.arange(num_sinks, dtype=jnp.int32)
        keys.insert(0, tokens_first(sinks[0]))
        values.insert(0, tokens_first(sinks[1]))
        pos.insert(0, jnp.broadcast_to(sink_pos, (batch, num_sinks)))
        ok.insert(0, stored_range(sink_pos, 0, length))
    keys.append(k_new.astype(jnp.float32))
    values.append(v_new.astype(jnp.float32))
    pos.append(positions)
    ok.append(jnp.arange(k_new.shape[1])[None, :] < num_new[:, None])
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    return attend.segment(None, None, None, rows.q, rows.pos, cat(keys), cat(values),
                          cat([p.astype(jnp.int32) for p in pos]), cat(ok), window, causal=True,
                          scale=rows.q.shape[-1] ** -0.5, kv_tokens_first=True,
                          store=(k_store, v_store, layer, num_sinks, main_end), finish=True,
                          dot_dtype=rows.dot_dtype)[2]


def segments(q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new, window, block,
             sinks, inv_freq, softcap, rows: Rows, many: bool, native: bool, int8_dots: bool = False) -> jax.Array:
    """`attend_kivi_xla`'s walk, a segment at a time (each a native call when `native`); `many`: a chunk's many
    query rows (`many_rows`)."""
    num_tokens = k_store.max_tokens
    residual = k_ring.shape[2]
    num_sinks = 0 if sinks is None else sinks[0].shape[2]
    main_end = layout.both_quantized_end(k_store.axis, v_store.axis, length, residual)
    block = block_size(num_tokens, max(k_store.block_multiple, v_store.block_multiple), block)  # whole groups, pages
    state = Softmax.empty(rows.q)
    if num_sinks:
        state = sink_tokens(state, rows, *sinks, length, window, inv_freq, softcap, native)

    # Many query rows (a prefill chunk's): each block is dequantized once and dotted densely; few (a decode step's):
    # the scales fold into q and p, which costs rows x groups instead of the block's tokens x head_dim
    dense = many and not int8_dots

    def step(state: Softmax, start, first_new) -> Softmax:
        kb = k_store.token_slice(start, block, layer)
        vb = v_store.token_slice(start, block, layer)
        pos = start + jnp.arange(block)
        if dense:
            return segment(state, rows, rotated(dequantized(kb), pos[None, :], inv_freq), dequantized(vb),
                           pos[None, :], stored_range(pos, jnp.maximum(first_new, num_sinks), main_end), window,
                           softcap, native=native)
        valid = stored_mask(pos, jnp.maximum(first_new, num_sinks), main_end, rows, window)
        if inv_freq is None:
            scores = quantized_scores(rows.q, kb, int8_dots)
        else:
            scores = scores_of(rows, rotated(dequantized(kb), pos[None, :], inv_freq))
        int8_chunk = k_store.group_size if int8_dots else 0
        return state.update(masked(scores, valid, softcap), lambda p: quantized_values(p, vb, int8_chunk))

    state = blockwise(state, num_tokens, block, main_end, step)

    k_win, v_win, held, in_ring = ring_window(k_store, v_store, layer, k_ring, v_ring, length, main_end, num_sinks,
                                              inv_freq)

    def ring(state: Softmax) -> Softmax:
        return segment(state, rows, k_win, v_win, held, in_ring, window, softcap, native=native)

    # A chunk onto an empty ring (a prompt's first) skips it, exactly (an all-masked segment changes no state): a
    # sixth of a 64-token chunk's time, docs/serving.md. A decode step always computes it (no test per layer).
    if many:
        state = jax.lax.cond(jnp.any(in_ring), ring, lambda state: state, state)
    else:
        state = ring(state)
    state = new_tokens(state, rows, k_new, v_new, positions, num_new, window, block, softcap, native)
    return rows_out(state, rows, q)


def decode_kivi_xla(
    q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, block: int = BLOCK_TOKENS, sinks=None,
    inv_freq=None, softcap: float | None = None, int8_dots: bool = False,
) -> jax.Array:
    """One new token a sequence (at position `length`) over one layer of a KIVI cache: `attend_kivi_xla` with T = 1,
    the decode kernels' twin. Rings and sinks `[batch, kv_heads, R or S, head_dim]` of that layer."""
    return attend_kivi_xla(q, length[:, None], k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new,
                           jnp.ones_like(length), window, block, sinks, inv_freq, softcap, int8_dots)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch: a decode step (T = 1) may take a kernel; a chunk (T > 1) the XLA path, its segments on the CPU the native
# chunk kernel (bfloat16 rows with AMX, float32 with AVX-512: `segment`, `chunk_native` above; over a readable KIVI
# store, one call a layer).


def use_pallas(impl: str, tpu_kernel: bool = False) -> bool:
    """`auto` takes a Pallas kernel on a GPU backend, and on a TPU backend where one exists (`tpu_kernel`: the KIVI
    decode kernel), the XLA path elsewhere; `pallas` forces one."""
    if impl == "auto":
        backend = jax.default_backend()
        return backend == "gpu" or (backend == "tpu" and tpu_kernel)
    return impl == "pallas"


def pallas_target() -> str:
    """The Pallas backend the kernels are written for here: `"tpu"` (Mosaic TPU) on a TPU backend, `"mosaic_gpu"` on a
    GPU of compute capability 9.0 or newer (Hopper, Blackwell; `KIVI_JAX_MOSAIC_GPU=0` keeps Triton there),
    `"triton"` on older GPUs and on any other backend (the CPU: interpret mode; tests monkeypatch this to run the TPU
    kernel there)."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend == "gpu":
        return "mosaic_gpu" if mosaic_gpu_capable(getattr(jax.devices()[0], "compute_capability", "0")) else "triton"
    return "triton"


def mosaic_gpu_capable(compute_capability: str) -> bool:
    """Whether a GPU of this compute capability (`"9.0"`) takes the Mosaic GPU kernels: Hopper (sm90) and newer,
    unless `KIVI_JAX_MOSAIC_GPU=0`."""
    return float(compute_capability) >= 9.0 and os.environ.get("KIVI_JAX_MOSAIC_GPU", "1") != "0"


def kivi_kernels(target: str) -> list:
    """The KIVI decode kernel modules to try for a Pallas target, in order (each has `unsupported` and `decode`):
    Mosaic GPU before Triton (which jax deprecates but still ships) on Hopper and newer."""
    from kivi_jax.pallas_kernels import kivi_decode

    if target == "tpu":
        from kivi_jax.pallas_kernels import kivi_decode_tpu

        return [kivi_decode_tpu]
    if target == "mosaic_gpu":
        from kivi_jax.pallas_kernels import kivi_decode_mosaic

        return [kivi_decode_mosaic, kivi_decode]
    return [kivi_decode]


def use_native(impl: str, full: bool = False) -> bool:
    """`native` forces the C++ CPU kernels (`native-int8` too, with the KIVI kernel's integer mode); `auto` takes them
    on the CPU backend when they built (for the full-precision cache only if it beats the XLA path:
    `native.FULL_AUTO`). False when they cannot be built (the loader has warned once, saying why)."""
    from kivi_jax import native

    if impl == "auto" and (jax.default_backend() != "cpu" or (full and not native.FULL_AUTO)):
        return False
    return impl in ("auto", "native", "native-int8") and native.available()


INT8_REASON = "this build of the native kernel has no integer mode (it needs AVX-512 BW and VBMI): it computes in float32"
CODEBOOK_REASON = "the Pallas kernels read uniform codes, not codebook levels (-nuqk/-nuqv): the XLA path serves them"
SOFTCAP_REASON = "no kernel soft-caps attention logits (Gemma 2)"
PAGED_REASON = "the kernels do not read through a block table yet (a paged cache)"


def fall_back(impl: str, reason: str) -> None:
    """The kernel cannot serve this cache: say so when the caller forced a kernel (`auto` falls back quietly)."""
    if impl in ("pallas", "native", "native-int8"):
        warnings.warn(f"attention_impl={impl!r}: {reason}; using the XLA path", stacklevel=3)


def attend_full(impl: str, q, positions, k_cache, v_cache, layer, length, k_new, v_new, num_new, window,
                softcap=None):
    """New tokens over one layer of a full-precision cache with the chosen implementation (kernels: T = 1 only)."""
    if q.shape[1] == 1:
        return decode_full(impl, q, k_cache, v_cache, layer, length, k_new, v_new, window, softcap)
    return attend_full_xla(q, positions, k_cache, v_cache, layer, length, k_new, v_new, num_new, window,
                           softcap=softcap, impl=impl)


def attend_kivi(impl: str, q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new,
                window, sinks=None, inv_freq=None, softcap=None):
    """New tokens over one layer of a KIVI cache with the chosen implementation (kernels: T = 1 only). Rings and
    sinks come stacked like the stores."""
    if q.shape[1] == 1:
        return decode_kivi(impl, q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, sinks,
                           inv_freq, softcap)
    k_ring, v_ring, sinks = one_layer(layer, k_ring, v_ring, sinks)
    return attend_kivi_xla(q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new,
                           window, sinks=sinks, inv_freq=inv_freq, softcap=softcap, impl=impl)


def one_layer(layer, k_ring, v_ring, sinks):
    """Rings and sinks of one layer from their stacks (as they are with `layer=None`)."""
    if layer is None:
        return k_ring, v_ring, sinks
    return k_ring[layer], v_ring[layer], None if sinks is None else (sinks[0][layer], sinks[1][layer])


@sharding.per_shard(q="query", k_cache="cache", v_cache="cache", layer="replicated", length="batch", k_new="query",
                    v_new="query")  # under a mesh: per shard over (batch, kv heads)
def decode_full(impl: str, q, k_cache, v_cache, layer, length, k_new, v_new, window, softcap=None):
    """Decode attention over one layer of a full-precision cache with the chosen implementation.

    The kernel reads the stacked cache in place (the layer is an index it reads) and masks the sliding window;
    shapes it cannot take (`full_decode.unsupported`) and soft-capped logits run the XLA path.
    """
    if not isinstance(k_cache, jax.Array):  # a paged cache's view
        fall_back(impl, PAGED_REASON)
        return decode_full_xla(q, k_cache, v_cache, layer, length, k_new, v_new, window, softcap=softcap)
    if softcap is not None:
        fall_back(impl, SOFTCAP_REASON)
    elif use_pallas(impl):
        from kivi_jax.pallas_kernels import full_decode

        reason = full_decode.unsupported(q.shape[-1], k_cache.shape[-2])
        if pallas_target() == "tpu":
            reason = "the full-precision cache has no TPU kernel"
        if reason is None:
            return full_decode.decode(q, k_cache, v_cache, layer, length, k_new, v_new, window)
        fall_back(impl, reason)
    if softcap is None and use_native(impl, full=True):
        from kivi_jax import native

        reason = native.unsupported_full(q.dtype, q.shape[-1], k_cache.dtype)
        if reason is None:
            return native.decode_full(q, k_cache, v_cache, layer, length, k_new, v_new, window)
        fall_back(impl, reason)
    return decode_full_xla(q, k_cache, v_cache, layer, length, k_new, v_new, window, softcap=softcap)


@sharding.per_shard(q="query", k_store="cache", v_store="cache", layer="replicated", k_ring="cache", v_ring="cache",
                    length="batch", k_new="query", v_new="query", sinks="cache",
                    inv_freq="replicated")  # under a mesh: per shard over (batch, kv heads)
def decode_kivi(impl: str, q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, sinks=None,
                inv_freq=None, softcap=None):
    """Decode attention over one layer of a KIVI cache with the chosen implementation.

    Rings and sinks come stacked like the stores (`[layers, batch, kv_heads, R or S, head_dim]`, or one layer with
    `layer=None`); `inv_freq` marks a pre-RoPE cache. The Pallas kernel of the backend (`pallas_target`: TPU, Mosaic
    GPU or Triton) reads them and the stores in place and masks the sliding window. Configurations it does not serve
    (`unsupported`: the axis ablations, 8-bit codes, other group sizes or head dims; codebooks), and soft-capped logits,
    run the XLA path; every kernel reads sinks and pre-RoPE keys, the native one codebooks too. `native-int8`: the
    native kernel dots 2-bit keys and values in integers (`native.decode_kivi(..., int8_dots=True)`).
    """
    if k_ring.ndim != k_store.codes.ndim:
        raise ValueError(f"rings {k_ring.shape} must be stacked like the stores {k_store.codes.shape} (one layer each "
                         "only with layer=None)")
    if softcap is not None:
        fall_back(impl, SOFTCAP_REASON)
    elif use_pallas(impl, tpu_kernel=True) and (k_store.levels is not None or v_store.levels is not None):
        fall_back(impl, CODEBOOK_REASON)
    elif use_pallas(impl, tpu_kernel=True):
        for kernel in kivi_kernels(pallas_target()):
            reason = kernel.unsupported(q.shape[-1], k_store.bits, v_store.bits, k_store.group_size,
                                        k_ring.shape[-2], k_store.axis, v_store.axis)
            if reason is None and k_store.paged and not getattr(kernel, "PAGED", False):
                reason = PAGED_REASON
            if reason is None and k_ring.dtype != q.dtype:
                reason = f"the kernels compute in the ring's dtype: a {k_ring.dtype} ring with {q.dtype} queries"
            if reason is None:
                k_sink, v_sink = (None, None) if sinks is None else sinks
                table = {"table": k_store.table} if k_store.paged else {}  # pools read through the block table
                return kernel.decode(
                    q, k_store.codes, k_store.scale, k_store.mn, v_store.codes, v_store.scale, v_store.mn, k_ring,
                    v_ring, layer, length, k_new, v_new, k_bits=k_store.bits, v_bits=v_store.bits,
                    group_size=k_store.group_size, window=window, k_sink=k_sink, v_sink=v_sink, inv_freq=inv_freq,
                    **table,
                )
        fall_back(impl, reason)
    if softcap is None and use_native(impl):
        from kivi_jax import native

        reason = native.unsupported_kivi(q.dtype, q.shape[-1], k_store, v_store, k_ring.dtype, k_ring.shape[-2],
                                         sinks)
        int8_dots = impl == "native-int8"
        if int8_dots and not native.int8_dots():
            warnings.warn(f"attention_impl={impl!r}: {INT8_REASON}", stacklevel=2)
            int8_dots = False
        if reason is None:
            return native.decode_kivi(q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window,
                                      sinks, inv_freq, int8_dots=int8_dots)
        fall_back(impl, reason)
    k_ring, v_ring, sinks = one_layer(layer, k_ring, v_ring, sinks)
    return decode_kivi_xla(q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, sinks=sinks,
                           inv_freq=inv_freq, softcap=softcap)

