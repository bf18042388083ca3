// Quantized-weight matmul on the CPU, an XLA FFI handler: y = x M^T for a matrix M [R, C] stored row by row in
// groups of G columns (docs/design.md §13, docs/kernels.md "Quantized weights").
//
// The contract is kivi_jax.weights.QuantizedMatrix.matmul_t's XLA path (dequantize, then dot): M[r, c] =
// (code[r, c] - offset) * scale[r, c / G] + min[r, c / G], with 8-bit codes (int8, one a byte) or 4-bit codes (two a
// byte: byte j of a group holds code j in its low nibble and code j + G/2 in its high one, GGUF's layout), scales and
// mins float16 or float32, no min for symmetric formats. Float activations times dequantized weights, float32 sums:
// y[n, r] = Σ_g scale[r, g] Σ_{c in g} code[r, c] x[n, c] + Σ_g (min - offset * scale)[r, g] Σ_{c in g} x[n, c], the
// activations' group sums computed once a call. The codes are widened to float in registers; for one or two
// activation rows several groups of a row go at once, so enough FMA chains are in flight (`row_dots`).
//
// Each weight row is read once per call whatever the batch: work items are blocks of rows shared out on XLA's
// intra-op thread pool; an item walks its rows for every tile of up to TILE activation rows, the tiles after the
// first reading the item's codes from cache. The stacked [layers, R, ...] leaves are read in place at the layer index.
// Past STRIP_ROWS activation rows a matrix's strip-major copy, when the call has one (`decoded_strip`), is decoded
// straight into the packed strips that `strip_item`'s tiles read.

#include "gemm.h"

namespace {

constexpr int TILE = 8;           // activation rows a pass holds in registers
constexpr int64_t ITEM_ROWS = 16;  // weight rows a work item takes
constexpr int64_t PREFETCH_ROWS = 4;  // how far ahead of the rows in use their codes are requested
// More float activation rows than this (a prefill chunk, a decode step of 17 or more rows): packed strips
// (`strip_item`). At 32 and 64 rows they took 0.65-0.81x the time of `item`'s dotted tiles on a Zen 4 VM (one
// layer's projections, three alternating runs, 2026-12-07); `item` keeps 16 and fewer.
constexpr int64_t STRIP_ROWS = 16;

// W codes of 8-bit weights at p, as float lanes.
inline vf codes8(const int8_t* p) {
#if defined(__AVX512F__)
  return __builtin_convertvector((vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), vf);
#elif defined(__AVX2__)
  return __builtin_convertvector((vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), vf);
#else
  vf out;
  for (int i = 0; i < W; ++i) out[i] = (float)p[i];
  return out;
#endif
}

struct QArgs {
  const float* x;     // [N, C] activations
  const uint8_t* codes;  // [R, C * bits / 8] at the layer
  const void* scale;  // [R, NG] at the layer
  const void* mn;     // [R, NG] at the layer, or null
  ScaleType st;
  int64_t N, R, C, NG, G;
  int offset;
  const float* xsum;  // [N, NG] the activations' sums over each group
  float* y;  // [N, R]
  const uint8_t* strips = nullptr;  // [S, strip_bytes] at the layer (`decoded_strip`), or null
  int64_t strip_bytes = 0;
};

// One scale or min (element i of a float16, bfloat16 or float32 array) as a float.
inline float scalar_at(const void* base, int64_t i, ScaleType t) {
  if (t == F32) return static_cast<const float*>(base)[i];
  uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (t == BF16) return bf16_to_float(h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// W codes of a group as float lanes: 4-bit codes j .. j + W - 1 (low nibbles, `high` false) or j + G/2 .. (high
// nibbles) from the group's bytes p + j; 8-bit codes j .. j + W - 1 from p + j.
template <int BITS>
inline void decode(const uint8_t* p, vf& lo, vf& hi) {
  if (BITS == 4) {
    const vi c = widen(p);
    lo = __builtin_convertvector(c & (vi{} + 0xF), vf);
    hi = __builtin_convertvector(c >> 4, vf);
  } else {
    lo = codes8(reinterpret_cast<const int8_t*>(p));
  }
}

// Weight row r against NT activation rows n0 .. n0 + NT - 1 -> dots[t], groups of GS columns (0: the runtime a.G),
// with the mins' part when MINS (an asymmetric or offset format). The row is read once, front to back. Two ways to
// apply a group's scale, by what fits in registers:
// - one or two activation rows: GU consecutive groups at once, each group's dot summed unscaled in its own FMA chain
//   (so the FMA latency does not bound a batch-1 matvec), then scaled once a group;
// - more: a group's codes are scaled in registers (one multiply a lane) and multiplied into every activation row.
template <int BITS, int GS, int NT, bool MINS>
void row_dots(const QArgs& a, int64_t r, int64_t n0, float* dots) {
  constexpr int GU = NT == 1 ? 4 : NT == 2 ? 2 : 1;  // groups in flight at once
  const int64_t G = GS ? GS : a.G, row_bytes = a.C * BITS / 8, NG = a.NG, C = a.C;
  const int64_t group_bytes = G * BITS / 8, half = G / 2;
  const int64_t steps = BITS == 4 ? half / W : G / W;  // whole vector steps in a group (the rest: a scalar tail)
  const float* x = a.x + n0 * C;
  const uint8_t* row = a.codes + r * row_bytes;
  vf acc[NT];
  float tail[NT];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) acc[t] = vf{}, tail[t] = 0.0f;
  int64_t g = 0;
  auto scales = [&](int64_t g, float& sc) {
    const int64_t i = r * NG + g;
    sc = scalar_at(a.scale, i, a.st);
    if (MINS) {  // the group's min (and offset) times the activations' group sum
      const float mf = (a.mn ? scalar_at(a.mn, i, a.st) : 0.0f) - a.offset * sc;
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) tail[t] += mf * a.xsum[(n0 + t) * NG + g];
    }
  };
  auto scalar_tail = [&](int64_t g, float sc) {  // columns past a group's whole steps
    const uint8_t* cg = row + g * group_bytes;
    const float* xg = x + g * G;
    for (int64_t j = steps * W; j < (BITS == 4 ? half : G); ++j) {
      if (BITS == 4) {
        const float lo = (cg[j] & 0xF) * sc, hi = (cg[j] >> 4) * sc;
        for (int t = 0; t < NT; ++t) tail[t] += lo * xg[t * C + j] + hi * xg[t * C + j + half];
      } else {
        const float w = (float)(int8_t)cg[j] * sc;
        for (int t = 0; t < NT; ++t) tail[t] += w * xg[t * C + j];
      }
    }
  };
  if (GU > 1) {
    for (; g + GU <= NG; g += GU) {
      vf part[GU][NT];
      float sc[GU];
#pragma GCC unroll 4
      for (int u = 0; u < GU; ++u) {
        scales(g + u, sc[u]);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) part[u][t] = vf{};
      }
#pragma GCC unroll 8
      for (int64_t k = 0; k < steps; ++k) {
        const int64_t j = k * W;
#pragma GCC unroll 4
        for (int u = 0; u < GU; ++u) {
          vf lo, hi;
          decode<BITS>(row + (g + u) * group_bytes + j, lo, hi);
          const float* xg = x + (g + u) * G;
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t) {
            part[u][t] += lo * vload(xg + t * C + j);
            if (BITS == 4) part[u][t] += hi * vload(xg + t * C + j + half);
          }
        }
      }
#pragma GCC unroll 4
      for (int u = 0; u < GU; ++u) {
        const vf s = vsplat(sc[u]);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) acc[t] += part[u][t] * s;
        scalar_tail(g + u, sc[u]);
      }
    }
  }
  for (; g < NG; ++g) {  // one group at a time: the codes scaled in registers
    float sc;
    scales(g, sc);
    const vf s = vsplat(sc);
    const float* xg = x + g * G;
#pragma GCC unroll 4
    for (int64_t k = 0; k < steps; ++k) {
      const int64_t j = k * W;
      vf lo, hi;
      decode<BITS>(row + g * group_bytes + j, lo, hi);
      lo *= s;
      if (BITS == 4) hi *= s;
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        acc[t] += lo * vload(xg + t * C + j);
        if (BITS == 4) acc[t] += hi * vload(xg + t * C + j + half);
      }
    }
    scalar_tail(g, sc);
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) dots[t] = hsum(acc[t]) + tail[t];
}

