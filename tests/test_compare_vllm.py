"""scripts/compare_vllm_serve.py reads both servers' /metrics and start lines (vLLM itself is never run here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import compare_vllm_serve as cmp  # noqa: E402

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 14.0
vllm:num_requests_running{engine="1",model_name="smollm2"} 2.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 50.0
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 3.0
"""
KIVI_METRICS = """# HELP kivi_serve_live_slots slots decoding a request
# TYPE kivi_serve_live_slots gauge
kivi_serve_live_slots 31
kivi_serve_peak_live_slots 64
kivi_serve_preemptions_total 0
"""


class FakeHttp:
    def __init__(self, text):
        self.text = text

    def get(self, url, timeout):
        assert url.endswith("/metrics")
        return self


class DownHttp:
    def get(self, url, timeout):
        raise ConnectionError("refused")


def test_scrape_sums_labelled_series_and_reads_plain_ones():
    assert cmp.scrape(FakeHttp(VLLM_METRICS), "u", cmp.LIVE_SERIES) == 16.0  # both engines, not the waiting ones
    assert cmp.scrape(FakeHttp(VLLM_METRICS), "u", cmp.PREEMPT_SERIES) == 3.0
    assert cmp.scrape(FakeHttp(KIVI_METRICS), "u", cmp.LIVE_SERIES) == 31.0  # not the peak since start
    assert cmp.scrape(FakeHttp(KIVI_METRICS), "u", cmp.PREEMPT_SERIES) == 0.0


def test_scrape_without_the_series_or_the_server_is_none():
    assert cmp.scrape(FakeHttp("# nothing\nother_metric 1\n"), "u", cmp.LIVE_SERIES) is None
    assert cmp.scrape(DownHttp(), "u", cmp.LIVE_SERIES) is None


