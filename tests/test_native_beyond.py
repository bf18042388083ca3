"""The native CPU decode kernel over the beyond-KIVI cache options (docs/kernels.md, "CPU kernel"): 3-bit key and
value codes, pre-RoPE keys (rotated by the kernel), full-precision sink tokens, and the presets' configurations
(`kivi2+`, `kivi3+`), against the XLA path on random caches (ragged batches, lengths that are not multiples of any
block, with and without a sliding window); `generate` through it gives the XLA path's greedy tokens for a
preset-like spec."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import attention, native
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params

from test_pallas_kivi import inv_freq, one_layer, random_cache, random_step

TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on the CPU backend")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not native.available():
        pytest.fail(f"the native kernels did not build here: {native.error()}")


def native_and_xla(cache, q, k_new, v_new, layer, window):
    """(native kernel, XLA path, XLA path without the window) as float32 numpy arrays, one compilation; a pre-RoPE
    cache is read with RoPE's inverse frequencies, a cache with sinks with its sinks; `layer=None` passes arrays
    holding layer 0 only."""
    kv = cache.config
    if layer is None:
        cache = one_layer(cache, 0)
    freqs = inv_freq(q.shape[-1]) if kv.pre_rope else None

    def run(c, q, k_new, v_new, layer):
        sinks = None if c.k_sink is None else (c.k_sink, c.v_sink)
        out = native.decode_kivi(q, c.k, c.v, layer, c.k_ring, c.v_ring, c.length, k_new, v_new, window, sinks,
                                 freqs)
        pick = (lambda x: x) if layer is None else (lambda x: x[layer])
        rings = pick(c.k_ring), pick(c.v_ring)
        sinks = None if sinks is None else (pick(sinks[0]), pick(sinks[1]))
        xla, unwindowed = (attention.decode_kivi_xla(q, c.k, c.v, layer, *rings, c.length, k_new, v_new, w,
                                                     sinks=sinks, inv_freq=freqs) for w in (window, None))
        return out, xla, unwindowed

    args = (cache, q, k_new, v_new, None if layer is None else jnp.int32(layer))
    return [np.asarray(x, np.float32) for x in jax.jit(run).lower(*args).compile(FAST)(*args)]


def preset(name: str) -> KIVIConfig:
    return parse_cache_spec(name)


# (name, config, head_dim, batch, kv_heads, n_rep, max tokens in R-blocks, lengths as f(R, T), window, layer)
CASES = [
    ("k3v3-g32-d64", KIVIConfig(3, 3, 32, 64), 64, 3, 2, 3, 4, lambda r, t: [r - 5, 2 * r + 9, t - 3], None, 0),
    ("k3v2-g64-d128-window", KIVIConfig(3, 2, 64, 64), 128, 2, 1, 4, 4, lambda r, t: [t - 7, r + 3], 100, None),
    ("k2v3-g128-d64", KIVIConfig(2, 3, 128, 128), 64, 2, 2, 5, 3, lambda r, t: [t - 1, r + 77], None, 1),
    ("k3v4-g32-d128", KIVIConfig(3, 4, 32, 64), 128, 2, 1, 2, 4, lambda r, t: [3 * r + 17, 1], None, 0),
    ("k4v3-g64-d64-window", KIVIConfig(4, 3, 64, 64), 64, 3, 1, 3, 4, lambda r, t: [2 * r + 1, 45, t - 2], 30, 1),
    ("k2v4-s5-window", KIVIConfig(2, 4, 32, 64, sinks=5), 64, 4, 1, 2, 4, lambda r, t: [3, 5, r + 1, t - 20], 150,
     0),
    ("k2v2-s40", KIVIConfig(2, 2, 32, 64, sinks=40), 64, 3, 2, 1, 3, lambda r, t: [39, r + 41, t - 4], None, 1),
    ("k2v2-prerope-d64", KIVIConfig(2, 2, 32, 64, pre_rope=True), 64, 3, 1, 2, 4, lambda r, t: [2 * r + 11, r, 37],
     None, 1),
    ("k4v4-prerope-d128-window", KIVIConfig(4, 4, 32, 64, pre_rope=True), 128, 2, 2, 2, 4,
     lambda r, t: [t - 1, r + r // 2], 90, 0),
    ("kivi2+-window", preset("kivi2+"), 64, 4, 1, 3, 3, lambda r, t: [2, r + 17, 2 * r, t - 9], 200, 1),
    ("kivi2+", preset("kivi2+"), 64, 3, 3, 3, 3, lambda r, t: [4, t - 1, r + 65], None, None),
    ("kivi3+", preset("kivi3+"), 128, 3, 2, 2, 3, lambda r, t: [6, r - 1, t - 13], None, 0),
    ("kivi3+-window-s7", KIVIConfig(4, 3, 64, 128, pre_rope=True, sinks=7), 64, 2, 2, 4, 3,
     lambda r, t: [5, 2 * r + 50], 77, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_native_kernel_equals_the_xla_path(case):
    """3-bit codes, sinks (lengths below, at and past S; windows reaching into the sinks or not), pre-RoPE keys and
    the presets' configurations: the native kernel equals the XLA path within 1e-5 in float32."""
    name, kivi, head_dim, batch, kv_heads, n_rep, blocks, lengths, window, layer = case
    i = CASES.index(case)
    r = kivi.residual_length
    max_tokens = blocks * r
    cache = random_cache(kivi, batch, kv_heads, head_dim, max_tokens, lengths(r, max_tokens), jnp.float32,
                         seed=400 + i)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=500 + i)
    assert native.unsupported_kivi(q.dtype, head_dim, cache.k, cache.v, cache.k_ring.dtype, r,
                                   None if cache.k_sink is None else (cache.k_sink, cache.v_sink)) is None
    out, xla, unwindowed = native_and_xla(cache, q, k_new, v_new, layer, window)
    assert np.abs(out - xla).max() <= TOL, np.abs(out - xla).max()
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides
    if window is not None:
        assert np.abs(unwindowed - xla).max() > 10 * TOL  # the window changed the answer


