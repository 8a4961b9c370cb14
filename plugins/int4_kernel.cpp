// The int4 x bfloat16 GEMM for few rows (decode steps) on AVX-512 BF16 CPUs; built and loaded by
// int4_kernel.py (see its docstring for the layout and the arithmetic).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <torch/python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGED_INT4_AVX512 1
#endif

namespace {

constexpr int64_t CHUNK = 64;  // weights per 32 packed bytes
constexpr int64_t SUB = 32;    // weights per scale/zero entry
constexpr int64_t ROW_GRAIN = 16;
// Software prefetch distance. A call reads each weight once in ~5-30 us, too short for the
// hardware prefetchers to ramp up: without it the weights of a decode step streamed at ~25 GB/s,
// with it at ~44 GB/s (the machine's copy bandwidth; benchmarks/int4_gemm.py).
constexpr int64_t PREFETCH_BYTES = 8192;

// A packed row: K/2 bytes of codes, then K/32 bf16 scales, then K/32 bf16 zeros (one run of
// memory per thread: scales and zeros in arrays of their own cost a decode step ~15%).
inline int64_t row_bytes(int64_t K) { return K / 2 + 4 * (K / SUB); }

bool available() {
#ifdef PAGED_INT4_AVX512
  return true;
#else
  return false;
#endif
}

inline float bf16_to_f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef PAGED_INT4_AVX512
inline __m512 bf16_load16(const uint16_t* p, __mmask16 k) {  // up to 16 bf16 values widened to fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// R output rows for MT activation rows. Per 64-weight chunk and row: the codes become two
// vectors of bf16 (128 + code) (32 inputs each), vdpbf16ps takes their dot products with x in
// 16 fp32 lanes, and one FMA per half adds them scaled by the half's scale. Two accumulators per
// (row, x row) and R rows in flight keep independent FMA chains (one chain waits its latency per
// chunk). The zero term, sum_g (zero_g - 136 scale_g) * xsum_g, goes into the same lanes before
// the one horizontal sum per output.
template <int R, int MT>
inline void rows_tile(const uint8_t* w, const uint16_t* xb, const float* xs, int64_t K, uint16_t* out, int64_t N) {
  const int64_t subs = K / SUB, half = K / 2, stride = row_bytes(K);
  // row r: codes at w + r * stride, then its scales, then its zeros
  auto scales = [&](int r) { return reinterpret_cast<const uint16_t*>(w + r * stride + half); };
  auto zeros = [&](int r) { return reinterpret_cast<const uint16_t*>(w + r * stride + half) + subs; };
  __m512 acc[R][MT][2];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x000f);
  const __m512i bits = _mm512_set1_epi16(0x4300);  // bf16 128.0; | code makes 128 + code
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m512i x0[MT], x1[MT];
    for (int m = 0; m < MT; ++m) {
      x0[m] = _mm512_loadu_si512(xb + m * K + CHUNK * c);
      x1[m] = _mm512_loadu_si512(xb + m * K + CHUNK * c + 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i wv =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride + 32 * c)));
      const __m512i lo = _mm512_ternarylogic_epi32(wv, nibble, bits, 0xEA);  // (A & B) | C
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(wv, 4), bits);
      // the chunk's two bf16 scales in one broadcast 32-bit load: low half s0, high half s1
      int32_t pair;
      std::memcpy(&pair, scales(r) + 2 * c, 4);
      const __m512i both = _mm512_set1_epi32(pair);
      const __m512 s0 = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      const __m512 s1 = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(int32_t(0xffff0000u))));
      for (int m = 0; m < MT; ++m) {
        const __m512 t0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)x0[m]);
        const __m512 t1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)hi, (__m512bh)x1[m]);
        acc[r][m][0] = _mm512_fmadd_ps(t0, s0, acc[r][m][0]);
        acc[r][m][1] = _mm512_fmadd_ps(t1, s1, acc[r][m][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t g = 0; g < subs; g += 16) {
      const __mmask16 k = subs - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (subs - g)) - 1);
      const __m512 sv = bf16_load16(scales(r) + g, k);
      const __m512 bias = _mm512_fmadd_ps(sv, _mm512_set1_ps(-136.f), bf16_load16(zeros(r) + g, k));
      for (int m = 0; m < MT; ++m)
        acc[r][m][0] = _mm512_fmadd_ps(bias, _mm512_maskz_loadu_ps(k, xs + m * subs + g), acc[r][m][0]);
    }
    for (int m = 0; m < MT; ++m)
      out[m * N + r] = f_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1])));
  }
}

