"""Decode attention over a full-precision cache: a flash-decoding Pallas kernel (the like-for-like baseline of the KIVI
kernel), its pure-jnp twin, and `jax.nn.dot_product_attention` as a second baseline.

The cache `k, v [layers, batch, kv_heads, tokens, head_dim]` in the compute dtype, read in place (the layer is an
index the kernel reads). Grid (batch, kv head, split): each program walks its share of the tokens `[lo, length)` in
power-of-two blocks, scores all n_rep query heads of its kv head at once (rows padded to 16 for the dot) with an
online softmax in float32, and writes a partial `(m, l, acc)`; `flash_decoding.combine` merges the splits with the
new token. Per-sequence lengths and the sliding window are masked; blocks wholly outside the window are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import flash_decoding as fd

fd.silence_triton_deprecation()  # Triton is our choice here, not the user's

BLOCK_TOKENS = 64  # tokens a program reads per loop step (at most; the largest power of two dividing the cache)
MIN_BLOCK = 16  # Triton's dot needs at least 16 columns
NUM_WARPS = 4
NUM_STAGES = 2


def unsupported(head_dim: int, max_tokens: int) -> str | None:
    """Why the kernel cannot serve this cache shape, or None when it can."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the kernel needs a power-of-two head_dim >= 16, not {head_dim}"
    if fd.largest_pow2_block(max_tokens, BLOCK_TOKENS) < MIN_BLOCK:
        return f"the kernel needs a cache of a multiple of {MIN_BLOCK} tokens, not {max_tokens}"
    return None


def _kernel(layer_ref, length_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, window, splits, block, dtype):
    b, s = pl.program_id(0), pl.program_id(2)
    h = pl.program_id(1)
    layer = layer_ref[0]
    length = length_ref[b]
    rows, head_dim = q_ref.shape
    sm_scale = head_dim**-0.5
    dot = functools.partial(plgpu.dot, precision=fd.dot_precision(dtype))
    q = q_ref[...].astype(dtype)  # [rows, D]
    lo = jnp.zeros_like(length) if window is None else jnp.maximum(length - window + 1, 0)

    first = lax.div(lo, block)
    n_blocks = jnp.maximum(lax.div(length + block - 1, block) - first, 0)
    per_split = lax.div(n_blocks + splits - 1, splits)
    mine = jnp.clip(n_blocks - s * per_split, 0, per_split)
    start = first + s * per_split

    def body(i, carry):
        m, l, acc = carry
        t0 = (start + i) * block
        k = k_ref[layer, b, h, pl.ds(t0, block), :]  # [block, D]
        v = v_ref[layer, b, h, pl.ds(t0, block), :]
        pos = t0 + jnp.arange(block)
        valid = (pos >= lo) & (pos < length)
        scores = jnp.where(valid[None, :], dot(q, k.astype(dtype), trans_b=True) * sm_scale, -jnp.inf)
        m, alpha, (p,), l = fd.online_update(m, l, [scores])
        acc = acc * alpha[:, None] + dot(p.astype(dtype), v.astype(dtype))
        return m, l, acc

    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(0, mine, body, carry)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def partials(q_rows, k, v, layer, length, *, window, num_splits=None, block_tokens=BLOCK_TOKENS, interpret=False):
    """The kernel's partials `(m, l, acc)` `[batch, kv_heads, splits, rows(, head_dim)]` for padded float32 queries
    `q_rows [batch, kv_heads, rows, head_dim]` over stacked `k, v [layers, batch, kv_heads, tokens, head_dim]`."""
    _, batch, kv_heads, max_tokens, head_dim = k.shape
    rows = q_rows.shape[2]
    block = fd.largest_pow2_block(max_tokens, block_tokens)
    splits = num_splits or fd.num_splits(batch, kv_heads, max_tokens // block)
    kernel = functools.partial(_kernel, window=window, splits=splits, block=block, dtype=k.dtype)
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h, s: (0,) * x.ndim)  # read in place, indexed in the kernel
    layer, length = fd.layer_operand(layer), length.astype(jnp.int32)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[whole(layer), whole(length), pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
                  whole(k), whole(v)],
        out_specs=[
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="full_decode",
    )(layer, length, q_rows, k, v)


def decode(q, k, v, layer, length, k_new, v_new, window: int | None = None, *, num_splits: int | None = None,
           block_tokens: int = BLOCK_TOKENS, interpret: bool | None = None) -> jax.Array:
    """Decode attention over one layer of a full-precision cache with the Pallas kernel.

    q `[batch, 1, q_heads, head_dim]`; k, v `[layers, batch, kv_heads, tokens, head_dim]` with `layer` a (traced)
    index, or one layer with `layer=None`; length `[batch]`; k_new, v_new `[batch, 1, kv_heads, head_dim]` at
    position length. `interpret=None`: the real kernel on GPU, interpret mode elsewhere.
    Returns `[batch, 1, q_heads, head_dim]` in q's dtype.
    """
    window = fd.static_window(window)
    k, v = fd.stacked(k, layer), fd.stacked(v, layer)
    m, l, acc = partials(fd.grouped_queries(q, k.shape[2]), k, v, layer, length, window=window,
                         num_splits=num_splits, block_tokens=block_tokens, interpret=fd.interpret_default(interpret))
    return fd.combine(m, l, acc, q, k_new, v_new, q.shape[-1] ** -0.5, q.dtype)


def reference(q, k, v, layer, length, k_new, v_new, window: int | None = None) -> jax.Array:
    """The kernel's pure-jnp twin: the same math (inputs rounded to the cache dtype for the dots, float32 softmax),
    all tokens at once."""
    k, v = fd.stacked(k, layer), fd.stacked(v, layer)
    lyr = 0 if layer is None else layer
    k, v = k[lyr], v[lyr]  # [batch, kv_heads, tokens, head_dim]
    dtype, max_tokens, head_dim = k.dtype, k.shape[2], k.shape[3]
    qr = fd.grouped_queries(q, k.shape[1]).astype(dtype).astype(jnp.float32)  # [batch, kv_heads, rows, head_dim]
    scores = jnp.einsum("bhrd,bhtd->bhrt", qr, k.astype(jnp.float32), precision="highest") * head_dim**-0.5
    pos = jnp.arange(max_tokens)[None, :]
    valid = pos < length[:, None]
    if window is not None:
        valid &= pos > length[:, None] - window
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bhrt,bhtd->bhrd", p.astype(dtype).astype(jnp.float32), v.astype(jnp.float32),
                     precision="highest")
    return fd.combine(m[:, :, None], l[:, :, None], acc[:, :, None], q, k_new, v_new, head_dim**-0.5, q.dtype)


def sdpa_decode(q, k, v, num_tokens) -> jax.Array:
    """The second baseline: `jax.nn.dot_product_attention` of one query token over one layer of a full-precision
    cache laid out as that API wants, `k, v [batch, tokens, kv_heads, head_dim]`, whose first `num_tokens [batch]`
    tokens are seen (the caller has written the new token at position `num_tokens - 1`, as a decode step does).

    q `[batch, 1, q_heads, head_dim]`. Returns `[batch, 1, q_heads, head_dim]` in q's dtype.
    """
    out = jax.nn.dot_product_attention(q.astype(k.dtype), k, v, key_value_seq_lengths=num_tokens.astype(jnp.int32))
    return out.astype(q.dtype)


def bytes_read(batch: int, kv_heads: int, tokens: int, head_dim: int, itemsize: int) -> int:
    """Bytes one decode step must read from one layer of a full-precision cache holding `tokens` tokens a sequence."""
    return 2 * batch * kv_heads * tokens * head_dim * itemsize