// Weight row r against one activation row (a matvec, the batch-1 decode step): W consecutive groups at once, each
// group's dot summed unscaled in its own FMA chain, the W dots gathered into one vector's lanes (`reduce_lanes`), then
// scaled and given their mins with one FMA each for all W groups. Groups past the last whole W are padded with zeros.
template <int BITS, int GS, ScaleType ST>
void row_dot1(const QArgs& a, int64_t r, int64_t n0, float* dots) {
  const int64_t row_bytes = a.C * BITS / 8, NG = a.NG;
  constexpr int64_t group_bytes = GS * BITS / 8, half = GS / 2;
  constexpr int64_t steps = BITS == 4 ? half / W : GS / W;
  static_assert(steps >= 1 && (BITS == 4 ? half % W : GS % W) == 0, "whole vector steps a group");
  const float* x = a.x + n0 * a.C;
  const float* xs = a.xsum + n0 * NG;
  const uint8_t* row = a.codes + r * row_bytes;
  auto group_dot = [&](int64_t g) {  // one group's unscaled dot, as a vector of partial sums
    const uint8_t* cg = row + g * group_bytes;
    const float* xg = x + g * GS;
    vf part = vf{};
#pragma GCC unroll 8
    for (int64_t k = 0; k < steps; ++k) {
      vf lo, hi;
      decode<BITS>(cg + k * W, lo, hi);
      part += lo * vload(xg + k * W);
      if (BITS == 4) part += hi * vload(xg + k * W + half);
    }
    return part;
  };
  const vf offset = vsplat((float)a.offset);
  vf acc = vf{}, acc_min = vf{};
  int64_t g0 = 0;
  for (; g0 + W <= NG; g0 += W) {
    vf part[W];
#pragma GCC unroll 16
    for (int u = 0; u < W; ++u) part[u] = group_dot(g0 + u);
    const vf s = scales_at<ST>(a.scale, r * NG + g0);
    acc += reduce_lanes(part) * s;
    const vf m = a.mn ? scales_at<ST>(a.mn, r * NG + g0) : vf{};
    acc_min += (m - s * offset) * vload(xs + g0);
  }
  float tail = 0.0f;
  for (; g0 < NG; ++g0) {  // the groups past the last whole W
    const float sg = scalar_at(a.scale, r * NG + g0, ST);
    const float mg = (a.mn ? scalar_at(a.mn, r * NG + g0, ST) : 0.0f) - a.offset * sg;
    tail += hsum(group_dot(g0)) * sg + mg * xs[g0];
  }
  dots[0] = hsum(acc + acc_min) + tail;
}

template <int BITS, int GS>
void row_dot1_any(const QArgs& a, int64_t r, int64_t n0, float* dots) {  // the scale type picked per call
  if (a.st == F16) row_dot1<BITS, GS, F16>(a, r, n0, dots);
  else if (a.st == F32) row_dot1<BITS, GS, F32>(a, r, n0, dots);
  else row_dot1<BITS, GS, BF16>(a, r, n0, dots);
}

using RowFn = void (*)(const QArgs&, int64_t, int64_t, float*);

template <int BITS, int GS, bool MINS>
RowFn pick(int nt) {
  switch (nt) {
    case 1: return row_dots<BITS, GS, 1, MINS>;
    case 2: return row_dots<BITS, GS, 2, MINS>;
    case 3: return row_dots<BITS, GS, 3, MINS>;
    case 4: return row_dots<BITS, GS, 4, MINS>;
    case 5: return row_dots<BITS, GS, 5, MINS>;
    case 6: return row_dots<BITS, GS, 6, MINS>;
    case 7: return row_dots<BITS, GS, 7, MINS>;
    default: return row_dots<BITS, GS, 8, MINS>;
  }
}

