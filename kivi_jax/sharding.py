"""Many devices on `jax.sharding` (docs/design.md §9): a `Mesh(data, model)`, one table of logical axes -> mesh axes
for every parameter and cache leaf, placement of params and caches, the per-shard decode hook, multi-host start-up.

- `data` splits the batch (and so each sequence's cache); `model` splits query and kv heads, the MLP's hidden units
  and the vocabulary. Layers, tokens and head_dim are never split.
- Parameters take the logical axes their architecture declares beside each leaf (models/registry.py `Param.axes`,
  `param_axes_of`); cache leaves by rule (`CACHE_AXES`, by rank): `[batch]`
  bookkeeping leaves split on data, `[layers, batch, kv_heads, ...]` stores on data and model; any other leaf is an
  error, so a new cache leaf is either covered by a rule or refused loudly.
- Heads that do not divide the model axis (SmolLM2: 3 kv heads) are replicated on it: attention (its weights, the
  cache and the decode kernel) runs data-parallel only, every model-axis device holding all heads; the MLP and the
  vocabulary stay split. `heads_sharded` makes that decision, once, and warns.
- Decode attention runs per shard under `shard_map` over (batch, kv heads) whenever a mesh is active (`use_mesh`):
  the Pallas kernels and the XLA path see only their own sequences and heads, so no device ever reads another's cache.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kivi_jax.models import registry

from kivi_jax.mesh_scope import MESH_AXES, active_mesh, use_mesh  # noqa: F401 (part of this module's API)

# The one table: logical axis -> mesh axis (None: never split). A dimension that the mesh axis does not divide is
# replicated instead (batch excepted: it must divide the data axis), and heads follow `heads_sharded`.
LOGICAL_AXES: dict[str, str | None] = {
    "batch": "data",
    "kv_heads": "model",
    "q_heads": "model",  # fused with head_dim in the projections: [hidden, q_heads * head_dim]
    "mlp": "model",
    "vocab": "model",
    "embed": None,  # the hidden size
    "layers": None,
    "tokens": None,  # cache rows: tokens, or token groups of per-channel scales
    "pages": None,  # a paged cache's pool pages and table entries: every model-axis device holds all pages
    "head_dim": None,  # cache columns: channels, packed code bytes, or channel groups of per-token scales
}
HEAD_AXES = ("kv_heads", "q_heads")

# Every cache leaf, by rank: bookkeeping per sequence (length, overflow, error flags, ...) and stores stacked
# [layers, batch, kv_heads, rows, cols] (FullCache k/v, QuantStore codes/scale/mn, rings, future sink tokens).
CACHE_AXES: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("batch",),
    5: ("layers", "batch", "kv_heads", "tokens", "head_dim"),
}
# A paged cache (docs/design.md §12, data=1 only: `check_paged_mesh`): its pools `[layers, pages, kv_heads,
# page_rows, X]` split their heads over model like the stores (pages never split), its block table `[batch,
# pages_per_sequence]` and bookkeeping whole on every device.
POOL_AXES = ("layers", "pages", "kv_heads", "tokens", "head_dim")
TABLE_AXES = ("batch", "pages")


class MeshError(ValueError):
    """A mesh that does not fit the devices, or a shape that does not fit the mesh."""


# ---------------------------------------------------------------------------------------------------------------------
# Meshes


def parse_mesh_shape(text: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; an axis left out has size 1 ('model=8')."""
    sizes = {name: 1 for name in MESH_AXES}
    seen = set()
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        m = re.fullmatch(r"([a-z_]+)\s*=\s*([0-9]+)", part)
        if not m or m.group(1) not in MESH_AXES or int(m.group(2)) < 1 or m.group(1) in seen:
            raise MeshError(f"bad mesh {text!r}: give axis=size pairs over the axes {', '.join(MESH_AXES)}, each at "
                            "most once with a positive size, e.g. data=2,model=4")
        seen.add(m.group(1))
        sizes[m.group(1)] = int(m.group(2))
    if not seen:
        raise MeshError(f"bad mesh {text!r}: name at least one axis, e.g. data=2,model=4")
    return sizes


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis sizes of a Mesh, an AbstractMesh, a mesh string or a {'data': .., 'model': ..} dict."""
    if isinstance(mesh, str):
        return parse_mesh_shape(mesh)
    if isinstance(mesh, dict):
        return {name: int(mesh.get(name, 1)) for name in MESH_AXES}
    shape = dict(mesh.shape)
    return {name: int(shape.get(name, 1)) for name in MESH_AXES}


def make_mesh(shape: "str | dict[str, int]", devices=None) -> Mesh:
    """A `Mesh(data, model)` over `devices` (default: every device of every process, in `jax.devices()` order)."""
    sizes = mesh_sizes(shape)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need != len(devices):
        name = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise MeshError(f"mesh {name} needs {need} devices, but there are {len(devices)} "
                        f"({jax.process_count()} process(es), {jax.local_device_count()} local); give sizes whose "
                        f"product is {len(devices)}, e.g. data={len(devices)} or model={len(devices)}")
    return Mesh(np.array(devices, dtype=object).reshape(sizes["data"], sizes["model"]), MESH_AXES)


def resolve_mesh(mesh) -> Mesh | None:
    """None, a Mesh with the axes ('data', 'model'), or a string for `make_mesh`."""
    if mesh is None:
        return None
    if isinstance(mesh, (str, dict)):
        return make_mesh(mesh)
    if isinstance(mesh, Mesh):
        if set(mesh.axis_names) != set(MESH_AXES):
            raise MeshError(f"a kivi_jax mesh has the axes {MESH_AXES}, not {tuple(mesh.axis_names)}")
        return mesh
    raise TypeError(f"mesh must be a jax.sharding.Mesh or a string like 'data=2,model=4', not {type(mesh).__name__}")


# ---------------------------------------------------------------------------------------------------------------------
# The table applied: partition specs for params and caches


@functools.lru_cache(maxsize=None)
def _warn_heads(kv_heads: int, model: int) -> None:
    divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
    warnings.warn(f"kv_heads={kv_heads} does not divide the model axis ({model}): attention heads (their weights, "
                  f"the cache and the decode kernel) are replicated on the model axis; model sizes that split them: "
                  f"{', '.join(map(str, divisors))}", RuntimeWarning, stacklevel=4)


def heads_sharded(kv_heads: int, mesh, warn: bool = True) -> bool:
    """Whether kv heads (and with them the query heads) are split over the model axis: when its size divides them.

    Otherwise they are replicated on it (warning once): attention runs data-parallel only, the MLP and the
    vocabulary stay split."""
    model = mesh_sizes(mesh)["model"]
    if kv_heads % model == 0:
        return True
    if warn:
        _warn_heads(kv_heads, model)
    return False


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], mesh, heads: bool, what: str = "array") -> P:
    """The PartitionSpec of an array whose dims carry the logical `axes`, on `mesh` (see LOGICAL_AXES)."""
    if len(axes) != len(shape):
        raise MeshError(f"{what} has shape {tuple(shape)} but the sharding table names {len(axes)} axes {axes}")
    sizes = mesh_sizes(mesh)
    out = []
    for name, size in zip(axes, shape):
        if name not in LOGICAL_AXES:
            raise MeshError(f"{what}: logical axis {name!r} is not in kivi_jax.sharding.LOGICAL_AXES")
        axis = LOGICAL_AXES[name]
        if name in HEAD_AXES and not heads:
            axis = None
        if name == "batch" and size == 1:
            axis = None  # one sequence (a request being prefilled): whole on every data shard
        if axis is not None and size % sizes[axis]:
            if name == "batch":
                raise MeshError(f"{what}: batch {size} does not divide the data axis ({sizes[axis]}); use a batch "
                                f"that is a multiple of {sizes[axis]} or a smaller data axis")
            axis = None  # e.g. a vocabulary the model axis does not divide: replicated
        out.append(axis)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _path_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def param_axes(params) -> dict[str, tuple[str, ...]]:
    """Logical axes of every parameter leaf, by path (a quantized matrix's codes, scales and mins under its own
    path: `layers.wq.codes`); a leaf its architecture's table does not know is an error."""
    from kivi_jax import weights

    table = registry.param_table(params.config)
    out = {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=weights.is_quantized)[0]:
        name = _path_name(p)
        axes = param_axes_of(name, leaf, table)
        if weights.is_quantized(leaf):
            out.update({f"{name}.{part}": axes for part in ("codes", "scale", "mn") if getattr(leaf, part) is not None})
        else:
            out[name] = axes
    return out


