"""A paged cache on a device mesh (issue 22, docs/design.md §9 and §12): on `data=1,model=N` the pools `[layers,
pages, kv_heads, page_rows, X]` split their kv heads over `model` (pages are not split: every model-axis device holds
all pages, of its heads), the block tables and per-sequence bookkeeping are whole on every device, and the paged
engine's greedy answers are those of the same engine on one device. `data>1` is refused with a clear error.

The checks run in a child process (this file run as a script) whose environment forces 4 CPU devices, as
tests/sharding_worker.py does, so this process and the rest of the suite keep one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
MESH = "data=1,model=4"
SPECS = ("k2v2-g16-r16", "full")  # KIVI pages of one 16-token block; full-precision pages of 16 tokens
LENGTHS = [40, 7, 25]  # ragged prompts; 20 decode steps take each across a page boundary (pages grow)
STEPS = 20
MAX_LENGTH = 128
PAGES = 24


@pytest.fixture(scope="module")
def measured() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_a_paged_engine_on_a_model_mesh_answers_as_on_one_device(measured, spec):
    got, ref = measured[spec]["mesh"], measured[spec]["one"]
    assert got["streams"] == ref["streams"]
    assert all(len(s) == STEPS + 1 for s in got["streams"].values())
    assert got["pages_grown"] and got["pages_used_end"] == 0  # pages were taken as they grew, and all came back


@pytest.mark.parametrize("spec", SPECS)
def test_the_pools_split_their_heads_over_model_and_keep_every_page(measured, spec):
    leaves = measured[spec]["mesh"]["leaves"]
    pools = [x for x in leaves if x["pool"]]
    assert len(pools) == (6 if spec.startswith("k") else 2)  # codes, scales, mins of keys and values; or k, v
    for x in pools:
        layers, pages, heads = x["shape"][:3]
        assert pages == PAGES and x["spec"][:3] == [None, None, "model"], x
        assert x["shard"][:3] == [layers, PAGES, heads // DEVICES], x  # all pages, a quarter of the heads
    table = next(x for x in leaves if x["path"] == "table")
    assert table["shard"] == table["shape"]  # whole on every device
    for x in leaves:
        if len(x["shape"]) == 1:  # length, error flags
            assert x["shard"] == x["shape"], x


@pytest.mark.parametrize("spec", SPECS)
def test_the_decode_step_on_a_mesh_moves_no_pool_between_devices(measured, spec):
    """The compiled decode step's collectives (all-reduces of the sharded projections, the vocabulary's gathers) are
    each smaller than one device's shard of the smallest pool: no page is gathered, permuted or reduced across
    devices, each device reads its own heads' pages."""
    got = measured[spec]["mesh"]
    assert any(op == "all-reduce" for op, _ in got["collectives"])  # the program was read (the row-split projections)
    assert all(n < got["pool_shard_elements"] for _, n in got["collectives"]), (got["pool_shard_elements"],
                                                                              got["collectives"])


def test_a_paged_cache_on_a_data_parallel_mesh_is_refused_clearly(measured):
    for where in ("engine", "make_cache"):
        msg = measured["errors"][where]
        assert "a paged cache needs data=1" in msg and "give a mesh of model=4" in msg, msg


# ---------------------------------------------------------------------------------------------------------------------
# The child process


def _serve(params, spec: str, mesh: str | None) -> dict:
    import jax
    import numpy as np

    from kivi_jax import sharding
    from kivi_jax.sampling import Sampling
    from kivi_jax.serve.engine import Engine

    from kivi_jax import runtime
    from kivi_jax.serve import engine

    calls = []  # the abstract arguments of each decode step (its cache is donated)

    def recorded(*args):
        calls.append(jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            args))
        return runtime.decode_step(*args)

    engine.decode_step = recorded
    eng = Engine(params, spec, slots=4, max_length=MAX_LENGTH, prefill_chunk=32, attention_impl="xla", pages=PAGES,
                 mesh=mesh)
    tokens = np.random.RandomState(1).randint(3, params.config.vocab_size, (len(LENGTHS), max(LENGTHS)))
    streams, before = {}, None
    for i, n in enumerate(LENGTHS):
        slot, first = eng.admit(tokens[i, :n].tolist(), Sampling(0.0))
        streams[str(slot)] = [first]
    before = eng.allocator.used_pages
    for _ in range(STEPS):
        for slot, t in eng.step().items():
            streams[str(slot)].append(t)
    out = {"streams": streams, "pages_grown": eng.allocator.used_pages > before}
    if mesh is not None:
        cache = eng.caches[0]
        pools, _ = sharding.paged_leaves(cache)
        out["leaves"] = [{"path": name, "pool": name in pools, "shape": list(x.shape), "spec": list(x.sharding.spec),
                          "shard": list(x.sharding.shard_shape(x.shape))}
                         for name, x in ((jax.tree_util.keystr(p, simple=True, separator="."), x)
                                         for p, x in jax.tree_util.tree_flatten_with_path(cache)[0])]
        out["pool_shard_elements"] = min(int(np.prod(x["shard"])) for x in out["leaves"] if x["pool"])
        with sharding.use_mesh(eng.mesh):  # as the engine traces it
            out["collectives"] = _collectives(runtime.decode_step.lower(*calls[-1]).compile().as_text())
    engine.decode_step = runtime.decode_step
    for slot in list(map(int, streams)):
        eng.finish(slot, hold=False)
    out["pages_used_end"] = eng.allocator.used_pages
    return out


def _collectives(hlo: str) -> list:
    """`(op, elements of its result)` for each cross-device collective of a compiled HLO text."""
    import re

    import numpy as np

    found = []
    for m in re.finditer(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(", hlo):
        shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))
        found.append((m.group(2), sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)))
    return found


def _errors(params) -> dict:
    from kivi_jax.cache import make_cache
    from kivi_jax.serve.engine import Engine

    out = {}
    try:
        Engine(params, SPECS[0], slots=4, max_length=MAX_LENGTH, pages=PAGES, mesh="data=2,model=2")
    except ValueError as e:
        out["engine"] = str(e)
    try:
        make_cache(SPECS[0], params.config, 4, MAX_LENGTH, pages=PAGES, mesh="data=2,model=2")
    except ValueError as e:
        out["make_cache"] = str(e)
    return out


def _main() -> dict:
    import jax

    from kivi_jax.models.config import LlamaConfig
    from kivi_jax.models.llama import init_params

    assert jax.device_count() == DEVICES, jax.devices()
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16, num_kv_heads=8,
                      head_dim=32, max_position_embeddings=512, eos_token_ids=(), pad_token_id=0)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.1)
    out = {spec: {"one": _serve(params, spec, None), "mesh": _serve(params, spec, MESH)} for spec in SPECS}
    out["errors"] = _errors(params)
    return out


if __name__ == "__main__":
    # before jax starts: forced CPU devices, LLVM at -O0 (tiny programs: compiling is nearly all the time)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from xla_flags import with_test_flags

    os.environ["XLA_FLAGS"] = with_test_flags(f"--xla_force_host_platform_device_count={DEVICES} "
                                              "--xla_backend_optimization_level=0")
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, ROOT)  # the checkout's kivi_jax
    print(json.dumps(_main()))
