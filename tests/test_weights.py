"""Quantized weights (kivi_jax/weights.py, docs/design.md §13): GGUF blocks bit for bit as `gguf` dequantizes them,
the native matmul against its XLA twin, quantized models against their float weights, checkpoints, lowering."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import checkpoint, native, weights
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import forward, init_params
from kivi_jax.weights import QuantizedMatrix

from test_checkpoint import write_gguf


def gguf_blocks(m: np.ndarray, type_name: str) -> np.ndarray:
    """`m [rows, cols]` float32 quantized by the `gguf` package into raw blocks `[rows, bytes]`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(m.astype(np.float32), GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_bit_for_bit_like_gguf(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    m = rng.standard_normal((37, 96)).astype(np.float32) * rng.uniform(0.01, 3, (37, 1)).astype(np.float32)
    m[3, :32] = 0.5  # a constant block (scale 0 in the file)
    raw = gguf_blocks(m, type_name)
    want = dequantize(raw, GGMLQuantizationType[type_name]).reshape(m.shape)
    got = np.asarray(weights.from_gguf_blocks(raw, type_name, transposed=False).dequantize())
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(got - m).max() < 0.2 * np.abs(m).max()  # and it is the matrix, roughly


def random_matrix(fmt: str, rows: int, cols: int, layers: int | None = None, seed: int = 0) -> QuantizedMatrix:
    rng = np.random.default_rng(seed)
    shape = (rows, cols) if layers is None else (layers, rows, cols)
    m = rng.standard_normal(shape).astype(np.float32)
    if fmt.startswith("q"):
        mats = [weights.from_gguf_blocks(gguf_blocks(x, fmt.upper()), fmt.upper(), True)
                for x in (m if layers else m[None])]
        return weights.stack_layers(mats) if layers else mats[0]
    return weights.quantize_matrix(m, fmt, transposed=True)


# (format, rows, cols): rows not a multiple of the kernel's 16-row items or the SIMD width; columns of int8 rows not
# a multiple of the SIMD width either (GGUF blocks are 32 columns by definition)
NATIVE_CASES = [("q8_0", 33, 96), ("q4_0", 7, 64), ("q4_1", 100, 128), ("int8", 21, 44), ("int8", 5, 72),
                ("int4-g32", 19, 96), ("int4-g64", 40, 128), ("int4-g128", 3, 256), ("int4s-g64", 17, 192)]


def test_matrices_sharing_an_input_run_in_one_native_call(monkeypatch):
    from kivi_jax.models.weights import dot_many
    from kivi_jax.native import matmul

    calls = []
    real = matmul.qmatmul
    monkeypatch.setattr(matmul, "qmatmul", lambda x, *ws: calls.append(len(ws)) or real(x, *ws))
    ws = (random_matrix("q4_1", 24, 64, layers=2), random_matrix("q8_0", 8, 64, layers=2, seed=1),
          random_matrix("int4-g32", 40, 64, layers=2, seed=2))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    f = jax.jit(lambda x, ws, layer: dot_many(x, tuple(w.at_layer(layer) for w in ws)))
    got = f(x, ws, jnp.int32(1))
    assert calls == [3]
    for y, w in zip(got, ws):
        want = np.asarray(x) @ np.asarray(w.dequantize())[1].T
        assert y.shape == (3, w.num_rows) and np.abs(np.asarray(y) - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("fmt, rows, cols", NATIVE_CASES)
def test_native_matmul_equals_the_xla_twin(fmt, rows, cols):
    assert native.available(), native.error()
    w = random_matrix(fmt, rows, cols, layers=3, seed=rows)
    f = jax.jit(lambda x, w, layer: w.at_layer(layer).matmul_t(x))
    # past 8 rows: weight rows dequantized once, register-blocked tiles; past 16 (STRIP_ROWS: a prefill chunk, a
    # larger decode step): a strip of rows decoded into gemm.h's packed tiles (row counts that are multiples of
    # neither its 12 rows nor its 512)
    for batch in (1, 3, 8, 9, 13, 16, 17, 32, 45, 64, 65, 131, 523):
        x = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, cols)), jnp.float32)
        ref = np.asarray(f(x, w.replace(impl="xla"), jnp.int32(2)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent fallback
            got = np.asarray(f(x, w.replace(impl="native"), jnp.int32(2)))
        want = x @ np.asarray(w.dequantize())[2].T  # dequantize, then dot
        assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (fmt, batch)


@pytest.mark.parametrize("fmt, rows, cols", NATIVE_CASES + [("q4_1", 65, 64), ("q8_0", 32, 32)])
def test_a_strip_major_copy_gives_the_same_products(fmt, rows, cols):
    """A matrix holding its strip-major copy (`weights.with_strips`: a call past 16 rows decodes it straight into
    the kernel's packed strips) gives bit for bit the products of the same matrix without it, at every row count; a
    corrupted copy changes the products past 16 rows only (so the copy is what those read), and a copy laid out for
    other strips is refused."""
    from kivi_jax.native import matmul

    assert native.available(), native.error()
    w = random_matrix(fmt, rows, cols, layers=3, seed=rows).replace(impl="native")
    strip = matmul.strip_rows()
    copy = weights.strip_layout(w, strip)
    assert copy.shape[:2] == (3, -(-rows // strip)) and copy.dtype == np.uint8 and copy.shape[2] % 64 == 0
    with_copy = w.replace(strips=jnp.asarray(copy))
    corrupt = copy.copy()
    corrupt[2, -1, : cols * w.bits * strip // 8] ^= 0x11  # the last strip's codes at layer 2
    f = jax.jit(lambda x, w, layer: w.at_layer(layer).matmul_t(x))
    for batch in (1, 9, 16, 17, 32, 45, 131, 523):
        x = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, cols)), jnp.float32)
        want = np.asarray(f(x, w, jnp.int32(2)))
        np.testing.assert_array_equal(np.asarray(f(x, with_copy, jnp.int32(2))), want)
        changed = np.asarray(f(x, w.replace(strips=jnp.asarray(corrupt)), jnp.int32(2))) != want
        assert changed.any() == (batch > matmul.STRIP_ROWS), batch
        assert not changed[:, : (rows - 1) // strip * strip].any()  # the other strips read as they are
    other = w.replace(strips=jnp.asarray(weights.strip_layout(w, strip // 2)))
    with pytest.raises(Exception, match="strips must be uint8"):
        f(jnp.ones((20, cols), jnp.float32), other, jnp.int32(0)).block_until_ready()


def test_with_strips_copies_every_4_and_8_bit_matrix_and_a_reordering_drops_the_copy():
    """`with_strips` gives every 4- and 8-bit matrix of a model its copy (counted in `nbytes`) and leaves float
    params as they are; permuting a matrix's rows (`map_rows`) or stacking layers drops a copy that would be stale."""
    from kivi_jax.native import matmul

    params = init_params(tiny_cfg(), jax.random.PRNGKey(0), std=0.1)
    quantized = weights.convert_params(params, "int4-g32")  # 4-bit projections, int8 embeddings
    copied = weights.with_strips(quantized)
    mats = lambda p: [w for w in jax.tree_util.tree_leaves(p, is_leaf=weights.is_quantized) if weights.is_quantized(w)]
    assert mats(copied) and all(w.strips is not None for w in mats(copied))
    assert all(w.strips is None for w in mats(quantized))
    for a, b in zip(mats(quantized), mats(copied)):
        assert b.nbytes == a.nbytes + b.strips.size
        np.testing.assert_array_equal(np.asarray(b.strips), weights.strip_layout(a, matmul.strip_rows()))
    assert weights.with_strips(params) is params  # float weights: nothing to copy
    w = copied.layers.wq  # a stack [layers, rows, ...]
    assert w.strips is not None and w.strips.shape[0] == w.codes.shape[0] == 2
    assert weights.map_rows(w, lambda a: a[..., ::-1, :]).strips is None
    single = [w.replace(codes=w.codes[i], scale=w.scale[i], mn=None if w.mn is None else w.mn[i]) for i in range(2)]
    assert weights.stack_layers(single).strips is None


def test_native_is_taken_for_decode_and_prefill_in_one_call(monkeypatch):
    from kivi_jax.native import matmul

    calls = []
    real = matmul.qmatmul
    monkeypatch.setattr(matmul, "qmatmul", lambda x, *ws: calls.append(x.shape) or real(x, *ws))
    w = random_matrix("q4_1", 16, 64)
    jax.jit(lambda x: w.matmul_t(x)).lower(jnp.ones((1, 4, 64), jnp.float32))
    jax.jit(lambda x: w.matmul_t(x)).lower(jnp.ones((2, 512, 64), jnp.float32))  # a prefill chunk: packed strips
    assert calls == [(4, 64), (1024, 64)]
    jax.jit(lambda x: w.matmul_t(x)).lower(jnp.ones((45, 64), jnp.float32))  # a 45-row decode step: one call
    assert calls[2:] == [(45, 64)]
    with pytest.warns(UserWarning, match="XLA path"):  # forced native on a dtype it cannot take says so
        jax.jit(lambda x: w.replace(impl="native").matmul_t(x)).lower(jnp.ones((65, 64), jnp.bfloat16))
    assert calls[3:] == []


# (in, out) of float matrices: neither a multiple of the kernel's column blocks (64, 16) nor of the SIMD width
FLOAT_CASES = [(64, 96), (72, 40), (33, 17), (576, 192)]


@pytest.mark.parametrize("cols, rows", FLOAT_CASES)
def test_float_native_matmul_equals_the_xla_twin(cols, rows):
    """A float32 projection W [in, out] (read at a layer of its stack) and a table T [out, in] through the native
    kernel against XLA's dot, for every activation-row count a decode bucket can have and a few odd ones; a
    projection also for prefill-sized inputs (the packed strips past 64 rows: row counts that are multiples of
    neither the tile's 12 rows nor the 512 of a work item)."""
    from kivi_jax.native import matmul

    assert native.available(), native.error()
    rng = np.random.default_rng(cols * rows)
    w = jnp.asarray(rng.standard_normal((3, cols, rows)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)
    f = jax.jit(lambda x, m, layer: m.at_layer(layer).matmul_t(x) if m.transposed else m.matmul_t(x))
    for batch in (1, 2, 3, 7, 8, 13, 16, 32, 45, 64, 65, 131, 523):
        x = jnp.asarray(rng.standard_normal((batch, cols)), jnp.float32)
        cases = [(weights.FloatMatrix(w), np.asarray(x, np.float64) @ np.asarray(w[2], np.float64))]
        if batch <= matmul.SPLIT_ROWS:  # a table takes the kernel for a decode step's rows only
            cases.append((weights.FloatMatrix(t, transposed=False), np.asarray(x, np.float64) @ np.asarray(t).T))
        for m, want in cases:
            ref = np.asarray(f(x, m.replace(impl="xla"), jnp.int32(2)))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no silent fallback
                got = np.asarray(f(x, m.replace(impl="native"), jnp.int32(2)))
            assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max()
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (m.transposed, batch)


def test_float_matrices_sharing_an_input_run_in_one_native_call(monkeypatch):
    from kivi_jax.models.weights import dot_many
    from kivi_jax.native import matmul

    calls = []
    real = matmul.fmatmul
    monkeypatch.setattr(matmul, "fmatmul", lambda x, *ws: calls.append(len(ws)) or real(x, *ws))
    rng = np.random.default_rng(0)
    ws = tuple(weights.FloatMatrix(jnp.asarray(rng.standard_normal((2, 64, n)), jnp.float32)) for n in (64, 32, 32))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    got = jax.jit(lambda x, ws, layer: dot_many(x, tuple(w.at_layer(layer) for w in ws)))(x, ws, jnp.int32(1))
    assert calls == [3]
    for y, w in zip(got, ws):
        want = np.asarray(x) @ np.asarray(w.w[1])
        assert np.abs(np.asarray(y) - want).max() <= 1e-5 * np.abs(want).max()


def test_native_view_takes_float32_decode_steps_and_prefill_projections():
    """`native_view` runs a float32 decode step's projections and tied head in the native kernel (the stacks read in
    place: no dynamic slice of a weight stack is left), with the logits of the plain model; a prefill chunk's
    projections too (its head over every position keeps XLA's dot); bfloat16 weights and a program lowered for a GPU
    keep XLA's dot."""
    params = init_params(tiny_cfg(num_layers=3), jax.random.PRNGKey(0))
    cache = kivi_jax.make_cache("kivi2", params.config, 4, 256)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (4, 1)), jnp.int32)
    plain = jax.jit(lambda p, t, c: forward(p, t, c)[0])
    viewed = jax.jit(lambda p, t, c: forward(weights.native_view(p), t, c)[0])
    text = viewed.lower(params, tokens, cache).compile().as_text()
    assert text.count('custom_call_target="kivi_jax_fmatmul"') == 5  # qkv, o, gate+up, down, the head
    sliced = lambda hlo: [l for l in hlo.splitlines()  # w_down's layer copied out of its stack
                          if l.split("=")[0].strip().startswith("%dynamic-slice") and "= f32[192,128]" in l]
    assert sliced(plain.lower(params, tokens, cache).compile().as_text()) and not sliced(text)
    got, want = np.asarray(viewed(params, tokens, cache)), np.asarray(plain(params, tokens, cache))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    prefill = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 96)), jnp.int32)
    fresh = lambda: kivi_jax.make_cache("kivi2", params.config, 2, 256)
    text = viewed.lower(params, prefill, fresh()).compile().as_text()
    assert text.count('custom_call_target="kivi_jax_fmatmul"') == 4  # qkv, o, gate+up, down: 96 rows a sequence
    assert not sliced(text)
    got, want = np.asarray(viewed(params, prefill, fresh())), np.asarray(plain(params, prefill, fresh()))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    bf16 = weights.convert_params(params, "bfloat16")
    assert "kivi_jax_fmatmul" not in viewed.lower(bf16, tokens, kivi_jax.make_cache(
        "kivi2", params.config, 4, 256, jnp.bfloat16)).as_text()
    gpu = viewed.trace(params, tokens, cache).lower(lowering_platforms=("cuda",)).as_text()
    assert "kivi_jax_fmatmul" not in gpu and "dot_general" in gpu


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4-g32"])
def test_prefill_view_dots_in_bfloat16_close_to_float32(fmt):
    """`dot_view(params, 'bfloat16')`: every projection and the head dot bfloat16 operands with float32 sums (the
    lowered program's dots read bf16), never the float32 native kernels even for a short chunk, and the logits stay
    within bfloat16 rounding of the float32 model's; 'float32' changes nothing; another precision is refused."""
    params = init_params(tiny_cfg(), jax.random.PRNGKey(0))
    params = params if fmt == "float32" else weights.convert_params(params, fmt)
    view = weights.dot_view(params, "bfloat16")
    assert weights.dot_view(params, "float32") is params
    with pytest.raises(ValueError, match="prefill precision"):
        weights.dot_view(params, "float16")
    f = jax.jit(lambda p, t: forward(p, t, kivi_jax.make_cache("kivi2", p.config, 2, 256))[0])
    for n in (16, 96):  # 32 and 192 rows: a short chunk would otherwise take the native kernel
        tokens = jnp.asarray(np.random.default_rng(n).integers(0, 96, (2, n)), jnp.int32)
        text = f.lower(view, tokens).as_text()
        assert "kivi_jax_fmatmul" not in text and "kivi_jax_qmatmul" not in text
        assert len([l for l in text.splitlines() if "dot_general" in l and "xbf16>" in l]) >= 6
        got, want = np.asarray(f(view, tokens)), np.asarray(f(params, tokens))
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
        assert np.abs(got - want).max() > 0  # the operands were rounded


def test_q8_rows_round_each_group_to_int8():
    """`q8_rows`: a group's largest magnitude becomes +-127, the rest round to nearest even against d = amax / 127,
    an all-zero group stays zero (scale 0), and the rounded sums are d times the codes' sums."""
    x = np.zeros((2, 8), np.float32)
    x[0, :4] = [1.0, -2.0, 0.5, 1.0 / 127 * 2 * 0.5 * 2]  # the last one 2/127 of amax 2: code 1 (1.0 exactly)
    x[1, 4:] = [0.0, 127.0, -63.5, 0.5]  # ties to even: -63.5 -> -64 (even), 0.5 -> 0
    q, d, sums = (np.asarray(a) for a in weights.q8_rows(jnp.asarray(x), 4))
    assert q.shape == (2, 2, 4) and d.shape == sums.shape == (2, 2)
    assert q[0, 0].tolist() == [64, -127, 32, 1] and np.isclose(d[0, 0], 2 / 127)
    assert q[0, 1].tolist() == [0, 0, 0, 0] and d[0, 1] == 0 and sums[0, 1] == 0
    assert q[1, 1].tolist() == [0, 127, -64, 0] and d[1, 1] == 1.0 and sums[1, 1] == 63.0
    assert np.isclose(sums[0, 0], (64 - 127 + 32 + 1) * 2 / 127)


@pytest.mark.parametrize("fmt, rows, cols", NATIVE_CASES)
def test_int8_activations_native_equals_the_twin(fmt, rows, cols):
    """`dot_dtype='int8'` (a prefill view's): the twin `q8_dot` is the dequantized matrix times x rounded to int8 per
    group, and the native kernel (AVX512-VNNI) equals the twin at every row count (1-4 rows against 32-column groups
    weight row by weight row; tiles of 6 rows, blocks of 512 rows: counts that are multiples of neither), columns that
    are whole 64s of its register transpose or not (an odd number of 32-column groups: a lone last group)."""
    from kivi_jax.native import matmul

    w = random_matrix(fmt, rows, cols, layers=3, seed=rows).replace(dot_dtype="int8")
    f = jax.jit(lambda x, w, layer: w.at_layer(layer).matmul_t(x))
    for batch in (1, 2, 3, 4, 5, 64, 65, 131, 523):
        x = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, cols)), jnp.float32)
        ref = np.asarray(f(x, w.replace(impl="xla"), jnp.int32(2)))
        q, d, _ = weights.q8_rows(x, w.group)
        rounded = (np.asarray(q, np.float64) * np.asarray(d, np.float64)[..., None]).reshape(batch, cols)
        want = rounded @ np.asarray(w.dequantize(), np.float64)[2].T  # the contract, in float64
        assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max(), (fmt, batch)
        exact = np.asarray(x) @ np.asarray(w.dequantize())[2].T
        assert 0 < np.abs(ref - exact).max() <= 5e-2 * np.abs(exact).max()  # rounded, and only by int8's step
        if not matmul.int8_matmul():
            continue  # (no VNNI: the twin is what runs; asserted below)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent fallback
            got = np.asarray(f(x, w.replace(impl="native"), jnp.int32(2)))
        assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max(), (fmt, batch)
    if not matmul.int8_matmul():
        assert "VNNI" in matmul.unsupported(w, 64, jnp.float32)


