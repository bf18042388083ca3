"""Qwen2, Qwen3 and Gemma 2, added through the architecture seam (models/registry.py), against transformers' PyTorch
models: logits of a prefill, chunked appends and decode steps through the full cache; KIVI caches (every preset,
`-rotv`) while every token is in the ring; greedy `generate`; GGUF files named as the `gguf` package names them;
Gemma 2's soft-capped attention over quantized tokens against a dense reference, and the kernels stepping aside."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from conftest import TINY_VOCAB, char_tokenizer, gguf_shape_header, hf_logits, torch_threads
from kivi_jax import attention, checkpoint, rotation
from kivi_jax.cache import KIVICache, make_cache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models import registry
from kivi_jax.models.config import ModelConfig, UnsupportedModelError
from kivi_jax.models.decoder import forward
from reference import dense_kivi_decode

TOL = 1e-4
PREFILL, CHUNK, CHUNKS, DECODE = 9, 5, 2, 6  # 25 tokens: past Qwen2's window (7) and Gemma 2's (6)
SEQ = PREFILL + CHUNK * CHUNKS + DECODE

# architecture -> transformers config options beyond the common tiny shapes
ARCHS = {
    # biases on q, k, v; an untied head; the second layer windowed (use_sliding_window from max_window_layers on)
    "qwen2": dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=7, max_window_layers=1),
    # per-head q/k RMSNorm, tied embeddings
    "qwen3": dict(tie_word_embeddings=True, head_dim=16),
    # scores scaled by 1/sqrt(24) (not head_dim 16), soft-caps small enough to bite, local/global alternation
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=1.0,
                   final_logit_softcapping=2.0),
}
# The KIVI presets, spread over the architectures (each run stays inside the ring: R >= SEQ). kivi2+ and kivi3+ hold
# pre-RoPE keys, sinks and rotated values; kivi2 runs as kivi4 does while no token is quantized (only the codes' bits
# differ), and quantized past its ring on every architecture in the mesh check (tests/sharding_worker.py).
KIVI_CASES = [("qwen2", "kivi3+"), ("qwen3", "kivi4"), ("gemma2", "kivi2+")]


def make_model(arch: str, seed: int = 0):
    """A tiny random transformers model of `arch` (2 layers, hidden 64), float32, every weight random: matrices
    3x the default init, biases and norm weights perturbed (their defaults, 0 or 1, would hide a wrong formula)."""
    torch = torch_threads()
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2"}[arch]
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    config = getattr(transformers, f"{cls}Config")(**common, **ARCHS[arch])
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (HF directory, the torch model, our Model loaded from it, HF logits of two SEQ-token sequences)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        model = make_model(arch, seed=10 + i)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        if arch == "gemma2":  # one of them through kivi_jax.load with its tokenizer (the others: load_hf, ids only)
            char_tokenizer().save_pretrained(path)
            ours = kivi_jax.load(str(path), progress=False)
        else:
            params = checkpoint.load_hf(path)
            ours = kivi_jax.Model(params, params.config, None)
        tokens = np.random.RandomState(i).randint(3, TINY_VOCAB, (2, SEQ))
        out[arch] = (path, model, ours, tokens, hf_logits(model, tokens))
    return out


prefill_step = jax.jit(forward)
decode_step = jax.jit(forward, donate_argnames=("cache",))


def cached_logits(params, tokens, cache, prefill: int = PREFILL, chunks: int = CHUNKS) -> np.ndarray:
    """Logits `[batch, SEQ, vocab]` through `cache`: a prefill of `prefill` tokens (none: 0), `chunks` appends of
    CHUNK tokens, then one token at a time."""
    out, t = [], 0
    if prefill:
        logits, cache = prefill_step(params, jnp.asarray(tokens[:, :prefill]), cache)
        out, t = [np.asarray(logits)], prefill
    for _ in range(chunks):
        logits, cache = prefill_step(params, jnp.asarray(tokens[:, t : t + CHUNK]), cache)
        out.append(np.asarray(logits))
        t += CHUNK
    while t < tokens.shape[1]:
        logits, cache = decode_step(params, jnp.asarray(tokens[:, t : t + 1]), cache)
        out.append(np.asarray(logits))
        t += 1
    assert cache.length.tolist() == [tokens.shape[1]] * tokens.shape[0]
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(models, arch):
    """Through the full cache: a prefill, chunked appends and decode steps (a whole sequence without a cache:
    test_gguf_matches_transformers)."""
    _, _, model, tokens, ref = models[arch]
    params = model.params
    assert params.config.model_type == arch and registry.for_config(params.config).name == arch
    ours = cached_logits(params, tokens, make_cache("full", params.config, 2, 32))
    segments = {"prefill": slice(0, PREFILL), "chunks": slice(PREFILL, PREFILL + CHUNK * CHUNKS),
                "decode": slice(PREFILL + CHUNK * CHUNKS, SEQ)}
    for name, part in segments.items():
        assert np.abs(ours[:, part] - ref[:, part]).max() <= TOL, name


def test_configs_read_what_each_architecture_has(models):
    qwen2, qwen3, gemma2 = (models[a][2].config for a in ("qwen2", "qwen3", "gemma2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.tie_word_embeddings
    assert qwen2.layer_attention() == ((None, None), (7, None))  # the window from max_window_layers on
    assert not qwen3.qkv_bias and qwen3.tie_word_embeddings
    assert gemma2.layer_attention() == ((6, 1.0), (None, 1.0)) and gemma2.final_logit_softcap == 2.0
    assert gemma2.query_scale == pytest.approx((16 / 24) ** 0.5) and gemma2.hidden_act == "gelu_tanh"
    for cfg in (qwen2, qwen3, gemma2):
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert {"layers.bq", "layers.bv"} <= set(registry.param_table(qwen2)) and "layers.q_norm" in registry.param_table(
        qwen3)


@pytest.mark.parametrize("arch, spec", KIVI_CASES)
def test_kivi_caches_equal_transformers_while_every_token_is_in_the_ring(models, arch, spec):
    """Every preset (pre-RoPE keys, sinks, rotated values with Qwen2's value bias rotated too): with no token
    quantized yet, the KIVI cache answers as transformers does, one token at a time from empty (a KIVI prefill and
    chunks run the same model code: test_logits_match_transformers, tests/test_chunked.py)."""
    _, _, model, tokens, ref = models[arch]
    parsed = parse_cache_spec(spec)
    assert parsed.residual_length >= SEQ
    params = rotation.prepare_params(model.params, parsed)
    if parsed.rotate_values:  # the value leaves the architecture declares did change
        for name in ("wv", "bv") if arch == "qwen2" else ("wv",):
            assert np.abs(np.asarray(getattr(params.layers, name) - getattr(model.params.layers, name))).max() > 1e-3
    ours = cached_logits(params, tokens, make_cache(parsed, params.config, 2, parsed.residual_length), 0, 0)
    assert np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generate_matches_transformers(models, arch):
    torch = torch_threads()
    _, hf, model, tokens, _ = models[arch]
    prompt = tokens[0, :11].tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)
    gen = kivi_jax.generate(model, prompt, max_new_tokens=16, cache="full", stop_at_eos=False)
    assert gen.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_through_chat_and_the_serving_engine_equals_generate(models, arch):
    """The three drivers of the runtime agree on every architecture, with a kivi2 cache past its ring (150 prompt
    tokens, R 128): `Chat`'s reply is what `generate` gives the rendered turn, the serving engine's tokens are what
    `generate` gives the prompt alone."""
    from kivi_jax.sampling import Sampling
    from kivi_jax.serve.engine import Engine

    _, _, model, _, _ = models[arch]
    tok = model.tokenizer if model.tokenizer is not None else char_tokenizer()
    m = kivi_jax.Model(model.params, model.config, tok)
    eos = set(model.config.eos_token_ids)
    kw = dict(cache="kivi2", max_length=256)

    chat = kivi_jax.Chat(m, max_new_tokens=12, **kw)
    text = "abc defg " * 17
    chat.send(text)
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(ids) > 128
    ref = kivi_jax.generate(m, ids, max_new_tokens=12, **kw)
    assert chat.last_turn["reply_ids"] == [t for t in ref.token_ids if t not in eos]

    prompt = np.random.RandomState(5).randint(3, TINY_VOCAB, 150).tolist()
    eng = Engine(m.params, "kivi2", slots=2, max_length=256, prefill_chunk=64)
    slot, first = eng.admit(prompt, Sampling(0.0))
    out = [first] + [eng.step()[slot] for _ in range(11)]
    ref = kivi_jax.generate(m, prompt, max_new_tokens=12, stop_at_eos=False, **kw)
    assert out == ref.token_ids


def write_gguf(model, arch: str, path) -> None:
    """A GGUF of a transformers model, tensors named by the `gguf` package's own table for the architecture (what
    llama.cpp's converter writes: q/k rows in HF's order for these architectures, Gemma's norms stored as 1 + w)."""
    import gguf

    cfg = model.config
    kind = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2}[arch]
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    gguf_shape_header(writer, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    if arch == "gemma2":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = w.numpy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            w = w + 1.0
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        writer.add_tensor(mapped, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_matches_transformers(models, arch, tmp_path):
    _, hf, model, tokens, ref = models[arch]
    if arch == "gemma2":  # a GGUF does not carry query_pre_attn_scalar: llama.cpp takes head_dim, as we do
        hf = make_model(arch, seed=10)
        hf.config.query_pre_attn_scalar = hf.config.head_dim
        for layer in hf.model.layers:
            layer.self_attn.scaling = hf.config.head_dim ** -0.5
        ref = hf_logits(hf, tokens)
    write_gguf(hf, arch, tmp_path / "tiny.gguf")
    params = checkpoint.load_gguf(tmp_path / "tiny.gguf")
    cfg = params.config
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.layer_attention()) == (
        arch, model.config.tie_word_embeddings, model.config.layer_attention() if arch != "qwen2" else
        ((None, None),) * 2)  # a qwen2 GGUF has no sliding window
    if arch == "qwen2":  # our reference had a window on its second layer: compare where it has not bitten yet
        tokens, ref = tokens[:, :7], ref[:, :7]
    ours, _ = prefill_step(params, jnp.asarray(tokens))
    assert np.abs(np.asarray(ours) - ref).max() <= TOL


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "layer_types": ["full_attention"]},
     "layer_types names 1 layers"),
    ({"model_type": "qwen3", "architectures": ["Qwen2ForCausalLM"]}, "unsupported architecture"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "layer_types": ["chunked_attention"] * 2},
     "layer types \\['chunked_attention'\\] are not supported"),
])
def test_unsupported_configs_say_why(change, message):
    hf = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, **change}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf)


