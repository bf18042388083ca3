// Float32-weight matmul on the CPU for the few activation rows of a decode step, an XLA FFI handler (docs/kernels.md
// "Float weights"), and its bfloat16-weight sibling (`KiviJaxBMatmul`, below). Its contract is
// kivi_jax.weights.FloatMatrix.matmul_t's XLA path: y = x W for a projection W [C, R] (a stacked [layers, C, R] leaf
// read at the layer index, in place: XLA's dot would first copy the layer's slice out of the stack), or y = x T^T for
// a table T [R, C] (the tied output head).
//
// Work items are blocks of output units shared out on XLA's intra-op thread pool; an item runs every tile of
// activation rows over its block (gemm.h), the first tile reading the block's weights from memory, the others from
// cache, so each weight is read from memory once per call whatever the rows. A projection of more than GEMM_ROWS
// activation rows (a prefill chunk) goes a packed strip at a time instead (`gemm_strip`: an item is a strip of
// GEMM_NR output units by up to GEMM_MB rows, 12 rows by 32 units in registers on AVX-512).

#include "amx.h"
#include "gemm.h"

namespace {

#if KIVI_AMX
// AMX for bfloat16 weights: y^T = M x^T in tiles, weights as the A operand (16 output rows by 32 inputs, each row
// read where it lies), the activations packed once a call as the B operand (input pairs by 16 activation rows), four
// 16 x 16 float32 accumulators (32 outputs by 32 activation rows), each run after `amx_allowed()` (amx.h).

// 16 floats -> their bfloat16 bits (rounded to nearest even, as XLA converts), in order.
inline __m256i bf16_round16(const float* src) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src));
#else
  const __m512i u = _mm512_loadu_si512(src);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                                 16));
#endif
}

// Activation rows [n0, n0 + 16) of x [N, C] float32, rounded to bfloat16, as their B tiles in xp [n16 / 16][C / 2]
// [16] uint32 (a pair of inputs' bfloat16 bits by 16 activation rows; each tile's 16 pair rows contiguous), zero past
// N.
inline void pack_rows(const float* x, int64_t N, int64_t C, int64_t n0, uint32_t* xp) {
  uint32_t* dst = xp + n0 / 16 * (C / 2) * 16;
  for (int64_t p0 = 0; p0 < C / 2; p0 += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      if (n0 + i >= N) {
        r[i] = _mm512_setzero_si512();
        continue;
      }
      const float* src = x + (n0 + i) * C + 2 * p0;  // 32 inputs, in order
      const __m256i lo = bf16_round16(src), hi = bf16_round16(src + 16);
      r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    transpose16(r);  // r[j]: pair p0 + j of the 16 rows
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (p0 + j) * 16, r[j]);
  }
}

