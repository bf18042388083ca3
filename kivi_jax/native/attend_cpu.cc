// A prefill chunk's attention segment on the CPU, an XLA FFI handler (docs/kernels.md "Chunk attention"). Its
// contract is kivi_jax.attention.segment's XLA path with bfloat16 dots: the chunk's queries q [B, Tq, Hq, D] (float32
// or bfloat16, times `scale` before their rounding) at q_pos [B, Tq] add keys and values k, v [B, H, T, D] (or
// [B, T, H, D]: `kv_tokens_first`) at positions k_pos [B, T], those with k_ok [B, T] set, to their online softmax
// (m, l [B, Tq, Hq], acc [B, Tq, Hq, D], updated in place; `fresh`: started from nothing seen, not read; `finish`:
// acc written as acc / l); query head h n_rep + r reads kv head h. A key counts for a query when it is ok, at or
// before the query's position (`causal`) and less than `window` positions before it (0: no window). A KIVI cache's
// stores may come first on the key axis (`Store`: their quantized tokens, read in place and dequantized as packed),
// so that a chunk's attention over the cache is one call. q, k, p and v are rounded to bfloat16 and their products
// summed in float32, as XLA's bfloat16 dots do; scores, the softmax and its sums stay float32.
//
// Work items are (sequence, kv head, 32 rows), a row being one query head of one token (row r of kv head h: token
// r / n_rep, head h n_rep + r % n_rep), shared out on XLA's intra-op pool; an item walks the keys 64 at a time,
// skipping a step none of whose keys any of its rows sees (the causal upper triangle, the window, keys not ok),
// flash-attention style and transposed, so that every softmax operation runs down AVX-512 lanes of 16 rows (no
// reduction across lanes): scores S^T = K Q^T in AMX tiles (keys by rows), the softmax a key at a time, then
// acc^T += V^T P^T in AMX tiles onto the item's float32 accumulator (channels by rows). Keys (row-major) and values
// (transposed) are packed as bfloat16 once a call. Without AMX (or with amx=0) the dots run scalar loops (tests,
// other CPUs).
//
// With `f32` the contract is the XLA path with float32 dots instead (a float32 chunk): q, k, p and v stay float32,
// keys packed row-major and values transposed in float32, and both products run `axpy_tile`'s register tiles
// (gemm.h): S^T = K Q^T with the keys as its rows and Q^T [D][ROWS] as its weights, acc^T += V^T P^T with the
// channels as its rows and P^T [KEYS][ROWS] (the scores' buffer, overwritten) as its weights.

#include "amx.h"
#include "gemm.h"
#include "simd.h"

namespace {

constexpr int64_t ROWS = 32;   // query rows a work item (two groups of 16 lanes)
constexpr int64_t KEYS = 64;   // keys a step (two blocks of 32)
constexpr int64_t TILE = 512;  // bfloat16s a packed tile (16 rows of 32)
// A row's reference m (its probabilities are exp(score - m)) moves up to its max only when a score passes it by more
// than this, so that the accumulator is rarely rescaled; probabilities stay below e^RESCALE (bfloat16 rounds them
// relatively: no precision is lost), and acc / l, what the softmax is, does not depend on m.
constexpr float RESCALE = 8.f;
constexpr int F32_NV = ROWS / W;          // vectors of rows a float32 tile holds (2 on AVX-512)
constexpr int F32_MR = W == 16 ? 12 : 2;  // keys (or channels) a float32 tile holds: 24 accumulators (8 on AVX2)

// One layer of a KIVI cache's stores (contiguous, uniform codes, keys after RoPE): keys per-channel (codes
// [L, B, H, Tc, D k_bits / 8], scale and min [L, B, H, Tc / k_group, D]), values per-token (codes [L, B, H, Tc,
// D v_bits / 8], scale and min [L, B, H, Tc, D / v_group]), planar-packed (quant.py: byte j of a row holds channels
// j + s D / p at bits s * bits, p = 8 / bits codes a byte), read in place at `layer`; a token dequantized as
// `code * scale + min` in float32, as attention.dequantized.
struct Store {
  const uint8_t *kc = nullptr, *vc = nullptr;
  const void *ks = nullptr, *km = nullptr, *vs = nullptr, *vm = nullptr;
  ScaleType st = F32;
  int k_bits = 2, v_bits = 2;
  int64_t k_group = 32, v_group = 32, B = 0, H = 0, Tc = 0, D = 0, layer = 0;

  int64_t bh(int64_t b, int64_t h) const { return (layer * B + b) * H + h; }
  // row t's codes (bits each, D of them) -> float32 codes in channel order
  static void codes(const uint8_t* row, int bits, int64_t D, float* out) {
    const int p = 8 / bits;
    const int64_t slab = D / p;
    const uint32_t mask = (1u << bits) - 1;
#if defined(__AVX512F__)
    if (slab % 16 == 0) {
      for (int64_t j = 0; j < slab; j += 16) {
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
        for (int sl = 0; sl < p; ++sl)
          _mm512_storeu_ps(out + sl * slab + j, _mm512_cvtepi32_ps(_mm512_and_si512(
              _mm512_srli_epi32(x, bits * sl), _mm512_set1_epi32((int)mask))));
      }
      return;
    }
#endif
    for (int64_t d = 0; d < D; ++d) out[d] = (float)((row[d % slab] >> (bits * (d / slab))) & mask);
  }
  void key(int64_t b, int64_t h, int64_t t, float* out) const {
    const int64_t i = bh(b, h);
    codes(kc + (i * Tc + t) * (D * k_bits / 8), k_bits, D, out);
    alignas(64) float sc[256], mn[256];
    const int64_t g = (i * (Tc / k_group) + t / k_group) * D;
    load_scales(ks, g, (int)D, st, sc);
    load_scales(km, g, (int)D, st, mn);
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] * sc[d] + mn[d];
  }
  void value(int64_t b, int64_t h, int64_t t, float* out) const {
    const int64_t i = bh(b, h), groups = D / v_group;
    codes(vc + (i * Tc + t) * (D * v_bits / 8), v_bits, D, out);
    alignas(64) float sc[256], mn[256];
    load_scales(vs, (i * Tc + t) * groups, (int)groups, st, sc);
    load_scales(vm, (i * Tc + t) * groups, (int)groups, st, mn);
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] * sc[d / v_group] + mn[d / v_group];
  }
};

