"""kivi-jax serve against hostile clients, as a new user would try it: odd types, huge numbers, NaN, lone surrogates,
deep nesting, huge and half-sent bodies, wrong routes and methods, clients that disconnect (queued or running), many
at once, and SIGTERM. Every request is answered as its class expects (400 / 404 / 405 / 413 / 503 with an OpenAI error
object, never a 500 or a hang), the server stays healthy, and nothing is lost of the other requests.

The live server of tests/test_serve.py (its fixtures, one server for this module); the shutdown tests build two more
alike (the same compiled functions).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

from test_serve import (MAX_QUEUE, MODEL, SLOTS, build, client, model, prompts, served,  # noqa: F401
                        token_ids, wait_for)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = 100_000


def raw(text: str) -> bytes:
    return text.encode()


# (id, method, path, body: a dict (sent as JSON), bytes (sent as they are) or None, status, code, words in the message)
HOSTILE = [
    ("temperature-nan", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi", "temperature": NaN}'), 400,
     "invalid_json", "NaN is not a JSON value"),
    ("top-p-infinity", "POST", CHAT, raw('{"model": "tiny", "messages": [], "top_p": Infinity}'), 400,
     "invalid_json", "Infinity is not a JSON value"),
    ("temperature-overflows-to-inf", "POST", COMPLETIONS,
     raw('{"model": "tiny", "prompt": "hi", "temperature": 1e400}'), 400, "invalid_value",
     "temperature must be a finite number"),
    ("top-p-minus-infinity", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi", "top_p": -1e999}'), 400,
     "invalid_value", "top_p must be a finite number"),
    ("lone-surrogate-in-chat", "POST", CHAT,
     raw('{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400, "invalid_value",
     "messages[0].content is not valid Unicode: a lone surrogate U+D800 at character 1"),
    ("lone-surrogate-in-a-part", "POST", CHAT,
     raw('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'), 400,
     "invalid_value", "lone surrogate U+DFFF"),
    ("lone-surrogate-in-prompt", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi \\ud800"}'), 400,
     "invalid_value", "prompt is not valid Unicode"),
    ("lone-surrogate-in-stop", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'), 400,
     "invalid_value", "stop is not valid Unicode"),
    ("lone-surrogate-as-a-key", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi", "\\ud800": 1}'), 400,
     "unknown_parameter", "unrecognized request argument(s)"),
    ("lone-surrogate-as-the-model", "POST", COMPLETIONS, raw('{"model": "\\ud800", "prompt": "hi"}'), 404,
     "model_not_found", "does not exist"),
    ("nested-100k-deep", "POST", COMPLETIONS, raw("[" * DEEP + "]" * DEEP), 400, "invalid_json", "nested too deeply"),
    ("nested-5k-deep-in-messages", "POST", CHAT,
     raw('{"model": "tiny", "messages": [' + "[" * 5000 + "]" * 5000 + "]}"), 400, "invalid_json", "nested too deeply"),
    ("nested-900-deep-in-n", "POST", COMPLETIONS, raw('{"model": "tiny", "prompt": "hi", "n": ' + "[" * 900 + "]" * 900
                                                      + "}"), 400, "invalid_value", "n=[[[["),
    ("integer-of-5000-digits", "POST", COMPLETIONS,
     raw('{"model": "tiny", "prompt": "hi", "seed": ' + "9" * 5000 + "}"), 400, "invalid_json", "4300 digits"),
    ("numeric-model", "POST", COMPLETIONS, {**HI, "model": 7}, 400, "invalid_type",
     "'model' must be a non-empty string"),
    ("empty-model", "POST", CHAT, {**HELLO, "model": ""}, 400, "invalid_type", "'model' must be a non-empty string"),
    ("no-model", "POST", COMPLETIONS, {"prompt": "hi"}, 400, "missing_parameter", "'model' is required"),
    ("another-model", "POST", COMPLETIONS, {**HI, "model": "gpt-4o"}, 404, "model_not_found",
     '"gpt-4o" does not exist'),
    ("max-tokens-zero", "POST", COMPLETIONS, {**HI, "max_tokens": 0}, 400, "invalid_value", "positive integer"),
    ("max-tokens-negative", "POST", CHAT, {**HELLO, "max_completion_tokens": -3}, 400, "invalid_value",
     "max_completion_tokens must be a positive integer"),
    ("max-tokens-string", "POST", COMPLETIONS, {**HI, "max_tokens": "8"}, 400, "invalid_value", 'not "8"'),
    ("max-tokens-fraction", "POST", COMPLETIONS, {**HI, "max_tokens": 2.5}, 400, "invalid_value", "not 2.5"),
    ("max-tokens-huge", "POST", COMPLETIONS, {**HI, "max_tokens": 10**30}, 400, "context_length_exceeded",
     "lower max_tokens to at most"),
    ("temperature-string", "POST", COMPLETIONS, {**HI, "temperature": "0.5"}, 400, "invalid_value", 'not "0.5"'),
    ("temperature-bool", "POST", COMPLETIONS, {**HI, "temperature": True}, 400, "invalid_value", "not true"),
    ("temperature-negative", "POST", COMPLETIONS, {**HI, "temperature": -0.1}, 400, "invalid_value", "out of range"),
    ("top-p-zero", "POST", COMPLETIONS, {**HI, "top_p": 0}, 400, "invalid_value", "(0, 1]"),
    ("top-k-past-int32", "POST", COMPLETIONS, {**HI, "top_k": 2**31}, 400, "invalid_value", "out of range"),
    ("top-k-minus-two", "POST", COMPLETIONS, {**HI, "top_k": -2}, 400, "invalid_value", "out of range"),
    ("seed-past-int64", "POST", COMPLETIONS, {**HI, "seed": 2**64}, 400, "invalid_value", "out of range"),
    ("seed-string", "POST", COMPLETIONS, {**HI, "seed": "42"}, 400, "invalid_value", "seed must be an integer"),
    ("stream-string", "POST", COMPLETIONS, {**HI, "stream": "yes"}, 400, "invalid_value",
     "stream must be true or false"),
    ("include-usage-string", "POST", COMPLETIONS, {**HI, "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "invalid_value", "include_usage must be true or false"),
    ("stream-options-list", "POST", COMPLETIONS, {**HI, "stream_options": ["include_usage"]}, 400, "invalid_value",
     "stream_options takes only include_usage"),
    ("five-stop-strings", "POST", COMPLETIONS, {**HI, "stop": list("abcde")}, 400, "invalid_value", "at most 4"),
    ("empty-stop-string", "POST", COMPLETIONS, {**HI, "stop": ""}, 400, "invalid_value", "non-empty"),
    ("stop-number", "POST", COMPLETIONS, {**HI, "stop": 5}, 400, "invalid_value", "stop must be a string"),
    ("n-past-the-slots", "POST", COMPLETIONS, {**HI, "n": 5}, 400, "invalid_value", "n=5 must be an integer in [1, 4]"),
    ("n-zero", "POST", CHAT, {**HELLO, "n": 0}, 400, "invalid_value", "n=0 must be an integer"),
    ("logprobs-past-20", "POST", COMPLETIONS, {**HI, "logprobs": 21}, 400, "invalid_value",
     "logprobs=21 must be an integer in [0, 20]"),
    ("logprobs-a-string", "POST", COMPLETIONS, {**HI, "logprobs": "5"}, 400, "invalid_value", 'logprobs="5"'),
    ("top-logprobs-without-logprobs", "POST", CHAT, {**HELLO, "top_logprobs": 3}, 400, "invalid_value",
     "top_logprobs needs logprobs: true"),
    ("top-logprobs-past-20", "POST", CHAT, {**HELLO, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value",
     "out of range"),
    ("top-logprobs-on-completions", "POST", COMPLETIONS, {**HI, "top_logprobs": 2}, 400, "invalid_value",
     "top_logprobs=2 is not supported"),
    ("echo-on-chat", "POST", CHAT, {**HELLO, "echo": True}, 400, "invalid_value", "echo=true is not supported"),
    ("echo-a-string", "POST", COMPLETIONS, {**HI, "echo": "yes"}, 400, "invalid_value", "echo must be true or false"),
    ("max-tokens-zero-with-logprobs-no-echo", "POST", COMPLETIONS, {**HI, "max_tokens": 0, "logprobs": 1}, 400,
     "invalid_value", "0 only with echo"),
    ("stop-token-ids-past-the-vocab", "POST", COMPLETIONS, {**HI, "stop_token_ids": [96]}, 400, "invalid_value",
     "stop_token_ids must be a list of at most 64 token ids in [0, 96)"),
    ("stop-token-ids-a-number", "POST", COMPLETIONS, {**HI, "stop_token_ids": 5}, 400, "invalid_value",
     "stop_token_ids must be a list"),
    ("cache-salt-a-number", "POST", CHAT, {**HELLO, "cache_salt": 5}, 400, "invalid_value",
     "cache_salt must be a string of at most 256 characters"),
    ("cache-salt-too-long", "POST", COMPLETIONS, {**HI, "cache_salt": "s" * 257}, 400, "invalid_value",
     "cache_salt must be a string"),
    ("response-format-unknown-type", "POST", CHAT, {**HELLO, "response_format": {"type": "xml"}}, 400,
     "invalid_value", "response_format must be an object whose type is one of text, json_object, json_schema"),
    ("response-format-schema-missing", "POST", CHAT, {**HELLO, "response_format": {"type": "json_schema"}}, 400,
     "invalid_value", 'needs "json_schema"'),
    ("response-format-schema-a-list", "POST", COMPLETIONS,
     {**HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400,
     "invalid_value", "must be a JSON Schema (an object), not list"),
    ("messages-empty", "POST", CHAT, {**HELLO, "messages": []}, 400, "invalid_value", "non-empty list"),
    ("messages-string", "POST", CHAT, {**HELLO, "messages": "hi"}, 400, "invalid_value", "non-empty list"),
    ("message-role-number", "POST", CHAT, {**HELLO, "messages": [{"role": 1, "content": "x"}]}, 400, "invalid_value",
     "with a role in"),
    ("message-role-list", "POST", CHAT, {**HELLO, "messages": [{"role": ["user"], "content": "x"}]}, 400,
     "invalid_value", "with a role in"),
    ("message-content-number", "POST", CHAT, {**HELLO, "messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_value", "content must be a string, not 5"),
    ("message-image-part", "POST", CHAT,
     {**HELLO, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "invalid_value", "only text content parts"),
    ("message-not-an-object", "POST", CHAT, {**HELLO, "messages": [None]}, 400, "invalid_value", "must be an object"),
    ("prompt-empty-list", "POST", COMPLETIONS, {**HI, "prompt": []}, 400, "invalid_value", "prompt must be a string"),
    ("prompt-empty-string", "POST", COMPLETIONS, {**HI, "prompt": ""}, 400, "invalid_value",
     "the prompt has no tokens"),
    ("prompt-fractions", "POST", COMPLETIONS, {**HI, "prompt": [1.5, 2]}, 400, "invalid_value", "list of token ids"),
    ("prompt-negative-id", "POST", COMPLETIONS, {**HI, "prompt": [-1, 5]}, 400, "invalid_value", "outside [0, 96)"),
    ("prompt-huge-id", "POST", COMPLETIONS, {**HI, "prompt": [10**30]}, 400, "invalid_value", "outside [0, 96)"),
    ("prompt-two-prompts", "POST", COMPLETIONS, {**HI, "prompt": ["a", "b"]}, 400, "invalid_value",
     "one prompt per request"),
    ("prompt-object", "POST", COMPLETIONS, {**HI, "prompt": {"text": "hi"}}, 400, "invalid_value", "prompt must be"),
    ("prompt-longer-than-a-slot", "POST", COMPLETIONS, {"model": MODEL, "prompt": [5] * 300}, 400,
     "context_length_exceeded", "shorten the prompt to at most 255 tokens"),
    ("body-a-list", "POST", COMPLETIONS, [1, 2], 400, "invalid_json", "must be a JSON object, not list"),
    ("body-null", "POST", CHAT, raw("null"), 400, "invalid_json", "must be a JSON object, not NoneType"),
    ("body-empty", "POST", COMPLETIONS, b"", 400, "invalid_json", "not valid JSON"),
    ("body-a-form", "POST", COMPLETIONS, raw("model=tiny&prompt=hi"), 400, "invalid_json", "not valid JSON"),
    ("body-not-utf8", "POST", COMPLETIONS, b'{"model": "tiny", "prompt": "\xff"}', 400, "invalid_json", "not UTF-8"),
    ("body-truncated", "POST", CHAT, raw('{"model": "tiny", "messages": [{"ro'), 400, "invalid_json", "not valid JSON"),
    ("unknown-route", "POST", "/v1/embeddings", HI, 404, "not_found", "there is no route POST /v1/embeddings"),
    ("unknown-path", "GET", "/admin/../etc/passwd", None, 404, "not_found", "there is no route"),
    ("get-completions", "GET", COMPLETIONS, None, 405, "method_not_allowed", "GET is not allowed on /v1/completions"),
    ("put-health", "PUT", "/health", HI, 405, "method_not_allowed", "use GET"),
    ("delete-models", "DELETE", "/v1/models", None, 405, "method_not_allowed", "DELETE is not allowed"),
    ("another-model-by-id", "GET", "/v1/models/gpt-4o", None, 404, "model_not_found", "does not exist"),
]


HTTP = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64))  # one client: httpx makes an SSL context each


def send(url: str, method: str, path: str, body, content_type: str = "application/json") -> httpx.Response:
    content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    return HTTP.request(method, url + path, content=content,
                        headers={"content-type": content_type} if content is not None else None)


def alone(url: str, prompt: list[int], n: int) -> list[int]:
    """The greedy tokens of `prompt` requested alone (tests/test_serve.py checks them against `generate`)."""
    r = send(url, "POST", COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                        "return_token_ids": True})
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["token_ids"]


def read_all(s: socket.socket) -> str:
    """What the server sends on a raw connection until it closes it."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.decode()


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a response, checked for its shape."""
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return err


@pytest.mark.parametrize("method, path, body, status, code, words", [c[1:] for c in HOSTILE],
                         ids=[c[0] for c in HOSTILE])
def test_hostile_requests_get_openai_error_objects(served, method, path, body, status, code, words):
    r = send(served[1], method, path, body)
    assert r.status_code == status, r.text[:300]
    err = error_of(r)
    assert err["code"] == code and words in err["message"], err
    if r.status_code == 405:
        assert r.headers["allow"]


def test_odd_but_valid_requests_are_answered(served, client):
    _, url = served
    ok = [
        send(url, "POST", COMPLETIONS, json.dumps(HI).encode(), content_type="text/plain"),
        send(url, "POST", COMPLETIONS, {**HI, "top_k": 2**31 - 1, "temperature": 0.5, "seed": -(2**63)}),
        send(url, "POST", COMPLETIONS, {**HI, "top_k": -1, "top_p": 0.5, "seed": 2**63 - 1}),
        send(url, "POST", COMPLETIONS, {**HI, "stop": [], "logit_bias": {}, "logprobs": False, "n": 1, "user": "x",
                                        "stream_options": None, "prompt": [[5, 6, 7]]}),
        send(url, "POST", COMPLETIONS, {**HI, "prompt": "\U0001f600 \u00e9 \ud83d\ude00", "max_tokens": 1}),
        send(url, "POST", CHAT, {**HELLO, "messages": [{"role": "developer", "content": ""},
                                                       {"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
    ]
    for r in ok:
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] >= 1
    # a top_p so small that it is 0 in float32 keeps the most likely token (it kept none: every draw was token 0)
    p = prompts(11, [9])[0]
    tiny_p = send(url, "POST", COMPLETIONS, {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 1.0,
                                             "top_p": 1e-300, "seed": 3, "return_token_ids": True})
    assert tiny_p.json()["choices"][0]["token_ids"] == alone(url, p, 8)  # = greedy
    # the openai client with every default, and streaming with usage
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream=True,
                                    stream_options={"include_usage": True})
    assert list(out)[-1].usage.completion_tokens == 1


def test_a_huge_body_is_refused_at_once_and_costs_no_memory(served):
    server, url = served
    limit = server.app.state.api.max_body_bytes
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    before = rss()
    # a Content-Length past the limit: 413 before a byte of the body is sent
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 20000000\r\n\r\n")
        head = read_all(s)  # the server closes the connection after it
    assert head.startswith("HTTP/1.1 413") and '"code":"body_too_large"' in head, head
    # 20 MB of a prompt, chunked (no length announced): read up to the limit, then 413
    big = json.dumps({"model": MODEL, "prompt": "a" * 20_000_000, "max_tokens": 1}).encode()
    r = HTTP.post(url + COMPLETIONS, content=(big[i : i + 2**20] for i in range(0, len(big), 2**20)),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large", r.text[:300]
    assert f"past this server's limit of {limit} bytes (kivi-jax serve --max-body-bytes)" in error_of(r)["message"]
    assert rss() - before < 200 * 2**20  # tokenizing it took 3.7 GB


def test_a_request_being_tokenized_holds_up_no_other_route(served, monkeypatch):
    """Parsing and tokenizing run in a worker thread: while one request's prompt is being tokenized (held here),
    /health and another request are answered."""
    server, url = served
    sched = server.scheduler
    started, release = threading.Event(), threading.Event()
    real = sched.encode

    def slow_encode(text, *args, **kwargs):
        if text == "slow":
            started.set()
            release.wait(60)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(sched, "encode", slow_encode)
    results = {}
    slow = threading.Thread(target=lambda: results.update(
        slow=send(url, "POST", COMPLETIONS, {**HI, "prompt": "slow"})))
    slow.start()
    try:
        assert started.wait(60)
        assert HTTP.get(url + "/health").json()["status"] == "ok"
        assert send(url, "POST", COMPLETIONS, HI).status_code == 200
        assert "slow" not in results  # still being tokenized
    finally:
        release.set()
        slow.join(60)
    assert results["slow"].status_code == 200


def test_a_chat_template_that_refuses_the_messages_is_a_400(served, monkeypatch):
    server, url = served  # real templates raise on what they cannot render (e.g. roles that do not alternate)
    monkeypatch.setattr(server.scheduler.encoder, "chat_template",
                        "{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    r = send(url, "POST", CHAT, HELLO)
    assert r.status_code == 400 and "roles must alternate" in error_of(r)["message"], r.text[:300]


def test_a_body_cut_short_by_the_client_is_no_server_error(served):
    import logging

    _, url = served
    port = int(url.rsplit(":", 1)[1])
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)  # "Exception in ASGI application" and its traceback
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
        assert HTTP.get(url + "/health").json()["status"] == "ok"
        time.sleep(0.5)  # the server hears of each disconnect on its own; nothing here may fail if it is slow
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [e.getMessage() for e in errors]


def open_request(url: str, body: dict, path: str = COMPLETIONS) -> socket.socket:
    """A raw connection that has sent a whole request (so the test can drop it at any moment)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
              "\r\n\r\n".encode() + data)
    return s