def test_prefill_view_int8_rounds_quantized_activations_only(monkeypatch):
    """`dot_view(params, 'int8')`: 4- and 8-bit matrices dot x rounded to int8 (the native kernel where the CPU
    has VNNI, in the lowered program), float weights stay as they are; a tiny model's logits stay within int8's
    rounding of the float32 prefill's, the native and XLA paths agree but for a rare code rounded apart."""
    from kivi_jax.native import matmul

    params = weights.convert_params(init_params(tiny_cfg(), jax.random.PRNGKey(0)), "int4-g32")
    view = weights.dot_view(params, "int8")
    fmts = {name: w.dot_dtype for name, w, _ in weights._quantizable(view) if weights.is_quantized(w)}
    assert fmts and set(fmts.values()) == {"int8"}
    floats = init_params(tiny_cfg(), jax.random.PRNGKey(0))
    assert weights.dot_view(floats, "int8") is floats  # nothing quantized: nothing to round
    # the server's `auto`: int8 where the kernel takes it, float32 for float weights or without VNNI
    assert weights.auto_precision(params) == ("int8" if matmul.int8_matmul() else "float32")
    assert weights.auto_precision(floats) == "float32" and weights.dot_view(floats, "auto") is floats
    f = jax.jit(lambda p, t: forward(p, t, kivi_jax.make_cache("kivi2", p.config, 2, 256))[0])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 96)), jnp.int32)
    text = f.lower(view, tokens).as_text()
    assert ("kivi_jax_qmatmul" in text) == matmul.int8_matmul()
    got, want = np.asarray(f(view, tokens)), np.asarray(f(params, tokens))
    assert 0 < np.abs(got - want).max() <= 5e-2 * np.abs(want).max()
    twin = np.asarray(f(weights.with_impl(view, "xla"), tokens))
    # the paths' float sums differ in order, so a layer's activation on a rounding boundary may round to the next
    # code in one and not the other: a few logits move by a step, the rest agree to float32's rounding
    assert np.abs(got - twin).max() <= 1e-2 * np.abs(twin).max()
    assert np.abs(got - twin).mean() <= 1e-4 * np.abs(twin).max()


