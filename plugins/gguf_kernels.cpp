// GGUF block weights (codes of 4, 5, 6 or 8 bits, two-level scales) x bfloat16 activations on
// AVX-512 BF16 CPUs, with bf16 panels for many rows (on AMX tiles, or in vdpbf16ps register blocks
// without AMX; or, with int8_panels, int8 codes and activations for vpdpbusd); built and loaded by
// gguf_kernels.py (see its docstring for the layout and the arithmetic).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <torch/python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGED_GGUF_AVX512 1
#endif
#if defined(PAGED_GGUF_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGED_GGUF_AMX 1
#endif

namespace {

constexpr int64_t CHUNK = 64;  // inputs per chunk of codes
constexpr int64_t ROW_GRAIN = 16;
// x rows per pass over the weights in the few-rows path (speculative verification runs 2-8)
constexpr int64_t ROWS_PER_PASS = 8;
constexpr int64_t PREFETCH_BYTES = 8192;  // as quant_kernels.cpp: a call is too short for the hardware prefetchers
constexpr int64_t PANEL = 32;             // many rows: weight rows dequantized at once (two B tiles' worth)

// The packed layout of one weight: per row, the codes of each 64-input chunk (chunk_bytes),
// then (two-level) the int8 scale and offset codes per group, then the float16 super-block
// scales and offsets. bits 2 and 3 are held as 4.
struct Format {
  int bits, group, super_block;
  bool interleaved = false;  // 16 rows interleaved (see X16 below)
  bool two_level() const { return super_block != group; }
  int64_t chunk_bytes() const { return bits == 8 ? 64 : 32 + 8 * (bits - 4); }
  int64_t row_bytes(int64_t K) const {
    return K / CHUNK * chunk_bytes() + (two_level() ? 2 * (K / group) : 0) + 4 * (K / super_block);
  }
};

bool available() {
#ifdef PAGED_GGUF_AVX512
  return true;
#else
  return false;
#endif
}

// Few rows of interleaved weights on AMX tiles (gemm_rows_x16_amx) where the CPU has them; off only
// to compare with the vdpbf16ps kernel (benchmarks/gguf_gemm.py, set_amx_few_rows)
std::atomic<bool> amx_few_rows{true};

bool amx_available() {
#ifdef PAGED_GGUF_AMX
  // Linux hands out the AMX tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); without it the first tile instruction faults.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef PAGED_GGUF_AVX512
// A row's scales and offsets of groups g .. g + 15 (lanes past the mask k zero) as two vectors:
// scale_g = d_s * a_g, offset_g = dm_s * o_g (one-level: d_g, dm_g). (G a template argument and
// the super-block 256 or G: no integer division per row at run time.)
template <int G>
inline void group_vectors(const uint8_t* row, int64_t K, const Format& f, int64_t g, __mmask16 k, __m512& scale,
                          __m512& offset) {
  constexpr int64_t per = 256 / G;  // groups per super-block of two-level types
  const int64_t groups = K / G;
  const uint8_t* meta = row + K / CHUNK * f.chunk_bytes();
  if (!f.two_level()) {
    const uint16_t* d = reinterpret_cast<const uint16_t*>(meta);
    scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + g));
    offset = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + groups + g));
    return;
  }
  const int8_t* a = reinterpret_cast<const int8_t*>(meta);
  const int8_t* o = a + groups;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(meta + 2 * groups);
  const uint16_t* dm = d + K / 256;
  // the super-block of each of the 16 groups: g / per + lane / per (per = 8 or 16)
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = per == 16 ? _mm512_setzero_si512() : _mm512_srli_epi32(lane, 3);
  const int64_t s0 = g / per, ns = std::min<int64_t>(K / 256 - s0, 2);
  const __mmask16 ks = __mmask16((1u << ns) - 1);
  const __m512 ds = _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, d + s0)));
  const __m512 dms = _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, dm + s0)));
  scale = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, a + g))));
  offset = _mm512_mul_ps(dms, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, o + g))));
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// A row's scale and offset per group, in float32, into scale[K / G] and offset[K / G].
template <int G>
inline void row_scales(const uint8_t* row, int64_t K, const Format& f, float* scale, float* offset) {
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 k = first_lanes(groups - g);
    __m512 s, o;
    group_vectors<G>(row, K, f, g, k, s, o);
    _mm512_mask_storeu_ps(scale + g, k, s);
    _mm512_mask_storeu_ps(offset + g, k, o);
  }
}
#endif

#ifdef PAGED_GGUF_AVX512
inline __mmask32 load_mask32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return _cvtu32_mask32(bits);
}

// One 64-input chunk's codes as two vectors of 32 uint16 lanes (inputs 0-31, 32-63).
template <int BITS>
inline void decode_chunk(const uint8_t* c, __m512i& h0, __m512i& h1) {
  if constexpr (BITS == 8) {
    h0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
    h1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)));
  } else {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
    h0 = _mm512_and_si512(v, _mm512_set1_epi16(0x000f));
    h1 = _mm512_srli_epi16(v, 4);
    for (int p = 0; p < BITS - 4; ++p) {  // bit plane p: bit i is input i's bit 4 + p (added: the lanes hold < 16 before)
      const __m512i bit = _mm512_set1_epi16(int16_t(16 << p));
      h0 = _mm512_mask_add_epi16(h0, load_mask32(c + 32 + 8 * p), h0, bit);
      h1 = _mm512_mask_add_epi16(h1, load_mask32(c + 36 + 8 * p), h1, bit);
    }
  }
}

// Lane scales for one 32-input half, from the vector of a 16-group block's scales: vdpbf16ps
// lane l holds inputs 2l, 2l + 1, so with groups of 32 every lane takes group 2 cc + half of the
// block (cc its chunk), with groups of 16 lanes 0-7 take group 4 cc + 2 half and lanes 8-15 the
// next. A permute, not a scalar in memory: the scales never leave the registers.
template <int G>
inline __m512 half_scales(__m512 block, int64_t cc, int half) {
  if constexpr (G == 32) {
    return _mm512_permutexvar_ps(_mm512_set1_epi32(int(2 * cc + half)), block);
  } else {
    const int g = int(4 * cc + 2 * half);
    return _mm512_permutexvar_ps(_mm512_set_epi32(g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g, g, g, g, g,
                                                  g, g, g),
                                 block);
  }
}

struct Ctx {
  int64_t K, N;
  Format f;
  const uint16_t* xb;  // x [M, K] bf16 bits
  const float* xs;     // per group of x, the sum of x [M, K / group]
  uint16_t* out;       // [M, N] bf16 bits, or null where outf is not
  const int8_t* xq;    // int8 activations: x [M, K] quantized per 32 inputs (or null)
  const float* xql;    // their scales, lane-expanded per 64-input chunk [M, K / 64, 16] (few rows)
  const float* dx;     // their scales per 32 inputs [M, K / 32] (int8 panels)
  int64_t stride;      // f.row_bytes(K), computed once per call (it divides)
  const uint16_t* xw;  // few rows (tile_words): x in the codes' word order [M, K] (word_order_x), else null
  float* outf = nullptr;  // [M, N] float32 (gemm_f32: the LM head's logits, not rounded to bf16)
};

// outputs n .. n + 15 of row m, or output n alone, as bf16 or (gemm_f32) float32
inline void store16(const Ctx& ctx, int64_t m, int64_t n, __m512 v) {
  if (ctx.outf != nullptr) _mm512_storeu_ps(ctx.outf + m * ctx.N + n, v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(ctx.out + m * ctx.N + n), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store1(const Ctx& ctx, int64_t m, int64_t n, float v) {
  if (ctx.outf != nullptr) ctx.outf[m * ctx.N + n] = v;
  else ctx.out[m * ctx.N + n] = f_to_bf16(v);
}

constexpr int AND_OR = 0xEA;  // (A & B) | C as a ternary-logic table

// R output rows from row n for MT x rows from m0, 16 groups (a block) at a time: the rows'
// scales and offsets of the block as vectors; per half-chunk, vdpbf16ps of the codes as the bf16
// numbers 128 + u (exact: u < 128) with x, times the lane scales; then the block's sum_g
// (offset_g - 128 scale_g) * xsum_g. 8 bits: u = lo + 16 hi, both nibbles in one accumulation
// (below), offsets less 2176 scale_g. The order of the sums is the same for every R and MT.
template <int BITS, int G, int R, int MT>
void tile(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
  const int64_t K = ctx.K, groups = K / G, stride = ctx.stride, cb = ctx.f.chunk_bytes();
  constexpr int64_t BLOCK_CHUNKS = 16 * G / CHUNK;  // chunks of a 16-group block: 8 or 4
  const uint16_t* xb = ctx.xb + m0 * K;
  const float* xs = ctx.xs + m0 * groups;
  __m512 acc[R][MT], acc1[R][MT];  // two per output: the halves' FMA chains stay independent
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = acc1[r][m] = _mm512_setzero_ps();
  const __m512i bias = _mm512_set1_epi16(0x4300);  // bf16 128.0: | u makes 128 + u
  const __m512 lift = _mm512_set1_ps(BITS == 8 ? -2176.f : -128.f);
  auto chunk = [&](int64_t c, int64_t cc, const __m512 (&scale)[R]) {
    // With one weight row per tile (MT >= 3) each x chunk is used once: loaded where it is
    // used, so that 8 rows' accumulators fit the 32 registers; with R rows, loaded once.
    __m512i x0[R == 1 ? 1 : MT], x1[R == 1 ? 1 : MT];
    if constexpr (R > 1) {
      for (int m = 0; m < MT; ++m) {
        x0[m] = _mm512_loadu_si512(xb + m * K + CHUNK * c);
        x1[m] = _mm512_loadu_si512(xb + m * K + CHUNK * c + 32);
      }
    }
    auto x_lo = [&](int m) {
      if constexpr (R == 1) return _mm512_loadu_si512(xb + m * K + CHUNK * c);
      else return x0[m];
    };
    auto x_hi = [&](int m) {
      if constexpr (R == 1) return _mm512_loadu_si512(xb + m * K + CHUNK * c + 32);
      else return x1[m];
    };
    for (int r = 0; r < R; ++r) {
      __m512i h0, h1;
      decode_chunk<BITS>(w + r * stride + cb * c, h0, h1);
      const __m512 s0 = half_scales<G>(scale[r], cc, 0), s1 = half_scales<G>(scale[r], cc, 1);
      if constexpr (BITS == 8) {
        // u = lo + 16 hi: lo as the bf16 number 128 + lo, hi as 2048 + 16 hi (0x4500 | hi: the
        // exponent 4 higher), so one accumulation of both gives sum (u + 2176) x
        const __m512i lo0 = _mm512_ternarylogic_epi32(h0, _mm512_set1_epi16(15), bias, AND_OR);
        const __m512i lo1 = _mm512_ternarylogic_epi32(h1, _mm512_set1_epi16(15), bias, AND_OR);
        const __m512i hi0 = _mm512_or_si512(_mm512_srli_epi16(h0, 4), _mm512_set1_epi16(0x4500));
        const __m512i hi1 = _mm512_or_si512(_mm512_srli_epi16(h1, 4), _mm512_set1_epi16(0x4500));
        for (int m = 0; m < MT; ++m) {
          const __m512i xa = x_lo(m), xb1 = x_hi(m);
          const __m512 t0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo0, (__m512bh)xa),
                                             (__m512bh)hi0, (__m512bh)xa);
          const __m512 t1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo1, (__m512bh)xb1),
                                             (__m512bh)hi1, (__m512bh)xb1);
          acc[r][m] = _mm512_fmadd_ps(t0, s0, acc[r][m]);
          acc1[r][m] = _mm512_fmadd_ps(t1, s1, acc1[r][m]);
        }
      } else {
        const __m512i c0 = _mm512_or_si512(h0, bias), c1 = _mm512_or_si512(h1, bias);
        for (int m = 0; m < MT; ++m) {
          acc[r][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)c0, (__m512bh)x_lo(m)), s0, acc[r][m]);
          acc1[r][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)c1, (__m512bh)x_hi(m)), s1, acc1[r][m]);
        }
      }
    }
  };
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 k = first_lanes(groups - g0);
    __m512 scale[R], lifted[R];  // lifted: offset_g - 128 scale_g (8 bits: - 2176 scale_g)
    for (int r = 0; r < R; ++r) {
      __m512 offset;
      group_vectors<G>(w + r * stride, K, ctx.f, g0, k, scale[r], offset);
      lifted[r] = _mm512_fmadd_ps(scale[r], lift, offset);
    }
    const int64_t c0 = g0 * G / CHUNK;
    if (groups - g0 >= 16) {
#pragma GCC unroll 8
      for (int64_t cc = 0; cc < BLOCK_CHUNKS; ++cc) chunk(c0 + cc, cc, scale);  // constant permutes
    } else {
      for (int64_t cc = 0; cc < (groups - g0) * G / CHUNK; ++cc) chunk(c0 + cc, cc, scale);
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(lifted[r], _mm512_maskz_loadu_ps(k, xs + m * groups + g0), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      store1(ctx, m0 + m, n + r, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], acc1[r][m])));
}

