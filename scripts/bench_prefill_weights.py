"""Prefill tokens/s of a 4096-token prompt (chunks of 512, the default) with each weight format: three calls, the
first compiling. A format may name its compute dtype after a slash (`bfloat16/float32`: bfloat16 matrices under a
float32 model).

    PYTHONPATH=. python scripts/bench_prefill_weights.py gguf,float32,bfloat16/float32
"""
import json, sys
import numpy as np
import kivi_jax
out = {}
for name in sys.argv[1].split(","):
    w, _, dtype = name.partition("/")
    model = kivi_jax.load("smollm2", weights=w, dtype=dtype or None)
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 4096)]
    runs = []
    for r in range(3):  # the first compiles
        g = kivi_jax.generate(model, [ids], max_new_tokens=1, cache="kivi2", max_length=4224)
        runs.append(4096 / g.prefill_seconds if hasattr(g, "prefill_seconds") else None)
    out[name] = runs
    print(name, runs, file=sys.stderr, flush=True)
print(json.dumps(out))
