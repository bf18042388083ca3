"""What every `kivi-jax` subcommand shares: argparse value validators (integers, finite floats, UTF-8 text, writable
output files), the one rule for flags that do not apply to the chosen configuration, and clean process exits
(Ctrl-C -> 130, a closed stdout pipe -> 141, neither with a traceback).

Validators are argparse `type=` callables: a bad value fails while the command line is parsed, before any model
loads, with `argument --flag: <what is wrong>; <what is allowed>`.
"""

from __future__ import annotations

import _thread
import argparse
import atexit
import functools
import math
import os
import signal
import sys
import time
from pathlib import Path

from kivi_jax.config import SPEC_HELP
from kivi_jax.quant import SUPPORTED_BITS

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what shells report when the reader of stdout went away


# ---------------------------------------------------------------------------------------------------------------------
# Value validators


def integer(minimum: int | None = None, maximum: int | None = None):
    """An argparse type: a whole number in `[minimum, maximum]` (either bound optional)."""
    allowed = _range_text(minimum, maximum, "an integer")

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give {allowed}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {allowed}")
        return value

    parse.__name__ = "integer"
    return parse


def real(minimum: float | None = None, maximum: float | None = None, above: bool = False):
    """An argparse type: a finite float in `[minimum, maximum]` (`above=True`: strictly above `minimum`)."""
    low = "" if minimum is None else (f"> {minimum:g}" if above else f">= {minimum:g}")
    high = "" if maximum is None else f"<= {maximum:g}"
    allowed = "a finite number" + (f" {low}" if low else "") + (" and" if low and high else "") + (f" {high}" if high else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {allowed}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite; give {allowed}")
        if minimum is not None and (value <= minimum if above else value < minimum):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; give {allowed}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; give {allowed}")
        return value

    parse.__name__ = "number"
    return parse


def _range_text(minimum, maximum, what: str) -> str:
    if minimum is not None and maximum is not None:
        return f"{what} from {minimum} to {maximum}"
    if minimum is not None:
        return f"{what} >= {minimum}"
    if maximum is not None:
        return f"{what} <= {maximum}"
    return what


def undecodable_bytes(text: str) -> list[tuple[int, int]]:
    """(position, byte) of each byte that was not UTF-8 where `text` came from (Python maps those to lone surrogates:
    U+DC80..U+DCFF for command-line arguments and file names on POSIX)."""
    return [(i, ord(c) - 0xDC00 if 0xDC80 <= ord(c) <= 0xDCFF else ord(c))
            for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF]


def utf8_text(text: str) -> str:
    """An argparse type: text that is valid UTF-8 (so a tokenizer can read it)."""
    bad = undecodable_bytes(text)
    if bad:
        where = ", ".join(f"0x{b:02x} at character {i}" for i, b in bad[:3])
        raise argparse.ArgumentTypeError(
            f"is not valid UTF-8 (undecodable byte {where}); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)"
        )
    return text


def writable_file(text: str) -> str:
    """An argparse type: a file path that can be written (its directory exists and is writable, and it is not a
    directory); '' passes through and means 'no file'. Checked when the command line is parsed, so an expensive run
    never ends in an unwritable output."""
    if text == "":
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the directory {parent} does not exist")
    try:  # a real probe: permission bits do not tell (root, read-only mounts)
        if path.exists():
            open(path, "ab").close()  # opened for appending, nothing written: the content stays
        else:
            open(path, "xb").close()
            path.unlink()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}; give a path you can write to") from None
    return text


# ---------------------------------------------------------------------------------------------------------------------
# The one rule for flags that do not apply to the chosen configuration


def add_conditional(p: argparse.ArgumentParser, flag: str, applies, why_not: str, **kwargs) -> None:
    """Adds `flag` (default None, so 'not given' is visible) that is only meaningful when `applies(args)` is true;
    `check_applicable` turns giving it otherwise into an error naming the flag and `why_not`. The rules live on the
    subcommand's own parser (`args.conditional_flags`), so the same dest may mean different things elsewhere."""
    action = p.add_argument(flag, default=None, **kwargs)
    rules = p.get_default("conditional_flags")
    if rules is None:
        rules = []
        p.set_defaults(conditional_flags=rules)
    rules.append((action.dest, flag, applies, why_not))