struct Segment {
  int64_t B, H, R, T, D, steps, window;
  int64_t Tq, Hq, n_rep;  // query tokens and heads: row r of kv head h is token r / n_rep's head h n_rep + r % n_rep
  float scale;  // the queries' scale (1/sqrt(head_dim)), applied before their rounding to bfloat16
  bool causal, amx, q_bf16, kv_tokens_first;
  bool f32 = false;     // float32 dots (q, k, p and v not rounded to bfloat16), the packs kf and vtf
  bool fresh = false;   // every row starts from nothing seen (m = -inf, l = 0, acc = 0): the state is not read
  bool finish = false;  // acc comes out normalized, acc / l (0 where a row saw nothing)
  const void* q;
  const float *k, *v;
  const int32_t *q_pos, *k_pos, *k_ok;  // of the key axis (store tokens first, then the dense ones)
  float *m, *l, *acc;
  // The KIVI store, when the call has one (`Store`): tokens [0, S) of the key axis are its tokens [0, S), the dense
  // keys k, v follow (key t >= S is dense key t - S of Td); T = S + Td.
  Store store;
  int64_t S = 0, Td = 0;
  // keys and values of (b, h), bfloat16, zero past T: kp [T'][D] row-major (T' = steps * KEYS); vt in blocks j of 32
  // keys and c of 16 channels, vt[(j * (D / 16) + c) * TILE + dd * 32 + n] = v[32 j + n][16 c + dd]
  uint16_t *kp, *vt;
  // with f32, of (b, h): kf [T'][D] row-major, vtf [D][T'] (zero past T)
  float *kf = nullptr, *vtf = nullptr;
  // per (b, step): which of its keys are ok (bit n: key KEYS s + n), and the least and greatest position among them
  std::vector<uint64_t> ok_bits;
  std::vector<int32_t> lo, hi;

  int64_t packed() const { return steps * KEYS * D; }  // bfloat16s of one (b, h)'s keys (or values)
  // the state's (and the query's) element of row r of (b, h), in [B, Tq, Hq(, D)]
  int64_t row(int64_t b, int64_t h, int64_t r) const { return (b * Tq + r / n_rep) * Hq + h * n_rep + r % n_rep; }
  // dense key (or value) t of (b, h): [B, Td, H, D] when kv_tokens_first, else [B, H, Td, D]
  const float* key_row(const float* x, int64_t bh, int64_t t) const {
    const int64_t b = bh / H, h = bh % H;
    return x + (kv_tokens_first ? (b * Td + t) * H + h : bh * Td + t) * D;
  }
  // key and value t of (b, h) as float32 rows (into kbuf / vbuf for a store token), nullptr for zeros (past T, or a
  // store token not ok: never dequantized)
  void rows_at(int64_t bh, int64_t t, float* kbuf, float* vbuf, const float*& kr, const float*& vr) const {
    kr = vr = nullptr;
    if (t >= T) return;
    if (t >= S) {
      kr = key_row(k, bh, t - S), vr = key_row(v, bh, t - S);
      return;
    }
    if (!k_ok[bh / H * T + t]) return;
    store.key(bh / H, bh % H, t, kbuf);
    store.value(bh / H, bh % H, t, vbuf);
    kr = kbuf, vr = vbuf;
  }
  // channels [d0, d0 + 32) of row r's query, times the scale, in float32
  void query(int64_t b, int64_t h, int64_t r, int64_t d0, float* out) const {
    const int64_t at = row(b, h, r) * D + d0;
    for (int64_t d = 0; d < 32; d += W)
      vstore(out + d, (q_bf16 ? bf16_load(static_cast<const uint16_t*>(q) + at + d)
                              : vload(static_cast<const float*>(q) + at + d)) * scale);
  }
};

// One item's working set: its rows' bfloat16 queries (row-major, and for AMX as B tiles: qt[(g * (D / 32) + c) *
// TILE + kk * 32 + n * 2 + e] = q[16 g + n][32 c + 2 kk + e]), the step's scores S^T [KEYS][ROWS], its
// probabilities as B tiles pt[(g * 2 + jq) * TILE + kk * 32 + n * 2 + e] = p[row 16 g + n][key 32 jq + 2 kk + e],
// and the accumulator acc^T [D][ROWS]. With f32: the queries as Q^T [D][ROWS] in float32 (qtf), the probabilities
// in place of the scores in st.
struct Item {
  line_vector<uint16_t> qb, qt, pt;  // (every buffer a tile reads starts on a cache line)
  line_vector<float> st, acct, qtf;
  alignas(64) float m[ROWS], l[ROWS];
  alignas(64) int32_t qpos[ROWS];
  explicit Item(int64_t D)
      : qb(ROWS * D, 0), qt(ROWS * D, 0), pt(4 * TILE, 0), st(KEYS * ROWS, 0.f), acct(D * ROWS, 0.f),
        qtf(D * ROWS, 0.f) {}
};

#if KIVI_AMX && defined(__AVX512BF16__)
constexpr bool VECTOR_PACK = true;

