// The fused CPU paged-decode attention kernel; built and loaded by cpu_paged_decode.py
// (see its docstring for the algorithm and the build). `vec`, `W` and `load_vec` come from
// core/native_vec.h, which the build puts before this source.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Positions per online-softmax step: the accumulator is rescaled once per tile, and a KV head's
// tile rows (TILE x D each for K and V) stay in L1/L2 while the G query heads of its group use them.
constexpr int64_t TILE = 64;
// split-KV runs (paged_decode_impl): RUN_TILES tiles from each multiple of RUN positions
constexpr int64_t RUN_TILES = 2, RUN = RUN_TILES * TILE;
inline float hsum(vec a) {  // halving tree, not a serial chain of 16 adds
#if defined(__clang__) || __GNUC__ >= 12
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
#else
  float sum = 0.f;
  for (int i = 0; i < W; ++i) sum += a[i];
  return sum;
#endif
}

// The lane sums of four vectors (the scores of four positions) into out[0 .. 3]: one shuffle
// tree for the four, about a third of the instructions of four hsum()s.
inline void hsum4(vec a, vec b, vec c, vec d, float* out) {
#if defined(__clang__) || __GNUC__ >= 12
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  // lanes 0-7: a's lanes i + (i + 8); lanes 8-15: b's
  const vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // lanes 4j .. 4j + 3: vector j's four partial sums
  const vec q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v8 r = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  const v4 sums = __builtin_shufflevector(r, r, 0, 2, 4, 6) + __builtin_shufflevector(r, r, 1, 3, 5, 7);
  std::memcpy(out, &sums, sizeof sums);
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

// exp(x) for x <= 0 (softmax weights), written so that the loop over a tile vectorizes (libm's
// expf is a call per element): 2^k * p(r) with a Cephes polynomial, relative error ~2e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: a weight that small is zero next to the max's 1
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

// tanh(x) through exp_nonpositive (so that a tile's soft-capping vectorizes, as std::tanh does
// not): sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|); absolute error ~2e-7.
inline float tanh_vec(float x) {
  const float e = exp_nonpositive(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
}

// acc[0 : NV*16] = alpha * acc + sum_t p[t] * V_row_t, NV vectors kept in registers while the
// tile's rows stream by: NV independent FMA chains (one chain would wait on its own latency).
template <int NV, typename T>
inline void accumulate_rows(float* acc, float alpha, const float* p, const T* v, const int64_t* rows, int64_t n) {
  vec a[NV];
  for (int i = 0; i < NV; ++i) a[i] = load_vec(acc + W * i) * alpha;
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < NV; ++i) a[i] += p[t] * load_vec(v + rows[t] + W * i);
  for (int i = 0; i < NV; ++i) std::memcpy(acc + W * i, &a[i], sizeof(vec));
}

// ---- Query heads in lanes: bf16 caches on CPUs with AVX512-BF16 ----
// The softmax states of one KV head (its G query heads, for each of the group's rows) are the 16
// lanes of a vector. The scores are computed with the positions in the lanes instead
// (scores_positions: the K rows transposed into pairs by position, D / 32 `vdpbf16ps` a position
// and state, no widening of K, no horizontal sums) and stored in the states' lanes. The online
// softmax runs on the lanes; the V rows are widened once per block of up to 6 states and weighted
// into each state's fp32 accumulator. A state's arithmetic is the same whichever states share its
// chunk: a row's attention has the same bits alone (a decode) or in a group (a verification).
constexpr int LANES = 16;
constexpr int LANE_BLOCK = 6;  // states whose accumulators (4 vectors each) stay in registers at once

struct LaneChunk {  // up to LANES softmax states of one KV head, one per lane
  int64_t state[LANES];  // index into the unit's states (acc rows, m, l)
  int64_t row[LANES];    // the state's query row within the group
  int used;              // lanes 0 .. used - 1 hold states
  alignas(64) float m[LANES];
  alignas(64) float l[LANES];
};

inline uint32_t load_pair(const c10::BFloat16* p) {  // two bf16 values as one 32-bit word
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// exp_nonpositive / tanh_vec above, 16 lanes at a time
inline __m512 exp_nonpositive_v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i two_k = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(two_k));
}

inline __m512 tanh_v(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 e = exp_nonpositive_v(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_andnot_ps(sign, x)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_or_ps(t, _mm512_and_ps(sign, x));  // copysign
}

// A position's K and V rows of one KV head (D bf16 each, 64-byte aligned) toward L2.
template <int64_t D>
inline void prefetch_row(const c10::BFloat16* kh, const c10::BFloat16* vh, int64_t off) {
  for (int64_t b = 0; b < D * 2; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(kh + off) + b, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(vh + off) + b, _MM_HINT_T1);
  }
}

// acc_s = alpha_s * acc_s + sum_t p[t][s] v_t for NS states (lanes j0 .. j0 + NS - 1 of p's rows),
// 64 head dims at a time: each V row widened once for the NS states.
// With next (not null): while the rows stream by, the K and V rows of the next tile's positions
// 0 .. min(t1 - t0, n_next) - 1 (cache offsets next[i]) are prefetched into L2, one a position.
template <int NS, int64_t D>
inline void accumulate_lanes(float* const* accs, const float* alpha, const float* p, const c10::BFloat16* kh,
                             const c10::BFloat16* vh, const int64_t* off, int64_t t0, int64_t t1, const int64_t* next,
                             int64_t n_next) {
  for (int64_t d = 0; d < D; d += 4 * W) {
    __m512 a[NS][4];
    for (int s = 0; s < NS; ++s)
      for (int i = 0; i < 4; ++i) a[s][i] = _mm512_mul_ps(_mm512_loadu_ps(accs[s] + d + W * i), _mm512_set1_ps(alpha[s]));
    for (int64_t t = t0; t < t1; ++t) {
      if (next != nullptr && d == 0 && t - t0 < n_next) prefetch_row<D>(kh, vh, next[t - t0]);
      __m512 v[4];
      for (int i = 0; i < 4; ++i) v[i] = (__m512)load_vec(vh + off[t] + d + W * i);
      for (int s = 0; s < NS; ++s) {
        const __m512 pt = _mm512_set1_ps(p[t * LANES + s]);
        for (int i = 0; i < 4; ++i) a[s][i] = _mm512_fmadd_ps(pt, v[i], a[s][i]);
      }
    }
    for (int s = 0; s < NS; ++s)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(accs[s] + d + W * i, a[s][i]);
  }
}

