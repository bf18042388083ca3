"""Lowering Pallas kernels to Triton on a machine without a GPU (tests/test_pallas_lowering.py, the sharding worker).

jax 0.11 asks the device for its compute capability when it lowers a Pallas kernel for CUDA, and off a GPU there is
none; an abstract mesh whose abstract device is an H200 (the GPU machine this project is lent) supplies it. jax 0.10
does not ask, and lowers the same under it.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def cuda_target(mesh=None):
    """A context in which lowering for CUDA targets an H200: a one-device abstract mesh, or `mesh`'s axes (for code
    traced under `sharding.use_mesh(mesh)`, which runs per shard on those axes)."""
    if mesh is None:
        return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("gpu",), abstract_device=H200))
    sizes = tuple(mesh.shape[name] for name in mesh.axis_names)
    return jax.sharding.use_abstract_mesh(AbstractMesh(sizes, tuple(mesh.axis_names), mesh.axis_types,
                                                       abstract_device=H200))