def param_specs(params, mesh):
    """A pytree like `params` of PartitionSpecs (a quantized matrix: one for each of its codes, scales and mins)."""
    from kivi_jax import weights

    heads = heads_sharded(params.config.num_kv_heads, mesh)
    table = registry.param_table(params.config)

    def one(path, leaf):
        name = _path_name(path)
        axes = param_axes_of(name, leaf, table)
        if not weights.is_quantized(leaf):
            return spec_for(axes, leaf.shape, mesh, heads, f"parameter {name}")
        return leaf.replace(**{part: spec_for(axes, getattr(leaf, part).shape, mesh, heads, f"parameter {name}.{part}")
                               for part in ("codes", "scale", "mn") if getattr(leaf, part) is not None})

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=weights.is_quantized)


def param_axes_of(name: str, leaf, table: dict) -> tuple[str, ...]:
    """The logical axes of a parameter leaf: those its architecture's `table` (`registry.param_table`) declares, or
    for a quantized matrix its rows' and columns' axes (a projection `[in, out]` is held as rows of out: its last two
    axes swap; its scales follow its rows)."""
    from kivi_jax import weights

    if name not in table:
        raise MeshError(f"parameter {name} {tuple(leaf.shape)} is not in its architecture's parameter table "
                        "(models/registry.py)")
    axes = table[name].axes
    if weights.is_quantized(leaf) and leaf.transposed:
        axes = axes[:-2] + (axes[-1], axes[-2])
    return axes


