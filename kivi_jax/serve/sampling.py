"""Per-row sampling for a batch of slots: each row has its own temperature, top-k, top-p and random key.

`kivi_jax.generate.sample_tokens` takes one static `Sampling` for the whole batch; a serving batch mixes requests, so
here the settings are arrays `[batch]`. A row with temperature 0 is exactly `argmax`; a sampled row draws what
`sample_tokens` would draw with that row's settings and key (the same masking, the same `jax.random.categorical`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (OpenAI's names; `top_k` 0 = no cut; `seed` None = a random one)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 means no top-k cut)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def sample_rows(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Next tokens `[batch]` int32 from float32 logits `[batch, vocab]`, keys `[batch, 2]` and per-row settings
    `temperature [batch]` (0 = greedy), `top_k [batch]` int (0 = none), `top_p [batch]` (1 = none).

    The random draw runs only when some row samples, and the sort behind top-k/top-p only when some sampled row asks
    for a cut (`lax.cond`s): an all-greedy batch costs an argmax, a plain-temperature one no sort."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_row = temperature > 0
    needs_cut = jnp.any(sampled_row & ((top_k > 0) | (top_p < 1)))

    def draw():
        plain = logits / jnp.where(sampled_row, temperature, 1.0)[:, None]
        x = jax.lax.cond(needs_cut, lambda: _cut(logits, temperature, top_k, top_p), lambda: plain)
        sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row[None])[0])(keys, x).astype(jnp.int32)
        return jnp.where(sampled_row, sampled, greedy)

    return jax.lax.cond(jnp.any(sampled_row), draw, lambda: greedy)


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's key `[batch, 2]` -> (its next key, the subkey to sample with), as `generate` splits its key."""
    pairs = jax.vmap(jax.random.split)(keys)  # [batch, 2, 2]
    return pairs[:, 0], pairs[:, 1]


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
