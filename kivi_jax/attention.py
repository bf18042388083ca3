"""Decode attention over a cache: the blockwise XLA path (online softmax over token blocks) and the dispatch that
picks the Pallas kernel on GPU.

Every decode function answers one new query token per sequence against what the cache holds plus the token's own
key and value, which the caller passes in full precision. Shapes: q `[batch, 1, q_heads, head_dim]` (GQA: query head
`h * n_rep + r` reads kv head `h`); cache tensors stacked `[layers, batch, kv_heads, tokens, ...]` and read one
block of one layer at a time (`layer=None` takes tensors that hold one layer already).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kivi_jax import sharding

BLOCK_TOKENS = 256  # tokens per block of the XLA path's loop (fastest on the 2-core CPU, see docs/benchmarks.md)


# ---------------------------------------------------------------------------------------------------------------------
# Reading one layer without copying it


def layer_tokens(a: jax.Array, layer, start, size: int) -> jax.Array:
    """Token rows `[start, start + size)` of one layer: `a [layers, batch, kv_heads, tokens, X]` (or without the
    layer axis when `layer` is None) -> `[batch, kv_heads, size, X]`."""
    if layer is None:
        return jax.lax.dynamic_slice_in_dim(a, start, size, axis=-2)
    sizes = (1,) + a.shape[1:3] + (size, a.shape[4])
    return jax.lax.dynamic_slice(a, (layer, 0, 0, start, 0), sizes)[0]


def gather_tokens(a: jax.Array, layer, rows: jax.Array) -> jax.Array:
    """Token rows `rows [batch, n]` of one layer, per sequence -> `[batch, kv_heads, n, X]`."""
    batch = rows.shape[0]
    a = a if layer is None else a[layer]  # a gather of a gather: XLA reads only the rows
    got = a[jnp.arange(batch)[:, None], :, rows]  # [batch, n, kv_heads, X]
    return jnp.moveaxis(got, 1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Online softmax


class Softmax(NamedTuple):
    """Online-softmax state for `[batch, kv_heads, n_rep]` query rows."""

    m: jax.Array  # [batch, kv_heads, n_rep] running max (-inf before any score)
    l: jax.Array  # [batch, kv_heads, n_rep] running sum of exp(score - m)
    acc: jax.Array  # [batch, kv_heads, n_rep, head_dim] running sum of exp(score - m) * value

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
        return self.acc / self.l[..., None]


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """`[batch, 1, q_heads, head_dim]` -> float32 `[batch, kv_heads, n_rep, head_dim]`, scaled by 1/sqrt(head_dim)."""
    batch, _, q_heads, head_dim = q.shape
    return (q[:, 0].astype(jnp.float32) * head_dim**-0.5).reshape(batch, kv_heads, q_heads // kv_heads, head_dim)


def ungroup(out: jax.Array, dtype) -> jax.Array:
    """`[batch, kv_heads, n_rep, head_dim]` -> `[batch, 1, q_heads, head_dim]` in `dtype`."""
    batch, kv_heads, n_rep, head_dim = out.shape
    return out.reshape(batch, 1, kv_heads * n_rep, head_dim).astype(dtype)


def token_mask(pos: jax.Array, end: jax.Array, query_pos: jax.Array, window: int | None, begin=None) -> jax.Array:
    """`[batch, tokens]`: positions `pos [tokens]` in `[begin, end)` (per sequence) and inside the sliding window."""
    valid = pos[None, :] < end[:, None]
    if begin is not None:
        valid &= pos[None, :] >= begin
    if window is not None:
        valid &= query_pos[:, None] - pos[None, :] < window
    return valid


def masked(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Scores `[batch, kv_heads, n_rep, tokens]` with invalid tokens `[batch, tokens]` set to -inf."""
    return jnp.where(valid[:, None, None, :], scores, -jnp.inf)


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