SOFTCAP_CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2, head_dim=16, model_type="gemma2")


def test_soft_capped_decode_over_quantized_tokens_equals_a_dense_reference():
    """The XLA path caps every segment's scores (sinks, quantized blocks, ring, the new token); a kernel cannot, so
    forcing one warns and the XLA path answers."""
    rng = np.random.RandomState(0)
    kivi = KIVIConfig(2, 2, 16, 16, sinks=3)
    batch, tokens, cap, window = 2, 50, 2.0, 40
    shape = (SOFTCAP_CFG.num_layers, batch, tokens, SOFTCAP_CFG.num_kv_heads, SOFTCAP_CFG.head_dim)
    k, v = (jnp.asarray(rng.randn(*shape).astype(np.float32)) for _ in range(2))
    lengths = jnp.array([tokens, 29])

    @jax.jit
    def filled(cache, k, v):  # the tokens appended through the cache's own protocol
        ups = [cache.append_update(cache.k_ring[l], cache.v_ring[l], jnp.swapaxes(k[l], 1, 2),
                                   jnp.swapaxes(v[l], 1, 2), lengths) for l in range(shape[0])]
        return cache.commit(jax.tree_util.tree_map(lambda *x: jnp.stack(x), *ups), lengths)

    cache = filled(KIVICache.create(SOFTCAP_CFG, kivi, batch, 64), k, v)
    q = jnp.asarray(3.0 * rng.randn(batch, 1, SOFTCAP_CFG.num_heads, SOFTCAP_CFG.head_dim).astype(np.float32))
    k_new, v_new = (jnp.asarray(rng.randn(batch, 1, 2, 16).astype(np.float32)) for _ in range(2))
    layer = 0

    @jax.jit
    def answers(c, q, k, v):
        ref = dense_kivi_decode(q, c, layer, k, v, window, softcap=cap)
        uncapped = dense_kivi_decode(q, c, layer, k, v, window)
        forced = [attention.decode_kivi(impl, q, c.k, c.v, layer, c.k_ring, c.v_ring, c.length, k, v, window,
                                        (c.k_sink, c.v_sink), None, cap) for impl in ("native", "pallas")]
        return ref, uncapped, forced

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, uncapped, forced = answers(cache, q, k_new, v_new)
    assert sum("soft-caps" in str(w.message) for w in caught) == 2  # each forced kernel said why it stepped aside
    for ours in forced:  # the XLA path answered
        assert np.abs(np.asarray(ours - ref)).max() <= 1e-5
    assert np.abs(np.asarray(ref - uncapped)).max() > 1e-2  # the cap changed the answer
