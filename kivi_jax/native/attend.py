"""A prefill chunk's attention segment in the native CPU kernel (`attend_cpu.cc`, through `jax.ffi.ffi_call`): its
contract and pure-jnp twin are `kivi_jax.attention.segment`'s XLA path with bfloat16 dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.native import build


def unsupported(dot_dtype, head_dim: int, softcap) -> str | None:
    """Why the kernel cannot add a segment for these rows, or None: it dots in bfloat16 with AMX tiles, over head
    dims a multiple of 32, without soft-capping."""
    if dot_dtype != jnp.bfloat16:
        return "the kernel dots bfloat16 rows (a float32 chunk takes XLA's dot)"
    if softcap is not None:
        return "the kernel does not soft-cap attention logits"
    if head_dim % 32:
        return f"head_dim {head_dim} is not a multiple of 32"
    if not build.has_amx():
        return "this CPU has no AMX tiles (the kernel's scalar path is for tests)"
    return None


def segment(m, l, acc, q, q_pos, k, v, k_pos, k_ok, window: int | None, causal: bool, amx: bool = True,
            scale: float = 1.0, kv_tokens_first: bool = False):
    """Adds keys and values `k, v [B, H, T, D]` (`[B, T, H, D]` with `kv_tokens_first`) at `k_pos [B or 1, T]`
    (those with `k_ok [B or 1, T]`) to the online softmax `(m, l [B, Tq, Hq], acc [B, Tq, Hq, D])` of the queries
    `q [B, Tq, Hq, D]` (float32 or bfloat16, times `scale` before their rounding to bfloat16) at `q_pos [B, Tq]`;
    query head `h * n_rep + r` reads kv head `h`. A key counts when ok, at or before the query (`causal`) and inside
    its `window` (None: none). Returns the new `(m, l, acc)`. `amx=False`: the kernel's scalar path (tests)."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    batch = q.shape[0]
    call = jax.ffi.ffi_call("kivi_jax_chunk_attend", (jax.ShapeDtypeStruct(m.shape, jnp.float32),
                                                      jax.ShapeDtypeStruct(l.shape, jnp.float32),
                                                      jax.ShapeDtypeStruct(acc.shape, jnp.float32)),
                            input_output_aliases={6: 0, 7: 1, 8: 2})
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    i32 = lambda a: jnp.broadcast_to(a, (batch, a.shape[-1])).astype(jnp.int32)  # noqa: E731
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        q = f32(q)
    return call(q, q_pos.astype(jnp.int32), f32(k), f32(v), i32(k_pos), i32(k_ok), f32(m), f32(l), f32(acc),
                window=np.int64(window or 0), causal=np.int64(causal), amx=np.int64(amx), scale=np.float32(scale),
                kv_tokens_first=np.int64(kv_tokens_first))