template <int MT>
inline void rows_range(const uint8_t* w, const uint16_t* xb, const float* xs, int64_t K, uint16_t* out, int64_t N,
                       int64_t n0, int64_t n1) {
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  const int64_t stride = row_bytes(K);
  const char* end = reinterpret_cast<const char*>(w + n1 * stride);
  const char* next = reinterpret_cast<const char*>(w + n0 * stride);  // the next line to prefetch
  // this thread's rows are one run of memory: keep PREFETCH_BYTES of it requested ahead
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const char* target = std::min(end, reinterpret_cast<const char*>(w + (n + R) * stride) + PREFETCH_BYTES);
    for (; next < target; next += 64) _mm_prefetch(next, _MM_HINT_T0);
    rows_tile<R, MT>(w + n * stride, xb, xs, K, out + n, N);
  }
  for (; n < n1; ++n) rows_tile<1, MT>(w + n * stride, xb, xs, K, out + n, N);
}
#endif

// x [M, K] bfloat16, packed [N, row_bytes(K)] uint8
at::Tensor int4_gemm(const at::Tensor& x_in, const at::Tensor& packed) {
  TORCH_CHECK(available(), "int4_gemm: built without AVX-512 BF16");
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(),
              "int4_gemm: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "int4_gemm: x must be [M, K] bfloat16, got ",
              x_in.sizes(), " ", x_in.scalar_type());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = packed.size(0);
  TORCH_CHECK(K % CHUNK == 0, "int4_gemm: K (", K, ") must be a multiple of ", CHUNK);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) == row_bytes(K) &&
                  packed.is_contiguous(),
              "int4_gemm: packed must be [N, ", row_bytes(K), "] uint8 contiguous for K ", K, ", got ", packed.sizes());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#ifdef PAGED_INT4_AVX512
  const int64_t subs = K / SUB;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xs(M * subs);  // per 32 inputs, the sum of x (the zero term's factor)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < subs; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < SUB; ++j) s += bf16_to_f(xb[m * K + g * SUB + j]);
      xs[m * subs + g] = s;
    }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // x rows four at a time; later passes re-read from L2
      const uint16_t* xm = xb + m0 * K;
      const float* xsm = xs.data() + m0 * subs;
      uint16_t* om = o + m0 * N;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: rows_range<4>(w, xm, xsm, K, om, N, n0, n1); break;
        case 3: rows_range<3>(w, xm, xsm, K, om, N, n0, n1); break;
        case 2: rows_range<2>(w, xm, xsm, K, om, N, n0, n1); break;
        default: rows_range<1>(w, xm, xsm, K, om, N, n0, n1);
      }
    }
  });
#endif
  return out;
}

bool int4_gemm_available() { return available(); }

}  // namespace

TORCH_LIBRARY(paged_int4, m) {
  m.def("int4_gemm(Tensor x, Tensor packed) -> Tensor");  // CPU kernel below; fake in Python
  m.def("available() -> bool", &int4_gemm_available);
}

TORCH_LIBRARY_IMPL(paged_int4, CPU, m) { m.impl("int4_gemm", &int4_gemm); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // the same kernel, called from eager code without the dispatcher
  m.def("int4_gemm", &int4_gemm);
  m.def("available", &int4_gemm_available);
}
