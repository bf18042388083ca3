"""The KIVI decode kernel reading pools of pages through a block table (`decode(..., table=...)`): in interpret mode
it equals the XLA path over the same `PagedStore`s (float32: 1e-5) on random pools with shuffled, non-contiguous
tables and a ragged batch; NaN in pages a sequence does not hold, and in the rows of its pages it has not written,
changes no bit; and the real Triton lowering of the paged kernel succeeds."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention
from kivi_jax.cache import PagedStore, make_cache
from kivi_jax.config import parse_cache_spec
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import flash_decoding, kivi_decode

from test_pallas_lowering import KIVI_MATRIX, TRITON_CALLS, lowered_for_cuda, sds

TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}
R = 128
LENGTHS = [0, 1, R - 1, R, R + 1, 3 * R + 17]  # none a multiple of a step past the first flush
PAGES_PER_SEQ = 4  # max_tokens = 4R
EXTRA_PAGE = 4  # this sequence (R + 1 tokens) also holds the page of its next block, nothing written there yet
POOL_PAGES = 10  # 6 held, 4 free


def inv_freq(head_dim: int) -> jax.Array:
    return 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def shuffled_table(rng):
    """`[batch, PAGES_PER_SEQ]` int32: each sequence's `length // R` blocks (and one extra) on pages in random order;
    the rest hold no page (entry POOL_PAGES)."""
    table = np.full((len(LENGTHS), PAGES_PER_SEQ), POOL_PAGES, np.int32)
    free = list(rng.permutation(POOL_PAGES))
    for b, n in enumerate(LENGTHS):
        for j in range(n // R + (b == EXTRA_PAGE)):
            table[b, j] = free.pop()
    return table


def random_pool(store, rng):
    """The pool store filled with random codes, positive float16 scales and float16 mins on every page."""
    codes = rng.randint(0, 256, store.codes.shape).astype(np.uint8)
    scale = rng.uniform(0.05, 0.5, store.scale.shape).astype(np.float16)
    mn = rng.uniform(-1.0, 1.0, store.mn.shape).astype(np.float16)
    return store.replace(codes=jnp.asarray(codes), scale=jnp.asarray(scale), mn=jnp.asarray(mn))


def poisoned(store: PagedStore, table, end) -> PagedStore:
    """The store with NaN scales and mins in every page not held and in every row of a held page at or past the
    sequence's quantized end `end [batch]` (codes there random already)."""
    g = store.group_size if store.axis == "channel" else 1
    scale, mn = np.array(store.scale), np.array(store.mn)
    held = set(table[table < POOL_PAGES].tolist())
    for page in set(range(POOL_PAGES)) - held:
        scale[:, page] = mn[:, page] = np.nan
    per_page = scale.shape[3]  # scale rows a page
    for b, e in enumerate(end):
        for j, page in enumerate(table[b]):
            if page < POOL_PAGES:
                first = max(int(e) // g - j * per_page, 0)
                scale[:, page, :, first:] = mn[:, page, :, first:] = np.nan
    return store.replace(scale=jnp.asarray(scale), mn=jnp.asarray(mn))


def paged_inputs(spec, layers, kv_heads, n_rep, head_dim, seed):
    """Random clean and poisoned paged stores, rings, sinks and the new token for LENGTHS."""
    rng = np.random.RandomState(seed)
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=layers,
                      num_heads=kv_heads * n_rep, num_kv_heads=kv_heads, head_dim=head_dim)
    batch = len(LENGTHS)
    cache = make_cache(spec, cfg, batch, PAGES_PER_SEQ * R, pages=POOL_PAGES)
    assert cache.residual == R
    table = shuffled_table(rng)
    length = jnp.asarray(LENGTHS, jnp.int32)
    stores, dirty = [], []
    for store in (cache.k, cache.v):
        pool = random_pool(store, rng)
        end = pool.quantized_end(length, R)  # [batch]
        stores.append(PagedStore.of(pool, jnp.asarray(table), end))
        dirty.append(poisoned(stores[-1], table, np.asarray(end)))
    ring = lambda: jnp.asarray(rng.randn(layers, batch, kv_heads, R, head_dim), jnp.float32)
    rings = (ring(), ring())  # [layers, batch, kv_heads, R, D] each
    sinks = None
    if cache.k_sink is not None:
        sink = lambda: jnp.asarray(rng.randn(*cache.k_sink.shape), jnp.float32)
        sinks = (sink(), sink())  # [layers, batch, kv_heads, S, D] each
    step = lambda *s: jnp.asarray(rng.randn(*s), jnp.float32)
    q, k_new, v_new = step(batch, 1, kv_heads * n_rep, head_dim), *(step(batch, 1, kv_heads, head_dim)
                                                                   for _ in range(2))
    return stores, dirty, rings, sinks, length, q, k_new, v_new


