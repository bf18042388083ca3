// A greedy draw on the CPU, an XLA FFI handler: the index of each row's first maximum of float32 logits x [rows, n]
// (the first NaN where a row holds one), as int32 — jnp.argmax's answer, whose pure-jnp twin is
// kivi_jax.sampling.first_max (docs/kernels.md "Greedy draws"). XLA:CPU's reduces over a decode step's 32 rows of a
// 49,152-token vocabulary took 4-5 ms of its 72 (a max broadcast back over the logits, then a min over indices); this
// is one pass, 16 lanes each keeping its first maximum and where, rows shared out on the intra-op pool.

#include "simd.h"

namespace {

// Row x [n]: the first index of its maximum, or of its first NaN (a row of -inf: 0).
int32_t first_max_row(const float* x, int64_t n) {
  int64_t i = 0, at = 0;
  float best = NEG_INF;
#if defined(__AVX512F__)
  if (n >= 16) {  // 16 lanes, each keeping its first maximum (strictly greater replaces) and its index
    __m512 top = _mm512_loadu_ps(x);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = where;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n && !nan; i += 16) {
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 more = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, more, v);
      where = _mm512_mask_mov_epi32(where, more, idx);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) return (int32_t)j;
    }
    best = _mm512_reduce_max_ps(top);  // the first index among the lanes holding it
    at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ), where);
  }
#endif
  for (; i < n; ++i) {  // the rest (every element without AVX-512), after every index above
    if (std::isnan(x[i])) return (int32_t)i;
    if (x[i] > best) best = x[i], at = i;
  }
  return (int32_t)at;
}

ffi::Error FirstMaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("first_max: x must be [rows, n]");
  const int64_t rows = d[0], n = d[1];
  if (n < 1 || out->element_count() != (size_t)rows)
    return ffi::Error::InvalidArgument("first_max: x must have a column; out must be [rows]");
  const float* xp = x.typed_data();
  int32_t* o = out->typed_data();
  parallel_for(pool, rows, [&](int64_t r) { o[r] = first_max_row(xp + r * n, n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxFirstMax, FirstMaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, n]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // the first maximum's index [rows]