// The kernel for these bits, group size and mins: compile-time groups for the shipped formats' 32, 64 and 128
// columns (4-bit, always with a min or an offset) and 32 (8-bit, Q8_0), the runtime group size otherwise (int8's one
// group a row, symmetric).
RowFn row_kernel(int bits, int64_t group, bool mins, int nt) {
  if (nt == 1 && bits == 4 && group % (2 * W) == 0 && group <= 128) {  // a matvec over whole-vector groups
    if (group == 32) return row_dot1_any<4, 32>;
    if (group == 64) return row_dot1_any<4, 64>;
    if (group == 128) return row_dot1_any<4, 128>;
  }
  if (nt == 1 && bits == 8 && group == 32) return row_dot1_any<8, 32>;
  if (bits == 4) {
    if (group == 32) return pick<4, 32, true>(nt);
    if (group == 64) return pick<4, 64, true>(nt);
    if (group == 128) return pick<4, 128, true>(nt);
    return pick<4, 0, true>(nt);
  }
  if (mins) return pick<8, 0, true>(nt);
  return group == 32 ? pick<8, 32, false>(nt) : pick<8, 0, false>(nt);
}

// Requests rows [r, r + n) of the codes, scales and mins into the cache ahead of their use: the hardware prefetcher
// alone left a DRAM-resident matrix (the output head) at a third of the memory bandwidth.
inline void prefetch_rows(const QArgs& a, int64_t r, int n, int64_t row_bytes, int64_t scale_bytes) {
  if (r + n > a.R) return;
  const char* c = reinterpret_cast<const char*>(a.codes) + r * row_bytes;
  for (int64_t i = 0; i < n * row_bytes; i += 64) __builtin_prefetch(c + i);
  const char* s = static_cast<const char*>(a.scale) + r * scale_bytes;
  for (int64_t i = 0; i < n * scale_bytes; i += 64) __builtin_prefetch(s + i);
  if (a.mn) {
    const char* m = static_cast<const char*>(a.mn) + r * scale_bytes;
    for (int64_t i = 0; i < n * scale_bytes; i += 64) __builtin_prefetch(m + i);
  }
}

// Weight row r dequantized into out[0, C): (code - offset) * scale + min in float32, every group; 4-bit groups
// decoded a vector of low and a vector of high nibbles at a time, the columns past a group's whole vectors one by one.
template <int BITS>
void decoded_row(const QArgs& a, int64_t r, float* out) {
  const int64_t G = a.G, NG = a.NG, group_bytes = G * BITS / 8, half = G / 2;
  const int64_t steps = BITS == 4 ? half / W : G / W;
  const uint8_t* row = a.codes + r * (a.C * BITS / 8);
  for (int64_t g = 0; g < NG; ++g) {
    const float sc = scalar_at(a.scale, r * NG + g, a.st);
    const float mf = (a.mn ? scalar_at(a.mn, r * NG + g, a.st) : 0.0f) - a.offset * sc;
    const vf s = vsplat(sc), m = vsplat(mf);
    const uint8_t* cg = row + g * group_bytes;
    float* o = out + g * G;
    for (int64_t k = 0; k < steps; ++k) {
      vf lo, hi;
      decode<BITS>(cg + k * W, lo, hi);
      vstore(o + k * W, lo * s + m);
      if (BITS == 4) vstore(o + half + k * W, hi * s + m);
    }
    for (int64_t j = steps * W; j < (BITS == 4 ? half : G); ++j) {
      if (BITS == 4) {
        o[j] = (cg[j] & 0xF) * sc + mf;
        o[j + half] = (cg[j] >> 4) * sc + mf;
      } else {
        o[j] = (float)(int8_t)cg[j] * sc + mf;
      }
    }
  }
}

// Rows [r0, r1) of y for every activation row.
// - Up to TILE activation rows (a small decode step): each weight row is dotted with the tile as its codes are read
//   (`row_dots`: decoding costs one pass however few the rows).
// - More, up to STRIP_ROWS (above it `strip_item`): DOT_NR weight rows at a time are dequantized once into an L1
//   buffer, then every DOT_MR activation rows are dotted with them by gemm.h's `dot_tile`, so decoding is paid once
//   a call and the arithmetic is register-blocked (row_dots re-decoded each weight row for every tile of 8 rows).
void item(const QArgs& a, int bits, int64_t r0, int64_t r1) {
  const int64_t row_bytes = a.C * bits / 8, scale_bytes = a.NG * (a.st == F32 ? 4 : 2);
  if (a.N > TILE) {
    thread_local std::vector<float> rows;
    rows.resize(DOT_NR * a.C);
    for (int64_t r = r0; r < r1; r += DOT_NR) {
      const int nr = (int)std::min<int64_t>(DOT_NR, r1 - r);
      prefetch_rows(a, r + PREFETCH_ROWS, nr, row_bytes, scale_bytes);
      for (int i = 0; i < nr; ++i) {
        if (bits == 4) decoded_row<4>(a, r + i, rows.data() + i * a.C);
        else decoded_row<8>(a, r + i, rows.data() + i * a.C);
      }
      for (int64_t n = 0; n < a.N; n += DOT_MR) {
        const int mr = (int)std::min<int64_t>(DOT_MR, a.N - n);
        dot_kernel<float>(mr, nr)(a.x + n * a.C, a.C, rows.data(), a.C, a.C, a.y + n * a.R + r, a.R);
      }
    }
    return;
  }
  float dots[TILE];
  const bool mins = a.mn || a.offset;
  for (int64_t n0 = 0; n0 < a.N; n0 += TILE) {
    const int nt = (int)std::min<int64_t>(TILE, a.N - n0);
    const RowFn fn = row_kernel(bits, a.G, mins, nt);
    for (int64_t r = r0; r < r1; ++r) {
      if (n0 == 0) prefetch_rows(a, r + PREFETCH_ROWS, 1, row_bytes, scale_bytes);
      fn(a, r, n0, dots);
      for (int t = 0; t < nt; ++t) a.y[(n0 + t) * a.R + r] = dots[t];
    }
  }
}

// The strip-major copy of a matrix (`weights.with_strips`, for calls of more than STRIP_ROWS rows): strip s holds
// weight rows [s GEMM_NR, (s + 1) GEMM_NR) (zero past R) as strip_bytes bytes: their codes column by column (4-bit:
// W bytes a column, byte j holding row j's code in its low nibble and row j + W's in its high one; 8-bit: GEMM_NR
// int8 codes a column), then their scales [NG][GEMM_NR] and, with mins, their mins [NG][GEMM_NR] in the scales'
// type, padded to a multiple of 64 bytes. Decoded, a column is GEMM_NV whole vectors of the packed strip: no
// transposition (`strip_item`).
static_assert(GEMM_NV == 2, "a strip-major column is two vectors: the low and the high nibbles of W bytes");