# (rows, cols) of bf16 matrices: rows not a multiple of the kernel's 64-row items (nor of AMX's 16-row tiles), columns
# a multiple of AMX's 32 or not (the widening tiles)
BF16_CASES = [(37, 100), (130, 577), (576, 192), (130, 576)]


@pytest.mark.parametrize("rows, cols", BF16_CASES)
def test_bf16_native_matmul_equals_the_xla_twin(rows, cols):
    """A `bf16` matrix holds its float matrix rounded to bfloat16, exactly; its dot (activations rounded to bfloat16,
    float32 sums) through the native kernel up to BF16_ROWS rows (AMX tiles where the CPU has them) and XLA's dot past
    them, against float64."""
    from kivi_jax.native import matmul

    assert native.available(), native.error()
    rng = np.random.default_rng(rows)
    m = rng.standard_normal((3, rows, cols)).astype(np.float32)
    w = weights.quantize_matrix(m, "bf16", transposed=True)
    rounded = np.asarray(jnp.asarray(m, jnp.bfloat16).astype(jnp.float32))
    assert w.fmt == "bf16" and w.num_cols == cols and np.array_equal(np.asarray(w.dequantize()), rounded)
    assert w.nbytes == m.size * 2 + 3 * rows * 4  # half the float32 matrix, and a scale a row
    f = jax.jit(lambda x, w, layer: w.at_layer(layer).matmul_t(x))
    for batch in (1, 2, 3, 7, 8, 13, 16, 17, 32, 45, 64, 65, 300):  # 300: parts of 128 activation rows, and 44
        x = jnp.asarray(rng.standard_normal((batch, cols)), jnp.float32)
        want = np.asarray(x.astype(jnp.bfloat16), np.float64) @ rounded[2].T.astype(np.float64)
        ref = np.asarray(f(x, w.replace(impl="xla"), jnp.int32(2)))
        text = f.lower(x, w, jnp.int32(2)).as_text()
        assert ("kivi_jax_bmatmul" in text) == (batch <= matmul.BF16_ROWS), batch
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent fallback
            got = np.asarray(f(x, w.replace(impl="native" if batch <= matmul.BF16_ROWS else "auto"), jnp.int32(2)))
        assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), batch