// 16 x 16 32-bit words transposed in registers: r[i] lane j becomes r[j] lane i (64 shuffles).
inline void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

// States j0 .. j0 + NS - 1 against NB blocks of 16 positions from u0 (pairs kp[p][u]): each score
// one chain of vdpbf16ps over the pairs in order, then scaled, stored at sp[u][j].
template <int NS, int NB, int64_t D>
inline void score_blocks(const uint32_t (*kp)[TILE], const uint32_t* qt, int j0, int64_t u0, float scale, float* sp) {
  __m512 a[NS][NB];
  for (int s = 0; s < NS; ++s)
    for (int b = 0; b < NB; ++b) a[s][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512i k[NB];
    for (int b = 0; b < NB; ++b) k[b] = _mm512_load_si512(&kp[p][u0 + 16 * b]);
    for (int s = 0; s < NS; ++s) {
      const __m512i q = _mm512_set1_epi32(static_cast<int>(qt[p * LANES + j0 + s]));
      for (int b = 0; b < NB; ++b) a[s][b] = _mm512_dpbf16_ps(a[s][b], (__m512bh)q, (__m512bh)k[b]);
    }
  }
  alignas(64) float v[16];
  for (int s = 0; s < NS; ++s)
    for (int b = 0; b < NB; ++b) {
      _mm512_store_ps(v, _mm512_mul_ps(a[s][b], _mm512_set1_ps(scale)));
      for (int i = 0; i < 16; ++i) sp[(u0 + 16 * b + i) * LANES + j0 + s] = v[i];
    }
}

template <int NS, int64_t D>
inline void score_blocks_any(const uint32_t (*kp)[TILE], const uint32_t* qt, int j0, int64_t u0, int64_t nb, float scale,
                             float* sp) {
  switch (nb) {
    case 1: return score_blocks<NS, 1, D>(kp, qt, j0, u0, scale, sp);
    case 2: return score_blocks<NS, 2, D>(kp, qt, j0, u0, scale, sp);
    case 3: return score_blocks<NS, 3, D>(kp, qt, j0, u0, scale, sp);
    default: return score_blocks<NS, 4, D>(kp, qt, j0, u0, scale, sp);
  }
}

// sp[t][j] = scale * q_j . k_t for positions t0 .. t1 - 1 and the chunk's `used` states, with the
// positions in the lanes: the tile's K rows, loaded whole in position order (the pattern the
// hardware prefetchers follow), are transposed into pairs by position (16 positions x 16 pairs at
// a time), then each state costs D / 32 vdpbf16ps a position against its query pair, broadcast
// once per 16 positions. The states in the lanes instead (each K pair broadcast against the
// states' query pairs) cost D / 2 broadcasts and D / 2 vdpbf16ps a position however few the
// states: a decode has 3, in 16 lanes. Same numbers either way, bit for bit: each score is one
// chain of vdpbf16ps over the pairs in order. 1.3-1.5x faster attention, `attention_torch.py
// --kernel-sweep` shapes, 2-core Xeon with AMX (README, Performance).
template <int64_t D>
inline void scores_positions(const c10::BFloat16* kh, const int64_t* off, const uint32_t* qt, int used, int64_t t0,
                             int64_t t1, float scale, float* sp) {
  constexpr int64_t PAIRS = D / 2;
  const int64_t b0 = t0 / 16 * 16, nb = (t1 - b0 + 15) / 16;  // blocks of 16 positions from b0 (at most 4)
  alignas(64) uint32_t kp[PAIRS][TILE];                           // kp[p][u]: pair p of position u (0 outside t0 .. t1 - 1)
  for (int64_t u0 = b0; u0 < b0 + 16 * nb; u0 += 16)
    for (int64_t p0 = 0; p0 < PAIRS; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = u0 + i >= t0 && u0 + i < t1 ? _mm512_loadu_si512(kh + off[u0 + i] + 2 * p0) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(&kp[p0 + i][u0], r[i]);
    }
  for (int j0 = 0; j0 < used; j0 += 4) {  // states 4 at a time: 4 x 4 accumulators in registers
    switch (std::min(4, used - j0)) {
      case 1: score_blocks_any<1, D>(kp, qt, j0, b0, nb, scale, sp); break;
      case 2: score_blocks_any<2, D>(kp, qt, j0, b0, nb, scale, sp); break;
      case 3: score_blocks_any<3, D>(kp, qt, j0, b0, nb, scale, sp); break;
      default: score_blocks_any<4, D>(kp, qt, j0, b0, nb, scale, sp); break;
    }
  }
}

