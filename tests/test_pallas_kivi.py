"""The KIVI decode kernel in interpret mode equals its jnp twin and the XLA path on random caches (every shipped
bits / group / head_dim combination, ragged lengths, windows, several split counts), and `generate` with it gives
the XLA path's greedy tokens."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import attention
from kivi_jax.cache import KIVICache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import kivi_decode

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
FAST = {"xla_backend_optimization_level": 0}
CFG_64 = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64)  # interpret mode compiles slowly; codegen speed does not matter here


def compiled(fn, *args):
    """`fn` jit-compiled for `args` with cheap XLA optimization (compile time dominates these tests)."""
    return jax.jit(fn).lower(*args).compile(FAST)


def random_cache(kivi: KIVIConfig, batch, kv_heads, head_dim, max_tokens, lengths, dtype, seed, layers=2):
    """A KIVI cache filled (as if token by token) with random keys (a few outlier channels, like real keys) and
    values: `lengths [batch]` tokens a sequence, every layer different."""
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=layers, num_heads=kv_heads,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    rng = np.random.RandomState(seed)
    shape = (layers, batch, kv_heads, max_tokens, head_dim)
    k = rng.randn(*shape).astype(np.float32)
    k[..., [3, head_dim // 2 + 1]] *= 8.0
    v = rng.randn(*shape).astype(np.float32)
    num_new = jnp.asarray(lengths, jnp.int32)
    keep = (np.arange(max_tokens)[None, :] < np.asarray(lengths)[:, None])[None, :, None, :, None]
    k, v = jnp.asarray(np.where(keep, k, 0), dtype), jnp.asarray(np.where(keep, v, 0), dtype)
    cache = KIVICache.create(cfg, kivi, batch, max_tokens, dtype)

    @jax.jit
    def fill(cache, k, v):
        ups = [cache.append_update(cache.k_ring[l], cache.v_ring[l], k[l], v[l], num_new) for l in range(layers)]
        return cache.commit(jax.tree_util.tree_map(lambda *x: jnp.stack(x), *ups), num_new)

    return fill(cache, k, v)


def random_step(batch, q_heads, kv_heads, head_dim, dtype, seed):
    """The new token's query, key and value."""
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(batch, 1, q_heads, head_dim), dtype)
    k_new = jnp.asarray(rng.randn(batch, 1, kv_heads, head_dim), dtype)
    v_new = jnp.asarray(rng.randn(batch, 1, kv_heads, head_dim), dtype)
    return q, k_new, v_new


def one_layer(cache, layer: int):
    """The cache's stores, rings and sinks cut to one layer (the `layer=None` form of the decode functions)."""
    cut = lambda store: store.replace(codes=store.codes[layer], scale=store.scale[layer], mn=store.mn[layer])
    sinks = {} if cache.k_sink is None else dict(k_sink=cache.k_sink[layer], v_sink=cache.v_sink[layer])
    return cache.replace(k=cut(cache.k), v=cut(cache.v), k_ring=cache.k_ring[layer], v_ring=cache.v_ring[layer],
                         **sinks)


def inv_freq(head_dim: int) -> jax.Array:
    """RoPE's inverse frequencies `[head_dim // 2]` (theta 10000), as a pre-RoPE cache's attention gets them."""
    return 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def three_ways(cache, q, k_new, v_new, layer, window, num_splits=None, tokens_per_step=None):
    """(kernel in interpret mode, jnp twin, XLA path, XLA path without the window) outputs as float32 numpy arrays,
    one compilation. `layer=None` passes arrays that hold that one layer (layer 0). A pre-RoPE cache
    (`config.pre_rope`) is read with RoPE's inverse frequencies; a cache with sinks with its sinks."""
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
        kernel = kivi_decode.decode(*args, **kw, num_splits=num_splits, interpret=True,
                                    tokens_per_step=tokens_per_step or kivi_decode.TOKENS_PER_STEP)
        twin = kivi_decode.reference(*args, **kw)
        pick = (lambda x: x) if layer is None else (lambda x: x[layer])
        rings = pick(cache.k_ring), pick(cache.v_ring)
        sinks = None if cache.k_sink is None else (pick(cache.k_sink), pick(cache.v_sink))
        xla, unwindowed = (attention.decode_kivi_xla(q, cache.k, cache.v, layer, *rings, cache.length, k_new, v_new,
                                                     w, sinks=sinks, inv_freq=freqs) for w in (window, None))
        return kernel, twin, xla, unwindowed

    args = (cache, q, k_new, v_new, None if layer is None else jnp.int32(layer))
    return [np.asarray(x, np.float32) for x in compiled(run, *args)(*args)]