def test_bf16_and_quantized_matrices_sharing_an_input(monkeypatch):
    """q, k and v of mixed formats (a rotated cache re-quantizes wv as int8 beside bf16 wq and wk): the bf16 ones in
    one bfloat16 call, the others in one quantized call, each result its own matrix's."""
    from kivi_jax.models.weights import dot_many
    from kivi_jax.native import matmul

    calls = []
    for name in ("bmatmul", "qmatmul"):
        real = getattr(matmul, name)
        monkeypatch.setattr(matmul, name, lambda x, *ws, real=real, name=name: calls.append((name, len(ws)))
                            or real(x, *ws))
    ws = (random_matrix("bf16", 24, 64, layers=2), random_matrix("int8", 8, 64, layers=2, seed=1),
          random_matrix("bf16", 40, 64, layers=2, seed=2))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    got = jax.jit(lambda x, ws, layer: dot_many(x, tuple(w.at_layer(layer) for w in ws)))(x, ws, jnp.int32(1))
    assert sorted(calls) == [("bmatmul", 2), ("qmatmul", 1)]
    for y, w in zip(got, ws):
        want = np.asarray(w.at_layer(jnp.int32(1)).replace(impl="xla").matmul_t(x))
        assert y.shape == (3, w.num_rows) and np.abs(np.asarray(y) - want).max() <= 1e-5 * np.abs(want).max()


