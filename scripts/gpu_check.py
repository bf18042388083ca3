"""GPU check of the decode kernels: correctness of the shipped configurations against the jnp twins (the Triton
kernel: 3-bit ones with the group size cycled, the kivi2+/kivi3+-like ones with pre-RoPE keys and sinks; the Mosaic
GPU kernel on Hopper and newer: a covering set), then timing of KIVI decode through the Triton kernel, the Mosaic
GPU kernel and the XLA path (kivi2, kivi4, and through Triton the preset-like configurations) side by side against
two fp16 baselines (the full-precision Pallas kernel and jax.nn.dot_product_attention), with the bandwidth each
achieves on the bytes it must read.

On a GPU machine, from the checkout (no install needed; imports only jax, numpy and pallas_kernels):
    bash scripts/gpu_check.sh [--json PATH]            # = PYTHONPATH=. python3 scripts/gpu_check.py
`--smoke` runs tiny shapes with the kernels in interpret mode (CPU is fine): it proves the script runs (the Mosaic
GPU kernel has no interpret mode: its rows are listed as skipped). The XLA path rows need the checkout's kivi_jax to
import (flax and the rest of its dependencies); without them they are listed as skipped.

Timing: one decode step over one layer, every sequence holding `tokens - 1` tokens plus the new one; warm-up, then
the median of `--repeats` runs of `--inner` back-to-back calls, synchronised with block_until_ready. A configuration
whose inputs would take more than MEMORY_FRACTION of the device's memory is skipped and listed; so is anything left
when the time budget runs out (`--budget-s`, counted from the start: the whole run stays under 5 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import full_decode, kivi_decode, kivi_decode_mosaic  # the checkout's folder: jax and numpy only

MODELS = {  # kv heads, query heads, head_dim
    "llama2-7b": (32, 32, 128),
    "smollm2-135m": (3, 9, 64),
}
SMOKE_MODELS = {"tiny-gqa": (2, 6, 64)}
# k_bits, v_bits, group size, pre-RoPE keys, sink tokens; residual 128. The "+like" rows stand for the kivi2+ and
# kivi3+ presets (3-bit codes, keys stored before RoPE and rotated in the kernel, full-precision sinks).
TIMED_KIVI = {"kivi2": (2, 2, 32, False, 0), "kivi4": (4, 4, 32, False, 0), "kivi2+like": (3, 2, 64, True, 4),
              "kivi3+like": (4, 3, 64, True, 4)}
SMOKE_TIMED = ("kivi2", "kivi4")  # --smoke times these (interpret mode compiles slowly; its correctness row runs
# a preset-like configuration)
# How a KIVI configuration is timed: the Triton kernel, the Mosaic GPU kernel (where it serves the configuration),
# the XLA path (kivi_jax.attention.decode_kivi_xla, where kivi_jax imports). Most telling first: the time budget may
# cut the tail.
IMPLS = ("triton", "mosaic", "xla")
TIMED_IMPLS = {"kivi2": IMPLS, "kivi4": IMPLS, "kivi2+like": ("triton",), "kivi3+like": ("triton",)}
# the Mosaic GPU kernel's covering set (its lowering takes seconds a configuration): every bits pair and (G, D)
MOSAIC_CHECKED = [(2, 4, 32, 64, False), (4, 2, 64, 128, True), (2, 2, 128, 128, False), (4, 4, 64, 64, True),
                  (2, 2, 32, 128, True)]
RESIDUAL = 128
MEMORY_FRACTION = 0.4
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600}  # HBM/GDDR, by device-kind substring
SMOKE_COMPILE = {"xla_backend_optimization_level": 0}  # --smoke on CPU: compiling dominates, not running
SHIPPED = [(kb, vb, g, d) for kb in (2, 4) for vb in (2, 4) for d in (64, 128) for g in (32, 64, 128) if g <= d]
# with 3-bit codes: every bits pair with a 3 at both head dims, the group size cycled (tests/test_pallas_lowering.py
# lowers them all)
SHIPPED += [(kb, vb, (32, 64, 128)[i % 3] if d == 128 else (32, 64)[i % 2], d)
            for i, (kb, vb) in enumerate([(3, 2), (3, 3), (3, 4), (2, 3), (4, 3)]) for d in (64, 128)]
# (k_bits, v_bits, group, head_dim, sinks) checked with pre-RoPE keys: the preset-like configurations
PRE_ROPE = [(3, 2, 64, 64, 4), (3, 2, 64, 128, 4), (4, 3, 64, 64, 4), (4, 3, 64, 128, 4), (2, 2, 32, 64, 5)]


# ---------------------------------------------------------------------------------------------------------------------
# Inputs


HOST_LIMIT = 16 << 20  # arrays up to this size are drawn on the host in full


def filled(seed: int, shape, dtype, low=None, high=None):
    """A device array of `shape`: drawn in full on the host when small, else a random block of 4096 token rows
    (axis -2) tiled on the device, so that no float32 copy of a large array is ever built."""
    dtype = jnp.dtype(dtype)
    small = math.prod(shape) * dtype.itemsize <= HOST_LIMIT
    rows = min(shape[-2], 4096)
    rng = np.random.default_rng(seed)
    block_shape = shape if small else (rows, shape[-1])
    if jnp.issubdtype(dtype, jnp.integer):
        block = rng.integers(low or 0, high or 256, block_shape)
    elif low is not None:
        block = rng.uniform(low, high, block_shape)
    else:
        block = rng.standard_normal(block_shape, np.float32)
    block = jax.device_put(block.astype(dtype))
    if small:
        return block
    return jax.jit(lambda b: jnp.broadcast_to(jnp.tile(b, (shape[-2] // rows, 1)), shape))(block)


def kivi_inputs(seed, batch, kv_heads, q_heads, head_dim, tokens, k_bits, v_bits, group, dtype, pre_rope=False,
                sinks=0):
    """Random KIVI cache arrays (one layer) and the new token: the kernel's arguments after q; and the keyword
    arguments of a pre-RoPE cache (`inv_freq`) with sinks (`k_sink`, `v_sink`)."""
    lead = (batch, kv_heads)
    shapes = [
        (lead + (tokens, head_dim * k_bits // 8), jnp.uint8, None, None),
        (lead + (tokens // group, head_dim), jnp.float16, 0.05, 1.0),
        (lead + (tokens // group, head_dim), jnp.float16, -2.0, 0.0),
        (lead + (tokens, head_dim * v_bits // 8), jnp.uint8, None, None),
        (lead + (tokens, head_dim // group), jnp.float16, 0.02, 0.4),
        (lead + (tokens, head_dim // group), jnp.float16, -1.0, 0.0),
        (lead + (RESIDUAL, head_dim), dtype, None, None),
        (lead + (RESIDUAL, head_dim), dtype, None, None),
    ]
    cache = tuple(filled(seed * 100 + i, *spec) for i, spec in enumerate(shapes))
    q = filled(seed * 100 + 50, (batch, 1, q_heads, head_dim), dtype)
    new = [filled(seed * 100 + 51 + i, (batch, 1, kv_heads, head_dim), dtype) for i in range(2)]
    extra = {}
    if pre_rope:
        extra["inv_freq"] = 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if sinks:
        extra.update(k_sink=filled(seed * 100 + 60, lead + (sinks, head_dim), dtype),
                     v_sink=filled(seed * 100 + 61, lead + (sinks, head_dim), dtype))
    return q, cache, new, extra


def full_inputs(seed, batch, kv_heads, q_heads, head_dim, tokens, dtype, layout="bhtd"):
    """A random full-precision cache (one layer, `[batch, kv_heads, tokens, D]` or `[batch, tokens, kv_heads, D]`)."""
    shape = (batch, kv_heads, tokens, head_dim) if layout == "bhtd" else (batch, tokens, kv_heads, head_dim)
    k, v = filled(seed * 100, shape, dtype), filled(seed * 100 + 1, shape, dtype)
    q = filled(seed * 100 + 2, (batch, 1, q_heads, head_dim), dtype)
    new = [filled(seed * 100 + 3 + i, (batch, 1, kv_heads, head_dim), dtype) for i in range(2)]
    return q, k, v, new


# ---------------------------------------------------------------------------------------------------------------------
# Correctness


def compiled(fn, args, smoke: bool):
    """`fn` compiled for `args` (cheaply optimized in the smoke run)."""
    return jax.jit(fn).lower(*args).compile(SMOKE_COMPILE if smoke else None)


def error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def compare(kernel: str, config: str, dtype: str, window, run) -> dict:
    """One correctness row: `run()` gives (kernel output, twin output); an exception is a failed row, not a crash."""
    tol = {"float32": 1e-4, "bfloat16": 2e-2}[dtype]
    row = dict(kernel=kernel, config=config, dtype=dtype, window=window, tol=tol)
    try:
        out, ref = run()
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        return dict(row, max_err=err, ok=bool(err <= tol))
    except Exception as e:
        return dict(row, max_err=None, ok=False, error=error_text(e))


def check_correctness(smoke: bool, interpret: bool) -> list[dict]:
    """Every shipped KIVI configuration (bfloat16; a few in float32 and with a sliding window), the preset-like ones
    with pre-RoPE keys and sinks (bfloat16 and float32, with and without a window), the full kernel and the
    dot_product_attention baseline, on random inputs with ragged lengths, against the jnp twins."""
    batch, kv_heads, q_heads, tokens = 3, 2, 6, (512 if smoke else 1024)
    length = jnp.array([tokens - 1, 300, 3], jnp.int32)  # the last one shorter than the sinks
    cases = [(c + (False, 0), "bfloat16", None) for c in SHIPPED]
    cases += [(c + (False, 0), "float32", None) for c in SHIPPED[::5]]
    cases += [(SHIPPED[0] + (False, 0), "bfloat16", 200), (SHIPPED[-1] + (False, 0), "float32", 90)]
    cases += [((kb, vb, g, d, True, s), dtype, window) for kb, vb, g, d, s in PRE_ROPE
              for dtype, window in (("bfloat16", None), ("float32", 200))]
    if smoke:
        cases = [(SHIPPED[0] + (False, 0), "bfloat16", 200), ((3, 2, 64, 64, True, 4), "float32", 200)]
    rows = []
    for (kb, vb, g, d, pre_rope, sinks), dtype, window in cases:

        def run():
            q, cache, (k_new, v_new), extra = kivi_inputs(kb * 1000 + vb * 100 + g + d, batch, kv_heads, q_heads, d,
                                                          tokens, kb, vb, g, jnp.dtype(dtype), pre_rope, sinks)
            kw = dict(k_bits=kb, v_bits=vb, group_size=g, window=window)
            args = (q, *cache, None, length, k_new, v_new)
            return (compiled(lambda a, e: kivi_decode.decode(*a, **kw, **e, interpret=interpret), (args, extra),
                             smoke)(args, extra),
                    compiled(lambda a, e: kivi_decode.reference(*a, **kw, **e), (args, extra), smoke)(args, extra))

        name = f"k{kb}v{vb}-g{g}-d{d}" + (f"-prerope-s{sinks}" if pre_rope else "")
        rows.append(compare("kivi", name, dtype, window, run))
    mosaic_cases = [] if mosaic_unavailable(smoke) else [
        ((kb, vb, g, d, pre_rope, 4 if pre_rope else 0), dtype, window) for kb, vb, g, d, pre_rope in MOSAIC_CHECKED
        for dtype, window in (("bfloat16", None), ("float32", 200))]
    for (kb, vb, g, d, pre_rope, sinks), dtype, window in mosaic_cases:

        def run():
            q, cache, (k_new, v_new), extra = kivi_inputs(kb * 1000 + vb * 100 + g + d, batch, kv_heads, q_heads, d,
                                                          tokens, kb, vb, g, jnp.dtype(dtype), pre_rope, sinks)
            kw = dict(k_bits=kb, v_bits=vb, group_size=g, window=window)
            args = (q, *cache, None, length, k_new, v_new)
            return (compiled(lambda a, e: kivi_decode_mosaic.decode(*a, **kw, **e), (args, extra), smoke)(args, extra),
                    compiled(lambda a, e: kivi_decode.reference(*a, **kw, **e), (args, extra), smoke)(args, extra))

        name = f"k{kb}v{vb}-g{g}-d{d}" + (f"-prerope-s{sinks}" if pre_rope else "")
        rows.append(compare("mosaic", name, dtype, window, run))
    full_cases = ((64, "bfloat16", None), (128, "bfloat16", 300), (128, "float32", None))
    for d, dtype, window in full_cases[1:2] if smoke else full_cases:

        def run():
            q, k, v, (k_new, v_new) = full_inputs(d, batch, kv_heads, q_heads, d, tokens, jnp.dtype(dtype))
            args = (q, k, v, None, length, k_new, v_new)
            return (compiled(lambda *a: full_decode.decode(*a, window, interpret=interpret), args, smoke)(*args),
                    compiled(lambda *a: full_decode.reference(*a, window), args, smoke)(*args))

        rows.append(compare("full", f"d{d}", dtype, window, run))

    def run_sdpa():  # dot_product_attention over the same cache with the new token written at position `length`
        q, k, v, (k_new, v_new) = full_inputs(7, batch, kv_heads, q_heads, 128, tokens, jnp.bfloat16)
        ref = jax.jit(full_decode.reference)(q, k, v, None, length, k_new, v_new)
        at = jnp.arange(tokens)[None, None, :, None] == length[:, None, None, None]
        k1, v1 = jnp.where(at, k_new[:, 0, :, None], k), jnp.where(at, v_new[:, 0, :, None], v)
        return jax.jit(full_decode.sdpa_decode)(q, jnp.swapaxes(k1, 1, 2), jnp.swapaxes(v1, 1, 2), length + 1), ref

    rows.append(compare("sdpa", "d128", "bfloat16", None, run_sdpa))
    return rows


def mosaic_unavailable(smoke: bool) -> str | None:
    """Why the Mosaic GPU kernel cannot run here (it has no interpret mode; it needs Hopper or newer and jax 0.11),
    or None."""
    if smoke or jax.default_backend() != "gpu":
        return "the Mosaic GPU kernel needs a GPU (no interpret mode)"
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if float(capability) < 9.0:
        return f"the Mosaic GPU kernel needs compute capability 9.0 or newer, not {capability}"
    return kivi_decode_mosaic.unsupported(64, 2, 2, 32, RESIDUAL)


def xla_path():
    """(kivi_jax's `decode_kivi_xla`, its `QuantStore`) from the checkout, or (None, why not): kivi_jax needs flax and
    the rest of its dependencies, which this script otherwise does not."""
    try:
        from kivi_jax.attention import decode_kivi_xla
        from kivi_jax.cache import QuantStore
    except Exception as e:  # a missing dependency: the XLA rows are skipped, the rest runs
        return None, error_text(e)
    return (decode_kivi_xla, QuantStore), None


# ---------------------------------------------------------------------------------------------------------------------
# Timing


def median_seconds(fn, args, warmup: int, repeats: int, inner: int, smoke: bool = False) -> tuple[float, float]:
    """(median seconds a call, compile seconds) of `fn(*args)`, device-synchronised."""
    t0 = time.perf_counter()
    call = compiled(fn, args, smoke)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(call(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            out = call(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times), compile_s


def stream_gbps(nbytes: int, repeats: int) -> float:
    """Measured device bandwidth of a read-and-write pass over `nbytes` (a ceiling the kernels can be held to)."""
    x = filled(0, (nbytes // 2 // 4096, 4096), jnp.float16)
    seconds, _ = median_seconds(lambda x: x * 2, (x,), 2, repeats, 5)
    return 2 * x.nbytes / seconds / 1e9


def device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 8 << 30))


def time_method(kind, seed, batch, kv_heads, q_heads, head_dim, tokens, dtype, args, interpret):
    """(median seconds, compile seconds) of one method at one point; its inputs are freed on return."""
    length = jnp.full((batch,), tokens - 1, jnp.int32)  # every sequence full: tokens - 1 cached plus the new one
    if kind == "full":
        q, k, v, (k_new, v_new) = full_inputs(seed, batch, kv_heads, q_heads, head_dim, tokens, dtype)
        fn = lambda q, k, v, l, kn, vn: full_decode.decode(q, k, v, None, l, kn, vn, None, interpret=interpret)
        call = (q, k, v, length, k_new, v_new)
    elif kind == "sdpa":
        q, k, v, _ = full_inputs(seed, batch, kv_heads, q_heads, head_dim, tokens, dtype, "bthd")
        fn, call = full_decode.sdpa_decode, (q, k, v, length + 1)
    else:
        name, impl = kind
        kb, vb, g, pre_rope, sinks = TIMED_KIVI[name]
        q, cache, (k_new, v_new), extra = kivi_inputs(seed, batch, kv_heads, q_heads, head_dim, tokens, kb, vb, g,
                                                      dtype, pre_rope, sinks)
        kw = dict(k_bits=kb, v_bits=vb, group_size=g)
        if impl == "triton":
            fn = lambda q, c, l, kn, vn, e: kivi_decode.decode(q, *c, None, l, kn, vn, **kw, **e, interpret=interpret)
        elif impl == "mosaic":
            fn = lambda q, c, l, kn, vn, e: kivi_decode_mosaic.decode(q, *c, None, l, kn, vn, **kw, **e)
        else:  # the XLA path over the same arrays (kivi2/kivi4: no sinks, keys after RoPE)
            (decode_xla, store), _ = xla_path()
            fn = lambda q, c, l, kn, vn, e: decode_xla(
                q, store(codes=c[0], scale=c[1], mn=c[2], bits=kb, group_size=g, axis="channel"),
                store(codes=c[3], scale=c[4], mn=c[5], bits=vb, group_size=g, axis="token"), None, c[6], c[7], l, kn,
                vn, None)
        call = (q, cache, length, k_new, v_new, extra)
    return median_seconds(fn, call, args.warmup, args.repeats, args.inner, args.smoke)


def timing(args, interpret: bool, deadline: float) -> tuple[list[dict], list[str]]:
    models = SMOKE_MODELS if args.smoke else MODELS
    lengths = (256,) if args.smoke else (32768, 4096)
    batches = (2,) if args.smoke else (8, 32, 1)
    dtype = jnp.dtype(args.dtype)
    budget = MEMORY_FRACTION * device_memory()
    rows, skipped = [], []
    unavailable = {"mosaic": mosaic_unavailable(args.smoke), "xla": xla_path()[1]}
    for impl, why in unavailable.items():
        if why:
            skipped.append(f"every {impl} row: {why}")
    for tokens in lengths:  # longest first: if the time budget runs out, the short caches are what is left
        for batch in batches:
            for model, (kv_heads, q_heads, head_dim) in models.items():
                point = dict(model=model, tokens=tokens, batch=batch)
                full_bytes = full_decode.bytes_read(batch, kv_heads, tokens, head_dim, dtype.itemsize)
                key = tokens + batch
                base = {}
                methods = [("pallas-fp16", "full"), ("sdpa-fp16", "sdpa")]
                methods += [(f"{n}-{impl}", (n, impl)) for n in TIMED_KIVI if n in SMOKE_TIMED or not args.smoke
                            for impl in TIMED_IMPLS[n] if not unavailable.get(impl)]
                for name, kind in methods:
                    label = f"{model} tokens={tokens} batch={batch} {name}"
                    if kind in ("full", "sdpa"):
                        need, read = full_bytes, full_bytes
                    else:
                        kb, vb, g, _, sinks = TIMED_KIVI[kind[0]]
                        need = tokens * batch * kv_heads * head_dim * (kb + vb) // 8 * 2  # codes + scales, generous
                        read = kivi_decode.bytes_read(batch, kv_heads, tokens, head_dim, kb, vb, g, RESIDUAL,
                                                      dtype.itemsize, sinks=sinks)
                    if need > budget:
                        skipped.append(f"{label}: needs {need / 2**30:.1f} GiB, over {MEMORY_FRACTION:.0%} of the "
                                       f"device's {device_memory() / 2**30:.0f} GiB")
                        continue
                    if time.perf_counter() > deadline:
                        skipped.append(f"{label}: time budget spent")
                        continue
                    try:
                        seconds, compile_s = time_method(kind, key, batch, kv_heads, q_heads, head_dim, tokens,
                                                         dtype, args, interpret)
                    except Exception as e:  # e.g. out of memory, or a compile failure: report it, go on
                        skipped.append(f"{label}: failed: {error_text(e)}")
                        continue
                    row = dict(point, method=name, ms=seconds * 1e3, compile_s=compile_s, gb_read=read / 1e9,
                               gbps=read / seconds / 1e9)
                    if kind in ("full", "sdpa"):
                        base[kind] = seconds
                    else:
                        row["speedup_vs_pallas_fp16"] = base["full"] / seconds if "full" in base else None
                        row["speedup_vs_sdpa_fp16"] = base["sdpa"] / seconds if "sdpa" in base else None
                    rows.append(row)
    return rows, skipped


# ---------------------------------------------------------------------------------------------------------------------
# Report


def peak_for(kind: str, override: float | None) -> float | None:
    if override:
        return override
    for name, gbps in PEAK_GBPS.items():
        if name.lower() in kind.lower():
            return gbps
    return None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_report(report: dict) -> None:
    print(f"device: {report['device']}  jax {report['jax']}  {report['date']}  interpret={report['interpret']}")
    print(f"peak bandwidth: {fmt(report['peak_gbps'], '.0f')} GB/s (spec), measured stream "
          f"{report['stream_gbps']:.0f} GB/s")
    print("\ncorrectness against the jnp twins")
    print(f"{'kernel':6} {'config':26} {'dtype':9} {'window':>6} {'max err':>10} {'tol':>7}  ok")
    for r in report["correctness"]:
        print(f"{r['kernel']:6} {r['config']:26} {r['dtype']:9} {fmt(r['window'], 'd'):>6} "
              f"{fmt(r['max_err'], '10.2e'):>10} {r['tol']:7.0e}  {'yes' if r['ok'] else 'NO'} {r.get('error', '')}")
    print("\ndecode attention, one layer (median ms a call; GB/s on the bytes each must read)")
    head = (f"{'model':13} {'tokens':>6} {'batch':>5} {'method':17} {'ms':>9} {'GB':>7} {'GB/s':>7} {'%peak':>6} "
            f"{'%stream':>7} {'x pallas':>8} {'x sdpa':>7}")
    print(head)
    for r in report["timing"]:
        peak = report["peak_gbps"]
        print(f"{r['model']:13} {r['tokens']:>6} {r['batch']:>5} {r['method']:17} {r['ms']:9.3f} {r['gb_read']:7.3f} "
              f"{r['gbps']:7.0f} {fmt(100 * r['gbps'] / peak if peak else None, '6.1f'):>6} "
              f"{100 * r['gbps'] / report['stream_gbps']:7.1f} {fmt(r.get('speedup_vs_pallas_fp16'), '8.2f'):>8} "
              f"{fmt(r.get('speedup_vs_sdpa_fp16'), '7.2f'):>7}")
    for s in report["skipped"]:
        print(f"skipped: {s}")
    print(f"\n{report['elapsed_s']:.0f} s; JSON: {report['json']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out_dir = os.environ.get("OUT") or "/tmp"
    p.add_argument("--json", default=os.path.join(out_dir, "gpu_check.json"), help="where to write the results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode (runs on CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="compute dtype of the timing")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=5, help="back-to-back calls a timed repeat")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="start no timing after this many seconds from the start (the run stays under 5 minutes)")
    p.add_argument("--peak-gbps", type=float, default=None, help="the device's peak bandwidth (default: by name)")
    p.add_argument("--skip-correctness", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.repeats, args.inner = 1, 2, 1
    start = time.perf_counter()
    interpret = args.smoke or jax.default_backend() != "gpu"
    if not args.smoke and jax.default_backend() != "gpu":
        print("no GPU backend: use --smoke for the CPU run", file=sys.stderr)
        return 2
    device = jax.devices()[0]
    correctness = [] if args.skip_correctness else check_correctness(args.smoke, interpret)
    stream = stream_gbps((8 << 20) if args.smoke else (4 << 30), 2 if args.smoke else 5)
    rows, skipped = timing(args, interpret, start + args.budget_s)
    report = dict(
        device=getattr(device, "device_kind", str(device)), platform=device.platform, jax=jax.__version__,
        python=sys.version.split()[0], date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        interpret=interpret, smoke=args.smoke, dtype=args.dtype, residual=RESIDUAL,
        peak_gbps=peak_for(getattr(device, "device_kind", ""), args.peak_gbps), stream_gbps=stream,
        correctness=correctness, timing=rows, skipped=skipped, elapsed_s=time.perf_counter() - start, json=args.json,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print_report(report)
    return 0 if all(r["ok"] for r in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
