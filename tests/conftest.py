"""Shared fixtures: tiny random transformers models (the parity oracle) saved as HF directories, loaded by us."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch on 2 threads is up to 1000x slower on small ops here
# Little compiler optimization (jax_disable_most_optimizations: LLVM at -O0) for the tests on tiny models, here and in
# the processes they start: nearly all their programs are tiny, so compiling is most of their time (a third less for
# tests/test_kivi_cache.py). XLA's HLO passes and the float semantics stay the same (XLA:CPU uses no fast math). The
# real-model tests (`real_model`) run their long decodes optimized as usual (at -O0 they took twice as long); see
# `compile_fast` below.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# ... and XLA:CPU's older loop-fusion emitter, which compiles in about half the time (tests/xla_flags.py): every test
# process, the processes the tests start inheriting it; except a test marked `xla_default_emitters` (below), run in a
# child process under XLA's own emitters.
from xla_flags import DEFAULT_EMITTERS_ENV, with_test_flags, without_test_flags  # noqa: E402

if os.environ.get(DEFAULT_EMITTERS_ENV) != "1":
    os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))
# With KIVI_JAX_TEST_JIT_CACHE=1: one persistent compilation cache for the whole run, shared by the xdist workers and
# every process the tests start (many files compile the same programs of the same tiny models, and a second compile
# becomes a read: about a tenth of the suite's time here). Off by default: once in about six full runs XLA aborted the
# worker while serializing an executable for the cache (`executable.serialize()` in jax's put_executable_and_time,
# test_pallas_cli's decode step, 2026-12-02), and xdist then hung. Fresh for each run (the controller makes it and
# removes it at the end), unless JAX_COMPILATION_CACHE_DIR is already set.
if os.environ.get("KIVI_JAX_TEST_JIT_CACHE") == "1" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kivi-jax-test-jit-")
    os.environ["KIVI_JAX_TEST_JIT_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import numpy as np
import pytest

TINY_VOCAB = 96

# name -> (architecture, kwargs for the transformers config)
TINY_CONFIGS = {
    # n_rep 1, untied embeddings
    "llama_mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    # GQA n_rep 2, tied embeddings, llama3 rope scaling (original context shorter than the test sequences)
    "llama_gqa_llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0,
    )),
    # Mistral: GQA n_rep 4, sliding window shorter than the sequences
    "mistral_window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=11,
                                       tie_word_embeddings=False)),
}


# The files that take longest, run first (largest first): pytest-xdist's `worksteal` starts each worker on a contiguous
# part of the collection order and the idle one steals from the end of the other's, so a long test collected late
# would run alone at the end (measured with whole files a worker, 2 workers: test_sharding 230 s of child
# processes, test_native and test_pallas_kivi about 275 s each, test_beyond_kivi 200 s, test_evaluate_real 90-150 s,
# test_pallas_tpu 190 s on a loaded machine)
LONGEST_FIRST = ("test_sharding.py", "test_native.py", "test_pallas_kivi.py", "test_beyond_kivi.py",
                 "test_pallas_tpu.py", "test_evaluate_real.py", "test_native_beyond.py", "test_real_model.py",
                 "test_kivi_cache.py")


def pytest_unconfigure(config):
    if os.environ.get("KIVI_JAX_TEST_JIT_CACHE_OWNER") == str(os.getpid()):  # the process that made it
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:  # a real-model check is never in the fast tier
        if item.get_closest_marker("real_model") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `xla_default_emitters` (a bit-for-bit claim that holds under XLA's default emitters, as users run
    it, and not under the tests' faster-compiling flag: a batch of rows rounding as one row alone) runs in a child
    pytest process without the tests' XLA flags; it passes when that run passes."""
    if pyfuncitem.get_closest_marker("xla_default_emitters") is None or os.environ.get(DEFAULT_EMITTERS_ENV) == "1":
        return None
    import re
    import subprocess
    import sys

    env = {**os.environ, DEFAULT_EMITTERS_ENV: "1", "XLA_FLAGS": without_test_flags(os.environ.get("XLA_FLAGS", ""))}
    proc = subprocess.run([sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-n", "0", "-p", "no:cacheprovider",
                           "--reruns", "0"], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0 and re.search(r"^1 passed", proc.stdout, re.M), (
        f"{pyfuncitem.nodeid} under XLA's default emitters (a child pytest, exit {proc.returncode}):\n"
        f"{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
    return True


@pytest.fixture(autouse=True)
def fault_handlers_kept():
    """A test that loads a library installing its own SIGSEGV/SIGBUS handler (xgrammar's tvm_ffi does, through a plain
    import) gets the worker's handlers back after it: tvm_ffi's deadlocks inside the C++ unwinder, which turned an
    XLA:CPU compiler crash into a worker hung at 0% CPU instead of a crash the crash-only rerun takes."""
    from kivi_jax.serve import grammar

    saved = grammar.fault_handlers()
    yield
    if saved is not None and grammar.fault_handler_addresses() != grammar.fault_handler_addresses(saved):
        grammar._restore_fault_handlers(saved)


@pytest.fixture(autouse=True)
def compile_fast(request):
    """Every test compiles with few optimizations, except the real-model tests (marked `real_model`)."""
    import jax

    jax.config.update("jax_disable_most_optimizations", request.node.get_closest_marker("real_model") is None)
    yield


MAPS_FILE = "/proc/self/maps"


def memory_maps() -> int | None:
    """How many memory mappings this process holds (None where /proc is not there)."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


MAPS_CLEAR_AT = max_map_count() * 2 // 5


@pytest.fixture(autouse=True)
def compiled_programs_bounded():
    """After a test, when this worker holds more than 2/5 of the kernel's memory-mapping limit, every compiled
    program is dropped (`jax.clear_caches`). Each XLA:CPU executable maps about five regions of JIT code; a worker
    running half the suite compiled enough to pass `vm.max_map_count` (65,530: measured 52,297 maps after three of
    the serving files in one process), and LLVM then died inside a compile (SIGSEGV or SIGABRT in
    `backend_compile_and_load`, late in a run, a test that passes alone and on rerun)."""
    yield
    maps = memory_maps()
    if maps is not None and maps > MAPS_CLEAR_AT:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def torch_threads():
    import torch

    torch.set_num_threads(1)
    return torch


def make_hf_model(name: str | tuple, seed: int = 0):
    """A tiny random transformers model: a name in TINY_CONFIGS or an (architecture, kwargs) pair; float32, eval."""
    torch = torch_threads()
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    arch, kw = TINY_CONFIGS[name] if isinstance(name, str) else name
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **kw))
    else:
        model = MistralForCausalLM(MistralConfig(**common, **kw))
    # Larger weights than the default init make the logits less flat, so greedy decoding has clear winners.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return model.eval()


def char_tokenizer():
    """A character-level tokenizer over TINY_VOCAB ids (pad 0, bos 1, eos 2), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + TINY_VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    return fast


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> (HF directory with safetensors + tokenizer, the torch model)."""
    out = {}
    for i, name in enumerate(TINY_CONFIGS):
        model = make_hf_model(name, seed=i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        char_tokenizer().save_pretrained(path)
        out[name] = (path, model)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct), loaded once for every `real_model` test that reads it."""
    import kivi_jax

    return kivi_jax.load("smollm2", progress=False)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    torch = torch_threads()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def gguf_shape_header(writer, cfg) -> None:
    """The model-shape metadata every test GGUF of a transformers model carries (blocks, context, widths, heads,
    RMSNorm epsilon)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