inline __m512i bf16_pairs(const float* x) {  // 32 floats -> their bfloat16s in order (16 words of two)
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

inline __m512i bf16_words(const float* x) {  // 16 floats -> their bfloat16s, each in the low half of a word
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
}

void pack(Segment& a, int64_t bh) {
  const int64_t D = a.D, blocks = a.steps * KEYS / 32;
  uint16_t* kp = a.kp + bh * a.packed();
  uint16_t* vt = a.vt + bh * a.packed();
  thread_local line_vector<float> buf;  // a block's store keys and values, dequantized
  if ((int64_t)buf.size() < 64 * D) buf.resize(64 * D);
  const float *kr[32], *vr[32];
  const uint64_t* ok = &a.ok_bits[bh / a.H * a.steps];
  for (int64_t j = 0; j < blocks; ++j) {
    if (!ok[32 * j / KEYS]) continue;  // a step none of whose keys is ok is never read (run_item skips it)
    for (int64_t n = 0; n < 32; ++n) a.rows_at(bh, 32 * j + n, &buf[n * D], &buf[(32 + n) * D], kr[n], vr[n]);
    for (int64_t n = 0; n < 32; ++n)
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(kp + (32 * j + n) * D + d, kr[n] ? bf16_pairs(kr[n] + d) : _mm512_setzero_si512());
    for (int64_t c = 0; c < D / 16; ++c) {
      __m512i r[16];  // r[kk]: (key 2 kk, key 2 kk + 1) of each of 16 channels; transposed, r[dd]: channel dd's keys
      for (int64_t kk = 0; kk < 16; ++kk) {
        const __m512i even = vr[2 * kk] ? bf16_words(vr[2 * kk] + 16 * c) : _mm512_setzero_si512();
        const __m512i odd = vr[2 * kk + 1] ? bf16_words(vr[2 * kk + 1] + 16 * c) : _mm512_setzero_si512();
        r[kk] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
      }
      transpose16(r);
      for (int64_t dd = 0; dd < 16; ++dd) _mm512_storeu_si512(vt + (j * (D / 16) + c) * TILE + dd * 32, r[dd]);
    }
  }
}
#else
constexpr bool VECTOR_PACK = false;

void pack(Segment& a, int64_t bh) {
  const int64_t D = a.D, blocks = a.steps * KEYS / 32;
  uint16_t* kp = a.kp + bh * a.packed();
  uint16_t* vt = a.vt + bh * a.packed();
  std::vector<float> buf(2 * D);
  const uint64_t* ok = &a.ok_bits[bh / a.H * a.steps];
  for (int64_t t = 0; t < blocks * 32; ++t) {
    if (!ok[t / KEYS]) continue;  // a step none of whose keys is ok is never read (run_item skips it)
    const float *kr, *vr;
    a.rows_at(bh, t, buf.data(), buf.data() + D, kr, vr);
    const int64_t j = t / 32, n = t % 32;
    for (int64_t d = 0; d < D; ++d) {
      kp[t * D + d] = kr ? bf16_bits(kr[d]) : 0;
      vt[(j * (D / 16) + d / 16) * TILE + (d % 16) * 32 + n] = vr ? bf16_bits(vr[d]) : 0;
    }
  }
}
#endif

// (b, h)'s keys and values for float32 dots: kf [T'][D] as they are, vtf [D][T'] transposed (16 x 16 blocks in
// registers), zero past T and for a store token not ok.
void pack_f32(Segment& a, int64_t bh) {
  const int64_t D = a.D, Tp = a.steps * KEYS;
  float* kf = a.kf + bh * a.packed();
  float* vt = a.vtf + bh * a.packed();
  thread_local line_vector<float> buf;  // 16 store keys and values, dequantized
  if ((int64_t)buf.size() < 32 * D) buf.resize(32 * D);
  const float *kr[16], *vr[16];
  const uint64_t* ok = &a.ok_bits[bh / a.H * a.steps];
  for (int64_t t0 = 0; t0 < Tp; t0 += 16) {
    if (!ok[t0 / KEYS]) continue;  // a step none of whose keys is ok is never read (run_item skips it)
    for (int64_t n = 0; n < 16; ++n) a.rows_at(bh, t0 + n, &buf[n * D], &buf[(16 + n) * D], kr[n], vr[n]);
    for (int64_t n = 0; n < 16; ++n) {
      if (kr[n])
        std::memcpy(kf + (t0 + n) * D, kr[n], D * sizeof(float));
      else
        std::memset(kf + (t0 + n) * D, 0, D * sizeof(float));
    }
#if defined(__AVX512F__)
    for (int64_t c = 0; c < D; c += 16) {
      __m512i r[16];  // r[n]: key t0 + n's channels c..; transposed, r[dd]: channel c + dd of the 16 keys
      for (int64_t n = 0; n < 16; ++n) r[n] = vr[n] ? _mm512_loadu_si512(vr[n] + c) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t dd = 0; dd < 16; ++dd) _mm512_storeu_si512(vt + (c + dd) * Tp + t0, r[dd]);
    }
#else
    for (int64_t n = 0; n < 16; ++n)
      for (int64_t d = 0; d < D; ++d) vt[d * Tp + t0 + n] = vr[n] ? vr[n][d] : 0.f;
#endif
  }
}

void key_steps(Segment& a, int64_t b) {
  for (int64_t s = 0; s < a.steps; ++s) {
    uint64_t bits = 0;
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
    for (int64_t n = 0; n < KEYS && s * KEYS + n < a.T; ++n) {
      const int64_t t = b * a.T + s * KEYS + n;
      if (!a.k_ok[t]) continue;
      bits |= uint64_t{1} << n;
      lo = std::min(lo, a.k_pos[t]);
      hi = std::max(hi, a.k_pos[t]);
    }
    a.ok_bits[b * a.steps + s] = bits;
    a.lo[b * a.steps + s] = lo;
    a.hi[b * a.steps + s] = hi;
  }
}

// S^T [KEYS][ROWS] of step s: key t's scores against every row
void scores_scalar(const Segment& a, const Item& it, const uint16_t* kp, int64_t s, float* st) {
  const int64_t D = a.D;
  for (int64_t n = 0; n < KEYS; ++n) {
    const uint16_t* key = kp + (s * KEYS + n) * D;
    for (int64_t i = 0; i < ROWS; ++i) {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) sum += bf16_to_float(it.qb[i * D + d]) * bf16_to_float(key[d]);
      st[n * ROWS + i] = sum;
    }
  }
}

// acc^T [D][ROWS] += V^T P^T of step s (the probabilities from the B tiles `pt`)
void values_scalar(const Segment& a, Item& it, const uint16_t* vt, int64_t s) {
  const int64_t D = a.D;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < ROWS; ++i) {
      float sum = 0.f;
      for (int64_t n = 0; n < KEYS; ++n) {
        const int64_t j = s * KEYS / 32 + n / 32, n32 = n % 32;
        const uint16_t p = it.pt[(i / 16 * 2 + n / 32) * TILE + (n32 / 2) * 32 + (i % 16) * 2 + n32 % 2];
        sum += bf16_to_float(p) * bf16_to_float(vt[(j * (D / 16) + d / 16) * TILE + (d % 16) * 32 + n32]);
      }
      it.acct[d * ROWS + i] += sum;
    }
}

