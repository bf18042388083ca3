// SIMD and threading helpers shared by the native CPU kernels (decode_cpu.cc, matmul_cpu.cc): vectors of W floats
// (GCC/Clang vector extensions: one AVX-512 register, one AVX2 register, or portable code), byte widening, float16
// and bfloat16 scales, and work sharing on XLA's intra-op thread pool (the FFI ThreadPool).

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__) || defined(__x86_64__)
#include <immintrin.h>  // (x86-64 without -march=native: SSE2's prefetch only)
#endif

namespace ffi = xla::ffi;

namespace {

// Lanes a vector: 16 with AVX-512 (one register), else 8 (one AVX2 register; wider generic vectors are lowered
// badly without AVX-512).
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint8_t vb __attribute__((vector_size(W)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// std::vector's memory on 64-byte (cache line) boundaries: AMX tile rows and AVX-512 loads that straddle two lines
// run up to twice as slow (a bfloat16 GEMM's tiles from a malloc'd buffer: 0.8 against 1.7 TFLOP/s a core here).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <class T>
using line_vector = std::vector<T, LineAllocator<T>>;

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }
// x in every lane, read from memory (one broadcast load; vsplat's add of a zero vector keeps -0.0 and costs an op)
inline vf vbroadcast(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (vf)_mm256_broadcast_ss(p);
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = *p;
  return v;
#endif
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// exp for float32 vectors (Cephes expf: range reduction by ln 2 in two parts and a degree-5 polynomial; about 1 ulp
// for x in [-87, 88]; inputs below -87 give (almost) 0, callers mask what must be exactly 0).
inline vf vexp(vf x) {
  const vf hi = vsplat(88.3762626647949f), lo = vsplat(-87.3365447505531f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);
  vf fn = __builtin_convertvector(n, vf);
  n = fn > fx ? n - 1 : n;  // floor
  fn = __builtin_convertvector(n, vf);
  x = x - fn * 0.693359375f;
  x = x - fn * -2.12194440e-4f;
  vf z = x * x;
  vf y = vsplat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  vi bits = (n + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return y * pow2;
}

#if defined(__AVX512F__)
// The 16 x 16 matrix of 32-bit lanes r[0..15] (r[i] row i) transposed in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}
#endif

// Codes of W consecutive bytes, widened to int32 lanes.
inline vi widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vi);  // (GCC 12 builds this lane by lane: the intrinsics above avoid that)
#endif
}

// Scales and mins: float16, bfloat16 or float32 in the cache, float32 here.
enum ScaleType { F16 = 0, BF16 = 1, F32 = 2 };

// An FFI buffer's element type as a ScaleType; false for any other.
inline bool scale_type(ffi::DataType t, ScaleType& out) {
  if (t == ffi::DataType::F16) out = F16;
  else if (t == ffi::DataType::BF16) out = BF16;
  else if (t == ffi::DataType::F32) out = F32;
  else return false;
  return true;
}

// float32 -> bfloat16 bits, rounded to nearest even as XLA converts (a NaN stays a quiet NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// W consecutive bfloat16 values (their bits) as float lanes: each widened by a shift of 16 bits.
inline vf bf16_load(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = bf16_to_float(p[i]);
  return v;
#endif
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void load_scales(const void* base, int64_t offset, int n, ScaleType t, float* out) {
  if (t == F32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, n * sizeof(float));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
  int i = 0;
  if (t == F16) {
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
    for (; i < n; ++i) out[i] = half_to_float(p[i]);
  } else {
    for (; i < n; ++i) out[i] = bf16_to_float(p[i]);
  }
}

// W consecutive scales (or mins) of type ST from element i, as float lanes (one load and one conversion).
template <ScaleType ST>
inline vf scales_at(const void* base, int64_t i) {
  if (ST == F32) return vload(static_cast<const float*>(base) + i);
  const uint16_t* p = static_cast<const uint16_t*>(base) + i;
#if defined(__AVX512F__)
  if (ST == F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  if (ST == F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  if (ST == BF16) return bf16_load(p);
  alignas(64) float out[W];
  load_scales(base, i, W, ST, out);
  return vload(out);
}

// Sums of W vectors' lanes: lane j of the result is the sum of v[j]'s lanes. A transpose-and-add tree on AVX-512
// (15 adds, 30 shuffles, one permute, for 16 sums), lane by lane elsewhere.
#if defined(__AVX512F__)
struct ReduceLanes {
  __m512i order;  // result lane j <- tree lane order[j]
  ReduceLanes() {
    vf v[16];
    for (int i = 0; i < 16; ++i) v[i] = vsplat((float)i);
    vf t = tree(v);
    int32_t idx[16];
    for (int j = 0; j < 16; ++j)
      for (int l = 0; l < 16; ++l)
        if ((int)(t[l] / 16.0f + 0.5f) == j) idx[j] = l;
    std::memcpy(&order, idx, sizeof(order));
  }
  static vf tree(const vf* v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i) {
      __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; ++i)
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
      y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]))));
    return (vf)_mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  }
  vf operator()(const vf* v) const { return (vf)_mm512_permutexvar_ps(order, (__m512)tree(v)); }
};
#elif defined(__AVX__)
struct ReduceLanes {  // W = 8 here: lane j of the result is the sum of v[j]'s lanes, by a tree of horizontal adds
  vf operator()(const vf* v) const {
    const __m256 a01 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), a23 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    const __m256 a45 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), a67 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    const __m256 b03 = _mm256_hadd_ps(a01, a23), b47 = _mm256_hadd_ps(a45, a67);  // per 128-bit half: v0..v3
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(b03, b47, 0x20), _mm256_permute2f128_ps(b03, b47, 0x31));
  }
};
#else
struct ReduceLanes {  // W = 8 here: lane j of the result is the sum of v[j]'s lanes
  vf operator()(const vf* v) const {
    vf out;
    for (int j = 0; j < W; ++j) out[j] = hsum(v[j]);
    return out;
  }
};
#endif
const ReduceLanes reduce_lanes;

