"""The OpenAI-compatible HTTP layer (FastAPI): it validates and tokenizes requests, queues them on the scheduler and
streams their events back. It never touches the engine.

Routes: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Every error is an OpenAI error object: 400 invalid parameters or a prompt
that does not fit a slot, 404 unknown model or route, 405 wrong method, 413 a body past `max_body_bytes`, 503 queue
full or shutting down.

A request body is read as it arrives (never more than `max_body_bytes` of it) and parsed and tokenized in a worker
thread, so a large or slow request holds up no other route. A client that disconnects cancels its request, waiting or
running. At shutdown (`UvicornServer`) the server stops admitting, ends the waiting requests and half-sent bodies with
503 and gives the running ones `shutdown_timeout` seconds before it ends them too.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kivi_jax.serve import grammar as grammar_mod
from kivi_jax.serve.engine import Out
from kivi_jax.sampling import MAX_LOGPROBS, Sampling
from kivi_jax.serve.scheduler import (DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT, SHUTTING_DOWN,
                                      SECONDS, TOKENS_PER_S_WINDOW, Event, QueueFull, Request, Scheduler,
                                      ShuttingDown)

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT = 256  # characters of a `cache_salt`
MAX_N = 8  # choices a request may ask for (and at most the server's slots)
MAX_TOP_K = 2**31 - 1  # an int32 in the sampler
# Accepted and ignored (they change nothing here) or accepted only at their default value (where a route does not
# take them).
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
DEFAULT_ONLY = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None,
                "top_logprobs": None, "logit_bias": None, "echo": False, "suffix": None, "tools": None,
                "tool_choice": None, "response_format": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "return_token_ids", "n", "response_format", "stop_token_ids", "logprobs", "ignore_eos", "cache_salt"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_KEYS = COMMON | {"prompt", "echo"}
ROLES = ("system", "developer", "user", "assistant")


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a lone surrogate echoed from a request cannot break the reply."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ASCIIJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _show(value: Any, limit: int = 60) -> str:
    """`value` as JSON for a message, cut to `limit` characters (a request may send anything, of any size)."""
    try:
        text = json.dumps(value)
    except (RecursionError, TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(param: str, text: str) -> str:
    """`text` if it is valid Unicode; a lone surrogate (JSON can spell one, "\\ud800") is a 400 naming where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"{param} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                          f"{e.start}; send UTF-8 text (surrogates only in pairs)") from None
    return text


