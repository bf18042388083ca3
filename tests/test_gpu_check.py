"""scripts/gpu_check.py runs end to end in its --smoke mode (CPU, interpret mode), from the checkout with
PYTHONPATH=. as on the GPU machine, importing nothing beyond jax, numpy and pallas_kernels."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_check", "scripts/gpu_check.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
rc = module.main(["--smoke", "--json", sys.argv[1]])
print("IMPORTED", sorted({n.split(".")[0] for n in sys.modules} & {"kivi_jax", "models", "flax", "transformers",
                                                                  "torch", "orbax"}))
sys.exit(rc)
"""


def test_smoke_run_prints_the_table_and_writes_the_json(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", RUN, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "IMPORTED []" in proc.stdout  # runs where only jax is installed
    assert "correctness against the jnp twins" in proc.stdout and "decode attention, one layer" in proc.stdout
    report = json.loads(out.read_text())
    assert report["smoke"] and report["interpret"]
    assert {r["kernel"] for r in report["correctness"]} == {"kivi", "full", "sdpa"}
    assert all(r["ok"] and r["max_err"] <= r["tol"] for r in report["correctness"])
    methods = {r["method"] for r in report["timing"]}
    assert methods == {"pallas-fp16", "sdpa-fp16", "kivi2", "kivi4"}
    for r in report["timing"]:
        assert r["ms"] > 0 and r["gb_read"] > 0


def test_bytes_each_must_read():
    """The bandwidth denominators: at 64K tokens a 2-bit, G=32 cache reads 3 bits a value plus its fp16 ring."""
    from pallas_kernels import full_decode, kivi_decode

    quantized = 65536 - 128
    codes = quantized * 128 * (2 + 2) // 8
    scales = 2 * 2 * (quantized // 32 * 128 + quantized * 128 // 32)  # (scale, min) x (key groups, value groups)
    ring = 2 * 128 * 128 * 2
    assert kivi_decode.bytes_read(1, 1, 65536, 128, 2, 2, 32, 128, 2) == codes + scales + ring
    assert full_decode.bytes_read(1, 1, 65536, 128, 2) == 2 * 65536 * 128 * 2