# (k_bits, v_bits, group_size, head_dim): every combination the kernel ships (tests/test_pallas_lowering.py lowers
# every one of them to Triton in both dtypes)
SHIPPED = [(kb, vb, g, d) for kb in (2, 4) for vb in (2, 4) for d in (64, 128) for g in (32, 64, 128) if g <= d]
# Interpret mode compiles slowly (about 8 s a case), so it runs a covering subset: every (group, head_dim) pair twice,
# with the four (key bits, value bits) pairs in turn, so each pair meets at least two of the (group, head_dim) pairs.
BITS = [(2, 2), (2, 4), (4, 2), (4, 4)]
SHAPED = sorted({(g, d) for _, _, g, d in SHIPPED}, key=lambda gd: (gd[1], gd[0]))
INTERPRETED = [(*BITS[(2 * i + j) % 4], g, d) for i, (g, d) in enumerate(SHAPED) for j in (0, 1)]
assert set(INTERPRETED) <= set(SHIPPED) and {c[:2] for c in INTERPRETED} == set(BITS)

# Shapes cycled through the combinations: (batch, kv_heads, n_rep, max_tokens in R-blocks, lengths as f(R, T)).
# Lengths: empty, ring-only, exactly at a flush, between flushes, near full; none a multiple of a step.
SHAPES = [
    (3, 2, 3, 4, lambda r, t: [r - 5, 2 * r, t - 3]),
    (2, 1, 8, 3, lambda r, t: [r + r // 2 + 7, 0]),
    (1, 3, 1, 4, lambda r, t: [t - 1]),
    (4, 1, 2, 3, lambda r, t: [1, r, 2 * r - 1, t - r // 2 - 1]),
]


@pytest.mark.parametrize("case", range(len(INTERPRETED)),
                         ids=[f"k{kb}v{vb}-g{g}-d{d}" for kb, vb, g, d in INTERPRETED])
def test_float32_kernel_equals_twin_and_xla_on_a_covering_set_of_shipped_combinations(case):
    k_bits, v_bits, g, head_dim = INTERPRETED[case]
    batch, kv_heads, n_rep, blocks, lengths = SHAPES[case % len(SHAPES)]
    residual = max(g, 64)
    max_tokens = blocks * residual
    cache = random_cache(KIVIConfig(k_bits, v_bits, g, residual), batch, kv_heads, head_dim, max_tokens,
                         lengths(residual, max_tokens), jnp.float32, seed=case)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.float32, seed=100 + case)
    layer = (0, 1, None)[case % 3]  # stacked layers read in place, or arrays holding one layer
    kernel, twin, xla, _ = three_ways(cache, q, k_new, v_new, layer=layer, window=None,
                                   num_splits=(None, 3)[case % 2], tokens_per_step=(g, 64)[case % 2])
    assert np.abs(kernel - twin).max() <= TOL[jnp.float32]
    assert np.abs(kernel - xla).max() <= TOL[jnp.float32]
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides


# bfloat16 compute dtype (q, rings, new token; scales stay float16): a subset in which every key bits, value bits,
# group size and head_dim appears (the Triton lowering test covers the whole matrix in both dtypes).
BF16 = [(2, 4, 32, 64), (4, 2, 64, 128), (2, 2, 128, 128)]


@pytest.mark.parametrize("combo", BF16, ids=[f"k{kb}v{vb}-g{g}-d{d}" for kb, vb, g, d in BF16])
def test_bfloat16_kernel_equals_twin_and_xla(combo):
    k_bits, v_bits, g, head_dim = combo
    i = BF16.index(combo)
    batch, kv_heads, n_rep, blocks, lengths = SHAPES[i % len(SHAPES)]
    residual = max(g, 64)
    max_tokens = blocks * residual
    cache = random_cache(KIVIConfig(k_bits, v_bits, g, residual), batch, kv_heads, head_dim, max_tokens,
                         lengths(residual, max_tokens), jnp.bfloat16, seed=50 + i)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, jnp.bfloat16, seed=150 + i)
    kernel, twin, xla, _ = three_ways(cache, q, k_new, v_new, layer=1, window=None)
    assert np.abs(kernel - twin).max() <= TOL[jnp.bfloat16]
    assert np.abs(kernel - xla).max() <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("dtype, window", [(jnp.float32, 150), (jnp.bfloat16, 50)])
def test_sliding_window_is_masked_like_the_xla_path(dtype, window):
    """A window reaching into the quantized tokens (whole steps skipped) and one shorter than the ring; R = 64."""
    lengths = [30, 64, 140, 250]
    cache = random_cache(KIVIConfig(2, 4, 32, 64), 4, 1, 64, 256, lengths, dtype, seed=window)
    q, k_new, v_new = random_step(4, 4, 1, 64, dtype, seed=window + 1)
    kernel, twin, xla, unwindowed = three_ways(cache, q, k_new, v_new, layer=0, window=window, num_splits=2)
    assert np.abs(kernel - twin).max() <= TOL[dtype]
    assert np.abs(kernel - xla).max() <= TOL[dtype]
    assert np.abs(unwindowed - xla).max() > 10 * TOL[dtype]  # the window changed the answer


def test_dispatch_runs_the_kernel_for_kivi_axes_and_falls_back_explicitly(monkeypatch):
    """Which implementation a forced `pallas` traces (the numbers are the other tests' business)."""
    calls = []
    monkeypatch.setattr(kivi_decode, "decode", lambda *a, **k: calls.append(k) or jnp.zeros(a[0].shape, a[0].dtype))
    for kivi, runs_kernel in ((KIVIConfig(2, 2, 32, 64), True), (KIVIConfig(2, 2, 32, 64, "token", "channel"), False),
                              (KIVIConfig(8, 2, 32, 64), False), (KIVIConfig(2, 2, 16, 64), False),
                              (KIVIConfig(3, 2, 32, 64, pre_rope=True, sinks=4), True)):
        cache = jax.eval_shape(lambda: KIVICache.create(CFG_64, kivi, 2, 128))
        q, k_new, v_new = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 1, 4, 64), (2, 1, 2, 64), (2, 1, 2, 64)))
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
            sink_shapes = None if sinks is None else (2, 2, 2, kivi.sinks, 64)  # [layers, batch, kv_heads, S, D]
            assert {k: v for k, v in calls[0].items() if k not in ("k_sink", "v_sink", "inv_freq")} == dict(
                k_bits=kivi.k_bits, v_bits=kivi.v_bits, group_size=32, window=None)
            assert (None if calls[0]["k_sink"] is None else calls[0]["k_sink"].shape) == sink_shapes
            assert (calls[0]["inv_freq"] is None) == (not kivi.pre_rope)
    assert not attention.use_pallas("xla") and attention.use_pallas("pallas")
    assert attention.use_pallas("auto") == (jax.default_backend() == "gpu")


