"""Decode speed of kivi_jax against transformers' own `generate` on SmolLM2, batch 1, float32, CPU, in one run.

    OMP_NUM_THREADS=1 python scripts/compare_transformers_generate.py [--new-tokens 128] [--cache full]

Needs the test extras (torch==2.13.0, transformers, accelerate). torch runs single-threaded. Prints one JSON object:
our prefill and decode-step compile times, our steady-state decode tokens/s (compiled, timed after a warm-up run), and
transformers' tokens/s for the same greedy generation from its own GGUF load of the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax

import kivi_jax
from kivi_jax import hub
from kivi_jax.generate import start

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(model, ids: list[int], new_tokens: int, cache: str) -> dict:
    """Compile times of the prefill and the decode step, then steady-state decode tokens/s."""
    kw = dict(max_new_tokens=new_tokens, cache=cache, stop_at_eos=False)
    jax.clear_caches()
    t0 = time.perf_counter()
    steps = start(model, ids, **kw).steps
    next(steps)  # prefill (compiles)
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    next(steps)  # first decode step (compiles)
    decode_compile_s = time.perf_counter() - t1
    for _ in steps:
        pass
    # Steady state: a second, fully compiled run, decode steps timed after the first one.
    steps = start(model, ids, **kw).steps
    next(steps)
    next(steps)
    t2 = time.perf_counter()
    n = sum(1 for _ in steps)
    decode_s = time.perf_counter() - t2
    gen = kivi_jax.generate(model, ids, **kw)
    return {"prefill_compile_s": round(prefill_s, 3), "decode_compile_s": round(decode_compile_s, 3),
            "decode_tokens_per_s": round(n / decode_s, 2), "token_ids": gen.token_ids}


def theirs(ids: list[int], new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    gguf = hub.fetch_gguf("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(x, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False)
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = model.generate(x, **kw)
        total_s = time.perf_counter() - t1
    decode_s = total_s - prefill_s
    return {"decode_tokens_per_s": round((new_tokens - 1) / decode_s, 2), "total_s": round(total_s, 3),
            "token_ids": out[0, len(ids):].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", default="full")
    args = parser.parse_args()
    model = kivi_jax.load("smollm2", progress=False)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                               add_generation_prompt=True)
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    a = ours(model, ids, args.new_tokens, args.cache)
    b = theirs(ids, args.new_tokens)
    same = sum(x == y for x, y in zip(a.pop("token_ids"), b.pop("token_ids")))
    print(json.dumps({
        "device": str(jax.devices()[0]), "model": "smollm2", "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
        "cache": args.cache, "kivi_jax": a, "transformers": b,
        "speedup": round(a["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3),
        "greedy_tokens_identical_prefix": same,
    }, indent=1))


if __name__ == "__main__":
    main()
