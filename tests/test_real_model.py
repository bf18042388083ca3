"""SmolLM2-135M-Instruct from its GGUF (the offline default model): parity with transformers and real answers."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from conftest import torch_threads
from kivi_jax import hub
from kivi_jax.models.llama import forward

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"


def test_default_model_shape(smollm2):
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert hub.checkpoint_dir("smollm2").is_dir()  # converted once, cached


def test_logits_match_transformers_gguf_load(smollm2):
    torch = torch_threads()
    from transformers import AutoModelForCausalLM

    gguf = hub.fetch_gguf("smollm2")
    ref_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = smollm2.tokenizer("The Python language reference describes the syntax and core semantics.")["input_ids"]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(jax.jit(forward)(smollm2.params, jnp.asarray([ids]))[0])
    assert np.abs(ours - ref).max() <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("cache", ["full", "kivi2"])  # 4-bit codes hold more than 2-bit ones (kivi4 measured in docs/quality.md)
def test_chat_answer_names_paris(smollm2, cache):
    gen = kivi_jax.generate(smollm2, QUESTION, chat=True, max_new_tokens=24, cache=cache)
    assert "Paris" in gen.text


def test_cli_generate_json(smollm2, capfd):
    """In this process (the compiled kivi2 steps of test_chat_answer_names_paris serve it: same prompt bucket and cache
    size); capfd reads file descriptor 1, so anything else written to stdout would break the JSON as it would in a
    pipe. The `python -m kivi_jax.cli` entry itself is checked with --help in a fresh interpreter."""
    from kivi_jax import cli

    assert cli.main(["generate", "--prompt", QUESTION, "--chat", "--max-new-tokens", "16", "--cache", "kivi2",
                     "--json"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert "Paris" in result["text"]
    assert {"text", "token_ids", "prompt_tokens", "new_tokens", "seconds"} <= set(result)
    assert result["new_tokens"] == len(result["token_ids"]) and result["prompt_tokens"] > 10
    entry = subprocess.run([sys.executable, "-m", "kivi_jax.cli", "generate", "--help"], capture_output=True,
                           text=True, check=True)
    assert "--max-new-tokens" in entry.stdout and "--json" in entry.stdout


def test_gguf_tokenizer_needs_no_torch_and_follows_llama_cpp(smollm2):
    """Our tokenizer is built from the GGUF with `tokenizers` alone. It splits digits one by one before the GPT-2
    byte-level split, as llama.cpp's `smollm` pre-tokenizer does; transformers' GGUF tokenizer does not split digits
    first, so the two differ only where whitespace runs into a digit."""
    import re

    from transformers import AutoTokenizer

    from kivi_jax import checkpoint, evaluate

    gguf = hub.fetch_gguf("smollm2")
    ours = checkpoint.gguf_tokenizer(gguf)
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = evaluate.default_text()
    no_digit_runs = re.sub(r"\s+(?=\d)", "", text)  # where whitespace runs into a digit, the pre-tokenizers differ
    assert ours(no_digit_runs)["input_ids"] == theirs(no_digit_runs)["input_ids"]
    ids = ours(text)["input_ids"]
    assert ours.decode(ids) == text
    assert [ours.convert_ids_to_tokens(i) for i in ours("x = 10\n   42")["input_ids"]] == \
        ["x", "Ġ=", "Ġ", "1", "0", "ĊĠĠĠ", "4", "2"]
    chat = [{"role": "user", "content": QUESTION}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert smollm2.tokenizer(text)["input_ids"] == ids  # the cached tokenizer is this one


def test_gguf_blocks_give_the_float32_path_s_tokens(smollm2):
    """The default model keeps its GGUF blocks (Q8_0 embeddings and head, Q4_1 projections) and decodes through the
    native quantized matmul: 64 greedy tokens of the README's prompts equal the float32-dequantized weights' through
    a kivi2 cache (the weights are read the same whatever the cache); the prefill logits agree to 1e-3 (float
    summation order only). Resident weights: the GGUF's own tensor bytes."""
    from kivi_jax import weights
    from kivi_jax.cache import tree_bytes

    assert weights.summary(smollm2.params) == "q4_1+q8_0"
    assert tree_bytes(smollm2.params) <= 1.1 * 96_576_768  # the GGUF's tensor bytes
    flat = kivi_jax.load("smollm2", progress=False, weights="float32")
    prompts = [QUESTION, "Write a short story about a lighthouse keeper."]
    ids = smollm2.tokenizer(prompts[1])["input_ids"]
    a, b = (np.asarray(jax.jit(forward)(m.params, jnp.asarray([ids]))[0]) for m in (smollm2, flat))
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max() and (a.argmax(-1) == b.argmax(-1)).all()
    kw = dict(chat=True, max_new_tokens=64, cache="kivi2", stop_at_eos=False)
    assert kivi_jax.generate(smollm2, prompts, **kw).token_ids == kivi_jax.generate(flat, prompts, **kw).token_ids


def test_a_prefill_from_a_chunk_end_is_the_prompts_own_prefill_bit_for_bit(smollm2):
    """A 600-token prompt: one 512-token chunk and a 96-token last one (`runtime.ChunkPlan`). Prefilled whole, and
    from the cache at its first chunk end (what a shared prefix starts from): the same logits to the bit. (On this
    model a 512-wide last chunk rounds differently, so this holds only because both take the plan's narrow one.)"""
    from kivi_jax import runtime
    from kivi_jax.cache import make_cache
    from kivi_jax.config import parse_cache_spec

    params, cfg = smollm2.params, smollm2.config
    prompt = np.random.RandomState(7).randint(10, cfg.vocab_size, (1, 600)).astype(np.int32)
    assert runtime.chunk_plan(600, 512) == (512, 2, 96)
    make = lambda: make_cache(parse_cache_spec("kivi2"), cfg, 1, 1024, params.dtype, "xla")
    whole, _ = runtime.prefill(params, prompt, np.array([600]), make(), 512)
    _, part = runtime.prefill(params, prompt[:, :512], np.array([512]), make(), 512)
    rest, _ = runtime.prefill(params, prompt[:, 512:], np.array([88]), part, 512)
    np.testing.assert_array_equal(np.asarray(rest), np.asarray(whole))