inline int64_t strip_layout_bytes(int64_t C, int64_t NG, int bits, int64_t scale_bytes, bool mins) {
  const int64_t n = C * GEMM_NR * bits / 8 + NG * GEMM_NR * scale_bytes * (mins ? 2 : 1);
  return (n + 63) / 64 * 64;
}

// Strip s of the strip-major copy decoded into bp [C][GEMM_NR]: (code - offset) * scale + min in float32, the same
// values as `decoded_row` gives those rows' columns.
template <int BITS, ScaleType ST>
void decoded_strip(const QArgs& a, int64_t s, float* bp) {
  constexpr int64_t col_bytes = GEMM_NR * BITS / 8;
  constexpr int64_t scale_bytes = ST == F32 ? 4 : 2;
  const int64_t C = a.C, G = a.G, NG = a.NG;
  const uint8_t* base = a.strips + s * a.strip_bytes;
  const uint8_t* sc = base + C * col_bytes;
  const uint8_t* mn = a.mn ? sc + NG * GEMM_NR * scale_bytes : nullptr;
  for (int64_t g = 0; g < NG; ++g) {
    vf scale[GEMM_NV], mf[GEMM_NV];
#pragma GCC unroll 2
    for (int j = 0; j < GEMM_NV; ++j) {
      scale[j] = scales_at<ST>(sc, g * GEMM_NR + j * W);
      mf[j] = (mn ? scales_at<ST>(mn, g * GEMM_NR + j * W) : vf{}) - vsplat((float)a.offset) * scale[j];
    }
    for (int64_t c = g * G; c < (g + 1) * G; ++c) {
      const uint8_t* p = base + c * col_bytes;
      float* o = bp + c * GEMM_NR;
      vf lo, hi, unused;
      decode<BITS>(p, lo, hi);  // 4-bit: rows 0 .. W - 1 (low nibbles) and W .. 2W - 1 (high)
      if (BITS == 8) decode<8>(p + W, hi, unused);  // 8-bit: rows W .. 2W - 1 from the next W bytes
      vstore(o, lo * scale[0] + mf[0]);
      vstore(o + W, hi * scale[1] + mf[1]);
    }
  }
}

template <int BITS>
void decoded_strip_any(const QArgs& a, int64_t s, float* bp) {  // the scale type picked per call
  if (a.st == F16) decoded_strip<BITS, F16>(a, s, bp);
  else if (a.st == F32) decoded_strip<BITS, F32>(a, s, bp);
  else decoded_strip<BITS, BF16>(a, s, bp);
}

// Output rows [r0, r0 + GEMM_NR) (clipped to R) of y [N, R] = x M^T for activation rows [n0, n1) (more than
// STRIP_ROWS in all): the packed strip decoded from the strip-major copy when the call has one (`decoded_strip`),
// else the strip's weight rows decoded (`decoded_row`) and transposed into it; then gemm.h's tiles, as for a float32
// projection.
void strip_item(const QArgs& a, int bits, int64_t r0, int64_t n0, int64_t n1) {
  thread_local line_vector<float> rows, strip;
  if (strip.size() < (size_t)(GEMM_NR * a.C)) strip.resize(GEMM_NR * a.C);
  const int64_t n = std::min<int64_t>(GEMM_NR, a.R - r0);
  if (a.strips) {
    if (bits == 4) decoded_strip_any<4>(a, r0 / GEMM_NR, strip.data());
    else decoded_strip_any<8>(a, r0 / GEMM_NR, strip.data());
  } else {
    if (rows.size() < (size_t)(GEMM_NR * a.C)) rows.resize(GEMM_NR * a.C);
    for (int64_t j = 0; j < n; ++j) {
      if (bits == 4) decoded_row<4>(a, r0 + j, rows.data() + j * a.C);
      else decoded_row<8>(a, r0 + j, rows.data() + j * a.C);
    }
    pack_rows_strip(rows.data(), a.C, n, strip.data());
  }
  gemm_rows(a.x, a.C, strip.data(), a.y, a.R, n0, n1, r0, n);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KIVI_VNNI 1
// ---- int8 activations (dot_dtype "int8", a prefill chunk or a decode step): y = x M^T, x rounded to int8 per group
// The contract is kivi_jax.weights.q8_dot: each activation row's group g of G columns becomes q = round(x * (127 /
// amax)) with scale d = amax / 127 (amax its largest magnitude), as llama.cpp's Q8 activations; then y[n, r] =
// Σ_g scale[r, g] d[n, g] Σ_{c in g} code[r, c] q[n, c] (exact int32 sums) + Σ_g (min - offset * scale)[r, g] d[n,
// g] Σ_{c in g} q[n, c]: the dequantized matrix times x rounded, as llama.cpp's Q4_1 x Q8_1. Products are
// AVX512-VNNI's u8 x s8 dot of four columns: the codes as the unsigned operand (4-bit as they are; 8-bit codes +
// 128, the excess taken out of the int32 sum as -128 Σ q, a per-group term of the activations), a strip of Q8_NR
// weight rows interleaved four codes a row ([C / 4][Q8_NR] dwords), Q8_MR activation rows broadcast four bytes at
// a time; or, for a decode step's few rows, each weight row's codes as they are stored (`q8_row_dots`).

constexpr int Q8_MR = 6;       // activation rows a tile holds: 12 int32 and 12 float accumulators
constexpr int64_t Q8_NR = 32;  // weight rows of a strip: two vectors

constexpr int Q8_ROW_ROWS = 4;  // activation rows up to which 32-column groups go weight row by weight row
// (`q8_row_dots`: packing a strip costs more than its dots for so few)

struct Q8Rows {  // activations rounded to int8 for one group size
  int64_t G = 0, NG = 0;
  line_vector<int8_t> q;      // [N, C]
  std::vector<float> d;       // [N, NG] the groups' scales
  std::vector<float> sum;     // [N, NG] the groups' sums of x rounded: d Σ q
  std::vector<int32_t> corr;  // [N, NG] -128 Σ q (for signed codes)
  line_vector<int32_t> quad;  // [N, C / 4] -128 Σ q over each four columns (signed codes, `q8_row_dots`), or empty
};

// Rows [n0, n1) of x [N, C] rounded to int8 in groups of G columns (G a multiple of 4) into r.
void quantize_rows(const float* x, int64_t C, int64_t n0, int64_t n1, Q8Rows& r) {
  const int64_t G = r.G, NG = r.NG;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t g = 0; g < NG; ++g) {
      const float* xg = x + n * C + g * G;
      int8_t* qg = r.q.data() + n * C + g * G;
      int64_t j = 0;
      __m512 vmax = _mm512_setzero_ps();
      for (; j + 16 <= G; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + j)));
      float amax = _mm512_reduce_max_ps(vmax);
      for (int64_t k = j; k < G; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t qsum = 0;
      j = 0;
      const __m512 vid = _mm512_set1_ps(id);
      __m512i vq = _mm512_setzero_si512();
      for (; j + 16 <= G; j += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + j), vid));  // to nearest even
        vq = _mm512_add_epi32(vq, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + j), _mm512_cvtsepi32_epi8(q));
      }
      qsum = _mm512_reduce_add_epi32(vq);
      for (int64_t k = j; k < G; ++k) {
        const int q = (int)std::nearbyint(xg[k] * id);
        qg[k] = (int8_t)q;
        qsum += q;
      }
      const float d = amax / 127.0f;
      r.d[n * NG + g] = d;
      r.sum[n * NG + g] = (float)qsum * d;
      r.corr[n * NG + g] = -128 * qsum;
      if (r.quad.empty()) continue;
      int32_t* quad = r.quad.data() + (n * C + g * G) / 4;
      for (int64_t k = 0; k < G / 4; ++k) quad[k] = -128 * (qg[4 * k] + qg[4 * k + 1] + qg[4 * k + 2] + qg[4 * k + 3]);
    }
}