def tiny_cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=32, tie_word_embeddings=True)
    return LlamaConfig(**{**base, **kw})


def test_quantized_tiny_model_tracks_the_float_model():
    """Each format computes exactly the model its dequantized weights make (up to summation order), close to the
    float model it came from: relative RMS error of the logits (random weights: 4-bit codes of Gaussian weights are
    the worst case; the real model's loss is measured in docs/benchmarks.md)."""
    params = init_params(tiny_cfg(), jax.random.PRNGKey(0), std=0.1)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)))
    fwd = jax.jit(forward)
    ref = np.asarray(fwd(params, toks)[0])
    err = {}
    for fmt in ("int8", "int4-g64"):
        q = weights.convert_params(params, fmt)
        assert weights.formats(q)["layers.wq"] == fmt and weights.formats(q)["embed"] == weights.table_format(fmt)
        got = np.asarray(fwd(q, toks)[0])
        same = np.asarray(fwd(weights.dequantize_params(q, jnp.float32), toks)[0])
        assert np.abs(got - same).max() <= 1e-5 * np.abs(same).max()
        err[fmt] = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert 0 < err["int8"] <= 0.05 and err["int8"] < err["int4-g64"] <= 0.4, err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:weights impl .native.")  # the prompt's prefill: XLA's dot, as it should
