"""The peer: transformers' QuantizedCache (quanto backend) under `kivi-jax eval ppl`'s protocol, same JSON.

Same model (transformers' own GGUF load of the SmolLM2 file kivi_jax uses), same text (the prose of Python's
pydoc_data.topics, or --text), same windows (W evenly spaced windows of P + N + 1 tokens at i * (n - P - N - 1) /
(W - 1)), same protocol: prefill P tokens, then feed N tokens one at a time through the cache and score each
prediction. `full` (transformers' DynamicCache) runs first and is the reference for KL and top-1 agreement.

Install, in a venv of its own (optimum-quanto is no kivi_jax dependency, and this script does not import kivi_jax);
pin torch to the CPU wheel, an unpinned torch pulls a multi-GB CUDA build:

    python3 -m venv /tmp/venv-quanto
    /tmp/venv-quanto/bin/pip install torch==2.13.0 transformers accelerate gguf numpy optimum-quanto

Run (one torch thread: faster than two on a small CPU, and comparable):

    OMP_NUM_THREADS=1 /tmp/venv-quanto/bin/python scripts/compare_hf_quantized_cache.py --json > quanto.json

The GGUF and the tokenizer are the ones `kivi-jax` fetched, built and cached (`$KIVI_JAX_CACHE` or ~/.cache/kivi_jax,
under smollm2/); run any `kivi-jax` command once first, or pass --gguf PATH and --tokenizer DIR. The tokenizer is
kivi_jax's (built from the GGUF with llama.cpp's pre-tokenizer), so both sides score the very same token windows.

quanto's axes (transformers 5.x `QuantoQuantizedLayer`, optimum-quanto 0.2.x grouping): on a `[batch, heads, tokens,
head_dim]` tensor, axis 0 groups `q_group_size` consecutive channels of one token (per-token, transformers' default
for keys and values) and axis -1 groups `q_group_size` consecutive tokens of one channel (per-channel, KIVI's choice
for keys). Unlike KIVI, transformers quantizes the whole prompt at prefill (no residual of the prompt's last tokens)
and, each time its residual holds R tokens, dequantizes and re-quantizes the whole cache.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# name -> QuantizedCache keywords (None: full precision); group 64 and residual 128 as in docs/design.md §6's reference run
CONFIGS = {
    "full": None,
    "quanto-k2v2-g64-r128-ktok": dict(nbits=2, axis_key=0, axis_value=0, q_group_size=64, residual_length=128),
    "quanto-k2v2-g64-r128": dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=64, residual_length=128),
    "quanto-k4v4-g64-r128": dict(nbits=4, axis_key=-1, axis_value=0, q_group_size=64, residual_length=128),
    "quanto-k4v4-g64-r128-ktok": dict(nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128),
    "quanto-k2v2-g32-r128": dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=32, residual_length=128),
}


def cache_root() -> Path:
    root = os.environ.get("KIVI_JAX_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kivi_jax"


def default_gguf() -> Path:
    return cache_root() / "smollm2" / "gguf" / GGUF_NAME


def default_tokenizer() -> Path:
    """The tokenizer kivi_jax built from the same GGUF (llama.cpp's pre-tokenizer), so the windows are identical."""
    return cache_root() / "smollm2" / "checkpoint-v2" / "tokenizer"


def default_text() -> str:
    """As kivi_jax.evaluate.default_text: the prose of Python's own language reference."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def window_starts(n_tokens: int, prefill: int, decode: int, windows: int) -> list[int]:
    """As kivi_jax.evaluate.window_starts: i * (n - P - N - 1) // (W - 1)."""
    span = n_tokens - prefill - decode - 1
    if span < 0:
        raise SystemExit(f"the text has {n_tokens} tokens; a window needs prefill + decode + 1 = {prefill + decode + 1}")
    return [0] if windows == 1 else [i * span // (windows - 1) for i in range(windows)]


def make_cache(model, kwargs):
    from transformers import DynamicCache, QuantizedCache

    if kwargs is None:
        return DynamicCache(config=model.config)
    return QuantizedCache(backend="quanto", config=model.config, **kwargs)


def teacher_forced(model, windows, prefill: int, kwargs, ref=None) -> dict:
    """Per scored token `[windows, decode]` NLL, KL(ref || ours), top-1 agreement; log-probs when `ref` is None."""
    import torch

    n_win, size = windows.shape
    decode = size - prefill - 1
    cache = make_cache(model, kwargs)
    nll = torch.zeros(n_win, decode)
    kl = torch.zeros(n_win, decode)
    top1 = torch.ones(n_win, decode)
    logps = torch.zeros(n_win, decode, model.config.vocab_size) if ref is None else None
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40)
    cache_kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    with torch.no_grad():
        model(input_ids=windows[:, :prefill], use_cache=True, logits_to_keep=1, **cache_kw)
        t0 = time.perf_counter()
        for j in range(decode):
            out = model(input_ids=windows[:, prefill + j : prefill + j + 1], use_cache=True, **cache_kw)
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [windows, vocab]
            nll[:, j] = -logp.gather(1, windows[:, prefill + j + 1, None])[:, 0]
            if ref is None:
                logps[:, j] = logp
            else:
                r = ref[:, j]
                kl[:, j] = (r.exp() * (r - logp)).sum(-1)
                top1[:, j] = (logp.argmax(-1) == r.argmax(-1)).float()
            if j % 32 == 31:
                print(f"  {j + 1}/{decode} steps", file=sys.stderr, flush=True)
        seconds = time.perf_counter() - t0
    return {"nll": nll, "kl": kl, "top1": top1, "logprobs": logps, "decode_seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=default_gguf(), help=f"the GGUF file (default {default_gguf()})")
    p.add_argument("--tokenizer", type=Path, default=default_tokenizer(),
                   help=f"tokenizer directory (default {default_tokenizer()}, the one kivi_jax uses)")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the prose of pydoc_data.topics)")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import platform

    import numpy as np
    import optimum.quanto
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    names = ["full"] + [n for n in names if n != "full"]
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf} does not exist: run a kivi-jax command once (it fetches the model) or pass --gguf")

    gguf_dir, gguf_file = str(args.gguf.parent), args.gguf.name
    if not args.tokenizer.is_dir():
        raise SystemExit(f"{args.tokenizer} does not exist: run a kivi-jax command once, or pass --tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    if args.text is None:
        text, text_name = default_text(), f"pydoc_data.topics (Python {platform.python_version()})"
    else:
        text, text_name = Path(args.text).read_text(encoding="utf-8"), args.text
    tokens = np.asarray(tokenizer(text)["input_ids"], np.int64)
    starts = window_starts(len(tokens), args.prefill, args.decode, args.windows)
    size = args.prefill + args.decode + 1
    windows = torch.tensor(np.stack([tokens[s : s + size] for s in starts]))

    results, ref = {}, None
    for name in names:
        print(f"{name}: {CONFIGS[name]}", file=sys.stderr, flush=True)
        out = teacher_forced(model, windows, args.prefill, CONFIGS[name], ref)
        if name == "full":
            ref = out["logprobs"]
        nll = out["nll"]
        results[name] = {
            "nll": float(nll.mean()),
            "ppl": float(nll.mean().exp()),
            "kl_vs_full": float(out["kl"].mean()),
            "top1_agree": float(out["top1"].mean()),
            "tokens": int(nll.numel()),
            "decode_tokens_per_s": nll.numel() / out["decode_seconds"],
            "nll_per_window": nll.mean(1).tolist(),
            "cache": "DynamicCache" if CONFIGS[name] is None else {"backend": "quanto", **CONFIGS[name]},
        }
    report = {
        "model": str(args.gguf), "text": text_name, "text_tokens": int(len(tokens)), "window_starts": starts,
        "prefill": args.prefill, "decode": args.decode, "windows": args.windows,
        "peer": f"transformers {transformers.__version__} QuantizedCache, optimum-quanto {optimum.quanto.__version__}, "
                f"torch {torch.__version__}, float32, 1 thread",
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['peer']}; text {text_name} ({len(tokens)} tokens); windows at {starts}")
    full = results["full"]["nll"]
    print(f"{'cache':<28}{'NLL':>8}{'ΔNLL':>9}{'ppl':>9}{'KL(full‖q)':>12}{'top-1':>8}{'tok/s':>9}")
    for name, r in results.items():
        print(f"{name:<28}{r['nll']:>8.4f}{r['nll'] - full:>+9.4f}{r['ppl']:>9.3f}{r['kl_vs_full']:>12.5f}"
              f"{r['top1_agree']:>8.3f}{r['decode_tokens_per_s']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
