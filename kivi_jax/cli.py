"""`kivi-jax generate | chat | serve | convert | eval | bench`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kivi_jax import cli_args
from kivi_jax.cli_args import (DTYPES, _dtype, add_cache_args, add_mesh_args, add_model_args,  # noqa: F401
                               add_sampling_args, cache_from_args, integer, mesh_from_args, sampling_from_args,
                               utf8_text, writable_file)
from kivi_jax.config import REFERENCE, SPEC_HELP, is_reference
from kivi_jax.quant import SUPPORTED_BITS

def cmd_generate(args) -> int:
    import kivi_jax
    from kivi_jax.generate import Generation, start
    from kivi_jax.runtime import TextStream

    spec = cache_from_args(args)  # a bad cache spec or flag fails before the model loads
    mesh = mesh_from_args(args)
    t0 = time.perf_counter()
    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=not args.json, mesh=mesh, weights=args.weights)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    session = start(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        **sampling_from_args(args),
        cache=spec,
        max_length=args.max_length,
        attention_impl=args.attention_impl,
        mesh=mesh,
    )
    tok = model.tokenizer
    text = TextStream(tok)
    for step in session.steps:
        if step.tokens[0] >= 0:
            text.add(int(step.tokens[0]))
        if not args.json and tok is not None:
            sys.stdout.write(text.piece(final=bool(step.done[0])))
            sys.stdout.flush()
    ids = text.ids
    gen = Generation(
        sequences=[ids],
        prompt_lengths=[len(session.prompts[0])],
        texts=None if tok is None else [text.text],
        single=True,
        seconds=time.perf_counter() - t1,
        prefill_seconds=session.result["prefill_seconds"],
        overflow=session.result["overflow"],
        cache_stats=session.result.get("cache"),
        seed=session.result.get("seed"),
    )
    held = weights_summary(model.params)
    if args.json:
        out = gen.to_json()
        out.update({"model": args.model, "cache": kivi_jax.config.spec_name(spec), "load_seconds": round(load_s, 4),
                    **held})
        print(json.dumps(out))
    else:
        if tok is None:
            sys.stdout.write(" ".join(map(str, ids)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        if gen.cache_stats is not None:
            print(f"kivi-jax: {cache_summary(gen.cache_stats)}; weights {held['weights']}, "
                  f"{held['weight_bytes'] / 2**20:.2f} MiB", file=sys.stderr)
    return 0


def weights_summary(params) -> dict:
    """What the weights are held as and their bytes (beside the cache's in every report)."""
    from kivi_jax import weights
    from kivi_jax.cache import tree_bytes

    return {"weights": weights.summary(params), "weight_bytes": int(tree_bytes(params))}


CHAT_HELP = "/reset  forget the conversation\n/save PATH  save it (and its cache)\n/load PATH  continue a saved one\n" \
            "/stats  tokens and bytes in the cache\n/exit  leave (or EOF, Ctrl-D)"


def cmd_chat(args) -> int:
    import kivi_jax
    from kivi_jax.chat import Chat, ConversationFullError

    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=True, weights=args.weights)
    chat = Chat(model, cache_from_args(args), system=args.system, max_new_tokens=args.max_new_tokens,
                max_length=args.max_length, attention_impl=args.attention_impl, **sampling_from_args(args))
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:  # EOF
            if interactive:
                sys.stdout.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            rest = rest.strip()
            if command == "/exit":
                return 0
            if command == "/reset":
                chat.reset()
                print("(conversation reset)")
            elif command in ("/save", "/load") and not rest:
                print(f"{command} needs a path, e.g. {command} conversation.kivi", file=sys.stderr)
            elif command in ("/save", "/load"):
                try:
                    chat.save(rest) if command == "/save" else chat.load(rest)
                except (ValueError, OSError) as e:  # a bad path or save: say so, keep the conversation
                    print(f"kivi-jax: {e}", file=sys.stderr)
                    continue
                print(f"(saved to {rest})" if command == "/save" else f"(loaded {rest}: {chat.turns} turns)")
            elif command == "/stats":
                print(json.dumps(chat.stats()))
            elif command == "/help":
                print(CHAT_HELP)
            else:
                print(f"unknown command {command}; the commands are:\n{CHAT_HELP}", file=sys.stderr)
            continue
        if interactive:
            sys.stdout.write("bot> ")
        try:
            for piece in chat.stream(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ConversationFullError as e:  # the conversation goes on being usable: /save, /reset
            print(f"kivi-jax: {e}", file=sys.stderr)
        sys.stdout.write("\n")
        sys.stdout.flush()


def cache_summary(stats: dict) -> str:
    """One line on what the cache did: tokens, how many were quantized, bytes against a full-precision cache."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    n, kq, vq = stats["tokens"][0], stats["keys_quantized"][0], stats["values_quantized"][0]
    if is_reference(stats["cache"]):
        return f"full cache: {n} tokens in full precision, {mib(stats['bytes'])}"
    r = stats["residual_length"]
    note = (f"; all within the {r}-token full-precision residual, so the output equals the full cache's "
            "(prompt and answer must pass it to exercise quantization)") if kq == 0 and vq == 0 and r else ""
    return (f"{stats['cache']} cache: {n} tokens, keys of {kq} and values of {vq} of them quantized{note}; "
            f"{mib(stats['bytes'])} for {stats['max_tokens']} tokens against {mib(stats['full_bytes'])} in full "
            f"precision ({stats['bytes'] / stats['full_bytes']:.3f}x)")


def cmd_convert(args) -> int:
    from kivi_jax import checkpoint, hub

    src = args.src
    checkpoint.check_output_dir(args.out)  # before any download or conversion
    if src in hub.MODELS:
        src = str(hub.fetch_gguf(src))
    out = checkpoint.convert(src, args.out, _dtype(args.dtype), progress=True, weights=args.weights)
    print(f"wrote {out}", file=sys.stderr)
    return 0


EVAL_DEFAULT_CACHES = "full,kivi2,kivi4"


def _eval_model_and_text(args):
    """The model and the token ids of `--text` (default: the pydoc prose) for an eval command."""
    import kivi_jax
    from kivi_jax import evaluate

    if args.text is None:
        text, name = evaluate.default_text(), evaluate.default_text_name()
    else:  # read before the model loads, so a bad file fails fast
        try:
            with open(args.text, encoding="utf-8") as f:
                text, name = f.read(), args.text
        except UnicodeDecodeError as e:
            raise ValueError(f"--text {args.text} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                             f"{e.start}); give a UTF-8 text file") from None
        except OSError as e:
            raise ValueError(f"cannot read --text {args.text}: {e.strerror or e}; give a UTF-8 text file") from None
    model = kivi_jax.load(args.model, _dtype(args.dtype), progress=not args.json, mesh=args.mesh_obj,
                          weights=args.weights)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; eval needs one to turn --text into tokens")
    return model, evaluate.tokenize(model.tokenizer, text), name


def _progress_bar(total: int, show: bool):
    """A tqdm bar on stderr over decode steps, and the `progress(spec, steps)` callback that advances it."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="step", file=sys.stderr, disable=not show, leave=False)

    def progress(name: str, steps: int) -> None:
        bar.set_description(name, refresh=False)
        bar.update(steps)

    return bar, progress


def _run_eval(args, specs: list[str]) -> tuple[dict, dict]:
    """Runs the teacher-forced protocol for `specs`; returns the JSON header and the results."""
    from kivi_jax import evaluate

    evaluate.check_protocol(args.prefill, args.decode, args.windows)
    args.mesh_obj = mesh_from_args(args)
    model, tokens, text_name = _eval_model_and_text(args)
    windows = evaluate.make_windows(tokens, args.prefill, args.decode, args.windows, args.split)
    n_specs = len(set(specs) | {REFERENCE})
    bar, progress = _progress_bar(n_specs * args.decode, show=not args.quiet)
    try:
        results = evaluate.evaluate(model.params, windows, args.prefill, specs, args.attention_impl, progress,
                                    mesh=args.mesh_obj,
                                    prefill_precision=getattr(args, "prefill_precision", "float32"),
                                    decode_precision=getattr(args, "decode_precision", "float32"))
    finally:
        bar.close()
    header = {"model": args.model, "text": text_name, "text_tokens": int(len(tokens)),
              "window_starts": evaluate.window_starts(len(tokens), args.prefill, args.decode, args.windows, args.split),
              "split": args.split, "prefill": args.prefill, "decode": args.decode, "windows": args.windows,
              "head_dim": model.params.config.head_dim, "num_layers": model.params.config.num_layers,
              "prefill_precision": getattr(args, "prefill_precision", "float32"),
              "decode_precision": getattr(args, "decode_precision", "float32")}
    return header, results


def _split_specs(text: str) -> list[str]:
    from kivi_jax.config import parse_cache_spec, spec_name

    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ValueError("--cache names no cache spec")
    return [spec_name(parse_cache_spec(s)) for s in specs]  # a bad spec fails here, before the model loads


def cmd_eval_ppl(args) -> int:
    from kivi_jax import evaluate

    header, results = _run_eval(args, _split_specs(args.cache))
    if args.json:
        print(json.dumps({**header, "results": results}))
        return 0
    print(f"model {header['model']}; text {header['text']} ({header['text_tokens']} tokens); {header['windows']} "
          f"windows at {header['window_starts']}: prefill {header['prefill']}, then {header['decode']} tokens scored "
          "one at a time through the cache")
    print(evaluate.format_results(results))
    return 0


def cmd_eval_ablate(args) -> int:
    from kivi_jax import evaluate

    specs = evaluate.ablation_specs() if args.cache is None else _split_specs(args.cache)
    if args.plot:
        from kivi_jax.plots import _pyplot

        _pyplot()  # matplotlib missing: say so before the ablation runs, not after
    peer = None
    if args.peer:
        try:
            with open(args.peer, encoding="utf-8") as f:
                peer = evaluate.peer_rows(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--peer {args.peer}: not a report of scripts/compare_hf_quantized_cache.py --json "
                             f"({e})") from None
    header, results = _run_eval(args, specs)
    rows = evaluate.ablation_rows(results, header["head_dim"], args.prefill + args.decode, header["num_layers"])
    what = (f"{header['model']}, {header['text']}, {header['windows']} windows ({header['split']} split), prefill "
            f"{header['prefill']}, decode {header['decode']}")
    table = evaluate.ablation_markdown(rows)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"KIVI ablation ({what}): ΔNLL against full precision through the cache.\n\n{table}")
    if args.plot:
        from kivi_jax.plots import plot_ablation, plot_tradeoff

        plot_ablation(rows, f"KIVI ablation: {what}", args.plot)
        plot_tradeoff(rows + (peer or []), f"ΔNLL against bits a value: {what}", tradeoff_path(args.plot))
    if args.json:
        print(json.dumps({**header, "results": results, "rows": rows, "peer_rows": peer or []}))
    else:
        print(f"ΔNLL against full precision ({what})")
        print(table, end="")
        wrote = [p for p in (args.out, args.plot, args.plot and tradeoff_path(args.plot)) if p]
        if wrote:
            print(f"wrote {', '.join(wrote)}", file=sys.stderr)
    return 0