// Inputs per 64 bytes of codes (a "unit"): two 4-bit chunks, or one 8-bit chunk.
template <int BITS>
constexpr int64_t unit_inputs() { return BITS == 4 ? 128 : 64; }

// x rows in the order tile_words reads the codes: a unit's 64 bytes as 32 16-bit words (word i =
// bytes 2i, 2i + 1) give four vectors of 32 codes, the nibbles at bits 0, 4, 8 and 12 of each word
// (A, B, C, D); x holds, per unit, the inputs of those lanes in that order. 4 bits (byte b of a
// unit holds inputs lo(b) = 64 (b / 32) + b % 32 and lo(b) + 32): A lo(2i), B lo(2i) + 32,
// C lo(2i + 1), D lo(2i + 1) + 32. 8 bits (byte b is input b; low nibble A/C, high B/D): A and B
// take x[2i], C and D x[2i + 1], stored once each. K is a whole number of units.
template <int BITS>
void word_order_x(const uint16_t* xb, int64_t M, int64_t K, uint16_t* xw) {
  constexpr int64_t U = unit_inputs<BITS>();
  auto lo = [](int64_t b) { return 64 * (b / 32) + b % 32; };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t u0 = 0; u0 < K; u0 += U) {
      const uint16_t* x = xb + m * K + u0;
      uint16_t* out = xw + m * K + u0;
      for (int64_t i = 0; i < 32; ++i) {
        if constexpr (BITS == 4) {
          out[i] = x[lo(2 * i)];
          out[32 + i] = x[lo(2 * i) + 32];
          out[64 + i] = x[lo(2 * i + 1)];
          out[96 + i] = x[lo(2 * i + 1) + 32];
        } else {
          out[i] = x[2 * i];
          out[32 + i] = x[2 * i + 1];
        }
      }
    }
}

// The lane scales of a unit's A/C (PART 0) or B/D (PART 1) vectors, from the vector of its
// 16-group block's scales (uu: the unit's place in the block). vdpbf16ps lane l holds words 2l,
// 2l + 1, i.e. bytes 4l .. 4l + 3 of the unit: 4 bits, groups of 32: lanes 0-7 group 4 uu + PART,
// 8-15 group 4 uu + 2 + PART; groups of 16: lanes in fours, groups 8 uu + 2 PART + {0, 1, 4, 5};
// 8 bits (PART 0 only): lanes 0-7 group 2 uu, 8-15 group 2 uu + 1.
template <int BITS, int G, int PART, int UU>
inline __m512 word_scales(__m512 block) {
  constexpr int uu = UU;
  int g[4];
  if constexpr (BITS == 8) {
    g[0] = g[1] = 2 * uu;
    g[2] = g[3] = 2 * uu + 1;
  } else if constexpr (G == 32) {
    g[0] = g[1] = 4 * uu + PART;
    g[2] = g[3] = 4 * uu + 2 + PART;
  } else {
    g[0] = 8 * uu + 2 * PART, g[1] = g[0] + 1, g[2] = g[0] + 4, g[3] = g[0] + 5;
  }
  return _mm512_permutexvar_ps(_mm512_set_epi32(g[3], g[3], g[3], g[3], g[2], g[2], g[2], g[2], g[1], g[1], g[1], g[1],
                                                g[0], g[0], g[0], g[0]),
                               block);
}

// As tile (the same sums per group and the same offsets' term), for 4- and 8-bit codes: each unit
// of 64 code bytes is read as one vector of words and its four nibble positions become four
// vectors of bf16 numbers with a shift and a ternary logic each (no widening, no byte permute),
// against x in the matching order (Ctx::xw); the two vectors of a lane's group go into one
// vdpbf16ps chain before their scale (one FMA per 64 codes, not per 32). Sums in another order
// than tile's, the same for every R and MT.
template <int BITS, int G, int R, int MT>
void tile_words(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
  constexpr int64_t U = unit_inputs<BITS>();
  constexpr int64_t BLOCK_UNITS = 16 * G / U;  // units of a 16-group block: 4 or 2 (4 bits), 8 (8 bits)
  const int64_t K = ctx.K, groups = K / G, stride = ctx.stride, kw = K;
  const uint16_t* xw = ctx.xw + m0 * kw;
  const float* xs = ctx.xs + m0 * groups;
  __m512 acc[R][MT], acc1[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = acc1[r][m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x000f);
  const __m512i bias = _mm512_set1_epi16(0x4300);                              // bf16 128.0: | u makes 128 + u
  const __m512i bias_hi = _mm512_set1_epi16(BITS == 8 ? 0x4500 : 0x4300);      // 8 bits: 2048 + 16 hi
  const __m512 lift = _mm512_set1_ps(BITS == 8 ? -2176.f : -128.f);
  // unit u, the block's unit UU (a constant: the lane scales are constant permutes)
  auto unit = [&](int64_t u, auto uu_c, const __m512 (&scale)[R]) {
    constexpr int UU = decltype(uu_c)::value;
    for (int r = 0; r < R; ++r) {
      const uint8_t* c = w + r * stride + 64 * u;
      const __m512i v = _mm512_loadu_si512(c);
      const __m512i a = _mm512_ternarylogic_epi32(v, nibble, bias, AND_OR);
      const __m512i b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, bias_hi, AND_OR);
      const __m512i cc = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nibble, bias, AND_OR);
      const __m512i d = _mm512_or_si512(_mm512_srli_epi16(v, 12), bias_hi);
      if constexpr (BITS == 8) {
        const __m512 s = word_scales<BITS, G, 0, UU>(scale[r]);
        for (int m = 0; m < MT; ++m) {
          const __m512i xe = _mm512_loadu_si512(xw + m * kw + U * u), xo = _mm512_loadu_si512(xw + m * kw + U * u + 32);
          const __m512 t0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)a, (__m512bh)xe),
                                             (__m512bh)b, (__m512bh)xe);
          const __m512 t1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)cc, (__m512bh)xo),
                                             (__m512bh)d, (__m512bh)xo);
          acc[r][m] = _mm512_fmadd_ps(t0, s, acc[r][m]);
          acc1[r][m] = _mm512_fmadd_ps(t1, s, acc1[r][m]);
        }
      } else {
        const __m512 s0 = word_scales<BITS, G, 0, UU>(scale[r]), s1 = word_scales<BITS, G, 1, UU>(scale[r]);
        for (int m = 0; m < MT; ++m) {
          const uint16_t* x = xw + m * kw + U * u;
          const __m512 t0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)a, (__m512bh)_mm512_loadu_si512(x)),
                                             (__m512bh)cc, (__m512bh)_mm512_loadu_si512(x + 64));
          const __m512 t1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)b, (__m512bh)_mm512_loadu_si512(x + 32)),
                                             (__m512bh)d, (__m512bh)_mm512_loadu_si512(x + 96));
          acc[r][m] = _mm512_fmadd_ps(t0, s0, acc[r][m]);
          acc1[r][m] = _mm512_fmadd_ps(t1, s1, acc1[r][m]);
        }
      }
    }
  };
  alignas(64) float lifted_mem[R][16];  // in memory while the block multiplies: the registers hold the codes
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 k = first_lanes(groups - g0);
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      __m512 offset;
      group_vectors<G>(w + r * stride, K, ctx.f, g0, k, scale[r], offset);
      _mm512_store_ps(lifted_mem[r], _mm512_fmadd_ps(scale[r], lift, offset));  // offset_g - 128 scale_g (8 bits: - 2176)
    }
    const int64_t u0 = g0 * G / U;
    const int64_t units = std::min<int64_t>(groups - g0, 16) * G / U;  // a last block may hold fewer
    auto each = [&](auto uu_c) {
      constexpr int UU = decltype(uu_c)::value;
      if (UU < units) unit(u0 + UU, uu_c, scale);
    };
    each(std::integral_constant<int, 0>{});
    each(std::integral_constant<int, 1>{});
    if constexpr (BLOCK_UNITS > 2) {
      each(std::integral_constant<int, 2>{});
      each(std::integral_constant<int, 3>{});
    }
    if constexpr (BLOCK_UNITS > 4) {
      each(std::integral_constant<int, 4>{});
      each(std::integral_constant<int, 5>{});
      each(std::integral_constant<int, 6>{});
      each(std::integral_constant<int, 7>{});
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m)
        acc[r][m] = _mm512_fmadd_ps(_mm512_load_ps(lifted_mem[r]), _mm512_maskz_loadu_ps(k, xs + m * groups + g0), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      store1(ctx, m0 + m, n + r, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], acc1[r][m])));
}

