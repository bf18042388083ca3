"""Requests over the engine: a bounded queue, a scheduler thread that owns the engine, stop strings, EOS, max_tokens
and incremental text. No HTTP here: a request carries an `emit` callback that receives its events.

The thread loops: drop cancelled requests (freeing their slots), admit waiting requests into free slots (prefill and
insert), then decode every live slot once. Text is decoded from all of a request's tokens each step and only the part
that can no longer change is emitted (not a half multi-byte character, not the start of a stop string). `cancel` takes
a waiting request out of the queue at once; `drain` (at shutdown) refuses new requests and ends the waiting ones,
while the live ones decode on.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import threading
import time
import traceback
import uuid
from typing import Callable

from kivi_jax.serve.engine import Engine
from kivi_jax.serve.sampling import RowSampling

TOKENS_PER_S_WINDOW = 10.0  # seconds over which /metrics' tokens/s is averaged
COUNTERS = ("requests_queued", "requests_rejected", "requests_finished", "requests_cancelled", "requests_failed",
            "prompt_tokens", "completion_tokens")


class QueueFull(RuntimeError):
    """The request queue is at its bound."""


class ShuttingDown(RuntimeError):
    """The server is shutting down: it admits no new request."""


SHUTTING_DOWN = "the server is shutting down; retry on another server or after it restarts"


@dataclasses.dataclass
class Event:
    """What a request's `emit` receives: `delta` (new text and token ids), then one `done` (or `error`)."""

    kind: str  # "delta" | "done" | "error"
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    message: str = ""
    status: int = 500  # of an error: 500 the engine failed, 503 the server is shutting down


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: RowSampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    generated: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # the text so far (stop-truncated once finished)
    sent_chars: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    slot: int | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt), len(self.generated)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may still change: a partial multi-byte character or the start of a stop
    string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