def tradeoff_path(plot: str) -> str:
    """Where `eval ablate` writes the ΔNLL-against-bits plot beside its `--plot` (ablation.png -> ablation_bits.png)."""
    stem, dot, ext = plot.rpartition(".")
    return f"{stem}_bits.{ext}" if dot else f"{plot}_bits"


def cmd_eval_errors(args) -> int:
    import numpy as np

    from kivi_jax import evaluate

    if args.tokens < args.group_size or args.tokens % args.group_size:
        raise ValueError(f"--tokens {args.tokens} must be a positive multiple of --group-size {args.group_size}")
    if args.windows < 1:
        raise ValueError(f"--windows must be at least 1 (got {args.windows})")
    args.mesh_obj = None  # the error diagnostics run on one device
    model, tokens, text_name = _eval_model_and_text(args)
    if len(tokens) < args.tokens:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than --tokens {args.tokens}")
    starts = evaluate.window_starts(len(tokens), args.tokens - 1, 0, args.windows)
    windows = np.stack([tokens[s : s + args.tokens] for s in starts])
    errors = evaluate.consumption_errors(model.params, windows, args.bits, args.group_size)
    summary = evaluate.errors_summary(errors)
    if args.json:
        print(json.dumps({"model": args.model, "text": text_name, "tokens": args.tokens, "windows": args.windows,
                          "window_starts": starts, "bits": args.bits, "group_size": args.group_size,
                          "per_layer": {k: v.tolist() for k, v in errors.items()}, "summary": summary}))
        return 0
    print(f"relative error (Frobenius) of {args.bits}-bit quantization, groups of {args.group_size}, every token "
          f"quantized; {args.windows} windows of {args.tokens} tokens of {text_name}; 'out' = softmax(q·k)·v with only "
          "the keys (K) or only the values (V) quantized")
    print(evaluate.format_errors(errors))
    print(evaluate.errors_summary_line(summary))
    print(f"\nbeyond KIVI, one option at a time on KIVI's axes (keys per-channel, values per-token): keys quantized "
          f"before RoPE, keys or values in the rotated basis, the first {evaluate.SINKS} tokens kept exact")
    print(evaluate.format_errors(errors, evaluate.BEYOND_COLUMNS))
    return 0


