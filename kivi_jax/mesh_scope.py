"""The mesh code runs under: the two mesh axes, the context that sets a mesh, and the question whether one is set
(`kivi_jax.sharding` re-exports all three; the weight formats ask it without importing the sharding table)."""

from __future__ import annotations

import contextlib

import jax

MESH_AXES = ("data", "model")


def use_mesh(mesh):
    """A context in which jit-compiled code runs on `mesh` (`jax.set_mesh`); nothing at all for None.

    Decode attention looks for this mesh to run per shard; code traced inside it is cached apart from code traced
    outside it."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def active_mesh():
    """The mesh of the enclosing `use_mesh` (an AbstractMesh while tracing), or None: none set, or inside
    `shard_map` already (manual axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != set(MESH_AXES):
        return None
    if getattr(mesh, "manual_axes", ()):
        return None
    return mesh
