"""Many devices (docs/design.md §9): the sharding table, sharded prefill/decode equal to one device, the kernels per
shard, lowering for TPU and CUDA, and two `jax.distributed` processes.

The multi-device checks run in child processes (tests/sharding_worker.py) whose environment forces 8 (or 2) CPU
devices, so this process and the rest of the suite keep one device. Each child runs all its cases at once (few
compilations); the tests below assert on what it measured.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from kivi_jax import sharding
from kivi_jax.bench import PRESETS
from kivi_jax.cache import make_cache
from kivi_jax.models import registry
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import init_params

WORKER = os.path.join(os.path.dirname(__file__), "sharding_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.Popen([sys.executable, WORKER, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen, timeout: int = 1800) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def workers():
    """Every child process of this file, started at once (two halves of the 8-device checks and the two
    jax.distributed processes share the cores); each test waits for the one it reads."""
    port = str(free_port())
    procs = {"llama": run_worker("devices8", "llama"), "mistral": run_worker("devices8", "mistral"),
             "dist0": run_worker("distributed", port, "0"), "dist1": run_worker("distributed", port, "1")}
    results: dict = {}

    def get(name: str) -> dict:
        if name not in results:
            results[name] = result_of(procs[name])
        return results[name]

    yield get
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.communicate()  # reaps it and closes its pipes


@pytest.fixture(scope="module")
def devices8(workers):
    """The measurements of both halves, merged: lists concatenated."""
    a, b = workers("llama"), workers("mistral")
    merged = {k: v for k, v in a.items()}
    for k, v in b.items():
        merged[k] = merged.get(k, []) + v if isinstance(v, list) else v
    return merged


# ---------------------------------------------------------------------------------------------------------------------
# The table itself (this process, one device: specs come from shapes and mesh sizes alone)

TINY = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16, num_kv_heads=8,
                   head_dim=64)


def test_parse_mesh_and_device_count():
    assert sharding.parse_mesh_shape("data=2,model=4") == {"data": 2, "model": 4}
    assert sharding.parse_mesh_shape("model=8") == {"data": 1, "model": 8}
    for bad in ("data=2,data=2", "rows=2", "data=0", "", "data:2"):
        with pytest.raises(sharding.MeshError, match="bad mesh"):
            sharding.parse_mesh_shape(bad)
    with pytest.raises(sharding.MeshError, match=r"needs 8 devices, but there are 1"):
        sharding.make_mesh("data=2,model=4")
    mesh = sharding.make_mesh("data=1")
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (1, 1)


def test_param_specs_follow_the_table():
    params = jax.eval_shape(lambda: init_params(TINY, jax.random.PRNGKey(0)))
    specs = sharding.param_specs(params, "data=2,model=4")
    assert specs.layers.wq == P(None, None, "model") and specs.layers.wk == P(None, None, "model")
    assert specs.layers.wo == P(None, "model") and specs.layers.w_down == P(None, "model")
    assert specs.layers.w_gate == P(None, None, "model") and specs.embed == P("model")
    assert specs.lm_head == P(None, "model") and specs.final_norm == P() and specs.layers.attn_norm == P()
    assert set(registry.param_table(TINY)) == set(sharding.param_axes(params))  # every leaf has declared axes
    # quantized leaves take their float leaf's axes, a projection's rows (output units) first: codes, scales and
    # mins alike (abstract params, nothing quantized)
    from kivi_jax import weights

    q = sharding.param_specs(weights.abstract_params(params, "int4-g32"), "data=2,model=4")
    assert q.layers.wq.codes == q.layers.wq.scale == q.layers.wq.mn == P(None, "model")
    assert q.layers.wo.codes == q.layers.wo.scale == P(None, None, "model")
    assert q.embed.codes == P("model") and q.lm_head.codes == P("model")


def test_every_architectures_leaves_take_the_axes_declared_beside_them():
    """Qwen2's biases split with their heads, Qwen3's per-head norms and Gemma 2's extra norms are whole; quantized
    projections of each take their float leaf's axes."""
    from kivi_jax import weights

    shapes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16, num_kv_heads=8,
                  head_dim=64)
    qwen3 = LlamaConfig(model_type="qwen3", qkv_bias=True, o_bias=True, **shapes)
    gemma2 = LlamaConfig(model_type="gemma2", layer_types=("sliding_attention", "full_attention"), sliding_window=8,
                         **shapes)
    for cfg in (qwen3, gemma2):
        params = jax.eval_shape(lambda cfg=cfg: init_params(cfg, jax.random.PRNGKey(0)))
        assert set(registry.param_table(cfg)) == set(sharding.param_axes(params))
        specs = sharding.param_specs(params, "data=2,model=4")
        assert specs.layers.wq == P(None, None, "model") and specs.layers.wo == P(None, "model")
        q = sharding.param_specs(weights.abstract_params(params, "int8"), "data=2,model=4")
        assert q.layers.wv.codes == q.layers.wv.scale == P(None, "model") and q.embed.codes == P("model")
    q3 = sharding.param_specs(jax.eval_shape(lambda: init_params(qwen3, jax.random.PRNGKey(0))), "data=2,model=4")
    assert q3.layers.bq == q3.layers.bk == q3.layers.bv == P(None, "model")  # [layers, heads * head_dim]
    assert q3.layers.q_norm == q3.layers.k_norm == q3.layers.bo == P()  # [layers, head_dim], [layers, hidden]
    g2 = sharding.param_specs(jax.eval_shape(lambda: init_params(gemma2, jax.random.PRNGKey(0))), "data=2,model=4")
    assert g2.layers.post_attn_norm == g2.layers.post_mlp_norm == P() and g2.layers.w_up == P(None, None, "model")