// The next panel's 32 weight rows (one contiguous run of bytes) toward the cache while this one
// is prepared and multiplied: 16 rows read at a stride are too many streams for the hardware
// prefetchers to follow.
inline void prefetch_panel(const uint8_t* w, int64_t stride, int64_t p, int64_t p1) {
  if (p + 1 >= p1) return;
  const char* next = reinterpret_cast<const char*>(w + (p + 1) * PANEL * stride);
  for (int64_t b = 0; b < PANEL * stride; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
}

// In each 128-bit lane, the 4 x 4 dwords of every four vectors r[i .. i + 3] transposed in place
// (vector i + d then holds dword d of the four): the first two steps of the transposes below.
template <int N>
inline void transpose_lanes4(__m512i r[N], __m512i t[N]) {
  for (int i = 0; i < N; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < N; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
}

// 16 vectors of 16 dwords, transposed in place (rows[i][j] <-> rows[j][i]).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  transpose_lanes4<16>(r, t);
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88),
                               t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// One 64-input chunk's codes as 64 bytes, input i in byte i.
template <int BITS>
inline __m512i decode_bytes(const uint8_t* c) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(c);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, nib)),
                                   _mm256_and_si256(_mm256_srli_epi16(b, 4), nib), 1);
    for (int p = 0; p < BITS - 4; ++p) {
      uint64_t plane;
      std::memcpy(&plane, c + 32 + 8 * p, 8);
      v = _mm512_mask_add_epi8(v, _cvtu64_mask64(plane), v, _mm512_set1_epi8(char(16 << p)));
    }
    return v;
  }
}

// 16 weight rows' (from w) scales and offsets per group as vectors over the rows: group g's at
// scale / offset + g * group_stride, 16 floats (row r in lane r). scratch: 32 x K / G floats,
// rounded up to 16 groups.
template <int G>
void scales_over_rows(const uint8_t* w, int64_t stride, int64_t K, const Format& f, float* scale, float* offset,
                      int64_t group_stride, float* scratch) {
  const int64_t groups = K / G, padded = (groups + 15) / 16 * 16;
  float* row_scale = scratch;  // [16 rows][padded], then the offsets alike: transposed 16 x 16 below
  float* row_offset = scratch + 16 * padded;
  for (int r = 0; r < 16; ++r) row_scales<G>(w + r * stride, K, f, row_scale + r * padded, row_offset + r * padded);
  for (int which = 0; which < 2; ++which) {
    const float* src = which == 0 ? row_scale : row_offset;
    float* dst = which == 0 ? scale : offset;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_castps_si512(_mm512_loadu_ps(src + r * padded + g0));
      transpose16(v);  // v[j]: group g0 + j of the 16 rows
      for (int j = 0; j < 16 && g0 + j < groups; ++j) _mm512_storeu_si512(dst + (g0 + j) * group_stride, v[j]);
    }
  }
}

// A panel's (32 weight rows from w) scales and offsets: [K / G][2 halves][16 rows] floats.
template <int G>
void panel_scales(const uint8_t* w, int64_t stride, int64_t K, const Format& f, float* scale, float* offset,
                  float* scratch) {
  for (int half = 0; half < 2; ++half)
    scales_over_rows<G>(w + 16 * half * stride, stride, K, f, scale + 16 * half, offset + 16 * half, 32, scratch);
}

#ifdef __AVX512VNNI__
// The int8-activation variant of tile(): x quantized per 32 inputs (llama.cpp's Q8 activations),
// vpdpbusd multiplies 64 codes (unsigned) by 64 int8 x per instruction into 16 int32 lanes (lane
// l: inputs 4l .. 4l + 3), converted and scaled per lane by the weight group's scale times the x
// block's; the offsets use the exact sums of x.
template <int BITS, int G, int R, int MT>
void tile_int8(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
  const int64_t K = ctx.K, groups = K / G, stride = ctx.stride, cb = ctx.f.chunk_bytes(), chunks = K / CHUNK;
  constexpr int64_t BLOCK_CHUNKS = 16 * G / CHUNK;
  const int8_t* xq = ctx.xq + m0 * K;
  const float* xql = ctx.xql + m0 * chunks * 16;
  const float* xs = ctx.xs + m0 * groups;
  // lane l of a chunk is inputs 4l .. 4l + 3: group 2cc + l / 8 (G = 32) or 4cc + l / 4 (G = 16) of the block
  const __m512i lane_group = G == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                     : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  auto chunk = [&](int64_t c, int64_t cc, const __m512 (&scale)[R]) {
    const __m512i idx = _mm512_add_epi32(lane_group, _mm512_set1_epi32(int(cc * (CHUNK / G))));
    __m512i x[MT];
    for (int m = 0; m < MT; ++m) x[m] = _mm512_loadu_si512(xq + m * K + CHUNK * c);
    for (int r = 0; r < R; ++r) {
      const __m512i codes = decode_bytes<BITS>(w + r * stride + cb * c);
      const __m512 sw = _mm512_permutexvar_ps(idx, scale[r]);
      for (int m = 0; m < MT; ++m) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x[m]);
        const __m512 lane_scale = _mm512_mul_ps(sw, _mm512_loadu_ps(xql + (m * chunks + c) * 16));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_scale, acc[r][m]);
      }
    }
  };
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 k = first_lanes(groups - g0);
    __m512 scale[R], offset[R];
    for (int r = 0; r < R; ++r) group_vectors<G>(w + r * stride, K, ctx.f, g0, k, scale[r], offset[r]);
    const int64_t c0 = g0 * G / CHUNK;
    if (groups - g0 >= 16) {
#pragma GCC unroll 8
      for (int64_t cc = 0; cc < BLOCK_CHUNKS; ++cc) chunk(c0 + cc, cc, scale);
    } else {
      for (int64_t cc = 0; cc < (groups - g0) * G / CHUNK; ++cc) chunk(c0 + cc, cc, scale);
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(offset[r], _mm512_maskz_loadu_ps(k, xs + m * groups + g0), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) store1(ctx, m0 + m, n + r, _mm512_reduce_add_ps(acc[r][m]));
}

// The many-rows path with int8 activations (AVX-512 VNNI, no AMX): 32 weight rows' codes as
// bytes, transposed so that one vector holds 4 consecutive inputs of 16 rows (the layout of
// AMX's int8 B tiles), with panel_scales()'s vectors. Nothing is rounded: the codes are the
// file's. The codes of a panel are [K / 4][2 halves][16 rows] uint32.
template <int BITS, int G>
void prepare_int8_panel(const uint8_t* w, int64_t stride, int64_t K, const Format& f, uint32_t* codes, float* scale,
                        float* offset, float* scratch) {
  panel_scales<G>(w, stride, K, f, scale, offset, scratch);
  const int64_t cb = f.chunk_bytes();
  for (int half = 0; half < 2; ++half) {
    const uint8_t* rows = w + 16 * half * stride;
    for (int64_t c = 0; c < K / CHUNK; ++c) {
      __m512i v[16];  // v[r]: row r's 64 codes, dword j = inputs 4j .. 4j + 3
      for (int r = 0; r < 16; ++r) v[r] = decode_bytes<BITS>(rows + r * stride + cb * c);
      transpose16(v);  // v[j]: inputs 4j .. 4j + 3 of the 16 rows
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(codes + ((16 * c + j) * 2 + half) * 16, v[j]);
    }
  }
}

// MR x rows from m0 times a prepared panel (weight rows n0 .. n0 + 31): per group, vpdpbusd of
// the panel's two vectors (16 rows x 4 codes each) with a broadcast of 4 int8 x into int32
// lanes, then in fp32 times the rows' group scale and the x block's scale, plus the rows' group
// offset times the sum of x (bf16, not quantized) over the group.
template <int G, int MR>
void int8_panel_rows(const uint32_t* codes, const float* scale, const float* offset, const Ctx& ctx, int64_t m0,
                     int64_t n0) {
  const int64_t K = ctx.K, groups = K / G, blocks = K / 32;
  const int8_t* xq = ctx.xq + m0 * K;
  // the sums over groups in memory (touched once a group), the registers for the group's dot products
  alignas(64) float acc[MR][2][16] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[MR][2];
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    const uint32_t* gc = codes + 32 * (G / 4) * g;
    const int8_t* gx = xq + G * g;
#pragma GCC unroll 8
    for (int q = 0; q < G / 4; ++q) {  // unrolled: the accumulators stay in registers
      const __m512i w0 = _mm512_loadu_si512(gc + 32 * q), w1 = _mm512_loadu_si512(gc + 32 * q + 16);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, gx + m * K + 4 * q, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w0, xb);
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w1, xb);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(scale + 32 * g), s1 = _mm512_loadu_ps(scale + 32 * g + 16);
    const __m512 o0 = _mm512_loadu_ps(offset + 32 * g), o1 = _mm512_loadu_ps(offset + 32 * g + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 d = _mm512_set1_ps(ctx.dx[(m0 + m) * blocks + g * G / 32]);
      const __m512 xsum = _mm512_set1_ps(ctx.xs[(m0 + m) * groups + g]);
      _mm512_store_ps(acc[m][0], _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(s0, d),
                                                 _mm512_fmadd_ps(o0, xsum, _mm512_load_ps(acc[m][0]))));
      _mm512_store_ps(acc[m][1], _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), _mm512_mul_ps(s1, d),
                                                 _mm512_fmadd_ps(o1, xsum, _mm512_load_ps(acc[m][1]))));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h)
      store16(ctx, m0 + m, n0 + 16 * h, _mm512_load_ps(acc[m][h]));
}

constexpr int INT8_PANEL_MR = 8;  // x rows per register block: 16 int32 accumulators of a group's dot products

template <int BITS, int G>
void gemm_panel_int8(const Ctx& ctx, const uint8_t* w, int64_t M) {
  const int64_t K = ctx.K, N = ctx.N, stride = ctx.f.row_bytes(K), groups = K / G;
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    line_vector<uint32_t> codes(PANEL * K / 4);
    line_vector<float> scale(PANEL * groups), offset(PANEL * groups), scratch(2 * 16 * ((groups + 15) / 16 * 16));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL;
      prefetch_panel(w, stride, p, p1);
      prepare_int8_panel<BITS, G>(w + n0 * stride, stride, K, ctx.f, codes.data(), scale.data(), offset.data(),
                                  scratch.data());
      int64_t m0 = 0;
      for (; m0 + INT8_PANEL_MR <= M; m0 += INT8_PANEL_MR)
        int8_panel_rows<G, INT8_PANEL_MR>(codes.data(), scale.data(), offset.data(), ctx, m0, n0);
      switch (M - m0) {
        case 7: int8_panel_rows<G, 7>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 6: int8_panel_rows<G, 6>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 5: int8_panel_rows<G, 5>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 4: int8_panel_rows<G, 4>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 3: int8_panel_rows<G, 3>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 2: int8_panel_rows<G, 2>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        case 1: int8_panel_rows<G, 1>(codes.data(), scale.data(), offset.data(), ctx, m0, n0); break;
        default: break;
      }
    }
  });
}
#endif  // __AVX512VNNI__

template <int BITS, int G, int R, int MT>
inline void tile_any(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
#ifdef __AVX512VNNI__
  if (ctx.xq != nullptr) return tile_int8<BITS, G, R, MT>(w, ctx, n, m0);
#endif
  if constexpr (BITS == 4 || BITS == 8) {
    if (ctx.xw != nullptr) return tile_words<BITS, G, R, MT>(w, ctx, n, m0);
  }
  tile<BITS, G, R, MT>(w, ctx, n, m0);
}

