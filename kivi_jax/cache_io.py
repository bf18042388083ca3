"""Saving and restoring a live cache (orbax): its leaves, lengths and spec, and a fingerprint of the model it
belongs to. Restore is bit-exact; a different model or spec, a truncated or corrupt save fails with what differs.

A save is a directory: `cache.json` (format, spec, shapes, the model's fingerprint, a sha256 of every leaf, the
caller's metadata) and `arrays/` (orbax). `cache.json` is written last, so its presence marks a whole save.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.cache import make_cache
from kivi_jax.checkpoint import CheckpointError
from kivi_jax.config import parse_cache_spec, spec_name
from kivi_jax.models.llama import Params

FORMAT = "kivi_jax-cache"
VERSION = 1
META_FILE = "cache.json"


def model_fingerprint(params: Params) -> dict:
    """The model a cache belongs to: its config and a hash of every weight (a strided sample of each leaf)."""
    digest = hashlib.sha256(json.dumps(params.config.to_dict(), sort_keys=True).encode())
    for leaf in jax.tree_util.tree_leaves(params):
        flat = np.asarray(leaf).reshape(-1)
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        digest.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).astype(np.float32).tobytes())
    return {"config": params.config.to_dict(), "weights_sha256": digest.hexdigest()}


def _leaves(cache) -> dict[str, np.ndarray]:
    named = jax.tree_util.tree_flatten_with_path(cache)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in named}


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def save_cache(cache, path: str | os.PathLike, params: Params, metadata: dict | None = None) -> Path:
    """Writes `cache` (full or KIVI) to the new directory `path`, bound to the model `params`; `metadata` is any
    JSON-able dict kept beside it (e.g. a conversation)."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().absolute()
    if path.exists():
        raise CheckpointError(f"{path} already exists; choose a new path or remove it first")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise CheckpointError(f"cannot write a cache save into {path.parent} (not a writable directory)")
    leaves = _leaves(cache)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "spec": cache.spec,
        "batch": int(cache.length.shape[0]),
        "max_tokens": int(cache.max_tokens),
        "dtype": jnp.dtype(cache.dtype).name,
        "model": model_fingerprint(params),
        "sha256": {name: _sha(a) for name, a in leaves.items()},
        "metadata": metadata or {},
    }
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "arrays", leaves)
        checkpointer.wait_until_finished()
        (tmp / META_FILE).write_text(json.dumps(meta))
        tmp.rename(path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not save the cache to {path}: {e.strerror or e}") from e
    return path


def restore_cache(path: str | os.PathLike, params: Params, spec=None, impl: str = "auto"):
    """Reads a save of `save_cache` for the model `params` -> (cache, metadata). `spec`, when given, must be the
    saved cache's spec. Raises CheckpointError naming what does not match or what is damaged."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().absolute()
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a kivi_jax cache save (no {META_FILE}): it is missing or was never "
                              "completed")
    try:
        meta = json.loads(meta_file.read_text())
        saved_spec, batch, max_tokens = meta["spec"], int(meta["batch"]), int(meta["max_tokens"])
        dtype, model, sums = jnp.dtype(meta["dtype"]), meta["model"], meta["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has format {meta.get('format')!r} version {meta.get('version')}; this kivi_jax "
                              f"reads {FORMAT!r} version {VERSION}")
    ours = model_fingerprint(params)
    if model != ours:
        diff = sorted(k for k in set(model["config"]) | set(ours["config"])
                      if model["config"].get(k) != ours["config"].get(k))
        saved, here = model["config"], ours["config"]
        fields = ", ".join(f"{k} (saved {saved.get(k)!r}, this model {here.get(k)!r})" for k in diff[:4])
        what = f"its config differs in {fields}" if diff else "the same architecture with different weights"
        raise CheckpointError(f"{path} belongs to another model: {what}")
    if spec is not None and spec_name(parse_cache_spec(spec)) != saved_spec:
        raise CheckpointError(f"{path} holds a {saved_spec!r} cache, not {spec_name(parse_cache_spec(spec))!r}")
    target = jax.eval_shape(lambda: make_cache(saved_spec, params.config, batch, max_tokens, dtype, impl))
    names, treedef = [], jax.tree_util.tree_structure(target)
    shapes = {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        names.append(jax.tree_util.keystr(p))
        shapes[names[-1]] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    if set(names) != set(sums):
        raise CheckpointError(f"{path} does not hold the leaves of a {saved_spec!r} cache")
    try:
        arrays = ocp.StandardCheckpointer().restore(path / "arrays", shapes)
    except Exception as e:  # orbax / tensorstore raise many kinds on damaged data
        raise CheckpointError(f"{path / 'arrays'} is corrupt or truncated ({type(e).__name__}: {str(e)[:200]})") from e
    for name in names:
        if _sha(np.asarray(arrays[name])) != sums[name]:
            raise CheckpointError(f"{path}: leaf {name} does not match its checksum (the save is corrupt)")
    cache = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(arrays[n]) for n in names])
    return cache, meta["metadata"]