// One tile for one chunk of states: lane j attends over tile positions t0s[j] .. t1s[j] - 1 (its
// row's part of the tile; an unused lane has none). K/V rows at kh + off[t], vh + off[t]; qt the
// chunk's query pairs ([D / 2][LANES] words, lane j = state j's pair); sp scratch [TILE][LANES].
template <int64_t D>
void attend_lanes(const c10::BFloat16* kh, const c10::BFloat16* vh, const int64_t* off, LaneChunk& c,
                  const uint32_t* qt, float* acc, const int32_t* t0s, const int32_t* t1s, float scale, float soft_cap,
                  float* sp, const int64_t* next, int64_t n_next) {
  int64_t tmin = TILE, tmax = 0;  // the positions any lane needs
  for (int j = 0; j < c.used; ++j)
    if (t1s[j] > t0s[j]) tmin = std::min<int64_t>(tmin, t0s[j]), tmax = std::max<int64_t>(tmax, t1s[j]);
  // the next tile's rows not prefetched during the V pass below (all of them where it has none)
  const int64_t streamed = next != nullptr && tmax > tmin ? std::min(n_next, tmax - tmin) : 0;
  for (int64_t i = streamed; next != nullptr && i < n_next; ++i) prefetch_row<D>(kh, vh, next[i]);
  if (tmax <= tmin) return;
  scores_positions<D>(kh, off, qt, c.used, tmin, tmax, scale, sp);
  // online softmax on the lanes; a lane's positions outside its range are masked out
  const __m512i lo = _mm512_loadu_si512(t0s), hi = _mm512_loadu_si512(t1s);
  auto in_range = [&](int64_t pos) {
    const __m512i tv = _mm512_set1_epi32(static_cast<int32_t>(pos));
    return static_cast<__mmask16>(_mm512_cmple_epi32_mask(lo, tv) & _mm512_cmpgt_epi32_mask(hi, tv));
  };
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 tile_max = minus_inf;
  for (int64_t u = tmin; u < tmax; ++u) {
    __m512 s = _mm512_loadu_ps(sp + u * LANES);
    if (soft_cap > 0.f) {
      s = _mm512_mul_ps(_mm512_set1_ps(soft_cap), tanh_v(_mm512_mul_ps(s, _mm512_set1_ps(1.0f / soft_cap))));
      _mm512_storeu_ps(sp + u * LANES, s);
    }
    tile_max = _mm512_mask_max_ps(tile_max, in_range(u), tile_max, s);
  }
  const __m512 m_old = _mm512_load_ps(c.m);
  const __m512 m_new = _mm512_max_ps(m_old, tile_max);
  // 0 where nothing was accumulated yet (m = -inf), 1 where the max did not move
  const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, minus_inf, _CMP_NEQ_OQ),
                                           exp_nonpositive_v(_mm512_sub_ps(m_old, m_new)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t u = tmin; u < tmax; ++u) {  // the weights, in place of the scores
    const __m512 p = _mm512_maskz_mov_ps(in_range(u), exp_nonpositive_v(_mm512_sub_ps(_mm512_loadu_ps(sp + u * LANES), m_new)));
    _mm512_storeu_ps(sp + u * LANES, p);
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_store_ps(c.l, _mm512_fmadd_ps(_mm512_load_ps(c.l), alpha, sum));
  _mm512_store_ps(c.m, m_new);
  // weighted V rows, states in blocks of up to LANE_BLOCK (a weight of 0 adds exactly nothing)
  alignas(64) float alphas[LANES];
  _mm512_store_ps(alphas, alpha);
  const int blocks = (c.used + LANE_BLOCK - 1) / LANE_BLOCK;
  for (int b = 0, j0 = 0; b < blocks; ++b) {
    const int ns = (c.used - j0) / (blocks - b);  // near-equal blocks
    float* accs[LANE_BLOCK];
    for (int s = 0; s < ns; ++s) accs[s] = acc + c.state[j0 + s] * D;
    const float* p = sp + j0;
    switch (ns) {
      case 1: accumulate_lanes<1, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
      case 2: accumulate_lanes<2, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
      case 3: accumulate_lanes<3, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
      case 4: accumulate_lanes<4, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
      case 5: accumulate_lanes<5, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
      default: accumulate_lanes<6, D>(accs, alphas + j0, p, kh, vh, off, tmin, tmax, b == 0 ? next : nullptr, n_next); break;
    }
    j0 += ns;
  }
}
constexpr bool HAVE_LANES = true;

