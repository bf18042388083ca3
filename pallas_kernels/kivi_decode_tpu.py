"""Fused dequantize + attention decode over a KIVI cache on TPU: a Pallas Mosaic kernel with the decode contract of
`kivi_decode.decode` (same arguments, same result); its pure-jnp twin is `kivi_decode.reference`.

The cache is read in place (docs/design.md §2; shapes in kivi_decode.py): codes, scales and mins stay in HBM
(`memory_space=ANY`) and are copied block by block into double-buffered VMEM with `make_async_copy`; the layer
index and the per-sequence lengths are scalar-prefetch operands (SMEM), so every DMA address is computed in the
kernel from them.

Grid (batch, kv head, split), every axis parallel. Programs `split < num_splits` walk their share of the tokens
whose key and value are both quantized, one step (whole R-token blocks, one DMA per block and array) at a time:
the next step's copies are started before the current step is waited on and read. Codes are unpacked in vregs from
the VMEM buffer one piece at a time (channels lying in one slab of every packed plane, so one shift and one mask a
plane); the key scales and mins fold into the query and a bias (`q·k_t = Σ_d (q_d s_gd) c_td + Σ_d q_d m_gd`), the
value scales and mins into the code tile (a per-token column, broadcast along lanes); the online softmax runs in
float32 over all n_rep query heads of the kv head at once (rows padded to 8 sublanes). The last program of each
(sequence, kv head) reads the residual segment: the ring and the last flushed key block, copied once. Pre-RoPE keys
are dequantized per piece and rotated in vregs (pieces i and i + n/2 are RoPE's two halves). Sinks and the new
token are attended in the jnp epilogue (`kivi_decode.with_sinks`, `flash_decoding.combine`).

Paged caches (`table` given, kivi_jax/paged.py): the stores are pools `[layers, pages, kv_heads, R or R / G, ...]`,
one R-token block a page, and the block table `[batch, blocks]` (flattened) is a third scalar-prefetch operand. Every
copy reads one R-token block of one (layer, sequence, kv head), and where it lies is computed in one place
(`_block_at`): row `block * R` of sequence b, or row 0 of page `table[b, block]`. A block whose entry holds no page
(the page count) is never copied; rows a program reads but does not attend (no page, or not written yet: anything,
NaN included) are masked out of the scores and zeroed in the values, so they change no output bit.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import flash_decoding as fd
from . import kivi_decode as kd

TOKENS_PER_STEP = 256  # tokens a main program copies and reads per loop step (whole R-token blocks)
SUBLANES = 8  # query rows are padded to a multiple of this (a vreg is 8 sublanes x 128 lanes of 32 bits)
CACHE_ARRAYS = ("k_codes", "k_scale", "k_mn", "v_codes", "v_scale", "v_mn")  # copied block by block
RING_ARRAYS = ("k_ring", "v_ring", "k_codes", "k_scale", "k_mn")  # copied once by the residual program
PAGED = True  # `decode(..., table=...)` reads pools through a block table (kivi_jax/attention.py hands it one)


def unsupported(head_dim: int, k_bits: int, v_bits: int, group_size: int, residual: int, key_axis: str = "channel",
                value_axis: str = "token") -> str | None:
    """Why the kernel cannot serve this cache configuration, or None when it can (the Triton kernel's set)."""
    return kd.unsupported(head_dim, k_bits, v_bits, group_size, residual, key_axis, value_axis)


def query_rows(n_rep: int) -> int:
    """Rows of the padded query tile: n_rep rounded up to whole sublanes."""
    return -(-n_rep // SUBLANES) * SUBLANES


def step_tokens(max_tokens: int, residual: int, tokens_per_step: int = TOKENS_PER_STEP) -> int:
    """Tokens per main-loop step: whole R-token blocks (the unit a block table would map to a page), a power of two
    of them dividing the cache (so no copy runs past it), at most `tokens_per_step` unless one block is more."""
    return residual * fd.largest_pow2_block(max_tokens // residual, max(tokens_per_step // residual, 1))


def interpret_params(interpret):
    """`None`: the real kernel on a TPU backend, TPU interpret mode elsewhere; `True`: interpret mode with default
    parameters; an `InterpretParams` as given (e.g. `detect_races=True`)."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _block_at(table_ref, b, block, residual: int, group_size: int, blocks: int, num_pages: int):
    """Where logical R-token block `block` of sequence b lies: (index on the stores' second axis, first code row,
    first key-scale row, held). Contiguous (`table_ref` None): sequence b, row `block * R`, held (True). Paged
    (`table_ref [batch * blocks]` int32 in SMEM, `blocks` entries a sequence): page `table[b, block]`, row 0, held
    unless the entry is `num_pages` (then index 0, which the caller must not copy)."""
    if table_ref is None:
        return b, block * residual, block * (residual // group_size), True
    page = table_ref[b * blocks + block]
    held = page < num_pages
    return jnp.where(held, page, 0), 0, 0, held


def _when(held, copies, method: str):
    """Starts (or waits for) `copies` where `held`: always where it is Python True (contiguous), else under
    `pl.when`."""
    def run():
        for c in copies:
            getattr(c, method)()

    if held is True:
        run()
    else:
        pl.when(held)(run)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel


def _kernel(layer_ref, length_ref, *refs, k_bits, v_bits, group_size, residual, window, sinks, rope, paged, blocks,
            splits, step):
    table_ref, refs = (refs[0], refs[1:]) if paged else (None, refs)  # [batch * blocks] int32
    q_ref, kc_hbm, ks_hbm, km_hbm, vc_hbm, vs_hbm, vm_hbm, kr_hbm, vr_hbm = refs[:9]
    inv_ref, refs = (refs[9], refs[10:]) if rope else (None, refs[9:])
    m_ref, l_ref, acc_ref, kc_buf, ks_buf, km_buf, vc_buf, vs_buf, vm_buf, sems = refs[:10]
    kr_buf, vr_buf, fkc_buf, fks_buf, fkm_buf, ring_sems = refs[10:]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[0], length_ref[b]
    block_at = lambda block: _block_at(table_ref, b, block, residual, group_size, blocks, kc_hbm.shape[1])
    rows, head_dim = q_ref.shape
    g, half = group_size, head_dim // 2
    sm_scale = head_dim**-0.5
    k_pieces, v_pieces = kd.pieces(head_dim, k_bits), kd.pieces(head_dim, v_bits, g)
    q_at = lambda first, width: q_ref[:, pl.ds(first, width)]  # [rows, width] float32

    def dot_nt(x, y):  # [m, k] x [n, k] -> [m, n], exact float32
        return lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    def dot_nn(x, y):  # [m, k] x [k, n] -> [m, n]
        return lax.dot_general(x, y, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    def unpack(codes_at, piece):
        """float32 codes `[tokens, width]` of `piece` from `codes_at(byte, width) -> uint8 [tokens, width]`."""
        out = 0
        for byte, shift, mask, weight in piece.planes:
            part = (codes_at(byte, piece.width).astype(jnp.int32) >> shift) & mask
            out = out + (part << weight)
        return out.astype(jnp.float32)

    def per_token(rows_of_groups):
        """`[tokens // G, w]` (a row a key group) -> `[tokens, w]` (each row repeated for its G tokens)."""
        n, w = rows_of_groups.shape
        return jnp.broadcast_to(rows_of_groups[:, None, :], (n, g, w)).reshape(n * g, w)

    def key_scores(codes_at, scale_at, pos):
        """Scores `[rows, tokens]` of quantized keys at positions `pos [tokens, 1]` (whole key groups):
        `codes_at(byte, width)` their code bytes, `scale_at(which, first, width)` their groups' scale (0) or min (1)
        rows `[tokens // G, width]`. Each piece is dequantized in vregs (`codes * scale + min`), rotated by its
        tokens' positions for a pre-RoPE cache (pieces i and i + n/2 are RoPE's halves), and dotted with the query."""
        keys = [unpack(codes_at, pc) * per_token(scale_at(0, pc.first, pc.width))
                + per_token(scale_at(1, pc.first, pc.width)) for pc in k_pieces]  # [tokens, w] float32 each
        if not rope:
            return sum(dot_nt(q_at(pc.first, pc.width), key) for pc, key in zip(k_pieces, keys)) * sm_scale
        return rotated_scores(keys, pos)

    def rotated_scores(keys, pos):
        """Scores `[rows, tokens]` of pre-RoPE keys given as float32 pieces `[tokens, w]` in channel order (the first
        half of the list pairs with the second), rotated by their positions `pos [tokens, 1]`: Llama's half split,
        `[x1 cos - x2 sin, x2 cos + x1 sin]` at angle `pos * inv_freq`."""
        n = len(keys) // 2
        scores = 0.0
        for x1, x2, first in zip(keys[:n], keys[n:], range(0, half, keys[0].shape[1])):
            w = x1.shape[1]
            angle = pos.astype(jnp.float32) * inv_ref[:, pl.ds(first, w)]  # [tokens, w]
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            scores = scores + dot_nt(q_at(first, w), x1 * cos - x2 * sin)
            scores = scores + dot_nt(q_at(first + half, w), x2 * cos + x1 * sin)
        return scores * sm_scale

    def online_update(m, l, scores):
        """One online-softmax step over `scores [rows, tokens]` (-inf where masked); m, l `[rows, 1]`."""
        m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: nothing to rescale
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(scores - m_safe)
        return m_new, alpha, p, l * alpha + jnp.sum(p, axis=1, keepdims=True)

    lo, main_end = kd.segment_bounds(length, residual, window)
    if sinks:  # tokens [0, S) are read from the sinks (the epilogue), never from codes or ring
        lo = jnp.maximum(lo, sinks)
    empty = lambda width: jnp.zeros((rows, width), jnp.float32)
    m0, l0 = jnp.full((rows, 1), -jnp.inf, jnp.float32), empty(1)
    iota = lambda shape, axis: lax.broadcasted_iota(jnp.int32, shape, axis)

    @pl.when(s < splits)
    def main_segment():
        """This split's share of the steps covering `[lo, main_end)`."""
        first = lax.div(lo, step)
        n_steps = jnp.maximum(lax.div(main_end + step - 1, step) - first, 0)
        per_split = lax.div(n_steps + splits - 1, splits)
        mine = jnp.clip(n_steps - s * per_split, 0, per_split)
        start = first + s * per_split
        hbm = (kc_hbm, ks_hbm, km_hbm, vc_hbm, vs_hbm, vm_hbm)
        bufs = (kc_buf, ks_buf, km_buf, vc_buf, vs_buf, vm_buf)

        def block_copies(i, j, slot):
            """The DMAs of R-token block j of step `start + i` into buffer `slot` (its code rows, key scale and min
            rows, value scale and min rows), and whether the block is held (none may run where it is not)."""
            seq, row, key_row, held = block_at(lax.div((start + i) * step, residual) + j)
            out = []
            for a, (src, dst) in enumerate(zip(hbm, bufs)):
                n, at = (residual // g, key_row) if a in (1, 2) else (residual, row)
                out.append(pltpu.make_async_copy(src.at[layer, seq, h, pl.ds(at, n)], dst.at[slot, pl.ds(j * n, n)],
                                                 sems.at[a, slot]))
            return out, held

        def step_copies(i, slot, method):
            """Starts (or waits for) every copy of step `start + i`, a loop over its held R-token blocks (the same
            table entries at the start and the wait: each wait matches its start)."""
            def each(j, carry):
                copies, held = block_copies(i, j, slot)
                _when(held, copies, method)
                return carry
            lax.fori_loop(0, step // residual, each, 0)

        @pl.when(mine > 0)
        def prefetch_first():
            step_copies(0, 0, "start")

        def body(i, carry):
            m, l, acc = carry
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < mine)
            def prefetch_next():  # the other buffer was read by the previous step, which is done
                step_copies(i + 1, 1 - slot, "start")

            step_copies(i, slot, "wait")
            t_step = (start + i) * step
            codes_at = lambda byte, w: kc_buf[slot, :, pl.ds(byte, w)]
            scale_at = lambda which, c0, w: (ks_buf, km_buf)[which][slot, :, pl.ds(c0, w)].astype(jnp.float32)
            pos = t_step + iota((1, step), 1)
            valid = (pos >= lo) & (pos < main_end)  # [1, step]; a score's NaN stays in its column: masked here
            scores = jnp.where(valid, key_scores(codes_at, scale_at, t_step + iota((step, 1), 0)), -jnp.inf)
            if paged:  # [step, 1]: the value rows attended; the others may hold anything (no page, not written)
                pos_col = t_step + iota((step, 1), 0)
                rows_ok = (pos_col >= lo) & (pos_col < main_end)
            m, alpha, p, l = online_update(m, l, scores)
            out = []
            for a, pc in zip(acc, v_pieces):
                grp = pc.first // g  # the piece's channel group: its scale and min are a column a token
                scale = vs_buf[slot, :, pl.ds(grp, 1)].astype(jnp.float32)  # [step, 1]
                mn = vm_buf[slot, :, pl.ds(grp, 1)].astype(jnp.float32)
                values = unpack(lambda byte, w: vc_buf[slot, :, pl.ds(byte, w)], pc) * scale + mn  # [step, w]
                if paged:  # zeroed where not attended: p is 0 there, but 0 * NaN is NaN
                    values = jnp.where(rows_ok, values, 0.0)
                out.append(a * alpha + dot_nn(p, values))
            return m, l, out

        m, l, acc = lax.fori_loop(0, mine, body, (m0, l0, [empty(pc.width) for pc in v_pieces]))
        m_ref[...], l_ref[...] = m, l
        for a, pc in zip(acc, v_pieces):
            acc_ref[:, pl.ds(pc.first, pc.width)] = a

    @pl.when(s == splits)
    def residual_segment():
        """The newest up-to-R tokens: keys from the ring, or, once flushed, from row `(length // R - 1) * R + slot`
        of the last quantized key block; values from the ring."""
        flushed = jnp.maximum(lax.div(length, residual) - 1, 0)  # the last flushed block (block 0 before any)
        seq, row, key_row, held = block_at(flushed)
        srcs = (kr_hbm.at[layer, b, h], vr_hbm.at[layer, b, h], kc_hbm.at[layer, seq, h, pl.ds(row, residual)],
                ks_hbm.at[layer, seq, h, pl.ds(key_row, residual // g)],
                km_hbm.at[layer, seq, h, pl.ds(key_row, residual // g)])
        copies = [pltpu.make_async_copy(src, dst, ring_sems.at[a])
                  for a, (src, dst) in enumerate(zip(srcs, (kr_buf, vr_buf, fkc_buf, fks_buf, fkm_buf)))]
        rings, block = copies[:2], copies[2:]  # the flushed block: held whenever one is attended (length >= R)
        for c in rings:
            c.start()
        _when(held, block, "start")
        for c in rings:
            c.wait()
        _when(held, block, "wait")
        tok, quantized = kd.ring_slot_tokens(length, iota((1, residual), 1), residual)  # [1, R]
        codes_at = lambda byte, w: fkc_buf[:, pl.ds(byte, w)]
        scale_at = lambda which, c0, w: (fks_buf, fkm_buf)[which][:, pl.ds(c0, w)].astype(jnp.float32)
        s_quant = key_scores(codes_at, scale_at, flushed * residual + iota((residual, 1), 0))
        if rope:  # the ring's pre-RoPE keys in halves, rotated by the tokens their slots hold
            tok_col, _ = kd.ring_slot_tokens(length, iota((residual, 1), 0), residual)  # [R, 1]
            halves = [kr_buf[:, pl.ds(i * half, half)].astype(jnp.float32) for i in range(2)]
            s_ring = rotated_scores(halves, jnp.maximum(tok_col, 0))
        else:
            s_ring = dot_nt(q_ref[...], kr_buf[...].astype(jnp.float32)) * sm_scale
        scores = jnp.where(tok >= lo, jnp.where(quantized, s_quant, s_ring), -jnp.inf)  # never written: tok < 0
        m, _, p, l = online_update(m0, l0, scores)
        m_ref[...], l_ref[...] = m, l
        acc_ref[...] = dot_nn(p, vr_buf[...].astype(jnp.float32))


def partials(q_rows, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, *, k_bits,
             v_bits, group_size, window, sinks=0, inv_freq=None, table=None, num_splits=None,
             tokens_per_step=TOKENS_PER_STEP, interpret=None):
    """The kernel's partials `(m, l, acc)` `[batch, kv_heads, splits + 1, rows(, head_dim)]` for padded float32
    queries `q_rows [batch, kv_heads, rows, head_dim]`; the last split is the residual segment. Tokens below `sinks`
    are left out (the sinks hold them); `inv_freq [D/2]` float32: keys are stored before RoPE; `table [batch,
    blocks]` int32: the stores are pools of R-token pages read through it."""
    _, batch, kv_heads, max_tokens, k_width = k_codes.shape
    rows, head_dim = q_rows.shape[2:]
    residual, g = k_ring.shape[3], group_size
    paged = table is not None
    blocks = max_tokens // residual  # table entries a sequence
    if paged:  # pools [layers, pages, kv_heads, R, X]: the table gives the batch and the capacity
        batch, blocks = table.shape
        max_tokens = blocks * residual
    step = step_tokens(max_tokens, residual, tokens_per_step)
    splits = num_splits or 1  # the grid runs in sequence on a TensorCore: splits only feed a second core
    rope = inv_freq is not None
    kernel = functools.partial(_kernel, k_bits=k_bits, v_bits=v_bits, group_size=g, residual=residual,
                               window=window, sinks=sinks, rope=rope, paged=paged, blocks=blocks, splits=splits,
                               step=step)
    hbm = pl.BlockSpec(memory_space=pl.ANY)  # left in HBM: the kernel copies what it reads
    in_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s, *_: (b, h, 0, 0))] + [hbm] * 8
    operands = [q_rows, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring]
    if rope:
        in_specs.append(pl.BlockSpec((1, head_dim // 2), lambda b, h, s, *_: (0, 0)))
        operands.append(inv_freq.astype(jnp.float32).reshape(1, head_dim // 2))
    v_width, sd, dtype = v_codes.shape[-1], k_scale.dtype, k_ring.dtype
    scratch = [
        pltpu.VMEM((2, step, k_width), jnp.uint8),  # double-buffered: key codes,
        pltpu.VMEM((2, step // g, head_dim), sd),  # key scales and mins (a row a key group),
        pltpu.VMEM((2, step // g, head_dim), sd),
        pltpu.VMEM((2, step, v_width), jnp.uint8),  # value codes,
        pltpu.VMEM((2, step, head_dim // g), sd),  # value scales and mins (a row a token)
        pltpu.VMEM((2, step, head_dim // g), sd),
        pltpu.SemaphoreType.DMA((len(CACHE_ARRAYS), 2)),
        pltpu.VMEM((residual, head_dim), dtype),  # the residual program's ring,
        pltpu.VMEM((residual, head_dim), dtype),
        pltpu.VMEM((residual, k_width), jnp.uint8),  # and the last flushed key block
        pltpu.VMEM((residual // g, head_dim), sd),
        pltpu.VMEM((residual // g, head_dim), sd),
        pltpu.SemaphoreType.DMA((len(RING_ARRAYS),)),
    ]
    part = lambda *tail: pl.BlockSpec((None, None, None, rows) + tail, lambda b, h, s, *_: (b, h, s, 0, 0))
    prefetch = [fd.layer_operand(layer), length.astype(jnp.int32)]  # [1], [batch]
    if paged:  # [batch * blocks]: flattened to 1-D in SMEM, indexed `b * blocks + block`
        prefetch.append(table.astype(jnp.int32).reshape(batch * blocks))
    m, l, acc = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),  # the layer, the lengths, the block table when paged
            grid=(batch, kv_heads, splits + 1),
            in_specs=in_specs,
            out_specs=[part(1), part(1), part(head_dim)],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows, 1), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows, 1), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits + 1, rows, head_dim), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="kivi_decode_tpu",
    )(*prefetch, *operands)
    return m[..., 0], l[..., 0], acc


def decode(q, k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring, layer, length, k_new, v_new, *,
           k_bits: int, v_bits: int, group_size: int, window: int | None = None, k_sink=None, v_sink=None,
           inv_freq=None, table=None, num_splits: int | None = None, tokens_per_step: int = TOKENS_PER_STEP,
           interpret=None) -> jax.Array:
    """Decode attention over one layer of a KIVI cache with the TPU kernel: `kivi_decode.decode`'s arguments and
    result (q `[batch, 1, q_heads, head_dim]`, cache arrays stacked `[layers, ...]` with a traced `layer` or one
    layer with `layer=None`, sinks, `inv_freq` for a pre-RoPE cache, `table [batch, blocks]` int32 for stores that
    are pools `[layers, pages, kv_heads, R or R / G, ...]`; rings and sinks stay a row a sequence). Every dot and the
    softmax are float32 whatever the rings' dtype. `interpret`: see `interpret_params`. Returns `[batch, 1, q_heads,
    head_dim]` in q's dtype."""
    window = fd.static_window(window)
    arrays = [fd.stacked(x, layer) for x in (k_codes, k_scale, k_mn, v_codes, v_scale, v_mn, k_ring, v_ring)]
    kv_heads, head_dim = arrays[0].shape[2], q.shape[-1]
    q_rows = fd.grouped_queries(q, kv_heads, query_rows(q.shape[2] // kv_heads))
    partial = partials(
        q_rows, *arrays, layer, length, k_bits=k_bits, v_bits=v_bits, group_size=group_size, window=window,
        sinks=kd.num_sinks(k_sink), inv_freq=inv_freq, table=table, num_splits=num_splits,
        tokens_per_step=tokens_per_step, interpret=interpret,
    )
    m, l, acc = kd.with_sinks(partial, q_rows, k_sink, v_sink, layer, length, window, inv_freq)
    return fd.combine(m, l, acc, q, k_new, v_new, head_dim**-0.5, q.dtype)