def test_heads_that_do_not_divide_the_model_axis_are_replicated():
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # SmolLM2's 9 query / 3 kv heads
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    with pytest.warns(RuntimeWarning, match=r"kv_heads=3 does not divide the model axis \(4\).*1, 3"):
        sharding._warn_heads.cache_clear()
        specs = sharding.param_specs(params, "data=2,model=4")
    assert specs.layers.wq == P() and specs.layers.wk == P() and specs.layers.wo == P()
    assert specs.layers.w_up == P(None, None, "model") and specs.embed == P("model")  # MLP and vocab stay split
    cache = jax.eval_shape(lambda: make_cache("kivi2", cfg, 4, 256))
    assert sharding.cache_specs(cache, "data=2,model=4").k_ring == P(None, "data")
    assert sharding.cache_specs(cache, "data=2,model=3").k_ring == P(None, "data", "model")


def test_cache_specs_by_rule_and_unknown_leaves_fail():
    cache = jax.eval_shape(lambda: make_cache("kivi2", TINY, 4, 256))
    specs = sharding.cache_specs(cache, "data=2,model=4")
    for s in (specs.k.codes, specs.k.scale, specs.v.mn, specs.k_ring, specs.v_ring):
        assert s == P(None, "data", "model")
    assert specs.length == P("data") and specs.error_flags == P("data")
    # a new [batch] flag or a [layers, batch, kv_heads, S, D] sink store is placed by rule, with no new entry
    grown = {"cache": cache, "error_flags": jax.ShapeDtypeStruct((4,), jnp.int32),
             "sink_k": jax.ShapeDtypeStruct((2, 4, 8, 4, 64), jnp.float32)}
    grown_specs = sharding.cache_specs(grown, "data=2,model=4")
    assert grown_specs["error_flags"] == P("data") and grown_specs["sink_k"] == P(None, "data", "model")
    with pytest.raises(sharding.MeshError, match=r"cache leaf bad has shape \(4, 3\).*CACHE_AXES"):
        sharding.cache_specs({"cache": cache, "bad": jax.ShapeDtypeStruct((4, 3), jnp.int32)}, "data=2,model=4")
    with pytest.raises(sharding.MeshError, match=r"does not share \[layers, batch, kv_heads\]"):
        sharding.cache_specs({"cache": cache, "x": jax.ShapeDtypeStruct((2, 4, 4, 8, 8), jnp.float32)}, "data=2")
    with pytest.raises(sharding.MeshError, match=r"batch 4 does not divide the data axis \(8\)"):
        sharding.cache_specs(cache, "data=8")
    # one sequence (a request being prefilled for serving) is whole on every data shard, its heads still split
    one = sharding.cache_specs(jax.eval_shape(lambda: make_cache("kivi2", TINY, 1, 256)), "data=2,model=4")
    assert one.k.codes == P(None, None, "model") and one.length == P()


