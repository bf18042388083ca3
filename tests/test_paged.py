"""The paged cache (docs/design.md §12): a pool of pages read and written through block tables gives what the
contiguous cache gives — the same logits and bit-identical stores — whatever pages the host hands out, and nothing in
a page a sequence does not hold (or has not written yet) reaches its attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax.cache import FullCache, FullUpdate, KIVICache, cache_bytes, make_cache
from kivi_jax.config import parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.decoder import init_params
from kivi_jax.models.protocol import PAST_CAPACITY
from kivi_jax import paged
from kivi_jax.paged import FULL_PAGE_TOKENS
from kivi_jax.models.llama import forward
from kivi_jax.rotation import prepare_params

CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32)
MISTRAL = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, sliding_window=21)
BATCH, MAX_TOKENS = 3, 192
TOL = 1e-5  # logits: the same arithmetic on the same numbers, up to how XLA fuses a gather (bits differ by an ulp)
step = jax.jit(forward, donate_argnames=("cache",))


def page_tokens(cache) -> int:
    return cache.residual if isinstance(cache, KIVICache) else cache.k.shape[3]


def pages_needed(cache, length: int) -> int:
    """Pages a sequence of `length` tokens holds: whole R-blocks for KIVI (the ring is its tail), every started page
    for the full-precision cache."""
    page = page_tokens(cache)
    return length // page if isinstance(cache, KIVICache) else -(-length // page)


def poisoned(cache, owned: set, rng):
    """The cache with every pool page outside `owned` holding NaN (floats) and random codes (uint8)."""
    free = np.array(sorted(set(range(cache.num_pages)) - owned), int)

    def poison(x):
        if x.ndim != 5 or x.shape[1] != cache.num_pages or not len(free):
            return x
        junk = rng.randint(0, 256, x[:, free].shape).astype(np.uint8) if x.dtype == jnp.uint8 else np.nan
        return x.at[:, free].set(junk)

    out = cache.replace(**{n: jax.tree_util.tree_map(poison, getattr(cache, n)) for n in ("k", "v")})
    if isinstance(cache, KIVICache) and cache.first is not None:
        out = out.replace(first=poisoned(cache.first, owned, rng))
    return out


def workload(rng, lengths):
    """Random ragged chunks `(width, counts)`: calls of 40, 9 or 1 token slots a sequence, each sequence taking 0 to
    `width` of them (so three shapes compile)."""
    done, chunks = np.zeros(len(lengths), int), []
    while (done < lengths).any():
        width = rng.choice([40, 9, 1]) if chunks else 40
        counts = np.minimum(rng.randint(0, width + 1, len(lengths)), lengths - done)
        if not counts.any():
            continue
        chunks.append((width, counts))
        done += counts
    return chunks


def hand_out(cache, table, free, done, counts):
    """Gives each sequence, from the shuffled `free` list, the pages its next `counts` tokens need (the host's job)."""
    for b, n in enumerate(counts):
        for j in range(pages_needed(cache, done[b]), pages_needed(cache, done[b] + n)):
            table[b, j] = free.pop()
    return cache.with_table(table)


def paged_twin(spec, cfg, rng):
    """A paged cache with half again the pages the sequences need (free pages to poison), its empty host table and
    its pages in random order."""
    page = page_tokens(make_cache(spec, cfg, 1, MAX_TOKENS, pages=1))
    pool_pages = 3 * BATCH * MAX_TOKENS // page // 2
    cache = make_cache(spec, cfg, BATCH, MAX_TOKENS, pages=pool_pages)
    return cache, np.full(cache.table.shape, pool_pages, np.int32), list(rng.permutation(pool_pages))


def feed_model(params, spec, lengths, seed, paged: bool, poison: bool = False):
    """Feeds a random ragged workload (the same for the same seed) through the model onto a contiguous or a paged
    cache (pages handed out in random order, every page not held poisoned before each call when `poison`); returns
    every fed token's logits, the cache and the table."""
    rng = np.random.RandomState(seed)
    cfg = params.config
    tokens = rng.randint(1, cfg.vocab_size, (BATCH, int(lengths.max()))).astype(np.int32)
    chunks = workload(rng, lengths)
    cache, table, free = paged_twin(spec, cfg, rng)
    if not paged:
        cache = make_cache(spec, cfg, BATCH, MAX_TOKENS)
    done, out = np.zeros(BATCH, int), []
    for width, counts in chunks:
        block = np.zeros((BATCH, width), np.int32)
        for b, n in enumerate(counts):
            block[b, :n] = tokens[b, done[b] : done[b] + n]
        if paged:
            cache = hand_out(cache, table, free, done, counts)
            if poison:
                cache = poisoned(cache, set(table[table < cache.num_pages].tolist()), rng)
        logits, cache = step(params, jnp.asarray(block), cache, jnp.asarray(counts, jnp.int32))
        out += [np.asarray(logits[b, :n]) for b, n in enumerate(counts)]
        done += counts
    return out, cache, table


def rows_held(x, table, end: int, b: int, per_page: int) -> np.ndarray:
    """Rows `[0, end)` of sequence `b`: `x [layers, batch, kv_heads, rows, X]` contiguous (`table` None) or a pool
    `[layers, pages, kv_heads, per_page, X]` read through the table -> `[layers, kv_heads, end, X]`."""
    x = np.asarray(x)
    if table is None:
        return x[:, b, :, :end]
    pages = [x[:, table[b, j]] for j in range(-(-end // per_page))]
    return np.concatenate(pages, axis=2)[:, :, :end] if pages else x[:, 0, :, :0]


def stored(cache, table=None) -> dict:
    """What a cache holds for its sequences, as bytes: every row each sequence has written (keys and values, codes,
    scales and mins), rings, sinks, lengths and flags — the same for a contiguous and a paged cache of the same
    tokens, whatever pages the paged one was handed."""
    lengths = np.asarray(cache.length)
    out = {"length": lengths, "flags": np.asarray(cache.error_flags)}
    if isinstance(cache, FullCache):
        for name in ("k", "v"):
            for b, n in enumerate(lengths):
                out[name, b] = rows_held(getattr(cache, name), table, int(n), b, FULL_PAGE_TOKENS)
        return out
    for part, c in (("rest", cache), ("first", cache.first)):
        if c is None:
            continue
        for name in ("k", "v"):
            store = getattr(c, name)
            ends = np.asarray(store.quantized_end(jnp.asarray(lengths), c.residual))
            g = store.group_size if store.axis == "channel" else 1
            for b, end in enumerate(ends):
                out[part, name, "codes", b] = rows_held(store.codes, table, int(end), b, c.residual)
                for leaf in ("scale", "mn"):
                    out[part, name, leaf, b] = rows_held(getattr(store, leaf), table, int(end) // g, b, c.residual // g)
        for leaf in ("k_ring", "v_ring", "k_sink", "v_sink"):
            if getattr(c, leaf) is not None:
                out[part, leaf] = np.asarray(getattr(c, leaf))
    return out


def assert_same_stores(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(b[key].view(np.uint8), a[key].view(np.uint8), err_msg=str(key))


SPECS = ["full", "k2v2-g16-r32", "k4v2-g16-r32", "k2v2-g16-r32-ktok-vchan", "k2v2-g16-r32-s4-prerope",
         "k2v2-g16-r32-l1k4v4", "k2v2-g16-r32-rotv-rotk", "k2v2-g16-r32-ringf16"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_paged_model_gives_the_contiguous_logits_for_ragged_chunks_and_shuffled_pages(spec):
    cfg = MISTRAL if spec == "k2v2-g16-r32" else CFG
    params = prepare_params(init_params(cfg, jax.random.PRNGKey(0)), parse_cache_spec(spec))
    lengths = np.array([150, 77, 31])
    flat, flat_cache, _ = feed_model(params, spec, lengths, seed=1, paged=False)
    paged, paged_cache, _ = feed_model(params, spec, lengths, seed=1, paged=True)
    for a, b in zip(flat, paged):
        np.testing.assert_allclose(b, a, rtol=0, atol=TOL)
    assert (np.asarray(paged_cache.length) == lengths).all() and not np.asarray(paged_cache.error_flags).any()


def random_chunk(rng, cache, width):
    """Random keys and values `[layers, batch, kv_heads, width, head_dim]` with an outlier channel, like real keys."""
    shape = (CFG.num_layers, BATCH, CFG.num_kv_heads, width, CFG.head_dim)
    k, v = rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)
    k[..., 3] *= 20.0
    return jnp.asarray(k), jnp.asarray(v)


@jax.jit
def append(cache, k, v, num_new):
    """Appends `k, v [layers, batch, kv_heads, T, head_dim]` (`num_new [batch]` real) through the cache protocol."""
    if isinstance(cache, FullCache):
        return cache.commit(FullUpdate(k, v), num_new)
    parts = [cache] if cache.first is None else [cache.first, cache.replace(first=None)]
    n = 0 if cache.first is None else cache.config.first_layers
    ups = []
    for i, part in enumerate(parts):
        lo, hi = (0, k.shape[0]) if len(parts) == 1 else ((0, n), (n, k.shape[0]))[i]
        ups.append(stack([part.append_update(part.k_ring[l - lo], part.v_ring[l - lo], k[l], v[l], num_new)
                          for l in range(lo, hi)]))
    if len(parts) == 1:
        return cache.commit(ups[0], num_new)
    zeros = lambda u, m: jax.tree_util.tree_map(lambda x: jnp.zeros((m,) + x.shape[1:], x.dtype), u)
    first = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ups[0], zeros(ups[0], k.shape[0] - n))
    rest = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), zeros(ups[1], n), ups[1])
    return cache.commit((first, rest), num_new)


def stack(updates):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *updates)


@pytest.mark.parametrize("spec", ["full", "k2v2-g16-r32", "k4v2-g16-r32", "k2v2-g16-r32-ktok-vchan",
                                  "k2v2-g16-r32-s4-prerope", "k2v2-g16-r32-l1k4v4"])
def test_paged_stores_equal_contiguous_bit_for_bit(spec):
    """The same keys and values appended in the same random ragged chunks: every row each sequence has written, read
    through its (shuffled) table, equals the contiguous cache's bit for bit, and so do rings and sinks."""
    rng = np.random.RandomState(5)
    lengths = np.array([170, 64, 33])
    flat = make_cache(spec, CFG, BATCH, MAX_TOKENS)
    pages, table, free = paged_twin(spec, CFG, rng)
    done = np.zeros(BATCH, int)
    for width, counts in workload(rng, lengths):
        k, v = random_chunk(rng, flat, width)
        pages = hand_out(pages, table, free, done, counts)
        num_new = jnp.asarray(counts, jnp.int32)
        flat, pages = append(flat, k, v, num_new), append(pages, k, v, num_new)
        done += counts
    assert_same_stores(stored(flat), stored(pages, table))
    assert not np.asarray(pages.error_flags).any()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["full", "k2v2-g16-r32", "k2v2-g16-r32-s4-prerope"])
def test_poisoned_free_pages_change_no_output(spec):
    """NaN and random codes in every page a sequence does not hold — and so in the rows of its own pages it has not
    written yet (a page is handed out before all its values arrive) — change no logit and no stored bit."""
    params = init_params(CFG, jax.random.PRNGKey(2))
    lengths = np.array([140, 95, 20])
    clean, clean_cache, table = feed_model(params, spec, lengths, seed=3, paged=True)
    dirty, dirty_cache, dirty_table = feed_model(params, spec, lengths, seed=3, paged=True, poison=True)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(b, a)
    assert (table == dirty_table).all()
    assert_same_stores(stored(clean_cache, table), stored(dirty_cache, table))


def test_a_write_onto_a_page_not_held_is_flagged_and_dropped():
    params = init_params(CFG, jax.random.PRNGKey(4))
    cache = make_cache("k2v2-g16-r32", CFG, 2, 128, pages=8)
    table = np.full((2, 4), 8, np.int32)
    table[0, 0] = 5  # sequence 0 holds the page its first block needs; sequence 1 holds none
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 64, (2, 40)), jnp.int32)
    before = np.asarray(cache.k.codes)
    _, cache = step(params, tokens, cache.with_table(table))
    flags = np.asarray(cache.error_flags)
    assert flags[0] == 0 and flags[1] & PAST_CAPACITY
    codes = np.asarray(cache.k.codes)
    untouched = [p for p in range(8) if p != 5]
    np.testing.assert_array_equal(codes[:, untouched], before[:, untouched])


