"""The native CPU decode kernels as jax functions: same arguments and results as `kivi_jax.attention.decode_kivi_xla`
and `decode_full_xla` (their pure-jnp twins), run through `jax.ffi.ffi_call` on the CPU backend.

The stacked `[layers, ...]` stores and rings are the call's operands (read in place at the traced `layer` index,
never sliced); a one-layer array (`layer=None`) gets a free leading axis. float32 in and out; the KIVI kernel reads
a residual ring stored in float32, float16 or bfloat16 (rows widened to float32 as read, like the XLA path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kivi_jax.native import build

KERNEL_BITS = (2, 3, 4)
KERNEL_KEY_GROUPS = (32, 64, 128)
HEAD_DIMS = (64, 128)
SCALE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
RING_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)  # the KIVI ring as stored (the kernel computes in float32)
# Whether `attention_impl="auto"` takes the native kernel for the full-precision cache too: only where it beat the
# XLA path on the decode benchmark (docs/benchmarks.md, "Native CPU kernels").
FULL_AUTO = True  # it did on the 2-core machine, 2026-12-01: 0.31-0.75x the XLA path's step


def unsupported_kivi(q_dtype, head_dim: int, k_store, v_store, ring_dtype, residual: int, sinks=None) -> str | None:
    """Why the native kernel cannot serve this KIVI cache (sinks: `(k_sink, v_sink)` or None), or None when it can.
    Pre-RoPE keys and codebooks need nothing more (the kernel rotates any head_dim it serves, and maps any codebook
    of 2^bits levels)."""
    if (k_store.axis, v_store.axis) != ("channel", "token"):
        return f"only KIVI's axes (keys per-channel, values per-token) have a kernel, not {k_store.axis}/{v_store.axis}"
    if k_store.bits not in KERNEL_BITS or v_store.bits not in KERNEL_BITS:
        return f"the kernel handles {KERNEL_BITS}-bit codes, not k_bits={k_store.bits}, v_bits={v_store.bits}"
    if head_dim not in HEAD_DIMS:
        return f"the kernel handles head_dim {HEAD_DIMS}, not {head_dim}"
    if k_store.group_size not in KERNEL_KEY_GROUPS:
        return f"the kernel handles group sizes {KERNEL_KEY_GROUPS}, not {k_store.group_size}"
    if v_store.group_size % 16 or head_dim % v_store.group_size:
        return f"the value channel group {v_store.group_size} must be a multiple of 16 dividing head_dim={head_dim}"
    if residual % k_store.group_size:
        return f"residual_length={residual} is not a multiple of group_size={k_store.group_size}"
    if jnp.dtype(q_dtype) != jnp.float32:
        return f"the kernel computes in float32: queries in {jnp.dtype(q_dtype).name} are not served"
    if jnp.dtype(ring_dtype) not in RING_DTYPES:
        return f"the kernel reads a float32, float16 or bfloat16 ring, not {jnp.dtype(ring_dtype).name}"
    if k_store.scale.dtype not in SCALE_DTYPES or k_store.scale.dtype != v_store.scale.dtype:
        return f"scales in {k_store.scale.dtype} / {v_store.scale.dtype} are not served"
    if sinks is not None and jnp.dtype(sinks[0].dtype) != jnp.float32:
        return f"the kernel reads float32 sinks, not {jnp.dtype(sinks[0].dtype).name}"
    if k_store.paged != v_store.paged:
        return "the key and value stores must both be paged or both contiguous"
    return None


def unsupported_full(q_dtype, head_dim: int, cache_dtype) -> str | None:
    """Why the native full-precision kernel cannot serve this cache, or None when it can."""
    if head_dim not in HEAD_DIMS:
        return f"the kernel handles head_dim {HEAD_DIMS}, not {head_dim}"
    if jnp.dtype(q_dtype) != jnp.float32 or jnp.dtype(cache_dtype) != jnp.float32:
        return f"the kernel computes in float32, not {jnp.dtype(cache_dtype).name}"
    return None


def _stacked(x: jax.Array, layer):
    return x[None] if layer is None else x


def _layer_operand(layer) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())


def _window(window) -> int:
    return 0 if window is None else int(window)


def int8_dots() -> bool:
    """Whether the built kernel dots 2-bit keys and values in integers when `decode_kivi(..., int8_dots=True)` asks
    (AVX-512 BW and VBMI; elsewhere it computes in float32 as without the flag)."""
    lib = build.load()
    return lib is not None and bool(lib.kivi_jax_int8_dots())


def decode_kivi(q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, window, sinks=None,
                inv_freq=None, int8_dots: bool = False) -> jax.Array:
    """Decode attention over one layer of a KIVI cache with the native kernel.

    q `[batch, 1, q_heads, head_dim]` float32; stores (QuantStore: codes, scale, mn, bits, group_size; a PagedStore's
    pools `[layers, pages, kv_heads, R or R // G, ...]` are read through its block table, an entry holding no page
    as zeros like the XLA path, only the pages of tokens attended), rings and
    `sinks = (k_sink, v_sink)` (None: no sinks) `[layers, batch, kv_heads, ...]` with `layer` a (traced) index, or
    one layer each with `layer=None` (rings in float32, float16 or bfloat16, read as stored and widened to float32;
    any other dtype is cast to float32 first); length `[batch]`; k_new (after RoPE), v_new `[batch, 1, kv_heads,
    head_dim]` at position length; `inv_freq [head_dim // 2]` float32 marks keys stored before RoPE (codes, ring,
    sinks); a store's `levels` (codebook) go along as an operand. `int8_dots`, where `int8_dots()`: 2-bit uniform
    keys after RoPE are scored with the folded query rounded to int8 per row and key group, 2-bit uniform values
    summed with the weights rounded to 8 bits per row, key group and value group (the twin:
    `attention.decode_kivi_xla(..., int8_dots=True)`).
    Returns q's shape, float32.
    """
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    arrays = [_stacked(x, layer) for x in (k_store.codes, k_store.scale, k_store.mn, v_store.codes, v_store.scale,
                                           v_store.mn, k_ring, v_ring)]
    head_dim = q.shape[-1]
    if sinks is None or sinks[0].shape[-2] == 0:  # [1, 1, 1, 0, D]: S = 0, nothing read
        k_sink = v_sink = jnp.zeros((1, 1, 1, 0, head_dim), jnp.float32)
    else:
        k_sink, v_sink = (_stacked(s, layer).astype(jnp.float32) for s in sinks)
    freqs = jnp.zeros((head_dim // 2,), jnp.float32) if inv_freq is None else inv_freq.astype(jnp.float32)
    levels = [jnp.asarray(s.levels or (0.0,), jnp.float32) for s in (k_store, v_store)]  # (0,): uniform, not read
    if k_store.paged:  # pools [layers, pages, ...] read through the block table (one table for keys and values)
        table = k_store.table.astype(jnp.int32)
    else:  # a contiguous store: sequence b's one page is its batch row
        table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
    rings = [r if r.dtype in RING_DTYPES else r.astype(jnp.float32) for r in arrays[6:]]  # 16-bit: never copied
    call = jax.ffi.ffi_call("kivi_jax_kivi_decode", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32), *arrays[:6], *rings,
        _layer_operand(layer), length.astype(jnp.int32), table, k_new.astype(jnp.float32), v_new.astype(jnp.float32),
        k_sink, v_sink, freqs.reshape(head_dim // 2), *levels,
        k_bits=int(k_store.bits), v_bits=int(v_store.bits), k_group=int(k_store.group_size),
        v_group=int(v_store.group_size), window=_window(window), rope=int(inv_freq is not None),
        k_codebook=len(k_store.levels or ()), v_codebook=len(v_store.levels or ()), int8_dots=int(int8_dots),
    )


def decode_full(q, k_cache, v_cache, layer, length, k_new, v_new, window) -> jax.Array:
    """Decode attention over one layer of a full-precision float32 cache `[(layers,) batch, kv_heads, tokens,
    head_dim]` holding `length [batch]` tokens, with the native kernel; the arguments of `decode_full_xla`."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    call = jax.ffi.ffi_call("kivi_jax_full_decode", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32), _stacked(k_cache, layer).astype(jnp.float32),
        _stacked(v_cache, layer).astype(jnp.float32), _layer_operand(layer), length.astype(jnp.int32),
        k_new.astype(jnp.float32), v_new.astype(jnp.float32), window=_window(window),
    )


