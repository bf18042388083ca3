"""Per-head orthogonal bases for quantizing in a rotated basis (docs/quality.md, "beyond KIVI").

A value quantized per token in a rotated basis `v @ H` spreads a channel's outlier over every channel of its group, so
one (scale, min) fits the group better. The rotation costs nothing per step: `H` is folded into the value projection
(`wv`, and a value bias: each kv head's columns times H) and its transpose into the output projection (`wo`: each
query head's rows times H^T), so with a full-precision cache the model computes the same function. The architecture
names those leaves (models/registry.py `Param.rotate`). Keys can be rotated too (queries
and keys by the same H every step, `KIVIConfig.rotate_keys`), but that erases the fixed outlier channels that
per-channel key scales exploit; docs/quality.md has the measurement.

`H` is the normalized Sylvester-Hadamard matrix when head_dim is a power of two, otherwise a random orthogonal matrix
from a fixed seed (QR of a Gaussian matrix, signs fixed), so a converted model and its cache always agree.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from kivi_jax.models import registry
from kivi_jax.models.decoder import leaves_by_path, replace_leaves

SEED = 20240101  # the random basis where head_dim is not a power of two


def basis(head_dim: int) -> np.ndarray:
    """float64 `[head_dim, head_dim]` orthogonal matrix H (H @ H.T = I); see the module doc."""
    if head_dim <= 0:
        raise ValueError(f"head_dim={head_dim} must be positive")
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return h / np.sqrt(head_dim)
    gauss = np.random.default_rng(SEED).standard_normal((head_dim, head_dim))
    q, r = np.linalg.qr(gauss)
    return q * np.sign(np.diag(r))[None, :]


# A quantized projection the rotation changes is rotated in float and quantized again in this format (per output
# channel, 8 bits: finer than the GGUF's 4-bit blocks, so the rotation adds little error; docs/benchmarks.md
# "Quantized weights" measures it).
ROTATED_FORMAT = "int8"


def rotate_values(params):
    """Params whose value projection produces each kv head's values in the basis H and whose output projection undoes
    it (full-precision outputs unchanged up to rounding); marks them `value_basis="hadamard"`. Idempotent. Which
    leaves those are, the architecture declares (`Param.rotate` in models/registry.py: `values` leaves — the value
    projection and its bias — get each kv head's block times H, `attention_out` leaves H^T times each query head's
    rows). Quantized projections are rotated in float and quantized again (`ROTATED_FORMAT`)."""
    from kivi_jax import weights

    if params.value_basis:
        return params
    d = params.config.head_dim
    h = jnp.asarray(basis(d), jnp.float32)
    as_float = lambda w: w.logical(jnp.float32) if weights.is_quantized(w) else w.astype(jnp.float32)
    leaves = leaves_by_path(params)

    def rotated(w, role):
        wf = as_float(w)
        if role == "values":  # [..., kv_heads * D]: each head's columns times H
            return jnp.einsum("...kd,dc->...kc", wf.reshape(*wf.shape[:-1], -1, d), h).reshape(wf.shape)
        if role == "attention_out":  # [layers, q_heads * D, hidden]: H^T times each head's rows
            return jnp.einsum("dc,lqde->lqce", h, wf.reshape(wf.shape[0], -1, d, wf.shape[-1])).reshape(wf.shape)
        raise ValueError(f"unknown value-rotation role {role!r}")

    def back(new, old):
        if weights.is_quantized(old) and isinstance(new, jax.core.Tracer):  # abstract (eval_shape): shapes only
            shapes = weights.abstract_matrix(new.shape, ROTATED_FORMAT, transposed=True).replace(impl=old.impl)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        if weights.is_quantized(old):
            return weights.quantize_matrix(jnp.swapaxes(new, -1, -2), ROTATED_FORMAT, transposed=True).replace(
                impl=old.impl)
        return new.astype(old.dtype)

    new = {path: back(rotated(leaves[path], p.rotate), leaves[path])
           for path, p in registry.param_table(params.config).items() if p.rotate is not None}
    return replace_leaves(params, new).replace(value_basis="hadamard")


def key_basis(head_dim: int, dtype) -> jnp.ndarray:
    """H in `dtype`, for rotating queries and keys by the same basis every step (`KIVIConfig.rotate_keys`)."""
    return jnp.asarray(basis(head_dim), dtype)


def prepare_params(params, spec):
    """The params a cache of `spec` (a parsed spec, or a cache) runs on: value-rotated for a `rotate_values` KIVI
    cache, else as they are. Every entry point (generate, eval, bench, serve, chat) calls this once."""
    if getattr(getattr(spec, "config", spec), "rotate_values", False):
        return rotate_values(params)
    return params
