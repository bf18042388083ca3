"""`kivi-jax eval ablate`'s measurement, spec by spec, saved as it goes: for long sweeps on a slow or shared machine.

    python scripts/eval_incremental.py run eval out.jsonl kivi2+,kivi3+,k3v2-g64   # one JSON line a spec (full first)
    python scripts/eval_incremental.py table out.jsonl [more.jsonl ...] --md docs/ablation.md --plot docs/ablation.png
        [--peer docs/bench/quanto_smollm2.json]

`run` scores the same windows with the same protocol as `kivi-jax eval` (prefill 512, decode 256, 4 windows of the
default text; `dev` for the development split) through `kivi_jax.evaluate.teacher_forced`, full precision first, and
appends a line per spec as soon as it is done, so an interrupted sweep keeps what it measured. `table` merges files
(each run's ΔNLL against its own full-precision run, which is the same on the same split) into the ablation's
markdown table and plots.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def run(split: str, out_path: str, specs: list[str]) -> None:
    import kivi_jax
    from kivi_jax import evaluate
    from kivi_jax.config import parse_cache_spec, spec_name

    model = kivi_jax.load("smollm2", progress=False)
    tokens = evaluate.tokenize(model.tokenizer, evaluate.default_text())
    windows = evaluate.make_windows(tokens, 512, 256, 4, split)
    for s in ["full"] + specs:
        t0 = time.time()
        out = evaluate.teacher_forced(model.params, windows, 512, s, None if s == "full" else full["logprobs"])
        if s == "full":
            full = out
        row = {"spec": spec_name(parse_cache_spec(s)), "alias": s, "split": split, "nll": float(out["nll"].mean()),
               "nll_per_window": out["nll"].mean(1).tolist(), "kl_vs_full": float(out["kl"].mean()),
               "top1_agree": float(out["top1"].mean()), "seconds": time.time() - t0,
               "head_dim": model.params.config.head_dim, "num_layers": model.params.config.num_layers}
        with open(out_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['spec']}: NLL {row['nll']:.4f} ({row['seconds']:.0f} s)", flush=True)


def table(paths: list[str], md: str | None, plot: str | None, peer: str | None) -> None:
    from kivi_jax import evaluate

    results, head_dim, num_layers = {}, None, None
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                results[row["spec"]] = row
                head_dim, num_layers = row.get("head_dim", head_dim), row.get("num_layers", num_layers)
    rows = evaluate.ablation_rows(results, head_dim, 512 + 256, num_layers)
    peer_rows = evaluate.peer_rows(json.load(open(peer, encoding="utf-8"))) if peer else []
    text = evaluate.ablation_markdown(rows)
    print(text, end="")
    if md:
        with open(md, "w", encoding="utf-8") as f:
            f.write("Ablation (SmolLM2, pydoc prose, 4 windows, prefill 512, decode 256): ΔNLL against full "
                    f"precision through the cache.\n\n{text}")
    if plot:
        from kivi_jax.plots import plot_ablation, plot_tradeoff

        plot_ablation(rows, "KIVI ablation and beyond: SmolLM2, 4 windows, prefill 512, decode 256", plot)
        stem = plot.rsplit(".", 1)[0]
        plot_tradeoff(rows + peer_rows, "ΔNLL against bits a value: SmolLM2, 4 windows", f"{stem}_bits.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("split", choices=("eval", "dev"))
    r.add_argument("out")
    r.add_argument("specs")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    t.add_argument("--md")
    t.add_argument("--plot")
    t.add_argument("--peer")
    args = p.parse_args(argv)
    if args.command == "run":
        run(args.split, args.out, [s for s in args.specs.split(",") if s])
    else:
        table(args.files, args.md, args.plot, args.peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
