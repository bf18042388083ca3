"""Text generation: a jit-compiled prefill, then a jit-compiled decode step per token with the cache donated."""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
import warnings
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import rotation, sharding
from kivi_jax.cache import (BAD_TOKEN, PAST_CAPACITY, SCALE_OVERFLOW, CacheCapacityError, check_impl, full_cache_bytes,
                            make_cache)
from kivi_jax.config import KIVIConfig, allocation_multiple, parse_cache_spec
from kivi_jax.models.config import ModelConfig
from kivi_jax.models.decoder import Params, forward

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so similar prompts share one compilation
CACHE_BUCKET = 256  # caches are allocated in multiples of this (and of the residual length)
PREFILL_CHUNK = 512  # prompt tokens a prefill call takes (docs/benchmarks.md: chunked prefill)


class Model(NamedTuple):
    """What `kivi_jax.load` returns; unpacks as `params, config, tokenizer`."""

    params: Params
    config: ModelConfig
    tokenizer: object | None


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when temperature is 0, else top-k / top-p sampling."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        check_number("temperature", self.temperature)
        check_number("top_p", self.top_p)
        check_int("top_k", self.top_k)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 means no top-k cut)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def check_int(name: str, value, minimum: int | None = None) -> int:
    """`value` as an int, or a clear error: an integer (not a bool, not a float such as 2.5) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an integer{'' if minimum is None else f' >= {minimum}'}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")
    return int(value)


def check_number(name: str, value) -> float:
    """`value` as a float, or a clear error: a finite real number (not nan or inf, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number (not nan or inf)")
    return float(value)


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens `[batch]` from float32 logits `[batch, vocab]`."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(order, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        kept = (before < sampling.top_p) | (before == 0)  # the most likely token always (top_p may round to 0)
        cutoff = jnp.min(jnp.where(kept, order, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_chunk(params: Params, tokens: jax.Array, num_new: jax.Array, cache, last: jax.Array, last_at: jax.Array):
    """One chunk `tokens [batch, C]` (`num_new [batch]` real) onto the cache; `last [batch, vocab]` keeps, for each
    sequence, the logits after its last prompt token, which sits at `last_at [batch]` in this chunk (-1: elsewhere)."""
    logits, cache = forward(params, tokens, cache, num_new=num_new, logits_at=jnp.maximum(last_at, 0))
    return jnp.where((last_at >= 0)[:, None], logits[:, 0], last), cache


def chunk_size(tokens: int, chunk: int | None = PREFILL_CHUNK) -> int:
    """The width of the prefill calls for a prompt of `tokens` (the longest of a batch): whole PROMPT_BUCKETs, so
    similar prompts share one compilation, at most `chunk` (None: no limit). Prompts of one width are prefilled
    alike alone or together (the serving engine batches by it)."""
    size = -(-max(tokens, 1) // PROMPT_BUCKET) * PROMPT_BUCKET
    return size if chunk is None else min(size, check_chunk(chunk))


def prefill_steps(params: Params, tokens: np.ndarray, lengths: np.ndarray, cache, chunk: int | None = PREFILL_CHUNK,
                  mesh=None) -> Iterator[tuple[jax.Array, object]]:
    """`prefill`, one chunk a step: yields `(last, cache)` after each chunk (the final pair is `prefill`'s result),
    so a caller can run other work between chunks. The cache of each yield is the one to continue with (the
    previous is donated)."""
    batch, n = tokens.shape
    size = chunk_size(n, chunk)
    n_chunks = -(-n // size)
    tokens = np.pad(tokens, ((0, 0), (0, n_chunks * size - n)), constant_values=params.config.pad_id)
    lengths = np.asarray(lengths, np.int32)
    put = jnp.asarray if mesh is None else functools.partial(sharding.put_batch, mesh=mesh)
    last = put(np.zeros((batch, params.config.vocab_size), np.float32))
    for c in range(n_chunks):
        start = c * size
        num_new = np.clip(lengths - start, 0, size).astype(np.int32)
        last_at = np.where((lengths - 1 >= start) & (lengths - 1 < start + size), lengths - 1 - start, -1)
        last, cache = prefill_chunk(params, put(tokens[:, start : start + size]), put(num_new), cache, last,
                                    put(last_at.astype(np.int32)))
        yield last, cache


def prefill(params: Params, tokens: np.ndarray, lengths: np.ndarray, cache, chunk: int | None = PREFILL_CHUNK,
            mesh=None):
    """Feeds right-padded prompts `tokens [batch, n]` (`lengths [batch]` real, 0 allowed) onto `cache` after what it
    holds, `chunk` tokens at a time (None: at once); every chunk has one shape (`chunk_size`), so one compilation
    serves them all.
    With `mesh` the inputs are placed split over its data axis (the caller runs this under `sharding.use_mesh`).
    Returns the float32 logits after each sequence's last new token `[batch, vocab]` and the cache."""
    for last, cache in prefill_steps(params, tokens, lengths, cache, chunk, mesh):
        pass
    return last, cache


def check_chunk(chunk) -> int:
    """`prefill_chunk` (tokens a prefill call takes) as a positive int; None is handled by the callers."""
    return check_int("prefill_chunk", chunk, 1)


@functools.partial(jax.jit, static_argnames=("sampling",))
def sample_step(logits: jax.Array, key: jax.Array, sampling: Sampling):
    """Next tokens `[batch]` from logits `[batch, vocab]` -> (tokens, key)."""
    key, sub = jax.random.split(key)
    return sharding.replicated(sample_tokens(logits, sub, sampling)), key  # whole on every device


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("cache",))
def decode_step(params: Params, tokens: jax.Array, cache, key: jax.Array, sampling: Sampling, num_new=None):
    """One token a sequence `[batch]` (`num_new [batch]` 0 or 1: a finished sequence is left as it was) ->
    (next token `[batch]`, cache, key)."""
    logits, cache = forward(params, tokens[:, None], cache, num_new=num_new)
    key, sub = jax.random.split(key)
    return sharding.replicated(sample_tokens(logits[:, 0], sub, sampling)), cache, key  # whole on every device


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


def cache_size(prompt_len: int, max_new_tokens: int, spec, max_length: int | None, cfg: ModelConfig) -> int:
    """Tokens the cache is allocated for: `max_length`, else the need rounded up to whole buckets. Either way the
    prompt plus the new tokens must fit the model's `max_position_embeddings`."""
    need = prompt_len + max_new_tokens
    multiple = allocation_multiple(CACHE_BUCKET, spec)
    if max_length is not None:
        check_int("max_length", max_length, 1)
        if need > cfg.max_position_embeddings:
            raise CacheCapacityError(
                f"the prompt has {prompt_len} tokens and max_new_tokens={max_new_tokens}: {need} tokens exceed the "
                f"model's {cfg.max_position_embeddings} positions (max_position_embeddings), whatever max_length="
                f"{max_length} says; shorten the prompt or lower max_new_tokens to at most "
                f"{max(cfg.max_position_embeddings - prompt_len, 0)}"
            )
        if need > max_length:
            raise CacheCapacityError(
                f"the prompt has {prompt_len} tokens and max_new_tokens={max_new_tokens}, so the cache needs "
                f"{need} tokens, but max_length={max_length}; raise max_length to at least {need} or shorten the prompt"
            )
        return max_length
    if need > cfg.max_position_embeddings:
        raise CacheCapacityError(
            f"the prompt has {prompt_len} tokens and max_new_tokens={max_new_tokens}: {need} tokens exceed the "
            f"model's {cfg.max_position_embeddings} positions; shorten the prompt or lower max_new_tokens"
        )
    return -(-need // multiple) * multiple


@dataclasses.dataclass
class Step:
    """One generated token per sequence; `token` is -1 for sequences already finished."""

    index: int
    tokens: np.ndarray  # [batch] int
    done: np.ndarray  # [batch] bool, after this step


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
    eos = np.array(cfg.eos_token_ids if stop_at_eos else [], np.int32)
    result: dict = {"prefill_seconds": 0.0, "overflow": False, "seed": seed}

    def steps() -> Iterator[Step]:
        t0 = time.perf_counter()
        kv = make_cache(spec, cfg, rows, max_tokens, params.dtype, attention_impl, mesh=mesh)
        key = jax.random.PRNGKey(seed) if mesh is None else sharding.put(jax.random.PRNGKey(seed), mesh)
        put = jnp.asarray if mesh is None else functools.partial(sharding.put_batch, mesh=mesh)
        with sharding.use_mesh(mesh):
            last, kv = prefill(params, tokens, lengths, kv, prefill_chunk, mesh)
            nxt, key = sample_step(last, key, sampling)
        done = np.zeros(batch, bool)
        for i in range(max_new_tokens):
            raise_cache_errors(kv)
            host = np.asarray(nxt)[:batch]
            if i == 0:
                result["prefill_seconds"] = time.perf_counter() - t0
            out = np.where(done, -1, host)
            done = done | np.isin(host, eos)
            if i == max_new_tokens - 1:
                done[:] = True
            yield Step(i, out, done.copy())
            if done.all():
                break
            feed = np.full(rows, cfg.pad_id, np.int32)
            feed[:batch] = np.where(done, cfg.pad_id, host)
            live = np.zeros(rows, np.int32)
            live[:batch] = ~done
            with sharding.use_mesh(mesh):
                nxt, kv, key = decode_step(params, put(feed), kv, key, sampling, put(live))
        raise_cache_errors(kv)
        overflow = sharding.to_host(kv.overflow)[:batch] if hasattr(kv, "overflow") else None
        if overflow is not None and bool(np.any(overflow)):
            result["overflow"] = True
            advice = ("Store scales in float32 (KIVIConfig(scale_dtype='float32'), spec suffix -sf32)."
                      if isinstance(spec, KIVIConfig) else "Use the full cache or a KIVI cache with -sf32.")
            warnings.warn(
                f"{spec.spec} cache: a quantization scale or min overflowed "
                f"{getattr(spec, 'scale_dtype', 'float16')} (|x| beyond its range) in "
                "sequences " + str(np.flatnonzero(overflow).tolist()) + "; their output is unreliable. " + advice,
                RuntimeWarning,
                stacklevel=3,
            )
        result["cache"] = cache_stats(kv, full_cache_bytes(cfg, rows, max_tokens, jnp.dtype(params.dtype).itemsize),
                                      batch)

    return Session(prompts, single, steps(), result)


def raise_cache_errors(cache) -> None:
    """Turns a cache's `error_flags` (`[batch]` int32 bitmask set under jit; absent on caches without guards) into a
    clear error: a token id out of range is a ValueError, a write past capacity a CacheCapacityError."""
    flags = getattr(cache, "error_flags", None)
    if flags is None:
        return
    flags = sharding.to_host(flags).reshape(-1)
    if not (flags & ~SCALE_OVERFLOW).any():
        return
    capacity = np.flatnonzero(flags & PAST_CAPACITY).tolist()
    tokens = np.flatnonzero(flags & BAD_TOKEN).tolist()
    unknown = np.flatnonzero(flags & ~(BAD_TOKEN | PAST_CAPACITY | SCALE_OVERFLOW)).tolist()  # overflow: a warning
    if capacity:
        raise CacheCapacityError(
            f"sequences {capacity} were written past the cache's capacity of {getattr(cache, 'max_tokens', '?')} "
            "tokens, so their logits are wrong; allocate a larger cache (max_length) or generate fewer tokens"
        )
    if tokens:
        raise ValueError(
            f"sequences {tokens} fed token ids outside the vocabulary [0, vocab_size) to the model, so their logits "
            "are meaningless; pass ids the model's tokenizer produces"
        )
    raise RuntimeError(f"the cache reports unknown error flags {sorted(set(flags[unknown].tolist()))} in sequences "
                       f"{unknown}")


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
