"""Saving and restoring a live cache (orbax): its leaves, lengths and spec, and a fingerprint of the model it
belongs to. Restore is bit-exact; a different model or spec, a truncated or corrupt save fails with what differs.

A save is a directory: `cache.json` (format, spec, shapes, the model's fingerprint, a sha256 of every leaf and of
every file orbax wrote, the caller's metadata, and a sha256 of all that) and `arrays/` (orbax). `cache.json` is
written last, so its presence marks a whole save. Restore checks, in this order, that `cache.json` is whole, that the
spec is the one asked for, that the model is the same (config, dtype, weights), and that every file is as written,
before orbax reads anything: each failure says which it is.
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

from kivi_jax import rotation
from kivi_jax.cache import make_cache
from kivi_jax.checkpoint import CheckpointError
from kivi_jax.config import parse_cache_spec, spec_name
from kivi_jax.models.decoder import Params

FORMAT = "kivi_jax-cache"
VERSION = 1
META_FILE = "cache.json"


def model_fingerprint(params: Params) -> dict:
    """The model a cache belongs to: its config, its dtype and a hash of every weight (a strided sample of each
    leaf)."""
    digest = hashlib.sha256(json.dumps(params.config.to_dict(), sort_keys=True).encode())
    for leaf in jax.tree_util.tree_leaves(params):
        flat = np.asarray(leaf).reshape(-1)
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        digest.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).astype(np.float32).tobytes())
    return {"config": params.config.to_dict(), "dtype": jnp.dtype(params.dtype).name,
            "weights_sha256": digest.hexdigest()}


def _model_difference(saved: dict, ours: dict) -> str | None:
    """What differs between the fingerprint of a save and of this model, in words (None: the same model). A save
    written before fingerprints had a dtype is compared on config and weights alone."""
    diff = sorted(k for k in set(saved["config"]) | set(ours["config"])
                  if saved["config"].get(k) != ours["config"].get(k))
    if diff:
        fields = ", ".join(f"{k} (saved {saved['config'].get(k)!r}, this model {ours['config'].get(k)!r})"
                           for k in diff[:4])
        return f"its config differs in {fields}"
    if "dtype" in saved and saved["dtype"] != ours["dtype"]:
        return (f"it was saved with the model in {saved['dtype']}, this model runs in {ours['dtype']} (load it with "
                f"the dtype of the save, e.g. --dtype {saved['dtype']})")
    if saved["weights_sha256"] != ours["weights_sha256"]:
        return "the same architecture with different weights"
    return None


def _files(root: Path) -> dict[str, list]:
    """Every file under `root` -> [bytes, sha256]."""
    return {str(f.relative_to(root)): [f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()]
            for f in sorted(root.rglob("*")) if f.is_file()}


def _meta_sha(meta: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"},
                                     sort_keys=True).encode()).hexdigest()


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
        meta["files"] = _files(tmp / "arrays")
        meta["meta_sha256"] = _meta_sha(meta)
        (tmp / META_FILE).write_text(json.dumps(meta))
        tmp.rename(path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not save the cache to {path}: {e.strerror or e}") from e
    return path


def restore_cache(path: str | os.PathLike, params: Params, spec=None, impl: str = "auto"):
    """Reads a save of `save_cache` for the model `params` -> (cache, metadata). `spec`, when given, must be the
    saved cache's spec. `params` may be the model's own or already prepared for the saved spec (value-rotated for a
    `-rotv` one, `kivi_jax.rotation.prepare_params`). Raises CheckpointError saying what does not match (the spec,
    the model) or what is damaged (which file)."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().absolute()
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a kivi_jax cache save (no {META_FILE}): it is missing or was never "
                              "completed")
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has format {meta.get('format')!r} version {meta.get('version')}; this kivi_jax "
                              f"reads {FORMAT!r} version {VERSION}")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_sha(meta):
        raise CheckpointError(f"{meta_file} is corrupt: its contents do not match the checksum written with them")
    try:
        saved_spec, batch, max_tokens = meta["spec"], int(meta["batch"]), int(meta["max_tokens"])
        dtype, model, sums = jnp.dtype(meta["dtype"]), meta["model"], meta["sha256"]
        parsed_spec = parse_cache_spec(saved_spec)
        if not (isinstance(model, dict) and isinstance(model.get("config"), dict) and "weights_sha256" in model
                and isinstance(sums, dict) and isinstance(meta.get("metadata", {}), dict)):
            raise TypeError("the model fingerprint, the checksums or the metadata are not what a save writes")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({type(e).__name__}: {e})") from e
    if spec is not None and spec_name(parse_cache_spec(spec)) != spec_name(parsed_spec):
        raise CheckpointError(f"{path} holds a {saved_spec!r} cache, not {spec_name(parse_cache_spec(spec))!r}: it "
                              f"was saved with --cache {saved_spec}; load it with that cache spec")
    rotated = bool(params.value_basis)
    if rotated and not getattr(parsed_spec, "rotate_values", False):
        raise CheckpointError(f"{path} holds a {saved_spec!r} cache, whose values are not rotated, but these params "
                              "are value-rotated (prepared for a -rotv cache); pass the model's own params")
    difference = _model_difference(model, model_fingerprint(rotation.prepare_params(params, parsed_spec)))
    if difference:
        raise CheckpointError(f"{path} belongs to another model: {difference}")
    for name, (size, sha) in (meta.get("files") or {}).items():  # saves before the file list skip this check
        f = path / "arrays" / name
        if not f.is_file():
            raise CheckpointError(f"{path} is damaged: arrays/{name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path} is truncated or corrupt: arrays/{name} has {f.stat().st_size} bytes, the "
                                  f"save wrote {size}")
        if hashlib.sha256(f.read_bytes()).hexdigest() != sha:
            raise CheckpointError(f"{path} is corrupt: arrays/{name} does not match its checksum")
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
    return cache, meta.get("metadata", {})
