"""`kivi-jax bench serve`: a load benchmark of the server with concurrent streaming clients.

The server runs in this process (one per cache spec, each built with the same capacity flags) or is reached at
`--url` (loopback only). For each client count, that many threads each send `--requests-per-client` streaming chat
requests from a fixed prompt set, within a time limit; the run reports requests/s, output tokens/s, time to first
token and inter-token latency (p50, p99) and the most slots live at once. `--layout slots,paged` runs each spec on
whole slots and on a paged cache (docs/design.md §12) with the same budget; `--workload mixed` sends prompts of
about 64 to 2048 tokens asking for 32 to 256 (seeded; the same requests for every server) instead of the short
questions.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from urllib.parse import urlparse

import numpy as np

from kivi_jax.config import is_reference

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Give one word that rhymes with cat.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Say hello in Spanish.",
    "How many legs does a spider have?",
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIXED_PROMPT_TOKENS, MIXED_OUTPUT_TOKENS = (64, 2048), (32, 256)  # --workload mixed: the ranges drawn from
WORDS_PER_TOKEN = 0.75  # English prose in SmolLM2's tokenizer, about: a mixed prompt's words for its tokens


def workload_request(name: str, index: int, max_tokens: int) -> tuple[str, int]:
    """Request `index` of a workload: (prompt, max_tokens). `short`: the fixed questions, `max_tokens` each;
    `mixed`: about 64 to 2048 tokens of repeated questions and 32 to 256 tokens asked (and generated: the requests
    ignore EOS), drawn from `index`'s seed."""
    if name == "short":
        return PROMPTS[index % len(PROMPTS)], max_tokens
    rng = np.random.RandomState(index)
    tokens = rng.randint(MIXED_PROMPT_TOKENS[0], MIXED_PROMPT_TOKENS[1] + 1)
    words = " ".join(PROMPTS).split()
    text = " ".join(words[(index + i) % len(words)] for i in range(int(tokens * WORDS_PER_TOKEN)))
    return (f"Here are some questions: {text}\nAnswer the last one.",
            int(rng.randint(MIXED_OUTPUT_TOKENS[0], MIXED_OUTPUT_TOKENS[1] + 1)))
# --response-format json_schema: every answer held to this schema (structured output's cost against free text)
BENCH_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
                "required": ["answer", "confidence"]}
RESPONSE_FORMATS = {"text": None, "json_object": {"type": "json_object"},
                    "json_schema": {"type": "json_schema", "json_schema": {"name": "answer", "schema": BENCH_SCHEMA}}}


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def stream_one(client, url: str, model: str, prompt: str, max_tokens: int, response_format: str = "text",
               ignore_eos: bool = False, on_token=None) -> dict:
    """One streaming chat request; returns its send time, chunk arrival times, output tokens and the prompt tokens
    the server counted (its `usage`; None if it sent none). `ignore_eos`: the answer runs to max_tokens (vLLM's option
    of that name); `on_token(n)` is called as the n-th chunk arrives."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if RESPONSE_FORMATS[response_format] is not None:
        body["response_format"] = RESPONSE_FORMATS[response_format]
    t0 = time.perf_counter()
    arrivals, tokens, prompt_tokens, status = [], 0, None, None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return {"status": status, "sent": t0, "arrivals": [], "tokens": 0, "prompt_tokens": None,
                    "end": time.perf_counter()}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"].get("prompt_tokens")
            for c in chunk.get("choices", []):
                n = len(c.get("token_ids") or []) or (1 if c.get("delta", {}).get("content") else 0)
                if n:
                    arrivals.append(time.perf_counter())
                    if on_token is not None:
                        on_token(len(arrivals))
    return {"status": status, "sent": t0, "arrivals": arrivals, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "end": time.perf_counter()}


def _pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if len(values) else None


def run_level(url: str, model: str, clients: int, per_client: int, max_tokens: int, time_limit: float,
              response_format: str = "text", workload: str = "short") -> dict:
    """`clients` threads, each sending up to `per_client` requests (stopping at `time_limit` seconds)."""
    import httpx

    results: list[dict] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=max(time_limit, 60) * 2) as http:
            for k in range(per_client):
                if time.perf_counter() - t_start > time_limit:
                    return
                prompt, asked = workload_request(workload, c * per_client + k, max_tokens)
                r = stream_one(http, url, model, prompt, asked, response_format, ignore_eos=workload == "mixed")
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_limit * 4 + 120)
    wall = time.perf_counter() - t_start
    ok = [r for r in results if r["status"] == 200 and r["arrivals"]]
    ttft = [r["arrivals"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": len(results), "ok": len(ok),
            "rejected": sum(r["status"] == 503 for r in results), "seconds": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 4), "output_tokens": out_tokens,
            "output_tokens_per_s": round(out_tokens / wall, 3),
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
            "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99)}


def metric_from_url(url: str, name: str) -> int | None:
    """The server's /metrics value `kivi_serve_<name>` (None if it has none)."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"kivi_serve_{name} "):
            return int(float(line.split()[1]))
    return None


