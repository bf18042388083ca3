// Decode attention on the CPU over the KIVI cache and the full-precision cache, as XLA FFI handlers.
//
// The contract is kivi_jax.attention.decode_kivi_xla / decode_full_xla (docs/design.md §2-§3, docs/kernels.md "CPU
// kernel"): one query token a sequence, the stacked [layers, ...] stores read in place at the layer index (the KIVI
// stores through a block table: a paged cache's pool of T-token pages, or a contiguous store as B pages of all its
// tokens), per-sequence lengths, GQA (the query heads of a kv head share one pass over its codes), the sliding
// window, the ring, the new token; scales and mins folded (keys: q·k = Σ_d (q_d s_gd) c_td + Σ_d q_d m_gd; values:
// Σ_t p_t v_td = Σ_t (p_t s_tg) c_td + Σ_t p_t m_tg; with a codebook, c is the level the code stands for); float32 in
// and out (the KIVI ring may be stored in float16 or bfloat16: its rows are widened to float32 as read), online
// softmax in float32.
//
// SIMD: GCC/Clang vector extensions, 16 floats a vector (one AVX-512 register; two AVX2 registers; portable code on
// anything else), channels in lanes. Threads: work items (batch, kv head, query-row block, token split) shared out
// through XLA's intra-op thread pool (the FFI ThreadPool), the calling thread working too; a combine merges the
// partial softmaxes with the new token.

#include "simd.h"

namespace {

constexpr int MAX_ROWS = 4;    // query rows a work item holds (n_rep is split into blocks of at most this)
constexpr int MAX_CHUNK = 128;  // tokens scored at once (whole key groups; ring and full-precision chunks)



// ---------------------------------------------------------------------------------------------------------------------
// Online softmax over one chunk of scores, for NR query rows; values are added by the caller with the returned p.

template <int NR, int D>
struct Rows {
  float m[NR], l[NR];
  vf acc[NR][D / W];

  void init() {
    for (int r = 0; r < NR; ++r) {
      m[r] = NEG_INF;
      l[r] = 0.0f;
      for (int k = 0; k < D / W; ++k) acc[r][k] = vf{};
    }
  }

  // scores[r][0, n) -> p[r][0, n) (0 past n, up to a multiple of W); rescales acc and l by the new max.
  void update(float (*scores)[MAX_CHUNK], float (*p)[MAX_CHUNK], int n) {
    const int nv = (n + W - 1) / W;
    for (int r = 0; r < NR; ++r) {
      for (int i = n; i < nv * W; ++i) scores[r][i] = NEG_INF;
      vf mx = vsplat(NEG_INF);
      for (int j = 0; j < nv; ++j) {
        vf s = vload(scores[r] + j * W);
        mx = s > mx ? s : mx;
      }
      float m_new = std::max(m[r], hmax(mx));
      float alpha = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - m_new);
      vf sum{};
      for (int j = 0; j < nv; ++j) {
        vf s = vload(scores[r] + j * W);
        vf e = vexp(s - m_new);
        e = s == NEG_INF ? vf{} : e;
        sum += e;
        vstore(p[r] + j * W, e);
      }
      l[r] = l[r] * alpha + hsum(sum);
      m[r] = m_new;
      for (int k = 0; k < D / W; ++k) acc[r][k] *= alpha;
    }
  }

  void store(float* part, int n_rep_block) const {  // part: [rows][D + 2] as (m, l, acc)
    for (int r = 0; r < n_rep_block && r < NR; ++r) {
      float* o = part + r * (D + 2);
      o[0] = m[r];
      o[1] = l[r];
      for (int k = 0; k < D / W; ++k) vstore(o + 2 + k * W, acc[r][k]);
    }
  }
};

// One layer of one (batch, kv head): pointers already offset.
struct Head {
  const float* q;  // [rows, D], scaled by 1/sqrt(D)
  int rows;
  int64_t length;
  int64_t lo;  // first visible token (sliding window), else 0
};

// ---------------------------------------------------------------------------------------------------------------------
// KIVI

// One page of the stores: one layer and kv head of a T-token block's codes, scales and mins.
struct Page {
  const uint8_t *kc, *vc;
  const void *ks, *km, *vs, *vm;
};

struct KiviArgs {
  int64_t B, H, n_rep, D, T, R, L, layer;  // T: token rows a page
  int64_t NP;                              // pages in the pool (a contiguous store: B pages of all its tokens)
  int kbits, vbits, gk, gv;
  int64_t window;  // 0: none
  ScaleType st;
  const float* q;
  const uint8_t *kc, *vc;
  const void *ks, *km, *vs, *vm;
  const void *kr, *vr;  // rings [L, B, H, R, D] of type krt / vrt (float32, float16 or bfloat16), read as float32
  ScaleType krt = F32, vrt = F32;
  const float *k_sink, *v_sink;  // [L, B, H, S, D]: tokens [0, S) in full precision (S = 0: none)
  int64_t S;
  const float* rope;  // pre-RoPE keys: [tokens, D] per position, cos of the D/2 angles then their sin; else null
  const float *k_levels, *v_levels;  // non-uniform codes: the level code c stands for (codebook), else null
  int k_nlevels, v_nlevels;
  int q8 = 0;  // 2-bit dots in integers where the CPU can (`Q8`): `key_scores_q8`, `value_sums_q8`
  const int32_t* length;
  int64_t splits;
  // Block table [B, pages_per_seq]: sequence b's token t in page table[b, t / T], row t % T (a contiguous store:
  // table[b, 0] = b). An entry outside [0, NP) holds no page and reads as `zero`, a zeroed page.
  const int32_t* table;
  int64_t pages_per_seq;
  const uint8_t* zero = nullptr;
  int scale_bytes;

  // layer-and-head index of the rings (times R * D: the offset of its first row, in elements)
  int64_t head_index(int64_t b, int64_t h) const { return (layer * B + b) * H + h; }

  // Page `block` of sequence b (tokens [block * T, (block + 1) * T)) at this layer and kv head h.
  Page page(int64_t b, int64_t h, int64_t block) const {
    const int64_t e = block < pages_per_seq ? table[b * pages_per_seq + block] : -1;
    if (e < 0 || e >= NP) return Page{zero, zero, zero, zero, zero, zero};
    const int64_t ph = (layer * NP + e) * H + h;
    const int64_t kso = ph * (T / gk) * D * scale_bytes, vso = ph * T * (D / gv) * scale_bytes;
    auto at = [](const void* base, int64_t bytes) { return static_cast<const uint8_t*>(base) + bytes; };
    return Page{kc + ph * T * (D * kbits / 8), vc + ph * T * (D * vbits / 8), at(ks, kso), at(km, kso), at(vs, vso),
                at(vm, vso)};
  }
};

// Ring row `row` (in rows of D) as D/W float32 vectors (float16 and bfloat16 widen exactly, as the XLA path's
// `astype(float32)`).
template <int D>
__attribute__((always_inline)) inline void ring_vectors(const void* ring, ScaleType t, int64_t row, vf* out) {
  const int64_t i = row * D;
  if (t == F32) {
    for (int k = 0; k < D / W; ++k) out[k] = vload(static_cast<const float*>(ring) + i + k * W);
  } else if (t == F16) {
    for (int k = 0; k < D / W; ++k) out[k] = scales_at<F16>(ring, i + k * W);
  } else {
    for (int k = 0; k < D / W; ++k) out[k] = scales_at<BF16>(ring, i + k * W);
  }
}

// Bytes a row of D codes of BITS bits packs into (3 bits: a 2-bit plane of D/4 bytes, then a 1-bit plane of D/8).
template <int D, int BITS>
constexpr int row_bytes() { return D * BITS / 8; }

// Lane indices 0, 1, ..., W - 1.
inline vi lane_iota() {
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}

