"""Sampling: the one `Sampling` type and the per-row draw every decode road uses (`kivi_jax.runtime`).

A batch mixes requests, so a draw takes each row's settings as arrays `[rows]`. A row with temperature 0 is exactly
`argmax`. The random key is either one chain per row (`keys [rows, 2]`: a request's draws are its own, whatever runs
beside it) or one chain for the whole batch (`keys [2]`: `generate`'s batch, one categorical draw over all rows).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a sequence's next token is chosen: greedy when temperature is 0, else a draw after the top-k / top-p cut
    (`top_k` 0: no cut; `top_p` 1: no cut). `seed` starts the sequence's own key chain (None: the caller's, or a
    random one)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        check_number("temperature", self.temperature)
        check_number("top_p", self.top_p)
        check_int("top_k", self.top_k)
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 means no top-k cut)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def row_settings(samplings, put=jnp.asarray):
    """Per-row `(temperature [rows], top_k [rows], top_p [rows])` of a list of Samplings, placed by `put` (on a mesh:
    split over the data axis)."""
    temperature = put(np.array([s.temperature for s in samplings], np.float32))
    top_k = put(np.array([s.top_k for s in samplings], np.int32))
    top_p = put(np.array([s.top_p for s in samplings], np.float32))
    return temperature, top_k, top_p


def _cut(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tempered logits `[batch, vocab]` with each row's top-k and top-p cut applied (cut tokens at -inf)."""
    vocab = logits.shape[-1]
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.sort(x, axis=-1)[:, ::-1]  # [batch, vocab] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)  # [batch, 1]: the k-th largest
    x = jnp.where(x < kth, -jnp.inf, x)
    order = jnp.where(order < kth, -jnp.inf, order)  # = the masked logits, sorted
    probs = jax.nn.softmax(order, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    kept = (before < top_p[:, None]) | (before == 0)  # the most likely token always (top_p may round to 0)
    cutoff = jnp.min(jnp.where(kept, order, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(top_p[:, None] < 1, cutoff, -jnp.inf)
    return jnp.where(x < cutoff, -jnp.inf, x)


def first_max(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32, the same index for every input (the first maximum; the first NaN where
    a row holds one): on the CPU backend the native kernel's one pass (`kivi_jax.native.argmax`; 4-5 ms of XLA's
    reduces in a 32-row decode step), else, and in a program lowered for a GPU or TPU, `first_max_xla`, its twin."""
    from kivi_jax.native import argmax

    if argmax.usable(logits):
        return jax.lax.platform_dependent(logits, cpu=argmax.first_max, default=first_max_xla)
    return first_max_xla(logits)


def first_max_xla(logits: jax.Array) -> jax.Array:
    """`first_max` in XLA: a max, then one min over each index, shifted below zero at a NaN (XLA:CPU's max may skip a
    NaN) so that a NaN comes first. XLA:CPU's argmax is one reduce over (value, index) pairs, twice the time of these
    two plain reduces (2.3-2.5 against 1.4 ms for 32 rows of 49,152 logits)."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first = jnp.min(jnp.where(jnp.isnan(logits), index - vocab, jnp.where(logits == top, index, vocab)), axis=-1)
    return jnp.where(first < 0, first + vocab, first)


def sample_rows(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Next tokens `[batch]` int32 from float32 logits `[batch, vocab]`, keys (`[batch, 2]`: a chain a row; `[2]`: one
    for the batch, a single categorical draw over every row) and per-row settings
    `temperature [batch]` (0 = greedy), `top_k [batch]` int (0 = none), `top_p [batch]` (1 = none).

    The random draw runs only when some row samples, and the sort behind top-k/top-p only when some sampled row asks
    for a cut (`lax.cond`s): an all-greedy batch costs an argmax, a plain-temperature one no sort."""
    greedy = first_max(logits)
    sampled_row = temperature > 0
    needs_cut = jnp.any(sampled_row & ((top_k > 0) | (top_p < 1)))

    def draw():
        plain = logits / jnp.where(sampled_row, temperature, 1.0)[:, None]
        x = jax.lax.cond(needs_cut, lambda: _cut(logits, temperature, top_k, top_p), lambda: plain)
        if keys.ndim == 1:
            sampled = jax.random.categorical(keys, x).astype(jnp.int32)
        else:
            sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row[None])[0])(keys, x).astype(jnp.int32)
        return jnp.where(sampled_row, sampled, greedy)

    return jax.lax.cond(jnp.any(sampled_row), draw, lambda: greedy)


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's key `[batch, 2]` (or the batch's one key `[2]`) -> (its next key, the subkey to sample with)."""
    if keys.ndim == 1:
        pairs = jax.random.split(keys)  # [2, 2]
        return pairs[0], pairs[1]
    pairs = jax.vmap(jax.random.split)(keys)  # [batch, 2, 2]
    return pairs[:, 0], pairs[:, 1]


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens `[batch]` from float32 logits `[batch, vocab]`, every row under one `sampling` and one key `[2]`."""
    rows = logits.shape[0]
    settings = (jnp.full((rows,), sampling.temperature, jnp.float32), jnp.full((rows,), sampling.top_k, jnp.int32),
                jnp.full((rows,), sampling.top_p, jnp.float32))
    return sample_rows(logits, key, *settings)


# ---------------------------------------------------------------------------------------------------------------------
# Token masks (structured output) and log-probabilities

MAX_LOGPROBS = 20  # the most top alternatives a request may ask for (vLLM's default bound; OpenAI's chat allows 20)


def bitmask_width(vocab: int) -> int:
    """int32 words a row of a token bitmask takes: bit `t % 32` of word `t // 32` allows token t."""
    return -(-vocab // 32)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array, constrained: jax.Array) -> jax.Array:
    """Logits `[batch, vocab]` with the tokens a constrained row's bitmask `[batch, words]` int32 forbids at -inf;
    rows with `constrained [batch]` False are left as they are (and nothing runs when no row is constrained)."""
    vocab = logits.shape[-1]

    def masked():
        ids = jnp.arange(vocab, dtype=jnp.int32)
        words = jnp.take(bitmask, ids // 32, axis=1)  # [batch, vocab]
        allowed = (jax.lax.shift_right_logical(words, jnp.broadcast_to(ids % 32, words.shape)) & 1).astype(bool)
        return jnp.where(allowed | ~constrained[:, None], logits, -jnp.inf)

    return jax.lax.cond(jnp.any(constrained), masked, lambda: logits)


def token_logprobs(logits: jax.Array, chosen: jax.Array, wanted: jax.Array):
    """The model's log-probabilities (log-softmax of the raw logits `[batch, vocab]`: before temperature, cuts and
    masks) of `chosen [batch]` and the MAX_LOGPROBS most likely tokens of each row, most likely first: `(logprob
    [batch], top ids [batch, K] int32, top logprobs [batch, K])`. Zeros unless some row is `wanted [batch]`."""
    batch = logits.shape[0]
    k = min(MAX_LOGPROBS, logits.shape[-1])

    def compute():
        logp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(logp, k)
        return jnp.take_along_axis(logp, chosen[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def skip():
        return jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, k), jnp.int32), jnp.zeros((batch, k), jnp.float32)

    return jax.lax.cond(jnp.any(wanted), compute, skip)
