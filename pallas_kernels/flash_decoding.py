"""Flash-decoding bookkeeping shared by the decode kernels: query rows, split counts, the partial-softmax combine.

A decode kernel answers one query token per sequence. Each program owns one (sequence, kv head, token split) and
writes a partial softmax `(m, l, acc)` for the `n_rep` query heads of its kv head: `m` the running max of its scores
(-inf when it saw no token), `l` the sum of `exp(score - m)`, `acc` the sum of `exp(score - m) * value`. `combine`
merges the partials of all splits with the new token's own (always visible) key and value.

Nothing here imports kivi_jax or models: the kernels take raw arrays and static ints.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

MIN_DOT_ROWS = 16  # Triton's dot needs at least 16 rows: query rows are zero-padded up to this
TARGET_PROGRAMS = 512  # enough (sequence, kv head, split) programs to fill a GPU with a few waves
MAX_SPLITS = 64
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"  # jax 0.11's warning when it lowers a Triton kernel


def query_rows(n_rep: int) -> int:
    """Rows of the padded query tile: a power of two, at least MIN_DOT_ROWS."""
    return max(MIN_DOT_ROWS, 1 << (n_rep - 1).bit_length())


def grouped_queries(q: jax.Array, kv_heads: int, rows: int | None = None) -> jax.Array:
    """`[batch, 1, q_heads, head_dim]` -> float32 `[batch, kv_heads, rows, head_dim]`, zero rows past n_rep (`rows`
    None: `query_rows(n_rep)`, the Triton kernels' tile).

    Query head `h * n_rep + r` lands in row r of kv head h. Not scaled: kernels apply 1/sqrt(head_dim) themselves.
    """
    batch, _, q_heads, head_dim = q.shape
    n_rep = q_heads // kv_heads
    rows = query_rows(n_rep) if rows is None else rows
    qg = q[:, 0].astype(jnp.float32).reshape(batch, kv_heads, n_rep, head_dim)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - n_rep), (0, 0)))


def num_splits(batch: int, kv_heads: int, max_blocks: int) -> int:
    """Token splits per (sequence, kv head): a power of two giving about TARGET_PROGRAMS programs, at most one
    split per block and MAX_SPLITS."""
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    splits = 1 << (want - 1).bit_length()
    return max(1, min(splits, MAX_SPLITS, max_blocks))


def largest_pow2_block(num: int, cap: int) -> int:
    """The largest power of two dividing `num`, at most `cap`."""
    block = 1
    while num % (block * 2) == 0 and block * 2 <= cap:
        block *= 2
    return block


def layer_operand(layer) -> jax.Array:
    """The layer index as an int32 `[1]` array the kernel reads (`None`: the arrays hold one layer, index 0)."""
    if layer is None:
        return jnp.zeros((1,), jnp.int32)
    return jnp.asarray(layer, jnp.int32).reshape(1)


def stacked(x: jax.Array, layer) -> jax.Array:
    """`x` with a leading layer axis (a free reshape when `layer` is None and `x` holds one layer)."""
    return x[None] if layer is None else x


def static_window(window) -> int | None:
    """The sliding window as a Python int (it shapes the kernel; a traced value cannot)."""
    return None if window is None else int(window)


def combine(m: jax.Array, l: jax.Array, acc: jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
            sm_scale: float, dtype) -> jax.Array:
    """Merges split partials with the new token and normalizes.

    m, l `[batch, kv_heads, splits, rows]`, acc `[batch, kv_heads, splits, rows, head_dim]` float32 (rows padded);
    q `[batch, 1, q_heads, head_dim]`; k_new, v_new `[batch, 1, kv_heads, head_dim]`.
    Returns `[batch, 1, q_heads, head_dim]` in `dtype`.
    """
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_new.shape[2]
    n_rep = q_heads // kv_heads
    m, l, acc = m[..., :n_rep], l[..., :n_rep], acc[..., :n_rep, :]
    qg = q[:, 0].astype(jnp.float32).reshape(batch, kv_heads, n_rep, head_dim)  # [batch, kv_heads, n_rep, head_dim]
    k = k_new[:, 0].astype(jnp.float32)  # [batch, kv_heads, head_dim]
    v = v_new[:, 0].astype(jnp.float32)
    s_new = jnp.einsum("bhrd,bhd->bhr", qg, k, precision="highest") * sm_scale  # [batch, kv_heads, n_rep]
    m_all = jnp.maximum(jnp.max(m, axis=2), s_new)  # the new token is always seen: finite
    w = jnp.exp(m - m_all[:, :, None, :])  # [batch, kv_heads, splits, n_rep]; 0 for splits that saw nothing
    w_new = jnp.exp(s_new - m_all)
    total = jnp.sum(w * l, axis=2) + w_new  # [batch, kv_heads, n_rep]
    out = jnp.sum(w[..., None] * acc, axis=2) + w_new[..., None] * v[:, :, None, :]
    out = out / total[..., None]  # [batch, kv_heads, n_rep, head_dim]
    return out.reshape(batch, 1, q_heads, head_dim).astype(dtype)


def online_update(m: jax.Array, l: jax.Array, scores: list[jax.Array]):
    """One online-softmax step over score tiles `[rows, n]` (-inf where masked).

    Returns (m_new, alpha, probabilities per tile, l_new); the caller rescales its accumulator by alpha `[rows]`.
    """
    m_new = m
    for s in scores:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: nothing to rescale
    alpha = jnp.exp(m - m_safe)
    probs = [jnp.exp(s - m_safe[:, None]) for s in scores]
    l_new = l * alpha
    for p in probs:
        l_new = l_new + jnp.sum(p, axis=1)
    return m_new, alpha, probs, l_new


def dot_precision(dtype):
    """Exact float32 dots (no TF32) when the compute dtype is float32; the default for 16-bit inputs."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def interpret_default(interpret: bool | None) -> bool:
    """`None` means: the real kernel on a GPU backend, interpret mode anywhere else."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return interpret


def silence_triton_deprecation() -> None:
    """jax 0.11 deprecates Pallas' Triton backend and warns each time it lowers a Triton kernel, from inside the
    caller's jit. Choosing Triton is this library's doing (GPUs older than Hopper; Hopper and newer take Mosaic GPU),
    not the user's, so the Triton kernel modules silence exactly that message when they load (a filter at the call
    could not: the lowering runs later, in the user's jit)."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