// A 3-bit row (quant.PLANES: the low two bits as 2-bit planar codes, D/4 bytes, then the high bit as 1-bit planar
// codes, D/8 bytes; channel c's high bit is bit c / (D/8) of byte c % (D/8)) -> D/W float vectors of exact codes.
template <int D>
inline void unpack_row3(const uint8_t* row, vf* out) {
  constexpr int WB2 = D / 4, WB1 = D / 8;
  const uint8_t* hi = row + WB2;
  vi low[D / W];
#pragma GCC unroll 8
  for (int c = 0; c < WB2 / W; ++c) {
    vi bytes = widen(row + c * W);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) low[s * (WB2 / W) + c] = (bytes >> (2 * s)) & 3;
  }
  if constexpr (WB1 % W == 0) {  // a vector's channels share one bit of W consecutive bytes
#pragma GCC unroll 8
    for (int c = 0; c < WB1 / W; ++c) {
      vi bytes = widen(hi + c * W);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const int k = s * (WB1 / W) + c;
        out[k] = __builtin_convertvector(low[k] | (((bytes >> s) & 1) << 2), vf);
      }
    }
  } else {  // W / WB1 bits of the same WB1 bytes a vector (AVX-512, D = 64: two bits of 8 bytes)
    static_assert(W % WB1 == 0, "the 1-bit plane's width must divide the vector width");
#if defined(__AVX512F__)
    static_assert(WB1 == 8, "with 16 lanes only head_dim 64 has a narrower 1-bit plane");
    uint64_t eight;
    std::memcpy(&eight, hi, 8);  // the 8 bytes twice in one 16-byte register, widened (no store-to-load round trip)
    const vi bytes = (vi)_mm512_cvtepu8_epi32(_mm_set1_epi64x((long long)eight));
#else
    uint8_t buf[W];
    for (int j = 0; j < W; j += WB1) std::memcpy(buf + j, hi, WB1);
    const vi bytes = widen(buf);
#endif
    const vi slab = lane_iota() / WB1;
#pragma GCC unroll 8
    for (int k = 0; k < D / W; ++k) {
      const vi shift = slab + (k * W) / WB1;
      out[k] = __builtin_convertvector(low[k] | (((bytes >> shift) & 1) << 2), vf);
    }
  }
}

// Unpacks one planar-packed row of D channels (bits each) into D/W float vectors, channel order. `Scaled`: slab s is
// masked in place, not shifted, so its codes come out multiplied by 2^(BITS*s) (exact; callers fold 2^-(BITS*s) into
// the query scales or the accumulator), which saves a shift per vector. 3-bit rows always come out as exact codes.
template <int D, int BITS, bool Scaled = true>
inline void unpack_row(const uint8_t* row, vf* out) {
  if constexpr (BITS == 3) {
    unpack_row3<D>(row, out);
  } else {
    constexpr int P = 8 / BITS, WB = D / P;  // codes a byte, bytes a row (the width of one slab)
    constexpr int32_t MASK = (1 << BITS) - 1;
#pragma GCC unroll 8
    for (int c = 0; c < WB / W; ++c) {
      vi bytes = widen(row + c * W);
#pragma GCC unroll 8
      for (int s = 0; s < P; ++s) {
        vi code = Scaled ? (bytes & (MASK << (BITS * s))) : ((bytes >> (BITS * s)) & MASK);
        out[s * (WB / W) + c] = __builtin_convertvector(code, vf);
      }
    }
  }
}

// 2^-(BITS * slab) of each vector of a row unpacked with Scaled = true (1 for 3-bit rows).
template <int D, int BITS>
inline float slab_unscale(int k) {
  if constexpr (BITS == 3) {
    return 1.0f;
  } else {
    constexpr int P = 8 / BITS, WB = D / P;
    return 1.0f / (float)(1 << (BITS * ((k * W) / WB)));
  }
}

// Exact codes (as floats, 0 .. n-1) -> the levels they stand for in a codebook of n levels, by n - 1 selects.
template <int D>
inline void code_levels(vf* x, const float* levels, int n) {
#pragma GCC unroll 8
  for (int k = 0; k < D / W; ++k) {
    const vf c = x[k];
    vf out = vsplat(levels[0]);
    for (int j = 1; j < n; ++j) out = c >= vsplat((float)j - 0.5f) ? vsplat(levels[j]) : out;
    x[k] = out;
  }
}

// One row of codes as the values they scale: exact codes mapped through the codebook when there is one (`levels`),
// else slab-scaled codes (`unpack_row`'s Scaled, undone by `slab_unscale`).
template <int D, int BITS>
inline void unpack_values(const uint8_t* row, vf* out, const float* levels, int n) {
  if (levels) {
    unpack_row<D, BITS, false>(row, out);
    code_levels<D>(out, levels, n);
  } else {
    unpack_row<D, BITS>(row, out);
  }
}

// RoPE (half-split layout) of one key row of D/W vectors, in place, with the token's table row `cs` (cos of the D/2
// angles, then their sin): [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
template <int D>
inline void rotate_row(vf* x, const float* cs) {
  constexpr int H2 = D / (2 * W);
#pragma GCC unroll 4
  for (int k = 0; k < H2; ++k) {
    const vf c = vload(cs + k * W), s = vload(cs + D / 2 + k * W);
    const vf x1 = x[k], x2 = x[k + H2];
    x[k] = x1 * c - x2 * s;
    x[k + H2] = x2 * c + x1 * s;
  }
}

// Integer dots (`KiviArgs::q8`): AVX-512 BW and VBMI (VNNI when the CPU has it, else VPMADDUBSW + VPMADDWD).
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define KIVI_Q8 1
constexpr bool Q8 = true;

// The key scores of n tokens of one key group (2-bit rows of D channels from `rows`, n <= MAX_CHUNK) for NR query
// rows, written at `off` in each row of `scores`, with the query quantized to int8 (llama.cpp's approach for its
// quantized caches): per row and group the folded query qs = q * scale becomes q8 = rint(qs * 127 / max|qs|), and
// score = max|qs| / 127 * Σ_c q8_c code_c + Σ_c q_c min_c, the integer dot by VPDPBUSD (VPMADDUBSW + VPMADDWD
// without VNNI). The twin is `attention.quantized_scores(..., int8_dots=True)`.
//
// A row's D / 4 bytes hold channel j + s * D / 4 in bits 2s of byte j (slab s), so a 64-byte load of 64 / (D / 4)
// consecutive rows gives, shifted by 2s and masked, slab s's codes of each token in its own D / 4-byte lane: one
// dot with the slab's q8 (repeated in every lane) adds 4 channels a 32-bit lane; 16 tokens' lanes are then summed
// into one vector of 16 scores in token order.
template <int NR, int D>
void key_scores_q8(const float (*q)[D], const float* kscale, const float* kmin, const uint8_t* rows, int n,
                   float (*scores)[MAX_CHUNK], int off) {
  constexpr int RB = D / 4;     // bytes a row
  constexpr int TPZ = 64 / RB;  // tokens a 64-byte register (4 for D = 64, 2 for D = 128)
  constexpr int NZ = 16 / TPZ;  // registers a block of 16 tokens
  __m512i qv[NR][4];            // per row and slab: q8 repeated in every token lane
  float sigma[NR], bias[NR];
  for (int r = 0; r < NR; ++r) {
    vf qs[D / W], amax{}, bsum{};
#pragma GCC unroll 8
    for (int k = 0; k < D / W; ++k) {
      const vf qk = vload(q[r] + k * W);
      qs[k] = qk * vload(kscale + k * W);
      const vf mag = qs[k] < 0 ? -qs[k] : qs[k];
      amax = mag > amax ? mag : amax;
      bsum += qk * vload(kmin + k * W);
    }
    const float m = hmax(amax);
    bias[r] = hsum(bsum);
    sigma[r] = m / 127.0f;
    const vf inv = vsplat(m > 0 ? 127.0f / m : 0.0f);
    alignas(64) int8_t q8[D];
#pragma GCC unroll 8
    for (int k = 0; k < D / W; ++k)  // rounded to nearest, ties to even (the default MXCSR), as jnp.round
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + k * W),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32((__m512)(qs[k] * inv))));
#pragma GCC unroll 4
    for (int sl = 0; sl < 4; ++sl) {
      if constexpr (RB == 16)
        qv[r][sl] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + sl * RB)));
      else
        qv[r][sl] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + sl * RB)));
    }
  }
  const __m512i three = _mm512_set1_epi8(3);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  // lane e * 4 + k of the summed vector holds token 4k + e
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  alignas(64) uint8_t pad[16 * RB];
  for (int i0 = 0; i0 < n; i0 += 16) {
    const int m = std::min(16, n - i0);
    const uint8_t* src = rows + (int64_t)i0 * RB;
    if (m < 16) {  // the last rows, zero-padded to 16 (never read past the group's own rows)
      std::memset(pad, 0, sizeof(pad));
      std::memcpy(pad, src, (size_t)m * RB);
      src = pad;
    }
    __m512i acc[NR][NZ];
#pragma GCC unroll 8
    for (int z = 0; z < NZ; ++z) {
      const __m512i x = _mm512_loadu_si512(src + z * 64);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][z] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int sl = 0; sl < 4; ++sl) {
        const __m512i c = _mm512_and_si512(sl ? _mm512_srli_epi16(x, 2 * sl) : x, three);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
#if defined(__AVX512VNNI__)
          acc[r][z] = _mm512_dpbusd_epi32(acc[r][z], c, qv[r][sl]);
#else
          acc[r][z] = _mm512_add_epi32(acc[r][z], _mm512_madd_epi16(_mm512_maddubs_epi16(c, qv[r][sl]), ones));
#endif
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      __m512i t4[4];  // tokens 4j .. 4j + 3, one a 128-bit lane of 4 partial sums
      if constexpr (TPZ == 4) {
        for (int j = 0; j < 4; ++j) t4[j] = acc[r][j];
      } else {  // a token spans two 128-bit lanes: fold them, then two registers' tokens into one
        __m512i y[NZ];
        for (int z = 0; z < NZ; ++z)
          y[z] = _mm512_add_epi32(acc[r][z], _mm512_shuffle_i32x4(acc[r][z], acc[r][z], 0xB1));
        for (int j = 0; j < 4; ++j) t4[j] = _mm512_shuffle_i32x4(y[2 * j], y[2 * j + 1], 0x88);
      }
      const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(t4[0], t4[1]), _mm512_unpackhi_epi32(t4[0], t4[1]));
      const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi32(t4[2], t4[3]), _mm512_unpackhi_epi32(t4[2], t4[3]));
      const __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(t, u), _mm512_unpackhi_epi64(t, u));
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(perm, sums));
      _mm512_storeu_ps(scores[r] + off + i0, _mm512_fmadd_ps(dots, _mm512_set1_ps(sigma[r]), _mm512_set1_ps(bias[r])));
    }
  }
}

