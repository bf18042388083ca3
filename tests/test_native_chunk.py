"""The native chunk-attention kernel (`kivi_jax/native/attend_cpu.cc`) equals its twin, `attention.segment`'s XLA
path with bfloat16 dots (or float32 ones), on random segments: row and key counts that are not multiples of its
32-row items or 64-key steps, head dims 32 / 64 / 128, causal and stored segments, sliding windows, keys not ok, rows
that see nothing, a state carried in; its AMX tiles, its scalar path and its float32 tiles alike. A chunk over a
KIVI cache in one call, the stores read in place, equals the XLA path's walk a segment at a time. Through the model,
a chunked prefill (bfloat16 with AMX, float32 with AVX-512) onto KIVI and full caches gives the XLA path's logits
and greedy tokens, and a program lowered for a GPU keeps the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import attention, layout, native, runtime
from kivi_jax.cache import QuantStore, make_cache
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import cast_params, init_params
from kivi_jax.native import attend, build

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on the CPU backend")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not native.available():
        pytest.fail(f"the native kernels did not build here: {native.error()}")


def random_segment(rng, batch, heads, tokens_q, tokens, head_dim, n_rep, causal, keys_token_major):
    """`tokens_q` query tokens (token-major rows, `n_rep` query heads a kv head) after `tokens` keys (causal: among
    them, the first query token one position before the first key, so that its rows see nothing), a state carried in
    (its first query token has seen nothing yet), keys 90% ok."""
    q = rng.standard_normal((batch, tokens_q, heads * n_rep, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, heads, tokens, head_dim)).astype(np.float32)
    k[..., 3] *= 6.0  # an outlier channel
    v = rng.standard_normal((batch, heads, tokens, head_dim)).astype(np.float32)
    if keys_token_major:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    start = rng.integers(0, 4, (batch, 1))
    k_pos = start + np.arange(tokens)[None, :]  # [batch, tokens]
    q_pos = (start + (-1 if causal else tokens)) + np.arange(tokens_q)[None, :]  # [batch, tokens_q]
    k_ok = rng.random((batch, tokens)) < 0.9
    m = rng.standard_normal((batch, tokens_q, heads * n_rep)).astype(np.float32)
    l = rng.random((batch, tokens_q, heads * n_rep)).astype(np.float32) + 0.5
    acc = rng.standard_normal((batch, tokens_q, heads * n_rep, head_dim)).astype(np.float32)
    m[:, 0], l[:, 0], acc[:, 0] = -np.inf, 0.0, 0.0
    state = attention.Softmax(*map(jnp.asarray, (m, l, acc)))
    return state, jnp.asarray(q, jnp.bfloat16), *map(jnp.asarray, (q_pos.astype(np.int32), k, v,
                                                                    k_pos.astype(np.int32), k_ok))


CASES = [  # batch, kv heads, query tokens, keys, head_dim, n_rep, window, causal, keys token-major
    (1, 3, 32, 32, 64, 3, None, True, True),  # a chunk over itself, its keys as the model gives them
    (2, 2, 33, 31, 32, 1, None, False, False),  # stored keys, fewer than a step; rows past an item
    (2, 3, 50, 200, 64, 3, 16, True, False),  # a sliding window inside the chunk
    (1, 1, 35, 130, 128, 2, None, False, False),  # head_dim 128, keys past two steps
    (2, 1, 16, 257, 64, 4, 100, False, True),  # a window over stored keys, a ragged last step
]


DOTS = {  # the kernel's modes: (AMX tiles, dot dtype); each compared with the twin of its dot dtype
    "amx": (True, jnp.bfloat16), "scalar": (False, jnp.bfloat16), "float32": (False, jnp.float32)}


def close(got, want, dot_dtype, atol=2e-2, mean=2e-3):
    """bfloat16 dots: probabilities round to bfloat16 against each side's own reference (the XLA path's segment max,
    the kernel's running one), so outputs agree to that rounding, not bit for bit; float32 dots: to float32's
    rounding of sums taken in another order."""
    if dot_dtype == jnp.float32:
        atol, mean = 2e-5, 2e-6
    np.testing.assert_allclose(got, want, atol=atol)
    assert np.mean(np.abs(got - want)) < mean


@pytest.mark.parametrize("dots", DOTS)
@pytest.mark.parametrize("case", CASES, ids=[f"t{c[2]}-k{c[3]}-d{c[4]}-w{c[6]}-{'causal' if c[7] else 'stored'}"
                                              for c in CASES])
def test_the_kernel_equals_its_twin(case, dots):
    amx, dot_dtype = DOTS[dots]
    batch, heads, tokens_q, tokens, head_dim, n_rep, window, causal, kv_first = case
    rng = np.random.default_rng(tokens_q * 7 + tokens)
    state, q, q_pos, k, v, k_pos, k_ok = random_segment(rng, batch, heads, tokens_q, tokens, head_dim, n_rep, causal,
                                                        kv_first)
    q = q.astype(dot_dtype)

    def twin(state, q, q_pos, k, v):  # the XLA path, regrouping the rows (as a program lowered for a GPU does)
        rows = attention.Rows(q, q_pos, dot_dtype, token_major=True)
        return attention.segment(state, rows, k, v, k_pos, k_ok, window, causal=causal, keys_token_major=kv_first)

    def kernel(state, q, q_pos, k, v):
        return attention.Softmax(*attend.segment(*state, q, q_pos, k, v, k_pos, k_ok, window, causal, amx,
                                                 scale=head_dim**-0.5, kv_tokens_first=kv_first, dot_dtype=dot_dtype))

    want = jax.jit(twin)(state, q, q_pos, k, v)
    got = jax.jit(kernel)(state, q, q_pos, k, v)
    want_out, got_out = np.asarray(want.result()), np.asarray(got.result())
    close(got_out, want_out, dot_dtype)
    # a query that sees no key of the segment keeps its state exactly; every other one moved
    qp, kp, ok = np.asarray(q_pos), np.asarray(k_pos), np.asarray(k_ok)
    sees = np.broadcast_to(ok[:, None, :], (batch, tokens_q, tokens)).copy()
    if causal:
        sees &= kp[:, None, :] <= qp[:, :, None]
    if window is not None:
        sees &= qp[:, :, None] - kp[:, None, :] < window
    blind = np.broadcast_to(~sees.any(-1)[:, :, None], (batch, tokens_q, heads * n_rep))
    assert blind.any() == causal  # the causal cases' first queries see nothing (their keys come later); no other
    for name in ("m", "l", "acc"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[blind], np.asarray(getattr(state, name))[blind])
    assert not np.allclose(got_out[~blind], np.asarray(state.result())[~blind], atol=1e-3)


@pytest.mark.parametrize("dots", DOTS)
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["causal", "window"])
def test_a_fresh_finished_call_equals_the_twins_result(case, dots):
    """No state in (`m = l = acc = None`: every row starts from nothing seen) and the attention out (`finish`):
    the twin's `Softmax.empty`, segment and `result`, rows that see nothing 0."""
    batch, heads, tokens_q, tokens, head_dim, n_rep, window, causal, kv_first = case
    rng = np.random.default_rng(tokens_q + tokens)
    _, q, q_pos, k, v, k_pos, k_ok = random_segment(rng, batch, heads, tokens_q, tokens, head_dim, n_rep, causal,
                                                    kv_first)
    amx, dot_dtype = DOTS[dots]
    q = q.astype(dot_dtype)

    def twin(q, q_pos, k, v):
        rows = attention.Rows(q, q_pos, dot_dtype, token_major=True)
        return attention.segment(attention.Softmax.empty(q), rows, k, v, k_pos, k_ok, window, causal=causal,
                                 keys_token_major=kv_first).result()

    def kernel(q, q_pos, k, v):
        return attend.segment(None, None, None, q, q_pos, k, v, k_pos, k_ok, window, causal, amx,
                              scale=head_dim**-0.5, kv_tokens_first=kv_first, finish=True, dot_dtype=dot_dtype)[2]

    want, got = np.asarray(jax.jit(twin)(q, q_pos, k, v)), np.asarray(jax.jit(kernel)(q, q_pos, k, v))
    close(got, want, dot_dtype)
    blind = (want == 0).all(-1)
    assert blind.any() and not blind.all()  # the first query token sees nothing (causal cases)
    np.testing.assert_array_equal(got[blind], 0.0)


