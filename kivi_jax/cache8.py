"""Dense8Cache: every key and value stored in 8 bits (int8 or fp8) as it comes, the simple baseline beside KIVI.

The same protocol as the other caches (`kivi_jax.cache`): `attend` answers the new tokens' attention over the stored
tokens (read a block at a time and widened to float32, never a dequantized layer) plus the new tokens themselves in
full precision, and returns the new rows; `commit` writes them after the layer scan. Each token is quantized on its
own (per token and kv head), so any chunking stores the same bytes. Keys are stored after RoPE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kivi_jax import attention
from kivi_jax.cache_rows import capacity_flags, check_impl, heads_first, new_rows, scatter_rows, tree_bytes
from kivi_jax.config import Dense8Config
from kivi_jax.mesh_scope import active_mesh
from kivi_jax.models.config import ModelConfig
from kivi_jax.models.protocol import SCALE_OVERFLOW

PALLAS_REASON = "no Pallas kernel reads 8-bit (int8 / fp8) caches: the XLA path serves them"
# Whether `attention_impl="auto"` takes the native kernel on the CPU backend (docs/benchmarks.md, "8-bit caches")
EIGHT_AUTO = True
MESH_REASON = "the native 8-bit kernel does not run per shard under a mesh: the XLA path serves it"


def quantize8(x: jax.Array, config: Dense8Config) -> tuple[jax.Array, jax.Array | None]:
    """`x [..., tokens, head_dim]` -> codes in the config's format and, per token, a float16 scale `[..., tokens, 1]`
    (absmax / the format's largest value; None without per-token scales). Values past the format's range saturate."""
    top = config.max_value
    x = x.astype(jnp.float32)
    if config.per_token:
        scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / top).astype(jnp.float16)
        safe = jnp.where(scale > 0, scale, 1).astype(jnp.float32)  # an all-zero token stores zeros
        x = x / safe
    else:
        scale = None
    x = jnp.clip(x, -top, top)
    x = jnp.round(x) if config.fmt == "int8" else x
    # kept as bytes: XLA:CPU moves uint8 buffers as they are (float8 ones it widens, a whole-cache cost), and the
    # native kernel reads them without a bitcast (which copied the cache a step)
    return jax.lax.bitcast_convert_type(x.astype(config.dtype), jnp.uint8), scale


def values8(codes: jax.Array, config: Dense8Config) -> jax.Array:
    """Stored bytes (of an int8 or fp8 value) -> their values in float32 (without the scale)."""
    return jax.lax.bitcast_convert_type(codes, config.dtype).astype(jnp.float32)


@struct.dataclass
class Store8:
    """One 8-bit tensor (keys or values), all layers stacked, read a block at a time by the attention (`read`)."""

    data: jax.Array  # [layers, batch, kv_heads, max_tokens, head_dim] uint8: the bytes of int8 / float8 values
    scale: jax.Array | None  # [layers, batch, kv_heads, max_tokens, 1] float16, or None (a scale of 1)
    config: Dense8Config = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return self.data.shape

    def read(self, layer, start, size: int) -> jax.Array:
        """Tokens `[start, start + size)` of one layer in float32 `[batch, kv_heads, size, head_dim]`."""
        x = values8(attention.layer_tokens(self.data, layer, start, size), self.config)
        if self.scale is None:
            return x
        return x * attention.layer_tokens(self.scale, layer, start, size).astype(jnp.float32)

    def write_rows(self, rows: jax.Array, data: jax.Array, scale: jax.Array | None) -> "Store8":
        """Writes new rows (stacked over layers) at token rows `rows [batch, n]`; rows past the end are dropped."""
        return self.replace(data=scatter_rows(self.data, rows, data),
                            scale=None if scale is None else scatter_rows(self.scale, rows, scale))

    def grown(self, extra: int) -> "Store8":
        pad = lambda x: None if x is None else jnp.pad(x, [(0, 0)] * 3 + [(0, extra), (0, 0)])
        return self.replace(data=pad(self.data), scale=pad(self.scale))


@struct.dataclass
class Dense8Update:
    """One layer's new rows (stacked over layers after the scan)."""

    k: jax.Array  # [batch, kv_heads, T, head_dim] codes, keys after RoPE
    v: jax.Array
    k_scale: jax.Array | None  # [batch, kv_heads, T, 1] float16, or None
    v_scale: jax.Array | None


@struct.dataclass
class Dense8Cache:
    """Keys (after RoPE) and values in 8 bits with optional per-token scales, one length counter, error flags."""

    k: Store8
    v: Store8
    length: jax.Array  # [batch] int32
    error_flags: jax.Array  # [batch] int32, bits BAD_TOKEN | PAST_CAPACITY | SCALE_OVERFLOW
    config: Dense8Config = struct.field(pytree_node=False)
    compute: str = struct.field(pytree_node=False, default="float32")
    impl: str = struct.field(pytree_node=False, default="auto")

    @classmethod
    def create(cls, cfg: ModelConfig, config: Dense8Config, batch: int, max_tokens: int, dtype=jnp.float32,
               impl: str = "auto") -> "Dense8Cache":
        config.check_shapes(cfg.head_dim, max_tokens)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_tokens, cfg.head_dim)
        store = lambda: Store8(jnp.zeros(shape, jnp.uint8),
                               jnp.zeros(shape[:4] + (1,), jnp.float16) if config.per_token else None, config)
        return cls(k=store(), v=store(), length=jnp.zeros((batch,), jnp.int32),
                   error_flags=jnp.zeros((batch,), jnp.int32), config=config, compute=jnp.dtype(dtype).name,
                   impl=check_impl(impl))

    @property
    def max_tokens(self) -> int:
        return self.k.data.shape[3]

    @property
    def nbytes(self) -> int:
        return tree_bytes(self)

    @property
    def spec(self) -> str:
        return self.config.spec

    @property
    def dtype(self):
        """The compute dtype (of the new tokens' attention and the output)."""
        return jnp.dtype(self.compute)

    @property
    def overflow(self) -> jax.Array:
        """`[batch]` bool: a per-token scale overflowed float16."""
        return (self.error_flags & SCALE_OVERFLOW) != 0

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        """New tokens' attention over this layer as stored (the new tokens themselves in full precision) and their
        8-bit rows."""
        k = rope(k, positions).astype(self.dtype)
        v = v.astype(self.dtype)
        if q.shape[1] == 1 and self.native_serves(q, softcap):
            from kivi_jax import native

            out = native.decode_eight(q, self.k, self.v, layer, self.length, k, v, window, self.config.fmt)
        else:
            out = attention.attend_full_xla(q, positions, self.k, self.v, layer, self.length, k, v, num_new, window,
                                            softcap=softcap)
        (kq, ks), (vq, vs) = quantize8(heads_first(k), self.config), quantize8(heads_first(v), self.config)
        return out, Dense8Update(kq, vq, ks, vs)

    def native_serves(self, q, softcap) -> bool:
        """Whether a decode step (one new token) runs the native CPU kernel: `native`, or `auto` on the CPU backend
        (`EIGHT_AUTO`), where it builds and serves the shapes; a forced kernel that cannot says why."""
        if self.impl == "pallas":
            attention.fall_back(self.impl, PALLAS_REASON)
        if softcap is not None:
            attention.fall_back(self.impl, attention.SOFTCAP_REASON)
            return False
        if self.impl == "auto" and not EIGHT_AUTO:
            return False
        if not attention.use_native(self.impl):
            return False
        from kivi_jax import native

        reason = native.unsupported_eight(q.dtype, q.shape[-1])
        if reason is None and active_mesh() is not None:
            reason = MESH_REASON
        if reason is not None:
            attention.fall_back(self.impl, reason)
        return reason is None

    def commit(self, updates: Dense8Update, num_new: jax.Array) -> "Dense8Cache":
        """Writes every layer's new rows (stacked on a leading layer axis) and advances `length` by `num_new`."""
        num_new = num_new.astype(jnp.int32)
        rows = new_rows(self.length, num_new, updates.k.shape[3], self.max_tokens)
        flags = capacity_flags(self.length, num_new, self.max_tokens)
        if self.config.per_token:  # a token past float16's range times the format's largest value
            written = (jnp.arange(updates.k.shape[3])[None, :] < num_new[:, None])[None, :, None, :, None]
            bad = [~jnp.isfinite(s.astype(jnp.float32)) & written for s in (updates.k_scale, updates.v_scale)]
            flags = flags | jnp.where(jnp.any(bad[0] | bad[1], axis=(0, 2, 3, 4)), SCALE_OVERFLOW, 0).astype(jnp.int32)
        return self.replace(
            k=self.k.write_rows(rows, updates.k, updates.k_scale),
            v=self.v.write_rows(rows, updates.v, updates.v_scale),
            length=self.length + num_new,
            error_flags=self.error_flags | flags,
        )

    def attending(self, live: jax.Array) -> "Dense8Cache":
        """The cache as a step over only the `live [batch]` rows attends to it (the others empty)."""
        return self.replace(length=jnp.where(live, self.length, 0))

    def grown(self, max_tokens: int) -> "Dense8Cache":
        """The same contents with room for `max_tokens` tokens (a new allocation; same numbers)."""
        extra = max_tokens - self.max_tokens
        return self.replace(k=self.k.grown(extra), v=self.v.grown(extra))

    def dequantized(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Every stored key and value of one layer in float32 `[batch, kv_heads, max_tokens, head_dim]` (tests)."""
        return self.k.read(layer, 0, self.max_tokens), self.v.read(layer, 0, self.max_tokens)


def dense8_cache_bytes(cfg: ModelConfig, config: Dense8Config, batch: int, max_tokens: int) -> dict[str, int]:
    """The byte formula of an 8-bit cache, by part: one byte a key or value, a float16 scale a token and kv head for
    each with per-token scales, and the bookkeeping."""
    lbh = cfg.num_layers * batch * cfg.num_kv_heads
    parts = {"codes": 2 * lbh * max_tokens * cfg.head_dim,
             "scales": 2 * lbh * max_tokens * 2 if config.per_token else 0,
             "bookkeeping": batch * (4 + 4)}
    parts["total"] = sum(parts.values())
    return parts