// Value sums of n tokens (2-bit rows from `rows`, n <= MAX_CHUNK) for NR rows with 8-bit weights, the tokens in runs
// (key groups) [runs[u], runs[u + 1]) for u < n_runs: per row, value group and run the weights w = p * scale (`ps`,
// [group][token]) become w8 = rint(w * 255 / max w), and `acc` (slab-scaled sums, as `kivi_item` keeps them) gains
// max w / 255 * Σ_t w8_t code_t. The twin is `attention.quantized_values(..., int8_chunk=G)`.
//
// Four rows' bytes are transposed (VPERMB) so that each 32-bit lane holds one byte position of 4 consecutive tokens:
// shifted by 2s and masked, one VPDPBUSD with the 4 tokens' weights (the same 4 bytes in every lane) adds 4 tokens to
// 16 channels of slab s.
template <int NR, int D, int NGV>
void value_sums_q8(const float (*ps)[MAX_CHUNK * (D / 16)], const uint8_t* rows, int n, const int* runs, int n_runs,
                   vf (*acc)[D / W], const float* vunscale) {
  constexpr int RB = D / 4;    // bytes a row
  constexpr int NO = RB / 16;  // transposed registers per 4 tokens (1 for D = 64, 2 for D = 128)
  constexpr int NK = D / 16;   // 16-channel vectors, NK / NGV of them a value group
  constexpr auto group = [](int k) { return k * NGV / NK; };
  struct Transpose {  // output byte 4j + k of register o: token k's byte 16o + j (of 4 * RB bytes)
    alignas(64) uint8_t idx[NO][64];
    Transpose() {
      for (int o = 0; o < NO; ++o)
        for (int j = 0; j < 16; ++j)
          for (int k = 0; k < 4; ++k) idx[o][4 * j + k] = (uint8_t)(k * RB + 16 * o + j);
    }
  };
  static const Transpose transpose;
  __m512i perm[NO];
  for (int o = 0; o < NO; ++o) perm[o] = _mm512_load_si512(transpose.idx[o]);
  const __m512i three = _mm512_set1_epi8(3);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  alignas(64) uint8_t w8[NR][NGV][MAX_CHUNK + 4];
  alignas(64) uint8_t pad[4 * RB];
  for (int u = 0; u < n_runs; ++u) {
    const int u0 = runs[u], u1 = runs[u + 1];
    float wsc[NR][NGV];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NGV; ++j) {
        const float* w = ps[r] + j * MAX_CHUNK;
        __m512 mx = _mm512_setzero_ps();
        for (int i = u0; i < u1; i += 16) {
          const __mmask16 live = (__mmask16)((1u << std::min(16, u1 - i)) - 1);
          mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(live, w + i));
        }
        const float m = _mm512_reduce_max_ps(mx);
        wsc[r][j] = m / 255.0f;
        const __m512 inv = _mm512_set1_ps(m > 0 ? 255.0f / m : 0.0f);
        for (int i = u0; i < u1; i += 16) {  // rounded to nearest, ties to even, as jnp.round
          const __mmask16 live = (__mmask16)((1u << std::min(16, u1 - i)) - 1);
          const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, w + i), inv));
          _mm_mask_storeu_epi8(w8[r][j] + i, live, _mm512_cvtusepi32_epi8(c));
        }
      }
    __m512i sums[NR][NK];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < NK; ++k) sums[r][k] = _mm512_setzero_si512();
    for (int i0 = u0; i0 < u1; i0 += 4) {
      const uint8_t* src = rows + (int64_t)i0 * RB;
      if (n - i0 < 4) {  // the chunk's last rows, zero-padded to 4 (never read past its own rows)
        std::memset(pad, 0, sizeof(pad));
        std::memcpy(pad, src, (size_t)(n - i0) * RB);
        src = pad;
      }
      const uint32_t keep = u1 - i0 >= 4 ? 0xFFFFFFFFu : (1u << (8 * (u1 - i0))) - 1;  // this run's tokens only
      __m512i x[NO];
      if constexpr (NO == 1) {
        x[0] = _mm512_permutexvar_epi8(perm[0], _mm512_loadu_si512(src));
      } else {
        const __m512i lo = _mm512_loadu_si512(src), hi = _mm512_loadu_si512(src + 64);
        for (int o = 0; o < NO; ++o) x[o] = _mm512_permutex2var_epi8(lo, perm[o], hi);
      }
      __m512i wb[NR][NGV];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < NGV; ++j) {
          uint32_t four;
          std::memcpy(&four, w8[r][j] + i0, 4);
          wb[r][j] = _mm512_set1_epi32((int)(four & keep));
        }
#pragma GCC unroll 4
      for (int sl = 0; sl < 4; ++sl) {
#pragma GCC unroll 2
        for (int o = 0; o < NO; ++o) {
          const __m512i c = _mm512_and_si512(sl ? _mm512_srli_epi16(x[o], 2 * sl) : x[o], three);
          const int k = sl * NO + o;  // channels 16k .. 16k + 15
#pragma GCC unroll 4
          for (int r = 0; r < NR; ++r) {
#if defined(__AVX512VNNI__)
            sums[r][k] = _mm512_dpbusd_epi32(sums[r][k], wb[r][group(k)], c);
#else
            sums[r][k] = _mm512_add_epi32(sums[r][k],
                                          _mm512_madd_epi16(_mm512_maddubs_epi16(wb[r][group(k)], c), ones));
#endif
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < NK; ++k)  // acc is slab-scaled (undone by vunscale at the end): scale these sums up to it
        acc[r][k] += (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][k]), _mm512_set1_ps(wsc[r][group(k)] / vunscale[k]));
  }
}
#else
constexpr bool Q8 = false;
#endif