class Scheduler:
    """Owns the engine in its own thread; `submit` queues a request (or raises QueueFull at once)."""

    def __init__(self, engine: Engine, tokenizer=None, max_queue: int = 64, hold_prefixes: bool = True):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be at least 1")
        self.engine, self.tokenizer, self.max_queue = engine, tokenizer, max_queue
        self.hold_prefixes = hold_prefixes
        # A fast tokenizer must not encode and decode at once: the loop decodes with `tokenizer`, the HTTP side
        # encodes with its own copy, so a long prompt being tokenized never holds up the decode steps.
        self.tokenizer_lock = threading.Lock()
        self.encoder = copy.deepcopy(tokenizer)
        self.encoder_lock = threading.Lock()
        self.waiting: collections.deque[Request] = collections.deque()  # at most max_queue, oldest first
        self._waiting_changed = threading.Condition()  # guards `waiting` and `draining`
        self.draining = False
        self.active: dict[int, Request] = {}
        # every key exists from the start, so the HTTP thread can read while the loop counts (no dict resizes)
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self._counters_lock = threading.Lock()  # both threads count (cancellations, rejections)
        self._recent = collections.deque()  # (time, tokens) of the last TOKENS_PER_S_WINDOW seconds
        self._recent_lock = threading.Lock()  # the HTTP thread reads it while the loop appends
        self._stop, self._run = threading.Event(), threading.Event()
        self._run.set()
        self._lock = threading.Lock()  # held by the loop for one iteration, or by `paused` for its whole block
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    # -- the outside --------------------------------------------------------------------------------------------------

    def submit(self, req: Request) -> Request:
        """Queues `req`; ValueError if it cannot fit a slot, QueueFull (at once) past the queue bound, ShuttingDown
        once `drain` was called."""
        self.engine.check_fits(len(req.prompt), req.max_tokens)
        with self._waiting_changed:
            if self.draining:
                raise ShuttingDown(SHUTTING_DOWN)
            if len(self.waiting) >= self.max_queue:
                self.count("requests_rejected")
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting, {self.engine.num_slots} slots "
                                "busy); retry later")
            self.waiting.append(req)
            self._waiting_changed.notify()
        self.count("requests_queued")
        return req

    def cancel(self, req: Request) -> None:
        """Cancels `req`: a waiting one leaves the queue now, a live one frees its slot before the next decode step;
        a finished one is left as it is."""
        req.cancel()
        with self._waiting_changed:
            try:
                self.waiting.remove(req)
            except ValueError:
                return  # live (the loop frees its slot), finished, or already gone
        self.count("requests_cancelled")

    def drain(self) -> None:
        """From now on `submit` raises ShuttingDown; every waiting request ends with a 503 error. Live requests go
        on decoding (the server gives them its shutdown timeout)."""
        with self._waiting_changed:
            self.draining = True
            waiting, self.waiting = list(self.waiting), collections.deque()
        for req in waiting:
            self._fail(req, SHUTTING_DOWN, status=503)

    def queue_length(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    def count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kivi-jax-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._run.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @contextlib.contextmanager
    def paused(self):
        """Admits and decodes nothing inside the block (requests still queue, and the bound still holds); an
        iteration in progress ends first."""
        self._run.clear()
        try:
            with self._lock:
                yield self
        finally:
            self._run.set()

    def _count_tokens(self, n: int) -> None:
        with self._recent_lock:
            self._recent.append((time.monotonic(), n))

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._recent_lock:
            while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW

    def metrics(self) -> dict:
        return {**self.engine.metrics(), "queue_length": self.queue_length(), "max_queue": self.max_queue,
                "tokens_per_s": self.tokens_per_s(), **{k: v for k, v in self.counters.items()}}

    def encode(self, *args, **kwargs):
        with self.encoder_lock:
            return self.encoder(*args, **kwargs)

    def apply_chat_template(self, messages: list[dict]) -> str:
        with self.encoder_lock:
            return self.encoder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # -- the thread ---------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run.wait()
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    if self._run.is_set():
                        self._iteration()
            except Exception:  # noqa: BLE001 (the server must keep serving; each active request hears why)
                self.error = traceback.format_exc()
                for slot, req in list(self.active.items()):
                    self._fail(req, f"the engine failed: {self.error.strip().splitlines()[-1]}")
                    with contextlib.suppress(Exception):
                        self.engine.free(slot)
                self.active.clear()

    def _iteration(self) -> None:
        for slot, req in list(self.active.items()):
            if req.cancelled.is_set():
                del self.active[slot]
                self.count("requests_cancelled")  # before the slot shows free
                self.engine.free(slot)
        self._admit(block=not self.active)
        if not self.active:
            return
        out = self.engine.step()
        self._count_tokens(len(out))
        for slot, token in out.items():
            self._on_token(self.active[slot], slot, token)

    def _next_waiting(self, block: bool) -> Request | None:
        with self._waiting_changed:
            if block and not self.waiting:
                self._waiting_changed.wait(0.05)
            return self.waiting.popleft() if self.waiting else None

    def _admit(self, block: bool) -> None:
        while self.engine.has_free_slot():
            req = self._next_waiting(block)
            if req is None:
                return
            block = False
            if req.cancelled.is_set():  # cancelled by its flag alone (`Request.cancel`), not through `cancel`
                self.count("requests_cancelled")
                continue
            try:
                slot, token = self.engine.admit(req.prompt, req.sampling)
            except (ValueError, OverflowError) as e:  # this request's own values; checked before queueing, but a
                self._fail(req, str(e))               # direct caller can still get here
                continue
            self.active[slot] = req
            req.slot = slot
            self._count_tokens(1)
            self._on_token(req, slot, token)

    def _fail(self, req: Request, message: str, status: int = 500) -> None:
        self.count("requests_failed")
        req.emit(Event("error", message=message, status=status))

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _on_token(self, req: Request, slot: int, token: int) -> None:
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
        req.generated.append(token)
        finish = None
        if token in self.engine.eos:
            finish = "stop"
            text = self._decode(req.generated[:-1])
        else:
            text = self._decode(req.generated)
        hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        if hits:
            finish, text = "stop", text[: min(hits)]
        if finish is None and len(req.generated) >= req.max_tokens:
            finish = "length"
        req.text = text
        end = len(text) if finish else len(text) - held_back(text, req.stop)
        ids = req.generated[req.sent_tokens :]
        if end > req.sent_chars or ids:
            req.emit(Event("delta", text=text[req.sent_chars : max(end, req.sent_chars)], token_ids=ids))
            req.sent_chars, req.sent_tokens = max(end, req.sent_chars), len(req.generated)
        if finish:
            req.finish_reason = finish
            del self.active[slot]
            self.engine.finish(slot, hold=self.hold_prefixes)
            self.count("requests_finished")
            self.count("prompt_tokens", len(req.prompt))
            self.count("completion_tokens", len(req.generated))
            req.emit(Event("done", finish_reason=finish, usage=req.usage))


