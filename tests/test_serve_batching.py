"""Batching in the serving engine: several waiting prompts of one prefill shape in one forward call, a chunk an
iteration between the running decode steps; short prompts of any lengths packed into one call; a decode step over
only the live rows, padded to a power-of-two bucket. What a request gets must not depend on what it was batched
with."""

from __future__ import annotations

import queue
import time

import jax
import numpy as np
import pytest

import kivi_jax
from kivi_jax import runtime
from conftest import TINY_VOCAB
from kivi_jax.config import parse_cache_spec
from kivi_jax.serve import engine as engine_mod
from kivi_jax.serve.engine import Engine, Waiting
from kivi_jax.sampling import Sampling
from kivi_jax.serve.scheduler import Request, Scheduler

SPEC = "k2v2-g8-r16"  # quantization within a few tokens: the batched stores are compared bit for bit
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return kivi_jax.load(str(tiny_dirs["llama_mha"][0]), progress=False)


def prompts(seed: int, lengths):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, TINY_VOCAB, n).tolist() for n in lengths]


def leaves(cache) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(cache)]


BIT_FOR_BIT = pytest.mark.xla_default_emitters  # as users compile it (tests/xla_flags.py)


def compare_caches(a, b, exact: bool) -> None:
    """Two caches' leaves equal (`exact`) or to float rounding (codes: a value on a rounding edge may round the
    other way)."""
    for x, y in zip(leaves(a), leaves(b)):
        if exact:
            np.testing.assert_array_equal(x, y)
        elif x.dtype.kind in "ui":  # codes, lengths: a value on a rounding edge may round the other way
            assert (x != y).mean() <= 1e-3
        else:
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("spec,chunk,lengths,exact", [
    pytest.param(SPEC, 64, [5, 17, 40, 63], True, marks=BIT_FOR_BIT),  # one chunk of 64, ragged
    # three chunks of 64 (3 prompts: a 4-row call with an empty row)
    pytest.param(SPEC, 64, [130, 150, 190], True, marks=BIT_FOR_BIT),
    pytest.param("full", 64, [70, 100], True, marks=BIT_FOR_BIT),
    pytest.param(SPEC, 128, [66, 80, 90, 96], True, marks=BIT_FOR_BIT),  # one chunk of 96
    pytest.param("full", 128, [70, 96], True, marks=BIT_FOR_BIT),
    (SPEC, 16, [34, 37, 48], False),  # chunks of 16: XLA's dot of 16 rows rounds unlike that of 64
])
def test_batched_prefill_gives_each_slot_what_a_prefill_alone_gives(model, spec, chunk, lengths, exact):
    """The same cache rows (bit for bit, every leaf, at chunk widths of whole PROMPT_BUCKETs, as the server's are;
    to float rounding at a width of 16) and the same first and next greedy tokens whether the prompts are prefilled
    one at a time or together, padded to their one chunk width (packing off; packed: the tests below)."""
    batch = prompts(3, lengths)
    alone = Engine(model.params, spec, slots=len(batch), max_length=MAX_LENGTH, prefill_chunk=chunk, prefill_batch=1)
    together = Engine(model.params, spec, slots=len(batch), max_length=MAX_LENGTH, prefill_chunk=chunk,
                      packed_prefill=False)
    first_alone = [alone.admit(p, Sampling(0.0)) for p in batch]
    assert together.batchable(batch[0]) and not alone.batchable(batch[0])
    with pytest.raises(ValueError, match="one prefill shape"):  # a prompt of another chunk count waits for its own
        together.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch + [batch[0] + [3] * chunk]])
    assert together.count("free") == len(batch)  # nothing reserved by the refused call
    job = together.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch])
    assert job.rows == 1 << (len(batch) - 1).bit_length()
    assert together.count("filling") == len(batch) and not together.has_free_slot()
    calls = 0
    while (admitted := together.advance(job)) is None:
        calls += 1
    assert calls + 1 == -(-max(lengths) // chunk) == together.counters["prefill_calls"]
    for (slot_a, tok_a), adm in zip(first_alone, admitted):
        assert adm.first[0].token == tok_a
        compare_caches(alone.extract(slot_a), together.extract(adm.slots[0]), exact)
    assert together.count("live") == len(batch)
    # and they decode alike
    for _ in range(20):
        a, b = alone.step(), together.step()
        assert [a[s] for s, _ in first_alone] == [b[adm.slots[0]] for adm in admitted]


def test_a_batched_prefill_takes_a_power_of_two_of_prompts_within_its_token_budget(model):
    """`prefill_room`: the prompts of one shape a call takes, at most `prefill_batch`, and no more than the largest
    power of two of rows (what a batch is padded to) whose rows x width stay within `prefill_tokens`; at least one."""
    eng = Engine(model.params, SPEC, slots=8, max_length=MAX_LENGTH, prefill_chunk=512, prefill_tokens=512,
                 packed_prefill=False)
    assert runtime.chunk_plan(20, 512).width == 64  # at least 64 wide
    for width, room in ((64, 8), (96, 4), (128, 4), (160, 2), (256, 2), (288, 1), (512, 1)):
        shape = runtime.chunk_plan(width, 512)
        assert shape.width == width and eng.prefill_room(shape) == room, width
        assert room * width <= 512
    job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in prompts(13, [70, 80, 90, 96])])  # 5 would not fit
    assert job.rows == 4 and job.plan == runtime.ChunkPlan(96, 1, 96)
    with pytest.raises(ValueError, match="prefill_room"):
        eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in prompts(14, [96] * 5)])