def add_new_token(state: Softmax, q: jax.Array, k_new: jax.Array, v_new: jax.Array) -> Softmax:
    """Adds the query token's own key and value `[batch, 1, kv_heads, head_dim]` (always visible, full precision)."""
    k = k_new[:, 0].astype(jnp.float32)  # [batch, kv_heads, head_dim]
    v = v_new[:, 0].astype(jnp.float32)
    scores = jnp.einsum("bhrd,bhd->bhr", q, k)[..., None]
    return state.update(scores, lambda p: p * v[:, :, None, :])


def block_size(num_tokens: int, multiple: int = 1, block: int = BLOCK_TOKENS) -> int:
    """The loop's block: at most `block` tokens and all of a short cache, a multiple of `multiple` (G)."""
    block = min(block, num_tokens)
    return block - block % multiple


# ---------------------------------------------------------------------------------------------------------------------
# Full precision


def decode_full_xla(q, k_cache, v_cache, layer, length, k_new, v_new, window, block: int = BLOCK_TOKENS) -> jax.Array:
    """Decode attention over one layer of a full-precision cache `[(layers,) batch, kv_heads, tokens, head_dim]` that
    holds `length [batch]` tokens; k_new/v_new `[batch, 1, kv_heads, head_dim]` sit at position `length`.
    Returns `[batch, 1, q_heads, head_dim]` in q's dtype."""
    kv_heads, num_tokens = k_cache.shape[-3], k_cache.shape[-2]
    qg = group_queries(q, kv_heads)  # [batch, kv_heads, n_rep, head_dim]
    block = block_size(num_tokens, 1, block)

    def step(state: Softmax, start, first_new) -> Softmax:
        kb = layer_tokens(k_cache, layer, start, block)  # [batch, kv_heads, block, head_dim]
        vb = layer_tokens(v_cache, layer, start, block)
        valid = token_mask(start + jnp.arange(block), length, length, window, begin=first_new)
        scores = masked(jnp.einsum("bhrd,bhtd->bhrt", qg, kb, preferred_element_type=jnp.float32), valid)
        return state.update(
            scores, lambda p: jnp.einsum("bhrt,bhtd->bhrd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        )

    state = blockwise(Softmax.empty(qg), num_tokens, block, length, step)
    state = add_new_token(state, qg, k_new, v_new)
    return ungroup(state.result(), q.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# KIVI: scores and weighted values straight from codes, scales and mins folded in (never a dequantized cache)


def unpack_codes(store) -> jax.Array:
    """float32 `[batch, kv_heads, tokens, head_dim]`: a store block's codes in channel order, in one fused loop.

    The shifts and masks run on 32-bit words of four packed bytes (SWAR): shifting a word right by `bits * i` and
    masking every byte leaves slab i's codes of those four bytes in place, and the words read back as bytes lay the
    slabs out as `[p, D/p]`, which is channel order for planar packing; no concatenation, no byte-wide variable
    shifts (both are slow loops on XLA:CPU; see docs/benchmarks.md). Rows of D/p bytes not a multiple of 4 use
    16-bit or 8-bit words.
    """
    codes, bits = store.codes, store.bits
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


def quantized_scores(q: jax.Array, store) -> jax.Array:
    """q `[batch, kv_heads, n_rep, head_dim]` against the keys of a store block -> `[batch, kv_heads, n_rep, tokens]`.

    Per-channel keys fold their scale into q (one scaled q per token group); per-token keys scale the partial dots
    of each channel group.
    """
    codes = unpack_codes(store)  # [batch, kv_heads, tokens, head_dim]
    batch, kv_heads, tokens, head_dim = codes.shape
    g = store.group_size
    scale, mn = store.scale.astype(jnp.float32), store.mn.astype(jnp.float32)
    if store.axis == "channel":  # scale, mn [batch, kv_heads, tokens // G, head_dim]
        q_scaled = q[:, :, :, None, :] * scale[:, :, None]  # [batch, kv_heads, n_rep, groups, head_dim]
        grouped = codes.reshape(batch, kv_heads, tokens // g, g, head_dim)
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


def quantized_values(p: jax.Array, store) -> jax.Array:
    """Probabilities `[batch, kv_heads, n_rep, tokens]` times a store block's values -> `[..., n_rep, head_dim]`.

    Per-token values fold their scale into p (one scaled p per channel group); per-channel values scale the partial
    sums of each token group.
    """
    codes = unpack_codes(store)  # [batch, kv_heads, tokens, head_dim]
    batch, kv_heads, tokens, head_dim = codes.shape
    g = store.group_size
    scale, mn = store.scale.astype(jnp.float32), store.mn.astype(jnp.float32)
    if store.axis == "token":  # scale, mn [batch, kv_heads, tokens, head_dim // G]
        mins = jnp.repeat(jnp.einsum("bhrt,bhtg->bhrg", p, mn), g, axis=-1)  # [batch, kv_heads, n_rep, head_dim]
        pieces = [
            jnp.einsum("bhrt,bhtj->bhrj", p * scale[:, :, None, :, i], codes[..., i * g : (i + 1) * g])
            for i in range(head_dim // g)
        ]
        return jnp.concatenate(pieces, axis=-1) + mins
    # per-channel: scale, mn [batch, kv_heads, tokens // G, head_dim]
    pg = p.reshape(p.shape[:3] + (tokens // g, g))  # [batch, kv_heads, n_rep, groups, G]
    acc = jnp.einsum("bhrg,bhgd->bhrd", pg.sum(-1), mn)
    sums = jnp.einsum("bhrgt,bhgtd->bhrgd", pg, codes.reshape(batch, kv_heads, tokens // g, g, head_dim))
    return acc + jnp.einsum("bhrgd,bhgd->bhrd", sums, scale)


def ring_tokens(length: jax.Array, residual: int) -> jax.Array:
    """`[batch, R]`: the token each ring slot holds once `length` tokens are in (the newest t < length with
    t % R == slot); negative where the slot was never written."""
    last = length[:, None] - 1
    return last - jnp.mod(last - jnp.arange(residual)[None, :], residual)


def window_tensor(store, layer, ring: jax.Array, held: jax.Array, length: jax.Array) -> jax.Array:
    """float32 `[batch, kv_heads, R, head_dim]`: what attention sees for each ring slot's token `held [batch, R]`.

    The ring's own entry, unless the token is already quantized (a per-channel store's last flushed block), in which
    case its dequantized value: ring slot s and row s of that R-block hold the same token.
    """
    residual = ring.shape[2]
    ring = ring.astype(jnp.float32)
    if store.axis == "token":  # a per-token store quantizes a token exactly when it leaves the ring
        return ring
    end = store.quantized_end(length, residual)  # [batch]
    rows = jnp.maximum(end - residual, 0)[:, None] + jnp.arange(residual)[None, :]
    block = store.gather_rows(layer, rows).dequantize()  # [batch, kv_heads, R, head_dim]
    return jnp.where((held < end[:, None])[:, None, :, None], block, ring)


def decode_kivi_xla(
    q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, block: int = BLOCK_TOKENS
) -> jax.Array:
    """Decode attention over one layer of a KIVI cache (docs/design.md §3), blockwise with an online softmax.

    Three segments: tokens whose key and value are both quantized (walked in blocks, scales folded into q and p);
    the newest up-to-R tokens (ring, or the last flushed key block); the new token itself (full precision).
    Stores are stacked over layers (or one layer with `layer=None`); rings `[batch, kv_heads, R, head_dim]`.
    Returns `[batch, 1, q_heads, head_dim]` in q's dtype.
    """
    kv_heads, num_tokens = k_store.codes.shape[-3], k_store.codes.shape[-2]
    residual = k_ring.shape[2]
    qg = group_queries(q, kv_heads)
    main_end = jnp.minimum(k_store.quantized_end(length, residual), v_store.quantized_end(length, residual))
    block = block_size(num_tokens, max(k_store.group_size, v_store.group_size), block)  # whole per-channel groups

    def step(state: Softmax, start, first_new) -> Softmax:
        kb = k_store.token_slice(start, block, layer)
        vb = v_store.token_slice(start, block, layer)
        valid = token_mask(start + jnp.arange(block), main_end, length, window, begin=first_new)
        scores = masked(quantized_scores(qg, kb), valid)
        return state.update(scores, lambda p: quantized_values(p, vb))

    state = blockwise(Softmax.empty(qg), num_tokens, block, main_end, step)

    held = ring_tokens(length, residual)  # [batch, R]
    k_win = window_tensor(k_store, layer, k_ring, held, length)
    v_win = window_tensor(v_store, layer, v_ring, held, length)
    valid = (held >= main_end[:, None]) & (held >= 0)
    if window is not None:
        valid &= length[:, None] - held < window
    scores = masked(jnp.einsum("bhrd,bhtd->bhrt", qg, k_win), valid)
    state = state.update(scores, lambda p: jnp.einsum("bhrt,bhtd->bhrd", p, v_win))
    state = add_new_token(state, qg, k_new, v_new)
    return ungroup(state.result(), q.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch


def use_pallas(impl: str) -> bool:
    """`auto` takes the Pallas kernel on a GPU backend and the XLA path elsewhere."""
    if impl == "auto":
        return jax.default_backend() == "gpu"
    return impl == "pallas"


def fall_back(impl: str, reason: str) -> None:
    """The kernel cannot serve this cache: say so when the caller forced `pallas` (`auto` falls back quietly)."""
    if impl == "pallas":
        warnings.warn(f"attention_impl='pallas': {reason}; using the XLA path", stacklevel=3)


@sharding.per_shard(q="query", k_cache="cache", v_cache="cache", layer="replicated", length="batch", k_new="query",
                    v_new="query")  # under a mesh: per shard over (batch, kv heads)
def decode_full(impl: str, q, k_cache, v_cache, layer, length, k_new, v_new, window):
    """Decode attention over one layer of a full-precision cache with the chosen implementation.

    The kernel reads the stacked cache in place (the layer is an index it reads) and masks the sliding window;
    shapes it cannot take (`full_decode.unsupported`) run the XLA path.
    """
    if use_pallas(impl):
        from kivi_jax.pallas_kernels import full_decode

        reason = full_decode.unsupported(q.shape[-1], k_cache.shape[-2])
        if reason is None:
            return full_decode.decode(q, k_cache, v_cache, layer, length, k_new, v_new, window)
        fall_back(impl, reason)
    return decode_full_xla(q, k_cache, v_cache, layer, length, k_new, v_new, window)


@sharding.per_shard(q="query", k_store="cache", v_store="cache", layer="replicated", k_ring="cache", v_ring="cache",
                    length="batch", k_new="query", v_new="query")  # under a mesh: per shard over (batch, kv heads)
def decode_kivi(impl: str, q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window):
    """Decode attention over one layer of a KIVI cache with the chosen implementation.

    Rings come stacked like the stores (`[layers, batch, kv_heads, R, head_dim]`, or one layer with `layer=None`).
    The kernel reads them and the stores in place and masks the sliding window. Configurations it does not serve
    (`kivi_decode.unsupported`: the axis ablations, 8-bit codes, other group sizes or head dims) run the XLA path.
    """
    if k_ring.ndim != k_store.codes.ndim:
        raise ValueError(f"rings {k_ring.shape} must be stacked like the stores {k_store.codes.shape} (one layer each "
                         "only with layer=None)")
    if use_pallas(impl):
        from kivi_jax.pallas_kernels import kivi_decode

        reason = kivi_decode.unsupported(q.shape[-1], k_store.bits, v_store.bits, k_store.group_size,
                                         k_ring.shape[-2], k_store.axis, v_store.axis)
        if reason is None:
            return kivi_decode.decode(
                q, k_store.codes, k_store.scale, k_store.mn, v_store.codes, v_store.scale, v_store.mn, k_ring, v_ring,
                layer, length, k_new, v_new, k_bits=k_store.bits, v_bits=v_store.bits,
                group_size=k_store.group_size, window=window,
            )
        fall_back(impl, reason)
    if layer is not None:
        k_ring, v_ring = k_ring[layer], v_ring[layer]
    return decode_kivi_xla(q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window)
