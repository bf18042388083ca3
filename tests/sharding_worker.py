"""Runs sharded checks in a process of its own (tests/test_sharding.py starts it): the forced CPU device count must be
set before jax starts, and only here, so the rest of the suite keeps one device.

`python tests/sharding_worker.py devices8 llama|mistral` -> one JSON object on the last stdout line with the
measurements of that half of the checks on 8 CPU devices (two halves, so that two processes share the cores);
`python tests/sharding_worker.py distributed PORT PROCESS_ID` -> one process of a two-process `jax.distributed` run
on localhost (2 CPU devices each).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

MODE = sys.argv[1]
DEVICES = {"devices8": 8, "distributed": 2}[MODE]
# LLVM at -O0: the programs here are tiny, so compiling (about 30 sharded programs a process) is nearly all the time;
# the partitioned HLO (what the all-gather and sharding checks read) and the float semantics stay the same.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xla_flags import with_test_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_flags(
    f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's kivi_jax

if MODE == "distributed":
    from kivi_jax import sharding as _sharding

    _sharding.initialize_distributed(f"localhost:{sys.argv[2]}", 2, int(sys.argv[3]))

import contextlib  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kivi_jax import sharding  # noqa: E402
from kivi_jax.cache import make_cache  # noqa: E402
from kivi_jax.generate import generate  # noqa: E402
from kivi_jax.models.config import LlamaConfig  # noqa: E402
from kivi_jax.models.llama import forward, init_params  # noqa: E402

from gpu_target import cuda_target  # noqa: E402

KIVI = "k2v2-g32-r32"  # kivi2 with a short ring, so the quantized stores and a key flush are exercised
MAX_TOKENS = 128
LENGTHS = [40, 7, 31, 25, 33, 12, 1, 29]  # ragged prompts: 31 flushes a key block on the first decode step
DECODE = 6
MESHES = ["data=8,model=1", "data=2,model=4", "data=1,model=8"]


def tiny(name: str) -> LlamaConfig:
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=64,
                  max_position_embeddings=512, eos_token_ids=(), pad_token_id=0)
    if name == "llama":  # GQA n_rep 2, untied
        return LlamaConfig(num_heads=16, num_kv_heads=8, **common)
    if name == "mistral":  # sliding window shorter than the sequences, tied embeddings
        return LlamaConfig(num_heads=8, num_kv_heads=8, sliding_window=20, tie_word_embeddings=True,
                           model_type="mistral", **common)
    if name == "llama_3kv":  # SmolLM2's head layout: 3 kv heads, 9 query heads
        return LlamaConfig(num_heads=9, num_kv_heads=3, **common)
    # the architectures added through models/registry.py: their own leaves (biases, q/k norms, post-norms) placed
    # by the axes declared beside them
    heads = dict(num_heads=16, num_kv_heads=8)
    if name == "qwen2":  # q, k, v biases (Qwen3's q/k norms and output bias: placed by test_sharding's table checks)
        return LlamaConfig(model_type="qwen2", qkv_bias=True, **heads, **common)
    if name == "gemma2":  # soft-caps, local/global layers (a window shorter than the sequences), query scaling
        return LlamaConfig(model_type="gemma2", layer_types=("sliding_attention", "full_attention"), sliding_window=20,
                           attn_logit_softcap=5.0, final_logit_softcap=10.0, query_pre_attn_scalar=48.0,
                           hidden_act="gelu_tanh", tie_word_embeddings=True, **heads, **common)
    raise KeyError(name)


def prompts(batch: int = len(LENGTHS)) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array(LENGTHS[:batch], np.int32)
    tokens = np.random.RandomState(1).randint(3, 96, (batch, max(lengths))).astype(np.int32)
    tokens[np.arange(max(lengths))[None, :] >= lengths[:, None]] = 0
    return tokens, lengths


def greedy_run(params, spec: str, mesh, impl: str = "xla", ref: dict | None = None) -> dict:
    """Prefill then DECODE greedy steps through the cache: logits `[steps, batch, vocab]`, tokens, the final cache.

    With `ref` (an earlier run), also each decode step teacher-forced from the reference's own cache and token (put
    on this run's mesh): `forced_logits`, and how many stored codes the step's output cache shares with the
    reference's. Prefill and decode are compiled once each (the compiled HLO is kept)."""
    cfg = params.config
    tokens, lengths = prompts()
    batch = len(lengths)
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    cache = make_cache(spec, cfg, batch, MAX_TOKENS, jnp.float32, impl, mesh=mesh)
    put = jnp.asarray if mesh is None else (lambda x: sharding.put_batch(x, mesh))
    place = (lambda c: c) if mesh is None else (lambda c: sharding.shard_cache(c.replace(impl=impl), mesh))
    out = {"caches": [], "fed": []}
    with sharding.use_mesh(mesh):
        args = (params, put(tokens), put(lengths), cache)
        prefill = jax.jit(lambda p, t, n, c: forward(p, t, c, num_new=n, logits_at=n - 1)).lower(*args).compile()
        logits, cache = prefill(*args)
        nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        decode = jax.jit(lambda p, t, c: forward(p, t[:, None], c)).lower(params, nxt, cache).compile()
        steps, forced, agree = [np.asarray(logits[:, 0])], [], []
        for i in range(DECODE):
            out["caches"].append(jax.tree_util.tree_map(np.asarray, cache))
            out["fed"].append(np.asarray(nxt))
            if ref is not None:  # the same step from the reference's state
                f_logits, f_cache = decode(params, put(ref["fed"][i]), place(ref["caches"][i]))
                forced.append(np.asarray(f_logits[:, 0]))
                want = ref["caches"][i + 1] if i + 1 < DECODE else ref["cache"]
                agree.append(codes_agreement(f_cache, want))
            logits, cache = decode(params, nxt, cache)
            steps.append(np.asarray(logits[:, 0]))
            nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    out.update(logits=np.stack(steps), tokens=np.stack(steps).argmax(-1), cache=cache, params=params,
               prefill_hlo=prefill.as_text(), decode_hlo=decode.as_text())
    if ref is not None:
        out.update(forced_logits=np.stack(forced), forced_codes_agree=min(agree))
    return out


