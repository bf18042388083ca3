"""Lowering Pallas TPU (Mosaic) kernels on a machine without a TPU (tests/test_pallas_tpu.py).

Lowering asks the device which TPU generation it targets (`pltpu.get_tpu_info`: jnp's floor division and sign lower
per generation, for one); off a TPU the device is a CPU and the lowering fails. An abstract mesh whose abstract device
is a TPU of a given kind supplies it, as tests/gpu_target.py does for an H200.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh

# device kinds as jax spells them (pltpu's chip_version_from_device_kind), with TensorCores a chip
TPUS = {"v5e": ("TPU v5 lite", 1), "v6e": ("TPU v6 lite", 1), "v4": ("TPU v4", 2)}


def tpu_target(generation: str = "v5e"):
    """A context in which lowering for TPU targets one chip of `generation` (a key of TPUS)."""
    kind, cores = TPUS[generation]
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform="tpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("tpu",), abstract_device=device))
