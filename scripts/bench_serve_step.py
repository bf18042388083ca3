"""Where a serving decode step's time goes, at several live-sequence counts: weights, attention, sampling, host.

    python scripts/bench_serve_step.py --cache kivi2 --live 1,8,32,64 --context 512 --json docs/bench/serve_step.json

For each count L an engine of L slots in one decode group (one step computes exactly the L live rows) is filled with
L prompts of `--context` tokens (batched prefill), then, each the median of `--steps` repeats:
- `step`: `Engine.step()` as the scheduler calls it (host arrays in, tokens back on the host);
- `device`: the jitted decode call alone (`runtime.decode_step`, inputs already on the device, blocked on);
- `weights`: the model's forward over one token a row without a cache (`forward(params, tokens [L, 1])`): the
  projections, MLP, norms and the LM head, with attention over the one new token only;
- `sampling`: the per-row choice (`runtime.choose`, greedy rows) over logits `[L, vocab]`;
- `attention` = device - weights - sampling (the cache's attention over `--context` tokens and its commit);
- `host` = step - device (building the inputs, the call's dispatch, reading the tokens).
With `--against int8`: also the jitted decode call with the params seen at that decode precision
(`weights.dot_view(params, "int8", "decode")`, `serve --decode-precision int8`), timed alternately with the float32
call in the same process (`device_int8_ms`, and the ratio to the float32 call's median of the same rounds).
With `--slots S`: also the whole step of an engine of S slots holding L live sequences, in one bucketed group (only
the live rows computed, padded to a power of two), in bucketed groups of 16, and in unbucketed groups of 16
(`Engine(buckets=False)`, what a CPU server ran before buckets), each the median of `--steps`.
Beside them: XLA:CPU's dot rate at the step's shapes (`[L, hidden] x [hidden, intermediate]`), a large square
matmul's rate (the machine's attainable FLOP rate) and a copy's bandwidth (numpy, 512 MiB). The process keeps the
memory it frees once the model is loaded, as the server does (`KIVI_JAX_KEEP_FREED_MEMORY=0`: it does not).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def median_time(fn, repeats: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dot_rate(rows: int, k: int, n: int, repeats: int) -> float:
    """GFLOP/s of a jitted float32 `[rows, k] x [k, n]`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((rows, k), jnp.float32)
    w = jnp.ones((k, n), jnp.float32) / k
    f = jax.jit(lambda x, w: x @ w)
    t = median_time(lambda: f(x, w).block_until_ready(), repeats)
    return 2 * rows * k * n / t / 1e9


def fill(eng, prompts: list[list[int]]) -> None:
    """Admits the prompts (greedy) into the engine's slots through its batched prefill."""
    from kivi_jax.serve.engine import Waiting
    from kivi_jax.sampling import Sampling

    room = eng.prefill_room(eng.prefill_shape(prompts[0]))
    for i in range(0, len(prompts), room):
        job = eng.start_prefill([Waiting(q, [Sampling(0.0)]) for q in prompts[i : i + room]])
        while eng.advance(job) is None:
            pass


