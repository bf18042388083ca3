"""A prompt's prefill with the projections in the native kernels' packed strips (float32 weights, or the GGUF's own
blocks with `--weights auto`) against XLA's dot (`--against xla`), or against the native kernel on int8 activations
(`--against int8`: `weights.dot_view(params, "int8")`, quantized weights only), in one process, the two
interleaved (docs/kernels.md "Float weights", "Quantized weights"; docs/serving.md "Run 23", "An int8 prefill"):
each round prefills new random tokens both ways (chunks of 512) onto a fresh cache; the first round compiles and is
not counted. Prints JSON (each counted round's milliseconds, the medians' ratio, prompt tokens/s, the largest logit
difference).

    PYTHONPATH=. python scripts/bench_prefill_matmul.py --tokens 512,1024 --cache kivi2 --weights float32
    PYTHONPATH=. python scripts/bench_prefill_matmul.py --tokens 512,1536 --weights auto --against int8
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import kivi_jax
from kivi_jax import runtime, weights
from kivi_jax.cache import make_cache
from kivi_jax.models.decoder import forward


@functools.partial(jax.jit, static_argnames=("arm",), donate_argnames=("cache",))
def chunk(params, tokens, num_new, cache, arm: str):
    """One chunk onto the cache -> (logits after its last token, cache), the projections native ('native'), native
    on int8 activations ('int8') or XLA's ('xla')."""
    if arm == "xla":
        view = weights.with_impl(params, "xla")
    else:
        view = weights.native_view(weights.dot_view(params, "int8") if arm == "int8" else params)
    logits, cache = forward(view, tokens, cache, num_new=num_new, logits_at=num_new - 1)
    return logits[:, 0], cache


def prefill(params, ids: np.ndarray, spec: str, arm: str):
    """Seconds to prefill `ids [batch, n]` onto a fresh cache, and the last chunk's logits."""
    batch, n = ids.shape
    cache = jax.device_put(make_cache(spec, params.config, batch, max(2048, n), jnp.float32), jax.devices()[0])
    start = time.perf_counter()
    for s in range(0, n, runtime.PREFILL_CHUNK):
        w = min(runtime.PREFILL_CHUNK, n - s)
        last, cache = chunk(params, jnp.asarray(ids[:, s : s + w]), jnp.full((batch,), w, jnp.int32), cache, arm)
    last.block_until_ready()
    return time.perf_counter() - start, last


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,1024", help="comma-separated prompt lengths")
    p.add_argument("--cache", default="kivi2")
    p.add_argument("--rounds", type=int, default=6, help="rounds a length, the first compiling")
    p.add_argument("--weights", default="float32", help="float32, or auto (the GGUF's own blocks)")
    p.add_argument("--against", default="xla", choices=("xla", "int8"), help="the second arm: XLA's dot (default) or "
                   "the native kernel on int8 activations (quantized weights; AVX512-VNNI)")
    args = p.parse_args()
    params = kivi_jax.load("smollm2", weights=args.weights, progress=False).params
    other = args.against
    rng = np.random.default_rng(0)
    rows = []
    for n in map(int, args.tokens.split(",")):
        ms = {"native": [], other: []}
        diff = 0.0
        for r in range(args.rounds):
            ids = rng.integers(100, 40000, (1, n)).astype(np.int32)
            last = {}
            for arm in ("native", other) if r % 2 else (other, "native"):
                t, last[arm] = prefill(params, ids, args.cache, arm)
                if r:
                    ms[arm].append(round(1000 * t))
            diff = max(diff, float(jnp.max(jnp.abs(last["native"] - last[other]))))
        med = {k: float(np.median(v)) for k, v in ms.items()}
        rows.append({"tokens": n, "cache": args.cache, "weights": args.weights,
                     "native_ms": ms["native"], f"{other}_ms": ms[other],
                     "ratio_of_medians": round(med["native"] / med[other], 3),
                     "native_tokens_per_s": round(1000 * n / med["native"]),
                     f"{other}_tokens_per_s": round(1000 * n / med[other]),
                     "max_logit_difference": diff})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