def packed_against_alone(params, spec, batch, exact: bool, steps: int, shared: int = 0) -> None:
    """Prefills `batch` (prompts of one chunk of at most PACK_WIDTH tokens) one at a time and packed into one call:
    each slot's cache rows, first greedy token and next `steps` greedy tokens are the same. The slots hold 512
    tokens, the packed call's cache 256 (what one chunk of 128 takes): its rows are zero-padded into the slots as a
    prefill alone's cache of 512 holds zeros past its prompt. `shared`: the tokens the packed call computes once."""
    n, kw = len(batch), dict(max_length=512, prefill_chunk=512)
    assert runtime.rounded_tokens(engine_mod.PACK_WIDTH, parse_cache_spec(spec)) == 256
    alone = Engine(params, spec, slots=n, prefill_batch=1, **kw)
    together = Engine(params, spec, slots=n, **kw)
    assert together.pack_width == engine_mod.PACK_WIDTH and all(together.packable(p) for p in batch)
    first_alone = [alone.admit(p, Sampling(0.0)) for p in batch]
    held = [together.admit(p, Sampling(0.0))[0] for p in prompts(23, [300] * n)]  # slots that held longer prompts:
    for slot in held:  # nothing of them may survive the inserts
        together.free(slot)
    together.counters["prefill_calls"] = 0
    job = together.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch])
    tokens = sum(len(p) - shared for p in batch)
    assert job.shared == shared
    assert job.packed == runtime.packed_size(tokens) < job.rows * runtime.chunk_size(max(len(p) for p in batch))
    admitted = together.advance(job)  # one call (and the common prefix's own)
    assert admitted is not None and together.counters["prefill_calls"] == 1 + bool(shared)
    assert job.tokens_run == job.packed
    for (slot, token), adm in zip(first_alone, admitted):
        assert adm.first[0].token == token
        compare_caches(alone.extract(slot), together.extract(adm.slots[0]), exact)
    for _ in range(steps):
        a, b = alone.step(), together.step()
        assert [a[s] for s, _ in first_alone] == [b[adm.slots[0]] for adm in admitted]


@pytest.mark.parametrize("spec", [SPEC, "full"])
def test_a_packed_prefill_gives_each_slot_what_a_prefill_alone_gives(model, spec):
    """Five prompts of 5 to 128 tokens (chunk widths 64 to 128) go into one packed call computing 320 token rows
    (their 308 tokens in whole PACK_BUCKETs, not 8 rows x 128): every slot gets a prefill alone's cache to float
    rounding (this tiny float model's XLA dots and attention round otherwise in the packed shapes from the second
    layer on; the default model's kernels bit for bit, below), its first greedy token, and decodes alike."""
    packed_against_alone(model.params, spec, prompts(21, [5, 40, 66, 69, 128]), exact=False, steps=12)


@pytest.mark.parametrize("spec", [SPEC, "full"])
def test_a_packed_prefill_into_a_paged_cache_decodes_as_a_prefill_alone(model, spec):
    """Paged, the packed call's 256-token cache is written into each slot's pages (pages that held longer prompts
    before): the same first and next greedy tokens as prompts prefilled one at a time into the same paged cache."""
    batch = prompts(24, [5, 40, 66, 69, 128])
    kw = dict(slots=5, max_length=512, prefill_chunk=512, pages=5 * 512 // 16)
    alone, together = Engine(model.params, spec, prefill_batch=1, **kw), Engine(model.params, spec, **kw)
    for slot in [together.admit(p, Sampling(0.0))[0] for p in prompts(25, [300] * 5)]:
        together.free(slot)
    first_alone = [alone.admit(p, Sampling(0.0)) for p in batch]
    job = together.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch])
    admitted = together.advance(job)
    assert job.packed == 320 and [a.first[0].token for a in admitted] == [t for _, t in first_alone]
    for _ in range(12):
        a, b = alone.step(), together.step()
        assert [a[s] for s, _ in first_alone] == [b[adm.slots[0]] for adm in admitted]