// Scales (or mins) g .. g + 15 of a row from element i of base as float lanes, zero past the mask's groups.
inline __m512 scales16(const void* base, int64_t i, __mmask16 m, ScaleType st) {
  if (st == F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
  if (st == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Weight row r of 32-column groups against NT activation rows n0 .. of q (a decode step's few rows), its codes read
// in place: 64 columns (two groups) at a time as one vector of unsigned codes (4-bit: a group's low and high nibbles
// in column order; 8-bit: + 128, the excess taken out by starting the int32 sums at `quad`), VNNI's u8 x s8 dot into
// 16 int32 lanes of four columns each (lanes 0-7 the first group, 8-15 the second), then into float accumulators
// times each lane's scale[r, g] d[n, g]; the mins' part (MINS) sixteen groups at a time. The same sums as the
// strips' `q8_tile`, added in another order.
template <int BITS, int NT, bool MINS>
void q8_row_dots(const QArgs& a, const Q8Rows& q, int64_t r, int64_t n0, float* dots) {
  constexpr int64_t G = 32;
  const int64_t C = a.C, NG = a.NG;
  const uint8_t* row = a.codes + r * (C * BITS / 8);
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  // lane -> group of two
  const __m512i low = _mm512_set1_epi8(0xF), excess = _mm512_set1_epi8((char)0x80);
  __m512 acc[NT], acc_min[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) acc[t] = acc_min[t] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < NG; g0 += 16) {
    const int ng = (int)std::min<int64_t>(16, NG - g0);
    const __mmask16 gm = (__mmask16)((1u << ng) - 1);
    const __m512 s = scales16(a.scale, r * NG + g0, gm, a.st);
    __m512 sd[NT];  // scale[r, g] d[n, g] for the sixteen groups
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) sd[t] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(gm, q.d.data() + (n0 + t) * NG + g0));
    if (MINS) {
      __m512 mf = _mm512_mul_ps(s, _mm512_set1_ps((float)-a.offset));
      if (a.mn) mf = _mm512_add_ps(scales16(a.mn, r * NG + g0, gm, a.st), mf);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t)
        acc_min[t] = _mm512_fmadd_ps(mf, _mm512_maskz_loadu_ps(gm, q.sum.data() + (n0 + t) * NG + g0), acc_min[t]);
    }
    for (int k = 0; k < ng; k += 2) {  // groups g0 + k and g0 + k + 1 (the last alone when ng is odd)
      const bool two = k + 1 < ng;
      const int64_t c0 = (g0 + k) * G;
      __m512i w;
      if (BITS == 8) {
        const __m512i codes = _mm512_maskz_loadu_epi8(two ? ~0ull : 0xFFFFFFFFull, row + c0);
        w = _mm512_xor_si512(codes, excess);
      } else {
        const __m256i b = _mm256_maskz_loadu_epi8(two ? ~0u : 0xFFFFu, row + c0 / 2);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
        // 128-bit lanes: [lo 0, lo 1, hi 0, hi 1] -> [lo 0, hi 0, lo 1, hi 1], the columns in order
        w = _mm512_and_si512(_mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)), low);
      }
      const __m512i idx = _mm512_add_epi32(pair, _mm512_set1_epi32(k));
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const int64_t n = n0 + t;
        const __m512i x = _mm512_maskz_loadu_epi8(two ? ~0ull : 0xFFFFFFFFull, q.q.data() + n * C + c0);
        const int32_t* quad = q.quad.data() + (n * C + c0) / 4;
        const __m512i start = BITS == 8 ? _mm512_maskz_loadu_epi32(two ? 0xFFFF : 0xFF, quad) : _mm512_setzero_si512();
        const __m512i dot = _mm512_dpbusd_epi32(start, w, x);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, sd[t]), acc[t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) dots[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc_min[t]));
}

using Q8RowFn = void (*)(const QArgs&, const Q8Rows&, int64_t, int64_t, float*);

// The row kernel for `nt` activation rows (1 .. Q8_ROW_ROWS), one instantiation a row count, as `q8_of`.
template <int BITS, bool MINS, int... NTs>
Q8RowFn q8_row_of(int nt, std::integer_sequence<int, NTs...>) {
  Q8RowFn fns[] = {q8_row_dots<BITS, NTs + 1, MINS>...};
  return fns[nt - 1];
}

// Rows [r0, r1) of y for the call's N <= Q8_ROW_ROWS activation rows (`q8_row_dots`), reading each weight row once.
void q8_row_item(const QArgs& a, int bits, const Q8Rows& q, int64_t r0, int64_t r1) {
  const int64_t row_bytes = a.C * bits / 8, scale_bytes = a.NG * (a.st == F32 ? 4 : 2);
  const bool mins = a.mn || a.offset;
  const int nt = (int)a.N;
  const auto seq = std::make_integer_sequence<int, Q8_ROW_ROWS>{};
  const Q8RowFn fn = bits == 8 ? (mins ? q8_row_of<8, true>(nt, seq) : q8_row_of<8, false>(nt, seq))
                               : (mins ? q8_row_of<4, true>(nt, seq) : q8_row_of<4, false>(nt, seq));
  float dots[Q8_ROW_ROWS];
  for (int64_t r = r0; r < r1; ++r) {
    prefetch_rows(a, r + PREFETCH_ROWS, 1, row_bytes, scale_bytes);
    fn(a, q, r, 0, dots);
    for (int t = 0; t < nt; ++t) a.y[t * a.R + r] = dots[t];
  }
}

