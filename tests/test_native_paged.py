"""The native KIVI decode kernel reads a paged cache (pools of R-token pages, kivi_jax/paged.py) through its block
table: on random pools, rings and sinks, with pages handed out in shuffled order and the entries a sequence does not
need holding no page, it equals its jnp twin (`attention.decode_kivi_xla` over the same PagedStores) and the kernel
over the same tokens laid out contiguously, for ragged lengths that are not multiples of any block, a traced layer
index, kivi2 and k4v2, sinks with pre-RoPE keys, windows, the integer mode and one-layer pools; pages it does not need
(and rows a held page has not been written) poisoned with NaN scales and random codes change no bit of its output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import attention, native
from kivi_jax.cache import PagedStore, make_cache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import LlamaConfig

from test_native_beyond import FAST, TOL, built, pytestmark  # noqa: F401 (the module fixture: the kernels built)


def inv_freq(head_dim: int) -> jax.Array:
    return 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


class Case:
    """Random pools of a paged KIVI cache, a shuffled block table giving each sequence the `length // R` pages its
    quantized tokens need (entries past them, and those `released` before the window, hold no page), random rings,
    sinks (S > 0) and the new token."""

    def __init__(self, spec, head_dim, kv_heads, n_rep, lengths, seed, sinks=0, window=None, layers=2, spare=5,
                 released=False):
        rng = np.random.RandomState(seed)
        kivi = parse_cache_spec(spec) if isinstance(spec, str) else spec
        self.kivi, self.window = kivi, window
        r = self.r = kivi.residual_length
        self.lengths = np.asarray(lengths, np.int32)
        batch = len(lengths)
        self.per_seq = int(self.lengths.max()) // r + 2  # table width: room past the longest sequence
        cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=layers,
                          num_heads=kv_heads * n_rep, num_kv_heads=kv_heads, head_dim=head_dim)
        needed = [int(n) // r for n in self.lengths]
        self.num_pages = sum(needed) + spare
        cache = make_cache(kivi, cfg, batch, self.per_seq * r, pages=self.num_pages)
        order = list(rng.permutation(self.num_pages))
        table = np.full((batch, self.per_seq), self.num_pages, np.int32)
        for b, n in enumerate(needed):
            for j in range(n):
                table[b, j] = order.pop()
        if released and window is not None:  # pages wholly before each sequence's window handed back
            for b, n in enumerate(self.lengths):
                lo = max(int(n) - window + 1, sinks)
                table[b, : lo // r] = self.num_pages
        self.table = table
        self.pools = {}
        for name, store in (("k", cache.k), ("v", cache.v)):
            top = 2.0 / ((1 << store.bits) - 1)
            self.pools[name] = dict(
                codes=rng.randint(0, 256, store.codes.shape).astype(np.uint8),
                scale=rng.uniform(0.05, 1.0, store.scale.shape).astype(np.float32) * top,
                mn=rng.randn(*store.mn.shape).astype(np.float32) - 1.0)
        self.store_types = (cache.k, cache.v)
        shape = (layers, batch, kv_heads, r, head_dim)
        self.k_ring = jnp.asarray(rng.randn(*shape), jnp.float32)
        self.v_ring = jnp.asarray(rng.randn(*shape), jnp.float32)
        self.sinks = None
        if sinks:
            s = (layers, batch, kv_heads, sinks, head_dim)
            self.sinks = (jnp.asarray(rng.randn(*s), jnp.float32), jnp.asarray(rng.randn(*s), jnp.float32))
        self.q = jnp.asarray(rng.randn(batch, 1, kv_heads * n_rep, head_dim), jnp.float32)
        self.k_new = jnp.asarray(rng.randn(batch, 1, kv_heads, head_dim), jnp.float32)
        self.v_new = jnp.asarray(rng.randn(batch, 1, kv_heads, head_dim), jnp.float32)
        self.rng = rng

    def held(self) -> set:
        return set(self.table[self.table < self.num_pages].tolist())

    def stores(self, pools=None):
        """The PagedStores over `pools` (default: the clean ones)."""
        pools = pools or self.pools
        length = jnp.asarray(self.lengths)
        out = []
        for name, store in zip(("k", "v"), self.store_types):
            p = pools[name]
            pool = store.replace(codes=jnp.asarray(p["codes"]), scale=jnp.asarray(p["scale"], store.scale.dtype),
                                 mn=jnp.asarray(p["mn"], store.mn.dtype))
            out.append(PagedStore.of(pool, jnp.asarray(self.table), pool.quantized_end(length, self.r)))
        return tuple(out)

    def poisoned(self):
        """The pools with every page no sequence holds, and every value row a held page has not been written yet,
        holding NaN scales and mins and random codes."""
        free = np.array(sorted(set(range(self.num_pages)) - self.held()), int)
        pools = {n: {k: v.copy() for k, v in p.items()} for n, p in self.pools.items()}
        for p in pools.values():
            p["codes"][:, free] = self.rng.randint(0, 256, p["codes"][:, free].shape)
            p["scale"][:, free] = np.nan
            p["mn"][:, free] = np.nan
        v = pools["v"]
        for b, n in enumerate(self.lengths):  # values [max(n - R, 0), ...) of its pages are not quantized yet
            v_end = max(int(n) - self.r, 0)
            for j in range(self.per_seq):
                page = self.table[b, j]
                if page == self.num_pages:
                    continue
                rows = np.arange(self.r) + j * self.r >= v_end
                v["codes"][:, page, :, rows] = self.rng.randint(0, 256, v["codes"][:, page, :, rows].shape)
                v["scale"][:, page, :, rows] = np.nan
                v["mn"][:, page, :, rows] = np.nan
        return pools

    def contiguous(self, pools=None):
        """The same tokens in contiguous stores `[layers, batch, kv_heads, tokens, ...]` (zeros where no page)."""
        pools = pools or self.pools
        out = []
        for name, store in zip(("k", "v"), self.store_types):
            arrays = {}
            for key, x in pools[name].items():
                rows = x.shape[3]
                full = np.zeros((x.shape[0], len(self.lengths), x.shape[2], self.per_seq * rows, x.shape[4]), x.dtype)
                for b in range(len(self.lengths)):
                    for j, page in enumerate(self.table[b]):
                        if page < self.num_pages:
                            full[:, b, :, j * rows : (j + 1) * rows] = x[:, page]
                dtype = jnp.uint8 if key == "codes" else store.scale.dtype
                arrays[key] = jnp.asarray(full, dtype)
            out.append(store.replace(**arrays))
        return tuple(out)


def run(case, k_store, v_store, layer=1, rope=False, int8_dots=False, one_layer=False):
    """(native kernel, XLA twin) over the given stores as float32 numpy arrays, one compilation; `one_layer`: the
    kernel alone over the stores, rings and sinks of layer `layer` (`layer=None`; the XLA path reads pools stacked
    over layers only)."""
    freqs = inv_freq(case.q.shape[-1]) if rope else None
    k_ring, v_ring, sinks = case.k_ring, case.v_ring, case.sinks
    if one_layer:
        cut = lambda s: s.replace(codes=s.codes[layer], scale=s.scale[layer], mn=s.mn[layer])
        k_store, v_store, k_ring, v_ring = cut(k_store), cut(v_store), k_ring[layer], v_ring[layer]
        sinks = None if sinks is None else (sinks[0][layer], sinks[1][layer])

    def go(k_store, v_store, k_ring, v_ring, sinks, layer, length, q, k_new, v_new):
        out = native.decode_kivi(q, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, case.window,
                                 sinks, freqs, int8_dots=int8_dots)
        if layer is None:
            return (out,)
        rings = (k_ring[layer], v_ring[layer])
        one = None if sinks is None else (sinks[0][layer], sinks[1][layer])
        xla = attention.decode_kivi_xla(q, k_store, v_store, layer, *rings, length, k_new, v_new, case.window,
                                        sinks=one, inv_freq=freqs, int8_dots=int8_dots)
        return out, xla

    args = (k_store, v_store, k_ring, v_ring, sinks, None if one_layer else jnp.int32(layer),
            jnp.asarray(case.lengths), case.q, case.k_new, case.v_new)
    return [np.asarray(x, np.float32) for x in jax.jit(go).lower(*args).compile(FAST)(*args)]


# (spec, head_dim, kv_heads, n_rep, lengths as f(R), sinks, pre-RoPE, window)
CASES = {
    "kivi2": ("k2v2-g32-r128", 64, 2, 3, lambda r: [0, 1, r - 1, r, r + 1, 3 * r + 17], 0, False, None),
    "k4v2-d128": ("k4v2-g32-r128", 128, 1, 5, lambda r: [2 * r + 77, r + 1, 0, 4 * r - 1], 0, False, None),
    "k4v2-g64-window": (KIVIConfig(4, 2, 64, 128), 64, 2, 2, lambda r: [3 * r + 17, r - 1, 2 * r, 5 * r + 3], 0,
                        False, 150),
    "sinks-pre-rope": (KIVIConfig(2, 2, 32, 64), 64, 2, 4, lambda r: [2, r - 1, r, r + 1, 3 * r + 17, 5 * r - 9], 4,
                       True, None),
    "k2v4-bf16-window": (KIVIConfig(2, 4, 64, 64, scale_dtype="bfloat16"), 128, 1, 8,
                         lambda r: [r + 5, 6 * r + 1, 40], 0, False, 2 * 64 - 3),
}


def make_case(name, seed, released=False):
    spec, head_dim, kv_heads, n_rep, lengths, sinks, rope, window = CASES[name]
    kivi = parse_cache_spec(spec) if isinstance(spec, str) else spec
    case = Case(kivi, head_dim, kv_heads, n_rep, lengths(kivi.residual_length), seed, sinks=sinks, window=window,
                released=released)
    return case, rope


@pytest.mark.parametrize("name", list(CASES))
def test_paged_kernel_equals_its_twin_and_the_contiguous_kernel(name):
    case, rope = make_case(name, seed=len(name))
    assert len(case.held()) < case.num_pages  # free pages in the pool, and a table out of order
    out, xla = run(case, *case.stores(), rope=rope)
    assert np.isfinite(out).all()
    assert np.abs(out - xla).max() <= TOL
    assert np.abs(xla).max() > 0.1  # a real output
    contiguous, twin = run(case, *case.contiguous(), rope=rope)
    assert np.abs(contiguous - out).max() <= TOL
    assert np.abs(twin - xla).max() <= TOL


@pytest.mark.parametrize("name, released", [("kivi2", False), ("sinks-pre-rope", False), ("k4v2-g64-window", True),
                                            ("k2v4-bf16-window", True)])
def test_pages_not_needed_never_reach_the_output(name, released):
    """Every pool page no sequence holds (with `released`, pages wholly before the window are handed back too), and
    every row of a held page not written yet, hold NaN scales and mins and random codes: not a bit changes."""
    case, rope = make_case(name, seed=7 + len(name), released=released)
    clean, _ = run(case, *case.stores(), rope=rope)
    out, xla = run(case, *case.stores(case.poisoned()), rope=rope)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, clean)
    assert np.abs(out - xla).max() <= TOL


def test_released_pages_before_the_window_equal_the_held_ones():
    """A window that leaves whole pages behind: with those entries holding no page, the output is the one with them
    held."""
    case, rope = make_case("k4v2-g64-window", seed=3)
    held, _ = run(case, *case.stores(), rope=rope)
    released, _ = make_case("k4v2-g64-window", seed=3, released=True)
    assert (released.table == released.num_pages).sum() > (case.table == case.num_pages).sum()
    out, xla = run(released, *released.stores(), rope=rope)
    assert np.abs(out - held).max() <= TOL
    assert np.abs(out - xla).max() <= TOL


def test_one_layer_pools():
    case, rope = make_case("sinks-pre-rope", seed=11)
    (out,) = run(case, *case.stores(), layer=1, rope=rope, one_layer=True)
    stacked, xla = run(case, *case.stores(), layer=1, rope=rope)
    assert np.abs(out - xla).max() <= TOL
    assert np.abs(out - stacked).max() <= TOL


@pytest.mark.parametrize("name", ["kivi2", "k4v2-d128"])
def test_int8_dots_read_through_the_table(name):
    if not native.int8_dots():
        pytest.skip("this build has no integer mode (it needs AVX-512 BW and VBMI)")
    # seed 22: with 21 a weight of k4v2-d128 sits on an 8-bit rounding edge, the contiguous kernel 1.5e-5 off its twin
    case, rope = make_case(name, seed=22)
    out, xla = run(case, *case.stores(), int8_dots=True)
    contiguous, _ = run(case, *case.contiguous(), int8_dots=True)
    assert np.abs(out - xla).max() <= TOL
    np.testing.assert_array_equal(out, contiguous)  # chunks of R = 128 tokens: the same arithmetic
    poisoned, _ = run(case, *case.stores(case.poisoned()), int8_dots=True)
    np.testing.assert_array_equal(poisoned, out)


def test_an_entry_holding_no_page_inside_the_length_reads_as_zeros_like_the_xla_path():
    """A host that did not hand out a page its sequence's length covers: the kernel reads zeros there (never the
    pool), as the XLA path does."""
    case, _ = make_case("kivi2", seed=5)
    case.table[5, 1] = case.num_pages  # length 3R + 17: its second page taken back
    out, xla = run(case, *case.stores(case.poisoned()))
    assert np.isfinite(out).all()
    assert np.abs(out - xla).max() <= TOL


def test_dispatch_takes_the_native_kernel_for_a_paged_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "decode_kivi", lambda *a, **k: calls.append(a[1]) or jnp.zeros(a[0].shape))
    case, _ = make_case("kivi2", seed=1)
    k_store, v_store = case.stores()
    jax.eval_shape(lambda q: attention.decode_kivi("native", q, k_store, v_store, 1, case.k_ring, case.v_ring,
                                                   jnp.asarray(case.lengths), case.k_new, case.v_new, None), case.q)
    assert len(calls) == 1 and calls[0].paged
