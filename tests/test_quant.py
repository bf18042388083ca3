"""The quantizer: error bounds, code ranges, packing, constant groups, outliers and subnormals (hypothesis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kivi_jax import quant

SETTINGS = settings(max_examples=40, deadline=None)


def arrays(tokens, channels, elements):
    return hnp.arrays(np.float32, (tokens, channels), elements=elements)


finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


def error_bound(x, scale, mn, group_size, axis, scale_dtype, bits):
    """scale/2 plus what rounding the scale and min to their storage dtype can add (see quant's module doc)."""
    levels = 2**bits - 1
    xg = np.moveaxis(x, axis, -1).reshape(np.moveaxis(x, axis, -1).shape[:-1] + (-1, group_size))
    mn_exact = xg.min(-1)
    scale_exact = (xg.max(-1) - mn_exact) / levels
    s = np.moveaxis(np.asarray(scale, np.float32), axis, -1)
    m = np.moveaxis(np.asarray(mn, np.float32), axis, -1)
    bound = s / 2 + np.abs(m - mn_exact) + levels * np.abs(np.where(scale_exact == 0, 0, s - scale_exact))
    bound = bound + 1e-6 * (np.abs(xg).max(-1) + 1)  # float32 arithmetic
    return np.moveaxis(np.repeat(bound, group_size, axis=-1).reshape(np.moveaxis(x, axis, -1).shape), -1, axis)


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
@pytest.mark.parametrize("axis", [0, 1])  # 0: per-channel (groups along tokens), 1: per-token (groups along channels)
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@SETTINGS
@given(data=st.data())
def test_error_within_half_a_step(bits, axis, scale_dtype, data):
    g = data.draw(st.sampled_from([4, 8, 16]))
    x = data.draw(arrays(2 * g, 2 * g, finite))
    sd = quant.SCALE_DTYPES[scale_dtype]
    codes, scale, mn = quant.quantize(jnp.asarray(x), bits, g, axis, sd)
    codes, scale, mn = np.asarray(codes), np.asarray(scale), np.asarray(mn)
    assert codes.dtype == np.uint8 and codes.max() <= 2**bits - 1
    assert scale.dtype == np.dtype(sd) and np.isfinite(scale).all() and np.isfinite(mn).all()
    x_hat = np.asarray(quant.dequantize(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(mn), g, axis))
    assert (np.abs(x_hat - x) <= error_bound(x, scale, mn, g, axis, sd, bits)).all()


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
@SETTINGS
@given(data=st.data())
def test_unpack_inverts_pack(bits, data):
    d = data.draw(st.sampled_from([8, 16, 64, 128]))
    codes = data.draw(hnp.arrays(np.uint8, (3, d), elements=st.integers(0, 2**bits - 1)))
    packed = quant.pack(jnp.asarray(codes), bits)
    assert packed.shape == (3, d * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), codes)


def test_three_bit_packing_is_a_two_bit_plane_then_a_one_bit_plane():
    codes = jnp.arange(8, dtype=jnp.uint8).reshape(1, 8)  # channels 0..7 with codes 0..7
    packed = np.asarray(quant.pack(codes, 3))  # 2 bytes of low bits (2-bit planar), 1 byte of high bits (1-bit)
    low, high = np.arange(8) % 4, np.arange(8) // 4
    assert packed.tolist() == [[low[0] | low[2] << 2 | low[4] << 4 | low[6] << 6,
                                low[1] | low[3] << 2 | low[5] << 4 | low[7] << 6,
                                sum(int(high[i]) << i for i in range(8))]]


def test_packing_is_planar():
    codes = jnp.arange(8, dtype=jnp.uint8).reshape(1, 8) % 4  # channels 0..7 with codes 0,1,2,3,0,1,2,3
    packed = np.asarray(quant.pack(codes, 2))  # 2 bytes; byte j holds channels j, j+2, j+4, j+6
    assert packed.tolist() == [[0 | 2 << 2 | 0 << 4 | 2 << 6, 1 | 3 << 2 | 1 << 4 | 3 << 6]]


