"""Checkpoints -> `Params`: HF directories (safetensors), GGUF files, and our own orbax directories."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import weights as formats
from kivi_jax.models import registry
from kivi_jax.models.config import ModelConfig, UnsupportedModelError
from kivi_jax.models.decoder import Params, cast_params, param_shapes, params_from_dict, params_to_dict
from kivi_jax.weights import QuantizedMatrix

FORMAT_FILE = "kivi_jax.json"
FORMAT_VERSION = 2  # 2: quantized weight leaves (kivi_jax.weights), described under "weights"
READABLE_VERSIONS = (1, 2)

class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, truncated or of the wrong kind."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_dtype(dtype):
    """`dtype` (None, a name or a jnp dtype) -> None or a jnp floating dtype that parameters may be cast to.

    Allowed: float32, bfloat16, float16, and float64 only when JAX's x64 mode is on (otherwise JAX would silently
    keep float32 and warn once per tensor)."""
    if dtype is None:
        return None
    allowed = DTYPE_NAMES + (("float64",) if jax.config.jax_enable_x64 else ())
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype; choose one of {', '.join(allowed)}") from None
    if dt.name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "dtype=float64 needs JAX's 64-bit mode (jax.config.update('jax_enable_x64', True) before anything else "
            f"runs); without it choose one of {', '.join(DTYPE_NAMES)}"
        )
    if dt.name not in allowed:
        raise ValueError(f"dtype={dt.name} is not a compute dtype for the weights; choose one of {', '.join(allowed)}")
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}[dt.name]


def _progress(total: int, desc: str, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not show, leave=False)

# ---------------------------------------------------------------------------------------------------------------------
# Placing named checkpoint tensors by the architecture's table (models/registry.py: each Param's `hf` / `gguf` name)


def tensor_names(cfg: ModelConfig, source: str) -> tuple[dict[str, tuple[str, int | None]], list]:
    """`({tensor name: (our path, layer or None)}, [(pattern, path)])` for a checkpoint format (`source` "hf" or
    "gguf"): every name the table gives, and a regex per stacked leaf that catches a layer the config lacks."""
    import re

    names, patterns = {}, []
    for path, p in registry.param_table(cfg).items():
        name = getattr(p, source)
        if name is None:
            continue
        if p.stacked:
            names.update({name.format(i=i): (path, i) for i in range(cfg.num_layers)})
            patterns.append((re.compile(re.escape(name).replace(re.escape("{i}"), r"(\d+)")), path))
        else:
            names[name] = (path, None)
    return names, patterns


def _assemble(cfg: ModelConfig, tensors: Iterator[tuple[str, "np.ndarray | QuantizedMatrix"]], source_format: str,
              dtype, source: str) -> Params:
    """Places named `[out, in]` tensors (float arrays, or quantized matrices of their rows) into stacked `Params`
    by the architecture's table, checking that each arrives exactly once; float leaves are cast to `dtype`. Names
    the table does not know (rotary buffers, tied heads) are skipped."""
    table = registry.param_table(cfg)
    names, patterns = tensor_names(cfg, source_format)
    stacked: dict = {}  # layer leaf -> a float [layers, ...] array, or a list of per-layer quantized matrices
    seen_layers = {path: np.zeros(cfg.num_layers, bool) for path, p in table.items() if p.stacked}
    tree: dict = {}

    def oriented(name, arr, transpose, shape):
        if isinstance(arr, QuantizedMatrix):
            value = arr.replace(transposed=transpose)
        else:
            value = arr.T if transpose else arr
        if tuple(value.shape) != tuple(shape):
            want = tuple(shape)[::-1] if transpose else tuple(shape)
            raise CheckpointError(f"{source}: {name} has shape {tuple(arr.shape)}, expected {want}")
        return value

    for name, arr in tensors:
        if name not in names:
            for pattern, path in patterns:
                m = pattern.fullmatch(name)
                if m:
                    raise CheckpointError(f"{source}: tensor {name} names layer {int(m.group(1))}, but the config "
                                          f"has {cfg.num_layers}")
            continue  # e.g. rotary inv_freq buffers
        path, i = names[name]
        p = table[path]
        if source_format == "gguf" and p.from_gguf is not None:
            fix = lambda w, p=p: p.from_gguf(w, cfg)  # noqa: E731
            arr = formats.map_rows(arr, fix) if isinstance(arr, QuantizedMatrix) else fix(arr)
        transpose = p.kind == "matrix"
        if i is None:
            tree[path] = oriented(name, arr, transpose, p.shape)
            continue
        value = oriented(name, arr, transpose, p.shape[1:])
        if isinstance(value, QuantizedMatrix):
            stacked.setdefault(path, [None] * cfg.num_layers)[i] = value
        else:
            stacked.setdefault(path, np.zeros(p.shape, np.float32))[i] = value
        seen_layers[path][i] = True
    missing = [f"{k}[{np.flatnonzero(~s).tolist()}]" for k, s in seen_layers.items() if not s.all()]
    missing += [k for k, p in table.items() if not p.stacked and k not in tree]
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks tensors for {', '.join(missing)} (truncated or wrong model?)")
    layers = {}
    for k, v in stacked.items():
        if isinstance(v, list):
            if any(isinstance(x, QuantizedMatrix) != isinstance(v[0], QuantizedMatrix) for x in v):
                raise CheckpointError(f"{source}: {k} mixes quantized and float layers")
            try:
                v = formats.stack_layers(v)
            except ValueError as e:
                raise CheckpointError(f"{source}: {k}: {e}") from e
        layers[k[len("layers."):]] = v
    tree["layers"] = layers
    try:
        params = params_from_dict(tree, cfg)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e
    return jax.tree_util.tree_map(lambda a: _device(a, dtype), params, is_leaf=formats.is_quantized)


def _device(a, dtype):
    """A host leaf on the device: float arrays in `dtype`, quantized matrices as stored."""
    if isinstance(a, QuantizedMatrix):
        return jax.tree_util.tree_map(jnp.asarray, a)
    return jnp.asarray(a, dtype)

# ---------------------------------------------------------------------------------------------------------------------
# HF directory: config.json + model.safetensors or a sharded index

def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not read: "
            "re-save with `save_pretrained(..., safe_serialization=True)`)"
        )
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f} is listed in the shard index but missing")
    return files

def load_hf(path: str | os.PathLike, dtype=jnp.float32, progress: bool = False) -> Params:
    """An HF directory (config.json + safetensors) of any registered architecture -> `Params`, without torch."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json, so it is not an HF model directory")
    cfg = ModelConfig.from_hf_file(path / "config.json")
    files = _safetensors_files(path)

    def tensors():
        for f in files:
            try:
                with safe_open(str(f), framework="flax") as handle:
                    names = list(handle.keys())
                    bar = _progress(len(names), f.name, progress)
                    for name in names:
                        yield name, np.asarray(handle.get_tensor(name), np.float32)
                        bar.update()
                    bar.close()
            except SafetensorError as e:
                raise CheckpointError(f"{f} is corrupt or truncated ({e}); re-download or re-save it") from e

    return _assemble(cfg, tensors(), "hf", dtype, str(path))

