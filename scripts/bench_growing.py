"""Growing a cache, measured on the real model (docs/design.md §7): chunked against one-shot prefill (peak temporary
bytes of the compiled call, wall time, tokens/s), a chat's second turn on the kept cache against re-prefilling the
history, and cache bytes after a 10-turn chat. Prints one JSON object.

    python scripts/bench_growing.py [--prompt 8000] [--rate-prompt 4096] [--chunks 256,512,1024,2048] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kivi_jax  # noqa: E402
from kivi_jax.cache import make_cache  # noqa: E402
from kivi_jax.evaluate import default_text, tokenize  # noqa: E402
from kivi_jax.runtime import PROMPT_BUCKET, prefill, prefill_chunk  # noqa: E402


def text_tokens(model, n: int) -> np.ndarray:
    ids = tokenize(model.tokenizer, default_text())
    return ids[10000 : 10000 + n].astype(np.int32)


def timed_prefill(model, spec, ids: np.ndarray, chunk: int | None, max_tokens: int, repeats: int = 1) -> float:
    """Median wall seconds of prefilling `ids` into a fresh cache, compilation excluded (its time, measured apart
    by `compiled_call`, is subtracted from the first run when `repeats` is 0)."""
    params = model.params
    times = []
    for i in range(max(repeats, 1) + (repeats > 0)):
        cache = make_cache(spec, params.config, 1, max_tokens, params.dtype)
        t0 = time.perf_counter()
        last, cache = prefill(params, ids[None], np.asarray([len(ids)]), cache, chunk)
        last.block_until_ready()
        if i or repeats == 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiled_call(model, spec, width: int, max_tokens: int) -> tuple[int, float]:
    """(peak temporary bytes, compile seconds) of one prefill call of `width` tokens onto a cache of `max_tokens`."""
    params = model.params
    cache = jax.eval_shape(lambda: make_cache(spec, params.config, 1, max_tokens, params.dtype))
    last = jax.ShapeDtypeStruct((1, params.config.vocab_size), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    t0 = time.perf_counter()
    compiled = prefill_chunk.lower(params, i32(1, width), i32(1), cache, last, i32(1)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - t0


def chat_second_turn(model, spec) -> dict:
    """Time to the first token of turn 2 with the kept cache, against prefilling the whole history afresh."""
    background = default_text()[30000:36000]
    first = f"Read this, then answer my questions.\n{background}"
    out = {}
    for trial in range(2):  # the first compiles
        chat = kivi_jax.Chat(model, cache=spec, max_new_tokens=16, max_length=4096)
        chat.send(first)
        chat.send("Summarize it in one sentence.")
        kept = chat.last_turn["first_token_seconds"]
        history = chat.ids[: len(chat.ids) - len(chat.last_turn["reply_ids"])]
        cache = make_cache(spec, model.params.config, 1, chat.cache.max_tokens, model.params.dtype)
        t0 = time.perf_counter()
        last, cache = prefill(model.params, np.asarray([history], np.int32), np.asarray([len(history)]), cache)
        int(jnp.argmax(last[0]))
        again = time.perf_counter() - t0
        out = {"history_tokens": len(history), "turn2_new_tokens": chat.last_turn["new_tokens"],
               "ttft_kept_cache_s": round(kept, 4), "ttft_reprefill_s": round(again, 4),
               "ratio_kept_vs_reprefill": round(kept / again, 4)}
    return out


def ten_turn_bytes(model) -> dict:
    out = {}
    for spec in ("full", "kivi2"):
        chat = kivi_jax.Chat(model, cache=spec, max_new_tokens=32, max_length=1024)
        for i in range(10):
            chat.send(f"Turn {i + 1}: name one more programming language and say one thing about it.")
        out[spec] = chat.stats()
    out["kivi2_vs_full_bytes"] = round(out["kivi2"]["cache_bytes"] / out["full"]["cache_bytes"], 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=8000, help="the long prompt (default 8000 tokens)")
    ap.add_argument("--rate-prompt", type=int, default=4096, help="prompt for tokens/s (default 4096)")
    ap.add_argument("--chunks", default="256,512,1024,2048", help="chunk sizes timed at --rate-prompt")
    ap.add_argument("--cache", default="kivi2")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: long,rate,chat,bytes")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    model = kivi_jax.load("smollm2", progress=False)
    spec = args.cache
    report: dict = {"machine": f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.local_device_count()} "
                               f"device(s)", "date": time.strftime("%Y-%m-%d"), "cache": spec}
    if "long" not in skip:
        n = args.prompt
        max_tokens = 8192
        ids = text_tokens(model, n)
        width = -(-n // PROMPT_BUCKET) * PROMPT_BUCKET
        parts = {}
        for name, chunk, w in (("one_shot", None, width), ("chunked_512", 512, 512)):
            temp, compile_s = compiled_call(model, spec, w, max_tokens)
            first = timed_prefill(model, spec, ids, chunk, max_tokens, repeats=0)  # includes compiling the call
            parts[name] = {"temp_bytes": temp, "seconds_incl_compile": round(first, 3),
                           "compile_seconds": round(compile_s, 3), "seconds": round(first - compile_s, 3)}
        report["long_prompt"] = {"tokens": n, **parts}
        lp = report["long_prompt"]
        lp["temp_ratio_chunked_vs_one_shot"] = round(lp["chunked_512"]["temp_bytes"] / lp["one_shot"]["temp_bytes"], 4)
        lp["time_ratio_chunked_vs_one_shot"] = round(lp["chunked_512"]["seconds"] / lp["one_shot"]["seconds"], 4)
    if "rate" not in skip:
        n = args.rate_prompt
        ids = text_tokens(model, n)
        rates = {"one_shot": round(n / timed_prefill(model, spec, ids, None, 8192), 1)}
        for c in (int(x) for x in args.chunks.split(",")):
            rates[f"chunk_{c}"] = round(n / timed_prefill(model, spec, ids, c, 8192), 1)
        report["prefill_tokens_per_s"] = {"tokens": n, **rates}
    if "chat" not in skip:
        report["chat_second_turn"] = chat_second_turn(model, spec)
    if "bytes" not in skip:
        report["ten_turn_chat"] = ten_turn_bytes(model)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