def test_bfloat16_weights_under_a_float32_model():
    """`weights='bfloat16'` with float32 compute: every matrix `bf16` (half the bytes), norms and activations float32;
    its logits the float model's within bfloat16 rounding, and the native and XLA paths give one greedy answer."""
    params = init_params(tiny_cfg(tie_word_embeddings=False), jax.random.PRNGKey(2), std=0.1)
    half = weights.convert_params(params, "bfloat16", jnp.float32)
    fmts = weights.formats(half)
    assert fmts["embed"] == fmts["lm_head"] == fmts["layers.wq"] == fmts["layers.w_down"] == "bf16"
    assert fmts["final_norm"] == fmts["layers.attn_norm"] == "float32" and half.dtype == jnp.float32
    assert weights.summary(half) == "bf16"
    assert half.layers.wq.nbytes < 0.6 * params.layers.wq.nbytes
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)))
    ref = np.asarray(jax.jit(forward)(params, toks)[0])
    got = np.asarray(jax.jit(forward)(half, toks)[0])
    err = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert 0 < err <= 0.02, err
    model = kivi_jax.Model(half, half.config, None)
    kw = dict(max_new_tokens=12, cache="kivi2", stop_at_eos=False)
    nat = kivi_jax.generate(model._replace(params=weights.with_impl(half, "native")), [[5, 6, 7], [9]], **kw)
    xla = kivi_jax.generate(model._replace(params=weights.with_impl(half, "xla")), [[5, 6, 7], [9]], **kw)
    assert nat.token_ids == xla.token_ids
    with pytest.raises(ValueError, match="disagree"):  # float16 weights under float32: not a format
        weights.convert_params(params, "float16", jnp.float32)
    all_half = weights.convert_params(params, "bfloat16")  # no dtype: bfloat16 compute, as before
    assert all_half.dtype == jnp.bfloat16 and weights.formats(all_half)["layers.wq"] == "bfloat16"