def peak_live_from_metrics(url: str) -> int | None:
    return metric_from_url(url, "peak_live_slots")


def bench_server(url: str, model: str, args, engine=None, label: str = "") -> list[dict]:
    """Every client count against one server; `engine` (in-process) lets the peak of live slots reset per level."""
    rows = []
    import httpx

    try:
        with httpx.Client(timeout=3600) as http:
            first = stream_one(http, url, model, PROMPTS[0], args.max_tokens,  # compiles what a request needs
                               args.response_format)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach a server at {url} ({type(e).__name__}: {e}); start one with kivi-jax serve "
                           "or leave out --url") from None
    if first["status"] != 200:
        raise RuntimeError(f"the server at {url} answered a test request with HTTP {first['status']}")
    for clients in args.clients:
        if engine is not None:
            engine.peak_live = 0
        preempted = metric_from_url(url, "preemptions_total")
        row = run_level(url, model, clients, args.requests_per_client, args.max_tokens, args.time_limit,
                        args.response_format, args.workload)
        if engine is not None and engine.paged:
            row["pages"] = engine.metrics()
        row["peak_live_slots"] = engine.peak_live if engine is not None else peak_live_from_metrics(url)
        if preempted is not None:
            row["preemptions"] = metric_from_url(url, "preemptions_total") - preempted
        row["cache"] = label
        _log(f"{label}: {clients} clients: {row['ok']} requests in {row['seconds']} s, "
             f"{row['output_tokens_per_s']} tokens/s, TTFT p50 {row['ttft_ms_p50']} ms, "
             f"ITL p50 {row['itl_ms_p50']} ms, peak slots {row['peak_live_slots']}"
             + (f", preemptions {row['preemptions']}" if row.get("preemptions") else ""))
        rows.append(row)
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's throughput and latencies over the full cache's at the same client count and layout (a label is
    the spec, then " paged" for a paged server; same run)."""
    spec_of = lambda label: label.split(" ")[0]  # noqa: E731
    layout_of = lambda label: label[len(spec_of(label)):]  # noqa: E731
    full = {(r["clients"], layout_of(r["cache"])): r for r in rows if is_reference(spec_of(r["cache"]))}
    keys = ("requests_per_s", "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    for r in rows:
        f = full.get((r["clients"], layout_of(r["cache"])))
        r["ratio_vs_full"] = None if f is None or is_reference(spec_of(r["cache"])) else {
            k: (round(r[k] / f[k], 3) if r[k] is not None and f[k] else None) for k in keys}
    return rows


def plot_serve(rows: list[dict], title: str, path) -> str:
    from kivi_jax.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for i, cache in enumerate(dict.fromkeys(r["cache"] for r in rows)):
        pts = [r for r in rows if r["cache"] == cache]
        x, color = [r["clients"] for r in pts], f"C{i}"
        axes[0].plot(x, [r["output_tokens_per_s"] for r in pts], marker="o", color=color, label=cache)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            ax.plot(x, [r[f"{key}_p50"] for r in pts], marker="o", color=color, label=f"{cache} p50")
            ax.plot(x, [r[f"{key}_p99"] for r in pts], marker="x", ls="--", color=color, label=f"{cache} p99")
    for ax, ylabel in zip(axes, ("output tokens/s", "time to first token (ms)", "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def add_serve_bench(sub) -> None:
    """The `serve` subcommand of `kivi-jax bench`."""
    from kivi_jax.cli_args import int_list
    from kivi_jax.serve.cli import add_serve_args

    p = sub.add_parser("serve", help="load benchmark of `kivi-jax serve`: concurrent streaming clients, "
                                     "throughput, TTFT and inter-token latency",
                       description=__doc__.split("\n\n")[1])
    add_serve_args(p, cache_default="full,kivi2")
    p.add_argument("--url", default=None, help="benchmark a running server (loopback only) instead of starting one")
    p.add_argument("--served-model-name", default=None, help="the model id to ask for (default: --model)")
    p.add_argument("--clients", type=int_list, default=[1, 8, 32], help="concurrent clients (default 1,8,32)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends (default 2)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens a request (default 16)")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds a client-count level may start requests for (default 300)")
    p.add_argument("--response-format", choices=sorted(RESPONSE_FORMATS), default="text",
                   help="hold every answer to JSON (json_object) or to a fixed schema (json_schema), to measure "
                        "structured output's cost (needs the grammar extra); default text")
    p.add_argument("--layout", default="slots", type=lambda s: s.split(","),
                   help="slots, paged, or slots,paged: each spec's server on whole slots and/or a paged cache, with "
                        "the same budget (default slots; --paged is paged alone)")
    p.add_argument("--workload", choices=("short", "mixed"), default="short",
                   help="short: the fixed questions, --max-tokens each (default); mixed: about 64-2048 prompt tokens "
                        "and 32-256 generated (EOS ignored), seeded (the same requests for every server)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from kivi_jax import allocator, bench
    from kivi_jax.cli_args import spec_list
    from kivi_jax.serve.cli import server_from_args
    from kivi_jax.serve.server import check_serve_extra

    check_serve_extra(("httpx",) if args.url else ("fastapi", "uvicorn", "httpx"))
    if args.requests_per_client < 1 or args.max_tokens < 1 or max(args.clients) > 256:
        raise ValueError("--requests-per-client and --max-tokens must be at least 1, and at most 256 clients")
    layouts = ["paged"] if args.paged else args.layout
    if not layouts or set(layouts) - {"slots", "paged"}:
        raise ValueError(f"--layout {','.join(layouts)}: give slots, paged or slots,paged")
    model_name = args.served_model_name or args.model
    out = {"device": bench.device_name(), "model": args.model, "clients": args.clients,
           "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens, "prompts": list(PROMPTS),
           "response_format": RESPONSE_FORMATS[args.response_format], "workload": args.workload,
           "layouts": layouts}
    rows, servers = [], {}
    if args.url:
        host = urlparse(args.url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"--url must be a loopback address ({', '.join(LOOPBACK)}), not {host!r}")
        rows = bench_server(args.url.rstrip("/"), model_name, args, label=args.url)
    else:
        from kivi_jax.serve.http import ServerThread

        for spec, layout in [(s, lay) for s in spec_list(args.cache) for lay in layouts]:
            args_one = argparse.Namespace(**{**vars(args), "cache": spec, "paged": layout == "paged"})
            server = server_from_args(args_one, model_name, progress=not args.json)
            _log(server.describe())
            name = server.engine.spec_name + (" paged" if layout == "paged" else "")
            servers[name] = {"capacity": server.capacity, "slots": server.engine.num_slots}
            with ServerThread(server.app) as thread, allocator.frozen_heap():  # as `serve` runs
                rows += bench_server(thread.url, model_name, args, server.engine, label=name)
            del server
        out["servers"] = servers
        out["cache_budget"] = args.cache_budget
        out["max_length"] = args.max_length
    out["results"] = with_ratios(rows)
    if args.plot:
        out["plot"] = plot_serve(rows, f"{args.model}: serve, {args.max_tokens} tokens a request, budget "
                                       f"{args.cache_budget or '-'}", args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    from kivi_jax.cli_args import text_table as _table

    for name, s in servers.items():
        print(f"# {name}: {s['slots']} slots")
    print(_table(["cache", "clients", "requests", "req/s", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                  "ITL p99 ms", "peak slots", "tokens/s vs full"],
                 [[r["cache"], r["clients"], r["ok"], r["requests_per_s"], r["output_tokens_per_s"], r["ttft_ms_p50"],
                   r["ttft_ms_p99"], r["itl_ms_p50"], r["itl_ms_p99"], r["peak_live_slots"],
                   "-" if not r["ratio_vs_full"] else r["ratio_vs_full"]["output_tokens_per_s"]] for r in rows]))
    if args.plot:
        print(f"plot: {out['plot']}")
    return 0