// S^T [KEYS][ROWS] of step s in float32: the step's keys (kf) against Q^T (qtf)
void scores_f32(const Segment& a, const Item& it, const float* kf, int64_t s, float* st) {
  const int64_t D = a.D;
  for (int64_t n = 0; n < KEYS; n += F32_MR) {
    const int mr = (int)std::min<int64_t>(F32_MR, KEYS - n);
    axpy_for_rows<F32_NV, false, F32_MR>(mr)(kf + (s * KEYS + n) * D, D, it.qtf.data(), ROWS, D, st + n * ROWS,
                                             ROWS, nullptr, 0, 1);
  }
}

// acc^T [D][ROWS] += V^T P^T of step s in float32 (the probabilities P^T [KEYS][ROWS] in `it.st`)
void values_f32(const Segment& a, Item& it, const float* vt, int64_t s) {
  const int64_t D = a.D, Tp = a.steps * KEYS;
  for (int64_t d = 0; d < D; d += F32_MR) {
    const int mr = (int)std::min<int64_t>(F32_MR, D - d);
    axpy_for_rows<F32_NV, true, F32_MR>(mr)(vt + d * Tp + s * KEYS, Tp, it.st.data(), ROWS, KEYS,
                                            it.acct.data() + d * ROWS, ROWS, nullptr, 0, 1);
  }
}

#if KIVI_AMX
void scores_amx(const Segment& a, const Item& it, const uint16_t* kp, int64_t s, float* st) {
  const int64_t D = a.D, C = D / 32;
  for (int64_t jq = 0; jq < KEYS / 32; ++jq) {
    const uint16_t* keys = kp + (s * KEYS + 32 * jq) * D;
    _tile_zero(0);  // keys 0..15 by rows 0..15
    _tile_zero(1);  // keys 0..15 by rows 16..31
    _tile_zero(2);  // keys 16..31 by rows 0..15
    _tile_zero(3);  // keys 16..31 by rows 16..31
    for (int64_t c = 0; c < C; ++c) {
      _tile_loadd(4, keys + 32 * c, D * 2);
      _tile_loadd(5, keys + 16 * D + 32 * c, D * 2);
      _tile_loadd(6, it.qt.data() + c * TILE, 64);
      _tile_loadd(7, it.qt.data() + (C + c) * TILE, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* out = st + 32 * jq * ROWS;
    _tile_stored(0, out, ROWS * 4);
    _tile_stored(1, out + 16, ROWS * 4);
    _tile_stored(2, out + 16 * ROWS, ROWS * 4);
    _tile_stored(3, out + 16 * ROWS + 16, ROWS * 4);
  }
}

void values_amx(const Segment& a, Item& it, const uint16_t* vt, int64_t s) {
  // four accumulator tiles at once (channel blocks c, c + 1 by the two groups of rows), so that the dots of one
  // accumulator do not wait on each other; the probabilities' tiles are read again for each pair of channel blocks
  static_assert(KEYS == 64, "two blocks of 32 keys a step");
  const int64_t C = a.D / 16;
  for (int64_t c = 0; c < C; c += 2) {
    float* acc = it.acct.data() + 16 * c * ROWS;
    _tile_loadd(0, acc, ROWS * 4);  // channels 16 c.. by rows 0..15
    _tile_loadd(1, acc + 16, ROWS * 4);  // by rows 16..31
    _tile_loadd(2, acc + 16 * ROWS, ROWS * 4);  // channels 16 (c + 1).. by rows 0..15
    _tile_loadd(3, acc + 16 * ROWS + 16, ROWS * 4);
    for (int64_t jq = 0; jq < 2; ++jq) {
      const uint16_t* vj = vt + (s * 2 + jq) * C * TILE;
      _tile_loadd(4, vj + c * TILE, 64);
      _tile_loadd(5, vj + (c + 1) * TILE, 64);
      _tile_loadd(6, it.pt.data() + jq * TILE, 64);  // rows 0..15, keys 32 jq..
      _tile_loadd(7, it.pt.data() + (2 + jq) * TILE, 64);  // rows 16..31
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc, ROWS * 4);
    _tile_stored(1, acc + 16, ROWS * 4);
    _tile_stored(2, acc + 16 * ROWS, ROWS * 4);
    _tile_stored(3, acc + 16 * ROWS + 16, ROWS * 4);
  }
}
#endif

#if defined(__AVX512F__)
// exp(x) for x <= RESCALE (a score less the row's reference): 2^(x log2 e) as 2^n (vscalefps) times 2^f, f in
// [-1/2, 1/2], by its Taylor polynomial of degree 6 (relative error below 2e-7, under a bfloat16 probability's
// rounding by four orders); x below -100 (-inf included) counts as -100, whose exp is 0 to float32.
inline __m512 exp_small(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945f));  // in [-ln2/2, ln2/2]
  __m512 r = _mm512_set1_ps(1.0f / 720);
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f / 120));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f / 24));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f / 6));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.5f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(r, n);
}

