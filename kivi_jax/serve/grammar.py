"""Structured output (`response_format`): a grammar compiled with xgrammar, one matcher a choice, a token bitmask for
each decode step (docs/serving.md).

xgrammar (the `grammar` extra) is imported on first use, in the request's parsing thread, never by the server at
start. Why xgrammar rather than outlines-core: `json_object` needs JSON itself, a context-free language, which
xgrammar compiles as a grammar (any nesting) in about 40 ms for SmolLM2's 49152 tokens, while outlines-core works
from regular expressions (JSON to a fixed depth) and built that index in 43 s here; a JSON schema compiled in 30 ms
against 0.8 s; both fill a step's mask in microseconds. The price is xgrammar's dependencies (torch, transformers,
triton): the `test` extra already has torch and transformers.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

import numpy as np

GRAMMAR_EXTRA = 'pip install "kivi-jax[grammar]" (from a checkout: pip install ".[grammar]")'
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class GrammarUnavailable(RuntimeError):
    """xgrammar (the `grammar` extra) is not installed."""


class GrammarError(ValueError):
    """A response_format that cannot be compiled (an invalid or unsupported schema)."""


FAULT_SIGNALS = ("SIGSEGV", "SIGBUS")


def fault_handlers() -> dict[str, bytes] | None:
    """The process's handlers of FAULT_SIGNALS as raw `struct sigaction` bytes (POSIX; None elsewhere)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    out = {}
    for name in FAULT_SIGNALS:
        buf = ctypes.create_string_buffer(256)  # larger than any platform's struct sigaction
        if libc.sigaction(int(getattr(signal, name)), None, buf) != 0:
            return None
        out[name] = buf.raw
    return out


def fault_handler_addresses(saved: dict[str, bytes] | None = None) -> dict[str, int] | None:
    """The address of each FAULT_SIGNALS handler (`sa_handler`, the first member of `struct sigaction`) in `saved`
    (`fault_handlers()`'s result; None: the process's now), for checks."""
    import ctypes

    saved = fault_handlers() if saved is None else saved
    return None if saved is None else {k: ctypes.c_void_p.from_buffer_copy(v[:8]).value for k, v in saved.items()}


def _restore_fault_handlers(saved: dict[str, bytes] | None) -> None:
    import ctypes
    import signal

    if saved is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for name, raw in saved.items():
        libc.sigaction(int(getattr(signal, name)), ctypes.create_string_buffer(raw, len(raw)), None)


def _xgrammar():
    """xgrammar, imported with the process's fault handlers kept: its tvm_ffi library installs a SIGSEGV handler at
    load that backtraces with the C++ unwinder, which deadlocks when the fault is inside the unwinder (seen here: an
    XLA:CPU compile error being unwound), so a crash would hang the process instead of ending it."""
    saved = fault_handlers()
    try:
        import xgrammar
    except ImportError as e:
        _restore_fault_handlers(saved)
        raise GrammarUnavailable(f"response_format needs the grammar extra (xgrammar), which is not installed ({e}); "
                                 f"install it: {GRAMMAR_EXTRA}") from None
    _restore_fault_handlers(saved)
    return xgrammar


class Grammar:
    """A compiled grammar; `matcher()` gives one choice its own state (a `Matcher`)."""

    def __init__(self, compiled, stop_ids: tuple[int, ...], description: str):
        self.compiled, self.stop_ids, self.description = compiled, stop_ids, description

    def matcher(self) -> "Matcher":
        xgr = _xgrammar()
        return Matcher(xgr.GrammarMatcher(self.compiled, override_stop_tokens=list(self.stop_ids)))


class Matcher:
    """One choice's place in its grammar: `fill_bitmask(row)` writes the tokens allowed next (bit t % 32 of int32
    word t // 32), `accept(token)` advances past a drawn token. Once the grammar is complete only a stop token is
    allowed, and drawing one ends the choice."""

    def __init__(self, matcher):
        self._m = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        if self._m.is_terminated():  # past a stop token: nothing further is asked of it
            return
        self._m.fill_next_token_bitmask(row[None], 0)

    def accept(self, token: int) -> bool:
        return False if self._m.is_terminated() else bool(self._m.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class Compiler:
    """Compiles response_format values for one tokenizer and vocabulary (lazily: xgrammar's tokenizer info is built
    on the first request that needs it, from the tokenizer `tokenizer()` returns, None for none). Thread-safe."""

    def __init__(self, tokenizer: Callable[[], object], vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, tuple(sorted(stop_ids))
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                tokenizer = self.tokenizer()
                if tokenizer is None:
                    raise GrammarError("this model has no tokenizer, so no grammar can be mapped onto its tokens")
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, response_format) -> Grammar | None:
        """A Grammar for an OpenAI `response_format` (None for `{"type": "text"}`); GrammarError says what is wrong
        with it, GrammarUnavailable that the extra is missing."""
        if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMATS:
            raise GrammarError("response_format must be an object whose type is one of "
                               f"{', '.join(RESPONSE_FORMATS)}")
        kind = response_format["type"]
        extra = set(response_format) - {"type", "json_schema"}
        if extra:
            raise GrammarError(f"response_format has unknown keys: {', '.join(sorted(map(str, extra)))[:200]}")
        if kind == "text":
            return None
        if kind == "json_object":  # any JSON object, compact (as a schema of one object, extra properties allowed)
            compiled = self._get().compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            return Grammar(compiled, self.stop_ids, "json_object")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError('a json_schema response_format needs "json_schema": {"name": ..., "schema": {...}}')
        schema = spec["schema"]
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema.schema must be a JSON Schema (an object), not {type(schema).__name__}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("json_schema.strict must be true or false")
        compiler = self._get()
        try:
            # compact JSON (no free whitespace: a model cannot loop on blanks); strict: no properties but the schema's
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    strict_mode=strict is not False)
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError / ValueError with its converter's reason)
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarError(f"json_schema.schema cannot be compiled: {reason[:300]}") from None
        return Grammar(compiled, self.stop_ids, f"json_schema {spec.get('name', '')!s}"[:80])
