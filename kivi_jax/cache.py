"""Cache pytrees: the full-precision cache (the baseline) and the KIVI cache.

Both hold every layer stacked on a leading axis, are preallocated at their final size, are written with
`dynamic_update_slice` / scatter under `jit`, and keep one counter, `length [batch]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kivi_jax import attention, quant
from kivi_jax.config import KIVIConfig, parse_cache_spec
from models.attention import causal_attention
from models.config import LlamaConfig

ATTENTION_IMPLS = ("auto", "xla", "pallas")


class CacheCapacityError(ValueError):
    """More tokens than the cache was allocated for."""


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    return impl


def check_prefill_fits(n_tok: int, max_tokens: int) -> None:
    if n_tok > max_tokens:
        raise CacheCapacityError(
            f"a prefill of {n_tok} tokens does not fit a cache of {max_tokens} tokens; allocate a larger cache"
        )


def zero_padding(x: jax.Array, num_new: jax.Array) -> jax.Array:
    """`x [batch, tokens, ...]` with the tokens at or past `num_new [batch]` set to zero."""
    keep = jnp.arange(x.shape[1])[None, :] < num_new[:, None]
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def write_token(buf: jax.Array, layer: jax.Array, slot: jax.Array, x: jax.Array) -> jax.Array:
    """Writes `x [batch, kv_heads, ...]` into `buf [layers, batch, kv_heads, slots, ...]` at `[layer, b, :, slot[b]]`."""
    batch = x.shape[0]
    return buf.at[layer, jnp.arange(batch), :, slot].set(x.astype(buf.dtype), mode="drop")


@struct.dataclass
class FullCache:
    """Keys and values in the compute dtype: the baseline every KIVI number is compared against."""

    k: jax.Array  # [layers, batch, kv_heads, max_tokens, head_dim]
    v: jax.Array  # [layers, batch, kv_heads, max_tokens, head_dim]
    length: jax.Array  # [batch] int32
    impl: str = struct.field(pytree_node=False, default="auto")

    @classmethod
    def create(cls, cfg: LlamaConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto") -> "FullCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_tokens, cfg.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            length=jnp.zeros((batch,), jnp.int32),
            impl=check_impl(impl),
        )

    @property
    def max_tokens(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def prefill_attend(self, layer, q, k, v, num_new, window):
        check_prefill_fits(k.shape[1], self.max_tokens)
        out = causal_attention(q, k, v, num_new, window)
        k_store = zero_padding(k, num_new).transpose(0, 2, 1, 3)[None]  # [1, batch, kv_heads, tokens, head_dim]
        v_store = zero_padding(v, num_new).transpose(0, 2, 1, 3)[None]
        at = (layer, 0, 0, 0, 0)
        return out, self.replace(
            k=jax.lax.dynamic_update_slice(self.k, k_store.astype(self.k.dtype), at),
            v=jax.lax.dynamic_update_slice(self.v, v_store.astype(self.v.dtype), at),
        )

    def decode_attend(self, layer, q, k, v, window):
        out = attention.decode_full(self.impl, q, self.k[layer], self.v[layer], self.length, k, v, window)
        return out, self.replace(
            k=write_token(self.k, layer, self.length, k[:, 0]),
            v=write_token(self.v, layer, self.length, v[:, 0]),
        )

    def advance(self, num_new):
        return self.replace(length=self.length + num_new.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------------------------------
# KIVI


@struct.dataclass
class QuantStore:
    """One quantized tensor (keys or values) of the KIVI cache, for all layers or for one.

    `axis="channel"`: groups of G tokens per channel, quantized in whole R-token blocks (scale `[..., tokens // G, D]`).
    `axis="token"`: groups of G channels per token, quantized one token at a time (scale `[..., tokens, D // G]`).
    """

    codes: jax.Array  # [(layers,) batch, kv_heads, max_tokens, head_dim // p] uint8, planar-packed
    scale: jax.Array  # [(layers,) batch, kv_heads, groups along tokens or tokens, head_dim or groups along channels]
    mn: jax.Array  # like scale
    bits: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    axis: str = struct.field(pytree_node=False)

    @classmethod
    def zeros(cls, lead: tuple, max_tokens: int, head_dim: int, bits: int, group_size: int, axis: str, scale_dtype):
        p = quant.codes_per_byte(bits)
        if axis == "channel":
            scale_shape = lead + (max_tokens // group_size, head_dim)
        else:
            scale_shape = lead + (max_tokens, head_dim // group_size)
        return cls(
            codes=jnp.zeros(lead + (max_tokens, head_dim // p), jnp.uint8),
            scale=jnp.zeros(scale_shape, scale_dtype),
            mn=jnp.zeros(scale_shape, scale_dtype),
            bits=bits,
            group_size=group_size,
            axis=axis,
        )

    def layer(self, i) -> "QuantStore":
        return self.replace(codes=self.codes[i], scale=self.scale[i], mn=self.mn[i])

    def quantized_end(self, length: jax.Array, residual: int) -> jax.Array:
        """Tokens `[0, end)` are quantized once `length` tokens are in: whole R-blocks, or all but the newest R."""
        if self.axis == "channel":
            return (length // residual) * residual
        return jnp.maximum(length - residual, 0)

    def quantize(self, x: jax.Array):
        """`x [..., tokens, head_dim]` -> (packed codes, scale, mn) on this store's axis."""
        fn = quant.quantize_per_channel if self.axis == "channel" else quant.quantize_per_token
        return fn(x, self.bits, self.group_size, self.scale.dtype)

    def dequantize(self) -> jax.Array:
        """Every token of a one-layer store in float32 `[batch, kv_heads, max_tokens, head_dim]` (references, tests)."""
        fn = quant.dequantize_per_channel if self.axis == "channel" else quant.dequantize_per_token
        return fn(self.codes, self.scale, self.mn, self.bits, self.group_size)

    def token_slice(self, start: jax.Array, size: int) -> "QuantStore":
        """Tokens `[start, start + size)` of a one-layer store (start a multiple of G for per-channel)."""
        codes = jax.lax.dynamic_slice_in_dim(self.codes, start, size, axis=-2)
        if self.axis == "channel":
            g = self.group_size
            scale = jax.lax.dynamic_slice_in_dim(self.scale, start // g, size // g, axis=-2)
            mn = jax.lax.dynamic_slice_in_dim(self.mn, start // g, size // g, axis=-2)
        else:
            scale = jax.lax.dynamic_slice_in_dim(self.scale, start, size, axis=-2)
            mn = jax.lax.dynamic_slice_in_dim(self.mn, start, size, axis=-2)
        return self.replace(codes=codes, scale=scale, mn=mn)


def _write_rows(buf: jax.Array, layer, rows: jax.Array, values: jax.Array) -> jax.Array:
    """Scatters `values [batch, kv_heads, n, ...]` into `buf [layers, batch, kv_heads, rows, ...]` at `rows [batch, n]`.

    Rows out of range (use `buf.shape[3]`) are dropped, which is how a sequence skips a write.
    """
    batch = values.shape[0]
    vals = jnp.moveaxis(values, 2, 1).astype(buf.dtype)  # [batch, n, kv_heads, ...]
    return buf.at[layer, jnp.arange(batch)[:, None], :, rows].set(vals, mode="drop")


def _write_store(store: QuantStore, layer, first_row: jax.Array, x: jax.Array, write: jax.Array):
    """Quantizes `x [batch, kv_heads, n, head_dim]` and writes it at tokens `[first_row, first_row + n)` where `write`.

    Returns the new store and a per-sequence overflow flag `[batch]`.
    """
    codes, scale, mn = store.quantize(x)
    n = x.shape[2]
    max_tokens = store.codes.shape[3]
    rows = jnp.where(write, first_row, max_tokens)[:, None] + jnp.arange(n)[None, :]  # [batch, n]
    if store.axis == "channel":
        g = store.group_size
        scale_rows = jnp.where(write, first_row // g, max_tokens // g)[:, None] + jnp.arange(n // g)[None, :]
    else:
        scale_rows = rows
    new = store.replace(
        codes=_write_rows(store.codes, layer, rows, codes),
        scale=_write_rows(store.scale, layer, scale_rows, scale),
        mn=_write_rows(store.mn, layer, scale_rows, mn),
    )
    bad = ~(jnp.all(jnp.isfinite(scale), axis=(1, 2, 3)) & jnp.all(jnp.isfinite(mn), axis=(1, 2, 3)))
    return new, bad & write


def _fill_store(store: QuantStore, layer, x: jax.Array, end: jax.Array):
    """Quantizes the prompt `x [batch, kv_heads, tokens, head_dim]` (tokens a multiple of G) up to `end [batch]`.

    Everything at or past `end` stays zero, as it would after the same tokens were appended one at a time.
    """
    codes, scale, mn = store.quantize(x)
    n = x.shape[2]
    keep = jnp.arange(n)[None, :] < end[:, None]  # [batch, tokens]
    codes = jnp.where(keep[:, None, :, None], codes, jnp.zeros((), codes.dtype))
    if store.axis == "channel":
        g = store.group_size
        keep_s = (jnp.arange(n // g)[None, :] + 1) * g <= end[:, None]
    else:
        keep_s = keep
    scale = jnp.where(keep_s[:, None, :, None], scale, jnp.zeros((), scale.dtype))
    mn = jnp.where(keep_s[:, None, :, None], mn, jnp.zeros((), mn.dtype))
    at = (layer, 0, 0, 0, 0)
    new = store.replace(
        codes=jax.lax.dynamic_update_slice(store.codes, codes[None], at),
        scale=jax.lax.dynamic_update_slice(store.scale, scale[None], at),
        mn=jax.lax.dynamic_update_slice(store.mn, mn[None], at),
    )
    bad = ~(jnp.all(jnp.isfinite(scale), axis=(1, 2, 3)) & jnp.all(jnp.isfinite(mn), axis=(1, 2, 3)))
    return new, bad


@struct.dataclass
class KIVICache:
    """The KIVI cache of DESIGN §2: quantized keys and values, a full-precision residual ring, one length counter.

    Keys `[0, k.quantized_end)` and values `[0, v.quantized_end)` are read from the quantized stores; the ring slot
    `t % R` holds token t's key and value for the newest R tokens.
    """

    k: QuantStore
    v: QuantStore
    k_ring: jax.Array  # [layers, batch, kv_heads, R, head_dim] compute dtype
    v_ring: jax.Array  # [layers, batch, kv_heads, R, head_dim] compute dtype
    length: jax.Array  # [batch] int32
    overflow: jax.Array  # [batch] bool: a stored scale or min was not finite (see KIVIConfig.scale_dtype)
    config: KIVIConfig = struct.field(pytree_node=False)
    impl: str = struct.field(pytree_node=False, default="auto")

    @classmethod
    def create(
        cls, cfg: LlamaConfig, kivi: KIVIConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto"
    ) -> "KIVICache":
        kivi.check_shapes(cfg.head_dim, max_tokens)
        lead = (cfg.num_layers, batch, cfg.num_kv_heads)
        sd = quant.SCALE_DTYPES[kivi.scale_dtype]
        g, d, r = kivi.group_size, cfg.head_dim, kivi.residual_length
        return cls(
            k=QuantStore.zeros(lead, max_tokens, d, kivi.k_bits, g, kivi.key_axis, sd),
            v=QuantStore.zeros(lead, max_tokens, d, kivi.v_bits, g, kivi.value_axis, sd),
            k_ring=jnp.zeros(lead + (r, d), dtype),
            v_ring=jnp.zeros(lead + (r, d), dtype),
            length=jnp.zeros((batch,), jnp.int32),
            overflow=jnp.zeros((batch,), bool),
            config=kivi,
            impl=check_impl(impl),
        )

    @property
    def max_tokens(self) -> int:
        return self.k.codes.shape[3]

    @property
    def residual(self) -> int:
        return self.config.residual_length

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def prefill_attend(self, layer, q, k, v, num_new, window):
        check_prefill_fits(k.shape[1], self.max_tokens)
        out = causal_attention(q, k, v, num_new, window)
        r = self.residual
        n_tok = k.shape[1]
        padded = -(-n_tok // r) * r  # the prompt rounded up to whole R-blocks (fits: max_tokens is a multiple of R)
        dtype = self.k_ring.dtype

        def prepare(x):  # [batch, tokens, kv_heads, head_dim] -> [batch, kv_heads, padded, head_dim], padding zero
            x = zero_padding(x, num_new).astype(dtype).transpose(0, 2, 1, 3)
            return jnp.pad(x, ((0, 0), (0, 0), (0, padded - n_tok), (0, 0)))

        kx, vx = prepare(k), prepare(v)
        k_store, k_bad = _fill_store(self.k, layer, kx, self.k.quantized_end(num_new, r))
        v_store, v_bad = _fill_store(self.v, layer, vx, self.v.quantized_end(num_new, r))
        held = attention.ring_tokens(num_new, r)  # [batch, R]
        idx = jnp.maximum(held, 0)[:, None, :, None]

        def ring(x):
            x = jnp.take_along_axis(x, jnp.broadcast_to(idx, x.shape[:2] + idx.shape[2:]), axis=2)
            return jnp.where((held >= 0)[:, None, :, None], x, jnp.zeros((), dtype))[None]

        at = (layer, 0, 0, 0, 0)
        return out, self.replace(
            k=k_store,
            v=v_store,
            k_ring=jax.lax.dynamic_update_slice(self.k_ring, ring(kx), at),
            v_ring=jax.lax.dynamic_update_slice(self.v_ring, ring(vx), at),
            overflow=self.overflow | k_bad | v_bad,
        )

    def decode_attend(self, layer, q, k, v, window):
        out = attention.decode_kivi(
            self.impl,
            q,
            self.k.layer(layer),
            self.v.layer(layer),
            self.k_ring[layer],
            self.v_ring[layer],
            self.length,
            k,
            v,
            window,
        )
        return out, self.append(layer, k[:, 0], v[:, 0])

    def append(self, layer, k: jax.Array, v: jax.Array) -> "KIVICache":
        """Appends one token's key and value `[batch, kv_heads, head_dim]` at position `length` in one layer.

        A per-token store first quantizes the token leaving the ring (t - R); the new token then takes ring slot t % R;
        a per-channel store quantizes the whole ring once `t + 1` is a multiple of R. `length` moves in `advance`.
        """
        r = self.residual
        t = self.length
        slot = jnp.mod(t, r)
        stores, bad = {}, self.overflow
        rings = {"k": self.k_ring, "v": self.v_ring}
        for name, store in (("k", self.k), ("v", self.v)):
            if store.axis == "token":
                leaving = jnp.take_along_axis(rings[name][layer], slot[:, None, None, None], axis=2)
                store, b = _write_store(store, layer, t - r, leaving, t >= r)
                bad = bad | b
            stores[name] = store
        k_ring = _write_rows(self.k_ring, layer, slot[:, None], k[:, :, None, :])
        v_ring = _write_rows(self.v_ring, layer, slot[:, None], v[:, :, None, :])
        new_rings = {"k": k_ring, "v": v_ring}
        flush = jnp.mod(t + 1, r) == 0
        for name in ("k", "v"):
            store = stores[name]
            if store.axis == "channel":
                store, b = _write_store(store, layer, t + 1 - r, new_rings[name][layer], flush)
                bad = bad | b
            stores[name] = store
        return self.replace(k=stores["k"], v=stores["v"], k_ring=k_ring, v_ring=v_ring, overflow=bad)

    def advance(self, num_new):
        return self.replace(length=self.length + num_new.astype(jnp.int32))


def kivi_cache_bytes(
    cfg: LlamaConfig, kivi: KIVIConfig, batch: int, max_tokens: int, compute_bytes: int
) -> dict[str, int]:
    """DESIGN §2's byte formula for a KIVI cache, by part (codes, scales and mins, ring, bookkeeping)."""
    lbh = cfg.num_layers * batch * cfg.num_kv_heads
    d, g, r = cfg.head_dim, kivi.group_size, kivi.residual_length
    scale_bytes = jnp.dtype(quant.SCALE_DTYPES[kivi.scale_dtype]).itemsize
    parts = {
        "codes": lbh * max_tokens * d * (kivi.k_bits + kivi.v_bits) // 8,
        "scales": 2 * 2 * lbh * max_tokens * (d // g) * scale_bytes,  # (scale, min) x (keys, values)
        "ring": 2 * lbh * r * d * compute_bytes,
        "bookkeeping": batch * (4 + 1),  # length int32 + overflow flag
    }
    parts["total"] = sum(parts.values())
    return parts


def full_cache_bytes(cfg: LlamaConfig, batch: int, max_tokens: int, compute_bytes: int) -> int:
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_tokens * cfg.head_dim * compute_bytes + 4 * batch


def make_cache(spec, cfg: LlamaConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto"):
    """A fresh cache for a parsed or unparsed spec ('full', 'kivi2', 'k4v2-g64-r128', a KIVIConfig)."""
    spec = parse_cache_spec(spec)
    if spec == "full":
        return FullCache.create(cfg, batch, max_tokens, dtype, impl)
    return KIVICache.create(cfg, spec, batch, max_tokens, dtype, impl)