// The online-softmax update of rows [16 g, 16 g + 16) by step s's scores (S^T in `it.st`), a key at a time down the
// rows' lanes: their max, the rescale of their sums and accumulators, the probabilities into the B tiles `it.pt`
// (with f32: in float32 over their scores in `it.st`).
// `seen`: the step's ok keys; `kq` their positions.
inline void softmax_rows(const Segment& a, Item& it, int64_t g, int64_t nr, uint64_t seen, const int32_t* kq) {
  const __m512i qv = _mm512_load_si512(it.qpos + 16 * g);
  const __mmask16 live = nr >= 16 * (g + 1) ? 0xffff : nr > 16 * g ? (__mmask16)((1u << (nr - 16 * g)) - 1) : 0;
  const __m512i win = _mm512_set1_epi32((int32_t)std::min<int64_t>(a.window, std::numeric_limits<int32_t>::max()));
  __mmask16 on[KEYS];
  __m512 top[4];  // four running maxima, so that the loop is not one chain of dependent maxes
  for (int i = 0; i < 4; ++i) top[i] = _mm512_set1_ps(NEG_INF);
  for (int64_t n = 0; n < KEYS; ++n) {
    __mmask16 ok = (seen >> n & 1u) ? live : 0;
    if (ok && a.causal) ok &= _mm512_cmpge_epi32_mask(qv, _mm512_set1_epi32(kq[n]));
    if (ok && a.window) ok &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(qv, _mm512_set1_epi32(kq[n])), win);
    on[n] = ok;
    top[n % 4] = _mm512_mask_max_ps(top[n % 4], ok, top[n % 4], _mm512_loadu_ps(&it.st[n * ROWS + 16 * g]));
  }
  const __m512 m_old = _mm512_load_ps(it.m + 16 * g);
  const __m512 seen_max = _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]));
  // the reference moves (to the max) where a score passes it by more than RESCALE, or where it was -inf
  const __mmask16 grew = _mm512_cmp_ps_mask(seen_max, _mm512_add_ps(m_old, _mm512_set1_ps(RESCALE)), _CMP_GT_OQ);
  const __m512 m_new = _mm512_mask_mov_ps(m_old, grew, seen_max);
  // where it moved: alpha = exp(m_old - m_new), 0 after -inf; elsewhere 1
  const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grew, exp_small(_mm512_sub_ps(m_old, m_new)));
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  static const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                     7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#endif
#pragma GCC unroll 4
  for (int64_t n = 0; n < KEYS; n += 2) {
    __m512 p[2];
    for (int e = 0; e < 2; ++e)
      p[e] = _mm512_maskz_mov_ps(on[n + e], exp_small(_mm512_sub_ps(_mm512_loadu_ps(&it.st[(n + e) * ROWS + 16 * g]),
                                                                    m_new)));
    sum[n / 2 % 2] = _mm512_add_ps(sum[n / 2 % 2], _mm512_add_ps(p[0], p[1]));
    if (a.f32) {
      _mm512_storeu_ps(&it.st[n * ROWS + 16 * g], p[0]);
      _mm512_storeu_ps(&it.st[(n + 1) * ROWS + 16 * g], p[1]);
      continue;
    }
    // B tile row kk = (n % 32) / 2 of block n / 32: word i = (p[key n][row i], p[key n + 1][row i])
    uint16_t* row = it.pt.data() + (g * 2 + n / 32) * TILE + (n % 32 / 2) * 32;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    _mm512_storeu_si512(row, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0])));
#else
    alignas(64) float pf[2][16];
    _mm512_store_ps(pf[0], p[0]);
    _mm512_store_ps(pf[1], p[1]);
    for (int i = 0; i < 16; ++i) row[2 * i] = bf16_bits(pf[0][i]), row[2 * i + 1] = bf16_bits(pf[1][i]);
#endif
  }
  _mm512_store_ps(it.l + 16 * g, _mm512_fmadd_ps(_mm512_load_ps(it.l + 16 * g), alpha, _mm512_add_ps(sum[0], sum[1])));
  _mm512_store_ps(it.m + 16 * g, m_new);
  if (grew & live)
    for (int64_t d = 0; d < a.D; ++d) {
      float* row = it.acct.data() + d * ROWS + 16 * g;
      _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), alpha));
    }
}
#else
inline void softmax_rows(const Segment& a, Item& it, int64_t g, int64_t nr, uint64_t seen, const int32_t* kq) {
  for (int64_t i = 16 * g; i < 16 * g + 16; ++i) {
    bool on[KEYS];
    float top = NEG_INF;
    for (int64_t n = 0; n < KEYS; ++n) {
      on[n] = i < nr && (seen >> n & 1u) && !(a.causal && kq[n] > it.qpos[i]) &&
              !(a.window && (int64_t)it.qpos[i] - kq[n] >= a.window);
      if (on[n]) top = std::max(top, it.st[n * ROWS + i]);
    }
    const float m_new = top > it.m[i] + RESCALE ? top : it.m[i];
    const float alpha = m_new == it.m[i] ? 1.f : std::exp(it.m[i] - m_new);
    float sum = 0.f;
    for (int64_t n = 0; n < KEYS; ++n) {
      const float p = on[n] ? std::exp(it.st[n * ROWS + i] - m_new) : 0.f;
      sum += p;
      if (a.f32)
        it.st[n * ROWS + i] = p;
      else
        it.pt[(i / 16 * 2 + n / 32) * TILE + (n % 32 / 2) * 32 + (i % 16) * 2 + n % 2] = bf16_bits(p);
    }
    it.l[i] = it.l[i] * alpha + sum;
    it.m[i] = m_new;
    if (alpha != 1.f)
      for (int64_t d = 0; d < a.D; ++d) it.acct[d * ROWS + i] *= alpha;
  }
}
#endif

#if defined(__AVX512F__)
// The item's accumulator rows r0 + [0, nr) of (b, h) transposed into acc^T (zeros past nr, or all when fresh), 16
// rows by 16 channels at a time in registers.
void acc_rows_in(const Segment& a, Item& it, int64_t b, int64_t h, int64_t r0, int64_t nr) {
  const int64_t D = a.D;
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t c = 0; c < D / 16; ++c) {
      __m512i r[16];  // r[n]: row 16 g + n's channels 16 c..; transposed, r[dd]: channel 16 c + dd of the rows
      for (int64_t n = 0; n < 16; ++n)
        r[n] = 16 * g + n < nr && !a.fresh ? _mm512_loadu_si512(a.acc + a.row(b, h, r0 + 16 * g + n) * D + 16 * c)
                                           : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t dd = 0; dd < 16; ++dd) _mm512_storeu_si512(&it.acct[(16 * c + dd) * ROWS + 16 * g], r[dd]);
    }
}
#endif

