"""The serving engine on a paged cache (docs/design.md §12): a request takes its prompt's pages when it is admitted
and a page each time it fills one (or, reserving, those of its prompt and max_tokens at once) and gives them back
when it ends; when the pool runs out the newest request is preempted and recomputed; requests wait for pages instead
of failing, and every greedy answer is what `generate` alone gives."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import kivi_jax
from kivi_jax import runtime
from kivi_jax.sampling import Sampling
from kivi_jax.serve.engine import Engine
from kivi_jax.serve.scheduler import Scheduler
from test_serve_batching import answer, prompts, request

SPEC = "k2v2-g8-r16"  # pages of 16 tokens
MAX_LENGTH = 384


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)


def reference(model, spec, prompt, new, chunk=64):
    return kivi_jax.generate(model, prompt, max_new_tokens=new, cache=spec, max_length=MAX_LENGTH,
                             prefill_chunk=chunk).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC, "full"])
def test_a_pool_too_small_for_every_request_at_once_still_answers_each_as_generate_alone(model, spec):
    """Nine requests (prompts of 4 to 250 tokens, 10 to 40 new) on 6 slots whose pool holds about three of them at a
    time: they wait for pages, none fails, each answer is `generate`'s, and every page comes back."""
    lengths, new = [4, 250, 30, 120, 9, 200, 60, 17, 90], [30, 12, 40, 25, 10, 20, 35, 15, 28]
    batch = prompts(11, lengths)
    eng = Engine(model.params, spec, slots=6, max_length=MAX_LENGTH, prefill_chunk=64, pages=24)
    need = [eng.pages_for(n, m) for n, m in zip(lengths, new)]
    assert sum(need) > 2 * eng.allocator.num_pages  # never all at once
    sched = Scheduler(eng, model.tokenizer)
    peak_pages = []
    sched.start()
    try:
        queued = [request(p, m, lambda e: peak_pages.append(eng.allocator.used_pages)) for p, m in zip(batch, new)]
        for req, _ in queued:
            sched.submit(req)
        got = [answer(q) for _, q in queued]
    finally:
        sched.stop()
    assert got == [reference(model, spec, p, m) for p, m in zip(batch, new)]
    assert max(peak_pages) <= eng.allocator.num_pages and eng.peak_live >= 2
    eng.allocator.check()
    metrics = eng.metrics()
    assert metrics["pages_free"] == metrics["pages_total"] == 24 and metrics["pages_used"] == 0
    assert sched.counters.get("requests_failed", 0) == 0
    assert not eng.tables[eng.tables < 24].size  # every table row holds no page


def run_all(eng, model, batch, new, samplings=None):
    """Every request through a scheduler on `eng` at once -> (each one's token ids, the scheduler)."""
    from kivi_jax.serve.scheduler import Request

    sched = Scheduler(eng, model.tokenizer)
    sched.start()
    try:
        queued = []
        for i, (p, m) in enumerate(zip(batch, new)):
            req, q = request(p, m)
            if samplings is not None:
                req = Request(p, m, samplings[i], req.emit, ignore_eos=True)  # every draw to max_tokens
            queued.append((sched.submit(req), q))
        got = [answer(q) for _, q in queued]
    finally:
        sched.stop()
    return got, sched


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC, "full"])
def test_requests_that_outgrow_the_pool_are_preempted_and_answer_as_generate_alone(model, spec):
    """Six short prompts with long answers on 6 slots: each is admitted with the pages of its prompt, then takes a
    page as it fills one; the pool holds about half of their final pages, so the newest are preempted (pages freed,
    queued first, prefilled again with what they generated) and every greedy answer is still `generate`'s."""
    lengths, new = [10, 21, 5, 30, 12, 8], [70, 50, 75, 45, 60, 66]
    batch = prompts(12, lengths)
    pages = 16 if spec == SPEC else 18
    eng = Engine(model.params, spec, slots=6, max_length=MAX_LENGTH, prefill_chunk=64, pages=pages)
    final = [eng.pages_for(n, m) for n, m in zip(lengths, new)]
    assert sum(final) > 1.5 * pages and all(eng.grows() for _ in final)
    got, sched = run_all(eng, model, batch, new)
    assert got == [reference(model, spec, p, m) for p, m in zip(batch, new)]
    assert sched.counters["preemptions"] > 0 and sched.counters["requests_failed"] == 0
    assert eng.peak_live >= 3  # more at once than whole reservations would have let in
    eng.allocator.check()
    assert eng.allocator.used_pages == 0 and not eng.growing and eng.metrics()["pages_free"] == pages