// Bytes next .. target - 1 of w toward the cache (next advances): a call streams its weights once,
// too briefly for the hardware prefetchers to ramp up. Into L2 (T1), as prefetch_panel: with T0
// the lines wait on L1's few miss buffers; decode of the default model's Q4_1 and Q4_K_M files
// was 10% and 17% faster with T1 (medians of three alternated runs, 2-core EPYC); 4 or 16 KB
// ahead instead of 8 no better. (quant_kernels.cpp keeps T0: no clear change there.)
inline void prefetch_until(const uint8_t* w, int64_t& next, int64_t target) {
  for (; next < target; next += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + next, _MM_HINT_T1);
}

// M x rows in passes of up to ROWS_PER_PASS (each pass reads the weights once): fn(mt, m0) with
// the pass's row count as a compile-time constant (std::integral_constant<int, MT>).
template <typename Fn>
void for_each_pass(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
    switch (std::min<int64_t>(ROWS_PER_PASS, M - m0)) {
      case 8: fn(std::integral_constant<int, 8>{}, m0); break;
      case 7: fn(std::integral_constant<int, 7>{}, m0); break;
      case 6: fn(std::integral_constant<int, 6>{}, m0); break;
      case 5: fn(std::integral_constant<int, 5>{}, m0); break;
      case 4: fn(std::integral_constant<int, 4>{}, m0); break;
      case 3: fn(std::integral_constant<int, 3>{}, m0); break;
      case 2: fn(std::integral_constant<int, 2>{}, m0); break;
      default: fn(std::integral_constant<int, 1>{}, m0);
    }
  }
}

template <int BITS, int G, int MT>
void rows_range(const uint8_t* w, const Ctx& ctx, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  const int64_t stride = ctx.f.row_bytes(ctx.K);
  const int64_t end = n1 * stride;
  int64_t next = n0 * stride;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    prefetch_until(w, next, std::min(end, (n + R) * stride + PREFETCH_BYTES));
    tile_any<BITS, G, R, MT>(w + n * stride, ctx, n, m0);
  }
  for (; n < n1; ++n) tile_any<BITS, G, 1, MT>(w + n * stride, ctx, n, m0);
}

template <int BITS, int G>
void gemm_rows(const Ctx& ctx, const uint8_t* w, int64_t M) {
  at::parallel_for(0, ctx.N, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for_each_pass(M, [&](auto mt, int64_t m0) { rows_range<BITS, G, decltype(mt)::value>(w, ctx, m0, n0, n1); });
  });
}

// The interleaved layout (Format::interleaved; every format: Q4_0 .. Q8_0 and the K-quants).
// Weight rows in tiles of 16, each tile 16 row_bytes long: first its codes, units of 64 bytes as
// 32 16-bit words, word 2l + e of a unit holding codes of row l; then the scales. 8 bits: unit j
// holds inputs 4j .. 4j + 3, byte h of word 2l + e is input 4j + 2h + e. Fewer bits (2 and 3 held
// as 4): unit j holds inputs 8j .. 8j + 7, the nibble at bits 4q of word 2l + e is input 8j + 2q +
// e (its low 4 bits); after all the units (8 K bytes), 5 bits: per unit its bit 4 as four 32-bit
// masks, mask q at 16 j + 4 q, bit 2l + e the bit 4 of that word's nibble q, so that a nibble
// position's bit 4 is a mask over its vector's 32 words (one masked add); 6 bits: per unit 32
// bytes, byte 2l + e holding word 2l + e's bits 4 and 5 (nibble q's at bits 2q, 2q + 1), widened
// to the words' lanes once per unit, then one shift and one ternary-logic op per nibble position.
// The scales, 16 rows side by side: one-level (groups of 32), per group the
// rows' d then (after all groups) their dm, float16; two-level (K-quants, super-blocks of 256),
// per group the rows' a (int8), then the o, then per super-block the d (float16), then the dm:
// scale = d * a and offset = dm * o, in fp32 as the row layout computes them. So each nibble position
// of a unit is a vector in which vdpbf16ps lane l is row l and the pair of inputs is the same for
// every lane: x enters as a broadcast pair, a group's products for 16 rows are summed before one
// FMA with the 16 rows' scales, and a tile gives 16 outputs with no horizontal sum.
namespace X16 {
constexpr int64_t ROWS = 16;
inline int64_t code_bytes(int64_t K, int bits) { return 2 * bits * K; }  // 16 rows x K x bits / 8
// An interleaved weight's offsets for K inputs, computed once per call (they divide: not per tile)
struct Layout {
  int64_t K, tile_bytes, meta, groups, o_apart, dm_apart;
  int bits, group;
  bool two_level;
  Layout(int64_t K_, const Format& f)
      : K(K_), tile_bytes(ROWS * f.row_bytes(K_)), meta(code_bytes(K_, f.bits)), groups(K_ / f.group),
        o_apart(16 * (K_ / f.group)), dm_apart(f.two_level() ? 32 * (K_ / 256) : K_), bits(f.bits), group(f.group),
        two_level(f.two_level()) {}
  const uint8_t* tile(const uint8_t* w, int64_t t) const { return w + t * tile_bytes; }
  // 5 and 6 bits: unit j's masks or bytes of bits 4 (and 5) (after the 8 K bytes of low nibbles)
  const uint8_t* high_bits(const uint8_t* tile, int64_t j) const { return tile + 8 * K + 16 * (bits - 4) * j; }
  // group g's scale fields (one-level: d, then dm dm_apart on; two-level: a, then o o_apart on)
  const uint8_t* group_fields(const uint8_t* tile, int64_t g) const { return tile + meta + (two_level ? 16 : 32) * g; }
  // two-level: the super-block of group g (d, then dm dm_apart on)
  const uint8_t* super_fields(const uint8_t* tile, int64_t g) const {
    return tile + meta + 32 * groups + 32 * (g * group / 256);
  }
};
// group g's scales and offsets of the 16 rows (two-level: d * a and dm * o in fp32, as the row layout)
inline void group_scales(const uint8_t* tile, const Layout& L, int64_t g, __m512& scale, __m512& offset) {
  const uint8_t* at = L.group_fields(tile, g);
  if (!L.two_level) {
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + L.dm_apart)));
    return;
  }
  const uint8_t* sup = L.super_fields(tile, g);
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
  const __m512 o = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + L.o_apart))));
  scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup))), a);
  offset = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + L.dm_apart))), o);
}
// 5 and 6 bits: adds bits 4 (and 5) of unit j's codes to the low nibbles n[q] (16-bit lanes, the
// code of nibble position q of each word, as an integer or as the bf16 number 128 + u: either way
// the bits land in u's bits 4 and 5, exact for u < 64)
template <int BITS>
inline void add_high_bits(const uint8_t* tile, const Layout& L, int64_t j, __m512i* n) {
  if constexpr (BITS == 5) {
    uint32_t h[4];
    std::memcpy(h, L.high_bits(tile, j), 16);
    const __m512i sixteen = _mm512_set1_epi16(16);
    for (int q = 0; q < 4; ++q) n[q] = _mm512_mask_add_epi16(n[q], __mmask32(h[q]), n[q], sixteen);
  } else if constexpr (BITS == 6) {
    const __m512i hv = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.high_bits(tile, j))));
    const __m512i bits45 = _mm512_set1_epi16(0x30);
    n[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(hv, 4), bits45, n[0], AND_OR);
    n[1] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(hv, 2), bits45, n[1], AND_OR);
    n[2] = _mm512_ternarylogic_epi32(hv, bits45, n[2], AND_OR);
    n[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(hv, 2), bits45, n[3], AND_OR);
  }
}
// unit j of a tile: its nibbles at bits 0, 4, 8 and 12 of each word as bf16 numbers, 128 + u (8
// bits: the low nibble 128 + lo, the high one 2048 + 16 hi), with bits 4 (and 5) added
template <int BITS>
inline void decode_unit(const uint8_t* tile, const Layout& L, int64_t j, __m512i* n) {
  const __m512i nibble = _mm512_set1_epi16(0x000f);
  const __m512i bias = _mm512_set1_epi16(0x4300);                          // bf16 128.0: | u makes 128 + u
  const __m512i bias_hi = _mm512_set1_epi16(BITS == 8 ? 0x4500 : 0x4300);  // 8 bits: 2048 + 16 hi
  const __m512i v = _mm512_loadu_si512(tile + 64 * j);
  n[0] = _mm512_ternarylogic_epi32(v, nibble, bias, AND_OR);
  n[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, bias_hi, AND_OR);
  n[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nibble, bias, AND_OR);
  n[3] = _mm512_or_si512(_mm512_srli_epi16(v, 12), bias_hi);
  add_high_bits<BITS>(tile, L, j, n);
}
}  // namespace X16

