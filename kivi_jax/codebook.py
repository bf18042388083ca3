"""Non-uniform codebooks for KIVI's codes (`-nuqk`, `-nuqv`; docs/quality.md, "kivi2.5"), and how they are calibrated.

A group keeps its (scale, min) as ever (`scale = (max - min) / (2^b - 1)`), but code `c` stands for `levels[c] *
scale + min` instead of `c * scale + min` (`kivi_jax.quant`, module doc). Min-max groups put their extremes at 0 and
2^b - 1 and most values in between, so levels drawn toward the middle (Lloyd-Max) cost less error than a uniform grid,
for the same bytes. One codebook a role (keys, values) and bit width, shared by every layer and head: the calibration
found per-layer codebooks almost equal to the pooled one (docs/quality.md).

`LEVELS` is the shipped table, computed by `scripts/calibrate_codebooks.py` (which calls `calibrate`) from SmolLM2 on
the development split of the default text: keys before RoPE in per-channel groups of `KEY_GROUP` tokens with the first
`SINKS` tokens standing in as in the cache, each value weighted by its squared scale (error in the key's own units)
times the attention its token receives in full precision (what a key error costs where attention reads it); values
after the Hadamard rotation (`-rotv`) in per-token groups of `VALUE_GROUP` channels, weighted by the squared scale.
Weighted Lloyd-Max runs on a fine histogram of the normalized values, so it is exact to the bin and deterministic.
"""

from __future__ import annotations

import numpy as np

ROLES = ("key", "value")
KEY_GROUP = 64  # the calibration's key group (tokens) and value group (channels)
VALUE_GROUP = 64
SINKS = 4
BINS = 4096  # histogram bins over [0, 2^b - 1]
ITERATIONS = 100

# (role, bits) -> levels in scale units above the group's min: the output of scripts/calibrate_codebooks.py
LEVELS: dict[tuple[str, int], tuple[float, ...]] = {
    ("key", 2): (0.3951, 1.1624, 1.8219, 2.6147),
    ("key", 3): (0.2642, 1.401, 2.2841, 3.0823, 3.8517, 4.6506, 5.5711, 6.7403),
    ("key", 4): (0.1341, 1.4434, 2.5873, 3.5829, 4.5049, 5.3713, 6.21, 7.0176, 7.8338, 8.6506, 9.467, 10.3205, 11.2542,
                 12.2563, 13.4411, 14.8519),
    ("value", 2): (0.5053, 1.2016, 1.7965, 2.4936),
    ("value", 3): (0.415, 1.5344, 2.3868, 3.1371, 3.859, 4.6092, 5.4599, 6.5836),
    ("value", 4): (0.2269, 1.6583, 2.8046, 3.7968, 4.6949, 5.5307, 6.3307, 7.112, 7.8861, 8.6642, 9.4616, 10.2958,
                   11.1898, 12.1787, 13.3304, 14.7706),
}


def levels(role: str, bits: int) -> tuple[float, ...]:
    """The shipped codebook of `role` ('key' or 'value') at `bits` bits, or a clear error."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {ROLES}")
    if (role, bits) not in LEVELS:
        have = sorted(b for r, b in LEVELS if r == role)
        raise ValueError(f"no calibrated {bits}-bit {role} codebook (kivi_jax/codebook.py has {have} bits; "
                         "scripts/calibrate_codebooks.py computes more)")
    return LEVELS[(role, bits)]


def supported_bits(role: str) -> tuple[int, ...]:
    return tuple(sorted(b for r, b in LEVELS if r == role))


def lloyd_max(hist: np.ndarray, bits: int, iterations: int = ITERATIONS) -> tuple[float, ...]:
    """Weighted Lloyd-Max levels for a histogram `hist [bins]` of weights over `[0, 2^b - 1]` (bin centres), from
    the uniform grid: each level moves to the weighted mean of the bins nearest it, `iterations` times. A level that
    owns no weight stays where it is."""
    top = 2**bits - 1
    n = len(hist)
    centres = (np.arange(n) + 0.5) * top / n
    lv = np.arange(top + 1, dtype=np.float64)
    for _ in range(iterations):
        edges = (lv[1:] + lv[:-1]) / 2
        owner = np.searchsorted(edges, centres)  # bin -> nearest level
        w = np.bincount(owner, weights=hist, minlength=top + 1)
        m = np.bincount(owner, weights=hist * centres, minlength=top + 1)
        lv = np.where(w > 0, m / np.where(w > 0, w, 1), lv)
    return tuple(float(x) for x in lv)


def histogram(u: np.ndarray, weights: np.ndarray, bits: int, bins: int = BINS) -> np.ndarray:
    """Weights `[...]` of normalized values `u [...]` (in `[0, 2^b - 1]`) summed into `bins` equal bins."""
    top = 2**bits - 1
    idx = np.clip((np.asarray(u, np.float64) * bins / top).astype(np.int64), 0, bins - 1)
    return np.bincount(idx.ravel(), weights=np.broadcast_to(weights, u.shape).ravel().astype(np.float64),
                       minlength=bins)


def normalized(x: np.ndarray, bits: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """`x` grouped along `axis` (already a group axis of its own): `(u, scale)` with `u = (x - min) / scale` in
    `[0, 2^b - 1]` as the cache computes them (float16 scale and min), scale broadcast against u."""
    x = np.asarray(x, np.float32)
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    mn_s = mn.astype(np.float16).astype(np.float32)  # round to nearest even, as jnp's cast
    scale = ((mx - mn) / np.float32(2**bits - 1)).astype(np.float16).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1.0), scale)
    return np.clip((x - mn_s) / scale, 0, 2**bits - 1), scale


def from_activations(acts, bits=(2, 3, 4), key_group: int = KEY_GROUP, value_group: int = VALUE_GROUP,
                     sinks: int = SINKS, key_weights: str = "attention") -> dict[tuple[str, int], tuple[float, ...]]:
    """Codebooks from a prefill's activations (`evaluate.capture_qkv`), Lloyd-Max on their `histograms`."""
    hists = histograms(acts, bits, key_group, value_group, sinks, key_weights)
    return {key: lloyd_max(h, key[1]) for key, h in hists.items()}


