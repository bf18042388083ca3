"""`kivi-jax generate | convert | eval | bench`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kivi_jax.config import SPEC_HELP

DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name: str | None):
    if name is None:
        return None
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def cache_from_args(args):
    """The cache spec from `--cache` with `--k-bits/--v-bits/--group-size/--residual-length` overrides."""
    import dataclasses

    from kivi_jax.config import KIVIConfig, parse_cache_spec

    spec = parse_cache_spec(args.cache)
    overrides = {k: v for k, v in (("k_bits", args.k_bits), ("v_bits", args.v_bits), ("group_size", args.group_size),
                                   ("residual_length", args.residual_length)) if v is not None}
    if not overrides:
        return spec
    if spec == "full":
        spec = KIVIConfig()
    return dataclasses.replace(spec, **overrides)


def add_cache_args(p: argparse.ArgumentParser, default: str = "kivi2") -> None:
    p.add_argument("--cache", default=default, help=f"cache kind (default {default}); {SPEC_HELP}")
    p.add_argument("--k-bits", type=int, choices=(2, 4, 8), help="override the key bits of --cache")
    p.add_argument("--v-bits", type=int, choices=(2, 4, 8), help="override the value bits of --cache")
    p.add_argument("--group-size", type=int, help="override the group size G of --cache")
    p.add_argument("--residual-length", type=int, help="override the residual length R of --cache")
    p.add_argument("--attention-impl", choices=("auto", "xla", "pallas"), default="auto",
                   help="decode attention: Pallas kernel on GPU (auto), the XLA path, or forced (pallas on CPU runs "
                        "in interpret mode, slowly)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default; fetched and converted once) or a path: HF directory, .gguf, kivi_jax checkpoint")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: as stored, float32)")


def cmd_generate(args) -> int:
    import kivi_jax
    from kivi_jax.generate import Generation, start

    t0 = time.perf_counter()
    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=not args.json)
    load_s = time.perf_counter() - t0
    temperature = 0.0 if args.greedy or args.temperature is None else args.temperature
    spec = cache_from_args(args)
    t1 = time.perf_counter()
    session = start(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        temperature=temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        cache=spec,
        max_length=args.max_length,
        attention_impl=args.attention_impl,
    )
    tok = model.tokenizer
    ids: list[int] = []
    shown = ""
    for step in session.steps:
        if step.tokens[0] >= 0:
            ids.append(int(step.tokens[0]))
        if not args.json and tok is not None:
            text = tok.decode(ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    gen = Generation(
        sequences=[ids],
        prompt_lengths=[len(session.prompts[0])],
        texts=None if tok is None else [tok.decode(ids, skip_special_tokens=True)],
        single=True,
        seconds=time.perf_counter() - t1,
        prefill_seconds=session.result["prefill_seconds"],
        overflow=session.result["overflow"],
    )
    if args.json:
        out = gen.to_json()
        out.update({"model": args.model, "cache": kivi_jax.config.spec_name(spec), "load_seconds": round(load_s, 4)})
        print(json.dumps(out))
    else:
        if tok is None:
            sys.stdout.write(" ".join(map(str, ids)))
        sys.stdout.write("\n")
    return 0


def cmd_convert(args) -> int:
    from kivi_jax import checkpoint, hub

    src = args.src
    if src in hub.MODELS:
        src = str(hub.fetch_gguf(src))
    out = checkpoint.convert(src, args.out, _dtype(args.dtype), progress=True)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def add_eval_parser(sub) -> None:
    """`kivi-jax eval ppl | ablate | errors`: quality through the cache (kivi_jax.evaluate)."""


def add_bench_parser(sub) -> None:
    """`kivi-jax bench decode | memory | generate`: speed and memory (kivi_jax.bench)."""
    from kivi_jax.bench_cli import add_bench_commands

    b = sub.add_parser("bench", help="decode speed, cache memory and generation throughput against the full cache")
    add_bench_commands(b.add_subparsers(dest="bench_command", required=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kivi-jax", description="Llama/Mistral inference with a KIVI-quantized KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed to the terminal")
    g.add_argument("--prompt", required=True, help="the prompt text")
    add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-length", type=int, default=None, help="cache size in tokens (default: prompt + new, rounded up)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--greedy", action="store_true", help="greedy decoding (the default unless --temperature is given)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_cache_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file (or 'smollm2') into a kivi_jax checkpoint")
    c.add_argument("src", help="HF model directory, .gguf file, or a known model name")
    c.add_argument("out", help="output directory (must not exist)")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="stored dtype (default float32)")
    c.set_defaults(func=cmd_convert)

    add_eval_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "greedy", False) and args.temperature:
        parser.error("--greedy and --temperature exclude each other")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:  # our errors say what is wrong and what would be right
        print(f"kivi-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