@pytest.mark.parametrize("spec", ["k2v2-g8-r32", "full"])
def test_a_packed_prefills_common_prefix_is_computed_once_and_decodes_as_a_prefill_alone(model, spec):
    """Prompts that begin alike (a chat template's system prompt) are packed after their common prefix, each row's
    cache starting from that prefix's, computed once and kept for the next job: every slot gets a prefill alone's
    cache to float rounding (the prefix's keys and values were computed in another call; the ring of 32 then
    quantizes them with what follows), its first greedy token and decodes alike; the prefix counts as reused.
    Prompts of two salts, a prefix the cache would quantize (a ring of 16, int8), or prefix reuse off: nothing
    shared."""
    prefix = prompts(30, [20])[0]
    batch = [prefix + p for p in prompts(31, [3, 17, 40, 60, 100])]
    packed_against_alone(model.params, spec, batch, exact=False, steps=12, shared=20)
    eng = Engine(model.params, spec, slots=16, max_length=512, prefill_chunk=512)
    job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch[:2]])
    assert job.shared == 20 and eng.counters["prefill_tokens_computed"] == 20  # the prefix's own call
    eng.advance(job)
    assert eng.counters["prefill_tokens_computed"] == 20 + 3 + 17 and eng.counters["prefix_tokens_reused"] == 40
    job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in batch[2:]])
    assert job.shared == 20 and len(eng.common_caches) == 1  # kept: not computed again
    eng.advance(job)
    assert eng.counters["prefill_tokens_computed"] == 20 + 3 + 17 + 40 + 60 + 100
    assert eng.common_prefix(batch[:2], ["a", "b"]) == 0 and eng.common_prefix(batch[:2], ["a", "a"]) == 20
    assert eng.common_prefix([prefix[:15] + p for p in prompts(32, [4, 5])]) == 0
    # the token budget counts what a packed call computes: 8 prompts of 70 tokens, 400 past their prefix of 20
    chats = [prefix + p for p in prompts(33, [50] * 8)]
    assert eng.joins(chats[:7], chats[7]) and not eng.joins(chats[:7], chats[7], ["a"] * 7 + ["b"])
    assert not eng.joins(chats[:7], prompts(34, [70])[0])  # nothing in common: 560 tokens
    job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in chats])
    assert job.shared == 20 and job.packed == 448
    eng.abandon(job)
    two = batch[:2]
    for other, kw in ((spec, dict(prefix_reuse=False)), (SPEC, {}), ("int8", {})):
        off = Engine(model.params, other, slots=2, max_length=512, prefill_chunk=512, **kw)
        assert off.common_prefix(two) == 0 and off.exact_prefix == {SPEC: 15, "int8": 0}.get(other, off.exact_prefix)


@pytest.mark.slow
@pytest.mark.real_model
@BIT_FOR_BIT
def test_a_packed_prefill_of_the_default_model_is_bit_for_bit_a_prefill_alone(smollm2):
    """On the default model (its GGUF blocks through the native kernels) a packed prefill of prompts of four chunk
    widths leaves every slot's cache bit for bit as a prefill alone does, with the same first tokens."""
    rng = np.random.RandomState(22)
    batch = [rng.randint(100, 20000, n).tolist() for n in (20, 54, 66, 100, 128)]
    packed_against_alone(smollm2.params, "kivi2", batch, exact=True, steps=2)


@pytest.mark.slow
@pytest.mark.real_model
def test_chat_prompts_packed_after_their_common_prefix_answer_as_alone_on_the_default_model(smollm2):
    """Eight chat questions (the template's system prompt and user header in common) packed after their common
    prefix give the default model's first and next 12 greedy tokens of prefills alone (kivi2; 96 of short's chats
    agreed over 25 tokens when this was written)."""
    from kivi_jax.evaluate import default_text

    text, tok = default_text(), smollm2.tokenizer
    chats = [[{"role": "user", "content": f"Answer briefly. {text[997 * i:][:60 + 25 * i]}?"}] for i in range(8)]
    ids = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           ["input_ids"] for c in chats]
    alone = Engine(smollm2.params, "kivi2", slots=8, max_length=512, prefill_batch=1)
    together = Engine(smollm2.params, "kivi2", slots=8, max_length=512)
    first = [alone.admit(p, Sampling(0.0)) for p in ids]
    job = together.start_prefill([Waiting(p, [Sampling(0.0)]) for p in ids])
    assert job.shared >= 24 and max(map(len, ids)) <= together.pack_width
    admitted = together.advance(job)
    assert [a.first[0].token for a in admitted] == [t for _, t in first]
    for _ in range(12):
        a, b = alone.step(), together.step()
        assert [a[s] for s, _ in first] == [b[adm.slots[0]] for adm in admitted]


