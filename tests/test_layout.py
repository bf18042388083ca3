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


def test_ring_slots_leave_every_slot_holding_the_token_ring_tokens_names():
    """Appending `num_new` of T tokens onto `length`: writing each landing token to its slot (in any order; slots are
    distinct) gives the ring `ring_tokens(length + num_new)` describes, for chunks shorter and longer than R."""
    rng = np.random.RandomState(0)
    for tokens in (1, 5, R, R + 9, 3 * R):
        length = jnp.asarray(rng.randint(0, 4 * R, 32), jnp.int32)
        num_new = jnp.asarray(rng.randint(0, tokens + 1, 32), jnp.int32)
        slots = np.asarray(layout.ring_slots(length, num_new, tokens, R))
        ring = np.asarray(layout.ring_tokens(length, R)).copy()  # token ids per slot before the append
        for b in range(32):
            landed = slots[b][slots[b] < R]
            assert len(set(landed.tolist())) == len(landed)  # distinct
            for i in range(tokens):
                if slots[b, i] < R:
                    ring[b, slots[b, i]] = int(length[b]) + i
        after = np.asarray(layout.ring_tokens(length + num_new, R))
        assert (np.where(after >= 0, ring, -1) == np.where(after >= 0, after, -1)).all()
