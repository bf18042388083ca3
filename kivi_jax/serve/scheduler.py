"""Requests over the engine: a bounded queue, a scheduler thread that owns the engine, stop strings, EOS, max_tokens
and incremental text. No HTTP here: a request carries an `emit` callback that receives its events.

The thread loops: drop cancelled requests (freeing their slots), admit waiting requests into free slots (prefill and
insert), then decode every live slot once. Plain requests are prefilled together (`Engine.start_prefill`: the oldest
waiting one and those behind it that it `joins`: short prompts of any lengths packed, longer ones of its prefill shape,
chunk width and count, as many as the engine's token budget takes), chunk by chunk, up to `step_prefill_tokens` token
rows an iteration (a finished job making room for the next), so a long prompt shares the time with the running decodes
instead of stalling them, and many waiting prompts are not held up by a decode step after every chunk. Text is decoded
from all of a request's tokens each step and only the part that can no longer change is emitted (not a half multi-byte
character, not the start of a stop string). `cancel` takes a waiting request out of the queue at once; `drain` (at
shutdown) refuses new requests and ends the waiting ones, while the live ones decode on.
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

import jax

from kivi_jax.runtime import Stop, TextStream
from kivi_jax.sampling import Sampling
from kivi_jax.serve.engine import Admitted, Engine, Out, PrefillJob, Waiting

DEFAULT_MAX_BODY_BYTES = 2 * 2**20  # as text-generation-inference's payload limit: far past any prompt a slot holds
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds running requests get to finish after SIGTERM

TOKENS_PER_S_WINDOW = 10.0  # seconds over which /metrics' tokens/s is averaged
COUNTERS = ("requests_queued", "requests_rejected", "requests_finished", "requests_cancelled", "requests_failed",
            "prompt_tokens", "completion_tokens", "preemptions")
SECONDS = {  # where the loop's time goes (/metrics `kivi_serve_<part>_seconds_total`); its idle waits count in none
    "prefill": "seconds the scheduler spent admitting and prefilling (first draws and inserts included)",
    "decode": "seconds the scheduler spent in decode steps",
    "host": "seconds the scheduler spent on the decoded tokens (stop rules, text, events)",
}
ARRIVAL_QUIET = 0.03  # an idle scheduler woken by a request admits once no other has come for this many seconds,
ARRIVAL_WINDOW = 0.1  # ... this long after it woke, or once a prefill job's worth wait: a burst of requests goes into
# one prefill job, not its first request alone and then the rest (32 chats sent together reach the queue over 90-120
# ms here, 3.5 ms apart on average, the second up to 37 ms after the first: docs/serving.md "Runs 45-49")
STEP_PREFILL_TOKENS = 2048  # prompt token rows prefilled between two decode steps at most (at least one call): vLLM's
# max_num_batched_tokens, its OpenAI server's default on a CPU; more calls between steps stall the running streams
# longer but spend fewer decode steps of few rows while many prompts wait (docs/serving.md, runs 14 and 16)


class QueueFull(RuntimeError):
    """The request queue is at its bound."""


class ShuttingDown(RuntimeError):
    """The server is shutting down: it admits no new request."""


SHUTTING_DOWN = "the server is shutting down; retry on another server or after it restarts"


@dataclasses.dataclass
class Event:
    """What a request's `emit` receives: per choice (`index`) `delta`s (new text and token ids, with their scores when
    logprobs were asked for; an echo's scored prompt as `prompt`) and one `done` (its finish reason), then one `end`
    (the usage), or one `error`."""

    kind: str  # "delta" | "done" | "end" | "error"
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    message: str = ""
    status: int = 500  # of an error: 500 the engine failed, 503 the server is shutting down
    index: int = 0  # the choice
    logprobs: list[Out] | None = None  # one per token id of this delta, when asked for
    prompt: list[Out] | None = None  # the prompt's scores (its tokens after the first), once all are known
    warnings: list[str] = dataclasses.field(default_factory=list)  # of an end: what makes the answer unreliable


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: `(seed + index) mod 2**31` (so choice i of a
    seeded request draws what a request of n = 1 with that seed draws); None stays None (each choice random)."""
    return None if seed is None else (seed + index) % (1 << 31)