def random_store(rng, lead, max_tokens, head_dim, bits, group, axis, scale_dtype):
    """A KIVI store of random codes, scales in [0.15, 0.9] / (2^bits - 1) and mins about 0 (values of order one;
    every token, written or not, finite)."""
    store = QuantStore.zeros(lead, max_tokens, head_dim, bits, group, axis, scale_dtype)
    top = 2**bits - 1
    return store.replace(codes=jnp.asarray(rng.integers(0, 256, store.codes.shape), jnp.uint8),
                         scale=jnp.asarray(rng.uniform(0.15 / top, 0.9 / top, store.scale.shape), scale_dtype),
                         mn=jnp.asarray(rng.normal(0, 0.5, store.mn.shape), scale_dtype))


STORE_CASES = [  # k_bits, v_bits, k_group, v_group, head_dim, residual, lengths, new tokens, window, sinks, scales
    (2, 2, 32, 32, 64, 32, (300, 45), (40, 23), None, 0, jnp.float16),  # kivi2: ragged lengths and new tokens
    (4, 2, 64, 16, 128, 64, (517, 0), (70, 70), 200, 0, jnp.bfloat16),  # an empty sequence, a window, head_dim 128
    (2, 4, 32, 32, 32, 32, (100, 257), (33, 1), None, 4, jnp.float32),  # 2-bit rows of 8 bytes a slab; sinks
    (8, 8, 32, 64, 64, 32, (64, 191), (17, 50), 60, 0, jnp.float16),  # 8-bit codes, a window inside the store
    (2, 2, 32, 32, 64, 64, (27, 5), (46, 30), None, 0, jnp.float16),  # prefixes in the ring, nothing quantized yet
]


