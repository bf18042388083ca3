"""kivi-jax serve: the engine, the scheduler and the OpenAI-compatible server, driven by the official `openai` client.

One live server for the module (a tiny random model, a KIVI cache with a small residual so that quantization happens
within a few tokens), so the decode step, the prefill bucket and the insert compile once.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from conftest import TINY_VOCAB
from kivi_jax.cache import full_cache_bytes, kivi_cache_bytes
from kivi_jax.config import parse_cache_spec
from kivi_jax.sampling import Sampling, sample_tokens
from kivi_jax.serve import engine as engine_mod
from kivi_jax.sampling import first_max, first_max_xla, sample_rows
from kivi_jax.runtime import held_back

openai = pytest.importorskip("openai")

SPEC = "k2v2-g8-r16"  # head_dim 16: groups of 8, a residual of 16 tokens
MAX_LENGTH = 256
SLOTS = 4
MAX_QUEUE = 8
MODEL = "tiny"
# Like ChatML: the generation prompt ('>') is how an assistant turn starts, so the next turn of a chat extends the
# tokens the last one held.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}>{{ m['content'] }}{% else %}"
                 "[{{ m['content'] }}]{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}")


def prompts(seed: int, lengths):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, TINY_VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model(tiny_dirs):
    m = kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)
    m.tokenizer.chat_template = CHAT_TEMPLATE
    return m


def build(model, **kwargs):
    """The test server: two decode groups of two slots (concurrent requests span both, an idle group is skipped).
    Another one built alike runs the same compiled functions."""
    from kivi_jax.serve.server import build_server

    return build_server(model, SPEC, slots=SLOTS, max_length=MAX_LENGTH, prefill_chunk=64, max_queue=MAX_QUEUE,
                        model_name=MODEL, decode_group=2, **kwargs)


@pytest.fixture(scope="module")
def served(model):
    from kivi_jax.serve.http import ServerThread

    server = build(model)
    with ServerThread(server.app) as thread:
        warm(thread.url)
        yield server, thread.url


def warm(url: str) -> None:
    """One request before the tests: the first one compiles the server's functions (about 40 s cold on 2 idle cores,
    minutes on a busy CI machine), so that the tests' own timeouts measure a hang, not a compile."""
    r = httpx.post(url + "/v1/completions", timeout=900,
                   json={"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text[:300]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(model, prompt, n, **kw):
    """What `kivi_jax.generate` gives the prompt alone, on the server's cache kind and slot size."""
    return kivi_jax.generate(model, prompt, max_new_tokens=n, cache=SPEC, max_length=MAX_LENGTH, **kw)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def wait_for(predicate, timeout: float = 60.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------------------------------------------------------------
# Pieces without a server


def test_per_row_sampler_is_argmax_for_greedy_rows_and_generates_draw_for_sampled_ones():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(4, 50).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    rows = [Sampling(0.0), Sampling(0.7), Sampling(1.3, top_k=5), Sampling(0.9, top_k=8, top_p=0.6)]
    got = sample_rows(logits, keys, jnp.array([r.temperature for r in rows]), jnp.array([r.top_k for r in rows]),
                      jnp.array([r.top_p for r in rows]))
    want = [int(sample_tokens(logits[i : i + 1], keys[i], r)[0]) for i, r in enumerate(rows)]
    assert np.asarray(got).tolist() == want
    assert int(got[0]) == int(jnp.argmax(logits[0]))
    # A top_p that is 0 in float32 keeps the most likely token (it kept none, and every draw was token 0).
    tiny = Sampling(1.0, top_p=1e-300)
    assert int(sample_tokens(logits[1:2], keys[1], tiny)[0]) == int(jnp.argmax(logits[1]))
    got = sample_rows(logits, keys, jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.full(4, 1e-300))
    assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1))
    # All rows greedy: exactly argmax (the cut's sort does not run).
    zeros = jnp.zeros(4)
    greedy = sample_rows(logits, keys, zeros, jnp.zeros(4, jnp.int32), jnp.ones(4))
    assert np.array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("first_max", [first_max, first_max_xla], ids=["as-dispatched", "xla"])
def test_first_max_is_argmax_for_ties_infinities_and_nans(first_max):
    """The greedy choice's argmax (the native kernel on the CPU, and XLA's two reduces) gives jnp.argmax's index for
    every row: ties (the first), -inf rows, +inf, NaNs (the first NaN), a maximum at either end, random rows of a real
    vocabulary's width."""
    rng = np.random.RandomState(1)
    x = rng.randn(9, 49152).astype(np.float32)
    x[0, [5, 7]] = 100.0  # a tie: the first
    x[1] = -np.inf
    x[2, [9, 3]] = np.nan  # the first NaN, over a larger value before it
    x[2, 1] = 1e30
    x[3, [11, 2]] = np.inf
    x[4, 0] = 50.0
    x[5, -1] = 50.0
    x[6] = 0.0
    x[7, 100:] = np.nan
    got = np.asarray(jax.jit(first_max)(jnp.asarray(x)))
    assert got.dtype == np.int32
    assert got.tolist() == np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)).tolist()
    assert got[:8].tolist() == [5, 0, 3, 2, 0, 49151, 0, 100]


