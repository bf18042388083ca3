"""Weights that stay quantized (docs/design.md §13): the formats, their exact dequantization, quantizers from float,
and the matmul every projection runs through (`models.weights.dot`).

A `QuantizedMatrix` holds a matrix `M [rows, cols]` row by row in groups of G consecutive columns:
`M[r, c] = (code[r, c] - offset) * scale[r, c // G] (+ mn[r, c // G])`, in float32 arithmetic. A projection `W [in,
out]` is held as `M = W.T` (rows are output units, `transposed=True`), an embedding table as itself. The formats:

| name | codes | G | scale / min | from |
|---|---|---|---|---|
| `q8_0` | int8 | 32 | float16 scale | GGUF, kept as stored |
| `q4_0` | 4-bit, offset 8 | 32 | float16 scale | GGUF, kept as stored |
| `q4_1` | 4-bit | 32 | float16 scale and min | GGUF, kept as stored |
| `int8` | int8 | a row | float32 scale (symmetric, per output channel) | any float model |
| `int4-gG` | 4-bit | G (32/64/128) | float16 scale and min (asymmetric) | any float model |
| `int4s-gG` | 4-bit, offset 8 | G | float16 scale (symmetric) | any float model |
| `bf16` | bfloat16 (its bits, uint16) | a row | float32 scale, 1 | `weights='bfloat16'` under a float32 model |

4-bit codes are two a byte in GGUF's layout: byte j of a group holds code j in its low nibble and code j + G/2 in its
high one. GGUF blocks dequantize bit for bit as `gguf.quants.dequantize` does. A `bf16` matrix is a float one rounded to
bfloat16 whose dot reads bfloat16 operands and sums in float32 (`bf16_dot`): float32 activations, norms, a decode
step's attention and the cache around bfloat16 weights (a prefill chunk's attention dots in bfloat16 too), at AMX's
rate on a CPU that has it; its codes are the bits as uint16 because XLA:CPU widens a whole bfloat16 stack to float32
to slice a layer out of it, and not an integer one.

`matmul_t(x) = x @ M.T`: on the CPU backend, for float32 inputs of any number of rows, the native kernel reads the
codes once (`kivi_jax/native/matmul_cpu.cc`; past `native.matmul.STRIP_ROWS` rows, a prefill chunk's or a batched
decode step's, decoded a strip of rows at a time into gemm.h's packed tiles); otherwise (GPU, TPU, a device mesh,
`impl="xla"`, other dtypes) the XLA path dequantizes inside the dot. A matrix may also hold a strip-major copy of its
codes (`with_strips`, which the serving engine makes): the strips then decode it with no transposition, giving the
same products. A float32 projection seen through `native_view` (`FloatMatrix`) takes its native kernel for any
number of rows too; a float32 table for at most `native.matmul.SPLIT_ROWS`. Inside the layer scan a stacked weight is
read at the layer index (`at_layer`), never sliced.
"""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kivi_jax.models import registry
from kivi_jax.models.decoder import cast_params, leaves_by_path, replace_leaves

IMPLS = ("auto", "xla", "native")
GGUF_FORMATS = ("q8_0", "q4_0", "q4_1")
GROUPS = (32, 64, 128)
FLOAT_WEIGHTS = ("float32", "bfloat16", "float16")
_INT4 = re.compile(r"^int4(s?)-g(\d+)$")

WEIGHTS_HELP = (
    "weights: 'auto' (a GGUF keeps its own quantized blocks, Q8_0/Q4_0/Q4_1; any other model its float weights), "
    "'gguf' (a GGUF's blocks, required), 'float32' | 'bfloat16' | 'float16' (float weights; 'bfloat16' with "
    "dtype float32: bfloat16 matrices, float32 activations), 'int8' (per output "
    "channel, symmetric), 'int4-g32' | 'int4-g64' | 'int4-g128' (4-bit, G columns a group, scale and min; "
    "embeddings and head in int8) or 'int4s-gG' (4-bit symmetric)"
)


