"""The gap between streamed tokens of running requests while a long prompt arrives and is prefilled.

    PYTHONPATH=. python scripts/bench_arrival.py --chunks 512,2048 --json docs/bench/arrival_run1.json

A `kivi-jax serve` subprocess (paged by default, `--cache-budget`, `--max-length`; warmed up, so nothing
compiles while it is measured; its own process, so the clients' threads do not share its interpreter), one configuration a
`--chunks` entry (the server's `--prefill-chunk`: 2048 prefills the long prompt in one call, as an unchunked
server would): `--running` streaming chats decode (greedy, `ignore_eos`, `--running-tokens` each); once each has
streamed 8 tokens a prompt of about `--long-tokens` tokens arrives. Reported for the running requests: their
inter-token gaps while they decode alone (from their 8th to their 16th token) and those overlapping the time from
its arrival to its first token (p50, p99, max), and its time to first token (docs/serving.md, "Batched prefill").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def gaps(arrivals: list[float], start: float, end: float) -> list[float]:
    """The gaps between consecutive arrivals that overlap [start, end] (a stall that spans the window counts)."""
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end]


def pcts(xs: list[float]) -> dict:
    import numpy as np

    if not xs:
        return {"n": 0}
    ms = lambda v: round(float(v) * 1000, 1)  # noqa: E731
    return {"n": len(xs), "p50_ms": ms(np.percentile(xs, 50)), "p99_ms": ms(np.percentile(xs, 99)),
            "max_ms": ms(max(xs))}


def run(model, args, chunk: int) -> dict:
    import httpx

    from kivi_jax.evaluate import default_text
    from kivi_jax.serve.loadtest import PROMPTS, stream_one
    from lm_eval_serve import free_port, launch, stop

    text = default_text()
    ids = model.tokenizer(text[:40000])["input_ids"]
    long_prompt = model.tokenizer.decode(ids[: args.long_tokens]) + "\n\nSummarize the text above."
    results: list = [None] * args.running
    streamed = [0] * args.running  # chunks each running request has received
    port = free_port()
    cmd = [sys.executable, "-m", "kivi_jax.cli", "serve", "--model", args.model, "--cache", args.cache,
           "--cache-budget", args.cache_budget, "--max-length", str(args.max_length), "--prefill-chunk", str(chunk),
           "--port", str(port), "--served-model-name", "m", *(["--paged"] if args.paged else [])]
    proc = launch(cmd, port, "kivi-jax serve", Path(tempfile.mkdtemp()) / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=3600) as http:  # the server warmed up; this warms the HTTP road
            stream_one(http, url, "m", PROMPTS[0], 4)

        def client(i: int) -> None:
            with httpx.Client(timeout=3600) as http:
                body_prompt = PROMPTS[i % len(PROMPTS)]
                results[i] = stream_one(http, url, "m", body_prompt, args.running_tokens, ignore_eos=True,
                                        on_token=lambda n: streamed.__setitem__(i, n))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.running)]
        for t in threads:
            t.start()
        while min(streamed) < 8:  # every running request has streamed 8 tokens: all admitted, decoding
            time.sleep(0.01)
        steady = time.perf_counter()
        while min(streamed) < 16:
            time.sleep(0.01)
        with httpx.Client(timeout=3600) as http:
            arrived = time.perf_counter()
            long_r = stream_one(http, url, "m", long_prompt, 4)
        first = long_r["arrivals"][0]
        for t in threads:
            t.join()
    finally:
        stop(proc)
    before = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:]) if steady <= a and b <= arrived]
    during = [g for r in results for g in gaps(r["arrivals"], arrived, first)]
    tokens = len(model.tokenizer.apply_chat_template([{"role": "user", "content": long_prompt}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    return {"prefill_chunk": chunk, "long_prompt_tokens": tokens, "long_ttft_s": round(first - arrived, 3),
            "gaps_before": pcts(before), "gaps_while_prefilling": pcts(during),
            "ok": all(r["status"] == 200 for r in results) and long_r["status"] == 200}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache", default="kivi2")
    p.add_argument("--cache-budget", default="1GiB")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--paged", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chunks", default="512,2048", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--running", type=int, default=8)
    p.add_argument("--running-tokens", type=int, default=160)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from sweep import sweep

    return sweep(args, args.chunks, run)


if __name__ == "__main__":
    raise SystemExit(main())
