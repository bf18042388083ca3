"""The serving engine (docs/design.md §8): a batch cache of S slots, prefill, insert, one decode step, free. No HTTP.

A slot is FREE (nothing in it), LIVE (a request decoding) or HELD (a finished request's cache, kept for prefix reuse
until the slot is needed). `admit` prefills a request into a one-sequence cache (in chunks of a static size, starting
from a held prefix's cache when the prompt extends one), samples its first token and inserts the cache into a slot;
`step` decodes every live slot once in one jitted call; `finish` turns a live slot into a held (or free) one. With
`decode_group` the slots are split into groups, each its own batch cache, and a step calls the one jitted decode once
per group that holds a live slot (one compilation; idle groups cost nothing).

Every cache leaf is stacked `[layers, batch, ...]` or is `[batch]`; the batch axis of each leaf is derived once by
comparing the shapes of a one-slot and a two-slot cache, so `insert` / `extract` work for any cache kind.

With `mesh` (docs/sharding.md) the params and every group's batch cache are sharded by the table (slots over the
data axis, heads over the model axis), a request is prefilled into a one-sequence cache that is whole on every data
shard (heads still split), and insert / extract move one row between the two without gathering a batch cache.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kivi_jax import rotation, sharding
from kivi_jax.cache import make_cache, tree_bytes
from kivi_jax.config import parse_cache_spec, spec_name
from kivi_jax.generate import PREFILL_CHUNK, prefill
from kivi_jax.models.llama import Params, forward
from kivi_jax.serve.sampling import RowSampling, sample_rows, split_rows

DEFAULT_PREFILL_CHUNK = PREFILL_CHUNK

FREE, LIVE, HELD = "free", "live", "held"


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
    for name, s in (("cache", spec), ("full", "full")):
        b = slot_bytes(s, cfg, max_length, dtype)
        out[name] = {"spec": spec_name(parse_cache_spec(s)), "slot_bytes": b, "slots": int(budget // b)}
        if mesh is not None:
            per_device = slot_bytes_per_device(s, cfg, max_length, dtype, mesh)
            out[name].update(slot_bytes_per_device=per_device, slots=data * int(budget // per_device))
    return out


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
def insert_cache(batch, one, slot: jax.Array, axes: tuple[int, ...]):
    """Copies every leaf of the one-sequence cache `one` into row `slot` of the batch cache (donated): the slot's
    whole state, lengths and flags included, so nothing of its last occupant survives."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    new = [jax.lax.dynamic_update_slice_in_dim(b, o.astype(b.dtype), slot, axis)
           for b, o, axis in zip(leaves, jax.tree_util.tree_leaves(one), axes)]
    return jax.tree_util.tree_unflatten(treedef, new)


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


@functools.partial(jax.jit, donate_argnames=("cache",))
def reset_length(cache, slot: jax.Array):
    """A freed slot's length back to 0, so the decode loop no longer walks its old tokens."""
    return cache.replace(length=cache.length.at[slot].set(0))


@jax.jit
def sample_first(logits, key, temperature, top_k, top_p):
    """The first token of a request from its prefill logits `[1, vocab]`, as `generate` draws it; returns the token
    `[1]` and the key to continue with."""
    key, sub = split_rows(key)
    return sample_rows(logits, sub, temperature, top_k, top_p), key


@functools.partial(jax.jit, donate_argnames=("cache", "keys"))
def decode_slots(params: Params, tokens, live, cache, keys, temperature, top_k, top_p):
    """One token for every slot: `tokens [slots]`, `live [slots]` bool (other slots advance by 0 tokens) -> (next
    tokens `[slots]`, cache, keys)."""
    logits, cache = forward(params, tokens[:, None], cache, num_new=live.astype(jnp.int32))
    keys, sub = split_rows(keys)
    return sample_rows(logits[:, 0], sub, temperature, top_k, top_p), cache, keys


# ---------------------------------------------------------------------------------------------------------------------
# The engine


class NoFreeSlot(RuntimeError):
    """Every slot is live."""


