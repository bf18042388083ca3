"""The real Pallas -> Triton lowering (no GPU needed) succeeds for every shipped kernel configuration, and for a
whole model decode step whose layer scan feeds the kernels a traced layer index."""

import functools

import jax
import jax.numpy as jnp
import pytest

from kivi_jax.cache import make_cache
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.pallas_kernels import flash_decoding, full_decode, kivi_decode

from gpu_target import cuda_target

TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # the custom-call target, old and new jaxlibs


def lowered_for_cuda(fn, *args) -> str:
    try:
        with cuda_target():  # jax 0.11 needs a GPU's compute capability to lower Triton: an H200's
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:  # jaxlibs after 0.10.2 compile the Triton IR while lowering: that needs CUDA's plugin
        if "Triton compilation handler" in str(e):
            pytest.skip(f"this jaxlib compiles Triton kernels at lowering time, which needs the CUDA plugin: {e}")
        raise
    assert any(t in text for t in TRITON_CALLS), "no Triton kernel in the CUDA lowering"
    return text


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


GROUPS_DIMS = [(g, d) for d in (64, 128) for g in (32, 64, 128) if g <= d]
# (k_bits, v_bits, group, head_dim, dtype, pre_rope): every shipped combination. 2/4-bit codes after RoPE in both
# compute dtypes; with 3-bit codes after RoPE, and before RoPE (with 4 sink tokens) for any bits, in bfloat16; the
# preset-like configurations before RoPE in float32 too.
KIVI_MATRIX = [(kb, vb, g, d, dt, False) for kb in (2, 4) for vb in (2, 4) for g, d in GROUPS_DIMS
               for dt in ("float32", "bfloat16")]
KIVI_MATRIX += [(kb, vb, g, d, "bfloat16", False) for kb in (2, 3, 4) for vb in (2, 3, 4) if 3 in (kb, vb)
                for g, d in GROUPS_DIMS]
KIVI_MATRIX += [(kb, vb, g, d, "bfloat16", True) for kb in (2, 3, 4) for vb in (2, 3, 4) for g, d in GROUPS_DIMS]
KIVI_MATRIX += [(kb, vb, 64, d, "float32", True) for kb, vb in ((3, 2), (4, 3)) for d in (64, 128)]


@pytest.mark.parametrize("k_bits, v_bits, group, head_dim, dtype, pre_rope", KIVI_MATRIX,
                         ids=[f"k{kb}v{vb}-g{g}-d{d}-{dt}" + ("-prerope-s4" if r else "")
                              for kb, vb, g, d, dt, r in KIVI_MATRIX])
def test_kivi_kernel_lowers_to_triton(k_bits, v_bits, group, head_dim, dtype, pre_rope):
    layers, batch, kv_heads, q_heads, tokens, residual, sinks = 3, 2, 2, 6, 512, 128, 4
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
    extra = (sds(lead + (sinks, head_dim), dtype), sds(lead + (sinks, head_dim), dtype),
             sds((head_dim // 2,), jnp.float32)) if pre_rope else ()
    assert kivi_decode.unsupported(head_dim, k_bits, v_bits, group, residual) is None

    def decode(*a, window):
        k_sink, v_sink, inv_freq = a[13:] if pre_rope else (None, None, None)
        return kivi_decode.decode(*a[:13], k_bits=k_bits, v_bits=v_bits, group_size=group, window=window,
                                  k_sink=k_sink, v_sink=v_sink, inv_freq=inv_freq, interpret=False)

    # the window is a few scalar ops: both ways for the 2/4-bit bfloat16 cases, with it before RoPE (sinks in view)
    windows = (None, 300) if dtype == "bfloat16" and 3 not in (k_bits, v_bits) and not pre_rope else \
        (300,) if pre_rope else (None,)
    for window in windows:
        lowered_for_cuda(functools.partial(decode, window=window), *args, *extra)


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


@pytest.mark.parametrize("spec", ["kivi2", "k4v2-g64-r128", "k3v2-g64-r128-prerope-s4", "k4v3-g64-r128-prerope-s4",
                                  "full"])
def test_model_decode_step_lowers_with_the_kernel_reading_the_stacked_cache(spec, monkeypatch):
    """forward() over a cache with impl='pallas', lowered for CUDA: the layer index comes from the scan (the
    preset-like specs: 3-bit codes, pre-RoPE keys and sinks reach the kernel too)."""
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
