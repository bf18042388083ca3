"""The Mosaic GPU KIVI decode kernel (Hopper and newer) lowers for sm90 on this CPU (an abstract H200, as
tests/gpu_target.py gives the Triton tests) in a covering set of its configurations (every one under `-m slow`),
and a model decode step with it lowers; dispatch takes it by compute capability and keeps Triton below sm90; no
Pallas deprecation warning reaches a caller. Its numbers need a GPU: scripts/gpu_check.py compares it with the jnp
twin there (jax's Mosaic GPU interpreter cannot run its loads here).

The kernel needs jax 0.11's Mosaic GPU; on jax 0.10 (CI) the lowering tests skip and the dispatch test checks that
the kernel declines, so Triton serves sm90 there."""

import warnings

import jax
import jax.numpy as jnp
import pytest

from kivi_jax import attention
from kivi_jax.cache import make_cache
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import flash_decoding, kivi_decode, kivi_decode_mosaic

from gpu_target import cuda_target

MOSAIC_CALL = "mosaic_gpu"  # the custom call's target (mosaic_gpu_v2 in jax 0.10 and 0.11)
needs_011 = pytest.mark.skipif(kivi_decode_mosaic.unsupported(64, 2, 2, 32, 128) is not None,
                               reason=f"{kivi_decode_mosaic.unsupported(64, 2, 2, 32, 128)}")


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lowered_for_sm90(fn, *args) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # none of jax's Pallas deprecations may fire
        with cuda_target():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert MOSAIC_CALL in text and "triton" not in text, "no Mosaic GPU kernel in the CUDA lowering"
    return text


