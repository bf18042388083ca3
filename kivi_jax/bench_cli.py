"""`kivi-jax bench decode | memory | generate | serve`: run a benchmark, print a table (or one JSON object), write a plot."""

from __future__ import annotations

import argparse
import json
import sys

from kivi_jax.cli_args import (_dtype, add_impl_arg, add_weights_arg, int_list, integer, spec_list, text_table as _table,
                               writable_file)

MODEL_HELP = ("'smollm2' (the real model), 'llama2-7b' or 'llama3-8b' (synthetic weights with those models' shapes), "
              "or a path (HF directory, .gguf, kivi_jax checkpoint)")


def _log(line: str) -> None:
    """Progress lines go to stderr, so stdout holds only the table or the JSON object."""
    print(line, file=sys.stderr, flush=True)


def _common(p: argparse.ArgumentParser, dtype_default: str | None, dtype_help: str) -> None:
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--layers", type=integer(1), default=None, help="keep only the first N layers (so large shapes fit)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=dtype_default, help=dtype_help)
    add_weights_arg(p)
    add_impl_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE", type=writable_file, default=None, help="write a PNG plot of the results")


def add_bench_commands(sub) -> None:
    """The `decode`, `memory` and `generate` subcommands of `kivi-jax bench`."""
    from kivi_jax.cli_args import add_mesh_args
    d = sub.add_parser("decode", help="jit-compiled decode-step latency and tokens/s against the full-precision cache")
    _common(d, None, "compute dtype (default: as stored, float32; the full cache's element type)")
    d.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384], help="tokens in the cache (default 1024,4096,16384)")
    d.add_argument("--batch", type=int_list, default=[1, 8], help="batch sizes (default 1,8)")
    d.add_argument("--cache", type=spec_list, default=["full", "kivi2", "kivi4"],
                   help="cache specs (default full,kivi2,kivi4); 'spec@impl' gives one its own attention impl, e.g. "
                        "full@xla,full@native,kivi2@native (ratios against the first full one, and each in ratio_vs)")
    d.add_argument("--repeats", type=integer(1), default=10, help="timed steps per configuration (default 10)")
    d.add_argument("--warmup", type=integer(0), default=2, help="untimed steps after the compiling one (default 2)")
    add_mesh_args(d)
    d.set_defaults(func=cmd_decode)

    m = sub.add_parser("memory", help="cache bytes, the formula, decode temporaries and the largest batch in a budget")
    _common(m, "bfloat16", "compute dtype: the full cache's element type and the weights' (default bfloat16)")
    m.add_argument("--context", type=integer(1), default=4096, help="tokens per sequence (default 4096)")
    m.add_argument("--budget", default="24GiB", help="memory for the weights and the caches (default 24GiB; GB is 1e9, "
                                                     "GiB 2^30)")
    m.add_argument("--cache", type=spec_list, default=["full", "kivi2", "kivi4"], help="cache specs (default full,kivi2,kivi4)")
    m.add_argument("--no-temps", action="store_true", help="skip compiling the decode step (no temporary bytes)")
    m.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="also report bytes per device on a mesh of this shape, the budget then per device: the "
                        "largest batch and context (no devices needed; see docs/sharding.md)")
    m.set_defaults(func=cmd_memory)

    g = sub.add_parser("generate", help="end-to-end generation throughput (prefill + N new tokens) across batch sizes")
    _common(g, None, "compute dtype (default: as stored, float32)")
    g.add_argument("--batch", type=int_list, default=[1, 4, 16], help="batch sizes (default 1,4,16)")
    g.add_argument("--prompt-len", type=integer(1), default=256, help="prompt tokens per sequence (default 256)")
    g.add_argument("--new-tokens", type=integer(1), default=64, help="tokens generated per sequence (default 64)")
    g.add_argument("--cache", type=spec_list, default=["full", "kivi2", "kivi4"], help="cache specs (default full,kivi2,kivi4)")
    g.add_argument("--repeats", type=integer(1), default=3, help="timed runs per configuration (default 3)")
    add_mesh_args(g)
    g.set_defaults(func=cmd_generate)

    from kivi_jax.serve.loadtest import add_serve_bench

    add_serve_bench(sub)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _check_positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {v}")


