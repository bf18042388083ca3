"""The decode attention alone on the CPU: bytes it must read over its time, against a memory-stream rate measured on
the same machine, for the native kernels (KIVI, in float and integer mode where the build has it, and full
precision) and the XLA path.

    PYTHONPATH=. python scripts/bench_native_attention.py [--contexts 8192,16384] [--batch 8] [--json out.json]
        [--rings float32,float16,bfloat16]

One layer with SmolLM2's attention shapes (3 kv heads, 9 query heads, head_dim 64; float32, kivi2 = k2v2-g32-r128),
a random cache at the given fill (the KIVI rows once for each residual-ring dtype in `--rings`: float32 is kivi2,
float16 / bfloat16 kivi2 with `-ringf16` / `-ringbf16`, rows named `kivi2_ringf16_...`), each function jit-compiled
and timed as the median of repeated calls. The stream rate is numpy summing (read only) and copying a 512 MiB array,
in one thread and in two threads at once (numpy releases the GIL). Timings on a shared machine are noisy: read the
ratios, and the load printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import attention, bench, native
from kivi_jax.config import parse_cache_spec
from kivi_jax.pallas_kernels import full_decode, kivi_decode


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def stream_rates(mib: int = 512, repeats: int = 5) -> dict:
    """GB/s reading (sum) and copying (read + write counted) `mib` MiB of float32, in 1 and 2 threads."""
    n = mib * 2**20 // 4
    arrays = [np.ones(n, np.float32) for _ in range(2)]
    outs = [np.empty(n, np.float32) for _ in range(2)]
    out = {}
    for threads in (1, 2):
        for name, op, traffic in (("read", lambda i: arrays[i].sum(), 1), ("copy", lambda i: np.copyto(outs[i], arrays[i]), 2)):
            def run():
                ts = [threading.Thread(target=op, args=(i,)) for i in range(threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            ms = median_ms(run, repeats)
            out[f"{name}_{threads}t_gbps"] = threads * n * 4 * traffic / (ms / 1e3) / 1e9
    return out


def one_layer_kivi(cache):
    cut = lambda s: s.replace(codes=s.codes[0], scale=s.scale[0], mn=s.mn[0])
    return cut(cache.k), cut(cache.v), cache.k_ring[0], cache.v_ring[0]


RING_SPECS = {"float32": "kivi2", "float16": "k2v2-g32-r128-ringf16", "bfloat16": "k2v2-g32-r128-ringbf16"}


def kivi_fns(spec: str, cfg, batch: int, tokens: int, ctx: int, k_new, v_new) -> dict:
    """name -> (jitted decode attention of q, bytes it reads) for one layer of a random `spec` cache: the native
    kernel (float and integer mode) and the XLA path, named `kivi2[_ringf16|_ringbf16]_{native,native_int8,xla}`."""
    kivi = parse_cache_spec(spec)
    cache = bench.random_cache(spec, cfg, batch, tokens, ctx)
    ks, vs, kr, vr = one_layer_kivi(cache)  # rings [batch, kv_heads, R, head_dim] in the spec's ring dtype
    length = cache.length
    kv, d = cfg.num_kv_heads, cfg.head_dim
    nbytes = kivi_decode.bytes_read(batch, kv, ctx, d, kivi.k_bits, kivi.v_bits, kivi.group_size,
                                    kivi.residual_length, jnp.dtype(kr.dtype).itemsize)
    prefix = "kivi2" + {"": "", "float16": "_ringf16", "bfloat16": "_ringbf16"}[kivi.ring_dtype]
    return {
        f"{prefix}_native": (jax.jit(lambda q: native.decode_kivi(q, ks, vs, None, kr, vr, length, k_new, v_new,
                                                                  None)), nbytes),
        f"{prefix}_native_int8": (jax.jit(lambda q: native.decode_kivi(q, ks, vs, None, kr, vr, length, k_new, v_new,
                                                                       None, int8_dots=native.int8_dots())), nbytes),
        f"{prefix}_xla": (jax.jit(lambda q: attention.decode_kivi_xla(q, ks, vs, None, kr, vr, length, k_new, v_new,
                                                                      None)), nbytes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,16384")
    p.add_argument("--batch", default="8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--rings", default="float32",
                   help="residual-ring dtypes of the kivi2 rows, comma-separated (float32, float16, bfloat16)")
    args = p.parse_args()
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.error()}")
    cfg = bench.with_layers(bench.model_config("smollm2"), 1)
    rings = args.rings.split(",")
    for ring in rings:
        if ring not in RING_SPECS:
            raise SystemExit(f"--rings: {ring!r} is not one of {tuple(RING_SPECS)}")
    load_before = os.getloadavg()[0]
    result = {"device": bench.device_name(), "load_before": load_before, "stream": stream_rates(), "rows": []}
    kv, d, n_rep = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batch.split(",")]:
            tokens = bench.cache_tokens(ctx, 0, ["kivi2"])
            q = jnp.asarray(np.random.RandomState(0).randn(batch, 1, kv * n_rep, d), jnp.float32)
            k_new = v_new = jnp.ones((batch, 1, kv, d), jnp.float32)
            fc = bench.random_cache("full", cfg, batch, tokens, ctx)
            fk, fv = fc.k[0], fc.v[0]
            length = fc.length
            fns = {}
            for ring in rings:
                fns.update(kivi_fns(RING_SPECS[ring], cfg, batch, tokens, ctx, k_new, v_new))
            fns.update({
                "full_native": (jax.jit(lambda q: native.decode_full(q, fk, fv, None, length, k_new, v_new, None)),
                                full_decode.bytes_read(batch, kv, ctx, d, 4)),
                "full_xla": (jax.jit(lambda q: attention.decode_full_xla(q, fk, fv, None, length, k_new, v_new, None)),
                             full_decode.bytes_read(batch, kv, ctx, d, 4)),
            })
            for name, (fn, nbytes) in fns.items():
                ms = median_ms(lambda: fn(q).block_until_ready(), args.repeats)
                row = {"impl": name, "context": ctx, "batch": batch, "ms_median": ms, "bytes": nbytes,
                       "gbps": nbytes / (ms / 1e3) / 1e9}
                row["of_stream_read_2t"] = row["gbps"] / result["stream"]["read_2t_gbps"]
                result["rows"].append(row)
                print(f"{name:>25s} ctx {ctx:6d} batch {batch:2d}: {ms:8.2f} ms, {nbytes / 2**20:8.1f} MiB, "
                      f"{row['gbps']:6.2f} GB/s ({100 * row['of_stream_read_2t']:.0f}% of the 2-thread read stream)",
                      flush=True)
            del fns, fc
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result["stream"]))
    print(f"load average {load_before:.2f} before, {result['load_after']:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