// Outputs [r0, r1) (whole 16s) of y [N, R] = (x W^T) * scale for activation rows [n0, n1) (n0 a multiple of 32, n1
// of 16 or N's rounding up to 16) of the packed activations xp (`pack_rows`) and the weights w [R, C] (C a multiple
// of 32) at row r0: each accumulator (16 outputs by 16 activation rows) transposed in registers and stored a row of
// 16 outputs at a time, scaled.
inline void amx_block(const uint32_t* xp, int64_t N, int64_t n0, int64_t n1, int64_t C, const uint16_t* w,
                      const float* scale, float* y, int64_t R, int64_t r0, int64_t r1) {
  load_square_tiles();
  const int64_t P = C / 2;
  alignas(64) float out[4][16 * 16];
  for (int64_t r = r0; r < r1; r += 32) {
    const bool two = r + 32 <= r1;  // 32 outputs, else 16
    for (int64_t nb = n0; nb < n1; nb += 32) {
      const bool pair = nb + 16 < n1;  // 32 activation rows, else 16
      const uint32_t* b0 = xp + nb / 16 * P * 16;
      const uint32_t* b1 = b0 + P * 16;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < C; k += 32) {
        _tile_loadd(4, w + (r - r0) * C + k, C * 2);
        _tile_loadd(6, b0 + k / 2 * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (pair) {
          _tile_loadd(7, b1 + k / 2 * 16, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
          _tile_loadd(5, w + (r - r0 + 16) * C + k, C * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (pair) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, out[0], 64);  // the tile register is an immediate
      if (pair) _tile_stored(1, out[1], 64);
      if (two) _tile_stored(2, out[2], 64);
      if (two && pair) _tile_stored(3, out[3], 64);
      for (int t = 0; t < 4; ++t) {  // out[t][m][n]: output ro + m, activation row no + n
        if ((t >= 2 && !two) || ((t & 1) && !pair)) continue;
        const int64_t ro = r + (t >= 2 ? 16 : 0), no = nb + (t & 1 ? 16 : 0);
        __m512i v[16];
        for (int m = 0; m < 16; ++m) v[m] = _mm512_load_si512(out[t] + m * 16);
        transpose16(v);  // v[n]: outputs ro.. of activation row no + n
        const __m512 s = _mm512_loadu_ps(scale + ro);
        for (int n = 0; n < 16 && no + n < N; ++n)
          _mm512_storeu_ps(y + (no + n) * R + ro, _mm512_mul_ps(_mm512_castsi512_ps(v[n]), s));
      }
    }
  }
  _tile_release();
}
#endif

constexpr int64_t AXPY_ITEM = AXPY_NV * W;       // output units a work item of a projection takes
constexpr int64_t DOT_ITEM = 64;                // ... of a table
constexpr int64_t PART_ROWS = 128;              // activation rows an AMX work item of a bfloat16 matrix takes

struct FArgs {
  const float* w;    // the layer's matrix
  int64_t R;         // output units
  bool projection;   // W [C, R] (else a table [R, C])
  float* y;          // [N, R]
  int64_t items;
};

// y_i = x W_i (or x T_i^T) for every matrix i of the call (matrices sharing their input, e.g. q, k, v), their
// blocks of output units one pool of work items.
ffi::Error FMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> projection) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("fmatmul: x must be [N, C]");
  const size_t M = projection.size();
  if (M == 0 || args.size() != M || rets.size() != M)
    return ffi::Error::InvalidArgument("fmatmul: one operand and one result a matrix");
  const int64_t N = xd[0], C = xd[1], l = layer.typed_data()[0];
  std::vector<FArgs> mats(M);
  std::vector<int64_t> first(M + 1, 0);  // first work item of each matrix
  for (size_t i = 0; i < M; ++i) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("fmatmul: float32 buffers only");
    auto wd = w->dimensions();
    if (wd.size() != 3) return ffi::Error::InvalidArgument("fmatmul: a matrix must be [L, A, B]");
    FArgs& a = mats[i];
    a.projection = projection[i] != 0;
    const int64_t in = a.projection ? wd[1] : wd[2];
    a.R = a.projection ? wd[2] : wd[1];
    if (in != C) return ffi::Error::InvalidArgument("fmatmul: a matrix's input size differs from x's columns");
    if ((*y)->element_count() != (size_t)(N * a.R)) return ffi::Error::InvalidArgument("fmatmul: y must be [N, R]");
    const int64_t li = std::min<int64_t>(std::max<int64_t>(l, 0), wd[0] - 1);
    a.w = w->typed_data() + li * wd[1] * wd[2];
    a.y = (*y)->typed_data();
    const int64_t unit = a.projection ? (N > GEMM_ROWS ? GEMM_NR : AXPY_ITEM) : DOT_ITEM;
    a.items = (a.R + unit - 1) / unit;
    if (a.projection && N > GEMM_ROWS) a.items *= (N + GEMM_MB - 1) / GEMM_MB;
    first[i + 1] = first[i] + a.items;
  }
  const float* xp = x.typed_data();
  parallel_for(pool, first[M], [&](int64_t it) {
    size_t i = 0;
    while (it >= first[i + 1]) ++i;
    const FArgs& a = mats[i];
    if (a.projection && N > GEMM_ROWS) {  // item: a block of GEMM_MB activation rows by a strip of output units
      thread_local line_vector<float> strip;
      if (strip.size() < (size_t)(C * GEMM_NR)) strip.resize(C * GEMM_NR);
      const int64_t strips = (a.R + GEMM_NR - 1) / GEMM_NR, local = it - first[i];
      const int64_t n0 = local / strips * GEMM_MB;
      gemm_strip(xp, C, a.w, a.R, a.y, n0, std::min(N, n0 + GEMM_MB), local % strips * GEMM_NR, strip.data());
      return;
    }
    const int64_t unit = a.projection ? AXPY_ITEM : DOT_ITEM;
    const int64_t r0 = (it - first[i]) * unit, r1 = std::min(a.R, r0 + unit);
    if (a.projection) {
      axpy_block(xp, N, C, a.w, a.y, a.R, r0, r1);
    } else {
      const int64_t next_rows = std::max<int64_t>(0, std::min(a.R, r1 + DOT_ITEM) - r1);
      dot_block(xp, N, C, a.w + r0 * C, C, a.y, a.R, r0, r1, a.w + r1 * C, next_rows * C * 4);
    }
  });
  return ffi::Error::Success();
}