def test_a_bfloat16_models_chunks_attend_in_bfloat16_and_its_decode_steps_do_not(monkeypatch):
    """Where the projections dot in bfloat16 (bf16 weights under float32, a bfloat16 prefill view, a bfloat16
    model) a prefill chunk's queries go to the cache in bfloat16, so its attention dots in bfloat16 too: its logits
    move within bfloat16 rounding of float32 attention's; a decode step's (one new token) are float32's to the bit."""
    from kivi_jax.cache import make_cache
    from kivi_jax.models import weights as seam

    params = init_params(tiny_cfg(tie_word_embeddings=False), jax.random.PRNGKey(3), std=0.1)
    half = weights.convert_params(params, "bfloat16", jnp.float32)
    assert seam.dots_in_bfloat16(half.layers) and not seam.dots_in_bfloat16(params.layers)
    assert seam.dots_in_bfloat16(weights.dot_view(params, "bfloat16").layers)
    assert seam.dots_in_bfloat16(weights.convert_params(params, "bfloat16").layers)
    assert not seam.dots_in_bfloat16(weights.convert_params(params, "int8").layers)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 70)))

    def run(*args):  # traced afresh (jit's cache would keep the first trace's choice)
        return jax.jit(lambda *a: forward(*a))(*args)

    chunk16, cache = run(half, toks, make_cache("kivi2", half.config, 2, 128))  # a 70-token chunk
    step16, _ = run(half, toks[:, :1], cache)  # then one decode step from the cache it left
    monkeypatch.setattr(seam, "dots_in_bfloat16", lambda layers: False)
    chunk32, _ = run(half, toks, make_cache("kivi2", half.config, 2, 128))
    step32, _ = run(half, toks[:, :1], cache)
    err = np.abs(np.asarray(chunk16 - chunk32)).max()
    assert 0 < err <= 2e-2 * np.abs(np.asarray(chunk32)).max(), err
    np.testing.assert_array_equal(np.asarray(step16), np.asarray(step32))