def codes_agreement(cache, want) -> float:
    """The fraction of uint8 code bytes (1.0 for a full cache: none) two caches share."""
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(want)) if np.asarray(a).dtype == np.uint8]
    if not pairs:
        return 1.0
    return float(sum((a == b).sum() for a, b in pairs) / sum(a.size for a, _ in pairs))


def largest_all_gather(hlo: str) -> int:
    """Elements of the largest array any all-gather in compiled HLO produces (0 when there is none)."""
    sizes = [0]
    for m in re.finditer(r"= \w+\[([0-9,]*)\]\{[^}]*\} all-gather(?:-start)?\(", hlo):
        dims = [int(d) for d in m.group(1).split(",") if d]
        sizes.append(int(np.prod(dims)) if dims else 1)
    for m in re.finditer(r"= \((\w+\[[0-9,]*\][^)]*)\) all-gather-start\(", hlo):
        for dims in re.findall(r"\[([0-9,]*)\]", m.group(1)):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return max(sizes)


def leaf_report(tree, specs) -> list[dict]:
    """Each leaf's path, global shape, sharding spec, shard shape, and whether it matches the table's spec."""
    out = []
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(flat, spec_leaves):
        want = jax.sharding.NamedSharding(leaf.sharding.mesh, spec)
        out.append({"path": jax.tree_util.keystr(path, simple=True, separator="."), "shape": list(leaf.shape),
                    "spec": [None if a is None else a for a in tuple(leaf.sharding.spec)],
                    "shard_shape": list(leaf.sharding.shard_shape(leaf.shape)),
                    "matches_table": bool(leaf.sharding.is_equivalent_to(want, leaf.ndim))})
    return out


_REFS: dict = {}


def reference(params, spec: str) -> dict:
    """The one-device run of a (model, spec), computed once."""
    key = (params.config, spec)
    if key not in _REFS:
        _REFS[key] = greedy_run(params, spec, None)
    return _REFS[key]


