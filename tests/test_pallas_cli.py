"""`kivi-jax generate --attention-impl pallas` runs a kernel (interpret mode on CPU) end to end and prints the same
greedy tokens as `--attention-impl xla`: the full-precision cache of a tiny Mistral (sliding window) model. (The
KIVI kernel under `generate`: test_pallas_kivi.py.)"""

import json
import warnings

from conftest import char_tokenizer, make_hf_model
from kivi_jax import cli
from kivi_jax.pallas_kernels import full_decode


def test_cli_generate_with_the_kernel_matches_the_xla_path(tmp_path, capsys, monkeypatch):
    calls = []
    real = full_decode.decode
    monkeypatch.setattr(full_decode, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = make_hf_model(("mistral", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                           sliding_window=20, tie_word_embeddings=False)), seed=7)
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    runs = {}
    for impl in ("xla", "pallas"):
        argv = ["generate", "--model", str(tmp_path), "--prompt", "the quick brown fox jumps over the lazy dog",
                "--max-new-tokens", "24", "--greedy", "--cache", "full", "--attention-impl", impl, "--json"]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a fallback to XLA would warn
            assert cli.main(argv) == 0
        runs[impl] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert calls
    assert runs["pallas"]["token_ids"] == runs["xla"]["token_ids"]
    assert runs["xla"]["new_tokens"] == 24 and len(set(runs["xla"]["token_ids"])) > 3