template <int NR, int D, int KB, int VB>
void kivi_item(const KiviArgs& a, int64_t b, int64_t h, int r0, int64_t split, float* part) {
  constexpr int RBK = row_bytes<D, KB>(), RBV = row_bytes<D, VB>();
  const int64_t hi = a.head_index(b, h);
  const int64_t length = a.length[b];
  const int64_t R = a.R, gk = a.gk, gv = a.gv;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(length - a.window + 1, 0) : 0;
  const int64_t main_end = std::max<int64_t>(length - R, 0);  // keys and values both quantized below this
  const int64_t k_end = (length / R) * R;                     // keys quantized below this
  const int nr = std::min<int>(NR, a.n_rep - r0);

  const int64_t T = a.T, gpp = T / gk;  // token rows and key groups a page

  float q[NR][D];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < D; ++d)
      q[r][d] = r < nr ? a.q[((b * a.H + h) * a.n_rep + r0 + r) * D + d] : 0.0f;

  Rows<NR, D> st;
  st.init();
  alignas(64) float scores[NR][MAX_CHUNK];
  alignas(64) float p[NR][MAX_CHUNK];
  alignas(64) float qs[NR][D];
  float bias[NR];
  alignas(64) float kscale[D], kmin[D];
  int vgroup[D / W];  // value channel group of each vector
  for (int k = 0; k < D / W; ++k) vgroup[k] = (k * W) / gv;
  const int ngv = D / gv;

  // Main segment: this split's share of the key groups covering [max(lo, S), main_end) (the sinks hold [0, S)).
  const int64_t lo_q = std::max<int64_t>(lo, a.S);
  const int64_t first = lo_q / gk, last = (main_end + gk - 1) / gk;
  const int64_t n_groups = std::max<int64_t>(last - first, 0);
  const int64_t per = (n_groups + a.splits - 1) / a.splits;
  const int64_t g_begin = first + split * per, g_end = std::min(first + (split + 1) * per, last);
  vf codes[D / W];
  alignas(64) vf partial[NR][W];  // per-token partial dot vectors of one W-token block, reduced together
  alignas(64) float vsc[MAX_CHUNK * (D / 16)], vmn[MAX_CHUNK * (D / 16)];  // the chunk's value scales and mins
  alignas(64) float ps[NR][MAX_CHUNK * (D / 16)];  // p * value scale
  float kunscale[D / W], vunscale[D / W];
  for (int k = 0; k < D / W; ++k) {  // codebooks map exact codes: nothing to unscale
    kunscale[k] = a.k_levels ? 1.0f : slab_unscale<D, KB>(k);
    vunscale[k] = a.v_levels ? 1.0f : slab_unscale<D, VB>(k);
  }
  for (int r = 0; r < NR; ++r)  // acc holds slab-scaled sums (codes unpacked as c * 2^(VB * slab)) until the ring
    for (int k = 0; k < D / W; ++k) st.acc[r][k] = vf{};
  // Chunks of whole key groups inside one page (MAX_CHUNK tokens, fewer at the ends and the page edges): the keys are
  // scored group by group into one row of scores, then the softmax and the values run once over the chunk.
  const int64_t gpc = std::max<int64_t>(MAX_CHUNK / gk, 1);  // key groups a chunk
  int64_t g1 = g_begin;
  for (int64_t g0 = g_begin; g0 < g_end; g0 = g1) {
    g1 = std::min({g0 + gpc, g_end, (g0 / gpp + 1) * gpp});
    const int64_t c_begin = std::max(g0 * gk, lo_q), c_end = std::min(g1 * gk, main_end);
    if (c_end <= c_begin) continue;
    const Page pg = a.page(b, h, g0 / gpp);  // read only for tokens attended
    const int64_t p0 = (g0 / gpp) * T, pg0 = (g0 / gpp) * gpp;  // the page's first token and key group
    const uint8_t *kc = pg.kc, *vc = pg.vc;  // token t's row: t - p0
    int runs[MAX_CHUNK / 32 + 1], n_runs = 0;  // each key group's start in the chunk (G >= 32), then the end
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t_begin = std::max(g * gk, lo_q), t_end = std::min((g + 1) * gk, main_end);
      const int n = (int)(t_end - t_begin);
      if (n <= 0) continue;
      const int off = (int)(t_begin - c_begin);
      runs[n_runs++] = off;
      load_scales(pg.ks, (g - pg0) * D, D, a.st, kscale);
      load_scales(pg.km, (g - pg0) * D, D, a.st, kmin);
      if (a.rope) {  // pre-RoPE keys: dequantize each row, rotate it by its position, dot (no folding into q)
        vf kse[D / W], kmn[D / W];
        for (int k = 0; k < D / W; ++k) {
          kse[k] = vload(kscale + k * W) * kunscale[k];
          kmn[k] = vload(kmin + k * W);
        }
        for (int i0 = 0; i0 < n; i0 += W) {
          const int m = std::min(W, n - i0);
          for (int i = 0; i < m; ++i) {
            const int64_t t = t_begin + i0 + i;
            unpack_values<D, KB>(kc + (t - p0) * RBK, codes, a.k_levels, a.k_nlevels);
#pragma GCC unroll 8
            for (int k = 0; k < D / W; ++k) codes[k] = codes[k] * kse[k] + kmn[k];
            rotate_row<D>(codes, a.rope + t * D);
            for (int r = 0; r < NR; ++r) {
              vf acc = codes[0] * vload(q[r]);
#pragma GCC unroll 8
              for (int k = 1; k < D / W; ++k) acc += codes[k] * vload(q[r] + k * W);
              partial[r][i] = acc;
            }
          }
          for (int r = 0; r < NR; ++r) {
            for (int i = m; i < W; ++i) partial[r][i] = vf{};
            vstore(scores[r] + off + i0, reduce_lanes(partial[r]));
          }
        }
      } else if (Q8 && KB == 2 && a.q8 && !a.k_levels) {
#if defined(KIVI_Q8)
        key_scores_q8<NR, D>(q, kscale, kmin, kc + (t_begin - p0) * RBK, n, scores, off);
#endif
      } else {
        for (int r = 0; r < NR; ++r) {
          vf bsum{};
          for (int k = 0; k < D / W; ++k) {
            vf qv = vload(q[r] + k * W);
            vstore(qs[r] + k * W, qv * vload(kscale + k * W) * kunscale[k]);
            bsum += qv * vload(kmin + k * W);
          }
          bias[r] = hsum(bsum);
        }
        for (int i0 = 0; i0 < n; i0 += W) {
          const int m = std::min(W, n - i0);
          for (int i = 0; i < m; ++i) {
            unpack_values<D, KB>(kc + (t_begin - p0 + i0 + i) * RBK, codes, a.k_levels, a.k_nlevels);
            for (int r = 0; r < NR; ++r) {
              vf acc = codes[0] * vload(qs[r]);
#pragma GCC unroll 8
              for (int k = 1; k < D / W; ++k) acc += codes[k] * vload(qs[r] + k * W);
              partial[r][i] = acc;
            }
          }
          for (int r = 0; r < NR; ++r) {
            for (int i = m; i < W; ++i) partial[r][i] = vf{};
            vstore(scores[r] + off + i0, reduce_lanes(partial[r]) + bias[r]);
          }
        }
      }
    }
    runs[n_runs] = (int)(c_end - c_begin);
    const int64_t t_begin = c_begin;
    const int n = (int)(c_end - c_begin);
    st.update(scores, p, n);
    load_scales(pg.vs, (t_begin - p0) * ngv, n * ngv, a.st, vsc);
    load_scales(pg.vm, (t_begin - p0) * ngv, n * ngv, a.st, vmn);
    // Transposed to [group][token] (zero past n), so p * scale and Σ p * min run over tokens in vectors.
    const int nv = (n + W - 1) / W;
    alignas(64) float vsc_t[D / 16][MAX_CHUNK], vmn_t[D / 16][MAX_CHUNK];
    for (int j = 0; j < ngv; ++j) {
      for (int i = 0; i < n; ++i) {
        vsc_t[j][i] = vsc[i * ngv + j];
        vmn_t[j][i] = vmn[i * ngv + j];
      }
      for (int i = n; i < nv * W; ++i) vsc_t[j][i] = vmn_t[j][i] = 0.0f;
    }
    float mins[NR][D / 16];  // Σ_t p_t m_tg per row and value group
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < ngv; ++j) {
        vf msum{};
        for (int c = 0; c < nv; ++c) {
          vf pv = vload(p[r] + c * W);
          vstore(ps[r] + j * MAX_CHUNK + c * W, pv * vload(vsc_t[j] + c * W));
          msum += pv * vload(vmn_t[j] + c * W);
        }
        mins[r][j] = hsum(msum);
      }
    if (Q8 && VB == 2 && a.q8 && !a.v_levels) {
#if defined(KIVI_Q8)
      const uint8_t* vrows = vc + (t_begin - p0) * RBV;
      if (ngv == 1) value_sums_q8<NR, D, 1>(ps, vrows, n, runs, n_runs, st.acc, vunscale);
      else if (ngv == 2) value_sums_q8<NR, D, 2>(ps, vrows, n, runs, n_runs, st.acc, vunscale);
      else if (ngv == 4) value_sums_q8<NR, D, 4>(ps, vrows, n, runs, n_runs, st.acc, vunscale);
      else  // 16-channel groups
        value_sums_q8<NR, D, D / 16>(ps, vrows, n, runs, n_runs, st.acc, vunscale);
#endif
    } else {
      for (int i = 0; i < n; ++i) {
        unpack_values<D, VB>(vc + (t_begin - p0 + i) * RBV, codes, a.v_levels, a.v_nlevels);
        for (int r = 0; r < NR; ++r) {
          const float* pr = ps[r] + i;
#pragma GCC unroll 8
          for (int k = 0; k < D / W; ++k) st.acc[r][k] += codes[k] * pr[vgroup[k] * MAX_CHUNK];
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < D / W; ++k) st.acc[r][k] += mins[r][vgroup[k]] / vunscale[k];
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < D / W; ++k) st.acc[r][k] *= vunscale[k];

  // Residual segment (the last split): ring slots holding tokens in [max(main_end, lo), length); keys already flushed
  // (token < k_end) come from the last quantized key block, dequantized.
  if (split == a.splits - 1 && length > 0) {
    const int64_t ring0 = hi * R;  // this layer and head's first ring row
    const int64_t flushed_row = std::max<int64_t>(length / R - 1, 0) * R;
    const int64_t last_tok = length - 1;
    const int64_t seg_lo = std::max(main_end, lo_q);
    const int64_t last_slot = last_tok % R;  // slot s holds token last_tok - (last_slot - s) (mod R)
    int64_t flushed_group = -1;  // the key group of the flushed block whose scales and mins are loaded
    for (int64_t c0 = 0; c0 < R; c0 += MAX_CHUNK) {
      const int cn = (int)std::min<int64_t>(MAX_CHUNK, R - c0);
      int slots[MAX_CHUNK];
      int64_t toks[MAX_CHUNK];
      int n = 0;
      for (int s = 0; s < cn; ++s) {
        const int64_t slot = c0 + s;
        const int64_t tok = last_tok - (slot <= last_slot ? last_slot - slot : last_slot - slot + R);
        if (tok >= 0 && tok >= seg_lo) slots[n] = (int)slot, toks[n++] = tok;
      }
      if (n == 0) continue;
      // Keys W tokens at a time: each token's dot with a query row as a vector of partial sums, the W reduced together
      for (int i0 = 0; i0 < n; i0 += W) {
        const int m = std::min(W, n - i0);
        for (int i = 0; i < m; ++i) {
          const int64_t slot = slots[i0 + i], tok = toks[i0 + i];
          vf key[D / W];
          if (tok < k_end) {
            const int64_t row = flushed_row + slot, in = row % T;
            const Page fp = a.page(b, h, row / T);
            if (row / gk != flushed_group) {
              flushed_group = row / gk;
              load_scales(fp.ks, (in / gk) * D, D, a.st, kscale);
              load_scales(fp.km, (in / gk) * D, D, a.st, kmin);
            }
            unpack_row<D, KB, false>(fp.kc + in * RBK, key);
            if (a.k_levels) code_levels<D>(key, a.k_levels, a.k_nlevels);
#pragma GCC unroll 8
            for (int k = 0; k < D / W; ++k) key[k] = key[k] * vload(kscale + k * W) + vload(kmin + k * W);
          } else {
            ring_vectors<D>(a.kr, a.krt, ring0 + slot, key);
          }
          if (a.rope) rotate_row<D>(key, a.rope + tok * D);  // a pre-RoPE key (ring or flushed block)
          for (int r = 0; r < NR; ++r) {
            vf acc{};
#pragma GCC unroll 8
            for (int k = 0; k < D / W; ++k) acc += vload(q[r] + k * W) * key[k];
            partial[r][i] = acc;
          }
        }
        for (int r = 0; r < NR; ++r) {
          for (int i = m; i < W; ++i) partial[r][i] = vf{};
          vstore(scores[r] + i0, reduce_lanes(partial[r]));
        }
      }
      st.update(scores, p, n);
      vf acc[NR][D / W];  // the rows' value sums in registers while the ring's rows are added
      for (int r = 0; r < NR; ++r)
        for (int k = 0; k < D / W; ++k) acc[r][k] = st.acc[r][k];
      for (int i = 0; i < n; ++i) {
        vf v[D / W];
        ring_vectors<D>(a.vr, a.vrt, ring0 + slots[i], v);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          const vf pr = vsplat(p[r][i]);
#pragma GCC unroll 8
          for (int k = 0; k < D / W; ++k) acc[r][k] += v[k] * pr;
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int k = 0; k < D / W; ++k) st.acc[r][k] = acc[r][k];
    }
  }
  st.store(part, nr);
}

