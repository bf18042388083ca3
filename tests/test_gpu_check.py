"""scripts/gpu_check.py runs end to end in its --smoke mode (CPU, interpret mode) and imports nothing beyond the
standard library, jax, numpy and pallas_kernels (which itself imports only jax), as the GPU machine requires."""

import ast
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_roots(path: pathlib.Path, guarded: bool = False) -> set[str]:
    """The top-level modules a file imports; `guarded`: only those imported inside a `try` (optional imports),
    else only those outside one."""
    tree = ast.parse(path.read_text())
    in_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
    roots = set()
    for node in ast.walk(tree):
        if (id(node) in in_try) != guarded:
            continue
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_script_and_the_kernels_need_only_jax_and_numpy():
    """The script's only optional import is kivi_jax (its XLA path rows, skipped when it does not import)."""
    allowed = set(sys.stdlib_module_names) | {"jax", "numpy", "pallas_kernels"}
    files = [ROOT / "scripts" / "gpu_check.py", *(ROOT / "pallas_kernels").glob("*.py")]
    for f in files:
        assert imported_roots(f) <= allowed, (f.name, imported_roots(f) - allowed)
    assert imported_roots(ROOT / "scripts" / "gpu_check.py", guarded=True) == {"kivi_jax"}
    assert "numpy" not in set().union(*(imported_roots(f) for f in (ROOT / "pallas_kernels").glob("*.py")))


@pytest.mark.slow
def test_smoke_run_prints_the_table_and_writes_the_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "correctness against the jnp twins" in printed and "decode attention, one layer" in printed
    report = json.loads(out.read_text())
    assert report["smoke"] and report["interpret"]
    assert {r["kernel"] for r in report["correctness"]} == {"kivi", "full", "sdpa"}
    assert all(r["ok"] and r["max_err"] <= r["tol"] for r in report["correctness"])
    # Triton (interpret mode) and the XLA path side by side; the Mosaic GPU kernel has no interpret mode: listed
    assert {r["method"] for r in report["timing"]} == {"pallas-fp16", "sdpa-fp16", "kivi2-triton", "kivi4-triton",
                                                       "kivi2-xla", "kivi4-xla"}
    assert any(s.startswith("every mosaic row: ") for s in report["skipped"])
    assert any("prerope-s4" in r["config"] for r in report["correctness"])  # the preset-like path ran
    for r in report["timing"]:
        assert r["ms"] > 0 and r["gb_read"] > 0 and r["model"] in printed


def test_bytes_each_must_read():
    """The bandwidth denominators: at 64K tokens a 2-bit, G=32 cache reads 3 bits a value plus its fp16 ring."""
    from kivi_jax.pallas_kernels import full_decode, kivi_decode

    quantized = 65536 - 128
    codes = quantized * 128 * (2 + 2) // 8
    scales = 2 * 2 * (quantized // 32 * 128 + quantized * 128 // 32)  # (scale, min) x (key groups, value groups)
    ring = 2 * 128 * 128 * 2
    assert kivi_decode.bytes_read(1, 1, 65536, 128, 2, 2, 32, 128, 2) == codes + scales + ring
    assert full_decode.bytes_read(1, 1, 65536, 128, 2) == 2 * 65536 * 128 * 2
    sinks = 2 * 4 * 128 * 2  # 4 sink tokens' fp16 keys and values
    assert kivi_decode.bytes_read(1, 1, 65536, 128, 2, 2, 32, 128, 2, sinks=4) == codes + scales + ring + sinks
