"""The native weight matmuls as jax functions, run through `jax.ffi.ffi_call` on the CPU backend: `y = x M^T` for a
`kivi_jax.weights.QuantizedMatrix` (`matmul_cpu.cc`; its pure-jnp twin is the matrix's XLA path, dequantize then
dot) and `y = x W` / `x T^T` for a float32 `kivi_jax.weights.FloatMatrix` (`fmatmul_cpu.cc`; twin: XLA's dot). The
stacked `[layers, ...]` leaves are operands read in place at the layer index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.native import build

SPLIT_ROWS = 64  # activation rows a decode step's path takes (past 8 it dequantizes each weight row once for all of
# them); more (a prefill chunk) go a packed strip at a time (gemm.h: a quantized matrix's rows decoded into it), but
# for a float32 table (the head over every position: XLA's dot)
BITS = (4, 8)


def bf16_rows() -> int:
    """Activation rows a bf16 matrix takes the native kernel for; more go to XLA's bfloat16 dot. With AMX the kernel
    runs tiles and takes any number (a SmolLM2 step at 32 rows 0.75x, at 64 0.90x XLA's; a 512- or 1,536-token
    prefill 0.89-0.91x, docs/kernels.md); without it, widening the weights, only up to 16 (at 32 rows a tie, at 64
    1.4x XLA's)."""
    return 1 << 30 if build.has_amx() else 16


BF16_ROWS = bf16_rows()


def int8_matmul() -> bool:
    """Whether the built kernel takes int8 activations (`dot_dtype='int8'`: AVX512-VNNI and BW)."""
    lib = build.load()
    return lib is not None and bool(lib.kivi_jax_int8_matmul())


STRIP_ROWS = 16  # activation rows past which a call of float32 activations takes packed strips (matmul_cpu.cc)


def strip_rows() -> int | None:
    """Weight rows of the built kernel's packed strips (what `weights.strip_layout` lays a strip-major copy out
    for: 32 with AVX-512, 16 with AVX2), or None when the kernels are not built."""
    lib = build.load()
    return None if lib is None else int(lib.kivi_jax_strip_rows())


def takes_int8(bits: int, group: int) -> bool:
    """Whether codes of `bits` bits in groups of `group` columns may dot int8 activations (`weights.q8_dot`): 4 or
    8 bits, groups a multiple of 4 (the kernel's dots take four columns at a time)."""
    return bits in BITS and group % 4 == 0


def unsupported(w, rows: int, x_dtype) -> str | None:
    """Why the native kernel cannot compute `x M^T` for this matrix and `rows` activation rows, or None."""
    if w.dot_dtype == "int8":
        if not takes_int8(w.bits, w.group):
            return f"int8 activations need 4- or 8-bit codes in groups of a multiple of 4, not {w.bits}-bit, {w.group}"
        if not int8_matmul():
            return "int8 activations need AVX512-VNNI (this build has none)"
    if w.bits == 16:
        if rows > BF16_ROWS:
            return f"{rows} activation rows of a bf16 matrix is more than the native path's {BF16_ROWS} (XLA's dot)"
        return None if jnp.dtype(x_dtype) == jnp.float32 else "the kernel takes float32 activations"
    if w.bits not in BITS:
        return f"the kernel reads {BITS}-bit codes, not {w.bits}"
    if jnp.dtype(x_dtype) != jnp.float32:
        return f"the kernel computes in float32, not {jnp.dtype(x_dtype).name}"
    if w.bits == 4 and w.group % 2:
        return f"4-bit groups of {w.group} columns must be even"
    return None


def call_layer(ws) -> jax.Array:
    """The layer index `[]` int32 one native call reads its matrices' stacks at (0 for single matrices), the kernels
    built; raises when they are not, or when the matrices disagree."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    layer = next((w.layer for w in ws if w.layer is not None), None)
    if any((w.layer is None) != (layer is None) for w in ws):
        raise ValueError("matrices of one call must all be read at the same layer, or all be single matrices")
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())


def qmatmul(x: jax.Array, *ws) -> tuple[jax.Array, ...]:
    """`x [n, cols]` float32 times `M^T` of each quantized matrix in `ws` (matrices sharing their input, e.g. q, k
    and v; each one layer, or a stack read at its `layer`) -> one `[n, rows]` float32 array each, in one call. A
    matrix with `dot_dtype='int8'` takes x rounded to int8 per group (twin: `kivi_jax.weights.q8_dot`); one with a
    strip-major copy (`weights.with_strips`) gives the same results, decoding that copy past STRIP_ROWS rows."""
    layer = call_layer(ws)
    operands, results = [], []
    for w in ws:
        stack = (lambda a: a) if w.codes.ndim == 3 else (lambda a: a[None])
        codes, scale = stack(w.codes), stack(w.scale)
        mn = jnp.zeros((0,), scale.dtype) if w.mn is None else stack(w.mn)
        strips = jnp.zeros((0,), jnp.uint8) if w.strips is None else stack(w.strips)
        operands += [codes, scale, mn, strips]
        results.append(jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), jnp.float32))
    call = jax.ffi.ffi_call("kivi_jax_qmatmul", tuple(results))
    return tuple(call(x.astype(jnp.float32), layer, *operands, bits=np.array([w.bits for w in ws], np.int64),
                      group=np.array([w.group for w in ws], np.int64),
                      offset=np.array([w.offset for w in ws], np.int64),
                      int8=np.array([w.dot_dtype == "int8" for w in ws], np.int64)))


def bmatmul(x: jax.Array, *ws) -> tuple[jax.Array, ...]:
    """`x [n, cols]` float32, rounded to bfloat16 by the kernel (to nearest even, as XLA converts), times `M^T` of
    each `bf16` matrix in `ws` (its bits `[(layers,) rows, cols]` uint16 and float32 row scales; matrices sharing
    their input, each one matrix or a stack read at its `layer`) -> one `[n, rows]` float32 array each, in one call
    (`fmatmul_cpu.cc`; twin: `kivi_jax.weights.bf16_dot`)."""
    layer = call_layer(ws)
    operands = []
    for w in ws:
        stack = (lambda a: a) if w.codes.ndim == 3 else (lambda a: a[None])
        operands += [stack(w.codes), stack(w.scale).astype(jnp.float32)]
    results = [jax.ShapeDtypeStruct((x.shape[0], w.num_rows), jnp.float32) for w in ws]
    return tuple(jax.ffi.ffi_call("kivi_jax_bmatmul", tuple(results))(x.astype(jnp.float32), layer, *operands))


def fmatmul(x: jax.Array, *ws) -> tuple[jax.Array, ...]:
    """`x [n, cols]` float32 times each float32 matrix of `ws` (`FloatMatrix`: a projection `[(layers,) cols, rows]`
    or a table `[rows, cols]`, matrices sharing their input; each one matrix, or a stack read at its `layer`) -> one
    `[n, rows]` float32 array each, in one call."""
    layer = call_layer(ws)
    operands = [w.w if w.w.ndim == 3 else w.w[None] for w in ws]
    results = [jax.ShapeDtypeStruct((x.shape[0], w.num_rows), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call("kivi_jax_fmatmul", tuple(results))
    return tuple(call(x.astype(jnp.float32), layer, *(o.astype(jnp.float32) for o in operands),
                      projection=np.array([int(w.transposed) for w in ws], np.int64)))