// ---- Causal prefill attention (bf16, AVX512-BF16) ----
// A chunk's query rows against its contiguous context, bottom-right causal: query row i (of Lq)
// sees keys 0 .. i + Lk - Lq. torch's CPU flash attention ran this at ~55 G multiply-adds a second
// on the 2-core EPYC (4.4 ms a layer at 512 tokens, 37% of a 512-token prefill), where a bf16
// matmul of the same sizes runs ~400. Here the scores are vdpbf16ps of K pairs (16 keys in the
// lanes, K transposed once per call into pairs by key) times a query pair broadcast, four rows x
// 64 keys per pass (one broadcast for four vdpbf16ps); softmax online per block of 64 keys in
// fp32; P (fp32) times V widened to fp32 once per call, with FMAs. Work items: (query head, 16
// query rows), handed out dynamically (later rows see more keys).
template <int64_t D>
void prefill_causal_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                         float scale) {
  constexpr int64_t P = D / 2, KB = 64, QB = 16, NV = D / 16;
  constexpr int RG = D == 64 ? 4 : 2;  // rows per pass of the P x V products (their accumulators in registers)
  const int64_t Lq = q.size(0), H = q.size(1), Lk = k.size(0), Hkv = k.size(1), G = H / Hkv, off = Lk - Lq;
  const int64_t Lp = (Lk + KB - 1) / KB * KB;
  const auto* qp = reinterpret_cast<const c10::BFloat16*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const c10::BFloat16*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const c10::BFloat16*>(v.data_ptr());
  auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const int64_t q0 = q.stride(0), q1 = q.stride(1), k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0),
                v1 = v.stride(1), o0 = out.stride(0), o1 = out.stride(1);
  // kt[g][j / KB][p][j % KB]: pair p of key j of KV head g (0 past Lk); a block of keys one run (a pair's
  // rows Lp apart were 4 KB-aliased: 2048 tokens took 1.5x the time per key of 512)
  line_vector<uint32_t> kt(Hkv * P * Lp, 0u);
  line_vector<float> vf(Hkv * Lp * D, 0.f);     // vf[g][j][d]: V in fp32
  at::parallel_for(0, Lk, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t g = 0; g < Hkv; ++g) {
        const c10::BFloat16* kr = kp + j * k0 + g * k1;
        const c10::BFloat16* vr = vp + j * v0 + g * v1;
        uint32_t* kd = kt.data() + (g * Lp + j / KB * KB) * P + j % KB;
        for (int64_t p = 0; p < P; ++p) kd[p * KB] = load_pair(kr + 2 * p);
        for (int64_t d = 0; d < D; ++d) vf[(g * Lp + j) * D + d] = static_cast<float>(vr[d]);
      }
  });
  const int64_t qblocks = (Lq + QB - 1) / QB, items = H * qblocks;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
  const float minus_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    // the last query blocks first: they see the most keys
    const int64_t h = item % H, i0 = (qblocks - 1 - item / H) * QB, nr = std::min<int64_t>(QB, Lq - i0), g = h / G;
    alignas(64) uint32_t qq[QB][P] = {};  // the rows' query pairs (rows past nr zero)
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t p = 0; p < P; ++p) qq[r][p] = load_pair(qp + (i0 + r) * q0 + h * q1 + 2 * p);
    alignas(64) float o[QB][D] = {};
    float m[QB], l[QB], alpha[QB];
    for (int64_t r = 0; r < QB; ++r) m[r] = minus_inf, l[r] = 0.f;
    const uint32_t* ktg = kt.data() + g * Lp * P;
    const float* vfg = vf.data() + g * Lp * D;
    const int64_t kend = i0 + nr + off;  // keys the item's last row sees: 0 .. kend - 1
    for (int64_t kb = 0; kb < kend; kb += KB) {
      alignas(64) float s[QB][KB];
      for (int64_t r0 = 0; r0 < nr; r0 += 4) {  // scores, four rows at a time
        __m512 acc[4][4];
        for (int r = 0; r < 4; ++r)
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; ++p) {
          const uint32_t* kr = ktg + (kb * P + p * KB);
          __m512bh kv[4];
          for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + 16 * c);
          for (int r = 0; r < 4; ++r) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qq[r0 + r][p]));
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kv[c], b);
          }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int r = 0; r < 4 && r0 + r < QB; ++r)
          for (int c = 0; c < 4; ++c) _mm512_store_ps(s[r0 + r] + 16 * c, _mm512_mul_ps(acc[r][c], sc));
      }
      for (int64_t r = 0; r < nr; ++r) {  // online softmax: s becomes the weights p (0 where not seen)
        const int64_t seen = std::min<int64_t>(KB, std::max<int64_t>(0, i0 + r + off + 1 - kb));
        if (seen == 0) {
          alpha[r] = 1.f;
          std::fill(s[r], s[r] + KB, 0.f);
          continue;
        }
        __mmask16 mk[4];
        __m512 mx = _mm512_set1_ps(minus_inf);
        for (int c = 0; c < 4; ++c) {
          const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, seen - 16 * c));
          mk[c] = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
          mx = _mm512_mask_max_ps(mx, mk[c], mx, _mm512_load_ps(s[r] + 16 * c));
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
        alpha[r] = m[r] == minus_inf ? 0.f : std::exp(m[r] - m_new);
        __m512 sum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m_new);
        for (int c = 0; c < 4; ++c) {
          const __m512 pw = _mm512_maskz_mov_ps(mk[c], exp_nonpositive_v(_mm512_sub_ps(_mm512_load_ps(s[r] + 16 * c), mv)));
          _mm512_store_ps(s[r] + 16 * c, pw);
          sum = _mm512_add_ps(sum, pw);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
      }
      const int64_t nk = std::min<int64_t>(KB, kend - kb);
      for (int64_t r0 = 0; r0 < nr; r0 += RG) {  // o = alpha o + p V, RG rows at a time
        const int rg = static_cast<int>(std::min<int64_t>(RG, nr - r0));
        __m512 a[RG][NV];
        for (int r = 0; r < RG; ++r)
          for (int c = 0; c < NV; ++c)
            a[r][c] = r < rg ? _mm512_mul_ps(_mm512_load_ps(o[r0 + r] + 16 * c), _mm512_set1_ps(alpha[r0 + r]))
                             : _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; ++j) {
          const float* vr = vfg + (kb + j) * D;
          __m512 vv[NV];
          for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
          for (int r = 0; r < RG; ++r) {
            const __m512 pw = _mm512_set1_ps(r < rg ? s[r0 + r][j] : 0.f);
            for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ps(pw, vv[c], a[r][c]);
          }
        }
        for (int r = 0; r < rg; ++r)
          for (int c = 0; c < NV; ++c) _mm512_store_ps(o[r0 + r] + 16 * c, a[r][c]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      const float inv = 1.f / l[r];
      c10::BFloat16* dst = op + (i0 + r) * o0 + h * o1;
      for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(o[r][d] * inv);
    }
  }
}
constexpr bool HAVE_PREFILL = true;
#else
constexpr bool HAVE_LANES = false;
constexpr bool HAVE_PREFILL = false;
template <int64_t D>  // never called without AVX512-BF16 (HAVE_LANES is false)
void attend_lanes(const c10::BFloat16*, const c10::BFloat16*, const int64_t*, LaneChunk&, const uint32_t*, float*,
                  const int32_t*, const int32_t*, float, float, float*, const int64_t*, int64_t) {}
#endif