// ---------------------------------------------------------------------------------------------------------------------
// Work sharing on XLA's intra-op pool: the caller claims items too and waits only for items already claimed, so it
// never waits on a task the pool has not started (the pool may be busy, have one thread, or run tasks inline).

// One call's items shared out: each of `parts` threads first takes its own contiguous run of items in order (so a
// thread reads weights, or tokens, front to back: interleaving small runs between threads defeated the hardware
// prefetchers and halved a matmul's speed on 2 cores), then takes what is left of the others' runs.
struct Shared {
  static constexpr int MAX_PARTS = 64;
  std::atomic<int64_t> next[MAX_PARTS];
  int64_t end[MAX_PARTS];
  int parts = 1;
  std::atomic<int> tickets{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::function<void(int64_t)> fn;
  std::mutex mu;
  std::condition_variable cv;

  void init(int64_t n, int threads) {
    total = n;
    parts = std::max(1, std::min<int>(threads, MAX_PARTS));
    for (int p = 0; p < parts; ++p) {
      next[p].store(n * p / parts);
      end[p] = n * (p + 1) / parts;
    }
  }

  void work() {
    const int me = tickets.fetch_add(1) % parts;
    for (int k = 0; k < parts; ++k) {
      const int p = (me + k) % parts;
      for (;;) {
        int64_t i = next[p].fetch_add(1);
        if (i >= end[p]) break;
        fn(i);
        if (done.fetch_add(1) + 1 == total) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
  }
};

int thread_limit() {
  const char* env = std::getenv("KIVI_JAX_NATIVE_THREADS");
  return env ? std::max(1, std::atoi(env)) : 0;
}

int64_t worker_count(ffi::ThreadPool& pool) {
  int64_t n = std::max<int64_t>(pool.num_threads(), 1);
  int limit = thread_limit();
  return limit ? std::min<int64_t>(n, limit) : n;
}

// fn(i) for every i in [0, total) on XLA's intra-op pool: the caller works too and waits only for items already
// claimed, so it never waits on a task the pool has not started (the pool may be busy, have one thread, or run tasks
// inline). (Workers of our own that spin between the calls of a decode step were tried and measured slower in the
// whole step: their spinning took the core XLA's own threads needed.)
void parallel_for(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  int64_t helpers = std::min<int64_t>(worker_count(pool), total) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->init(total, (int)helpers + 1);
  shared->fn = std::move(fn);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == total; });
}

}  // namespace