def test_a_preempted_seeded_request_goes_on_with_its_key(model):
    """A seeded choice preempted after 10 draws, its prompt prefilled again and its tokens replayed with its key given
    back (`admit_choices(keys=, replay_from=)`), holds the key chain and draws of one never preempted."""
    prompt = prompts(13, [20])[0]
    sampling = Sampling(1.0, seed=7)
    eng = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64, pages=40)
    slot, first = eng.admit(prompt, sampling)
    alone = [first] + [eng.step()[slot] for _ in range(20)]
    key_alone = eng.key_of(slot)
    eng.free(slot)
    slot, first = eng.admit(prompt, sampling)
    tokens = [first] + [eng.step()[slot] for _ in range(9)]
    key = eng.key_of(slot)
    eng.free(slot)  # preempted: the pages go back, the key and tokens stay with the request
    again = eng.admit_choices(prompt + tokens, [sampling], max_tokens=11, keys=[key], replay_from=len(prompt))
    slot, replayed = again.slots[0], []
    assert again.first == [None]  # nothing is drawn until the generated tokens are replayed
    while len(tokens) < len(alone):
        out = eng.step_scored()[slot]
        (replayed if out.prompt else tokens).append(out.token)
    assert replayed == tokens[1:10]  # each replay step hands back the token it feeds next
    assert np.array_equal(eng.key_of(slot), key_alone)
    assert tokens == alone


@pytest.mark.slow
def test_reserving_pages_up_front_never_preempts(model):
    """`grow=False`: each request takes its prompt and max_tokens' pages at admission, so requests wait instead."""
    lengths, new = [10, 21, 5, 30, 12, 8], [70, 50, 75, 45, 60, 66]
    batch = prompts(12, lengths)
    eng = Engine(model.params, SPEC, slots=6, max_length=MAX_LENGTH, prefill_chunk=64, pages=16, grow=False)
    got, sched = run_all(eng, model, batch, new)
    assert got == [reference(model, SPEC, p, m) for p, m in zip(batch, new)]
    assert sched.counters["preemptions"] == 0 and not eng.growing


def test_choices_take_pages_each_and_requests_past_the_pool_are_refused_at_once(model):
    eng = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=64, pages=12)
    prompt = prompts(2, [40])[0]
    admitted = eng.admit_choices(prompt, [Sampling(0.0), Sampling(0.0)], max_tokens=50)
    need = eng.pages_for(40, 50)
    assert need == (40 + 50) // 16 and eng.allocator.used_pages == 2 * need
    held = [eng.slot_pages[s] for s in admitted.slots]
    assert not set(held[0]) & set(held[1])
    for slot in admitted.slots:
        eng.free(slot)
    assert eng.allocator.used_pages == 0
    sched = Scheduler(eng, None)
    too_big, _ = request(prompts(3, [100])[0], 200)
    with pytest.raises(ValueError, match=r"needs 18 pages of 16 tokens .* the pool has 12; lower max_tokens"):
        sched.submit(too_big)
    with pytest.raises(ValueError, match="a paged cache needs data=1 .* give a mesh of model=2"):
        Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, pages=8, mesh="data=2")


def test_paged_engine_steps_equal_the_slot_engine_steps(model):
    """The same admissions and decode steps on slots and on pages (handed out as the allocator gives them) give the
    same tokens step by step."""
    batch = prompts(4, [5, 33, 70])
    slots = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=64, prefix_reuse=False)
    pages = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=64, pages=60)
    firsts = []
    for eng in (slots, pages):
        firsts.append([eng.admit_choices(p, [Sampling(0.0)], max_tokens=40).first[0].token for p in batch])
    assert firsts[0] == firsts[1]
    for _ in range(40):
        a, b = slots.step(), pages.step()
        assert a == b
    assert np.asarray(pages.caches[0].length).tolist()[:3] == [n + 40 for n in (5, 33, 70)]


