"""Per-head orthogonal bases for quantizing in a rotated basis (docs/quality.md, "beyond KIVI").

A value quantized per token in a rotated basis `v @ H` spreads a channel's outlier over every channel of its group, so
one (scale, min) fits the group better. The rotation costs nothing per step: `H` is folded into the value projection
(`wv`: each kv head's columns times H) and its transpose into the output projection (`wo`: each query head's rows
times H^T), so with a full-precision cache the model computes the same function. Keys can be rotated too (queries
and keys by the same H every step, `KIVIConfig.rotate_keys`), but that erases the fixed outlier channels that
per-channel key scales exploit; docs/quality.md has the measurement.

`H` is the normalized Sylvester-Hadamard matrix when head_dim is a power of two, otherwise a random orthogonal matrix
from a fixed seed (QR of a Gaussian matrix, signs fixed), so a converted model and its cache always agree.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

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


def rotate_values(params):
    """Params whose value projection produces each kv head's values in the basis H and whose output projection undoes
    it (full-precision outputs unchanged up to rounding); marks them `value_basis="hadamard"`. Idempotent."""
    if params.value_basis:
        return params
    cfg = params.config
    d, kv, q_heads = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    h = jnp.asarray(basis(d), jnp.float32)
    lp = params.layers
    layers = lp.wv.shape[0]
    wv = lp.wv.astype(jnp.float32).reshape(layers, -1, kv, d)  # [layers, hidden, kv_heads, head_dim]
    wv = jnp.einsum("lekd,dc->lekc", wv, h).reshape(lp.wv.shape).astype(lp.wv.dtype)
    wo = lp.wo.astype(jnp.float32).reshape(layers, q_heads, d, -1)  # [layers, q_heads, head_dim, hidden]
    wo = jnp.einsum("dc,lqde->lqce", h, wo).reshape(lp.wo.shape).astype(lp.wo.dtype)  # each head's rows: H^T @ W
    return params.replace(layers=lp.replace(wv=wv, wo=wo), value_basis="hadamard")


def key_basis(head_dim: int, dtype) -> jnp.ndarray:
    """H in `dtype`, for rotating queries and keys by the same basis every step (`KIVIConfig.rotate_keys`)."""
    return jnp.asarray(basis(head_dim), dtype)


def prepare_params(params, spec):
    """The params a cache of `spec` (a parsed spec, or a cache) runs on: value-rotated for a `rotate_values` KIVI
    cache, else as they are. Every entry point (generate, eval, bench, serve, chat) calls this once."""
    if getattr(getattr(spec, "config", spec), "rotate_values", False):
        return rotate_values(params)
    return params