// ---------------------------------------------------------------------------------------------------------------------
// Full precision

struct FullArgs {
  int64_t B, H, n_rep, D, T, L, layer;
  int64_t window;
  const float *q, *k, *v;
  // 8-bit caches (EIGHT): codes [L, B, H, T, D] in format `fmt` (widen_bytes), times a float16 scale per token
  // (ks / vs [L, B, H, T], or null: a scale of 1)
  const uint8_t *k8 = nullptr, *v8 = nullptr;
  const uint16_t *ks = nullptr, *vs = nullptr;
  int64_t fmt = 0;
  const int32_t* length;
  int64_t splits;
  int64_t head_index(int64_t b, int64_t h) const { return (layer * B + b) * H + h; }
};

constexpr int FULL_CHUNK = 64;

// W bytes of an 8-bit format (0 int8, 1 float8 e4m3fn, 2 float8 e5m2) as float32 lanes, by integer arithmetic on the
// bits (what jnp.float8_e4m3fn / float8_e5m2 hold): a normal float8 moves its exponent and mantissa into place,
// a subnormal one is its mantissa times the smallest step, e4m3fn's 0x7f / 0xff are NaN, e5m2's top exponent is
// infinity or NaN as in IEEE.
inline vf widen_bytes(const uint8_t* p, int64_t fmt) {
  const vi v = widen(p);  // [0, 255] a lane
  if (fmt == 0) return __builtin_convertvector((v ^ 0x80) - 0x80, vf);  // two's complement
  const int man_bits = fmt == 1 ? 3 : 2, bias = fmt == 1 ? 7 : 15, max_exp = fmt == 1 ? 15 : 31;
  const vi sign = (v & 0x80) << 24, exp = (v >> man_bits) & max_exp, man = v & ((1 << man_bits) - 1);
  vi bits = sign | ((exp + (127 - bias)) << 23) | (man << (23 - man_bits));
  vf sub = __builtin_convertvector(man, vf) * std::ldexp(1.0f, 1 - bias - man_bits);
  vi sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub));
  bits = exp == 0 ? (sub_bits | sign) : bits;
  if (fmt == 1) bits = (exp == max_exp) & (man == 7) ? (sign | 0x7fc00000) : bits;
  else bits = exp == max_exp ? (sign | 0x7f800000 | (man << 21)) : bits;
  vf out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One token's 8-bit row widened to float32: each code's value times the token's scale.
template <int D>
inline const float* widen8(const uint8_t* codes, const uint16_t* scale, int64_t fmt, float* row) {
  const float s = scale ? half_to_float(*scale) : 1.0f;
  for (int k = 0; k < D / W; ++k) vstore(row + k * W, widen_bytes(codes + k * W, fmt) * s);
  return row;
}

template <int NR, int D, bool EIGHT>
void full_item(const FullArgs& a, int64_t b, int64_t h, int r0, int64_t split, float* part) {
  const int64_t hi = a.head_index(b, h);
  const int64_t length = a.length[b];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(length - a.window + 1, 0) : 0;
  const int nr = std::min<int>(NR, a.n_rep - r0);
  const float* kp = EIGHT ? nullptr : a.k + hi * a.T * D;
  const float* vp = EIGHT ? nullptr : a.v + hi * a.T * D;
  alignas(64) float row[D];
  auto key_row = [&](int64_t t) {
    if constexpr (EIGHT) return widen8<D>(a.k8 + (hi * a.T + t) * D, a.ks ? a.ks + hi * a.T + t : nullptr, a.fmt, row);
    return kp + t * D;
  };
  auto value_row = [&](int64_t t) {
    if constexpr (EIGHT) return widen8<D>(a.v8 + (hi * a.T + t) * D, a.vs ? a.vs + hi * a.T + t : nullptr, a.fmt, row);
    return vp + t * D;
  };
  float q[NR][D];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < D; ++d)
      q[r][d] = r < nr ? a.q[((b * a.H + h) * a.n_rep + r0 + r) * D + d] : 0.0f;
  Rows<NR, D> st;
  st.init();
  alignas(64) float scores[NR][MAX_CHUNK];
  alignas(64) float p[NR][MAX_CHUNK];
  alignas(64) vf partial[NR][W];
  const int64_t first = lo / FULL_CHUNK, last = (length + FULL_CHUNK - 1) / FULL_CHUNK;
  const int64_t n_chunks = std::max<int64_t>(last - first, 0);
  const int64_t per = (n_chunks + a.splits - 1) / a.splits;
  const int64_t c_begin = first + split * per, c_end = std::min(first + (split + 1) * per, last);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t t_begin = std::max<int64_t>(c * FULL_CHUNK, lo), t_end = std::min<int64_t>((c + 1) * FULL_CHUNK, length);
    const int n = (int)(t_end - t_begin);
    if (n <= 0) continue;
    for (int i0 = 0; i0 < n; i0 += W) {
      const int m = std::min(W, n - i0);
      for (int i = 0; i < m; ++i) {
        const float* kt = key_row(t_begin + i0 + i);
        vf kv[D / W];
        for (int k = 0; k < D / W; ++k) kv[k] = vload(kt + k * W);
        for (int r = 0; r < NR; ++r) {
          vf acc = kv[0] * vload(q[r]);
#pragma GCC unroll 8
          for (int k = 1; k < D / W; ++k) acc += kv[k] * vload(q[r] + k * W);
          partial[r][i] = acc;
        }
      }
      for (int r = 0; r < NR; ++r) {
        for (int i = m; i < W; ++i) partial[r][i] = vf{};
        vstore(scores[r] + i0, reduce_lanes(partial[r]));
      }
    }
    st.update(scores, p, n);
    for (int i = 0; i < n; ++i) {
      const float* vt = value_row(t_begin + i);
      vf vv[D / W];
      for (int k = 0; k < D / W; ++k) vv[k] = vload(vt + k * W);
      for (int r = 0; r < NR; ++r) {
        const float pr = p[r][i];
#pragma GCC unroll 8
        for (int k = 0; k < D / W; ++k) st.acc[r][k] += vv[k] * pr;
      }
    }
  }
  st.store(part, nr);
}

