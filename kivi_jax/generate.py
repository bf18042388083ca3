"""Text generation from prompts: validation up front, then the runtime's prefill and decode steps (`kivi_jax.runtime`)."""

from __future__ import annotations

import dataclasses
import functools
import secrets
import time
import warnings
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import rotation, runtime, sharding
from kivi_jax.cache import check_impl, full_cache_bytes, make_cache
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.config import ModelConfig
from kivi_jax.models.decoder import Params
from kivi_jax.runtime import PREFILL_CHUNK, Step, cache_size, check_chunk
from kivi_jax.sampling import Sampling, check_int, row_settings

class Model(NamedTuple):
    """What `kivi_jax.load` returns; unpacks as `params, config, tokenizer`."""

    params: Params
    config: ModelConfig
    tokenizer: object | None


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in x)


def encode_prompts(prompt, tokenizer=None, chat: bool = False) -> tuple[list[list[int]], bool]:
    """A prompt (text, token ids, or a list of either) -> (token id lists, whether it was a single prompt)."""
    if isinstance(prompt, np.ndarray) or isinstance(prompt, jax.Array):
        prompt = np.asarray(prompt).tolist()
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts, single = [prompt], True
    elif isinstance(prompt, (list, tuple)) and prompt:
        prompts, single = list(prompt), False
    else:
        raise ValueError("empty prompt: give a non-empty string, a list of token ids, or a list of prompts")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            bad = [j for j, c in enumerate(p) if 0xD800 <= ord(c) <= 0xDFFF]
            if bad:
                raise ValueError(
                    f"prompt{'' if single else f' {i}'} is not valid Unicode: lone surrogate characters at "
                    f"{bad[:3]} (bytes that were not UTF-8?); pass UTF-8 text"
                )
            if tokenizer is None:
                raise ValueError(
                    "a text prompt needs a tokenizer: pass the Model from kivi_jax.load(...) or tokenizer=..."
                )
            if chat:
                if not getattr(tokenizer, "chat_template", None):
                    raise ValueError("chat=True but this tokenizer has no chat template")
                p = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True)
                ids = tokenizer(p, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(p)["input_ids"]
        elif _is_token_list(p):
            if chat:
                raise ValueError("chat=True needs text prompts, not token ids")
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is a {type(p).__name__}; give text or a list of token ids")
        if not ids:
            raise ValueError(f"empty prompt{'' if single else f' (number {i})'}: it has no tokens")
        out.append(ids)
    return out, single


@dataclasses.dataclass
class Generation:
    """The result of `generate`; `text` and `token_ids` are per sequence lists for a batch, plain for one prompt."""

    sequences: list[list[int]]  # new token ids per sequence (including the EOS that stopped it)
    prompt_lengths: list[int]
    texts: list[str] | None
    single: bool
    seconds: float  # wall time of the whole call
    prefill_seconds: float  # prefill (and its compilation on first use)
    overflow: bool = False  # a KIVI scale/min overflowed its storage dtype
    cache_stats: dict | None = None  # generate.cache_stats of the final cache: tokens quantized, bytes vs full
    seed: int | None = None  # the sampling seed used (a fresh random one when seed=None was passed)

    @property
    def text(self):
        return None if self.texts is None else (self.texts[0] if self.single else self.texts)

    @property
    def token_ids(self):
        return self.sequences[0] if self.single else self.sequences

    @property
    def new_tokens(self):
        n = [len(s) for s in self.sequences]
        return n[0] if self.single else n

    @property
    def prompt_tokens(self):
        return self.prompt_lengths[0] if self.single else self.prompt_lengths

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_tokens_per_s": round(self._decode_rate(), 2),
            "overflow": self.overflow,
            "seed": self.seed,
            **self._cache_json(),
        }

    def _cache_json(self) -> dict:
        c = self.cache_stats
        if c is None:
            return {}
        one = (lambda xs: xs[0]) if self.single else (lambda xs: xs)
        return {"cache_tokens": one(c["tokens"]), "keys_quantized": one(c["keys_quantized"]),
                "values_quantized": one(c["values_quantized"]), "residual_length": c["residual_length"],
                "cache_max_tokens": c["max_tokens"], "cache_bytes": c["bytes"], "full_cache_bytes": c["full_bytes"]}

    def _decode_rate(self) -> float:
        steps = max(len(s) for s in self.sequences) - 1
        dt = self.seconds - self.prefill_seconds
        return steps * len(self.sequences) / dt if steps > 0 and dt > 0 else 0.0