// HEAD_DIM > 0: the head dim as a compile-time constant (64, 128), so that the loops over it are
// unrolled and their accumulators stay in registers; 0: any head dim, read at run time.
// window > 0: request b attends over its last `window` positions only (those before are never
// read: their blocks may have been freed); soft_cap > 0: scores become cap * tanh(scores / cap).
// groups (nullptr: every query row its own request): request b's query rows are groups[b] ..
// groups[b + 1] - 1, consecutive tokens of one sequence (each row's seq_len one more than the
// previous one's), sharing block-table row b; a tile's K/V rows are read once for all of them.
template <typename T, int64_t HEAD_DIM>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                       const at::Tensor& out, int64_t window, double soft_cap, const int32_t* groups, int64_t B) {
  const int64_t H = q.size(1), D = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cached position
  const int64_t DV = D / W * W;  // head dims covered by whole vectors; the rest (D % 16) is scalar
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_table.stride(0);
  const float fscale = static_cast<float>(scale);
  const bool capped = soft_cap > 0.0;
  const float cap = static_cast<float>(soft_cap), inv_cap = capped ? 1.0f / cap : 0.f;
  // Work items: whole requests when there are enough of them, so that a tile's K/V rows of every
  // KV head are read together (a block is then one contiguous run, which the hardware
  // prefetchers follow), else (request, KV head) pairs so that a small batch still keeps every
  // thread busy.
  const int64_t heads_per_item = B >= 2 * at::get_num_threads() ? Hkv : 1;
  const int64_t items_per_req = Hkv / heads_per_item, QH = heads_per_item * G;  // query heads per item and row
  const int64_t items = B * items_per_req;
  int64_t max_rows = 1;  // query rows of the largest group
  for (int64_t b = 0; groups != nullptr && b < B; ++b) max_rows = std::max<int64_t>(max_rows, groups[b + 1] - groups[b]);
  const int64_t QS = max_rows * QH;  // softmax states per item
  // Split-KV: with fewer items than two per thread (batch 1: one per KV head, 3 for 2 threads
  // here), each item's positions are cut into runs of RUN_TILES tiles, computed as separate work
  // units, and their softmax states (max, sum, accumulator) merged at the end in run order. Runs
  // and tiles start at fixed positions (multiples of RUN and TILE), not at the item's first
  // position or by its length: a verification's row cuts its positions as the decode of that row
  // does, and so gets the same bits (runs past a row's positions are empty, and skipped).
  // an item's query rows: r0 .. r0 + nr - 1 (its request's group, or its one row)
  auto rows_of = [&](int64_t item) {
    const int64_t b = item / items_per_req, r0 = groups != nullptr ? groups[b] : b;
    return std::pair<int64_t, int64_t>(r0, groups != nullptr ? groups[b + 1] - r0 : 1);
  };
  const int64_t num_threads = at::get_num_threads();
  const bool split = items < 2 * num_threads;
  std::vector<int64_t> unit_item, unit_run, item_units(items + 1, 0);  // split: units per item, in run order
  for (int64_t item = 0; split && item < items; ++item) {
    const int64_t r0 = rows_of(item).first, nr = rows_of(item).second;
    const int64_t len = lens[r0 + nr - 1], lo = window > 0 ? std::max<int64_t>(0, lens[r0] - window) : 0;
    for (int64_t run = lo / RUN; run * RUN < len; ++run) unit_item.push_back(item), unit_run.push_back(run);
    item_units[item + 1] = static_cast<int64_t>(unit_item.size());
  }
  const int64_t units = split ? static_cast<int64_t>(unit_item.size()) : items;
  line_vector<float> partial(split ? units * QS * (D + 2) : 0);  // per unit and query state: m, l, acc[D]
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)));
  // bf16 with AVX512-BF16 and a head dim of 64 or 128: the KV head's states in lanes (above)
  constexpr bool lanes = HAVE_LANES && std::is_same_v<T, c10::BFloat16> && (HEAD_DIM == 64 || HEAD_DIM == 128);
  const int64_t chunks_per_head = (max_rows * G + LANES - 1) / LANES;  // lane chunks of a KV head's states
  const int64_t num_chunks = lanes ? heads_per_item * chunks_per_head : 0;

  // Dynamic scheduling, not at::parallel_for's static halves: contexts are ragged (and a core
  // may be busy elsewhere), so a fixed split leaves a thread idle at the end.
