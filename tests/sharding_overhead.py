"""Decode-step time on 8 forced CPU devices against one device, in one process: `python tests/sharding_overhead.py`.

The 8 devices share this machine's cores, so the ratio measures the overhead of sharding (partitioned programs,
collectives, per-shard attention), not a speed-up. Prints one JSON object.
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
for mesh in (None, "data=8", "data=2,model=4", "model=8"):
    rows = bench.bench_decode(params, [CONTEXT], [BATCH], ["full", "kivi2"], "xla", REPEATS, 3, mesh=mesh)
    out["results"][mesh or "one device"] = {r["cache"]: r["step_ms_median"] for r in rows}
one = out["results"]["one device"]
out["ratio_vs_one_device"] = {m: {c: t / one[c] for c, t in r.items()} for m, r in out["results"].items()}
print(json.dumps(out))
