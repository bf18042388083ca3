"""The Pallas TPU (Mosaic) KIVI decode kernel reading pools of pages through a block table (`decode(..., table=...)`,
the table a scalar-prefetch operand): in TPU interpret mode (race detector on, uninitialized VMEM NaN) it equals the
XLA path over the same `PagedStore`s (float32: 1e-5) through shuffled, non-contiguous tables at several shapes, with
lengths that are multiples of no block and steps of several blocks partly held; NaN in pages a sequence does not
hold, and in the rows of its pages it has not written, changes no bit; the paged kernel lowers for TPU; and a model
decode step over a paged cache lowers for TPU with the kernel (no fallback) reading the pools and the table."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kivi_jax import attention
from kivi_jax.cache import PagedStore, make_cache
from kivi_jax.config import KIVIConfig
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import kivi_decode_tpu

from test_pallas_tpu import COVERING, TPU_CALL, races_found, sds
from tpu_target import tpu_target

TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}


def inv_freq(head_dim: int) -> jax.Array:
    return 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def shuffled_table(rng, lengths, residual, per_seq, pool_pages, extra):
    """`[batch, per_seq]` int32: sequence b's `length // R` blocks (and one more for b in `extra`, nothing written
    there yet) on pages drawn in random order; the other entries hold no page (`pool_pages`)."""
    table = np.full((len(lengths), per_seq), pool_pages, np.int32)
    free = list(rng.permutation(pool_pages))
    for b, n in enumerate(lengths):
        for j in range(n // residual + (b in extra)):
            table[b, j] = free.pop()
    return table


def random_pool(store, rng):
    """The pool store with random codes, positive float16 scales and float16 mins on every page."""
    return store.replace(codes=jnp.asarray(rng.randint(0, 256, store.codes.shape), jnp.uint8),
                         scale=jnp.asarray(rng.uniform(0.05, 0.5, store.scale.shape), jnp.float16),
                         mn=jnp.asarray(rng.uniform(-1.0, 1.0, store.mn.shape), jnp.float16))


def poisoned(store: PagedStore, table, end, pool_pages) -> PagedStore:
    """The store with NaN scales and mins in every page no sequence holds and in every row of a held page at or past
    its sequence's quantized end `end [batch]` (the codes there are random already)."""
    g = store.group_size if store.axis == "channel" else 1
    scale, mn = np.array(store.scale), np.array(store.mn)  # [layers, pages, kv_heads, rows, X]
    for page in set(range(pool_pages)) - set(table[table < pool_pages].tolist()):
        scale[:, page] = mn[:, page] = np.nan
    per_page = scale.shape[3]
    for b, e in enumerate(end):
        for j, page in enumerate(table[b]):
            if page < pool_pages:
                first = max(int(e) // g - j * per_page, 0)
                scale[:, page, :, first:] = mn[:, page, :, first:] = np.nan
    return store.replace(scale=jnp.asarray(scale), mn=jnp.asarray(mn))


# (name, config, head_dim, kv_heads, n_rep, lengths as f(R), table entries a sequence, pool pages, sequences with a
# page past their blocks, window, splits, tokens a step): 2-bit KIVI with steps of two blocks (a step's second block
# often holds no page); 4-bit keys at head_dim 128 and R = 64 with a window into the quantized tokens and two
# splits; 3-bit keys before RoPE with sinks, a window, three splits. Lengths: empty, ring-only, at and past a flush,
# between flushes; none a multiple of a step.
CASES = [
    ("kivi2-2blocks-a-step", KIVIConfig(2, 2, 32, 128), 64, 2, 2, lambda r: [0, 1, r + 1, 3 * r + 17], 4, 9, (1,),
     None, 1, 256),
    ("k4v2-g32-r64-d128-window", KIVIConfig(4, 2, 32, 64), 128, 1, 3, lambda r: [r - 1, 2 * r + 5, 5 * r + 33], 6,
     10, (0,), 150, 2, 128),
    ("k3v2-g64-prerope-s4-window", KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4), 64, 1, 2,
     lambda r: [3, r, 3 * r + 17], 4, 7, (0, 1), 200, 3, 256),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_interpret_mode_equals_the_xla_path_and_ignores_poison(case):
    name, kivi, head_dim, kv_heads, n_rep, lengths, per_seq, pool_pages, extra, window, splits, per_step = case
    i = CASES.index(case)
    rng = np.random.RandomState(700 + i)
    residual, layers = kivi.residual_length, 2
    lengths = lengths(residual)
    batch = len(lengths)
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=layers,
                      num_heads=kv_heads * n_rep, num_kv_heads=kv_heads, head_dim=head_dim)
    cache = make_cache(kivi, cfg, batch, per_seq * residual, pages=pool_pages)
    table = shuffled_table(rng, lengths, residual, per_seq, pool_pages, extra)  # [batch, per_seq]
    length = jnp.asarray(lengths, jnp.int32)
    stores, dirty = [], []
    for store in (cache.k, cache.v):
        pool = random_pool(store, rng)
        end = pool.quantized_end(length, residual)  # [batch]
        stores.append(PagedStore.of(pool, jnp.asarray(table), end))
        dirty.append(poisoned(stores[-1], table, np.asarray(end), pool_pages))
    dense = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)
    rings = tuple(dense(layers, batch, kv_heads, residual, head_dim) for _ in range(2))
    sinks = None if cache.k_sink is None else tuple(dense(*cache.k_sink.shape) for _ in range(2))
    q, k_new, v_new = dense(batch, 1, kv_heads * n_rep, head_dim), *(dense(batch, 1, kv_heads, head_dim)
                                                                    for _ in range(2))
    freqs = inv_freq(head_dim) if kivi.pre_rope else None

    def run(k_store, v_store, layer):
        k_sink, v_sink = (None, None) if sinks is None else sinks
        kernel = kivi_decode_tpu.decode(
            q, k_store.codes, k_store.scale, k_store.mn, v_store.codes, v_store.scale, v_store.mn, *rings, layer,
            length, k_new, v_new, k_bits=kivi.k_bits, v_bits=kivi.v_bits, group_size=kivi.group_size, window=window,
            k_sink=k_sink, v_sink=v_sink, inv_freq=freqs, table=k_store.table, num_splits=splits,
            tokens_per_step=per_step, interpret=pltpu.InterpretParams(detect_races=True))
        one = None if sinks is None else (sinks[0][layer], sinks[1][layer])
        xla = attention.decode_kivi_xla(q, k_store, v_store, layer, rings[0][layer], rings[1][layer], length, k_new,
                                        v_new, window, sinks=one, inv_freq=freqs)
        return kernel, xla

    layer = jnp.int32(1)  # traced
    fn = jax.jit(run).lower(*stores, layer).compile(FAST)
    kernel, xla = (np.asarray(x) for x in fn(*stores, layer))
    assert not races_found()
    dirty_kernel, dirty_xla = (np.asarray(x) for x in fn(*dirty, layer))
    assert not races_found()
    assert np.isfinite(kernel).all()
    assert np.abs(kernel - xla).max() <= TOL, np.abs(kernel - xla).max()
    assert np.abs(xla).max() > 0.1  # a real output
    np.testing.assert_array_equal(dirty_kernel, kernel)  # poison in pages or rows not attended: not one bit
    np.testing.assert_array_equal(dirty_xla, xla)


