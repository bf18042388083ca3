"""`kivi-jax serve`: the OpenAI-compatible server on one model and one cache kind."""

from __future__ import annotations

import argparse
import json
import socket
import sys


def add_serve_args(p: argparse.ArgumentParser, cache_default: str = "kivi2") -> None:
    """The model, cache and capacity flags (shared with `kivi-jax bench serve`, whose --cache is a list)."""
    from kivi_jax.cli_args import add_cache_args, add_mesh_args, add_model_args
    from kivi_jax.cli_args import integer
    from kivi_jax.serve.engine import (CPU_PREFILL_TOKENS, DEFAULT_PREFILL_BATCH, DEFAULT_PREFILL_CHUNK, PACK_BUCKET,
                                       PACK_WIDTH, PREFILL_TOKENS)
    from kivi_jax.serve.scheduler import STEP_PREFILL_TOKENS
    from kivi_jax.weights import DECODE_CHOICES, PREFILL_CHOICES

    add_model_args(p)
    add_cache_args(p, cache_default)
    p.add_argument("--slots", type=integer(1), default=None,
                   help="sequences decoded together (default 8; with --paged and --cache-budget: as many rows as half "
                        "the budget holds)")
    p.add_argument("--cache-budget", default=None,
                   help="bytes for the batch cache, e.g. 4GiB: the most slots of --max-length tokens that fit (with "
                        "--paged: the rows and the pool of pages together)")
    p.add_argument("--paged", action="store_true",
                   help="a paged cache (docs/design.md §12): one pool of pages, a block table a sequence; a request "
                        "takes its prompt's pages and a page as it fills one (the newest request is preempted and "
                        "recomputed when the pool runs out), not a whole --max-length slot")
    p.add_argument("--reserve-pages", action="store_true",
                   help="with --paged: a request takes the pages of its prompt and max_tokens when it is admitted "
                        "(no preemption; requests wait longer)")
    p.add_argument("--prefix-snapshots", type=integer(0), default=0,
                   help="with --paged: keep the cache of this many prompt prefixes (at chunk ends: the ring as it "
                        "stood, the pages then final) so that a prompt starting with one shares its pages and computes "
                        "only the rest (docs/serving.md; each snapshot is a one-row cache outside --cache-budget; "
                        "default 0: none)")
    p.add_argument("--max-length", type=integer(2), default=None,
                   help="tokens a slot holds, prompt plus output (default 4096 or the model's positions)")
    p.add_argument("--prefill-chunk", type=integer(1), default=DEFAULT_PREFILL_CHUNK,
                   help=f"prompt tokens prefilled per step (default {DEFAULT_PREFILL_CHUNK}; one compilation each)")
    p.add_argument("--prefill-batch", type=integer(1), default=DEFAULT_PREFILL_BATCH,
                   help=f"waiting prompts of one chunk width prefilled together (default {DEFAULT_PREFILL_BATCH}; 1: "
                        "one at a time; always 1 on a mesh)")
    p.add_argument("--prefill-tokens", type=integer(1), default=None,
                   help=f"tokens a batched prefill call takes at most, prompts x chunk width (default "
                        f"{CPU_PREFILL_TOKENS} on a CPU, where more rows a call gain nothing, {PREFILL_TOKENS} on a "
                        "GPU or TPU): the size of one prefill call (--step-prefill-tokens bounds the calls between "
                        "two decode steps)")
    p.add_argument("--no-packed-prefill", action="store_true",
                   help=f"batch only prompts of one chunk width, each padded to it (default: prompts of at most "
                        f"{PACK_WIDTH} tokens go together whatever their lengths, a call computing their tokens side "
                        f"by side in whole blocks of {PACK_BUCKET})")
    p.add_argument("--no-weight-strips", action="store_true",
                   help="hold 4- and 8-bit weights row by row only (default: also strip by strip, which the native "
                        "kernel's calls of more than 16 rows decode with no transposition: a 32-row decode step's "
                        "matmuls about 0.88x the time, for a second copy of the codes, 92 MiB for SmolLM2's GGUF)")
    p.add_argument("--step-prefill-tokens", type=integer(1), default=STEP_PREFILL_TOKENS,
                   help=f"prompt token rows prefilled between two decode steps at most (default {STEP_PREFILL_TOKENS}, "
                        "vLLM's batch token budget; at least one prefill call): the longest pause waiting prompts put "
                        "between the running requests' tokens")
    p.add_argument("--max-queue", type=integer(1), default=64, help="requests that may wait for a slot; past it: 503")
    p.add_argument("--decode-group", type=integer(1), default=None,
                   help="decode the slots in groups of this many, skipping groups with no live request; a group's "
                        "step computes only its live rows (default: 16 on a CPU, where a slot's cache work still "
                        "costs, 32 for bf16 weights on an AMX CPU and for 4- or 8-bit weights such as the GGUF's; "
                        "all slots in one step on a GPU or TPU)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="never reuse a finished request's cache for a prompt that extends it, nor compute the common "
                        "prefix of short prompts prefilled together once (a chat template's system prompt)")
    p.add_argument("--prefill-precision", choices=PREFILL_CHOICES, default="float32",
                   help="the operands of a prompt's prefill matmuls: float32 (default, exact); int8 rounds the "
                        "activations of 4- and 8-bit weights to int8 per group (llama.cpp's Q8; 1.5-1.7x faster "
                        "prefill on a CPU with AVX512-VNNI; it flips near-tied greedy tokens); bfloat16 rounds both "
                        "operands (1.4-1.9x faster with AMX); auto: int8 where the weights are quantized and the CPU "
                        "has VNNI, else float32. docs/serving.md measures speed and loss; decode steps (see "
                        "--decode-precision) and scored prompts stay float32")
    p.add_argument("--decode-precision", choices=DECODE_CHOICES, default="float32",
                   help="the operands of every decode step's matmuls: float32 (default, exact); int8 rounds the "
                        "activations of 4- and 8-bit weights to int8 per group, as --prefill-precision int8 does "
                        "(a step of 1-64 rows 0.67-0.89x the time on a CPU with AVX512-VNNI; a scored prompt's "
                        "forced tokens too); auto: int8 where the weights are quantized and the CPU has VNNI")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every prefill shape and decode bucket before serving (about 1-3 s each on a 2-core "
                        "CPU, which requests would otherwise wait; default: on for `serve`, off for `bench serve`)")
    add_mesh_args(p)  # with --mesh, --cache-budget is per device and slots a multiple of the data axis


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching over the cache",
                       description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
                                   "(docs/serving.md).")
    from kivi_jax.cli_args import integer, real
    from kivi_jax.serve.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT

    add_serve_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: --model)")
    p.add_argument("--max-body-bytes", default=None,
                   help=f"the largest request body, e.g. 8MiB (default {DEFAULT_MAX_BODY_BYTES // 2**20} MiB); past "
                        "it: 413")
    p.add_argument("--shutdown-timeout", type=real(0.0), default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help=f"seconds running requests get to finish after SIGTERM or Ctrl-C before they are ended "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g}); waiting ones end at once")
    p.set_defaults(func=cmd_serve)


