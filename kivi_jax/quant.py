"""Asymmetric group quantization and planar uint8 packing (pure jnp, float32 arithmetic).

A group of `group_size` consecutive elements along one axis shares a (scale, min):
`scale = (max - min) / (2**bits - 1)`, `code = clip(round_half_even((x - min) / scale), 0, 2**bits - 1)`,
`x_hat = code * scale + min`. Scale and min are rounded to their storage dtype first and the codes are computed
against the stored values, so the grid the codes index is exactly the one dequantization uses. A zero range (or one
that underflows the storage dtype) stores scale 1, so a constant group comes back exactly as its stored min.

Non-uniform codes (`levels`, a codebook of `2**bits` ascending levels in units of the scale above the min, e.g.
`(0.5, 1.2, 1.8, 2.5)` for 2 bits; `kivi_jax.codebook`): the same (scale, min) a group, but code `c` stands for
`x_hat = levels[c] * scale + min`, and a value takes the nearest level (`code = #{j : u > (levels[j] + levels[j+1]) /
2}` with `u = (x - min) / scale`). Uniform codes are the levels `(0, 1, ..., 2**bits - 1)` with ties to even.

Per-channel (KIVI's keys): groups run along the token axis, one (scale, min) per channel per `group_size` tokens.
Per-token (KIVI's values): groups run along the channel axis, one (scale, min) per token per `group_size` channels.

Packing is planar along the last axis: with `p = 8 // bits` codes a byte, byte `j` of a row of `D` codes holds
codes `j, j + D/p, j + 2D/p, ...`, code `i` of the byte in bits `[bits*i, bits*(i+1))`. 3-bit codes are two planes
side by side in one row of `3D/8` bytes: the low two bits of every code packed as 2-bit codes (`D/4` bytes), then the
high bit packed as 1-bit codes (`D/8` bytes), so a kernel unpacks them with the same shifts and masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUPPORTED_BITS = (2, 3, 4, 8)
PLANES = {2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}  # bits of each packed plane, low bits first
SCALE_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits} bits are not supported; choose one of {SUPPORTED_BITS}")
    return bits


def packed_width(bits: int, head_dim: int) -> int:
    """Bytes a row of `head_dim` codes packs into (`head_dim * bits / 8`)."""
    return sum(head_dim // (8 // b) for b in PLANES[check_bits(bits)])


def pack_multiple(bits: int) -> int:
    """The row length must be a multiple of this to pack `bits`-bit codes (codes a byte of the narrowest plane)."""
    return max(8 // b for b in PLANES[check_bits(bits)])


def check_levels(levels, bits: int) -> tuple | None:
    """`levels` (None: uniform codes) as a tuple of `2**bits` ascending floats, or a clear error."""
    if levels is None:
        return None
    levels = tuple(float(x) for x in levels)
    if len(levels) != 2 ** check_bits(bits) or any(b <= a for a, b in zip(levels, levels[1:])):
        raise ValueError(f"a {bits}-bit codebook needs {2 ** bits} strictly ascending levels, not {levels}")
    return levels


def nearest_level(u: jax.Array, levels: tuple) -> jax.Array:
    """uint8 codes of the nearest of `levels` (ascending) to `u` (in scale units above the min)."""
    codes = jnp.zeros(u.shape, jnp.uint8)
    for a, b in zip(levels, levels[1:]):
        codes = codes + (u > jnp.float32((a + b) / 2)).astype(jnp.uint8)
    return codes


def quantize(x: jax.Array, bits: int, group_size: int, axis: int, scale_dtype=jnp.float16, levels=None):
    """Quantizes `x` in groups of `group_size` consecutive elements along `axis` (`levels`: a non-uniform codebook,
    module doc; None for uniform codes).

    Returns `(codes, scale, mn)`: codes uint8 with x's shape (one code a byte, unpacked); scale and mn in
    `scale_dtype` with x's shape except `axis`, which has `x.shape[axis] // group_size` groups.
    """
    levels = check_levels(levels, bits)
    top = 2 ** bits - 1
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % group_size:
        raise ValueError(f"axis {axis} has {n} elements, not a multiple of group_size={group_size}")
    grouped_shape = x.shape[:axis] + (n // group_size, group_size) + x.shape[axis + 1 :]
    xg = x.astype(jnp.float32).reshape(grouped_shape)
    mn = jnp.min(xg, axis=axis + 1)
    mx = jnp.max(xg, axis=axis + 1)
    mn_s = mn.astype(scale_dtype)
    scale_s = ((mx - mn) / top).astype(scale_dtype)
    scale_s = jnp.where(scale_s == 0, jnp.ones((), scale_dtype), scale_s)
    mn_f = jnp.expand_dims(mn_s.astype(jnp.float32), axis + 1)
    scale_f = jnp.expand_dims(scale_s.astype(jnp.float32), axis + 1)
    if levels is None:
        codes = jnp.clip(jnp.round((xg - mn_f) / scale_f), 0, top).astype(jnp.uint8)
    else:
        codes = nearest_level((xg - mn_f) / scale_f, levels)
    return codes.reshape(x.shape), scale_s, mn_s


def dequantize(codes: jax.Array, scale: jax.Array, mn: jax.Array, group_size: int, axis: int,
               levels=None) -> jax.Array:
    """float32 `codes * scale + mn` (`levels[codes] * scale + mn` with a codebook), with scale and mn broadcast over
    their groups along `axis`."""
    axis = axis % codes.ndim
    scale = jnp.repeat(scale.astype(jnp.float32), group_size, axis=axis)
    mn = jnp.repeat(mn.astype(jnp.float32), group_size, axis=axis)
    values = codes.astype(jnp.float32) if levels is None else jnp.asarray(levels, jnp.float32)[codes.astype(jnp.int32)]
    return values * scale + mn


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Packs uint8 codes `[..., D]` (each < 2**bits) into `[..., packed_width(bits, D)]` bytes, planar (module doc)."""
    d = codes.shape[-1]
    if d % pack_multiple(bits):
        raise ValueError(f"the last axis ({d}) must be a multiple of {pack_multiple(bits)} to pack {bits}-bit codes")
    planes, shift = [], 0
    for b in PLANES[bits]:
        planes.append(pack_plane((codes >> shift) & (2**b - 1), b))
        shift += b
    return planes[0] if len(planes) == 1 else jnp.concatenate(planes, axis=-1)