def _number(body: dict, name: str, default, lo: float, hi: float, lo_open: bool = False, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or (isinstance(v, float) and not math.isfinite(v)):
        what = "an integer" if integer else "a finite number"
        raise _bad(name, f"{name} must be {what}, not {_show(v)}")
    if v < lo or (lo_open and v == lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise _bad(name, f"{name}={_show(v)} is out of range: it must be in {interval}")
    return v


def _flag(body: dict, name: str, where: dict | None = None) -> bool:
    v = (body if where is None else where).get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"{name} must be true or false, not {_show(v)}")
    return v


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (JSON has no NaN or Infinity)")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 `invalid_json` that says why not."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to parse; send a JSON object of plain values",
                       code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, an integer past Python's 4300 digits
        reason = str(e).split(";")[0]
        raise APIError(400, f"the request body is not valid JSON ({reason}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    return body


def _shutting_down(message: str | None = None) -> APIError:
    return APIError(503, message or SHUTTING_DOWN, type_="server_error", code="shutting_down")


class Parsed:
    """A validated request: prompt token ids and everything the scheduler needs."""

    def __init__(self, prompt: list[int], max_tokens: int | None, sampling: Sampling, stop: tuple[str, ...],
                 stream: bool, include_usage: bool, token_ids: bool, n: int = 1, logprobs: int | None = None,
                 echo: bool = False, stop_token_ids: frozenset[int] = frozenset(), grammar=None,
                 continuous_usage: bool = False, ignore_eos: bool = False, cache_salt: str = ""):
        self.ignore_eos, self.cache_salt = ignore_eos, cache_salt
        self.prompt, self.max_tokens, self.sampling, self.stop = prompt, max_tokens, sampling, stop
        self.stream, self.include_usage, self.token_ids = stream, include_usage, token_ids
        self.n, self.logprobs, self.echo, self.stop_token_ids = n, logprobs, echo, stop_token_ids
        self.grammar, self.continuous_usage = grammar, continuous_usage
        self.prompt_text = ""  # echo: the prompt as text

    @property
    def score_prompt(self) -> bool:
        """Whether the prompt's own tokens are scored (echo with logprobs)."""
        return self.echo and self.logprobs is not None


class API:
    """The routes over one scheduler; `model_name` is the only model `/v1/models` lists."""

    def __init__(self, scheduler: Scheduler, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} must be at least 1")
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={shutdown_timeout} must be a number of seconds >= 0")
        self.scheduler, self.engine, self.model_name = scheduler, scheduler.engine, model_name
        self.max_body_bytes, self.shutdown_timeout = max_body_bytes, shutdown_timeout
        self.created = int(time.time())
        self.draining = asyncio.Event()  # set once at shutdown (`start_draining`)
        self.running: dict[str, tuple[Request, asyncio.Queue]] = {}  # id -> a queued or live request, its events
        self.grammars = grammar_mod.Compiler(self._tokenizer_copy, self.engine.cfg.vocab_size, self.engine.eos)
        self._strings: list[str] | None = None  # each token id as text (logprobs), made on first use
        self._strings_lock = threading.Lock()

    # -- tokens as text -----------------------------------------------------------------------------------------------

    def _tokenizer_copy(self):
        """A private copy of the tokenizer (a fast tokenizer must not be used by two threads at once)."""
        with self.scheduler.encoder_lock:
            return copy.deepcopy(self.scheduler.encoder)

    def token_strings(self) -> list[str]:
        """Every token id's own text (special tokens as they are written), for logprobs: `token_id:N` without a
        tokenizer."""
        with self._strings_lock:
            if self._strings is None:
                vocab, tok = self.engine.cfg.vocab_size, self.scheduler.encoder
                if tok is None:
                    self._strings = [f"token_id:{i}" for i in range(vocab)]
                else:
                    with self.scheduler.encoder_lock:
                        self._strings = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False,
                                                         clean_up_tokenization_spaces=False)
            return self._strings

    def _detokenize(self, ids: list[int]) -> str:
        if self.scheduler.encoder is None:
            return ""
        with self.scheduler.encoder_lock:
            return self.scheduler.encoder.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- reading and parsing ------------------------------------------------------------------------------------------

    def _too_large(self, declared: int | None) -> APIError:
        size = f" of {declared} bytes" if declared is not None else ""
        return APIError(413, f"the request body{size} is past this server's limit of {self.max_body_bytes} bytes "
                             "(kivi-jax serve --max-body-bytes)", code="body_too_large",
                        headers={"Connection": "close"})

    async def _read_body(self, http: HTTPRequest) -> bytes:
        """The body as it arrives, refused (413) as soon as it is known to pass `max_body_bytes`."""
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        chunks, size = [], 0
        try:
            async for chunk in http.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise self._too_large(None)
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body was whole: nobody reads the answer
            raise APIError(499, "the client disconnected before its request body was whole") from None
        return b"".join(chunks)

    async def _unless_draining(self, awaitable):
        """`awaitable`'s result, or a 503 once the server starts shutting down (a half-sent body ends then)."""
        task, drain = asyncio.ensure_future(awaitable), asyncio.ensure_future(self.draining.wait())
        try:
            done, _ = await asyncio.wait({task, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        raise _shutting_down()

    def parse(self, raw: bytes, chat: bool) -> "Parsed":
        """Validates and tokenizes a request body (in a worker thread: tokenizing a long prompt takes a while)."""
        try:
            body = parse_json(raw)
            if chat:
                parsed = self._common(body, CHAT_KEYS, "max_completion_tokens")
                parsed.prompt = self._chat_prompt(body)
            else:
                parsed = self._common(body, COMPLETION_KEYS)
                parsed.prompt = self._completion_prompt(body)
                if parsed.echo:
                    prompt = body.get("prompt")
                    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
                    parsed.prompt_text = prompt if isinstance(prompt, str) else self._detokenize(parsed.prompt)
            self._check_fit(parsed, "messages" if chat else "prompt")
            if "response_format" in body and body["response_format"] is not None:
                parsed.grammar = self._grammar(body["response_format"])
            if parsed.logprobs is not None:
                self.token_strings()  # made here, in the worker thread, the first time
        except RecursionError:  # a value nested nearly as deep as the parser allows, in a key that is looked into
            raise APIError(400, "the request is nested too deeply; send plain values", code="invalid_value") from None
        return parsed

    def _common(self, body: dict, allowed: set[str], max_tokens_key: str = "max_tokens") -> Parsed:
        """Everything but the prompt (which the caller fills in)."""
        unknown = sorted(set(body) - allowed - IGNORED - set(DEFAULT_ONLY))
        if unknown:
            names = ", ".join(_show(k, 40) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise APIError(400, f"unrecognized request argument(s): {names}; this server accepts "
                                f"{', '.join(sorted(allowed | set(DEFAULT_ONLY)))}", param=unknown[0][:100],
                           code="unknown_parameter")
        chat = "messages" in allowed
        for k, default in DEFAULT_ONLY.items():
            if k in allowed:
                continue
            v = body.get(k)
            if v is not None and v != default and not (k == "logit_bias" and v == {}) and not (
                    k == "logprobs" and v is False):
                raise _bad(k, f"{k}={_show(v)} is not supported by this server (only {json.dumps(default)})")
        model = body.get("model")
        if model is None:
            raise APIError(400, f"'model' is required; this server serves {self.model_name!r}", param="model",
                           code="missing_parameter")
        if not isinstance(model, str) or not model:
            raise APIError(400, f"'model' must be a non-empty string, the served model's id {self.model_name!r}, "
                                f"not {_show(model)}", param="model", code="invalid_type")
        if model != self.model_name:
            raise APIError(404, f"the model {_show(model)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        echo = not chat and _flag(body, "echo")
        key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < (0 if echo else 1)):
            raise _bad(key, f"{key} must be a positive integer (0 only with echo: the prompt alone), not "
                            f"{_show(max_tokens)}")
        top_k = _number(body, "top_k", 0, -1, MAX_TOP_K, integer=True)
        seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
        sampling = Sampling(
            temperature=float(_number(body, "temperature", 1.0, 0, 2)),  # OpenAI's default temperature: 1
            top_p=float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)),
            top_k=max(top_k, 0),  # -1 (vLLM) and 0 both mean no cut
            seed=None if seed is None else seed % (1 << 31),
        )
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise _bad("stop", f"stop must be a string or a list of strings, not {_show(stop)}")
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise _bad("stop", f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        stop = tuple(_text("stop", s) for s in stop)
        stream = _flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "stream_options takes only include_usage (true or false)")
        include_usage = _flag(body, "include_usage", options)
        continuous = _flag(body, "continuous_usage_stats", options)  # vLLM's: the usage so far on every chunk
        token_ids = _flag(body, "return_token_ids")
        n = body.get("n")
        n = 1 if n is None else n
        most = min(MAX_N, self.engine.num_slots)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
            raise _bad("n", f"n={_show(n)} must be an integer in [1, {most}] (choices a request may ask for: at most "
                            f"{MAX_N}, and this server's {self.engine.num_slots} slots)")
        logprobs = self._logprobs(body, chat)
        stop_ids = body.get("stop_token_ids")
        stop_ids = [] if stop_ids is None else stop_ids
        vocab = self.engine.cfg.vocab_size
        if (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids)):
            raise _bad("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                         f"[0, {vocab}), not {_show(stop_ids)}")
        salt = body.get("cache_salt")
        salt = "" if salt is None else salt
        if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT:
            raise _bad("cache_salt", f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters (prefixes "
                                     f"are shared only between requests of one salt), not {_show(salt)}")
        return Parsed([], max_tokens, sampling, stop, stream, include_usage, token_ids, n=n, logprobs=logprobs,
                      echo=echo, stop_token_ids=frozenset(stop_ids), continuous_usage=continuous,
                      ignore_eos=_flag(body, "ignore_eos"),  # vLLM's: EOS ends nothing (benchmarks)
                      cache_salt=salt)

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        """The number of top alternatives a request wants with each token's logprob (0 = the token's own only), or
        None: chat's `logprobs: true` with `top_logprobs`, completions' `logprobs: k`."""
        if chat:
            want = _flag(body, "logprobs")
            top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
            if top is not None and not want:
                raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
            return (top or 0) if want else None
        v = body.get("logprobs")
        if v is None or v is False:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS:
            raise _bad("logprobs", f"logprobs={_show(v)} must be an integer in [0, {MAX_LOGPROBS}] (the most likely "
                                   "alternatives returned with each token)")
        return v

    def _grammar(self, response_format):
        """The compiled grammar of a response_format (None for text), or a 400 that says what is wrong."""
        try:
            return self.grammars.compile(response_format)
        except grammar_mod.GrammarUnavailable as e:
            raise APIError(400, str(e), param="response_format", code="grammar_unavailable") from None
        except grammar_mod.GrammarError as e:
            raise _bad("response_format", str(e)) from None

    def _check_fit(self, parsed: Parsed, param: str) -> None:
        n = len(parsed.prompt)
        if n < 1:
            raise _bad(param, "the prompt has no tokens")
        try:
            if parsed.max_tokens is None:
                parsed.max_tokens = self.engine.room(n)  # the rest of the slot
            self.engine.check_fits(n, parsed.max_tokens, least=0)
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
                raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a role in {', '.join(ROLES)}")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string, not {_show(content)}")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"],
                          "content": _text(f"messages[{i}].content", content)})
        tok = self.scheduler.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = self.scheduler.apply_chat_template(clean)
        except Exception as e:  # noqa: BLE001 (jinja2's TemplateError, or the template's own raise_exception)
            raise _bad("messages", f"the model's chat template refused these messages: {e}") from None
        return self._encode("messages", text, add_special_tokens=False)

    def _encode(self, param: str, text: str, **kwargs) -> list[int]:
        try:
            return list(self.scheduler.encode(text, **kwargs)["input_ids"])
        except Exception as e:  # noqa: BLE001 (a tokenizer raises many kinds; the text is what it could not take)
            raise _bad(param, f"the tokenizer could not encode {param}: {type(e).__name__}: {str(e)[:200]}") from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if self.scheduler.tokenizer is None:
                raise _bad("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
            return self._encode("prompt", _text("prompt", prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.cfg.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _bad("prompt", f"token ids outside [0, {vocab}): {_show(bad[:5])}")
            return prompt
        raise _bad("prompt", "prompt must be a string or a list of token ids (one prompt per request)")

    # -- running ------------------------------------------------------------------------------------------------------

    def _submit(self, parsed: Parsed) -> tuple[Request, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        req = Request(parsed.prompt, parsed.max_tokens, parsed.sampling, emit, parsed.stop, n=parsed.n,
                      logprobs=parsed.logprobs is not None, score_prompt=parsed.score_prompt,
                      stop_token_ids=parsed.stop_token_ids, grammar=parsed.grammar, ignore_eos=parsed.ignore_eos,
                      cache_salt=parsed.cache_salt)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(503, str(e), type_="server_error", code="queue_full") from None
        except ShuttingDown:
            raise _shutting_down() from None
        except ValueError as e:
            raise _bad("n", str(e)) from None
        self.running[req.id] = req, events
        return req, events

    def _end(self, req: Request) -> None:
        """The request is answered or abandoned: cancel it (a no-op once done) and forget it."""
        self.scheduler.cancel(req)
        self.running.pop(req.id, None)

    async def _cancel_on_disconnect(self, http: HTTPRequest, req: Request, events: asyncio.Queue) -> None:
        """Waits for the client to go away, then cancels its request (it leaves the queue, or frees its slot before
        the next decode step) and wakes whoever waits for its events."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self._end(req)
        events.put_nowait(Event("error", message="the client disconnected", status=499))

    def _error(self, ev: Event) -> APIError:
        if ev.status == 503:
            return _shutting_down(ev.message)
        return APIError(ev.status, ev.message, type_="server_error")

    async def _collect(self, req: Request, events: asyncio.Queue) -> tuple[list[Event], Event]:
        """All of a request's events up to `end`."""
        got = []
        while True:
            ev = await events.get()
            if ev.kind == "error":
                raise self._error(ev)
            if ev.kind == "end":
                return got, ev
            got.append(ev)

    # -- logprobs -----------------------------------------------------------------------------------------------------

    def _completion_logprobs(self, entries: list[tuple[int, Out | None]], k: int, offset: int = 0) -> dict:
        """The legacy completions `logprobs` object for (token, score) pairs (a score of None: the prompt's first
        token, which nothing predicts): tokens, token_logprobs, top_logprobs (the k most likely and the token
        itself, by text), text_offset (from `offset`, by the tokens' text)."""
        strings = self.token_strings()
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, score in entries:
            text = strings[token]
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if score is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(score.logprob)
            top: dict[str, float] = {}
            for t, lp in score.top[:k]:
                top.setdefault(strings[t], lp)
            top.setdefault(text, score.logprob)
            out["top_logprobs"].append(top)
        return out

    def _chat_logprobs(self, scores: list[Out], k: int) -> dict:
        """The chat `logprobs` object: one content entry per token with its top_logprobs (k of them)."""
        strings = self.token_strings()

        def entry(token: int, logprob: float) -> dict:
            text = strings[token]
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

        return {"content": [{**entry(o.token, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top[:k]]}
                            for o in scores], "refusal": None}

    def _prompt_entries(self, parsed: Parsed, scores: list[Out]) -> list[tuple[int, Out | None]]:
        return [(parsed.prompt[0], None)] + [(o.token, o) for o in scores]

    # -- answering ----------------------------------------------------------------------------------------------------

    def _stream(self, req: Request, events: asyncio.Queue, parsed: Parsed, chat: bool,
                watcher: asyncio.Task) -> StreamingResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + req.id
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        k = parsed.logprobs
        completion_tokens = 0
        offsets = [0] * parsed.n  # text_offset so far, per choice

        def usage() -> dict:
            p = len(parsed.prompt)
            return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

        def chunk(choices: list, **extra) -> str:
            if parsed.continuous_usage and "usage" not in extra:
                extra["usage"] = usage()
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": choices, **extra}) + "\n\n"

        def choice(index: int, text: str | None, finish: str | None, ids: list[int] | None = None,
                   role: bool = False, entries: list | None = None) -> dict:
            c: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c["delta"] = delta
                if k is not None and entries:
                    c["logprobs"] = self._chat_logprobs([o for _, o in entries], k)
            else:
                c["text"] = text or ""
                if k is not None and entries:
                    c["logprobs"] = self._completion_logprobs(entries, k, offsets[index])
                    offsets[index] = c["logprobs"]["text_offset"][-1] + len(c["logprobs"]["tokens"][-1])
            if parsed.token_ids and ids is not None:
                c["token_ids"] = ids
            return c

        async def body() -> AsyncIterator[str]:
            nonlocal completion_tokens
            try:
                for i in range(parsed.n):
                    if chat:
                        yield chunk([choice(i, "", None, role=True)])
                    elif parsed.echo and not parsed.score_prompt:
                        yield chunk([choice(i, parsed.prompt_text, None)])
                while True:
                    ev = await events.get()
                    if ev.kind == "delta" and ev.prompt is not None:  # the scored prompt, echoed
                        yield chunk([choice(ev.index, parsed.prompt_text, None,
                                            entries=self._prompt_entries(parsed, ev.prompt))])
                    elif ev.kind == "delta":
                        completion_tokens += len(ev.token_ids)
                        entries = None if ev.logprobs is None else [(o.token, o) for o in ev.logprobs]
                        yield chunk([choice(ev.index, ev.text, None, ev.token_ids, entries=entries)])
                    elif ev.kind == "done":
                        yield chunk([choice(ev.index, None if chat else "", ev.finish_reason, [])])
                    elif ev.kind == "error":
                        yield "data: " + json.dumps(self._error(ev).body()) + "\n\n"
                        break
                    else:  # end
                        if ev.warnings:
                            yield chunk([], warnings=ev.warnings)
                        if parsed.include_usage:
                            yield chunk([], usage=ev.usage)
                        break
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                self._end(req)  # frees the slots if the client went away

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _answer(self, req: Request, parsed: Parsed, chat: bool, got: list[Event], end: Event) -> dict:
        """The non-streamed response from all of a request's events."""
        k = parsed.logprobs
        choices = []
        for i in range(parsed.n):
            mine = [ev for ev in got if ev.index == i]
            deltas = [ev for ev in mine if ev.kind == "delta" and ev.prompt is None]
            prompt = next((ev.prompt for ev in mine if ev.prompt is not None), None)
            done = next(ev for ev in mine if ev.kind == "done")
            text = "".join(d.text for d in deltas)
            scores = [o for d in deltas for o in (d.logprobs or [])]
            choice: dict[str, Any] = {"index": i, "finish_reason": done.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if k is not None:
                    choice["logprobs"] = self._chat_logprobs(scores, k)
            else:
                choice["text"] = (parsed.prompt_text if parsed.echo else "") + text
                if k is not None:
                    entries = self._prompt_entries(parsed, prompt) if parsed.score_prompt else []
                    choice["logprobs"] = self._completion_logprobs(entries + [(o.token, o) for o in scores], k)
            if parsed.token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
            choices.append(choice)
        return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": end.usage,
                **({"warnings": end.warnings} if end.warnings else {})}

    def _prompt_only(self, parsed: Parsed) -> dict:
        """echo with max_tokens 0 and no logprobs: the prompt back, nothing computed."""
        p = len(parsed.prompt)
        choices = [{"index": i, "text": parsed.prompt_text, "finish_reason": "length", "logprobs": None}
                   for i in range(parsed.n)]
        if parsed.token_ids:
            for c in choices:
                c["token_ids"] = []
        return {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p}}

    async def completions(self, http: HTTPRequest, chat: bool):
        req = watcher = None
        streaming = False
        try:
            if self.draining.is_set():
                raise _shutting_down()
            raw = await self._unless_draining(self._read_body(http))
            parsed = await asyncio.to_thread(self.parse, raw, chat)
            if parsed.max_tokens == 0 and not parsed.score_prompt:
                answer = self._prompt_only(parsed)
                if not parsed.stream:
                    return answer
                return StreamingResponse(self._stream_answer(answer, parsed), media_type="text/event-stream")
            req, events = self._submit(parsed)
            watcher = asyncio.create_task(self._cancel_on_disconnect(http, req, events))
            if parsed.stream:
                streaming = True
                return self._stream(req, events, parsed, chat, watcher)
            got, end = await self._collect(req, events)
        except APIError as e:
            return e.response()
        finally:
            if req is not None and not streaming:
                watcher.cancel()
                self._end(req)
        return await asyncio.to_thread(self._answer, req, parsed, chat, got, end)

    async def _stream_answer(self, answer: dict, parsed: Parsed) -> AsyncIterator[str]:
        """A complete answer as one chunk (and its usage when asked), then [DONE]."""
        usage = answer.pop("usage")
        extra = {"usage": usage} if parsed.continuous_usage else {}
        yield "data: " + json.dumps({**answer, **extra}) + "\n\n"
        if parsed.include_usage:
            yield "data: " + json.dumps({**answer, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    # -- shutting down ------------------------------------------------------------------------------------------------

    def start_draining(self) -> None:
        """At shutdown: admit nothing more, end the waiting requests and half-sent bodies (503), and give the running
        requests `shutdown_timeout` seconds before they end too."""
        if self.draining.is_set():
            return
        self.draining.set()
        self.scheduler.drain()
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self._end_running)

    def _end_running(self) -> None:
        message = (f"the server shut down before this request finished (it gives running requests "
                   f"{self.shutdown_timeout:g} s: kivi-jax serve --shutdown-timeout)")
        for req, events in list(self.running.values()):
            self.scheduler.cancel(req)
            events.put_nowait(Event("error", message=message, status=503))

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "kivi_jax"}]}

    def health(self) -> dict:
        m = self.scheduler.metrics()
        return {"status": "ok", "model": self.model_name, "cache": self.engine.spec_name, "slots": m["slots"],
                "live_slots": m["live"], "queue_length": m["queue_length"]}

    def prometheus(self) -> str:
        m = self.scheduler.metrics()
        rows = [
            ("slots", "gauge", "slots in the batch cache", m["slots"]),
            ("live_slots", "gauge", "slots decoding a request", m["live"]),
            ("held_slots", "gauge", "slots holding a finished request's prefix for reuse", m["held"]),
            ("filling_slots", "gauge", "slots reserved for a batched prefill in progress", m["filling"]),
            ("peak_live_slots", "gauge", "most slots live at once since start", m["peak_live"]),
            ("queue_length", "gauge", "requests waiting for a slot", m["queue_length"]),
            ("queue_capacity", "gauge", "the queue bound (past it: 503)", m["max_queue"]),
            ("tokens_per_second", "gauge", f"generated tokens a second over the last {TOKENS_PER_S_WINDOW:g} s",
             m["tokens_per_s"]),
            ("cache_bytes", "gauge", "bytes of the batch cache", m["cache_bytes"]),
            ("cache_bytes_in_use", "gauge", "bytes of the slots that hold a live or held sequence",
             m["cache_bytes_in_use"]),
            ("max_length_tokens", "gauge", "tokens a slot holds", self.engine.max_length),
        ]
        if self.engine.paged:  # docs/serving.md, "Paged cache"
            rows += [(name, "gauge", help_, m[name]) for name, help_ in (
                ("pages_total", "pages in the paged cache's pool"), ("pages_free", "pages neither held nor cached"),
                ("pages_used", "pages a request holds"), ("pages_cached", "unheld pages kept as a prefix"),
                ("pages_shared", "pages more than one request holds"))]
            rows += [("page_evictions_total", "counter", "cached pages evicted", m["pages_evictions"])]
            if self.engine.prefix_snapshots:
                rows += [("prefix_snapshots", "gauge", "prompt prefixes kept for sharing", m["prefix_snapshots"]),
                         ("prefix_snapshot_bytes", "gauge", "bytes of the prefix snapshots (outside the pool)",
                          m["prefix_snapshot_bytes"])]
        counters = ["requests_queued", "requests_rejected", "requests_finished", "requests_cancelled",
                    "requests_failed", "prompt_tokens", "completion_tokens", "prefill_tokens_computed",
                    "prefix_tokens_reused", "decode_steps", "prefill_calls", "prefill_rows", "preemptions"]
        rows += [(f"{c}_total", "counter", c.replace("_", " "), m.get(c, 0)) for c in counters]
        rows += [(f"{part}_seconds_total", "counter", help_, m[f"{part}_seconds"]) for part, help_ in SECONDS.items()]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP kivi_serve_{name} {help_}", f"# TYPE kivi_serve_{name} {kind}",
                      f"kivi_serve_{name} {value}"]
        return "\n".join(lines) + "\n"


ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
          "GET /health", "GET /metrics")