@pytest.mark.parametrize("spec", ["full", "kivi2", "kivi4", "k2v2-g32-r128-ktok-vchan", "k2v2-g32-r128-s4", "k2v2-g32-r128-l2k4v4"])
def test_paged_bytes_equal_the_formula(spec):
    cfg = LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=128)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = jax.eval_shape(lambda: make_cache(spec, cfg, 4, 1024, dtype, pages=20))
        itemsize = jnp.dtype(dtype).itemsize
        tree = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
        assert tree == cache_bytes(spec, cfg, 4, 1024, itemsize, pages=20)


def test_paged_caches_refuse_what_they_do_not_offer():
    with pytest.raises(ValueError, match="whole number of pages"):
        make_cache("kivi2", CFG, 2, 256, pages=0)
    with pytest.raises(ValueError, match="not offered for int8"):
        make_cache("int8", CFG, 2, 256, pages=4)
    with pytest.raises(ValueError, match="whole pages of 16 tokens; round it up to 112"):
        make_cache("full", CFG, 2, 100, pages=4)


def test_a_table_entry_that_holds_no_page_reads_zeros_and_never_the_pool():
    pool = jnp.full((2, 5, 3, 4, 8), jnp.nan)  # [layers, pages, kv_heads, rows, X]: every page poison
    table = paged.empty_table(2, 3, 5)
    assert (paged.read_pages(pool, 1, table, 0, 3) == 0).all()
    assert (paged.read_rows(pool, 1, table, jnp.asarray([[0, 5, 11], [3, 4, 2]])) == 0).all()
    dropped = paged.write_rows(pool, table, jnp.asarray([[0, 1], [2, 3]]), jnp.ones((2, 2, 3, 2, 8)))
    assert jnp.isnan(dropped).all()
