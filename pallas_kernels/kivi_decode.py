"""Fused dequantize + attention decode over a KIVI cache: a flash-decoding Pallas kernel and its pure-jnp twin.

The cache (docs/design.md §2), stacked over layers, read in place (the layer is an index the kernel reads, never a slice):
- keys per-channel: codes `[layers, batch, kv_heads, tokens, D * bits / 8]` uint8 planar-packed, scale/min
  `[layers, batch, kv_heads, tokens // G, D]`; quantized for tokens `[0, (length // R) * R)`;
- values per-token: codes `[layers, batch, kv_heads, tokens, D * bits / 8]`, scale/min `[layers, batch, kv_heads,
  tokens, D // G]`; quantized for tokens `[0, max(length - R, 0))`;
- rings `[layers, batch, kv_heads, R, D]` in the compute dtype, token t in slot t % R.

Grid (batch, kv head, split). Programs `split < num_splits` walk their share of the tokens whose key and value are
both quantized, `tokens_per_step` at a time: they load packed codes and scales, unpack each planar slab with one
shift and one mask, fold the scales into the query (keys: `q·k_t = Σ_d (q_d s_gd) c_td + Σ_d q_d m_gd`) and into the
probabilities (values: `Σ_t p_t v_td = Σ_t (p_t s_tg) c_td + Σ_t p_t m_tg`), score all n_rep query heads of the kv
head at once (rows padded to 16 for the dot) and keep an online softmax in float32. The last program of each
(batch, kv head) reads the residual segment: the newest up-to-R tokens, keys from the ring or, for those already
flushed, from the last quantized key block, values from the ring. A small jnp epilogue (`combine`) merges the
partials with the new token's own key and value. Per-sequence lengths and the sliding window are masked; blocks
wholly outside the window are skipped.

Beyond KIVI (docs/kernels.md): 3-bit codes are a 2-bit plane then a 1-bit plane in one row (`3D/8` bytes); the
kernel reads them in the 2-bit plane's slabs, the high bits by a gather load and a per-column shift. Pre-RoPE keys
(`inv_freq` given) are dequantized per block, rotated in registers by their positions (slab i and slab i + slabs/2
are RoPE's two halves) and dotted with the query; the ring's keys likewise. Sink tokens `[0, S)` are left out of
the kernel's segments and attended in full precision in the jnp epilogue (`sink_partial`).

Paged (`table` given, kivi_jax/paged.py): the stores are pools `[layers, pages, kv_heads, R or R / G, ...]`, one
R-token block a page, and sequence b's token t lies in page `table [batch, pages_per_seq][b, t // R]`, row `t % R`.
The same programs read each G-token group through the table (steps divide R, so a group never spans pages) with
masked loads: only the rows they attend, never an entry that holds no page (one equal to the page count), and rows of
a held page a sequence has not written yet (which may hold anything, NaN included) read as zeros.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import flash_decoding as fd

fd.silence_triton_deprecation()  # Triton is our choice here, not the user's

KERNEL_BITS = (2, 3, 4)
PLANES = {2: (2,), 3: (2, 1), 4: (4,)}  # bits of each packed plane, low bits first: kivi_jax/quant.py's PLANES
KERNEL_GROUPS = (32, 64, 128)
TOKENS_PER_STEP = 64  # tokens a main program reads per loop step (whole key groups)
NUM_WARPS = 4
NUM_STAGES = 2
PAGED = True  # `decode(..., table=...)` reads pools through a block table (kivi_jax/attention.py hands it one)


def unsupported(head_dim: int, k_bits: int, v_bits: int, group_size: int, residual: int, key_axis: str = "channel",
                value_axis: str = "token", codebook: bool = False) -> str | None:
    """Why the kernel cannot serve this cache configuration, or None when it can (`codebook`: keys or values have
    non-uniform codes)."""
    if codebook:
        return "the Pallas kernel reads uniform codes only, not non-uniform codebooks (-nuqk/-nuqv)"
    if (key_axis, value_axis) != ("channel", "token"):
        return f"only KIVI's axes (keys per-channel, values per-token) have a kernel, not {key_axis}/{value_axis}"
    if k_bits not in KERNEL_BITS or v_bits not in KERNEL_BITS:
        return f"the kernel handles {KERNEL_BITS}-bit codes, not k_bits={k_bits}, v_bits={v_bits}"
    if group_size not in KERNEL_GROUPS:
        return f"the kernel handles group sizes {KERNEL_GROUPS}, not {group_size}"
    if head_dim not in (64, 128):
        return f"the kernel handles head_dim 64 and 128, not {head_dim}"
    if head_dim % group_size:
        return f"group_size={group_size} does not divide head_dim={head_dim} (values are grouped along channels)"
    if residual % group_size:
        return f"residual_length={residual} is not a multiple of group_size={group_size}"
    return None


def step_tokens(max_tokens: int, group_size: int, tokens_per_step: int = TOKENS_PER_STEP) -> int:
    """Tokens per main-loop step: whole key groups, a power of two dividing the cache (so no read runs past it)."""
    return group_size * fd.largest_pow2_block(max_tokens // group_size, max(tokens_per_step // group_size, 1))


def slab_width(head_dim: int, bits: int) -> int:
    """Channels of one slab of the first (low-bits) plane: `head_dim / (codes a byte)`. Slab i holds channels
    `[i * width, (i + 1) * width)`; slabs i and i + slabs/2 hold the two halves RoPE pairs."""
    return head_dim * PLANES[bits][0] // 8


def value_pieces(head_dim: int, bits: int, group_size: int) -> list[tuple[int, int, int, int]]:
    """Value channel ranges lying in one planar slab and one per-token group, in channel order:
    (first channel, slab, first byte column, width)."""
    width = slab_width(head_dim, bits)
    piece = min(width, group_size)
    return [(c, c // width, c % width, piece) for c in range(0, head_dim, piece)]


class Piece(NamedTuple):
    """Channels `[first, first + width)` whose codes lie in one slab of every packed plane:
    `codes = Σ_planes ((row[byte : byte + width] >> shift) & mask) << weight`."""

    first: int
    width: int
    planes: tuple[tuple[int, int, int, int], ...]  # (byte, shift, mask, weight) a plane


def pieces(head_dim: int, bits: int, max_width: int | None = None) -> list[Piece]:
    """A row's channels in pieces, in channel order: each as wide as the narrowest slab of the planes
    (`PLANES`; planar packing: slab s of a plane of b bits holds channels `[s*w, (s+1)*w)`,
    `w = D*b/8`, in bits `[s*b, (s+1)*b)` of the plane's bytes), and at most `max_width`."""
    widths = [head_dim * b // 8 for b in PLANES[bits]]
    width = min(widths + ([max_width] if max_width else []))
    out = []
    for first in range(0, head_dim, width):
        planes, byte0, weight = [], 0, 0
        for b, w in zip(PLANES[bits], widths):
            planes.append((byte0 + first % w, b * (first // w), 2**b - 1, weight))
            byte0, weight = byte0 + w, weight + b
        out.append(Piece(first, width, tuple(planes)))
    return out


def split_parts(x: jax.Array, dtype) -> list[jax.Array]:
    """float32 `x` as dot inputs in `dtype`: itself in float32; a high and a low part in a 16-bit dtype, whose sum
    keeps about 16 mantissa bits (the folded key scales can be large: one rounding would cost ~1e-2 in the scores)."""
    if jnp.dtype(dtype) == jnp.float32:
        return [x]
    high = x.astype(dtype)
    return [high, (x - high.astype(jnp.float32)).astype(dtype)]


def segment_bounds(length, residual: int, window: int | None):
    """Per sequence: (first visible token, end of the both-quantized segment), docs/design.md §2's token ranges.
    pallas_kernels imports nothing of ours: this and `ring_slot_tokens` mirror kivi_jax/layout.py inside the kernel,
    and tests/test_layout.py holds them equal."""
    main_end = jnp.maximum(length - residual, 0)  # = min(keys' (len // R) * R, values' max(len - R, 0))
    return window_start(length, window), main_end


def window_start(length, window: int | None):
    """The first token the new token at `length` sees through the sliding window (0 without one)."""
    return jnp.zeros_like(length) if window is None else jnp.maximum(length - window + 1, 0)


def ring_slot_tokens(length, slots, residual: int):
    """The token each ring slot holds once `length` tokens are in (negative: never written), and whether its key
    is already quantized (it sits in the last flushed key block, row `(length // R - 1) * R + slot`)."""
    full, filled = length // residual, length % residual
    tok = jnp.where(slots < filled, full * residual + slots, (full - 1) * residual + slots)
    return tok, slots >= filled


# ---------------------------------------------------------------------------------------------------------------------
# Kernel


def _kernel(layer_ref, length_ref, q_ref, kc_ref, ks_ref, km_ref, vc_ref, vs_ref, vm_ref, kr_ref, vr_ref, *refs,
            k_bits, v_bits, group_size, residual, window, sinks, rope, paged, splits, step, dtype):
    extra, (m_ref, l_ref, acc_ref) = refs[:-3], refs[-3:]
    inv_ref = extra[0] if rope else None
    table_ref = extra[-1] if paged else None  # [batch, pages_per_seq] int32
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = length_ref[b]
    rows, head_dim = q_ref.shape
    g = group_size
    half = head_dim // 2
    sm_scale = head_dim**-0.5
    precision = fd.dot_precision(dtype)
    dot = functools.partial(plgpu.dot, precision=precision)
    k_low = PLANES[k_bits][0]  # bits of the first plane (3-bit codes: 2, then a 1-bit plane)
    n_slabs = 8 // k_low
    wk = slab_width(head_dim, k_bits)
    pieces = value_pieces(head_dim, v_bits, g)
    q_slabs = [q_ref[:, pl.ds(i * wk, wk)] for i in range(n_slabs)]  # [rows, D/slabs] float32 each
    q_dot = q_ref[...].astype(dtype)  # [rows, D] for the ring's keys
    if rope:  # the query in the compute dtype, cut like the rotated key pieces: slabs, and halves for the ring
        q_pieces = {w: [q_ref[:, pl.ds(c, w)].astype(dtype) for c in range(0, head_dim, w)] for w in {wk, half}}

    class At(NamedTuple):
        """Where the G store rows of tokens `[t0, t0 + G)` lie: `seq` the index on the stores' second axis (the
        sequence, or its page), `row` the first row there, `rows_ok [G]` the rows to read (None: all, contiguous)."""

        seq: jax.Array
        row: jax.Array
        rows_ok: jax.Array | None

    def at(t0, rows_ok) -> At:
        """The G rows from token t0 (`rows_ok [G]`: those attended): row t0 of sequence b, or row `t0 % R` of page
        `table[b, t0 // R]`, read only where attended and the entry holds a page."""
        if not paged:
            return At(b, t0, None)
        blk = lax.div(t0, residual)
        page = table_ref[b, blk]
        held = page < kc_ref.shape[1]  # an entry equal to the page count holds no page
        return At(jnp.where(held, page, 0), t0 - blk * residual, rows_ok & held)

    def load(ref, idx, mask, shape):
        """`ref[idx]` of `shape`; with a mask (broadcast to `shape`) a masked load, zeros where it is False."""
        if mask is None:
            return ref[idx]
        idx = tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)  # masked: a Python int index is no array
        return plgpu.load(ref.at[idx], mask=jnp.broadcast_to(mask, shape), other=0)

    def rows_mask(a: At):
        """The row mask `[G, 1]` of a `[G, width]` load (None: contiguous, all rows)."""
        return None if a.rows_ok is None else a.rows_ok[:, None]

    def group_mask(a: At):
        """Whether the key group's scale row is read: any of its rows is (None: contiguous, always)."""
        return None if a.rows_ok is None else jnp.sum(a.rows_ok.astype(jnp.int32)) > 0

    def high_bits(ref, a: At, c0, width):
        """uint8 `[G, width]`: the 1-bit plane's bit of channels `[c0, c0 + width)` of the G rows at `a` (3-bit
        codes). The plane follows the 2-bit plane's D/4 bytes; byte j holds channels j, j + D/8, ... A D/4-wide slab
        spans two of its bit slabs: a gather load of each column's byte and a per-column shift (D/8 = 8 channels at
        head_dim 64 is too narrow for a Triton dot, and Triton's Pallas backend cannot concatenate two tiles)."""
        eighth = head_dim // 8
        ch = c0 + jnp.arange(width)
        idx = (layer, a.seq, h, (a.row + jnp.arange(g))[:, None], (head_dim // 4 + ch % eighth)[None, :])
        raw = load(ref, idx, rows_mask(a), (g, width))
        return (raw >> (ch // eighth).astype(jnp.uint8)[None, :]) & 1

    def planar(first_plane, ref, a: At, slab, c0, width, bits):
        """uint8 codes `[G, width]` of channels `[c0, c0 + width)` in slab `slab`, from the loaded first-plane
        bytes: one shift and one mask, and for 3-bit codes the high bit from the 1-bit plane."""
        low = PLANES[bits][0]
        codes = (first_plane >> (low * slab)) & (2**low - 1)
        if bits == 3:
            codes = codes | (high_bits(ref, a, c0, width) << 2)
        return codes

    def key_first_plane(a: At):
        """uint8 `[G, D/slabs]`: the first plane's bytes of the G quantized keys at `a`."""
        width = wk if k_bits == 3 else kc_ref.shape[-1]  # 3-bit: the 2-bit plane; else the whole row
        return load(kc_ref, (layer, a.seq, h, pl.ds(a.row, g), pl.ds(0, width)), rows_mask(a), (g, width))

    def key_group(a: At, ref, i):
        """float32 `[D/pk]`: slab i's channels of the scale or min row of the key group at `a`."""
        return load(ref, (layer, a.seq, h, lax.div(a.row, g), pl.ds(i * wk, wk)), group_mask(a), (wk,)).astype(
            jnp.float32)

    def key_scores(a: At):
        """Scores `[rows, G]` of the G quantized keys at `a` (one key group), scales folded into q."""
        first_plane = key_first_plane(a)
        scores = jnp.zeros((rows, g), jnp.float32)
        bias = jnp.zeros((rows,), jnp.float32)
        for i in range(n_slabs):
            scale, mn = key_group(a, ks_ref, i), key_group(a, km_ref, i)  # [D/pk]
            slab = planar(first_plane, kc_ref, a, i, i * wk, wk, k_bits).astype(dtype)  # channels [i*wk, (i+1)*wk)
            for part in split_parts(q_slabs[i] * (scale * sm_scale)[None, :], dtype):
                scores = scores + dot(part, slab, trans_b=True)
            bias = bias + jnp.sum(q_slabs[i] * mn[None, :], axis=1)
        return scores + (bias * sm_scale)[:, None]

    def rotated_scores(firsts, seconds, pos):
        """Scores `[rows, G]` of G pre-RoPE keys given as float32 pieces `[G, w]`: firsts[i] channels `[i*w, (i+1)*w)`,
        seconds[i] their RoPE partners `+ D/2`; rotated here by the tokens' positions `pos [G]` (Llama's half split:
        `[x1 cos - x2 sin, x2 cos + x1 sin]`, angle `pos * inv_freq`), then dotted with the query."""
        w = firsts[0].shape[1]
        scores = jnp.zeros((rows, g), jnp.float32)
        for i, (x1, x2) in enumerate(zip(firsts, seconds)):
            angle = pos.astype(jnp.float32)[:, None] * inv_ref[pl.ds(i * w, w)][None, :]  # [G, w]
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            for j, key in ((i, x1 * cos - x2 * sin), (i + len(firsts), x2 * cos + x1 * sin)):
                for part in split_parts(key, dtype):
                    scores = scores + dot(q_pieces[w][j], part, trans_b=True)
        return scores * sm_scale

    def rotated_key_scores(a: At, t0):
        """Scores `[rows, G]` of the G quantized pre-RoPE keys at `a` (tokens from t0): dequantized, rotated,
        dotted."""
        first_plane = key_first_plane(a)
        keys = []
        for i in range(n_slabs):
            scale, mn = key_group(a, ks_ref, i), key_group(a, km_ref, i)  # [D/pk]
            codes = planar(first_plane, kc_ref, a, i, i * wk, wk, k_bits)
            keys.append(codes.astype(jnp.float32) * scale[None, :] + mn[None, :])  # [G, D/pk]
        return rotated_scores(keys[: n_slabs // 2], keys[n_slabs // 2 :], t0 + jnp.arange(g))

    def quantized_key_scores(t0, rows_ok):
        """Scores `[rows, G]` of the G quantized keys from token t0 (`rows_ok [G]`: those attended)."""
        a = at(t0, rows_ok)
        return rotated_key_scores(a, t0) if rope else key_scores(a)

    def add_quantized_values(acc, p, t0, rows_ok):
        """acc pieces + p `[rows, G]` times the G quantized values from token t0 (`rows_ok [G]`: those attended),
        scales folded into p."""
        acc = list(acc)
        a = at(t0, rows_ok)
        for j, (ch, slab_i, col, width) in enumerate(pieces):
            codes = load(vc_ref, (layer, a.seq, h, pl.ds(a.row, g), pl.ds(col, width)), rows_mask(a),
                         (g, width))  # [G, width] uint8
            scale = load(vs_ref, (layer, a.seq, h, pl.ds(a.row, g), ch // g), a.rows_ok, (g,)).astype(jnp.float32)
            mn = load(vm_ref, (layer, a.seq, h, pl.ds(a.row, g), ch // g), a.rows_ok, (g,)).astype(jnp.float32)
            slab = planar(codes, vc_ref, a, slab_i, ch, width, v_bits).astype(dtype)
            acc[j] = acc[j] + dot((p * scale[None, :]).astype(dtype), slab) + jnp.sum(p * mn[None, :], axis=1)[:, None]
        return tuple(acc)

    lo, main_end = segment_bounds(length, residual, window)
    if sinks:  # tokens [0, S) are read from the sinks (the combine epilogue), never from codes or ring
        lo = jnp.maximum(lo, sinks)

    # Main segment: this split's share of the steps covering [lo, main_end).
    first = lax.div(lo, step)
    n_steps = jnp.maximum(lax.div(main_end + step - 1, step) - first, 0)
    per_split = lax.div(n_steps + splits - 1, splits)
    mine = jnp.where(s < splits, jnp.clip(n_steps - s * per_split, 0, per_split), 0)
    start = first + s * per_split

    def main_step(i, carry):
        m, l, acc = carry
        t_step = (start + i) * step
        scores, valids = [], []
        for j in range(step // g):
            t0 = t_step + j * g
            pos = t0 + jnp.arange(g)
            valids.append((pos >= lo) & (pos < main_end))  # [G]
            scores.append(jnp.where(valids[j][None, :], quantized_key_scores(t0, valids[j]), -jnp.inf))
        m, alpha, probs, l = fd.online_update(m, l, scores)
        acc = tuple(a * alpha[:, None] for a in acc)
        for j, p in enumerate(probs):
            acc = add_quantized_values(acc, p, t_step + j * g, valids[j])
        return m, l, acc

    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        tuple(jnp.zeros((rows, width), jnp.float32) for *_, width in pieces),
    )
    carry = lax.fori_loop(0, mine, main_step, carry)

    # Residual segment (the last program only): G ring slots at a time.
    flushed_row = jnp.maximum(lax.div(length, residual) - 1, 0) * residual  # first row of the last flushed key block

    def ring_step(c, carry):
        m, l, acc = carry
        slots = c * g + jnp.arange(g)
        tok, quantized = ring_slot_tokens(length, slots, residual)
        valid = tok >= lo  # lo >= 0: never-written slots (tok < 0) are out
        s_quant = quantized_key_scores(flushed_row + c * g, valid & quantized)  # none read before the first flush
        if rope:  # the ring's pre-RoPE keys in halves, rotated by the tokens they hold
            ring_halves = [kr_ref[layer, b, h, pl.ds(c * g, g), pl.ds(i * half, half)].astype(jnp.float32)
                           for i in range(2)]  # [G, D/2] each
            s_ring = rotated_scores(ring_halves[:1], ring_halves[1:], jnp.maximum(tok, 0))
        else:
            ring_k = kr_ref[layer, b, h, pl.ds(c * g, g), :]  # [G, D]
            s_ring = dot(q_dot, ring_k.astype(dtype), trans_b=True) * sm_scale
        scores = jnp.where(valid[None, :], jnp.where(quantized[None, :], s_quant, s_ring), -jnp.inf)
        m, alpha, (p,), l = fd.online_update(m, l, [scores])
        p = p.astype(dtype)
        acc = tuple(
            a * alpha[:, None] + dot(p, vr_ref[layer, b, h, pl.ds(c * g, g), pl.ds(ch, width)].astype(dtype))
            for a, (ch, _, _, width) in zip(acc, pieces)
        )
        return m, l, acc

    m, l, acc = lax.fori_loop(0, jnp.where(s == splits, residual // g, 0), ring_step, carry)

    m_ref[...] = m
    l_ref[...] = l
    for a, (ch, _, _, width) in zip(acc, pieces):
        acc_ref[:, pl.ds(ch, width)] = a


def partials(q_rows, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, *, k_bits,
             v_bits, group_size, window, sinks=0, inv_freq=None, table=None, num_splits=None,
             tokens_per_step=TOKENS_PER_STEP, interpret=False):
    """The kernel's partials `(m, l, acc)` `[batch, kv_heads, splits + 1, rows(, head_dim)]` for padded float32
    queries `q_rows [batch, kv_heads, rows, head_dim]`; the last split is the residual segment. Tokens below `sinks`
    are left out (the sinks hold them); `inv_freq [D/2]` float32: keys are stored before RoPE; `table [batch,
    pages_per_seq]`: the stores are pools of R-token pages read through it."""
    _, batch, kv_heads, max_tokens, _ = k_codes.shape
    rows, head_dim = q_rows.shape[2:]
    residual = k_ring.shape[3]
    paged = table is not None
    if paged:  # steps within one page
        batch, max_tokens = table.shape[0], table.shape[1] * residual
    step = step_tokens(residual if paged else max_tokens, group_size, tokens_per_step)
    splits = num_splits or fd.num_splits(batch, kv_heads, max_tokens // step)
    rope = inv_freq is not None
    kernel = functools.partial(
        _kernel, k_bits=k_bits, v_bits=v_bits, group_size=group_size, residual=residual, window=window,
        sinks=sinks, rope=rope, paged=paged, splits=splits, step=step, dtype=k_ring.dtype,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h, s: (0,) * x.ndim)  # read in place, indexed in the kernel
    cache = (k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring)
    if rope:
        cache = cache + (inv_freq.astype(jnp.float32),)
    if paged:
        cache = cache + (table.astype(jnp.int32),)
    layer, length = fd.layer_operand(layer), length.astype(jnp.int32)
    grid = (batch, kv_heads, splits + 1)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(layer), whole(length), pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))]
        + [whole(x) for x in cache],
        out_specs=[
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows, head_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="kivi_decode",
    )(layer, length, q_rows, *cache)


def rope(x: jax.Array, pos: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """float32 keys `x [..., tokens, D]` at positions `pos [..., tokens]` after RoPE (Llama's half split, like
    models/llama.py `apply_rope`; the kernel does the same per piece in registers)."""
    angle = pos.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [..., tokens, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sink_partial(q_rows, k_sink, v_sink, length, window, inv_freq):
    """The sink tokens' partial softmax `(m, l, acc)` `[batch, kv_heads, 1, rows(, head_dim)]`, in jnp (a few tokens
    a sequence): tokens `[0, min(S, length))` from `k_sink, v_sink [batch, kv_heads, S, head_dim]` in full
    precision, inside the sliding window; keys rotated by their positions for a pre-RoPE cache."""
    num, head_dim = k_sink.shape[2:]
    pos = jnp.arange(num, dtype=jnp.int32)
    keys = k_sink.astype(jnp.float32)  # [batch, kv_heads, S, D]
    if inv_freq is not None:
        keys = rope(keys, pos, inv_freq)
    scores = jnp.einsum("bhrd,bhtd->bhrt", q_rows, keys, precision="highest") * head_dim**-0.5
    valid = (pos[None, :] < length[:, None]) & (pos[None, :] >= window_start(length, window)[:, None])  # [batch, S]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1)  # [batch, kv_heads, rows]
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    acc = jnp.einsum("bhrt,bhtd->bhrd", p, v_sink.astype(jnp.float32), precision="highest")
    return m[:, :, None], jnp.sum(p, axis=-1)[:, :, None], acc[:, :, None]


def with_sinks(partial, q_rows, k_sink, v_sink, layer, length, window, inv_freq):
    """The kernel's partials `(m, l, acc)` with the sink tokens' one appended along the split axis (`k_sink` None:
    unchanged). Sinks `[layers, batch, kv_heads, S, head_dim]` stacked like the cache (one layer with `layer=None`)."""
    if k_sink is None or k_sink.shape[-2] == 0:
        return partial
    lyr = 0 if layer is None else layer
    sink = sink_partial(q_rows, fd.stacked(k_sink, layer)[lyr], fd.stacked(v_sink, layer)[lyr], length, window,
                        inv_freq)
    return tuple(jnp.concatenate([x, y], axis=2) for x, y in zip(partial, sink))


def num_sinks(k_sink) -> int:
    """S: the sink tokens a sequence (0 without sinks)."""
    return 0 if k_sink is None else k_sink.shape[-2]


def decode(q, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, k_new, v_new, *,
           k_bits: int, v_bits: int, group_size: int, window: int | None = None, k_sink=None, v_sink=None,
           inv_freq=None, table=None, num_splits: int | None = None, tokens_per_step: int = TOKENS_PER_STEP,
           interpret: bool | None = None) -> jax.Array:
    """Decode attention over one layer of a KIVI cache with the Pallas kernel.

    q `[batch, 1, q_heads, head_dim]`; cache arrays stacked `[layers, ...]` with `layer` a (traced) index, or holding
    one layer with `layer=None`; length `[batch]`; k_new, v_new `[batch, 1, kv_heads, head_dim]` at position length
    (k_new after RoPE). Sinks `k_sink, v_sink [layers, batch, kv_heads, S, head_dim]` (None: no sinks) hold tokens
    `[0, S)` in full precision; `inv_freq [head_dim // 2]` (None: keys stored after RoPE) marks a cache whose keys
    (codes, ring, sinks) are stored before RoPE. The compute dtype is the rings' dtype (dots take it as input,
    accumulate in float32). `table [batch, pages_per_seq]` int32 (None: contiguous stores): the stores are pools
    `[layers, pages, kv_heads, R or R / G, ...]` and sequence b's token t lies in page `table[b, t // R]` (an entry
    equal to the page count holds none); rings and sinks stay a row a sequence. `interpret=None`: the real kernel on
    GPU, interpret mode elsewhere. Returns `[batch, 1, q_heads, head_dim]` in q's dtype.
    """
    window = fd.static_window(window)
    arrays = [fd.stacked(x, layer) for x in (k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring)]
    kv_heads, head_dim = arrays[0].shape[2], q.shape[-1]
    q_rows = fd.grouped_queries(q, kv_heads)
    partial = partials(
        q_rows, *arrays, layer, length, k_bits=k_bits, v_bits=v_bits, group_size=group_size, window=window,
        sinks=num_sinks(k_sink), inv_freq=inv_freq, table=table, num_splits=num_splits,
        tokens_per_step=tokens_per_step, interpret=fd.interpret_default(interpret),
    )
    m, l, acc = with_sinks(partial, q_rows, k_sink, v_sink, layer, length, window, inv_freq)
    return fd.combine(m, l, acc, q, k_new, v_new, head_dim**-0.5, q.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Pure-jnp twin: the same math (folded scales, the same roundings to the compute dtype, float32 softmax), one layer
# and all tokens at once instead of blocks and splits.


def _unpack(codes: jax.Array, bits: int) -> jax.Array:
    """Planar bytes `[..., D * bits / 8]` -> float32 codes `[..., D]` in channel order (3-bit: the 2-bit plane plus
    4 times the 1-bit plane)."""
    head_dim = codes.shape[-1] * 8 // bits
    out, start, shift = 0.0, 0, 0
    for plane in PLANES[bits]:
        width = head_dim * plane // 8
        part = codes[..., start : start + width]
        slabs = [((part >> (plane * i)) & (2**plane - 1)).astype(jnp.float32) for i in range(8 // plane)]
        out = out + jnp.concatenate(slabs, axis=-1) * float(2**shift)
        start, shift = start + width, shift + plane
    return out


def _rounded(x: jax.Array, dtype) -> jax.Array:
    """x as the kernel feeds it to a dot: rounded to the compute dtype, computed on in float32."""
    return x.astype(dtype).astype(jnp.float32)


def _quantized_key_scores(q, codes, scale, mn, sm_scale, dtype):
    """q `[batch, kv_heads, rows, D]` against quantized keys (codes `[batch, kv_heads, tokens, D]` float32, scale/mn
    `[batch, kv_heads, tokens // G, D]`) -> `[batch, kv_heads, rows, tokens]`, scales folded into q per key group."""
    batch, kv_heads, tokens, head_dim = codes.shape
    n_groups = scale.shape[2]
    q_scaled = q[:, :, :, None, :] * (scale * sm_scale)[:, :, None]  # [batch, kv_heads, rows, groups, D]
    grouped = codes.reshape(batch, kv_heads, n_groups, tokens // n_groups, head_dim)
    dots = sum(jnp.einsum("bhrgd,bhgtd->bhrgt", part.astype(jnp.float32), grouped, precision="highest")
               for part in split_parts(q_scaled, dtype))
    bias = jnp.einsum("bhrd,bhgd->bhrg", q, mn, precision="highest") * sm_scale
    return (dots + bias[..., None]).reshape(q.shape[:3] + (tokens,))


def _rotated_scores(q, keys, pos, inv_freq, sm_scale, dtype):
    """q `[batch, kv_heads, rows, D]` against float32 pre-RoPE keys `[batch, kv_heads, tokens, D]` at positions
    `pos [batch, tokens]`: rotated, then dotted as the kernel does (both sides in the compute dtype, the keys as a
    high and a low part)."""
    rotated = rope(keys, pos[:, None, :], inv_freq)
    return sum(jnp.einsum("bhrd,bhtd->bhrt", _rounded(q, dtype), part.astype(jnp.float32), precision="highest")
               for part in split_parts(rotated, dtype)) * sm_scale


def _dequantized_keys(codes, scale, mn):
    """float32 keys `[batch, kv_heads, tokens, D]` from codes (float32, channel order) and per-group scale/mn."""
    g = codes.shape[2] // scale.shape[2]
    return codes * jnp.repeat(scale, g, axis=2) + jnp.repeat(mn, g, axis=2)


def reference(q, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, k_new, v_new, *,
              k_bits: int, v_bits: int, group_size: int, window: int | None = None, k_sink=None, v_sink=None,
              inv_freq=None) -> jax.Array:
    """The kernel's pure-jnp twin: same arguments, same result up to float32 summation order."""
    arrays = [fd.stacked(x, layer) for x in (k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring)]
    lyr = 0 if layer is None else layer
    kc, ks, km, vc, vs, vm, kr, vr = (x[lyr] for x in arrays)
    dtype = kr.dtype
    batch, kv_heads, max_tokens, _ = kc.shape
    head_dim, residual, g = q.shape[-1], kr.shape[2], group_size
    sm_scale = head_dim**-0.5
    qr = fd.grouped_queries(q, kv_heads)  # [batch, kv_heads, rows, D]
    ks, km, vs, vm = (x.astype(jnp.float32) for x in (ks, km, vs, vm))
    k_codes_f, v_codes_f = _unpack(kc, k_bits), _unpack(vc, v_bits)  # [batch, kv_heads, tokens, D]
    lo, main_end = segment_bounds(length, residual, window)
    lo = jnp.maximum(lo, num_sinks(k_sink))  # the sinks' tokens come from the sinks

    def key_scores(codes, scale, mn, pos):  # pos [batch, tokens]: the keys' positions (for pre-RoPE keys)
        if inv_freq is None:
            return _quantized_key_scores(qr, codes, scale, mn, sm_scale, dtype)
        return _rotated_scores(qr, _dequantized_keys(codes, scale, mn), pos, inv_freq, sm_scale, dtype)

    # Both-quantized segment.
    pos = jnp.arange(max_tokens)
    valid = (pos[None, :] >= lo[:, None]) & (pos[None, :] < main_end[:, None])  # [batch, tokens]
    scores = key_scores(k_codes_f, ks, km, jnp.broadcast_to(pos, (batch, max_tokens)))
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m1 = jnp.max(scores, axis=-1)  # [batch, kv_heads, rows]
    p = jnp.exp(scores - jnp.where(m1 == -jnp.inf, 0.0, m1)[..., None])
    l1 = jnp.sum(p, axis=-1)
    p_scaled = _rounded(p[..., None] * vs[:, :, None], dtype)  # [b, h, rows, tokens, D // G]
    p_scaled = jnp.repeat(p_scaled, g, axis=-1)  # [b, h, rows, tokens, D]: channel d uses group d // G
    acc1 = jnp.einsum("bhrtd,bhtd->bhrd", p_scaled, v_codes_f, precision="highest")
    acc1 = acc1 + jnp.repeat(jnp.einsum("bhrt,bhtg->bhrg", p, vm, precision="highest"), g, axis=-1)

    # Residual segment: ring slots, keys already flushed read from the last quantized key block.
    slots = jnp.arange(residual)
    tok, quantized = ring_slot_tokens(length[:, None], slots[None, :], residual)  # [batch, R]
    ring_valid = tok >= lo[:, None]  # lo >= 0: never-written slots (tok < 0) are out
    row0 = jnp.maximum(length // residual - 1, 0) * residual  # [batch]
    rows = row0[:, None] + slots[None, :]
    take = lambda x, r: jnp.take_along_axis(x, r[:, None, :, None], axis=2)
    block_scores = key_scores(take(k_codes_f, rows), take(ks, rows[:, ::g] // g), take(km, rows[:, ::g] // g), rows)
    if inv_freq is None:
        ring_scores = jnp.einsum("bhrd,bhtd->bhrt", _rounded(qr, dtype), kr.astype(jnp.float32),
                                 precision="highest") * sm_scale
    else:
        ring_scores = _rotated_scores(qr, kr.astype(jnp.float32), jnp.maximum(tok, 0), inv_freq, sm_scale, dtype)
    scores = jnp.where(quantized[:, None, None, :], block_scores, ring_scores)
    scores = jnp.where(ring_valid[:, None, None, :], scores, -jnp.inf)
    m2 = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - jnp.where(m2 == -jnp.inf, 0.0, m2)[..., None])
    l2 = jnp.sum(p, axis=-1)
    acc2 = jnp.einsum("bhrt,bhtd->bhrd", _rounded(p, dtype), vr.astype(jnp.float32), precision="highest")

    partial = tuple(jnp.stack(pair, axis=2) for pair in ((m1, m2), (l1, l2), (acc1, acc2)))
    m, l, acc = with_sinks(partial, qr, k_sink, v_sink, layer, length, window, inv_freq)
    return fd.combine(m, l, acc, q, k_new, v_new, sm_scale, q.dtype)


def bytes_read(batch: int, kv_heads: int, tokens: int, head_dim: int, k_bits: int, v_bits: int, group_size: int,
               residual: int, ring_itemsize: int, scale_itemsize: int = 2, sinks: int = 0) -> int:
    """Bytes one decode step must read from one layer of a KIVI cache holding `tokens` tokens a sequence (codes,
    scales and mins of the quantized tokens, the ring, the sinks); the bandwidth figure of the GPU check divides by
    this."""
    quantized = max(tokens - residual, 0)
    per_head = quantized * head_dim * (k_bits + v_bits) // 8
    per_head += 2 * scale_itemsize * (math.ceil(quantized / group_size) * head_dim + quantized * head_dim // group_size)
    per_head += 2 * (residual + sinks) * head_dim * ring_itemsize
    return batch * kv_heads * per_head