// TILES weight tiles from tile t0 (outputs 16 t0 ..) for MT x rows from m0. Per group: per unit,
// its four nibble positions as bf16 numbers (4 bits: 128 + u; 5 bits plus 16 where the masks say,
// 6 bits bits 4 and 5 OR'd in from the unit's bytes; 8 bits: the low nibble 128 + lo, the high one
// 2048 + 16 hi, as tile()), positions
// 0 and 2 into one fp32 chain, 1 and 3 into another, each times x's broadcast pair; then (chains
// summed) times the rows' scales, plus (offset - 128 scale; 8 bits: - 2176 scale) times x's group
// sum. The same order of sums for every TILES and MT: an x row gets the same bits in any batch.
// A unit is decoded for all TILES tiles before the x rows' pairs are broadcast, each once for them.
// Each unit and scale read also prefetches (into L2) the same bytes of the tile TILES further on,
// the next call's: a stream as long as the reads, where prefetch_until ahead of each call (one
// burst of up to 4 tiles, 23 KB at K = 576) left most of the tiles to come from memory on demand:
// one row 25% faster, two 34%, five 12% (Q4_1, 30 layers, benchmarks/gguf_gemm.py, 2-core EPYC).
template <int BITS, int G, int MT, int TILES>
void tile_x16(const uint8_t* w, const Ctx& ctx, const X16::Layout& L, int64_t t0, int64_t m0) {
  constexpr int UNIT_BITS = BITS == 8 ? 8 : 4;
  constexpr int UNITS = G * UNIT_BITS / 32;  // units per group: 4 (G = 32), 2 (G = 16); 8 bits 8
  constexpr int INPUTS = 32 / UNIT_BITS;     // inputs of a unit (per row)
  constexpr int MASK_BYTES = BITS == 5 || BITS == 6 ? 16 * (BITS - 4) : 0;  // bytes of bits 4 (and 5) per unit
  const int64_t K = ctx.K, groups = K / G;
  const uint16_t* xb = ctx.xb + m0 * K;
  const float* xs = ctx.xs + m0 * groups;
  // the outputs' sums, in memory: updated once per group, they leave the registers to the chains
  alignas(64) float res[TILES][MT][16] = {};
  const int64_t second_field = L.two_level ? L.o_apart : L.dm_apart;  // o or dm, from a or d
  const uint8_t* tiles[TILES];  // this call's tiles
  const uint8_t* ahead[TILES];  // the tiles TILES further on (nullptr past the weight's last)
  for (int tt = 0; tt < TILES; ++tt) {
    tiles[tt] = L.tile(w, t0 + tt);
    ahead[tt] = t0 + tt + TILES < ctx.N / X16::ROWS ? L.tile(w, t0 + tt + TILES) : nullptr;
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc0[TILES][MT], acc1[TILES][MT];
    for (int tt = 0; tt < TILES; ++tt)
      for (int m = 0; m < MT; ++m) acc0[tt][m] = acc1[tt][m] = _mm512_setzero_ps();
    for (int u = 0; u < UNITS; ++u) {
      const int64_t j = UNITS * g + u;
      __m512i n[TILES][4];  // the unit's four nibble positions as bf16 numbers, per tile
      for (int tt = 0; tt < TILES; ++tt) {
        const uint8_t* tile = tiles[tt];
        if (ahead[tt] != nullptr) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead[tt] + 64 * j), _MM_HINT_T1);
          if (MASK_BYTES > 0 && MASK_BYTES * j % 64 == 0)  // the next line of high bits
            _mm_prefetch(reinterpret_cast<const char*>(L.high_bits(ahead[tt], j)), _MM_HINT_T1);
        }
        X16::decode_unit<BITS>(tile, L, j, n[tt]);
      }
      for (int m = 0; m < MT; ++m) {
        // x's input pair p of the unit (inputs INPUTS j + 2p, + 1), broadcast from memory once for
        // all the tiles (a broadcast per vdpbf16ps held a 5-row verification to ~60% of the
        // vdpbf16ps rate; through an integer register it cost a shift and a GPR-to-vector move
        // each): 4 bits, nibble position q takes pair q; 8 bits, positions 0 and 1 pair 0, 2 and 3
        // pair 1
        const float* x2 = reinterpret_cast<const float*>(xb + m * K + INPUTS * j);
        auto pair = [&](int p) { return (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(x2 + p)); };
        if constexpr (BITS == 8) {
          const __m512bh p0 = pair(0), p1 = pair(1);
          for (int tt = 0; tt < TILES; ++tt) {
            acc0[tt][m] = _mm512_dpbf16_ps(acc0[tt][m], (__m512bh)n[tt][0], p0);
            acc1[tt][m] = _mm512_dpbf16_ps(acc1[tt][m], (__m512bh)n[tt][1], p0);
          }
          for (int tt = 0; tt < TILES; ++tt) {
            acc0[tt][m] = _mm512_dpbf16_ps(acc0[tt][m], (__m512bh)n[tt][2], p1);
            acc1[tt][m] = _mm512_dpbf16_ps(acc1[tt][m], (__m512bh)n[tt][3], p1);
          }
        } else {
          for (int q = 0; q < 4; ++q) {
            const __m512bh p = pair(q);
            for (int tt = 0; tt < TILES; ++tt) {
              if (q % 2 == 0) acc0[tt][m] = _mm512_dpbf16_ps(acc0[tt][m], (__m512bh)n[tt][q], p);
              else acc1[tt][m] = _mm512_dpbf16_ps(acc1[tt][m], (__m512bh)n[tt][q], p);
            }
          }
        }
      }
    }
    for (int tt = 0; tt < TILES; ++tt) {
      if (ahead[tt] != nullptr) {  // (written out here: from a helper function GCC 12 dropped these prefetches)
        const uint8_t* at = L.group_fields(ahead[tt], g);
        _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(at + second_field), _MM_HINT_T1);
        if (L.two_level && g * G % 256 == 0) {
          const uint8_t* sup = L.super_fields(ahead[tt], g);
          _mm_prefetch(reinterpret_cast<const char*>(sup), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(sup + L.dm_apart), _MM_HINT_T1);
        }
      }
      __m512 scale, offset;
      X16::group_scales(tiles[tt], L, g, scale, offset);
      const __m512 lifted = _mm512_fmadd_ps(scale, _mm512_set1_ps(BITS == 8 ? -2176.f : -128.f), offset);
      for (int m = 0; m < MT; ++m) {
        __m512 r = _mm512_fmadd_ps(_mm512_add_ps(acc0[tt][m], acc1[tt][m]), scale, _mm512_load_ps(res[tt][m]));
        _mm512_store_ps(res[tt][m], _mm512_fmadd_ps(lifted, _mm512_set1_ps(xs[m * groups + g]), r));
      }
    }
  }
  for (int tt = 0; tt < TILES; ++tt)
    for (int m = 0; m < MT; ++m)
      store16(ctx, m0 + m, X16::ROWS * (t0 + tt), _mm512_load_ps(res[tt][m]));
}

// Tiles t0 .. t1 - 1 for MT x rows from m0, several tiles at a time for few x rows (one x row:
// four tiles, eight vdpbf16ps chains in flight; 2-5 x rows two, so that each broadcast of x feeds
// two vdpbf16ps: 4 and 5 rows 13-19% faster than one tile at a time, Q8_0 4-7%, 2 and 3 rows, bound
// by the memory, level, benchmarks/gguf_gemm.py's shapes on the 2-core EPYC; 6-8 rows one, as two
// tiles' chains would not fit the 32 registers); the first call's tiles prefetched here, each
// call's reads prefetch the next call's (tile_x16).
template <int BITS, int G, int MT>
void tiles_range_x16(const uint8_t* w, const Ctx& ctx, const X16::Layout& L, int64_t m0, int64_t t0, int64_t t1) {
  constexpr int TILES = MT == 1 ? 4 : MT <= 5 ? 2 : 1;
  int64_t next = t0 * L.tile_bytes;
  prefetch_until(w, next, std::min(t1, t0 + TILES) * L.tile_bytes);
  int64_t t = t0;
  for (; t + TILES <= t1; t += TILES) tile_x16<BITS, G, MT, TILES>(w, ctx, L, t, m0);
  if constexpr (TILES > 2)
    for (; t + 2 <= t1; t += 2) tile_x16<BITS, G, MT, 2>(w, ctx, L, t, m0);
  for (; t < t1; ++t) tile_x16<BITS, G, MT, 1>(w, ctx, L, t, m0);
}

template <int BITS, int G>
void gemm_rows_x16(const Ctx& ctx, const uint8_t* w, int64_t M) {
  const X16::Layout L(ctx.K, ctx.f);
  at::parallel_for(0, ctx.N / X16::ROWS, 1, [&](int64_t t0, int64_t t1) {
    for_each_pass(M, [&](auto mt, int64_t m0) { tiles_range_x16<BITS, G, decltype(mt)::value>(w, ctx, L, m0, t0, t1); });
  });
}

// Row n of an interleaved weight as bfloat16 (scale * u + offset, rounded once) into dst [K].
void dequantize_row_x16(const uint8_t* w, const X16::Layout& L, int64_t n, uint16_t* dst) {
  const int64_t K = L.K;
  const uint8_t* tile = L.tile(w, n / X16::ROWS);
  const int unit_bits = L.bits == 8 ? 8 : 4;  // fewer bits: the low nibble in the units, bits 4 and 5 after them
  const int64_t l = n % X16::ROWS, per = 32 / unit_bits;  // inputs of a unit per row: 8 or 4
  alignas(64) float scales[16], offsets[16];
  for (int64_t i = 0; i < K; ++i) {
    const int64_t j = i / per, q = i % per / 2, e = i % 2, g = i / L.group;  // q: the nibble (4 bits) or byte (8)
    if (i % L.group == 0) {
      __m512 s, o;
      X16::group_scales(tile, L, g, s, o);
      _mm512_store_ps(scales, s);
      _mm512_store_ps(offsets, o);
    }
    uint16_t word;
    std::memcpy(&word, tile + 64 * j + 2 * (2 * l + e), 2);
    uint32_t code = (word >> (unit_bits * q)) & ((1u << unit_bits) - 1);
    if (L.bits == 5) {
      uint32_t mask;
      std::memcpy(&mask, L.high_bits(tile, j) + 4 * q, 4);
      code |= ((mask >> (2 * l + e)) & 1u) << 4;
    } else if (L.bits == 6) {
      code |= ((L.high_bits(tile, j)[2 * l + e] >> (2 * q)) & 3u) << 4;
    }
    dst[i] = f_to_bf16(std::fma(float(code), scales[l], offsets[l]));
  }
}

// Row n of the weight as bfloat16 (scale * u + offset, rounded once) into dst [K].
template <int BITS, int G>
void dequantize_row(const uint8_t* row, int64_t K, const Format& f, uint16_t* dst, float* scratch) {
  const int64_t groups = K / G, cb = f.chunk_bytes();
  float* scale = scratch;
  float* offset = scratch + groups;
  row_scales<G>(row, K, f, scale, offset);
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m512i h[2];
    decode_chunk<BITS>(row + cb * c, h[0], h[1]);
    for (int half = 0; half < 2; ++half) {
      __m512 v[2];
      for (int q = 0; q < 2; ++q) {  // 16 inputs: one group of 16, or half a group of 32
        const int64_t k = CHUNK * c + 32 * half + 16 * q;
        const __m256i u = q == 0 ? _mm512_castsi512_si256(h[half]) : _mm512_extracti64x4_epi64(h[half], 1);
        v[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(u)), _mm512_set1_ps(scale[k / G]),
                               _mm512_set1_ps(offset[k / G]));
      }
      _mm512_storeu_si512(dst + CHUNK * c + 32 * half, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
  }
}