def pack_plane(codes: jax.Array, bits: int) -> jax.Array:
    """One plane: codes `[..., D]` (each < 2**bits, bits in {1, 2, 4, 8}) -> `[..., D * bits / 8]` planar bytes."""
    p = 8 // bits
    d = codes.shape[-1]
    if d % p:
        raise ValueError(f"the last axis ({d}) must be a multiple of {p} to pack {bits}-bit codes")
    slabs = codes.reshape(codes.shape[:-1] + (p, d // p)).astype(jnp.uint8)
    packed = jnp.zeros(codes.shape[:-1] + (d // p,), jnp.uint8)
    for i in range(p):
        packed = packed | (slabs[..., i, :] << (bits * i))
    return packed


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """The inverse of `pack`: `[..., packed_width(bits, D)]` bytes -> uint8 codes `[..., D]`."""
    planes = PLANES[check_bits(bits)]
    d = packed.shape[-1] * 8 // bits
    codes, start, shift = None, 0, 0
    for b in planes:
        width = d * b // 8
        plane = unpack_plane(packed[..., start : start + width], b) << shift
        codes = plane if codes is None else codes | plane
        start, shift = start + width, shift + b
    return codes


def unpack_plane(packed: jax.Array, bits: int) -> jax.Array:
    """The inverse of `pack_plane`."""
    p = 8 // bits
    mask = jnp.uint8(2**bits - 1)
    slabs = [(packed >> (bits * i)) & mask for i in range(p)]
    return jnp.concatenate(slabs, axis=-1)


def quantize_per_channel(x: jax.Array, bits: int, group_size: int, scale_dtype=jnp.float16, levels=None):
    """`x [..., tokens, D]` -> packed codes `[..., tokens, D * bits / 8]`, scale and min `[..., tokens // G, D]`."""
    codes, scale, mn = quantize(x, bits, group_size, axis=-2, scale_dtype=scale_dtype, levels=levels)
    return pack(codes, bits), scale, mn


def quantize_per_token(x: jax.Array, bits: int, group_size: int, scale_dtype=jnp.float16, levels=None):
    """`x [..., tokens, D]` -> packed codes `[..., tokens, D * bits / 8]`, scale and min `[..., tokens, D // G]`."""
    codes, scale, mn = quantize(x, bits, group_size, axis=-1, scale_dtype=scale_dtype, levels=levels)
    return pack(codes, bits), scale, mn


def dequantize_per_channel(packed, scale, mn, bits: int, group_size: int, levels=None) -> jax.Array:
    return dequantize(unpack(packed, bits), scale, mn, group_size, axis=-2, levels=levels)


def dequantize_per_token(packed, scale, mn, bits: int, group_size: int, levels=None) -> jax.Array:
    return dequantize(unpack(packed, bits), scale, mn, group_size, axis=-1, levels=levels)


def overflowed(*stored: jax.Array) -> jax.Array:
    """True where a stored scale or min is not finite (|x| beyond the storage dtype's range, or NaN input)."""
    bad = jnp.zeros((), bool)
    for s in stored:
        bad = bad | ~jnp.all(jnp.isfinite(s))
    return bad