def test_a_lazy_ring_window_reads_the_flushed_block_only_when_a_written_slot_needs_it():
    """`attention.window_tensor(..., lazy=True)` (a chunk's one call) equals the eager one at every written ring slot,
    and where no written slot's token is quantized it is the ring itself: the flushed block is not read."""
    rng = np.random.default_rng(11)
    residual, heads, head_dim, max_tokens = 32, 2, 64, 256
    for lengths in ((0, 1, 27, residual - 1), (0, residual, residual + 5, 3 * residual + 7)):
        length = jnp.asarray(lengths, jnp.int32)
        store = random_store(rng, (len(lengths), heads), max_tokens, head_dim, 2, 32, "channel", jnp.float16)
        ring = jnp.asarray(rng.standard_normal((len(lengths), heads, residual, head_dim)), jnp.float32)
        held = layout.ring_tokens(length, residual)
        eager = np.asarray(attention.window_tensor(store, None, ring, held, length))
        lazy = np.asarray(jax.jit(lambda r: attention.window_tensor(store, None, r, held, length, lazy=True))(ring))
        written = np.broadcast_to(np.asarray(held >= 0)[:, None, :, None], eager.shape)
        np.testing.assert_array_equal(lazy[written], eager[written])
        flushed = max(lengths) >= residual
        assert np.array_equal(lazy, np.asarray(ring)) != flushed  # the block read exactly when some token is in it
        assert not np.array_equal(eager, np.asarray(ring))  # (the eager one reads it for never-written slots too)


def dots_served(dot_dtype) -> bool:
    """Whether `auto` takes the kernel for rows of this dot dtype on this CPU."""
    return attend.unsupported(dot_dtype, 64, None) is None


@pytest.mark.parametrize("stacked, dots", [(False, "amx"), (True, "amx"), (True, "scalar"), (False, "float32"),
                                           (True, "float32")],
                         ids=["one-layer", "stacked", "stacked-scalar", "one-layer-f32", "stacked-f32"])
@pytest.mark.parametrize("case", STORE_CASES, ids=[f"k{c[0]}v{c[1]}-g{c[2]}/{c[3]}-d{c[4]}-w{c[8]}-s{c[9]}"
                                                    for c in STORE_CASES])
