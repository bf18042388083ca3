"""The weight seam (docs/design.md §11, §13): every projection, the output head and the embedding lookup go through
these three functions, so a model runs on float arrays or on quantized weights alike.

A weight is either a float array or a quantized matrix: any pytree with the methods below (`kivi_jax.weights`
defines the formats; the model never imports them, as it never imports a cache):
- `w.matmul_t(x)`: `x [..., cols] @ M.T -> [..., rows]` for the matrix `M [rows, cols]` it stores row by row;
  `w.matmul_t_many(x, ws)` the same for every matrix of `ws` at once (they share the input);
- `w.rows(ids)`: rows `M[ids] -> [..., cols]` (an embedding table);
- `w.at_layer(layer)`: a stacked `[layers, rows, ...]` weight read at a (traced) layer index without slicing it;
- `w.operand_dtype`: the dtype ('float32', 'bfloat16'; 'int8': the activations of a quantized matrix, a prefill
  view's) its matmul rounds the operands to.
A projection `W [in, out]` is stored as `M = W.T` (one row an output unit); an embedding table `E [vocab, hidden]`
as `M = E`, so the tied output head is `matmul_t` of the same table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def is_quantized(w) -> bool:
    """Whether `w` is a quantized matrix (has the methods above) rather than a float array."""
    return hasattr(w, "matmul_t")


def dot(x: jax.Array, w) -> jax.Array:
    """A projection: `x [..., in]` times `w [in, out]` (float) or its quantized matrix -> `[..., out]` in x's dtype."""
    if is_quantized(w):
        return w.matmul_t(x)
    return x @ w


def dot_many(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """Several projections of the same input (q, k, v; gate, up): `dot(x, w)` for each `w` of `ws`, computed together
    when they are quantized matrices that can be (one kernel call reads them all)."""
    if all(is_quantized(w) for w in ws):
        return ws[0].matmul_t_many(x, ws)
    return tuple(dot(x, w) for w in ws)


def dot_table(x: jax.Array, table) -> jax.Array:
    """The output head over an embedding table (tied) or an untied head: `x [..., hidden]` against every row of
    `table [vocab, hidden]` -> float32 logits `[..., vocab]`."""
    if is_quantized(table):
        return table.matmul_t(x, out_dtype=jnp.float32)
    return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32)


def dot_head(x: jax.Array, lm_head) -> jax.Array:
    """An untied output head `lm_head [hidden, vocab]` (float) or its quantized matrix -> float32 logits."""
    if is_quantized(lm_head):
        return lm_head.matmul_t(x, out_dtype=jnp.float32)
    return jnp.einsum("...e,ev->...v", x, lm_head, preferred_element_type=jnp.float32)


def table_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """Embedding rows `table[ids]` -> `[..., hidden]` in `dtype`."""
    if is_quantized(table):
        return table.rows(ids).astype(dtype)
    return table[ids].astype(dtype)


def dots_in_bfloat16(layers) -> bool:
    """Whether the stacked layer params' projections dot with bfloat16 operands: bfloat16 matrices, or quantized
    ones whose `operand_dtype` is bfloat16 (bfloat16 weights under float32, a bfloat16 prefill view)."""
    mats = [getattr(layers, f.name) for f in dataclasses.fields(layers)]
    return any(w.operand_dtype == "bfloat16" if is_quantized(w) else w.ndim == 3 and w.dtype == jnp.bfloat16
               for w in mats if w is not None)


def split_stacked(layers):
    """`(sliced, whole)`: a copy of the stacked layer params `layers` (a dataclass) whose quantized leaves are None
    — the part `lax.scan` slices layer by layer — and a dict of those quantized leaves, kept whole so a kernel reads
    them in place at the layer index (`join_layer`)."""
    whole = {f.name: getattr(layers, f.name) for f in dataclasses.fields(layers)
             if is_quantized(getattr(layers, f.name))}
    return layers.replace(**{name: None for name in whole}), whole


def join_layer(sliced, whole: dict, layer: jax.Array):
    """One layer's params inside the scan: the sliced float leaves and each whole quantized leaf at `layer`."""
    return sliced.replace(**{name: w.at_layer(layer) for name, w in whole.items()})