// Weight rows [r0, r0 + n) (n <= Q8_NR) as a strip: their unsigned codes interleaved four a row into wq [C / 4]
// [Q8_NR] dwords, their scales and (min - offset * scale) into sc, mf [NG][Q8_NR] floats; zero past n.
void pack_q8_strip(const QArgs& a, int bits, int64_t r0, int64_t n, uint8_t* codes, int32_t* wq, float* sc,
                   float* mf) {
  const int64_t C = a.C, G = a.G, NG = a.NG, half = G / 2;
  for (int64_t j = 0; j < Q8_NR; ++j) {
    uint8_t* out = codes + j * C;
    if (j >= n) {
      std::memset(out, 0, C);
      continue;
    }
    const uint8_t* row = a.codes + (r0 + j) * (C * bits / 8);
    if (bits == 8) {
      for (int64_t c = 0; c < C; ++c) out[c] = row[c] ^ 0x80;  // int8 code + 128
    } else {
      const __m128i low = _mm_set1_epi8(0xF);
      for (int64_t g = 0; g < NG; ++g) {
        const uint8_t* cg = row + g * half;
        uint8_t* og = out + g * G;
        int64_t k = 0;
        for (; k + 16 <= half; k += 16) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + k));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(og + k), _mm_and_si128(b, low));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(og + k + half), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        }
        for (; k < half; ++k) og[k] = cg[k] & 0xF, og[k + half] = cg[k] >> 4;
      }
    }
  }
  int64_t c0 = 0;
  for (; c0 + 64 <= C; c0 += 64)  // 16 rows by 16 dwords (64 codes) at a time, transposed in registers
    for (int64_t j0 = 0; j0 < Q8_NR; j0 += 16) {
      __m512i t[16];
      for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(codes + (j0 + i) * C + c0);
      transpose16(t);  // t[k]: codes c0 + 4k .. c0 + 4k + 3 of rows j0 .. j0 + 15
      for (int k = 0; k < 16; ++k) _mm512_store_si512(wq + (c0 / 4 + k) * Q8_NR + j0, t[k]);
    }
  for (int64_t k = c0 / 4; k < C / 4; ++k)
    for (int64_t j = 0; j < Q8_NR; ++j) std::memcpy(wq + k * Q8_NR + j, codes + j * C + 4 * k, 4);
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t j = 0; j < Q8_NR; ++j) {
      const int64_t i = (r0 + j) * NG + g;
      const float s = j < n ? scalar_at(a.scale, i, a.st) : 0.0f;
      sc[g * Q8_NR + j] = s;
      mf[g * Q8_NR + j] = j < n ? (a.mn ? scalar_at(a.mn, i, a.st) : 0.0f) - a.offset * s : 0.0f;
    }
}