// ---------------------------------------------------------------------------------------------------------------------
// Shared driver: items (b, h, row block, split), then the combine with the new token.

struct Layout {
  int64_t B, H, n_rep, D, splits, blocks;
  int64_t items() const { return B * H * blocks * splits; }
  // partials: [B, H, splits, n_rep, D + 2]
  int64_t part_offset(int64_t b, int64_t h, int64_t s, int64_t r) const {
    return (((b * H + h) * splits + s) * n_rep + r) * (D + 2);
  }
};

int64_t choose_splits(int64_t B, int64_t H, int64_t blocks, int64_t workers, int64_t max_units, int64_t min_units) {
  // Enough items for every worker to get about four (load balance), each at least `min_units` of work.
  int64_t base = B * H * blocks;
  int64_t want = (4 * workers + base - 1) / base;
  int64_t cap = std::max<int64_t>(max_units / std::max<int64_t>(min_units, 1), 1);
  return std::max<int64_t>(1, std::min(want, cap));
}

// The sink tokens of one layer, attended in the combine (a few tokens a sequence, in full precision).
struct Sinks {
  const float *k = nullptr, *v = nullptr;  // [L, B, H, S, D] (keys before RoPE when `rope`)
  int64_t S = 0, layer = 0;
  const int32_t* length = nullptr;
  int64_t window = 0;
  const float* rope = nullptr;  // [tokens, D] cos then sin per position, or null
};

