"""kivi_jax: Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 inference in JAX with a KIVI-quantized KV cache (2/4-bit keys and values)."""

from __future__ import annotations

import os
from pathlib import Path

# The repository keeps `models/` and `pallas_kernels/` beside `kivi_jax/`; the wheel installs them as the subpackages
# `kivi_jax.models` and `kivi_jax.pallas_kernels` (pyproject's package-dir table), so no generic top-level name is
# claimed. Run from a checkout, the subpackages are found beside this folder.
_here = Path(__file__).resolve().parent
if not (_here / "models").is_dir() and (_here.parent / "models" / "llama.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821 (the package's own search path)

# transformers serves only tokenization here; without torch (the normal install) it would advise installing torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from kivi_jax.cache import CacheCapacityError, FullCache, KIVICache, make_cache
from kivi_jax.cache_io import restore_cache, save_cache
from kivi_jax.chat import Chat, ConversationFullError
from kivi_jax.checkpoint import CheckpointError, convert, restore, save
from kivi_jax.cache8 import Dense8Cache
from kivi_jax.config import Dense8Config, KIVIConfig, parse_cache_spec
from kivi_jax.generate import Generation, Model, generate, stream
from kivi_jax.sampling import Sampling
from kivi_jax.hub import MODELS, ModelNotAvailableError
from kivi_jax.models.config import LlamaConfig, ModelConfig, UnsupportedModelError
from kivi_jax.models.decoder import Params, forward

__version__ = "0.1.0"


def load(name_or_path: str = "smollm2", dtype=None, progress: bool = True, mesh=None, weights: str = "auto") -> Model:
    """Loads a model: a known name (`smollm2`, fetched and converted once, then cached), an HF directory, a `.gguf`
    file or a kivi_jax checkpoint directory. Returns `Model(params, config, tokenizer)`; `dtype` is the compute
    dtype (float32 on CPU, bfloat16 on GPU; float32, bfloat16 or float16, a name or a jnp dtype; float64 only with
    JAX's x64 mode on); `weights` the format the weights are held in (kivi_jax.weights: 'auto' keeps a GGUF's own
    quantized blocks, as `smollm2` is; 'float32', 'bfloat16', 'int8', 'int4-g64', ...); `mesh` (a
    jax.sharding.Mesh or 'data=2,model=4') places them sharded over its devices (kivi_jax.sharding)."""
    if mesh is not None:
        from kivi_jax import sharding

        model = load(name_or_path, dtype, progress, weights=weights)
        return model._replace(params=sharding.shard_params(model.params, mesh))
    from kivi_jax import checkpoint, hub
    from kivi_jax import weights as formats

    dtype = checkpoint.check_dtype(dtype)
    weights = formats.check_weights(weights)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load() takes a model name or a path, not {type(name_or_path).__name__}")
    name_or_path = os.fspath(name_or_path)

    if name_or_path in hub.MODELS:
        path = hub.ensure_checkpoint(name_or_path, progress=progress)
        try:
            params = checkpoint.restore(path)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. The cached model is damaged: delete {hub.model_dir(name_or_path)} and "
                                  "run again to rebuild it") from e
        params = formats.convert_params(params, weights, dtype)
        return Model(params, params.config, checkpoint.load_tokenizer(path))
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"unknown model {name_or_path!r}: not a known name ({', '.join(hub.MODELS)}) and no such file or "
            "directory; give a known name, an HF model directory, a .gguf file or a kivi_jax checkpoint"
        )
    params, tokenizer = checkpoint.load_any(path, dtype, progress, weights)
    return Model(params, params.config, tokenizer)


__all__ = [
    "CacheCapacityError",
    "Chat",
    "CheckpointError",
    "ConversationFullError",
    "Dense8Cache",
    "Dense8Config",
    "FullCache",
    "Generation",
    "KIVICache",
    "KIVIConfig",
    "LlamaConfig",
    "ModelConfig",
    "MODELS",
    "Model",
    "ModelNotAvailableError",
    "Params",
    "Sampling",
    "UnsupportedModelError",
    "__version__",
    "convert",
    "forward",
    "generate",
    "load",
    "make_cache",
    "parse_cache_spec",
    "restore",
    "restore_cache",
    "save",
    "save_cache",
    "stream",
]