def test_kv_capacity_reads_slots_and_paged_start_lines(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("starting\nkivi-jax serve: model 'smollm2'; cache kivi2, paged: 72 rows of up to 2048 tokens (6 MiB "
                   "a row), a pool of 900 pages of 128 tokens (1 MiB a page), 1 GiB in all\n")
    assert cmp.kv_capacity("kivi2:--paged", log).startswith("kivi2, paged: 72 rows of up to 2048")
    log.write_text("kivi-jax serve: model 'smollm2'; cache kivi2: 72 slots of 2048 tokens, 14 MiB a slot, 1 GiB in "
                   "all\n")
    assert cmp.kv_capacity("kivi2", log) == "kivi2: 72 slots of 2048 tokens, 14 MiB a slot, 1 GiB in all"


def test_a_servers_own_flags_follow_its_command(tmp_path, monkeypatch):
    """`--servers` entries carry each server's flags after colons, vLLM's too (`vllm:--block-size=16`); the capacity
    line is read by the server's kind whatever its flags."""
    import argparse

    monkeypatch.setattr(cmp, "launch", lambda cmd, *a, **k: cmd)
    monkeypatch.setattr(cmp, "vllm_python", lambda: Path("py"))
    args = argparse.Namespace(model="smollm2", weights="auto", kv_gib=1, max_length=2048, kivi_flags=["--x"],
                              vllm_dtype="float32")
    cmd = cmp.start("vllm:--block-size=16", args, Path("hf"), 8000, tmp_path / "log")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and cmd[-1] == "--block-size=16"
    cmd = cmp.start("kivi2:--no-prefix-reuse", args, Path("hf"), 8000, tmp_path / "log")
    assert cmd[cmd.index("--cache") + 1] == "kivi2" and cmd[-2:] == ["--x", "--no-prefix-reuse"]
    log = tmp_path / "serve.log"
    log.write_text("INFO [kv_cache_utils.py:1] CPU KV cache size: 23,296 tokens\n")
    assert cmp.kv_capacity("vllm:--block-size=16", log) == "CPU KV cache size: 23,296 tokens"


def test_prefix_cache_hits_are_read_from_either_server():
    vllm = VLLM_METRICS + 'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 4096.0\n'
    assert cmp.scrape(FakeHttp(vllm), "u", cmp.PREFIX_HIT_SERIES) == 4096.0
    assert cmp.scrape(FakeHttp(KIVI_METRICS + "kivi_serve_prefix_tokens_reused_total 12\n"), "u",
                      cmp.PREFIX_HIT_SERIES) == 12.0
    assert cmp.scrape(FakeHttp(VLLM_METRICS), "u", cmp.PREFIX_HIT_SERIES) is None


class WordTokenizer:
    """Offsets of whitespace-separated words, as a fast tokenizer's `return_offsets_mapping` gives them."""

    def __call__(self, text, return_offsets_mapping, add_special_tokens):
        import re

        return {"offset_mapping": [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]}


def test_each_run_prompts_other_stretches_of_the_same_lengths():
    tok = WordTokenizer()
    first, second = (cmp.make_prompts(tok, 8, 120, 400, run) for run in (1, 2))
    assert cmp.make_prompts(tok, 8, 120, 400) == first  # run 1 is the default
    words = lambda ps: [len(p.split()) for p in ps]  # noqa: E731
    assert words(first) == words(second)
    assert not set(first) & set(second)  # no prompt, so no prompt's prefix of a chunk, repeats from run 1 to run 2
    assert all(a.split()[:16] != b.split()[:16] for a, b in zip(first, second))


def test_interleaved_runs_go_round_the_servers_reversing_every_other_run():
    sessions = cmp.schedule(["a", "b", "c"], ["short", "long"], 2, "interleaved")
    assert sessions == [[(1, "short", "a"), (1, "short", "b"), (1, "short", "c"),
                         (2, "short", "c"), (2, "short", "b"), (2, "short", "a"),
                         (1, "long", "a"), (1, "long", "b"), (1, "long", "c"),
                         (2, "long", "c"), (2, "long", "b"), (2, "long", "a")]]


def test_sequential_runs_take_one_server_a_session():
    assert cmp.schedule(["a", "b"], ["short", "long"], 2, "sequential") == [
        [(1, "short", "a"), (2, "short", "a"), (1, "long", "a"), (2, "long", "a")],
        [(1, "short", "b"), (2, "short", "b"), (1, "long", "b"), (2, "long", "b")]]
    import pytest

    with pytest.raises(ValueError, match="one of interleaved, sequential"):
        cmp.schedule(["a"], ["short"], 1, "random")


def test_cpu_seconds_counts_a_sessions_processes():
    import os
    import time

    sid = os.getsid(0)
    before = cmp.cpu_seconds(sid)
    assert before is not None and before >= time.process_time() - 0.5  # this process is one of the session's
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    assert cmp.cpu_seconds(sid) >= before + 0.25
    assert cmp.cpu_seconds(2**22 + 12345) is None  # no process of that session


def test_a_run_waits_for_the_other_servers_to_go_quiet():
    """`settle` returns once the servers not under test took at most 0.05 CPU seconds in a window (here the third:
    the first two were busy), at its timeout if they never go quiet, at once with no other server or no /proc."""
    now = [0.0]

    def sleep(s):
        now[0] += s

    def cpu_of(steps):  # each window's CPU seconds for a session, one step a window
        used = {}

        def cpu(pid):
            used.setdefault(pid, [0.0, 0])
            return used[pid][0]

        def sleep_and_use(s):
            sleep(s)
            for u in used.values():
                u[0] += steps[min(u[1], len(steps) - 1)]
                u[1] += 1
        return cpu, sleep_and_use

    cpu, step = cpu_of([0.6, 0.3, 0.01])
    assert cmp.settle([7], cpu=cpu, sleep=step, clock=lambda: now[0]) == 1.5  # three half-second windows
    now[0] = 0.0
    cpu, step = cpu_of([0.5])
    assert cmp.settle([7, 8], cpu=cpu, sleep=step, clock=lambda: now[0], timeout=3.0) == 3.0  # never quiet
    assert cmp.settle([], cpu=cpu, sleep=step, clock=lambda: now[0]) == 0.0
    assert cmp.settle([7], cpu=lambda pid: None, sleep=sleep, clock=lambda: 0.0) == 0.0


def test_a_streamed_answer_reports_the_prompt_tokens_the_server_counted():
    """`stream_one` keeps the server's own prompt count (its usage), which the comparison sums a run to show both
    servers prefilled the same tokens; a server that sends no usage gives None, not a zero."""
    import json

    import httpx

    from kivi_jax.serve.loadtest import stream_one

    def sse(usage):
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}, "token_ids": [i]}]}
                  for i, w in enumerate(["Paris", "."])]
        if usage is not None:
            chunks.append({"choices": [], "usage": usage})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    for usage, want in (({"prompt_tokens": 57, "completion_tokens": 2}, 57), (None, None)):
        transport = httpx.MockTransport(lambda request, u=usage: httpx.Response(200, text=sse(u)))
        with httpx.Client(transport=transport) as http:
            r = stream_one(http, "http://server", "smollm2", "What is the capital of France?", 8)
        assert r["prompt_tokens"] == want and len(r["arrivals"]) == 2
        assert r["tokens"] == (2 if usage else 0)
    rows = [{"workload": "short", "server": "vllm", "run": 1, "output_tokens_per_s": 1.0, "ttft_s_p50": 0.1,
             "ttft_s_p99": 0.2, "itl_s_p50": 0.01, "itl_s_p99": 0.02, "prompt_tokens": 2340, "ok": 32, "requests": 32}]
    assert "| 2340 | 32/32 |" in cmp.table(rows)


def test_ignore_eos_asks_every_answer_to_run_to_the_workloads_new_tokens(monkeypatch):
    """`--ignore-eos` (`run_workload(..., ignore_eos=True)`) puts vLLM's `ignore_eos` in every request, so servers
    whose answers end at different places still do the same work; without it no request carries it. Every client
    is made before any request is sent."""
    import json
    import threading

    import httpx

    bodies, lock = [], threading.Lock()
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in (
        {"choices": [{"index": 0, "delta": {"content": "Paris"}, "token_ids": [7]}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})) + "data: [DONE]\n\n"

    def handle(request):
        if request.url.path.endswith("/metrics"):
            return httpx.Response(200, text=KIVI_METRICS)
        with lock:
            bodies.append({**json.loads(request.content), "clients_made": len(made)})
        return httpx.Response(200, text=stream)

    real, made = httpx.Client, []

    def client(*a, **k):
        made.append(1)
        return real(transport=httpx.MockTransport(handle))

    monkeypatch.setattr(httpx, "Client", client)
    for flag in (False, True):
        r = cmp.run_workload("http://server", ["one", "two", "three"], 8, ignore_eos=flag)
        assert r["ok"] == 3 and r["prompt_tokens"] == 27 and r["sends_within_s"] >= 0
        # every client of the run made before any of its requests is sent (they are released together)
        assert len({b["clients_made"] for b in bodies[-3:]}) == 1
    assert sorted(b.get("ignore_eos", False) for b in bodies) == [False] * 3 + [True] * 3
    assert all(b["max_tokens"] == 8 for b in bodies)
