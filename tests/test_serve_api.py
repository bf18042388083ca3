"""kivi-jax serve's tool-facing API: logprobs and echo against `kivi_jax.evaluate`'s teacher-forced log-probabilities,
n choices from one prefill with per-choice seeds, structured output through a grammar, stop token ids, usage on every
stream chunk, seeds across a restart.

The live server of tests/test_serve.py (its fixtures: a tiny random model, a KIVI cache with a residual of 16 tokens
so that prompts cross several quantized blocks), one for this module; the compiled functions are shared.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from kivi_jax.evaluate import teacher_forced
from kivi_jax.serve.scheduler import choice_seed
from test_serve import MAX_LENGTH, MODEL, SPEC, build, client, model, prompts, served  # noqa: F401

openai = pytest.importorskip("openai")

COMPLETIONS = "/v1/completions"
SCORED = 70  # prompt tokens scored: 16 prefilled (the ring), the rest one a step across three quantized blocks
P = 2  # the prefill of kivi-jax eval's protocol (tokens it does not score one a step)


def post(url: str, body: dict, path: str = COMPLETIONS) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


# ---------------------------------------------------------------------------------------------------------------------
# logprobs and echo


@pytest.fixture(scope="module")
def scored_prompt():
    return prompts(21, [SCORED])[0]


def test_echo_logprobs_are_the_teacher_forced_logprobs_through_the_cache(model, served, scored_prompt):
    """echo + logprobs + max_tokens 0 (what lm-evaluation-harness sends for log-likelihoods) gives, for every prompt
    token after the first, the log-probability `kivi_jax.evaluate.teacher_forced` gives it through the same cache: the
    server's KIVI cache, and the full-precision one (an engine alone)."""
    from kivi_jax.serve.engine import Engine
    from kivi_jax.sampling import Sampling

    server, url = served
    tokens = scored_prompt
    r = post(url, {"prompt": tokens, "echo": True, "logprobs": 3, "max_tokens": 0})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == SCORED
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token: no prediction
    got = {SPEC: np.array(lp["token_logprobs"][1:])}
    eng = Engine(model.params, "full", slots=1, max_length=MAX_LENGTH, prefill_chunk=64)
    admitted = eng.admit_choices(tokens, [Sampling(0.0)], score_prompt=True, logprobs=True)
    assert eng.counters["decode_steps"] == 0  # the full cache: the whole prompt scored by its prefill
    assert [o.token for o in admitted.prompt_scores] == tokens[1:]
    got["full"] = np.array([o.logprob for o in admitted.prompt_scores])
    want = {spec: -teacher_forced(model.params, np.asarray([tokens]), P, spec)["nll"][0] for spec in got}
    for spec in got:  # tokens P + 1 .. end
        assert np.abs(got[spec][P:] - want[spec]).max() <= 1e-4, spec
    assert np.abs(want["full"] - want[SPEC])[16:].max() > 1e-3  # the quantized blocks change the numbers


