"""The one decode road (docs/design.md §11): a batch of sequences on one cache.

Everything that runs the model token by token goes through here: `generate` / `stream`, `Chat`, the serving engine,
`bench` and `eval`. The pieces, each in one place:

- the cache's allocation rule (`cache_size`) and the prefill's chunk shape (`chunk_size`, `chunk_plan`);
- ragged chunked prefill of several sequences in one call (`prefill_steps`, `prefill`), and the scored variant that
  gives every prompt position's log-probability (`prefill_scored`);
- one jitted decode step over the live rows (`decode_step`; `rows` computes only a bucket of them) with per-row
  sampling (`kivi_jax.sampling`: a key chain a request, or one for a batch), forced tokens (teacher forcing / prompt
  scoring), token masks and log-probabilities; `decode_logits`, the model call inside it, for timing and scoring;
- the cache's error flags read on the host (`raise_cache_errors`, `overflowed_rows`);
- incremental detokenization (`TextStream`) and stop conditions (`Stop`);
- `run`, the host loop over decode steps that `generate` and `Chat` drive.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import sharding, weights
from kivi_jax.cache import BAD_TOKEN, PAST_CAPACITY, SCALE_OVERFLOW, CacheCapacityError
from kivi_jax.config import allocation_multiple
from kivi_jax.models.config import ModelConfig
from kivi_jax.models.decoder import Params, forward
from kivi_jax.sampling import apply_bitmask, check_int, sample_rows, split_rows, token_logprobs

PROMPT_BUCKET = 32  # prompts are right-padded to a multiple of this, so similar prompts share one compilation
MIN_CHUNK = 64  # and a call to at least this many tokens (unless the chunk is narrower): at 32 a batch's XLA dots
# rounded unlike one prompt's (tests/test_serve_batching.py), and few rows gain little
CACHE_BUCKET = 256  # caches are allocated in multiples of this (and of the residual length)
PREFILL_CHUNK = 512  # prompt tokens a prefill call takes (docs/benchmarks.md: chunked prefill)
PACK_BUCKET = 64  # a packed prefill computes its prompts' tokens rounded up to a multiple of this (few compilations)


# ---------------------------------------------------------------------------------------------------------------------
# Sizes


def rounded_tokens(tokens: int, *specs, bucket: int = CACHE_BUCKET) -> int:
    """`tokens` rounded up to the cache's allocation unit: whole `bucket`s and whole multiples every spec needs (KIVI:
    R). The one allocation rule of every cache the runtime makes."""
    multiple = allocation_multiple(bucket, *specs)
    return -(-max(tokens, 1) // multiple) * multiple


def cache_size(prompt_len: int, max_new_tokens: int, spec, max_length: int | None, cfg: ModelConfig) -> int:
    """Tokens the cache is allocated for: `max_length`, else the need rounded up to whole buckets. Either way the
    prompt plus the new tokens must fit the model's `max_position_embeddings`."""
    need = prompt_len + max_new_tokens
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
    return rounded_tokens(need, spec)


def check_chunk(chunk) -> int:
    """`prefill_chunk` (tokens a prefill call takes) as a positive int; None is handled by the callers."""
    return check_int("prefill_chunk", chunk, 1)


