"""A prefill chunk's attention four ways, one process: `runtime.prefill` of one prompt (chunks of 512) onto an empty
kivi2 cache, by default with bfloat16 weights under float32 compute; 'bfloat16' is the library as it is (the chunk's
queries go to the cache in bfloat16 because the matmuls dot in bfloat16, and on a CPU with AMX the native chunk
kernel computes their attention), 'bfloat16-xla' the same on a cache of `impl="xla"` (XLA's blockwise path),
'float32' the chunk in float32 (`models.weights.dots_in_bfloat16` patched to False; on a CPU with AVX-512 the native
kernel's float32 tiles compute its attention), 'float32-xla' that on a cache of `impl="xla"`. `--weights float32` (or
`auto`, the GGUF's blocks) loads those weights instead. The variants alternate, two rounds, ms medians of 3 after a
compiling call. docs/serving.md: "A prefill chunk's attention in bfloat16, an empty ring skipped"; docs/kernels.md
"Chunk attention".

    PYTHONPATH=. python scripts/bench_prefill_attention.py --variants bfloat16-xla,bfloat16 \
        --json docs/bench/prefill_chunk_kernel_ab.json
    PYTHONPATH=. python scripts/bench_prefill_attention.py --weights float32 --variants float32-xla,float32
"""
import argparse
import json
import time

import jax
import numpy as np

import kivi_jax
from kivi_jax import runtime
from kivi_jax.cache import make_cache
from kivi_jax.models import weights as seam


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,1536", help="prompt tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="float32,bfloat16", help="of float32, float32-xla, bfloat16-xla, bfloat16; "
                   "in this order each round")
    p.add_argument("--weights", default="bfloat16", help="the weights `kivi_jax.load` keeps (default bfloat16; "
                   "float32, auto)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    model = kivi_jax.load("smollm2", weights=args.weights, dtype="float32")
    params, cfg = model.params, model.params.config
    lengths = [int(n) for n in args.lengths.split(",")]
    as_is = seam.dots_in_bfloat16
    out = {}
    for rnd in range(args.rounds):
        for variant in args.variants.split(","):
            if variant not in ("float32", "float32-xla", "bfloat16-xla", "bfloat16"):
                p.error(f"unknown variant {variant!r}")
            seam.dots_in_bfloat16 = (lambda layers: False) if variant.startswith("float32") else as_is
            jax.clear_caches()  # the prefill program is traced again with the variant's choice
            for n in lengths:
                ids = np.random.default_rng(0).integers(100, 40000, (1, n)).astype(np.int32)
                times = []
                for _ in range(4):  # the first compiles
                    cache = make_cache("kivi2", cfg, 1, max(2176, max(lengths) + 128),  # a 2048-token slot's
                                       impl="xla" if variant.endswith("-xla") else "auto")
                    t0 = time.perf_counter()
                    last, cache = runtime.prefill(params, ids, np.array([n]), cache)
                    last.block_until_ready()
                    times.append(time.perf_counter() - t0)
                ms = round(float(np.median(times[1:])) * 1000, 1)
                out.setdefault(f"round{rnd + 1}", {}).setdefault(variant, {})[n] = ms
                print(f"round {rnd + 1} {variant:12s} {n:5d} tokens {ms:8.1f} ms {n / ms * 1000:7.0f} tok/s", flush=True)
    seam.dots_in_bfloat16 = as_is
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
