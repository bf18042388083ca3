"""The native CPU decode kernels (C++, XLA FFI) equal their jnp twins (the XLA path, and the Pallas kernel's
`reference`) on random caches: every shipped bits / group / head_dim combination, ragged lengths that are not
multiples of any block, GQA row blocks, sliding windows, scale dtypes, one-layer arrays. `generate` through them gives
the XLA path's greedy tokens; with the build forced to fail, generation still works and warns once.

The library is built once (cached under the kivi_jax cache directory, keyed by source, flags, jaxlib and CPU), so the
whole session pays for at most one compile."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import attention, native
from kivi_jax.config import KIVIConfig
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params
from kivi_jax.native import build
from kivi_jax.pallas_kernels import kivi_decode

from test_pallas_kivi import random_cache, random_step

TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on the CPU backend")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not native.available():
        pytest.fail(f"the native kernels did not build here: {native.error()}")


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST)


def native_and_twins(cache, q, k_new, v_new, layer, window, with_reference=False, int8_dots=False):
    """(native kernel, XLA path[, Pallas twin]) as float32 numpy arrays, one compilation; `layer=None` passes arrays
    holding layer 0 only; `int8_dots` for the kernel and the XLA path."""
    kv = cache.config
    if layer is None:
        cut = lambda s: s.replace(codes=s.codes[0], scale=s.scale[0], mn=s.mn[0])
        cache = cache.replace(k=cut(cache.k), v=cut(cache.v), k_ring=cache.k_ring[0], v_ring=cache.v_ring[0])

    def run(cache, q, k_new, v_new, layer):
        c = cache
        out = native.decode_kivi(q, c.k, c.v, layer, c.k_ring, c.v_ring, c.length, k_new, v_new, window,
                                 int8_dots=int8_dots)
        rings = (c.k_ring, c.v_ring) if layer is None else (c.k_ring[layer], c.v_ring[layer])
        xla = attention.decode_kivi_xla(q, c.k, c.v, layer, *rings, c.length, k_new, v_new, window,
                                        int8_dots=int8_dots)
        if not with_reference:
            return out, xla
        twin = kivi_decode.reference(q, c.k.codes, c.k.scale, c.k.mn, c.v.codes, c.v.scale, c.v.mn, c.k_ring,
                                     c.v_ring, layer, c.length, k_new, v_new, k_bits=kv.k_bits, v_bits=kv.v_bits,
                                     group_size=kv.group_size, window=window)
        return out, xla, twin

    args = (cache, q, k_new, v_new, None if layer is None else jnp.int32(layer))
    return [np.asarray(x, np.float32) for x in compiled(run, *args)(*args)]


# (k_bits, v_bits, group_size, head_dim): every combination the kernel ships (G=128 with head_dim 64: values are
# grouped over all 64 channels)
SHIPPED = [(kb, vb, g, d) for kb in (2, 4) for vb in (2, 4) for d in (64, 128) for g in (32, 64, 128)]

# (batch, kv_heads, n_rep, max_tokens in R-blocks, lengths as f(R, T)): empty, ring-only, at a flush, between flushes,
# near full; n_rep 5 and 8 take two query-row blocks.
SHAPES = [
    (3, 2, 3, 4, lambda r, t: [r - 5, 2 * r, t - 3]),
    (2, 1, 8, 3, lambda r, t: [r + r // 2 + 7, 0]),
    (1, 3, 1, 5, lambda r, t: [t - 1]),
    (4, 1, 2, 3, lambda r, t: [1, r, 2 * r - 1, t - r // 2 - 1]),
    (2, 2, 5, 4, lambda r, t: [3 * r + 17, 2 * r + 1]),
    (2, 1, 4, 3, lambda r, t: [r + 1, t - 2]),
]


@pytest.mark.parametrize("case", range(len(SHIPPED)), ids=[f"k{kb}v{vb}-g{g}-d{d}" for kb, vb, g, d in SHIPPED])
def test_kivi_kernel_equals_the_xla_path_for_every_shipped_combination(case):
    k_bits, v_bits, g, head_dim = SHIPPED[case]
    batch, kv_heads, n_rep, blocks, lengths = SHAPES[case % len(SHAPES)]
    residual = max(g, 64)
    max_tokens = blocks * residual
    cache = random_cache(KIVIConfig(k_bits, v_bits, g, residual), batch, kv_heads, head_dim, max_tokens,
                         lengths(residual, max_tokens), jnp.float32, seed=case)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=100 + case)
    layer = (0, 1, None)[case % 3]
    out, xla, *twin = native_and_twins(cache, q, k_new, v_new, layer, None, with_reference=case % 4 == 0 and g <= head_dim)  # the twin groups values by G
    assert np.abs(out - xla).max() <= TOL
    if twin:
        assert np.abs(out - twin[0]).max() <= TOL
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides


Q8_SHIPPED = [(kb, vb, g, d) for kb, vb, g, d in SHIPPED if 2 in (kb, vb)]


@pytest.mark.parametrize("case", range(len(Q8_SHIPPED)), ids=[f"k{kb}v{vb}-g{g}-d{d}" for kb, vb, g, d in Q8_SHIPPED])
def test_int8_dots_equal_their_xla_twin(case):
    """The integer mode (2-bit keys against an int8 query, 2-bit values with 8-bit weights): the kernel equals
    `decode_kivi_xla(..., int8_dots=True)` at every shipped combination with a 2-bit side, ragged lengths, windows
    into the quantized tokens; the rounding moves the output more than float error, less than a tenth of its range
    (the cost in quality is measured through the model, docs/benchmarks.md)."""
    if not native.int8_dots():
        pytest.skip("this build has no integer mode (it needs AVX-512 BW and VBMI)")
    k_bits, v_bits, g, head_dim = Q8_SHIPPED[case]
    batch, kv_heads, n_rep, blocks, lengths = SHAPES[case % len(SHAPES)]
    residual = max(g, 64)
    max_tokens = blocks * residual
    cache = random_cache(KIVIConfig(k_bits, v_bits, g, residual), batch, kv_heads, head_dim, max_tokens,
                         lengths(residual, max_tokens), jnp.float32, seed=case)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=100 + case)
    layer = (0, 1, None)[case % 3]
    window = (None, 2 * residual - 3, g + 5)[case % 3]
    out, xla = native_and_twins(cache, q, k_new, v_new, layer, window, int8_dots=True)
    exact, _ = native_and_twins(cache, q, k_new, v_new, layer, window)
    assert np.abs(out - xla).max() <= TOL
    quantized = np.asarray(cache.length) > residual  # rows with quantized tokens: the rounding shows there
    if quantized.any():
        moved = np.abs(out - exact)[quantized].max()
        assert 10 * TOL < moved < 0.1 * np.abs(exact).max()
    assert np.abs(xla).max() > 0.1


@pytest.mark.parametrize("window, kivi", [(150, KIVIConfig(2, 4, 32, 64)), (50, KIVIConfig(4, 2, 64, 128)),
                                          (20, KIVIConfig(2, 2, 32, 64))])
def test_sliding_window_is_masked_like_the_xla_path(window, kivi):
    """Windows reaching into the quantized tokens, shorter than the ring, and shorter than one key group."""
    r = kivi.residual_length
    lengths = [30, r, r + 77, 3 * r - 6, 4 * r - 1]
    cache = random_cache(kivi, len(lengths), 2, 64, 4 * r, lengths, jnp.float32, seed=window)
    q, k_new, v_new = random_step(len(lengths), 6, 2, 64, jnp.float32, seed=window + 1)
    out, xla = native_and_twins(cache, q, k_new, v_new, 1, window)
    _, unwindowed = native_and_twins(cache, q, k_new, v_new, 1, None)
    assert np.abs(out - xla).max() <= TOL
    assert np.abs(unwindowed - xla).max() > 10 * TOL  # the window changed the answer


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_scale_dtypes(scale_dtype):
    kivi = KIVIConfig(2, 2, 32, 64, scale_dtype=scale_dtype)
    cache = random_cache(kivi, 2, 1, 64, 256, [200, 77], jnp.float32, seed=7)
    q, k_new, v_new = random_step(2, 3, 1, 64, jnp.float32, seed=8)
    out, xla = native_and_twins(cache, q, k_new, v_new, 0, None)
    assert np.abs(out - xla).max() <= TOL


@pytest.mark.parametrize("head_dim, n_rep, window", [(64, 3, None), (128, 1, 100), (64, 8, 37), (128, 5, None)])
def test_full_kernel_equals_the_xla_path(head_dim, n_rep, window):
    rng = np.random.RandomState(head_dim + n_rep)
    layers, batch, kv_heads, tokens = 2, 3, 2, 320
    lengths = jnp.asarray([0, 67, 319], jnp.int32)
    k = jnp.asarray(rng.randn(layers, batch, kv_heads, tokens, head_dim), jnp.float32)
    v = jnp.asarray(rng.randn(layers, batch, kv_heads, tokens, head_dim), jnp.float32)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=n_rep)

    def run(k, v, q, k_new, v_new, layer):
        return (native.decode_full(q, k, v, layer, lengths, k_new, v_new, window),
                attention.decode_full_xla(q, k, v, layer, lengths, k_new, v_new, window),
                native.decode_full(q, k[1], v[1], None, lengths, k_new, v_new, window))

    args = (k, v, q, k_new, v_new, jnp.int32(1))
    out, xla, one_layer = (np.asarray(x) for x in compiled(run, *args)(*args))
    assert np.abs(out - xla).max() <= TOL
    assert np.abs(one_layer - xla).max() <= TOL


def test_dispatch_takes_native_on_cpu_and_falls_back_explicitly(monkeypatch):
    """Which implementation `auto` and a forced `native` trace; unserved configurations warn only when forced."""
    from kivi_jax.cache import KIVICache

    calls = []
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append(1) or jnp.zeros(a[0].shape, a[0].dtype))
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=64)
    for kivi, served in ((KIVIConfig(2, 2, 32, 64), True), (KIVIConfig(2, 2, 32, 64, "token", "channel"), False),
                         (KIVIConfig(8, 2, 32, 64), False), (KIVIConfig(2, 2, 16, 64), False)):
        cache = jax.eval_shape(lambda: KIVICache.create(cfg, kivi, 2, 128))
        q, k_new, v_new = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 1, 4, 64), (2, 1, 2, 64), (2, 1, 2, 64)))
        for impl in ("auto", "native"):
            calls.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                jax.eval_shape(lambda c, q, k, v: attention.decode_kivi(impl, q, c.k, c.v, 1, c.k_ring, c.v_ring,
                                                                        c.length, k, v, None), cache, q, k_new, v_new)
            assert bool(calls) == served
            assert any("using the XLA path" in str(w.message) for w in caught) == (impl == "native" and not served)
    assert attention.use_native("native") and not attention.use_native("xla") and not attention.use_native("pallas")
    assert attention.use_native("auto") and attention.use_native("auto", full=True) == native.FULL_AUTO


def test_the_build_is_cached(monkeypatch):
    """A second build finds the library by its key and compiles nothing."""
    monkeypatch.setattr(build, "compile_library", lambda *a: pytest.fail("compiled again"))
    path = build.build()
    assert path.exists() and path.parent == build.cache_dir()
    assert path.name.startswith("decode_cpu-") and build.library_path(build.compiler(), build.BASE_FLAGS) != path


HEAD64 = {  # tiny random models with the kernel's head_dim: GQA n_rep 2, and Mistral's window (n_rep 4, window > R)
    "llama_gqa64": LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=64),
    "mistral_window64": LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2,
                                    num_heads=4, num_kv_heads=1, head_dim=64, sliding_window=50),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEAD64))
def test_generate_with_native_gives_the_xla_greedy_tokens(name, monkeypatch):
    """A ragged batch crossing ring flushes (quantized, flushed-key and ring tokens all in view), KIVI and full."""
    calls = []
    real_kivi, real_full = native.decode_kivi, native.decode_full
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append("kivi") or real_kivi(*a, **k))
    monkeypatch.setattr(native, "decode_full", lambda *a, **k: calls.append("full") or real_full(*a, **k))
    params = init_params(HEAD64[name], jax.random.PRNGKey(1), std=0.2)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(3, 128, n).tolist() for n in (5, 45)]
    for spec in ("k2v4-g32-r32", "full"):
        kw = dict(max_new_tokens=40, cache=spec, stop_at_eos=False)
        xla = kivi_jax.generate(params, prompts, attention_impl="xla", **kw).token_ids
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent fallback
            out = kivi_jax.generate(params, prompts, attention_impl="native", **kw).token_ids
        assert out == xla
        assert len(set(xla[0])) > 5  # not a degenerate repetition
    assert "kivi" in calls and "full" in calls  # both kernels were traced into the decode steps


@pytest.mark.slow
def test_native_int8_runs_the_integer_mode_through_the_model(monkeypatch):
    """`attention_impl="native-int8"` asks the KIVI kernel for its integer mode in every decode step; a build without
    it says so once a trace and gives the float kernel's tokens exactly."""
    flags = []
    real_kivi = native.decode_kivi
    monkeypatch.setattr(native, "decode_kivi",
                        lambda *a, **k: flags.append(k.get("int8_dots")) or real_kivi(*a, **k))
    params = init_params(HEAD64["llama_gqa64"], jax.random.PRNGKey(1), std=0.2)
    prompts = [np.random.RandomState(3).randint(3, 128, n).tolist() for n in (7, 70)]
    kw = dict(max_new_tokens=40, cache="k2v2-g32-r32", stop_at_eos=False)
    float_tokens = kivi_jax.generate(params, prompts, attention_impl="native", **kw).token_ids
    assert flags and not any(flags)
    flags.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        int8_tokens = kivi_jax.generate(params, prompts, attention_impl="native-int8", **kw).token_ids
    assert flags and all(flags) == native.int8_dots()
    assert any("no integer mode" in str(w.message) for w in caught) == (not native.int8_dots())  # served, or said
    assert [len(t) for t in int8_tokens] == [len(t) for t in float_tokens]
    flags.clear()
    monkeypatch.setattr(native, "int8_dots", lambda: False)
    jax.clear_caches()  # trace the decode step again, under the build without the integer mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = kivi_jax.generate(params, prompts, attention_impl="native-int8", **kw).token_ids
    assert flags and not any(flags)
    assert fallback == float_tokens
    assert any("no integer mode" in str(w.message) for w in caught)