def test_generate_with_the_kernel_gives_the_xla_greedy_tokens(monkeypatch):
    """A tiny random model (head_dim 64, GQA) with a Mistral-style sliding window longer than the ring, a ragged
    batch whose sequences cross ring flushes: quantized, flushed-key and ring tokens all in view."""
    calls = []
    real = kivi_decode.decode
    monkeypatch.setattr(kivi_decode, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=50)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(3, 128, n).tolist() for n in (5, 45)]
    kw = dict(max_new_tokens=40, cache="k2v4-g32-r32", stop_at_eos=False)
    xla = kivi_jax.generate(params, prompts, attention_impl="xla", **kw).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback
        pallas = kivi_jax.generate(params, prompts, attention_impl="pallas", **kw).token_ids
    assert calls  # the kernel was traced into the decode step
    assert pallas == xla
    assert len(set(xla[0])) > 5  # not a degenerate repetition


# Beyond KIVI (docs/kernels.md): 3-bit codes, pre-RoPE keys, sink tokens, and configurations like the presets
# (kivi2+ ~ k3v2-g64-r128 + pre-RoPE + 4 sinks, kivi3+ ~ k4v3-g64-r128 + pre-RoPE + sinks). Few cases: interpret mode
# compiles slowly. (name, config, head_dim, batch, kv_heads, n_rep, max tokens in R-blocks, lengths as f(R, T),
# window, layer, dtype)
BEYOND = [
    ("k3v3-g32-d64", KIVIConfig(3, 3, 32, 64), 64, 3, 2, 3, 4, lambda r, t: [r - 5, 2 * r + 9, t - 3], None, 0,
     jnp.float32),
    ("k3v3-g64-d128-window", KIVIConfig(3, 3, 64, 64), 128, 2, 1, 4, 4, lambda r, t: [t - 7, r + 3], 100, None,
     jnp.float32),
    ("k2v2-prerope-d64", KIVIConfig(2, 2, 32, 64, pre_rope=True), 64, 3, 1, 2, 4, lambda r, t: [2 * r + 11, r, 37],
     None, 1, jnp.float32),
    ("k4v4-prerope-d128-window", KIVIConfig(4, 4, 32, 64, pre_rope=True), 128, 2, 2, 2, 4,
     lambda r, t: [t - 1, r + r // 2], 90, 0, jnp.float32),
    ("k2v4-s5-window", KIVIConfig(2, 4, 32, 64, sinks=5), 64, 4, 1, 2, 4, lambda r, t: [3, 5, r + 1, t - 20], 150,
     0, jnp.float32),
    ("kivi2+like-window", KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4), 64, 4, 1, 3, 3,
     lambda r, t: [2, r + 17, 2 * r, t - 9], 200, 1, jnp.float32),
    ("kivi3+like-s7", KIVIConfig(4, 3, 64, 128, pre_rope=True, sinks=7), 128, 3, 2, 2, 3,
     lambda r, t: [6, r - 1, t - 13], None, None, jnp.float32),
    ("kivi2+like-bf16", KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4), 64, 2, 3, 3, 3,
     lambda r, t: [r + 70, t - 5], None, 0, jnp.bfloat16),
]


