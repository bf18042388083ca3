"""The OpenAI-compatible HTTP layer (FastAPI): it validates and tokenizes requests, queues them on the scheduler and
streams their events back. It never touches the engine.

Routes: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors are OpenAI error objects: 400 invalid parameters or a prompt that
does not fit a slot, 404 unknown model, 503 queue full.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kivi_jax.serve.sampling import RowSampling
from kivi_jax.serve.scheduler import TOKENS_PER_S_WINDOW, Event, QueueFull, Request, Scheduler

MAX_STOP_STRINGS = 4
# Accepted and ignored (they change nothing here) or accepted only at their default value.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
DEFAULT_ONLY = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None,
                "top_logprobs": None, "logit_bias": None, "echo": False, "suffix": None, "tools": None,
                "tool_choice": None, "response_format": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "return_token_ids"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_KEYS = COMMON | {"prompt"}
ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default, lo: float, hi: float, lo_open: bool = False, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise _bad(name, f"{name} must be {'an integer' if integer else 'a number'}, not {json.dumps(v)}")
    if v < lo or (lo_open and v == lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise _bad(name, f"{name}={v} is out of range: it must be in {interval}")
    return v


class Parsed:
    """A validated request: prompt token ids and everything the scheduler needs."""

    def __init__(self, prompt: list[int], max_tokens: int | None, sampling: RowSampling, stop: tuple[str, ...],
                 stream: bool, include_usage: bool, token_ids: bool):
        self.prompt, self.max_tokens, self.sampling, self.stop = prompt, max_tokens, sampling, stop
        self.stream, self.include_usage, self.token_ids = stream, include_usage, token_ids


class API:
    """The routes over one scheduler; `model_name` is the only model `/v1/models` lists."""

    def __init__(self, scheduler: Scheduler, model_name: str):
        self.scheduler, self.engine, self.model_name = scheduler, scheduler.engine, model_name
        self.created = int(time.time())

    # -- parsing ------------------------------------------------------------------------------------------------------

    async def _json(self, request: HTTPRequest) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def _common(self, body: dict, allowed: set[str], max_tokens_key: str = "max_tokens") -> Parsed:
        """Everything but the prompt (which the caller fills in)."""
        unknown = sorted(set(body) - allowed - IGNORED - set(DEFAULT_ONLY))
        if unknown:
            raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)}; this server accepts "
                                f"{', '.join(sorted(allowed | set(DEFAULT_ONLY)))}", param=unknown[0],
                           code="unknown_parameter")
        for k, default in DEFAULT_ONLY.items():
            v = body.get(k)
            if v is not None and v != default and not (k == "logit_bias" and v == {}) and not (
                    k == "logprobs" and v is False):
                raise _bad(k, f"{k}={json.dumps(v)} is not supported by this server (only {json.dumps(default)})")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, f"'model' is required; this server serves {self.model_name!r}", param="model",
                           code="missing_parameter")
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise _bad(key, f"{key} must be a positive integer, not {json.dumps(max_tokens)}")
        top_k = _number(body, "top_k", 0, -1, 1 << 31, integer=True)
        sampling = RowSampling(
            temperature=float(_number(body, "temperature", 1.0, 0, 2)),
            top_p=float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)),
            top_k=max(top_k, 0),  # -1 (vLLM) and 0 both mean no cut
            seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        )
        if sampling.seed is not None:
            sampling = RowSampling(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed % (1 << 31))
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise _bad("stop", "stop must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise _bad("stop", f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "stream must be true or false")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "stream_options takes only include_usage")
        token_ids = body.get("return_token_ids", False)
        if not isinstance(token_ids, bool):
            raise _bad("return_token_ids", "return_token_ids must be true or false")
        return Parsed([], max_tokens, sampling, stop, stream, bool(options.get("include_usage")), token_ids)

    def _check_fit(self, parsed: Parsed, param: str) -> None:
        n = len(parsed.prompt)
        if parsed.max_tokens is None:
            parsed.max_tokens = self.engine.max_length - n  # the rest of the slot
        if n < 1:
            raise _bad(param, "the prompt has no tokens")
        try:
            self.engine.check_fits(n, max(parsed.max_tokens, 1))
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a role in {', '.join(ROLES)}")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        tok = self.scheduler.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        text = self.scheduler.apply_chat_template(clean)
        return list(self.scheduler.encode(text, add_special_tokens=False)["input_ids"])

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if self.scheduler.tokenizer is None:
                raise _bad("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
            return list(self.scheduler.encode(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.cfg.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _bad("prompt", f"token ids outside [0, {vocab}): {bad[:5]}")
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

        req = Request(parsed.prompt, parsed.max_tokens, parsed.sampling, emit, parsed.stop)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(503, str(e), type_="server_error", code="queue_full") from None
        return req, events

    async def _collect(self, http: HTTPRequest, req: Request, events: asyncio.Queue) -> tuple[list[Event], Event]:
        """All of a request's events up to `done`; cancels it if the client goes away meanwhile."""
        deltas = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        req.cancel()
                        raise APIError(499, "client disconnected")
                    continue
                if ev.kind == "delta":
                    deltas.append(ev)
                elif ev.kind == "error":
                    raise APIError(500, ev.message, type_="server_error")
                else:
                    return deltas, ev
        except asyncio.CancelledError:
            req.cancel()
            raise

    def _stream(self, req: Request, events: asyncio.Queue, parsed: Parsed, chat: bool) -> StreamingResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + req.id
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": choices, **extra}) + "\n\n"

        def choice(text: str | None, finish: str | None, ids: list[int] | None = None, role: bool = False) -> dict:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            if parsed.token_ids and ids is not None:
                c["token_ids"] = ids
            return c

        async def body() -> AsyncIterator[str]:
            try:
                if chat:
                    yield chunk([choice("", None, role=True)])
                while True:
                    ev = await events.get()
                    if ev.kind == "delta":
                        yield chunk([choice(ev.text, None, ev.token_ids)])
                    elif ev.kind == "error":
                        yield "data: " + json.dumps(APIError(500, ev.message, "server_error").body()) + "\n\n"
                        break
                    else:
                        yield chunk([choice(None if chat else "", ev.finish_reason, [])])
                        if parsed.include_usage:
                            yield chunk([], usage=ev.usage)
                        break
                yield "data: [DONE]\n\n"
            finally:
                req.cancel()  # a no-op once the request is done; frees the slot if the client went away

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(self, http: HTTPRequest, chat: bool):
        try:
            body = await self._json(http)
            if chat:
                parsed = self._common(body, CHAT_KEYS, "max_completion_tokens")
                parsed.prompt = self._chat_prompt(body)
            else:
                parsed = self._common(body, COMPLETION_KEYS)
                parsed.prompt = self._completion_prompt(body)
            self._check_fit(parsed, "messages" if chat else "prompt")
            req, events = self._submit(parsed)
            if parsed.stream:
                return self._stream(req, events, parsed, chat)
            deltas, done = await self._collect(http, req, events)
        except APIError as e:
            return e.response()
        text = "".join(d.text for d in deltas)
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if parsed.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": done.usage}

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
        counters = ["requests_queued", "requests_rejected", "requests_finished", "requests_cancelled",
                    "requests_failed", "prompt_tokens", "completion_tokens", "prefill_tokens_computed",
                    "prefix_tokens_reused", "decode_steps"]
        rows += [(f"{c}_total", "counter", c.replace("_", " "), m.get(c, 0)) for c in counters]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP kivi_serve_{name} {help_}", f"# TYPE kivi_serve_{name} {kind}",
                      f"kivi_serve_{name} {value}"]
        return "\n".join(lines) + "\n"


def create_app(scheduler: Scheduler, model_name: str) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread."""
    import contextlib

    api = API(scheduler, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="kivi_jax", lifespan=lifespan)
    app.state.api = api

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
            return APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                            param="model", code="model_not_found").response()
        return api.models()["data"][0]

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(api.prometheus(), media_type="text/plain; version=0.0.4")

    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` in a background thread (tests, the in-process benchmark)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning"))
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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