@dataclasses.dataclass
class Choice:
    """One of a request's n answers: its own slot, key chain, tokens, text and grammar state."""

    index: int
    sampling: Sampling
    generated: list[int] = dataclasses.field(default_factory=list)
    scores: list[Out] = dataclasses.field(default_factory=list)  # one per generated token (with logprobs)
    prompt_scores: list[Out] = dataclasses.field(default_factory=list)  # score_prompt: one per prompt token after the first
    text: TextStream | None = None  # the tokens of its text so far and the characters sent (set by the scheduler)
    sent_tokens: int = 0
    finish_reason: str | None = None
    slot: int | None = None
    matcher: object = None  # its grammar matcher (made once, so that it survives a preemption)
    key: object = None  # its sampling key `[2]` when it was preempted (the next draw goes on from it)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int  # 0 only with score_prompt: the prompt is scored and nothing generated
    sampling: Sampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    n: int = 1  # choices: the prompt prefilled once, each choice in its own slot (choice_seed for its seed)
    logprobs: bool = False  # every token's logprob and top alternatives
    score_prompt: bool = False  # echo with logprobs: the prompt's own tokens scored (kivi_jax.serve.engine)
    stop_token_ids: frozenset[int] = frozenset()  # end a choice like an EOS (not part of its text)
    ends: Stop | None = None  # the stop rule (EOS and stop ids, max_tokens, stop strings), made at its first token
    grammar: object = None  # kivi_jax.serve.grammar.Grammar: each choice's output held to it
    ignore_eos: bool = False  # EOS ends nothing: a choice runs to max_tokens or a stop (vLLM's, for benchmarks)
    cache_salt: str = ""  # vLLM's: prefixes are shared only between requests of one salt (a tenant's namespace)
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    admitted_at: float = 0.0  # when it last went live (the newest is preempted first)
    preemptions: int = 0
    choices: list[Choice] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)  # sent with the end (the `warnings` field)

    def __post_init__(self):
        if not self.choices:
            self.choices = [Choice(i, dataclasses.replace(self.sampling, seed=choice_seed(self.sampling.seed, i)))
                            for i in range(self.n)]

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def context(self) -> list[int]:
        """The tokens its cache holds when it goes live again after a preemption: the prompt and what its one choice
        generated (the prompt prefilled as before, then the generated tokens replayed a decode step each, so that
        the cache is what it was; `Engine.admit_choices(replay_from=)`)."""
        return self.prompt + self.choices[0].generated if self.n == 1 else self.prompt

    @property
    def tokens_left(self) -> int:
        """max_tokens less what was generated before a preemption."""
        return self.max_tokens - (len(self.choices[0].generated) if self.n == 1 else 0)

    @property
    def resume_keys(self) -> list | None:
        """Each choice's key to go on from after a preemption, or None (keys from the seeds)."""
        return [c.key for c in self.choices] if any(c.key is not None for c in self.choices) else None

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt), sum(len(ch.generated) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def overflow_warning(spec: str, index: int) -> str:
    """What a client is told when a float16 scale overflowed in its choice's cache row."""
    return (f"choice {index}: a quantization scale of the {spec} cache overflowed float16 (a key or value beyond its "
            "range); this answer is unreliable. Serve a cache with float32 scales (spec suffix -sf32, e.g. "
            "k2v2-g32-r128-sf32) or the full cache.")


class Scheduler:
    """Owns the engine in its own thread; `submit` queues a request (or raises QueueFull at once)."""

    def __init__(self, engine: Engine, tokenizer=None, max_queue: int = 64, hold_prefixes: bool = True,
                 step_prefill_tokens: int = STEP_PREFILL_TOKENS):
        if max_queue < 1 or step_prefill_tokens < 1:
            raise ValueError(f"max_queue={max_queue} and step_prefill_tokens={step_prefill_tokens} must be at least 1")
        self.engine, self.tokenizer, self.max_queue = engine, tokenizer, max_queue
        self.step_prefill_tokens = step_prefill_tokens
        self.hold_prefixes = hold_prefixes
        # A fast tokenizer must not encode and decode at once: the loop decodes with `tokenizer`, the HTTP side
        # encodes with its own copy, so a long prompt being tokenized never holds up the decode steps.
        self.tokenizer_lock = threading.Lock()
        self.encoder = copy.deepcopy(tokenizer)
        self.encoder_lock = threading.Lock()
        self.waiting: collections.deque[Request] = collections.deque()  # at most max_queue, oldest first
        self._waiting_changed = threading.Condition()  # guards `waiting` and `draining`
        self.draining = False
        self.active: dict[int, tuple[Request, Choice]] = {}  # slot -> its request and choice
        self.job: PrefillJob | None = None  # the batched prefill in progress
        self.job_requests: list[Request] = []  # its requests, in its order
        # every key exists from the start, so the HTTP thread can read while the loop counts (no dict resizes)
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self.seconds = dict.fromkeys(SECONDS, 0.0)  # written by the loop only (whole floats: a reader sees one value)
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
        self.engine.check_fits(len(req.prompt), req.max_tokens, least=0 if req.score_prompt else 1)
        if not 1 <= req.n <= self.engine.num_slots:
            raise ValueError(f"n={req.n} choices need as many slots; this server has {self.engine.num_slots}")
        self.engine.check_pool(len(req.prompt), req.max_tokens, req.n)
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
        """From now on `submit` raises ShuttingDown; every waiting request ends with a 503 error. Live requests, and
        preempted ones waiting to go on, go on decoding (the server gives them its shutdown timeout)."""
        with self._waiting_changed:
            self.draining = True
            # a preempted request has started streaming: it stays queued, a running request given the timeout
            waiting = [r for r in self.waiting if not r.preemptions]
            self.waiting = collections.deque(r for r in self.waiting if r.preemptions)
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
                "tokens_per_s": self.tokens_per_s(), **{k: v for k, v in self.counters.items()},
                **{f"{k}_seconds": round(v, 3) for k, v in self.seconds.items()}}

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
                failed = set()
                for slot, (req, _) in list(self.active.items()):
                    if req.id not in failed:
                        failed.add(req.id)
                        self._fail(req, f"the engine failed: {self.error.strip().splitlines()[-1]}")
                    with contextlib.suppress(Exception):
                        self.engine.free(slot)
                self.active.clear()
                if self.job is not None:
                    for req in self.job_requests:
                        self._fail(req, f"the engine failed: {self.error.strip().splitlines()[-1]}")
                    with contextlib.suppress(Exception):
                        self.engine.abandon(self.job)
                    self.job, self.job_requests = None, []

    def _iteration(self) -> None:
        """Cancellations, then admissions and prefill chunks up to `step_prefill_tokens` token rows (at least one
        call; a job that finishes makes room for the next), then one decode step of every live slot."""
        t0 = time.monotonic()
        for slot, (req, _) in list(self.active.items()):
            if req.cancelled.is_set():
                del self.active[slot]
                if not any(r is req for r, _ in self.active.values()):
                    self.count("requests_cancelled")  # before the slot shows free
                self.engine.free(slot)
        prefilled = 0
        while True:
            if self.job is None:
                if not self.active and not prefilled:  # idle: wait a moment for a request (not counted as busy)
                    with self._waiting_changed:
                        if not self.waiting:
                            self._waiting_changed.wait(0.05)
                        deadline, seen = time.monotonic() + ARRIVAL_WINDOW, len(self.waiting)
                        while 0 < seen < self.engine.prefill_batch and time.monotonic() < deadline:  # a burst's rest
                            self._waiting_changed.wait(ARRIVAL_QUIET)
                            if len(self.waiting) == seen:
                                break
                            seen = len(self.waiting)
                    t0 = time.monotonic()
                self._admit()
            if self.job is None:
                break
            before = self.job.tokens_run
            job = self.job
            self._advance()
            prefilled += job.tokens_run - before
            if prefilled >= self.step_prefill_tokens:
                break
        if self.job is not None:  # its calls run asynchronously: their time is the prefill's, not the next step's
            jax.block_until_ready(self.job.last)
        t1 = time.monotonic()
        self.seconds["prefill"] += t1 - t0
        if not self.active:
            return
        self._make_room()
        out = self.engine.step_scored()
        t2 = time.monotonic()
        self.seconds["decode"] += t2 - t1
        self._count_tokens(sum(not o.prompt for o in out.values()))
        for slot, o in out.items():
            if slot in self.active:  # a choice finished in this loop leaves its slot
                req, choice = self.active[slot]
                self._on_token(req, choice, slot, o)
        self.seconds["host"] += time.monotonic() - t2

    def _next_waiting(self) -> Request | None:
        """The oldest waiting request if enough slots are not live for its choices, and a paged cache has their
        pages (it keeps its place if not)."""
        with self._waiting_changed:
            first = self.waiting[0] if self.waiting else None
            if first is not None and self.engine.can_admit(len(first.context), first.tokens_left, first.n,
                                                           first.score_prompt):
                return self.waiting.popleft()
            return None

    def _admit(self) -> None:
        while self.engine.has_free_slot():
            req = self._next_waiting()
            if req is None:
                return
            if req.cancelled.is_set():  # cancelled by its flag alone (`Request.cancel`), not through `cancel`
                self.count("requests_cancelled")
                continue
            if not req.score_prompt and not req.preemptions and self.engine.batchable(req.context, req.cache_salt):
                self._start_job(req)
                return  # the job's requests go live when its last chunk has run; the next iteration admits more
            try:
                admitted = self.engine.admit_choices(req.context, [c.sampling for c in req.choices],
                                                     score_prompt=req.score_prompt, logprobs=req.logprobs,
                                                     constraints=self._constraints(req), max_tokens=req.tokens_left,
                                                     keys=req.resume_keys,
                                                     replay_from=len(req.prompt) if req.preemptions else None,
                                                     salt=req.cache_salt)
            except (ValueError, OverflowError) as e:  # this request's own values; checked before queueing, but a
                self._fail(req, str(e))               # direct caller can still get here
                continue
            self._went_live(req, admitted)

    @staticmethod
    def _constraints(req: Request) -> list | None:
        """Each choice's grammar matcher (made at its first admission, kept through preemptions), or None."""
        if req.grammar is None:
            return None
        for c in req.choices:
            if c.matcher is None:
                c.matcher = req.grammar.matcher()
        return [c.matcher for c in req.choices]

    def _waiting_of(self, req: Request) -> Waiting | None:
        """The engine's view of a request, or None (and the request failed) when it does not fit."""
        w = Waiting(req.context, [c.sampling for c in req.choices], req.logprobs, self._constraints(req),
                    req.tokens_left, req.resume_keys, req.cache_salt)
        try:
            self.engine.check_request(w.prompt, w.samplings, w.constraints, w.max_tokens)
        except (ValueError, OverflowError) as e:
            self._fail(req, str(e))
            return None
        return w

    def _start_job(self, first: Request) -> None:
        """Starts a batched prefill of `first` and of the waiting requests behind it that it `joins` (plain ones, no
        held prefix to reuse: short prompts packed, others of its prefill shape), as many as the token budget and the
        open slots allow."""
        open_slots = self.engine.open_slots()
        open_pages = self.engine.free_pages() - self.engine.headroom
        pages = lambda req: self.engine.admission_pages(len(req.context), req.tokens_left, req.n)  # noqa: E731
        taken, reqs = [], []
        w = self._waiting_of(first)
        if w is not None:
            taken, reqs, open_slots, open_pages = [w], [first], open_slots - first.n, open_pages - pages(first)
        with self._waiting_changed:
            for req in list(self.waiting):
                if (req.score_prompt or req.preemptions or req.n > open_slots or pages(req) > open_pages or req.cancelled.is_set()
                        or not self.engine.joins([t.prompt for t in taken], req.context,
                                                 [t.salt for t in taken] + [req.cache_salt])
                        or not self.engine.batchable(req.context, req.cache_salt)):
                    continue
                w = self._waiting_of(req)
                self.waiting.remove(req)
                if w is not None:
                    taken.append(w)
                    reqs.append(req)
                    open_slots -= req.n
                    open_pages -= pages(req)
        if taken:
            self.job, self.job_requests = self.engine.start_prefill(taken), reqs

    def _advance(self) -> None:
        """Runs the prefill job's next chunk; after its last, its requests go live (a cancelled one frees its
        slots)."""
        admitted = self.engine.advance(self.job)
        if admitted is None:
            return
        reqs, self.job, self.job_requests = self.job_requests, None, []
        for req, adm in zip(reqs, admitted):
            if req.cancelled.is_set():
                self.count("requests_cancelled")
                for slot in adm.slots:
                    self.engine.free(slot)
                continue
            self._went_live(req, adm)

    def _went_live(self, req: Request, admitted: Admitted) -> None:
        """A request is in its slots: its choices become active and hear their first tokens."""
        req.admitted_at = time.monotonic()
        for choice, slot, first in zip(req.choices, admitted.slots, admitted.first):
            self.active[slot] = req, choice
            choice.slot = slot
            if req.score_prompt:
                choice.prompt_scores = list(admitted.prompt_scores)
                if len(choice.prompt_scores) == len(req.prompt) - 1:
                    self._prompt_scored(req, choice, slot)
            if first is not None and choice.finish_reason is None:
                self._count_tokens(1)
                self._on_token(req, choice, slot, first)

    def _make_room(self) -> None:
        """Preempts the newest growing requests (vLLM's recompute preemption: pages freed, the request queued first
        to be computed again) until the pool has the pages the next decode step needs."""
        while not self.engine.can_grow():
            growing = {self.active[s][0].id: self.active[s][0] for s in self.engine.growing if s in self.active}
            if not growing:
                return  # nothing to preempt: the step raises PoolExhausted
            self._preempt(max(growing.values(), key=lambda r: r.admitted_at))

    def _preempt(self, req: Request) -> None:
        """Frees a live request's slots and pages and queues it first; its choice keeps its tokens, text, key and
        grammar state, so that it goes on where it stopped once its prompt is prefilled and its tokens replayed."""
        for slot, (r, choice) in list(self.active.items()):
            if r is req:
                choice.key = self.engine.key_of(slot)
                if self.engine.overflowed(slot):
                    warning = overflow_warning(self.engine.spec_name, choice.index)
                    if warning not in req.warnings:
                        req.warnings.append(warning)
                del self.active[slot]
                choice.slot = None
                self.engine.free(slot)
        req.preemptions += 1
        self.count("preemptions")
        with self._waiting_changed:
            self.waiting.appendleft(req)  # admitted once already: the queue bound does not apply
            self._waiting_changed.notify()

    def _fail(self, req: Request, message: str, status: int = 500) -> None:
        self.count("requests_failed")
        req.emit(Event("error", message=message, status=status))

    def _prompt_scored(self, req: Request, choice: Choice, slot: int) -> None:
        """Every prompt token of the choice has its score: hand them over; with max_tokens 0 the choice is done."""
        req.emit(Event("delta", index=choice.index, prompt=choice.prompt_scores))
        if req.max_tokens == 0:
            self._finish(req, choice, slot, "length")

    def _on_token(self, req: Request, choice: Choice, slot: int, out: Out) -> None:
        if out.prompt and not req.score_prompt:
            return  # a preempted request replaying a token it generated (and sent) before
        if out.prompt:
            choice.prompt_scores.append(out)
            if len(choice.prompt_scores) == len(req.prompt) - 1:
                self._prompt_scored(req, choice, slot)
            return
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
        token = out.token
        choice.generated.append(token)
        if req.logprobs:
            choice.scores.append(out)
        if choice.text is None:
            choice.text = TextStream(self.tokenizer, req.stop, self.tokenizer_lock)
        if req.ends is None:
            eos = frozenset() if req.ignore_eos else self.engine.eos
            req.ends = Stop(eos | req.stop_token_ids, req.max_tokens, req.stop)
        stop = req.ends
        finish = stop.after(token, len(choice.generated))
        if finish != "stop":  # a stop token is not part of the text
            choice.text.add(token)
        text = choice.text.text
        cut = stop.cut(text)
        if cut is not None:
            finish, text = "stop", cut
        piece = choice.text.piece(final=finish is not None, text=text)
        ids = choice.generated[choice.sent_tokens :]
        if piece or ids:
            scores = choice.scores[choice.sent_tokens :] if req.logprobs else None
            req.emit(Event("delta", text=piece, token_ids=ids, index=choice.index, logprobs=scores))
            choice.sent_tokens = len(choice.generated)
        if finish:
            self._finish(req, choice, slot, finish)

    def _finish(self, req: Request, choice: Choice, slot: int, reason: str) -> None:
        choice.finish_reason = reason
        if self.engine.overflowed(slot):
            warning = overflow_warning(self.engine.spec_name, choice.index)
            if warning not in req.warnings:  # (already there when it overflowed before a preemption)
                req.warnings.append(warning)
        del self.active[slot]
        self.engine.finish(slot, hold=self.hold_prefixes)
        req.emit(Event("done", finish_reason=reason, index=choice.index))
        if req.finished:
            self.count("requests_finished")
            self.count("prompt_tokens", len(req.prompt))
            self.count("completion_tokens", req.usage["completion_tokens"])
            req.emit(Event("end", usage=req.usage, warnings=list(req.warnings)))