# ---------------------------------------------------------------------------------------------------------------------
# GGUF (the architectures whose tensors the `gguf` package names)

def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


class GGUFMeta:
    """A GGUF file's metadata as an architecture's reader asks for it (models/registry.py): `meta(key, default)`
    reads `<arch>.key`, `meta.file(key, default)` any key, `meta.tensors` the tensor names, `meta.arch`,
    `meta.source`."""

    def __init__(self, reader, source: str):
        self.reader, self.source = reader, source
        self.arch = _gguf_field(reader, "general.architecture")
        self.tensors = {t.name for t in reader.tensors}

    def __call__(self, key: str, default=None):
        return _gguf_field(self.reader, f"{self.arch}.{key}", default)

    def file(self, key: str, default=None):
        return _gguf_field(self.reader, key, default)


def gguf_config(reader, source: str) -> ModelConfig:
    """The model config a GGUF file's metadata describes (by its `general.architecture`)."""
    meta = GGUFMeta(reader, source)
    return ModelConfig.from_gguf(meta.arch, meta)

def load_gguf(path: str | os.PathLike, dtype=jnp.float32, progress: bool = False, keep_blocks: bool = False) -> Params:
    """A GGUF file of a registered architecture -> `Params` (tensors named and fixed up as its table says). With
    `keep_blocks` its Q8_0, Q4_0 and Q4_1 matrices stay quantized as stored (`kivi_jax.weights`); every other tensor
    (and, without it, every tensor) is dequantized to float32 by `gguf`'s own `dequantize`, then cast to `dtype`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises a variety of errors on damaged files
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); corrupt or truncated?") from e
    cfg = gguf_config(reader, str(path))

    def tensors():
        bar = _progress(len(reader.tensors), path.name, progress)
        for t in reader.tensors:
            kind = t.tensor_type.name
            shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
            try:
                if keep_blocks and kind in formats.GGUF_BLOCKS and len(shape) == 2:
                    arr = formats.from_gguf_blocks(np.asarray(t.data).reshape(shape[0], -1), kind, transposed=False)
                else:
                    arr = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
            except Exception as e:
                raise CheckpointError(f"{path}: tensor {t.name} cannot be read ({e}); corrupt or truncated?") from e
            yield t.name, arr
            bar.update()
        bar.close()

    return _assemble(cfg, tensors(), "gguf", dtype, str(path))

CONTROL_TOKEN = 3  # GGUF token type of special tokens such as <|im_end|>


def gguf_tokenizer(path: str | os.PathLike):
    """The byte-level BPE tokenizer embedded in a GGUF file (`tokenizer.ggml.model == "gpt2"`), built with the
    `tokenizers` library alone (transformers' own GGUF reader needs torch): vocabulary and merges from the file,
    digits split one by one before the GPT-2 byte-level split (llama.cpp's `smollm` pre-tokenizer, as SmolLM2's own
    tokenizer does), control tokens special, the file's chat template and special token ids."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    meta = lambda key, default=None: _gguf_field(reader, f"tokenizer.{key}", default)  # noqa: E731
    kind = meta("ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer type {kind!r} is not supported (kivi_jax builds byte-level BPE, 'gpt2'); "
            "convert the model from an HF directory that has tokenizer.json instead"
        )
    tokens = list(meta("ggml.tokens"))
    types = list(meta("ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta("ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN])

    def token(key):
        i = meta(f"ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos = token("bos")
    if meta("ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=meta("chat_template"),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Our own format: orbax params + config json + tokenizer files

def check_output_dir(path: str | os.PathLike) -> Path:
    """Raises a clear CheckpointError unless a checkpoint directory can be created at `path`: it must not exist, and
    its nearest existing parent must be a writable directory. Cheap: run it before any expensive conversion."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        raise CheckpointError(f"{path} already exists; choose a new directory or remove it first")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"cannot create {path}: {parent} is a file, not a directory")
    import tempfile

    try:  # a real probe: permission bits do not tell (root, read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent))
    except OSError as e:
        raise CheckpointError(
            f"cannot create {path}: {parent} is not writable ({e.strerror or e}); choose a directory you can write to"
        ) from None
    return path


def save(params: Params, path: str | os.PathLike, tokenizer=None, source: str | None = None) -> Path:
    """Writes params (orbax), their config and optionally a tokenizer to the directory `path` (must not exist).

    The files are written into a sibling `NAME.partial-PID-RANDOM` (unique to this writer) and renamed into place
    whole; errors name `path`, never the partial directory."""
    import orbax.checkpoint as ocp

    from kivi_jax.paths import partial_name

    path = check_output_dir(path)
    tmp = path.with_name(partial_name(path.name))
    try:
        tmp.mkdir(parents=True)
        tree, quantized = _to_tree(params)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", tree)
        checkpointer.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        meta = {
            "format": "kivi_jax",
            "version": FORMAT_VERSION,
            "dtype": jnp.dtype(params.dtype).name,
            "config": params.config.to_dict(),
            "source": source,
            "weights": quantized,
        }
        (tmp / FORMAT_FILE).write_text(json.dumps(meta, indent=2))  # written last: its presence marks a whole checkpoint
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint {path}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(path)
    except OSError as e:  # another writer got there first
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{path} appeared while saving ({e.strerror or e})") from e
    return path

def is_kivi_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()

def restore(path: str | os.PathLike, dtype=None) -> Params:
    """Reads params written by `save`; `dtype` casts the float leaves (default: as saved; quantized leaves stay as
    stored)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta_file = path / FORMAT_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a kivi_jax checkpoint (no {FORMAT_FILE}); convert with `kivi-jax convert`")
    try:
        meta = json.loads(meta_file.read_text())
        cfg = ModelConfig.from_dict(meta["config"])
        saved_dtype = jnp.dtype(meta["dtype"])
        quantized = meta.get("weights") or {}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({e}); re-run `kivi-jax convert`") from e
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format version {meta.get('version')}, this kivi_jax reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    shapes = param_shapes(cfg)
    try:
        target = {k: _abstract(k, s, saved_dtype, quantized) for k, s in shapes.items()
                  if k != "layers" and s is not None}
        target["layers"] = {k: _abstract(f"layers.{k}", s, saved_dtype, quantized)
                            for k, s in shapes["layers"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file} describes its quantized weights wrongly ({e}); re-run `kivi-jax convert`")
    try:
        tree = ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as e:  # orbax / tensorstore raise many kinds on damaged data
        raise CheckpointError(
            f"{path / 'params'} is corrupt or truncated ({type(e).__name__}: {str(e)[:300]}); "
            "delete it and convert again"
        ) from e
    tree = _from_tree(tree, quantized)
    tree.setdefault("lm_head", None)
    params = params_from_dict(tree, cfg)
    if dtype is not None:
        params = cast_params(params, dtype)
    return params


def _to_tree(params: Params) -> tuple[dict, dict]:
    """Params -> (a tree of arrays for orbax, the description of each quantized leaf by path)."""
    quantized: dict = {}

    def leaf(name, w):
        if not isinstance(w, QuantizedMatrix):
            return w
        parts = {k: getattr(w, k) for k in ("codes", "scale", "mn") if getattr(w, k) is not None}
        quantized[name] = {"fmt": w.fmt, "bits": w.bits, "group": w.group, "offset": w.offset,
                           "transposed": w.transposed,
                           **{k: [list(a.shape), jnp.dtype(a.dtype).name] for k, a in parts.items()}}
        return parts

    d = params_to_dict(params)
    tree = {k: leaf(k, v) for k, v in d.items() if k != "layers" and v is not None}
    tree["layers"] = {k: leaf(f"layers.{k}", v) for k, v in d["layers"].items()}
    return tree, quantized


def _abstract(name: str, shape, dtype, quantized: dict):
    """The restore target of one leaf: a float ShapeDtypeStruct, or a dict of them for a quantized leaf."""
    if name not in quantized:
        return jax.ShapeDtypeStruct(shape, dtype)
    q = quantized[name]
    return {k: jax.ShapeDtypeStruct(tuple(q[k][0]), jnp.dtype(q[k][1])) for k in ("codes", "scale", "mn") if k in q}


def _from_tree(tree: dict, quantized: dict) -> dict:
    """The inverse of `_to_tree`: quantized leaves rebuilt from their arrays and description."""

    def leaf(name, v):
        if name not in quantized:
            return v
        q = quantized[name]
        return QuantizedMatrix(v["codes"], v["scale"], v.get("mn"), fmt=q["fmt"], bits=int(q["bits"]),
                               group=int(q["group"]), offset=int(q["offset"]), transposed=bool(q["transposed"]))

    out = {k: leaf(k, v) for k, v in tree.items() if k != "layers"}
    out["layers"] = {k: leaf(f"layers.{k}", v) for k, v in tree["layers"].items()}
    return out

def load_tokenizer(path: str | os.PathLike):
    """The tokenizer stored beside a checkpoint (our `tokenizer/` or an HF dir's files), or None."""
    path = Path(path)
    for candidate in (path / "tokenizer", path):
        if (candidate / "tokenizer.json").exists() or (candidate / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(candidate))
    return None

def load_any(path: str | os.PathLike, dtype=None, progress: bool = False, weights: str = "auto") -> tuple[Params, object]:
    """Params and tokenizer from an HF directory, a .gguf file or a kivi_jax checkpoint directory, holding the
    weights `weights` names (kivi_jax.weights.WEIGHTS_HELP; 'auto': a GGUF keeps its quantized blocks)."""
    weights = formats.check_weights(weights)
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf; give a .gguf file, an HF directory or a kivi_jax checkpoint")
        keep = weights not in formats.FLOAT_WEIGHTS
        params = load_gguf(path, dtype or jnp.float32, progress, keep_blocks=keep)
        return formats.convert_params(params, weights, dtype), gguf_tokenizer(path)
    if is_kivi_checkpoint(path):
        return formats.convert_params(restore(path), weights, dtype), load_tokenizer(path)
    if (path / "config.json").exists():
        params = load_hf(path, dtype or jnp.float32, progress)
        return formats.convert_params(params, weights, dtype), load_tokenizer(path)
    raise CheckpointError(
        f"{path} is neither an HF model directory (config.json + safetensors) nor a kivi_jax checkpoint ({FORMAT_FILE})"
    )


def convert(src: str | os.PathLike, out: str | os.PathLike, dtype=None, progress: bool = True,
            weights: str = "auto") -> Path:
    """Converts an HF directory, a GGUF file or a kivi_jax checkpoint into a kivi_jax checkpoint directory holding
    the weights `weights` names (`out` must not exist; checked before anything is read)."""
    dtype = check_dtype(dtype)
    weights = formats.check_weights(weights)
    check_output_dir(out)
    params, tokenizer = load_any(src, dtype, progress, weights)
    return save(params, out, tokenizer, source=str(src))