def test_quantized_checkpoint_roundtrips_exactly(tmp_path):
    params = weights.convert_params(init_params(tiny_cfg(tie_word_embeddings=False), jax.random.PRNGKey(1)),
                                    "int4-g32")
    out = checkpoint.save(params, tmp_path / "q")
    back = checkpoint.restore(out)
    assert weights.formats(back) == weights.formats(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert back.layers.wq.transposed and not back.embed.transposed and back.lm_head.transposed
    half = checkpoint.restore(out, jnp.bfloat16)  # the compute dtype casts float leaves only
    assert half.dtype == jnp.bfloat16 and half.layers.wq.codes.dtype == jnp.uint8
    bf16 = weights.convert_params(params, "bfloat16", jnp.float32)
    back = checkpoint.restore(checkpoint.save(bf16, tmp_path / "b"))
    assert weights.formats(back) == weights.formats(bf16) and back.layers.wq.codes.dtype == jnp.uint16
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(bf16), jax.tree_util.tree_leaves(back)))


@pytest.mark.slow
def test_gguf_blocks_load_as_stored_and_equal_the_dequantized_model(tiny_dirs, tmp_path):
    """A GGUF of Q8_0 / Q4_0 / Q4_1 tensors keeps its blocks by default; its logits are the float32-dequantized
    model's up to summation order, its greedy tokens the same; `weights='float32'` gives today's float params."""
    _, model = tiny_dirs["llama_mha"]
    path = tmp_path / "q.gguf"
    write_gguf(model, path, types={"token_embd": "Q8_0", "attn_q": "Q4_0", "default": "Q4_1"})
    # (the tiny GGUF has no tokenizer, which kivi_jax.load would build: load the params as load_any does)
    blocks = kivi_jax.Model(weights.convert_params(checkpoint.load_gguf(path, keep_blocks=True), "auto"), None, None)
    flat = kivi_jax.Model(checkpoint.load_gguf(path), None, None)
    fmts = weights.formats(blocks.params)
    assert fmts["embed"] == "q8_0" and fmts["layers.wq"] == "q4_0" and fmts["layers.w_up"] == "q4_1"
    assert fmts["layers.w_down"] == "float32"  # 112 columns: not whole blocks, kept float by the writer
    assert weights.summary(flat.params) == "float32"
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 96, (1, 20)))
    a, b = (np.asarray(jax.jit(forward)(m.params, toks)[0]) for m in (blocks, flat))
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    for name in ("wq", "w_gate"):  # bit for bit the float32 params gguf's dequantize gives
        got, want = getattr(blocks.params.layers, name).logical(), getattr(flat.params.layers, name)
        assert np.array_equal(np.asarray(got), np.asarray(want))
    kw = dict(max_new_tokens=16, cache="kivi2", stop_at_eos=False)
    assert kivi_jax.generate(blocks, [[5, 6, 7]], **kw).token_ids == kivi_jax.generate(flat, [[5, 6, 7]], **kw).token_ids
    with pytest.raises(ValueError, match="GGUF"):
        weights.convert_params(flat.params, "gguf")


def test_weights_names_are_checked():
    for bad in ("int3", "int4-g48", "fp8", 8):
        with pytest.raises(ValueError, match="weights"):
            weights.check_weights(bad)
    params = init_params(tiny_cfg(hidden_size=96, head_dim=24), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="int4-g32"):  # 96 columns: g64 does not divide them, g32 does
        weights.convert_params(params, "int4-g64")
    with pytest.raises(ValueError, match="disagree"):
        weights.convert_params(params, "float32", jnp.bfloat16)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_the_xla_path_lowers_for_gpu_and_tpu(platform, fmt):
    params = weights.convert_params(init_params(tiny_cfg(), jax.random.PRNGKey(0)), fmt, jnp.float32)
    cache = kivi_jax.make_cache("kivi2", params.config, 2, 256)
    step = jax.jit(lambda p, t, c: forward(p, t, c), donate_argnums=(2,))
    text = step.trace(params, jnp.ones((2, 1), jnp.int32), cache).lower(lowering_platforms=(platform,)).as_text()
    assert "kivi_jax_qmatmul" not in text and "kivi_jax_bmatmul" not in text and "dot_general" in text