def test_tiny_models_with_other_head_dims_fall_back_to_the_xla_tokens(tiny_dirs):
    """conftest's tiny models have head_dim 16, which the kernel does not serve: forced `native` says so and runs
    the XLA path."""
    path, _ = tiny_dirs["llama_gqa_llama3"]
    model = kivi_jax.load(str(path))
    kw = dict(max_new_tokens=12, cache="kivi2", stop_at_eos=False)
    xla = kivi_jax.generate(model, [[5, 6, 7, 8]], attention_impl="xla", **kw).token_ids
    with pytest.warns(UserWarning, match="head_dim"):
        out = kivi_jax.generate(model, [[5, 6, 7, 8]], attention_impl="native", **kw).token_ids
    assert out == xla


FALLBACK_SCRIPT = r"""
import json, warnings
import jax, numpy as np
import kivi_jax
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params
cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=64)
params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
kw = dict(max_new_tokens=6, stop_at_eos=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    runs = {f"{impl}-{spec}": kivi_jax.generate(params, [[3, 4, 5]], attention_impl=impl, cache=spec, **kw).token_ids
            for impl, spec in (("auto", "kivi2"), ("native", "kivi2"), ("xla", "kivi2"), ("auto", "full"), ("xla", "full"))}
    # quantized weights take the native matmul when it built: without it, the XLA path's tokens
    from kivi_jax import weights
    quantized = weights.convert_params(params, "int4-g64")
    for impl in ("auto", "xla"):
        runs[f"weights-{impl}"] = kivi_jax.generate(weights.with_impl(quantized, impl), [[3, 4, 5]], cache="kivi2",
                                                    **kw).token_ids
msgs = [str(w.message) for w in caught if "native CPU kernels unavailable" in str(w.message)]
print(json.dumps({"runs": runs, "warnings": msgs}))
"""


