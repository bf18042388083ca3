"""The KIVI cache: streaming equals one-shot quantization, prefill equals appends, attention equals a dense
reference, bytes equal the formula, the decode step's temporaries stay small."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention, quant
from kivi_jax.cache import KIVICache, full_cache_bytes, kivi_cache_bytes, make_cache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from reference import dense_kivi_decode

G, R = 16, 32
CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32)
KIVI = KIVIConfig(2, 2, G, R)


def random_kv(seed, batch, tokens, cfg=CFG):
    """Keys/values `[layers, batch, kv_heads, tokens, head_dim]` with a few outlier channels, like real keys."""
    rng = np.random.RandomState(seed)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, tokens, cfg.head_dim)
    k = rng.randn(*shape).astype(np.float32)
    k[..., 3] *= 20.0
    v = rng.randn(*shape).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(v)


def stack(updates):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *updates)


@jax.jit
def append_tokens(cache: KIVICache, k, v, num_new):
    """Appends `k, v [layers, batch, kv_heads, T, head_dim]` (`num_new [batch]` real) through the cache protocol."""
    ups = [cache.append_update(cache.k_ring[l], cache.v_ring[l], k[l], v[l], num_new) for l in range(k.shape[0])]
    return cache.commit(stack(ups), num_new)


def append(cache: KIVICache, k, v):
    """Appends one token per sequence, `k, v [layers, batch, kv_heads, head_dim]`."""
    return append_tokens(cache, k[:, :, :, None], v[:, :, :, None], jnp.ones_like(cache.length))


def prefill(cache: KIVICache, k, v, num_new):
    """Fills an empty cache with `k, v [layers, batch, kv_heads, tokens, head_dim]` of `num_new [batch]` tokens."""
    return append_tokens(cache, k, v, num_new)


def leaves_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("kivi", [KIVI, KIVIConfig(4, 2, G, R), KIVIConfig(2, 2, G, R, "token", "channel")])
def test_streaming_appends_equal_one_shot_quantization(kivi):
    n = 3 * R + 5
    k, v = random_kv(0, 2, n)
    cache = KIVICache.create(CFG, kivi, 2, 4 * R)
    for t in range(n):
        cache = append(cache, k[:, :, :, t], v[:, :, :, t])
    assert cache.length.tolist() == [n, n]
    for store, x in ((cache.k, k), (cache.v, v)):
        end = int(store.quantized_end(cache.length, R)[0])
        assert end == (3 * R if store.axis == "channel" else n - R)
        q = store.quantize(x[:, :, :, :end])
        np.testing.assert_array_equal(np.asarray(store.codes[:, :, :, :end]), np.asarray(q.codes))
        rows = end // G if store.axis == "channel" else end
        np.testing.assert_array_equal(np.asarray(store.scale[:, :, :, :rows]), np.asarray(q.scale))
        np.testing.assert_array_equal(np.asarray(store.mn[:, :, :, :rows]), np.asarray(q.mn))
        assert not np.asarray(store.codes[:, :, :, end:]).any()  # nothing beyond the quantized end
    slots = np.arange(n - R, n) % R
    np.testing.assert_array_equal(np.asarray(cache.k_ring)[:, :, :, slots], np.asarray(k[:, :, :, n - R:]))
    np.testing.assert_array_equal(np.asarray(cache.v_ring)[:, :, :, slots], np.asarray(v[:, :, :, n - R:]))


@pytest.mark.parametrize("n_prefill", [R - 1, R, R + 1, 2 * R + G - 1])
@pytest.mark.parametrize("kivi", [KIVI, KIVIConfig(2, 2, G, R, "token", "channel")])
def test_prefill_then_appends_equals_appends_only(n_prefill, kivi):
    n = 3 * R + 5
    k, v = random_kv(1, 2, n)
    streamed = KIVICache.create(CFG, kivi, 2, 4 * R)
    for t in range(n):
        streamed = append(streamed, k[:, :, :, t], v[:, :, :, t])
    filled = prefill(KIVICache.create(CFG, kivi, 2, 4 * R), k[:, :, :, :n_prefill], v[:, :, :, :n_prefill],
                     jnp.array([n_prefill, n_prefill]))
    for t in range(n_prefill, n):
        filled = append(filled, k[:, :, :, t], v[:, :, :, t])
    leaves_equal(filled, streamed)


def test_ragged_prefill_equals_each_sequence_alone():
    k, v = random_kv(2, 2, 2 * R + 7)
    lengths = [R + 3, 2 * R + 7]
    both = prefill(KIVICache.create(CFG, KIVI, 2, 4 * R), k, v, jnp.array(lengths))
    for b, n in enumerate(lengths):
        alone = prefill(KIVICache.create(CFG, KIVI, 1, 4 * R), k[:, b : b + 1, :, :n], v[:, b : b + 1, :, :n],
                        jnp.array([n]))
        picked = jax.tree_util.tree_map(lambda x: x[b : b + 1] if x.ndim == 1 else x[:, b : b + 1], both)
        leaves_equal(picked, alone)


@pytest.mark.parametrize(
    "kivi, window",
    [(KIVI, None), (KIVIConfig(4, 2, G, R), 40), (KIVIConfig(2, 4, 8, R, "token", "channel"), None),
     (KIVIConfig(2, 2, G, R, "channel", "channel"), 23)],
)
def test_blockwise_attention_equals_dense_reference(kivi, window):
    """At every length from a ragged prefill to past three flushes, for several block sizes (a block count that does
    not divide the cache, so the last block starts early)."""
    batch, max_tokens = 2, 5 * R
    k, v = random_kv(3, batch, max_tokens)
    rng = np.random.RandomState(4)
    cache = prefill(KIVICache.create(CFG, kivi, batch, max_tokens), k, v, jnp.array([5, R + 9]))

    @jax.jit
    def check(cache, q, k_new, v_new):
        worst = 0.0
        for layer in range(CFG.num_layers):
            ref = dense_kivi_decode(q, cache, layer, k_new, v_new, window)
            for block in (G, 3 * G, 512):
                ours = attention.decode_kivi_xla(q, cache.k, cache.v, layer, cache.k_ring[layer],
                                                 cache.v_ring[layer], cache.length, k_new, v_new, window, block)
                # allclose's bound (atol 1e-5, rtol 1e-5): float32 rounding of exp and of the block-wise rescaling
                # grows with the magnitude of the output (outlier key channels make scores of tens)
                worst = jnp.maximum(worst, (jnp.abs(ours - ref) / (1e-5 + 1e-5 * jnp.abs(ref))).max())
        return worst

    worst = 0.0
    for step in range(3 * R + 4):
        q = jnp.asarray(rng.randn(batch, 1, CFG.num_heads, CFG.head_dim).astype(np.float32))
        k_new = jnp.asarray(rng.randn(batch, 1, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
        v_new = jnp.asarray(rng.randn(batch, 1, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
        worst = max(worst, float(check(cache, q, k_new, v_new)))
        cache = append(cache, k[:, :, :, step], v[:, :, :, step])
    assert int(cache.length[1]) > 4 * R  # crossed every flush boundary of both sequences
    assert worst <= 1.0


@pytest.mark.slow
def test_kivi_model_decode_error_shrinks_with_bits():
    params = init_params(CFG, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(5).randint(0, CFG.vocab_size, (2, 3 * R)))
    step = jax.jit(forward, donate_argnames=("cache",))
    errs = {}
    for spec in ("full", "k8v8-g16-r32", "k4v4-g16-r32", "k2v2-g16-r32"):
        cache = make_cache(spec, CFG, 2, 4 * R)
        logits, cache = step(params, tokens[:, :R + 3], cache)
        outs = [logits[:, -1]]
        for t in range(R + 3, 3 * R):
            logits, cache = step(params, tokens[:, t : t + 1], cache)
            outs.append(logits[:, 0])
        errs[spec] = np.stack(outs)
    e8, e4, e2 = (np.abs(errs[f"k{b}v{b}-g16-r32"] - errs["full"]).max() for b in (8, 4, 2))
    assert e8 < 0.01 * np.abs(errs["full"]).max() and e8 < e4 < e2


@pytest.mark.parametrize("spec", ["kivi2", "kivi4", "k4v2-g64-r128", "k2v2-g32-r128-ktok-vchan", "k2v2-g32-r128-sf32",
                                  "k2v2-g32-r128-s4-ringbf16"])
def test_bytes_equal_the_formula(spec):
    cfg = LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=128)
    kivi = parse_cache_spec(spec)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = KIVICache.create(cfg, kivi, 2, 1024, dtype)
        assert cache.nbytes == kivi_cache_bytes(cfg, kivi, 2, 1024, jnp.dtype(dtype).itemsize)["total"]
    assert make_cache("full", cfg, 2, 1024).nbytes == full_cache_bytes(cfg, 2, 1024, 4)


def test_two_bit_group_32_costs_three_bits_a_value():
    cfg = LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=128)
    parts = kivi_cache_bytes(cfg, KIVIConfig(2, 2, 32, 128), 1, 4096, 2)
    values = 2 * 2 * 4096 * 128  # keys and values
    assert (parts["codes"] + parts["scales"]) * 8 / values == 3.0


def test_decode_step_temporaries_stay_under_a_quarter_of_the_full_cache():
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    params = init_params(cfg, jax.random.PRNGKey(0))
    step = jax.jit(forward, donate_argnames=("cache",))
    full_bytes = make_cache("full", cfg, 1, 8192).nbytes
    for spec in ("kivi2", "kivi4", "full"):
        cache = jax.eval_shape(lambda: make_cache(spec, cfg, 1, 8192))
        compiled = step.lower(params, jnp.zeros((1, 1), jnp.int32), cache).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < 0.25 * full_bytes, (spec, temp, full_bytes)


def test_float16_overflow_is_flagged_and_float32_scales_avoid_it():
    k, v = random_kv(6, 1, 2 * R)
    k = k.at[:, :, :, :, 5].set(1e5)  # a channel whose per-channel min overflows float16
    cache = prefill(KIVICache.create(CFG, KIVI, 1, 4 * R), k, v, jnp.array([2 * R]))
    assert bool(cache.overflow[0])
    safe = prefill(KIVICache.create(CFG, parse_cache_spec("k2v2-g16-r32-sf32"), 1, 4 * R),
                   k, v, jnp.array([2 * R]))
    assert not bool(safe.overflow[0])
    assert np.isfinite(np.asarray(safe.k.scale)).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k_bits=5), "k_bits=5 is not supported"),
        (dict(v_bits=1), "v_bits=1 is not supported"),
        (dict(group_size=32, residual_length=48), "residual_length=48 must be a positive multiple of group_size=32"),
        (dict(residual_length=0), "must be a positive multiple"),
        (dict(key_axis="row"), "key_axis='row' must be one of"),
    ],
)
def test_bad_kivi_configs_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KIVIConfig(**kwargs)


def test_shapes_that_do_not_fit_say_what_would():
    with pytest.raises(ValueError, match="group_size=48 does not divide head_dim=64"):
        KIVIConfig(2, 2, 48, 96).check_shapes(64, 960)
    with pytest.raises(ValueError, match="max_tokens=1000 must be a positive multiple of residual_length=128 \\(e.g. 1024\\)"):
        KIVICache.create(CFG.__class__(**{**CFG.__dict__, "head_dim": 64}), KIVIConfig(2, 2, 32, 128), 1, 1000)