// The item's rows r0 + [0, nr) of (b, h) into its working set: their queries scaled and rounded to bfloat16
// (row-major for the scalar dots, B tiles for AMX; zero past nr), or with f32 transposed in float32, and their
// accumulators transposed.
void load_rows(const Segment& a, Item& it, int64_t b, int64_t h, int64_t r0, int64_t nr) {
  const int64_t D = a.D;
  alignas(64) float qf[32];
  if (VECTOR_PACK && a.amx) {
#if KIVI_AMX && defined(__AVX512BF16__)
    for (int64_t g = 0; g < 2; ++g) {
      for (int64_t c = 0; c < D / 32; ++c) {
        __m512i r[16];  // r[n]: row 16 g + n's channel pairs of block c; transposed, r[kk]: pair kk of the 16 rows
        for (int64_t n = 0; n < 16; ++n) {
          if (16 * g + n >= nr) {
            r[n] = _mm512_setzero_si512();
            continue;
          }
          a.query(b, h, r0 + 16 * g + n, 32 * c, qf);
          r[n] = bf16_pairs(qf);
        }
        transpose16(r);
        for (int64_t kk = 0; kk < 16; ++kk)
          _mm512_storeu_si512(it.qt.data() + (g * (D / 32) + c) * TILE + kk * 32, r[kk]);
      }
    }
    acc_rows_in(a, it, b, h, r0, nr);
#endif
    return;
  }
#if defined(__AVX512F__)
  if (a.f32) {  // Q^T, 16 rows by 16 channels at a time transposed in registers
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t c = 0; c < D / 16; ++c) {
        __m512i r[16];  // r[n]: row 16 g + n's channels 16 c..; transposed, r[dd]: channel 16 c + dd of the rows
        for (int64_t n = 0; n < 16; ++n) {
          if (16 * g + n >= nr) {
            r[n] = _mm512_setzero_si512();
            continue;
          }
          const int64_t at = a.row(b, h, r0 + 16 * g + n) * D + 16 * c;
          const __m512 x = a.q_bf16 ? bf16_load(static_cast<const uint16_t*>(a.q) + at)
                                    : _mm512_loadu_ps(static_cast<const float*>(a.q) + at);
          r[n] = _mm512_castps_si512(_mm512_mul_ps(x, scale));
        }
        transpose16(r);
        for (int64_t dd = 0; dd < 16; ++dd) _mm512_storeu_si512(&it.qtf[(16 * c + dd) * ROWS + 16 * g], r[dd]);
      }
    acc_rows_in(a, it, b, h, r0, nr);
    return;
  }
#endif
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      if (i < nr) a.query(b, h, r0 + i, d0, qf);
      for (int64_t d = d0; d < d0 + 32; ++d) {
        if (a.f32) {
          it.qtf[d * ROWS + i] = i < nr ? qf[d - d0] : 0.f;
        } else {
          const uint16_t x = i < nr ? bf16_bits(qf[d - d0]) : 0;
          it.qb[i * D + d] = x;
          it.qt[((i / 16) * (D / 32) + d / 32) * TILE + (d % 32 / 2) * 32 + (i % 16) * 2 + d % 2] = x;
        }
        it.acct[d * ROWS + i] = i < nr && !a.fresh ? a.acc[a.row(b, h, r0 + i) * D + d] : 0.f;
      }
    }
}

// The item's rows back: accumulators (normalized with `finish`), references and sums.
void store_rows(const Segment& a, Item& it, int64_t b, int64_t h, int64_t r0, int64_t nr) {
  const int64_t D = a.D;
  for (int64_t i = 0; i < nr; ++i) {
    a.m[a.row(b, h, r0 + i)] = it.m[i];
    a.l[a.row(b, h, r0 + i)] = it.l[i];
  }
  if (a.finish) {  // acc / l, as attention.Softmax.result (a row that saw nothing: l = 0, acc = 0, out 0)
    alignas(64) float inv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) inv[i] = it.l[i] > 0.f ? 1.f / it.l[i] : 1.f;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < ROWS; ++i) it.acct[d * ROWS + i] *= inv[i];
  }
#if defined(__AVX512F__)
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t c = 0; c < D / 16; ++c) {
      __m512i r[16];  // r[dd]: channel 16 c + dd of rows 16 g..; transposed, r[n]: row 16 g + n's channels
      for (int64_t dd = 0; dd < 16; ++dd) r[dd] = _mm512_loadu_si512(&it.acct[(16 * c + dd) * ROWS + 16 * g]);
      transpose16(r);
      for (int64_t n = 0; n < 16 && 16 * g + n < nr; ++n)
        _mm512_storeu_si512(a.acc + a.row(b, h, r0 + 16 * g + n) * D + 16 * c, r[n]);
    }
#else
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t d = 0; d < D; ++d) a.acc[a.row(b, h, r0 + i) * D + d] = it.acct[d * ROWS + i];
#endif
}

// One work item: rows [r0, r0 + 32) of (b, h).
void run_item(const Segment& a, int64_t b, int64_t h, int64_t r0) {
  const int64_t D = a.D, bh = b * a.H + h, nr = std::min(ROWS, a.R - r0);
  thread_local Item it(D);  // reused by this thread's items (sized for the largest head_dim seen)
  if ((int64_t)it.acct.size() < D * ROWS) it = Item(D);
  int32_t qlo = std::numeric_limits<int32_t>::max(), qhi = std::numeric_limits<int32_t>::min();
  for (int64_t i = 0; i < ROWS; ++i) {
    const int64_t row = i < nr ? a.row(b, h, r0 + i) : 0;
    it.m[i] = i < nr && !a.fresh ? a.m[row] : NEG_INF;
    it.l[i] = i < nr && !a.fresh ? a.l[row] : 0.f;
    it.qpos[i] = i < nr ? a.q_pos[b * a.Tq + (r0 + i) / a.n_rep] : 0;
    if (i >= nr) continue;
    qlo = std::min(qlo, it.qpos[i]);
    qhi = std::max(qhi, it.qpos[i]);
  }
  // no step seen by any row (rows of padding, at position -1): from nothing seen, the rows come out as they start
  const auto runs = [&](int64_t s) {
    const uint64_t ok = a.ok_bits[b * a.steps + s];
    return ok && !(a.causal && a.lo[b * a.steps + s] > qhi) &&
           !(a.window && (int64_t)qlo - a.hi[b * a.steps + s] >= a.window);
  };
  bool any = false;
  for (int64_t s = 0; s < a.steps && !any; ++s) any = runs(s);
  if (!any && a.fresh) {
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t row = a.row(b, h, r0 + i);
      a.m[row] = NEG_INF, a.l[row] = 0.f;
      std::memset(a.acc + row * D, 0, D * sizeof(float));
    }
    return;
  }
  load_rows(a, it, b, h, r0, nr);
  const uint16_t* kp = a.f32 ? nullptr : a.kp + bh * a.packed();
  const uint16_t* vt = a.f32 ? nullptr : a.vt + bh * a.packed();
  const float* kf = a.f32 ? a.kf + bh * a.packed() : nullptr;
  const float* vtf = a.f32 ? a.vtf + bh * a.packed() : nullptr;
  const int32_t* kpos = a.k_pos + b * a.T;