// 16 weight rows from w, dequantized to bf16 in AMX's B layout: per 32 inputs (k0) a tile of 16
// rows (input pairs) x 16 columns (weight rows) x 2 bf16, at dst + (k0 / 32) * tiles_apart tiles.
// The codes are transposed as bytes first (a vector: 4 inputs of the 16 rows), so that each
// weight is scale * u + offset in fp32 with the rows' scales as vectors, rounded once to bf16.
// scratch: 64 x K / G floats (rounded up to 16 groups).
template <int BITS, int G>
void dequantize_b_tiles(const uint8_t* w, int64_t stride, int64_t K, const Format& f, uint32_t* dst, int64_t tiles_apart,
                        float* scratch) {
  const int64_t groups = K / G, padded = (groups + 15) / 16 * 16, cb = f.chunk_bytes();
  float* scale = scratch;  // [groups][16 rows]
  float* offset = scratch + 16 * padded;
  scales_over_rows<G>(w, stride, K, f, scale, offset, 16, scratch + 32 * padded);
  alignas(64) static const uint16_t pairs_of[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(pairs_of);  // element 2i: input a of row i, 2i + 1: input b
  // inputs 64c + 4j .. + 3 of the 16 rows, their codes in byte b of lane r >> shift (mask: 0xff or 0x0f)
  auto dequantize_dwords = [&](int64_t c, int j, __m512i v, int shift, __m512i mask) {
    const int64_t g = (CHUNK * c + 4 * j) / G;
    const __m512 s = _mm512_loadu_ps(scale + 16 * g), o = _mm512_loadu_ps(offset + 16 * g);
    __m512 q[4];
    for (int b = 0; b < 4; ++b)
      q[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * b + shift), mask)), s, o);
    for (int h = 0; h < 2; ++h) {  // pair 32c + 2j + h: inputs 4j + 2h, 4j + 2h + 1
      const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(q[2 * h + 1], q[2 * h]));
      const int64_t p = 32 * c + 2 * j + h;
      _mm512_storeu_si512(dst + (p / 16) * tiles_apart * 256 + (p % 16) * 16, pair);
    }
  };
  if constexpr (BITS == 4) {
    // 4 bits: the 16 rows' 32 code bytes of a chunk transposed as they are stored (an 8 x 8 dword
    // transpose in each half: rows r and r + 8 share a vector), the nibbles taken apart after it;
    // half the shuffles of widening each row to bytes first, the same values
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    const __m512i lanes02 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), lanes13 = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int64_t c = 0; c < K / CHUNK; ++c) {
      __m512i v[8], t[8];  // v[r]: dwords 0-7 row r's 32 bytes, 8-15 row r + 8's
      for (int r = 0; r < 8; ++r)
        v[r] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride + cb * c))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r + 8) * stride + cb * c)), 1);
      transpose_lanes4<8>(v, t);
      // v[4a + d]'s 128-bit lanes: dword d (lanes 0, 2) or 4 + d (lanes 1, 3) of rows 4a .. 4a + 3 (lanes 0, 1)
      // and 8 + 4a .. 11 + 4a (lanes 2, 3); lanes 0 and 2 of v[d], v[d + 4] are dword d of the 16 rows, 1 and 3 dword 4 + d
      for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_permutex2var_epi64(v[i], lanes02, v[i + 4]);
        t[i + 4] = _mm512_permutex2var_epi64(v[i], lanes13, v[i + 4]);
      }
      for (int j = 0; j < 8; ++j) {  // t[j]: bytes 4j .. 4j + 3 of the 16 rows: inputs 4j + b (low nibbles), 32 + 4j + b (high)
        dequantize_dwords(c, j, t[j], 0, nibble);
        dequantize_dwords(c, j + 8, t[j], 4, nibble);
      }
    }
    return;
  }
  const __m512i byte = _mm512_set1_epi32(0xff);
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m512i v[16];  // v[r]: row r's 64 codes, dword j = inputs 4j .. 4j + 3
    for (int r = 0; r < 16; ++r) v[r] = decode_bytes<BITS>(w + r * stride + cb * c);
    transpose16(v);  // v[j]: inputs 64c + 4j .. + 3 of the 16 rows
    for (int j = 0; j < 16; ++j) dequantize_dwords(c, j, v[j], 0, byte);
  }
}

// dequantize_b_tiles for an interleaved weight tile (16 rows): each pair of inputs of a unit is
// already one vector over the 16 rows (lane l: row l; its even input in the low word's bits,
// its odd one in the high word's), so it becomes one B-tile row with no transpose: both inputs
// times the rows' group scale plus offset in fp32, rounded once.
template <int BITS, int G>
void dequantize_b_tiles_x16(const uint8_t* tile, const X16::Layout& L, uint32_t* dst, int64_t tiles_apart) {
  const int64_t K = L.K;
  constexpr int UNIT_BITS = BITS == 8 ? 8 : 4;  // 5 and 6 bits: bits 4 and 5 after the units (add_high_bits)
  constexpr int UNITS = G * UNIT_BITS / 32, PAIRS = 16 / UNIT_BITS;  // per group; pairs per unit: 4 or 2
  alignas(64) static const uint16_t pairs_of[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(pairs_of);  // element 2i: input a of row i, 2i + 1: input b
  const __m512i mask = _mm512_set1_epi32((1 << UNIT_BITS) - 1);
  const __m512i low_word = _mm512_set1_epi32(0xffff), nibble = _mm512_set1_epi16(0x000f);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 s, o;
    X16::group_scales(tile, L, g, s, o);
    for (int u = 0; u < UNITS; ++u) {
      const int64_t j = UNITS * g + u;
      const __m512i v = _mm512_loadu_si512(tile + 64 * j);
      __m512i u16[4];  // 5 and 6 bits: each word's codes as integers, nibble position q's in u16[q]
      if constexpr (BITS == 5 || BITS == 6) {
        for (int q = 0; q < 4; ++q) u16[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4 * q), nibble);
        X16::add_high_bits<BITS>(tile, L, j, u16);
      }
      for (int q = 0; q < PAIRS; ++q) {  // pair p = PAIRS j + q: its even input at bits UNIT_BITS q, its odd at 16 + UNIT_BITS q
        __m512i even_codes, odd_codes;
        if constexpr (BITS == 5 || BITS == 6) {  // the two words apart
          even_codes = _mm512_and_si512(u16[q], low_word);
          odd_codes = _mm512_srli_epi32(u16[q], 16);
        } else {
          const __m512i codes = _mm512_srli_epi32(v, UNIT_BITS * q);
          even_codes = _mm512_and_si512(codes, mask);
          odd_codes = _mm512_and_si512(_mm512_srli_epi32(codes, 16), mask);
        }
        const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even_codes), s, o);
        const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd_codes), s, o);
        const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
        const int64_t p = PAIRS * j + q;
        _mm512_storeu_si512(dst + (p / 16) * tiles_apart * 256 + (p % 16) * 16, pair);
      }
    }
  }
}

// A panel's 32 weight rows from n0 (either layout) as bf16 in the B tiles' pair layout: two tiles
// of 16 rows per 32 inputs, [K / 32][2][16 pairs][16 rows] uint32.
template <int BITS, int G>
void dequantize_panel(const Ctx& ctx, const uint8_t* w, int64_t n0, uint32_t* panel, float* scratch) {
  const int64_t K = ctx.K, stride = ctx.f.row_bytes(K);
  const X16::Layout L(K, ctx.f);  // (once per panel: its divisions cost nothing beside 32 rows' dequantization)
  for (int half = 0; half < 2; ++half) {
    if (ctx.f.interleaved) {
      dequantize_b_tiles_x16<BITS, G>(L.tile(w, n0 / 16 + half), L, panel + 256 * half, 2);
    } else {
      dequantize_b_tiles<BITS, G>(w + (n0 + 16 * half) * stride, stride, K, ctx.f, panel + 256 * half, 2, scratch);
    }
  }
}

// The many-rows path without AMX (AVX-512 BF16): each 32-row panel of the weight dequantized to
// bf16 once per call, in the same pair layout as AMX's B tiles, then a register-blocked
// vdpbf16ps kernel: per input pair, the panel's two vectors (16 weight rows x 2 inputs each) times
// MR x rows' pair broadcast, into MR x 2 fp32 accumulators. The weights are rounded to bf16 once
// (as the AMX path and a dense copy hold them); every product is summed in fp32.
template <int MR>
void panel_rows(const uint32_t* panel, const uint16_t* xb, int64_t K, int64_t m0, int64_t n0, const Ctx& ctx) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint32_t* b = panel + kb * 512;
    const uint16_t* x = xb + m0 * K + kb * 32;
    for (int i = 0; i < 16; ++i) {  // inputs kb * 32 + 2i, 2i + 1
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + 16 * i), b1 = (__m512bh)_mm512_loadu_si512(b + 256 + 16 * i);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 2 * i, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h)
      store16(ctx, m0 + m, n0 + 16 * h, acc[m][h]);
}

constexpr int PANEL_MR = 8;  // x rows per register block: 16 accumulators, 2 weight vectors, 1 broadcast

template <int BITS, int G>
void gemm_panel(const Ctx& ctx, const uint8_t* w, int64_t M) {
  const int64_t K = ctx.K, N = ctx.N, stride = ctx.f.row_bytes(K);
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    line_vector<uint32_t> panel(PANEL * K / 2);  // [K/32][2 halves][16 pairs][16 rows]
    line_vector<float> scratch(64 * ((K / G + 15) / 16 * 16));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL;
      prefetch_panel(w, stride, p, p1);
      dequantize_panel<BITS, G>(ctx, w, n0, panel.data(), scratch.data());
      int64_t m0 = 0;
      for (; m0 + PANEL_MR <= M; m0 += PANEL_MR) panel_rows<PANEL_MR>(panel.data(), ctx.xb, K, m0, n0, ctx);
      switch (M - m0) {
        case 7: panel_rows<7>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 6: panel_rows<6>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 5: panel_rows<5>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 4: panel_rows<4>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 3: panel_rows<3>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 2: panel_rows<2>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        case 1: panel_rows<1>(panel.data(), ctx.xb, K, m0, n0, ctx); break;
        default: break;
      }
    }
  });
}

#ifdef PAGED_GGUF_AMX
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// C [m, n] = x [m, :] . W [n, :] on AMX: A tiles are 16 x rows (32 inputs, straight from x), B
// tiles 16 weight rows dequantized to bf16 in pairs of inputs; 2 x 2 tiles of C per step. Where x
// is larger than X_IN_L2 (a prefill's thousands of rows), a thread dequantizes its panels a group
// at a time (up to GROUP_BYTES of them, kept in L2) and multiplies each 32-row block of x by the
// whole group before the next block: a block of x is then read from L3 or memory once per group,
// not once per panel. 2,048 rows of the default model's shapes: 0.80-0.86x the time of one panel
// at a time (`gguf_kernel_ab.py --path many --threads 2`, 2-core Xeon); with x in L2 (64 and 512
// rows) the groups were 1.00-1.13x, so there a group is one panel. Each C tile sums over the
// inputs in the same order either way: the same bits.
constexpr int64_t X_IN_L2 = 2 * 1024 * 1024;
constexpr int64_t GROUP_BYTES = 512 * 1024;
constexpr int64_t MAX_GROUP = 8;

// x rows m0 .. m0 + 31 (Mp: x's rows padded to 16) times one dequantized panel (weight rows n0 ..
// n0 + 31): 2 x 2 C tiles over the inputs, then stored through c.
inline void amx_panel_block(const Ctx& ctx, const uint32_t* panel, const uint16_t* xb, int64_t M, int64_t Mp, int64_t m0,
                            int64_t n0, float* c) {
  const int64_t K = ctx.K;
  const bool two = m0 + 16 < Mp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const uint32_t* b = panel + (k0 / 32) * 512;
    _tile_loadd(4, xb + m0 * K + k0, K * 2);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, xb + (m0 + 16) * K + k0, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  for (int t = 0; t < (two ? 4 : 2); ++t) {  // tile t: x rows m0 + 16 (t / 2), weight rows n0 + 16 (t % 2)
    switch (t) {
      case 0: _tile_stored(0, c, 64); break;
      case 1: _tile_stored(1, c, 64); break;
      case 2: _tile_stored(2, c, 64); break;
      default: _tile_stored(3, c, 64);
    }
    const int64_t mb = m0 + 16 * (t / 2), nb = n0 + 16 * (t % 2);
    for (int64_t i = 0; i < 16 && mb + i < M; ++i)
      store16(ctx, mb + i, nb, _mm512_load_ps(c + 16 * i));
  }
}