# (spec, kv_heads, n_rep, window, num_splits, tokens_per_step): KIVI-2, 4-bit keys, and 3-bit keys before RoPE with
# sinks and a window reaching into the quantized tokens
CASES = [
    ("kivi2", 2, 2, None, None, kivi_decode.TOKENS_PER_STEP),
    ("k4v2-g32-r128", 1, 3, 150, 2, 32),
    ("k3v2-g64-r128-prerope-s4", 1, 2, 200, 3, kivi_decode.TOKENS_PER_STEP),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_kernel_equals_the_xla_path_and_ignores_poison(case):
    spec, kv_heads, n_rep, window, num_splits, tokens_per_step = case
    kivi = parse_cache_spec(spec)
    head_dim = 64
    stores, dirty, rings, sinks, length, q, k_new, v_new = paged_inputs(spec, 2, kv_heads, n_rep, head_dim,
                                                                        seed=CASES.index(case))
    freqs = inv_freq(head_dim) if kivi.pre_rope else None

    def run(k_store, v_store, rings, sinks, layer):
        k_sink, v_sink = (None, None) if sinks is None else sinks
        kernel = kivi_decode.decode(
            q, k_store.codes, k_store.scale, k_store.mn, v_store.codes, v_store.scale, v_store.mn, *rings, layer,
            length, k_new, v_new, k_bits=kivi.k_bits, v_bits=kivi.v_bits, group_size=kivi.group_size, window=window,
            k_sink=k_sink, v_sink=v_sink, inv_freq=freqs, table=k_store.table, num_splits=num_splits,
            tokens_per_step=tokens_per_step, interpret=True)
        one = None if sinks is None else (sinks[0][layer], sinks[1][layer])
        xla = attention.decode_kivi_xla(q, k_store, v_store, layer, rings[0][layer], rings[1][layer], length, k_new,
                                        v_new, window, sinks=one, inv_freq=freqs)
        return kernel, xla

    layer = jnp.int32(1)  # traced
    fn = jax.jit(run).lower(*stores, rings, sinks, layer).compile(FAST)
    kernel, xla = (np.asarray(x) for x in fn(*stores, rings, sinks, layer))
    dirty_kernel, dirty_xla = (np.asarray(x) for x in fn(*dirty, rings, sinks, layer))
    assert np.isfinite(kernel).all()
    assert np.abs(kernel - xla).max() <= TOL, np.abs(kernel - xla).max()
    assert np.abs(xla).max() > 0.1  # a real output
    np.testing.assert_array_equal(dirty_kernel, kernel)  # poison in pages or rows not attended: not one bit
    np.testing.assert_array_equal(dirty_xla, xla)


# Every shipped configuration (tests/test_pallas_lowering.py's matrix) in paged mode, without a window (the window is
# a few scalar ops the contiguous lowering already covers)
@pytest.mark.parametrize("k_bits, v_bits, group, head_dim, dtype, pre_rope", KIVI_MATRIX,
                         ids=[f"k{kb}v{vb}-g{g}-d{d}-{dt}" + ("-prerope-s4" if r else "")
                              for kb, vb, g, d, dt, r in KIVI_MATRIX])
def test_paged_kivi_kernel_lowers_to_triton(k_bits, v_bits, group, head_dim, dtype, pre_rope):
    layers, batch, kv_heads, q_heads, pages, per_seq, residual, sinks = 3, 2, 2, 6, 7, 4, 128, 4
    lead = (layers, pages, kv_heads)  # pools
    args = (
        sds((batch, 1, q_heads, head_dim), dtype),
        sds(lead + (residual, head_dim * k_bits // 8), jnp.uint8),
        sds(lead + (residual // group, head_dim), jnp.float16),
        sds(lead + (residual // group, head_dim), jnp.float16),
        sds(lead + (residual, head_dim * v_bits // 8), jnp.uint8),
        sds(lead + (residual, head_dim // group), jnp.float16),
        sds(lead + (residual, head_dim // group), jnp.float16),
        sds((layers, batch, kv_heads, residual, head_dim), dtype),
        sds((layers, batch, kv_heads, residual, head_dim), dtype),
        sds((), jnp.int32),  # the layer: traced
        sds((batch,), jnp.int32),
        sds((batch, 1, kv_heads, head_dim), dtype),
        sds((batch, 1, kv_heads, head_dim), dtype),
        sds((batch, per_seq), jnp.int32),  # the block table
    )
    extra = (sds((layers, batch, kv_heads, sinks, head_dim), dtype),
             sds((layers, batch, kv_heads, sinks, head_dim), dtype),
             sds((head_dim // 2,), jnp.float32)) if pre_rope else ()

    def decode(*a):
        k_sink, v_sink, inv = a[14:] if pre_rope else (None, None, None)
        return kivi_decode.decode(*a[:13], k_bits=k_bits, v_bits=v_bits, group_size=group, window=300 if pre_rope
                                  else None, k_sink=k_sink, v_sink=v_sink, inv_freq=inv, table=a[13],
                                  interpret=False)

    text = lowered_for_cuda(decode, *args, *extra)
    [call] = [line for line in text.splitlines() if any(t in line for t in TRITON_CALLS)]
    assert f"tensor<{layers}x{pages}x{kv_heads}x{residual}x" in call and f"tensor<{batch}x{per_seq}xi32>" in call


@pytest.mark.parametrize("spec", ["kivi2", "k3v2-g64-r128-prerope-s4"])
def test_model_decode_step_over_a_paged_cache_lowers_with_the_kernel_reading_the_pools(spec, monkeypatch):
    """forward() over a paged cache with impl='pallas', lowered for CUDA: the kernel (no fallback) gets the pools
    and the block table themselves."""
    monkeypatch.setattr(flash_decoding, "interpret_default", lambda interpret: False)  # the real kernel, not on GPU
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=None)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: make_cache(spec, cfg, 2, 1024, jnp.bfloat16, impl="pallas", pages=13))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to the XLA path
        text = lowered_for_cuda(lambda p, t, c: forward(p, t, c), params, sds((2, 1), jnp.int32), cache)
    [call] = [line for line in text.splitlines() if any(t in line for t in TRITON_CALLS)]
    assert "tensor<3x13x2x128x" in call and "tensor<2x8xi32>" in call  # the pools and the table [batch, 1024 / R]