def _unpack_model(model, tokenizer):
    if isinstance(model, Model):
        return model.params, tokenizer if tokenizer is not None else model.tokenizer
    if isinstance(model, Params):
        return model, tokenizer
    raise TypeError(f"expected the Model from kivi_jax.load(...) or Params, not {type(model).__name__}")


class Session(NamedTuple):
    """A prepared generation: encoded prompts and the stream of steps over them."""

    prompts: list[list[int]]
    single: bool
    steps: Iterator[Step]
    result: dict  # filled as the stream runs: prefill_seconds, overflow


def start(
    model,
    prompt,
    *,
    tokenizer=None,
    max_new_tokens: int = 64,
    chat: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    cache: "str | KIVIConfig" = "full",
    max_length: int | None = None,
    attention_impl: str = "auto",
    stop_at_eos: bool = True,
    prefill_chunk: int | None = PREFILL_CHUNK,
    mesh=None,
) -> Session:
    """Validates everything up front (so bad input fails before any compute) and returns the lazy step stream."""
    params, tokenizer = _unpack_model(model, tokenizer)
    cfg = params.config
    mesh = sharding.resolve_mesh(mesh)
    check_int("max_new_tokens", max_new_tokens, 1)
    if seed is None:  # documented: a fresh random seed, reported in the result
        seed = secrets.randbelow(2**32)
    seed = check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed={seed} must be below 2**32 (a 32-bit PRNG seed), or None for a fresh random one")
    check_impl(attention_impl)
    sampling = Sampling(temperature, top_k, top_p)
    spec = parse_cache_spec(cache)
    params = rotation.prepare_params(params, spec)
    prompts, single = encode_prompts(prompt, tokenizer, chat)
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    max_tokens = cache_size(longest, max_new_tokens, spec, max_length, cfg)
    spec.check_shapes(cfg.head_dim, max_tokens)
    if prefill_chunk is not None:
        check_chunk(prefill_chunk)
    batch = len(prompts)
    # On a mesh the batch is padded to a multiple of the data axis with one-token dummy rows, dropped from the output.
    rows = batch if mesh is None else -(-batch // sharding.mesh_sizes(mesh)["data"]) * sharding.mesh_sizes(mesh)["data"]
    tokens = np.full((rows, longest), cfg.pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts] + [1] * (rows - batch), np.int32)
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
    result: dict = {"prefill_seconds": 0.0, "overflow": False, "seed": seed}

    def steps() -> Iterator[Step]:
        t0 = time.perf_counter()
        kv = make_cache(spec, cfg, rows, max_tokens, params.dtype, attention_impl, mesh=mesh)
        key = jax.random.PRNGKey(seed) if mesh is None else sharding.put(jax.random.PRNGKey(seed), mesh)
        put = jnp.asarray if mesh is None else functools.partial(sharding.put_batch, mesh=mesh)
        state = runtime.Run(params, kv, key, row_settings([sampling] * rows, put), batch, mesh)
        with sharding.use_mesh(mesh):
            last, state.cache = runtime.prefill(params, tokens, lengths, state.cache, prefill_chunk, mesh)
        first = runtime.start_run(state, last)
        for step in runtime.run(state, first, max_new_tokens, cfg.eos_token_ids if stop_at_eos else ()):
            if step.index == 0:
                result["prefill_seconds"] = time.perf_counter() - t0
            yield step
        kv = state.cache
        overflow = runtime.overflowed_rows(kv)[:batch]
        if overflow.any():
            result["overflow"] = True
            warnings.warn(
                f"{spec.spec} cache: a quantization scale or min overflowed "
                f"{getattr(spec, 'scale_dtype', 'float16')} (|x| beyond its range) in "
                "sequences " + str(np.flatnonzero(overflow).tolist()) + "; their output is unreliable. "
                + runtime.overflow_advice(spec),
                RuntimeWarning,
                stacklevel=3,
            )
        result["cache"] = cache_stats(kv, full_cache_bytes(cfg, rows, max_tokens, jnp.dtype(params.dtype).itemsize),
                                      batch)

    return Session(prompts, single, steps(), result)