def check_parity(model_name: str) -> list[dict]:
    rows = []
    # Llama: both caches on every mesh. Mistral differs in its window, which only the KIVI attention path reads on
    # a mesh (the full cache's window is one mask, checked on one mesh). The other head layouts and architectures on
    # the mesh that splits both axes, in the Llama half (the Mistral half also runs serve, bench and weights checks).
    if model_name == "llama":
        cases = [("llama", s, mesh) for s in ("full", KIVI) for mesh in MESHES]
        cases += [(m, KIVI, "data=2,model=4") for m in ("llama_3kv", "qwen2", "gemma2")]
    else:
        cases = [("mistral", KIVI, mesh) for mesh in MESHES] + [("mistral", "full", "data=2,model=4")]
    for model, spec, mesh_text in cases:
        params = init_params(tiny(model), jax.random.PRNGKey(0), std=0.1)
        ref = reference(params, spec)
        mesh = sharding.make_mesh(mesh_text)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = greedy_run(params, spec, mesh, ref=ref)
        seconds = round(time.perf_counter() - t0, 2)
        cache = got["cache"]
        row = {
            "model": model, "spec": spec, "mesh": mesh_text, "seconds": seconds,
            "prefill_logit_diff": float(np.max(np.abs(got["logits"][0] - ref["logits"][0]))),
            "decode_logit_diff": float(np.max(np.abs(got["forced_logits"] - ref["logits"][1:]))),
            "free_running_logit_diff": float(np.max(np.abs(got["logits"] - ref["logits"]))),
            "forced_codes_agree": got["forced_codes_agree"],
            "logit_scale": float(np.max(np.abs(ref["logits"]))),
            "tokens_equal": bool(np.array_equal(got["tokens"], ref["tokens"])),
            "cache_leaves": leaf_report(cache, sharding.cache_specs(cache, mesh)),
            "param_leaves": leaf_report(got["params"], sharding.param_specs(got["params"], mesh)),
            "warnings": [str(w.message) for w in caught],
        }
        if mesh_text == "data=2,model=4":
            stores = [leaf for leaf in jax.tree_util.tree_leaves(cache) if leaf.ndim == 5]
            row["smallest_store_shard"] = min(int(np.prod(x.sharding.shard_shape(x.shape))) for x in stores)
            row["largest_all_gather_decode"] = largest_all_gather(got["decode_hlo"])
            row["largest_all_gather_prefill"] = largest_all_gather(got["prefill_hlo"])
        rows.append(row)
    return rows


def check_kernel() -> list[dict]:
    """The Pallas kernels (interpret mode) and the native CPU kernels per shard under shard_map against the unsharded
    XLA path."""
    from kivi_jax import native

    rows = []
    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    for impl, spec in (("pallas", "full"), ("pallas", KIVI), ("native", "full"), ("native", KIVI)):
        ref = reference(params, spec)  # the XLA path on one device
        with warnings.catch_warnings():
            if impl == "native":  # the native kernel falling back to the XLA path would warn: fail instead
                warnings.simplefilter("error", RuntimeWarning)
            got = greedy_run(params, spec, sharding.make_mesh("data=2,model=4"), impl=impl, ref=ref)
        rows.append({"impl": impl, "spec": spec, "native_available": native.available(),
                     "prefill_logit_diff": float(np.max(np.abs(got["logits"][0] - ref["logits"][0]))),
                     "decode_logit_diff": float(np.max(np.abs(got["forced_logits"] - ref["logits"][1:]))),
                     "free_running_logit_diff": float(np.max(np.abs(got["logits"] - ref["logits"]))),
                     "tokens_equal": bool(np.array_equal(got["tokens"], ref["tokens"]))})
    return rows