// y_i = (x M_i^T) * scale_i for every bfloat16 matrix i of the call (`kivi_jax.weights` format bf16: its bits
// [L, R, C] uint16, a float32 scale [L, R, 1] a row), their blocks of DOT_ITEM rows one pool of work items. x is
// float32, rounded to bfloat16 here (to nearest even, as XLA's bfloat16 dot rounds it). With AMX (and C a multiple of
// 32) whole 16s of a block's rows run in tiles (`amx_block`); the rest in the float kernel's dot tiles on x rounded
// (`rounded_rows`), the weights widened to float32 as they are loaded (half a float32 matrix's bytes from memory
// either way).
ffi::Error BMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("bmatmul: x must be [N, C]");
  const size_t M = rets.size();
  if (M == 0 || args.size() != 2 * M) return ffi::Error::InvalidArgument("bmatmul: bits and scale a matrix");
  const int64_t N = xd[0], C = xd[1], l = layer.typed_data()[0];
  struct BArgs {
    const uint16_t* w;  // the layer's [R, C]
    const float* scale;  // [R]
    int64_t R;
    float* y;
  };
  std::vector<BArgs> mats(M);
  std::vector<int64_t> first(M + 1, 0);
  for (size_t i = 0; i < M; ++i) {
    auto w = args.get<ffi::Buffer<ffi::U16>>(2 * i);
    auto sc = args.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !sc.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("bmatmul: uint16 bits, float32 scales and results");
    auto wd = w->dimensions();
    auto sd = sc->dimensions();
    if (wd.size() != 3 || wd[2] != C) return ffi::Error::InvalidArgument("bmatmul: bits must be [L, R, C]");
    if (sd.size() != 3 || sd[0] != wd[0] || sd[1] != wd[1] || sd[2] != 1)
      return ffi::Error::InvalidArgument("bmatmul: a scale must be [L, R, 1]");
    BArgs& a = mats[i];
    a.R = wd[1];
    if ((*y)->element_count() != (size_t)(N * a.R)) return ffi::Error::InvalidArgument("bmatmul: y must be [N, R]");
    const int64_t li = std::min<int64_t>(std::max<int64_t>(l, 0), wd[0] - 1);
    a.w = w->typed_data() + li * a.R * C;
    a.scale = sc->typed_data() + li * a.R;
    a.y = (*y)->typed_data();
    first[i + 1] = first[i] + (a.R + DOT_ITEM - 1) / DOT_ITEM;
  }
  const float* xp = x.typed_data();
  bool tiles_all = false;  // every output row of every matrix in AMX tiles (else the dot tiles read x rounded)
  int64_t parts = 1;  // AMX items: a block of DOT_ITEM outputs by PART_ROWS activation rows (a prefill's many rows)
#if KIVI_AMX
  // x rounded to bfloat16 as B tiles (`pack_rows`), 16 rows an item, into this thread's buffer: kept between calls
  // (a fresh one costs its page faults, 15% of a 512-row call), on a cache line (tile rows that straddle two load
  // slower), never zeroed (pack_rows writes every word)
  const bool amx = C % 32 == 0 && amx_allowed();
  const int64_t n16 = (N + 15) / 16 * 16;
  thread_local line_vector<uint32_t> packed_rows;
  if (amx && packed_rows.size() < (size_t)(C / 2 * n16)) packed_rows.resize(C / 2 * n16);
  uint32_t* const packed = packed_rows.data();
  if (amx) {
    const auto pack = [&](int64_t b) { pack_rows(xp, N, C, 16 * b, packed); };
    if (n16 > PART_ROWS) {
      parallel_for(pool, n16 / 16, pack);
    } else {  // a decode step's few rows: not worth the pool
      for (int64_t b = 0; b < n16 / 16; ++b) pack(b);
    }
    parts = (n16 + PART_ROWS - 1) / PART_ROWS;
    tiles_all = std::all_of(mats.begin(), mats.end(), [](const BArgs& a) { return a.R % 16 == 0; });
  }
#endif
  thread_local line_vector<float> rounded_rows;  // x rounded to bfloat16, for the dot tiles
  if (!tiles_all) {
    if (rounded_rows.size() < (size_t)(N * C)) rounded_rows.resize(N * C);
    for (int64_t e = 0; e < N * C; ++e) rounded_rows[e] = bf16_to_float(bf16_bits(xp[e]));
  }
  const float* xr = tiles_all ? xp : rounded_rows.data();
  parallel_for(pool, first[M] * parts, [&](int64_t item) {
    const int64_t it = item / parts, part = item % parts;
    size_t i = 0;
    while (it >= first[i + 1]) ++i;
    const BArgs& a = mats[i];
    int64_t r0 = (it - first[i]) * DOT_ITEM;
    const int64_t r1 = std::min(a.R, r0 + DOT_ITEM);
#if KIVI_AMX
    if (amx) {  // whole 16s of outputs in tiles, the rest below (by the item of part 0, for every activation row)
      const int64_t r16 = r0 + (r1 - r0) / 16 * 16;
      const int64_t n0 = part * PART_ROWS, n1 = std::min(n16, n0 + PART_ROWS);
      if (r16 > r0) amx_block(packed, N, n0, n1, C, a.w + r0 * C, a.scale, a.y, a.R, r0, r16);
      r0 = r16;
      if (r0 == r1 || part > 0) return;
    }
#endif
    const int64_t next_rows = std::max<int64_t>(0, std::min(a.R, r1 + DOT_ITEM) - r1);
    dot_block(xr, N, C, a.w + r0 * C, C, a.y, a.R, r0, r1, a.w + r1 * C, next_rows * C * 2);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t r = r0; r < r1; ++r) a.y[n * a.R + r] *= a.scale[r];
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxBMatmul, BMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // per matrix: bits [L, R, C] uint16, scale [L, R, 1]
                                  .RemainingRets());             // per matrix: y [N, R] float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxFMatmul, FMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // per matrix: [L, C, R] (a projection) or [L, R, C]
                                  .RemainingRets()               // per matrix: y [N, R] float32
                                  .Attr<ffi::Span<const int64_t>>("projection"));
