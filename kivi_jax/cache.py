"""Cache pytrees: the full-precision cache (the baseline) and the KIVI cache.

Both hold every layer stacked on a leading axis, are preallocated at their final size, and keep one counter,
`length [batch]`. Inside the model's layer scan a cache is only read: each layer returns a small update (the new
token's rows), and `commit` writes all layers' updates at once after the scan. Reads inside the loop and writes
after it let XLA update the donated buffers in place instead of copying the whole cache every step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from kivi_jax import attention, quant, sharding
from kivi_jax.config import KIVIConfig, parse_cache_spec
from kivi_jax.models.attention import causal_attention
from kivi_jax.models.config import LlamaConfig

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


def tree_bytes(tree) -> int:
    """Bytes of a pytree's array leaves, concrete or abstract (`jax.eval_shape`): what a cache reports as its size."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def zero_padding(x: jax.Array, num_new: jax.Array) -> jax.Array:
    """`x [batch, tokens, ...]` with the tokens at or past `num_new [batch]` set to zero."""
    keep = jnp.arange(x.shape[1])[None, :] < num_new[:, None]
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


@sharding.per_shard(out="cache", buf="cache", rows="rows", values="cache")  # under a mesh: each shard its own rows
def scatter_rows(buf: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """Writes `values [layers, batch, kv_heads, n, ...]` into `buf [layers, batch, kv_heads, rows, ...]` at token rows
    `rows [batch, n]`, for every layer. Rows out of range (e.g. `buf.shape[3]`) are dropped: a sequence skips a write."""
    batch = rows.shape[0]
    vals = jnp.moveaxis(values, (1, 3), (0, 1)).astype(buf.dtype)  # [batch, n, layers, kv_heads, ...]
    return buf.at[:, jnp.arange(batch)[:, None], :, rows].set(vals, mode="drop")


def write_prefix(buf: jax.Array, values: jax.Array) -> jax.Array:
    """Writes `values [layers, batch, kv_heads, n, ...]` over the first n token rows of `buf`."""
    return jax.lax.dynamic_update_slice(buf, values.astype(buf.dtype), (0,) * buf.ndim)


def stored_layout(x: jax.Array, num_new: jax.Array, dtype) -> jax.Array:
    """New tokens `[batch, tokens, kv_heads, head_dim]` -> `[batch, kv_heads, tokens, head_dim]` in `dtype`, padding 0."""
    return zero_padding(x, num_new).astype(dtype).transpose(0, 2, 1, 3)


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
        return tree_bytes(self)

    def prefill_attend(self, layer, q, k, v, num_new, window):
        check_prefill_fits(k.shape[1], self.max_tokens)
        out = causal_attention(q, k, v, num_new, window)
        return out, {"prefill_k": stored_layout(k, num_new, self.k.dtype), "prefill_v": stored_layout(v, num_new, self.v.dtype)}

    def decode_attend(self, layer, q, k, v, window):
        out = attention.decode_full(self.impl, q, self.k, self.v, layer, self.length, k, v, window)
        return out, {"k": k[:, 0, :, None, :], "v": v[:, 0, :, None, :]}  # [batch, kv_heads, 1, head_dim]

    def commit(self, updates: dict, num_new: jax.Array) -> "FullCache":
        if "prefill_k" in updates:
            k, v = write_prefix(self.k, updates["prefill_k"]), write_prefix(self.v, updates["prefill_v"])
        else:
            rows = self.length[:, None]
            k, v = scatter_rows(self.k, rows, updates["k"]), scatter_rows(self.v, rows, updates["v"])
        return self.replace(k=k, v=v, length=self.length + num_new.astype(jnp.int32))


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

    @property
    def max_tokens(self) -> int:
        return self.codes.shape[-2]

    def quantized_end(self, length: jax.Array, residual: int) -> jax.Array:
        """Tokens `[0, end)` are quantized once `length` tokens are in: whole R-blocks, or all but the newest R."""
        if self.axis == "channel":
            return (length // residual) * residual
        return jnp.maximum(length - residual, 0)

    def quantize(self, x: jax.Array) -> dict:
        """`x [..., tokens, head_dim]` -> {codes, scale, mn} on this store's axis, plus `bad [...]` (non-finite)."""
        fn = quant.quantize_per_channel if self.axis == "channel" else quant.quantize_per_token
        codes, scale, mn = fn(x, self.bits, self.group_size, self.scale.dtype)
        finite = jnp.all(jnp.isfinite(scale), axis=(-2, -1)) & jnp.all(jnp.isfinite(mn), axis=(-2, -1))
        return {"codes": codes, "scale": scale, "mn": mn, "bad": ~finite}

    def dequantize(self) -> jax.Array:
        """Every token of a one-layer store in float32 `[batch, kv_heads, max_tokens, head_dim]` (references, tests)."""
        fn = quant.dequantize_per_channel if self.axis == "channel" else quant.dequantize_per_token
        return fn(self.codes, self.scale, self.mn, self.bits, self.group_size)

    def token_slice(self, start: jax.Array, size: int, layer=None) -> "QuantStore":
        """Tokens `[start, start + size)` of one layer (`layer` of a stacked store, or all of a one-layer store) as a
        one-layer store; `start` a multiple of G for per-channel. Only the slice is read."""
        codes = attention.layer_tokens(self.codes, layer, start, size)
        if self.axis == "channel":
            g = self.group_size
            scale = attention.layer_tokens(self.scale, layer, start // g, size // g)
            mn = attention.layer_tokens(self.mn, layer, start // g, size // g)
        else:
            scale = attention.layer_tokens(self.scale, layer, start, size)
            mn = attention.layer_tokens(self.mn, layer, start, size)
        return self.replace(codes=codes, scale=scale, mn=mn)

    def gather_rows(self, layer, rows: jax.Array) -> "QuantStore":
        """Token rows `[batch, n]` (whole groups for per-channel) of one layer of a stacked store, as a one-layer store."""
        srows = self.scale_rows(rows)
        return self.replace(
            codes=attention.gather_tokens(self.codes, layer, rows),
            scale=attention.gather_tokens(self.scale, layer, srows),
            mn=attention.gather_tokens(self.mn, layer, srows),
        )

    def scale_rows(self, rows: jax.Array) -> jax.Array:
        """Scale/min rows for token rows `[batch, n]` (one per G tokens for per-channel; rows are whole groups)."""
        if self.axis == "token":
            return rows
        g = self.group_size
        return rows[:, ::g] // g

    def write_rows(self, rows: jax.Array, q: dict) -> "QuantStore":
        """Writes quantized rows `q` (stacked over layers, token rows `[batch, n]`) into every layer."""
        srows = self.scale_rows(rows)
        return self.replace(
            codes=scatter_rows(self.codes, rows, q["codes"]),
            scale=scatter_rows(self.scale, srows, q["scale"]),
            mn=scatter_rows(self.mn, srows, q["mn"]),
        )

    def write_prefix(self, q: dict) -> "QuantStore":
        return self.replace(
            codes=write_prefix(self.codes, q["codes"]),
            scale=write_prefix(self.scale, q["scale"]),
            mn=write_prefix(self.mn, q["mn"]),
        )


def _zero_beyond(q: dict, store: QuantStore, end: jax.Array) -> dict:
    """Quantized prompt rows with everything at or past token `end [batch]` zeroed (as if never written)."""
    n = q["codes"].shape[2]
    keep = jnp.arange(n)[None, :] < end[:, None]  # [batch, tokens]
    if store.axis == "channel":
        g = store.group_size
        keep_s = (jnp.arange(n // g)[None, :] + 1) * g <= end[:, None]
    else:
        keep_s = keep

    def zero(x, k):
        return jnp.where(k[:, None, :, None], x, jnp.zeros((), x.dtype))

    return {"codes": zero(q["codes"], keep), "scale": zero(q["scale"], keep_s), "mn": zero(q["mn"], keep_s),
            "bad": q["bad"]}


@struct.dataclass
class KIVICache:
    """The KIVI cache of docs/design.md §2: quantized keys and values, a full-precision residual ring, one length counter.

    Keys `[0, k.quantized_end)` and values `[0, v.quantized_end)` are read from the quantized stores; ring slot `t % R`
    holds token t's key and value for the newest R tokens.
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
        d, r = cfg.head_dim, kivi.residual_length
        return cls(
            k=QuantStore.zeros(lead, max_tokens, d, kivi.k_bits, kivi.store_group(kivi.key_axis, d), kivi.key_axis, sd),
            v=QuantStore.zeros(lead, max_tokens, d, kivi.v_bits, kivi.store_group(kivi.value_axis, d), kivi.value_axis,
                               sd),
            k_ring=jnp.zeros(lead + (r, d), dtype),
            v_ring=jnp.zeros(lead + (r, d), dtype),
            length=jnp.zeros((batch,), jnp.int32),
            overflow=jnp.zeros((batch,), bool),
            config=kivi,
            impl=check_impl(impl),
        )

    @property
    def max_tokens(self) -> int:
        return self.k.max_tokens

    @property
    def residual(self) -> int:
        return self.config.residual_length

    @property
    def nbytes(self) -> int:
        return tree_bytes(self)

    def prefill_attend(self, layer, q, k, v, num_new, window):
        """Full-precision attention over the prompt; the update holds the prompt quantized as if appended one by one."""
        check_prefill_fits(k.shape[1], self.max_tokens)
        out = causal_attention(q, k, v, num_new, window)
        return out, self.prompt_update(stored_layout(k, num_new, self.k_ring.dtype),
                                       stored_layout(v, num_new, self.v_ring.dtype), num_new)

    def prompt_update(self, k: jax.Array, v: jax.Array, num_new: jax.Array) -> dict:
        """One layer's filled state from a prompt `[batch, kv_heads, tokens, head_dim]` of `num_new [batch]` tokens:
        keys and values quantized up to their quantized ends, the ring holding the newest R tokens."""
        r = self.residual
        n_tok = k.shape[2]
        padded = -(-n_tok // r) * r  # whole R-blocks (fits: max_tokens is a multiple of R)
        pad = ((0, 0), (0, 0), (0, padded - n_tok), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        held = attention.ring_tokens(num_new, r)  # [batch, R]
        idx = jnp.broadcast_to(jnp.maximum(held, 0)[:, None, :, None], k.shape[:2] + (r, k.shape[3]))

        def ring(x):
            x = jnp.take_along_axis(x, idx, axis=2)
            return jnp.where((held >= 0)[:, None, :, None], x, jnp.zeros((), x.dtype))

        return {
            "prefill_k": _zero_beyond(self.k.quantize(k), self.k, self.k.quantized_end(num_new, r)),
            "prefill_v": _zero_beyond(self.v.quantize(v), self.v, self.v.quantized_end(num_new, r)),
            "k_ring": ring(k),
            "v_ring": ring(v),
        }

    def decode_attend(self, layer, q, k, v, window):
        """Attention over the cache as it stands plus the new token (KIVI's order); the update appends the token."""
        out = attention.decode_kivi(self.impl, q, self.k, self.v, layer, self.k_ring, self.v_ring, self.length, k, v,
                                    window)  # the stacked rings: a kernel reads them in place
        return out, self.append_update(self.k_ring[layer], self.v_ring[layer], k[:, 0], v[:, 0])

    def append_update(self, k_ring: jax.Array, v_ring: jax.Array, k: jax.Array, v: jax.Array) -> dict:
        """One layer's rows to write when token t = length arrives (`k`, `v` `[batch, kv_heads, head_dim]`).

        A per-token store quantizes the token leaving the ring (t - R, ring slot t % R); a per-channel store quantizes
        the ring with the new token in its slot, which is written only when t + 1 completes an R-block.
        """
        r = self.residual
        slot = jnp.mod(self.length, r)  # [batch]
        in_slot = (jnp.arange(r)[None, :] == slot[:, None])[:, None, :, None]  # [batch, 1, R, 1]
        update = {"k_new": k[:, :, None, :], "v_new": v[:, :, None, :]}
        for name, store, ring, new in (("k", self.k, k_ring, k), ("v", self.v, v_ring, v)):
            if store.axis == "token":
                leaving = jnp.take_along_axis(ring, slot[:, None, None, None], axis=2)  # [batch, kv_heads, 1, head_dim]
                update[name] = store.quantize(leaving)
            else:
                update[name] = store.quantize(jnp.where(in_slot, new[:, :, None, :].astype(ring.dtype), ring))
        return update

    def commit(self, updates: dict, num_new: jax.Array) -> "KIVICache":
        """Writes every layer's update (stacked on a leading layer axis) and advances `length` by `num_new`."""
        r = self.residual
        if "prefill_k" in updates:
            pk, pv = updates["prefill_k"], updates["prefill_v"]
            bad = jnp.any(pk["bad"], axis=(0, 2)) | jnp.any(pv["bad"], axis=(0, 2))
            return self.replace(
                k=self.k.write_prefix(pk),
                v=self.v.write_prefix(pv),
                k_ring=write_prefix(self.k_ring, updates["k_ring"]),
                v_ring=write_prefix(self.v_ring, updates["v_ring"]),
                length=self.length + num_new.astype(jnp.int32),
                overflow=self.overflow | bad,
            )
        t = self.length
        stores, bad = {}, self.overflow
        for name, store in (("k", self.k), ("v", self.v)):
            if store.axis == "token":  # row t - R, once t >= R
                write, first = t >= r, t - r
            else:  # the block [t + 1 - R, t + 1), once t + 1 is a multiple of R
                write, first = jnp.mod(t + 1, r) == 0, t + 1 - r
            q = updates[name]
            n = q["codes"].shape[3]
            rows = jnp.where(write, first, store.max_tokens)[:, None] + jnp.arange(n)[None, :]
            stores[name] = store.write_rows(rows, q)
            bad = bad | (write & jnp.any(q["bad"], axis=(0, 2)))
        slot = jnp.mod(t, r)[:, None]
        return self.replace(
            k=stores["k"],
            v=stores["v"],
            k_ring=scatter_rows(self.k_ring, slot, updates["k_new"]),
            v_ring=scatter_rows(self.v_ring, slot, updates["v_new"]),
            length=t + num_new.astype(jnp.int32),
            overflow=bad,
        )


def kivi_cache_bytes(
    cfg: LlamaConfig, kivi: KIVIConfig, batch: int, max_tokens: int, compute_bytes: int
) -> dict[str, int]:
    """docs/design.md §2's byte formula for a KIVI cache, by part (codes, scales and mins, ring, bookkeeping)."""
    lbh = cfg.num_layers * batch * cfg.num_kv_heads
    d, r = cfg.head_dim, kivi.residual_length
    scale_bytes = jnp.dtype(quant.SCALE_DTYPES[kivi.scale_dtype]).itemsize
    # (scale, min) per group: G tokens x 1 channel (per-channel) or 1 token x channel_group channels (per-token)
    groups = sum(max_tokens * d // kivi.store_group(axis, d) for axis in (kivi.key_axis, kivi.value_axis))
    parts = {
        "codes": lbh * max_tokens * d * (kivi.k_bits + kivi.v_bits) // 8,
        "scales": 2 * lbh * groups * scale_bytes,  # (scale, min) for keys and values
        "ring": 2 * lbh * r * d * compute_bytes,
        "bookkeeping": batch * (4 + 1),  # length int32 + overflow flag
    }
    parts["total"] = sum(parts.values())
    return parts


def full_cache_bytes(cfg: LlamaConfig, batch: int, max_tokens: int, compute_bytes: int) -> int:
    """Bytes of a full-precision cache: keys and values in the compute dtype plus the length counter."""
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_tokens * cfg.head_dim * compute_bytes + 4 * batch


def make_cache(spec, cfg: LlamaConfig, batch: int, max_tokens: int, dtype=jnp.float32, impl: str = "auto", mesh=None):
    """A fresh cache for a parsed or unparsed spec ('full', 'kivi2', 'k4v2-g64-r128', a KIVIConfig); with `mesh` (a
    Mesh or 'data=2,model=4') allocated sharded by kivi_jax.sharding's table."""
    spec = parse_cache_spec(spec)
    if mesh is not None:
        from kivi_jax import sharding

        return sharding.make_cache(lambda: make_cache(spec, cfg, batch, max_tokens, dtype, impl), mesh)
    if spec == "full":
        return FullCache.create(cfg, batch, max_tokens, dtype, impl)
    return KIVICache.create(cfg, spec, batch, max_tokens, dtype, impl)
