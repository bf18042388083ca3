"""Where kivi_jax keeps what it writes (converted models, native builds) and how a writer names its copy in progress."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

CACHE_ENV = "KIVI_JAX_CACHE"


def cache_root() -> Path:
    """Where converted models live: `$KIVI_JAX_CACHE`, else `~/.cache/kivi_jax`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kivi_jax"


def partial_name(name: str) -> str:
    """A name for `name`'s in-progress copy that no other writer uses: `NAME.partial-PID-RANDOM`."""
    return f"{name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