@pytest.mark.parametrize("spec", ["full", SPEC])
def test_batch_axes_and_slot_bytes(model, spec):
    cfg = model.config
    cache = engine_mod.abstract_slot_cache(spec, cfg, MAX_LENGTH, jnp.float32, batch=3)
    axes = engine_mod.batch_axes(spec, cfg, MAX_LENGTH, jnp.float32)
    for leaf, axis in zip(jax.tree_util.tree_leaves(cache), axes):
        assert leaf.shape[axis] == 3
        assert axis == (0 if leaf.ndim == 1 else 1)  # [batch] counters, [layers, batch, ...] stores
    parsed = parse_cache_spec(spec)
    formula = (full_cache_bytes(cfg, 1, MAX_LENGTH, 4) if parsed == "full"
               else kivi_cache_bytes(cfg, parsed, 1, MAX_LENGTH, 4)["total"])
    one = engine_mod.slot_bytes(spec, cfg, MAX_LENGTH, jnp.float32)
    assert one == formula
    budget = 10 * one + one // 2
    assert engine_mod.slots_in_budget(spec, cfg, MAX_LENGTH, jnp.float32, budget) == 10
    report = engine_mod.capacity_report(spec, cfg, MAX_LENGTH, jnp.float32, budget)
    assert report["cache"]["slots"] == 10
    if parsed != "full":
        assert report["full"]["slots"] < 10  # the same budget holds fewer full-precision slots


def test_cli_flags():
    from kivi_jax.cli import build_parser, main

    parser = build_parser()
    args = parser.parse_args(["serve", "--cache", "kivi4", "--cache-budget", "2GiB", "--max-length", "1024",
                              "--port", "9000", "--decode-group", "8"])
    assert (args.cache, args.cache_budget, args.slots, args.max_length, args.port, args.decode_group) == (
        "kivi4", "2GiB", None, 1024, 9000, 8)
    assert (args.prefill_batch, args.prefill_tokens) == (8, None)  # batched prefill by default
    args = parser.parse_args(["serve", "--prefill-batch", "1", "--prefill-tokens", "4096"])
    assert (args.prefill_batch, args.prefill_tokens) == (1, 4096)
    assert main(["serve", "--slots", "4", "--cache-budget", "2GiB"]) == 2  # a slot count or a budget, not both
    paged = parser.parse_args(["serve", "--paged", "--slots", "4", "--cache-budget", "2GiB"])  # paged: rows and bytes
    assert paged.paged and paged.slots == 4 and not paged.reserve_pages
    assert main(["serve", "--reserve-pages"]) == 2  # an option of the paged cache only
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefill-batch", "0"])
    bench = parser.parse_args(["bench", "serve", "--clients", "1,8", "--url", "http://127.0.0.1:8000"])
    assert bench.clients == [1, 8] and bench.cache == "full,kivi2"

    assert main(["bench", "serve", "--url", "http://10.1.2.3:8000"]) == 2  # loopback only


def test_held_back_text():
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0
    assert held_back("ab\ufffd", ()) == 1
    assert held_back("say STO", ("STOP", "ST")) == 3


# ---------------------------------------------------------------------------------------------------------------------
# The live server


def test_models_health_metrics(served):
    server, url = served
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert server.engine.groups == [(0, 2), (2, 2)]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == SLOTS
    metrics = httpx.get(url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    lines = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if not line.startswith("#"))
    assert int(lines["kivi_serve_slots"]) == SLOTS
    assert int(lines["kivi_serve_cache_bytes"]) == SLOTS * server.engine.slot_bytes
    for name in ("kivi_serve_live_slots", "kivi_serve_queue_length", "kivi_serve_tokens_per_second",
                 "kivi_serve_cache_bytes_in_use"):
        float(lines[name])
    busy = {part: float(lines[f"kivi_serve_{part}_seconds_total"]) for part in ("prefill", "decode", "host")}
    assert all(seconds >= 0 for seconds in busy.values())


def test_completion_streaming_and_not(model, client):
    ref = reference(model, "hello world", 12)
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert token_ids(choice) == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == ("stop" if len(ref.token_ids) < 12 else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.prompt_tokens, ref.new_tokens)
    assert out.usage.total_tokens == ref.prompt_tokens + ref.new_tokens
    chunks = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == ref.new_tokens