def check_lowering() -> list[dict]:
    """The sharded prefill and decode step (XLA path) lower for TPU and CUDA; so does the real Triton kernel per
    shard (its lowering, not interpret mode)."""
    from kivi_jax.pallas_kernels import flash_decoding

    rows = []
    mesh = sharding.make_mesh("data=2,model=4")
    cfg = tiny("llama")
    params = sharding.shard_params(init_params(cfg, jax.random.PRNGKey(0)), mesh)
    tokens, lengths = prompts()
    tokens, lengths = sharding.put_batch(tokens, mesh), sharding.put_batch(lengths, mesh)
    for impl in ("xla", "pallas"):
        for spec in ("full", KIVI):
            cache = jax.eval_shape(lambda: make_cache(spec, cfg, len(LENGTHS), MAX_TOKENS, jnp.float32, impl))
            cache = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                                           sharding.named(sharding.cache_specs(cache, mesh), mesh))
            for platform in ("tpu", "cuda") if impl == "xla" else ("cuda",):
                row = {"impl": impl, "spec": spec, "platform": platform}
                saved = flash_decoding.interpret_default
                if impl == "pallas":  # the real kernel, as on a GPU
                    flash_decoding.interpret_default = lambda interpret: False
                try:
                    with sharding.use_mesh(mesh), (cuda_target(mesh) if impl == "pallas" else contextlib.nullcontext()):
                        decode = jax.jit(lambda p, t, c: forward(p, t[:, :1], c))
                        text = decode.trace(params, tokens, cache).lower(lowering_platforms=(platform,)).as_text()
                        row["decode_ok"] = True
                        row["shard_map_in_decode"] = "shard_map" in text or "sdy.manual_computation" in text
                        row["triton_in_decode"] = "triton" in text
                        if impl == "xla":
                            prefill = jax.jit(lambda p, t, n, c: forward(p, t, c, num_new=n, logits_at=n - 1))
                            prefill.trace(params, tokens, lengths, cache).lower(lowering_platforms=(platform,))
                            row["prefill_ok"] = True
                except RuntimeError as e:
                    row["error"] = str(e)[:500]
                    row["needs_cuda_plugin"] = "Triton compilation handler" in str(e)
                finally:
                    flash_decoding.interpret_default = saved
                rows.append(row)
    return rows


def check_generate(mesh_text: str, reference: bool = True) -> dict:
    """`generate(..., mesh=)` on a ragged batch of 3 prompts (padded to the data axis), then on one device (`ref`,
    unless `reference` is False). The sharded run comes first: processes of a distributed run reach it together."""
    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    tokens, lengths = prompts(3)
    batch = [tokens[i, : lengths[i]].tolist() for i in range(3)]
    kw = dict(max_new_tokens=5, cache=KIVI, max_length=MAX_TOKENS, attention_impl="xla")
    got = generate(params, batch, mesh=mesh_text, **kw).sequences
    if "generate" not in _REFS and reference:
        _REFS["generate"] = generate(params, batch, **kw).sequences
    ref = _REFS.get("generate")
    return {"mesh": mesh_text, "ref": ref, "got": got}


def check_weights() -> dict:
    """Quantized weights on a mesh: `generate` with int8 and int4-g32 params (their codes, scales and mins placed by
    the table, rows split with the weights' output axis, a strip-major copy dropped) gives the one-device tokens."""
    from kivi_jax import weights

    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    tokens, lengths = prompts(4)
    batch = [tokens[i, : lengths[i]].tolist() for i in range(4)]
    kw = dict(max_new_tokens=5, cache=KIVI, max_length=MAX_TOKENS, attention_impl="xla")
    out = {}
    for fmt in ("int8", "int4-g32"):
        q = weights.convert_params(params, fmt)
        mesh = sharding.make_mesh("data=2,model=4")
        placed = sharding.shard_params(weights.with_strips(q), mesh)  # a strip-major copy is not placed
        out[fmt] = {"got": generate(q, batch, mesh="data=2,model=4", **kw).sequences,
                    "strips_dropped": all(w.strips is None for w in (placed.layers.wq, placed.layers.wo, placed.embed)),
                    "ref": generate(q, batch, **kw).sequences,
                    "wq_codes_spec": str(placed.layers.wq.codes.sharding.spec),
                    "wq_scale_spec": str(placed.layers.wq.scale.sharding.spec),
                    "wo_codes_spec": str(placed.layers.wo.codes.sharding.spec)}
    return out


def check_evaluate() -> dict:
    """`evaluate(..., mesh=)` (teacher-forced NLL through the cache) against one device."""
    from kivi_jax import evaluate

    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    windows = np.random.RandomState(0).randint(3, 96, (4, 32 + 4 + 1))
    ref = evaluate.evaluate(params, windows, 32, ["full"], "xla")["full"]
    got = evaluate.evaluate(params, windows, 32, ["full"], "xla", mesh="data=2,model=4")["full"]
    return {"ref_nll": ref["nll_per_window"], "got_nll": got["nll_per_window"]}


