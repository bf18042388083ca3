"""The native KIVI decode kernel over a 16-bit residual ring (`-ringf16`, `-ringbf16`: the ring's key and value rows
stored in float16 or bfloat16; the query, the new token and the arithmetic stay float32). The XLA path widens the
ring to float32 as stored, and so does the kernel: on random caches it equals the XLA path within the shared
tolerance (ragged lengths that are not multiples of any block, GQA, windows, sinks, pre-RoPE keys, codebooks, a traced
or absent layer index, the integer mode), contiguous and paged through shuffled block tables, and gives bit for bit
what it gives over the same ring widened to float32 first. `unsupported_kivi` serves the three ring dtypes and names
the dtype it refuses; `auto` takes the kernel for a 16-bit ring; a tiny model's decode logits on a
`k2v2-g32-r128-ringf16` cache (kivi2 with a float16 ring) through the kernel equal the XLA path's."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention, native
from kivi_jax.cache import KIVICache, make_cache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params

from test_native_beyond import FAST, TOL, built, pytestmark  # noqa: F401 (the module fixture: the kernels built)
from test_native_paged import make_case, run as run_paged
from test_pallas_kivi import inv_freq, one_layer, random_cache, random_step

RINGS = ("float16", "bfloat16")
CFG64 = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=64)


def kernel_and_xla(cache, q, k_new, v_new, layer, window, int8_dots=False):
    """(kernel over the 16-bit ring, kernel over that ring widened to float32, XLA path, XLA path without the window)
    as float32 numpy arrays, one compilation; a pre-RoPE cache is read with RoPE's inverse frequencies, a cache with
    sinks with its sinks; `layer=None` passes arrays holding layer 0 only."""
    if layer is None:
        cache = one_layer(cache, 0)
    freqs = inv_freq(q.shape[-1]) if cache.config.pre_rope else None

    def go(c, q, k_new, v_new, layer):
        sinks = None if c.k_sink is None else (c.k_sink, c.v_sink)
        kernel = lambda k_ring, v_ring: native.decode_kivi(q, c.k, c.v, layer, k_ring, v_ring, c.length, k_new,
                                                           v_new, window, sinks, freqs, int8_dots=int8_dots)
        out = kernel(c.k_ring, c.v_ring)
        widened = kernel(c.k_ring.astype(jnp.float32), c.v_ring.astype(jnp.float32))
        pick = (lambda x: x) if layer is None else (lambda x: x[layer])
        rings = pick(c.k_ring), pick(c.v_ring)  # [batch, kv_heads, R, head_dim], 16-bit
        one = None if sinks is None else (pick(sinks[0]), pick(sinks[1]))
        xla, unwindowed = (attention.decode_kivi_xla(q, c.k, c.v, layer, *rings, c.length, k_new, v_new, w,
                                                     sinks=one, inv_freq=freqs, int8_dots=int8_dots)
                           for w in (window, None))
        return out, widened, xla, unwindowed

    args = (cache, q, k_new, v_new, None if layer is None else jnp.int32(layer))
    return [np.asarray(x, np.float32) for x in jax.jit(go).lower(*args).compile(FAST)(*args)]


# (name, config without its ring dtype, head_dim, batch, kv_heads, n_rep, max tokens in R-blocks, lengths as f(R, T),
# window, layer)
CASES = [
    ("kivi2-d64", KIVIConfig(2, 2, 32, 128), 64, 3, 2, 3, 3, lambda r, t: [r - 5, 2 * r + 9, t - 3], None, 0),
    ("k4v2-g64-d128-window", KIVIConfig(4, 2, 64, 128), 128, 2, 1, 5, 4, lambda r, t: [t - 7, r + 3], 100, 1),
    ("k2v4-g128-d64-short-window", KIVIConfig(2, 4, 128, 128), 64, 3, 2, 2, 3, lambda r, t: [r + 77, 45, 1], 30,
     None),
    ("k3v2-prerope-s4", KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4), 64, 3, 1, 4, 3,
     lambda r, t: [3, r + 1, t - 9], None, 1),
    ("k2v2-codebooks-d128-window", KIVIConfig(2, 2, 32, 64, k_codebook=True, v_codebook=True), 128, 2, 2, 2, 4,
     lambda r, t: [2 * r + 11, r - 1], 70, 0),
    ("k4v4-sf32-window", KIVIConfig(4, 4, 32, 64, scale_dtype="float32"), 64, 4, 1, 8, 4,
     lambda r, t: [r, r + 1, 3 * r - 6, t - 1], 2 * 64 - 3, 1),
]


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_over_a_16bit_ring_equals_the_xla_path(case, ring):
    name, kivi, head_dim, batch, kv_heads, n_rep, blocks, lengths, window, layer = case
    kivi = dataclasses.replace(kivi, ring_dtype=ring)
    r = kivi.residual_length
    i = CASES.index(case)
    cache = random_cache(kivi, batch, kv_heads, head_dim, blocks * r, lengths(r, blocks * r), jnp.float32,
                         seed=700 + i)
    assert cache.k_ring.dtype == cache.v_ring.dtype == jnp.dtype(ring)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=800 + i)
    sinks = None if cache.k_sink is None else (cache.k_sink, cache.v_sink)
    assert native.unsupported_kivi(q.dtype, head_dim, cache.k, cache.v, cache.k_ring.dtype, r, sinks) is None
    out, widened, xla, unwindowed = kernel_and_xla(cache, q, k_new, v_new, layer, window)
    assert np.abs(out - xla).max() <= TOL, np.abs(out - xla).max()
    np.testing.assert_array_equal(out, widened)  # the ring read as stored, widened exactly
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides
    if window is not None:
        assert np.abs(unwindowed - xla).max() > 10 * TOL  # the window changed the answer


def ring16(case, ring: str):
    """The case with its rings `[layers, batch, kv_heads, R, head_dim]` stored in `ring`."""
    case.k_ring, case.v_ring = (x.astype(ring) for x in (case.k_ring, case.v_ring))
    return case


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("name", ["kivi2", "k4v2-g64-window", "sinks-pre-rope", "k2v4-bf16-window"])
def test_paged_kernel_over_a_16bit_ring_equals_its_twin_and_the_contiguous_kernel(name, ring):
    """Pools read through a shuffled block table (entries past each sequence's pages holding none) with 16-bit
    rings: the kernel equals the XLA path over the same PagedStores and the kernel over the same tokens laid out
    contiguously."""
    case, rope = make_case(name, seed=30 + len(name))
    case = ring16(case, ring)
    assert len(case.held()) < case.num_pages  # free pages in the pool, and a table out of order
    out, xla = run_paged(case, *case.stores(), rope=rope)
    assert np.isfinite(out).all()
    assert np.abs(out - xla).max() <= TOL, np.abs(out - xla).max()
    assert np.abs(xla).max() > 0.1
    contiguous, twin = run_paged(case, *case.contiguous(), rope=rope)
    assert np.abs(contiguous - out).max() <= TOL
    assert np.abs(twin - xla).max() <= TOL


@pytest.mark.parametrize("ring", RINGS)
def test_int8_dots_over_a_16bit_ring(ring):
    """The integer mode (it touches the quantized tokens only) with a 16-bit ring: paged and contiguous, against
    `decode_kivi_xla(..., int8_dots=True)`; and contiguous from a random cache through `random_cache`."""
    if not native.int8_dots():
        pytest.skip("this build has no integer mode (it needs AVX-512 BW and VBMI)")
    case, _ = make_case("kivi2", seed=22)
    case = ring16(case, ring)
    out, xla = run_paged(case, *case.stores(), int8_dots=True)
    contiguous, _ = run_paged(case, *case.contiguous(), int8_dots=True)
    assert np.abs(out - xla).max() <= TOL, np.abs(out - xla).max()
    np.testing.assert_array_equal(out, contiguous)  # chunks of R = 128 tokens: the same arithmetic
    kivi = KIVIConfig(2, 2, 32, 64, ring_dtype=ring)
    cache = random_cache(kivi, 3, 2, 64, 256, [30, 64 + 17, 255], jnp.float32, seed=41)
    q, k_new, v_new = random_step(3, 6, 2, 64, jnp.float32, seed=42)
    out, widened, xla, _ = kernel_and_xla(cache, q, k_new, v_new, 1, None, int8_dots=True)
    assert np.abs(out - xla).max() <= TOL, np.abs(out - xla).max()
    np.testing.assert_array_equal(out, widened)


def test_unsupported_serves_the_three_ring_dtypes_and_names_what_it_refuses():
    cache = jax.eval_shape(lambda: KIVICache.create(CFG64, parse_cache_spec("k2v2-g32-r128-ringf16"), 2, 256))
    for ring in (jnp.float32, jnp.float16, jnp.bfloat16):
        assert native.unsupported_kivi(jnp.float32, 64, cache.k, cache.v, ring, 128) is None
    why = native.unsupported_kivi(jnp.float32, 64, cache.k, cache.v, jnp.int8, 128)
    assert "ring" in why and "int8" in why, why
    why = native.unsupported_kivi(jnp.bfloat16, 64, cache.k, cache.v, jnp.float16, 128)
    assert "queries in bfloat16" in why and "ring" not in why, why


@pytest.mark.parametrize("ring", RINGS)
def test_auto_takes_the_native_kernel_for_a_16bit_ring(ring, monkeypatch):
    """`decode_kivi` with `auto` (and a forced `native`) on the CPU traces the kernel for a kivi2 cache with a 16-bit
    ring, contiguous and paged, handing it the ring as stored, with no fallback warning."""
    calls = []
    monkeypatch.setattr(native, "decode_kivi",
                        lambda *a, **k: calls.append((a[4].dtype, a[5].dtype)) or jnp.zeros(a[0].shape, a[0].dtype))
    spec = parse_cache_spec("k2v2-g32-r128-" + {"float16": "ringf16", "bfloat16": "ringbf16"}[ring])
    q, k_new, v_new = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 1, 4, 64), (2, 1, 2, 64), (2, 1, 2, 64)))
    assert attention.use_native("auto")  # the CPU backend
    for pages in (None, 6):
        cache = jax.eval_shape(lambda: KIVICache.create(CFG64, spec, 2, 256, pages=pages))
        assert cache.k_ring.dtype == jnp.dtype(ring)
        for impl in ("auto", "native"):
            calls.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback to the XLA path
                jax.eval_shape(lambda c, q, k, v: attention.decode_kivi(
                    impl, q, *c.stores(), 1, c.k_ring, c.v_ring, c.length, k, v, None), cache, q, k_new, v_new)
            assert calls == [(jnp.dtype(ring), jnp.dtype(ring))]


@pytest.mark.slow
def test_model_logits_through_the_kernel_equal_the_xla_path_for_a_float16_ring(monkeypatch):
    """A tiny model with the kernel's head_dim (GQA, 2 layers) on a `k2v2-g32-r128-ringf16` cache: a ragged prefill
    (the XLA path), then 40 decode steps, each run from the same cache with `attention_impl` "xla" and "auto" (which
    takes the kernel), crossing ring flushes (quantized, flushed-key and ring tokens all in view): the logits agree
    at every step. (Each step goes on from the XLA path's cache: caches fed by the two paths drift apart as an ulp
    in a stored key or value moves a code or a 16-bit rounding, which is not the kernel's error.)"""
    calls = []
    real = native.decode_kivi
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append(a[4].dtype) or real(*a, **k))
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    rng = np.random.RandomState(4)
    lengths = np.array([120, 250, 37])
    prompt = rng.randint(3, 128, (3, int(lengths.max()))).astype(np.int32)  # [batch, prompt tokens]
    steps = rng.randint(3, 128, (40, 3, 1)).astype(np.int32)  # [steps, batch, 1]: the decoded tokens
    step = jax.jit(forward)
    cache = make_cache("k2v2-g32-r128-ringf16", cfg, 3, 384, impl="xla")
    assert cache.k_ring.dtype == jnp.float16
    _, cache = step(params, jnp.asarray(prompt), cache, jnp.asarray(lengths, jnp.int32))
    errs, top = [], 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback
        for tokens in steps:
            kernel, _ = step(params, jnp.asarray(tokens), cache.replace(impl="auto"))  # [batch, 1, vocab]
            xla, cache = step(params, jnp.asarray(tokens), cache)
            errs.append(np.abs(np.asarray(kernel) - np.asarray(xla)).max())
            top = max(top, np.abs(np.asarray(xla)).max())
    assert (np.asarray(cache.length) == lengths + len(steps)).all()
    assert set(calls) == {jnp.dtype(jnp.float16)}  # "auto" traced the kernel, over the float16 ring
    # attention within TOL, through two layers and the LM head (logits up to ~8): 1.5e-5 typical, under 5e-5 at
    # worst for this seed; the float32 ring's cache spreads as much (up to 8e-5 over seeds 4-6, measured)
    assert max(errs) <= 10 * TOL, errs
    assert top > 0.1