def test_a_packed_prefill_takes_short_prompts_of_any_lengths_within_the_token_budget(model):
    """`joins`: prompts of at most PACK_WIDTH tokens go together whatever their lengths while their tokens, in whole
    PACK_BUCKETs, stay within `prefill_tokens`, at most `prefill_batch` of them; a longer prompt joins only prompts of
    its own prefill shape; one short prompt alone is prefilled at its chunk width, unpacked."""
    eng = Engine(model.params, SPEC, slots=12, max_length=MAX_LENGTH, prefill_chunk=512, prefill_tokens=512)
    short = prompts(15, [128, 128, 128, 100, 28, 40])
    assert eng.joins([], short[0]) and eng.joins(short[:1], short[1]) and eng.joins(short[:3], short[3])
    assert eng.joins(short[:4], short[4])  # 512 tokens
    assert not eng.joins(short[:4], short[5])  # 524: past the budget
    longer = prompts(16, [129, 150, 400])
    assert not eng.joins(short[:1], longer[0]) and not eng.joins(longer[:1], short[0])
    assert eng.joins(longer[:1], longer[1]) and not eng.joins(longer[:1], longer[2])  # 160 wide both; 400: 416
    tiny = prompts(17, [10] * 9)
    assert eng.joins(tiny[:7], tiny[7]) and not eng.joins(tiny[:8], tiny[8])  # prefill_batch 8
    with pytest.raises(ValueError, match="packed prefill takes at most"):
        eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in short[:4] + short[5:]])
    assert eng.count("free") == 12
    lone = eng.start_prefill([Waiting(short[5], [Sampling(0.0)])])
    assert lone.packed is None and lone.rows == 1 and lone.plan == runtime.ChunkPlan(64, 1, 64)
    eng.abandon(lone)
    job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in short[:5]])
    assert job.packed == 512 and job.rows == 8 and job.plan == runtime.ChunkPlan(128, 1, 128)
    off = Engine(model.params, SPEC, slots=4, max_length=MAX_LENGTH, prefill_chunk=512, packed_prefill=False)
    assert off.pack_width == 0 and not off.packable(short[4]) and not off.joins(short[3:4], short[4])


def request(prompt: list[int], new: int, seen=None) -> tuple[Request, queue.Queue]:
    """A greedy request whose events land in the queue returned; `seen(event)` is called as each arrives (in the
    scheduler's thread)."""
    q = queue.Queue()

    def emit(e):
        if seen is not None:
            seen(e)
        q.put(e)

    return Request(prompt, new, Sampling(0.0), emit), q


def answer(q: queue.Queue) -> list[int]:
    """The token ids a request's events carry, once it has ended."""
    ids = []
    while (e := q.get(timeout=600)).kind != "end":
        assert e.kind != "error", e.message
        ids += e.token_ids
    return ids


def reference(model, prompt, new, max_length=384):
    return kivi_jax.generate(model, prompt, max_new_tokens=new, cache=SPEC, max_length=max_length,
                             prefill_chunk=64).token_ids


@pytest.mark.slow
def test_the_scheduler_batches_waiting_prompts_and_interleaves_a_long_one(model):
    """Six short prompts of one width go through one packed prefill call (their 156 tokens in 192 token rows, where
    rows of the chunk width would take two calls of 4 x 64 and 2 x 64); a long prompt (four chunks) is prefilled a
    chunk an iteration while two others decode; every greedy answer is `generate` alone's."""
    short = prompts(5, [4, 9, 12, 30, 41, 60])
    long = prompts(6, [250])[0]
    eng = Engine(model.params, SPEC, slots=8, max_length=384, prefill_chunk=64, prefill_tokens=256, decode_group=4)
    assert eng.prefill_shape(short[0]) == runtime.ChunkPlan(64, 1, 64) and eng.prefill_room(eng.prefill_shape(short[0])) == 4
    assert Engine(model.params, SPEC, slots=8, max_length=384).prefill_tokens == 512  # the CPU's default
    sched = Scheduler(eng, model.tokenizer, step_prefill_tokens=64)  # one chunk of 64 between two decode steps
    with sched.paused():  # all six wait before the loop runs, so they are batched
        sched.start()
        queued = [request(p, 24) for p in short]
        for req, _ in queued:
            sched.submit(req)
    try:
        got = [answer(q) for _, q in queued]
        assert eng.counters["prefill_calls"] == 1 and eng.counters["prefill_rows"] == 8  # six prompts, packed
        # the long one arrives while two short ones decode: its four chunks alternate with their steps
        pair = [request(short[0], 60), request(short[1], 60)]
        for req, _ in pair:
            sched.submit(req)
        t0 = time.monotonic()
        while eng.count("live") < 2 and time.monotonic() - t0 < 600:
            time.sleep(0.001)
        calls, steps = eng.counters["prefill_calls"], eng.counters["decode_steps"]
        first = []  # decode steps run when the long prompt's first token came
        lone = request(long, 8, lambda e: first or first.append(eng.counters["decode_steps"]))
        sched.submit(lone[0])
        outs = [answer(q) for _, q in pair + [lone]]
    finally:
        sched.stop()
    assert eng.counters["prefill_calls"] - calls == 4  # the long prompt alone, in four chunks of 64
    assert first[0] - steps >= 3  # a decode step of the others after each chunk but the last
    assert got == [reference(model, p, 24) for p in short]
    assert outs == [reference(model, short[0], 60), reference(model, short[1], 60), reference(model, long, 8)]