def weighted_error(hist: np.ndarray, levels, bits: int) -> float:
    """The weighted squared error `Σ weight * (u - nearest level)^2` of a histogram (bin centres) under `levels`
    (None: the uniform grid)."""
    top = 2**bits - 1
    centres = (np.arange(len(hist)) + 0.5) * top / len(hist)
    lv = np.arange(top + 1, dtype=np.float64) if levels is None else np.asarray(levels, np.float64)
    nearest = lv[np.abs(centres[:, None] - lv[None, :]).argmin(1)]
    return float(np.sum(hist * (centres - nearest) ** 2))


def histograms(acts, bits=(2, 3, 4), key_group: int = KEY_GROUP, value_group: int = VALUE_GROUP, sinks: int = SINKS,
               key_weights: str = "attention") -> dict[tuple[str, int], np.ndarray]:
    """`(role, bits) -> [BINS]` weights of normalized values from a prefill's activations (`evaluate.capture_qkv`:
    per layer `q` and `k` after RoPE `[layers, batch, tokens, heads, D]`, `k_pre` before, `v`), pooled over layers and
    heads. `key_weights`: 'attention' (squared scale times the attention each token receives, summed over the queries
    that see it) or 'mse' (squared scale alone)."""
    import jax
    import jax.numpy as jnp

    if key_weights not in ("attention", "mse"):
        raise ValueError(f"key_weights={key_weights!r} must be 'attention' or 'mse'")
    layers, batch, tokens, kv_heads, d = np.shape(acts["k_pre"])
    if tokens % key_group or tokens <= sinks:
        raise ValueError(f"windows of {tokens} tokens must be a multiple of key_group={key_group} (and more than "
                         f"{sinks} sinks)")
    hist = {(r, b): np.zeros(BINS) for r in ROLES for b in bits}

    @jax.jit
    def attention_mass(q, k):  # q [batch, tokens, q_heads, D], k [batch, tokens, kv_heads, D] -> [batch, kv_heads, t]
        qg = q.astype(jnp.float32).reshape(batch, tokens, kv_heads, -1, d) * d**-0.5
        s = jnp.einsum("bqhrd,bkhd->bhrqk", qg, k.astype(jnp.float32), precision="highest")
        s = jnp.where(jnp.tril(jnp.ones((tokens, tokens), bool)), s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1).sum(axis=(2, 3))

    g = min(value_group, d)
    for layer in range(layers):
        k = np.swapaxes(np.array(acts["k_pre"][layer], np.float32), 1, 2)  # [batch, kv_heads, tokens, D], a copy
        v = np.swapaxes(np.asarray(acts["v"][layer], np.float32), 1, 2)
        k[:, :, :sinks] = k[:, :, sinks : sinks + 1]  # sinks stand in as the first non-sink token (the cache's rule)
        v = v[:, :, sinks:]  # sinks are read in full precision; their value codes are never read
        kg = k.reshape(batch, kv_heads, tokens // key_group, key_group, d)
        mass = 1.0
        if key_weights == "attention":
            mass = np.asarray(attention_mass(acts["q"][layer], acts["k"][layer]), np.float64)
            mass = mass.reshape(batch, kv_heads, tokens // key_group, key_group, 1)
        vg = v.reshape(v.shape[:3] + (d // g, g))
        for b in bits:
            u, scale = normalized(kg, b, axis=3)
            hist[("key", b)] += histogram(u, scale.astype(np.float64) ** 2 * mass, b)
            u, scale = normalized(vg, b, axis=4)
            hist[("value", b)] += histogram(u, scale.astype(np.float64) ** 2, b)
    return hist
