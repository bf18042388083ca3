"""The native greedy draw (`kivi_jax/native/argmax_cpu.cc`) equals its twin `sampling.first_max_xla` and
`jnp.argmax`: the first maximum, the first NaN where a row holds one, on rows whose lengths are and are not multiples
of its 16 lanes; a program lowered for a GPU keeps XLA's reduces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import native, sampling
from kivi_jax.native import argmax

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on the CPU backend")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not native.available():
        pytest.fail(f"the native kernels did not build here: {native.error()}")


def hard_rows(rng, rows: int, vocab: int) -> np.ndarray:
    """Random rows with ties (small integers), a row of -inf, a row of one value, NaNs in the first vector, in a later
    one and in the tail, +inf, and the maximum in the tail."""
    x = rng.integers(-3, 4, (rows, vocab)).astype(np.float32)
    x[0] = -np.inf
    if rows > 1:
        x[1] = 2.5
    if rows > 2:
        x[2, rng.integers(0, vocab)] = np.nan
    if rows > 3:
        x[3, vocab - 1] = np.nan
        x[3, vocab // 2] = np.nan
    if rows > 4:
        x[4, rng.integers(0, vocab)] = np.inf
    if rows > 5:
        x[5, vocab - 1] = 9.0
    if rows > 6:
        x[6] = rng.standard_normal(vocab)
    return x


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 15), (7, 16), (8, 17), (33, 100), (32, 49152), (2, 4097)])
def test_the_kernel_equals_its_twin_and_argmax(rows, vocab):
    x = jnp.asarray(hard_rows(np.random.default_rng(rows * 1000 + vocab), rows, vocab))
    got = np.asarray(jax.jit(argmax.first_max)(x))
    want = np.asarray(jax.jit(sampling.first_max_xla)(x))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert got.dtype == np.int32


def test_first_max_takes_the_kernel_on_the_cpu_only():
    x = jnp.zeros((4, 64), jnp.float32)
    assert argmax.usable(x) and not argmax.usable(x.astype(jnp.bfloat16))
    cpu = jax.jit(sampling.first_max).lower(x).as_text()
    gpu = jax.jit(sampling.first_max).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "kivi_jax_first_max" in cpu and "kivi_jax_first_max" not in gpu
    batched = jnp.asarray(hard_rows(np.random.default_rng(0), 8, 300)).reshape(2, 4, 300)
    np.testing.assert_array_equal(np.asarray(sampling.first_max(batched)), np.asarray(jnp.argmax(batched, -1)))