def lower_paged_kernel(k_bits, v_bits, group, head_dim, dtype, pre_rope, generation="v5e"):
    """The paged kernel's pallas_call (`partials`) lowered for TPU: 3 stacked layers of pools of 7 pages read at a
    traced layer index, 2 sequences of 4 table entries, 2 kv heads, R = 128; before RoPE with 4 sinks and a window."""
    layers, pages, batch, per_seq, kv_heads, residual = 3, 7, 2, 4, 2, 128
    lead = (layers, pages, kv_heads)  # pools
    args = (
        sds((batch, kv_heads, kivi_decode_tpu.query_rows(3), head_dim), jnp.float32),
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
        sds((batch, per_seq), jnp.int32),  # the block table
    )
    extra = (sds((head_dim // 2,), jnp.float32),) if pre_rope else ()

    def partials(*a):
        return kivi_decode_tpu.partials(*a[:11], k_bits=k_bits, v_bits=v_bits, group_size=group,
                                        window=300 if pre_rope else None, sinks=4 if pre_rope else 0,
                                        inv_freq=a[12] if pre_rope else None, table=a[11], interpret=False)

    with tpu_target(generation):
        text = jax.jit(partials).trace(*args, *extra).lower(lowering_platforms=("tpu",)).as_text()
    [call] = [line for line in text.splitlines() if TPU_CALL in line]
    assert f"tensor<{layers}x{pages}x{kv_heads}x{residual}x" in call  # the pools themselves
    assert f"tensor<{batch * per_seq}xi32>" in call  # the flattened table: a scalar-prefetch operand
    return text


@pytest.mark.parametrize("generation, matrix", [("v5e", COVERING), ("v6e", COVERING[1::3])], ids=["v5e", "v6e"])
def test_paged_kernel_lowers_for_tpu(generation, matrix):
    """A covering subset of the shipped configurations (every bits pair, every (G, head_dim) pair, keys after and
    before RoPE) paged; the contiguous lowering of all of them is tests/test_pallas_tpu.py's."""
    for i, (kb, vb, g, d, rope) in enumerate(matrix):
        text = lower_paged_kernel(kb, vb, g, d, ("float32", "bfloat16")[i % 2], rope, generation)
        assert text.count(TPU_CALL) == 1, (kb, vb, g, d, rope)


@pytest.mark.parametrize("spec", ["kivi2", "k3v2-g64-r128-prerope-s4"])
def test_model_decode_step_over_a_paged_cache_lowers_for_tpu_with_the_kernel(spec, monkeypatch):
    """forward() over a paged cache with impl='pallas' and the TPU target, lowered for TPU: no fallback to the XLA
    path, and the Mosaic call's operands are the pools and the (flattened) block table themselves."""
    monkeypatch.setattr(attention, "pallas_target", lambda: "tpu")
    monkeypatch.setattr(kivi_decode_tpu, "interpret_params", lambda interpret: False)  # the real kernel, off a TPU
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=None)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: make_cache(spec, cfg, 2, 1024, jnp.bfloat16, impl="pallas", pages=13))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to the XLA path
        with tpu_target("v5e"):
            text = jax.jit(lambda p, t, c: forward(p, t, c)).trace(params, sds((2, 1), jnp.int32), cache).lower(
                lowering_platforms=("tpu",)).as_text()
    [call] = [line for line in text.splitlines() if TPU_CALL in line]
    assert "tensor<3x13x2x128x" in call and "tensor<16xi32>" in call  # the pools, the table [2 * 1024 / R]
