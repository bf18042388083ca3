"""What every decoder shares (docs/design.md §4): the parameter pytree built from an architecture's table, norms, RoPE,
input checks, and the layer scan that hands each layer's attention to the cache.

An architecture (`llama.py`, `qwen.py`, `gemma2.py`) writes only its layer (`block`) and its table; `decode` runs it:
the embedding, one `lax.scan` over the stacked layers whose per-layer attention options (sliding window or global,
logit soft-cap) are data the scan carries, the cache's single `commit` after the scan, the final norm, the output
head and its soft-cap, and the error flags.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import weights
from .attention import causal_attention
from .config import ModelConfig
from .protocol import BAD_TOKEN, POISON, CacheCapacityError, KVCache
from .registry import Param, for_config


@struct.dataclass
class Params:
    """All weights of a model, with its config as a static field. Weights are float arrays in the compute dtype or
    quantized matrices (`kivi_jax.weights`: GGUF blocks, int8, int4); norms and biases are always float. `layers` is
    the architecture's stacked layer-params dataclass (models/registry.py)."""

    embed: jax.Array  # [vocab, hidden] (a quantized table: one row a token)
    layers: object
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`
    config: ModelConfig = struct.field(pytree_node=False)
    value_basis: str = struct.field(pytree_node=False, default="")  # "hadamard": values rotated (kivi_jax.rotation)

    @property
    def dtype(self):
        """The compute dtype (of the activations and every float leaf; norms are never quantized)."""
        return self.final_norm.dtype


GLOBALS = ("embed", "final_norm", "lm_head")  # the leaves outside `layers`, as Params names them


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, keyed like `Params` (nested dict for `layers`; an absent leaf is None)."""
    table = for_config(cfg).params(cfg)
    out: dict = {name: (table[name].shape if name in table else None) for name in GLOBALS}
    out["layers"] = {path[len("layers."):]: p.shape for path, p in table.items() if p.stacked}
    return out


def params_from_dict(tree: dict, cfg: ModelConfig) -> Params:
    """Builds `Params` from a nested dict shaped like `param_shapes(cfg)`, checking every shape."""
    arch = for_config(cfg)
    shapes = param_shapes(cfg)

    def check(name, arr, shape):
        if shape is None:
            return None
        if arr is None:
            raise ValueError(f"parameter {name} is missing (expected shape {shape})")
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return arr

    layers = arch.layers(**{k: check(f"layers.{k}", tree["layers"].get(k), s) for k, s in shapes["layers"].items()})
    return Params(**{name: check(name, tree.get(name), shapes[name]) for name in GLOBALS}, layers=layers, config=cfg)


def params_to_dict(params: Params) -> dict:
    """The inverse of `params_from_dict` (without the config): every leaf of the table, by its place."""
    shapes = param_shapes(params.config)
    out = {name: getattr(params, name) for name in GLOBALS}
    out["layers"] = {k: getattr(params.layers, k) for k in shapes["layers"]}
    return out


def leaves_by_path(params: Params) -> dict:
    """`{path: leaf}` of every parameter the table lists (`"embed"`, `"layers.wq"`, ...), float or quantized."""
    d = params_to_dict(params)
    out = {name: d[name] for name in GLOBALS if d[name] is not None}
    out.update({f"layers.{k}": v for k, v in d["layers"].items()})
    return out


def replace_leaves(params: Params, new: dict) -> Params:
    """Params with the leaves at the given paths (`leaves_by_path` names) replaced."""
    top = {k: v for k, v in new.items() if not k.startswith("layers.")}
    layers = {k[len("layers."):]: v for k, v in new.items() if k.startswith("layers.")}
    return params.replace(layers=params.layers.replace(**layers), **top)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights with the config's shapes (tests and synthetic benchmarks): each leaf as its table entry says
    (`normal` with `std`, `ones`, `zeros`)."""
    table = for_config(cfg).params(cfg)
    # one key a leaf, in this order: embed, the head (even when tied), the stacked leaves, any other global
    names = ["embed", "lm_head"] + [n for n, p in table.items() if p.stacked]
    names += [n for n, p in table.items() if not p.stacked and n not in names and p.init == "normal"]
    keys = dict(zip(names, jax.random.split(key, len(names))))

    def value(name: str, p: Param):
        if p.init == "ones":
            return jnp.ones(p.shape, dtype)
        if p.init == "zeros":
            return jnp.zeros(p.shape, dtype)
        return (std * jax.random.normal(keys[name], p.shape, jnp.float32)).astype(dtype)

    tree: dict = {"layers": {}}
    for name, p in table.items():
        if p.stacked:
            tree["layers"][name[len("layers."):]] = value(name, p)
        else:
            tree[name] = value(name, p)
    return params_from_dict(tree, cfg)


def cast_params(params: Params, dtype) -> Params:
    """The same parameters in another compute dtype (quantized matrices keep their codes and scales)."""
    return jax.tree_util.tree_map(lambda a: a if weights.is_quantized(a) else a.astype(dtype), params,
                                  is_leaf=weights.is_quantized)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result in x's dtype (as transformers computes it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies `[head_dim // 2]` (float32), with linear or llama3-style scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return jnp.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates `x [batch, tokens, heads, head_dim]` by `positions [batch, tokens]` (half-split layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, head_dim // 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, tokens, 1, head_dim]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The rotary function a layer hands its cache: `rope(x, positions)`; `inv_freq [head_dim // 2]` for a cache that
    rotates stored keys itself (a pre-RoPE store)."""

    inv_freq: jax.Array

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, self.inv_freq)


class NoCache:
    """Stands in for a cache when scoring a whole sequence at once: attention over the given tokens only (also the
    base of test and diagnostic stand-ins that override `attend`)."""

    def __init__(self, batch: int, tokens: int):
        self.length = jnp.zeros((batch,), jnp.int32)
        self.error_flags = jnp.zeros((batch,), jnp.int32)
        self.max_tokens = tokens

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        return causal_attention(q, rope(k, positions), v, num_new, window, softcap), None

    def commit(self, updates, num_new):
        return self

    def attending(self, live):
        return self

    def replace(self, **changes):
        for name, value in changes.items():
            setattr(self, name, value)
        return self


def _concrete(x):
    """x as a numpy array, or None when it is traced (under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_inputs(tokens: jax.Array, num_new: jax.Array, logits_at, cache: KVCache, vocab: int) -> jax.Array:
    """`[batch]` bool: sequences given bad input (a real token id outside `[0, vocab)`, `num_new` outside `[0, T]`).
    With concrete inputs (no jit) bad input, or more tokens than the cache holds, raises at once; traced, the
    caller flags the sequence instead."""
    n_tok = tokens.shape[1]
    real = jnp.arange(n_tok)[None, :] < num_new[:, None]
    bad = jnp.any(real & ((tokens < 0) | (tokens >= vocab)), axis=1) | (num_new < 0) | (num_new > n_tok)  # [batch]
    length, n, at = _concrete(cache.length), _concrete(num_new), None if logits_at is None else _concrete(logits_at)
    if n is not None and ((n < 0) | (n > n_tok)).any():
        raise ValueError(f"num_new={n.tolist()} must count real tokens of each sequence, between 0 and {n_tok}")
    if at is not None and ((at < 0) | (at >= n_tok)).any():
        raise ValueError(f"logits_at={at.tolist()} must pick a token index in [0, {n_tok})")
    bad_now = _concrete(bad)
    if bad_now is not None and bad_now.any():
        ids = np.asarray(tokens)[np.asarray(real)]
        wrong = sorted({int(t) for t in ids if not 0 <= t < vocab})
        raise ValueError(f"token ids {wrong[:5]} in sequences {np.flatnonzero(bad_now).tolist()} are outside the "
                         f"vocabulary [0, {vocab})")
    if length is not None and n is not None:
        over = np.flatnonzero(length + n > cache.max_tokens)
        if over.size:
            b = int(over[0])
            raise CacheCapacityError(
                f"sequence {b} holds {int(length[b])} tokens and gets {int(n[b])} more, past the cache's "
                f"{cache.max_tokens}; allocate a larger cache (make_cache(..., max_tokens>={int(length[b] + n[b])})) "
                "or grow it (cache.grown(max_tokens))")
    return bad


def check_value_basis(params: Params, cache) -> None:
    """A cache that quantizes values in a rotated basis needs params whose projections carry it, and a cache that
    does not needs params that do not (else the stored values silently differ); the full cache takes either."""
    wanted = getattr(cache, "value_basis", None)
    if wanted is not None and wanted != params.value_basis:
        basis = lambda name: f"the {name} basis" if name else "the model's own basis"
        raise ValueError(
            f"the cache quantizes values in {basis(wanted)} but the params produce values in "
            f"{basis(params.value_basis)}; prepare them for this cache with "
            "kivi_jax.rotation.prepare_params(params, spec) from the unrotated params")


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping); x itself when `cap` is None."""
    if cap is None:
        return x
    return cap * jnp.tanh(x / cap)


def attention_kinds(cfg: ModelConfig) -> tuple[tuple[tuple[int | None, float | None], ...], tuple[int, ...]]:
    """`(options, kinds)`: the distinct per-layer attention options `(window, softcap)` in order of first use, and
    each layer's index into them (the data the layer scan carries)."""
    per_layer = cfg.layer_attention()
    options = tuple(dict.fromkeys(per_layer))
    return options, tuple(options.index(o) for o in per_layer)


def decode(params: Params, tokens: jax.Array, cache: KVCache | None, num_new: jax.Array | None,
           logits_at: jax.Array | None, block, norm=rms_norm, embed_scale: float | None = None,
           rows: jax.Array | None = None, packed: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """The forward pass of every architecture: `forward`'s contract (see `llama.forward`) around its layer.

    `block(cfg, lp, x, attend) -> (x, update)` is one layer over `x [batch, T, hidden]` with its params `lp`;
    `attend(q, k, v)` (q `[batch, T, q_heads, head_dim]` before RoPE, k and v `[batch, T, kv_heads, head_dim]`)
    rotates and scales the queries (`cfg.query_scale`) and hands them to the cache with the layer's window and
    soft-cap, returning the attention `[batch, T, q_heads, head_dim]` and the cache's update. Layers whose options
    differ are told apart by a `lax.switch` on their index into `attention_kinds`, so each option stays static for
    the cache and its kernels. `norm(x, w, eps)` is the final norm, `embed_scale` multiplies the embeddings.

    `rows [B]` (with a cache): `tokens [B, T]` (and `num_new`, `logits_at`) are for those rows of the cache's batch
    only (an index past the batch: a padding row, dropped), so the projections and the MLP compute B rows whatever
    the cache's batch; the other rows are left as they were and their attention is skipped (`cache.attending`).

    `packed [P]` (without `rows`): the flat places in `[batch * T]` of the tokens to compute (`batch * T`: none, a
    padding row of the packing), so the projections and the MLP compute P rows, the real tokens side by side, however
    ragged the right-padded `tokens`; attention and the cache see them in their `[batch, T]` places as before."""
    cfg = params.config
    batch, n_tok = tokens.shape
    dtype = params.dtype
    given = cache
    if cache is None:
        cache = NoCache(batch, n_tok)
    check_value_basis(params, cache)
    num_new = jnp.full((batch,), n_tok, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    steps = jnp.arange(n_tok, dtype=jnp.int32)[None, :]
    if rows is None:
        bad_tokens = check_inputs(tokens, num_new, logits_at, cache, cfg.vocab_size)
        num_new = jnp.clip(num_new, 0, n_tok)
        positions = cache.length[:, None] + steps  # [batch, T]
        to_cache, of_rows, seen = num_new, (lambda a: a), cache
        row_positions = positions
    else:
        held = cache.length.shape[0]
        of_rows = lambda a: a.at[rows].get(mode="fill", fill_value=0)  # noqa: E731 ([held, ...] -> [B, ...])
        row_view = NoCache(batch, cache.max_tokens).replace(length=of_rows(cache.length))  # for the input checks
        bad_tokens = check_inputs(tokens, num_new, logits_at, row_view, cfg.vocab_size)
        num_new = jnp.clip(num_new, 0, n_tok)
        to_cache = jnp.zeros((held,), jnp.int32).at[rows].set(num_new, mode="drop")  # [held]
        seen = cache.attending(jnp.zeros((held,), bool).at[rows].set(True, mode="drop"))
        positions = seen.length[:, None] + steps  # [held, T]
        row_positions = of_rows(cache.length)[:, None] + steps  # [B, T]

    def to_held(a):  # [B, ...] -> [held, ...], zeros elsewhere
        return a if rows is None else jnp.zeros((held,) + a.shape[1:], a.dtype).at[rows].set(a, mode="drop")

    if packed is not None:
        if rows is not None:
            raise ValueError("decode takes `rows` or `packed`, not both")
        size = packed.shape[0]
        # each place's row in the packing (`size` where no token is packed), found once a call: packing and unpacking
        # are both gathers, not scatters
        rows_of = jnp.full((batch * n_tok,), size, jnp.int32).at[packed].set(jnp.arange(size, dtype=jnp.int32),
                                                                            mode="drop")

        def pack(a):  # [batch, T, ...] -> [1, P, ...]
            return a.reshape(batch * n_tok, *a.shape[2:]).at[packed].get(mode="fill", fill_value=0)[None]

        def unpack(a):  # [1, P, ...] -> [batch, T, ...], zeros at the padding
            return a[0].at[rows_of].get(mode="fill", fill_value=0).reshape(batch, n_tok, *a.shape[2:])
    else:
        pack = unpack = lambda a: a  # noqa: E731
    rope = Rotary(rope_inv_freq(cfg))
    options, kinds = attention_kinds(cfg)
    q_scale = cfg.query_scale
    # a chunk's queries in bfloat16 where the matmuls dot in bfloat16: its attention dots so too (attention.Rows)
    chunk_queries = jnp.bfloat16 if n_tok > 1 and weights.dots_in_bfloat16(params.layers) else None

    # Float leaves are sliced by the scan; quantized ones stay whole and are read at the layer index (no copy).
    sliced, whole = weights.split_stacked(params.layers)

    def layer_step(x, xs):
        lp, layer, kind = xs
        lp = weights.join_layer(lp, whole, layer)

        def attend(q, k, v):
            q, k, v = unpack(q), unpack(k), unpack(v)
            q = rope(q, row_positions)
            if q_scale != 1.0:
                q = q * jnp.asarray(q_scale, q.dtype)
            if chunk_queries is not None:
                q = q.astype(chunk_queries)
            q, k, v = to_held(q), to_held(k), to_held(v)
            branches = [functools.partial(seen.attend, layer, q, k, v, positions, rope, to_cache, window,
                                          softcap=cap) for window, cap in options]
            out, update = branches[0]() if len(branches) == 1 else jax.lax.switch(kind, branches)
            return pack(of_rows(out).astype(dtype)), update

        return block(cfg, lp, x, attend)

    x = weights.table_rows(params.embed, jnp.clip(tokens, 0, cfg.vocab_size - 1), dtype)  # [batch, T, hidden]
    if embed_scale is not None:
        x = x * jnp.asarray(embed_scale, dtype)
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    layer_kinds = jnp.asarray(kinds, jnp.int32) if len(options) > 1 else None  # [layers]
    # The cache is only read inside the loop; every layer's update comes out stacked and is written once after it.
    x, updates = jax.lax.scan(layer_step, pack(x), (sliced, layer_ids, layer_kinds))
    x = unpack(x)
    cache = cache.commit(updates, to_cache)
    bad_flags = jnp.where(bad_tokens, BAD_TOKEN, 0).astype(jnp.int32)  # [batch]
    cache = cache.replace(error_flags=cache.error_flags | to_held(bad_flags))
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)  # [batch, 1, hidden]
    x = norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        logits = weights.dot_table(x, params.embed)  # [batch, T, vocab] float32
    else:
        logits = weights.dot_head(x, params.lm_head)
    logits = softcap(logits, cfg.final_logit_softcap)
    poisoned = (of_rows(cache.error_flags) & POISON) != 0  # [batch]
    logits = jnp.where(poisoned[:, None, None], jnp.nan, logits)
    return logits, (cache if given is not None else None)


def forward(params: Params, tokens: jax.Array, cache: KVCache | None = None, num_new: jax.Array | None = None,
            logits_at: jax.Array | None = None, rows: jax.Array | None = None,
            packed: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """The forward pass of whichever architecture `params.config` names (`llama.forward` documents the contract;
    `rows` and `packed`: `decode`'s)."""
    arch = for_config(params.config)
    extra = {k: v for k, v in (("rows", rows), ("packed", packed)) if v is not None}
    return arch.forward(params, tokens, cache, num_new, logits_at, **extra)