#pragma omp parallel num_threads(threads)
  {
    // per-thread scratch: the queries (fp32, scaled), the softmax states, a tile's scores and cache rows
    line_vector<float> qf(lanes ? 0 : QS * D), acc(QS * D), s(TILE), m(QS), l(QS);
    std::vector<int64_t> rows(2 * TILE);  // this tile's cache rows, then the next one's (prefetched)
    // lanes: the chunks, their query pairs [chunk][D / 2][LANES], a tile's scores [TILE][LANES]
    std::vector<LaneChunk> chunks(num_chunks);
    line_vector<uint32_t> qt(num_chunks * (D / 2) * LANES);
    line_vector<float> sp(lanes ? TILE * LANES : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t item = split ? unit_item[unit] : unit;
      // query rows r0 .. r0 + nr - 1; state r * QH + i is row r0 + r's query head h0 * G + i,
      // which uses KV head h0 + i / G
      const int64_t b = item / items_per_req, h0 = item % items_per_req * heads_per_item;
      const int64_t r0 = rows_of(item).first, nr = rows_of(item).second;
      const int64_t ns = nr * QH, len = lens[r0 + nr - 1];  // the last row sees the most positions
      if constexpr (lanes) {  // KV head g's states k = 0 .. nr * G - 1 in lane k % 16 of chunk k / 16
        std::fill(qt.begin(), qt.end(), 0u);
        for (LaneChunk& c : chunks) c.used = 0;  // chunks past this group's states stay empty
        for (int64_t g = 0; g < heads_per_item; ++g)
          for (int64_t k = 0; k < nr * G; ++k) {
            LaneChunk& c = chunks[g * chunks_per_head + k / LANES];
            const int64_t j = k % LANES, r = k / G, i = g * G + k % G;  // row r's query head h0 * G + i
            if (j == 0) {
              std::fill(c.m, c.m + LANES, -std::numeric_limits<float>::infinity());
              std::fill(c.l, c.l + LANES, 0.f);
            }
            c.state[j] = r * QH + i, c.row[j] = r, c.used = static_cast<int>(j + 1);
            const T* src = qp + (r0 + r) * q_s0 + (h0 * G + i) * q_s1;
            uint32_t* dst = qt.data() + (g * chunks_per_head + k / LANES) * (D / 2) * LANES + j;
            for (int64_t p = 0; p < D / 2; ++p) dst[p * LANES] = load_pair(reinterpret_cast<const c10::BFloat16*>(src) + 2 * p);
          }
      } else {
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t i = 0; i < QH; ++i) {  // the queries in fp32, scale folded in
            const T* src = qp + (r0 + r) * q_s0 + (h0 * G + i) * q_s1;
            for (int64_t d = 0; d < D; ++d) qf[(r * QH + i) * D + d] = static_cast<float>(src[d]) * fscale;
          }
      }
      std::fill(acc.begin(), acc.begin() + ns * D, 0.f);
      std::fill(m.begin(), m.begin() + ns, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + ns, 0.f);
      // the positions attended: lo .. len - 1 (all of them without a window), from the first
      // row's window start; row r sees lo_r .. lens[r0 + r] - 1 of them. Tiles from a multiple of
      // TILE (positions before lo_r masked), this unit's run's only where split.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[r0] - window) : 0;
      const int64_t first = split ? std::max(unit_run[unit] * RUN, lo / TILE * TILE) : lo / TILE * TILE;
      const int64_t last = split ? std::min(len, (unit_run[unit] + 1) * RUN) : len;
      for (int64_t start = first; start < last; start += TILE) {
        const int64_t n = std::min(TILE, last - start);
        // cache row of each position of this tile and the next, through the block table (the
        // block and the offset in it stepped along, not divided out per position)
        const int64_t n_next = std::min(TILE, std::max<int64_t>(0, last - start - TILE));
        for (int64_t t = 0, blk = start / block_size, in = start % block_size; t < n + n_next; ++t) {
          rows[t] = ((int64_t)bt[b * bt_s0 + blk] * block_size + in) * row;
          if (++in == block_size) in = 0, ++blk;
        }
        // the next tile's K/V rows of this item's KV heads toward the cache while this one is
        // computed (and, at a run's first tile, its own): a head's rows are a strided run (Hkv
        // heads to a position) that the hardware prefetchers follow poorly. Into L2 (prefetcht1),
        // not L1: a tile's lines (256 for one KV head of 64 dims) asked for at once into L1 wait
        // on its few miss buffers; into L2, 1 row from memory took 25% less time (30 layers at
        // 900 and 3,000 positions, 2-core EPYC), the same in cache; two tiles ahead no better.
        // In the lanes path only a run's first tile here: the next tile's rows are prefetched a
        // position at a time during each KV head's V pass (attend_lanes), which overlaps them with
        // the work (the burst here waited on the miss buffers: attention 3-10% slower, 2-core Xeon).
        const int64_t head_bytes = heads_per_item * D * int64_t(sizeof(T));
        for (int64_t t = start == first ? 0 : n; t < (lanes ? (start == first ? n : 0) : n + n_next); ++t)
          for (const T* cache : {kp, vp}) {  // every 64-byte line the item's heads touch
            const uintptr_t begin = reinterpret_cast<uintptr_t>(cache + rows[t] + h0 * D);
            for (uintptr_t line = begin & ~uintptr_t(63); line < begin + head_bytes; line += 64)
              __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
          }
        // One softmax state (row r's query head i) over positions t0 .. t1 - 1 of the tile: the
        // KV head's rows at kf + off[t], vf + off[t], read in place and widened as loaded.
        auto attend = [&](const T* kf, const T* vf, const int64_t* off, int64_t si, int64_t t0, int64_t t1) {
          // scores of the tile and their max (the group's later heads find the rows in L1)
          const float* qi = qf.data() + si * D;
          float tile_max = -std::numeric_limits<float>::infinity();
          int64_t t = t0;
          for (; t + 4 <= t1; t += 4) {  // four positions at a time: one reduction tree for their sums
            vec a[4] = {};
            for (int64_t d = 0; d < DV; d += W) {
              const vec qd = load_vec(qi + d);
              for (int j = 0; j < 4; ++j) a[j] += qd * load_vec(kf + off[t + j] + d);
            }
            hsum4(a[0], a[1], a[2], a[3], &s[t]);
            for (int j = 0; j < 4 && DV < D; ++j) {
              const T* k = kf + off[t + j];
              for (int64_t d = DV; d < D; ++d) s[t + j] += qi[d] * static_cast<float>(k[d]);
            }
          }
          for (; t < t1; ++t) {
            const T* k = kf + off[t];
            vec a = {};
            for (int64_t d = 0; d < DV; d += W) a += load_vec(qi + d) * load_vec(k + d);
            float dot = hsum(a);
            for (int64_t d = DV; d < D; ++d) dot += qi[d] * static_cast<float>(k[d]);
            s[t] = dot;
          }
          if (capped) {  // soft-capping is monotonic, but the max must be of the capped scores
#pragma omp simd
            for (int64_t t = t0; t < t1; ++t) s[t] = cap * tanh_vec(s[t] * inv_cap);
          }
          // the max after the scores, one vectorized pass (a running max was a chain of dependent
          // scalar maxes, one per position)
#pragma omp simd reduction(max : tile_max)
          for (int64_t t = t0; t < t1; ++t) tile_max = std::max(tile_max, s[t]);
          // online softmax: new running max, weights, rescale of what was accumulated so far
          const float m_new = std::max(m[si], tile_max);
          const float alpha = std::exp(m[si] - m_new);  // 0 on the first tile (m = -inf)
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = t0; t < t1; ++t) {
            s[t] = exp_nonpositive(s[t] - m_new);
            sum += s[t];
          }
          l[si] = l[si] * alpha + sum;
          m[si] = m_new;
          // weighted V rows into the fp32 accumulator, 4 vectors (64 dims) at a time
          float* ai = acc.data() + si * D;
          const float* p = s.data() + t0;
          const int64_t* rows_t = off + t0;
          const int64_t nt = t1 - t0;
          int64_t d = 0;
          for (; d + 4 * W <= DV; d += 4 * W) accumulate_rows<4>(ai + d, alpha, p, vf + d, rows_t, nt);
          for (; d < DV; d += W) accumulate_rows<1>(ai + d, alpha, p, vf + d, rows_t, nt);
          for (; d < D; ++d) {
            float a = ai[d] * alpha;
            for (int64_t t = 0; t < nt; ++t) a += p[t] * static_cast<float>(vf[rows_t[t] + d]);
            ai[d] = a;
          }
        };
        for (int64_t g = 0; g < heads_per_item; ++g) {  // KV head by KV head; each row's heads of its group
          const T* kh = kp + (h0 + g) * D;
          const T* vh = vp + (h0 + g) * D;
          if constexpr (lanes) {
            for (int64_t ci = g * chunks_per_head; ci < (g + 1) * chunks_per_head; ++ci) {
              LaneChunk& c = chunks[ci];
              alignas(64) int32_t t0s[LANES] = {}, t1s[LANES] = {};  // each lane's part of the tile
              for (int j = 0; j < c.used; ++j) {
                const int64_t len_r = lens[r0 + c.row[j]], lo_r = window > 0 ? std::max<int64_t>(0, len_r - window) : 0;
                t0s[j] = static_cast<int32_t>(std::max<int64_t>(0, lo_r - start));
                t1s[j] = static_cast<int32_t>(std::max<int64_t>(t0s[j], std::min<int64_t>(n, len_r - start)));
              }
              attend_lanes<HEAD_DIM>(reinterpret_cast<const c10::BFloat16*>(kh), reinterpret_cast<const c10::BFloat16*>(vh),
                                     rows.data(), c, qt.data() + ci * (D / 2) * LANES, acc.data(), t0s, t1s, fscale,
                                     static_cast<float>(soft_cap), sp.data(),
                                     ci == g * chunks_per_head ? rows.data() + n : nullptr, n_next);
            }
            continue;
          }
          for (int64_t c = g * nr * G; c < (g + 1) * nr * G; ++c) {
            const int64_t r = c / G % nr, i = g * G + c % G;  // head i of row r
            // this row's part of the tile: positions lo_r .. len_r - 1 only
            const int64_t len_r = lens[r0 + r], lo_r = window > 0 ? std::max<int64_t>(0, len_r - window) : 0;
            const int64_t t0 = std::max<int64_t>(0, lo_r - start), t1 = std::min<int64_t>(n, len_r - start);
            if (t1 <= t0) continue;  // none of its positions in this tile
            attend(kh, vh, rows.data(), r * QH + i, t0, t1);
          }
        }
      }
      if constexpr (lanes) {  // the lanes' running max and sum back to the states'
        for (int64_t ci = 0; ci < num_chunks; ++ci)
          for (int j = 0; j < chunks[ci].used; ++j) m[chunks[ci].state[j]] = chunks[ci].m[j], l[chunks[ci].state[j]] = chunks[ci].l[j];
      }
      if (split) {  // this run's softmax states, merged below
        for (int64_t si = 0; si < ns; ++si) {
          float* dst = partial.data() + (unit * QS + si) * (D + 2);
          dst[0] = m[si];
          dst[1] = l[si];
          std::memcpy(dst + 2, acc.data() + si * D, D * sizeof(float));
        }
        continue;
      }
      for (int64_t si = 0; si < ns; ++si) {
        const float inv = l[si] > 0.f ? 1.f / l[si] : 0.f;  // len 0 (never for a decode): zeros
        T* dst = op + (r0 + si / QH) * o_s0 + (h0 * G + si % QH) * o_s1;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[si * D + d] * inv);
      }
    }
    if (split) {  // after the loop's barrier: merge each item's runs in order (an empty run has m = -inf, l = 0)
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t h0 = item % items_per_req * heads_per_item;
        const int64_t r0 = rows_of(item).first, nr = rows_of(item).second;
        for (int64_t si = 0; si < nr * QH; ++si) {
          const int64_t i = si % QH;
          float m_all = -std::numeric_limits<float>::infinity();
          for (int64_t j = item_units[item]; j < item_units[item + 1]; ++j) m_all = std::max(m_all, partial[(j * QS + si) * (D + 2)]);
          float l_all = 0.f;
          std::fill(acc.begin(), acc.begin() + D, 0.f);
          for (int64_t j = item_units[item]; j < item_units[item + 1]; ++j) {
            const float* src = partial.data() + (j * QS + si) * (D + 2);
            if (src[1] == 0.f) continue;  // an empty run
            const float w = std::exp(src[0] - m_all);
            l_all += src[1] * w;
            for (int64_t d = 0; d < D; ++d) acc[d] += src[2 + d] * w;
          }
          const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
          T* dst = op + (r0 + si / QH) * o_s0 + (h0 * G + i) * o_s1;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
        }
      }
    }
  }
}

