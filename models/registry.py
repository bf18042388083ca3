"""The architecture seam (docs/design.md §4): every decoder family this package runs, keyed by HF `model_type` and GGUF
`general.architecture`.

An `Architecture` bundles what the rest of the library needs of a model and may not know itself: how to read its
config (HF `config.json`, GGUF metadata), the table of its parameters (`Param`: shape, logical sharding axes,
checkpoint names, initialization and its role under value rotation, declared beside each other), the stacked
layer-params class and `forward`. Checkpoints, sharding, value rotation, quantized weights and benchmarks ask this
table; none of them names a model's leaves.

Each architecture module (`llama.py`, `qwen.py`, `gemma2.py`) registers itself when the package is imported
(`models/__init__.py`); this module imports nothing of ours, so every other module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this library does not implement."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter leaf: its shape (stacked layer leaves lead with `[layers]`), its logical axes (one a dim, mapped
    to a mesh by kivi_jax.sharding), what it is, and its names in checkpoints.

    `kind`: `matrix` a projection `[in, out]` (checkpoints hold `[out, in]`; may be quantized), `table` an embedding
    table `[rows, cols]` as checkpoints hold it (may be quantized), `vector` a norm or bias (always float). `hf` and
    `gguf` are tensor names, `{i}` standing for the layer. `from_gguf(w, cfg)` fixes a GGUF tensor `[out, in]` as
    llama.cpp's converter changed it (for a quantized matrix only a permutation of its rows is allowed: it is applied
    to the rows of codes and scales). `rotate` is the role under value rotation (kivi_jax/rotation.py): `values` its
    last axis is kv heads x head_dim and produces the values (each head's block times H), `attention_out` its rows
    are query heads x head_dim and read attention's output (H^T times each head's block)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kind: str = "matrix"
    hf: str | None = None
    gguf: str | None = None
    init: str = "normal"  # normal | ones | zeros: random params for tests and synthetic benchmarks
    from_gguf: Callable | None = None
    rotate: str | None = None

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"a parameter of shape {self.shape} needs one logical axis a dim, not {self.axes}")
        if self.kind not in ("matrix", "table", "vector"):
            raise ValueError(f"parameter kind {self.kind!r} is not matrix, table or vector")

    @property
    def stacked(self) -> bool:
        """A per-layer leaf, stacked on a leading `[layers]` axis."""
        return bool(self.axes) and self.axes[0] == "layers"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A decoder family: what reads it, what it holds, what runs it.

    `params(cfg)` is the table `{path: Param}` of every leaf present for that config (`"embed"`, `"layers.wq"`, ...;
    an untied head only when untied), in the order checkpoints and random init visit them. `layers` is the
    flax dataclass of the stacked layer leaves (its fields named like the table's `layers.*` paths; a field the
    table leaves out for a config is None). `config_from_hf(hf)` reads a `config.json` dict and
    `config_from_gguf(get)` GGUF metadata (`get(key, default)` without the `<arch>.` prefix, `get.file(key)` for a
    whole key), raising UnsupportedModelError for what the model does not implement."""

    name: str
    model_types: tuple[str, ...]  # HF `model_type` values it reads
    hf_classes: tuple[str, ...]  # HF `architectures` entries it reads
    gguf_name: str | None  # GGUF `general.architecture`; None: GGUF files are not read
    layers: type
    params: Callable[[Any], dict[str, Param]]
    config_from_hf: Callable[[dict], Any]
    config_from_gguf: Callable[[Callable], Any] | None
    forward: Callable


_BY_MODEL_TYPE: dict[str, Architecture] = {}
_BY_GGUF: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Adds an architecture under each of its HF model types and its GGUF name (each claimed once)."""
    for model_type in arch.model_types:
        if model_type in _BY_MODEL_TYPE:
            raise ValueError(f"model_type {model_type!r} is registered twice")
        _BY_MODEL_TYPE[model_type] = arch
    if arch.gguf_name is not None:
        if arch.gguf_name in _BY_GGUF:
            raise ValueError(f"GGUF architecture {arch.gguf_name!r} is registered twice")
        _BY_GGUF[arch.gguf_name] = arch
    return arch


def model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def architectures() -> tuple[Architecture, ...]:
    """Every registered architecture, once each."""
    return tuple(dict.fromkeys(_BY_MODEL_TYPE.values()))


def supported() -> str:
    """The architectures in words, for error messages: `llama, mistral (LlamaForCausalLM, MistralForCausalLM); ...`."""
    return "; ".join(f"{', '.join(a.model_types)} ({', '.join(a.hf_classes)})" for a in architectures())


def for_model_type(model_type: str) -> Architecture:
    """The architecture of an HF `model_type` (also `ModelConfig.model_type`)."""
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        raise UnsupportedModelError(f"unsupported architecture: model_type={model_type!r}; kivi_jax runs "
                                    f"{supported()}")
    return arch


def for_config(cfg) -> Architecture:
    return for_model_type(cfg.model_type)


def for_hf(hf: dict) -> Architecture:
    """The architecture an HF `config.json` dict names, checking its `architectures` list."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None or any(a not in arch.hf_classes for a in archs):
        raise UnsupportedModelError(f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                                    f"kivi_jax runs model_type {supported()}")
    return arch


def for_gguf(name: str | None, source: str) -> Architecture:
    arch = _BY_GGUF.get(name)
    if arch is None:
        raise UnsupportedModelError(f"{source}: GGUF architecture {name!r} is not supported; kivi_jax reads "
                                    f"{', '.join(repr(n) for n in _BY_GGUF)}")
    return arch


def param_table(cfg) -> dict[str, Param]:
    """Every parameter leaf of a config's model, by path (`Architecture.params`)."""
    return for_config(cfg).params(cfg)