// y[i, j] for i < MR activation rows (n0 .. of r), j < Q8_NR weight rows of a packed strip: per group, int32 sums of
// u8 x s8 products, then scaled into float accumulators (with the mins' part when MINS, the codes' excess taken out
// when SIGNED); groups of GS columns (0: r.G), a group's steps unrolled when known.
template <int MR, int GS, bool MINS, bool SIGNED>
void q8_tile(const Q8Rows& r, int64_t C, int64_t n0, const int32_t* wq, const float* sc, const float* mf, float* y,
             int64_t ldy) {
  const int64_t G = GS ? GS : r.G, NG = r.NG;
  __m512 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int8_t* x = r.q.data() + n0 * C;
  for (int64_t g = 0; g < NG; ++g) {
    __m512i dot[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
      dot[i][0] = dot[i][1] = SIGNED ? _mm512_set1_epi32(r.corr[(n0 + i) * NG + g]) : _mm512_setzero_si512();
    const int32_t* wg = wq + g * (G / 4) * Q8_NR;
    const int8_t* xg = x + g * G;
#pragma GCC unroll 8
    for (int64_t k = 0; k < G / 4; ++k) {
      const __m512i w0 = _mm512_load_si512(wg + k * Q8_NR), w1 = _mm512_load_si512(wg + k * Q8_NR + 16);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, xg + i * C + 4 * k, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], w0, xb);
        dot[i][1] = _mm512_dpbusd_epi32(dot[i][1], w1, xb);
      }
    }
    const __m512 s0 = _mm512_load_ps(sc + g * Q8_NR), s1 = _mm512_load_ps(sc + g * Q8_NR + 16);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512 d = _mm512_set1_ps(r.d[(n0 + i) * NG + g]);
      acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s0, d), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][1]), _mm512_mul_ps(s1, d), acc[i][1]);
    }
    if (MINS) {
      const __m512 m0 = _mm512_load_ps(mf + g * Q8_NR), m1 = _mm512_load_ps(mf + g * Q8_NR + 16);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m512 xs = _mm512_set1_ps(r.sum[(n0 + i) * NG + g]);
        acc[i][0] = _mm512_fmadd_ps(m0, xs, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(m1, xs, acc[i][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(y + i * ldy, acc[i][0]);
    _mm512_storeu_ps(y + i * ldy + 16, acc[i][1]);
  }
}

using Q8Fn = void (*)(const Q8Rows&, int64_t, int64_t, const int32_t*, const float*, const float*, float*, int64_t);

template <int GS, bool MINS, bool SIGNED, int... MRs>
Q8Fn q8_of(int mr, std::integer_sequence<int, MRs...>) {
  Q8Fn fns[] = {q8_tile<MRs + 1, GS, MINS, SIGNED>...};
  return fns[mr - 1];
}

// The tile for `mr` rows (1 .. Q8_MR): GGUF's 32-column groups unrolled, other group sizes at run time.
template <int GS>
Q8Fn q8_kernel(int mr, bool mins, bool is_signed) {
  const auto seq = std::make_integer_sequence<int, Q8_MR>{};
  if (is_signed) return mins ? q8_of<GS, true, true>(mr, seq) : q8_of<GS, false, true>(mr, seq);
  return mins ? q8_of<GS, true, false>(mr, seq) : q8_of<GS, false, false>(mr, seq);
}

// Whether an int8 matrix's call goes weight row by weight row (`q8_row_item`) rather than in packed strips.
inline bool q8_by_row(const QArgs& a) { return a.N <= Q8_ROW_ROWS && a.G == 32; }

// Output rows [r0, r0 + Q8_NR) (clipped to R) of y [N, R] for activation rows [n0, n1) of r: the strip packed, then
// every tile of Q8_MR rows (a strip's narrower last tile through a buffer).
void q8_strip_item(const QArgs& a, int bits, const Q8Rows& r, int64_t r0, int64_t n0, int64_t n1) {
  thread_local line_vector<uint8_t> codes;
  thread_local line_vector<int32_t> wq;
  thread_local line_vector<float> sc, mf;
  if (codes.size() < (size_t)(Q8_NR * a.C)) codes.resize(Q8_NR * a.C), wq.resize(Q8_NR * a.C / 4);
  if (sc.size() < (size_t)(Q8_NR * a.NG)) sc.resize(Q8_NR * a.NG), mf.resize(Q8_NR * a.NG);
  const int64_t n = std::min<int64_t>(Q8_NR, a.R - r0);
  pack_q8_strip(a, bits, r0, n, codes.data(), wq.data(), sc.data(), mf.data());
  const bool mins = a.mn || a.offset;
  alignas(64) float part[Q8_MR * Q8_NR];
  for (int64_t i = n0; i < n1; i += Q8_MR) {
    const int mr = (int)std::min<int64_t>(Q8_MR, n1 - i);
    const Q8Fn fn = a.G == 32 ? q8_kernel<32>(mr, mins, bits == 8) : q8_kernel<0>(mr, mins, bits == 8);
    if (n == Q8_NR) {
      fn(r, a.C, i, wq.data(), sc.data(), mf.data(), a.y + i * a.R + r0, a.R);
      continue;
    }
    fn(r, a.C, i, wq.data(), sc.data(), mf.data(), part, Q8_NR);
    for (int t = 0; t < mr; ++t) std::memcpy(a.y + (i + t) * a.R + r0, part + t * Q8_NR, n * sizeof(float));
  }
}
#endif

// One matrix of a call, checked: its QArgs (x, y and xsum set by the caller) and bits.
ffi::Error matrix_args(ffi::AnyBuffer codes, ffi::AnyBuffer scale, ffi::AnyBuffer mn, ffi::AnyBuffer strips,
                       int64_t layer, int64_t N, int64_t C, int64_t bits, int64_t group, int64_t offset, QArgs& a) {
  auto cd = codes.dimensions(), sd = scale.dimensions(), md = mn.dimensions(), pd = strips.dimensions();
  if (cd.size() != 3 || sd.size() != 3) return ffi::Error::InvalidArgument("qmatmul: codes and scales must be [L, R, .]");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("qmatmul: bits must be 4 or 8");
  a.N = N;
  a.C = C;
  a.R = cd[1];
  a.NG = sd[2];
  a.G = group;
  a.offset = (int)offset;
  const int64_t L = cd[0];
  if (a.G <= 0 || a.C != a.G * a.NG || cd[2] != a.C * bits / 8 || sd[0] != L || sd[1] != a.R ||
      (bits == 4 && a.G % 2))
    return ffi::Error::InvalidArgument("qmatmul: codes [L, R, C * bits / 8] and scales [L, R, C / G] disagree with x");
  auto et = scale.element_type();
  if (!scale_type(et, a.st)) return ffi::Error::InvalidArgument("qmatmul: scales must be float16, bfloat16 or float32");
  const bool has_min = md.size() == 3 && md[0] == L && md[1] == a.R && md[2] == a.NG;
  if (has_min && mn.element_type() != et) return ffi::Error::InvalidArgument("qmatmul: mins must have the scales' dtype");
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer, 0), L - 1);
  const int64_t scale_bytes = a.st == F32 ? 4 : 2;
  a.codes = static_cast<const uint8_t*>(codes.untyped_data()) + l * a.R * cd[2];
  a.scale = static_cast<const uint8_t*>(scale.untyped_data()) + l * a.R * a.NG * scale_bytes;
  a.mn = has_min ? static_cast<const uint8_t*>(mn.untyped_data()) + l * a.R * a.NG * scale_bytes : nullptr;
  if (pd.size() == 3) {  // the strip-major copy
    const int64_t S = (a.R + GEMM_NR - 1) / GEMM_NR, B = strip_layout_bytes(a.C, a.NG, (int)bits, scale_bytes, has_min);
    if (pd[0] != L || pd[1] != S || pd[2] != B || strips.element_type() != ffi::DataType::U8)
      return ffi::Error::InvalidArgument("qmatmul: strips must be uint8 [L, R / strip rows, strip bytes] "
                                         "(weights.strip_layout for this build's strip rows)");
    a.strips = static_cast<const uint8_t*>(strips.untyped_data()) + l * S * B;
    a.strip_bytes = B;
  } else if (strips.element_count() != 0) {
    return ffi::Error::InvalidArgument("qmatmul: strips must be [L, S, bytes] or empty");
  }
  return ffi::Error::Success();
}

// y_i = x M_i^T for every matrix i of the call (matrices sharing their input, e.g. q, k, v): their rows are shared
// out as one pool of work items, so a call long enough to be worth a second thread is one call.
ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> bits,
                       ffi::Span<const int64_t> groups, ffi::Span<const int64_t> offsets,
                       ffi::Span<const int64_t> int8) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x must be [N, C]");
  const size_t M = bits.size();
  if (M == 0 || groups.size() != M || offsets.size() != M || int8.size() != M || args.size() != 4 * M ||
      rets.size() != M)
    return ffi::Error::InvalidArgument("qmatmul: four operands (codes, scales, mins, strips) and one result a matrix");
  const int64_t N = xd[0], C = xd[1], l = layer.typed_data()[0];
  std::vector<QArgs> mats(M);