def check_applicable(args: argparse.Namespace) -> None:
    """Raises ValueError for a conditional flag given where it does not apply (e.g. `--group-size` with
    `--cache full`): nothing is silently ignored or silently changes the configuration."""
    for dest, flag, applies, why_not in getattr(args, "conditional_flags", None) or ():
        if getattr(args, dest, None) is not None and not applies(args):
            raise ValueError(f"{flag} does not apply here: {why_not}")


# ---------------------------------------------------------------------------------------------------------------------
# Clean exits


def silence_stdout() -> None:
    """After the reader of stdout went away: point stdout at /dev/null, so the interpreter's final flush does not
    print a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured under a test runner)
        pass


def run(func, *args) -> int:
    """`func(*args)` with Ctrl-C and a closed stdout pipe turned into quiet exits (130 and 141).

    Two things make Ctrl-C in a JAX program more than a KeyboardInterrupt:
    - Python runs the SIGINT handler at its next bytecode, which may be inside a callback that cannot raise (jax's gc
      callback, run by an allocation in XLA's C++ code): the KeyboardInterrupt is printed as "Exception ignored" and
      the program goes on. `_redeliver_interrupt` raises it again in the program itself.
    - An XLA compile runs on XLA's thread pool; Ctrl-C ends only the wait for it. At exit jax's atexit `clean_up`
      destroys the CPU client while that compile is still running, and the compile thread then crashes (SIGSEGV).
      An interrupted process therefore ends with `os._exit` at its own exit, after the output is flushed and every
      `finally` has run, skipping the interpreter's teardown (see `_exit_at_exit`).
    """
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver_interrupt, previous_hook)
    try:
        return func(*args)
    except KeyboardInterrupt:
        print("\nkivi-jax: interrupted", file=sys.stderr)
        atexit.register(_exit_at_exit, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        sys.unraisablehook = previous_hook


def _redeliver_interrupt(previous_hook, unraisable) -> None:
    """A `sys.unraisablehook`: a KeyboardInterrupt that landed where it cannot be raised (a gc callback, a `__del__`)
    is delivered again to the main thread, from another thread so that it lands after the callback returns (should it
    land in one again, this hook sees it again)."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _thread.start_new_thread(_interrupt_main_soon, ())  # not threading.Thread: its start() waits, running code
        return
    previous_hook(unraisable)


def _interrupt_main_soon() -> None:
    time.sleep(0.01)  # the callback that swallowed the interrupt has returned by then
    _thread.interrupt_main(signal.SIGINT)


def _exit_at_exit(code: int) -> None:
    """Registered last, so it runs first at exit: flush and leave without the teardown (jax's `clean_up` and the
    interpreter's finalization) that an abandoned compile would crash."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def add_impl_arg(p: argparse.ArgumentParser) -> None:
    """`--attention-impl`, shared by every subcommand that runs the model (choices: kivi_jax.cache.ATTENTION_IMPLS)."""
    from kivi_jax.cache import ATTENTION_IMPLS

    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                   help="decode attention: Pallas kernel on GPU, C++ kernel on CPU (auto), the XLA path, or forced "
                        "(pallas on CPU runs in interpret mode, slowly); native-int8: the C++ kernel dots 2-bit keys "
                        "and values in integers (AVX-512 VBMI; faster, rounding measured in docs/benchmarks.md)")


def weights_name(text: str) -> str:
    """`--weights`: a weight format (kivi_jax.weights.WEIGHTS_HELP), checked when the command line is parsed."""
    from kivi_jax.weights import check_weights

    try:
        return check_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    """`--weights`, shared by every subcommand that loads a model."""
    p.add_argument("--weights", type=weights_name, default="auto", metavar="FORMAT",
                   help="how the weights are held (default auto: a GGUF such as smollm2 keeps its own Q8_0/Q4_1 "
                        "blocks; others their float weights); float32, bfloat16, gguf, int8, int4-g32, int4-g64, "
                        "int4-g128, int4s-gG")


# ---------------------------------------------------------------------------------------------------------------------
# The flags shared by the subcommands that load a model: model, cache, sampling, mesh

DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name: str | None):
    if name is None:
        return None
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def cache_from_args(args):
    """The cache spec from `--cache` with `--k-bits/--v-bits/--group-size/--residual-length` overrides (which apply
    to KIVI caches only: with `--cache full` they are an error, see check_applicable)."""
    import dataclasses

    from kivi_jax.config import parse_cache_spec

    check_applicable(args)
    spec = parse_cache_spec(args.cache)
    overrides = {k: v for k, v in (("k_bits", args.k_bits), ("v_bits", args.v_bits), ("group_size", args.group_size),
                                   ("residual_length", args.residual_length)) if v is not None}
    if not overrides:
        return spec
    return dataclasses.replace(spec, **overrides)


def _is_kivi(args) -> bool:
    from kivi_jax.config import KIVIConfig, parse_cache_spec

    return isinstance(parse_cache_spec(args.cache), KIVIConfig)


_NOT_FOR_FULL = ("only a KIVI cache has bits, groups and a residual (not --cache full, int8 or fp8); drop the flag or "
                 "choose a KIVI cache (--cache kivi2, kivi4, kivi2+, kivi3+ or k<bits>v<bits>[-g<G>][-r<R>])")


def _is_sampling(args) -> bool:
    return not getattr(args, "greedy", False) and bool(getattr(args, "temperature", None))


def add_cache_args(p: argparse.ArgumentParser, default: str = "kivi2") -> None:
    p.add_argument("--cache", default=default, help=f"cache kind (default {default}); {SPEC_HELP}")
    add_conditional(p, "--k-bits", _is_kivi, _NOT_FOR_FULL, type=int, choices=SUPPORTED_BITS,
                             help="override the key bits of a KIVI --cache")
    add_conditional(p, "--v-bits", _is_kivi, _NOT_FOR_FULL, type=int, choices=SUPPORTED_BITS,
                             help="override the value bits of a KIVI --cache")
    add_conditional(p, "--group-size", _is_kivi, _NOT_FOR_FULL, type=integer(1),
                             help="override the group size G of a KIVI --cache")
    add_conditional(p, "--residual-length", _is_kivi, _NOT_FOR_FULL, type=integer(1),
                             help="override the residual length R of a KIVI --cache (a multiple of G)")
    add_impl_arg(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags of generate and chat (and the prefill chunk)."""
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default unless --temperature is given)")
    p.add_argument("--temperature", type=real(0.0), default=None, help="sampling temperature (> 0 samples; 0 = greedy)")
    not_sampling = "greedy decoding (no --temperature, or --greedy) ignores it; add --temperature T > 0 to sample"
    add_conditional(p, "--top-k", _is_sampling, not_sampling, type=integer(0),
                             help="sample from the K most likely tokens (0 = no cut; needs --temperature)")
    add_conditional(p, "--top-p", _is_sampling, not_sampling, type=real(0.0, 1.0, above=True),
                             help="sample from the smallest set of tokens with mass P, in (0, 1] (needs --temperature)")
    p.add_argument("--seed", type=integer(0, 2**32 - 1), default=0, help="sampling seed (default 0)")
    p.add_argument("--prefill-chunk", type=integer(1), default=512,
                   help="prompt tokens a prefill call takes; longer prompts go in chunks of that shape (default 512)")