@pytest.mark.slow
def test_bench_serve_runs_slots_and_paged_servers_side_by_side(tiny_dirs):
    """`kivi-jax bench serve --layout slots,paged`: one row a layout, the paged one with its page counters (every
    page back in the pool once the level is done). In its own process: the in-process servers' log handlers outlive
    pytest's captured streams."""
    import json
    import subprocess
    import sys

    args = ["bench", "serve", "--model", str(tiny_dirs["llama_mha"][0]), "--cache", SPEC, "--layout", "slots,paged",
            "--clients", "2", "--requests-per-client", "1", "--max-tokens", "4", "--max-length", "256",
            "--cache-budget", "2MiB", "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", f"from kivi_jax.cli import main; raise SystemExit(main({args!r}))"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    rows = {r["cache"]: r for r in out["results"]}
    assert set(rows) == {"k2v2-g8-r16", "k2v2-g8-r16 paged"} and all(r["ok"] == 2 for r in rows.values())
    assert all(r["preemptions"] >= 0 for r in rows.values())  # read from each server's /metrics
    paged = rows["k2v2-g8-r16 paged"]["pages"]
    assert paged["pages_free"] == paged["pages_total"] == out["servers"]["k2v2-g8-r16 paged"]["capacity"]["pages"]
    assert out["servers"]["k2v2-g8-r16 paged"]["capacity"]["paged"]


@pytest.mark.slow
def test_the_openai_client_against_a_live_paged_server(tiny_dirs):
    """Concurrent streaming chats through the `openai` client on a paged server whose pool holds two of them at a
    time (6 to 10 pages each of 16): every answer is `generate`'s, a disconnect mid-stream gives its pages back, /metrics reports the pool."""
    import threading

    import httpx

    openai = pytest.importorskip("openai")
    from kivi_jax.serve.http import ServerThread
    from kivi_jax.serve.server import build_server
    from test_serve import CHAT_TEMPLATE, wait_for

    model = kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)
    model.tokenizer.chat_template = CHAT_TEMPLATE
    from kivi_jax.serve.engine import paged_capacity

    sizes = paged_capacity(SPEC, model.params.config, 256, model.params.dtype, None, 4, 4)
    budget = 4 * sizes["row_bytes"] + 16 * sizes["page_bytes"]  # 4 rows and 16 pages: two chats at a time
    server = build_server(model, SPEC, slots=4, max_length=256, prefill_chunk=64, model_name="tiny", paged=True,
                          cache_budget=budget)
    eng = server.engine
    assert eng.paged and eng.allocator.num_pages == 16 and eng.num_slots == 4
    assert abs(eng.cache_bytes - budget) < sizes["page_bytes"]
    texts = [f"question {i}: " + "abcdefghij" * (3 + 2 * i) for i in range(4)]
    with ServerThread(server.app) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        got: dict[int, list[int]] = {}

        def chat(i):
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": texts[i]}],
                                                    max_tokens=60, temperature=0, stream=True,
                                                    extra_body={"return_token_ids": True})
            got[i] = [t for chunk in stream for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(4)]
        with server.scheduler.paused():  # all four wait before the loop runs: they must wait for pages too
            for t in threads:
                t.start()
            assert wait_for(lambda: server.scheduler.queue_length() == 4)
        for t in threads:
            t.join(600)
        for i, text in enumerate(texts):
            ref = kivi_jax.generate(model, text, max_new_tokens=60, cache=SPEC, max_length=256, chat=True,
                                    prefill_chunk=64).token_ids
            assert got[i] == ref, i
        assert eng.peak_live >= 2 and eng.allocator.used_pages == 0
        body = {"model": "tiny", "messages": [{"role": "user", "content": texts[3]}], "max_tokens": 150,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", thread.url + "/v1/chat/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    assert eng.allocator.used_pages > 0
                    break  # the client leaves
        assert wait_for(lambda: eng.allocator.used_pages == 0 and eng.count("live") == 0)
        metrics = httpx.get(thread.url + "/metrics", timeout=30).text
        assert "kivi_serve_pages_total 16" in metrics and "kivi_serve_pages_free 16" in metrics
        preempted = server.scheduler.counters["preemptions"]  # four growing chats, a pool for about two of them
        assert f"kivi_serve_preemptions_total {preempted}" in metrics
    eng.allocator.check()


@pytest.mark.slow
def test_ignore_eos_runs_a_request_to_max_tokens(model):
    """`ignore_eos` (vLLM's, which `bench serve --workload mixed` sends): an EOS ends nothing, so the answer is the
    first max_tokens tokens `generate` gives; without it the answer stops at the EOS."""
    prompt = prompts(9, [12])[0]
    full = kivi_jax.generate(model, prompt, max_new_tokens=20, cache=SPEC, max_length=MAX_LENGTH,
                             prefill_chunk=64).token_ids
    eng = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64, pages=24)
    eng.eos = frozenset({full[5]})  # a token the greedy answer holds, standing in for the EOS
    sched = Scheduler(eng, model.tokenizer).start()
    try:
        plain, q1 = request(prompt, 20)
        ignoring, q2 = request(prompt, 20)
        ignoring.ignore_eos = True
        sched.submit(plain)
        sched.submit(ignoring)
        stopped, ran = answer(q1), answer(q2)
    finally:
        sched.stop()
    assert stopped == full[: full.index(full[5]) + 1] and ran == full and len(ran) == 20  # the EOS is sent, then ends


