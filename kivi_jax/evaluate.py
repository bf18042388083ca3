"""Quality through the cache: teacher-forced next-token loss, KL and top-1 agreement against full precision.

Protocol (DESIGN §6): windows of P + N + 1 tokens; prefill P tokens, then feed N tokens one at a time through the
cache, scoring each decode step's prediction of the next token (N scored tokens a window). All windows run as one
batch; `full` runs first and its log-probabilities are the reference for KL and top-1 agreement.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.cache import make_cache
from kivi_jax.config import parse_cache_spec, spec_name
from models.llama import Params, forward


def default_text() -> str:
    """The prose of Python's own language reference (`pydoc_data.topics`), on every machine without downloads."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def window_starts(n_tokens: int, prefill: int, decode: int, windows: int) -> list[int]:
    """Starts of `windows` evenly spaced windows of `prefill + decode + 1` tokens: i * (n - P - N - 1) / (W - 1)."""
    span = n_tokens - prefill - decode - 1
    if span < 0:
        raise ValueError(
            f"the text has {n_tokens} tokens; a window needs prefill + decode + 1 = {prefill + decode + 1}"
        )
    if windows == 1:
        return [0]
    return [i * span // (windows - 1) for i in range(windows)]


def make_windows(tokens, prefill: int, decode: int, windows: int) -> np.ndarray:
    """`[windows, prefill + decode + 1]` token windows from a token list."""
    tokens = np.asarray(tokens, np.int32)
    size = prefill + decode + 1
    return np.stack([tokens[s : s + size] for s in window_starts(len(tokens), prefill, decode, windows)])


def cache_tokens(prefill: int, decode: int, spec) -> int:
    """Cache size for a run: prefill + decode rounded up to the residual length (KIVI) or 128 (full)."""
    multiple = 128 if spec == "full" else spec.residual_length
    return -(-(prefill + decode) // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("prefill", "spec", "impl"))
def _teacher_forced(params: Params, windows: jax.Array, ref_logprobs, prefill: int, spec, impl: str = "auto"):
    """Per scored token `[windows, decode]`: NLL, KL(ref || ours), top-1 agreement with ref; and our log-probs."""
    n_win, size = windows.shape
    decode = size - prefill - 1
    cache = make_cache(spec, params.config, n_win, cache_tokens(prefill, decode, spec), params.dtype, impl)
    _, cache = forward(params, windows[:, :prefill], cache, logits_at=jnp.full((n_win,), prefill - 1))

    def step(cache, xs):
        tok, target, ref = xs  # [windows], [windows], [windows, vocab] or None
        logits, cache = forward(params, tok[:, None], cache)
        logp = jax.nn.log_softmax(logits[:, 0], axis=-1)  # [windows, vocab]
        nll = -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        if ref is None:
            return cache, (nll, jnp.zeros_like(nll), jnp.ones_like(nll), logp)
        kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
        top1 = (jnp.argmax(logp, -1) == jnp.argmax(ref, -1)).astype(jnp.float32)
        return cache, (nll, kl, top1, None)

    inputs = windows[:, prefill : prefill + decode].T  # [decode, windows]
    targets = windows[:, prefill + 1 :].T
    ref = None if ref_logprobs is None else jnp.swapaxes(ref_logprobs, 0, 1)
    _, (nll, kl, top1, logp) = jax.lax.scan(step, cache, (inputs, targets, ref))
    logp = None if logp is None else jnp.swapaxes(logp, 0, 1)
    return nll.T, kl.T, top1.T, logp


def teacher_forced(params: Params, windows, prefill: int, spec, ref_logprobs=None, impl: str = "auto") -> dict:
    """Runs one cache spec over the windows; returns per-token arrays and timing."""
    spec = parse_cache_spec(spec)
    t0 = time.perf_counter()
    nll, kl, top1, logp = _teacher_forced(params, jnp.asarray(windows), ref_logprobs, prefill, spec, impl)
    nll = np.asarray(nll)
    seconds = time.perf_counter() - t0
    return {"nll": nll, "kl": np.asarray(kl), "top1": np.asarray(top1), "logprobs": logp, "seconds": seconds}


def evaluate(params: Params, windows, prefill: int, specs, impl: str = "auto", progress=None) -> dict:
    """Mean NLL, perplexity, KL vs full, top-1 agreement and throughput for each spec (`full` always included)."""
    names = [spec_name(parse_cache_spec(s)) for s in specs]
    if "full" not in names:
        names = ["full"] + names
    results, ref = {}, None
    for name in names:
        out = teacher_forced(params, windows, prefill, name, ref, impl)
        if name == "full":
            ref = out["logprobs"]
        tokens = out["nll"].size
        results[name] = {
            "nll": float(out["nll"].mean()),
            "ppl": float(np.exp(out["nll"].mean())),
            "kl_vs_full": float(out["kl"].mean()),
            "top1_agree": float(out["top1"].mean()),
            "tokens": int(tokens),
            "decode_tokens_per_s": tokens / out["seconds"],
            "nll_per_window": out["nll"].mean(axis=1).tolist(),
        }
        if progress is not None:
            progress(name, results[name])
    return results