def test_a_chunk_over_a_kivi_store_in_one_call_equals_the_segments(case, stacked, dots, monkeypatch):
    """`attend_kivi_xla` of bfloat16 rows on an AMX CPU, or of float32 rows on an AVX-512 CPU: one kernel call reads
    the stores in place (the tokens whose key and value are quantized, past the sinks), then the sinks, the ring (the
    last flushed key block where a token is in both) and the new tokens; the XLA path's walk, a segment at a time, is
    its twin. Lengths and new tokens that are multiples of no block, an empty sequence, windows, sinks, 2-, 4- and
    8-bit codes, three scale dtypes; the kernel's AMX tiles, its scalar path and its float32 tiles."""
    amx, dot_dtype = DOTS[dots]
    if not dots_served(dot_dtype):
        pytest.skip(f"`auto` does not take the kernel here: {attend.unsupported(dot_dtype, 64, None)}")
    if not amx:
        real = attend.segment
        monkeypatch.setattr(attend, "segment", lambda *a, **k: real(*a, **{**k, "amx": False}))
    k_bits, v_bits, k_group, v_group, head_dim, residual, lengths, new, window, num_sinks, scale_dtype = case
    rng = np.random.default_rng(k_bits * 10 + head_dim)
    batch, heads, n_rep, layers, max_tokens = 2, 2, 3, 3, 640
    lead = (layers, batch, heads) if stacked else (batch, heads)
    layer = jnp.int32(1) if stacked else None
    k_store = random_store(rng, lead, max_tokens, head_dim, k_bits, k_group, "channel", scale_dtype)
    v_store = random_store(rng, lead, max_tokens, head_dim, v_bits, v_group, "token", scale_dtype)
    ring = lambda: jnp.asarray(rng.standard_normal((batch, heads, residual, head_dim)), jnp.float32)  # noqa: E731
    k_ring, v_ring = ring(), ring()
    sinks = None
    if num_sinks:
        sinks = tuple(jnp.asarray(rng.standard_normal((batch, heads, num_sinks, head_dim)), jnp.float32)
                      for _ in range(2))
    length = jnp.asarray(lengths, jnp.int32)
    tokens = max(new)
    num_new = jnp.asarray(new, jnp.int32)
    positions = length[:, None] + jnp.arange(tokens)[None, :]
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads * n_rep, head_dim)), dot_dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((batch, tokens, heads, head_dim)), jnp.float32) for _ in range(2))

    def attend_with(impl):
        return jax.jit(lambda q, k_store, v_store: attention.attend_kivi_xla(
            q, positions, k_store, v_store, layer, k_ring, v_ring, length, k_new, v_new, num_new, window,
            sinks=sinks, impl=impl))

    assert "kivi_jax_chunk_attend" not in attend_with("xla").lower(q, k_store, v_store).as_text()
    assert attend_with("auto").lower(q, k_store, v_store).as_text().count("custom_call @kivi_jax_chunk_attend") == 1
    want = np.asarray(attend_with("xla")(q, k_store, v_store), np.float32)
    got = np.asarray(attend_with("auto")(q, k_store, v_store), np.float32)
    real_rows = np.arange(tokens)[None, :] < np.asarray(new)[:, None]  # padded new tokens: no answer asked
    close(got[real_rows], want[real_rows], dot_dtype, atol=3e-2, mean=3e-3)
    assert np.abs(want[real_rows]).mean() > 0.05  # the outputs are not all near zero
    # a padded query is at position -1: under the kernel's one causal rule it sees no key, and an item of such rows
    # skips every step (its output zero; the twin's walk still attends it to the stored tokens: no answer asked)
    assert not got[~real_rows].any()


def test_a_full_caches_first_chunk_skips_its_padded_queries():
    """A full-precision cache's chunk onto an empty cache (a packed prefill's rows: ragged prompts in one width): the
    kernel's new-token segment equals the XLA path on the real queries, and a padded query (at position -1,
    `attention.query_positions`) sees no key there, so its output is zero."""
    if not dots_served(jnp.float32):
        pytest.skip(f"`auto` does not take the kernel here: {attend.unsupported(jnp.float32, 64, None)}")
    rng = np.random.default_rng(5)
    batch, heads, n_rep, head_dim, tokens, max_tokens = 3, 2, 3, 64, 40, 128
    new = np.array([40, 17, 1])
    length, num_new = jnp.zeros((batch,), jnp.int32), jnp.asarray(new, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    cache = jnp.zeros((batch, heads, max_tokens, head_dim), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads * n_rep, head_dim)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((batch, tokens, heads, head_dim)), jnp.float32) for _ in range(2))

    def attend_with(impl):
        return jax.jit(lambda q: attention.attend_full_xla(q, positions, cache, cache, None, length, k_new, v_new,
                                                           num_new, None, impl=impl))

    assert "kivi_jax_chunk_attend" in attend_with("auto").lower(q).as_text()
    want, got = np.asarray(attend_with("xla")(q)), np.asarray(attend_with("auto")(q))
    real_rows = np.arange(tokens)[None, :] < new[:, None]
    close(got[real_rows], want[real_rows], jnp.float32)
    assert np.abs(want[real_rows]).mean() > 0.05
    assert not got[~real_rows].any()


