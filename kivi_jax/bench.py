"""Benchmark building blocks: synthetic caches at a given fill, and warmed-up, jit-compiled decode-step timing."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.cache import FullCache, KIVICache, make_cache
from models.llama import Params, forward


def random_cache(spec, cfg, batch: int, max_tokens: int, length: int, dtype=jnp.float32, impl: str = "auto",
                 seed: int = 0):
    """A cache of `max_tokens` holding `length` tokens of random content (decode cost does not depend on values)."""
    cache = make_cache(spec, cfg, batch, max_tokens, dtype, impl)
    key = jax.random.PRNGKey(seed)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    keys = jax.random.split(key, len(leaves))
    filled = []
    for k, leaf in zip(keys, leaves):
        if leaf.dtype == jnp.uint8:
            filled.append(jax.random.randint(k, leaf.shape, 0, 256, jnp.int32).astype(jnp.uint8))
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            filled.append((0.1 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
        else:
            filled.append(leaf)
    cache = jax.tree_util.tree_unflatten(treedef, filled)
    return cache.replace(length=jnp.full((batch,), length, jnp.int32))


def decode_step_fn():
    """The jit-compiled decode step with the cache donated (what generation runs per token)."""
    return jax.jit(lambda params, tokens, cache: forward(params, tokens, cache), donate_argnums=(2,))


def time_decode(params: Params, cache, repeats: int = 10, warmup: int = 2) -> dict:
    """Median / min / spread of the decode step's wall time (ms), the cache advancing one token per call.

    The first call's time (compilation included) is reported as `compile_s`.
    """
    step = decode_step_fn()
    batch = cache.length.shape[0]
    tokens = jnp.ones((batch, 1), jnp.int32)
    t0 = time.perf_counter()
    logits, cache = step(params, tokens, cache)
    logits.block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        logits, cache = step(params, tokens, cache)
    logits.block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits, cache = step(params, tokens, cache)
        logits.block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms_max": max(times),
        "compile_s": compile_s,
        "tokens_per_s": batch / (statistics.median(times) / 1e3),
    }
