"""An independent oracle for the cache: KIVI's semantics simulated by fake quantization in one full forward pass.

Teacher forcing makes this exact. When token i is decoded, the cache holds tokens [0, i): a per-channel store has
quantized whole R-blocks, tokens [0, (i // R) * R); a per-token store every token but the newest R, [0, i - R); the
rest, and token i itself, are seen in full precision; the prompt (i < prefill) attends in full precision. Every
layer's keys and values of token t are the same whether computed at t's own decode step or in one pass over the
window, so one forward pass that picks, for each (query i, key t), the quantized or the exact key and value gives
the cache's logits, without any cache code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kivi_jax import layout
from kivi_jax.config import KIVIConfig
from kivi_jax.evaluate import fake_quant
from kivi_jax.models.llama import NoCache
from kivi_jax.quant import SCALE_DTYPES


def quantized_before(axis: str, query: jax.Array, key: jax.Array, prefill: int, residual: int) -> jax.Array:
    """`[queries, keys]` bool: when query `i` is decoded, key position `t` is read from a store on `axis`."""
    end = layout.quantized_end(axis, query, residual)
    return (query >= prefill) & (key < end)


class SimulatedKIVI(NoCache):
    """Stands in for a cache in `models.llama.forward` over whole windows `[batch, prefill + decode]`."""

    def __init__(self, batch: int, tokens: int, prefill: int, kivi: KIVIConfig):
        super().__init__(batch, tokens)
        self.prefill, self.kivi = prefill, kivi

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        if softcap is not None:
            raise NotImplementedError("the simulation does not soft-cap attention logits")
        k = rope(k, positions)
        kivi = self.kivi
        batch, tokens, q_heads, d = q.shape
        kv_heads = k.shape[2]
        sd = SCALE_DTYPES[kivi.scale_dtype]
        k = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [batch, kv_heads, tokens, D]
        v = jnp.swapaxes(v, 1, 2).astype(jnp.float32)
        pad = ((0, 0), (0, 0), (0, -tokens % kivi.group_size), (0, 0))  # a partial last group is never read quantized
        kq = fake_quant(jnp.pad(k, pad), kivi.key_axis, kivi.k_bits, kivi.group_size, sd)[:, :, :tokens]
        vq = fake_quant(jnp.pad(v, pad), kivi.value_axis, kivi.v_bits, kivi.group_size, sd)[:, :, :tokens]
        i, t = jnp.arange(tokens)[:, None], jnp.arange(tokens)[None, :]
        use_kq = quantized_before(kivi.key_axis, i, t, self.prefill, kivi.residual_length)  # [query, key]
        use_vq = quantized_before(kivi.value_axis, i, t, self.prefill, kivi.residual_length)
        qg = q.astype(jnp.float32).reshape(batch, tokens, kv_heads, q_heads // kv_heads, d) * d**-0.5
        scores = jnp.where(
            use_kq,
            jnp.einsum("bqhrd,bhkd->bhrqk", qg, kq, precision="highest"),
            jnp.einsum("bqhrd,bhkd->bhrqk", qg, k, precision="highest"),
        )
        allowed = t <= i
        if window is not None:
            allowed &= i - t < window
        p = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhrqk,bhkd->bqhrd", p, v, precision="highest")
        out += jnp.einsum("bhrqk,bhkd->bqhrd", jnp.where(use_vq, p, 0.0), vq - v, precision="highest")
        return out.reshape(batch, tokens, q_heads, d).astype(q.dtype), None


def simulated_nll(params, windows: jax.Array, prefill: int, kivi: KIVIConfig | None) -> jax.Array:
    """Per scored token `[windows, decode]` NLL of the protocol, by one forward pass (`kivi=None`: no quantization)."""
    from kivi_jax.models.llama import forward

    windows = jnp.asarray(windows, jnp.int32)
    tokens = windows[:, :-1]
    cache = None if kivi is None else SimulatedKIVI(*tokens.shape, prefill, kivi)
    logits, _ = forward(params, tokens, cache)
    logp = jax.nn.log_softmax(logits[:, prefill:], axis=-1)  # predictions of tokens prefill + 1 ...
    return -jnp.take_along_axis(logp, windows[:, prefill + 1 :, None], axis=-1)[..., 0]