def test_the_kernel_refuses_a_store_it_does_not_read():
    s = QuantStore.zeros((1, 1), 64, 64, 2, 32, "channel", jnp.float16)
    t = QuantStore.zeros((1, 1), 64, 64, 2, 32, "token", jnp.float16)
    assert attend.unsupported_store(s, t, None) is None
    assert attend.unsupported_store(t, s, None) is not None  # the axes flipped
    assert attend.unsupported_store(s, t, jnp.ones((32,))) is not None  # keys stored before RoPE
    assert attend.unsupported_store(s.replace(bits=3), t, None) is not None
    assert attend.unsupported_store(s, t.replace(levels=(0.0, 1.0, 2.0, 3.0)), None) is not None  # a codebook


def test_the_kernel_refuses_what_it_does_not_serve():
    assert attend.unsupported(jnp.float16, 64, None) is not None  # float16 rows: XLA's dot
    assert attend.unsupported(jnp.bfloat16, 64, 50.0) is not None  # a soft-cap
    assert attend.unsupported(jnp.float32, 64, 50.0) is not None
    assert attend.unsupported(jnp.bfloat16, 48, None) is not None  # head_dim not a multiple of 32
    assert attend.unsupported(jnp.float32, 288, None) is not None  # past the kernel's 256
    assert (attend.unsupported(jnp.bfloat16, 64, None) is None) == build.has_amx()
    assert (attend.unsupported(jnp.float32, 64, None) is None) == build.has_avx512()


CFG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=64)
WINDOW = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=1, head_dim=64, sliding_window=40)


def chunked_prefill(params, spec, impl, prompts, chunk=48):
    """`runtime.prefill` of ragged prompts in chunks onto a fresh cache of `impl` -> the logits after each prompt."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    cache = make_cache(spec, params.config, batch=len(prompts), max_tokens=256, impl=impl)
    logits, _ = runtime.prefill(params, tokens, lengths, cache, chunk)
    return np.asarray(logits)


@pytest.mark.skipif(not build.has_amx(), reason="`auto` takes the kernel only with AMX tiles (else XLA's path, tested "
                                                "above against the kernel's scalar path)")
@pytest.mark.parametrize("cfg", [CFG, WINDOW], ids=["gqa", "window"])
def test_a_bfloat16_chunked_prefill_gives_the_xla_paths_logits(cfg, monkeypatch):
    """Prompts of 150 and 77 tokens in chunks of 48 (stored blocks, the ring and each chunk itself), KIVI and full:
    the kernel's logits differ from the XLA path's by less than half of what bfloat16 itself moves them (the same
    model in float32), and are no farther from float32's."""
    calls = []
    real = attend.segment
    monkeypatch.setattr(attend, "segment", lambda *a, **k: calls.append(1) or real(*a, **k))
    exact = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    params = cast_params(exact, jnp.bfloat16)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 128, n).tolist() for n in (150, 77)]
    for spec in ("k2v2-g32-r32", "full"):
        jax.clear_caches()
        xla = chunked_prefill(params, spec, "xla", prompts)
        ref = chunked_prefill(exact, spec, "xla", prompts)  # the same model in float32
        assert not calls
        jax.clear_caches()
        out = chunked_prefill(params, spec, "auto", prompts)
        assert calls  # the kernel was traced into the chunk program
        calls.clear()
        bf16_moves = np.abs(xla - ref).max()
        assert bf16_moves > 0.01
        assert np.abs(out - xla).max() < 0.5 * bf16_moves
        assert np.abs(out - ref).max() < 1.25 * bf16_moves


@pytest.mark.skipif(not build.has_avx512(), reason="`auto` takes the float32 kernel only with AVX-512")
@pytest.mark.parametrize("cfg", [CFG, WINDOW], ids=["gqa", "window"])
def test_a_float32_chunked_prefill_gives_the_xla_paths_logits(cfg, monkeypatch):
    """Prompts of 150 and 77 tokens in chunks of 48 of a float32 model, KIVI and full: the kernel (float32 tiles)
    gives the XLA path's logits to float32's rounding of sums in another order."""
    calls = []
    real = attend.segment
    monkeypatch.setattr(attend, "segment", lambda *a, **k: calls.append(k["dot_dtype"]) or real(*a, **k))
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 128, n).tolist() for n in (150, 77)]
    for spec in ("k2v2-g32-r32", "full"):
        jax.clear_caches()
        xla = chunked_prefill(params, spec, "xla", prompts)
        assert not calls
        out = chunked_prefill(params, spec, "auto", prompts)
        assert calls and set(calls) == {jnp.float32}  # the kernel was traced into the chunk program, in float32
        calls.clear()
        assert np.abs(xla).max() > 1.0
        np.testing.assert_allclose(out, xla, atol=2e-4)