def serve_run(params, mesh_text: str | None) -> dict:
    """The serving engine on a mesh (or one device): 3 ragged greedy requests decoded together, then a request
    that extends the first one's finished tokens (prefix reuse: its cache extracted from the batch cache)."""
    from kivi_jax.serve.engine import Engine, extract_cache
    from kivi_jax.sampling import Sampling

    eng = Engine(params, KIVI, slots=4, max_length=MAX_TOKENS, prefill_chunk=32, attention_impl="xla",
                 mesh=mesh_text)
    tokens, lengths = prompts(3)
    out: dict = {"streams": {}}
    for i in range(3):
        slot, first = eng.admit(tokens[i, : lengths[i]].tolist(), Sampling(0.0))
        out["streams"][slot] = [first]
    for _ in range(4):
        for slot, t in eng.step().items():
            out["streams"][slot].append(t)
    eng.finish(0)
    follow = eng.slots[0].tokens + [eng.slots[0].last, 5, 6, 7]
    slot, first = eng.admit(follow, Sampling(0.0))
    reuse = [first] + [eng.step()[slot] for _ in range(3)]
    out.update(reuse=reuse, reused=eng.counters["prefix_tokens_reused"])
    if mesh_text is not None:
        mesh = eng.mesh
        out["cache_leaves"] = leaf_report(eng.caches[0], sharding.cache_specs(eng.caches[0], mesh))
        with sharding.use_mesh(mesh):
            hlo = extract_cache.lower(eng.caches[0], jnp.int32(1), eng.axes, mesh).compile().as_text()
        row = jax.tree_util.tree_leaves(eng.extract(1))
        out["largest_all_gather_extract"] = largest_all_gather(hlo)
        out["largest_row_leaf"] = max(int(np.prod(x.shape)) for x in row)
        out["row_specs"] = [str(x.sharding.spec) for x in row]
    return out


def check_serve() -> dict:
    """`Engine(mesh=)` against the same requests on one device."""
    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    return {"got": serve_run(params, "data=2,model=4"), "ref": serve_run(params, None)}


def check_bench_generate() -> list[dict]:
    """`kivi-jax bench generate --mesh`: the compiled prefill + decode loop runs sharded for full and KIVI."""
    from kivi_jax import bench

    params = init_params(tiny("llama"), jax.random.PRNGKey(0), std=0.1)
    return bench.bench_generate(params, [2], ["full", KIVI], 40, 4, "xla", 1, mesh="data=2,model=4")


def check_errors() -> dict:
    out = {}
    try:
        sharding.make_mesh("data=2,model=2")
    except sharding.MeshError as e:
        out["mesh_count"] = str(e)
    cfg = tiny("llama")
    cache = jax.eval_shape(lambda: make_cache(KIVI, cfg, 2, MAX_TOKENS))
    bad = cache.replace(length=jax.ShapeDtypeStruct((2, 3), jnp.int32))
    try:
        sharding.cache_specs(bad, sharding.make_mesh("data=2,model=4"))
    except sharding.MeshError as e:
        out["unknown_leaf"] = str(e)
    try:
        sharding.cache_specs(jax.eval_shape(lambda: make_cache(KIVI, cfg, 3, MAX_TOKENS)), "data=2,model=4")
    except sharding.MeshError as e:
        out["batch"] = str(e)
    return out


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    TIMES[fn.__name__ + "".join(f"({a})" for a in args)] = round(time.perf_counter() - t0, 2)
    return out


TIMES: dict = {}


def main_devices8(part: str) -> dict:
    assert jax.device_count() == 8, jax.devices()
    if part == "llama":
        out = {"parity": timed(check_parity, "llama"), "kernel": timed(check_kernel),
               "generate": [timed(check_generate, "data=2,model=4")], "evaluate": timed(check_evaluate)}
    else:
        out = {"parity": timed(check_parity, "mistral"), "lowering": timed(check_lowering),
               "errors": timed(check_errors), "serve": timed(check_serve),
               "bench_generate": timed(check_bench_generate), "weights": timed(check_weights)}
    out["seconds"] = TIMES
    return out


def main_distributed() -> dict:
    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    result = check_generate("data=2,model=2", reference=jax.process_index() == 0)  # one reference is enough
    result["process"] = jax.process_index()
    return result


def _json(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)


if __name__ == "__main__":
    result = main_devices8(sys.argv[2]) if MODE == "devices8" else main_distributed()
    print(json.dumps(result, default=_json))