def server_from_args(args, model_name: str | None = None, progress: bool = True, before_load=None,
                     warmup: bool = False):
    """Loads the model and builds the server the flags describe; `before_load()` runs once the flags are checked,
    before the model loads (`serve` binds its port there, so that a busy port fails at once). `warmup`: the default
    of --warmup (its engine compiles what it will run before it serves: `Engine.warm_up`)."""
    import kivi_jax
    from kivi_jax import allocator
    from kivi_jax.bench import parse_bytes
    from kivi_jax.cli_args import _dtype, cache_from_args, mesh_from_args
    from kivi_jax.serve.server import build_server, check_serve_extra

    spec = cache_from_args(args)  # a bad spec, size or missing extra fails before the model loads
    budget = None if args.cache_budget is None else parse_bytes(args.cache_budget)
    if args.slots is not None and budget is not None and not getattr(args, "paged", False):
        raise ValueError("give --slots or --cache-budget, not both (both only with --paged: its rows and its bytes)")
    for flag in ("reserve_pages", "prefix_snapshots"):
        if getattr(args, flag, False) and not getattr(args, "paged", False):
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} is an option of the paged cache: add --paged, or drop {name}")
    body = getattr(args, "max_body_bytes", None)
    body = None if body is None else parse_bytes(body)
    if body is not None and body < 1:
        raise ValueError(f"--max-body-bytes {args.max_body_bytes} must be at least 1 byte")
    check_serve_extra()
    if before_load is not None:
        before_load()
    mesh = mesh_from_args(args)
    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=progress, mesh=mesh, weights=args.weights)
    allocator.keep_freed_memory()  # each step's buffers reuse the last step's freed ones (kivi_jax/allocator.py)
    return build_server(model, spec, slots=args.slots, cache_budget=budget, max_length=args.max_length,
                        prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
                        attention_impl=args.attention_impl, prefix_reuse=not args.no_prefix_reuse,
                        model_name=model_name or args.model, decode_group=args.decode_group, mesh=mesh,
                        max_body_bytes=body, shutdown_timeout=getattr(args, "shutdown_timeout", None),
                        prefill_batch=args.prefill_batch, prefill_tokens=args.prefill_tokens,
                        step_prefill_tokens=args.step_prefill_tokens,
                        paged=getattr(args, "paged", False), grow=not getattr(args, "reserve_pages", False),
                        prefix_snapshots=getattr(args, "prefix_snapshots", 0),
                        warmup=warmup if getattr(args, "warmup", None) is None else args.warmup,
                        prefill_precision=getattr(args, "prefill_precision", "float32"),
                        decode_precision=getattr(args, "decode_precision", "float32"),
                        packed_prefill=not getattr(args, "no_packed_prefill", False),
                        weight_strips=not getattr(args, "no_weight_strips", False))


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (a busy port fails at once); port 0 takes a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or "
                         "--port") from None
    return sock


def cmd_serve(args) -> int:
    sockets = []
    server = server_from_args(args, args.served_model_name,
                              before_load=lambda: sockets.append(listen_socket(args.host, args.port)), warmup=True)
    sock = sockets[0]
    from kivi_jax import allocator
    from kivi_jax.serve.http import make_uvicorn

    print(f"kivi-jax serve: model {server.model_name!r}; {server.describe()}", file=sys.stderr, flush=True)
    print(json.dumps({"capacity": server.capacity}), file=sys.stderr)
    host, port = sock.getsockname()[:2]
    uv = make_uvicorn(server.app, host, port, log_level="info")
    with allocator.frozen_heap():  # the collector leaves the loaded model and compiled programs alone while serving
        print(f"listening on http://{host if ':' not in host else f'[{host}]'}:{port}/v1", file=sys.stderr,
              flush=True)  # once the heap is frozen: that first collection takes about a second
        uv.run(sockets=[sock])  # SIGTERM or Ctrl-C: drains (docs/serving.md), then exits as that signal asks
    return 0
