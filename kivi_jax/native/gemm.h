// Register-blocked float32 tiles of y = x W for the few activation rows of a decode step (docs/kernels.md "Float
// weights"), shared by the float-weight matmul (fmatmul_cpu.cc) and the quantized one's many-row path
// (matmul_cpu.cc, on weight rows decoded to float32 first); and, at the end, the packed strips of a prefill chunk's
// many rows (`gemm_strip`).
//
// Two layouts of the weights, two tiles:
// - `axpy_tile`: W [C, R] row by row (a projection W [in, out]: the output units of a row contiguous). MR activation
//   rows times NV vectors of output units: each weight vector feeds MR FMAs, each activation broadcast NV.
// - `dot_tile`: W [R, C] row by row (one row an output unit: an embedding table, or quantized rows decoded). MR
//   activation rows times NR weight rows, summed along C in vector lanes and reduced at the end.

#pragma once

#include <utility>

#include "simd.h"

namespace {

#if defined(__AVX512F__)
constexpr int AXPY_MR = 6, AXPY_NV = 4;  // 24 accumulators of the 32 registers
constexpr int DOT_MR = 4, DOT_NR = 4;    // 16 accumulators
#else
constexpr int AXPY_MR = 4, AXPY_NV = 2;  // 8 accumulators of the 16 registers
constexpr int DOT_MR = 3, DOT_NR = 3;    // 9 accumulators
#endif
// y[i, j] = sum_c x[i, c] w[c, j] for i < MR, j < NV * W (`ADD`: y[i, j] += that sum): activation rows at stride
// ldx, weight rows at stride ldw, outputs at stride ldy. `next`: the weights of the next column block (same rows and
// stride), or null: this tile, the `part`-th of `parts`, requests the lines of that block's rows [C * part / parts,
// C * (part + 1) / parts) into L2, one row every `parts` steps, so that the next block's first tile finds its weights
// in cache.
template <int MR, int NV, bool ADD = false>
inline void axpy_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t C, float* y, int64_t ldy,
                      const float* next, int part, int parts) {
  const char* pf = next ? reinterpret_cast<const char*>(next + C * part / parts * ldw) : nullptr;
  const char* pf_end = next ? reinterpret_cast<const char*>(next + C * (part + 1) / parts * ldw) : nullptr;
  int countdown = 0;
  vf acc[MR][NV];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = ADD ? vload(y + i * ldy + j * W) : vf{};
  for (int64_t c = 0; c < C; ++c) {
    const float* wc = w + c * ldw;
    if (pf && --countdown <= 0 && pf < pf_end) {
#pragma GCC unroll 4
      for (int k = 0; k < NV * W * 4; k += 64) _mm_prefetch(pf + k, _MM_HINT_T1);
      pf += ldw * 4;
      countdown = parts;
    }
    vf wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = vload(wc + j * W);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const vf xb = vbroadcast(x + i * ldx + c);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] += xb * wv[j];
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vstore(y + i * ldy + j * W, acc[i][j]);
}

using AxpyFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, const float*, int,
                        int);

template <int NV, bool ADD, int... MRs>
AxpyFn axpy_of(int mr, std::integer_sequence<int, MRs...>) {
  AxpyFn fns[] = {axpy_tile<MRs + 1, NV, ADD>...};
  return fns[std::min<int>(mr, sizeof...(MRs)) - 1];
}

// The tile of `mr` rows (1 .. MAX_MR; more: MAX_MR) by NV vectors.
template <int NV, bool ADD = false, int MAX_MR = AXPY_MR>
AxpyFn axpy_for_rows(int mr) {
  return axpy_of<NV, ADD>(mr, std::make_integer_sequence<int, MAX_MR>{});
}

// Output units [r0, r1) of y [N, R] = x [N, C] W [C, R] (W row by row, R its row stride): column blocks of AXPY_NV
// vectors, then of one vector, then the units past the last whole vector one at a time. Each block's activation
// tiles read its weights from cache, its tiles having requested them while computing the block before (the
// previous block of the matrix, which this thread most likely took before), so that memory traffic overlaps
// arithmetic.
inline void axpy_block(const float* x, int64_t N, int64_t C, const float* w, float* y, int64_t R, int64_t r0,
                       int64_t r1) {
  int64_t r = r0;
  const int tiles = (int)((N + AXPY_MR - 1) / AXPY_MR);
  for (; r + AXPY_NV * W <= r1; r += AXPY_NV * W) {
    const float* next = r + 2 * AXPY_NV * W <= R ? w + r + AXPY_NV * W : nullptr;
    for (int64_t n = 0; n < N; n += AXPY_MR) {
      const int mr = (int)std::min<int64_t>(AXPY_MR, N - n);
      axpy_for_rows<AXPY_NV>(mr)(x + n * C, C, w + r, R, C, y + n * R + r, R, next, (int)(n / AXPY_MR), tiles);
    }
  }
  for (; r + W <= r1; r += W)
    for (int64_t n = 0; n < N; n += AXPY_MR) {
      const int mr = (int)std::min<int64_t>(AXPY_MR, N - n);
      axpy_for_rows<1>(mr)(x + n * C, C, w + r, R, C, y + n * R + r, R, nullptr, 0, 1);
    }
  for (; r < r1; ++r)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t c = 0; c < C; ++c) s += x[n * C + c] * w[c * R + r];
      y[n * R + r] = s;
    }
}