def chunk_size(tokens: int, chunk: int | None = PREFILL_CHUNK) -> int:
    """The width of the prefill calls for a prompt of `tokens` (the longest of a batch): whole PROMPT_BUCKETs, at
    least MIN_CHUNK, so similar prompts share one compilation, at most `chunk` (None: no limit). The last call may be
    narrower (`ChunkPlan`)."""
    size = max(-(-max(tokens, 1) // PROMPT_BUCKET) * PROMPT_BUCKET, MIN_CHUNK)
    return size if chunk is None else min(size, check_chunk(chunk))


class ChunkPlan(NamedTuple):
    """The prefill calls of a prompt: `chunks` calls, each `width` tokens wide but the last, which is `tail` wide
    (the rest of the prompt in whole PROMPT_BUCKETs, at least MIN_CHUNK: a long prompt computes less than that of
    padding).
    Prompts of one plan are prefilled alike alone or together (the serving engine batches by it), and the calls
    past a chunk end are the same whatever came before it (what a shared prefix relies on)."""

    width: int
    chunks: int
    tail: int

    def widths(self) -> list[int]:
        return [self.width] * (self.chunks - 1) + [self.tail]


def chunk_plan(tokens: int, chunk: int | None = PREFILL_CHUNK) -> ChunkPlan:
    """The `ChunkPlan` of a prompt of `tokens` (the longest of a batch) in calls of at most `chunk` tokens."""
    width = chunk_size(tokens, chunk)
    chunks = -(-max(tokens, 1) // width)
    return ChunkPlan(width, chunks, chunk_size(max(tokens, 1) - (chunks - 1) * width, width))


def packed_size(tokens: int) -> int:
    """The token rows a packed prefill of prompts of `tokens` tokens in all computes: whole PACK_BUCKETs."""
    return -(-max(tokens, 1) // PACK_BUCKET) * PACK_BUCKET


def pack_index(lengths, width: int, size: int) -> np.ndarray:
    """`[size]` int32: the flat places in `[rows * width]` of each row's first `lengths[row]` tokens, row after row,
    then `rows * width` (no place: padding) up to `size` (`decoder.decode`'s `packed`)."""
    lengths = np.asarray(lengths, np.int64)
    places = np.concatenate([r * width + np.arange(n) for r, n in enumerate(lengths)] + [np.zeros(0, np.int64)])
    if places.size > size or (lengths > width).any():
        raise ValueError(f"prompts of {lengths.tolist()} tokens do not pack into {size} rows of a {width}-wide batch")
    return np.concatenate([places, np.full(size - places.size, lengths.size * width)]).astype(np.int32)


def _placer(mesh):
    """How host arrays `[batch, ...]` go to the device(s): split over the data axis on a mesh."""
    return jnp.asarray if mesh is None else functools.partial(sharding.put_batch, mesh=mesh)


# ---------------------------------------------------------------------------------------------------------------------
# Prefill


def prefill_logits(params: Params, tokens: jax.Array, cache, lengths=None):
    """The model call of a one-piece prefill: `tokens [batch, n]` (`lengths [batch]` real; None: all n) onto the
    cache -> (float32 logits after each sequence's last token `[batch, vocab]`, cache). Traced inside a caller's jit
    (`eval`'s and `bench`'s compiled programs); `prefill` is the chunked, host-driven form."""
    batch, n = tokens.shape
    last = jnp.full((batch,), n - 1, jnp.int32) if lengths is None else lengths - 1
    logits, cache = forward(params, tokens, cache, num_new=lengths, logits_at=last)
    return logits[:, 0], cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_chunk(params: Params, tokens: jax.Array, num_new: jax.Array, cache, last: jax.Array, last_at: jax.Array,
                  packed: jax.Array | None = None):
    """One chunk `tokens [batch, C]` (`num_new [batch]` real) onto the cache; `last [batch, vocab]` keeps, for each
    sequence, the logits after its last prompt token, which sits at `last_at [batch]` in this chunk (-1: elsewhere).
    Float32 projections are seen as `weights.FloatMatrix` (the native CPU matmul's packed strips). `packed [P]`:
    only the real tokens' rows are computed (`pack_index`)."""
    logits, cache = forward(weights.native_view(params), tokens, cache, num_new=num_new,
                            logits_at=jnp.maximum(last_at, 0), packed=packed)
    return jnp.where((last_at >= 0)[:, None], logits[:, 0], last), cache


def prefill_steps(params: Params, tokens: np.ndarray, lengths: np.ndarray, cache, chunk: int | None = PREFILL_CHUNK,
                  mesh=None, packed: int | None = None) -> Iterator[tuple[jax.Array, object]]:
    """`prefill`, one chunk a step: yields `(last, cache)` after each chunk (the final pair is `prefill`'s result),
    so a caller can run other work between chunks. The cache of each yield is the one to continue with (the
    previous is donated). `packed`: the prompts, one chunk each, are computed side by side in that many token rows
    (at least their tokens: `packed_size`) instead of `batch` rows of the chunk's width."""
    batch, n = tokens.shape
    plan = chunk_plan(n, chunk)
    if packed is not None and (plan.chunks != 1 or mesh is not None):
        raise ValueError(f"a packed prefill takes prompts of one chunk on one device; {n} tokens make {plan.chunks} "
                         f"chunks of {plan.width}{' (and a mesh was given)' if mesh is not None else ''}")
    widths = plan.widths()
    tokens = np.pad(tokens, ((0, 0), (0, sum(widths) - n)), constant_values=params.config.pad_id)
    lengths = np.asarray(lengths, np.int32)
    put = _placer(mesh)
    last = put(np.zeros((batch, params.config.vocab_size), np.float32))
    if mesh is None:  # committed to its device, as every chunk's outputs are: else the first call of a shape
        # compiles a program of its own (jit keys on it), and a prompt's later chunks another
        last, cache = jax.device_put((last, cache), jax.devices()[0])
    index = None if packed is None else jax.device_put(pack_index(lengths, plan.width, packed), jax.devices()[0])
    for c, size in enumerate(widths):
        start = c * plan.width
        num_new = np.clip(lengths - start, 0, size).astype(np.int32)
        last_at = np.where((lengths - 1 >= start) & (lengths - 1 < start + size), lengths - 1 - start, -1)
        last, cache = prefill_chunk(params, put(tokens[:, start : start + size]), put(num_new), cache, last,
                                    put(last_at.astype(np.int32)), index)
        yield last, cache


def prefill(params: Params, tokens: np.ndarray, lengths: np.ndarray, cache, chunk: int | None = PREFILL_CHUNK,
            mesh=None, packed: int | None = None):
    """Feeds right-padded prompts `tokens [batch, n]` (`lengths [batch]` real, 0 allowed) onto `cache` after what it
    holds, `chunk` tokens at a time (None: at once); every chunk but a narrower last has one shape (`chunk_plan`), so
    two compilations serve them all.
    With `mesh` the inputs are placed split over its data axis (the caller runs this under `sharding.use_mesh`).
    `packed`: `prefill_steps`'. Returns the float32 logits after each sequence's last new token `[batch, vocab]` and
    the cache."""
    for last, cache in prefill_steps(params, tokens, lengths, cache, chunk, mesh, packed):
        pass
    return last, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_scored_chunk(params: Params, tokens, num_new, cache, targets, last, last_at):
    """One prompt chunk `tokens [1, C]` (`num_new [1]` real) onto the cache, scoring every position's prediction of
    `targets [1, C]` (the next prompt token): (logprobs `[C]`, top ids and logprobs `[C, K]`, the logits after the
    prompt's last token `[1, vocab]` (kept from `last` unless it is at `last_at` in this chunk), cache)."""
    logits, cache = forward(params, tokens, cache, num_new=num_new)  # [1, C, vocab]
    logprob, top_ids, top_logprobs = token_logprobs(logits[0], targets[0], jnp.ones((1,), bool))
    last = jnp.where(last_at >= 0, logits[:, jnp.maximum(last_at, 0)], last)
    return logprob, top_ids, top_logprobs, last, cache


def prefill_scored(params: Params, tokens: list[int], targets: list[int], cache, chunk: int | None = PREFILL_CHUNK,
                   mesh=None):
    """Prefills one sequence's `tokens` onto `cache`, scoring each position's prediction of `targets` (as long as
    `tokens`) -> (`[(target, logprob, ((id, logprob), ...) top alternatives)]` a position, the logits after the last
    token `[1, vocab]`, the cache). Chunks as `prefill` makes them."""
    n = len(tokens)
    plan = chunk_plan(n, chunk)
    widths = plan.widths()
    pad = params.config.pad_id
    tokens = np.asarray(list(tokens) + [pad] * (sum(widths) - n), np.int32)[None]
    targets = np.asarray(list(targets) + [pad] * (sum(widths) - n), np.int32)[None]
    put = _placer(mesh)
    last = put(np.zeros((1, params.config.vocab_size), np.float32))
    pieces = []
    for c, size in enumerate(widths):
        lo = c * plan.width
        at = n - 1 - lo if lo <= n - 1 < lo + size else -1
        lp, ids, top, last, cache = prefill_scored_chunk(
            params, put(tokens[:, lo : lo + size]), put(np.asarray([min(size, n - lo)], np.int32)), cache,
            put(targets[:, lo : lo + size]), last, jnp.int32(at))
        pieces.append((lp, ids, top))
    scores = []
    for c, (lp, ids, top) in enumerate(pieces):
        lp, ids, top = np.asarray(lp), np.asarray(ids), np.asarray(top)
        for j in range(min(plan.width, n - c * plan.width)):
            scores.append((int(targets[0, c * plan.width + j]), float(lp[j]),
                           tuple(zip(ids[j].tolist(), top[j].tolist()))))
    return scores, last, cache


# ---------------------------------------------------------------------------------------------------------------------
# The decode step


class Chosen(NamedTuple):
    """What a decode step chose for each row: tokens `[rows]`, their log-probabilities `[rows]` and each row's top
    alternatives (`[rows, K]` ids and log-probabilities; the three are None unless logprobs were asked for), and the
    keys to continue with."""

    tokens: jax.Array
    logprob: jax.Array | None
    top_ids: jax.Array | None
    top_logprobs: jax.Array | None
    keys: jax.Array


def choose(logits, keys, temperature, top_k, top_p, forced=None, forced_next=None, constrained=None, bitmask=None,
           wanted=None) -> Chosen:
    """The next token of every row from float32 logits `[rows, vocab]`: a forced row's `forced_next` (a prompt token
    being scored or taught), else a draw from the logits under the row's bitmask (when `constrained`). A forced row's
    key does not advance. `wanted [rows]`: rows whose log-probabilities are reported (None: none are computed)."""
    next_keys, sub = split_rows(keys)
    masked = logits if bitmask is None else apply_bitmask(logits, bitmask, constrained)
    chosen = sample_rows(masked, sub, temperature, top_k, top_p)
    if forced is not None:
        chosen = jnp.where(forced, forced_next, chosen)
        next_keys = jnp.where(forced[:, None], keys, next_keys)
    chosen = sharding.replicated(chosen)  # whole on every device: the host reads it
    if wanted is None:
        return Chosen(chosen, None, None, None, next_keys)
    return Chosen(chosen, *token_logprobs(logits, chosen, wanted), next_keys)


@jax.jit
def sample_first(logits, keys, temperature, top_k, top_p, constrained=None, bitmask=None, wanted=None) -> Chosen:
    """The first token of each of `[rows]` sequences from prefill logits (`[rows, vocab]`, or `[1, vocab]` shared by
    every row: one prompt's choices) and their keys (`[rows, 2]`, or one `[2]` for the batch)."""
    rows = temperature.shape[0]
    return choose(jnp.broadcast_to(logits, (rows, logits.shape[-1])), keys, temperature, top_k, top_p,
                  constrained=constrained, bitmask=bitmask, wanted=wanted)


def decode_logits(params: Params, tokens, cache, live=None, rows=None):
    """The model call of a decode step: one token a row `tokens [batch]` (`live [batch]` bool: other rows advance by
    0 tokens; None: all) -> (float32 logits `[batch or rows, vocab]`, cache). With `rows [B]` only those rows are
    computed (`forward`'s `rows`). Float32 weights are seen as `weights.FloatMatrix` (the native CPU matmul)."""
    num_new = None if live is None else live.astype(jnp.int32)
    logits, cache = forward(weights.native_view(params), tokens[:, None], cache, num_new=num_new, rows=rows)
    return logits[:, 0], cache


@functools.partial(jax.jit, donate_argnames=("cache", "keys"))
def decode_step(params: Params, tokens, live, cache, keys, temperature, top_k, top_p, forced=None, forced_next=None,
                constrained=None, bitmask=None, wanted=None, rows=None) -> tuple[Chosen, object]:
    """One token for every row: `tokens [batch]`, `live [batch]` bool (other rows advance by 0 tokens; None: all),
    keys `[batch, 2]` (a chain a row) or `[2]` (one for the batch) -> (`Chosen`, cache); see `choose`.
    With `rows [B]` (a bucket: row indices, those past the batch padding) every per-row input and output is for those
    rows only and only they are computed; the other rows are left as they were."""
    logits, cache = decode_logits(params, tokens, cache, live, rows)
    per_row = keys.ndim == 2 and rows is not None
    row_keys = keys.at[rows].get(mode="fill", fill_value=0) if per_row else keys  # [rows, 2]
    out = choose(logits, row_keys, temperature, top_k, top_p, forced, forced_next, constrained, bitmask, wanted)
    if per_row:
        out = out._replace(keys=keys.at[rows].set(out.keys, mode="drop"))
    return out, cache


# ---------------------------------------------------------------------------------------------------------------------
# Error flags


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


def overflowed_rows(cache) -> np.ndarray:
    """`[batch]` bool: rows whose sticky SCALE_OVERFLOW flag is set (a quantization scale or min overflowed its
    storage dtype: the row's output is unreliable); all False for a cache without flags."""
    flags = getattr(cache, "error_flags", None)
    if flags is None:
        return np.zeros(np.shape(sharding.to_host(cache.length)), bool)
    return (sharding.to_host(flags).reshape(-1) & SCALE_OVERFLOW).astype(bool)


def overflow_advice(spec) -> str:
    """What to do about an overflowed scale, for a cache of `spec`."""
    if getattr(spec, "scale_dtype", None) is None:
        return "Use the full cache or a KIVI cache with -sf32."
    return "Store scales in float32 (KIVIConfig(scale_dtype='float32'), spec suffix -sf32)."


# ---------------------------------------------------------------------------------------------------------------------
# Text and stops


def held_back(text: str, stops: tuple[str, ...] = ()) -> int:
    """Characters at the end of `text` that may still change: a partial multi-byte character or the start of a stop
    string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


class TextStream:
    """Incremental detokenization of one sequence: `add(token)` then `piece()` gives the text that became final since
    the last piece (a partial multi-byte character or the start of a stop string is held back). The text is always
    the tokenizer's decoding of all ids so far, so pieces join to exactly `decode(ids)`. `lock`: a lock to hold
    while decoding (a tokenizer shared by threads)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), lock: threading.Lock | None = None):
        self.tokenizer, self.stops, self.lock = tokenizer, tuple(stops), lock
        self.ids: list[int] = []
        self.sent = 0  # characters handed out

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        if self.lock is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def text(self) -> str:
        return self.decode(self.ids)

    def add(self, token: int) -> None:
        self.ids.append(int(token))

    def piece(self, final: bool = False, text: str | None = None) -> str:
        """The text not handed out yet that can no longer change (all of it when `final`); `text` overrides the
        decoding (a caller that cut it at a stop string)."""
        text = self.text if text is None else text
        end = len(text) if final else len(text) - held_back(text, self.stops)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out


@dataclasses.dataclass(frozen=True)
class Stop:
    """When a sequence ends: at one of `token_ids` (EOS and the request's stop ids; the token is not part of the
    text), at `max_tokens` generated, or where its text first contains one of `strings` (cut there)."""

    token_ids: frozenset = frozenset()
    max_tokens: int | None = None
    strings: tuple[str, ...] = ()

    def after(self, token: int, generated: int) -> str | None:
        """"stop" when `token` stops the sequence, "length" when `generated` tokens (this one included) are the most
        it may have, else None."""
        if token in self.token_ids:
            return "stop"
        if self.max_tokens is not None and generated >= self.max_tokens:
            return "length"
        return None

    def cut(self, text: str) -> str | None:
        """`text` up to its first stop string, or None when it holds none."""
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(hits)] if hits else None


# ---------------------------------------------------------------------------------------------------------------------
# The host loop


@dataclasses.dataclass
class Step:
    """One generated token per sequence; `token` is -1 for sequences already finished."""

    index: int
    tokens: np.ndarray  # [batch] int
    done: np.ndarray  # [batch] bool, after this step


@dataclasses.dataclass
class Run:
    """A batch of sequences on one cache, between calls of `run`: the cache and the key(s) to continue with (the
    previous ones are donated), and the settings of the rows (`rows` >= the `batch` real sequences: padding rows
    on a mesh)."""

    params: Params
    cache: object
    keys: jax.Array  # [2] (one chain for the batch) or [rows, 2]
    settings: tuple  # (temperature, top_k, top_p), each [rows]
    batch: int
    mesh: object = None

    @property
    def rows(self) -> int:
        return int(self.settings[0].shape[0])


def start_run(run: Run, last) -> np.ndarray:
    """The first token of every row from the prefill's logits `last [rows, vocab]` (advances the keys)."""
    with sharding.use_mesh(run.mesh):
        out = sample_first(last, run.keys, *run.settings)
    run.keys = out.keys
    return out.tokens


def run(state: Run, first, max_new_tokens: int, stop_ids=(), feed_last: bool = False,
        feed_first: bool = False) -> Iterator[Step]:
    """Decodes from the first tokens `first [rows]` (from `start_run`): yields a `Step` per token, up to
    `max_new_tokens`, a sequence ending at one of `stop_ids` (not fed to the cache). Every other token is fed back
    for the next step; the last one too when `feed_last` (so the cache holds the whole output). `feed_first`: each
    token is fed before its step is yielded (a consumer that stops early leaves the cache holding every token it
    saw), else after. `state` carries the cache and keys across steps; the cache's error flags are checked before
    each token is handed out."""
    rows, batch, cfg = state.rows, state.batch, state.params.config
    put = _placer(state.mesh)
    stop_ids = np.asarray(list(stop_ids), np.int32)
    nxt = first
    done = np.zeros(batch, bool)
    for i in range(max_new_tokens):
        raise_cache_errors(state.cache)
        host = np.asarray(nxt)[:batch]
        out = np.where(done, -1, host)
        stopped = np.isin(host, stop_ids)
        done = done | stopped
        last = i == max_new_tokens - 1
        if last:
            done[:] = True
        step = Step(i, out, done.copy())
        fed = (out >= 0) & ~stopped if last and feed_last else ~done
        if not feed_first:
            yield step
        if fed.any():
            feed = np.full(rows, cfg.pad_id, np.int32)
            feed[:batch] = np.where(fed, host, cfg.pad_id)
            live = np.zeros(rows, bool)
            live[:batch] = fed
            with sharding.use_mesh(state.mesh):
                chosen, state.cache = decode_step(state.params, put(feed), put(live), state.cache, state.keys,
                                                  *state.settings)
            state.keys, nxt = chosen.keys, chosen.tokens
        if feed_first:
            yield step
        if last or not fed.any():
            break
    raise_cache_errors(state.cache)
