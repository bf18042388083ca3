"""A greedy draw in the native CPU kernel (`argmax_cpu.cc`, through `jax.ffi.ffi_call`): the index of each row's
first maximum, whose pure-jnp twin is `kivi_jax.sampling.first_max_xla`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kivi_jax.native import build


def usable(logits) -> bool:
    """Whether a greedy draw over `logits` takes the kernel: float32 on the CPU backend, the kernels built (not
    switched off), no device mesh (XLA partitions its own reduce)."""
    if jax.default_backend() != "cpu" or jnp.dtype(logits.dtype) != jnp.float32 or logits.shape[-1] < 1:
        return False
    from kivi_jax.mesh_scope import active_mesh

    return active_mesh() is None and build.available()


def first_max(logits: jax.Array) -> jax.Array:
    """`[..., vocab]` float32 -> int32 `[...]`: the first maximum's index of each row, the first NaN's where a row
    holds one (`jnp.argmax`'s answer)."""
    if build.load() is None:
        raise build.NativeBuildError(f"the native kernels are unavailable: {build.error()}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = jax.ffi.ffi_call("kivi_jax_first_max", jax.ShapeDtypeStruct(flat.shape[:1], jnp.int32))(flat)
    return out.reshape(lead)