// Weights of a dot tile: float32, or bfloat16 (its bits as uint16_t) widened to float32 as they are loaded.
inline vf wload(const float* p) { return vload(p); }
inline float wscalar(const float* p) { return *p; }
inline vf wload(const uint16_t* p) { return bf16_load(p); }
inline float wscalar(const uint16_t* p) { return bf16_to_float(*p); }

// y[i, j] = sum_c x[i, c] w[j, c] for i < MR, j < NR: activation rows at stride ldx, weight rows (float32 or
// bfloat16 bits, T) at stride ldw, outputs at stride ldy. The C % W columns past the last whole vector are added one
// by one.
template <int MR, int NR, typename T>
inline void dot_tile(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t C, float* y, int64_t ldy) {
  vf acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = vf{};
  int64_t c = 0;
  for (; c + W <= C; c += W) {
    vf wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wv[j] = wload(w + j * ldw + c);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vf xv = vload(x + i * ldx + c);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = c; k < C; ++k) s += x[i * ldx + k] * wscalar(w + j * ldw + k);
      y[i * ldy + j] = s;
    }
}

template <typename T>
using DotFn = void (*)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t);

template <int NR, typename T>
DotFn<T> dot_for_rows(int mr) {
  switch (mr) {
    case 1: return dot_tile<1, NR, T>;
    case 2: return dot_tile<2, NR, T>;
#if defined(__AVX512F__)
    case 3: return dot_tile<3, NR, T>;
    default: return dot_tile<4, NR, T>;
#else
    default: return dot_tile<3, NR, T>;
#endif
  }
}

template <typename T>
inline DotFn<T> dot_kernel(int mr, int nr) {
  switch (nr) {
    case 1: return dot_for_rows<1, T>(mr);
    case 2: return dot_for_rows<2, T>(mr);
#if defined(__AVX512F__)
    case 3: return dot_for_rows<3, T>(mr);
    default: return dot_for_rows<4, T>(mr);
#else
    default: return dot_for_rows<3, T>(mr);
#endif
  }
}

// Output units [r0, r1) of y [N, R] = x [N, C] W^T for W [R, C] row by row at stride ldw (w points at row r0): for
// each tile of DOT_MR activation rows (held in L1), every DOT_NR weight rows of the block. `next`, `next_bytes`: the
// weights the thread most likely takes next (the following block), requested into L2 a share after each tile, so
// that their memory traffic overlaps this block's arithmetic.
template <typename T>
inline void dot_block(const float* x, int64_t N, int64_t C, const T* w, int64_t ldw, float* y, int64_t R,
                      int64_t r0, int64_t r1, const T* next = nullptr, int64_t next_bytes = 0) {
  const int64_t tiles = ((N + DOT_MR - 1) / DOT_MR) * ((r1 - r0 + DOT_NR - 1) / DOT_NR);
  const int64_t share = next ? ((next_bytes + 63) / 64 + tiles - 1) / tiles * 64 : 0;  // bytes a tile requests
  const char* pf = reinterpret_cast<const char*>(next);
  const char* pf_end = pf + next_bytes;
  for (int64_t n = 0; n < N; n += DOT_MR) {
    const int mr = (int)std::min<int64_t>(DOT_MR, N - n);
    for (int64_t r = r0; r < r1; r += DOT_NR) {
      const int nr = (int)std::min<int64_t>(DOT_NR, r1 - r);
      dot_kernel<T>(mr, nr)(x + n * C, C, w + (r - r0) * ldw, ldw, C, y + n * R + r, R);
      for (int64_t k = 0; k < share && pf < pf_end; k += 64, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    }
  }
}

// ---- Many activation rows (a prefill chunk): y = x W a packed strip of output units at a time ----

#if defined(__AVX512F__)
constexpr int GEMM_MR = 12;  // activation rows a tile holds: 24 accumulators, 2 weight vectors, 1 broadcast
#else
constexpr int GEMM_MR = 6;   // 12 accumulators of the 16 registers
#endif
constexpr int GEMM_NV = 2;                   // vectors of output units a strip holds
constexpr int64_t GEMM_NR = GEMM_NV * W;     // output units of a strip
constexpr int64_t GEMM_ROWS = 64;   // more activation rows than this (a prefill chunk): packed strips
constexpr int64_t GEMM_MB = 512;    // activation rows a strip's work item takes

// Columns [r0, r0 + n) (n <= GEMM_NR) of W [C, R] row by row, copied to bp [C][GEMM_NR] (contiguous, zero past n),
// so that every tile of a strip streams its weights front to back.
inline void pack_strip(const float* w, int64_t C, int64_t R, int64_t r0, int64_t n, float* bp) {
  if (n == GEMM_NR) {
    for (int64_t c = 0; c < C; ++c)
#pragma GCC unroll 2
      for (int j = 0; j < GEMM_NV; ++j) vstore(bp + c * GEMM_NR + j * W, vload(w + c * R + r0 + j * W));
    return;
  }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < GEMM_NR; ++j) bp[c * GEMM_NR + j] = j < n ? w[c * R + r0 + j] : 0.0f;
}

