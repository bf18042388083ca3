"""Build, cache, load and register the C++ CPU kernels (XLA FFI handlers in `decode_cpu.cc`, `matmul_cpu.cc`,
`fmatmul_cpu.cc`, `attend_cpu.cc` and `argmax_cpu.cc`).

On first use the sources are compiled with the system C++ compiler (`$CXX`, else `g++`, else `c++`) against the FFI
headers jaxlib ships (`jax.ffi.include_dir()`): `-O3 -march=native -shared -fPIC -std=c++17`, or without
`-march=native` when the compiler refuses it. The shared library is cached under `<cache root>/native/` (the root is
`$KIVI_JAX_CACHE`, else `~/.cache/kivi_jax`), named by a hash of the sources, the flags, the compiler, the jaxlib
version and the CPU's features, and written to a temporary name first and renamed into place, so concurrent processes
never load a half-written file; a build holds a file lock, so processes starting together compile it once. It is loaded with ctypes and its handlers registered with
`jax.ffi.register_ffi_target(..., platform="cpu")`.

When there is no compiler or the build fails, `load()` returns None and warns once (why, and that the XLA path runs
instead); later calls return None without a second warning. `reset()` forgets that state (tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "decode_cpu.cc", HERE / "matmul_cpu.cc", HERE / "fmatmul_cpu.cc",
           HERE / "attend_cpu.cc", HERE / "argmax_cpu.cc")  # compiled into one library
HEADERS = (HERE / "simd.h", HERE / "gemm.h", HERE / "amx.h")
TARGETS = {"kivi_jax_kivi_decode": "KiviJaxKiviDecode", "kivi_jax_full_decode": "KiviJaxFullDecode",
           "kivi_jax_eight_decode": "KiviJaxEightDecode", "kivi_jax_qmatmul": "KiviJaxQMatmul",
           "kivi_jax_fmatmul": "KiviJaxFMatmul", "kivi_jax_bmatmul": "KiviJaxBMatmul",
           "kivi_jax_chunk_attend": "KiviJaxChunkAttend", "kivi_jax_first_max": "KiviJaxFirstMax"}
CXX_ENV = "CXX"
DISABLE_ENV = "KIVI_JAX_NATIVE"  # "0": never build or use the native kernels
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-w")
BUILD_TIMEOUT_S = 900  # 72 kernel instantiations: about 1 CPU-minute, several on a loaded 2-core machine


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded (the reason is in the message)."""


_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why not
_registered: dict = {}  # library path -> the library whose handlers are registered (once a process)


def cpu_features() -> str:
    """The CPU's model and feature flags (what `-march=native` compiles for): part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    pick = lambda key: next((l.split(":", 1)[1].strip() for l in lines if l.split(":")[0].strip() == key), "")
    return " ".join((platform.machine(), pick("model name"), pick("flags") or pick("Features")))


def has_amx() -> bool:
    """Whether this CPU has AMX tiles with bfloat16 (what the bfloat16 kernels' fast paths need)."""
    flags = cpu_features().split()
    return "amx_bf16" in flags and "amx_tile" in flags


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 F (what the float32 chunk attention's tiles are measured on)."""
    return "avx512f" in cpu_features().split()


def compiler() -> str:
    """The C++ compiler to use: `$CXX` as given (it may not exist: then the build fails and says so), else g++/c++."""
    env = os.environ.get(CXX_ENV)
    if env:
        return env
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")


def cache_dir() -> Path:
    from kivi_jax.paths import cache_root

    return cache_root() / "native"


def library_path(cxx: str, flags: tuple[str, ...]) -> Path:
    """Where the library built from these sources, with these flags, for this jaxlib and this CPU lives."""
    import jaxlib

    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode(), cxx.encode(),
                 jaxlib.__version__.encode(), cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"decode_cpu-{key.hexdigest()[:20]}.so"


def compile_library(cxx: str, flags: tuple[str, ...], out: Path) -> None:
    """Compiles the sources into `out` (via a temporary file in the same folder and an atomic rename)."""
    import jax

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"running {cxx!r} failed: {e}") from None
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip()[-2000:]
            raise NativeBuildError(f"{' '.join(cmd)} exited with {res.returncode}:\n{tail}")
        os.replace(tmp, out)  # atomic: other processes see nothing or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build() -> Path:
    """The cached library, compiled first if needed; raises NativeBuildError saying why it cannot be."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        raise NativeBuildError(f"disabled by {DISABLE_ENV}=0")
    cxx = compiler()
    errors = []
    for flags in (BASE_FLAGS + ("-march=native",), BASE_FLAGS):
        path = library_path(cxx, flags)
        if path.exists():
            return path
        try:
            with build_lock(path):  # concurrent first uses: one compiles, the others wait and find its library
                if not path.exists():
                    compile_library(cxx, flags, path)
            return path
        except NativeBuildError as e:
            errors.append(str(e))
    raise NativeBuildError("; then without -march=native: ".join(errors))


@contextlib.contextmanager
def build_lock(path: Path):
    """An exclusive `fcntl.flock` on `<library>.lock` for the time of a build (released if the process dies)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def register(lib_path: Path):
    import jax

    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def load():
    """The loaded, registered library, or None (with one warning, the first time) when it cannot be built."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        if "error" in _state:
            return None
        try:
            path = build()
            _state["lib"] = _registered.get(path) or register(path)
            _registered[path] = _state["lib"]
            _state["path"] = str(path)
            return _state["lib"]
        except (NativeBuildError, OSError, AttributeError) as e:
            _state["error"] = str(e)
            warnings.warn(f"kivi_jax native CPU kernels unavailable ({e}); decode attention uses the XLA path",
                          RuntimeWarning, stacklevel=3)
            return None


def available() -> bool:
    """Whether the native kernels are built and registered (building them on first call)."""
    return load() is not None


def error() -> str | None:
    """Why the native kernels are unavailable (after `load()`), or None."""
    return _state.get("error")


def reset() -> None:
    """Forgets the loaded or failed state, so the next `load()` tries again (a registered target stays registered)."""
    with _lock:
        _state.clear()