def cmd_eval_longctx(args) -> int:
    from kivi_jax import longctx

    specs = _split_specs(args.cache)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in longctx.TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: choose from {', '.join(longctx.TASKS)}")
    lengths = longctx.parse_lengths(args.lengths, args.cases)
    if args.plot:
        from kivi_jax.plots import _pyplot

        _pyplot()  # matplotlib missing: say so before the run, not after
    if args.report_only:
        if not args.results:
            raise ValueError("--report-only reports the cases of a --results file; give one")
        rep = longctx.report_file(args.results, specs, tasks, lengths, args.documents)
        tokens, text_name = None, f"the cases in {args.results}"
    else:
        args.mesh_obj = None  # one device
        model, tokens, text_name = _eval_model_and_text(args)
        log = None if args.quiet or args.json else (lambda line: print(line, file=sys.stderr, flush=True))
        rep = longctx.run(model, specs, tasks, lengths, args.results, tokens, args.documents,
                          impl=args.attention_impl, log=log)
    what = f"{args.model}, {text_name}, prefill chunks of {longctx.PREFILL_CHUNK}, greedy answers"
    table = longctx.markdown(rep)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"Long-context evaluation through the cache ({what}).\n\n{table}")
    if args.plot:
        from kivi_jax.plots import plot_longctx

        plot_longctx(rep, args.model, args.plot)
    if args.json:
        size = {} if tokens is None else {"text_tokens": int(len(tokens))}
        print(json.dumps({"model": args.model, "text": text_name, **size, **rep}))
    else:
        print(f"Long-context evaluation through the cache ({what})\n")
        print(table, end="")
    return 0