@pytest.mark.skipif(not build.has_avx512(), reason="`auto` takes the float32 kernel only with AVX-512")
def test_a_short_float32_chunk_over_a_kivi_cache_stays_on_xlas_path():
    """A chunk of few rows (10 tokens x 3 query heads a kv head, under `attention.DEQUANTIZE_ROWS`) over a KIVI cache
    folds the scales into q and p on XLA's path, as a decode step does; a chunk of many rows takes the kernel. Both
    give the XLA path's logits."""
    params = init_params(CFG, jax.random.PRNGKey(5), std=0.2)
    rng = np.random.default_rng(6)
    prompt = rng.integers(3, 128, 100)
    for tokens, kernel in ((10, False), (40, True)):
        cache = make_cache("kivi2", CFG, batch=1, max_tokens=256)
        _, cache = runtime.prefill(params, prompt[None, :90].astype(np.int32), np.array([90], np.int32), cache, 64)
        assert 3 * tokens < attention.DEQUANTIZE_ROWS or kernel
        chunk = jnp.asarray(rng.integers(3, 128, (1, tokens)), jnp.int32)
        # (the chunk's call donates its cache: each gets a copy)
        run = lambda impl: runtime.prefill_chunk(  # noqa: E731
            params, chunk, jnp.full((1,), tokens, jnp.int32), jax.tree.map(jnp.copy, cache).replace(impl=impl),
            jnp.zeros((1, 128), jnp.float32), jnp.full((1,), tokens - 1, jnp.int32))[0]
        text = jax.jit(run, static_argnums=0).trace("auto").lower().as_text()
        assert ("kivi_jax_chunk_attend" in text) == kernel
        want, got = np.asarray(run("xla")), np.asarray(run("auto"))
        assert np.abs(want).max() > 1.0
        np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_generate_through_the_kernel_gives_the_xla_greedy_tokens(dtype):
    """A float32 model (the kernel's float32 tiles, AVX-512) and a bfloat16 one (AMX tiles)."""
    if not dots_served(dtype):
        pytest.skip(f"`auto` does not take the kernel here: {attend.unsupported(dtype, 64, None)}")
    params = cast_params(init_params(CFG, jax.random.PRNGKey(3), std=0.2), dtype)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 128, n).tolist() for n in (90, 33)]
    kw = dict(max_new_tokens=12, cache="kivi2", stop_at_eos=False, prefill_chunk=32)
    xla = kivi_jax.generate(params, prompts, attention_impl="xla", **kw).token_ids
    out = kivi_jax.generate(params, prompts, attention_impl="auto", **kw).token_ids
    assert out == xla


def test_a_program_lowered_for_a_gpu_keeps_the_xla_path():
    params = cast_params(init_params(CFG, jax.random.PRNGKey(1), std=0.2), jnp.bfloat16)
    cache = make_cache("kivi2", CFG, batch=1, max_tokens=128)
    tokens = jnp.ones((1, 64), jnp.int32)
    args = (params, tokens, jnp.full((1,), 64, jnp.int32), cache, jnp.zeros((1, 128), jnp.float32),
            jnp.full((1,), 63, jnp.int32))
    gpu = runtime.prefill_chunk.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "kivi_jax_chunk_attend" not in gpu
    if build.has_amx():
        cpu = runtime.prefill_chunk.trace(*args).lower().as_text()
        assert "kivi_jax_chunk_attend" in cpu
    exact = init_params(CFG, jax.random.PRNGKey(1), std=0.2)  # float32: the kernel's float32 tiles on the CPU
    args = (exact, *args[1:])
    traced = runtime.prefill_chunk.trace(*args)
    assert "kivi_jax_chunk_attend" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert ("kivi_jax_chunk_attend" in traced.lower().as_text()) == build.has_avx512()
