"""The Pallas TPU (Mosaic) KIVI decode kernel: in TPU interpret mode (DMAs and semaphores simulated, the race
detector on) it equals the XLA path and the jnp twin on random caches (a covering set of the shipped configuration
classes: bits, group, head_dim, window, sinks, pre-RoPE keys; ragged lengths that are multiples of no block); it
lowers for TPU (abstract TPU devices of two generations) in every shipped configuration; a whole model decode step
with `attention_impl="pallas"` lowers for TPU with the kernel reading the stacked cache; and dispatch picks it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kivi_jax import attention
from kivi_jax.cache import KIVICache, make_cache
from kivi_jax.config import KIVIConfig
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import kivi_decode, kivi_decode_tpu

from test_pallas_kivi import CFG_64, compiled, inv_freq, random_step
from tpu_target import tpu_target

TPU_CALL = "tpu_custom_call"


def races_found() -> bool:
    """Whether TPU interpret mode's race detector flagged a race in the last interpreted kernel (jax keeps the
    state in its interpreter module; no public accessor)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)


def random_cache(kivi: KIVIConfig, batch, kv_heads, head_dim, max_tokens, lengths, dtype, seed, layers=2):
    """A KIVI cache holding `lengths [batch]` tokens whose every array is random: codes (garbage past the lengths
    too, which must stay unseen), positive float16 scales with two 8x outlier key channels, mins, rings, sinks. Built
    on the host: no quantization to compile (the kernel's contract is the stored arrays, not how they were made)."""
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=layers, num_heads=kv_heads,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    empty = KIVICache.create(cfg, kivi, batch, max_tokens, dtype)
    rng = np.random.RandomState(seed)

    def store(s, outliers):
        scale = rng.uniform(0.02, 0.3, s.scale.shape)
        if outliers:
            scale[..., [3, head_dim // 2 + 1]] *= 8.0
        return s.replace(codes=jnp.asarray(rng.randint(0, 256, s.codes.shape), jnp.uint8),
                         scale=jnp.asarray(scale, s.scale.dtype),
                         mn=jnp.asarray(rng.uniform(-1.5, 0.0, s.mn.shape), s.mn.dtype))

    dense = lambda x: None if x is None else jnp.asarray(rng.randn(*x.shape), dtype)
    return empty.replace(k=store(empty.k, True), v=store(empty.v, False), k_ring=dense(empty.k_ring),
                         v_ring=dense(empty.v_ring), k_sink=dense(empty.k_sink), v_sink=dense(empty.v_sink),
                         length=jnp.asarray(lengths, jnp.int32))


def kernel_twin_xla(cache, q, k_new, v_new, layer, window, num_splits=None, tokens_per_step=None, twin=True):
    """(kernel in TPU interpret mode with race detection, jnp twin, XLA path, XLA path without the window) as
    float32 numpy arrays, one compilation (the twin and the windowless path only when asked for: each compiles);
    `layer=None` passes arrays holding layer 0 only."""
    from test_pallas_kivi import one_layer

    kv = cache.config
    if layer is None:
        cache = one_layer(cache, 0)
    freqs = inv_freq(q.shape[-1]) if kv.pre_rope else None

    def run(cache, q, k_new, v_new, layer):
        arrays = (cache.k.codes, cache.k.scale, cache.k.mn, cache.v.codes, cache.v.scale, cache.v.mn,
                  cache.k_ring, cache.v_ring)
        args = (q, *arrays, layer, cache.length, k_new, v_new)
        kw = dict(k_bits=kv.k_bits, v_bits=kv.v_bits, group_size=kv.group_size, window=window, k_sink=cache.k_sink,
                  v_sink=cache.v_sink, inv_freq=freqs)
        kernel = kivi_decode_tpu.decode(*args, **kw, num_splits=num_splits,
                                        tokens_per_step=tokens_per_step or kivi_decode_tpu.TOKENS_PER_STEP,
                                        interpret=pltpu.InterpretParams(detect_races=True))
        pick = (lambda x: x) if layer is None else (lambda x: x[layer])
        rings = pick(cache.k_ring), pick(cache.v_ring)
        sinks = None if cache.k_sink is None else (pick(cache.k_sink), pick(cache.v_sink))
        xla = lambda w: attention.decode_kivi_xla(q, cache.k, cache.v, layer, *rings, cache.length, k_new, v_new, w,
                                                  sinks=sinks, inv_freq=freqs)
        return (kernel, kivi_decode.reference(*args, **kw) if twin else kernel, xla(window),
                xla(None) if window is not None else kernel)

    args = (cache, q, k_new, v_new, None if layer is None else jnp.int32(layer))
    return [np.asarray(x, np.float32) for x in compiled(run, *args)(*args)]


# (name, config, head_dim, batch, kv_heads, n_rep, max tokens in R-blocks, lengths as f(R, T), window, layer, splits,
# tokens a step, dtype): every key and value bit width, group size and head dim, windows (into the quantized tokens,
# into the sinks), sinks, pre-RoPE keys at both head dims, both compute dtypes, one-layer arrays, one and several
# R-blocks a step, one to three splits. Lengths: empty, ring-only, at a flush, between flushes, near full,
# below / at / past the sinks; none a multiple of a step or key group.
CASES = [
    ("k2v2-g32-d64", KIVIConfig(2, 2, 32, 64), 64, 3, 2, 3, 4, lambda r, t: [r - 5, 2 * r + 9, t - 3], None, 0, 1,
     64, jnp.float32),
    ("k3v3-g128-d128-window", KIVIConfig(3, 3, 128, 128), 128, 3, 1, 4, 3, lambda r, t: [t - 7, r - 1, r + 3], 100,
     None, 3, 128, jnp.float32),
    ("k2v4-g32-s5-window-4blocks", KIVIConfig(2, 4, 32, 32, sinks=5), 64, 4, 1, 2, 8,
     lambda r, t: [0, 5, 2 * r + 1, t - 20], 150, 0, 2, 128, jnp.float32),
    ("kivi2+like-window", KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4), 64, 3, 1, 3, 3,
     lambda r, t: [2, r + 17, t - 9], 200, 1, 1, 256, jnp.float32),
    ("kivi3+like-s7-bf16", KIVIConfig(4, 3, 64, 128, pre_rope=True, sinks=7), 128, 2, 2, 2, 3,
     lambda r, t: [6, t - 13], None, None, 1, 256, jnp.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_mode_equals_the_xla_path_with_no_race(case):
    name, kivi, head_dim, batch, kv_heads, n_rep, blocks, lengths, window, layer, splits, per_step, dtype = case
    i = CASES.index(case)
    max_tokens = blocks * kivi.residual_length
    cache = random_cache(kivi, batch, kv_heads, head_dim, max_tokens, lengths(kivi.residual_length, max_tokens),
                         dtype, seed=400 + i)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, dtype, seed=500 + i)
    twin_too = i in (0, len(CASES) - 2)  # the twin equals the XLA path (tests/test_pallas_kivi.py): twice is enough
    kernel, twin, xla, unwindowed = kernel_twin_xla(cache, q, k_new, v_new, layer, window, splits, per_step, twin_too)
    assert not races_found()
    # float32 throughout the kernel, whatever the compute dtype: 1e-5 before the output's rounding to it
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.abs(kernel - xla).max() <= tol, np.abs(kernel - xla).max()
    assert np.abs(kernel - twin).max() <= max(tol, 2e-5), np.abs(kernel - twin).max()
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides
    if window is not None:
        assert np.abs(unwindowed - xla).max() > 100 * tol  # the window changed the answer


def test_the_race_detector_is_live():
    """The check above could pass vacuously if this jax's interpreter ignored `detect_races`: a kernel that reads a
    DMA's destination before waiting for it is flagged."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]  # read while the copy may still be writing
        copy.wait()

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    pl.pallas_call(racy, in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                   scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
                   interpret=params)(x).block_until_ready()
    assert races_found()


def test_pieces_cover_every_channel_once_in_one_slab_of_every_plane():
    for bits in kivi_decode.KERNEL_BITS:
        for head_dim in (64, 128):
            for cap in (None, 32):
                ps = kivi_decode.pieces(head_dim, bits, cap)
                assert [c for p in ps for c in range(p.first, p.first + p.width)] == list(range(head_dim))
                for p in ps:  # the piece's bytes stay inside its plane and its bits inside one slab
                    for byte, shift, mask, weight in p.planes:
                        assert shift + mask.bit_length() <= 8 and byte + p.width <= head_dim * bits // 8


# Every shipped configuration: key and value bits 2/3/4, (G, head_dim) pairs, keys after RoPE or before it with 4
# sinks and a window; the compute dtype alternates (the kernel computes in float32; only the rings' loads differ).
GROUPS_DIMS = [(g, d) for d in (64, 128) for g in (32, 64, 128) if g <= d]
TPU_MATRIX = [(kb, vb, g, d, rope) for kb in (2, 3, 4) for vb in (2, 3, 4) for g, d in GROUPS_DIMS
              for rope in (False, True)]


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_kernel(k_bits, v_bits, group, head_dim, dtype, pre_rope, generation):
    """The kernel's pallas_call (`partials`: the jnp epilogue around it is plain XLA, lowered whole by the model step
    test below) lowered for TPU: 3 stacked layers read at a traced layer index, 2 sequences, 2 kv heads, 512 tokens,
    R = 128; before RoPE with 4 sinks and a window."""
    layers, batch, kv_heads, tokens, residual = 3, 2, 2, 512, 128
    lead = (layers, batch, kv_heads)
    args = (
        sds((batch, kv_heads, kivi_decode_tpu.query_rows(3), head_dim), jnp.float32),
        sds(lead + (tokens, head_dim * k_bits // 8), jnp.uint8),
        sds(lead + (tokens // group, head_dim), jnp.float16),
        sds(lead + (tokens // group, head_dim), jnp.float16),
        sds(lead + (tokens, head_dim * v_bits // 8), jnp.uint8),
        sds(lead + (tokens, head_dim // group), jnp.float16),
        sds(lead + (tokens, head_dim // group), jnp.float16),
        sds(lead + (residual, head_dim), dtype),
        sds(lead + (residual, head_dim), dtype),
        sds((), jnp.int32),  # the layer: traced
        sds((batch,), jnp.int32),
    )
    extra = (sds((head_dim // 2,), jnp.float32),) if pre_rope else ()
    assert kivi_decode_tpu.unsupported(head_dim, k_bits, v_bits, group, residual) is None

    def partials(*a):
        return kivi_decode_tpu.partials(*a[:11], k_bits=k_bits, v_bits=v_bits, group_size=group,
                                        window=300 if pre_rope else None, sinks=4 if pre_rope else 0,
                                        inv_freq=a[11] if pre_rope else None, interpret=False)

    lowered = lambda: jax.jit(partials).trace(*args, *extra).lower(lowering_platforms=("tpu",)).as_text()
    if generation is None:  # no abstract TPU device
        return lowered()
    with tpu_target(generation):
        return lowered()


# A second generation (and a third, with two TensorCores a chip) lower a covering subset: every bits pair once, keys
# after and before RoPE in turn, the (G, head_dim) pairs cycled. The generation changes only a few lowering rules
# (jnp's integer division among them); the time budget of the suite does not allow the whole matrix three times.
COVERING = [(kb, vb, *GROUPS_DIMS[(3 * kb + vb) % len(GROUPS_DIMS)], (kb + vb) % 2 == 1) for kb in (2, 3, 4)
            for vb in (2, 3, 4)]
assert set(COVERING) <= set(TPU_MATRIX) and {c[2:4] for c in COVERING} == set(GROUPS_DIMS)
assert {c[4] for c in COVERING} == {False, True}


@pytest.mark.parametrize("generation, matrix", [("v5e", TPU_MATRIX), ("v6e", COVERING), ("v4", COVERING[::3])],
                         ids=["v5e-every", "v6e-covering", "v4-some"])
@pytest.mark.slow
def test_every_shipped_configuration_lowers_for_tpu(generation, matrix):
    """One test a generation (the configurations lower in a loop: pytest's per-test overhead would be a third)."""
    for i, (kb, vb, g, d, rope) in enumerate(matrix):
        text = lower_kernel(kb, vb, g, d, ("float32", "bfloat16")[i % 2], rope, generation)
        assert text.count(TPU_CALL) == 1, (kb, vb, g, d, rope)


def test_lowering_needs_a_tpu_generation():
    """Why the tests lower under an abstract TPU device: off a TPU, the lowering asks the device's generation."""
    with pytest.raises(ValueError, match="TPU device kind"):
        lower_kernel(2, 2, 32, 64, "float32", False, None)


@pytest.mark.parametrize("spec", ["kivi2", "k3v2-g64-r128-prerope-s4", "k4v3-g64-r128-prerope-s4"])
def test_model_decode_step_lowers_for_tpu_with_the_kernel_reading_the_stacked_cache(spec, monkeypatch):
    """forward() over a KIVI cache with impl='pallas' and the TPU target, lowered for TPU: one Mosaic call a layer
    scan, whose operands are the stacked cache and rings themselves (the layer index comes from the scan)."""
    monkeypatch.setattr(attention, "pallas_target", lambda: "tpu")
    monkeypatch.setattr(kivi_decode_tpu, "interpret_params", lambda interpret: False)  # the real kernel, off a TPU
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=None)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: make_cache(spec, cfg, 2, 1024, jnp.bfloat16, impl="pallas"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the XLA path
        with tpu_target("v5e"):
            text = jax.jit(lambda p, t, c: forward(p, t, c)).trace(params, sds((2, 1), jnp.int32), cache).lower(
                lowering_platforms=("tpu",)).as_text()
    [call] = [line for line in text.splitlines() if TPU_CALL in line]
    assert "tensor<3x2x2x1024x" in call  # the stacked cache itself is the operand: no per-layer slice
    assert "tensor<3x2x2x128x64xbf16>" in call  # and the stacked rings


def test_dispatch_takes_the_tpu_kernel_on_tpu_and_falls_back_explicitly(monkeypatch):
    """`auto` and `pallas` trace the TPU kernel on the TPU target; configurations it does not serve take the XLA path
    (with a warning under `pallas`); the full-precision cache has no TPU kernel; the CPU keeps Triton's interpret
    mode unless a test asks."""
    calls = []
    monkeypatch.setattr(kivi_decode_tpu, "decode",
                        lambda *a, **k: calls.append(k) or jnp.zeros(a[0].shape, a[0].dtype))
    monkeypatch.setattr(attention, "pallas_target", lambda: "tpu")
    q, k_new, v_new = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 1, 4, 64), (2, 1, 2, 64), (2, 1, 2, 64)))
    for kivi, runs_kernel in ((KIVIConfig(2, 2, 32, 64), True), (KIVIConfig(8, 2, 32, 64), False),
                              (KIVIConfig(3, 2, 32, 64, pre_rope=True, sinks=4), True)):
        cache = jax.eval_shape(lambda: KIVICache.create(CFG_64, kivi, 2, 128))
        sinks = None if cache.k_sink is None else (cache.k_sink, cache.v_sink)
        freqs = inv_freq(64) if kivi.pre_rope else None
        calls.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.eval_shape(lambda c, q, k, v: attention.decode_kivi("pallas", q, c.k, c.v, 1, c.k_ring, c.v_ring,
                                                                    c.length, k, v, None, sinks, freqs),
                           cache, q, k_new, v_new)
        assert bool(calls) == runs_kernel
        assert any("using the XLA path" in str(w.message) for w in caught) == (not runs_kernel)
        if runs_kernel:
            assert calls[0]["k_bits"] == kivi.k_bits and (calls[0]["inv_freq"] is None) == (not kivi.pre_rope)
    full = jax.ShapeDtypeStruct((2, 2, 2, 128, 64), jnp.float32)
    with pytest.warns(UserWarning, match="no TPU kernel"):
        jax.eval_shape(lambda c, q, k, v: attention.decode_full("pallas", q, c, c, 1, jnp.zeros(2, jnp.int32), k, v,
                                                                None), full, q, k_new, v_new)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.use_pallas("auto", tpu_kernel=True) and not attention.use_pallas("auto")
    monkeypatch.undo()
    assert attention.pallas_target() == "triton"  # on this CPU: Triton's interpret mode, as before
    assert not attention.use_pallas("auto", tpu_kernel=True)