@struct.dataclass
class QuantizedMatrix:
    """`M [rows, cols]` (or a stack `[layers, rows, cols]`) quantized row by row in groups of `group` columns."""

    codes: jax.Array  # [(layers,) rows, cols] int8 (8-bit) or uint16 (bf16), or [(layers,) rows, cols // 2] uint8
    scale: jax.Array  # [(layers,) rows, cols // group] float16 or float32
    mn: jax.Array | None  # like scale (asymmetric formats), else None
    layer: jax.Array | None = None  # set inside the layer scan: read the stack at this index
    strips: jax.Array | None = None  # [(layers,) strips, bytes] uint8: the strip-major copy (`with_strips`), or None
    fmt: str = struct.field(pytree_node=False, default="q8_0")
    bits: int = struct.field(pytree_node=False, default=8)
    group: int = struct.field(pytree_node=False, default=32)
    offset: int = struct.field(pytree_node=False, default=0)  # subtracted from 4-bit codes (Q4_0, int4s: 8)
    transposed: bool = struct.field(pytree_node=False, default=True)  # a projection W [in, out], M = W.T
    impl: str = struct.field(pytree_node=False, default="auto")
    dot_dtype: str = struct.field(pytree_node=False, default="float32")  # XLA's dot operands (`dot_view`)

    @property
    def operand_dtype(self) -> str:
        """The dtype the matmul rounds its operands to (the model seam's `operand_dtype`)."""
        return "bfloat16" if self.bits == 16 else self.dot_dtype

    # -- shapes -------------------------------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.codes.shape[-2]

    @property
    def num_cols(self) -> int:
        return self.codes.shape[-1] * 2 if self.bits == 4 else self.codes.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float leaf it stands for: `[(layers,) in, out]` for a projection, `[rows, cols]` else."""
        lead = self.codes.shape[:-2]
        return lead + ((self.num_cols, self.num_rows) if self.transposed else (self.num_rows, self.num_cols))

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in (self.codes, self.scale, self.mn, self.strips) if a is not None)

    # -- reading ------------------------------------------------------------------------------------------------------

    def at_layer(self, layer: jax.Array) -> "QuantizedMatrix":
        """A stacked matrix read at the (traced) `layer` index by `matmul_t` (models.weights.join_layer)."""
        return self.replace(layer=layer)

    def _leaves(self):
        """(codes, scale, mn) of the matrix in use: the stack at `layer` when set."""
        if self.layer is None:
            return self.codes, self.scale, self.mn
        pick = lambda a: None if a is None else a[self.layer]
        return pick(self.codes), pick(self.scale), pick(self.mn)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """`M` (or its stack) in float: exactly `(code - offset) * scale + mn` in float32, then cast to `dtype`."""
        codes, scale, mn = self._leaves()
        return _dequantize(codes, scale, mn, self.bits, self.group, self.offset).astype(dtype)

    def logical(self, dtype=jnp.float32) -> jax.Array:
        """The float leaf it stands for (`W [(layers,) in, out]` for a projection, the table itself else)."""
        m = self.dequantize(dtype)
        return jnp.swapaxes(m, -1, -2) if self.transposed else m

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `M[ids]` -> float32 `[..., cols]` (an embedding lookup: only those rows are read)."""
        codes, scale, mn = self._leaves()
        take = lambda a: None if a is None else a[ids]
        return _dequantize(take(codes), take(scale), take(mn), self.bits, self.group, self.offset)

    def matmul_t(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """`x [..., cols] @ M.T -> [..., rows]` in `out_dtype` (default x's dtype)."""
        return matmul_many(x, (self,), out_dtype)[0]

    def matmul_t_many(self, x: jax.Array, ws, out_dtype=None) -> tuple[jax.Array, ...]:
        """`matmul_t` of each matrix in `ws` (this one among them) with the same `x`, in one native call when they
        take the native kernel (models.weights.dot_many)."""
        return matmul_many(x, tuple(ws), out_dtype)

    def native_reason(self, rows: int, x_dtype) -> str | None:
        """Why a matmul of `rows` activation rows cannot take the native kernel here, or None when it may."""
        from kivi_jax.native import matmul

        return native_reason(self.impl, lambda: (None if self.dot_dtype == "int8" else bf16_reason(self.dot_dtype))
                             or matmul.unsupported(self, rows, x_dtype))


def q8_rows(x: jax.Array, group: int):
    """`x [..., cols]` rounded to int8 in groups of `group` columns, as llama.cpp's Q8 activations: each group's
    scale d = amax / 127 (amax its largest magnitude) and codes round(x * (127 / amax)) to nearest even -> (codes
    `[..., groups, G]` int32, d `[..., groups]`, the rounded groups' sums d Σ codes `[..., groups]`)."""
    g = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // group, group))
    amax = jnp.max(jnp.abs(g), axis=-1)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    codes = jnp.round(g * inv[..., None]).astype(jnp.int32)
    d = amax / 127.0
    return codes, d, jnp.sum(codes, axis=-1).astype(jnp.float32) * d


def q8_dot(x: jax.Array, w: "QuantizedMatrix", out_dtype) -> jax.Array:
    """`x @ M.T` with x rounded to int8 per group of M's columns (`q8_rows`; a matrix of `dot_dtype='int8'`, a
    prefill view's): y = Σ_g scale d Σ_c code q (exact integer sums) + Σ_g (mn - offset * scale) d Σ_c q, the
    dequantized matrix times x rounded. The native kernel's contract (matmul_cpu.cc, AVX512-VNNI)."""
    codes, scale, mn = w._leaves()
    c = (_unpack4(codes, w.group) if w.bits == 4 else codes).astype(jnp.int32)
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // w.group, w.group))  # [rows, groups, G]
    q, d, sums = q8_rows(x, w.group)  # [..., groups, G], [..., groups], [..., groups]
    ints = jnp.einsum("...gc,rgc->...rg", q, c, preferred_element_type=jnp.int32)  # [..., rows, groups]
    scale = scale.astype(jnp.float32)
    y = jnp.sum(ints.astype(jnp.float32) * (scale * d[..., None, :]), axis=-1)
    mins = (jnp.zeros_like(scale) if mn is None else mn.astype(jnp.float32)) - w.offset * scale
    if mn is not None or w.offset:
        y = y + jnp.einsum("...g,rg->...r", sums, mins)
    return y.astype(out_dtype)


def bf16_reason(dot_dtype: str) -> str | None:
    """The native kernels compute float32: a matrix whose dot reads bfloat16 operands takes XLA's dot."""
    return None if dot_dtype == "float32" else f"its dot reads {dot_dtype} operands (dot_view)"


def xla_dot(x: jax.Array, w: jax.Array, spec: str, dot_dtype: str, out_dtype) -> jax.Array:
    """XLA's `einsum(spec, x, w)` in `out_dtype`, the operands first rounded to `dot_dtype` (float32 sums whatever it
    is: on a CPU with AMX or AVX512-BF16 a bfloat16 dot of a prefill chunk runs several times a float32 one's rate)."""
    if dot_dtype != "float32":
        x, w = x.astype(dot_dtype), w.astype(dot_dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32 if dot_dtype != "float32" else out_dtype
                      ).astype(out_dtype)


BF16_MIN_ROWS = 8  # XLA:CPU's bfloat16 dot of fewer rows is slow (one row by the 49,152-row head: 11x 8 rows' time)


def bf16_dot(x: jax.Array, w: "QuantizedMatrix", out_dtype) -> jax.Array:
    """`x [..., cols] @ M.T` for a `bf16` matrix: x rounded to bfloat16, the products summed in float32, times the
    rows' scales -> `[..., rows]` in `out_dtype`; fewer than BF16_MIN_ROWS rows are padded to that many."""
    codes, scale, _ = w._leaves()
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [n, cols]
    n = flat.shape[0]
    if n < BF16_MIN_ROWS:
        flat = jnp.pad(flat, ((0, BF16_MIN_ROWS - n), (0, 0)))
    m = jax.lax.bitcast_convert_type(codes, jnp.bfloat16)  # [rows, cols]
    y = jnp.einsum("nc,rc->nr", flat.astype(jnp.bfloat16), m, preferred_element_type=jnp.float32)
    y = y[:n] * scale[:, 0]  # [n, rows]
    return y.reshape(lead + (w.num_rows,)).astype(out_dtype)


def native_reason(impl: str, unsupported) -> str | None:
    """Why a weight matrix of `impl` cannot take its native kernel (`unsupported()`: the kernel's own reason about the
    shapes and dtypes, or None), or None when it may: not with `impl='xla'`, a device mesh or no native build."""
    if impl == "xla":
        return "impl='xla'"
    from kivi_jax import native
    from kivi_jax.mesh_scope import active_mesh

    reason = unsupported()
    if reason is None and active_mesh() is not None:
        reason = "a device mesh is active (XLA partitions the dot)"
    if reason is None and not native.available():
        reason = f"the native kernels are unavailable ({native.error()})"
    return reason


def native_or_xla(ws: tuple, rows: int, x_dtype, cpu, xla):
    """`cpu()` (the native kernel) when every matrix of `ws` may take it for `rows` activation rows, chosen when
    lowering (`lax.platform_dependent`: a program lowered for a GPU or TPU gets `xla()`); else `xla()`, with a
    warning for a matrix whose `impl='native'` could not be honoured."""
    reasons = [w.native_reason(rows, x_dtype) for w in ws]
    if any(reasons):
        for w, why in zip(ws, reasons):
            if w.impl == "native" and why:
                warnings.warn(f"weights impl 'native': {why}; using the XLA path", stacklevel=5)
        return xla()
    return jax.lax.platform_dependent(cpu=cpu, default=xla)


def matmul_many(x: jax.Array, ws: tuple, out_dtype=None) -> tuple[jax.Array, ...]:
    """`x [..., cols] @ M_i.T` for each quantized matrix `M_i` of `ws` -> a `[..., rows_i]` array each, in
    `out_dtype` (default x's dtype). On the CPU, when every matrix may take the native kernel, one native call reads
    them all (`lax.platform_dependent`: a program lowered for a GPU or TPU gets XLA's dot); otherwise XLA
    dequantizes each inside its dot."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead, cols = x.shape[:-1], x.shape[-1]
    for w in ws:
        if cols != w.num_cols:
            raise ValueError(f"x has {cols} columns but a matrix ({w.fmt}) has {w.num_cols}")
    n = math.prod(lead)

    def xla():  # XLA fuses each dequantization into its dot's operand
        def one(w):
            if w.bits == 16:
                return bf16_dot(x, w, out_dtype)
            if w.dot_dtype == "int8":
                return q8_dot(x, w, out_dtype)
            return xla_dot(x, w.dequantize(x.dtype if w.dot_dtype == "float32" else w.dot_dtype), "...c,rc->...r",
                           w.dot_dtype, out_dtype)

        return tuple(one(w) for w in ws)

    def cpu():
        from kivi_jax.native import matmul

        flat = x.reshape(n, cols)
        half = [i for i, w in enumerate(ws) if w.bits == 16]  # bf16: one call, up to BF16_ROWS rows
        rest = [i for i, w in enumerate(ws) if w.bits != 16]
        ys = [None] * len(ws)
        if half:
            outs = matmul.bmatmul(flat.astype(jnp.float32), *(ws[i] for i in half))  # rounded to bf16 in it
            for i, y in zip(half, outs):
                ys[i] = y
        if rest:
            for i, y in zip(rest, matmul.qmatmul(flat, *(ws[i] for i in rest))):
                ys[i] = y
        return tuple(y.reshape(lead + (w.num_rows,)).astype(out_dtype) for y, w in zip(ys, ws))

    return native_or_xla(ws, n, x.dtype, cpu, xla)


@struct.dataclass
class FloatMatrix:
    """A float32 projection `W [(layers,) in, out]` (`transposed`) or table `T [rows, cols]` that the model sees as a
    matrix with `matmul_t`, as it sees a `QuantizedMatrix`: made inside a trace by `native_view`, so that a decode
    step's matmuls and a prefill chunk's projections run in the native CPU kernel, which reads a stacked leaf in
    place at the layer index (XLA's dot would first copy the layer's slice out of the stack: a quarter of a 32-row
    step's time, docs/kernels.md)."""

    w: jax.Array
    layer: jax.Array | None = None
    transposed: bool = struct.field(pytree_node=False, default=True)
    impl: str = struct.field(pytree_node=False, default="auto")
    dot_dtype: str = struct.field(pytree_node=False, default="float32")  # XLA's dot operands (`dot_view`)

    @property
    def operand_dtype(self) -> str:
        """The dtype the matmul rounds its operands to (the model seam's `operand_dtype`)."""
        return self.dot_dtype

    @property
    def num_rows(self) -> int:
        """Output units (`M = W.T` has one a row)."""
        return self.w.shape[-1] if self.transposed else self.w.shape[-2]

    @property
    def num_cols(self) -> int:
        return self.w.shape[-2] if self.transposed else self.w.shape[-1]

    def at_layer(self, layer: jax.Array) -> "FloatMatrix":
        return self.replace(layer=layer)

    def _matrix(self) -> jax.Array:
        """The matrix in use (the stack at `layer`: a slice XLA copies)."""
        return self.w if self.layer is None else self.w[self.layer]

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `T[ids]` of a table (an embedding lookup)."""
        return self._matrix()[ids]

    def matmul_t(self, x: jax.Array, out_dtype=None) -> jax.Array:
        return float_matmul_many(x, (self,), out_dtype)[0]

    def matmul_t_many(self, x: jax.Array, ws, out_dtype=None) -> tuple[jax.Array, ...]:
        return float_matmul_many(x, tuple(ws), out_dtype)

    def native_reason(self, rows: int, x_dtype) -> str | None:
        """Why a matmul of `rows` activation rows cannot take the native kernel here, or None when it may."""
        from kivi_jax.native import matmul

        def unsupported():
            if bf16_reason(self.dot_dtype):
                return bf16_reason(self.dot_dtype)
            if rows > matmul.SPLIT_ROWS and not self.transposed:
                return f"{rows} activation rows of a table is more than the native path's {matmul.SPLIT_ROWS}"
            if jnp.dtype(x_dtype) != jnp.float32 or jnp.dtype(self.w.dtype) != jnp.float32:
                return "the kernel computes float32 weights and activations"
            return None

        return native_reason(self.impl, unsupported)


def float_matmul_many(x: jax.Array, ws: tuple, out_dtype=None) -> tuple[jax.Array, ...]:
    """`x [..., cols]` times each float matrix of `ws` -> `[..., rows_i]` each, in `out_dtype` (default x's): on the
    CPU one native call for all of them when each may take the kernel (`lax.platform_dependent`: a program lowered
    for a GPU or TPU gets XLA's dot), else XLA's dot."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead, cols = x.shape[:-1], x.shape[-1]
    n = math.prod(lead)

    def xla():
        return tuple(xla_dot(x, w._matrix(), "...c,co->...o" if w.transposed else "...c,rc->...r", w.dot_dtype,
                             out_dtype) for w in ws)

    def cpu():
        from kivi_jax.native import matmul

        ys = matmul.fmatmul(x.reshape(n, cols), *ws)
        return tuple(y.reshape(lead + (w.num_rows,)).astype(out_dtype) for y, w in zip(ys, ws))

    return native_or_xla(ws, n, x.dtype, cpu, xla)


def native_view(params, impl: str = "auto"):
    """`params` with every float32 projection and table seen as a `FloatMatrix` (a view, no copy: for use inside a
    jitted decode step or prefill chunk), so that the native CPU kernel computes their matmuls; other params (and
    matrices already seen through a view, e.g. `dot_view`'s bfloat16 ones) as they are. Under a
    device mesh `params` as they are: XLA partitions the dots there, and reads each layer's slice of a sharded stack
    through the model's scan (a view indexed at the layer would gather the stack across devices)."""
    from kivi_jax.mesh_scope import active_mesh

    if active_mesh() is not None:
        return params
    new = {name: FloatMatrix(w, transposed=not table, impl=impl) for name, w, table in _quantizable(params)
           if isinstance(w, jax.Array) and jnp.dtype(w.dtype) == jnp.float32}
    return replace_leaves(params, new) if new else params


PREFILL_PRECISIONS = ("float32", "bfloat16", "int8")
DECODE_PRECISIONS = ("float32", "int8")  # a decode step's (its bfloat16 would be XLA's dot: not offered)
PREFILL_CHOICES = PREFILL_PRECISIONS + ("auto",)  # what the server's flags take: 'auto' is `auto_precision`
DECODE_CHOICES = DECODE_PRECISIONS + ("auto",)


def takes_int8(w) -> bool:
    """Whether a matrix may dot int8 activations (`q8_dot`): quantized, with codes `native.matmul.takes_int8` takes."""
    from kivi_jax.native import matmul

    return is_quantized(w) and matmul.takes_int8(w.bits, w.group)


def auto_precision(params, mesh=None) -> str:
    """The server's `--prefill-precision auto` and `--decode-precision auto`: 'int8' where the params hold matrices
    that take int8 activations and the native kernel takes them on this CPU (AVX512-VNNI; docs/serving.md measures
    its speed and its loss), else 'float32' (and on a device mesh, where the native kernels do not run and int8 would
    be XLA's twin)."""
    from kivi_jax.native import matmul

    if mesh is not None or jax.default_backend() != "cpu":
        return "float32"
    quantized = any(takes_int8(w) for _, w, _ in _quantizable(params))
    return "int8" if quantized and matmul.int8_matmul() else "float32"


def resolve_precision(precision: str, params, mesh=None) -> str:
    """`precision` as a prefill or decode runs it: 'auto' becomes `auto_precision(params, mesh)`, others stay."""
    return auto_precision(params, mesh) if precision == "auto" else precision


def dot_view(params, precision: str = "float32", stage: str = "prefill"):
    """`params` whose projections and tables dot their activations with operands rounded to `precision` (float32
    sums), for a prefill chunk (`stage` 'prefill': any of PREFILL_PRECISIONS) or a decode step ('decode':
    DECODE_PRECISIONS): 'float32' returns them as they are; 'bfloat16' shows float32 weights as `FloatMatrix` and
    quantized ones as themselves with `dot_dtype='bfloat16'` (views: nothing copied), an approximation for CPUs whose
    bfloat16 dot is fast (AMX, AVX512-BF16); 'int8' rounds the activations of 4- and 8-bit matrices to int8 per group
    (`q8_dot`, llama.cpp's Q8 activations, AVX512-VNNI's integer dots), other weights as they are. docs/serving.md
    measures what each changes. 'auto': `auto_precision`."""
    choices = {"prefill": PREFILL_PRECISIONS, "decode": DECODE_PRECISIONS}[stage]
    precision = resolve_precision(precision, params)
    if precision not in choices:
        raise ValueError(f"{stage} precision {precision!r} is not one of {', '.join(choices)}")
    if precision == "float32":
        return params
    if precision == "int8":
        new = {name: w.replace(dot_dtype="int8") for name, w, _ in _quantizable(params) if takes_int8(w)}
        return replace_leaves(params, new) if new else params
    new = {name: (w.replace(dot_dtype=precision) if is_quantized(w) else
                  FloatMatrix(w, transposed=not table, dot_dtype=precision))
           for name, w, table in _quantizable(params)}
    return replace_leaves(params, new)


def _unpack4(codes: jax.Array, group: int) -> jax.Array:
    """4-bit codes `[..., cols // 2]` (GGUF layout within each group) -> uint8 codes `[..., cols]`."""
    half = group // 2
    g = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // half, half))  # [..., groups, G/2]
    both = jnp.concatenate([g & 0xF, g >> 4], axis=-1)  # [..., groups, G]: codes j and j + G/2
    return both.reshape(codes.shape[:-1] + (codes.shape[-1] * 2,))


def _dequantize(codes, scale, mn, bits: int, group: int, offset: int) -> jax.Array:
    """float32 `(code - offset) * scale + mn` with scale and mn broadcast over their groups."""
    if bits == 16:
        c = jax.lax.bitcast_convert_type(codes, jnp.bfloat16).astype(jnp.float32)
    else:
        c = (_unpack4(codes, group) if bits == 4 else codes).astype(jnp.float32)
    if offset:
        c = c - float(offset)
    grouped = c.reshape(c.shape[:-1] + (c.shape[-1] // group, group))  # [..., groups, G]
    out = grouped * scale.astype(jnp.float32)[..., None]
    if mn is not None:
        out = out + mn.astype(jnp.float32)[..., None]
    return out.reshape(c.shape)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF blocks, kept as stored

GGUF_BLOCKS = {"Q8_0": ("q8_0", 34), "Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20)}  # type -> (format, bytes a block)


def from_gguf_blocks(data: np.ndarray, type_name: str, transposed: bool) -> QuantizedMatrix:
    """A GGUF tensor's raw blocks `[rows, blocks * bytes]` uint8 (type Q8_0, Q4_0 or Q4_1) as a matrix, bit for
    bit: Q8_0 blocks are (float16 d, 32 int8), Q4_0 (d, 16 bytes of nibbles), Q4_1 (d, float16 m, 16 bytes)."""
    fmt, size = GGUF_BLOCKS[type_name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, size)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # [rows, blocks]
    mn = None
    if fmt == "q8_0":
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
        return QuantizedMatrix(codes, d, None, fmt=fmt, bits=8, group=32, offset=0, transposed=transposed)
    if fmt == "q4_1":
        mn = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        codes = blocks[..., 4:].reshape(rows, -1)
    else:
        codes = blocks[..., 2:].reshape(rows, -1)
    return QuantizedMatrix(np.ascontiguousarray(codes), d, mn, fmt=fmt, bits=4, group=32,
                           offset=8 if fmt == "q4_0" else 0, transposed=transposed)


# ---------------------------------------------------------------------------------------------------------------------
# Quantizing a float model


def check_weights(weights: str) -> str:
    """A `weights=` name, checked (see WEIGHTS_HELP)."""
    if not isinstance(weights, str):
        raise ValueError(f"weights={weights!r} must be a string; {WEIGHTS_HELP}")
    w = weights.strip().lower()
    if w in ("auto", "gguf", "int8") + FLOAT_WEIGHTS:
        return w
    m = _INT4.match(w)
    if m and int(m.group(2)) in GROUPS:
        return w
    raise ValueError(f"unknown weights {weights!r}; {WEIGHTS_HELP}")


def is_quantized_format(weights: str) -> bool:
    """Whether a checked `weights` name quantizes a float model (int8, int4-gG, int4s-gG)."""
    return weights == "int8" or bool(_INT4.match(weights))


def quantize_matrix(m, fmt: str, transposed: bool) -> QuantizedMatrix:
    """Float `M [(layers,) rows, cols]` -> a QuantizedMatrix in `fmt` (int8, int4-gG, int4s-gG, bf16), on the host.
    Scales and mins are rounded to their storage dtype first and the codes computed against the stored values."""
    m = np.asarray(m, np.float32)
    cols = m.shape[-1]
    if fmt == "bf16":
        bits = jax.lax.bitcast_convert_type(jnp.asarray(m, jnp.bfloat16), jnp.uint16)
        return _device(QuantizedMatrix(bits, np.ones(m.shape[:-1] + (1,), np.float32), None, fmt=fmt, bits=16,
                                       group=cols, offset=0, transposed=transposed))
    if fmt == "int8":
        amax = np.max(np.abs(m), axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        codes = np.clip(np.round(m / scale), -127, 127).astype(np.int8)
        return _device(QuantizedMatrix(codes, scale, None, fmt=fmt, bits=8, group=cols, offset=0,
                                       transposed=transposed))
    match = _INT4.match(fmt)
    if not match:
        raise ValueError(f"cannot quantize into {fmt!r}; choose int8, int4-gG or int4s-gG")
    symmetric, group = bool(match.group(1)), int(match.group(2))
    if cols % group:
        fits = ", ".join(f"int4-g{g}" for g in GROUPS if cols % g == 0) or "int8"
        raise ValueError(f"{fmt} groups {group} columns, but a matrix of these weights has {cols} columns, not a "
                         f"multiple of {group}; choose {fits}")
    g = m.reshape(m.shape[:-1] + (cols // group, group))  # [..., groups, G]
    one = np.float16(1)
    if symmetric:
        scale = (np.max(np.abs(g), axis=-1) / np.float32(7)).astype(np.float16)
        scale = np.where(scale == 0, one, scale)
        q = np.clip(np.round(g / scale.astype(np.float32)[..., None]), -7, 7) + 8
        mn, offset = None, 8
    else:
        lo, hi = np.min(g, axis=-1), np.max(g, axis=-1)
        mn = lo.astype(np.float16)
        scale = ((hi - lo) / np.float32(15)).astype(np.float16)
        scale = np.where(scale == 0, one, scale)
        q = np.clip(np.round((g - mn.astype(np.float32)[..., None]) / scale.astype(np.float32)[..., None]), 0, 15)
        offset = 0
    q = q.astype(np.uint8)  # [..., groups, G]
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # byte j: codes j (low) and j + G/2 (high)
    return _device(QuantizedMatrix(packed.reshape(m.shape[:-1] + (cols // 2,)), scale, mn, fmt=fmt, bits=4,
                                   group=group, offset=offset, transposed=transposed))


def _device(w: QuantizedMatrix) -> QuantizedMatrix:
    return jax.tree_util.tree_map(jnp.asarray, w)


def table_format(weights: str) -> str:
    """The format an embedding table (and an untied head) takes under `weights`: int8 for the 4-bit formats (the
    output head is the most sensitive matrix, as llama.cpp keeps it at 8 bits), else `weights` itself."""
    return "int8" if _INT4.match(weights) else weights


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedMatrix)


def formats(params) -> dict[str, str]:
    """The format of every weight leaf, by path ('float32' etc. for float arrays)."""
    return {name: w.fmt if is_quantized(w) else jnp.dtype(w.dtype).name for name, w in leaves_by_path(params).items()}


def native_codes(params) -> bool:
    """Whether every projection and table is held in 4- or 8-bit codes (GGUF blocks, int8, int4-gG, int4s-gG): the
    formats of the native quantized matmul, whose float path takes packed strips past a few rows."""
    return all(is_quantized(w) and w.bits in (4, 8) for _, w, _ in _quantizable(params))


def summary(params) -> str:
    """A short name of the weights params hold, e.g. 'q4_1+q8_0' (GGUF blocks), 'int8', 'float32'."""
    fmts = formats(params)
    quant = sorted({f for f in fmts.values() if f not in FLOAT_WEIGHTS and f != "float64"})
    return "+".join(quant) if quant else jnp.dtype(params.dtype).name


def with_impl(params, impl: str):
    """Params whose quantized matrices use `impl` ('auto', 'xla', 'native') for their matmuls."""
    if impl not in IMPLS:
        raise ValueError(f"weights impl {impl!r} is not one of {', '.join(IMPLS)}")
    return jax.tree_util.tree_map(lambda w: w.replace(impl=impl) if is_quantized(w) else w, params,
                                  is_leaf=is_quantized)


def stack_layers(mats: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Per-layer matrices of one format -> one stacked `[layers, rows, ...]` matrix."""
    first = mats[0]
    key = lambda m: (m.fmt, m.bits, m.group, m.offset, m.transposed, m.codes.shape, m.mn is None)
    if any(key(m) != key(first) for m in mats):
        raise ValueError(f"the layers do not share one format and shape ({sorted({m.fmt for m in mats})})")
    stack = lambda name: None if getattr(first, name) is None else np.stack([np.asarray(getattr(m, name))
                                                                            for m in mats])
    return first.replace(codes=stack("codes"), scale=stack("scale"), mn=stack("mn"), strips=None)


def map_rows(w: QuantizedMatrix, fn) -> QuantizedMatrix:
    """The matrix with `fn` applied to each leaf along its row axis (e.g. a permutation of the rows: rows are
    quantized independently, so this is exact). A strip-major copy is dropped (`with_strips` makes it again)."""
    return w.replace(codes=fn(w.codes), scale=fn(w.scale), mn=None if w.mn is None else fn(w.mn), strips=None)


def strip_layout(w: QuantizedMatrix, rows: int) -> np.ndarray:
    """The strip-major copy of a 4- or 8-bit matrix for a native kernel whose packed strips take `rows` weight rows
    (`native.matmul.strip_rows()`; matmul_cpu.cc `decoded_strip` reads it) -> uint8 `[(layers,) strips, bytes]`:
    strip s holds rows `[s rows, (s + 1) rows)` (zero past the last) as their codes column by column (4-bit: byte j
    of a column holds row j's code in its low nibble and row j + rows/2's in its high one; 8-bit: `rows` int8 codes),
    then their scales `[groups, rows]` and mins `[groups, rows]` (when the format has them) as stored, the whole padded
    to a multiple of 64 bytes."""
    if w.bits not in (4, 8) or rows % 2:
        raise ValueError(f"a strip-major copy takes 4- or 8-bit codes in strips of an even row count, not "
                         f"{w.bits}-bit codes in strips of {rows}")
    codes = np.asarray(_unpack4(w.codes, w.group) if w.bits == 4 else w.codes)  # one code a byte, column order
    lead, num_rows = codes.shape[:-2], w.num_rows
    strips = -(-num_rows // rows)

    def strip_major(a: np.ndarray) -> np.ndarray:  # [..., R, k] -> [..., strips, k, rows] contiguous, zero past R
        pad = np.zeros(lead + (strips * rows - num_rows, a.shape[-1]), a.dtype)
        a = np.concatenate([a, pad], axis=-2).reshape(lead + (strips, rows, a.shape[-1]))
        return np.ascontiguousarray(np.swapaxes(a, -1, -2))

    c = strip_major(codes.view(np.uint8))  # [..., strips, cols, rows]
    if w.bits == 4:
        c = c[..., : rows // 2] | (c[..., rows // 2 :] << 4)  # [..., strips, cols, rows / 2]
    parts = [c, strip_major(np.asarray(w.scale))] + ([] if w.mn is None else [strip_major(np.asarray(w.mn))])
    flat = [np.ascontiguousarray(p).view(np.uint8).reshape(lead + (strips, -1)) for p in parts]
    used = sum(f.shape[-1] for f in flat)
    return np.concatenate(flat + [np.zeros(lead + (strips, -used % 64), np.uint8)], axis=-1)


def with_strips(params):
    """`params` whose 4- and 8-bit matrices also hold their strip-major copy (`strip_layout`), so that the native
    kernel's calls of more than `native.matmul.STRIP_ROWS` activation rows (a batched decode step, a prefill chunk)
    decode it straight into their packed strips, transposing nothing (docs/kernels.md "Quantized weights"). The price
    is a second copy of those matrices' codes and scales (92 MiB for SmolLM2-135M's GGUF blocks). `params` as they are
    when the default backend is not the CPU or the native kernels are not built."""
    from kivi_jax.native import matmul

    rows = matmul.strip_rows() if jax.default_backend() == "cpu" else None
    if rows is None:
        return params
    new = {name: w.replace(strips=jnp.asarray(strip_layout(w, rows))) for name, w, _ in _quantizable(params)
           if is_quantized(w) and w.bits in (4, 8) and w.strips is None}
    return replace_leaves(params, new) if new else params


def without_strips(params):
    """`params` with no strip-major copy (`with_strips`): what a device mesh shards, where the kernel that reads the
    copy does not run."""
    new = {name: w.replace(strips=None) for name, w, _ in _quantizable(params)
           if is_quantized(w) and w.strips is not None}
    return replace_leaves(params, new) if new else params


# ---------------------------------------------------------------------------------------------------------------------
# Params in a chosen format


def _quantizable(params):
    """(path, leaf, is_table) of every matrix that may be quantized, as the architecture's table declares them
    (models/registry.py `Param.kind`): the embedding table, an untied head and every projection; norms and biases
    stay float."""
    leaves = leaves_by_path(params)
    return [(name, leaves[name], p.kind == "table") for name, p in registry.param_table(params.config).items()
            if p.kind != "vector"]


def dequantize_params(params, dtype):
    """Every quantized matrix as the float leaf it stands for, in `dtype` (float leaves are cast too)."""
    new = {name: w.logical(jnp.float32).astype(dtype) for name, w, _ in _quantizable(params) if is_quantized(w)}
    return cast_params(replace_leaves(params, new), dtype)


def convert_params(params, weights: str, dtype=None):
    """`params` holding the weights `weights` names (WEIGHTS_HELP); `dtype` is the compute dtype of the float
    leaves (and of every weight for a float format). Raises ValueError for a combination that cannot be."""
    weights = check_weights(weights)
    held = summary(params)
    if weights == "bfloat16" and dtype is not None and jnp.dtype(dtype) == jnp.float32:
        weights = "bf16"  # every matrix rounded to bfloat16 (the quantizing loop below), the rest float32
    if weights in FLOAT_WEIGHTS:
        if dtype is not None and jnp.dtype(dtype) != jnp.dtype(weights):
            raise ValueError(f"weights={weights} and dtype={jnp.dtype(dtype).name} disagree: float weights are the "
                             "compute dtype, but for bfloat16 weights under float32 compute; give one of them")
        return dequantize_params(params, jnp.dtype(weights))
    if weights == "gguf" and not any(f in GGUF_FORMATS for f in formats(params).values()):
        raise ValueError(f"weights='gguf' keeps a GGUF file's quantized blocks, but this model holds {held} "
                         "weights (load a .gguf file, or choose int8 / int4-g64 to quantize it)")
    if weights in ("auto", "gguf"):
        return params if dtype is None else cast_params(params, dtype)
    dtype = params.dtype if dtype is None else dtype
    new = {}
    for name, w, table in _quantizable(params):
        m = w.dequantize(jnp.float32) if is_quantized(w) else (w if table else jnp.swapaxes(w, -1, -2))
        new[name] = quantize_matrix(m, table_format(weights) if table or name == "lm_head" else weights,
                                    transposed=not table)
    return cast_params(replace_leaves(params, new), dtype)


def abstract_matrix(shape: tuple[int, ...], fmt: str, transposed: bool) -> QuantizedMatrix:
    """The QuantizedMatrix (of ShapeDtypeStructs: nothing allocated) that `quantize_matrix` makes of a float leaf of
    logical `shape` (`[(layers,) in, out]` for a projection, `[rows, cols]` for a table)."""
    lead, (a, b) = tuple(shape[:-2]), shape[-2:]
    rows, cols = (b, a) if transposed else (a, b)
    sds = lambda *s, dt: jax.ShapeDtypeStruct(lead + s, dt)
    if fmt == "bf16":
        return QuantizedMatrix(sds(rows, cols, dt=jnp.uint16), sds(rows, 1, dt=jnp.float32), None, fmt=fmt, bits=16,
                               group=cols, offset=0, transposed=transposed)
    if fmt == "int8":
        return QuantizedMatrix(sds(rows, cols, dt=jnp.int8), sds(rows, 1, dt=jnp.float32), None, fmt=fmt, bits=8,
                               group=cols, offset=0, transposed=transposed)
    match = _INT4.match(fmt)
    if not match:
        raise ValueError(f"no abstract form for {fmt!r}")
    group = int(match.group(2))
    if cols % group:
        raise ValueError(f"{fmt} groups {group} columns, but a matrix has {cols}")
    scale = sds(rows, cols // group, dt=jnp.float16)
    return QuantizedMatrix(sds(rows, cols // 2, dt=jnp.uint8), scale, None if match.group(1) else scale, fmt=fmt,
                           bits=4, group=group, offset=8 if match.group(1) else 0, transposed=transposed)


def abstract_params(params, weights: str):
    """Abstract (or concrete) float params -> the abstract params `convert_params(params, weights)` would give, for
    byte counts and lowering without quantizing anything; 'auto' and float formats return them as they are."""
    weights = check_weights(weights)
    if not is_quantized_format(weights):
        return params
    new = {name: abstract_matrix(w.shape, table_format(weights) if table or name == "lm_head" else weights,
                                 transposed=not table)
           for name, w, table in _quantizable(params)}
    return replace_leaves(params, new)