def test_an_idle_scheduler_gathers_a_burst_of_requests_into_one_prefill(model, monkeypatch):
    """Requests that reach an idle scheduler one after another, each within ARRIVAL_QUIET of the last (a burst of
    clients, each request parsed and tokenized in turn), go into one packed prefill, not the first alone and then the
    rest; it waits no longer once a job's worth (prefill_batch) wait; the answers are `generate` alone's. (The quiet
    time and window are widened here so that a slow test machine's pauses between the submissions do not end the
    burst.)"""
    from kivi_jax.serve import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "ARRIVAL_QUIET", 0.5)
    monkeypatch.setattr(scheduler_mod, "ARRIVAL_WINDOW", 5.0)
    eng = Engine(model.params, SPEC, slots=4, max_length=384, prefill_chunk=64)
    sched = Scheduler(eng, model.tokenizer).start()
    burst = prompts(7, [5, 9, 14, 20])
    try:
        time.sleep(0.2)  # idle, waiting for a request
        queued = []
        for p in burst:
            queued.append(request(p, 6))
            sched.submit(queued[-1][0])
            time.sleep(0.05)
        got = [answer(q) for _, q in queued]
    finally:
        sched.stop()
    assert eng.counters["prefill_calls"] == 1 and eng.counters["prefill_rows"] == 4
    assert got == [reference(model, p, 6) for p in burst]
    monkeypatch.setattr(scheduler_mod, "ARRIVAL_QUIET", 5.0)  # a burst would be waited for to the window's end
    eng = Engine(model.params, SPEC, slots=4, max_length=384, prefill_chunk=64, prefill_batch=2)
    sched = Scheduler(eng, model.tokenizer).start()
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        first = [request(p, 1) for p in burst[:2]]
        for req, _ in first:
            sched.submit(req)
        [answer(q) for _, q in first]
        waited = time.monotonic() - t0
    finally:
        sched.stop()
    assert waited < 4.0 and eng.counters["prefill_calls"] == 1  # two, a job's worth: not the 5 s window


