"""The XLA path's word-wise (SWAR) unpacking equals the quantizer's own unpacking, in channel order."""

import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention, quant
from kivi_jax.cache import QuantStore


@pytest.mark.parametrize("bits, head_dim", [  # rows of D/p bytes: multiples of 4, 2 or 1; every packable pair
    (b, d) for b in quant.SUPPORTED_BITS for d in (16, 20, 24, 40, 64, 128) if d % quant.pack_multiple(b) == 0])
def test_unpack_codes_equals_quant_unpack(bits, head_dim):
    rng = np.random.RandomState(bits * head_dim)
    codes = jnp.asarray(rng.randint(0, 2**bits, (2, 3, 40, head_dim)).astype(np.uint8))
    packed = quant.pack(codes, bits)
    store = QuantStore(codes=packed, scale=jnp.zeros(()), mn=jnp.zeros(()), bits=bits, group_size=8, axis="token")
    got = attention.unpack_codes(store)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(quant.unpack(packed, bits)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(codes).astype(np.float32))
