"""`kivi-jax eval`: the loss through the cache equals the loss of one forward pass (full) and of a fake-quantization
simulation of KIVI (quantized caches); spec parsing; the CLI's JSON; the consumption-error diagnostics."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import cli, evaluate
from kivi_jax.cache import FullCache
from kivi_jax.config import KIVIConfig, parse_cache_spec, spec_name
from kivi_simulation import simulated_nll
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
PREFILL, DECODE = 21, 44  # the prompt ends mid-block; the decode crosses several R-blocks and flushes


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.15)  # large enough weights for peaked predictions


@pytest.fixture(scope="module")
def windows():
    rng = np.random.RandomState(0)
    return rng.randint(0, CFG.vocab_size, (3, PREFILL + DECODE + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def full_run(params, windows):
    return evaluate.teacher_forced(params, windows, PREFILL, "full")


def test_full_cache_nll_equals_one_forward_pass(params, windows, full_run):
    ref = np.asarray(simulated_nll(params, windows, PREFILL, None))  # [windows, decode]
    assert full_run["nll"].shape == (3, DECODE)
    np.testing.assert_allclose(full_run["nll"], ref, atol=1e-4)
    assert abs(full_run["nll"].mean() - ref.mean()) <= 1e-5
    assert full_run["nll"].std() > 0.1  # the model predicts something: the comparison is not between constants


# float32 scales: with float16 ones, a group's (max - min) / (2^b - 1) that differs in its last float32 bit between a
# one-token decode step and a whole-window pass can round to a neighbouring float16 value, a real but float-level
# difference (up to ~1e-3 nats on this tiny model) that would blur what this test checks: the cache's semantics.
@pytest.mark.parametrize("spec", [
    "k2v2-g8-r16-sf32",  # KIVI's axes
    "k2v2-g8-r16-ktok-vchan-sf32",  # flipped
    "k4v2-g8-r16-vchan-sf32",  # both per-channel
    "k2v4-g8-r8-ktok-sf32",  # both per-token, R = G
    "k2v2-g32-r32-sf32",  # G wider than head_dim 16: per-token groups are whole heads
])
def test_kivi_cache_nll_equals_fake_quant_simulation(params, windows, full_run, spec):
    kivi = parse_cache_spec(spec)
    ours = evaluate.teacher_forced(params, windows, PREFILL, kivi, full_run["logprobs"])
    ref = np.asarray(simulated_nll(params, windows, PREFILL, kivi))
    # One-row decode matmuls and the simulation's whole-window matmul sum in different orders (XLA:CPU's gemv and
    # gemm kernels differ by CPU), so a value lying on a rounding boundary can take the neighbouring code in one of
    # them: a float-level difference that then runs through the rest of its window (seen on an AVX2-only CPU: one
    # window of three, up to 5e-3 nats). At most one window may show one; the others agree to 1e-4, and a semantic
    # difference (an axis, a range, a flush) would show in every window.
    per_window = np.abs(ours["nll"] - ref).max(axis=1)  # [windows]
    assert (per_window <= 1e-4).sum() >= len(per_window) - 1 and per_window.max() <= 2e-2, per_window
    assert np.abs(ours["nll"] - full_run["nll"]).max() > 1e-3  # the quantization shows: this compares something
    assert ours["kl"].min() >= -1e-6 and ours["kl"].mean() > 0
    assert 0 < ours["top1"].mean() <= 1


def test_ablation_rows_hold_every_study_and_other_specs():
    def result(nll, per_window):
        return {"nll": nll, "nll_per_window": per_window, "kl_vs_full": 0.1, "top1_agree": 0.9}

    results = {"full": result(2.0, [1.0, 3.0]), "k2v2-g32-r128": result(2.2, [1.1, 3.3]),
               "k8v8-g32-r128": result(2.01, [1.0, 3.02])}
    rows = evaluate.ablation_rows(results)
    assert [(r["study"], r["spec"]) for r in rows] == [
        ("reference", "full"), ("axes", "k2v2-g32-r128"), ("group size", "k2v2-g32-r128"),
        ("residual", "k2v2-g32-r128"), ("bits", "k2v2-g32-r128"), ("beyond: alone", "k2v2-g32-r128"),
        ("other", "k8v8-g32-r128")]
    kivi = rows[1]
    assert kivi["delta_nll"] == pytest.approx(0.2) and (kivi["delta_min"], kivi["delta_max"]) == pytest.approx((0.1, 0.3))
    assert rows[-1]["keys"] == "8-bit per-channel" and rows[-1]["values"] == "8-bit per-token"
    assert "| other | `k8v8-g32-r128` |" in evaluate.ablation_markdown(rows)
    specs = evaluate.ablation_specs()
    assert specs[0] == "full" and len(specs) == len(set(specs))
    assert set(specs) == {spec_name(parse_cache_spec(s)) for _, s in evaluate.ABLATION}
    assert "k2v2-g32-r128-prerope" in specs and parse_cache_spec("kivi2+").spec in specs


def test_windows_are_evenly_spaced():
    assert evaluate.window_starts(1000, 100, 50, 4) == [0, 283, 566, 849]  # i * (n - P - N - 1) / (W - 1)
    assert evaluate.window_starts(151, 100, 50, 3) == [0, 0, 0]
    win = evaluate.make_windows(np.arange(1000), 100, 50, 4)
    assert win.shape == (4, 151) and win[3, -1] == 999
    with pytest.raises(ValueError, match="the text has 150 tokens; a window needs prefill \\+ decode \\+ 1 = 151"):
        evaluate.window_starts(150, 100, 50, 2)


@pytest.mark.parametrize("spec, expected", [
    ("full", "full"),
    ("FULL", "full"),
    ("kivi2", KIVIConfig(2, 2, 32, 128)),
    ("kivi4", KIVIConfig(4, 4, 32, 128)),
    ("k4v2", KIVIConfig(4, 2, 32, 128)),
    ("k2v2-g64-r256", KIVIConfig(2, 2, 64, 256)),
    ("k2v2-r64-g32-ktok-vchan", KIVIConfig(2, 2, 32, 64, "token", "channel")),
    ("k8v4-g128-r128-sf32", KIVIConfig(8, 4, 128, 128, scale_dtype="float32")),
])
def test_specs_parse(spec, expected):
    parsed = parse_cache_spec(spec)
    assert parsed == expected
    if parsed != "full":
        assert parse_cache_spec(parsed.spec) == parsed  # the canonical name parses back


@pytest.mark.parametrize("spec, message", [
    ("kivi3", "bad cache spec 'kivi3'; cache specs: 'full'"),
    ("k2v2-g32-x", "bad cache spec 'k2v2-g32-x'"),
    ("k5v2", "bad cache spec 'k5v2': k_bits=5 is not supported; choose one of \\(2, 3, 4, 8\\)"),
    ("k2v1", "v_bits=1 is not supported"),
    ("k2v2-g32-r48", "residual_length=48 must be a positive multiple of group_size=32"),
    ("k2v2-g32-g64", "group_size given twice"),
    ("k2v2-g0", "group_size=0 must be a positive integer"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_cache_spec(spec)


def test_groups_wider_than_the_head_take_the_whole_head():
    kivi = parse_cache_spec("k2v2-g128-r128")
    kivi.check_shapes(64, 768)  # G=128 > head_dim 64: fine
    assert kivi.store_group("channel", 64) == 128 and kivi.store_group("token", 64) == 64
    with pytest.raises(ValueError, match="group_size=96 does not divide head_dim=64 \\(nor is it a multiple of it\\)"):
        KIVIConfig(2, 2, 96, 192).check_shapes(64, 768)


def test_capture_records_what_the_cache_stores(params, windows):
    acts = evaluate.capture_qkv(params, jnp.asarray(windows))
    tokens = windows.shape[1]
    assert acts["q"].shape == (CFG.num_layers, 3, tokens, CFG.num_heads, CFG.head_dim)
    cache = FullCache.create(CFG, 3, 128)
    _, cache = jax.jit(forward)(params, jnp.asarray(windows), cache)
    # two compiled programs, so float32 rounding may differ in the last bits
    np.testing.assert_allclose(np.asarray(acts["k"]).transpose(0, 1, 3, 2, 4), np.asarray(cache.k)[:, :, :, :tokens],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(acts["v"]).transpose(0, 1, 3, 2, 4), np.asarray(cache.v)[:, :, :, :tokens],
                               rtol=1e-5, atol=1e-5)


def test_consumption_errors_shrink_with_bits_and_follow_the_tensor(params, windows):
    win = windows[:, :64]
    e2 = evaluate.consumption_errors(params, win, bits=2, group_size=16)
    e8 = evaluate.consumption_errors(params, win, bits=8, group_size=16)
    for key in e2:
        assert e2[key].shape == (CFG.num_layers,)
        assert (e8[key] < e2[key]).all() and (e2[key] > 0).all()
    assert (e2["k_channel_tensor"] < 0.6).all()  # a 2-bit code: the error is a fraction of the tensor
    acts = evaluate.capture_qkv(params, jnp.asarray(win))
    k = jnp.swapaxes(acts["k"][1], 1, 2)
    kq = evaluate.fake_quant(k, "token", 2, 16)
    assert float(e2["k_token_tensor"][1]) == pytest.approx(float(jnp.linalg.norm(kq - k) / jnp.linalg.norm(k)),
                                                          rel=1e-5)
    s = evaluate.errors_summary(e2)
    assert s["layers"] == CFG.num_layers and 0 <= s["values_disagree_layers"] <= CFG.num_layers
    assert "values: per-token tensor error" in evaluate.errors_summary_line(s)


# ---------------------------------------------------------------------------------------------------------------------
# The CLI, on a tiny HF model directory with a character tokenizer


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "prose.txt"
    path.write_text("The quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 12)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_eval_ppl_json_shape(tiny_dirs, text_file, capsys):
    path = str(tiny_dirs["llama_gqa_llama3"][0])
    code, out, err = run_cli(capsys, "eval", "ppl", "--model", path, "--text", str(text_file), "--prefill", "40",
                             "--decode", "24", "--windows", "3", "--cache", "k4v2-g16-r32,K4V2-r32-g16", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert {"model", "text", "prefill", "decode", "windows", "results"} <= set(got)
    assert (got["model"], got["text"], got["prefill"], got["decode"], got["windows"]) == (path, str(text_file), 40, 24, 3)
    assert list(got["results"]) == ["full", "k4v2-g16-r32"]  # full always and first; one spec, spelled twice, once
    for r in got["results"].values():
        assert {"nll", "ppl", "kl_vs_full", "top1_agree", "tokens", "decode_tokens_per_s"} <= set(r)
        assert r["tokens"] == 3 * 24 and r["nll"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["ppl"] == pytest.approx(np.exp(r["nll"]), rel=1e-6)
        assert r["nll"] == pytest.approx(np.mean(r["nll_per_window"]), rel=1e-6)
    assert got["results"]["full"]["kl_vs_full"] == 0 and got["results"]["full"]["top1_agree"] == 1
    assert 0 < got["results"]["k4v2-g16-r32"]["kl_vs_full"] and got["results"]["k4v2-g16-r32"]["top1_agree"] <= 1
    assert got["window_starts"] == evaluate.window_starts(got["text_tokens"], 40, 24, 3)
    assert got["text_tokens"] == len(text_file.read_text())  # one character a token


def test_cli_eval_ppl_table_on_the_default_text(tiny_dirs, capsys):
    code, out, err = run_cli(capsys, "eval", "ppl", "--model", str(tiny_dirs["mistral_window"][0]), "--prefill", "24",
                             "--decode", "8", "--windows", "2", "--cache", "kivi4")
    assert code == 0, err
    assert "pydoc_data.topics" in out and "ΔNLL" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert set(lines) == {"full", "k4v4-g32-r128"} and lines["full"][2] == "+0.0000"


def test_cli_eval_bad_spec_fails_before_loading(capsys):
    code, out, err = run_cli(capsys, "eval", "ppl", "--model", "/no/such/model", "--cache", "full,k2v2-g24")
    assert code == 2
    assert "bad cache spec 'k2v2-g24'" in err and "residual_length=128 must be a positive multiple" in err


def test_cli_eval_ablate_writes_table_and_plot(tiny_dirs, text_file, tmp_path, capsys):
    md, png = tmp_path / "ablation.md", tmp_path / "ablation.png"
    code, out, err = run_cli(capsys, "eval", "ablate", "--model", str(tiny_dirs["llama_mha"][0]), "--text",
                             str(text_file), "--prefill", "40", "--decode", "16", "--windows", "2", "--cache",
                             "kivi2", "--out", str(md), "--plot", str(png), "--quiet")
    assert code == 0, err
    table = md.read_text()
    assert "| axes | `k2v2-g32-r128` | 2-bit per-channel | 2-bit per-token | 32 | 128 |" in table
    assert "| reference | `full` | full | full |  |  |" in table and "+0.0000 |" in table
    assert table.count("`k2v2-g32-r128`") == 5  # the reference row of every study it belongs to
    assert "| 3.50 |" in table  # kivi2 at head_dim 16: keys 2 + 32/32 bits, values 2 + 32/16 (groups of a head)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "ablation_bits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ΔNLL" in out


def test_the_development_split_is_disjoint_from_the_reported_windows():
    for n, (p, d, w) in ((112955, (512, 256, 4)), (5000, (64, 32, 3)), (20000, (512, 256, 1))):
        evals, devs = evaluate.window_starts(n, p, d, w), evaluate.window_starts(n, p, d, w, "dev")
        assert len(devs) == w and all(0 <= s <= n - p - d - 1 for s in devs)
        assert all(abs(a - b) >= p + d + 1 for a in evals for b in devs)
    with pytest.raises(ValueError, match="too few for 4 development windows"):
        evaluate.window_starts(3000, 512, 256, 4, "dev")


def test_peer_rows_take_bits_from_the_peers_configuration():
    report = {"results": {"full": {"nll": 2.0, "kl_vs_full": 0.0, "top1_agree": 1.0, "cache": "DynamicCache"},
                          "k2": {"nll": 2.3, "kl_vs_full": 0.3, "top1_agree": 0.7,
                                 "cache": {"backend": "quanto", "nbits": 2, "q_group_size": 32}}}}
    (row,) = evaluate.peer_rows(report)
    assert row["bits"] == 4.0 and row["delta_nll"] == pytest.approx(0.3) and row["study"] == "peer"


def test_cli_eval_errors_json(tiny_dirs, text_file, capsys):
    code, out, err = run_cli(capsys, "eval", "errors", "--model", str(tiny_dirs["llama_mha"][0]), "--text",
                             str(text_file), "--tokens", "64", "--windows", "2", "--group-size", "16", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert set(got["per_layer"]) == {key for _, key in evaluate.ERROR_COLUMNS + evaluate.BEYOND_COLUMNS}
    assert all(len(v) == 3 for v in got["per_layer"].values())  # the tiny models have 3 layers
    assert got["summary"]["layers"] == 3


def test_a_bfloat16_prefill_changes_the_cache_it_leaves_a_little_and_never_the_reference(params, windows, full_run):
    """`prefill_precision='bfloat16'`: the reference `full` still prefills in float32 (its NLL is the float32 run's
    to the bit), a KIVI spec's decode steps score a cache its rounded prefill left (its NLL moves, within bfloat16
    rounding of the exact prefill's), and another precision is refused."""
    spec = "k2v2-g8-r16-sf32"
    exact = evaluate.evaluate(params, windows, PREFILL, [spec])
    rounded = evaluate.evaluate(params, windows, PREFILL, [spec], prefill_precision="bfloat16")
    np.testing.assert_array_equal(rounded["full"]["nll_per_window"], full_run["nll"].mean(axis=1))
    np.testing.assert_array_equal(rounded["full"]["nll_per_window"], exact["full"]["nll_per_window"])
    got, want = np.asarray(rounded[spec]["nll_per_window"]), np.asarray(exact[spec]["nll_per_window"])
    assert 0 < np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    with pytest.raises(ValueError, match="prefill precision"):
        evaluate.evaluate(params, windows, PREFILL, [spec], prefill_precision="float16")


def test_an_int8_decode_moves_a_quantized_models_scores_and_never_the_references(params, windows):
    """`decode_precision='int8'` on quantized weights: the reference `full` still decodes exactly (its NLL is the
    exact run's to the bit), a KIVI spec's scored decode steps dot int8-rounded activations (its NLL moves, within
    int8's rounding: the native kernel and XLA's twin round alike), and bfloat16 is refused for decode steps."""
    from kivi_jax import weights

    spec = "k2v2-g8-r16-sf32"
    quantized = weights.convert_params(params, "int8")
    exact = evaluate.evaluate(quantized, windows, PREFILL, [spec])
    rounded = evaluate.evaluate(quantized, windows, PREFILL, [spec], decode_precision="int8")
    np.testing.assert_array_equal(rounded["full"]["nll_per_window"], exact["full"]["nll_per_window"])
    got, want = np.asarray(rounded[spec]["nll_per_window"]), np.asarray(exact[spec]["nll_per_window"])
    assert 0 < np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    with pytest.raises(ValueError, match="decode precision"):
        evaluate.evaluate(params, windows, PREFILL, [spec], decode_precision="bfloat16")