#if KIVI_AMX
  if (a.amx) load_square_tiles();
#endif
  for (int64_t s = 0; s < a.steps; ++s) {
    // skipped: no key ok, every key after every row, or every key out of every window
    if (!runs(s)) continue;
    const uint64_t ok = a.ok_bits[b * a.steps + s];
    if (a.f32)
      scores_f32(a, it, kf, s, it.st.data());
#if KIVI_AMX
    else if (a.amx)
      scores_amx(a, it, kp, s, it.st.data());
#endif
    else
      scores_scalar(a, it, kp, s, it.st.data());
    int32_t kq[KEYS];  // the step's key positions (past T: never ok)
    for (int64_t n = 0; n < KEYS; ++n) kq[n] = s * KEYS + n < a.T ? kpos[s * KEYS + n] : 0;
    softmax_rows(a, it, 0, nr, ok, kq);
    softmax_rows(a, it, 1, nr, ok, kq);
    if (a.f32)
      values_f32(a, it, vtf, s);
#if KIVI_AMX
    else if (a.amx)
      values_amx(a, it, vt, s);
#endif
    else
      values_scalar(a, it, vt, s);
  }
#if KIVI_AMX
  if (a.amx) _tile_release();
#endif
  store_rows(a, it, b, h, r0, nr);
}

ffi::Error ChunkAttendImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> q_pos,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> k_pos,
                           ffi::Buffer<ffi::S32> k_ok, ffi::Buffer<ffi::U8> k_codes, ffi::AnyBuffer k_scale,
                           ffi::AnyBuffer k_mn, ffi::Buffer<ffi::U8> v_codes, ffi::AnyBuffer v_scale,
                           ffi::AnyBuffer v_mn, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> store_end,
                           ffi::Buffer<ffi::F32> m_in, ffi::Buffer<ffi::F32> l_in, ffi::Buffer<ffi::F32> acc_in,
                           ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> l_out,
                           ffi::ResultBuffer<ffi::F32> acc_out, int64_t window, int64_t causal, int64_t amx,
                           float scale, int64_t kv_tokens_first, int64_t k_bits, int64_t v_bits, int64_t k_group,
                           int64_t v_group, int64_t store_begin, int64_t fresh, int64_t finish, int64_t f32) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("chunk_attend: q, k must be 4-d");
  if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("chunk_attend: q must be float32 or bfloat16");
  Segment a;
  a.B = qd[0], a.Tq = qd[1], a.Hq = qd[2], a.D = qd[3];
  a.kv_tokens_first = kv_tokens_first != 0;
  a.H = a.kv_tokens_first ? kd[2] : kd[1], a.Td = a.kv_tokens_first ? kd[1] : kd[2];
  if (kd[0] != a.B || kd[3] != a.D || a.H < 1 || a.Hq % a.H || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("chunk_attend: k, v must be [B, H, T, D] (or [B, T, H, D]) of q's B and D, "
                                       "H dividing q's heads");
  a.n_rep = a.Hq / a.H, a.R = a.Tq * a.n_rep;
  if (a.D % 32 != 0 || a.D > 256)
    return ffi::Error::InvalidArgument("chunk_attend: head_dim must be a multiple of 32, at most 256");
  if (q_pos.element_count() != (size_t)(a.B * a.Tq) || k_pos.element_count() != (size_t)(a.B * a.Td) ||
      k_ok.element_count() != (size_t)(a.B * a.Td))
    return ffi::Error::InvalidArgument("chunk_attend: q_pos [B, Tq], k_pos and k_ok [B, T]");
  // the store: codes [L, B, H, Tc, D bits / 8] (Tc = 0: none), its tokens [store_begin, store_end[b]) ok
  auto cd = k_codes.dimensions();
  Store& st = a.store;
  if (cd.size() != 5 || v_codes.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("chunk_attend: store codes must be [L, B, H, T, bytes]");
  st.Tc = cd[3];
  if (st.Tc > 0) {
    if ((k_bits != 2 && k_bits != 4 && k_bits != 8) || (v_bits != 2 && v_bits != 4 && v_bits != 8) || k_group < 1 ||
        st.Tc % k_group || v_group < 1 || a.D % v_group)
      return ffi::Error::InvalidArgument("chunk_attend: store bits must be 2, 4 or 8; groups must divide T and D");
    auto vd = v_codes.dimensions();
    if (cd[1] != a.B || cd[2] != a.H || cd[4] != a.D * k_bits / 8 || vd[0] != cd[0] || vd[1] != a.B ||
        vd[2] != a.H || vd[3] != st.Tc || vd[4] != a.D * v_bits / 8 ||
        k_scale.element_count() != (size_t)(cd[0] * a.B * a.H * st.Tc / k_group * a.D) ||
        k_mn.element_count() != k_scale.element_count() ||
        v_scale.element_count() != (size_t)(cd[0] * a.B * a.H * st.Tc * (a.D / v_group)) ||
        v_mn.element_count() != v_scale.element_count() || store_end.element_count() != (size_t)a.B)
      return ffi::Error::InvalidArgument("chunk_attend: the store's codes, scales, mins and ends disagree with q, k");
    const auto et = k_scale.element_type();
    if (et != k_mn.element_type() || et != v_scale.element_type() || et != v_mn.element_type())
      return ffi::Error::InvalidArgument("chunk_attend: the store's scales and mins must share one dtype");
    if (!scale_type(et, st.st))
      return ffi::Error::InvalidArgument("chunk_attend: store scales must be float16, bfloat16 or float32");
    st.kc = k_codes.typed_data(), st.vc = v_codes.typed_data();
    st.ks = k_scale.untyped_data(), st.km = k_mn.untyped_data();
    st.vs = v_scale.untyped_data(), st.vm = v_mn.untyped_data();
    st.k_bits = (int)k_bits, st.v_bits = (int)v_bits, st.k_group = k_group, st.v_group = v_group;
    st.B = a.B, st.H = a.H, st.D = a.D;
    st.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), cd[0] - 1);
    for (int64_t b = 0; b < a.B; ++b) a.S = std::max<int64_t>(a.S, std::min<int64_t>(store_end.typed_data()[b], st.Tc));
  }
  a.T = a.S + a.Td;
  a.fresh = fresh != 0, a.finish = finish != 0;
  if (m_out->element_count() != (size_t)(a.B * a.Tq * a.Hq) || l_out->element_count() != m_out->element_count() ||
      acc_out->element_count() != q.element_count() ||
      (!a.fresh && (m_in.element_count() != m_out->element_count() || l_in.element_count() != m_out->element_count() ||
                    acc_in.element_count() != q.element_count())))
    return ffi::Error::InvalidArgument("chunk_attend: m, l [B, Tq, Hq] and acc [B, Tq, Hq, D] (in unless fresh)");
  a.scale = scale;
  a.q_bf16 = q.element_type() == ffi::DataType::BF16;
  a.steps = (a.T + KEYS - 1) / KEYS;
  a.window = window > 0 ? window : 0;
  a.causal = causal != 0;
  a.f32 = f32 != 0;