void combine(const Layout& lay, const float* parts, const float* q, const float* kn, const float* vn, float* out,
             const Sinks& sk = Sinks()) {
  const int64_t D = lay.D;
  std::vector<float> sink_keys(sk.S * D), sink_scores(sk.S);
  for (int64_t b = 0; b < lay.B; ++b)
    for (int64_t h = 0; h < lay.H; ++h) {
      const float* k = kn + (b * lay.H + h) * D;
      const float* v = vn + (b * lay.H + h) * D;
      // Sinks: tokens [lo, min(S, length)) (lo: the sliding window's first visible token), keys rotated if pre-RoPE.
      int64_t s_lo = 0, s_hi = 0;
      const float* sv = nullptr;
      if (sk.S > 0) {
        const int64_t length = sk.length[b];
        s_lo = sk.window > 0 ? std::max<int64_t>(length - sk.window + 1, 0) : 0;
        s_hi = std::min<int64_t>(sk.S, length);
        const int64_t off = ((sk.layer * lay.B + b) * lay.H + h) * sk.S * D;
        sv = sk.v + off;
        for (int64_t j = s_lo; j < s_hi; ++j) {
          const float* kj = sk.k + off + j * D;
          float* o = sink_keys.data() + j * D;
          if (sk.rope) {
            const float* cs = sk.rope + j * D;
            for (int64_t i = 0; i < D / 2; ++i) {
              o[i] = kj[i] * cs[i] - kj[i + D / 2] * cs[D / 2 + i];
              o[i + D / 2] = kj[i + D / 2] * cs[i] + kj[i] * cs[D / 2 + i];
            }
          } else {
            std::memcpy(o, kj, D * sizeof(float));
          }
        }
      }
      for (int64_t r = 0; r < lay.n_rep; ++r) {
        const float* qr = q + ((b * lay.H + h) * lay.n_rep + r) * D;
        float s_new = 0.0f;
        for (int64_t d = 0; d < D; ++d) s_new += qr[d] * k[d];
        float m = s_new;
        for (int64_t s = 0; s < lay.splits; ++s) m = std::max(m, parts[lay.part_offset(b, h, s, r)]);
        for (int64_t j = s_lo; j < s_hi; ++j) {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * sink_keys[j * D + d];
          sink_scores[j] = dot;
          m = std::max(m, dot);
        }
        float w_new = std::exp(s_new - m), l = w_new;
        float* o = out + ((b * lay.H + h) * lay.n_rep + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = w_new * v[d];
        for (int64_t s = 0; s < lay.splits; ++s) {
          const float* pt = parts + lay.part_offset(b, h, s, r);
          if (pt[0] == NEG_INF) continue;
          float w = std::exp(pt[0] - m);
          l += w * pt[1];
          for (int64_t d = 0; d < D; ++d) o[d] += w * pt[2 + d];
        }
        for (int64_t j = s_lo; j < s_hi; ++j) {
          float w = std::exp(sink_scores[j] - m);
          l += w;
          for (int64_t d = 0; d < D; ++d) o[d] += w * sv[j * D + d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= l;
      }
    }
}

// RoPE tables: row t holds cos(a_ti) for the D/2 angles a_ti = float32(t * inv_freq_i) (rounded like jnp), then
// sin(a_ti), computed in double and rounded to float32. They depend only on inv_freq and t, so one table serves
// every layer, head and step: kept (a few, most recent first) and grown in blocks of ROPE_BLOCK tokens when a call
// needs more positions. Readers hold a shared_ptr to an immutable table.
struct RopeTable {
  std::vector<float> inv_freq;
  int64_t tokens = 0;
  std::vector<float> data;  // [tokens, D]
};
constexpr int64_t ROPE_BLOCK = 1024;
constexpr size_t ROPE_KEEP = 4;
std::mutex rope_mu;
std::vector<std::shared_ptr<const RopeTable>> rope_tables;

std::shared_ptr<const RopeTable> rope_table(const float* inv_freq, int64_t D, int64_t tokens) {
  const int64_t half = D / 2;
  std::lock_guard<std::mutex> lock(rope_mu);
  std::shared_ptr<const RopeTable> old;
  for (size_t i = 0; i < rope_tables.size(); ++i) {
    const auto& t = rope_tables[i];
    if ((int64_t)t->inv_freq.size() == half && std::memcmp(t->inv_freq.data(), inv_freq, half * sizeof(float)) == 0) {
      old = t;
      rope_tables.erase(rope_tables.begin() + i);
      break;
    }
  }
  if (!old || old->tokens < tokens) {
    auto fresh = std::make_shared<RopeTable>();
    fresh->inv_freq.assign(inv_freq, inv_freq + half);
    fresh->tokens = std::max<int64_t>((tokens + ROPE_BLOCK - 1) / ROPE_BLOCK, 1) * ROPE_BLOCK;
    fresh->data.resize(fresh->tokens * D);
    int64_t start = 0;
    if (old) {
      std::memcpy(fresh->data.data(), old->data.data(), old->data.size() * sizeof(float));
      start = old->tokens;
    }
    for (int64_t t = start; t < fresh->tokens; ++t) {
      float* row = fresh->data.data() + t * D;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = (float)t * inv_freq[i];
        row[i] = (float)std::cos((double)angle);
        row[half + i] = (float)std::sin((double)angle);
      }
    }
    old = fresh;
  }
  rope_tables.insert(rope_tables.begin(), old);
  if (rope_tables.size() > ROPE_KEEP) rope_tables.pop_back();
  return old;
}

// Query rows scaled by 1/sqrt(D), [B, Hq, D].
std::vector<float> scaled_queries(const float* q, int64_t n, int64_t D) {
  std::vector<float> out(q, q + n);
  const float sm = 1.0f / std::sqrt((float)D);
  for (auto& x : out) x *= sm;
  return out;
}

template <typename Args, typename ItemFn>
void run_items(ffi::ThreadPool& pool, const Layout& lay, const Args& args, ItemFn item, std::vector<float>& parts) {
  parts.assign(lay.B * lay.H * lay.splits * lay.n_rep * (lay.D + 2), 0.0f);
  float* base = parts.data();
  parallel_for(pool, lay.items(), [&](int64_t i) {
    int64_t s = i % lay.splits, rest = i / lay.splits;
    int64_t blk = rest % lay.blocks;
    rest /= lay.blocks;
    int64_t h = rest % lay.H, b = rest / lay.H;
    int r0 = (int)(blk * MAX_ROWS);
    item(args, b, h, r0, s, base + lay.part_offset(b, h, s, r0));
  });
}

using KiviFn = void (*)(const KiviArgs&, int64_t, int64_t, int, int64_t, float*);
using FullFn = void (*)(const FullArgs&, int64_t, int64_t, int, int64_t, float*);

template <int NR, int D>
KiviFn kivi_pick_bits(int kb, int vb) {
  if (kb == 2 && vb == 2) return kivi_item<NR, D, 2, 2>;
  if (kb == 2 && vb == 3) return kivi_item<NR, D, 2, 3>;
  if (kb == 2 && vb == 4) return kivi_item<NR, D, 2, 4>;
  if (kb == 3 && vb == 2) return kivi_item<NR, D, 3, 2>;
  if (kb == 3 && vb == 3) return kivi_item<NR, D, 3, 3>;
  if (kb == 3 && vb == 4) return kivi_item<NR, D, 3, 4>;
  if (kb == 4 && vb == 2) return kivi_item<NR, D, 4, 2>;
  if (kb == 4 && vb == 3) return kivi_item<NR, D, 4, 3>;
  if (kb == 4 && vb == 4) return kivi_item<NR, D, 4, 4>;
  return nullptr;
}

template <int NR>
KiviFn kivi_pick(int64_t D, int kb, int vb) {
  if (D == 64) return kivi_pick_bits<NR, 64>(kb, vb);
  if (D == 128) return kivi_pick_bits<NR, 128>(kb, vb);
  return nullptr;
}

KiviFn kivi_kernel(int nr, int64_t D, int kb, int vb) {
  switch (nr) {
    case 1: return kivi_pick<1>(D, kb, vb);
    case 2: return kivi_pick<2>(D, kb, vb);
    case 3: return kivi_pick<3>(D, kb, vb);
    default: return kivi_pick<4>(D, kb, vb);
  }
}

template <int NR, bool EIGHT>
FullFn full_pick(int64_t D) {
  if (D == 64) return full_item<NR, 64, EIGHT>;
  if (D == 128) return full_item<NR, 128, EIGHT>;
  return nullptr;
}

FullFn full_kernel(int nr, int64_t D, bool eight = false) {
  switch (nr) {
    case 1: return eight ? full_pick<1, true>(D) : full_pick<1, false>(D);
    case 2: return eight ? full_pick<2, true>(D) : full_pick<2, false>(D);
    case 3: return eight ? full_pick<3, true>(D) : full_pick<3, false>(D);
    default: return eight ? full_pick<4, true>(D) : full_pick<4, false>(D);
  }
}


ffi::Error KiviDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kc, ffi::AnyBuffer ks,
                          ffi::AnyBuffer km, ffi::Buffer<ffi::U8> vc, ffi::AnyBuffer vs, ffi::AnyBuffer vm,
                          ffi::AnyBuffer kr, ffi::AnyBuffer vr, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::S32> tab, ffi::Buffer<ffi::F32> kn,
                          ffi::Buffer<ffi::F32> vn, ffi::Buffer<ffi::F32> k_sink, ffi::Buffer<ffi::F32> v_sink, ffi::Buffer<ffi::F32> inv_freq,
                          ffi::Buffer<ffi::F32> k_levels, ffi::Buffer<ffi::F32> v_levels,
                          ffi::ResultBuffer<ffi::F32> out, int64_t k_bits, int64_t v_bits, int64_t k_group,
                          int64_t v_group, int64_t window, int64_t rope, int64_t k_codebook, int64_t v_codebook,
                          int64_t int8_dots) {
  auto qd = q.dimensions(), kcd = kc.dimensions(), krd = kr.dimensions(), skd = k_sink.dimensions();
  auto vcd = vc.dimensions(), td = tab.dimensions();
  if (qd.size() != 4 || kcd.size() != 5 || vcd.size() != 5 || krd.size() != 5 || skd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "kivi_decode: q must be [B, 1, Hq, D], stores [L, pages, H, ., .], rings and sinks [L, B, H, ., .], the table "
        "[B, pages a sequence]");
  KiviArgs a;
  a.L = kcd[0];
  a.NP = kcd[1];
  a.B = qd[0];
  a.H = kcd[2];
  a.T = kcd[3];
  a.D = qd[3];
  a.n_rep = qd[2] / a.H;
  a.R = krd[3];
  a.kbits = (int)k_bits;
  a.vbits = (int)v_bits;
  a.gk = (int)k_group;
  a.gv = (int)v_group;
  a.window = window;
  auto et = ks.element_type();
  if (et != km.element_type() || et != vs.element_type() || et != vm.element_type())
    return ffi::Error::InvalidArgument("kivi_decode: scales and mins must share one dtype");
  if (!scale_type(et, a.st))
    return ffi::Error::InvalidArgument("kivi_decode: scales must be float16, bfloat16 or float32");
  if (!scale_type(kr.element_type(), a.krt) || !scale_type(vr.element_type(), a.vrt))
    return ffi::Error::InvalidArgument("kivi_decode: rings must be float32, float16 or bfloat16");
  if (a.gk < 32 || a.gk > MAX_CHUNK || a.T % a.gk || a.R % a.gk || a.gv < W || a.gv % W || a.D % a.gv)
    return ffi::Error::InvalidArgument("kivi_decode: unsupported group sizes");
  if (td[0] != a.B || krd[1] != a.B || krd[0] != a.L || krd[2] != a.H || krd[4] != a.D || !(vr.dimensions() == krd) ||
      vcd[0] != a.L || vcd[1] != a.NP ||
      vcd[2] != a.H || vcd[3] != a.T || (int64_t)length.element_count() != a.B)
    return ffi::Error::InvalidArgument("kivi_decode: stores, rings, lengths and the table disagree on their shapes");
  KiviFn probe = kivi_kernel(MAX_ROWS, a.D, a.kbits, a.vbits);
  if (!probe) return ffi::Error::InvalidArgument("kivi_decode: unsupported head_dim or bits");
  a.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), a.L - 1);
  a.length = length.typed_data();
  a.table = tab.typed_data();
  a.pages_per_seq = td[1];
  a.scale_bytes = a.st == F32 ? 4 : 2;
  a.kc = kc.typed_data();
  a.vc = vc.typed_data();
  a.ks = ks.untyped_data();
  a.km = km.untyped_data();
  a.vs = vs.untyped_data();
  a.vm = vm.untyped_data();
  a.kr = kr.untyped_data();
  a.vr = vr.untyped_data();
  a.S = skd[3];
  if (a.S > 0 && (skd[0] != a.L || skd[1] != a.B || skd[2] != a.H || skd[4] != qd[3] ||
                  v_sink.dimensions().size() != 5 || v_sink.element_count() != k_sink.element_count()))
    return ffi::Error::InvalidArgument("kivi_decode: sinks must be [L, B, H, S, D] like the stores");
  a.k_sink = a.S > 0 ? k_sink.typed_data() : nullptr;
  a.v_sink = a.S > 0 ? v_sink.typed_data() : nullptr;
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.B; ++b) max_len = std::max<int64_t>(max_len, a.length[b]);
  // A zeroed page for the entries that hold none (as the XLA path reads them), when the table has any or a length
  // reaches past it.
  bool holes = max_len > a.pages_per_seq * a.T;
  for (int64_t i = 0; i < a.B * a.pages_per_seq && !holes; ++i) holes = a.table[i] < 0 || a.table[i] >= a.NP;
  std::vector<uint8_t> zero;
  if (holes) {
    const int64_t kb = a.T * (a.D * a.kbits / 8), vb = a.T * (a.D * a.vbits / 8);
    const int64_t ksb = (a.T / a.gk) * a.D * a.scale_bytes, vsb = a.T * (a.D / a.gv) * a.scale_bytes;
    zero.assign(std::max({kb, vb, ksb, vsb}), 0);
    a.zero = zero.data();
  }
  std::shared_ptr<const RopeTable> table;
  if (rope) {
    if ((int64_t)inv_freq.element_count() * 2 != a.D)
      return ffi::Error::InvalidArgument("kivi_decode: inv_freq must be [head_dim / 2]");
    table = rope_table(inv_freq.typed_data(), a.D, max_len + 1);
  }
  a.rope = table ? table->data.data() : nullptr;
  if ((k_codebook && k_codebook != (1 << a.kbits)) || (v_codebook && v_codebook != (1 << a.vbits)) ||
      (int64_t)k_levels.element_count() < k_codebook || (int64_t)v_levels.element_count() < v_codebook)
    return ffi::Error::InvalidArgument("kivi_decode: a codebook needs 2^bits levels");
  a.k_levels = k_codebook ? k_levels.typed_data() : nullptr;
  a.v_levels = v_codebook ? v_levels.typed_data() : nullptr;
  a.k_nlevels = (int)k_codebook;
  a.v_nlevels = (int)v_codebook;
  a.q8 = (int)int8_dots;
  std::vector<float> qs = scaled_queries(q.typed_data(), a.B * a.H * a.n_rep * a.D, a.D);
  a.q = qs.data();

  Layout lay{a.B, a.H, a.n_rep, a.D, 1, (a.n_rep + MAX_ROWS - 1) / MAX_ROWS};
  lay.splits = choose_splits(a.B, a.H, lay.blocks, worker_count(pool), max_len / a.gk, 512 / a.gk);
  a.splits = lay.splits;
  std::vector<float> parts;
  run_items(pool, lay, a, [&](const KiviArgs& args, int64_t b, int64_t h, int r0, int64_t s, float* part) {
    int nr = (int)std::min<int64_t>(MAX_ROWS, args.n_rep - r0);
    kivi_kernel(nr, args.D, args.kbits, args.vbits)(args, b, h, r0, s, part);
  }, parts);
  Sinks sk;
  sk.k = a.k_sink;
  sk.v = a.v_sink;
  sk.S = a.S;
  sk.layer = a.layer;
  sk.length = a.length;
  sk.window = a.window;
  sk.rope = a.rope;
  combine(lay, parts.data(), qs.data(), kn.typed_data(), vn.typed_data(), out->typed_data(), sk);
  return ffi::Error::Success();
}

