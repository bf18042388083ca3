"""8-bit caches (int8, fp8 e4m3 / e5m2): the spec grammar, what is stored, attention against a dense reference of it,
chunked appends equal one-token appends byte for byte, bytes against the formula, kernels refusing them clearly, and
the model end to end."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import attention
from kivi_jax.cache import SCALE_OVERFLOW, cache_bytes, make_cache
from kivi_jax.cache8 import Dense8Cache, Dense8Update, quantize8, values8
from kivi_jax.config import Dense8Config, parse_cache_spec, spec_name
from kivi_jax.evaluate import describe
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from test_kivi_cache import CFG, random_kv

SPECS = ["int8", "fp8", "fp8-e5m2", "fp8-tok", "fp8-e5m2-tok"]


def identity_rope(x, positions):
    return x


def append8(cache: Dense8Cache, k, v, num_new):
    """Appends `k, v [layers, batch, kv_heads, T, head_dim]` (`num_new [batch]` real) as the layer scan would."""
    (kq, ks), (vq, vs) = quantize8(k, cache.config), quantize8(v, cache.config)
    return cache.commit(Dense8Update(kq, vq, ks, vs), num_new)


append8_jit = jax.jit(append8)


@pytest.mark.parametrize("text, name, bits", [("int8", "int8", 8.5), ("FP8", "fp8-e4m3", 8.0),
                                              ("fp8-e4m3", "fp8-e4m3", 8.0), ("fp8-e5m2", "fp8-e5m2", 8.0),
                                              ("fp8-tok", "fp8-e4m3-tok", 8.5), ("fp8-e5m2-tok", "fp8-e5m2-tok", 8.5)])
def test_spec_grammar_prints_what_it_parses(text, name, bits):
    spec = parse_cache_spec(text)
    assert isinstance(spec, Dense8Config) and spec_name(spec) == name and parse_cache_spec(name) == spec
    assert describe(name, head_dim=32)["bits"] == bits  # a float16 scale a token and head: 16 / 32 bits a value
    assert spec.token_multiple == 1 and spec.exact_prefill(10) == 1


@pytest.mark.parametrize("text", ["int4", "fp8-e4m3fn", "int8-tok-tok", "fp16"])
def test_bad_eight_bit_specs_say_what_would_be_right(text):
    with pytest.raises(ValueError, match="int8.*fp8"):
        parse_cache_spec(text)
    with pytest.raises(ValueError, match="needs its per-token scales"):
        Dense8Config("int8", per_token=False)


def test_stored_values_are_within_half_a_step_and_fp8_saturates():
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(3, 7, 32).astype(np.float32) * np.exp(rng.randn(3, 7, 1)))
    codes, scale = quantize8(x, parse_cache_spec("int8"))
    assert codes.dtype == jnp.uint8 and scale.shape == (3, 7, 1) and scale.dtype == jnp.float16  # the int8's bytes
    back = values8(codes, parse_cache_spec("int8")) * scale.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(values8(codes, parse_cache_spec("int8"))))) <= 127
    assert float(jnp.max(jnp.abs(back - x) / scale.astype(jnp.float32))) <= 0.5 + 1e-3
    for spec, mantissa in (("fp8-tok", 3), ("fp8-e5m2-tok", 2)):
        codes, scale = quantize8(x, parse_cache_spec(spec))
        assert codes.dtype == jnp.uint8  # the float8 value's bytes
        back = values8(codes, parse_cache_spec(spec)) * scale.astype(jnp.float32)
        normal = jnp.abs(x) > 0.02 * scale.astype(jnp.float32) * parse_cache_spec(spec).max_value  # not subnormal
        rel = jnp.where(normal, jnp.abs(back - x) / jnp.abs(x), 0)
        assert float(rel.max()) <= 2.0 ** -(mantissa + 1) * 1.01, spec  # half a unit in the last place
    big = jnp.asarray([[1000.0, -1e6, 3.0, 0.0]])
    codes, scale = quantize8(big, parse_cache_spec("fp8"))
    assert scale is None and np.asarray(values8(codes, parse_cache_spec("fp8"))).tolist() == [[448.0, -448.0, 3.0, 0.0]]
    codes, scale = quantize8(jnp.zeros((2, 8)), parse_cache_spec("int8"))  # an all-zero token: zeros, not NaN
    assert np.all(np.asarray(codes) == 0) and np.all(np.asarray(scale) == 0)


@pytest.mark.parametrize("spec", SPECS)
def test_chunked_appends_store_the_bytes_of_one_token_appends(spec):
    batch, n = 2, 45
    k, v = random_kv(1, batch, n)
    lengths = np.array([n, 31])
    caches = []
    rng = np.random.RandomState(2)
    for pattern in ("one", "seven", "random"):
        cache, done = make_cache(spec, CFG, batch, 64), np.zeros(batch, int)
        while (done < lengths).any():
            step = {"one": 1, "seven": 7}.get(pattern) or int(rng.randint(1, 12))
            num_new = np.minimum(step, lengths - done)
            idx = np.minimum(done[:, None] + np.arange(step)[None, :], n - 1)  # [batch, step]
            take = lambda x: jnp.stack([x[:, b, :, idx[b]].transpose(1, 2, 0, 3) for b in range(batch)], axis=1)
            cache = append8_jit(cache, take(k), take(v), jnp.asarray(num_new, jnp.int32))
            done += num_new
        caches.append(cache)
    for other in caches[1:]:
        assert other.length.tolist() == lengths.tolist()
        for a, b in zip(jax.tree_util.tree_leaves(caches[0]), jax.tree_util.tree_leaves(other)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    stored_k, _ = caches[0].dequantized(1)  # what was stored is the tokens, to the format's precision
    assert float(jnp.max(jnp.abs(stored_k[1, :, :31] - k[1, 1, :, :31]))) <= 0.1 * float(jnp.max(jnp.abs(k)))


def dense_reference(q, positions, cache: Dense8Cache, layer, k_new, v_new, num_new, window):
    """Attention of new tokens over every stored token of one layer (dequantized, materialized) and the real new
    tokens, causal and windowed, in float32 at the highest precision."""
    k_old, v_old = cache.dequantized(layer)  # [batch, kv_heads, max_tokens, head_dim]
    batch, tokens, q_heads, d = q.shape
    kv_heads, max_tokens = k_old.shape[1], k_old.shape[2]
    k = jnp.concatenate([k_old, jnp.swapaxes(k_new, 1, 2).astype(jnp.float32)], axis=2)
    v = jnp.concatenate([v_old, jnp.swapaxes(v_new, 1, 2).astype(jnp.float32)], axis=2)
    key_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(max_tokens), (batch, max_tokens)), positions], axis=1)
    key_ok = jnp.concatenate([jnp.arange(max_tokens)[None] < cache.length[:, None],
                              jnp.arange(tokens)[None] < num_new[:, None]], axis=1)  # [batch, keys]
    valid = key_ok[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None])
    if window is not None:
        valid &= key_pos[:, None, :] > positions[:, :, None] - window
    qg = q.astype(jnp.float32).reshape(batch, tokens, kv_heads, q_heads // kv_heads, d) / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("bqhrd,bhtd->bhrqt", qg, k, precision="highest")
    p = jax.nn.softmax(jnp.where(valid[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhrqt,bhtd->bqhrd", p, v, precision="highest")
    return out.reshape(batch, tokens, q_heads, d)


@pytest.mark.parametrize("spec, window, tokens", [("int8", None, 5), ("fp8", 23, 1), ("fp8-e5m2-tok", None, 1),
                                                  ("int8", 40, 1), ("fp8-tok", 11, 4)])
def test_attention_equals_a_dense_reference_of_what_is_stored(spec, window, tokens):
    batch, max_tokens = 2, 600  # past one 512-token block, and not a multiple of any block
    k, v = random_kv(3, batch, max_tokens)
    cache = append8_jit(make_cache(spec, CFG, batch, max_tokens), k, v, jnp.asarray([37, 541]))
    rng = np.random.RandomState(4)
    q = jnp.asarray(rng.randn(batch, tokens, CFG.num_heads, CFG.head_dim).astype(np.float32))
    k_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    v_new = jnp.asarray(rng.randn(batch, tokens, CFG.num_kv_heads, CFG.head_dim).astype(np.float32))
    num_new = jnp.asarray([tokens, max(tokens - 2, 1)])  # ragged when several tokens come
    positions = cache.length[:, None] + jnp.arange(tokens)[None, :]
    real = np.asarray(jnp.arange(tokens)[None, :] < num_new[:, None])

    @jax.jit
    def run(cache, q, k_new, v_new):
        out = []
        for layer in range(CFG.num_layers):
            ref = dense_reference(q, positions, cache, layer, k_new, v_new, num_new, window)
            ours, update = cache.attend(layer, q, k_new, v_new, positions, identity_rope, num_new, window)
            blocks = [attention.attend_full_xla(q, positions, cache.k, cache.v, layer, cache.length, k_new, v_new,
                                                num_new, window, block) for block in (16, 48)]
            out.append((ref, [ours] + blocks, update))
        return out

    for ref, ours_by_block, update in run(cache, q, k_new, v_new):
        for ours in ours_by_block:
            bound = 1e-5 + 1e-5 * np.abs(np.asarray(ref))  # allclose's: float32 rounding of the online softmax
            assert (np.abs(np.asarray(ours - ref)) <= bound)[real].all()
        want = quantize8(jnp.swapaxes(k_new, 1, 2), cache.config)[0]  # the update is the new tokens' codes
        np.testing.assert_array_equal(np.asarray(update.k).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_equal_the_formula(spec):
    cfg = LlamaConfig(vocab_size=8, hidden_size=256, intermediate_size=8, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=128)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = make_cache(spec, cfg, 2, 1000, dtype)
        assert cache.nbytes == cache_bytes(spec, cfg, 2, 1000, jnp.dtype(dtype).itemsize)
    per_token = parse_cache_spec(spec).per_token
    full = cache_bytes("full", cfg, 2, 1000, 2)
    assert cache_bytes(spec, cfg, 2, 1000, 2) - 16 == (full - 16) // 2 * (1 + per_token * 2 / 128)


def test_a_forced_kernel_that_cannot_serve_says_why_and_auto_is_quiet():
    params = init_params(CFG, jax.random.PRNGKey(0))  # head_dim 32: the native kernel serves 64 and 128
    tokens = jnp.asarray(np.random.RandomState(5).randint(0, CFG.vocab_size, (1, 1)))
    with pytest.warns(UserWarning, match="no Pallas kernel reads 8-bit"):
        forward(params, tokens, make_cache("int8", CFG, 1, 16, impl="pallas"))
    with pytest.warns(UserWarning, match="head_dim"):
        forward(params, tokens, make_cache("int8", CFG, 1, 16, impl="native"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward(params, tokens, make_cache("int8", CFG, 1, 16))


def test_a_scale_past_float16_is_flagged():
    cache = make_cache("int8", CFG, 2, 16)
    k = jnp.ones((CFG.num_layers, 2, CFG.num_kv_heads, 1, CFG.head_dim)).at[:, 1, 0, 0, 3].set(1e7)
    cache = append8(cache, k, jnp.ones_like(k), jnp.asarray([1, 1]))
    assert cache.overflow.tolist() == [False, True] and int(cache.error_flags[1]) & SCALE_OVERFLOW


def test_the_model_through_eight_bit_caches_stays_close_to_full_and_finer_formats_closer():
    params = init_params(CFG, jax.random.PRNGKey(1))
    tokens = jnp.asarray(np.random.RandomState(6).randint(0, CFG.vocab_size, (2, 40)))
    step = jax.jit(forward, donate_argnames=("cache",))
    logits = {}
    for spec in ["full", "int8", "fp8-tok", "fp8-e5m2-tok"]:
        cache = make_cache(spec, CFG, 2, 48)
        out, cache = step(params, tokens[:, :9], cache)
        outs = [out[:, -1]]
        for t in range(9, 40):
            out, cache = step(params, tokens[:, t : t + 1], cache)
            outs.append(out[:, 0])
        logits[spec] = np.stack(outs)
    err = {s: np.abs(logits[s] - logits["full"]).max() for s in logits if s != "full"}
    scale = np.abs(logits["full"]).max()
    assert err["int8"] < err["fp8-tok"] < err["fp8-e5m2-tok"] < 0.05 * scale, err


def test_generate_with_an_int8_cache_reports_every_token_stored_in_eight_bits(tiny_dirs):
    model = kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)
    out = kivi_jax.generate(model, [5, 6, 7, 8], max_new_tokens=6, cache="int8")
    ref = kivi_jax.generate(model, [5, 6, 7, 8], max_new_tokens=6, cache="full")
    stats = out.cache_stats
    assert stats["cache"] == "int8" and stats["keys_quantized"] == stats["tokens"] == [4 + 6 - 1]
    assert stats["bytes"] < stats["full_bytes"] / 3.5
    assert len(out.token_ids) == len(ref.token_ids) == 6


def test_the_serving_engine_on_an_int8_cache_gives_generate_s_greedy_tokens(tiny_dirs):
    from kivi_jax.serve.engine import Engine
    from kivi_jax.sampling import Sampling

    model = kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)
    prompt = np.random.RandomState(9).randint(3, 90, 37).tolist()
    eng = Engine(model.params, "int8", slots=2, max_length=64, prefill_chunk=64)  # one chunk, as generate
    assert eng.slot_bytes < cache_bytes("full", model.config, 1, 64, 4) / 3.5
    slot, tok = eng.admit(prompt, Sampling(0.0))
    out = [tok] + [eng.step()[slot] for _ in range(7)]
    ref = kivi_jax.generate(model, prompt, max_new_tokens=8, cache="int8", max_length=64, stop_at_eos=False)
    assert out == ref.token_ids


@pytest.mark.parametrize("spec, window, head_dim, n_rep", [("int8", None, 64, 2), ("fp8", 23, 128, 1),
                                                           ("fp8-e5m2-tok", None, 64, 3), ("fp8-e5m2", 40, 128, 4),
                                                           ("fp8-tok", None, 64, 5)])
def test_the_native_kernel_equals_the_xla_path(spec, window, head_dim, n_rep):
    """The C++ decode kernel (kivi_jax/native) against its twin, the XLA path over the same stores: ragged lengths
    that are not multiples of its 64-token chunks, every format, both head dims, windows, GQA of 1 to 5 rows."""
    from kivi_jax import native

    if jax.default_backend() != "cpu":
        pytest.skip("the native kernels run on the CPU backend")
    assert native.available(), native.error()
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2 * n_rep,
                      num_kv_heads=2, head_dim=head_dim)
    batch, max_tokens = 3, 300
    k, v = random_kv(5, batch, max_tokens, cfg)
    cache = append8_jit(make_cache(spec, cfg, batch, max_tokens), k, v, jnp.asarray([1, 130, 299]))
    rng = np.random.RandomState(6)
    q = jnp.asarray(rng.randn(batch, 1, cfg.num_heads, head_dim).astype(np.float32))
    k_new, v_new = (jnp.asarray(rng.randn(batch, 1, 2, head_dim).astype(np.float32)) for _ in range(2))

    @jax.jit
    def both(cache, q, k_new, v_new):
        return [(native.decode_eight(q, cache.k, cache.v, layer, cache.length, k_new, v_new, window,
                                     cache.config.fmt),
                 attention.attend_full_xla(q, cache.length[:, None], cache.k, cache.v, layer, cache.length, k_new,
                                           v_new, jnp.ones_like(cache.length), window))
                for layer in range(cfg.num_layers)]

    for ours, twin in both(cache, q, k_new, v_new):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(twin), rtol=1e-5, atol=1e-5)


def test_auto_takes_the_native_kernel_on_the_cpu_and_greedy_tokens_agree(monkeypatch):
    from kivi_jax import cache8, native

    if jax.default_backend() != "cpu":
        pytest.skip("the native kernels run on the CPU backend")
    calls = []
    real = native.decode_eight
    monkeypatch.setattr(native, "decode_eight", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)  # a head_dim the kernel serves
    params = init_params(cfg, jax.random.PRNGKey(3))
    prompt = np.random.RandomState(10).randint(3, 120, 30).tolist()
    got = kivi_jax.generate(params, prompt, max_new_tokens=8, cache="int8", stop_at_eos=False)
    assert calls and cache8.EIGHT_AUTO  # traced into the decode step
    xla = kivi_jax.generate(params, prompt, max_new_tokens=8, cache="int8", stop_at_eos=False, attention_impl="xla")
    assert got.token_ids == xla.token_ids