// Rows rows [n][C] (n <= GEMM_NR: weight rows decoded to float32, each an output unit) transposed into bp
// [C][GEMM_NR], zero past n: the strip `pack_strip` makes of a projection.
inline void pack_rows_strip(const float* rows, int64_t C, int64_t n, float* bp) {
  int64_t c0 = 0;
#if defined(__AVX512F__)
  static_assert(GEMM_NR % 16 == 0, "strips of whole 16s");
  for (; c0 + 16 <= C; c0 += 16)
    for (int64_t j0 = 0; j0 < GEMM_NR; j0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_loadu_si512(rows + (j0 + i) * C + c0) : _mm512_setzero_si512();
      transpose16(r);  // r[c]: column c0 + c of rows j0 .. j0 + 15
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(bp + (c0 + c) * GEMM_NR + j0, r[c]);
    }
#endif
  for (int64_t c = c0; c < C; ++c)
    for (int64_t j = 0; j < GEMM_NR; ++j) bp[c * GEMM_NR + j] = j < n ? rows[j * C + c] : 0.0f;
}

// y[i, j] = sum_c x[i, c] bp[c, j] for i < MR, j < n (n <= GEMM_NR): activation rows at stride ldx, a packed strip
// (`pack_strip`) as `axpy_tile`'s weights, outputs at stride ldy (a strip's last, narrower tile through a buffer).
template <int MR>
inline void gemm_tile(const float* x, int64_t ldx, const float* bp, int64_t C, float* y, int64_t ldy, int64_t n) {
  if (n == GEMM_NR) return axpy_tile<MR, GEMM_NV>(x, ldx, bp, GEMM_NR, C, y, ldy, nullptr, 0, 1);
  alignas(64) float part[MR * GEMM_NR];
  axpy_tile<MR, GEMM_NV>(x, ldx, bp, GEMM_NR, C, part, GEMM_NR, nullptr, 0, 1);
  for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, part + i * GEMM_NR, n * sizeof(float));
}

using GemmFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);

template <int... MRs>
inline GemmFn gemm_for_rows(int mr, std::integer_sequence<int, MRs...>) {
  GemmFn fns[] = {gemm_tile<MRs + 1>...};
  return fns[mr - 1];
}

// Output units [r0, r0 + n) (n <= GEMM_NR) of y [N, R] for activation rows [n0, n1) of x [N, C], from a packed
// strip bp (`pack_strip`, `pack_rows_strip`): every tile of GEMM_MR rows.
inline void gemm_rows(const float* x, int64_t C, const float* bp, float* y, int64_t R, int64_t n0, int64_t n1,
                      int64_t r0, int64_t n) {
  for (int64_t i = n0; i < n1; i += GEMM_MR) {
    const int mr = (int)std::min<int64_t>(GEMM_MR, n1 - i);
    gemm_for_rows(mr, std::make_integer_sequence<int, GEMM_MR>{})(x + i * C, C, bp, C, y + i * R + r0, R, n);
  }
}

// Output units [r0, r0 + GEMM_NR) (clipped to R) of y [N, R] = x [N, C] W [C, R] for activation rows [n0, n1):
// the strip packed into bp (C * GEMM_NR floats), then every tile of GEMM_MR rows.
inline void gemm_strip(const float* x, int64_t C, const float* w, int64_t R, float* y, int64_t n0, int64_t n1,
                       int64_t r0, float* bp) {
  const int64_t n = std::min<int64_t>(GEMM_NR, R - r0);
  pack_strip(w, C, R, r0, n, bp);
  gemm_rows(x, C, bp, y, R, n0, n1, r0, n);
}

}  // namespace