def test_a_client_that_disconnects_from_a_non_streamed_request_frees_its_slot_within_a_step_or_two(served):
    server, url = served
    sched, eng = server.scheduler, server.engine
    before = dict(sched.counters)
    s = open_request(url, {"model": MODEL, "prompt": prompts(3, [5])[0], "max_tokens": 200, "temperature": 0})
    assert wait_for(lambda: eng.count("live") == 1 and eng.counters["decode_steps"] > 0)
    with sched.paused():  # no step runs until the server has heard of the disconnect
        (req, _), = sched.active.values()
        s.close()
        assert wait_for(req.cancelled.is_set, timeout=30)  # the HTTP side cancels the request
        steps = eng.counters["decode_steps"]
    assert wait_for(lambda: eng.count("live") == 0, timeout=30)
    assert eng.counters["decode_steps"] == steps  # freed before the next step (it would have run to 200 tokens)
    assert sched.counters["requests_cancelled"] == before["requests_cancelled"] + 1
    assert sched.counters["requests_finished"] == before["requests_finished"]


def test_a_cancelled_request_leaves_the_queue_at_once(served):
    server, url = served
    sched = server.scheduler
    stays = {}
    p = prompts(8, [6])[0]
    want = alone(url, p, 4)
    before = dict(sched.counters)
    waiter = threading.Thread(target=lambda: stays.update(r=send(url, "POST", COMPLETIONS, {
        "model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0, "return_token_ids": True})))
    with sched.paused():  # nothing is admitted: every request waits in the queue
        gone = [open_request(url, {**HI, "max_tokens": 50}),
                open_request(url, {**HELLO, "stream": True, "max_tokens": 50}, CHAT)]
        waiter.start()
        assert wait_for(lambda: sched.queue_length() == 3)
        for s in gone:
            s.close()
        assert wait_for(lambda: sched.queue_length() == 1, timeout=10)  # before a slot frees
        assert sched.counters["requests_cancelled"] == before["requests_cancelled"] + 2
    waiter.join(60)
    assert stays["r"].status_code == 200 and stays["r"].json()["choices"][0]["token_ids"] == want


def test_many_clients_at_once_some_leaving_lose_nothing(served):
    server, url = served
    sched = server.scheduler
    p = prompts(9, [7])[0]
    want = alone(url, p, 6)
    results, left = {}, []

    def stay(i):
        results[i] = send(url, "POST", COMPLETIONS, {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0,
                                                     "return_token_ids": True})

    def leave(i):
        try:
            with httpx.stream("POST", url + COMPLETIONS, timeout=60, json={
                    "model": MODEL, "prompt": prompts(10 + i, [5])[0], "max_tokens": 100, "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 2:
                        break
            left.append(r.status_code)
        except httpx.HTTPError as e:  # noqa: PERF203 (a refused or dropped connection is not a lost answer here)
            left.append(type(e).__name__)

    threads = [threading.Thread(target=stay, args=(i,)) for i in range(24)]
    threads += [threading.Thread(target=leave, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(24))
    for r in results.values():  # answered, or refused at once with a reason: never a 500
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"] == want
        else:
            assert r.status_code == 503 and error_of(r)["code"] == "queue_full", r.text[:300]
    assert sum(r.status_code == 200 for r in results.values()) >= SLOTS + MAX_QUEUE // 2
    assert len(left) == 8 and set(left) <= {200, 503}
    assert wait_for(lambda: server.engine.count("live") == 0 and sched.queue_length() == 0)


def test_the_server_is_healthy_after_all_that(model, served, client):
    server, url = served
    health = HTTP.get(url + "/health").json()
    assert health["status"] == "ok" and health["live_slots"] == 0 and health["queue_length"] == 0
    assert server.scheduler.counters["requests_failed"] == 0 and server.scheduler.error is None
    p = prompts(11, [9])[0]
    out = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert token_ids(out.choices[0]) == alone(url, p, 8)


# ---------------------------------------------------------------------------------------------------------------------
# Shutdown: `should_exit` is what uvicorn's SIGTERM handler sets in `kivi-jax serve` (tests/test_serve.py's fixture
# shuts down the same way)


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return True
    return False


def test_shutdown_lets_a_running_request_finish_and_refuses_new_ones(model):
    from kivi_jax.serve.http import ServerThread

    server = build(model, shutdown_timeout=120)
    thread = ServerThread(server.app).start()
    p = prompts(12, [6])[0]
    want = alone(thread.url, p, 60)
    assert len(want) == 60  # no EOS on the way: it runs for 60 steps
    result = {}
    running = threading.Thread(target=lambda: result.update(r=send(thread.url, "POST", COMPLETIONS, {
        "model": MODEL, "prompt": p, "max_tokens": 60, "temperature": 0, "return_token_ids": True})))
    running.start()
    assert wait_for(lambda: server.engine.count("live") == 1)
    with server.scheduler.paused():  # running, and it cannot finish before the shutdown starts
        assert server.engine.count("live") == 1
        thread.server.should_exit = True
        assert wait_for(lambda: refused(thread.port), timeout=30)
    running.join(120)
    thread.thread.join(60)
    assert not thread.thread.is_alive()
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["token_ids"] == want


def test_shutdown_ends_waiting_half_sent_idle_and_overdue_requests(model):
    from kivi_jax.serve.http import ServerThread

    server = build(model, shutdown_timeout=0)  # running requests get no time: they end at once
    sched = server.scheduler
    thread = ServerThread(server.app).start()
    url, port = thread.url, thread.port
    lines = []

    def stream():
        with httpx.stream("POST", url + COMPLETIONS, timeout=60, json={
                "model": MODEL, "prompt": prompts(3, [5])[0], "max_tokens": 200, "temperature": 0,
                "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert wait_for(lambda: len(lines) >= 2)
    queued = {}
    with sched.paused():
        waiting = threading.Thread(target=lambda: queued.update(r=send(url, "POST", COMPLETIONS, HI)))
        waiting.start()
        assert wait_for(lambda: sched.queue_length() == 1)
        idle = socket.create_connection(("127.0.0.1", port), timeout=30)
        half = socket.create_connection(("127.0.0.1", port), timeout=30)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        assert wait_for(lambda: len(server.app.state.api.running) == 2)  # the stream and the queued one
        thread.server.should_exit = True
        waiting.join(60)
        assert queued["r"].status_code == 503 and error_of(queued["r"])["code"] == "shutting_down"
        head = read_all(half)
        assert head.startswith("HTTP/1.1 503") and '"code":"shutting_down"' in head, head
        assert idle.recv(1) == b""  # closed
    streaming.join(60)
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down" and lines[-1] == (
        "data: [DONE]")
    thread.thread.join(60)
    assert not thread.thread.is_alive() and refused(port)
    half.close()
    idle.close()