def test_top_logprobs_are_sorted_and_hold_the_greedy_token(model, served, client):
    _, url = served
    p = prompts(22, [9])[0]
    plain = post(url, {"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).json()
    r = post(url, {"prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 4, "return_token_ids": True})
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    assert ids == plain["choices"][0]["token_ids"]  # logprobs change nothing of what is drawn
    lp = choice["logprobs"]
    strings = [model.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["tokens"] == strings
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and 4 <= len(top) <= 5
        assert next(iter(top)) == token and top[token] == logprob  # greedy: the most likely one
        assert logprob <= 0
    assert lp["text_offset"] == list(np.cumsum([0] + [len(s) for s in strings[:-1]]))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content)
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert c.bytes == list(c.token.encode())
    # streamed: the same numbers, a delta at a time
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_echo_with_generation_and_the_lm_eval_request(served, scored_prompt):
    """lm-eval's local-completions sends token ids, echo, logprobs 1 and max_tokens 1, and reads
    token_logprobs[ctxlen:-1] and whether each is the top one."""
    _, url = served
    tokens = scored_prompt[:30]
    alone = post(url, {"prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 0}).json()["choices"][0]
    r = post(url, {"prompt": [tokens], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
                   "seed": 1234}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(tokens) + 1 and r["usage"]["completion_tokens"] == 1
    assert lp["token_logprobs"][:-1] == alone["logprobs"]["token_logprobs"]
    ctxlen = 20
    cont = lp["token_logprobs"][ctxlen:-1]
    is_greedy = all(t == max(top.values()) for t, top in zip(cont, lp["top_logprobs"][ctxlen:-1]))
    assert is_greedy == all(next(iter(top)) == tok for tok, top in zip(lp["tokens"][ctxlen:-1],
                                                                      lp["top_logprobs"][ctxlen:-1]))
    # the generated token is the greedy one after the prompt: the top entry of the last position
    assert next(iter(lp["top_logprobs"][-1])) == lp["tokens"][-1]
    # echo without logprobs: the prompt's text first; with max_tokens 0 nothing runs
    text = post(url, {"prompt": "abc", "echo": True, "max_tokens": 0}).json()
    assert text["choices"][0]["text"] == "abc" and text["usage"] == {"prompt_tokens": 3, "completion_tokens": 0,
                                                                      "total_tokens": 3}
    more = post(url, {"prompt": "abc", "echo": True, "max_tokens": 3, "temperature": 0}).json()
    plain = post(url, {"prompt": "abc", "max_tokens": 3, "temperature": 0}).json()
    assert more["choices"][0]["text"] == "abc" + plain["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------------------------------
# n choices


def test_n_choices_prefill_once_and_each_equals_a_request_with_its_seed(served):
    server, url = served
    p = prompts(23, [13])[0]
    before = server.engine.counters["prefill_tokens_computed"]
    body = {"prompt": p, "max_tokens": 10, "temperature": 0.9, "top_k": 30, "seed": 77, "return_token_ids": True}
    r = post(url, {**body, "n": 4}).json()
    assert server.engine.counters["prefill_tokens_computed"] - before == len(p)  # the prompt prefilled once
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    got = [c["token_ids"] for c in r["choices"]]
    assert len({tuple(g) for g in got}) > 1  # four chains, not one
    for i, ids in enumerate(got):
        single = post(url, {**body, "seed": choice_seed(77, i)}).json()["choices"][0]
        assert single["token_ids"] == ids, i
    assert r["usage"]["completion_tokens"] == sum(len(g) for g in got)
    assert r["usage"]["prompt_tokens"] == len(p)
    greedy = post(url, {"prompt": p, "max_tokens": 10, "temperature": 0, "n": 2, "return_token_ids": True}).json()
    a, b = greedy["choices"]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    # streamed: chunks carry their choice's index; each choice's text is the non-streamed one
    with httpx.stream("POST", url + COMPLETIONS, json={"model": MODEL, **body, "n": 4, "stream": True},
                      timeout=120) as s:
        texts = ["", "", "", ""]
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in r["choices"]]


def test_seeded_choices_are_the_same_after_a_restart(model, served):
    from kivi_jax.serve.http import ServerThread

    _, url = served
    body = {"prompt": prompts(24, [7])[0], "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2,
            "return_token_ids": True}
    first = [c["token_ids"] for c in post(url, body).json()["choices"]]
    again = build(model)  # a new engine, scheduler and app: nothing of the first survives
    with ServerThread(again.app) as thread:
        second = [c["token_ids"] for c in post(thread.url, body).json()["choices"]]
    assert second == first


# ---------------------------------------------------------------------------------------------------------------------
# Structured output, stop token ids, usage


SCHEMA = {"type": "array", "items": {"type": "string", "enum": ["ab", "cd"]}, "minItems": 1, "maxItems": 3}


def valid(value) -> bool:
    """`value` validates against SCHEMA."""
    return isinstance(value, list) and 1 <= len(value) <= 3 and all(v in ("ab", "cd") for v in value)


def test_json_schema_output_validates_and_a_bad_schema_is_a_400(served, client):
    from kivi_jax.serve import grammar

    try:
        grammar._xgrammar()  # as the server imports it (the process's fault handlers kept), not importorskip's way
    except grammar.GrammarUnavailable as e:
        pytest.skip(str(e))
    _, url = served
    fmt = {"type": "json_schema", "json_schema": {"name": "pairs", "schema": SCHEMA}}
    for p in (prompts(25, [5])[0], prompts(26, [12])[0]):
        free = post(url, {"prompt": p, "max_tokens": 40, "temperature": 0}).json()["choices"][0]["text"]
        r = post(url, {"prompt": p, "max_tokens": 40, "temperature": 0, "response_format": fmt}).json()
        text = r["choices"][0]["text"]
        assert valid(json.loads(text)), (text, free)
        assert r["choices"][0]["finish_reason"] == "stop"  # the grammar was complete: the EOS ended it
    sampled = post(url, {"prompt": p, "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2,
                         "response_format": fmt}).json()
    for c in sampled["choices"]:
        assert valid(json.loads(c["text"])), c["text"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "list"}], max_tokens=40,
                                          temperature=0, response_format=fmt)
    assert valid(json.loads(chat.choices[0].message.content))
    for bad, words in ((SCHEMA | {"type": "arrayy"}, "cannot be compiled"),
                       ({"type": "object", "properties": 5}, "cannot be compiled")):
        r = post(url, {"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema",
                                                                           "json_schema": {"name": "b", "schema": bad}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]
        assert words in r.json()["error"]["message"]
    for fmt_bad in ({"type": "yaml"}, {"type": "json_schema"}, "json"):
        r = post(url, {"prompt": "x", "max_tokens": 4, "response_format": fmt_bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"


def test_response_format_without_the_grammar_extra_is_a_clear_400(served, monkeypatch):
    from kivi_jax.serve import grammar

    def missing():
        raise grammar.GrammarUnavailable("response_format needs the grammar extra (xgrammar), which is not installed; "
                                         f"install it: {grammar.GRAMMAR_EXTRA}")

    monkeypatch.setattr(grammar, "_xgrammar", missing)
    r = post(served[1], {"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_unavailable"
    assert "kivi-jax[grammar]" in r.json()["error"]["message"]
    ok = post(served[1], {"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_stop_token_ids_and_usage_on_every_chunk(model, served):
    _, url = served
    p = prompts(27, [6])[0]
    ref = post(url, {"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True}).json()
    ref = ref["choices"][0]["token_ids"]
    at = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] not in model.config.eos_token_ids)
    r = post(url, {"prompt": p, "max_tokens": 12, "temperature": 0, "stop_token_ids": [ref[at]],
                   "return_token_ids": True}).json()["choices"][0]
    assert r["token_ids"] == ref[: at + 1] and r["finish_reason"] == "stop"
    assert r["text"] == model.tokenizer.decode(ref[:at], skip_special_tokens=True)  # the stop token is not text
    body = {"prompt": p, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", url + COMPLETIONS, json={"model": MODEL, **body}, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks)
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert used == sorted(used) and used[-1] == 5 and chunks[-1]["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == len(p) for c in chunks)


def test_a_scale_overflow_reaches_the_client_as_a_warning(model, served):
    """Keys beyond float16's range (the key projection times 1e7) overflow the cache's float16 scales once a key block
    is quantized: the answer carries a `warnings` field saying so, streamed or not; a healthy answer has none."""
    from kivi_jax.serve.http import ServerThread

    layers = model.params.layers
    hot = model._replace(params=model.params.replace(layers=layers.replace(wk=layers.wk * 1e7)))
    prompt = prompts(21, [40])[0]  # past the 16-token ring: a key block is quantized at prefill
    server = build(hot)
    with ServerThread(server.app) as thread:
        r = post(thread.url, {"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text[:300]
        warnings = r.json()["warnings"]
        one = post(thread.url, {"prompt": prompt, "max_tokens": 1})  # no decode step: the prefill's flag
        assert one.json()["warnings"] == warnings
        assert len(warnings) == 1 and "overflowed float16" in warnings[0] and "-sf32" in warnings[0]
        with httpx.stream("POST", thread.url + COMPLETIONS, timeout=120,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [c["warnings"] for c in chunks if "warnings" in c] == [warnings]
    healthy = post(served[1], {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert healthy.status_code == 200 and "warnings" not in healthy.json()


GRAMMAR_IMPORT = """
import faulthandler
faulthandler.enable()
from kivi_jax.serve import grammar
before = grammar.fault_handler_addresses()
{how}
print("kept" if grammar.fault_handler_addresses() == before else "changed")
"""


@pytest.mark.parametrize("how, want", [("import xgrammar", "changed"), ("grammar._xgrammar()", "kept")])
def test_the_grammar_import_keeps_the_processs_fault_handlers(how, want):
    """xgrammar's tvm_ffi installs a SIGSEGV handler at load that backtraces with the C++ unwinder and deadlocks when
    the fault is inside it (a test worker hung so instead of crashing); imported through kivi_jax, the process keeps
    its handlers. A plain import shows the check sees the change."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", GRAMMAR_IMPORT.format(how=how)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == want
