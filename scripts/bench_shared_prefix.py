"""Time to first token when many requests share a long system prompt, with and without prefix snapshots.

    PYTHONPATH=. python scripts/bench_shared_prefix.py --snapshots 0,4 --requests 32 --system-tokens 1024 \
        --json docs/bench/shared_prefix_run1.json

A paged kivi2 server in this process (`--cache-budget`, `--max-length`), one configuration after the other: the
first request alone, then the others one at a time (each after the previous answered), every prompt the same system
prompt of about `--system-tokens` tokens and its own question, greedy, `--max-tokens` out. Reports each request's
time to first token, the later ones' p50/p99 against the first's, and the pool's page counters while the last one
runs (docs/serving.md, "Paged cache").
"""

from __future__ import annotations

import argparse
import threading


def system_prompt(tokenizer, tokens: int, lead: str = "You answer questions about this text.") -> str:
    """About `tokens` tokens of prose (the load benchmark's questions, repeated) after `lead`."""
    from kivi_jax.serve.loadtest import PROMPTS

    words, text = " ".join(PROMPTS).split(), ""
    i = 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " " + " ".join(words[j % len(words)] for j in range(i, i + 32))
        i += 32
    return lead + text


def run(model, args, snapshots: int) -> dict:
    import httpx

    from kivi_jax.bench import parse_bytes
    from kivi_jax.serve.http import ServerThread
    from kivi_jax.serve.loadtest import PROMPTS, stream_one
    from kivi_jax.serve.server import build_server

    server = build_server(model, args.cache, cache_budget=parse_bytes(args.cache_budget), max_length=args.max_length,
                          paged=True, prefix_snapshots=snapshots, model_name="m")
    system = system_prompt(model.tokenizer, args.system_tokens)
    warm = system_prompt(model.tokenizer, args.system_tokens, "Another text, for the warm-up.")
    rows, seen, shared = [], {}, [0]
    done = threading.Event()

    def poll():  # the most pages held more than once at any time (a live request and the snapshot)
        while not done.wait(0.05):
            shared[0] = max(shared[0], server.engine.allocator.metrics()["pages_shared"])

    with ServerThread(server.app) as thread, httpx.Client(timeout=3600) as http:
        stream_one(http, thread.url, "m", PROMPTS[0], 2)  # compiles the decode step and a short prefill
        for q in (0, 1):  # the long prompt's prefill, and with snapshots the path that starts from one
            stream_one(http, thread.url, "m", f"{warm}\n\nQuestion {q}: {PROMPTS[q]}", 2)
        server.engine.counters.update(prefill_tokens_computed=0, prefix_tokens_reused=0)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for i in range(args.requests):
            prompt = f"{system}\n\nQuestion {i}: {PROMPTS[i % len(PROMPTS)]}"
            r = stream_one(http, thread.url, "m", prompt, args.max_tokens)
            if r["status"] != 200 or not r["arrivals"]:
                raise RuntimeError(f"request {i} answered HTTP {r['status']}")
            rows.append(round(r["arrivals"][0] - r["sent"], 4))
            if i == args.requests - 1:
                seen = dict(server.engine.metrics())
    done.set()
    poller.join()
    later = sorted(rows[1:])
    pct = lambda q: later[min(len(later) - 1, int(round(q * (len(later) - 1))))]  # noqa: E731
    m = seen
    return {"prefix_snapshots": snapshots, "ttft_s": rows, "first_s": rows[0], "later_p50_s": pct(0.5),
            "later_p99_s": pct(0.99), "later_p50_over_first": round(pct(0.5) / rows[0], 3),
            "prefill_tokens_computed": m.get("prefill_tokens_computed"), "prefix_tokens_reused": m.get(
                "prefix_tokens_reused"), "pages_total": m.get("pages_total"), "pages_used": m.get("pages_used"),
            "pages_shared_peak": shared[0], "snapshot_bytes": m.get("prefix_snapshot_bytes", 0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache", default="kivi2")
    p.add_argument("--cache-budget", default="180MiB")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--snapshots", default="0,4", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from sweep import sweep

    return sweep(args, args.snapshots, run)


if __name__ == "__main__":
    raise SystemExit(main())