@pytest.mark.parametrize("spec", [SPEC, "full"])
def test_two_requests_with_a_common_prefix_hold_its_pages_once_and_answer_as_generate_alone(model, spec):
    """With prefix snapshots a prompt's prefill leaves its cache at each chunk end (`Snapshot`: the ring as it stood,
    and the pages then final); a second prompt sharing that 64-token prefix starts from it: its table names the same
    pages (held by both requests and the snapshot, counted once), it computes only its own tokens, and both answers
    are `generate`'s. Another salt shares nothing."""
    eng = Engine(model.params, spec, slots=4, max_length=MAX_LENGTH, prefill_chunk=64, pages=60, prefix_snapshots=4)
    common = prompts(21, [64])[0]
    a, b = (common + tail for tail in prompts(22, [30, 41]))
    first_a = eng.admit_choices(a, [Sampling(0.0)], max_tokens=20)
    snap = eng.shared_prefix(b)
    assert snap is not None and snap.length == 64 and len(snap.pages) >= 2
    computed = eng.counters["prefill_tokens_computed"]
    first_b = eng.admit_choices(b, [Sampling(0.0)], max_tokens=20)
    assert eng.counters["prefill_tokens_computed"] - computed == len(b) - 64
    assert eng.counters["prefix_tokens_reused"] == 64
    sa, sb = first_a.slots[0], first_b.slots[0]
    shared = set(eng.slot_pages[sa]) & set(eng.slot_pages[sb])
    assert shared == set(snap.pages) and eng.slot_pages[sb][: len(snap.pages)] == snap.pages
    assert all(eng.allocator.refcount(p) == 3 for p in shared)  # both requests and the snapshot
    assert eng.allocator.used_pages == len(set(eng.slot_pages[sa]) | set(eng.slot_pages[sb]))
    outs = {sa: [first_a.first[0].token], sb: [first_b.first[0].token]}
    for _ in range(19):
        for slot, token in eng.step().items():
            outs[slot].append(token)
    assert outs[sa] == reference(model, spec, a, 20) and outs[sb] == reference(model, spec, b, 20)
    assert eng.shared_prefix(b, salt="tenant-2") is None
    other = eng.admit_choices(b, [Sampling(0.0)], max_tokens=20, salt="tenant-2")
    assert not set(eng.slot_pages[other.slots[0]]) & shared
    for slot in (sa, sb, other.slots[0]):
        eng.free(slot)
    held = sum(len(s.pages) for s in eng.snapshots.values())
    assert eng.allocator.used_pages <= held and eng.free_pages() == eng.allocator.num_pages  # snapshots alone
    eng.allocator.check()