#if KIVI_AMX
  a.amx = amx != 0 && !a.f32 && amx_allowed();
#else
  a.amx = false;
#endif
  a.q = q.untyped_data(), a.k = k.typed_data(), a.v = v.typed_data();
  a.q_pos = q_pos.typed_data(), a.k_pos = k_pos.typed_data(), a.k_ok = k_ok.typed_data();
  std::vector<int32_t> all_pos, all_ok;  // the key axis's with a store: its tokens' (at their index), then k_pos, k_ok
  if (a.S > 0) {
    all_pos.resize(a.B * a.T);
    all_ok.resize(a.B * a.T);
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t end = std::min<int64_t>(store_end.typed_data()[b], a.S);
      for (int64_t t = 0; t < a.S; ++t) {
        all_pos[b * a.T + t] = (int32_t)t;
        all_ok[b * a.T + t] = t >= store_begin && t < end;
      }
      std::memcpy(&all_pos[b * a.T + a.S], a.k_pos + b * a.Td, a.Td * 4);
      std::memcpy(&all_ok[b * a.T + a.S], a.k_ok + b * a.Td, a.Td * 4);
    }
    a.k_pos = all_pos.data(), a.k_ok = all_ok.data();
  }
  a.m = m_out->typed_data(), a.l = l_out->typed_data(), a.acc = acc_out->typed_data();
  if (!a.fresh && a.m != m_in.typed_data()) std::memcpy(a.m, m_in.typed_data(), m_in.size_bytes());
  if (!a.fresh && a.l != l_in.typed_data()) std::memcpy(a.l, l_in.typed_data(), l_in.size_bytes());
  if (!a.fresh && a.acc != acc_in.typed_data()) std::memcpy(a.acc, acc_in.typed_data(), acc_in.size_bytes());
  // packed keys and values: this thread's buffers, kept between calls (a fresh one costs its page faults), every
  // word of a step that has ok keys written by `pack` (`run_item` reads no other)
  thread_local line_vector<uint16_t> kp, vt;
  thread_local line_vector<float> kf, vtf;
  const size_t packed = a.B * a.H * a.packed();
  if (a.f32 && kf.size() < packed) kf.resize(packed), vtf.resize(packed);
  if (!a.f32 && kp.size() < packed) kp.resize(packed), vt.resize(packed);
  a.kp = kp.data(), a.vt = vt.data(), a.kf = kf.data(), a.vtf = vtf.data();
  a.ok_bits.assign(a.B * a.steps, 0);
  a.lo.assign(a.B * a.steps, 0);
  a.hi.assign(a.B * a.steps, 0);
  for (int64_t b = 0; b < a.B; ++b) key_steps(a, b);
  parallel_for(pool, a.B * a.H, [&](int64_t bh) { a.f32 ? pack_f32(a, bh) : pack(a, bh); });  // ok steps only
  const int64_t tiles = (a.R + ROWS - 1) / ROWS;
  parallel_for(pool, a.B * a.H * tiles, [&](int64_t i) {
    const int64_t bh = i / tiles;
    run_item(a, bh / a.H, bh % a.H, i % tiles * ROWS);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxChunkAttend, ChunkAttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [B, Tq, Hq, D] float32 or bfloat16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos [B, Tq]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [B, H, T, D] (or [B, T, H, D])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v, as k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // k_pos [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // k_ok [B, T]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // store key codes [L, B, H, Tc, D k_bits / 8]
                                  .Arg<ffi::AnyBuffer>()         // key scales [L, B, H, Tc / k_group, D]
                                  .Arg<ffi::AnyBuffer>()         // key mins
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value codes [L, B, H, Tc, D v_bits / 8]
                                  .Arg<ffi::AnyBuffer>()         // value scales [L, B, H, Tc, D / v_group]
                                  .Arg<ffi::AnyBuffer>()         // value mins
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // store_end [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m [B, Tq, Hq] (empty when fresh)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // l [B, Tq, Hq]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // acc [B, Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m (aliases the input unless fresh)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Ret<ffi::Buffer<ffi::F32>>()  // acc (normalized with finish)
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("amx")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("kv_tokens_first")
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("v_bits")
                                  .Attr<int64_t>("k_group")
                                  .Attr<int64_t>("v_group")
                                  .Attr<int64_t>("store_begin")
                                  .Attr<int64_t>("fresh")
                                  .Attr<int64_t>("finish")
                                  .Attr<int64_t>("f32"));