def create_app(scheduler: Scheduler, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread. Serve it with `make_uvicorn` (or
    `ServerThread`), whose shutdown drains it first."""
    import contextlib

    api = API(scheduler, model_name, max_body_bytes, shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop(timeout=5.0)

    app = FastAPI(title="kivi_jax", lifespan=lifespan)
    app.state.api = api

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 404:
            message = f"there is no route {where}; this server has {', '.join(ROUTES)}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path[:200]}; use {allowed or 'another method'}"
        else:
            message = f"{where}: {exc.detail}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, exc: Exception):  # a bug: logged by uvicorn, an error object here
        return APIError(500, f"internal error ({type(exc).__name__}); the server logged it", type_="server_error",
                        code="internal_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await api.completions(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await api.completions(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return api.models()

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        if model_id != model_name:
            return APIError(404, f"the model {_show(model_id)} does not exist; this server serves {model_name!r}",
                            param="model", code="model_not_found").response()
        return api.models()["data"][0]

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(api.prometheus(), media_type="text/plain; version=0.0.4")

    return app


def make_uvicorn(app, host: str, port: int, log_level: str = "info"):
    """A uvicorn server for `app` whose shutdown (SIGTERM, SIGINT, `should_exit`) first drains it
    (`API.start_draining`); past the running requests' `shutdown_timeout`, uvicorn's own graceful timeout (5 s more)
    cancels whatever is left."""
    import uvicorn

    api: API = app.state.api

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            api.start_draining()
            await super().shutdown(sockets)

    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=api.shutdown_timeout + 5))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` in a background thread (tests, the in-process benchmark); `stop` shuts it down as
    SIGTERM does the CLI's."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port or free_port(host)
        self.server = make_uvicorn(app, self.host, self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="kivi-jax-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
