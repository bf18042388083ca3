"""Fused dequantize + attention decode over a KIVI cache on Hopper and newer GPUs: a Pallas Mosaic GPU kernel
(`plgpu.kernel`, one warpgroup a block) with the decode contract of `kivi_decode.decode`; its twin is
`kivi_decode.reference`. jax 0.11 deprecates Pallas' Triton backend; this kernel takes sm90+ (the Triton one serves
older GPUs, and configurations this one does not).

Grid (batch, kv head, split), as the Triton kernel's. Programs `split < num_splits` walk their share of the tokens
whose key and value are both quantized, 64 tokens (one WGMMA row tile) at a time; the last program reads the ring
and the last flushed key block. A tile's codes are loaded from global memory into registers in the WGMMA layout
(tokens on rows, a piece of channels on columns: `kivi_decode.pieces`), unpacked with one shift and one mask a plane,
and dequantized there (key scale and min rows broadcast down the columns, value scale and min columns, one per token,
across them); pre-RoPE keys are rotated in registers. Scores and the value sums are float32 FMAs with row and column
reductions (CUDA cores, no tensor cores: the query is at most a few rows and decode is bound by the bytes read), one
online softmax per query row. Partials `(m, l, acc)` go through the same jnp epilogue as the Triton kernel's (sinks,
the new token, the combine).

Needs jax 0.11's Mosaic GPU (reduced-layout loads and broadcasts, strided loads): on jax 0.10 `unsupported` says so
and the dispatch takes the Triton kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import flash_decoding as fd
from . import kivi_decode as kd

TILE = 64  # tokens a tile: the rows of one WGMMA register tile (one warpgroup)
KERNEL_BITS = (2, 4)  # 3-bit codes (two planes of D/4 and D/8 bytes) take the Triton kernel
MIN_JAX = (0, 11)


def _jax_version() -> tuple[int, int]:
    return tuple(int(x) for x in jax.__version__.split(".")[:2])


def unsupported(head_dim: int, k_bits: int, v_bits: int, group_size: int, residual: int, key_axis: str = "channel",
                value_axis: str = "token") -> str | None:
    """Why the kernel cannot serve this cache configuration, or None when it can."""
    if _jax_version() < MIN_JAX:
        return (f"the Mosaic GPU kernel needs jax {'.'.join(map(str, MIN_JAX))} or newer (its register layouts), not "
                f"{jax.__version__}")
    reason = kd.unsupported(head_dim, k_bits, v_bits, group_size, residual, key_axis, value_axis)
    if reason is None and (k_bits not in KERNEL_BITS or v_bits not in KERNEL_BITS):
        reason = f"the Mosaic GPU kernel handles {KERNEL_BITS}-bit codes, not k_bits={k_bits}, v_bits={v_bits}"
    if reason is None and residual % TILE:
        reason = (f"the Mosaic GPU kernel reads the ring {TILE} slots at a time: residual_length={residual} is not a "
                  "multiple")
    return reason


def _kernel(layer_g, length_g, q_g, kc_g, ks_g, km_g, vc_g, vs_g, vm_g, kr_g, vr_g, *refs, k_bits, v_bits,
            group_size, window, sinks, rope, splits, n_rep):
    inv_g, refs = (refs[0], refs[1:]) if rope else (None, refs)
    ml_g, acc_g, ml_s, acc_s = refs
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    layer, length = layer_g[0], length_g[b]
    head_dim, residual, g = q_g.shape[-1], kr_g.shape[3], group_size
    half, sm_scale = head_dim // 2, head_dim**-0.5
    k_pieces, v_pieces = kd.pieces(head_dim, k_bits), kd.pieces(head_dim, v_bits, g)
    tile_layout = plgpu.Layout.WGMMA
    token_layout, channel_layout = tile_layout.reduce(1), tile_layout.reduce(0)  # [TILE] a token, [w] a channel
    load = functools.partial(plgpu.load, optimized=False)  # straight from global memory, in the layout asked
    # every register array's layout pinned where it is made: Mosaic GPU's layout inference searches otherwise
    tiled = lambda x: plgpu.layout_cast(x, tile_layout)
    per_token = lambda x: plgpu.layout_cast(x, token_layout)
    per_channel = lambda x: plgpu.layout_cast(x, channel_layout)
    # the query rows, in pieces of every width the kernel dots with (columns of a tile)
    widths = {pc.width for pc in k_pieces} | {half if rope else head_dim}  # the ring's: halves or whole rows
    q = {(r, c, w): load(q_g.at[b, h, r, pl.ds(c, w)], layout=channel_layout)
         for r in range(n_rep) for w in widths for c in range(0, head_dim, w)}

    def tile_of(ref, t0, c0, w):
        """`[TILE, w]` of `ref[layer, b, h]` (token rows from t0, columns from c0) in the tile layout."""
        return load(ref.at[layer, b, h, pl.ds(t0, TILE), pl.ds(c0, w)], layout=tile_layout)

    def unpack(codes_at, piece):
        out = 0
        for byte, shift, mask, weight in piece.planes:
            out = out + (((codes_at(byte, piece.width).astype(jnp.int32) >> shift) & mask) << weight)
        return tiled(out.astype(jnp.float32))

    def rows_iota(t0):
        return per_token(t0 + plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=token_layout))

    def group_rows(ref, t0, c0, w):
        """`[TILE, w]` key scale (or min) for the tile's tokens: the row of each token's key group."""
        row = lambda grp: load(ref.at[layer, b, h, grp, pl.ds(c0, w)], layout=channel_layout).astype(jnp.float32)
        first = lax.div(t0, g)
        out = tiled(jnp.broadcast_to(row(first)[None, :], (TILE, w)))
        for j in range(1, max(TILE // g, 1)):  # G = 32: the tile's second group
            later = plgpu.broadcasted_iota(jnp.int32, (TILE, w), 0, layout=tile_layout) >= j * g
            out = tiled(jnp.where(later, tiled(jnp.broadcast_to(row(first + j)[None, :], (TILE, w))), out))
        return out

    def dots(keys, pos):
        """Scores `[TILE]` of each query row against keys given as float32 pieces `[TILE, w]` in channel order at
        positions `pos() [TILE]` (rotated first when pre-RoPE: pieces i and i + n/2 are RoPE's halves). A function:
        a value left unused confuses Mosaic GPU's layout inference (it searched for minutes)."""
        if rope:
            n, w = len(keys) // 2, keys[0].shape[1]
            rotated = []
            for x1, x2, c0 in zip(keys[:n], keys[n:], range(0, half, w)):
                freq = load(inv_g.at[pl.ds(c0, w)], layout=channel_layout)
                angle = tiled(pos().astype(jnp.float32)[:, None] * freq[None, :])
                cos, sin = tiled(jnp.cos(angle)), tiled(jnp.sin(angle))
                rotated.append((c0, tiled(x1 * cos - x2 * sin)))
                rotated.append((c0 + half, tiled(x2 * cos + x1 * sin)))
        else:
            rotated = list(zip(range(0, head_dim, keys[0].shape[1]), keys))
        return [per_token(sum(per_token(jnp.sum(tiled(k * q[(r, c0, k.shape[1])][None, :]), axis=1))
                              for c0, k in rotated) * sm_scale) for r in range(n_rep)]

    def quantized_keys(codes_ref, scales_t0, t0):
        """Dequantized key pieces `[TILE, w]` of the code rows from t0 (their groups' scales from token scales_t0)."""
        codes_at = lambda byte, w: tile_of(codes_ref, t0, byte, w)
        return [tiled(unpack(codes_at, pc) * group_rows(ks_g, scales_t0, pc.first, pc.width)
                      + group_rows(km_g, scales_t0, pc.first, pc.width)) for pc in k_pieces]

    def update(state, scores, values):
        """One online-softmax step a query row: `scores` `[TILE]` each (-inf where masked), `values(p)` -> the
        value sums `{first channel: [w]}` of its probabilities."""
        out = []
        for (m, l, acc), sc in zip(state, scores):
            m_new = jnp.maximum(m, jnp.max(sc))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = per_token(jnp.exp(sc - m_safe))
            add = values(p)
            out.append((m_new, l * alpha + jnp.sum(p), {c: per_channel(a * alpha + add[c]) for c, a in acc.items()}))
        return out

    lo, main_end = kd.segment_bounds(length, residual, window)
    if sinks:
        lo = jnp.maximum(lo, sinks)

    def empty(pieces_at):
        zero = lambda w: plgpu.layout_cast(jnp.zeros((w,), jnp.float32), channel_layout)
        return [(jnp.float32(-jnp.inf), jnp.float32(0.0), {c: zero(w) for c, w in pieces_at}) for _ in range(n_rep)]

    def write(state):
        for r, (m, l, acc) in enumerate(state):
            ml_s[0, r] = plgpu.layout_cast(jnp.full((16,), m, jnp.float32), channel_layout)
            ml_s[1, r] = plgpu.layout_cast(jnp.full((16,), l, jnp.float32), channel_layout)
            for c, a in acc.items():
                acc_s[r, pl.ds(c, a.shape[0])] = a
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ml_s, ml_g.at[b, h, s])
        plgpu.copy_smem_to_gmem(acc_s, acc_g.at[b, h, s])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(s < splits)
    def main_segment():
        first = lax.div(lo, TILE)
        n_tiles = jnp.maximum(lax.div(main_end + TILE - 1, TILE) - first, 0)
        per_split = lax.div(n_tiles + splits - 1, splits)
        mine = jnp.clip(n_tiles - s * per_split, 0, per_split)
        start = first + s * per_split

        def body(i, state):
            t0 = (start + i) * TILE
            pos = rows_iota(t0)
            valid = (pos >= lo) & (pos < main_end)
            scores = [per_token(jnp.where(valid, sc, -jnp.inf))
                      for sc in dots(quantized_keys(kc_g, t0, t0), lambda: pos)]

            def values(p):
                out = {}
                for pc in v_pieces:
                    grp = pc.first // g  # the piece's channel group: a scale and a min a token
                    column = lambda ref: tiled(jnp.broadcast_to(load(ref.at[layer, b, h, pl.ds(t0, TILE), grp],
                                                                     layout=token_layout).astype(jnp.float32)[:, None],
                                                                (TILE, pc.width)))
                    v = tiled(unpack(lambda byte, w: tile_of(vc_g, t0, byte, w), pc) * column(vs_g) + column(vm_g))
                    out[pc.first] = per_channel(jnp.sum(tiled(p[:, None] * v), axis=0))
                return out

            return update(state, scores, values)

        write(lax.fori_loop(0, mine, body, empty([(pc.first, pc.width) for pc in v_pieces])))

    @pl.when(s == splits)
    def residual_segment():
        flushed_row = jnp.maximum(lax.div(length, residual) - 1, 0) * residual

        def body(c, state):
            slot0 = c * TILE
            slots = rows_iota(slot0)
            tok, quantized = (per_token(x) for x in kd.ring_slot_tokens(length, slots, residual))
            row = flushed_row + slot0
            s_quant = dots(quantized_keys(kc_g, row, row), lambda: rows_iota(row))
            if rope:
                ring = [tiled(tile_of(kr_g, slot0, i * half, half).astype(jnp.float32)) for i in range(2)]
            else:
                ring = [tiled(tile_of(kr_g, slot0, 0, head_dim).astype(jnp.float32))]
            s_ring = dots(ring, lambda: jnp.maximum(tok, 0))
            scores = [per_token(jnp.where(tok >= lo, jnp.where(quantized, sq, sr), -jnp.inf))
                      for sq, sr in zip(s_quant, s_ring)]
            v = tiled(tile_of(vr_g, slot0, 0, head_dim).astype(jnp.float32))
            return update(state, scores, lambda p: {0: per_channel(jnp.sum(tiled(p[:, None] * v), axis=0))})

        write(lax.fori_loop(0, residual // TILE, body, empty([(0, head_dim)])))


def partials(q_rows, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, *, k_bits,
             v_bits, group_size, window, n_rep, sinks=0, inv_freq=None, num_splits=None):
    """The kernel's partials `(m, l, acc)` `[batch, kv_heads, splits + 1, rows(, head_dim)]` (the last split: the
    residual segment) for float32 queries `q_rows [batch, kv_heads, rows, head_dim]` of which the first n_rep are
    real."""
    _, batch, kv_heads, max_tokens, _ = k_codes.shape
    rows, head_dim = q_rows.shape[2:]
    splits = num_splits or fd.num_splits(batch, kv_heads, max(max_tokens // TILE, 1))
    rope = inv_freq is not None
    kernel = functools.partial(_kernel, k_bits=k_bits, v_bits=v_bits, group_size=group_size, window=window,
                               sinks=sinks, rope=rope, splits=splits, n_rep=n_rep)
    operands = [fd.layer_operand(layer), length.astype(jnp.int32), q_rows, k_codes, k_scale, k_mn, v_codes, v_scale,
                v_mn, k_ring, v_ring] + ([inv_freq.astype(jnp.float32)] if rope else [])
    ml, acc = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, 2, rows, 16), jnp.float32),
                  jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows, head_dim), jnp.float32)],
        scratch_types=[plgpu.SMEM((2, rows, 16), jnp.float32), plgpu.SMEM((rows, head_dim), jnp.float32)],
        grid=(batch, kv_heads, splits + 1),
        grid_names=("b", "h", "s"),
    )(*operands)
    return ml[..., 0, :, 0], ml[..., 1, :, 0], acc


