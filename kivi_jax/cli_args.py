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
                        "(pallas on CPU runs in interpret mode, slowly)")


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