def _add_eval_common(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--text", default=None,
                   help="a UTF-8 text file to evaluate on (default: the prose of Python's pydoc_data.topics)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_protocol_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=integer(2), default=512, help="prompt tokens per window, prefilled at once (default 512)")
    p.add_argument("--decode", type=integer(1), default=256,
                   help="tokens then fed one at a time through the cache, each prediction scored (default 256)")
    p.add_argument("--windows", type=integer(1), default=4,
                   help="windows evenly spaced over the text, run as one batch (default 4)")
    from kivi_jax.evaluate import SPLITS

    p.add_argument("--split", choices=SPLITS, default="eval",
                   help="'eval' (default): the reported windows; 'dev': as many windows between them, disjoint from "
                        "them, for choosing a configuration without tuning on the reported windows")
    cli_args.add_impl_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    add_mesh_args(p)


def add_eval_parser(sub) -> None:
    """`kivi-jax eval ppl | ablate | errors | longctx`: quality through the cache (kivi_jax.evaluate, kivi_jax.longctx)."""
    from kivi_jax.weights import DECODE_PRECISIONS, PREFILL_PRECISIONS

    e = sub.add_parser("eval", help="quality through the cache: perplexity, the KIVI ablation, error diagnostics",
                       description="Quality of a cache configuration, measured through the cache (docs/design.md §6).")
    esub = e.add_subparsers(dest="eval_command", required=True)

    p = esub.add_parser(
        "ppl", help="NLL / perplexity, KL and top-1 agreement vs full precision, through the cache",
        description="Teacher-forced loss through the cache: windows of the text, each prefilled with --prefill tokens, "
                    "then --decode tokens fed one at a time through the cache, every prediction scored. 'full' is "
                    "always run first; KL(full || cache) and top-1 agreement are against it.",
        epilog=SPEC_HELP,
    )
    _add_eval_common(p)
    _add_protocol_args(p)
    p.add_argument("--cache", default=EVAL_DEFAULT_CACHES,
                   help=f"comma-separated cache specs (default {EVAL_DEFAULT_CACHES}); the grammar is below")
    p.add_argument("--prefill-precision", choices=PREFILL_PRECISIONS, default="float32",
                   help="the operands of the prefill's matmuls for every cache but the reference full (default "
                        "float32; bfloat16 or int8: as `serve --prefill-precision` prefills with them)")
    p.add_argument("--decode-precision", choices=DECODE_PRECISIONS, default="float32",
                   help="the operands of the scored decode steps' matmuls for every cache but the reference full "
                        "(default float32; int8: as `serve --decode-precision int8` decodes)")
    p.set_defaults(func=cmd_eval_ppl)

    a = esub.add_parser(
        "ablate", help="the KIVI ablation and beyond: axes, G, R, bits, pre-RoPE, sinks, rotations, presets; table and plots",
        description="Runs the ablation through the cache: the four key/value axis combinations at 2 bits (G32, R128), "
                    "G in {32, 64, 128}, R in {32, 64, 128, 256}, mixed bits k2v4 and k4v2, plus full and kivi4; then "
                    "beyond KIVI: pre-RoPE keys, sinks, rotated values and keys, 3-bit codes, each alone on kivi2, "
                    "then combined up to the presets kivi2+ and kivi3+; the 8-bit baselines int8, fp8-e4m3, "
                    "fp8-e5m2 and fp8-e4m3-tok; writes a markdown table (with bits a value) "
                    "and PNG plots of ΔNLL against full precision and against bits a value.",
        epilog=SPEC_HELP,
    )
    _add_eval_common(a)
    _add_protocol_args(a)
    a.add_argument("--cache", default=None, help="comma-separated specs to run instead of the ablation's")
    a.add_argument("--out", type=writable_file, default="ablation.md", help="markdown table to write (default ablation.md; '' for none)")
    a.add_argument("--plot", type=writable_file, default="ablation.png",
                   help="PNG plot to write (default ablation.png; '' for none), and beside it ΔNLL against bits a "
                        "value (ablation_bits.png)")
    a.add_argument("--peer", default=None,
                   help="a JSON report of scripts/compare_hf_quantized_cache.py --json (transformers' quanto cache on "
                        "the same windows), placed on the bits plot")
    a.set_defaults(func=cmd_eval_ablate)

    r = esub.add_parser(
        "errors", help="per-layer error of quantized keys/values: the tensor, the scores q·k, the attention output",
        description="On real activations of the model over the text: for each layer and each quantization axis, the "
                    "relative error of the keys and values themselves, of the attention scores q·k, and of the "
                    "attention output softmax(q·k)·v (the KIVI paper's analysis). Every token is quantized (no "
                    "residual).",
    )
    _add_eval_common(r)
    r.add_argument("--tokens", type=integer(1), default=512, help="tokens per window (a multiple of --group-size; default 512)")
    r.add_argument("--windows", type=integer(1), default=2, help="windows evenly spaced over the text (default 2)")
    r.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=2, help="bits for keys and values (default 2)")
    r.add_argument("--group-size", type=integer(1), default=32, help="group size G (default 32)")
    r.set_defaults(func=cmd_eval_errors)


    from kivi_jax import longctx

    lc = esub.add_parser(
        "longctx", help="long context: passkey retrieval, a needle in prose, long-document loss; table and plot",
        description="Through the cache as generation runs it (prefill in chunks, then greedy decoding): a 5-digit "
                    "pass key in filler and a made-up fact in the prose of --text, each at --cases depths from 0 to "
                    "100% per length, answered greedily and scored by exact match; and the teacher-forced loss of "
                    f"{longctx.SCORED} tokens after {', '.join(map(str, longctx.CONTEXTS))} tokens of --documents "
                    "documents, with KL and top-1 agreement against the full cache (always run, first). With "
                    "--results, each finished case is appended to that file and a rerun skips the cases it holds.",
        epilog=SPEC_HELP,
    )
    _add_eval_common(lc)
    lc.add_argument("--cache", default=",".join(longctx.SPECS),
                    help=f"comma-separated cache specs (default {','.join(longctx.SPECS)}); full always runs")
    lc.add_argument("--tasks", default=",".join(longctx.TASKS),
                    help=f"comma-separated tasks (default {','.join(longctx.TASKS)})")
    lc.add_argument("--lengths", default=",".join(map(str, longctx.LENGTHS)), metavar="LENGTH[:CASES],...",
                    help="retrieval prompt lengths in tokens, each optionally with its own case count (default "
                         f"{','.join(map(str, longctx.LENGTHS))}; capped at the model's positions less the answer)")
    lc.add_argument("--cases", type=integer(1), default=longctx.CASES,
                    help=f"retrieval cases a length, depths spread evenly over 0..100%% (default {longctx.CASES})")
    lc.add_argument("--documents", type=integer(1), default=longctx.DOCUMENTS,
                    help=f"documents for the long-document loss, evenly spaced over the text (default "
                         f"{longctx.DOCUMENTS})")
    lc.add_argument("--results", type=writable_file, default=None,
                    help="a JSON-lines file: each finished case is appended; a rerun skips the cases it holds")
    lc.add_argument("--out", type=writable_file, default="", help="markdown tables to write ('' for none, the default)")
    lc.add_argument("--plot", type=writable_file, default="",
                    help="PNG to write: accuracy against length, ΔNLL against context ('' for none, the default)")
    cli_args.add_impl_arg(lc)
    lc.add_argument("--report-only", action="store_true",
                    help="run nothing: the tables, plot and JSON of the cases the --results file holds")
    lc.add_argument("--quiet", action="store_true", help="no line per finished case on stderr")
    lc.set_defaults(func=cmd_eval_longctx)