def sampling_from_args(args) -> dict:
    """The sampling keywords of generate / Chat from the shared flags."""
    temperature = 0.0 if args.greedy or args.temperature is None else args.temperature
    return dict(temperature=temperature, top_k=0 if args.top_k is None else args.top_k,
                top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed, prefill_chunk=args.prefill_chunk)


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """`--mesh` and the multi-host flags, one definition for every subcommand that runs a model."""
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run sharded over a device mesh: the batch split D ways, heads, MLP and vocabulary M ways "
                        "(D x M = the device count, devices taken in order; see docs/sharding.md)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: process 0's address for jax.distributed (or JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="multi-host: processes in all (or JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index (or JAX_PROCESS_ID)")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host on a cluster jax detects itself (TPU slice, SLURM, Open MPI): no other flags")


def mesh_from_args(args):
    """Starts jax.distributed if the flags or environment ask for it, then builds `--mesh` (None without it)."""
    from kivi_jax import sharding

    sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id, args.distributed)
    return sharding.resolve_mesh(args.mesh)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default; fetched and converted once) or a path: HF directory, .gguf, kivi_jax checkpoint")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: as stored, float32)")
    add_weights_arg(p)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1024,4096")
    return values


def spec_list(text: str) -> list[str]:
    from kivi_jax.bench import split_impl
    from kivi_jax.config import parse_cache_spec

    specs = [s.strip() for s in text.split(",") if s.strip()]
    for s in specs:
        try:
            parse_cache_spec(split_impl(s)[0])
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not specs:
        raise argparse.ArgumentTypeError("give at least one cache spec, e.g. full,kivi2")
    return specs


def text_table(header: list[str], rows: list[list]) -> str:
    """Rows under a header, right-aligned columns, a dashed rule under the header."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