def _check_batches(batches, mesh) -> None:
    """On a mesh every `--batch` must split over its data axis: checked before the model loads."""
    if mesh is None:
        return
    from kivi_jax import sharding

    data = sharding.mesh_sizes(mesh)["data"]
    bad = [b for b in batches if b % data]
    if bad:
        raise ValueError(f"--batch {','.join(map(str, bad))}: each batch must be a multiple of the mesh's data axis "
                         f"({data})")


def _header(args, params) -> dict:
    """What every timing result says about where and on what it ran."""
    from kivi_jax import bench, weights

    return {"device": bench.device_name(), "model": args.model, "layers": params.config.num_layers,
            "dtype": str(params.dtype), "weights": weights.summary(params), "weights_bytes": bench.tree_bytes(params)}


def cmd_decode(args) -> int:
    from kivi_jax import bench

    _check_positive(repeats=args.repeats, layers=args.layers)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, not {args.warmup}")
    from kivi_jax.cli_args import mesh_from_args

    mesh = mesh_from_args(args)
    _check_batches(args.batch, mesh)
    params = bench.load_model(args.model, _dtype(args.dtype), args.layers, weights=args.weights)
    rows = bench.bench_decode(params, args.contexts, args.batch, args.cache, args.attention_impl, args.repeats,
                              args.warmup, log=None if args.json else _log, mesh=mesh)
    out = {
        **_header(args, params),
        "mesh": args.mesh,
        "attention_impl": args.attention_impl,
        "repeats": args.repeats,
        "results": rows,
    }
    if args.plot:
        from kivi_jax.plots import plot_decode

        out["plot"] = plot_decode(rows, f"{args.model} ({params.config.num_layers} layers, {params.dtype}) decode step",
                                  args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"# decode step, {out['device']}, {args.model} ({out['layers']} layers, {out['dtype']})")
    print(_table(
        ["cache", "context", "batch", "median ms", "min ms", "max ms", "tokens/s", "ratio vs full"],
        [[r["cache"], r["context"], r["batch"], f"{r['step_ms_median']:.2f}", f"{r['step_ms_min']:.2f}",
          f"{r['step_ms_max']:.2f}", f"{r['tokens_per_s']:.1f}", _ratio(r["ratio_vs_full"])] for r in rows],
    ))
    if args.plot:
        print(f"plot: {out['plot']}")
    return 0