template <int BITS, int G>
void gemm_amx(const Ctx& ctx, const uint8_t* w, int64_t M) {
  const int64_t K = ctx.K, N = ctx.N, stride = ctx.f.row_bytes(K);
  const int64_t Mp = (M + 15) / 16 * 16;
  const uint16_t* xb = ctx.xb;
  line_vector<uint16_t> padded;  // x with zero rows up to a multiple of 16 (tiles read 16 rows)
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), xb, M * K * 2);
    xb = padded.data();
  }
  const int64_t panel_words = PANEL * K / 2;  // [K/32][2 tiles][16 pairs][16 rows] uint32
  const int64_t group = Mp * K * 2 <= X_IN_L2 ? 1 : std::clamp<int64_t>(GROUP_BYTES / (4 * panel_words), 1, MAX_GROUP);
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    line_vector<uint32_t> panels(std::min(group, p1 - p0) * panel_words);
    line_vector<float> scratch(64 * ((K / G + 15) / 16 * 16));
    alignas(64) float c[16 * 16];
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t ng = std::min(group, p1 - g0);  // 1 with x in L2: a panel at a time, every block of x by it
      for (int64_t j = 0; j < ng; ++j) {
        prefetch_panel(w, stride, g0 + j, p1);
        dequantize_panel<BITS, G>(ctx, w, (g0 + j) * PANEL, panels.data() + j * panel_words, scratch.data());
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 32)
        for (int64_t j = 0; j < ng; ++j)
          amx_panel_block(ctx, panels.data() + j * panel_words, xb, M, Mp, m0, (g0 + j) * PANEL, c);
    }
    _tile_release();
  });
}

// C tile CT (zeroed first) = A . B for one group: A (tile 1; 8 bits also tile 2, the second 16
// pairs) x rows from xg, x_bytes apart; B (tile 3; 8 bits also 4) the decoded group at bg. A
// macro: the tile intrinsics take their tile numbers as literals (GCC pastes them into the asm).
#define PAGED_TILE_PRODUCT(CT, BT, xg, x_bytes, bg) \
  do {                                               \
    _tile_zero(CT);                                  \
    _tile_loadd(1, xg, x_bytes);                     \
    _tile_loadd(3, bg, 64);                          \
    _tile_dpbf16ps(CT, 1, 3);                        \
    if constexpr (BT == 2) {                         \
      _tile_loadd(2, (xg) + 32, x_bytes);            \
      _tile_loadd(4, (bg) + 256, 64);                \
      _tile_dpbf16ps(CT, 2, 4);                      \
    }                                                \
  } while (false)

// Few rows of an interleaved weight on AMX, exact (every type). A group of a tile's 16 rows is
// decoded as tile_x16 decodes it (each nibble position of a unit a vector of 16 rows' input pairs,
// the codes as the bf16 numbers 128 + u; 8 bits: 128 + lo and 2048 + 16 hi) and those vectors,
// stored in order, are an AMX B tile of G / 2 rows: lane l is weight row l, vector r the pair of
// inputs r (8 bits: two B tiles of 16, vector r the pair r / 2, which x enters twice, side by
// side). One tdpbf16ps multiplies it by up to 16 x rows (the A tile, the group's G inputs straight
// from x), summing the exact products in fp32; the C tile then leaves for memory, where each x
// row's sums are scaled per weight row as in tile_x16 (sum times the scales, plus (offset - 128
// scale) times x's group sum). A row's arithmetic does not depend on the other rows of the call
// (2 rows or more here: one row runs tile_x16, see gemm_format). Where the vdpbf16ps kernel costs
// a multiply per x row and code pair, this costs one tile product for all rows: the decode and
// the scaling per group are what grows with the rows.
template <int BITS, int G>
void tile_x16_amx(const uint8_t* w, const Ctx& ctx, const X16::Layout& L, int64_t t, int64_t m0, int mr,
                  const uint16_t* xa, int64_t xa_stride) {
  constexpr int UNITS = BITS == 8 ? 8 : G / 8;  // units per group (a unit: 4 inputs of 8 bits, else 8)
  constexpr int BT = BITS == 8 ? 2 : 1;     // B tiles per group
  constexpr int MASK_BYTES = BITS == 5 || BITS == 6 ? 16 * (BITS - 4) : 0;
  const int64_t K = ctx.K, groups = K / G;
  const uint8_t* tile = L.tile(w, t);
  const uint8_t* ahead = t + 1 < ctx.N / X16::ROWS ? L.tile(w, t + 1) : nullptr;
  const int64_t second_field = L.two_level ? L.o_apart : L.dm_apart;
  alignas(64) uint32_t b[3][BT * 256];  // decoded groups (three in flight, below)
  alignas(64) float c[16 * 16];
  alignas(64) float res[16][16];
  for (int m = 0; m < mr; ++m) _mm512_store_ps(res[m], _mm512_setzero_ps());
  auto decode = [&](int64_t g, uint32_t* dst) {
    for (int u = 0; u < UNITS; ++u) {
      const int64_t j = UNITS * g + u;
      if (ahead != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * j), _MM_HINT_T1);
        if (MASK_BYTES > 0 && MASK_BYTES * j % 64 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(L.high_bits(ahead, j)), _MM_HINT_T1);
      }
      __m512i n[4];
      X16::decode_unit<BITS>(tile, L, j, n);
      for (int q = 0; q < 4; ++q) _mm512_store_si512(dst + 16 * (4 * u + q), n[q]);
    }
  };
  // group g + 1's product is issued before g's sums are read back, into the other C tile (0 or 5),
  // and g + 2 is decoded before it: a tile load does not wait on stores just made, a tile store on
  // the product just issued
  auto product = [&](int64_t g) {
    const uint16_t* xg = xa + m0 * xa_stride + BT * G * g;
    if (g % 2 == 0) PAGED_TILE_PRODUCT(0, BT, xg, xa_stride * 2, b[g % 3]);
    else PAGED_TILE_PRODUCT(5, BT, xg, xa_stride * 2, b[g % 3]);
  };
  decode(0, b[0]);
  if (groups > 1) decode(1, b[1]);
  product(0);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 2 < groups) decode(g + 2, b[(g + 2) % 3]);
    if (g + 1 < groups) product(g + 1);
    if (g % 2 == 0) _tile_stored(0, c, 64);
    else _tile_stored(5, c, 64);
    if (ahead != nullptr) {
      const uint8_t* at = L.group_fields(ahead, g);
      _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(at + second_field), _MM_HINT_T1);
      if (L.two_level && g * G % 256 == 0) {
        const uint8_t* sup = L.super_fields(ahead, g);
        _mm_prefetch(reinterpret_cast<const char*>(sup), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(sup + L.dm_apart), _MM_HINT_T1);
      }
    }
    __m512 scale, offset;
    X16::group_scales(tile, L, g, scale, offset);
    const __m512 lifted = _mm512_fmadd_ps(scale, _mm512_set1_ps(BITS == 8 ? -2176.f : -128.f), offset);
    for (int m = 0; m < mr; ++m) {
      const __m512 r = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * m), scale, _mm512_load_ps(res[m]));
      _mm512_store_ps(res[m], _mm512_fmadd_ps(lifted, _mm512_set1_ps(ctx.xs[(m0 + m) * groups + g]), r));
    }
  }
  for (int m = 0; m < mr; ++m)
    store16(ctx, m0 + m, X16::ROWS * t, _mm512_load_ps(res[m]));
}

template <int BITS, int G>
void gemm_rows_x16_amx(const Ctx& ctx, const uint8_t* w, int64_t M) {
  const X16::Layout L(ctx.K, ctx.f);
  const int64_t K = ctx.K;
  // 8 bits: x's pairs each twice, side by side (the low and the high nibble vectors of a pair)
  line_vector<uint32_t> doubled(BITS == 8 ? M * K : 0);
  if constexpr (BITS == 8)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t p = 0; p < K / 2; ++p) {
        uint32_t pair;
        std::memcpy(&pair, ctx.xb + m * K + 2 * p, 4);
        doubled[m * K + 2 * p] = doubled[m * K + 2 * p + 1] = pair;
      }
  const uint16_t* xa = BITS == 8 ? reinterpret_cast<const uint16_t*>(doubled.data()) : ctx.xb;
  const int64_t xa_stride = BITS == 8 ? 2 * K : K;  // bf16 elements per x row
  at::parallel_for(0, ctx.N / X16::ROWS, 1, [&](int64_t t0, int64_t t1) {
    int64_t next = t0 * L.tile_bytes;
    prefetch_until(w, next, std::min(t1, t0 + 1) * L.tile_bytes);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int mr = int(std::min<int64_t>(16, M - m0));
      TileConfig cfg{};
      cfg.palette = 1;
      // C; A (8 bits: two, each of 16 of the doubled pairs); B (8 bits: two), a row per pair of A
      cfg.rows[0] = uint8_t(mr), cfg.colsb[0] = 64;
      for (int i : {1, 2}) cfg.rows[i] = uint8_t(mr), cfg.colsb[i] = BITS == 8 ? 64 : 2 * G;
      for (int i : {3, 4}) cfg.rows[i] = BITS == 8 ? 16 : G / 2, cfg.colsb[i] = 64;
      cfg.rows[5] = uint8_t(mr), cfg.colsb[5] = 64;  // the second C
      _tile_loadconfig(&cfg);
      for (int64_t t = t0; t < t1; ++t) tile_x16_amx<BITS, G>(w, ctx, L, t, m0, mr, xa, xa_stride);
    }
    _tile_release();
  });
}
#endif  // PAGED_GGUF_AMX

template <int BITS, int G>
void gemm_format(const Ctx& ctx, const uint8_t* w, int64_t M, bool many) {
  if (many) {
#ifdef PAGED_GGUF_AMX
    if (amx_available()) return gemm_amx<BITS, G>(ctx, w, M);
#endif
#ifdef __AVX512VNNI__
    if (ctx.dx != nullptr) return gemm_panel_int8<BITS, G>(ctx, w, M);
#endif
    return gemm_panel<BITS, G>(ctx, w, M);
  }
#ifdef PAGED_GGUF_AMX
  // one x row (a decode step) stays on vdpbf16ps: on tiles its step was 12-17% slower end to end
  // (groups of 16 inputs ~20% slower in the kernel alone, groups of 32 level there); from 2 rows on tiles
  if (ctx.f.interleaved && amx_few_rows.load(std::memory_order_relaxed) && amx_available() && M >= 2)
    return gemm_rows_x16_amx<BITS, G>(ctx, w, M);
#endif
  if (ctx.f.interleaved) return gemm_rows_x16<BITS, G>(ctx, w, M);
  gemm_rows<BITS, G>(ctx, w, M);
}