@pytest.mark.parametrize("axis", [0, 1])
def test_constant_groups_come_back_exactly(axis):
    x = np.full((8, 8), 3.14159, np.float32)
    x[4:] = -2.5  # two different constant groups along the token axis
    for sd, expected in ((jnp.float32, x), (jnp.float16, x.astype(np.float16).astype(np.float32))):
        codes, scale, mn = quant.quantize(jnp.asarray(x), 2, 4, axis, sd)
        assert not np.isnan(np.asarray(scale, np.float32)).any()
        np.testing.assert_array_equal(np.asarray(quant.dequantize(codes, scale, mn, 4, axis)), expected)
    representable = np.full((8, 8), 0.375, np.float32)  # exact in float16: exact through float16 storage too
    codes, scale, mn = quant.quantize(jnp.asarray(representable), 2, 4, axis, jnp.float16)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(codes, scale, mn, 4, axis)), representable)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_outliers_and_subnormals_give_no_nan_or_inf(bits, axis):
    rng = np.random.RandomState(0)
    x = rng.randn(32, 32).astype(np.float32) * 1e-3
    x[3, 5], x[17, 30] = 1e4, -1e4
    x[8:16, :] = rng.randn(8, 32).astype(np.float32) * 1e-40  # float32 subnormals
    x[20, :] = 1e-45
    for sd in (jnp.float16, jnp.bfloat16, jnp.float32):
        codes, scale, mn = quant.quantize(jnp.asarray(x), bits, 8, axis, sd)
        x_hat = np.asarray(quant.dequantize(codes, scale, mn, 8, axis))
        assert np.isfinite(x_hat).all()
        assert np.isfinite(np.asarray(scale, np.float32)).all() and np.isfinite(np.asarray(mn, np.float32)).all()
        assert not bool(quant.overflowed(scale, mn))


def test_float16_overflow_is_reported_and_float32_storage_avoids_it():
    x = np.zeros((8, 8), np.float32)
    x[0, :4] = 1e5  # a group whose min is beyond float16's 65504
    x[1, 0] = 3e5  # a group whose scale (range / 3) is beyond it
    _, scale, mn = quant.quantize(jnp.asarray(x), 2, 4, 1, jnp.float16)
    assert bool(quant.overflowed(scale, mn))
    assert np.isinf(np.asarray(mn, np.float32)[0, 0]) and np.isinf(np.asarray(scale, np.float32)[1, 0])
    codes, scale, mn = quant.quantize(jnp.asarray(x), 2, 4, 1, jnp.float32)
    assert not bool(quant.overflowed(scale, mn))
    assert np.abs(np.asarray(quant.dequantize(codes, scale, mn, 4, 1)) - x).max() <= 3e5 / 3 / 2 + 1e-2


def test_per_channel_and_per_token_shapes():
    x = jnp.asarray(np.random.RandomState(1).randn(2, 3, 64, 32).astype(np.float32))  # [batch, heads, tokens, dim]
    codes, scale, mn = quant.quantize_per_channel(x, 2, 16)
    assert codes.shape == (2, 3, 64, 8) and scale.shape == mn.shape == (2, 3, 4, 32)
    codes, scale, mn = quant.quantize_per_token(x, 4, 16)
    assert codes.shape == (2, 3, 64, 16) and scale.shape == mn.shape == (2, 3, 64, 2)
    codes, scale, mn = quant.quantize_per_channel(x, 3, 16)  # a 2-bit plane (8 bytes) then a 1-bit plane (4 bytes)
    assert codes.shape == (2, 3, 64, 12) and scale.shape == mn.shape == (2, 3, 4, 32)
    with pytest.raises(ValueError, match="5 bits are not supported"):
        quant.quantize_per_token(x, 5, 16)
    with pytest.raises(ValueError, match="not a multiple of group_size=24"):
        quant.quantize_per_token(x, 2, 24)
