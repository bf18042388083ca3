"""The real Pallas -> Triton lowering (no GPU needed) succeeds for every shipped kernel configuration, and for a
whole model decode step whose layer scan feeds the kernels a traced layer index."""

import jax
import jax.numpy as jnp
import pytest

from kivi_jax.cache import make_cache
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import flash_decoding, full_decode, kivi_decode

TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # the custom-call target, old and new jaxlibs


def lowered_for_cuda(fn, *args) -> str:
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:  # jaxlibs after 0.10.2 compile the Triton IR while lowering: that needs CUDA's plugin
        if "Triton compilation handler" in str(e):
            pytest.skip(f"this jaxlib compiles Triton kernels at lowering time, which needs the CUDA plugin: {e}")
        raise
    assert any(t in text for t in TRITON_CALLS), "no Triton kernel in the CUDA lowering"
    return text


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


KIVI_MATRIX = [(kb, vb, g, d, dt) for kb in (2, 4) for vb in (2, 4) for d in (64, 128) for g in (32, 64, 128)
               if g <= d for dt in ("float32", "bfloat16")]


@pytest.mark.parametrize("k_bits, v_bits, group, head_dim, dtype", KIVI_MATRIX,
                         ids=[f"k{kb}v{vb}-g{g}-d{d}-{dt}" for kb, vb, g, d, dt in KIVI_MATRIX])
def test_kivi_kernel_lowers_to_triton(k_bits, v_bits, group, head_dim, dtype):
    layers, batch, kv_heads, q_heads, tokens, residual = 3, 2, 2, 6, 512, 128
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
        sds((), jnp.int32),  # the layer: traced
        sds((batch,), jnp.int32),
        sds((batch, 1, kv_heads, head_dim), dtype),
        sds((batch, 1, kv_heads, head_dim), dtype),
    )
    assert kivi_decode.unsupported(head_dim, k_bits, v_bits, group, residual) is None
    for window in (None, 300) if dtype == "bfloat16" else (None,):  # the window is a few scalar ops
        lowered_for_cuda(lambda *a: kivi_decode.decode(*a, k_bits=k_bits, v_bits=v_bits, group_size=group,
                                                       window=window, interpret=False), *args)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_full_kernel_lowers_to_triton(head_dim, dtype):
    layers, batch, kv_heads, q_heads, tokens = 3, 2, 3, 9, 1024
    cache = sds((layers, batch, kv_heads, tokens, head_dim), dtype)
    new = sds((batch, 1, kv_heads, head_dim), dtype)
    args = (sds((batch, 1, q_heads, head_dim), dtype), cache, cache, sds((), jnp.int32), sds((batch,), jnp.int32),
            new, new)
    for window in (None, 300):
        lowered_for_cuda(lambda *a: full_decode.decode(*a, window, interpret=False), *args)


@pytest.mark.parametrize("spec", ["kivi2", "k4v2-g64-r128", "full"])
def test_model_decode_step_lowers_with_the_kernel_reading_the_stacked_cache(spec, monkeypatch):
    """forward() over a cache with impl='pallas', lowered for CUDA: the layer index comes from the scan."""
    monkeypatch.setattr(flash_decoding, "interpret_default", lambda interpret: False)  # the real kernel, not on GPU
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=64, sliding_window=None)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: make_cache(spec, cfg, 2, 1024, jnp.bfloat16, impl="pallas"))
    text = lowered_for_cuda(lambda p, t, c: forward(p, t, c), params, sds((2, 1), jnp.int32), cache)
    [call] = [line for line in text.splitlines() if any(t in line for t in TRITON_CALLS)]
    assert "tensor<3x2x2x1024x" in call  # the stacked cache itself is the operand: no per-layer slice
    if spec != "full":
        assert "tensor<3x2x2x128x64xbf16>" in call  # and the stacked rings
