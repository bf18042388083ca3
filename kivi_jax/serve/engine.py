"""The serving engine (docs/design.md §8): a batch cache of S slots, prefill, insert, one decode step, free. No HTTP.

A slot is FREE (nothing in it), LIVE (a request decoding) or HELD (a finished request's cache, kept for prefix reuse
until the slot is needed). `admit` prefills a request into a one-sequence cache (in chunks of a static size, starting
from a held prefix's cache when the prompt extends one), samples its first token and inserts the cache into a slot;
`step` decodes every live slot once in one jitted call; `finish` turns a live slot into a held (or free) one. One
request may take several slots (`n` choices): its prompt is prefilled once and the cache inserted into each. A step
computes only the live slots: their rows, padded to a power of two (a bucket, one compilation each), go through the
model's projections and MLP, and the attention of the other rows is skipped (`forward`'s `rows`; not on a mesh).
With `decode_group` (by default 16 on a CPU, 32 for bf16 weights on AMX, all slots elsewhere:
`default_decode_group`) the slots are split into groups, each its own batch cache, and a step calls the one jitted
decode once per group that holds a live slot.

Every cache leaf is stacked `[layers, batch, ...]` or is `[batch]`; the batch axis of each leaf is derived once by
comparing the shapes of a one-slot and a two-slot cache, so `insert` / `extract` work for any cache kind.

With `mesh` (docs/sharding.md) the params and every group's batch cache are sharded by the table (slots over the
data axis, heads over the model axis), a request is prefilled into a one-sequence cache that is whole on every data
shard (heads still split), and insert / extract move one row between the two without gathering a batch cache.

With `pages` (docs/design.md §12) the slots share one pool of pages through block tables: a request takes its
prompt's pages and then a page as it fills one (on a mesh: data=1 only, the pool's kv heads split over model where
they divide it and every page on every device, the tables and bookkeeping whole on every device); the scheduler
preempts when the pool runs out, and a preempted request comes back through `admit_choices(replay_from=)`: its
prompt prefilled again, its generated tokens fed back one a step on the forced-token path below, so that its cache
is what it was. With `prefix_snapshots` a prompt's prefill keeps its cache at each chunk end (a `Snapshot`), and a
later prompt of the same salt starting with that prefix starts from it and shares its pages (`_prefill_shared`).

Scoring a prompt (`echo` with logprobs, docs/serving.md): each prompt token's log-probability is what a decode step
reading the cache would give it, as `kivi-jax eval` scores text. The first R tokens (all of them for the full cache)
are prefilled in one piece with logits at every position: nothing is quantized before the ring first fills, so that
is exactly what one-token steps would compute. The rest of the prompt is fed one token a step through the batched
decode step, the next prompt token forced instead of sampled (the slot's key chain does not advance meanwhile).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import secrets
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kivi_jax import rotation, sharding, weights
from kivi_jax.cache import SCALE_OVERFLOW, cache_bytes, make_cache, tree_bytes
from kivi_jax.config import REFERENCE, is_reference, parse_cache_spec, spec_name
from kivi_jax.models.decoder import Params
from kivi_jax.runtime import (PACK_BUCKET, PREFILL_CHUNK, PROMPT_BUCKET, ChunkPlan, chunk_plan, chunk_size, decode_step,
                              packed_size, prefill, prefill_scored, prefill_steps, rounded_tokens, sample_first)
from kivi_jax.sampling import Sampling, bitmask_width, row_settings
from kivi_jax.serve.pages import PageAllocator, PoolExhausted

DEFAULT_PREFILL_CHUNK = PREFILL_CHUNK
DEFAULT_PREFILL_BATCH = 8  # prompts prefilled together at most (in power-of-two row counts)
PREFILL_TOKENS = 2048  # tokens a batched prefill call takes at most (rows x the chunk width) on a GPU or TPU
CPU_PREFILL_TOKENS = 512  # ... and on a CPU, where a prefill is compute-bound: more rows a call gain nothing there
# (docs/serving.md), so long prompts go one a call and short ones up to 8 together (the scheduler runs calls up to
# its own budget between two decode steps, `scheduler.STEP_PREFILL_TOKENS`)
PACK_WIDTH = 128  # prompts of at most this many tokens (and one chunk) are prefilled packed: a call computes their
# tokens side by side, whatever their lengths, instead of each padded to its chunk width (docs/serving.md, runs 40-44)
SHARED_PREFIX_MIN = 16  # tokens a packed prefill's prompts must begin with alike (a chat template's system prompt)
# for those to be computed once, and each row's cache to start from that prefix's
SHARED_PREFIXES = 8  # such prefixes' caches kept (one row each), the least recently used dropped first

FREE, LIVE, HELD, FILLING = "free", "live", "held", "filling"  # FILLING: reserved for a batched prefill in progress
SHARED = "shared"  # warm-up's packed jobs whose prompts share their prefix (`Engine._shared_jobs`)


def _spread(tokens: int, n: int) -> list[int]:
    """`n` prompt lengths as even as can be that add up to `tokens` (warm-up's packed prompts)."""
    return [tokens // n + (i < tokens % n) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# Capacity


def abstract_slot_cache(spec, cfg, max_length: int, dtype, batch: int = 1, impl: str = "auto"):
    """A cache of `batch` slots as ShapeDtypeStructs (no allocation)."""
    return jax.eval_shape(lambda: make_cache(spec, cfg, batch, max_length, dtype, impl))


def slot_bytes(spec, cfg, max_length: int, dtype) -> int:
    """Bytes one slot of `max_length` tokens takes in the batch cache (every leaf grows linearly with the batch)."""
    return tree_bytes(abstract_slot_cache(spec, cfg, max_length, dtype))


def slots_in_budget(spec, cfg, max_length: int, dtype, budget: int) -> int:
    """The most slots of `max_length` tokens whose cache fits `budget` bytes."""
    return int(budget // slot_bytes(spec, cfg, max_length, dtype))


def slot_bytes_per_device(spec, cfg, max_length: int, dtype, mesh) -> int:
    """Bytes one device holds for every `data`-axis-size slots (one slot a data shard) on a mesh of that shape."""
    data = sharding.mesh_sizes(mesh)["data"]
    cache = abstract_slot_cache(spec, cfg, max_length, dtype, data)
    return sharding.per_device_bytes(cache, sharding.cache_specs(cache, mesh), mesh)


def capacity_report(spec, cfg, max_length: int, dtype, budget: int, mesh=None) -> dict:
    """Slots that fit `budget` for `spec` and for the full-precision cache, with the bytes a slot takes. With
    `mesh` the budget is per device: the slots are a multiple of the data axis whose shards fit it on every device
    (`slot_bytes_per_device` is what one slot a data shard takes of one device)."""
    out = {"budget_bytes": int(budget), "max_length": max_length}
    data = 1 if mesh is None else sharding.mesh_sizes(mesh)["data"]
    for name, s in (("cache", spec), ("full", REFERENCE)):
        b = slot_bytes(s, cfg, max_length, dtype)
        out[name] = {"spec": spec_name(parse_cache_spec(s)), "slot_bytes": b, "slots": int(budget // b)}
        if mesh is not None:
            per_device = slot_bytes_per_device(s, cfg, max_length, dtype, mesh)
            out[name].update(slot_bytes_per_device=per_device, slots=data * int(budget // per_device))
    return out


MAX_PAGED_ROWS = 256  # rows a paged cache gets by default at most (each holds a ring whatever its pages)


def paged_capacity(spec, cfg, max_length: int, dtype, budget: int | None, slots: int | None,
                   default_slots: int) -> dict:
    """The rows and pool of a paged cache: what a row takes (its ring, sinks, counters and table row), a page, and
    how many of each. With `budget`: `slots` rows (default below) and the pages the rest
    holds; without: `slots` rows (default `default_slots`) and the pages for each to reach `max_length`. The default
    rows with a budget: as many as fit with a quarter of `max_length` in pages each (at most MAX_PAGED_ROWS)."""
    itemsize = jnp.dtype(dtype).itemsize
    row = cache_bytes(spec, cfg, 1, max_length, itemsize, pages=0)
    page = cache_bytes(spec, cfg, 1, max_length, itemsize, pages=1) - row
    one = jax.eval_shape(lambda: make_cache(spec, cfg, 1, max_length, dtype, pages=1))  # shapes only
    per_sequence = one.pages_needed(max_length)
    if budget is None:
        slots = default_slots if slots is None else slots
        pages = max(1, slots * per_sequence)
    else:
        quarter = row + page * -(-per_sequence // 4)
        slots = max(1, min(MAX_PAGED_ROWS, budget // quarter)) if slots is None else slots
        pages = (budget - slots * row) // page
        if pages < 1:
            raise ValueError(f"a cache budget of {budget} bytes leaves no page for {slots} rows of {row} bytes each "
                             f"(pages of {page} bytes); raise the budget or give fewer --slots")
    return {"paged": True, "row_bytes": int(row), "page_bytes": int(page), "slots": int(slots), "pages": int(pages),
            "page_tokens": max_length // one.table.shape[1],
            "pages_a_sequence": int(per_sequence), "budget_bytes": budget}


# ---------------------------------------------------------------------------------------------------------------------
# Jitted pieces


def batch_axes(spec, cfg, max_length: int, dtype, impl: str = "auto") -> tuple[int, ...]:
    """The batch axis of every cache leaf (in `tree_leaves` order): where a one-slot and a two-slot cache differ."""
    one = jax.tree_util.tree_leaves(abstract_slot_cache(spec, cfg, max_length, dtype, 1, impl))
    two = jax.tree_util.tree_leaves(abstract_slot_cache(spec, cfg, max_length, dtype, 2, impl))
    axes = []
    for a, b in zip(one, two):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) != 1 or a.shape[diff[0]] != 1:
            raise ValueError(f"a cache leaf of shape {a.shape} (one slot) / {b.shape} (two) has no single batch axis")
        axes.append(diff[0])
    return tuple(axes)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("batch",))
def insert_cache(batch, many, row: jax.Array, slot: jax.Array, axes: tuple[int, ...]):
    """Copies every leaf of row `row` of the cache `many` (a one-sequence cache, row 0, or a batched prefill's) into
    row `slot` of the batch cache (donated): the slot's whole state, lengths and flags included, so nothing of its
    last occupant survives. `many` may hold fewer tokens (a packed prefill's): its leaves are zero-padded to the
    slot's, as a cache of the slot's tokens would be past what was written."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)

    def row_of(b, o, axis):
        part = jax.lax.dynamic_slice_in_dim(o, row, 1, axis).astype(b.dtype)
        pad = [(0, 0) if i == axis else (0, n - m) for i, (n, m) in enumerate(zip(b.shape, part.shape))]
        return jnp.pad(part, pad) if any(p for _, p in pad) else part

    new = [jax.lax.dynamic_update_slice_in_dim(b, row_of(b, o, axis), slot, axis)
           for b, o, axis in zip(leaves, jax.tree_util.tree_leaves(many), axes)]
    return jax.tree_util.tree_unflatten(treedef, new)


@functools.partial(jax.jit, static_argnames=("rows", "axes"))
def tile_cache(one, rows: int, axes: tuple[int, ...]):
    """A one-sequence cache repeated into `rows` rows, each a copy of it."""
    leaves, treedef = jax.tree_util.tree_flatten(one)
    return jax.tree_util.tree_unflatten(treedef, [jnp.repeat(a, rows, axis) for a, axis in zip(leaves, axes)])


@functools.partial(jax.jit, static_argnames=("axes", "mesh"))
def extract_cache(batch, slot: jax.Array, axes: tuple[int, ...], mesh=None):
    """Row `slot` of the batch cache as a one-sequence cache (a copy). With `mesh`: each data shard slices its
    candidate row and only those D rows are gathered (never the batch cache), so the copy is whole on every data
    shard, its heads split as the batch cache's."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if mesh is None:
        return jax.tree_util.tree_unflatten(
            treedef, [jax.lax.dynamic_slice_in_dim(b, slot, 1, axis) for b, axis in zip(leaves, axes)])
    in_specs = jax.tree_util.tree_leaves(sharding.cache_specs(batch, mesh), is_leaf=lambda x: isinstance(x, P))
    row_cache = jax.tree_util.tree_unflatten(
        treedef, [jax.ShapeDtypeStruct(b.shape[:a] + (1,) + b.shape[a + 1:], b.dtype) for b, a in zip(leaves, axes)])
    out_specs = jax.tree_util.tree_leaves(sharding.cache_specs(row_cache, mesh), is_leaf=lambda x: isinstance(x, P))

    def local(slot, *shards):
        rows = []
        for b, axis in zip(shards, axes):
            n = b.shape[axis]  # slots on this data shard
            mine = jnp.clip(slot - jax.lax.axis_index("data") * n, 0, n - 1)
            gathered = jax.lax.all_gather(jax.lax.dynamic_slice_in_dim(b, mine, 1, axis), "data", axis=axis,
                                          tiled=True)  # one candidate row a data shard
            rows.append(jax.lax.dynamic_slice_in_dim(gathered, slot // n, 1, axis))
        return tuple(rows)

    rows = jax.shard_map(local, mesh=mesh, in_specs=(P(), *in_specs), out_specs=tuple(out_specs),
                         check_vma=False)(slot, *leaves)
    return jax.tree_util.tree_unflatten(treedef, list(rows))


@functools.partial(jax.jit, donate_argnames=("batch",))
def insert_sequence(batch, seq, row: jax.Array, slot: jax.Array):
    """A paged batch cache (donated) whose row `slot` holds row `row` of the contiguous cache `seq`: its tokens
    written into the pages the slot's table row names, its ring, sinks, length and flags copied (under a mesh laid
    out as the table says: the pool's heads split, its pages whole)."""
    return sharding.constrain_cache(batch.with_sequence(seq, row, slot))


@functools.partial(jax.jit, donate_argnames=("cache",))
def reset_length(cache, slot: jax.Array):
    """A freed slot's length back to 0, so the decode loop no longer walks its old tokens."""
    return cache.replace(length=cache.length.at[slot].set(0))


# ---------------------------------------------------------------------------------------------------------------------
# The engine


class NoFreeSlot(RuntimeError):
    """Every slot is live (or fewer are free than a request's choices)."""


class Out(NamedTuple):
    """What a slot produced in a step: a generated token, or (`prompt`) the next prompt token being scored; with
    logprobs asked for, its log-probability and the MAX_LOGPROBS most likely `(token, logprob)`, most likely first."""

    token: int
    prompt: bool = False
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass
class Admitted:
    """A request in its slots: `first[i]` is choice i's first generated token (None while its prompt is still being
    scored, one token a step); `prompt_scores` (when asked) the scores of the prompt's tokens after the first that the
    prefill computed (the rest come from `step` as `Out(prompt=True)`)."""

    slots: list[int]
    first: list[Out | None]
    prompt_scores: list[Out] | None = None


@dataclasses.dataclass
class Waiting:
    """A request as the engine admits it: its prompt, one sampling a choice, whether its tokens are scored
    (`logprobs`) and each choice's grammar matcher (or None)."""

    prompt: list[int]
    samplings: Sequence[Sampling]
    logprobs: bool = False
    constraints: Sequence | None = None
    max_tokens: int | None = None  # sizes a paged request's pages (None: up to max_length)
    keys: Sequence | None = None  # each choice's sampling key `[2]` to go on from (a preempted request), else seeds
    salt: str = ""  # its tenant's prefix namespace (`cache_salt`): prefixes are shared only within one salt


@dataclasses.dataclass
class Snapshot:
    """A prompt prefix's cache as its prefill left it at a chunk boundary (docs/design.md §12, "Shared prefixes"):
    a one-row contiguous cache of `length` tokens (its ring and sinks as they stood) and the pool pages of its final
    blocks, which the snapshot holds a reference to."""

    length: int
    cache: object
    pages: list[int]


@dataclasses.dataclass
class PrefillJob:
    """Several requests' prompts prefilled together into one cache of `rows` rows (a power of two; rows past the
    requests are empty), one chunk per `Engine.advance`; each request's slots are reserved (FILLING) meanwhile."""

    requests: list[Waiting]
    slots: list[list[int]]  # reserved slots, one a choice, per request
    rows: int
    chunks: object  # the `runtime.prefill_steps` iterator
    plan: ChunkPlan  # the prompts' chunks (one plan for all)
    chunks_left: int
    packed: int | None = None  # packed (short prompts of any lengths, one chunk): the token rows its call computes
    shared: int = 0  # packed: the tokens every prompt begins with, computed once (each row's cache starts with them)
    last: object = None  # logits after each prompt's last token [rows, vocab], once the last chunk ran
    cache: object = None
    taken: list = dataclasses.field(default_factory=list)  # per request: prefix snapshots `(length, cache)` taken
    tokens_run: int = 0  # token rows its chunks computed so far (rows x each chunk's width)


@dataclasses.dataclass
class Slot:
    state: str = FREE
    tokens: list[int] = dataclasses.field(default_factory=list)  # the tokens the slot's cache holds (fed tokens)
    last: int = 0  # the token to feed next (sampled or a prompt token, not yet in the cache)
    sampling: Sampling = Sampling(0.0)
    used_at: float = 0.0  # when it last changed (the least recently used held slot is evicted first)
    forced: collections.deque = dataclasses.field(default_factory=collections.deque)  # prompt tokens to score yet
    logprobs: bool = False  # report each token's logprob and top alternatives
    constraint: object = None  # a grammar's matcher: fill_bitmask(row) before, accept(token) after each draw


CPU_DECODE_GROUP = 16  # slots a decode call covers on a CPU by default (docs/serving.md: at 72 kivi2 slots, 1 to 32
# live, bucketed groups of 16 were faster than one bucketed group of all 72 slots, which won only at 64 live)
CPU_DECODE_GROUP_WIDE = 32  # ... where a step of 32 rows costs well under two of 16: bf16 weights through AMX tiles
# (docs/serving.md run 12: short's ITL p50 45 against 56-57 ms, long's tokens/s 66-67 against 60-62), or 4- and 8-bit
# weights, whose float activations take the native kernel's packed strips past 16 rows (run 38: short's tokens/s
# 1.10-1.14x, ITL p50 81-82 against 101-128 ms)


def cpu_decode_group(params) -> int:
    """The CPU's default decode group for these params: CPU_DECODE_GROUP_WIDE where the native kernels run and every
    matrix is `bf16` with AMX tiles for that many rows, or every matrix is held in 4- or 8-bit codes
    (`weights.native_codes`); else CPU_DECODE_GROUP (and on other backends, which decode all slots in one step)."""
    from kivi_jax import native
    from kivi_jax.native import matmul

    if jax.default_backend() != "cpu" or not native.available():
        return CPU_DECODE_GROUP
    amx = weights.summary(params) == "bf16" and matmul.BF16_ROWS >= CPU_DECODE_GROUP_WIDE
    return CPU_DECODE_GROUP_WIDE if amx or weights.native_codes(params) else CPU_DECODE_GROUP


def default_prefill_tokens() -> int:
    """The batched prefill's token budget when none is given: CPU_PREFILL_TOKENS on the CPU backend, else
    PREFILL_TOKENS."""
    return CPU_PREFILL_TOKENS if jax.default_backend() == "cpu" else PREFILL_TOKENS


def default_decode_group(slots: int, data: int = 1, cpu_group: int = CPU_DECODE_GROUP) -> int:
    """The decode group when none is given: all slots in one step on an accelerator (a memory-bound step: extra rows
    are nearly free), groups of `cpu_group` (`cpu_decode_group`; a multiple of the mesh's data axis) on the CPU
    backend, where every row of a step costs compute: a group's bucketed step computes only its live rows, but the
    cache's own per-row work (the ring, the token-wise value quantization, the kernel's walk) still scales with the
    group's slots."""
    if jax.default_backend() != "cpu" or slots <= cpu_group:
        return slots
    return max(data, cpu_group // data * data)


class Engine:
    """S slots over one batch cache; see the module docstring. Not thread-safe: one thread (the scheduler) owns it."""

    def __init__(
        self,
        params: Params,
        cache: str = "kivi2",
        slots: int = 4,
        max_length: int = 4096,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        attention_impl: str = "auto",
        prefix_reuse: bool = True,
        decode_group: int | None = None,
        mesh=None,
        prefill_batch: int = DEFAULT_PREFILL_BATCH,
        prefill_tokens: int | None = None,
        buckets: bool = True,
        pages: int | None = None,
        grow: bool = True,
        prefix_snapshots: int = 0,
        prefill_precision: str = "float32",
        decode_precision: str = "float32",
        packed_prefill: bool = True,
        weight_strips: bool = True,
    ):
        cfg = params.config
        if pages is not None and mesh is not None:  # heads split over model, every page on every device
            sharding.check_paged_mesh(mesh if isinstance(mesh, (str, dict)) else sharding.resolve_mesh(mesh))
        mesh = sharding.resolve_mesh(mesh)
        data = 1 if mesh is None else sharding.mesh_sizes(mesh)["data"]
        if mesh is not None and jax.process_count() > 1:
            raise ValueError(f"serving runs in one process (this is one of {jax.process_count()}): give a mesh of "
                             "this host's devices")
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        if decode_group is not None and decode_group < 1:
            raise ValueError(f"decode_group={decode_group} must be at least 1 (or None: all slots in one step)")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be at least 1")
        prefill_tokens = default_prefill_tokens() if prefill_tokens is None else prefill_tokens
        if prefill_batch < 1 or prefill_tokens < 1:
            raise ValueError(f"prefill_batch={prefill_batch} and prefill_tokens={prefill_tokens} must be at least 1 "
                             "(prefill_batch 1: one prompt a prefill call)")
        if not 1 < max_length <= cfg.max_position_embeddings:
            raise ValueError(f"max_length={max_length} must be in [2, {cfg.max_position_embeddings}] (the model's "
                             "positions)")
        self.spec = parse_cache_spec(cache)
        self.spec.check_shapes(cfg.head_dim, max_length)
        # Slots in groups of `decode_group` (default: `default_decode_group`), each group its own batch cache: a
        # decode step runs one jitted call per group holding a live slot, so idle groups cost nothing. With buckets a
        # group's call computes only its live rows, padded to a power of two (a few compiled shapes); on a mesh every
        # row (the bucket's gather would cross the data shards).
        self.buckets = buckets and mesh is None
        # a paged cache: one pool, so one group (its idle rows cost their ring, not their reservation)
        if pages is not None:
            group = slots
        else:  # the default only when none is given (finding it may build the native kernels)
            group = min(decode_group or default_decode_group(slots, data, cpu_decode_group(params)), slots)
        self.groups = [(start, min(group, slots - start)) for start in range(0, slots, group)]  # (first slot, size)
        if any(n % data for _, n in self.groups):
            raise ValueError(f"slots={slots} in decode groups of {group}: every group must be a multiple of the mesh's "
                             f"data axis ({data}), so its slots split evenly over the data shards; give slots and "
                             f"--decode-group that are multiples of {data}")
        params = rotation.prepare_params(params, self.spec)
        self.mesh = mesh
        if mesh is not None:
            params = sharding.shard_params(params, mesh)
        elif weight_strips:  # steps past 16 rows decode 4- and 8-bit weights from a strip-major copy (none on a mesh)
            params = weights.with_strips(params)
        self.params, self.cfg, self.dtype, self.impl = params, cfg, params.dtype, attention_impl
        # A plain prompt's prefill dots with operands rounded to `prefill_precision`, every decode step (a scored
        # prompt's forced tokens too) with `decode_precision` (weights.dot_view); a scored prompt's prefill is exact
        prefill_precision = weights.resolve_precision(prefill_precision, params, mesh)
        decode_precision = weights.resolve_precision(decode_precision, params, mesh)
        self.prefill_params = weights.dot_view(params, prefill_precision)
        self.decode_params = weights.dot_view(params, decode_precision, "decode")
        self.prefill_precision, self.decode_precision = prefill_precision, decode_precision
        self.num_slots, self.max_length, self.prefill_chunk = slots, max_length, prefill_chunk
        # Batched prefill: several prompts a call, rows x width within the token budget; on a mesh one at a time (a
        # one-sequence cache is whole on every data shard)
        self.prefill_batch = 1 if mesh is not None else min(prefill_batch, slots)
        self.prefill_tokens = prefill_tokens
        # Packed prefill: prompts of one chunk up to `pack_width` tokens go 2 or more a call, computed side by side in
        # whole PACK_BUCKETs of token rows (and laid out `[rows, pack_width]` for attention and the cache); 0: off
        packs = packed_prefill and self.prefill_batch > 1 and prefill_tokens >= PACK_BUCKET
        self.pack_width = chunk_size(PACK_WIDTH, prefill_chunk) if packs else 0
        # the longest prefix (up to pack_width) this cache holds as computed, nothing of it quantized: a packed
        # prefill's common prefix at most (`common_prefix`)
        keys, values = (np.asarray(q) for q in self.spec.quantized_tokens(np.arange(self.pack_width + 1)))
        self.exact_prefix = int(np.flatnonzero((keys == 0) & (values == 0)).max())
        self.axes = batch_axes(self.spec, cfg, max_length, self.dtype, attention_impl)
        self.caches = [make_cache(self.spec, cfg, n, max_length, self.dtype, attention_impl, mesh=mesh, pages=pages)
                       for _, n in self.groups]
        if mesh is None:  # committed to the device, as every insert's and step's outputs are: a jitted step keys on
            # that, so a group warmed up uncommitted would compile its step again on its first request
            self.caches = jax.device_put(self.caches, jax.devices()[0])
        # Paged (docs/design.md §12): every slot a block table into one pool; pages are taken when a request's slots
        # are reserved and given back when they are freed. Growing (`grow`): a one-choice request takes the pages of
        # its prompt and one token more, then a page each time it fills one (`grow_pages`, before every decode step);
        # the scheduler preempts when the pool runs out. Other requests (several choices, a scored prompt), and all
        # without `grow`, take their prompt and max_tokens' pages at admission.
        self.paged = pages is not None
        # A packed prefill's common prefix, computed once (`common_prefix`): (salt, tokens) -> its one-row cache
        self.shares_prefixes = prefix_reuse
        self.common_caches: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.grow = grow and self.paged
        self.growing: set[int] = set()  # the slots whose pages are taken as they grow (paged)
        # Shared prefixes (paged, `prefix_snapshots` > 0): the newest snapshots, least recently used first
        if prefix_snapshots and not self.paged:
            raise ValueError(f"prefix_snapshots={prefix_snapshots} shares prefix pages: it needs a paged cache")
        if prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots={prefix_snapshots} must be at least 0 (0: no prefix sharing)")
        self.prefix_snapshots = prefix_snapshots
        self.snapshots: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self.snapshot_refs: collections.Counter[int] = collections.Counter()  # page -> snapshots holding it
        self.slot_shared: dict[int, int] = {}  # slot -> its first pages, shared (never written by its insert)
        if self.paged:
            table = self.caches[0].table
            self.allocator = PageAllocator(pages, max_length // table.shape[1], f"{self.spec}")
            self.tables = np.full(table.shape, pages, np.int32)  # [slots, pages a sequence]: the host's block tables
            self.slot_pages: dict[int, list[int]] = {}
            prefix_reuse = False  # a held slot would hold its pages: sharing prefix pages is what replaces it
        self.keys = [self._put(np.zeros((n, 2), np.uint32)) for _, n in self.groups]
        if mesh is None:  # committed, as a step's new keys are (above)
            self.keys = jax.device_put(self.keys, jax.devices()[0])
        self.mask_words = bitmask_width(cfg.vocab_size)
        self.no_mask = [self._put(np.zeros((n, self.mask_words), np.int32)) for _, n in self.groups]  # unconstrained
        self.slot_bytes = slot_bytes(self.spec, cfg, max_length, self.dtype)
        self.slots = [Slot() for _ in range(slots)]
        self.eos = frozenset(cfg.eos_token_ids)
        self.prefix_reuse = prefix_reuse
        self.counters = {"prefill_tokens_computed": 0, "prefix_tokens_reused": 0, "decode_steps": 0,
                         "tokens_generated": 0, "requests_admitted": 0, "prefill_calls": 0, "prefill_rows": 0}
        self.peak_live = 0

    # -- queries ------------------------------------------------------------------------------------------------------

    @property
    def spec_name(self) -> str:
        return spec_name(self.spec)

    def count(self, state: str) -> int:
        return sum(s.state == state for s in self.slots)

    def live_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state == LIVE]

    def has_free_slot(self, n: int = 1) -> bool:
        """Whether `n` slots are free or held (neither live nor reserved for a prefill)."""
        return self.open_slots() >= n

    def open_slots(self) -> int:
        """Slots a new request may take: free or held."""
        return sum(s.state in (FREE, HELD) for s in self.slots)

    @property
    def cache_bytes(self) -> int:
        return tree_bytes(self.caches) if self.paged else self.slot_bytes * self.num_slots

    @property
    def cache_bytes_in_use(self) -> int:
        """Bytes of the slots that hold something (live or held); paged: of the pages in use."""
        if self.paged:
            return self.allocator.used_pages * self.page_bytes
        return self.slot_bytes * (self.num_slots - self.count(FREE))

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes in the pool (the byte formula's difference between one page and none)."""
        itemsize = jnp.dtype(self.dtype).itemsize
        one, none = (cache_bytes(self.spec, self.cfg, 1, self.max_length, itemsize, pages=p) for p in (1, 0))
        return one - none

    def pages_for(self, prompt_tokens: int, max_tokens: int | None, grows: bool = False) -> int:
        """Pages one choice of a request takes in a paged cache (0 for slots): enough for the prompt and max_tokens
        (None: up to max_length), or, for a request that `grows`, for the prompt and the first token fed."""
        if not self.paged:
            return 0
        if grows:
            total = min(prompt_tokens + 1, self.max_length)
        else:
            total = self.max_length if max_tokens is None else min(prompt_tokens + max_tokens, self.max_length)
        return self.caches[0].pages_needed(total)

    def grows(self, n: int = 1, scored: bool = False) -> bool:
        """Whether a request of `n` choices takes its pages as it grows (paged with `grow`, one choice, its prompt not
        scored: a request the scheduler can preempt and recompute) instead of all at admission."""
        return self.paged and self.grow and n == 1 and not scored

    def admission_pages(self, prompt_tokens: int, max_tokens: int | None, n: int = 1, scored: bool = False) -> int:
        """Pages a request of `n` choices takes when it is admitted (0 for slots)."""
        return n * self.pages_for(prompt_tokens, max_tokens, self.grows(n, scored))

    def free_pages(self) -> float:
        """Pages that can be had now (infinite for slots): free, cached, and held by prefix snapshots alone (dropped
        when they are needed)."""
        if not self.paged:
            return float("inf")
        alone = sum(1 for page, n in self.snapshot_refs.items() if self.allocator.refcount(page) == n)
        return self.allocator.free_pages + self.allocator.cached_pages + alone

    def check_pool(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> None:
        """ValueError unless a request of `n` choices could ever fit a paged cache's pool (nothing for slots)."""
        need = n * self.pages_for(prompt_tokens, max_tokens)
        if self.paged and need > self.allocator.num_pages:
            raise ValueError(f"the request needs {need} pages of {self.allocator.page_tokens} tokens ({n} choice(s) "
                             f"of its prompt and max_tokens) and the pool has {self.allocator.num_pages}; lower "
                             "max_tokens or n, or serve with a larger --cache-budget")

    @property
    def headroom(self) -> int:
        """Pages an admission must leave free: one for each growing sequence's next page (vLLM's watermark), so
        that a request just admitted does not make the next step preempt."""
        return len(self.growing) if self.paged else 0

    def can_admit(self, prompt_tokens: int, max_tokens: int | None, n: int = 1, scored: bool = False) -> bool:
        """Whether a request of `n` choices could be admitted now: `n` open slots and, paged, their pages with the
        headroom left."""
        pages = self.admission_pages(prompt_tokens, max_tokens, n, scored)
        return self.has_free_slot(n) and (not self.paged or pages + self.headroom <= self.free_pages())

    def _reserve_pages(self, slots: Sequence[int], prompt_tokens: int, max_tokens: int | None,
                       scored: bool = False, shared: Sequence[int] = ()) -> None:
        """Takes each slot's pages (paged; before anything is written into them) and writes its table row; the first
        are `shared` (a prefix snapshot's, one more reference each), the rest fresh."""
        if not self.paged:
            return
        grows = self.grows(len(slots), scored)
        need = self.pages_for(prompt_tokens, max_tokens, grows)
        shared = list(shared)
        for _ in slots:
            self.allocator.share(shared)  # before `_reclaim` could drop the snapshot that holds them
        self._reclaim((need - len(shared)) * len(slots))
        if not self.allocator.can_allocate((need - len(shared)) * len(slots)):
            for _ in slots:
                self.allocator.release(shared)
            raise NoFreeSlot(f"{len(slots)} choices need {need} pages each; {self.free_pages()} of "
                             f"{self.allocator.num_pages} are free")
        for slot in slots:
            pages = shared + self.allocator.allocate(need - len(shared))
            self.slot_pages[slot] = pages
            self.slot_shared[slot] = len(shared)
            self.tables[slot] = self.allocator.num_pages
            self.tables[slot, :need] = pages
            if grows:
                self.growing.add(slot)

    def pages_wanted(self) -> dict[int, int]:
        """{growing live slot: pages it must take before the next decode step} (the step writes its next token)."""
        if not self.paged:
            return {}
        want = {}
        for slot in sorted(self.growing):
            s = self.slots[slot]
            if s.state == LIVE:
                k = self.caches[0].pages_needed(min(len(s.tokens) + 1, self.max_length)) - len(self.slot_pages[slot])
                if k > 0:
                    want[slot] = k
        return want

    def can_grow(self) -> bool:
        """Whether the pool has the pages the next decode step needs (always, unpaged)."""
        return not self.paged or sum(self.pages_wanted().values()) <= self.free_pages()

    def grow_pages(self) -> None:
        """Gives each growing live slot the pages its next token needs; `PoolExhausted` (nothing taken) when the pool
        has too few: the caller preempts first (`pages_wanted` says how many)."""
        want = self.pages_wanted()
        if not want:
            return
        total = sum(want.values())
        self._reclaim(total)
        if not self.allocator.can_allocate(total):
            raise PoolExhausted(f"the next step needs {total} pages for {len(want)} sequences and "
                                f"{self.free_pages()} are free: preempt a request first")
        for slot, k in want.items():
            held = self.slot_pages[slot]
            new = self.allocator.allocate(k)
            self.tables[slot, len(held) : len(held) + k] = new
            held.extend(new)
        self.caches[0] = self.caches[0].with_table(self._table(self.tables))

    def room(self, prompt_tokens: int) -> int:
        """Tokens a slot has left after a prompt of this many (what max_tokens defaults to), or ValueError when the
        prompt leaves none."""
        if prompt_tokens >= self.max_length:
            raise ValueError(f"the prompt has {prompt_tokens} tokens: a slot holds {self.max_length} tokens, prompt and "
                             f"output together; shorten the prompt to at most {self.max_length - 1} tokens")
        return self.max_length - prompt_tokens

    def check_fits(self, prompt_tokens: int, max_tokens: int, least: int = 1) -> None:
        """Raises ValueError (with the limits) unless a prompt of this many tokens plus `max_tokens` fits a slot
        (`max_tokens` at least `least`: 0 for a prompt that is only scored)."""
        if prompt_tokens < 1:
            raise ValueError("the prompt has no tokens")
        if max_tokens < least:
            raise ValueError(f"max_tokens={max_tokens} must be at least {least}")
        if prompt_tokens + max_tokens > self.max_length:
            room = []
            if max_tokens < self.max_length:
                room.append(f"shorten the prompt to at most {self.max_length - max_tokens} tokens")
            if prompt_tokens < self.max_length:
                room.append(f"lower max_tokens to at most {self.max_length - prompt_tokens}")
            raise ValueError(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: {prompt_tokens + max_tokens} "
                f"tokens do not fit a slot of {self.max_length} tokens; "
                + (" or ".join(room) or f"both must shrink: a prompt of at most {self.max_length - 1} tokens and "
                                        "max_tokens of at most the rest"))

    # -- shared prefixes (paged) --------------------------------------------------------------------------------------

    def _prefix_key(self, tokens: Sequence[int], width: int, salt: str) -> bytes:
        """The key of a prefix: the spec, the prefill's chunk width (its numerics), the salt and the tokens."""
        h = hashlib.sha256(f"{spec_name(self.spec)}|{width}|{len(salt)}:{salt}|".encode())
        h.update(np.asarray(list(tokens), "<i4").tobytes())
        return h.digest()

    def final_pages(self, tokens: int) -> int:
        """Pages of a sequence of `tokens` tokens whose contents are final (a KIVI block once both its keys and
        values are quantized, a full page once full): what a prefix snapshot shares."""
        page = self.allocator.page_tokens
        if is_reference(self.spec):
            return tokens // page
        k, v = self.spec.quantized_tokens(np.asarray([tokens]))
        return int(min(int(np.asarray(k)[0]), int(np.asarray(v)[0]))) // page

    def shared_prefix(self, prompt: Sequence[int], salt: str = "") -> Snapshot | None:
        """The snapshot of the longest prefix of `prompt` (a whole number of its chunks, at least one token short of
        it) kept for this salt, or None."""
        if not self.snapshots:
            return None
        width = chunk_size(len(prompt), self.prefill_chunk)
        for end in range((len(prompt) - 1) // width * width, 0, -width):
            key = self._prefix_key(prompt[:end], width, salt)
            if key in self.snapshots:
                self.snapshots.move_to_end(key)
                return self.snapshots[key]
        return None

    def _keep_snapshots(self, prompt: Sequence[int], taken: list, pages: list[int], salt: str) -> None:
        """Keeps the snapshots `taken` (`(length, one-row cache)` at chunk ends) of a prompt now in `pages`, each
        holding a reference to the pages final at its length; the least recently used go past `prefix_snapshots`."""
        width = chunk_size(len(prompt), self.prefill_chunk)
        for length, cache in taken:
            key = self._prefix_key(prompt[:length], width, salt)
            if key in self.snapshots:
                continue
            held = pages[: self.final_pages(length)]
            self.allocator.share(held)
            self.snapshot_refs.update(held)
            self.snapshots[key] = Snapshot(length, cache, held)
            while len(self.snapshots) > self.prefix_snapshots:
                self._drop_snapshot()

    def _drop_snapshot(self) -> None:
        _, snap = self.snapshots.popitem(last=False)
        self.snapshot_refs.subtract(snap.pages)
        for page in snap.pages:  # only pages some snapshot holds stay counted (`free_pages` walks them)
            if not self.snapshot_refs[page]:
                del self.snapshot_refs[page]
        self.allocator.release(snap.pages)

    def _reclaim(self, pages: int) -> None:
        """Drops the least recently used snapshots until `pages` fresh pages can be allocated (or none is left)."""
        while self.snapshots and not self.allocator.can_allocate(pages):
            self._drop_snapshot()

    def _prefill_shared(self, prompt: list[int], salt: str):
        """Prefills `prompt` from its longest kept prefix snapshot (else from nothing) in the chunks its own prefill
        has (the same width, the same boundaries, so its cache is what a prefill alone gives bit for bit), taking a
        snapshot at each chunk end before the last -> (logits `[1, vocab]`, the cache, the snapshot used or None,
        the snapshots taken)."""
        width = chunk_size(len(prompt), self.prefill_chunk)
        snap = self.shared_prefix(prompt, salt)
        start = 0 if snap is None else snap.length
        cache = self.fresh_cache() if snap is None else jax.tree_util.tree_map(jnp.copy, snap.cache)
        rest = np.asarray([prompt[start:]], np.int32)  # its chunks past `start` are the prompt's own (`ChunkPlan`)
        taken = []
        steps = prefill_steps(self.prefill_params, rest, np.asarray([rest.shape[1]]), cache, width)
        for c, (last, cache) in enumerate(steps):
            end = start + (c + 1) * width
            if end < len(prompt):
                taken.append((end, jax.tree_util.tree_map(jnp.copy, cache)))
        return last, cache, snap, taken

    # -- prefill and insert -------------------------------------------------------------------------------------------

    def _put(self, x: np.ndarray) -> jax.Array:
        """A `[slots, ...]` host array on the device(s): split over the data axis on a mesh."""
        return jnp.asarray(x) if self.mesh is None else sharding.put_batch(x, self.mesh)

    def _table(self, tables: np.ndarray):
        """The host's block tables `[slots, pages a sequence]` on the device(s): whole on every device on a mesh;
        committed to the device otherwise, as the cache leaf it replaces is (a jitted step keys on that)."""
        tables = np.asarray(tables, np.int32)
        return jax.device_put(tables, jax.devices()[0]) if self.mesh is None else sharding.put(tables, self.mesh)

    def fresh_cache(self):
        return make_cache(self.spec, self.cfg, 1, self.max_length, self.dtype, self.impl, mesh=self.mesh)

    def prefill(self, tokens: list[int], cache=None):
        """Prefills `tokens` onto a one-sequence `cache` (default: a fresh one) -> (logits of the last token
        `[1, vocab]`, the cache)."""
        cache = self.fresh_cache() if cache is None else cache
        with sharding.use_mesh(self.mesh):
            return prefill(self.prefill_params, np.asarray([tokens], np.int32), np.asarray([len(tokens)]), cache,
                           self.prefill_chunk, self.mesh)

    def _where(self, slot: int) -> tuple[int, int]:
        """(group, row in the group's batch cache) of a slot."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is not in [0, {self.num_slots})")
        group = slot // self.groups[0][1]
        return group, slot - self.groups[group][0]

    def insert(self, seq_cache, slot: int, row: int = 0) -> None:
        """Copies row `row` of a cache (a one-sequence cache: row 0) into batch row `slot` (jitted, the batch cache
        donated); paged, into the slot's pages."""
        g, r = self._where(slot)
        if self.paged:
            tables, shared = self.tables, self.slot_shared.get(slot, 0)
            if shared:  # a prefix snapshot's pages hold these blocks already: the writes there are dropped
                tables = tables.copy()
                tables[slot, :shared] = self.allocator.num_pages
            with sharding.use_mesh(self.mesh):
                self.caches[0] = insert_sequence(self.caches[0].with_table(self._table(tables)), seq_cache,
                                                 jnp.int32(row), jnp.int32(slot))
            if shared:
                self.caches[0] = self.caches[0].with_table(self._table(self.tables))
            return
        with sharding.use_mesh(self.mesh):
            self.caches[g] = insert_cache(self.caches[g], seq_cache, jnp.int32(row), jnp.int32(r), self.axes)

    def extract(self, slot: int):
        """Batch row `slot` as a one-sequence cache (a copy)."""
        g, row = self._where(slot)
        with sharding.use_mesh(self.mesh):
            return extract_cache(self.caches[g], jnp.int32(row), self.axes, self.mesh)

    def _reusable(self, prompt: list[int]) -> int | None:
        """The held slot with the longest token list that is a proper prefix of `prompt` (None if there is none)."""
        if not self.prefix_reuse:
            return None
        best, best_len = None, 0
        for i, s in enumerate(self.slots):
            n = len(s.tokens)
            if s.state == HELD and best_len < n < len(prompt) and prompt[:n] == s.tokens:
                best, best_len = i, n
        return best

    def _pick_slot(self, taken: Sequence[int] = ()) -> int:
        """A slot for a new sequence (`taken`: slots this admission already chose), placed so that the live rows
        stay in few decode groups, each group with a live row being a call of every decode step: the open slots
        (free or held) of the group with the most busy ones (live, filling or taken); where no group with a busy
        slot has room, of the largest group, the one with the most free slots first. There a free slot, else the
        least recently used held one (its prefix is lost)."""
        taken = set(taken)
        busy = lambda i: i in taken or self.slots[i].state in (LIVE, FILLING)  # noqa: E731
        best, best_rank = None, None
        for first, n in self.groups:
            members = range(first, first + n)
            open_ = [i for i in members if not busy(i) and self.slots[i].state in (FREE, HELD)]
            if not open_:
                continue
            free = [i for i in open_ if self.slots[i].state == FREE]
            rank = (sum(map(busy, members)), n, len(free))
            if best_rank is None or rank > best_rank:
                best_rank = rank
                best = free[0] if free else min(open_, key=lambda i: self.slots[i].used_at)
        if best is None:
            raise NoFreeSlot(f"all {self.num_slots} slots are live")
        return best

    def prefill_scored(self, tokens: list[int], targets: list[int]):
        """Prefills `tokens` onto a fresh one-sequence cache, scoring each position's prediction of `targets` (as
        long as `tokens`; the next prompt token at each) -> (scores `[Out]`, the logits after the last token
        `[1, vocab]`, the cache). Chunks as `runtime.prefill` makes them."""
        with sharding.use_mesh(self.mesh):
            scores, last, cache = prefill_scored(self.params, tokens, targets, self.fresh_cache(), self.prefill_chunk,
                                                 self.mesh)
        return [Out(t, True, lp, top) for t, lp, top in scores], last, cache

    def _masks(self, rows: list[Slot], constrained: list[bool], g: int | None = None):
        """The bitmask `[rows, words]` of a group (or of a request's choices, `g` None) and whether any row uses it."""
        if not any(constrained):
            return (self.no_mask[g] if g is not None else jnp.zeros((len(rows), self.mask_words), jnp.int32)), False
        bits = np.full((len(rows), self.mask_words), -1, np.int32)
        for r, (s, c) in enumerate(zip(rows, constrained)):
            if c:
                s.constraint.fill_bitmask(bits[r])
        return (self._put(bits) if g is not None else jnp.asarray(bits)), True

    def admit(self, prompt: list[int], sampling: Sampling) -> tuple[int, int]:
        """Prefills `prompt` (reusing a held prefix when one matches), samples its first token and puts it in a slot.
        Returns (slot, first token). The slot is live until `finish`."""
        admitted = self.admit_choices(prompt, [sampling])
        return admitted.slots[0], admitted.first[0].token

    def admit_choices(self, prompt: list[int], samplings: Sequence[Sampling], *, score_prompt: bool = False,
                      logprobs: bool = False, constraints: Sequence | None = None,
                      max_tokens: int | None = None, keys: Sequence | None = None,
                      replay_from: int | None = None, salt: str = "") -> Admitted:
        """Prefills `prompt` once and puts it in one slot per choice (each with its own sampling and key, from its
        seed). Without `score_prompt` a held prefix is reused when one matches and every choice's first token is
        sampled now; with it the prompt is scored (see the module docstring; the first prompt token has no score) and
        the choices start live on the prompt's remaining tokens, if any. `logprobs`: every Out carries its scores;
        `constraints[i]`: choice i's grammar matcher (or None); `max_tokens` (None: up to max_length) sizes a paged
        request's pages; `keys`: each choice's key to go on from (else from its seed). `replay_from`: prefill only
        `prompt[:replay_from]` and feed the rest one token a decode step, not drawn (a preempted request replaying
        its original prompt's prefill and then the tokens it generated, so that its cache and logits are what they
        were bit for bit; its first Outs are those tokens, marked `prompt`). `salt`: its prefix namespace (with
        `prefix_snapshots`, a prompt starting with a kept prefix of this salt shares its pages and starts from its
        snapshot)."""
        k, constraints = self.check_request(prompt, samplings, constraints, max_tokens)
        if not self.can_admit(len(prompt), max_tokens, k, score_prompt):
            raise NoFreeSlot(f"{k} choices need {self.admission_pages(len(prompt), max_tokens, k, score_prompt)} "
                             f"pages and {self.headroom} more kept free; {self.free_pages()} are free")
        slots, start, seq = [], 0, None
        scores, shared, taken = None, [], []
        if score_prompt:
            # the prompt tokens one prefill scores as decode steps would (a KIVI cache: until the ring first fills)
            done = self.spec.exact_prefill(len(prompt))
            scores, logits, seq = self.prefill_scored(prompt[:done], (prompt[1:] + [self.cfg.pad_id])[:done])
            scores = scores[: len(prompt) - 1]  # the last position predicts the first generated token
        elif replay_from is not None:
            if not 0 < replay_from < len(prompt):
                raise ValueError(f"replay_from={replay_from} must be in [1, {len(prompt)}) (the original prompt)")
            logits, seq = self.prefill(prompt[:replay_from])
            done = replay_from
        elif self.prefix_snapshots:
            logits, seq, snap, taken = self._prefill_shared(prompt, salt)
            if snap is not None:
                start, shared = snap.length, snap.pages
            done = len(prompt)
        else:
            reuse = self._reusable(prompt)
            if reuse is not None:
                slots, start, seq = [reuse], len(self.slots[reuse].tokens), self.extract(reuse)
            logits, seq = self.prefill(prompt[start:], seq)
            done = len(prompt)
        while len(slots) < k:
            slots.append(self._pick_slot(slots))
        self._reserve_pages(slots, len(prompt), max_tokens, score_prompt, shared)
        if taken:
            self._keep_snapshots(prompt, taken, self.slot_pages[slots[0]], salt)
        admitted = self._place(Waiting(prompt, samplings, logprobs, constraints, keys=keys), slots, logits, seq, 0, done)
        admitted.prompt_scores = scores
        self.counters["prefill_tokens_computed"] += done - start
        self.counters["prefix_tokens_reused"] += start
        return admitted

    def check_request(self, prompt: list[int], samplings: Sequence[Sampling], constraints,
                      max_tokens: int | None = None) -> tuple[int, list]:
        """(choices, a constraint or None each) of a request that fits a slot (paged: and the pool, `max_tokens`
        None: up to max_length), or ValueError / NoFreeSlot."""
        k = len(samplings)
        constraints = list(constraints) if constraints is not None else [None] * k
        if k < 1 or len(constraints) != k:
            raise ValueError(f"{k} choices with {len(constraints)} constraints: give one or more choices, a "
                             "constraint (or None) for each")
        self.check_fits(len(prompt), 1)
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        self.check_pool(len(prompt), max_tokens, k)
        if not self.has_free_slot(k):
            raise NoFreeSlot(f"{k} choices need {k} slots that are neither live nor reserved; "
                             f"{self.open_slots()} of {self.num_slots} are")
        return k, constraints

    def _place(self, req: Waiting, slots: list[int], logits, cache, row: int, done: int) -> Admitted:
        """Puts a prefilled request into its `slots` (one a choice): row `row` of `cache` holds its first `done`
        prompt tokens, `logits [1, vocab]` what follows them. Each choice draws its first token now when the whole
        prompt is in; otherwise the prompt goes on one token a step, scored."""
        prompt, samplings, constraints, k = req.prompt, req.samplings, req.constraints, len(req.samplings)
        keys = jnp.stack([jax.random.PRNGKey(s.seed if s.seed is not None else secrets.randbits(31))
                          if req.keys is None else jnp.asarray(req.keys[i], jnp.uint32)
                          for i, s in enumerate(samplings)])  # [choices, 2]
        rows = [Slot(LIVE, list(prompt[:done]), 0, s, time.monotonic(), collections.deque(prompt[done + 1 :]),
                     req.logprobs, c) for s, c in zip(samplings, constraints)]
        first: list[Out | None] = [None] * k
        if done == len(prompt):  # the whole prompt is in: each choice draws its first token from the last logits
            bitmask, _ = self._masks(rows, [c is not None for c in constraints])
            with sharding.use_mesh(self.mesh):
                out = sample_first(logits, keys, *row_settings(samplings),
                                   jnp.asarray([c is not None for c in constraints]), bitmask,
                                   jnp.full((k,), req.logprobs))
            keys = out.keys
            first = self._outs(rows, np.asarray(out.tokens),
                               (out.logprob, out.top_ids, out.top_logprobs) if req.logprobs else None)
            for r, o in zip(rows, first):
                r.last = o.token
            self.counters["tokens_generated"] += k
        else:  # the keys start unsplit, as sample_first gets them
            for r in rows:
                r.last = prompt[done]
        for i, (slot, r) in enumerate(zip(slots, rows)):
            self.insert(cache, slot, row)
            g, gr = self._where(slot)
            with sharding.use_mesh(self.mesh):
                self.keys[g] = self.keys[g].at[gr].set(keys[i])
            self.slots[slot] = r
        self.counters["requests_admitted"] += 1
        self.peak_live = max(self.peak_live, self.count(LIVE))
        return Admitted(slots, first)

    # -- batched prefill ----------------------------------------------------------------------------------------------

    def batchable(self, prompt: list[int], salt: str = "") -> bool:
        """Whether a (plain, unscored) request may be prefilled in a batch: batching is on and no held prefix
        would spare it the work."""
        return self.prefill_batch > 1 and self._reusable(prompt) is None and self.shared_prefix(prompt, salt) is None

    def packable(self, prompt: list[int]) -> bool:
        """Whether the prompt may go into a packed prefill: packing is on and it is one chunk of at most
        `pack_width` tokens."""
        return 0 < len(prompt) <= self.pack_width

    def packs(self, prompts: Sequence[list[int]]) -> bool:
        """Whether one batched prefill of `prompts` is packed: two or more, every one packable."""
        return len(prompts) > 1 and all(self.packable(p) for p in prompts)

    def fits(self, prompts: Sequence[list[int]], salts: Sequence[str] = ()) -> bool:
        """Whether one batched prefill takes all of `prompts` (of `salts`, one each; none: one salt): packed, at most
        `prefill_batch` whose tokens past their `common_prefix`, in whole PACK_BUCKETs, stay within the token budget;
        else 1 to `prefill_room` prompts of one `prefill_shape`."""
        if self.packs(prompts):
            computed = sum(map(len, prompts)) - len(prompts) * self.common_prefix(prompts, salts)
            return len(prompts) <= self.prefill_batch and packed_size(computed) <= self.prefill_tokens
        shapes = {self.prefill_shape(p) for p in prompts}
        return len(shapes) == 1 and len(prompts) <= self.prefill_room(next(iter(shapes)))

    def joins(self, prompts: Sequence[list[int]], prompt: list[int], salts: Sequence[str] = ()) -> bool:
        """Whether one batched prefill may take `prompt` beside `prompts` (those `start_prefill` would take; `salts`:
        theirs and then its own, or none: one salt)."""
        return self.fits([*prompts, prompt], salts)

    def prefill_shape(self, prompt: list[int]) -> ChunkPlan:
        """The chunks of the prompt's prefill (width, count, the last's width): prompts of one shape are prefilled
        together, so that each sees the chunks it sees alone and none computes chunks past its own end."""
        return chunk_plan(len(prompt), self.prefill_chunk)

    def prefill_room(self, shape: ChunkPlan) -> int:
        """The most prompts of prefill shape `shape` one batched prefill takes: at most `prefill_batch`, and no more
        than the largest power of two of rows (what `start_prefill` pads a batch to) within the token budget."""
        rows = max(1, self.prefill_tokens // shape.width)
        return min(self.prefill_batch, 1 << (rows.bit_length() - 1))

    def start_prefill(self, requests: Sequence[Waiting]) -> PrefillJob:
        """Reserves the slots of `requests` (one a choice; prompts that one batched prefill `fits`: two or more
        packable ones, packed, or prompts of one `prefill_shape`, at most `prefill_room` of them) and sets up their
        prefill into one cache; `advance` runs it a chunk at a time. A request that does not fit raises as
        `admit_choices` does, before anything is reserved."""
        requests = list(requests)
        prompts, salts = [r.prompt for r in requests], [r.salt for r in requests]
        packed = self.packs(prompts)
        if not self.fits(prompts, salts):
            if packed:
                raise ValueError(f"a packed prefill takes at most prefill_batch={self.prefill_batch} prompts within "
                                 f"prefill_tokens={self.prefill_tokens} (whole {PACK_BUCKET}s), not {len(prompts)} "
                                 f"of {sum(map(len, prompts))} tokens")
            raise ValueError(f"a batched prefill takes 1 to prefill_room prompts of one prefill shape, not "
                             f"{len(prompts)} of shapes {sorted({self.prefill_shape(p) for p in prompts})}")
        plan = chunk_plan(self.pack_width, self.prefill_chunk) if packed else self.prefill_shape(prompts[0])
        need = pages = 0
        for r in requests:
            k, r.constraints = self.check_request(r.prompt, r.samplings, r.constraints, r.max_tokens)
            need += k
            pages += self.admission_pages(len(r.prompt), r.max_tokens, k)
        if not self.has_free_slot(need) or (self.paged and pages + self.headroom > self.free_pages()):
            raise NoFreeSlot(f"{len(requests)} requests need {need} slots and {pages} pages ({self.headroom} more kept "
                             f"free); {self.open_slots()} slots and {self.free_pages()} pages are open")
        slots = []
        for r in requests:
            mine = []
            for _ in r.samplings:
                slot = self._pick_slot()
                self.slots[slot] = Slot(FILLING)
                mine.append(slot)
            self._reserve_pages(mine, len(r.prompt), r.max_tokens)
            slots.append(mine)
        rows = 1 << (len(requests) - 1).bit_length()  # a power of two: few compiled shapes
        longest = plan.width if packed else max(len(r.prompt) for r in requests)
        shared = self.common_prefix(prompts, salts) if packed else 0
        tokens = np.full((rows, longest), self.cfg.pad_id, np.int32)
        lengths = np.zeros(rows, np.int32)  # empty rows: nothing prefilled
        for i, r in enumerate(requests):  # packed with a common prefix: what follows it, onto its cache
            tokens[i, : len(r.prompt) - shared] = r.prompt[shared:]
            lengths[i] = len(r.prompt) - shared
        if shared:
            cache = tile_cache(self._prefix_cache(requests[0].prompt[:shared], requests[0].salt), rows, self.axes)
        else:
            cache = make_cache(self.spec, self.cfg, rows, self.job_tokens(packed), self.dtype, self.impl)
        size = packed_size(int(lengths.sum())) if packed else None
        return PrefillJob(requests, slots, rows, prefill_steps(self.prefill_params, tokens, lengths, cache,
                                                               self.prefill_chunk, packed=size),
                          plan, plan.chunks, size, shared)

    def job_tokens(self, packed: bool) -> int:
        """The tokens a batched prefill's cache holds: packed, one chunk of `pack_width` (the insert pads it to the
        slot's), not max_length's (whose zeros cost a call of 8 rows about 8% more); else max_length."""
        if not packed:
            return self.max_length
        return min(rounded_tokens(self.pack_width, self.spec), self.max_length)

    def common_prefix(self, prompts: Sequence[list[int]], salts: Sequence[str] = ()) -> int:
        """The tokens a packed prefill of `prompts` (of `salts`, one each; none: one salt) computes once for all of
        them (0: none): what every prompt begins with, when prefix reuse is on, the salts agree (prefixes are shared
        only within one) and it is at least SHARED_PREFIX_MIN tokens, one short of the shortest prompt at most (each
        computes a token of its own), within `exact_prefix` (what follows attends to the prefix as a prefill alone
        would: unquantized) and leaves a chunk's room in the job's cache."""
        if not self.shares_prefixes or len(set(salts)) > 1 or len(prompts) < 2:
            return 0
        limit = min(min(map(len, prompts)) - 1, self.exact_prefix, self.job_tokens(True) - self.pack_width)
        n = 0
        while n < limit and all(p[n] == prompts[0][n] for p in prompts):
            n += 1
        return n if n >= SHARED_PREFIX_MIN else 0

    def _prefix_cache(self, prefix: list[int], salt: str):
        """The one-row cache (of a packed job's tokens) holding `prefix`: kept from an earlier job of this salt, or
        prefilled now (a packed call of two rows, one empty: warm-up's smallest) and kept, SHARED_PREFIXES at most."""
        key = (salt, tuple(prefix))
        if key in self.common_caches:
            self.common_caches.move_to_end(key)
            return self.common_caches[key]
        tokens = np.full((2, self.pack_width), self.cfg.pad_id, np.int32)
        tokens[0, : len(prefix)] = prefix
        cache = make_cache(self.spec, self.cfg, 2, self.job_tokens(True), self.dtype, self.impl)
        _, cache = prefill(self.prefill_params, tokens, np.array([len(prefix), 0], np.int32), cache,
                           self.prefill_chunk, packed=packed_size(len(prefix)))
        self.counters["prefill_tokens_computed"] += len(prefix)
        self.counters["prefill_calls"] += 1
        self.common_caches[key] = extract_cache(cache, jnp.int32(0), self.axes)
        while len(self.common_caches) > SHARED_PREFIXES:
            self.common_caches.popitem(last=False)
        return self.common_caches[key]

    def advance(self, job: PrefillJob) -> list[Admitted] | None:
        """Runs the job's next prefill chunk; after the last, each request's choices draw their first tokens and
        go live in their slots: returns their `Admitted` (in the job's order), else None."""
        job.last, job.cache = next(job.chunks)
        plan = job.plan
        job.tokens_run += job.packed or job.rows * (plan.width if job.chunks_left > 1 else plan.tail)  # the call run
        job.chunks_left -= 1
        self.counters["prefill_calls"] += 1
        if self.prefix_snapshots:  # each prompt's cache at this chunk end, if its prompt goes on past it
            if not job.taken:
                job.taken = [[] for _ in job.requests]
            end = (plan.chunks - job.chunks_left) * plan.width
            for i, req in enumerate(job.requests):
                if end < len(req.prompt):
                    job.taken[i].append((end, extract_cache(job.cache, jnp.int32(i), self.axes)))
        if job.chunks_left:
            return None
        out = []
        for i, (req, slots) in enumerate(zip(job.requests, job.slots)):
            out.append(self._place(req, slots, job.last[i : i + 1], job.cache, i, len(req.prompt)))
            if job.taken and job.taken[i]:
                self._keep_snapshots(req.prompt, job.taken[i], self.slot_pages[slots[0]], req.salt)
            self.counters["prefill_tokens_computed"] += len(req.prompt) - job.shared
            self.counters["prefix_tokens_reused"] += job.shared
        self.counters["prefill_rows"] += job.rows
        job.cache = job.last = None
        return out

    def abandon(self, job: PrefillJob) -> None:
        """Frees the slots a job reserved (its requests failed or were cancelled before they went live)."""
        for slots in job.slots:
            for slot in slots:
                if self.slots[slot].state == FILLING:
                    self.free(slot)
        job.cache = job.last = None

    def _outs(self, rows: list[Slot], tokens: np.ndarray, scored) -> list[Out]:
        """Each row's Out from the drawn or forced `tokens`; a generated token advances the row's constraint."""
        if scored is not None:
            lp, ids, top = (np.asarray(x) for x in scored)
        outs = []
        for r, s in enumerate(rows):
            token = int(tokens[r])
            prompt = bool(s.forced)
            if prompt:
                s.forced.popleft()
            elif s.constraint is not None:
                s.constraint.accept(token)
            if scored is None or not s.logprobs:
                outs.append(Out(token, prompt))
            else:
                outs.append(Out(token, prompt, float(lp[r]), tuple(zip(ids[r].tolist(), top[r].tolist()))))
        return outs

    # -- decode -------------------------------------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        """Feeds every live slot its last token: {slot: the token it produced} (see `step_scored`)."""
        return {slot: out.token for slot, out in self.step_scored().items()}

    def step_scored(self) -> dict[int, Out]:
        """Feeds every live slot its last token and samples the next (or takes the next prompt token of a slot still
        scoring its prompt): {slot: Out}. Free and held slots get a pad token and 0 new tokens; a group without a live
        slot is not run. With `buckets` a group computes only its live rows, padded to a power of two (at most the
        group; `runtime.decode_step`'s `rows`), and the other rows' attention is skipped; otherwise (a mesh) every row."""
        live = self.live_slots()
        if not live:
            return {}
        self.grow_pages()
        pending = []
        for g, (first, n) in enumerate(self.groups):
            idx = [i for i in range(n) if self.slots[first + i].state == LIVE]  # live rows of the group
            if not idx:
                continue
            width = min(1 << (len(idx) - 1).bit_length(), n)
            picked = idx + [n] * (width - len(idx)) if self.buckets else list(range(n))  # n: a padding row
            chosen, wanted = self._dispatch(g, picked)
            nxt, lp, ids, top = chosen.tokens, chosen.logprob, chosen.top_ids, chosen.top_logprobs
            at = [j for j, i in enumerate(picked) if i < n and self.slots[first + i].state == LIVE]
            pending.append(([first + picked[j] for j in at], at, nxt, (lp, ids, top) if wanted.any() else None))
        out = {}
        for slots, at, nxt, scored in pending:  # all dispatched, then read
            tokens = np.asarray(nxt)[at]
            if scored is not None:
                scored = tuple(np.asarray(x)[at] for x in scored)
            for i in slots:
                self.slots[i].tokens.append(self.slots[i].last)
            for i, o in zip(slots, self._outs([self.slots[i] for i in slots], tokens, scored)):
                self.slots[i].last = o.token
                out[i] = o
                self.counters["tokens_generated"] += not o.prompt
        self.counters["decode_steps"] += 1
        return out

    def _dispatch(self, g: int, picked: list[int]):
        """Runs group `g`'s jitted decode step over its rows `picked` (a bucket: row indices in the group, the group's
        size for a padding row; without buckets every row) -> (`Chosen`, which rows asked for log-probabilities)."""
        first, n = self.groups[g]
        rows = [self.slots[first + i] if i < n else Slot() for i in picked]
        mask = np.array([s.state == LIVE for s in rows])
        tokens = np.array([s.last if s.state == LIVE else self.cfg.pad_id for s in rows], np.int32)
        sampling = [s.sampling if s.state == LIVE else Sampling(0.0) for s in rows]
        forced = np.array([s.state == LIVE and bool(s.forced) for s in rows])
        forced_next = np.array([s.forced[0] if f else 0 for s, f in zip(rows, forced)], np.int32)
        constrained = [s.state == LIVE and s.constraint is not None and not f for s, f in zip(rows, forced)]
        wanted = np.array([s.state == LIVE and s.logprobs for s in rows])
        bitmask, _ = self._masks(rows, constrained, None if self.buckets else g)
        with sharding.use_mesh(self.mesh):
            chosen, self.caches[g] = decode_step(
                self.decode_params, self._put(tokens), self._put(mask), self.caches[g], self.keys[g],
                *row_settings(sampling, self._put), self._put(forced), self._put(forced_next),
                self._put(np.array(constrained)), bitmask, self._put(wanted),
                jnp.asarray(np.array(picked, np.int32)) if self.buckets else None)
        self.keys[g] = chosen.keys
        return chosen, wanted

    def warm_up(self) -> dict:
        """Compiles what serving runs before the first request comes (each program compiles in 1-3 s on a 2-core
        CPU, which a request would otherwise wait): a batched prefill of every shape the scheduler forms (rows, a
        power of two up to what the token budget takes, times each chunk width; packed, rows times each packed
        size), each request's insert and first draw (into each size of decode group), and every decode bucket of
        every group (rows that are all padding: nothing changes). The engine is left as it was: slots free, pages
        back, counters and snapshots untouched. Returns the programs run and the seconds taken."""
        t0 = time.monotonic()
        counters, peak, keep = dict(self.counters), self.peak_live, self.prefix_snapshots
        self.prefix_snapshots = 0  # warm-up prompts keep no snapshot
        runs = 0
        try:
            widths = sorted({chunk_size(t, self.prefill_chunk) for t in range(1, self.prefill_chunk + 1, PROMPT_BUCKET)})
            packed = self._packed_jobs()
            # every prefill shape into the first group, and the smallest of each row count into the first group of
            # each other size: an insert and a first draw compile for the group's shape (the others' slots held back)
            sizes = {}
            for start, n in self.groups:
                sizes.setdefault(n, start)
            plans = [(self._width_jobs(width), False, self.groups[0]) for width in widths]
            plans += [(packed, True, self.groups[0]), (self._shared_jobs(), SHARED, self.groups[0])]
            smallest = [(self._width_jobs(widths[0]), False)] + [([job for job in packed if len(job) == rows][:1], True)
                                                                 for rows in sorted({len(job) for job in packed})]
            plans += [(jobs, packs, (start, n)) for n, start in sizes.items() if start != self.groups[0][0]
                      for jobs, packs in smallest]
            for jobs, packs, (start, n_group) in plans:
                runs += self._warm_prefills(jobs, packs, start, n_group)
            for g, (_, n) in enumerate(self.groups):
                buckets = sorted({min(1 << k, n) for k in range(n.bit_length() + 1)}) if self.buckets else [n]
                for width in buckets:
                    chosen, _ = self._dispatch(g, [n] * width if self.buckets else list(range(n)))
                    jax.block_until_ready(chosen.tokens)
                    runs += 1
        finally:
            self.counters.clear()
            self.counters.update(counters)
            self.peak_live, self.prefix_snapshots = peak, keep
            self.common_caches.clear()
        return {"programs": runs, "seconds": round(time.monotonic() - t0, 1)}

    def _width_jobs(self, width: int) -> list[list[int]]:
        """Warm-up's prefills of prompts `width` tokens long: the prompt lengths of one job for each row count
        `start_prefill` forms of them (one row where two or more would be packed)."""
        room = self.prefill_room(chunk_plan(width, self.prefill_chunk)) if self.prefill_batch > 1 else 1
        if width <= self.pack_width:
            room = 1
        return [[width] * min(rows, room) for rows in sorted({1 << (k - 1).bit_length() for k in range(1, room + 1)})]

    def _packed_jobs(self) -> list[list[int]]:
        """Warm-up's packed prefills: the prompt lengths of one job for each (rows, packed size) `start_prefill`
        forms, each job as many prompts as its rows hold, their tokens the packed size."""
        if not self.pack_width:
            return []
        jobs = []
        for rows in sorted({1 << (n - 1).bit_length() for n in range(2, self.prefill_batch + 1)}):
            n = min(rows, self.prefill_batch)
            for size in range(PACK_BUCKET, self.prefill_tokens + 1, PACK_BUCKET):
                if size <= n * self.pack_width:
                    jobs.append(_spread(size, n))
        return jobs

    def _shared_jobs(self) -> list[list[int]]:
        """Warm-up's packed prefills of prompts with a common prefix (`SHARED`), one for each row count: the prefix's
        own call, its one-row cache repeated into the job's rows (`tile_cache`)."""
        if not self.pack_width or not self.shares_prefixes:
            return []
        n = SHARED_PREFIX_MIN + 1
        return [[n] * min(rows, self.prefill_batch)
                for rows in sorted({1 << (k - 1).bit_length() for k in range(2, self.prefill_batch + 1)})]

    def _warm_prefills(self, jobs: list[list[int]], packed: bool | str, start: int, n_group: int) -> int:
        """Warm-up's prefills of prompts of the given lengths (a list a job) into the decode group of slots `start` ..
        `start + n_group` (every other free slot held back meanwhile), each then freed. A job of more prompts than
        the group's open slots takes as many as it holds (packed: their tokens the same, spread over them; those
        rows are what such a job forms), and none after it runs (not packed); returns the programs run. The prompts
        differ in their first token, so that a packed call computes all of them, but with `packed` SHARED: alike,
        so that it computes their common prefix once."""
        held_back = [i for i in range(self.num_slots) if not start <= i < start + n_group
                     and self.slots[i].state == FREE]
        for i in held_back:
            self.slots[i].state = FILLING
        runs = 0
        try:
            for lengths in jobs:
                n = min(len(lengths), self.open_slots())
                cut = n < len(lengths)
                if cut and packed and packed != SHARED:
                    if n < 2 or sum(lengths) > n * self.pack_width:
                        continue
                    lengths = _spread(sum(lengths), n)
                elif cut:
                    lengths = lengths[:n]
                pages = sum(self.admission_pages(k, 1) for k in lengths) if self.paged else 0
                if n < 1 or (self.paged and pages + self.headroom > self.free_pages()):
                    break
                prompts = [Waiting([self.cfg.pad_id if packed == SHARED else i % self.cfg.vocab_size]
                                   + [self.cfg.pad_id] * (k - 1), [Sampling(0.0)], max_tokens=1)
                           for i, k in enumerate(lengths)]
                if self.prefill_batch > 1:
                    job = self.start_prefill(prompts)
                    while (admitted := self.advance(job)) is None:
                        pass
                else:
                    admitted = [self.admit_choices(w.prompt, w.samplings, max_tokens=1) for w in prompts]
                for a in admitted:
                    for slot in a.slots:
                        self.free(slot)
                runs += 1
                if cut and not packed:
                    break
        finally:
            for i in held_back:
                self.slots[i].state = FREE
        return runs

    def key_of(self, slot: int) -> np.ndarray:
        """The slot's sampling key `[2]` (what its next draw splits), for a request to go on from after preemption."""
        g, row = self._where(slot)
        return np.asarray(sharding.to_host(self.keys[g])[row])

    def overflowed(self, slot: int) -> bool:
        """Whether a float16 scale overflowed in the slot's cache row (its output is unreliable; `-sf32` scales or the
        full cache avoid it): the row's sticky SCALE_OVERFLOW flag, which the request's prefill (or the prefix it
        extends) and decode steps set. Read once, when the request ends."""
        g, row = self._where(slot)
        return bool(sharding.to_host(self.caches[g].error_flags)[row] & SCALE_OVERFLOW)

    def finish(self, slot: int, hold: bool = True) -> None:
        """Ends the slot's request: its cache stays as a held prefix (when prefix reuse is on) or the slot is freed."""
        s = self.slots[slot]
        if hold and self.prefix_reuse:
            s.state, s.used_at = HELD, time.monotonic()
        else:
            self.free(slot)

    def free(self, slot: int) -> None:
        """Empties a slot (its next `insert` overwrites every leaf of it); paged, its pages go back to the pool and
        its table row holds none."""
        self.slots[slot] = Slot()
        g, row = self._where(slot)
        if self.paged:
            self.allocator.release(self.slot_pages.pop(slot, []))
            self.growing.discard(slot)
            self.slot_shared.pop(slot, None)
            self.tables[slot] = self.allocator.num_pages
            self.caches[0] = self.caches[0].with_table(self._table(self.tables))
        with sharding.use_mesh(self.mesh):
            self.caches[g] = reset_length(self.caches[g], jnp.int32(row))

    def metrics(self) -> dict:
        pages = {}
        if self.paged:
            pages = {f"pages_{k}" if not k.startswith("pages") else k: v for k, v in self.allocator.metrics().items()}
        if self.prefix_snapshots:
            pages.update(prefix_snapshots=len(self.snapshots), prefix_snapshot_bytes=tree_bytes(
                [snap.cache for snap in self.snapshots.values()]))
        return {**pages, "slots": self.num_slots, "decode_groups": len(self.groups), "live": self.count(LIVE),
                "held": self.count(HELD), "free": self.count(FREE), "filling": self.count(FILLING), "peak_live": self.peak_live, "cache_bytes": self.cache_bytes,
                "cache_bytes_in_use": self.cache_bytes_in_use, **self.counters}
