"""The full-precision decode kernel in interpret mode equals its jnp twin and the XLA path (ragged lengths, windows,
caches that are not a multiple of the block); the dot_product_attention baseline agrees. (`generate` with it:
test_pallas_cli.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention
from kivi_jax.pallas_kernels import full_decode

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
FAST = {"xla_backend_optimization_level": 0}  # interpret mode compiles slowly; codegen speed does not matter here


def random_inputs(layers, batch, kv_heads, n_rep, max_tokens, head_dim, dtype, seed):
    """A stacked random cache `[layers, batch, kv_heads, tokens, head_dim]` and the new token's q, k, v."""
    rng = np.random.RandomState(seed)
    shape = (layers, batch, kv_heads, max_tokens, head_dim)
    k = rng.randn(*shape)
    k[..., 3] *= 8.0
    arr = lambda *s: jnp.asarray(rng.randn(*s), dtype)
    return (jnp.asarray(k, dtype), arr(*shape), arr(batch, 1, kv_heads * n_rep, head_dim),
            arr(batch, 1, kv_heads, head_dim), arr(batch, 1, kv_heads, head_dim))


# (dtype, batch, kv_heads, n_rep, max_tokens, head_dim, lengths, window, splits)
CASES = [
    (jnp.float32, 3, 2, 3, 256, 64, [0, 77, 255], None, None),
    (jnp.float32, 2, 1, 4, 80, 128, [80, 33], 20, 2),  # 80 tokens: 16-token blocks
    (jnp.bfloat16, 2, 2, 1, 192, 128, [150, 191], None, 3),
    (jnp.bfloat16, 1, 3, 2, 256, 64, [200], 70, None),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{jnp.dtype(c[0]).name}-d{c[5]}-w{c[7]}" for c in CASES])
def test_kernel_equals_twin_and_xla(case):
    dtype, batch, kv_heads, n_rep, max_tokens, head_dim, lengths, window, splits = case
    k, v, q, k_new, v_new = random_inputs(2, batch, kv_heads, n_rep, max_tokens, head_dim, dtype, seed=max_tokens)
    length = jnp.asarray(lengths, jnp.int32)

    def run(q, k, v, length, k_new, v_new, layer):
        args = (q, k, v, layer, length, k_new, v_new, window)
        return (full_decode.decode(*args, num_splits=splits, interpret=True), full_decode.reference(*args),
                attention.decode_full_xla(*args))

    args = (q, k, v, length, k_new, v_new, jnp.int32(1))
    kernel, twin, xla = (np.asarray(x, np.float32) for x in jax.jit(run).lower(*args).compile(FAST)(*args))
    assert np.abs(kernel - twin).max() <= TOL[dtype]
    assert np.abs(kernel - xla).max() <= TOL[dtype]
    assert np.abs(xla).max() > 0.1


def test_dot_product_attention_baseline_agrees():
    k, v, q, k_new, v_new = random_inputs(1, 2, 2, 3, 128, 64, jnp.float32, seed=3)
    length = jnp.array([50, 127], jnp.int32)

    @jax.jit
    def both(q, k, v, length, k_new, v_new):
        ours = full_decode.reference(q, k, v, 0, length, k_new, v_new)
        rows = jnp.arange(k.shape[3])[None, None, :, None] == length[:, None, None, None]  # [batch, 1, tokens, 1]
        k1 = jnp.where(rows, k_new[:, 0, :, None, :], k[0])  # the new token written at position length
        v1 = jnp.where(rows, v_new[:, 0, :, None, :], v[0])
        sdpa = full_decode.sdpa_decode(q, jnp.swapaxes(k1, 1, 2), jnp.swapaxes(v1, 1, 2), length + 1)
        return ours, sdpa

    ours, sdpa = both(q, k, v, length, k_new, v_new)
    np.testing.assert_allclose(np.asarray(sdpa), np.asarray(ours), atol=1e-4)


def test_unsupported_shapes_fall_back_to_xla():
    assert full_decode.unsupported(64, 256) is None
    assert "head_dim" in full_decode.unsupported(48, 256)
    assert "multiple of 16" in full_decode.unsupported(64, 72)