def test_per_device_bytes_of_a_7b_cache():
    cfg = PRESETS["llama2-7b"]
    cache = jax.eval_shape(lambda: make_cache("full", cfg, 8, 4096, jnp.bfloat16))
    book = 8 * (4 + 4)  # length and error_flags, int32, for 8 sequences: split by data only
    whole = 2 * 32 * 8 * 32 * 4096 * 128 * 2 + book
    for mesh in ("data=1,model=8", "data=8,model=1"):
        per = sharding.per_device_bytes(cache, sharding.cache_specs(cache, mesh), mesh)
        assert per == (whole - book) // 8 + (book if mesh.startswith("data=1") else book // 8)


def test_bench_memory_per_device(capsys):
    from kivi_jax import cli
    from kivi_jax.bench import abstract_params, max_batch
    from kivi_jax.cache import full_cache_bytes, tree_bytes

    cfg = PRESETS["llama2-7b"]
    assert cli.main(["bench", "memory", "--model", "llama2-7b", "--context", "4096", "--budget", "80GB", "--no-temps",
                     "--cache", "full,kivi2", "--mesh", "data=1,model=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    full = out["results"]["full"]["per_device"]
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2  # replicated; everything else splits 8 ways
    weights = (tree_bytes(abstract_params(cfg, jnp.bfloat16)) - norms) // 8 + norms
    per_seq = (full_cache_bytes(cfg, 1, 4096, 2) - 8) // 8 + 8  # length and error_flags are not split by model
    assert full["weights_bytes_per_device"] == weights and full["cache_bytes_per_device_per_seq"] == per_seq
    assert full["max_batch"] == max_batch(80 * 10**9, weights, per_seq) > 8 * 30  # 30 fit one 80 GB device
    kivi = out["results"]["kivi2"]["per_device"]
    assert kivi["max_batch"] > 4 * full["max_batch"]
    assert kivi["max_context_one_seq_per_data_shard"] > 4 * full["max_context_one_seq_per_data_shard"]
    assert cli.main(["bench", "memory", "--model", "llama2-7b", "--no-temps", "--mesh", "data=3,rows=2"]) == 2


def test_bench_batches_must_split_over_the_data_axis():
    from kivi_jax.bench_cli import _check_batches

    _check_batches([2, 4], {"data": 2})
    _check_batches([3], None)
    with pytest.raises(ValueError, match=r"--batch 3,5: each batch must be a multiple of the mesh's data axis \(2\)"):
        _check_batches([2, 3, 5], {"data": 2})


def test_initialize_distributed_needs_all_or_none(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert sharding.initialize_distributed() is False
    with pytest.raises(sharding.MeshError, match="needs all of --coordinator"):
        sharding.initialize_distributed(num_processes=2)


# ---------------------------------------------------------------------------------------------------------------------
# On 8 CPU devices (one child process)


@pytest.mark.slow
def test_sharded_prefill_and_decode_equal_one_device(devices8):
    rows = devices8["parity"]
    assert {(r["model"], r["spec"], r["mesh"]) for r in rows} >= {
        ("llama", s, mesh) for s in ("full", "k2v2-g32-r32")
        for mesh in ("data=8,model=1", "data=2,model=4", "data=1,model=8")} | {
        ("mistral", "k2v2-g32-r32", mesh) for mesh in ("data=8,model=1", "data=2,model=4", "data=1,model=8")} | {
        ("mistral", "full", "data=2,model=4"), ("llama_3kv", "k2v2-g32-r32", "data=2,model=4")} | {
        (m, "k2v2-g32-r32", "data=2,model=4") for m in ("qwen2", "gemma2")}
    for r in rows:
        what = f"{r['model']} {r['spec']} on {r['mesh']}"
        assert r["tokens_equal"], what  # greedy tokens of the free-running generation
        assert r["prefill_logit_diff"] <= 1e-5, f"{what}: prefill logits differ by {r['prefill_logit_diff']}"
        # each decode step from the one-device run's own cache state and token
        assert r["decode_logit_diff"] <= 1e-5, f"{what}: decode logits differ by {r['decode_logit_diff']}"
        assert r["forced_codes_agree"] >= 0.999, what  # the quantized codes that step stores
        if r["spec"] == "full":  # no quantization to amplify rounding: free-running stays within 1e-5 too
            assert r["free_running_logit_diff"] <= 1e-5, what


@pytest.mark.slow
def test_every_leaf_carries_the_tables_sharding(devices8):
    for r in devices8["parity"]:
        data, model = (int(x.split("=")[1]) for x in r["mesh"].split(","))
        kv_heads = 3 if r["model"] == "llama_3kv" else 8
        heads = model if kv_heads % model == 0 else 1
        for leaf in r["cache_leaves"] + r["param_leaves"]:
            assert leaf["matches_table"], (r["mesh"], leaf)
        for leaf in r["cache_leaves"]:
            shape = leaf["shape"]
            if len(shape) == 5:  # [layers, batch, kv_heads, rows, cols]: split on batch and heads only
                want = [shape[0], shape[1] // data, shape[2] // heads] + shape[3:]
            else:
                want = [shape[0] // data]
            assert leaf["shard_shape"] == want, (r["mesh"], leaf)
    three = next(r for r in devices8["parity"] if r["model"] == "llama_3kv")
    assert any("kv_heads=3 does not divide the model axis (4)" in w for w in three["warnings"])


@pytest.mark.slow
def test_no_cache_sized_all_gather(devices8):
    for r in devices8["parity"]:
        if "largest_all_gather_decode" not in r:
            continue
        what = f"{r['model']} {r['spec']} on {r['mesh']}"
        # bookkeeping (token indices of the writes) may be gathered; nothing as large as one shard of a cache store
        assert r["largest_all_gather_decode"] < r["smallest_store_shard"], what
        assert r["largest_all_gather_prefill"] < r["smallest_store_shard"], what


@pytest.mark.slow
def test_kernels_per_shard_equal_the_unsharded_xla_path(devices8):
    """The Pallas kernels (interpret mode) and the native CPU kernels, each run per shard under shard_map."""
    assert {(r["impl"], r["spec"]) for r in devices8["kernel"]} == {
        (i, s) for i in ("pallas", "native") for s in ("full", "k2v2-g32-r32")}
    assert all(r["native_available"] for r in devices8["kernel"])
    for r in devices8["kernel"]:
        assert r["tokens_equal"], r
        assert r["prefill_logit_diff"] <= 1e-5 and r["decode_logit_diff"] <= 1e-5, r


@pytest.mark.slow
def test_sharded_steps_lower_for_tpu_and_cuda(devices8):
    rows = devices8["lowering"]
    xla = [r for r in rows if r["impl"] == "xla"]
    assert {(r["spec"], r["platform"]) for r in xla} == {(s, p) for s in ("full", "k2v2-g32-r32")
                                                         for p in ("tpu", "cuda")}
    for r in xla:
        assert r.get("decode_ok") and r.get("prefill_ok"), r
        assert r["shard_map_in_decode"], r
    for r in rows:
        if r["impl"] == "pallas":
            if r.get("needs_cuda_plugin"):
                continue  # newer jaxlibs compile the Triton IR while lowering (tests/test_pallas_lowering.py skips)
            assert r.get("decode_ok") and r["triton_in_decode"], r


@pytest.mark.slow
def test_generate_with_a_mesh(devices8):
    assert devices8["generate"]
    for r in devices8["generate"]:
        assert r["got"] == r["ref"], r
        assert [len(s) for s in r["got"]] == [5, 5, 5]


@pytest.mark.slow
def test_quantized_weights_with_a_mesh(devices8):
    """int8 and int4 weights sharded like their float leaves (a projection's rows are its output units: wq's rows
    split over model, wo's columns) give the one-device tokens; placing params drops a strip-major copy."""
    for fmt, r in devices8["weights"].items():
        assert r["got"] == r["ref"] and all(len(s) == 5 for s in r["got"]), (fmt, r)
        spec = lambda key: r[key].replace("PartitionSpec(", "P(")  # noqa: E731 (jax versions print P or PartitionSpec)
        assert spec("wq_codes_spec") == spec("wq_scale_spec") == "P(None, 'model')", r
        assert spec("wo_codes_spec") == "P(None, None, 'model')", r
        assert r["strips_dropped"], r  # the engine's strip-major copy is for the one-device native kernel only


@pytest.mark.slow
def test_evaluate_with_a_mesh(devices8):
    ref, got = devices8["evaluate"]["ref_nll"], devices8["evaluate"]["got_nll"]
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5, (ref, got)


@pytest.mark.slow
def test_serving_engine_on_a_mesh(devices8):
    """`kivi-jax serve --mesh`: the same tokens as one device (decoding together, and a prefix reused from a
    finished slot); slots split over data, heads over model; a slot is extracted without gathering its group."""
    got, ref = devices8["serve"]["got"], devices8["serve"]["ref"]
    assert got["streams"] == ref["streams"] and all(len(s) == 5 for s in got["streams"].values())
    assert got["reuse"] == ref["reuse"] and got["reused"] == ref["reused"] > 0
    leaves = got["cache_leaves"]
    assert all(x["matches_table"] for x in leaves), leaves
    assert all(x["shard_shape"][1] == 2 and x["shard_shape"][2] == 2 for x in leaves if len(x["shape"]) == 5)
    assert 0 < got["largest_all_gather_extract"] <= 2 * got["largest_row_leaf"]  # D=2 candidate rows, no more
    stores = [spec for spec in got["row_specs"] if "model" in spec]  # the extracted row: heads split, batch whole
    assert len(stores) == 8 and all(spec == "P(None, None, 'model')" for spec in stores), got["row_specs"]


@pytest.mark.slow
def test_bench_generate_with_a_mesh(devices8):
    rows = devices8["bench_generate"]
    assert [r["cache"] for r in rows] == ["full", "k2v2-g32-r32"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["ratio_vs_full"] == rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]


@pytest.mark.slow
def test_errors_name_what_is_wrong(devices8):
    err = devices8["errors"]
    assert "needs 4 devices, but there are 8" in err["mesh_count"]
    assert "length" in err["unknown_leaf"] and "CACHE_AXES" in err["unknown_leaf"]
    assert "batch 3 does not divide the data axis (2)" in err["batch"]


# ---------------------------------------------------------------------------------------------------------------------
# Two processes, jax.distributed on localhost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_generate_on_a_2x2_mesh(workers):
    results = [workers("dist0"), workers("dist1")]
    assert [r["process"] for r in results] == [0, 1]
    ref = results[0]["ref"]  # one device, computed by process 0 alone
    assert ref is not None and results[1]["ref"] is None
    for r in results:
        assert r["got"] == ref, r