@pytest.mark.slow
def test_a_failing_build_falls_back_to_the_xla_path_with_one_warning(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "KIVI_JAX_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           # seven generate runs of tiny programs: compiling is the cost, LLVM at -O0 (as FAST) halves it
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}
    res = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "no-such-compiler" in got["warnings"][0] and "XLA path" in got["warnings"][0]
    runs = got["runs"]
    assert runs["auto-kivi2"] == runs["native-kivi2"] == runs["xla-kivi2"]
    assert runs["auto-full"] == runs["xla-full"]
    assert runs["weights-auto"] == runs["weights-xla"]
    assert not any((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind


@pytest.mark.real_model
def test_real_model_generates_the_xla_greedy_tokens_through_native(smollm2):
    from pydoc_data.topics import topics

    model = smollm2
    text = topics["assignment"][:1500]  # about 300 tokens: quantized, flushed, ring and sink tokens in view
    # kivi2+: 3-bit keys, pre-RoPE, sinks, rotated values, the most the kernel reads (kivi3+'s 4-bit keys and 3-bit
    # values: tests/test_native_beyond.py; kivi2 and the full-precision kernel against the XLA path on tiny models with
    # SmolLM2's head_dim, above)
    for spec in ("kivi2+",):
        kw = dict(max_new_tokens=32, cache=spec, stop_at_eos=False)
        xla = kivi_jax.generate(model, [text, text[:400]], attention_impl="xla", **kw).token_ids
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = kivi_jax.generate(model, [text, text[:400]], attention_impl="native", **kw).token_ids
        assert out == xla