def add_bench_parser(sub) -> None:
    """`kivi-jax bench decode | memory | generate`: speed and memory (kivi_jax.bench)."""
    from kivi_jax.bench_cli import add_bench_commands

    b = sub.add_parser("bench", help="decode speed, cache memory and generation throughput against the full cache")
    add_bench_commands(b.add_subparsers(dest="bench_command", required=True))


def build_parser() -> argparse.ArgumentParser:
    from kivi_jax import __version__

    parser = argparse.ArgumentParser(prog="kivi-jax", description="Llama/Mistral inference with a KIVI-quantized KV cache")
    parser.add_argument("--version", action="version", version=f"kivi-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streamed to the terminal")
    g.add_argument("--prompt", required=True, type=utf8_text, help="the prompt text (UTF-8)")
    add_model_args(g)
    g.add_argument("--max-new-tokens", type=integer(1), default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--max-length", type=integer(1), default=None,
                   help="cache size in tokens (default: prompt + new, rounded up; at most the model's positions)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_cache_args(g)
    add_mesh_args(g)
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser(
        "chat", help="a conversation on a live cache: each turn appends only its new tokens",
        description="A REPL: type a message, the reply streams back; the cache keeps the conversation, so a turn "
                    "prefills only its own tokens. Commands: /reset, /save PATH, /load PATH, /stats, /help, /exit. "
                    "Reads piped stdin too (one message a line).")
    add_model_args(ch)
    ch.add_argument("--system", default=None, help="a system message (default: the chat template's own)")
    ch.add_argument("--max-new-tokens", type=integer(1), default=256, help="the longest reply (default 256)")
    ch.add_argument("--max-length", type=integer(1), default=None,
                    help="initial cache size in tokens (default 1024; it grows as the conversation does)")
    add_sampling_args(ch)
    add_cache_args(ch)
    ch.set_defaults(func=cmd_chat)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file (or 'smollm2') into a kivi_jax checkpoint")
    c.add_argument("src", help="HF model directory, .gguf file, or a known model name")
    c.add_argument("out", help="output directory (must not exist)")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype of the float leaves (default float32)")
    cli_args.add_weights_arg(c)
    c.set_defaults(func=cmd_convert)

    add_eval_parser(sub)
    add_bench_parser(sub)
    from kivi_jax.serve.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    """The console script: exit 0 on success, 2 on a usage or input error (one line on stderr), 130 on Ctrl-C and
    141 when the reader of stdout went away (both quiet; see kivi_jax.cli_args)."""
    return cli_args.run(_main, argv)


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "greedy", False) and args.temperature:
        parser.error("--greedy and --temperature exclude each other")
    try:
        cli_args.check_applicable(args)
        return args.func(args)
    except BrokenPipeError:
        raise  # cli_args.run: a quiet exit
    except (ValueError, RuntimeError, OSError) as e:  # our errors say what is wrong and what would be right
        print(f"kivi-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