PLOT_BUDGETS = ("16GiB", "24GiB", "40GB", "80GB")
PLOT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def cmd_memory(args) -> int:
    from kivi_jax import bench

    import jax.numpy as jnp

    _check_positive(context=args.context, layers=args.layers)
    budget = bench.parse_bytes(args.budget)
    dtype = _dtype(args.dtype)
    params = bench.memory_params(args.model, dtype, args.layers, args.weights)
    cfg = params.config
    if args.mesh is not None:
        from kivi_jax import sharding

        sharding.parse_mesh_shape(args.mesh)  # a bad shape fails before any work
    table = bench.bench_memory(cfg, args.context, args.cache, dtype, budget, args.attention_impl, not args.no_temps,
                               mesh=args.mesh, params=params)
    results = table["results"]
    out = {
        "model": args.model,
        "layers": cfg.num_layers,
        "dtype": jnp.dtype(dtype).name,
        "context": args.context,
        "budget_bytes": budget,
        "weights": table["weights"],
        "weights_bytes": table["weights_bytes"],
        "mesh": args.mesh,
        "results": results,
    }
    if args.plot:
        from kivi_jax.plots import plot_memory

        curves = {
            name: [(c, bench.tree_bytes(bench.abstract_cache(spec, cfg, 1, bench.cache_tokens(c, 0, [spec]), dtype)))
                   for c in PLOT_CONTEXTS]
            for name, spec in zip(results, args.cache)
        }
        budgets = {}
        for label in dict.fromkeys(PLOT_BUDGETS + (args.budget,)):
            b = bench.parse_bytes(label)
            budgets[label] = {name: bench.max_batch(b, table["weights_bytes"], row["cache_bytes"])
                              for name, row in results.items()}
        title = f"{args.model} ({cfg.num_layers} layers, {out['dtype']}), max batch at {args.context} tokens"
        out["plot"] = plot_memory(curves, budgets, title, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    fb = bench.format_bytes
    print(f"# cache memory, {args.model} ({cfg.num_layers} layers, {out['dtype']}), {args.context} tokens a sequence, "
          f"budget {fb(budget)}, weights {out['weights']} {fb(out['weights_bytes'])}")
    header = ["cache", "bytes/seq", "formula", "bytes/token", "ratio vs full", "max batch"]
    if not args.no_temps:
        header += ["decode temp (batch 1)", "temp / full cache", "temp per extra seq", "max batch with temps"]
    rows = []
    for name, r in results.items():
        row = [name, fb(r["cache_bytes"]), "=" if r["formula_bytes"] == r["cache_bytes"] else fb(r["formula_bytes"]),
               f"{r['bytes_per_token']:.0f}", f"{r['ratio_vs_full']:.3f}", r["max_batch"]]
        if not args.no_temps:
            row += [fb(r["decode_temp_bytes"]), f"{r['decode_temp_ratio_vs_full_cache']:.3f}",
                    fb(r["decode_temp_per_seq_bytes"]), r["max_batch_with_temps"]]
        rows.append(row)
    print(_table(header, rows))
    print("max batch: weights + batch x cache within the budget; with temps: plus the compiled decode step's "
          "temporaries on this backend")
    if args.mesh is not None:
        first = next(iter(results.values()))["per_device"]
        print(f"\n# per device on mesh {first['mesh']} ({'heads split' if first['heads_split'] else 'heads replicated'}"
              f" on the model axis), budget {fb(budget)} per device, weights {fb(first['weights_bytes_per_device'])} "
              "per device")
        print(_table(["cache", "bytes/seq/device", "max batch", "max context (one seq per data shard)"],
                     [[name, fb(r["per_device"]["cache_bytes_per_device_per_seq"]), r["per_device"]["max_batch"],
                       r["per_device"]["max_context_one_seq_per_data_shard"]] for name, r in results.items()]))
        print("max context counts memory only (the model's own position limit is not applied)")
    if args.plot:
        print(f"plot: {out['plot']}")
    return 0


def cmd_generate(args) -> int:
    from kivi_jax import bench

    _check_positive(repeats=args.repeats, layers=args.layers, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    from kivi_jax.cli_args import mesh_from_args

    mesh = mesh_from_args(args)
    _check_batches(args.batch, mesh)
    params = bench.load_model(args.model, _dtype(args.dtype), args.layers, weights=args.weights)
    rows = bench.bench_generate(params, args.batch, args.cache, args.prompt_len, args.new_tokens, args.attention_impl,
                                args.repeats, log=None if args.json else _log, mesh=mesh)
    out = {
        **_header(args, params),
        "mesh": args.mesh,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "results": rows,
    }
    if args.plot:
        from kivi_jax.plots import plot_generate

        title = f"{args.model}: prefill {args.prompt_len} + {args.new_tokens} new tokens"
        out["plot"] = plot_generate(rows, title, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"# generation throughput, {out['device']}, {args.model} ({out['layers']} layers, {out['dtype']}), "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens")
    print(_table(
        ["cache", "batch", "median s", "min s", "new tokens/s", "ratio vs full"],
        [[r["cache"], r["batch"], f"{r['seconds_median']:.3f}", f"{r['seconds_min']:.3f}", f"{r['tokens_per_s']:.1f}",
          _ratio(r["ratio_vs_full"])] for r in rows],
    ))
    if args.plot:
        print(f"plot: {out['plot']}")
    return 0