template <typename Fn>
void dispatch(const Format& f, Fn&& fn) {
  // bits 2 and 3 are packed as 4 (pack() widens them)
  const int bits = f.bits < 4 ? 4 : f.bits;
  if (bits == 4 && f.group == 32) return fn(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{});
  if (bits == 4 && f.group == 16) return fn(std::integral_constant<int, 4>{}, std::integral_constant<int, 16>{});
  if (bits == 5 && f.group == 32) return fn(std::integral_constant<int, 5>{}, std::integral_constant<int, 32>{});
  if (bits == 6 && f.group == 16) return fn(std::integral_constant<int, 6>{}, std::integral_constant<int, 16>{});
  if (bits == 8 && f.group == 32) return fn(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{});
  TORCH_CHECK(false, "gguf kernels: no kernel for ", f.bits, "-bit codes in groups of ", f.group);
}
#endif  // PAGED_GGUF_AVX512

Format format_of(int64_t bits, int64_t group, int64_t super_block, int64_t interleave) {
  TORCH_CHECK((group == 16 || group == 32) && super_block % group == 0 && (super_block == group || super_block == 256),
              "gguf kernels: group ", group, " / super-block ", super_block, " not supported");
  TORCH_CHECK(interleave == 1 || interleave == 16, "gguf kernels: interleave ", interleave,
              " (1: the row layout; 16: 16 rows interleaved)");
  return Format{int(bits < 4 ? 4 : bits), int(group), int(super_block), interleave == 16};
}

void check(const at::Tensor& packed, int64_t K, const Format& f, const char* op) {
  TORCH_CHECK(available(), op, ": built without AVX-512 BF16");
  TORCH_CHECK(K % CHUNK == 0 && K % f.super_block == 0, op, ": K (", K, ") must be a multiple of 64 and of the super-block");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                  packed.size(1) == f.row_bytes(K) && packed.is_contiguous(),
              op, ": packed must be [N, ", f.row_bytes(K), "] uint8 contiguous for K ", K, ", got ", packed.sizes());
  TORCH_CHECK(!f.interleaved || packed.size(0) % 16 == 0, op, ": an interleaved weight has rows in tiles of 16, got ",
              packed.size(0));
}

#ifdef PAGED_GGUF_AVX512
// x [M, K] bf16 -> int8 per 32 inputs (scale dx = max |x| / 127, round to nearest), dx [M, K / 32].
void quantize_x(const uint16_t* xb, int64_t M, int64_t K, int8_t* xq, float* dx) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint16_t* p = xb + m * K + 32 * b;
      __m512 v[2];
      for (int q = 0; q < 2; ++q)
        v[q] = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * q))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      dx[m * (K / 32) + b] = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      for (int q = 0; q < 2; ++q)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + 32 * b + 16 * q),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[q], inv))));
    }
}
#endif

// x [M, K] bfloat16 times packed [N, row_bytes] -> [M, N] bfloat16; from many_min_rows rows on, AMX
// tiles (gemm_amx) or, without AMX, AVX-512 panels (gemm_panel; gemm_panel_int8 with int8_panels)
at::Tensor gemm_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t bits, int64_t group, int64_t super_block,
                     int64_t many_min_rows, bool int8_activations, bool int8_panels, int64_t interleave, bool float_out) {
  const Format f = format_of(bits, group, super_block, interleave);
  TORCH_CHECK(!f.interleaved || !(int8_activations || int8_panels),
              "gguf_gemm: int8 activations read the row layout (interleave 1), not interleave ", interleave);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "gguf_gemm: x must be [M, K] bfloat16 on the CPU, got ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  check(packed, K, f, "gguf_gemm");
  at::Tensor out = at::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
#ifdef PAGED_GGUF_AVX512
  if (M == 0 || N == 0) return out;
  const int64_t groups = K / f.group;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  // from many_min_rows rows on (0: never): AMX tiles where the CPU has them, else the AVX-512 panels
  const bool many = many_min_rows > 0 && M >= many_min_rows && N % PANEL == 0;
  // int8 activations: few rows with int8_activations, many rows (the panels, not AMX) with int8_panels
  bool int8 = false, panels8 = false;
#ifdef __AVX512VNNI__
  panels8 = many && int8_panels && !amx_available();
  int8 = panels8 || (!many && int8_activations);
#endif
  // per group of x, its sum in fp32: the offsets' factor (not used where many rows dequantize the weights);
  // few rows sum in order (as always: a decode step's results stay bit for bit), the int8 panels by vectors
  line_vector<float> xs(many && !panels8 ? 0 : M * groups);
  for (int64_t m = 0; m < M && !many; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < f.group; ++j) s += bf16_to_f(xb[m * K + g * f.group + j]);
      xs[m * groups + g] = s;
    }
  for (int64_t m = 0; m < M && panels8; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t j = 0; j < f.group; j += 16)
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + m * K + g * f.group + j))), 16)));
      xs[m * groups + g] = _mm512_reduce_add_ps(s);
    }
  line_vector<int8_t> xq(int8 ? M * K : 0);
  line_vector<float> dx(int8 ? M * (K / 32) : 0), xql(int8 && !many ? M * (K / CHUNK) * 16 : 0);
  if (int8) quantize_x(xb, M, K, xq.data(), dx.data());
  for (int64_t i = 0; i < int64_t(xql.size()) / 16; ++i)  // few rows: lanes 0-7 a chunk's first block, 8-15 its second
    for (int l = 0; l < 16; ++l) xql[16 * i + l] = dx[2 * i + l / 8];
  // few rows of 8-bit codes, or of 4-bit codes in whole units of 128 inputs, bf16 x: x in the
  // codes' word order (tile_words; 4-bit rows of 64 more inputs, as the default model's 576, were
  // measured no faster that way: their last half unit costs a whole one)
  const bool words = !many && !int8 && !f.interleaved && (f.bits == 8 || (f.bits == 4 && K % 128 == 0));
  line_vector<uint16_t> xw(words ? M * K : 0);
  if (words && f.bits == 4) word_order_x<4>(xb, M, K, xw.data());
  if (words && f.bits == 8) word_order_x<8>(xb, M, K, xw.data());
  const Ctx ctx{K, N, f, xb, xs.data(), float_out ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr()), int8 ? xq.data() : nullptr,
                xql.data(), panels8 ? dx.data() : nullptr, f.row_bytes(K), words ? xw.data() : nullptr, float_out ? out.data_ptr<float>() : nullptr};
  const uint8_t* w = packed.data_ptr<uint8_t>();
  dispatch(f, [&](auto b, auto g) { gemm_format<decltype(b)::value, decltype(g)::value>(ctx, w, M, many); });
#endif
  return out;
}

// x [M, K] bfloat16 times packed -> [M, N] bfloat16 (the layers)
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t group, int64_t super_block,
                int64_t many_min_rows, bool int8_activations, bool int8_panels, int64_t interleave) {
  return gemm_into(x, packed, bits, group, super_block, many_min_rows, int8_activations, int8_panels, interleave, false);
}

// the same -> [M, N] float32: the LM head's logits as the fp32 sums give them, not rounded to
// bf16 (whose step at a logit of 25 is 0.125: near-ties became exact ties, won by the lower id)
at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t group, int64_t super_block,
                    int64_t many_min_rows, bool int8_activations, bool int8_panels, int64_t interleave) {
  return gemm_into(x, packed, bits, group, super_block, many_min_rows, int8_activations, int8_panels, interleave, true);
}

// rows ids of the weight, dequantized -> [T, K] bfloat16 (the embedding table)
at::Tensor dequantize_rows(const at::Tensor& packed, const at::Tensor& ids_in, int64_t K, int64_t bits, int64_t group,
                           int64_t super_block, int64_t interleave) {
  const Format f = format_of(bits, group, super_block, interleave);
  check(packed, K, f, "gguf_dequantize_rows");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel(), N = packed.size(0);
  at::Tensor out = at::empty({T, K}, packed.options().dtype(at::kBFloat16));
#ifdef PAGED_GGUF_AVX512
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "gguf_dequantize_rows: id ", id[t], " out of range [0, ", N, ")");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t stride = f.row_bytes(K);
  if (f.interleaved) {
    const X16::Layout L(K, f);
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) dequantize_row_x16(w, L, id[t], o + t * K);
    });
    return out;
  }
  dispatch(f, [&](auto b, auto g) {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      line_vector<float> scratch(2 * (K / f.group));
      for (int64_t t = t0; t < t1; ++t)
        dequantize_row<decltype(b)::value, decltype(g)::value>(w + id[t] * stride, K, f, o + t * K, scratch.data());
    });
  });
#endif
  return out;
}

bool kernels_available() { return available(); }
bool kernels_amx() { return amx_available(); }
bool set_amx_few_rows(bool on) { return amx_few_rows.exchange(on); }
bool kernels_int8_activations() {
#ifdef __AVX512VNNI__
  return available();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(paged_gguf, m) {  // CPU kernels below; fakes in Python
  m.def("gemm(Tensor x, Tensor packed, int bits, int group, int super_block, int many_min_rows, bool int8_activations, bool int8_panels, int interleave) -> Tensor");
  m.def("gemm_f32(Tensor x, Tensor packed, int bits, int group, int super_block, int many_min_rows, bool int8_activations, bool int8_panels, int interleave) -> Tensor");
  m.def("dequantize_rows(Tensor packed, Tensor ids, int K, int bits, int group, int super_block, int interleave) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_gguf, CPU, m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_f32", &gemm_f32);
  m.impl("dequantize_rows", &dequantize_rows);
}

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // eager calls without the dispatcher; the GIL released while they run
  m.def("gemm", &gemm, py::arg("x"), py::arg("packed"), py::arg("bits"), py::arg("group"), py::arg("super_block"),
        py::arg("many_min_rows"), py::arg("int8_activations"), py::arg("int8_panels"), py::arg("interleave"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_f32", &gemm_f32, py::arg("x"), py::arg("packed"), py::arg("bits"), py::arg("group"), py::arg("super_block"),
        py::arg("many_min_rows"), py::arg("int8_activations"), py::arg("int8_panels"), py::arg("interleave"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, py::arg("packed"), py::arg("ids"), py::arg("K"), py::arg("bits"),
        py::arg("group"), py::arg("super_block"), py::arg("interleave"), py::call_guard<py::gil_scoped_release>());
  m.def("available", &kernels_available);
  m.def("amx_available", &kernels_amx);
  m.def("set_amx_few_rows", &set_amx_few_rows, py::arg("on"),
        "few rows of interleaved weights on AMX tiles (the default where the CPU has AMX) or, off, with vdpbf16ps; "
        "returns the previous setting (for benchmarks and tests: it holds for the whole process)");
  m.def("int8_activations_available", &kernels_int8_activations);
  // gemm's C++ function for other native code (paged.models.cpu_layer_ops' DecoderPlan), without Python between
  m.attr("gemm_capsule") = py::capsule(reinterpret_cast<void*>(&gemm), "paged.gguf.gemm");
}