@dataclasses.dataclass
class Slot:
    state: str = FREE
    tokens: list[int] = dataclasses.field(default_factory=list)  # the tokens the slot's cache holds (fed tokens)
    last: int = 0  # the token to feed next (sampled, not yet in the cache)
    sampling: RowSampling = RowSampling(0.0)
    used_at: float = 0.0  # when it last changed (the least recently used held slot is evicted first)


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
    ):
        cfg = params.config
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
        if not 1 < max_length <= cfg.max_position_embeddings:
            raise ValueError(f"max_length={max_length} must be in [2, {cfg.max_position_embeddings}] (the model's "
                             "positions)")
        self.spec = parse_cache_spec(cache)
        if self.spec != "full":
            self.spec.check_shapes(cfg.head_dim, max_length)
        # Slots in groups of `decode_group` (default: one group of all), each group its own batch cache: a decode
        # step runs one jitted call per group holding a live slot, so idle groups cost nothing.
        group = min(decode_group or slots, slots)
        self.groups = [(start, min(group, slots - start)) for start in range(0, slots, group)]  # (first slot, size)
        if any(n % data for _, n in self.groups):
            raise ValueError(f"slots={slots} in decode groups of {group}: every group must be a multiple of the mesh's "
                             f"data axis ({data}), so its slots split evenly over the data shards; give slots and "
                             f"--decode-group that are multiples of {data}")
        params = rotation.prepare_params(params, self.spec)
        self.mesh = mesh
        if mesh is not None:
            params = sharding.shard_params(params, mesh)
        self.params, self.cfg, self.dtype, self.impl = params, cfg, params.dtype, attention_impl
        self.num_slots, self.max_length, self.prefill_chunk = slots, max_length, prefill_chunk
        self.axes = batch_axes(self.spec, cfg, max_length, self.dtype, attention_impl)
        self.caches = [make_cache(self.spec, cfg, n, max_length, self.dtype, attention_impl, mesh=mesh)
                       for _, n in self.groups]
        self.keys = [self._put(np.zeros((n, 2), np.uint32)) for _, n in self.groups]
        self.slot_bytes = slot_bytes(self.spec, cfg, max_length, self.dtype)
        self.slots = [Slot() for _ in range(slots)]
        self.eos = frozenset(cfg.eos_token_ids)
        self.prefix_reuse = prefix_reuse
        self.counters = {"prefill_tokens_computed": 0, "prefix_tokens_reused": 0, "decode_steps": 0,
                         "tokens_generated": 0, "requests_admitted": 0}
        self.peak_live = 0

    # -- queries ------------------------------------------------------------------------------------------------------

    @property
    def spec_name(self) -> str:
        return spec_name(self.spec)

    def count(self, state: str) -> int:
        return sum(s.state == state for s in self.slots)

    def live_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state == LIVE]

    def has_free_slot(self) -> bool:
        return any(s.state != LIVE for s in self.slots)

    @property
    def cache_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def cache_bytes_in_use(self) -> int:
        """Bytes of the slots that hold something (live or held)."""
        return self.slot_bytes * (self.num_slots - self.count(FREE))

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError (with the limits) unless a prompt of this many tokens plus `max_tokens` fits a slot."""
        if prompt_tokens < 1:
            raise ValueError("the prompt has no tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1")
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

    # -- prefill and insert -------------------------------------------------------------------------------------------

    def _put(self, x: np.ndarray) -> jax.Array:
        """A `[slots, ...]` host array on the device(s): split over the data axis on a mesh."""
        return jnp.asarray(x) if self.mesh is None else sharding.put_batch(x, self.mesh)

    def fresh_cache(self):
        return make_cache(self.spec, self.cfg, 1, self.max_length, self.dtype, self.impl, mesh=self.mesh)

    def prefill(self, tokens: list[int], cache=None):
        """Prefills `tokens` onto a one-sequence `cache` (default: a fresh one) -> (logits of the last token
        `[1, vocab]`, the cache)."""
        cache = self.fresh_cache() if cache is None else cache
        with sharding.use_mesh(self.mesh):
            return prefill(self.params, np.asarray([tokens], np.int32), np.asarray([len(tokens)]), cache,
                           self.prefill_chunk, self.mesh)

    def _where(self, slot: int) -> tuple[int, int]:
        """(group, row in the group's batch cache) of a slot."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is not in [0, {self.num_slots})")
        group = slot // self.groups[0][1]
        return group, slot - self.groups[group][0]

    def insert(self, seq_cache, slot: int) -> None:
        """Copies a one-sequence cache into batch row `slot` (jitted, the batch cache donated)."""
        g, row = self._where(slot)
        with sharding.use_mesh(self.mesh):
            self.caches[g] = insert_cache(self.caches[g], seq_cache, jnp.int32(row), self.axes)

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

    def _pick_slot(self) -> int:
        free = [i for i, s in enumerate(self.slots) if s.state == FREE]
        if free:
            return free[0]
        held = [i for i, s in enumerate(self.slots) if s.state == HELD]
        if not held:
            raise NoFreeSlot(f"all {self.num_slots} slots are live")
        return min(held, key=lambda i: self.slots[i].used_at)

    def admit(self, prompt: list[int], sampling: RowSampling) -> tuple[int, int]:
        """Prefills `prompt` (reusing a held prefix when one matches), samples its first token and puts it in a slot.
        Returns (slot, first token). The slot is live until `finish`."""
        self.check_fits(len(prompt), 1)
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        slot = self._reusable(prompt)
        if slot is not None:
            start, seq = len(self.slots[slot].tokens), self.extract(slot)
        else:
            slot, start, seq = self._pick_slot(), 0, None
        logits, seq = self.prefill(prompt[start:], seq)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        key = jax.random.PRNGKey(seed)[None]
        with sharding.use_mesh(self.mesh):
            first, key = sample_first(logits, key, *self._row_arrays([sampling]))
        self.insert(seq, slot)
        g, row = self._where(slot)
        with sharding.use_mesh(self.mesh):
            self.keys[g] = self.keys[g].at[row].set(key[0])
        token = int(np.asarray(first)[0])
        self.slots[slot] = Slot(LIVE, list(prompt), token, sampling, time.monotonic())
        self.counters["prefill_tokens_computed"] += len(prompt) - start
        self.counters["prefix_tokens_reused"] += start
        self.counters["requests_admitted"] += 1
        self.counters["tokens_generated"] += 1
        self.peak_live = max(self.peak_live, self.count(LIVE))
        return slot, token

    # -- decode -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _row_arrays(rows: list[RowSampling], put=jnp.asarray):
        """Per-row temperature, top-k and top-p, placed by `put` (a batch group's: split over the data axis)."""
        temperature = put(np.array([r.temperature for r in rows], np.float32))
        top_k = put(np.array([r.top_k for r in rows], np.int32))
        top_p = put(np.array([r.top_p for r in rows], np.float32))
        return temperature, top_k, top_p

    def step(self) -> dict[int, int]:
        """Feeds every live slot its last token and samples the next: {slot: new token}. Free and held slots get a
        pad token and 0 new tokens; a group without a live slot is not run."""
        live = self.live_slots()
        if not live:
            return {}
        pending = []
        for g, (first, n) in enumerate(self.groups):
            rows = self.slots[first : first + n]
            if not any(s.state == LIVE for s in rows):
                continue
            mask = np.array([s.state == LIVE for s in rows])
            tokens = np.array([s.last if s.state == LIVE else self.cfg.pad_id for s in rows], np.int32)
            sampling = [s.sampling if s.state == LIVE else RowSampling(0.0) for s in rows]
            with sharding.use_mesh(self.mesh):
                nxt, self.caches[g], self.keys[g] = decode_slots(self.params, self._put(tokens), self._put(mask),
                                                                 self.caches[g], self.keys[g],
                                                                 *self._row_arrays(sampling, self._put))
            pending.append((first, nxt))  # every group is dispatched before any result is read
        host = np.zeros(self.num_slots, np.int64)
        for first, nxt in pending:
            values = np.asarray(nxt)
            host[first : first + len(values)] = values
        out = {}
        for i in live:
            s = self.slots[i]
            s.tokens.append(s.last)
            s.last = int(host[i])
            out[i] = s.last
        self.counters["decode_steps"] += 1
        self.counters["tokens_generated"] += len(live)
        return out

    def finish(self, slot: int, hold: bool = True) -> None:
        """Ends the slot's request: its cache stays as a held prefix (when prefix reuse is on) or the slot is freed."""
        s = self.slots[slot]
        if hold and self.prefix_reuse:
            s.state, s.used_at = HELD, time.monotonic()
        else:
            self.free(slot)

    def free(self, slot: int) -> None:
        """Empties a slot (its next `insert` overwrites every leaf of it)."""
        self.slots[slot] = Slot()
        g, row = self._where(slot)
        with sharding.use_mesh(self.mesh):
            self.caches[g] = reset_length(self.caches[g], jnp.int32(row))

    def metrics(self) -> dict:
        return {"slots": self.num_slots, "decode_groups": len(self.groups), "live": self.count(LIVE),
                "held": self.count(HELD), "free": self.count(FREE), "peak_live": self.peak_live, "cache_bytes": self.cache_bytes,
                "cache_bytes_in_use": self.cache_bytes_in_use, **self.counters}