def test_stop_strings_end_the_text_before_them(model, client):
    ref = reference(model, "hello world", 12)
    stop = ref.text[4:6]
    cut = ref.text.index(stop)
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
                                    stop=[stop, "\x00"])
    assert out.choices[0].text == ref.text[:cut] and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_streaming_and_not(model, client):
    messages = [{"role": "user", "content": "hi there"}]
    ref = reference(model, "hi there", 10, chat=True)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert out.object == "chat.completion"
    assert token_ids(out.choices[0]) == ref.token_ids
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len("[hi there]>") == ref.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_eight_concurrent_requests_each_get_what_they_get_alone(model, client):
    batch = prompts(1, [3, 9, 17, 24, 31, 40, 52, 60])
    new = [40, 33, 25, 38, 20, 30, 28, 36]  # crossing several residual blocks of 16 tokens
    sampled = 5  # one request samples (seeded): its draw is its own, whatever runs beside it
    results: dict[int, object] = {}

    def run(i):
        kw = dict(temperature=0.8, seed=11) if i == sampled else dict(temperature=0)
        extra = {"return_token_ids": True, **({"top_k": 20} if i == sampled else {})}
        results[i] = client.completions.create(model=MODEL, prompt=batch[i], max_tokens=new[i], extra_body=extra,
                                               **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(batch):
        kw = dict(temperature=0.8, top_k=20, seed=11) if i == sampled else {}
        ref = reference(model, p, new[i], **kw)
        assert token_ids(results[i].choices[0]) == ref.token_ids, i
        assert results[i].usage.prompt_tokens == len(p)
        assert results[i].usage.completion_tokens == len(ref.token_ids)


def test_bad_requests_get_error_objects_and_the_server_keeps_serving(served, client):
    _, url = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=5)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    long_prompt = prompts(2, [MAX_LENGTH - 3])[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8)
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"{MAX_LENGTH} tokens" in e.value.message and f"at most {MAX_LENGTH - 8}" in e.value.message
    bad = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', timeout=30,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot"}]}, timeout=30)
    assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_the_slot(model, served, client):
    server, url = served
    sched = server.scheduler
    before = dict(sched.counters)
    body = {"model": MODEL, "prompt": prompts(3, [5])[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break  # leave after three chunks
    assert wait_for(lambda: sched.counters["requests_cancelled"] == before.get("requests_cancelled", 0) + 1)
    assert wait_for(lambda: server.engine.count("live") == 0)
    assert sched.counters["requests_finished"] == before.get("requests_finished", 0)  # cut short, not finished
    p = prompts(4, [7])[0]
    out = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert token_ids(out.choices[0]) == reference(model, p, 6).token_ids


def test_queue_full_answers_503_at_once_and_loses_nothing(model, served):
    server, url = served
    sched = server.scheduler
    batch = prompts(5, [4 + i for i in range(MAX_QUEUE)])
    finished_before = sched.counters["requests_finished"]
    results: dict[int, httpx.Response] = {}

    def run(i):
        results[i] = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": batch[i], "max_tokens": 5, "temperature": 0, "return_token_ids": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(MAX_QUEUE)]
    with sched.paused():
        for t in threads:
            t.start()
        assert wait_for(lambda: sched.queue_length() == MAX_QUEUE)
        rejected = [httpx.post(url + "/v1/completions", timeout=30,
                               json={"model": MODEL, "prompt": "one too many", "max_tokens": 5}) for _ in range(3)]
        assert not results  # the scheduler is paused: nothing queued has been answered
    for r in rejected:  # answered while every queued request still waited
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join()
    assert sorted(results) == list(range(MAX_QUEUE))
    for i, p in enumerate(batch):
        assert results[i].status_code == 200
        assert results[i].json()["choices"][0]["token_ids"] == reference(model, p, 5).token_ids
    assert sched.counters["requests_finished"] == finished_before + MAX_QUEUE


def test_bench_serve_against_the_running_server(served, capsys, tmp_path):
    from kivi_jax.cli import main

    _, url = served
    plot = tmp_path / "serve.png"
    assert main(["bench", "serve", "--url", url, "--served-model-name", MODEL, "--clients", "1,3", "--max-tokens", "4",
                 "--requests-per-client", "1", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["results"]
    assert [(r["clients"], r["ok"], r["requests"]) for r in rows] == [(1, 1, 1), (3, 3, 3)]
    for r in rows:
        assert 0 < r["output_tokens"] <= 4 * r["ok"] and r["ttft_ms_p50"] > 0 and r["requests_per_s"] > 0
        assert r["peak_live_slots"] >= 1 and r["peak_live_slots"] <= SLOTS
    assert plot.stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------------------
# Prefix reuse and chunked prefill (docs/design.md §7: any number of new tokens onto any cache)


def test_second_chat_turn_prefills_only_its_new_tokens(model, served, client):
    server, _ = served
    eng = server.engine
    assert eng.prefix_reuse
    first = [{"role": "user", "content": "tell me"}]
    a = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids = token_ids(a.choices[0])
    by_eos = a.choices[0].finish_reason == "stop"  # the EOS ends the reply and is not part of its text
    assert not set(ids[:-1] if by_eos else ids) & {0, 1, 2}, "the reply must read back as the same tokens"
    turn1 = a.usage.prompt_tokens + a.usage.completion_tokens - 1  # the last sampled token was never fed
    before = dict(eng.counters)
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "more"}]
    b = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0)
    reused = eng.counters["prefix_tokens_reused"] - before["prefix_tokens_reused"]
    computed = eng.counters["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert reused == turn1
    # the new turn, plus the reply's last token (sampled but never fed) unless that was the EOS
    assert computed == b.usage.prompt_tokens - turn1 == len("[more]>") + (0 if by_eos else 1)


def test_multi_chunk_prefill_matches_one_piece(model, monkeypatch):
    """A 150-token prompt in chunks of 64 on the full cache gives what one prefill gives (greedy)."""
    import importlib

    from kivi_jax.serve.engine import Engine
    from kivi_jax.sampling import Sampling

    gen = importlib.import_module("kivi_jax.runtime")  # where the prefill chunks run
    calls = []
    real = gen.prefill_chunk
    monkeypatch.setattr(gen, "prefill_chunk", lambda *a: calls.append(a[1].shape) or real(*a))
    eng = Engine(model.params, "full", slots=1, max_length=MAX_LENGTH, prefill_chunk=64)
    p = prompts(6, [150])[0]
    slot, tok = eng.admit(p, Sampling(0.0))
    assert calls == [(1, 64)] * 3  # three chunks of one shape
    out = [tok] + [eng.step()[slot] for _ in range(11)]
    ref = kivi_jax.generate(model, p, max_new_tokens=12, cache="full", max_length=MAX_LENGTH, stop_at_eos=False)
    assert out == ref.token_ids


# ---------------------------------------------------------------------------------------------------------------------
# The real model


@pytest.mark.real_model
def test_real_model_answers_through_the_server(smollm2):
    from kivi_jax.serve.http import ServerThread
    from kivi_jax.serve.server import build_server

    server = build_server(smollm2, "kivi2", slots=2, max_length=512, model_name="smollm2")
    with ServerThread(server.app) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        out = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_cpu_server_decodes_in_groups_of_16_by_default(model):
    from kivi_jax.serve.engine import Engine, default_decode_group

    assert jax.default_backend() == "cpu"
    assert default_decode_group(8) == 8 and default_decode_group(40) == 16 and default_decode_group(40, data=3) == 15
    eng = Engine(model.params, SPEC, slots=40, max_length=64)
    assert eng.groups == [(0, 16), (16, 16), (32, 8)] and eng.buckets  # each group's step: its live rows only
    assert Engine(model.params, SPEC, slots=40, max_length=64, decode_group=40).groups == [(0, 40)]
    assert not Engine(model.params, SPEC, slots=40, max_length=64, buckets=False).buckets


def test_bf16_weights_on_amx_and_quantized_weights_decode_in_groups_of_32_by_default(model):
    """Where every matrix is bf16 and the native kernel runs AMX tiles, or every matrix is held in 4- or 8-bit codes
    (the native kernel's packed strips past 16 rows), a CPU's default group is 32 rows (a step of 32 costs less than
    two of 16); float32 weights, a CPU without AMX for bf16, or no native kernels, stay at 16."""
    from kivi_jax import native
    from kivi_jax.native import matmul
    from kivi_jax.serve.engine import CPU_DECODE_GROUP, CPU_DECODE_GROUP_WIDE, Engine, cpu_decode_group

    half = kivi_jax.weights.convert_params(model.params, "bfloat16", dtype="float32")  # bf16 matrices
    codes = kivi_jax.weights.convert_params(model.params, "int8", dtype="float32")  # 8-bit codes
    amx = matmul.BF16_ROWS >= CPU_DECODE_GROUP_WIDE and native.available()
    assert cpu_decode_group(model.params) == CPU_DECODE_GROUP == 16
    assert cpu_decode_group(half) == (32 if amx else 16)
    assert kivi_jax.weights.native_codes(codes) and not kivi_jax.weights.native_codes(half)
    assert cpu_decode_group(codes) == (32 if native.available() else 16)
    assert Engine(codes, SPEC, slots=40, max_length=64).groups == (
        [(0, 32), (32, 8)] if native.available() else [(0, 16), (16, 16), (32, 8)])
    groups = Engine(half, SPEC, slots=40, max_length=64).groups
    assert groups == ([(0, 32), (32, 8)] if amx else [(0, 16), (16, 16), (32, 8)])
    assert Engine(half, SPEC, slots=40, max_length=64, decode_group=16).groups == [(0, 16), (16, 16), (32, 8)]
