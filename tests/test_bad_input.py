"""Bad input, CLI and API: every case fails before any compute with a message that names the problem and what would
be right. CLI cases run `kivi_jax.cli.main` in-process on a tiny model directory."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from conftest import TINY_VOCAB
from kivi_jax import checkpoint, cli
from kivi_jax.cache import CacheCapacityError
from kivi_jax.checkpoint import CheckpointError
from kivi_jax.generate import quantized_counts
from kivi_jax.runtime import raise_cache_errors

MODEL = "<tiny model dir>"  # replaced by the tiny llama's HF directory
NOT_UTF8 = "a\udcffb"  # how Python hands over the bytes b"a\xffb" of a command-line argument


def run_cli(capsys, argv, model_dir) -> tuple[int, str, str]:
    argv = [str(model_dir) if a == MODEL else a for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse: a bad value while parsing
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


GEN = ["generate", "--model", MODEL, "--prompt", "hello"]

# (id, argv, substrings the error must hold: the flag, the problem, the allowed values)
CLI_CASES = [
    ("temperature-nan", GEN + ["--temperature", "nan"], ["--temperature", "'nan' is not finite", "finite number >= 0"]),
    ("temperature-inf", GEN + ["--temperature", "inf"], ["--temperature", "'inf' is not finite", ">= 0"]),
    ("temperature-negative", GEN + ["--temperature", "-1"], ["--temperature", "-1 is out of range", ">= 0"]),
    ("temperature-word", GEN + ["--temperature", "hot"], ["--temperature", "'hot' is not a number"]),
    ("top-p-zero", GEN + ["--temperature", "1", "--top-p", "0"], ["--top-p", "out of range", "> 0 and <= 1"]),
    ("top-p-above-one", GEN + ["--temperature", "1", "--top-p", "1.5"], ["--top-p", "1.5 is out of range", "<= 1"]),
    ("top-p-nan", GEN + ["--temperature", "1", "--top-p", "nan"], ["--top-p", "not finite", "> 0 and <= 1"]),
    ("top-k-negative", GEN + ["--temperature", "1", "--top-k", "-1"], ["--top-k", "out of range", "integer >= 0"]),
    ("top-k-fraction", GEN + ["--temperature", "1", "--top-k", "2.5"], ["--top-k", "'2.5' is not an integer"]),
    ("top-k-when-greedy", GEN + ["--top-k", "5"], ["--top-k does not apply", "greedy", "--temperature T > 0"]),
    ("top-p-when-greedy", GEN + ["--greedy", "--top-p", "0.9"], ["--top-p does not apply", "--temperature T > 0"]),
    ("max-new-tokens-zero", GEN + ["--max-new-tokens", "0"], ["--max-new-tokens", "0 is out of range", "integer >= 1"]),
    ("max-new-tokens-fraction", GEN + ["--max-new-tokens", "2.5"], ["--max-new-tokens", "'2.5' is not an integer"]),
    ("max-length-negative", GEN + ["--max-length", "-5"], ["--max-length", "out of range", "integer >= 1"]),
    ("seed-negative", GEN + ["--seed", "-1"], ["--seed", "out of range", "from 0 to 4294967295"]),
    ("group-size-with-full", GEN + ["--cache", "full", "--group-size", "64"],
     ["--group-size does not apply", "--cache full", "kivi2, kivi4, kivi2+, kivi3+ or k<bits>v<bits>"]),
    ("residual-with-full", GEN + ["--cache", "full", "--residual-length", "64"],
     ["--residual-length does not apply", "--cache full", "KIVI cache"]),
    ("k-bits-with-full", GEN + ["--cache", "full", "--k-bits", "4"], ["--k-bits does not apply", "--cache full"]),
    ("v-bits-with-full", GEN + ["--cache", "full", "--v-bits", "4"], ["--v-bits does not apply", "--cache full"]),
    ("k-bits-5", GEN + ["--k-bits", "5"], ["--k-bits", "invalid choice", "2, 3, 4, 8"]),
    ("group-size-zero", GEN + ["--group-size", "0"], ["--group-size", "out of range", "integer >= 1"]),
    ("residual-not-multiple", GEN + ["--residual-length", "48"],
     ["residual_length=48 must be a positive multiple of group_size=32"]),
    ("bad-spec", GEN + ["--cache", "k5v2"], ["bad cache spec 'k5v2'", "k_bits=5 is not supported; choose one of (2, 3, 4, 8)"]),
    ("prompt-not-utf8", ["generate", "--model", MODEL, "--prompt", NOT_UTF8],
     ["--prompt", "not valid UTF-8", "0xff", "UTF-8 text"]),
    ("past-positions", GEN + ["--max-new-tokens", "600"], ["exceed the model's 512 positions", "lower max_new_tokens"]),
    ("past-positions-with-max-length", GEN + ["--max-new-tokens", "600", "--max-length", "1024"],
     ["exceed the model's 512 positions", "max_position_embeddings", "at most"]),
    ("dtype-float64", GEN + ["--dtype", "float64"], ["--dtype", "invalid choice", "float32", "bfloat16"]),
    ("errors-group-size-zero", ["eval", "errors", "--model", MODEL, "--group-size", "0"],
     ["--group-size", "0 is out of range", "integer >= 1"]),
    ("errors-group-size-negative", ["eval", "errors", "--model", MODEL, "--group-size", "-32"],
     ["--group-size", "-32 is out of range", "integer >= 1"]),
    ("errors-tokens-not-multiple", ["eval", "errors", "--model", MODEL, "--tokens", "100", "--group-size", "32"],
     ["--tokens 100 must be a positive multiple of --group-size 32"]),
    ("ppl-prefill-one", ["eval", "ppl", "--model", MODEL, "--prefill", "1"], ["--prefill", "integer >= 2"]),
    ("ppl-windows-zero", ["eval", "ppl", "--model", MODEL, "--windows", "0"], ["--windows", "integer >= 1"]),
    ("ablate-out-missing-dir", ["eval", "ablate", "--model", MODEL, "--out", "/no/such/dir/a.md"],
     ["--out", "cannot write /no/such/dir/a.md", "directory /no/such/dir does not exist"]),
    ("ablate-out-unwritable", ["eval", "ablate", "--model", MODEL, "--out", "/sys/a.md"],
     ["--out", "cannot write /sys/a.md", "give a path you can write to"]),
    ("ablate-plot-unwritable", ["eval", "ablate", "--model", MODEL, "--plot", "/sys/a.png"],
     ["--plot", "cannot write /sys/a.png"]),
    ("ablate-out-is-dir", ["eval", "ablate", "--model", MODEL, "--out", "/tmp"], ["--out", "/tmp is a directory"]),
    ("convert-out-unwritable", ["convert", MODEL, "/sys/kivi-jax-out"],
     ["cannot create /sys/kivi-jax-out", "not writable", "choose a directory you can write to"]),
    ("convert-out-exists", ["convert", MODEL, "/tmp"], ["/tmp already exists", "choose a new directory"]),
    ("bench-repeats-zero", ["bench", "decode", "--model", MODEL, "--repeats", "0"],
     ["--repeats", "0 is out of range", "integer >= 1"]),
    ("bench-layers-fraction", ["bench", "memory", "--model", MODEL, "--layers", "1.5"],
     ["--layers", "'1.5' is not an integer", "integer >= 1"]),
    ("bench-plot-unwritable", ["bench", "decode", "--model", MODEL, "--plot", "/sys/d.png"],
     ["--plot", "cannot write /sys/d.png", "give a path you can write to"]),
    ("serve-port-past-65535", ["serve", "--model", MODEL, "--port", "70000"],
     ["--port", "70000 is out of range", "from 0 to 65535"]),
    ("serve-slots-zero", ["serve", "--model", MODEL, "--slots", "0"], ["--slots", "0 is out of range", ">= 1"]),
    ("serve-max-queue-negative", ["serve", "--model", MODEL, "--max-queue", "-1"], ["--max-queue", "out of range"]),
    ("serve-body-limit-word", ["serve", "--model", MODEL, "--max-body-bytes", "lots"],
     ["bad byte size 'lots'", "512MiB"]),
    ("bench-serve-nothing-listening", ["bench", "serve", "--url", "http://127.0.0.1:1", "--max-tokens", "2"],
     ["cannot reach a server at http://127.0.0.1:1", "ConnectError", "start one with kivi-jax serve"]),
    ("serve-shutdown-timeout-nan", ["serve", "--model", MODEL, "--shutdown-timeout", "nan"],
     ["--shutdown-timeout", "not finite"]),
]


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["llama_mha"][0]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(capsys, model_dir, argv, expected):
    code, out, err = run_cli(capsys, argv, model_dir)
    assert code == 2, (out, err)
    for piece in expected:
        assert piece in err, f"{piece!r} not in {err!r}"
    assert "Traceback" not in err and ".partial" not in err
    lines = err.splitlines()
    if lines[0].startswith("usage:"):  # argparse: the usage block (indented continuation lines) and one error line
        assert all(line.startswith(" ") for line in lines[1:-1]) and ": error: " in lines[-1], err
    else:
        assert len(lines) <= 15  # one line (and progress bars), never a dump


def test_serve_on_a_busy_port_fails_before_the_model_loads(capsys, model_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(capsys, ["serve", "--model", "/no/such/model", "--port", str(port)], model_dir)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "choose another --host or --port" in err


def test_serve_without_the_serve_extra_says_what_to_install(capsys, model_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ModuleNotFoundError
    code, _, err = run_cli(capsys, ["serve", "--model", MODEL], model_dir)
    assert code == 2 and 'pip install "kivi-jax[serve]"' in err and 'pip install ".[serve]"' in err
    assert "uvicorn" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def model(model_dir):
    return kivi_jax.load(str(model_dir))


# (id, keyword arguments for generate(model, "hello", ...), the exception, substrings of its message)
API_CASES = [
    ("temperature-nan", dict(temperature=float("nan")), ValueError, ["temperature=nan", "finite number"]),
    ("temperature-inf", dict(temperature=float("inf")), ValueError, ["temperature=inf", "finite number"]),
    ("temperature-string", dict(temperature="0.7"), ValueError, ["temperature='0.7' must be a finite number"]),
    ("top-p-nan", dict(temperature=1.0, top_p=float("nan")), ValueError, ["top_p=nan", "finite"]),
    ("top-p-zero", dict(temperature=1.0, top_p=0.0), ValueError, ["top_p=0.0 must be in (0, 1]"]),
    ("top-k-fraction", dict(temperature=1.0, top_k=2.5), ValueError, ["top_k=2.5 must be an integer"]),
    ("max-new-tokens-fraction", dict(max_new_tokens=2.5), ValueError, ["max_new_tokens=2.5 must be an integer >= 1"]),
    ("max-new-tokens-zero", dict(max_new_tokens=0), ValueError, ["max_new_tokens=0 must be an integer >= 1"]),
    ("max-new-tokens-bool", dict(max_new_tokens=True), ValueError, ["max_new_tokens=True must be an integer"]),
    ("seed-negative", dict(seed=-1), ValueError, ["seed=-1 must be an integer >= 0"]),
    ("seed-string", dict(seed="1"), ValueError, ["seed='1' must be an integer"]),
    ("seed-too-large", dict(seed=2**40), ValueError, ["seed=1099511627776 must be below 2**32", "None"]),
    ("max-length-fraction", dict(max_length=100.5), ValueError, ["max_length=100.5 must be an integer >= 1"]),
    ("attention-impl", dict(attention_impl="cuda"), ValueError, ["attention impl 'cuda' is not one of", "xla"]),
    ("past-positions-with-max-length", dict(max_new_tokens=600, max_length=1024), CacheCapacityError,
     ["exceed the model's 512 positions", "at most 507"]),
    ("bad-spec", dict(cache="k2v2-r48"), ValueError, ["bad cache spec", "multiple of group_size=32"]),
]


@pytest.mark.parametrize("kwargs, error, expected", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input(model, kwargs, error, expected):
    with pytest.raises(error) as info:
        kivi_jax.generate(model, "hello", **kwargs)
    for piece in expected:
        assert piece in str(info.value), f"{piece!r} not in {str(info.value)!r}"


def test_api_prompt_that_was_not_utf8(model):
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode: lone surrogate characters at \[1\].*UTF-8"):
        kivi_jax.generate(model, NOT_UTF8)


@pytest.mark.parametrize("dtype, expected", [
    (jnp.int8, "dtype=int8 is not a compute dtype for the weights; choose one of float32, bfloat16, float16"),
    ("float64", "dtype=float64 needs JAX's 64-bit mode"),
    (np.float64, "without it choose one of float32, bfloat16, float16"),
    ("bogus", "dtype='bogus' is not a dtype; choose one of float32, bfloat16, float16"),
])
def test_load_refuses_dtypes_it_cannot_compute_in(model_dir, dtype, expected):
    with pytest.raises(ValueError) as info:
        kivi_jax.load(str(model_dir), dtype=dtype)
    assert expected in str(info.value)


def test_load_accepts_dtype_names(model_dir):
    assert kivi_jax.load(str(model_dir), dtype="bfloat16").params.dtype == jnp.bfloat16


def test_convert_checks_out_before_reading_the_source(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # the source does not even exist: the check on OUT comes first, so no conversion work is done
    with pytest.raises(CheckpointError, match="already exists; choose a new directory"):
        kivi_jax.convert(tmp_path / "no-such-model", out)
    with pytest.raises(CheckpointError, match=r"cannot create /sys/x: /sys is not writable"):
        kivi_jax.convert(tmp_path / "no-such-model", "/sys/x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the writability probe left nothing behind


def test_save_into_an_unwritable_place_names_the_output_not_a_partial(model):
    with pytest.raises(CheckpointError) as info:
        checkpoint.save(model.params, "/sys/kivi-jax-ckpt")
    assert "/sys/kivi-jax-ckpt" in str(info.value) and ".partial" not in str(info.value)


def test_seed_none_draws_a_fresh_seed_and_reports_it(model):
    a = kivi_jax.generate(model, [5, 6, 7], max_new_tokens=6, temperature=1.0, seed=None, stop_at_eos=False)
    b = kivi_jax.generate(model, [5, 6, 7], max_new_tokens=6, temperature=1.0, seed=None, stop_at_eos=False)
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**32 and a.seed != b.seed
    again = kivi_jax.generate(model, [5, 6, 7], max_new_tokens=6, temperature=1.0, seed=a.seed, stop_at_eos=False)
    assert again.token_ids == a.token_ids and a.to_json()["seed"] == a.seed


class FakeCache:
    def __init__(self, flags):
        self.error_flags = np.asarray(flags, np.int32)
        self.max_tokens = 256


def test_cache_error_flags_become_clear_errors():
    raise_cache_errors(object())  # a cache without guards: nothing to check
    raise_cache_errors(FakeCache([0, 0, 0]))
    with pytest.raises(CacheCapacityError, match=r"sequences \[1\] were written past the cache's capacity of 256"):
        raise_cache_errors(FakeCache([0, 2, 0]))
    with pytest.raises(ValueError, match=r"sequences \[0, 2\] fed token ids outside the vocabulary"):
        raise_cache_errors(FakeCache([1, 0, 1]))
    with pytest.raises(CacheCapacityError, match=r"sequences \[0\]"):  # both bits: capacity is named first
        raise_cache_errors(FakeCache([3, 0]))
    raise_cache_errors(FakeCache([4, 0]))  # a float16 scale overflow is a warning (generate warns), not an error
    with pytest.raises(RuntimeError, match="unknown error flags"):
        raise_cache_errors(FakeCache([8]))


def test_quantized_counts_follow_the_residual():
    lengths = [0, 127, 128, 200, 256, 300]
    keys, values = quantized_counts(lengths, kivi_jax.KIVIConfig(residual_length=128))
    assert keys.tolist() == [0, 0, 128, 128, 256, 256]
    assert values.tolist() == [0, 0, 0, 72, 128, 172]
    keys, values = quantized_counts(lengths, "full")
    assert keys.tolist() == values.tolist() == [0] * 6


@pytest.mark.parametrize("cache", ["k2v2-g16-r32", "full"])
def test_generate_json_reports_quantized_tokens_and_bytes(capsys, model_dir, model, cache):
    prompt = "".join(chr(33 + i % 90) for i in range(40))  # 40 tokens: one character a token, plus BOS
    code, out, err = run_cli(capsys, ["generate", "--model", MODEL, "--prompt", prompt, "--max-new-tokens", "20",
                                      "--cache", cache, "--json"], model_dir)
    assert code == 0, err
    got = json.loads(out)
    n = got["prompt_tokens"] + got["new_tokens"] - 1  # the last new token is never fed back
    assert got["cache_tokens"] == n
    if cache == "full":
        assert got["keys_quantized"] == got["values_quantized"] == 0
        assert got["cache_bytes"] == got["full_cache_bytes"]
    else:
        assert got["keys_quantized"] == n // 32 * 32 and got["values_quantized"] == n - 32 > 0
        cfg = model.config
        kivi = kivi_jax.make_cache(cache, cfg, 1, got["cache_max_tokens"])
        full = kivi_jax.make_cache("full", cfg, 1, got["cache_max_tokens"])
        assert (got["cache_bytes"], got["full_cache_bytes"]) == (kivi.nbytes, full.nbytes)
        assert got["cache_bytes"] < got["full_cache_bytes"]


def test_generate_says_on_stderr_what_the_cache_quantized(capsys, model_dir):
    code, out, err = run_cli(capsys, ["generate", "--model", MODEL, "--prompt", "hi", "--max-new-tokens", "3",
                                      "--cache", "kivi2"], model_dir)
    assert code == 0, err
    assert "keys of 0 and values of 0 of them quantized" in err and "128-token full-precision residual" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kivi-jax {kivi_jax.__version__}"


def test_version_matches_the_package_metadata():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == kivi_jax.__version__


def test_out_of_vocab_ids_still_refused_up_front(model):
    with pytest.raises(ValueError, match=rf"outside \[0, {TINY_VOCAB}\)"):
        kivi_jax.generate(model, [5, -1], max_new_tokens=2)


def test_stream_checks_its_arguments_when_called(model):
    with pytest.raises(ValueError, match="temperature=nan"):
        kivi_jax.stream(model, "hello", temperature=float("nan"))  # not deferred to the first step
    steps = list(kivi_jax.stream(model, [5, 6, 7], max_new_tokens=3, stop_at_eos=False))
    assert [s.index for s in steps] == [0, 1, 2]


def test_eval_text_that_is_missing_or_not_utf8_fails_before_the_model_loads(capsys, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    argv = ["eval", "ppl", "--model", "/no/such/model", "--text"]
    code, _, err = run_cli(capsys, argv + [str(bad)], None)
    assert code == 2 and f"--text {bad} is not UTF-8 text (byte 0xe9 at offset 3); give a UTF-8 text file" in err
    code, _, err = run_cli(capsys, argv + [str(tmp_path / "missing.txt")], None)
    assert code == 2 and "cannot read --text" in err and "No such file or directory" in err
