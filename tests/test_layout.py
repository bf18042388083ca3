"""The token ranges of a cache (kivi_jax/layout.py), and the Pallas kernel's in-kernel mirror of them:
pallas_kernels imports nothing of ours, so its two helpers must stay equal to layout's functions."""

import jax.numpy as jnp
import numpy as np

from kivi_jax import layout
from kivi_jax.pallas_kernels import kivi_decode

R = 32


def test_ranges_by_hand():
    length = jnp.asarray([0, 1, R - 1, R, R + 1, 3 * R + 5])
    assert layout.quantized_end("channel", length, R).tolist() == [0, 0, 0, R, R, 3 * R]
    assert layout.quantized_end("token", length, R).tolist() == [0, 0, 0, 0, 1, 2 * R + 5]
    held = np.asarray(layout.ring_tokens(length, R))
    assert (held[0] < 0).all() and held[1, 0] == 0 and (held[1, 1:] < 0).all()
    assert sorted(held[-1].tolist()) == list(range(2 * R + 5, 3 * R + 5))  # the newest R tokens, slot t % R
    assert all(held[-1, t % R] == t for t in range(2 * R + 5, 3 * R + 5))
    assert layout.last_flushed_block(length, R).tolist() == [0, 0, 0, 0, 0, 2 * R]
    assert layout.appended_blocks(1, R) == 1 and layout.appended_blocks(R + 1, R) == 2


def test_the_kernels_mirror_equals_layout():
    length = jnp.arange(0, 5 * R + 3)
    slots = jnp.arange(R)
    for window in (None, 23, 3 * R):
        lo, main_end = kivi_decode.segment_bounds(length, R, window)
        assert (lo == layout.window_start(length, window)).all()
        assert (main_end == layout.both_quantized_end("channel", "token", length, R)).all()
    tok, quantized = kivi_decode.ring_slot_tokens(length[:, None], slots[None, :], R)
    held = layout.ring_tokens(length, R)
    written = held >= 0
    assert (jnp.where(written, tok, 0) == jnp.where(written, held, 0)).all()
    assert (tok[~written] < 0).all()
    assert (jnp.where(written, quantized, False) == (written & (held < layout.quantized_end("channel", length, R)[:, None]))).all()