void check_decode_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& out, int64_t window,
                       double soft_cap, int64_t min_table_rows) {
  TORCH_CHECK(window >= 0 && soft_cap >= 0.0, "paged_decode: window and soft_cap must be >= 0 (0: none)");
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_table, &seq_lens, &out})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [B, H, D], caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: K and V caches must be contiguous and of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == k_cache.scalar_type(),
              "paged_decode: q, out and the caches must share a dtype");
  TORCH_CHECK(q.sizes() == out.sizes() && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: shapes do not match (q and out [B, H, D], H a multiple of Hkv)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode: q and out need a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) >= min_table_rows,
              "paged_decode: block_table [>= B, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() >= q.size(0),
              "paged_decode: seq_lens [>= B] int32");
}

void dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
              const at::Tensor& seq_lens, double scale, const at::Tensor& out, int64_t window, double soft_cap,
              const int32_t* groups, int64_t B) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 64: return paged_decode_impl<scalar_t, 64>(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap, groups, B);
      case 128: return paged_decode_impl<scalar_t, 128>(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap, groups, B);
      default: return paged_decode_impl<scalar_t, 0>(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap, groups, B);
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                  const at::Tensor& out, int64_t window, double soft_cap) {
  check_decode_args(q, k_cache, v_cache, block_table, seq_lens, out, window, soft_cap, q.size(0));
  dispatch(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap, nullptr, q.size(0));
}