def copy_bandwidth() -> float:
    """GB/s (read + write) of a numpy copy of 512 MiB."""
    import numpy as np

    a = np.ones(2**27, np.float32)
    b = np.empty_like(a)
    t = median_time(lambda: np.copyto(b, a), 5)
    return 2 * a.nbytes / t / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="float32")
    p.add_argument("--dtype", default=None, help="compute dtype (bfloat16 weights under float32: --dtype float32)")
    p.add_argument("--cache", default="kivi2")
    p.add_argument("--live", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512, help="prompt tokens a sequence holds (default 512)")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--slots", type=int, default=0, help="also time an engine of this many slots (0: not)")
    p.add_argument("--against", default=None, choices=("int8",),
                   help="also time the decode call at this decode precision, alternating with float32's")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kivi_jax
    from kivi_jax.models.decoder import forward
    from kivi_jax import allocator, runtime, weights
    from kivi_jax.serve import engine as E
    from kivi_jax.sampling import Sampling, row_settings

    model = kivi_jax.load(args.model, progress=False, weights=args.weights, dtype=args.dtype)
    allocator.keep_freed_memory()  # as the server does once its model is loaded (kivi_jax/allocator.py)
    params, cfg = model.params, model.config
    rng = np.random.RandomState(0)
    weights_fn = jax.jit(forward)
    choose = jax.jit(runtime.choose)
    rows_out = []
    for live in [int(x) for x in args.live.split(",")]:
        max_length = -(-(args.context + 6 * args.steps + 12) // 256) * 256  # every call below adds a token a row
        eng = E.Engine(params, args.cache, slots=live, decode_group=live, max_length=max_length, prefix_reuse=False)
        fill(eng, [rng.randint(3, cfg.vocab_size, args.context).tolist() for _ in range(live)])
        step = median_time(eng.step, args.steps)

        # the decode call alone, as step_scored makes it (every row live and greedy)
        put = jnp.asarray
        zeros_i, zeros_b = put(np.zeros(live, np.int32)), put(np.zeros(live, bool))
        temperature, top_k, top_p = row_settings([Sampling(0.0)] * live)
        tokens = put(np.full(live, 5, np.int32))
        state = {"cache": eng.caches[0], "keys": eng.keys[0]}

        def device(step_params=eng.params):
            out, state["cache"] = runtime.decode_step(step_params, tokens, put(np.ones(live, bool)), state["cache"],
                                                      state["keys"], temperature, top_k, top_p, zeros_b, zeros_i,
                                                      zeros_b, eng.no_mask[0], zeros_b)
            state["keys"] = out.keys
            out.tokens.block_until_ready()

        dev = median_time(device, args.steps)
        against = {}
        if args.against:  # the two arms alternately, each round one call of each
            arms = {"float32": eng.params, args.against: weights.dot_view(eng.params, args.against, "decode")}
            times = {arm: [] for arm in arms}
            for p_arm in arms.values():
                device(p_arm)  # compile / warm
            for _ in range(args.steps):
                for arm, p_arm in arms.items():
                    t0 = time.perf_counter()
                    device(p_arm)
                    times[arm].append(time.perf_counter() - t0)
            alt = {arm: statistics.median(ts) for arm, ts in times.items()}
            against = {f"device_{args.against}_ms": round(alt[args.against] * 1e3, 2),
                       f"{args.against}_vs_float32": round(alt[args.against] / alt["float32"], 3)}
        one = put(np.full((live, 1), 5, np.int32))
        w = median_time(lambda: weights_fn(eng.params, one)[0].block_until_ready(), args.steps)
        logits = put(rng.randn(live, cfg.vocab_size).astype(np.float32))
        keys = put(np.zeros((live, 2), np.uint32))
        s = median_time(lambda: choose(logits, keys, temperature, top_k, top_p, zeros_b, zeros_i, zeros_b,
                                       eng.no_mask[0], zeros_b).tokens.block_until_ready(), args.steps)
        rate = dot_rate(live, cfg.hidden_size, cfg.intermediate_size, args.steps)
        row = {"live": live, "context": args.context, "step_ms": round(step * 1e3, 2), "device_ms": round(dev * 1e3, 2),
               "weights_ms": round(w * 1e3, 2), "sampling_ms": round(s * 1e3, 2),
               "attention_ms": round((dev - w - s) * 1e3, 2), "host_ms": round((step - dev) * 1e3, 2),
               "tokens_per_s": round(live / step, 1), "mlp_dot_gflops": round(rate, 1), **against}
        rows_out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    engine_rows = []
    configs = {"one_group_bucketed": dict(), "groups_of_16_bucketed": dict(decode_group=16),
               "groups_of_16": dict(decode_group=16, buckets=False)}
    for live in [int(x) for x in args.live.split(",")] if args.slots else []:
        row = {"slots": args.slots, "live": live, "context": args.context}
        for key, options in configs.items():
            max_length = -(-(args.context + 4 * args.steps + 8) // 256) * 256
            eng = E.Engine(params, args.cache, slots=args.slots, max_length=max_length, prefix_reuse=False, **options)
            fill(eng, [rng.randint(3, cfg.vocab_size, args.context).tolist() for _ in range(live)])
            row[f"{key}_step_ms"] = round(median_time(eng.step, args.steps) * 1e3, 2)
        engine_rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    peak = dot_rate(1024, 1024, 1024, 5)
    bw = copy_bandwidth()
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
           "jax": jax.__version__, "model": args.model, "weights": args.weights, "dtype": args.dtype,
           "cache": args.cache, "against": args.against,
           "peak_matmul_gflops_1024": round(peak, 1), "copy_gb_per_s": round(bw, 2), "rows": rows_out,
           "engine": engine_rows}
    print("| live | step ms | device | weights | attention | sampling | host | tokens/s | MLP dot GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['live']} | {r['step_ms']} | {r['device_ms']} | {r['weights_ms']} | {r['attention_ms']} | "
              f"{r['sampling_ms']} | {r['host_ms']} | {r['tokens_per_s']} | {r['mlp_dot_gflops']} |")
    if engine_rows:
        print(f"| live | {' ms | '.join(configs)} ms |")
        print("|---:|" + "---:|" * len(configs))
        for r in engine_rows:
            print(f"| {r['live']} | " + " | ".join(str(r[f'{k}_step_ms']) for k in configs) + " |")
    print(f"1024^3 matmul: {peak:.1f} GFLOP/s; numpy copy: {bw:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