def decode(q, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, k_new, v_new, *,
           k_bits: int, v_bits: int, group_size: int, window: int | None = None, k_sink=None, v_sink=None,
           inv_freq=None, num_splits: int | None = None, interpret=None) -> jax.Array:
    """Decode attention over one layer of a KIVI cache with the Mosaic GPU kernel: `kivi_decode.decode`'s arguments
    and result. float32 arithmetic throughout. No interpret mode (jax's Mosaic GPU interpreter cannot run these
    loads): `interpret` must be None or False."""
    if interpret:
        raise ValueError("the Mosaic GPU kernel has no interpret mode here; use kivi_decode (Triton) or "
                         "kivi_decode_tpu in interpret mode on a CPU")
    window = fd.static_window(window)
    arrays = [fd.stacked(x, layer) for x in (k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring)]
    kv_heads, head_dim = arrays[0].shape[2], q.shape[-1]
    n_rep = q.shape[2] // kv_heads
    q_rows = fd.grouped_queries(q, kv_heads, -(-n_rep // 8) * 8)  # whole 32-byte rows for the output copies
    partial = partials(q_rows, *arrays, layer, length, k_bits=k_bits, v_bits=v_bits, group_size=group_size,
                       window=window, n_rep=n_rep, sinks=kd.num_sinks(k_sink), inv_freq=inv_freq,
                       num_splits=num_splits)
    m, l, acc = kd.with_sinks(partial, q_rows, k_sink, v_sink, layer, length, window, inv_freq)
    return fd.combine(m, l, acc, q, k_new, v_new, head_dim**-0.5, q.dtype)