def test_a_request_from_a_shared_prefix_computes_only_its_narrow_last_chunk(model, monkeypatch):
    """128-token chunks: a prompt of 256 + 40 tokens prefills 128, 128, then a 64-token last chunk (`ChunkPlan`);
    a second prompt with the same 256-token prefix starts from its snapshot and runs one 64-token call; its logits
    are those of its prefill alone, to the bit, and both answers are `generate`'s."""
    eng = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=128, pages=60, prefix_snapshots=4)
    common = prompts(41, [256])[0]
    a, b = (common + tail for tail in prompts(42, [40, 30]))
    assert eng.prefill_shape(b) == (128, 3, 64)
    alone, _ = eng.prefill(b)
    first_a = eng.admit_choices(a, [Sampling(0.0)], max_tokens=12)
    calls, real = [], runtime.prefill_chunk
    monkeypatch.setattr(runtime, "prefill_chunk",
                        lambda p, tokens, *rest: calls.append(tokens.shape) or real(p, tokens, *rest))
    logits, _, snap, _ = eng._prefill_shared(b, "")
    monkeypatch.undo()
    assert snap is not None and snap.length == 256 and calls == [(1, 64)]
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(alone))
    first_b = eng.admit_choices(b, [Sampling(0.0)], max_tokens=12)
    outs = {s.slots[0]: [s.first[0].token] for s in (first_a, first_b)}
    for _ in range(11):
        for slot, token in eng.step().items():
            outs[slot].append(token)
    assert outs[first_a.slots[0]] == reference(model, SPEC, a, 12, 128)
    assert outs[first_b.slots[0]] == reference(model, SPEC, b, 12, 128)
    for slot in outs:
        eng.free(slot)
    eng._reclaim(eng.allocator.num_pages + 1)  # more than can be had: every snapshot goes
    assert not eng.snapshots and not eng.snapshot_refs and eng.allocator.free_pages == eng.allocator.num_pages
    eng.allocator.check()


def test_a_batched_prefill_keeps_snapshots_that_a_later_request_starts_from(model):
    """Through the scheduler: the first prompt goes through a batched prefill job, which keeps its snapshots too; a
    later prompt with the same 128-token prefix starts from one and both answers are `generate`'s."""
    eng = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=64, pages=60, prefix_snapshots=2)
    common = prompts(31, [128])[0]
    a, b = (common + tail for tail in prompts(32, [20, 50]))
    got = []
    for p in (a, b):  # one after the other
        answers, sched = run_all(eng, model, [p], [15])
        got += answers
        if p is a:
            assert eng.counters["prefill_calls"] >= 3 and eng.snapshots  # a's three chunks, two snapshots kept
    assert {s.length for s in eng.snapshots.values()} == {64, 128}
    assert eng.counters["prefix_tokens_reused"] == 128
    assert got == [reference(model, SPEC, p, 15) for p in (a, b)]
    assert eng.allocator.used_pages == len(set().union(*(s.pages for s in eng.snapshots.values())))  # theirs alone


def test_drain_keeps_a_preempted_request_that_has_started_streaming(model):
    """At shutdown the waiting requests end with a 503, but a preempted one (already streaming) stays queued, to go
    on within the shutdown timeout like a running one."""
    from kivi_jax.serve.scheduler import Request

    eng = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64, pages=16)
    sched = Scheduler(eng, model.tokenizer)  # not started: the queue alone
    events = []
    fresh, preempted = (Request(prompts(40 + i, [10])[0], 5, Sampling(0.0), events.append) for i in range(2))
    preempted.preemptions = 1
    sched.waiting.extend([fresh, preempted])
    sched.drain()
    assert list(sched.waiting) == [preempted]
    assert [e.status for e in events if e.kind == "error"] == [503]