def check_paged_mesh(mesh) -> None:
    """MeshError unless a paged cache can live on `mesh`: one pool shared by all sequences, so data=1 (its heads
    split over model)."""
    sizes = mesh_sizes(mesh)
    if sizes["data"] != 1:
        raise MeshError(f"a paged cache needs data=1 (one pool shared by every sequence; its kv heads split over "
                        f"model), not data={sizes['data']}: give a mesh of model={sizes['data'] * sizes['model']} "
                        "(or data=1,model=N), or drop pages for a data-parallel slot cache")


def paged_leaves(cache, prefix: str = "") -> tuple[set[str], set[str]]:
    """Paths of a paged cache's pool leaves (its `k` and `v`) and block tables, its per-layer-bits part's included
    (empty for a contiguous cache)."""
    pools, tables = set(), set()
    if getattr(cache, "table", None) is None:
        return pools, tables
    tables.add(prefix + "table")
    for name in ("k", "v"):
        for p, _ in jax.tree_util.tree_flatten_with_path(getattr(cache, name))[0]:
            pools.add(prefix + name + (f".{_path_name(p)}" if p else ""))
    if getattr(cache, "first", None) is not None:
        more = paged_leaves(cache.first, prefix + "first.")
        pools, tables = pools | more[0], tables | more[1]
    return pools, tables


def cache_axes(cache) -> dict[str, tuple[str, ...]]:
    """Logical axes of every cache leaf, by path, from the rank rules of CACHE_AXES (a paged cache's pools and tables:
    POOL_AXES, TABLE_AXES); checks that every stacked store agrees on [layers, batch, kv_heads], every pool on [pages,
    kv_heads] and every bookkeeping leaf on [batch]. Unknown ranks are an error."""
    leaves = [(_path_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]]
    pools, tables = paged_leaves(cache)
    out, lead, batch, pool = {}, None, None, None
    for name, leaf in leaves:
        shape = tuple(leaf.shape)
        if name in pools or name in tables:
            axes = POOL_AXES if name in pools else TABLE_AXES
            if len(shape) != len(axes):
                raise MeshError(f"paged cache leaf {name} has shape {shape}, not the {len(axes)} axes {axes}")
            if name in pools:
                pool = pool or (name, shape[1:3])
                if shape[1:3] != pool[1]:
                    raise MeshError(f"pool leaf {name} {shape} does not share [pages, kv_heads] = {pool[1]} with "
                                    f"{pool[0]}; the sharding table cannot place it")
            out[name] = axes
            continue
        if len(shape) not in CACHE_AXES:
            raise MeshError(
                f"cache leaf {name} has shape {shape}: the sharding table (kivi_jax.sharding.CACHE_AXES) knows "
                f"scalars, [batch] bookkeeping leaves and [layers, batch, kv_heads, rows, cols] stores; add a rule "
                "for this leaf there")
        axes = CACHE_AXES[len(shape)]
        if "layers" in axes:
            lead = lead or (name, shape[:3])
            if shape[:3] != lead[1]:
                raise MeshError(f"cache leaf {name} {shape} does not share [layers, batch, kv_heads] = {lead[1]} with "
                                f"{lead[0]}; the sharding table cannot place it")
        if "batch" in axes:
            b = shape[axes.index("batch")]
            batch = batch or (name, b)
            if b != batch[1]:
                raise MeshError(f"cache leaf {name} {shape} has batch {b}, but {batch[0]} has {batch[1]}")
        out[name] = axes
    if pool and lead and pool[1][1] != lead[1][2]:
        raise MeshError(f"pool leaf {pool[0]} has {pool[1][1]} kv heads, but {lead[0]} has {lead[1][2]}")
    return out