EIGHT_FORMATS = {"int8": 0, "fp8-e4m3": 1, "fp8-e5m2": 2}  # the kernel's `fmt` attribute


def unsupported_eight(q_dtype, head_dim: int) -> str | None:
    """Why the native kernel cannot serve an 8-bit cache (kivi_jax.cache8), or None when it can."""
    if head_dim not in HEAD_DIMS:
        return f"the kernel handles head_dim {HEAD_DIMS}, not {head_dim}"
    if jnp.dtype(q_dtype) != jnp.float32:
        return f"the kernel computes in float32, not {jnp.dtype(q_dtype).name}"
    return None


def decode_eight(q, k_store, v_store, layer, length, k_new, v_new, window, fmt: str) -> jax.Array:
    """Decode attention over one layer of an 8-bit cache (`cache8.Store8`: codes `[layers, batch, kv_heads, tokens,
    head_dim]`, the uint8 bytes of int8 / float8 values, per-token float16 scales or None) with the native kernel; the twin of
    `attend_full_xla` over the same stores with T = 1."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    codes = [k_store.data, v_store.data]  # uint8: the values' bytes
    scaled = k_store.scale is not None
    none = jnp.zeros((1,), jnp.float16)
    scales = [s.scale.astype(jnp.float16) if scaled else none for s in (k_store, v_store)]
    call = jax.ffi.ffi_call("kivi_jax_eight_decode", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), *codes, *scales, _layer_operand(layer), length.astype(jnp.int32),
                k_new.astype(jnp.float32), v_new.astype(jnp.float32), window=_window(window),
                fmt=EIGHT_FORMATS[fmt], scaled=int(scaled))
