"""Non-uniform codebooks (`-nuqk`, `-nuqv`, in `kivi2.5`; kivi_jax/codebook.py): the grammar, the quantizer and its
calibration, attention over what a codebook cache stores against a dense reference (prefill, ragged chunks, decode),
stores bit-identical to one-token appends, bytes against the formula, and the kernels (native serves codebooks and
equals the XLA path; Pallas refuses them with a clear message, and `auto` falls back quietly)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention, codebook, native, quant
from kivi_jax.cache import KIVICache, kivi_cache_bytes, make_cache
from kivi_jax.config import ALIASES, KIVIConfig, bits_per_value, parse_cache_spec
from test_beyond_kivi import feed_through_attend
from test_kivi_cache import CFG, append_tokens, leaves_equal, random_kv

R, G = 32, 16


def test_specs_with_codebooks_parse_and_print_from_the_one_table():
    kivi = parse_cache_spec("k2v2-g64-r64-prerope-s4-rotv-nuqk-nuqv")
    assert (kivi.k_codebook, kivi.v_codebook, kivi.group_size, kivi.residual_length) == (True, True, 64, 64)
    assert kivi.spec == "k2v2-g64-r64-prerope-s4-rotv-nuqk-nuqv"
    assert parse_cache_spec("k2v2-nuqv-s4-g64-r64-prerope-rotv-nuqk") == kivi  # any order in, canonical order out
    assert kivi.levels("key") == codebook.LEVELS[("key", 2)] and parse_cache_spec("kivi2").levels("key") is None
    assert parse_cache_spec("kivi2.5").k_codebook or parse_cache_spec("kivi2.5").v_codebook
    for name, cfg in ALIASES.items():  # every preset's canonical name parses back to it
        assert parse_cache_spec(cfg.spec) == cfg, name
    with pytest.raises(ValueError, match="v_codebook given twice"):
        parse_cache_spec("k2v2-nuqv-nuqv")
    with pytest.raises(ValueError, match="no calibrated 8-bit key codebook; choose key bits in"):
        parse_cache_spec("k8v2-nuqk")
    with pytest.raises(ValueError, match="no calibrated 8-bit value codebook"):
        parse_cache_spec("k2v2-nuqv-l2k4v8")  # the first layers' bits need a codebook too


def test_codes_take_the_nearest_level_and_come_back_as_it():
    levels = (0.4, 1.2, 1.8, 2.6)
    x = jnp.asarray(np.random.RandomState(0).randn(5, 64, 8).astype(np.float32))
    codes, scale, mn = quant.quantize(x, 2, 16, axis=1, levels=levels)
    u = (np.asarray(x).reshape(5, 4, 16, 8) - np.asarray(mn, np.float32)[:, :, None]) / np.asarray(
        scale, np.float32)[:, :, None]
    nearest = np.abs(u[..., None] - np.asarray(levels)).argmin(-1).reshape(5, 64, 8)
    np.testing.assert_array_equal(np.asarray(codes), nearest)
    back = quant.dequantize(codes, scale, mn, 16, axis=1, levels=levels)
    expect = np.asarray(levels, np.float32)[nearest] * np.repeat(np.asarray(scale, np.float32), 16, 1) + np.repeat(
        np.asarray(mn, np.float32), 16, 1)
    np.testing.assert_allclose(np.asarray(back), expect, rtol=1e-6, atol=1e-6)
    # the uniform grid as a codebook is the uniform quantizer (no ties in random data)
    uniform = quant.quantize(x, 2, 16, axis=1)
    np.testing.assert_array_equal(np.asarray(quant.quantize(x, 2, 16, axis=1, levels=(0, 1, 2, 3))[0]),
                                  np.asarray(uniform[0]))
    # on bell-shaped data Lloyd-Max-like levels cost less squared error than the uniform grid
    err = lambda y: float(jnp.mean((y - x) ** 2))
    assert err(back) < 0.85 * err(quant.dequantize(*uniform, 16, axis=1))
    with pytest.raises(ValueError, match="needs 4 strictly ascending levels"):
        quant.quantize(x, 2, 16, axis=1, levels=(0, 2, 1, 3))


def test_lloyd_max_finds_the_known_levels():
    u = np.linspace(0, 3, 300001)  # uniform density on [0, 3]: four cells of 0.75, levels at their centres
    lv = codebook.lloyd_max(codebook.histogram(u, np.ones_like(u), 2), 2)
    np.testing.assert_allclose(lv, (0.375, 1.125, 1.875, 2.625), atol=2e-3)
    # two clusters of weight: the levels near each take its mean; weights count
    u = np.array([0.2, 0.3, 2.9, 2.95])
    lv = codebook.lloyd_max(codebook.histogram(u, np.array([1.0, 3.0, 1.0, 1.0]), 2), 2)
    assert abs(lv[0] - 0.275) < 2e-3 and abs(lv[3] - 2.925) < 2e-3
    assert all(0 <= a < b <= 3 for a, b in zip(lv, lv[1:]))
    # the weighted error it minimizes: Lloyd-Max's levels beat the uniform grid on the uniform density's histogram
    hist = codebook.histogram(np.linspace(0, 3, 300001), np.ones(300001), 2)
    assert codebook.weighted_error(hist, codebook.lloyd_max(hist, 2), 2) < 0.6 * codebook.weighted_error(hist, None, 2)
    # the shipped table is a set of valid codebooks
    for (role, bits), levels in codebook.LEVELS.items():
        assert quant.check_levels(levels, bits) == levels and 0 <= levels[0] and levels[-1] <= 2**bits - 1


CONFIGS = {  # codebooks alone, together, with the preset's other options, with 3-bit keys on the first layer
    "nuqk": KIVIConfig(2, 2, G, R, k_codebook=True),
    "nuqv-prerope-s4": KIVIConfig(2, 2, G, R, pre_rope=True, sinks=4, v_codebook=True),
    "nuqkv-prerope-s5": KIVIConfig(2, 2, G, R, pre_rope=True, sinks=5, k_codebook=True, v_codebook=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_equals_a_dense_reference_of_what_is_stored(name):
    """Prefill, ragged chunks across ring flushes and block edges, then decode steps: every layer's answer equals
    a dense reference that dequantizes through the codebook (a table lookup) within 1e-5."""
    cache = KIVICache.create(CFG, CONFIGS[name], 2, 5 * R)
    cache, _ = feed_through_attend(cache, [[37, 9], [0, 30], [5, 40]] + [[1, 1]] * 2, seed=3)
    assert cache.length.tolist() == [44, 81]


def test_stores_are_bit_identical_to_one_token_appends_and_really_non_uniform():
    kivi = CONFIGS["nuqkv-prerope-s5"]
    batch, n_max = 2, 2 * R + 9
    lengths = np.array([R + 3, 2 * R + 9])
    k, v = random_kv(31, batch, n_max)
    one_by_one = KIVICache.create(CFG, kivi, batch, 3 * R)
    for t in range(n_max):
        one_by_one = append_tokens(one_by_one, k[:, :, :, t : t + 1], v[:, :, :, t : t + 1],
                                   jnp.asarray((t < lengths).astype(np.int32)))
    chunked = KIVICache.create(CFG, kivi, batch, 3 * R)
    for lo, hi in ((0, 11), (11, 50), (50, n_max)):  # chunks crossing the ring's flush at R and 2R
        counts = np.clip(lengths - lo, 0, hi - lo)
        chunked = append_tokens(chunked, k[:, :, :, lo:hi], v[:, :, :, lo:hi], jnp.asarray(counts, jnp.int32))
    leaves_equal(chunked, one_by_one)
    # the same tokens under uniform codes store other codes: the codebook is in force
    uniform = append_tokens(KIVICache.create(CFG, KIVIConfig(2, 2, G, R, pre_rope=True, sinks=5), batch, 3 * R),
                            k, v, jnp.asarray(lengths, jnp.int32))
    assert (np.asarray(uniform.k.codes) != np.asarray(one_by_one.k.codes)).mean() > 0.05
    assert (np.asarray(uniform.v.codes) != np.asarray(one_by_one.v.codes)).mean() > 0.05
    np.testing.assert_array_equal(np.asarray(uniform.k.scale), np.asarray(one_by_one.k.scale))  # same groups


@pytest.mark.parametrize("spec", ["k2v2-g16-r32-nuqk-nuqv", "kivi2.5"])
def test_bytes_equal_the_formula(spec):
    kivi = parse_cache_spec(spec)
    cfg = CFG if kivi.group_size <= CFG.head_dim else dataclasses.replace(CFG, head_dim=64)
    cfg = dataclasses.replace(cfg, num_layers=max(cfg.num_layers, kivi.first_layers + 1))  # kivi2.5's first layers
    cache = make_cache(kivi, cfg, 2, 2 * kivi.residual_length)
    assert cache.nbytes == kivi_cache_bytes(cfg, kivi, 2, 2 * kivi.residual_length, 4)["total"]
    # a codebook costs no bytes in the cache: the levels live in the spec
    plain = parse_cache_spec(spec.replace("-nuqk", "").replace("-nuqv", "")) if "-nuq" in spec else None
    if plain is not None:
        assert make_cache(plain, cfg, 2, 2 * kivi.residual_length).nbytes == cache.nbytes
        assert bits_per_value(plain, cfg.head_dim) == bits_per_value(kivi, cfg.head_dim)


def _decode_case(kivi, head_dim=64, lengths=(70, 201), seed=5):
    from test_pallas_kivi import random_cache, random_step

    cache = random_cache(kivi, 2, 2, head_dim, 4 * kivi.residual_length, list(lengths), jnp.float32, seed=seed)
    return (cache,) + random_step(2, 6, 2, head_dim, jnp.float32, seed=seed + 1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on the CPU backend")
@pytest.mark.parametrize("spec, head_dim, window", [("k2v2-g64-r64-prerope-s4-nuqk-nuqv", 64, None),
                                                     ("k3v2-g32-r64-nuqv", 128, 50), ("k2v3-g32-r64-s3-nuqk", 64, None)])
def test_the_native_kernel_serves_codebooks_and_equals_the_xla_path(spec, head_dim, window):
    from test_native_beyond import native_and_xla

    if not native.available():
        pytest.fail(f"the native kernels did not build here: {native.error()}")
    kivi = parse_cache_spec(spec)
    cache, q, k_new, v_new = _decode_case(kivi, head_dim)
    assert native.unsupported_kivi(q.dtype, head_dim, cache.k, cache.v, cache.k_ring.dtype, kivi.residual_length,
                                   None if cache.k_sink is None else (cache.k_sink, cache.v_sink)) is None
    out, xla, _ = native_and_xla(cache, q, k_new, v_new, 1, window)
    assert np.abs(out - xla).max() <= 1e-5, np.abs(out - xla).max()
    assert np.abs(xla).max() > 0.1


def test_pallas_refuses_codebooks_and_auto_falls_back_quietly():
    from kivi_jax.pallas_kernels import kivi_decode

    assert "non-uniform codebooks" in kivi_decode.unsupported(64, 2, 2, 64, 64, codebook=True)
    assert kivi_decode.unsupported(64, 2, 2, 64, 64) is None  # the same shape without a codebook is served
    kivi = parse_cache_spec("k2v2-g64-r64-nuqv")
    cache, q, k_new, v_new = _decode_case(kivi)
    c = cache
    run = lambda impl: attention.decode_kivi(impl, q, c.k, c.v, 0, c.k_ring, c.v_ring, c.length, k_new, v_new, None)
    xla = np.asarray(run("xla"))
    with pytest.warns(UserWarning, match="codebook levels.*using the XLA path"):
        forced = np.asarray(run("pallas"))
    np.testing.assert_array_equal(forced, xla)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto: no warning whatever kernel it takes
        assert np.abs(np.asarray(run("auto")) - xla).max() <= 1e-5


@pytest.mark.real_model
def test_real_model_kivi25_through_native_and_its_codebooks_on_real_activations(smollm2):
    """SmolLM2 with kivi2.5: the native kernel gives the XLA path's greedy tokens; on real keys (before RoPE) and
    rotated values of text the calibration never saw (the evaluation split's first window), the shipped codebooks
    quantize with less error than the uniform grid in the same bytes (keys: weighted by the attention each token
    receives, as calibrated)."""
    import kivi_jax
    from kivi_jax import evaluate, rotation

    text = evaluate.default_text()
    kw = dict(max_new_tokens=24, cache="kivi2.5", stop_at_eos=False)
    prompts = [text[:1500], text[:400]]  # about 300 and 80 tokens: flushed blocks, ring and sinks in view
    xla = kivi_jax.generate(smollm2, prompts, attention_impl="xla", **kw).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kivi_jax.generate(smollm2, prompts, attention_impl="native", **kw).token_ids == xla
    kivi = parse_cache_spec("kivi2.5")
    tokens = evaluate.make_windows(evaluate.tokenize(smollm2.tokenizer, text), 512, 256, 4, "eval")[:1, :256]
    acts = evaluate.capture_qkv(rotation.rotate_values(smollm2.params), jnp.asarray(tokens))
    hists = codebook.histograms(acts, (2,), kivi.group_size, kivi.group_size, kivi.sinks)
    for role in ("key", "value"):
        err = {name: codebook.weighted_error(hists[(role, 2)], lv, 2) for name, lv in (("codebook", kivi.levels(role)),
                                                                                       ("uniform", None))}
        assert err["codebook"] < 0.9 * err["uniform"], (role, err)