def test_rotation_and_sinks_change_the_answer():
    """The kernel really rotates and really reads the sinks: the same codes read as post-RoPE keys, or with the
    sinks left out, give other outputs (so the equalities above are not vacuous)."""
    kivi = KIVIConfig(3, 2, 32, 64, pre_rope=True, sinks=4)
    cache = random_cache(kivi, 2, 1, 64, 192, [150, 70], jnp.float32, seed=9)
    q, k_new, v_new = random_step(2, 3, 1, 64, jnp.float32, seed=10)
    sinks = (cache.k_sink, cache.v_sink)
    run = jax.jit(lambda c, q, k, v, sinks, freqs: native.decode_kivi(q, c.k, c.v, 0, c.k_ring, c.v_ring, c.length,
                                                                      k, v, None, sinks, freqs))
    full = np.asarray(run(cache, q, k_new, v_new, sinks, inv_freq(64)))
    assert np.abs(full - np.asarray(run(cache, q, k_new, v_new, sinks, None))).max() > 1e-2
    assert np.abs(full - np.asarray(run(cache, q, k_new, v_new, None, inv_freq(64)))).max() > 1e-3


def test_dispatch_serves_the_presets_natively(monkeypatch):
    """`decode_kivi` with a forced or automatic native implementation takes the kernel for the presets (sinks and
    inverse frequencies passed on, no fallback warning)."""
    from kivi_jax.cache import KIVICache

    calls = []
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append(a) or jnp.zeros(a[0].shape, a[0].dtype))
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=64)
    for name in ("kivi2+", "kivi3+"):
        kivi = preset(name)
        cache = jax.eval_shape(lambda: KIVICache.create(cfg, kivi, 2, 256))
        q, k_new, v_new = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 1, 4, 64), (2, 1, 2, 64), (2, 1, 2, 64)))
        for impl in ("auto", "native"):
            calls.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                jax.eval_shape(lambda c, q, k, v: attention.decode_kivi(
                    impl, q, c.k, c.v, 1, c.k_ring, c.v_ring, c.length, k, v, None, (c.k_sink, c.v_sink),
                    inv_freq(64)), cache, q, k_new, v_new)
            assert len(calls) == 1
            sinks, freqs = calls[0][-2:]
            assert sinks[0].shape == (2, 2, 2, kivi.sinks, 64) and freqs.shape == (32,)


def test_generate_with_native_gives_the_xla_greedy_tokens_for_a_preset_like_spec(monkeypatch):
    """kivi2+'s options at a small ring (3-bit keys before RoPE, 4 sinks, rotated values; R = G = 32), a ragged
    batch crossing ring flushes (one prompt shorter than the sinks), GQA: greedy tokens equal the XLA path's."""
    calls = []
    real = native.decode_kivi
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(3, 128, n).tolist() for n in (3, 45)]
    kw = dict(max_new_tokens=40, cache="k3v2-g32-r32-prerope-s4-rotv", stop_at_eos=False)
    xla = kivi_jax.generate(params, prompts, attention_impl="xla", **kw).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback
        out = kivi_jax.generate(params, prompts, attention_impl="native", **kw).token_ids
    assert calls  # the kernel was traced into the decode step
    assert out == xla
    assert len(set(xla[1])) > 5  # not a degenerate repetition
