"""The installed package cannot be shadowed: the wheel holds `kivi_jax`, `kivi_jax.models` and
`kivi_jax.pallas_kernels` only, so a user's own top-level `models/` package does not break `import kivi_jax`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import kivi_jax, kivi_jax.models.llama, kivi_jax.pallas_kernels, models
print(kivi_jax.__file__)
print(kivi_jax.models.llama.__file__)
print(kivi_jax.pallas_kernels.__file__)
print(models.__file__)
"""


def test_installed_package_imports_beside_a_decoy_models_package(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "tests", "docs", "scripts", "build", "dist",
                                                             "*.egg-info", "__pycache__", ".*"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-q", "--target", str(target), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert top == ["bin", "kivi_jax"] or top == ["kivi_jax"], top  # no generic top-level `models`/`pallas_kernels`
    assert (target / "kivi_jax" / "models" / "llama.py").is_file()
    assert (target / "kivi_jax" / "pallas_kernels" / "__init__.py").is_file()

    user = tmp_path / "project"  # a user's project with its own `models` and `pallas_kernels` packages
    for name in ("models", "pallas_kernels"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text("DECOY = True\n")
    env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", CHECK], cwd=user, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ours, llama, kernels, decoy = (Path(line) for line in run.stdout.split())
    assert ours == target / "kivi_jax" / "__init__.py"
    assert llama == target / "kivi_jax" / "models" / "llama.py"
    assert kernels == target / "kivi_jax" / "pallas_kernels" / "__init__.py"
    assert decoy == user / "models" / "__init__.py"  # the user's own package is still theirs