def cache_specs(cache, mesh):
    """A pytree like `cache` (concrete or from `jax.eval_shape`) of PartitionSpecs."""
    axes = cache_axes(cache)
    if paged_leaves(cache)[0]:
        check_paged_mesh(mesh)
    stores = [leaf for p, leaf in jax.tree_util.tree_flatten_with_path(cache)[0] if leaf.ndim == 5]
    heads = heads_sharded(stores[0].shape[2], mesh) if stores else True

    def one(path, leaf):
        name = _path_name(path)
        return spec_for(axes[name], leaf.shape, mesh, heads, f"cache leaf {name}")

    return jax.tree_util.tree_map_with_path(one, cache)


def named(specs, mesh: Mesh):
    """PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def put(x, mesh: Mesh, spec: P = P()):
    """A host or device array placed on `mesh` with `spec`; works with many processes (each holding all of `x`)."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process, or a global array resharded
    host = np.asarray(x)  # a host or process-local array: every process holds all of it
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(params, mesh):
    """Params placed on `mesh` by their declared axes (a leaf already placed so is kept as it is; a quantized
    matrix's strip-major copy dropped: the native kernel that reads it does not run on a mesh)."""
    from kivi_jax import weights

    mesh = resolve_mesh(mesh)
    params = weights.without_strips(params)
    return jax.tree_util.tree_map(lambda x, s: put(x, mesh, s), params, param_specs(params, mesh),
                                  is_leaf=lambda x: isinstance(x, P))


def shard_cache(cache, mesh):
    """An existing cache placed on `mesh` by CACHE_AXES."""
    mesh = resolve_mesh(mesh)
    return jax.tree_util.tree_map(lambda x, s: put(x, mesh, s), cache, cache_specs(cache, mesh),
                                  is_leaf=lambda x: isinstance(x, P))


def make_cache(make: Callable[[], Any], mesh):
    """The cache `make()` builds, allocated already sharded on `mesh` (no device ever holds the whole of it)."""
    mesh = resolve_mesh(mesh)
    shardings = named(cache_specs(jax.eval_shape(make), mesh), mesh)
    return jax.jit(make, out_shardings=shardings)()


def constrain_cache(cache):
    """Inside jit under an active mesh: the cache constrained to the table's shardings (so a compiled step's output
    cache is laid out as its next call expects); outside a mesh: unchanged."""
    mesh = active_mesh()
    if mesh is None:
        return cache
    specs = cache_specs(cache, mesh)
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, cache, specs)


def abstract_cache(cache, mesh):
    """ShapeDtypeStructs of a (possibly abstract) cache carrying the table's shardings on `mesh` (for lowering)."""
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                                  named(cache_specs(cache, mesh), mesh))


def put_batch(x, mesh: Mesh, axis: int = 0):
    """An array whose dim `axis` is the batch (tokens, lengths, `[steps, windows]` inputs) placed on `mesh`, split
    over the data axis there."""
    shape = np.shape(x)
    axes = tuple("batch" if i == axis else "tokens" for i in range(len(shape)))
    return put(x if isinstance(x, jax.Array) else np.asarray(x), mesh, spec_for(axes, shape, mesh, True, "input"))


def replicated(x):
    """Inside jit under an active mesh: `x` constrained to be whole on every device (small outputs the host reads,
    e.g. the sampled tokens); outside a mesh: `x` unchanged."""
    if active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def to_host(x) -> np.ndarray:
    """A (possibly multi-process, sharded) array as a numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ---------------------------------------------------------------------------------------------------------------------
# Bytes per device (from shapes alone: no devices or allocation needed)


def shard_shape(shape: tuple[int, ...], spec: P, mesh) -> tuple[int, ...]:
    sizes = mesh_sizes(mesh)
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(d // (sizes[a] if a is not None else 1) for d, a in zip(shape, spec))


def per_device_bytes(tree, specs, mesh) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) placed with `specs` on a mesh of that shape."""
    leaves = jax.tree_util.tree_leaves(tree)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(math.prod(shard_shape(x.shape, s, mesh)) * jnp.dtype(x.dtype).itemsize
               for x, s in zip(leaves, spec_leaves))


