"""Any number of new tokens onto any cache (docs/design.md §7): chunked feeding equals transformers, KIVI stores
equal one-at-a-time appends bit for bit, a chunk's attention equals a dense reference of what is stored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_CONFIGS, TINY_VOCAB, hf_logits
from kivi_jax import attention, runtime
from kivi_jax.cache import FullCache, KIVICache, make_cache
from kivi_jax.checkpoint import load_hf
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward
from reference import seen_keys_values
from test_kivi_cache import CFG, append_tokens, leaves_equal, random_kv

TOL = 1e-4
SEQ = 40  # longer than the Mistral window (11)
step = jax.jit(forward, donate_argnames=("cache",))


def feed(params, cache, tokens: np.ndarray, lengths: np.ndarray, chunks: list[list[int]]):
    """Feeds right-padded `tokens [batch, n]` chunk by chunk: `chunks[c][b]` new tokens of sequence b in call c (0
    allowed); returns the logits of every fed token `[batch, n, vocab]` (NaN where never fed) and the cache."""
    batch, n = tokens.shape
    width = max(max(c) for c in chunks)
    out = np.full((batch, n, params.config.vocab_size), np.nan, np.float32)
    done = np.zeros(batch, int)
    for counts in chunks:
        block = np.zeros((batch, width), np.int32)
        for b, k in enumerate(counts):
            block[b, :k] = tokens[b, done[b] : done[b] + k]
        logits, cache = step(params, jnp.asarray(block), cache, jnp.asarray(counts, jnp.int32))
        for b, k in enumerate(counts):
            out[b, done[b] : done[b] + k] = np.asarray(logits[b, :k])
        done += counts
    assert (done == lengths).all()
    return out, cache


def fixed_chunks(lengths, size):
    """Every sequence fed `size` tokens a call until it runs out (then 0s)."""
    lengths = np.asarray(lengths)
    calls = -(-lengths.max() // size)
    return [np.clip(lengths - c * size, 0, size).tolist() for c in range(calls)]


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "mistral_window"])
def test_full_cache_in_any_chunks_matches_transformers(tiny_dirs, name):
    path, model = tiny_dirs[name]
    params = load_hf(path)
    rng = np.random.RandomState(7)
    lengths = np.array([SEQ, 29, 17])  # ragged: the shorter ones run out early and get num_new 0
    tokens = rng.randint(3, TINY_VOCAB, (3, SEQ)).astype(np.int32)
    refs = [hf_logits(model, tokens[b : b + 1, :n])[0] for b, n in enumerate(lengths)]
    random_chunks = []
    done = np.zeros(3, int)
    while (done < lengths).any():
        counts = np.minimum(rng.randint(0, 9, 3), lengths - done)
        random_chunks.append(counts.tolist())
        done += counts
    for chunks in (fixed_chunks(lengths, 1), fixed_chunks(lengths, 7), fixed_chunks(lengths, 64), random_chunks):
        logits, cache = feed(params, FullCache.create(params.config, 3, 64), tokens, lengths, chunks)
        assert cache.length.tolist() == lengths.tolist()
        for b, n in enumerate(lengths):
            assert np.abs(logits[b, :n] - refs[b]).max() <= TOL, (name, chunks[:2])


def test_prefill_then_a_multi_token_forward_gives_the_right_logits(tiny_dirs):
    """The misuse of the old API (prefill 8 tokens, then forward 4 more) is now simply an append."""
    path, model = tiny_dirs["llama_mha"]
    params = load_hf(path)
    tokens = np.random.RandomState(8).randint(3, TINY_VOCAB, (1, 12)).astype(np.int32)
    ref = hf_logits(model, tokens)
    for spec in ("full", "kivi2"):
        cache = make_cache(spec, params.config, 1, 128)
        _, cache = step(params, jnp.asarray(tokens[:, :8]), cache)  # jitted: op-by-op dispatch costs more
        logits, cache = step(params, jnp.asarray(tokens[:, 8:]), cache)
        assert int(cache.length[0]) == 12
        # inside the residual KIVI holds everything in full precision, so both caches equal transformers
        assert np.abs(np.asarray(logits) - ref[:, 8:]).max() <= TOL, spec


R = 32
KIVI = KIVIConfig(2, 2, 16, R)


@pytest.mark.parametrize("kivi", [KIVI, KIVIConfig(4, 2, 16, R), KIVIConfig(2, 2, 16, R, "token", "channel"),
                                  KIVIConfig(2, 2, 16, R, ring_dtype="float16")])
def test_kivi_stores_are_bit_identical_to_one_token_appends_in_any_chunking(kivi):
    batch, n_max = 3, 3 * R + 5
    lengths = np.array([R - 1, R + 1, 3 * R + 5])  # and R itself is crossed on the way
    k, v = random_kv(11, batch, n_max)
    one_by_one = KIVICache.create(CFG, kivi, batch, 4 * R)
    for t in range(n_max):
        live = jnp.asarray((t < lengths).astype(np.int32))
        one_by_one = append_tokens(one_by_one, k[:, :, :, t : t + 1], v[:, :, :, t : t + 1], live)
    assert one_by_one.length.tolist() == lengths.tolist()
    rng = np.random.RandomState(12)
    for trial in range(3):
        cache, done = KIVICache.create(CFG, kivi, batch, 4 * R), np.zeros(batch, int)
        width = [5, R, 2 * R + 3][trial]  # chunk widths below, at and above R (one compilation each)
        while (done < lengths).any():
            counts = np.minimum(rng.randint(0, width + 1, batch), lengths - done)
            idx = np.minimum(done[:, None] + np.arange(width)[None, :], n_max - 1)  # [batch, width]
            take = lambda x: jnp.asarray(np.take_along_axis(np.asarray(x), idx[None, :, None, :, None], axis=3))
            cache = append_tokens(cache, take(k), take(v), jnp.asarray(counts, jnp.int32))
            done += counts
        leaves_equal(cache, one_by_one)


def dense_chunk_reference(q, cache, layer, k_new, v_new, num_new, window=None, inv_freq=None):
    """A chunk's attention, the obvious way: dequantize what is stored (the ring above the quantized ends, the sinks
    below S; rotated after for a pre-RoPE cache), put the chunk's own keys (after RoPE) and values after it in full
    precision, causal softmax per query. q `[batch, T, q_heads, D]`."""
    k, v = seen_keys_values(cache, layer, inv_freq)  # [batch, kv_heads, max, D]
    batch, tokens, q_heads, d = q.shape
    stored = k.shape[2]
    k = jnp.concatenate([k, jnp.moveaxis(k_new, 1, 2).astype(jnp.float32)], axis=2)
    v = jnp.concatenate([v, jnp.moveaxis(v_new, 1, 2).astype(jnp.float32)], axis=2)
    idx = jnp.arange(stored + tokens)[None, None, :]  # [1, 1, stored + T]
    i = jnp.arange(tokens)[None, :, None]  # [1, T, 1]: the query
    length = cache.length[:, None, None]
    pos = jnp.where(idx < stored, idx, length + idx - stored)  # [batch, 1, stored + T]
    valid = jnp.where(idx < stored, idx < length, (idx - stored <= i) & (idx - stored < num_new[:, None, None]))
    if window is not None:
        valid &= length + i - pos < window  # [batch, T, stored + T]
    qg = q.astype(jnp.float32).reshape(batch, tokens, k.shape[1], -1, d) / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("bqhrd,bhtd->bhrqt", qg, k, precision="highest")
    p = jax.nn.softmax(jnp.where(valid[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhrqt,bhtd->bqhrd", p, v, precision="highest")
    return out.reshape(batch, tokens, q_heads, d)


@pytest.mark.parametrize("kivi, window", [(KIVI, None), (KIVIConfig(4, 2, 16, R), 23),
                                          (KIVIConfig(2, 2, 16, R, "token", "channel"), None)])
def test_chunk_attention_equals_a_dense_reference_of_what_is_stored(kivi, window):
    batch, tokens = 2, 5
    k, v = random_kv(13, batch, 4 * R)
    rng = np.random.RandomState(14)
    cache = append_tokens(KIVICache.create(CFG, kivi, batch, 5 * R), k, v, jnp.asarray([R + 9, 3 * R + 2]))
    num_new = jnp.asarray([tokens, 3])  # ragged: the second sequence has two padded queries
    q = jnp.asarray(rng.randn(batch, tokens, CFG.num_heads, CFG.head_dim).astype(np.float32))
    k_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    positions = cache.length[:, None] + jnp.arange(tokens)[None, :]
    blocks = (16, 48, 512)

    @jax.jit  # every layer and block in one compiled program (op-by-op dispatch of the same ops costs far more)
    def refs_and_ours(cache, q, k_new, v_new, num_new):
        return [(dense_chunk_reference(q, cache, layer, k_new, v_new, num_new, window),
                 [attention.attend_kivi_xla(q, positions, cache.k, cache.v, layer, cache.k_ring[layer],
                                            cache.v_ring[layer], cache.length, k_new, v_new, num_new, window, block)
                  for block in blocks]) for layer in range(CFG.num_layers)]

    real = np.asarray(jnp.arange(tokens)[None, :] < num_new[:, None])  # padded queries: any finite answer
    for layer, (ref, ours_by_block) in enumerate(refs_and_ours(cache, q, k_new, v_new, num_new)):
        for block, ours in zip(blocks, ours_by_block):
            assert np.isfinite(np.asarray(ours)).all()
            assert np.abs(np.asarray(ours - ref))[real].max() <= 1e-5, (layer, block)


@pytest.mark.parametrize("tokens, window", [(129, None), (300, 23), (300, None)])
def test_a_long_chunk_in_causal_tiles_equals_the_dense_reference(tokens, window):
    """Past NEW_TILE new tokens the chunk's attention over itself runs in query tiles that skip later keys; at
    lengths no tile divides, ragged, onto a cache holding quantized tokens and a ring."""
    batch = 2
    assert tokens > attention.NEW_TILE
    k, v = random_kv(15, batch, 4 * R)
    rng = np.random.RandomState(16)
    cache = append_tokens(KIVICache.create(CFG, KIVI, batch, 4 * R + -(-tokens // R) * R), k, v, jnp.asarray([R + 9, 3 * R + 2]))
    num_new = jnp.asarray([tokens, tokens - 77])
    q = jnp.asarray(rng.randn(batch, tokens, CFG.num_heads, CFG.head_dim).astype(np.float32))
    k_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    positions = cache.length[:, None] + jnp.arange(tokens)[None, :]
    real = np.asarray(jnp.arange(tokens)[None, :] < num_new[:, None])
    for layer in range(CFG.num_layers):
        ref = dense_chunk_reference(q, cache, layer, k_new, v_new, num_new, window)
        ours = attention.attend_kivi_xla(q, positions, cache.k, cache.v, layer, cache.k_ring[layer],
                                         cache.v_ring[layer], cache.length, k_new, v_new, num_new, window)
        assert np.isfinite(np.asarray(ours)).all()
        assert np.abs(np.asarray(ours - ref))[real].max() <= 1e-5, layer


@pytest.mark.parametrize("tokens, window, softcap", [(200, None, None), (333, 50, 30.0)])
def test_causal_tiles_equal_one_block_over_the_whole_chunk(tokens, window, softcap, monkeypatch):
    """The tiled path against the one-block path it replaces (NEW_TILE raised past the chunk), soft-cap included."""
    rng = np.random.RandomState(17)
    batch, kv_heads, n_rep, d = 2, 2, 3, 16
    q = jnp.asarray(rng.randn(batch, tokens, kv_heads * n_rep, d).astype(np.float32))
    k_new = jnp.asarray(rng.randn(batch, tokens, kv_heads, d).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, kv_heads, d).astype(np.float32))
    positions = jnp.asarray([[40], [3]]) + jnp.arange(tokens)[None, :]
    num_new = jnp.asarray([tokens, tokens // 2 + 1])

    def run():
        rows = attention.group_queries(q, positions, kv_heads)
        state = attention.new_tokens(attention.Softmax.empty(rows.q), rows, k_new, v_new, positions, num_new,
                                     window, tokens, softcap)
        return np.asarray(state.result())

    tiled = run()
    monkeypatch.setattr(attention, "NEW_TILE", tokens)
    whole = run()
    real = np.repeat(np.asarray(jnp.arange(tokens)[None, :] < num_new[:, None]), n_rep, axis=1)  # [batch, rows]
    assert np.abs(tiled - whole).transpose(0, 2, 1, 3)[real].max() <= 1e-5


@pytest.mark.parametrize("tokens", [5, 40, 150])
def test_a_chunk_of_bfloat16_queries_dots_in_bfloat16(tokens):
    """Queries in bfloat16 (the model's matmuls dot in bfloat16): a chunk of many rows (`many_rows`) dots keys,
    values and probabilities in bfloat16 over every segment (quantized blocks, ring, its own tokens, in causal tiles
    past NEW_TILE): within bfloat16 rounding of the dense reference and not its float32 answer; a shorter one (a
    decode step's few rows) stays float32, as exact as float32 queries."""
    batch = 2
    k, v = random_kv(21, batch, 4 * R)
    rng = np.random.RandomState(22)
    cache = append_tokens(KIVICache.create(CFG, KIVI, batch, 4 * R + -(-tokens // R) * R), k, v,
                          jnp.asarray([R + 9, 3 * R + 2]))
    num_new = jnp.asarray([tokens, tokens - 2])
    q = jnp.asarray(rng.randn(batch, tokens, CFG.num_heads, CFG.head_dim).astype(np.float32)).astype(jnp.bfloat16)
    k_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    positions = cache.length[:, None] + jnp.arange(tokens)[None, :]
    rows = attention.group_queries(q, positions, CFG.num_kv_heads)
    many = attention.many_rows(tokens * (CFG.num_heads // CFG.num_kv_heads))
    assert rows.dot_dtype == (jnp.bfloat16 if many else jnp.float32)
    real = np.asarray(jnp.arange(tokens)[None, :] < num_new[:, None])
    for layer in range(CFG.num_layers):
        ref = dense_chunk_reference(q.astype(jnp.float32), cache, layer, k_new, v_new, num_new)
        ours = attention.attend_kivi_xla(q, positions, cache.k, cache.v, layer, cache.k_ring[layer],
                                         cache.v_ring[layer], cache.length, k_new, v_new, num_new, None)
        assert ours.dtype == jnp.bfloat16
        err = np.abs(np.asarray(ours.astype(jnp.float32) - ref))[real].max()
        scale = np.abs(np.asarray(ref))[real].max()
        if many:
            # keys, values and probabilities each rounded to 8 bits of mantissa, and random_kv's keys carry a x20
            # outlier channel whose products round coarsest: 0.8-2.4% of the output's scale seen
            assert 1e-4 * scale < err <= 4e-2 * scale, (layer, err, scale)
        else:  # float32 dots; only the output's own rounding to bfloat16
            assert err <= 2**-8 * scale, (layer, err, scale)


@pytest.mark.parametrize("held", [0, 5])
def test_a_chunk_onto_an_empty_ring_skips_it_exactly(held, monkeypatch):
    """A chunk's ring segment runs under a condition (skipped while no row sees a ring token, as on a prompt's first
    chunk): bit for bit what computing it gives, with the ring empty and with a few tokens in it."""
    batch, tokens = 2, 70
    k, v = random_kv(23, batch, 8)
    cache = append_tokens(KIVICache.create(CFG, KIVI, batch, 4 * R), k, v, jnp.asarray([held, 0]))
    rng = np.random.RandomState(24)
    q = jnp.asarray(rng.randn(batch, tokens, CFG.num_heads, CFG.head_dim).astype(np.float32))
    k_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    positions = cache.length[:, None] + jnp.arange(tokens)[None, :]

    def run():
        return np.asarray(attention.attend_kivi_xla(q, positions, cache.k, cache.v, 0, cache.k_ring[0],
                                                    cache.v_ring[0], cache.length, k_new, v_new,
                                                    jnp.asarray([tokens, 40]), None))

    skipped = run()
    monkeypatch.setattr(attention, "DEQUANTIZE_ROWS", 10**6)  # as a decode step: the ring always computed
    np.testing.assert_array_equal(skipped, run())


def test_a_sequence_given_no_new_tokens_is_left_exactly_as_it_was():
    k, v = random_kv(15, 2, 2 * R)
    cache = append_tokens(KIVICache.create(CFG, KIVI, 2, 4 * R), k, v, jnp.asarray([R + 3, R + 7]))
    after = append_tokens(cache, k[:, :, :, :4], v[:, :, :, :4], jnp.asarray([0, 4]))
    row0 = lambda c: jax.tree_util.tree_map(lambda x: x[:1] if x.ndim == 1 else x[:, :1], c)
    leaves_equal(row0(after), row0(cache))
    assert after.length.tolist() == [R + 3, R + 11]


def test_writes_past_capacity_and_bad_token_ids_never_give_silent_numbers():
    from kivi_jax.cache import BAD_TOKEN, PAST_CAPACITY, CacheCapacityError
    from kivi_jax.models.llama import init_params

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32)
    params = init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"token ids \[64\] in sequences \[1\] are outside the vocabulary \[0, 64\)"):
        forward(params, jnp.asarray([[1, 2], [3, 64]]), make_cache("full", cfg, 2, 32))
    with pytest.raises(ValueError, match=r"num_new=\[3, 1\] must count real tokens of each sequence, between 0 and 2"):
        forward(params, jnp.asarray([[1, 2], [3, 4]]), make_cache("full", cfg, 2, 32), jnp.asarray([3, 1]))
    with pytest.raises(ValueError, match=r"logits_at=\[2, 0\] must pick a token index in \[0, 2\)"):
        forward(params, jnp.asarray([[1, 2], [3, 4]]), None, logits_at=jnp.asarray([2, 0]))
    with pytest.raises(CacheCapacityError, match="sequence 0 holds 0 tokens and gets 40 more, past the cache's 32"):
        forward(params, jnp.zeros((1, 40), jnp.int32), make_cache("full", cfg, 1, 32))
    # under jit the values are traced: the sequence is flagged and its logits are NaN, the others untouched
    for spec in ("full", "k2v2-g16-r32"):
        logits, cache = step(params, jnp.asarray([[1, 2], [3, -1]]), make_cache(spec, cfg, 2, 32))
        assert cache.error_flags.tolist() == [0, BAD_TOKEN]
        assert np.isfinite(np.asarray(logits[0])).all() and np.isnan(np.asarray(logits[1])).all()
        logits, cache = step(params, jnp.zeros((2, 31), jnp.int32), cache, jnp.asarray([31, 1]))  # 2 + 31 > 32
        assert cache.error_flags.tolist() == [PAST_CAPACITY, BAD_TOKEN]
        assert np.isnan(np.asarray(logits)).all()


@pytest.mark.parametrize("chunk", [64, 100, 128, 512, None])
def test_a_prompts_chunk_plan_covers_it_and_its_calls_past_a_chunk_end_are_its_own(chunk):
    """Every call but the last is `width` wide; the last covers the rest in whole buckets (less than one bucket of
    padding); the plan of what follows any chunk end, in calls of `width`, is the rest of the prompt's plan."""
    for tokens in [1, 63, 64, 65, 130, 511, 512, 513, 577, 1090, 2048, 2049]:
        plan = runtime.chunk_plan(tokens, chunk)
        widths = plan.widths()
        assert len(widths) == plan.chunks and plan.width == runtime.chunk_size(tokens, chunk)
        assert all(w == plan.width for w in widths[:-1]) and 0 < plan.tail <= plan.width
        assert sum(widths) - plan.width < tokens <= sum(widths) < tokens + max(runtime.PROMPT_BUCKET, runtime.MIN_CHUNK)
        assert sum(widths) < tokens + runtime.PROMPT_BUCKET or plan.tail == min(runtime.MIN_CHUNK, plan.width)
        assert plan.tail % runtime.PROMPT_BUCKET == 0 or plan.tail == plan.width
        for k in range(1, plan.chunks):
            assert runtime.chunk_plan(tokens - k * plan.width, plan.width).widths() == widths[k:]


@pytest.mark.parametrize("spec", ["k2v2-g8-r16", "full"])
def test_a_prefill_after_a_chunk_end_is_the_prompts_own_prefill_bit_for_bit(tiny_dirs, spec):
    """A prompt prefilled whole (two 128-token chunks, then a narrower last one) and the same prompt prefilled up
    to a chunk end, then the rest onto that cache (what a shared prefix and longctx's shared documents do): the
    same stores and the same logits, to the bit."""
    params = load_hf(tiny_dirs["llama_mha"][0])
    cfg = params.config
    prompt = np.random.RandomState(5).randint(3, TINY_VOCAB, (1, 2 * 128 + 37)).astype(np.int32)
    assert runtime.chunk_plan(prompt.shape[1], 128) == (128, 3, 64)
    make = lambda: make_cache(parse_cache_spec(spec), cfg, 1, 384, params.dtype, "xla")
    whole_logits, whole = runtime.prefill(params, prompt, np.array([prompt.shape[1]]), make(), 128)
    for end in (128, 256):
        _, part = runtime.prefill(params, prompt[:, :end], np.array([end]), make(), 128)
        logits, part = runtime.prefill(params, prompt[:, end:], np.array([prompt.shape[1] - end]), part, 128)
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(whole_logits))
        leaves_equal(part, whole)