def lower(k_bits, v_bits, group, head_dim, dtype, pre_rope, q_heads=2):
    layers, batch, kv_heads, tokens, residual, sinks = 2, 2, 2, 256, 128, 4
    lead = (layers, batch, kv_heads)
    args = (
        sds((batch, 1, q_heads, head_dim), dtype),
        sds(lead + (tokens, head_dim * k_bits // 8), jnp.uint8),
        sds(lead + (tokens // group, head_dim), jnp.float16),
        sds(lead + (tokens // group, head_dim), jnp.float16),
        sds(lead + (tokens, head_dim * v_bits // 8), jnp.uint8),
        sds(lead + (tokens, head_dim // group), jnp.float16),
        sds(lead + (tokens, head_dim // group), jnp.float16),
        sds(lead + (residual, head_dim), dtype),
        sds(lead + (residual, head_dim), dtype),
        sds((), jnp.int32),
        sds((batch,), jnp.int32),
        sds((batch, 1, kv_heads, head_dim), dtype),
        sds((batch, 1, kv_heads, head_dim), dtype),
    )
    extra = (sds(lead + (sinks, head_dim), dtype), sds(lead + (sinks, head_dim), dtype),
             sds((head_dim // 2,), jnp.float32)) if pre_rope else ()
    assert kivi_decode_mosaic.unsupported(head_dim, k_bits, v_bits, group, residual) is None

    def decode(*a):
        k_sink, v_sink, freqs = a[13:] if pre_rope else (None, None, None)
        return kivi_decode_mosaic.decode(*a[:13], k_bits=k_bits, v_bits=v_bits, group_size=group,
                                         window=300 if pre_rope else None, k_sink=k_sink, v_sink=v_sink,
                                         inv_freq=freqs)

    return lowered_for_sm90(decode, *args, *extra)


GROUPS_DIMS = [(g, d) for d in (64, 128) for g in (32, 64, 128) if g <= d]
MOSAIC_MATRIX = [(kb, vb, g, d, rope) for kb in (2, 4) for vb in (2, 4) for g, d in GROUPS_DIMS
                 for rope in (False, True)]
# Lowering Mosaic GPU is slow (its layout inference and code emission run in Python: 3-30 s a configuration), so
# the default run lowers a covering set: every bits pair, every (G, head_dim) pair, keys after and before RoPE.
COVERING = [(2, 4, 32, 64, False), (4, 2, 64, 128, True), (2, 2, 128, 128, False), (4, 4, 64, 64, True),
            (2, 2, 32, 128, True)]
assert set(COVERING) <= set(MOSAIC_MATRIX) and {c[2:4] for c in COVERING} == set(GROUPS_DIMS)
assert {c[:2] for c in COVERING} == {(kb, vb) for kb in (2, 4) for vb in (2, 4)}


@needs_011
@pytest.mark.parametrize("config", COVERING, ids=[f"k{kb}v{vb}-g{g}-d{d}" + ("-prerope" if r else "")
                                                  for kb, vb, g, d, r in COVERING])
def test_kernel_lowers_for_sm90(config):
    kb, vb, g, d, rope = config
    lower(kb, vb, g, d, ("float32", "bfloat16")[COVERING.index(config) % 2], rope)


@needs_011
@pytest.mark.slow
def test_every_configuration_lowers_for_sm90():
    for i, (kb, vb, g, d, rope) in enumerate(MOSAIC_MATRIX):
        lower(kb, vb, g, d, ("float32", "bfloat16")[i % 2], rope, q_heads=(2, 6)[i % 2])


@needs_011
def test_model_decode_step_lowers_with_the_mosaic_kernel_reading_the_stacked_cache(monkeypatch):
    monkeypatch.setattr(attention, "pallas_target", lambda: "mosaic_gpu")
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=64, sliding_window=None)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: make_cache("k4v2-g64-r128", cfg, 2, 512, jnp.bfloat16, impl="pallas"))
    text = lowered_for_sm90(lambda p, t, c: forward(p, t, c), params, sds((2, 1), jnp.int32), cache)
    [call] = [line for line in text.splitlines() if MOSAIC_CALL in line and "custom_call" in line]
    assert "tensor<3x2x2x512x" in call  # the stacked cache itself is the operand: no per-layer slice


def test_dispatch_by_compute_capability(monkeypatch):
    """sm90 and newer try Mosaic GPU, then Triton (what jax 0.10 or an unsupported configuration gets); older GPUs
    Triton; KIVI_JAX_MOSAIC_GPU=0 keeps Triton on Hopper."""
    assert attention.mosaic_gpu_capable("9.0") and attention.mosaic_gpu_capable("10.0")
    assert not attention.mosaic_gpu_capable("8.9") and not attention.mosaic_gpu_capable("8.0")
    monkeypatch.setenv("KIVI_JAX_MOSAIC_GPU", "0")
    assert not attention.mosaic_gpu_capable("9.0")
    assert attention.kivi_kernels("mosaic_gpu") == [kivi_decode_mosaic, kivi_decode]
    assert attention.kivi_kernels("triton") == [kivi_decode]
    # 3-bit codes are Triton's on every GPU
    assert kivi_decode_mosaic.unsupported(64, 3, 2, 64, 128) is not None and kivi_decode.unsupported(64, 3, 2, 64,
                                                                                                     128) is None
    calls = []
    for module in (kivi_decode_mosaic, kivi_decode):
        monkeypatch.setattr(module, "decode", lambda *a, name=module.__name__, **k: calls.append(name) or
                            jnp.zeros(a[0].shape, a[0].dtype))
    monkeypatch.setattr(attention, "pallas_target", lambda: "mosaic_gpu")
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=64)
    q, k_new = sds((2, 1, 4, 64), jnp.float32), sds((2, 1, 2, 64), jnp.float32)
    for spec in ("k2v2-g32-r128", "k3v2-g64-r128"):
        cache = jax.eval_shape(lambda: make_cache(spec, cfg, 2, 256))
        calls.clear()
        jax.eval_shape(lambda c, q, k: attention.decode_kivi("pallas", q, c.k, c.v, 1, c.k_ring, c.v_ring, c.length,
                                                               k, k, None), cache, q, k_new)
        mosaic = spec.startswith("k2") and kivi_decode_mosaic.unsupported(64, 2, 2, 32, 128) is None
        assert calls == [(kivi_decode_mosaic if mosaic else kivi_decode).__name__], (spec, calls)


def test_triton_deprecation_is_silenced_only_for_itself():
    """jax 0.11 warns when it lowers a Triton kernel; the Triton kernel modules filter exactly that message."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flash_decoding.silence_triton_deprecation()
        warnings.warn(flash_decoding.TRITON_DEPRECATION + " and will be removed", DeprecationWarning)
        warnings.warn("some other deprecation", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["some other deprecation"]