#if KIVI_VNNI
  // x rounded to int8, one for each group size of the int8 matrices (the first q8used of this thread's buffers, kept
  // between calls: fresh ones cost their page faults every call). A reference, so that the pool's threads read the
  // calling thread's buffers, not their own thread_local ones
  thread_local std::vector<Q8Rows> q8store;
  std::vector<Q8Rows>& q8rows = q8store;
  size_t q8used = 0;
  std::vector<int> q8of(M, -1);
#endif
  std::vector<std::vector<float>> xsums(M);
  std::vector<int64_t> first(M + 1, 0);  // first work item of each matrix
  for (size_t i = 0; i < M; ++i) {
    auto codes = args.get<ffi::AnyBuffer>(4 * i), scale = args.get<ffi::AnyBuffer>(4 * i + 1),
         mn = args.get<ffi::AnyBuffer>(4 * i + 2), strips = args.get<ffi::AnyBuffer>(4 * i + 3);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!codes.has_value() || !scale.has_value() || !mn.has_value() || !strips.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("qmatmul: operands must be buffers, results float32 buffers");
    QArgs& a = mats[i];
    ffi::Error err = matrix_args(*codes, *scale, *mn, *strips, l, N, C, bits[i], groups[i], offsets[i], a);
    if (err.failure()) return err;
    if ((*y)->element_count() != (size_t)(N * a.R)) return ffi::Error::InvalidArgument("qmatmul: y must be [N, R]");
    a.x = x.typed_data();
    a.y = (*y)->typed_data();
    if (int8[i]) {  // items: ITEM_ROWS rows of M (`q8_by_row`), else a strip of Q8_NR rows by GEMM_MB activation rows
#if KIVI_VNNI
      if (a.G % 4) return ffi::Error::InvalidArgument("qmatmul: int8 activations need groups of a multiple of 4");
      size_t k = 0;
      while (k < q8used && q8rows[k].G != a.G) ++k;
      if (k == q8used) {
        if (q8used == q8rows.size()) q8rows.emplace_back();
        Q8Rows& r = q8rows[q8used++];
        r.G = a.G, r.NG = a.NG;
        r.q.resize(N * C), r.d.resize(N * a.NG), r.sum.resize(N * a.NG), r.corr.resize(N * a.NG);
        r.quad.clear();
      }
      q8of[i] = (int)k;
      if (q8_by_row(a)) {
        q8rows[k].quad.resize(N * C / 4);
        first[i + 1] = first[i] + (a.R + ITEM_ROWS - 1) / ITEM_ROWS;
      } else {
        first[i + 1] = first[i] + (a.R + Q8_NR - 1) / Q8_NR * ((N + GEMM_MB - 1) / GEMM_MB);
      }
      continue;
#else
      return ffi::Error::InvalidArgument("qmatmul: int8 activations need AVX512-VNNI (this build has none)");
#endif
    }
    if (N > STRIP_ROWS) {  // items: a strip of GEMM_NR rows of M by a block of GEMM_MB activation rows
      first[i + 1] = first[i] + (a.R + GEMM_NR - 1) / GEMM_NR * ((N + GEMM_MB - 1) / GEMM_MB);
      continue;
    }
    xsums[i].resize(N * a.NG);
    for (int64_t k = 0; k < N * a.NG; ++k) {  // group k % NG of row k / NG: rows are NG whole groups
      const float* p = a.x + k * a.G;
      float sum = 0.0f;
      for (int64_t j = 0; j < a.G; ++j) sum += p[j];
      xsums[i][k] = sum;
    }
    a.xsum = xsums[i].data();
    first[i + 1] = first[i] + (a.R + ITEM_ROWS - 1) / ITEM_ROWS;
  }
#if KIVI_VNNI
  for (size_t k = 0; k < q8used; ++k) {  // blocks of 16 rows shared out when there are many
    Q8Rows& r = q8rows[k];
    const int64_t blocks = (N + 15) / 16;
    const auto quantize = [&](int64_t b) { quantize_rows(x.typed_data(), C, 16 * b, std::min(N, 16 * b + 16), r); };
    if (N > GEMM_ROWS) parallel_for(pool, blocks, quantize);
    else for (int64_t b = 0; b < blocks; ++b) quantize(b);
  }
#endif
  parallel_for(pool, first[M], [&](int64_t it) {
    size_t i = 0;
    while (it >= first[i + 1]) ++i;
    const QArgs& a = mats[i];
#if KIVI_VNNI
    if (q8of[i] >= 0 && q8_by_row(a)) {
      const int64_t r0 = (it - first[i]) * ITEM_ROWS;
      q8_row_item(a, (int)bits[i], q8rows[q8of[i]], r0, std::min(a.R, r0 + ITEM_ROWS));
      return;
    }
    if (q8of[i] >= 0) {
      const int64_t strips = (a.R + Q8_NR - 1) / Q8_NR, local = it - first[i], n0 = local / strips * GEMM_MB;
      q8_strip_item(a, (int)bits[i], q8rows[q8of[i]], local % strips * Q8_NR, n0, std::min(N, n0 + GEMM_MB));
      return;
    }
#endif
    if (N > STRIP_ROWS) {
      const int64_t strips = (a.R + GEMM_NR - 1) / GEMM_NR, local = it - first[i], n0 = local / strips * GEMM_MB;
      strip_item(a, (int)bits[i], local % strips * GEMM_NR, n0, std::min(N, n0 + GEMM_MB));
      return;
    }
    const int64_t r0 = (it - first[i]) * ITEM_ROWS;
    item(a, (int)bits[i], r0, std::min(a.R, r0 + ITEM_ROWS));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxQMatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // per matrix: codes [L, R, C * bits / 8] (int8 or
                                                                 // uint8), scales [L, R, C / G], mins (or [0]),
                                                                 // strips [L, S, bytes] uint8 (or [0])
                                  .RemainingRets()               // per matrix: y [N, R] float32
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("group")
                                  .Attr<ffi::Span<const int64_t>>("offset")
                                  .Attr<ffi::Span<const int64_t>>("int8"));  // x rounded to int8 (q8_dot)

// The weight rows of this build's packed strips (`decoded_strip`: a strip-major copy must have them).
extern "C" int kivi_jax_strip_rows() { return (int)GEMM_NR; }

// Whether this build's quantized matmul takes int8 activations (`int8`: AVX512-VNNI and BW).
#if KIVI_VNNI
extern "C" int kivi_jax_int8_matmul() { return 1; }
#else
extern "C" int kivi_jax_int8_matmul() { return 0; }
#endif