// The shapes, window, layer and lengths of a dense kernel's call (full precision or 8-bit): false when q is not
// [B, 1, Hq, D], the stores not [L, B, H, T, D], or no kernel serves head_dim D.
template <class Dims>
bool dense_args(const Dims& qd, const Dims& kd, int64_t window, ffi::Buffer<ffi::S32>& layer,
                ffi::Buffer<ffi::S32>& length, FullArgs& a) {
  if (qd.size() != 4 || kd.size() != 5) return false;
  a.L = kd[0];
  a.B = kd[1];
  a.H = kd[2];
  a.T = kd[3];
  a.D = qd[3];
  a.n_rep = qd[2] / a.H;
  a.window = window;
  if (!full_kernel(MAX_ROWS, a.D)) return false;
  a.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), a.L - 1);
  a.length = length.typed_data();
  return true;
}

// The driver of the dense kernels (full precision and 8-bit): scaled queries, work items over (batch, kv head, row
// block, token split), the combine with the new token.
ffi::Error run_dense(ffi::ThreadPool& pool, FullArgs& a, const float* q, const float* kn, const float* vn, float* out,
                     bool eight) {
  std::vector<float> qs = scaled_queries(q, a.B * a.H * a.n_rep * a.D, a.D);
  a.q = qs.data();
  Layout lay{a.B, a.H, a.n_rep, a.D, 1, (a.n_rep + MAX_ROWS - 1) / MAX_ROWS};
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.B; ++b) max_len = std::max<int64_t>(max_len, a.length[b]);
  lay.splits = choose_splits(a.B, a.H, lay.blocks, worker_count(pool), max_len / FULL_CHUNK, 512 / FULL_CHUNK);
  a.splits = lay.splits;
  std::vector<float> parts;
  run_items(pool, lay, a, [&](const FullArgs& args, int64_t b, int64_t h, int r0, int64_t s, float* part) {
    int nr = (int)std::min<int64_t>(MAX_ROWS, args.n_rep - r0);
    full_kernel(nr, args.D, eight)(args, b, h, r0, s, part);
  }, parts);
  combine(lay, parts.data(), qs.data(), kn, vn, out);
  return ffi::Error::Success();
}

ffi::Error FullDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> length,
                          ffi::Buffer<ffi::F32> kn, ffi::Buffer<ffi::F32> vn, ffi::ResultBuffer<ffi::F32> out,
                          int64_t window) {
  FullArgs a;
  if (!dense_args(q.dimensions(), k.dimensions(), window, layer, length, a))
    return ffi::Error::InvalidArgument(
        "full_decode: q must be [B, 1, Hq, D], k and v [L, B, H, T, D], head_dim 64 or 128");
  a.k = k.typed_data();
  a.v = v.typed_data();
  return run_dense(pool, a, q.typed_data(), kn.typed_data(), vn.typed_data(), out->typed_data(), false);
}

ffi::Error EightDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k,
                           ffi::Buffer<ffi::U8> v, ffi::Buffer<ffi::F16> ks, ffi::Buffer<ffi::F16> vs,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::F32> kn,
                           ffi::Buffer<ffi::F32> vn, ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t fmt,
                           int64_t scaled) {
  if (fmt < 0 || fmt > 2) return ffi::Error::InvalidArgument("eight_decode: fmt must be 0 (int8), 1 (e4m3), 2 (e5m2)");
  FullArgs a;
  if (!dense_args(q.dimensions(), k.dimensions(), window, layer, length, a))
    return ffi::Error::InvalidArgument(
        "eight_decode: q must be [B, 1, Hq, D], k and v [L, B, H, T, D] codes, head_dim 64 or 128");
  if (scaled && ((int64_t)ks.element_count() != a.L * a.B * a.H * a.T || vs.element_count() != ks.element_count()))
    return ffi::Error::InvalidArgument("eight_decode: scales must be [L, B, H, T, 1] like the codes");
  a.k8 = k.typed_data();
  a.v8 = v.typed_data();
  a.ks = scaled ? reinterpret_cast<const uint16_t*>(ks.untyped_data()) : nullptr;
  a.vs = scaled ? reinterpret_cast<const uint16_t*>(vs.untyped_data()) : nullptr;
  a.fmt = fmt;
  return run_dense(pool, a, q.typed_data(), kn.typed_data(), vn.typed_data(), out->typed_data(), true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxEightDecode, EightDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, 1, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key codes [L, B, H, T, D] (int8 / fp8 bytes)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value codes
                                  .Arg<ffi::Buffer<ffi::F16>>()  // key scales [L, B, H, T, 1] (read when scaled)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // value scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new key [B, 1, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new value
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, 1, Hq, D]
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("scaled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxKiviDecode, KiviDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, 1, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key codes [L, pages, H, T, D / pk]
                                  .Arg<ffi::AnyBuffer>()         // key scales [L, pages, H, T / G, D]
                                  .Arg<ffi::AnyBuffer>()         // key mins
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value codes [L, pages, H, T, D / pv]
                                  .Arg<ffi::AnyBuffer>()         // value scales [L, pages, H, T, D / Gv]
                                  .Arg<ffi::AnyBuffer>()         // value mins
                                  .Arg<ffi::AnyBuffer>()         // key ring [L, B, H, R, D] (f32, f16 or bf16)
                                  .Arg<ffi::AnyBuffer>()         // value ring (f32, f16 or bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block table [B, pages a sequence] (contiguous: [b])
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new key [B, 1, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new value
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key sinks [L, B, H, S, D] (S = 0: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value sinks
                                  .Arg<ffi::Buffer<ffi::F32>>()  // inv_freq [D / 2] (read when rope)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key codebook [>= 2^k_bits] (read when k_codebook)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value codebook
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, 1, Hq, D]
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("v_bits")
                                  .Attr<int64_t>("k_group")
                                  .Attr<int64_t>("v_group")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("rope")
                                  .Attr<int64_t>("k_codebook")    // levels in the key codebook (0: uniform codes)
                                  .Attr<int64_t>("v_codebook")
                                  .Attr<int64_t>("int8_dots"));  // 1: 2-bit keys and values dotted in integers (`Q8`)

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviJaxFullDecode, FullDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, 1, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [L, B, H, T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new key [B, 1, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new value
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, 1, Hq, D]
                                  .Attr<int64_t>("window"));

// Whether this build dots 2-bit keys and values in integers when asked (`int8_dots`; else it computes in float32).
extern "C" int kivi_jax_int8_dots() { return Q8 ? 1 : 0; }
