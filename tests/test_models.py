"""Our functional Llama/Mistral against transformers' PyTorch models (the correctness oracle)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_CONFIGS, TINY_VOCAB, hf_logits
from kivi_jax.cache import FullCache
from kivi_jax.checkpoint import load_hf
from kivi_jax.models.config import LlamaConfig, UnsupportedModelError
from kivi_jax.models.llama import forward

TOL = 1e-4
SEQ = 40  # longer than the Mistral window (11) and the llama3 original context (32)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefill_logits_match_transformers(tiny_dirs, name):
    path, model = tiny_dirs[name]
    params = load_hf(path)
    tokens = np.random.RandomState(1).randint(0, TINY_VOCAB, (2, SEQ))
    ref = hf_logits(model, tokens)
    ours, _ = jax.jit(forward)(params, jnp.asarray(tokens))
    assert np.abs(np.asarray(ours) - ref).max() <= TOL
    # through the cache: one prefill of the whole sequence
    cache = FullCache.create(params.config, 2, 64)
    ours_cached, cache = jax.jit(forward)(params, jnp.asarray(tokens), cache)
    assert np.abs(np.asarray(ours_cached) - ref).max() <= TOL
    assert cache.length.tolist() == [SEQ, SEQ]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_token_by_token_decoding_matches_transformers(tiny_dirs, name):
    path, model = tiny_dirs[name]
    params = load_hf(path)
    tokens = np.random.RandomState(2).randint(0, TINY_VOCAB, (2, SEQ))
    ref = hf_logits(model, tokens)
    step = jax.jit(forward, donate_argnames=("cache",))
    cache = FullCache.create(params.config, 2, 64)
    prompt = 5
    logits, cache = step(params, jnp.asarray(tokens[:, :prompt]), cache)
    worst = np.abs(np.asarray(logits) - ref[:, :prompt]).max()
    for t in range(prompt, SEQ):
        logits, cache = step(params, jnp.asarray(tokens[:, t : t + 1]), cache)
        worst = max(worst, np.abs(np.asarray(logits[:, 0]) - ref[:, t]).max())
    assert worst <= TOL


def test_ragged_prefill_matches_each_sequence_alone(tiny_dirs):
    path, model = tiny_dirs["llama_gqa_llama3"]
    params = load_hf(path)
    rng = np.random.RandomState(3)
    lengths = [9, 23]
    tokens = np.zeros((2, 23), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.randint(3, TINY_VOCAB, n)
    cache = FullCache.create(params.config, 2, 64)
    logits, cache = forward(params, jnp.asarray(tokens), cache, num_new=jnp.asarray(lengths))
    for i, n in enumerate(lengths):
        ref = hf_logits(model, tokens[i : i + 1, :n])[0]
        assert np.abs(np.asarray(logits[i, :n]) - ref).max() <= TOL
    assert cache.length.tolist() == lengths
    # padded positions were never written
    assert float(jnp.abs(cache.k[:, 0, :, lengths[0]:]).max()) == 0.0


def test_config_reads_transformers_4_and_5_formats():
    v5 = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "eos_token_id": [2, 3],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 500000.0
    v4["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}
    a, b = LlamaConfig.from_hf(v5), LlamaConfig.from_hf(v4)
    assert a == b
    assert a.rope_type == "llama3" and a.rope_theta == 500000.0 and a.eos_token_ids == (2, 3)
    assert LlamaConfig.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "unsupported architecture"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_configs_say_why(change, message):
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    }
    hf.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        LlamaConfig.from_hf(hf)
