"""Benchmarks: the byte accounting (pytree leaves equal the formula, the ratio targets that are pure arithmetic), the
jit-compiled generator against `kivi_jax.generate`, and the `kivi-jax bench` commands' JSON and plots on a tiny model.
Speed is never asserted."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import bench
from kivi_jax.cli import main
from kivi_jax.config import parse_cache_spec
from kivi_jax.runtime import PROMPT_BUCKET, cache_size

LLAMA2 = bench.PRESETS["llama2-7b"]
TINY_SPECS = "full,k2v2-g16-r32"  # the tiny models' head_dim is 16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("spec", ["full", "kivi2", "kivi4", "k4v2-g64-r128", "k2v2-g32-r128-sf32", "k8v8-g64-r256"])
def test_llama2_7b_cache_bytes_equal_the_formula(spec, dtype):
    """From eval_shape: nothing of the (many GiB) caches is allocated."""
    for batch, tokens in ((1, 4096), (3, 32768)):
        cache = bench.abstract_cache(spec, LLAMA2, batch, tokens, dtype)
        assert bench.tree_bytes(cache) == bench.formula_bytes(spec, LLAMA2, batch, tokens, jnp.dtype(dtype).itemsize)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_llama2_7b_ratio_targets(dtype):
    """The 16-bit targets of issue 6: kivi2 <= 0.22x the fp16 cache at 4096 tokens and <= 0.195x at 32768 (3/16 of
    the quantized tokens plus the ring), kivi4 <= 0.35x at 4096; at 80 GB, kivi2 fits at least 4x the batch."""

    def ratio(spec, tokens):
        size = bench.tree_bytes(bench.abstract_cache(spec, LLAMA2, 1, tokens, dtype))
        return size / bench.tree_bytes(bench.abstract_cache("full", LLAMA2, 1, tokens, dtype))

    assert ratio("kivi2", 4096) <= 0.22
    assert ratio("kivi2", 32768) <= 0.195
    assert ratio("kivi4", 4096) <= 0.35
    table = bench.bench_memory(LLAMA2, 4096, ["full", "kivi2", "kivi4"], dtype, bench.parse_bytes("80GB"), temps=False)
    assert table["weights_bytes"] == LLAMA2.num_params() * 2
    rows = table["results"]
    assert rows["full"]["max_batch"] >= 1
    assert rows["kivi2"]["max_batch"] >= 4 * rows["full"]["max_batch"]
    assert rows["kivi2"]["ratio_vs_full"] == pytest.approx(ratio("kivi2", 4096))


def test_budgets_parse_in_decimal_and_binary_units():
    assert bench.parse_bytes("24GiB") == 24 * 2**30
    assert bench.parse_bytes("80GB") == 80 * 10**9
    assert bench.parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="24GiB"):
        bench.parse_bytes("lots")
    assert bench.max_batch(100, 40, 7) == 8 and bench.max_batch(10, 40, 7) == 0


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    path, _ = tiny_dirs["llama_gqa_llama3"]
    return str(path), kivi_jax.load(str(path), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["full", "k2v2-g16-r32"])
def test_compiled_generator_gives_the_tokens_of_generate(tiny, spec):
    path, model = tiny
    cfg = model.config
    prompts = [list(range(3, 40)), list(range(5, 19))]
    new = 40  # crosses a residual flush
    want = kivi_jax.generate(model, prompts, max_new_tokens=new, cache=spec, stop_at_eos=False).token_ids
    longest = max(map(len, prompts))
    tokens = np.full((2, -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET), cfg.pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    max_tokens = cache_size(longest, new, parse_cache_spec(spec), None, cfg)
    cache = kivi_jax.make_cache(spec, cfg, 2, max_tokens, model.params.dtype)
    got, cache = bench.generate_greedy(model.params, jnp.asarray(tokens), jnp.array([len(p) for p in prompts]),
                                       cache, new)
    assert np.asarray(got).tolist() == want
    assert np.asarray(cache.length).tolist() == [len(p) + new - 1 for p in prompts]


def run_cli(capsys, *argv) -> dict:
    assert main(["bench", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_json_and_plot(tiny, capsys, tmp_path):
    path, _ = tiny
    out = run_cli(capsys, "decode", "--model", path, "--contexts", "40,100", "--batch", "2", "--cache", TINY_SPECS,
                  "--repeats", "2", "--warmup", "1", "--json", "--plot", str(tmp_path / "decode.png"))
    assert {"device", "model", "results"} <= set(out)
    assert len(out["results"]) == 2 * 2
    for r in out["results"]:
        assert {"cache", "context", "batch", "step_ms_median", "step_ms_min", "tokens_per_s", "ratio_vs_full"} <= set(r)
        assert r["step_ms_min"] <= r["step_ms_median"] and r["tokens_per_s"] > 0
    assert [r["ratio_vs_full"] for r in out["results"] if r["cache"] == "full"] == [1.0, 1.0]
    assert is_png(tmp_path / "decode.png")


def test_bench_memory_json_and_plot(tiny, capsys, tmp_path):
    path, model = tiny
    out = run_cli(capsys, "memory", "--model", path, "--context", "256", "--budget", "1MiB", "--cache", TINY_SPECS,
                  "--json", "--plot", str(tmp_path / "memory.png"))
    assert {"model", "context", "budget_bytes", "results"} <= set(out)
    assert out["budget_bytes"] == 2**20 and out["context"] == 256
    assert set(out["results"]) == set(TINY_SPECS.split(","))
    cfg = model.config
    for spec, r in out["results"].items():
        assert {"cache_bytes", "bytes_per_token", "ratio_vs_full", "decode_temp_bytes", "max_batch"} <= set(r)
        assert r["cache_bytes"] == r["formula_bytes"] == bench.formula_bytes(spec, cfg, 1, 256, 2)  # bfloat16
        assert r["max_batch"] == bench.max_batch(2**20, out["weights_bytes"], r["cache_bytes"])
    assert out["results"]["full"]["ratio_vs_full"] == 1.0
    assert out["results"]["k2v2-g16-r32"]["ratio_vs_full"] < 1
    assert is_png(tmp_path / "memory.png")


def test_bench_memory_lowers_a_value_rotated_cache_with_rotated_params(tiny):
    _, model = tiny  # `bench memory --cache kivi2+` (any -rotv spec) failed here: "prepare them for this cache"
    assert bench.decode_temp_bytes(model.config, "k2v2-g16-r32-rotv", 1, 256, jnp.float32) > 0


@pytest.mark.slow
def test_bench_generate_json_and_plot(tiny, capsys, tmp_path):
    path, _ = tiny
    out = run_cli(capsys, "generate", "--model", path, "--batch", "1,2", "--prompt-len", "20", "--new-tokens", "4",
                  "--cache", TINY_SPECS, "--repeats", "1", "--json", "--plot", str(tmp_path / "generate.png"))
    assert {"device", "model", "prompt_len", "new_tokens", "results"} <= set(out)
    assert len(out["results"]) == 2 * 2
    for r in out["results"]:
        assert {"cache", "batch", "seconds_median", "tokens_per_s", "ratio_vs_full"} <= set(r)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 4 / r["seconds_median"])
    assert is_png(tmp_path / "generate.png")


def test_bench_table_output_and_bad_arguments(tiny, capsys):
    path, _ = tiny
    assert main(["bench", "memory", "--model", path, "--context", "256", "--cache", "full,k2v2-g16-r32",
                 "--no-temps"]) == 0
    text = capsys.readouterr().out
    assert "k2v2-g16-r32" in text and "max batch" in text
    assert main(["bench", "memory", "--model", path, "--budget", "plenty"]) == 2
    assert "24GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--cache", "kivi3"])
    assert "bad cache spec" in capsys.readouterr().err