@pytest.mark.parametrize("case", BEYOND, ids=[c[0] for c in BEYOND])
def test_beyond_kivi_kernel_equals_twin_and_xla(case):
    """Interpret mode equals the jnp twin and the XLA path (float32: 1e-5) for 3-bit codes, pre-RoPE keys, sinks and
    the preset-like configurations; ragged lengths (below, at and past S, across ring flushes), windows reaching into
    the sinks or not."""
    name, kivi, head_dim, batch, kv_heads, n_rep, blocks, lengths, window, layer, dtype = case
    i = BEYOND.index(case)
    max_tokens = blocks * kivi.residual_length
    cache = random_cache(kivi, batch, kv_heads, head_dim, max_tokens, lengths(kivi.residual_length, max_tokens),
                         dtype, seed=200 + i)
    q, k_new, v_new = random_step(batch, kv_heads * n_rep, kv_heads, head_dim, dtype, seed=300 + i)
    kernel, twin, xla, unwindowed = three_ways(cache, q, k_new, v_new, layer=layer, window=window,
                                               num_splits=(None, 2)[i % 2])
    tol = 1e-5 if dtype == jnp.float32 else TOL[dtype]
    assert np.abs(kernel - twin).max() <= tol, np.abs(kernel - twin).max()
    assert np.abs(kernel - xla).max() <= tol, np.abs(kernel - xla).max()
    assert np.abs(xla).max() > 0.1  # a real output, not zeros on both sides
    if window is not None:
        assert np.abs(unwindowed - xla).max() > 10 * tol  # the window changed the answer


def test_kernel_planes_are_quants():
    """The kernel's copy of the packing planes (pallas_kernels imports nothing of ours) is quant's."""
    from kivi_jax import quant

    assert kivi_decode.PLANES == {b: quant.PLANES[b] for b in kivi_decode.KERNEL_BITS}


def test_model_decode_step_with_a_preset_like_cache_runs_the_kernel_like_the_xla_path(monkeypatch):
    """End to end through the model: over a kivi2+-like cache (3-bit keys stored before RoPE, 4 sinks; R = G = 32 to
    keep it small) holding a ragged batch (one sequence shorter than the sinks), a decode step with the kernel gets
    the sinks and inverse frequencies, does not fall back, and gives the XLA path's logits; the sliding window reaches
    past the sinks of the long sequence."""
    calls = []
    real = kivi_decode.decode
    monkeypatch.setattr(kivi_decode, "decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=40)
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.2)
    kivi = parse_cache_spec("k3v2-g32-r32-prerope-s4")
    cache = random_cache(kivi, 2, 2, 64, 128, [3, 90], jnp.float32, seed=5)
    step = jnp.asarray([[7], [99]], jnp.int32)
    both = lambda p, t, c: tuple(forward(p, t, c.replace(impl=impl))[0] for impl in ("xla", "pallas"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback
        xla, pallas = compiled(both, params, step, cache)(params, step, cache)  # one compilation
    assert calls and calls[0]["k_sink"].shape == (2, 2, 2, 4, 64) and calls[0]["inv_freq"].shape == (32,)
    assert np.abs(np.asarray(pallas) - np.asarray(xla)).max() <= 1e-4
    assert np.asarray(xla).std() > 0.1  # real logits
