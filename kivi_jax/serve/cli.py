"""`kivi-jax serve`: the OpenAI-compatible server on one model and one cache kind."""

from __future__ import annotations

import argparse
import json
import sys


def add_serve_args(p: argparse.ArgumentParser, cache_default: str = "kivi2") -> None:
    """The model, cache and capacity flags (shared with `kivi-jax bench serve`, whose --cache is a list)."""
    from kivi_jax.cli import add_cache_args, add_mesh_args, add_model_args
    from kivi_jax.serve.engine import DEFAULT_PREFILL_CHUNK

    add_model_args(p)
    add_cache_args(p, cache_default)
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--slots", type=int, default=None, help="sequences decoded together (default 8)")
    cap.add_argument("--cache-budget", default=None,
                     help="bytes for the batch cache, e.g. 4GiB: the most slots of --max-length tokens that fit")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens a slot holds, prompt plus output (default 4096 or the model's positions)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"prompt tokens prefilled per step (default {DEFAULT_PREFILL_CHUNK}; one compilation each)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; past it: 503")
    p.add_argument("--decode-group", type=int, default=None,
                   help="decode the slots in groups of this many, skipping groups with no live request (default: "
                        "all slots in one step; on a compute-bound CPU, idle slots otherwise cost time)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="never reuse a finished request's cache for a prompt that extends it")
    add_mesh_args(p)  # with --mesh, --cache-budget is per device and slots a multiple of the data axis


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching over the cache",
                       description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
                                   "(docs/serving.md).")
    add_serve_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: --model)")
    p.set_defaults(func=cmd_serve)


def server_from_args(args, model_name: str | None = None, progress: bool = True):
    """Loads the model and builds the server the flags describe."""
    import kivi_jax
    from kivi_jax.bench import parse_bytes
    from kivi_jax.cli import _dtype, cache_from_args, mesh_from_args
    from kivi_jax.serve.server import build_server

    spec = cache_from_args(args)  # a bad spec fails before the model loads
    budget = None if args.cache_budget is None else parse_bytes(args.cache_budget)
    mesh = mesh_from_args(args)
    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=progress, mesh=mesh, weights=args.weights)
    return build_server(model, spec, slots=args.slots, cache_budget=budget, max_length=args.max_length,
                        prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
                        attention_impl=args.attention_impl, prefix_reuse=not args.no_prefix_reuse,
                        model_name=model_name or args.model, decode_group=args.decode_group, mesh=mesh)


def cmd_serve(args) -> int:
    import uvicorn

    server = server_from_args(args, args.served_model_name)
    print(f"kivi-jax serve: model {server.model_name!r}; {server.describe()}", file=sys.stderr, flush=True)
    print(json.dumps({"capacity": server.capacity}), file=sys.stderr)
    print(f"listening on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="info")
    return 0