def quantized_counts(length, spec) -> tuple[np.ndarray, np.ndarray]:
    """Tokens stored quantized, (keys `[batch]`, values `[batch]`), of a cache holding `length [batch]` tokens
    (`quantized_tokens` of the spec: KIVI by each store's axis, an 8-bit cache all, a full cache none)."""
    length = np.asarray(length, np.int64)
    return tuple(np.asarray(n, np.int64) for n in parse_cache_spec(spec).quantized_tokens(length))


def cache_stats(cache, full_bytes: int, batch: int | None = None) -> dict:
    """What a cache holds and costs: tokens per sequence (the first `batch` rows), tokens quantized (keys, values),
    its bytes, and `full_bytes`, what a full-precision cache of the same shape takes (`full_cache_bytes`)."""
    spec = parse_cache_spec(cache.spec)
    length = sharding.to_host(cache.length)[:batch]
    kq, vq = quantized_counts(length, spec)
    return {
        "cache": spec.spec,
        "max_tokens": int(cache.max_tokens),
        "tokens": length.tolist(),
        "keys_quantized": kq.tolist(),
        "values_quantized": vq.tolist(),
        "bytes": int(cache.nbytes),
        "full_bytes": int(full_bytes),
        "residual_length": getattr(spec, "residual_length", None),
    }


def stream(model, prompt, **kwargs) -> Iterator[Step]:
    """An iterator over the generated tokens, one `Step` (a token per sequence) as each is produced (see `generate`
    for the arguments). Bad arguments raise here, when `stream` is called, not at the first step."""
    return start(model, prompt, **kwargs).steps


def generate(model, prompt, **kwargs) -> Generation:
    """Generates text or tokens from a prompt (or a batch of prompts of different lengths).

    `model`: the Model from `kivi_jax.load` (or Params plus `tokenizer=`). `prompt`: text, token ids, or a list of
    either. Keywords: `max_new_tokens`, `chat` (apply the tokenizer's chat template), `temperature` (0 = greedy),
    `top_k`, `top_p`, `seed` (an integer in [0, 2**32); None draws a fresh random seed, reported as
    `Generation.seed`), `cache` ('full', the default, 'kivi2', 'kivi4', a spec like 'k4v2-g64-r128', or a KIVIConfig),
    `max_length` (cache tokens), `attention_impl` ('auto' | 'xla' | 'pallas' | 'native' | 'native-int8'), `stop_at_eos`,
    `prefill_chunk` (prompt tokens a prefill call takes; longer prompts go in chunks of that shape; None: at once),
    `mesh` (a jax.sharding.Mesh or 'data=2,model=4': params and cache sharded over devices, see kivi_jax.sharding).
    """
    t0 = time.perf_counter()
    _, tokenizer = _unpack_model(model, kwargs.get("tokenizer"))
    session = start(model, prompt, **kwargs)
    seqs: list[list[int]] = [[] for _ in session.prompts]
    for step in session.steps:
        for b, t in enumerate(step.tokens):
            if t >= 0:
                seqs[b].append(int(t))
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
    return Generation(
        sequences=seqs,
        prompt_lengths=[len(p) for p in session.prompts],
        texts=texts,
        single=session.single,
        seconds=time.perf_counter() - t0,
        prefill_seconds=session.result["prefill_seconds"],
        overflow=session.result["overflow"],
        cache_stats=session.result.get("cache"),
        seed=session.result.get("seed"),
    )