# ---------------------------------------------------------------------------------------------------------------------
# Decode attention per shard


def _decode_spec(role: str, ndim: int, batch_axis, head_axis) -> P:
    if role == "query":  # [batch, 1, heads, head_dim]
        return P(batch_axis, None, head_axis, None)
    if role in ("batch", "rows"):  # [batch], or [batch, n] token rows
        return P(batch_axis)
    if role == "cache":  # [layers, batch, kv_heads, rows, cols], or one layer [batch, kv_heads, rows, cols]
        return P(None, batch_axis, head_axis) if ndim == 5 else P(batch_axis, head_axis)
    if role == "replicated":
        return P()
    raise ValueError(f"unknown decode argument role {role!r}")


def _is_paged(arg) -> bool:
    """A paged store's view (`paged.PagedRows`, `cache.PagedStore`): a pool read through a block table."""
    return getattr(arg, "table", None) is not None


def _paged_spec(ndim: int, batch_axis, head_axis) -> P:
    """A paged view's leaves per shard: the pool `[layers, pages, kv_heads, m, X]` by heads (every page on every
    shard), the table `[batch, pages_per_sequence]` and `end [batch]` by sequence."""
    return P(None, None, head_axis) if ndim == 5 else P(batch_axis)


def per_shard(out: str = "query", **roles: str):
    """Decorates a function of per-sequence, per-kv-head work (decode attention, a cache write) so that, under an
    active mesh, it runs per shard in `shard_map` over (batch on data, kv heads on model); without a mesh it is called
    as it is.

    `roles` names each array argument's layout: `query` (q, k_new, v_new `[batch, 1, heads, head_dim]`), `cache`
    (stacked or one-layer cache tensors, or pytrees of them such as a QuantStore), `batch` (`[batch]`), `rows`
    (`[batch, n]` token rows), `replicated` (the layer index). Other arguments (impl, window, a None layer) are
    static. The answer is laid out like a `query` (`out="query"`) or a stacked cache tensor (`out="cache"`). A
    `cache` argument that is a paged view (a pool and its block table) is split by heads only (`_paged_spec`)."""

    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            mesh = active_mesh()
            if mesh is None:
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            names = [n for n in sig.parameters if n in roles and bound.arguments[n] is not None]
            first = next(bound.arguments[n] for n in names if roles[n] == "cache")
            cache = jax.tree_util.tree_leaves(first)[0]
            kv_heads, batch = cache.shape[-3], cache.shape[-4]
            if _is_paged(first):  # a pool [layers, pages, kv_heads, m, X]: the batch is its table's
                batch = first.table.shape[0]
            sizes = mesh_sizes(mesh)
            batch_axis = "data" if batch % sizes["data"] == 0 else None
            head_axis = "model" if heads_sharded(kv_heads, mesh) else None

            def spec_tree(name):
                arg = bound.arguments[name]
                if roles[name] == "cache" and _is_paged(arg):
                    return jax.tree_util.tree_map(lambda x: _paged_spec(x.ndim, batch_axis, head_axis), arg)
                return jax.tree_util.tree_map(lambda x: _decode_spec(roles[name], x.ndim, batch_axis, head_axis), arg)

            def body(*dyn):
                local = dict(bound.arguments)
                local.update(zip(names, dyn))
                return fn(**local)

            in_specs = tuple(spec_tree(n) for n in names)
            out_spec = _decode_spec(out, 4 if out == "query" else 5, batch_axis, head_axis)
            return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
                *(bound.arguments[n] for n in names))

        return run

    return wrap


# ---------------------------------------------------------------------------------------------------------------------
# Many hosts


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False) -> bool:
    """Starts `jax.distributed` when asked to, before anything touches a device; every process runs the same program.

    From the arguments (`--coordinator host:port --num-processes N --process-id I`), else from the environment
    (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), else with `auto` (`--distributed`) from the
    cluster jax detects itself (TPU slices, SLURM, Open MPI, Kubernetes). Returns whether it initialized; nothing is
    done for a single process with none of these."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None and process_id is None and not auto:
        return False
    if (num_processes is None) != (process_id is None) or (coordinator is None and num_processes is not None):
        raise MeshError("multi-host needs all of --coordinator, --num-processes and --process-id (or "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or none of them with "
                        "--distributed on a cluster jax detects (TPU slice, SLURM, Open MPI)")
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU arrays across processes
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
