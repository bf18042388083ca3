"""Calibrates the non-uniform codebooks of `kivi_jax/codebook.py` (`LEVELS`) from the default model on the development
split of the default text, offline and deterministically; prints the table to paste into codebook.py.

    python scripts/calibrate_codebooks.py [--bits 2,3,4] [--key-weights attention|mse] [--json out.json]

The windows are the development split's (`kivi-jax eval ppl --split dev`: 4 windows of the protocol's 512 + 256
tokens; their first 768 tokens, a multiple of the key group), never the evaluation windows.
"""

from __future__ import annotations

import argparse
import json
import time


def calibrate(params, windows, bits=(2, 3, 4), key_weights: str = "attention"):
    """Codebooks for keys and values at each of `bits`, from a full-precision prefill of `windows [batch, tokens]`
    (tokens a multiple of the key group) on `params` (values rotated here, as `-rotv` quantizes them); see
    `codebook.from_activations`."""
    import jax.numpy as jnp

    from kivi_jax import codebook, evaluate, rotation

    params = rotation.rotate_values(params)
    acts = evaluate.capture_qkv(params, jnp.asarray(windows, jnp.int32))
    return codebook.from_activations(acts, bits, key_weights=key_weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", default="2,3,4", help="bit widths to calibrate (default 2,3,4)")
    p.add_argument("--key-weights", choices=("attention", "mse"), default="attention",
                   help="weigh key errors by the attention their token receives (default) or not")
    p.add_argument("--json", default=None, help="also write the levels and the run's details to this file")
    args = p.parse_args(argv)

    import kivi_jax
    from kivi_jax import evaluate

    t0 = time.time()
    model = kivi_jax.load("smollm2", progress=False)
    tokens = evaluate.tokenize(model.tokenizer, evaluate.default_text())
    windows = evaluate.make_windows(tokens, 512, 256, 4, "dev")[:, :768]
    bits = tuple(int(b) for b in args.bits.split(","))
    levels = calibrate(model.params, windows, bits, key_weights=args.key_weights)
    seconds = time.time() - t0
    print(f"# {evaluate.default_text_name()}, dev windows at "
          f"{evaluate.window_starts(len(tokens), 512, 256, 4, 'dev')}, key weights {args.key_weights}, "
          f"{seconds:.0f} s")
    print("LEVELS = {")
    for (role, b), lv in sorted(levels.items()):
        print(f"    ({role!r}, {b}): ({', '.join(f'{x:.4f}' for x in lv)}),")
    print("}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"text": evaluate.default_text_name(), "key_weights": args.key_weights, "seconds": seconds,
                       "levels": {f"{r}{b}": lv for (r, b), lv in levels.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
