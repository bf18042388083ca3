"""A prefill chunk's attention segment in the native CPU kernel (`attend_cpu.cc`, through `jax.ffi.ffi_call`): its
contract and pure-jnp twin are `kivi_jax.attention.segment`'s XLA path with bfloat16 dots, or float32 ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.native import build


def unsupported(dot_dtype, head_dim: int, softcap) -> str | None:
    """Why the kernel cannot add a segment for these rows, or None: it dots in bfloat16 with AMX tiles, or in
    float32 with AVX-512 registers, over head dims a multiple of 32 up to 256, without soft-capping."""
    if dot_dtype not in (jnp.bfloat16, jnp.float32):
        return f"the kernel dots bfloat16 or float32 rows, not {jnp.dtype(dot_dtype).name}"
    if softcap is not None:
        return "the kernel does not soft-cap attention logits"
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 32 up to 256"
    if dot_dtype == jnp.bfloat16 and not build.has_amx():
        return "this CPU has no AMX tiles (the kernel's scalar path is for tests)"
    if dot_dtype == jnp.float32 and not build.has_avx512():
        return "this CPU has no AVX-512 (the kernel's float32 tiles are measured there only): XLA's dot serves"
    return None


STORE_BITS = (2, 4, 8)  # the codes a store the kernel reads in place may hold


def unsupported_store(k_store, v_store, inv_freq) -> str | None:
    """Why the kernel cannot read these KIVI stores in place (`segment(..., store=...)`), or None: KIVI's axes,
    contiguous stores of uniform 2-, 4- or 8-bit codes, keys stored after RoPE."""
    if (k_store.axis, v_store.axis) != ("channel", "token"):
        return f"the kernel reads KIVI's axes (keys per-channel, values per-token), not {k_store.axis}/{v_store.axis}"
    if k_store.bits not in STORE_BITS or v_store.bits not in STORE_BITS:
        return f"the kernel reads {STORE_BITS}-bit codes, not k_bits={k_store.bits}, v_bits={v_store.bits}"
    if k_store.levels is not None or v_store.levels is not None:
        return "the kernel reads uniform codes, not a codebook's"
    if inv_freq is not None:
        return "the kernel reads keys stored after RoPE"
    if k_store.paged or v_store.paged:
        return "the kernel reads a contiguous store, not pages"
    return None


def _store_operands(store, batch: int) -> tuple[list, dict]:
    """The kernel's store operands and attributes: `store = (k_store, v_store, layer, begin, end)` (None: no store,
    operands of no tokens)."""
    if store is None:
        none = jnp.zeros((1, 1, 1, 0, 1), jnp.uint8)
        scales = jnp.zeros((0,), jnp.float32)
        return ([none, scales, scales, none, scales, scales, jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32)],
                dict(k_bits=np.int64(2), v_bits=np.int64(2), k_group=np.int64(1), v_group=np.int64(1),
                     store_begin=np.int64(0)))
    k_store, v_store, layer, begin, end = store
    stacked = (lambda a: a[None]) if layer is None else (lambda a: a)  # noqa: E731
    scale_dtype = k_store.scale.dtype
    ops = [stacked(k_store.codes), stacked(k_store.scale), stacked(k_store.mn).astype(scale_dtype),
           stacked(v_store.codes), stacked(v_store.scale).astype(scale_dtype), stacked(v_store.mn).astype(scale_dtype),
           jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()), end.astype(jnp.int32)]
    return ops, dict(k_bits=np.int64(k_store.bits), v_bits=np.int64(v_store.bits),
                     k_group=np.int64(k_store.group_size), v_group=np.int64(v_store.group_size),
                     store_begin=np.int64(begin))


def segment(m, l, acc, q, q_pos, k, v, k_pos, k_ok, window: int | None, causal: bool, amx: bool = True,
            scale: float = 1.0, kv_tokens_first: bool = False, store=None, finish: bool = False,
            dot_dtype=jnp.bfloat16):
    """Adds keys and values `k, v [B, H, T, D]` (`[B, T, H, D]` with `kv_tokens_first`) at `k_pos [B or 1, T]`
    (those with `k_ok [B or 1, T]`) to the online softmax `(m, l [B, Tq, Hq], acc [B, Tq, Hq, D])` of the queries
    `q [B, Tq, Hq, D]` (float32 or bfloat16, times `scale` before any rounding to bfloat16) at `q_pos [B, Tq]`;
    query head `h * n_rep + r` reads kv head `h`. `m = l = acc = None`: the rows start from nothing seen, and no state
    is read. A key counts when ok, at or before the query (`causal`) and inside its `window` (None: none).
    `store = (k_store, v_store, layer, begin, end)`: a KIVI cache's stores (`unsupported_store` says which; stacked
    `[layers, ...]` and read in place at `layer`, or one layer with None) whose tokens `[begin, end[b])`, at their
    index as position, come first, each dequantized as `attention.dequantized` does. Returns the new `(m, l, acc)`,
    with `finish` the normalized attention `acc / l` (`attention.Softmax.result`) as acc. `dot_dtype`: q, k, p and v
    rounded to bfloat16 before their products (AMX tiles; `amx=False`: the kernel's scalar path, for tests), or
    float32 throughout (AVX-512 tiles)."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    batch = q.shape[0]
    fresh = m is None
    store_ops, store_attrs = _store_operands(store, batch)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    i32 = lambda a: jnp.broadcast_to(a, (batch, a.shape[-1])).astype(jnp.int32)  # noqa: E731
    if fresh:  # nothing to read: empty operands, fresh results
        m = l = acc = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call("kivi_jax_chunk_attend", (jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),
                                                      jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),
                                                      jax.ShapeDtypeStruct(q.shape, jnp.float32)),
                            input_output_aliases={} if fresh else {14: 0, 15: 1, 16: 2})
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        q = f32(q)
    return call(q, q_pos.astype(jnp.int32), f32(k), f32(v), i32(k_pos), i32(k_ok), *store_ops, f32(m), f32(l),
                f32(acc), window=np.int64(window or 0), causal=np.int64(causal), amx=np.int64(amx),
                scale=np.float32(scale), kv_tokens_first=np.int64(kv_tokens_first), fresh=np.int64(fresh),
                finish=np.int64(finish), f32=np.int64(jnp.dtype(dot_dtype) == jnp.float32), **store_attrs)