// paged_decode with the query rows in groups: request b's rows are groups[b] .. groups[b + 1] - 1
// (consecutive tokens of one sequence, seq_lens one apart, block-table row b): what a speculative
// verification or a short prefill chunk needs, each K/V tile read once for the group's rows.
void paged_decode_grouped(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& groups,
                          double scale, const at::Tensor& out, int64_t window, double soft_cap) {
  check_decode_args(q, k_cache, v_cache, block_table, seq_lens, out, window, soft_cap, 0);
  TORCH_CHECK(groups.device().is_cpu() && groups.scalar_type() == at::kInt && groups.dim() == 1 &&
                  groups.is_contiguous() && groups.numel() >= 2,
              "paged_decode_grouped: groups [B + 1] int32");
  const int64_t B = groups.numel() - 1;
  const int32_t* g = groups.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(g[0] == 0 && g[B] == q.size(0), "paged_decode_grouped: groups must run from 0 to the number of rows");
  TORCH_CHECK(block_table.size(0) >= B, "paged_decode_grouped: block_table needs a row per group");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(g[b + 1] > g[b], "paged_decode_grouped: group ", b, " is empty");
    for (int64_t r = g[b] + 1; r < g[b + 1]; ++r)
      TORCH_CHECK(lens[r] == lens[r - 1] + 1, "paged_decode_grouped: the seq_lens of group ", b, " must rise by one a row");
  }
  dispatch(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap, g, B);
}

// Each new token's K and V rows into the cache at its slot (what two index_copy_ calls do, in one
// call): key/value [T, Hkv, D] with a contiguous last dim (views of the QKV projection), caches
// contiguous [num_blocks, block_size, Hkv, D] of the same dtype, slot_mapping [T] int64.
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : {&key, &value, &k_cache, &v_cache, &slot_mapping})
    TORCH_CHECK(t->device().is_cpu(), "write_kv: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "write_kv: K and V caches must be contiguous [blocks, block_size, Hkv, D] of one shape");
  const int64_t tokens = key.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == hkv && key.size(2) == d &&
                  value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == d && value.stride(1) == d,
              "write_kv: key and value must be [T, ", hkv, ", ", d, "] with contiguous heads, got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: key, value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.is_contiguous(),
              "write_kv: slot_mapping must be [T] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = hkv * d * k_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t)  // every slot checked before anything is written
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot ", slots[t], " of token ", t,
                " is outside the cache (", num_slots, " slots)");
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    std::memcpy(kc + slot * row_bytes, kp + t * ks, row_bytes);
    std::memcpy(vc + slot * row_bytes, vp + t * vs, row_bytes);
  }
}

// write_and_decode with grouped query rows (paged_decode_grouped).
at::Tensor write_and_decode_grouped(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                    const at::Tensor& seq_lens, const at::Tensor& groups, double scale, int64_t window,
                                    double soft_cap);

// Causal prefill of one chunk (prefill_causal_impl): q [Lq, H, D] against the chunk's whole context
// k, v [Lk, Hkv, D] (Lk >= Lq, its last Lq positions the queries'), into out [Lq, H, D]; bf16, head
// dim 64 or 128, the last dims contiguous.
void prefill_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_causal: bfloat16 tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes() &&
                  q.size(2) == k.size(2) && k.size(0) >= q.size(0) && q.size(1) % k.size(1) == 0,
              "prefill_causal: q, out [Lq, H, D] and k, v [Lk >= Lq, Hkv, D] with H a multiple of Hkv");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_causal: the head dim must be contiguous");
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (q.size(0) == 0) return;
  if (q.size(2) == 64) return prefill_causal_impl<64>(q, k, v, out, static_cast<float>(scale));
  if (q.size(2) == 128) return prefill_causal_impl<128>(q, k, v, out, static_cast<float>(scale));
#endif
  TORCH_CHECK(false, "prefill_causal: needs AVX512-BF16 and a head dim of 64 or 128");
}

// A step of decodes only, one call per layer: the new K/V rows into the caches, then attention.
at::Tensor write_and_decode(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            int64_t window, double soft_cap) {
  write_kv(key, value, k_cache, v_cache, slot_mapping);
  at::Tensor out = at::empty(q.sizes(), q.options());
  paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, out, window, soft_cap);
  return out;
}

at::Tensor write_and_decode_grouped(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                    const at::Tensor& seq_lens, const at::Tensor& groups, double scale, int64_t window,
                                    double soft_cap) {
  write_kv(key, value, k_cache, v_cache, slot_mapping);
  at::Tensor out = at::empty(q.sizes(), q.options());
  paged_decode_grouped(q, k_cache, v_cache, block_table, seq_lens, groups, scale, out, window, soft_cap);
  return out;
}

}  // namespace

TORCH_LIBRARY(paged_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, Tensor(a!) out, int window=0, float soft_cap=0.) -> ()", &paged_decode);
}

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // the same kernels, called from eager code without the dispatcher;
  // the GIL is released while they run, as torch's own ops do
  m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("out"), py::arg("window") = 0, py::arg("soft_cap") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_causal", &prefill_causal, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("has_prefill_causal") = HAVE_PREFILL;  // this CPU's build has it (AVX512-BF16)
  m.def("write_and_decode", &write_and_decode, py::arg("q"), py::arg("key"), py::arg("value"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("soft_cap") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_grouped", &paged_decode_grouped, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("groups"), py::arg("scale"), py::arg("out"),
        py::arg("window") = 0, py::arg("soft_cap") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("write_and_decode_grouped", &write_and_decode_grouped, py::arg("q"), py::arg("key"), py::arg("value"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("groups"), py::arg("scale"), py::arg("window") = 0, py::arg("soft_cap") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  // the two C++ functions for other native code (paged.models.cpu_layer_ops' DecoderPlan)
  m.attr("write_and_decode_capsule") =
      py::capsule(reinterpret_cast<void*>(&write_and_decode), "paged.cpu_decode.write_and_decode");
  m.attr("write_and_decode_grouped_capsule") =
      py::capsule(reinterpret_cast<void*>(&write_and_decode_grouped), "paged.cpu_decode.write_and_decode_grouped");
}
