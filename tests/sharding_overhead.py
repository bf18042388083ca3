"""Decode-step time on 8 forced CPU devices against one device, in one process: `python tests/sharding_overhead.py`.

The 8 devices share this machine's cores, so the ratio measures the overhead of sharding (partitioned programs,
collectives, per-shard attention), not a speed-up. Each number is the fastest step over two interleaved rounds of
15 timed steps (the least disturbed by other work on the machine). Prints one JSON object.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from kivi_jax import bench  # noqa: E402
from kivi_jax.models.config import LlamaConfig  # noqa: E402
from kivi_jax.models.llama import init_params  # noqa: E402

CFG = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=2, num_heads=8,
                  num_kv_heads=8, head_dim=64, max_position_embeddings=4096)
CONTEXT, BATCH, REPEATS = 1024, 8, 15

params = init_params(CFG, jax.random.PRNGKey(0))
out = {"device": bench.device_name(), "devices": jax.device_count(), "config": CFG.to_dict(), "context": CONTEXT,
       "batch": BATCH, "results": {}}
MESHES = (None, "data=8", "data=2,model=4", "model=8")
for spec in ("full", "kivi2"):  # the meshes interleaved, twice: a load spike on the shared cores hits all of them
    for round_ in range(2):
        for mesh in MESHES:
            rows = bench.bench_decode(params, [CONTEXT], [BATCH], [spec], "xla", REPEATS, 3, mesh=mesh)
            best = out["results"].setdefault(mesh or "one device", {})
            best[spec] = min(best.get(spec, float("inf")), rows[0]["step_ms_min"])  # fastest step seen
one = out["results"]["one device"]
out["ratio_vs_one_device"] = {m: {c: t / one[c] for c, t in r.items()} for m, r in out["results"].items()}
print(json.dumps(out))