@pytest.mark.slow
def test_the_scheduler_prefills_its_token_budget_between_two_decode_steps(model):
    """With a budget of 256 prompt tokens between two decode steps, a 400-token prompt (seven chunks of 64) arriving
    while two requests decode is prefilled four chunks an iteration (then three), a decode step after each; the
    answers are `generate` alone's, and /metrics' seconds count the loop's prefill, decode and host time."""
    pair = prompts(8, [10, 20])
    long = prompts(9, [400])[0]
    eng = Engine(model.params, SPEC, slots=4, max_length=512, prefill_chunk=64, decode_group=4)
    sched = Scheduler(eng, model.tokenizer, step_prefill_tokens=256)
    queued = [request(p, 30) for p in pair]
    for req, _ in queued:
        sched.submit(req)
    sched._iteration()  # the loop's thread is not started: one iteration at a time
    assert eng.counters["prefill_calls"] == 1 and eng.count("live") == 2 and eng.counters["decode_steps"] == 1
    lone = request(long, 8)
    sched.submit(lone[0])
    for calls, steps in ((4, 2), (7, 3)):  # four chunks and a decode step of the pair, then three and a step of all
        sched._iteration()
        assert eng.counters["prefill_calls"] == 1 + calls and eng.counters["decode_steps"] == steps
    assert eng.count("live") == 3
    with pytest.raises(ValueError, match="step_prefill_tokens=0"):
        Scheduler(eng, step_prefill_tokens=0)
    sched.start()
    try:
        outs = [answer(q) for _, q in queued + [lone]]
    finally:
        sched.stop()
    assert outs == [reference(model, pair[0], 30, 512), reference(model, pair[1], 30, 512),
                    reference(model, long, 8, 512)]
    seconds = sched.metrics()
    assert seconds["prefill_seconds"] > 0 and seconds["decode_seconds"] > 0 and seconds["host_seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SPEC, "full", "int8", "kivi2+"])
def test_bucketed_decode_equals_the_full_width_step_for_any_live_set(model, spec):
    """Requests arrive and finish at random steps over 8 slots (so the live set is ragged, with held and free rows
    between live ones): every step's tokens equal those of the step that computes all 8 rows, and the bucketed
    engine compiles at most one decode a bucket size (1, 2, 4, 8)."""
    from kivi_jax.serve import engine as engine_mod

    rng = np.random.RandomState(11)
    batch = prompts(12, rng.randint(3, 40, 10))
    plan = [(int(rng.randint(0, 40)), int(rng.randint(4, 25))) for _ in batch]  # (arrival step, tokens)
    got = {}
    for buckets in (False, True):
        eng = Engine(model.params, spec, slots=8, max_length=128, prefill_chunk=64, buckets=buckets, prefill_batch=1)
        assert eng.groups == [(0, 8)] and eng.buckets == buckets
        compiled = engine_mod.decode_step._cache_size()
        steps, live, trace = 0, {}, []
        while steps < 70:
            for i, (at, _) in enumerate(plan):
                if at == steps and eng.has_free_slot():
                    slot, _tok = eng.admit(batch[i], Sampling(0.0))
                    live[slot] = (i, 0)
            out = eng.step()
            trace.append(sorted((live[s][0], t) for s, t in out.items()))
            for s in list(live):
                i, n = live[s]
                live[s] = (i, n + 1)
                if n + 1 >= plan[i][1]:
                    eng.finish(s, hold=bool(i % 2))  # some held (length kept), some freed
                    del live[s]
            steps += 1
        got[buckets] = trace
        if buckets:
            assert engine_mod.decode_step._cache_size() - compiled <= 4  # buckets 1, 2, 4, 8
    assert any(len(t) > 1 for t in got[True]) and any(len(t) == 1 for t in got[True])
    assert got[True] == got[False]


def test_new_sequences_fill_the_busiest_decode_group_first(model):
    """Slots are chosen so that live rows stay in few decode groups (each group with a live row is a call of every
    step): a batch after two others finished (held, prefixes kept) lands in one group of 4, not in the small group's
    free slots and then the oldest held ones of another (as the lowest free slot first did); a request joins the
    group already decoding, taking its held slot, while the small group's slots are free; its tokens are a prefill
    alone's."""
    eng = Engine(model.params, SPEC, slots=10, max_length=128, prefill_chunk=64, decode_group=4)
    assert eng.groups == [(0, 4), (4, 4), (8, 2)]
    group = lambda slots: {eng._where(s)[0] for s in slots}  # noqa: E731

    def batch(seed: int) -> list:
        job = eng.start_prefill([Waiting(p, [Sampling(0.0)]) for p in prompts(seed, [9, 11, 13, 15])])
        admitted = None
        while admitted is None:
            admitted = eng.advance(job)
        return admitted

    for seed in (1, 2):  # two batches that finish, their slots held
        done = batch(seed)
        assert len(group([a.slots[0] for a in done])) == 1
        for a in done:
            eng.finish(a.slots[0], hold=True)
    assert eng.count("held") == 8 and eng.count("free") == 2
    third = batch(3)
    slots = [a.slots[0] for a in third]
    assert len(group(slots)) == 1 and eng.groups[group(slots).pop()][1] == 4  # one call of 4 rows a step
    eng.finish(slots[0], hold=True)
    prompt = prompts(4, [7])[0]
    slot, token = eng.admit(prompt, Sampling(0.0))
    assert slot == slots[0]  # beside the three still decoding (its held prefix given up), not in the free group
    alone = Engine(model.params, SPEC, slots=1, max_length=128, prefill_chunk=64)
    assert token == alone.admit(prompt, Sampling(0.0))[1]
    assert eng.step()[slot] == alone.step()[0]


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True])
def test_warm_up_compiles_what_serving_runs_and_changes_nothing(model, paged):
    """After `warm_up` a batch of short prompts, short prompts with a common prefix, a long prompt of several chunks
    and decode steps at every live count compile no new program (the prefill chunk, insert, first draw, decode step
    and the common prefix's extract and tile caches do not grow); the engine is as it was (slots free, every page
    back, counters untouched, no common prefix kept) and its answers equal a cold engine's."""
    kw = dict(slots=9, max_length=MAX_LENGTH, prefill_chunk=64, decode_group=3 if not paged else None,
              pages=9 * (MAX_LENGTH // 16) if paged else None)
    params = jax.device_put(model.params, jax.devices()[0])  # committed, as the default model's load gives them
    spec = "k2v2-g8-r32"  # a ring that holds a common prefix of 16 or more unquantized (SPEC's 16 would not)
    cold, warm = Engine(params, spec, **kw), Engine(params, spec, **kw)
    before = dict(warm.counters)
    done = warm.warm_up()
    assert done["programs"] > 0 and warm.count("free") == 9 and warm.counters == before and not warm.common_caches
    if paged:
        assert warm.free_pages() == warm.allocator.num_pages
    jitted = (runtime.prefill_chunk, runtime.decode_step, runtime.sample_first, engine_mod.tile_cache,
              engine_mod.extract_cache)
    sizes = [f._cache_size() for f in jitted]
    batch = prompts(11, [20, 33, 60, 64, 150])  # four of one chunk (a batch), one of three chunks
    prefix = prompts(12, [18])[0]
    alike = [prefix + p for p in prompts(13, [5, 9, 30])]  # packed after their common prefix

    def serve(engine):
        out = {}
        for group in (batch[:4], alike, batch[4:]):
            job = engine.start_prefill([Waiting(p, [Sampling(0.0)]) for p in group])
            assert job.shared == (18 if group is alike else 0)
            while (admitted := engine.advance(job)) is None:
                pass
            for p, a in zip(group, admitted):
                out[a.slots[0]] = [a.first[0].token]
        for _ in range(4):
            for slot, token in engine.step().items():
                out[slot].append(token)
        return [out[s] for s in sorted(out)]

    assert serve(warm) == serve(cold)
    assert [f._cache_size() for f in jitted] == sizes


def test_warm_up_covers_every_decode_groups_size(model):
    """Slots in decode groups of unequal sizes (2, 2 and 1, as a server's 72 slots in groups of 32 end with 8): after
    `warm_up`, requests filling every slot, the last group's too, compile no new prefill, insert, first draw or
    decode step (each group's cache and keys are committed to the device from the start, as an insert's and a
    step's outputs are, and each group size gets its insert warmed up)."""
    from kivi_jax.serve import engine as engine_mod

    params = jax.device_put(model.params, jax.devices()[0])  # committed, as the default model's load gives them
    eng = Engine(params, SPEC, slots=5, max_length=MAX_LENGTH, prefill_chunk=64, decode_group=2)
    assert [n for _, n in eng.groups] == [2, 2, 1]
    eng.warm_up()
    jitted = (runtime.prefill_chunk, runtime.decode_step, runtime.sample_first, engine_mod.insert_cache)
    sizes = [f._cache_size() for f in jitted]
    for p in prompts(12, [20, 33, 40, 52, 60]):  # one at a time: slots 0 to 4, the last group's included
        job = eng.start_prefill([Waiting(p, [Sampling(0.0)])])
        while eng.advance(job) is None:
            pass
    assert eng.count("live") == 5
    for _ in range(3):
        assert len(eng.step()) == 5
    assert [f._cache_size() for f in jitted] == sizes


def test_a_prompts_later_chunks_reuse_its_first_chunks_program(model):
    """A prompt's second chunk runs the program its first chunk compiled: the first call's inputs are committed to
    the device as every chunk's outputs are (jit keys on that), so warming up one chunk of a width covers a long
    prompt's chunks of that width too."""
    spec, width = "k2v2-g8-r32", 96  # a shape no other test of this module compiles
    params = jax.device_put(model.params, jax.devices()[0])  # committed, as the default model's load gives them
    fresh = lambda: kivi_jax.make_cache(spec, params.config, 1, MAX_LENGTH)  # noqa: E731
    one = np.asarray(prompts(5, [width])[0], np.int32)[None]
    runtime.prefill(params, one, np.array([width]), fresh(), chunk=width)
    compiled = runtime.prefill_chunk._cache_size()
    two = np.asarray(prompts(6, [2 * width])[0], np.int32)[None]
    runtime.prefill(params, two, np.array([2 * width]), fresh(), chunk=width)
    assert runtime.prefill_chunk._cache_size() == compiled


def test_an_auto_prefill_precision_rounds_quantized_activations_where_the_cpu_has_vnni(model):
    """`prefill_precision='auto'` (`serve --prefill-precision auto`): int8 activations for quantized weights where
    the native kernel takes them, the prefill's logits within int8's rounding of the exact engine's; float weights
    exact."""
    from kivi_jax.native import matmul

    quantized = kivi_jax.weights.convert_params(model.params, "int8")  # 8-bit codes, a group a row
    auto = Engine(quantized, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64, prefill_precision="auto")
    exact = Engine(quantized, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64)
    assert auto.prefill_precision == ("int8" if matmul.int8_matmul() else "float32")
    prompt = prompts(22, [40])[0]
    want, got = (np.asarray(e.prefill(prompt)[0]) for e in (exact, auto))
    assert np.abs(got - want).max() <= 5e-2 * np.abs(want).max()
    assert (np.abs(got - want).max() > 0) == matmul.int8_matmul()
    floats = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_precision="auto")
    assert floats.prefill_precision == "float32" and floats.prefill_params is floats.params


def test_an_engine_decodes_quantized_weights_from_their_strip_major_copy_as_without_it(model):
    """On the CPU an engine gives its 4- and 8-bit matrices their strip-major copy (`weights.with_strips`: what its
    prefill chunks and decode steps past 16 rows decode), and its answers are bit for bit those of an engine without
    one (`weight_strips=False`): 20 prompts' first tokens (prefill calls of 20-59 rows) and three decode steps of 20
    live rows, every row's token and log-probabilities."""
    from kivi_jax import native

    quantized = kivi_jax.weights.convert_params(model.params, "int8")  # 8-bit codes, a group a row
    engines = [Engine(quantized, SPEC, slots=20, decode_group=20, max_length=MAX_LENGTH, weight_strips=copy)
               for copy in (True, False)]
    mats = lambda p: [w for w in jax.tree_util.tree_leaves(p, is_leaf=kivi_jax.weights.is_quantized)
                      if kivi_jax.weights.is_quantized(w)]
    assert all((w.strips is not None) == native.available() for w in mats(engines[0].decode_params))
    assert all(w.strips is None for w in mats(engines[1].decode_params))
    batch = prompts(29, np.random.RandomState(29).randint(20, 60, 20))  # prefill calls of 20-59 rows
    got = []
    for e in engines:
        admitted = [e.admit_choices(p, [Sampling(0.0)], logprobs=True) for p in batch]
        firsts = [(a.slots[0], a.first[0].token, tuple(lp for _, lp in a.first[0].top)) for a in admitted]
        steps = [sorted((s, r.token, tuple(lp for _, lp in r.top)) for s, r in e.step_scored().items())
                 for _ in range(3)]  # steps of 20 live rows
        got.append((firsts, steps))
    assert len(got[0][1][0]) == 20
    assert got[0] == got[1]


def test_an_int8_decode_precision_rounds_the_decode_steps_only(model):
    """`decode_precision='int8'` (`serve --decode-precision int8`): every decode step dots int8-rounded activations
    of the quantized weights (a step's log-probabilities within int8's rounding of the exact engine's, and not equal:
    the native kernel and, without VNNI, XLA's twin round alike), the prompt's prefill stays exact; 'auto' resolves
    as the prefill's does; bfloat16 is refused for decode steps."""
    from kivi_jax.native import matmul

    quantized = kivi_jax.weights.convert_params(model.params, "int8")  # 8-bit codes, a group a row
    exact = Engine(quantized, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64)
    rounded = Engine(quantized, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64, decode_precision="int8")
    assert rounded.prefill_params is rounded.params and rounded.decode_params is not rounded.params
    prompt = prompts(23, [40])[0]
    firsts, steps = [], []
    for e in (exact, rounded):
        admitted = e.admit_choices(prompt, [Sampling(0.0)], logprobs=True)
        firsts.append(admitted.first[0])
        steps.append([e.step_scored()[admitted.slots[0]] for _ in range(3)])
    assert firsts[0] == firsts[1]  # the same exact prefill
    for want, got in zip(*steps):
        assert want.token == got.token  # greedy on a random tiny model: no near tie in three steps
        w, g = np.array([lp for _, lp in want.top]), np.array([lp for _, lp in got.top])
        assert 0 < np.abs(g - w).max() <= 5e-2 * np.abs(w).max()
    auto = Engine(quantized, SPEC, slots=2, max_length=MAX_LENGTH, decode_precision="auto")
    assert auto.decode_precision == ("int8" if matmul.int8_matmul() else "float32")
    floats = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, decode_precision="auto")
    assert floats.decode_precision == "float32" and floats.decode_params is floats.params
    with pytest.raises(ValueError, match="decode precision 'bfloat16'"):
        Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, decode_precision="bfloat16")


def test_a_bfloat16_prefill_is_close_and_only_the_prefill(model):
    """`prefill_precision='bfloat16'`: a prompt's prefill logits within bfloat16 rounding of the exact engine's (and
    not equal: its matmuls did round), the decode steps of both engines run the same exact program, and another
    precision is refused."""
    prompt = prompts(21, [40])[0]
    exact = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64)
    rounded = Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_chunk=64,
                     prefill_precision="bfloat16")
    assert exact.prefill_params is exact.params and rounded.prefill_params is not rounded.params
    want, got = (np.asarray(e.prefill(prompt)[0]) for e in (exact, rounded))
    assert 0 < np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    steps = runtime.decode_step._cache_size()
    for e in (exact, rounded):
        e.admit(prompt, Sampling(0.0))
        e.step()
    assert runtime.decode_step._cache_size() - steps <= 1  # one decode program serves both
    with pytest.raises(ValueError, match="prefill precision"):
        Engine(model.params, SPEC, slots=2, max_length=MAX_LENGTH, prefill_precision="float16")
