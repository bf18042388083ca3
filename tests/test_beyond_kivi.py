"""Beyond KIVI (docs/quality.md): pre-RoPE keys, full-precision sink tokens, 3-bit codes, rotated values and keys.

Each option is checked where it is consumed: attention over what the cache stores equals a dense reference that
dequantizes (then rotates, for pre-RoPE keys), for prefill, chunks and decode, ragged; stores stay bit-identical
to one-token appends; the bytes equal the formula; rotations leave full-precision outputs unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_VOCAB, hf_logits
from kivi_jax import quant, rotation
from kivi_jax.cache import KIVICache, kivi_cache_bytes, make_cache
from kivi_jax.checkpoint import load_hf
from kivi_jax.config import KIVIConfig, bits_per_value, parse_cache_spec
from kivi_jax.models.llama import Rotary, forward, rope_inv_freq
from test_chunked import dense_chunk_reference
from test_kivi_cache import CFG, append_tokens, leaves_equal, random_kv

R, G = 32, 16
ROPE = Rotary(rope_inv_freq(CFG))
CONFIGS = {  # each option alone and together, with sinks below, inside and beyond the first group and the ring
    "prerope": KIVIConfig(2, 2, G, R, pre_rope=True),
    "sinks": KIVIConfig(2, 2, G, R, sinks=5),
    "k3v3": KIVIConfig(3, 3, G, R),
    "k3v2-prerope-s4-window": KIVIConfig(3, 2, G, R, pre_rope=True, sinks=4),
    "k2v3-s40-prerope": KIVIConfig(2, 3, G, R, pre_rope=True, sinks=40),
    "axes-flipped-sinks": KIVIConfig(2, 2, G, R, "token", "channel", sinks=3),
}


@functools.partial(jax.jit, static_argnames=("window",))
def attend_chunk(cache: KIVICache, q, k, v, num_new, window=None):
    """One chunk through `attend` + `commit` (what the model does), every layer's answer beside the dense reference
    of what the cache held before it; compiled once per configuration."""
    positions = cache.length[:, None] + jnp.arange(q.shape[1])[None, :]
    outs, refs, updates = [], [], []
    for layer in range(CFG.num_layers):
        out, up = cache.attend(layer, q, k[layer], v[layer], positions, ROPE, num_new, window)
        outs.append(out)
        refs.append(dense_chunk_reference(q, cache, layer, ROPE(k[layer], positions), v[layer], num_new, window,
                                          ROPE.inv_freq))
        updates.append(up)
    return jnp.stack(outs), jnp.stack(refs), cache.commit(jax.tree_util.tree_map(lambda *x: jnp.stack(x), *updates),
                                                          num_new)


def feed_through_attend(cache: KIVICache, chunks, window=None, seed=0, check=True):
    """Feeds random q/k/v chunk by chunk (`chunks` lists per-call `num_new`, every call as wide as the widest),
    checking every layer's answer against the dense reference of what the cache held before the chunk."""
    rng = np.random.RandomState(seed)
    width = max(max(c) for c in chunks)
    raw_keys = []
    for counts in chunks:
        num_new = jnp.asarray(counts, jnp.int32)
        batch = len(counts)
        q = jnp.asarray(rng.randn(batch, width, CFG.num_heads, CFG.head_dim).astype(np.float32))
        k = rng.randn(CFG.num_layers, batch, width, CFG.num_kv_heads, CFG.head_dim).astype(np.float32)
        k[..., 3] *= 20.0  # an outlier channel, like real keys
        k = jnp.asarray(k)
        v = jnp.asarray(rng.randn(CFG.num_layers, batch, width, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
        outs, refs, cache = attend_chunk(cache, q, k, v, num_new, window)
        if check:
            real = np.asarray(jnp.arange(width)[None, :] < num_new[:, None])
            assert np.isfinite(np.asarray(outs)).all()
            assert np.abs(np.asarray(outs - refs))[:, real].max() <= 1e-5, counts
        raw_keys.append((k, num_new))
    return cache, raw_keys


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_equals_a_dense_reference_that_dequantizes_then_rotates(name):
    kivi = CONFIGS[name]
    window = 45 if name.endswith("window") else None
    cache = KIVICache.create(CFG, kivi, 2, 5 * R)
    # prefill (empty cache), ragged chunks across the ring and block edges, then decode steps (T = 1)
    chunks = [[37, 9], [0, 30], [5, 40], [13, 1]] + [[1, 1]] * 3
    cache, _ = feed_through_attend(cache, chunks, window)
    assert cache.length.tolist() == [58, 83]


def test_a_pre_rope_store_holds_the_keys_before_rope():
    kivi = KIVIConfig(3, 2, G, R, pre_rope=True, sinks=2)
    cache, fed = feed_through_attend(KIVICache.create(CFG, kivi, 1, 4 * R), [[R + 7]], check=False)
    (k, _), = fed  # [layers, batch, T, kv_heads, D] before RoPE
    raw = jnp.swapaxes(k, 2, 3)  # [layers, batch, kv_heads, T, D]
    np.testing.assert_array_equal(np.asarray(cache.k_ring[:, :, :, :7]), np.asarray(raw[:, :, :, R : R + 7]))
    np.testing.assert_array_equal(np.asarray(cache.k_sink), np.asarray(raw[:, :, :, :2]))
    # tokens 2..R-1 of the block quantize like the raw keys with the sinks replaced by token 2 (same group)
    stand_in = jnp.concatenate([raw[:, :, :, 2:3], raw[:, :, :, 2:3], raw[:, :, :, 2:R]], axis=3)
    codes, scale, mn = quant.quantize_per_channel(stand_in, 3, G)
    np.testing.assert_array_equal(np.asarray(cache.k.codes[:, :, :, :R]), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(cache.k.scale[:, :, :, : R // G]), np.asarray(scale))


@pytest.mark.parametrize("kivi", [KIVIConfig(3, 2, G, R, sinks=5, pre_rope=True), KIVIConfig(2, 3, G, R, sinks=40),
                                  KIVIConfig(3, 3, G, R, "token", "channel", sinks=17)])
def test_stores_with_sinks_are_bit_identical_to_one_token_appends_in_any_chunking(kivi):
    batch, n_max = 2, 2 * R + 9
    lengths = np.array([R + 3, 2 * R + 9])
    k, v = random_kv(21, batch, n_max)
    one_by_one = KIVICache.create(CFG, kivi, batch, 3 * R)
    for t in range(n_max):
        live = jnp.asarray((t < lengths).astype(np.int32))
        one_by_one = append_tokens(one_by_one, k[:, :, :, t : t + 1], v[:, :, :, t : t + 1], live)
    # the first S tokens (of those each sequence has) come back bit-identical from the sinks
    for b, n in enumerate(lengths):
        s = min(kivi.sinks, n)
        np.testing.assert_array_equal(np.asarray(one_by_one.k_sink[:, b, :, :s]), np.asarray(k[:, b, :, :s]))
        np.testing.assert_array_equal(np.asarray(one_by_one.v_sink[:, b, :, :s]), np.asarray(v[:, b, :, :s]))
    rng = np.random.RandomState(22)
    cache, done, width = KIVICache.create(CFG, kivi, batch, 3 * R), np.zeros(batch, int), 2 * R + 1
    while (done < lengths).any():
        counts = np.minimum(rng.randint(0, width + 1, batch), lengths - done)
        idx = np.minimum(done[:, None] + np.arange(width)[None, :], n_max - 1)
        take = lambda x: jnp.asarray(np.take_along_axis(np.asarray(x), idx[None, :, None, :, None], axis=3))
        cache = append_tokens(cache, take(k), take(v), jnp.asarray(counts, jnp.int32))
        done += counts
    leaves_equal(cache, one_by_one)


def test_a_huge_sink_never_widens_its_groups_range():
    k, v = random_kv(23, 1, R)
    k = k.at[:, :, :, 0].multiply(1000.0)  # an attention-sink-like first token
    v = v.at[:, :, :, 0].multiply(1000.0)
    errs = {}
    for sinks in (0, 1):
        cache = append_tokens(KIVICache.create(CFG, KIVIConfig(2, 2, G, R, sinks=sinks), 1, 2 * R), k, v,
                              jnp.asarray([R]))
        deq = np.asarray(cache.k.replace(codes=cache.k.codes[0], scale=cache.k.scale[0], mn=cache.k.mn[0])
                         .dequantize())
        errs[sinks] = np.abs(deq[:, :, 1:G] - np.asarray(k[0, :, :, 1:G]))  # [batch, kv_heads, G - 1, D]
    rest = np.asarray(k[0, :, :, 1:G])
    half_step = (rest.max(2, keepdims=True) - rest.min(2, keepdims=True)) / 3 / 2  # the group without the sink
    assert (errs[1] <= half_step * 1.01 + 1e-3).all()  # float16 scales
    assert errs[0].mean() > 5 * errs[1].mean(), (errs[0].mean(), errs[1].mean())


@pytest.mark.parametrize("spec", ["kivi2", "k3v2-g64-prerope-s4-rotv", "k3v3-g32-s8", "k2v3-g64-s1-rotk",
                                  "k4v3-g128-r128-prerope"])
def test_bytes_equal_the_formula_and_bits_a_value(spec):
    kivi = parse_cache_spec(spec)
    cache = make_cache(kivi, CFG, 2, 256)
    parts = kivi_cache_bytes(CFG, kivi, 2, 256, 4)
    assert cache.nbytes == parts["total"]
    lbh = CFG.num_layers * 2 * CFG.num_kv_heads
    quantized = parts["codes"] + parts["scales"] + parts["sinks"] * 16 // 32  # sinks counted in float16
    assert quantized * 8 / (2 * lbh * 256 * CFG.head_dim) == pytest.approx(bits_per_value(kivi, CFG.head_dim, 256))


def test_rotated_values_leave_full_precision_logits_unchanged(tiny_dirs):
    path, model = tiny_dirs["llama_gqa_llama3"]
    params = load_hf(path)
    rotated = rotation.rotate_values(params)
    assert rotated.value_basis == "hadamard" and rotation.rotate_values(rotated) is rotated
    tokens = np.random.RandomState(24).randint(3, TINY_VOCAB, (2, 21)).astype(np.int32)
    ref = hf_logits(model, tokens)
    logits, _ = forward(rotated, jnp.asarray(tokens), make_cache("full", params.config, 2, 64))
    assert np.abs(np.asarray(logits) - ref).max() <= 1e-4
    assert np.abs(np.asarray(rotated.layers.wv - params.layers.wv)).max() > 1e-3  # the weights did change
    # a cache that quantizes in the rotated basis refuses unrotated params, and the reverse
    with pytest.raises(ValueError, match="prepare_params"):
        forward(params, jnp.asarray(tokens), make_cache("k2v2-g16-r32-rotv", params.config, 2, 64))
    with pytest.raises(ValueError, match="prepare_params"):
        forward(rotated, jnp.asarray(tokens), make_cache("k2v2-g16-r32", params.config, 2, 64))


def test_the_basis_is_orthogonal_at_every_head_dim():
    for d in (8, 24, 64, 80, 128):
        h = rotation.basis(d)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(rotation.basis(24), rotation.basis(24))  # seeded: a checkpoint and its cache agree


def test_rotated_keys_change_no_score_while_everything_is_in_the_ring(tiny_dirs):
    path, _ = tiny_dirs["llama_gqa_llama3"]
    params = load_hf(path)
    tokens = jnp.asarray(np.random.RandomState(25).randint(3, TINY_VOCAB, (1, 20)).astype(np.int32))
    plain, _ = forward(params, tokens, make_cache("k2v2-g16-r32", params.config, 1, 64))
    rot, cache = forward(params, tokens, make_cache("k2v2-g16-r32-rotk", params.config, 1, 64))
    assert np.abs(np.asarray(plain - rot)).max() <= 1e-5
    # the ring holds the keys in the basis H: not the plain keys
    _, plain_cache = forward(params, tokens, make_cache("k2v2-g16-r32", params.config, 1, 64))
    assert np.abs(np.asarray(cache.k_ring - plain_cache.k_ring)).max() > 1e-3


@pytest.mark.slow
def test_per_layer_bits_store_the_first_layers_apart(tiny_dirs):
    """`-l1k4v4`: layer 0 at 4 bits, the others at 2. Layer 0 sees the same input in any cache, so its stores equal
    those of an all-4-bit cache fed the same tokens (prefill, a chunk, a decode step under jit)."""
    path, _ = tiny_dirs["llama_gqa_llama3"]
    params = load_hf(path)
    cfg = params.config
    mixed, low, high = (parse_cache_spec(s) for s in ("k2v2-g16-r32-s2-l1k4v4", "k2v2-g16-r32-s2", "k4v4-g16-r32-s2"))
    assert mixed.first() == high and mixed.rest() == low
    cache = make_cache(mixed, cfg, 2, 128)
    assert cache.first.k.codes.shape[0] == 1 and cache.k.codes.shape[0] == cfg.num_layers - 1
    assert cache.first.k.bits == 4 and cache.k.bits == 2
    assert cache.nbytes == kivi_cache_bytes(cfg, mixed, 2, 128, 4)["total"]
    tokens = jnp.asarray(np.random.RandomState(26).randint(3, TINY_VOCAB, (2, 61)).astype(np.int32))
    step = jax.jit(forward, donate_argnames=("cache",))
    caches, logits = {}, {}
    for s in (mixed, high):  # prefill 37 / 50 tokens, then a chunk, then one token
        c = make_cache(s, cfg, 2, 128)
        _, c = step(params, tokens[:, :50], c, jnp.asarray([37, 50]))
        _, c = step(params, tokens[:, 50:60], c, jnp.asarray([10, 4]))
        logits[s], caches[s] = step(params, tokens[:, 60:61], c)
    assert caches[mixed].length.tolist() == [48, 55] and caches[mixed].first.length.tolist() == [48, 55]
    first, high_c = caches[mixed].first, caches[high]
    for name in ("codes", "scale", "mn"):
        np.testing.assert_array_equal(np.asarray(getattr(first.k, name)), np.asarray(getattr(high_c.k, name)[:1]))
        np.testing.assert_array_equal(np.asarray(getattr(first.v, name)), np.asarray(getattr(high_c.v, name)[:1]))
    np.testing.assert_array_equal(np.asarray(first.k_ring), np.asarray(high_c.k_ring[:1]))
    np.testing.assert_array_equal(np.asarray(first.k_sink), np.asarray(high_c.k_sink[:1]))
    assert np.abs(np.asarray(caches[mixed].k.codes)).max() > 0  # the other layers were written, at 2 bits
    assert np.isfinite(np.asarray(logits[mixed])).all()
    assert np.abs(np.asarray(logits[mixed] - logits[high])).max() > 1e-4  # layers 1.. are 2-bit: it shows
