// int4 and int8 x bfloat16 GEMMs for few rows (decode steps) on AVX-512 BF16 CPUs; built and
// loaded by quant_kernels.py (see its docstring for the layouts and the arithmetic).
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
#define PAGED_QUANT_AVX512 1
#endif

namespace {

constexpr int64_t CHUNK = 64;  // int4: weights per 32 packed bytes
constexpr int64_t SUB = 32;    // int4: weights per scale/zero entry; int8: weights per step
constexpr int64_t ROW_GRAIN = 16;
// Software prefetch distance. A call reads each weight once in ~5-30 us, too short for the
// hardware prefetchers to ramp up: without it the weights of a decode step streamed at ~25 GB/s,
// with it at ~44 GB/s (the machine's copy bandwidth; benchmarks/quant_gemm.py).
// Into L1 (T0): T1, which the GGUF kernels use, changed no decode here measurably (2026-12-05).
constexpr int64_t PREFETCH_BYTES = 8192;

// A packed row: K/2 bytes of codes, then K/32 bf16 scales, then K/32 bf16 zeros (one run of
// memory per thread: scales and zeros in arrays of their own cost a decode step ~15%).
inline int64_t row_bytes(int64_t K) { return K / 2 + 4 * (K / SUB); }

bool available() {
#ifdef PAGED_QUANT_AVX512
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

#ifdef PAGED_QUANT_AVX512
inline __m512 bf16_load16(const uint16_t* p, __mmask16 k) {  // up to 16 bf16 values widened to fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// What a tile of rows sees: x [M, K] as bf16 bits, its sums per 32 inputs xs [M, K/32], the
// output [M, N] as bf16 bits, and (int8) the per-row scales.
struct Ctx {
  int64_t K, N;
  const uint16_t* xb;
  const float* xs;
  uint16_t* out;
  const uint16_t* row_scale;
};

// (A & B) | C and (A | B) ^ C as ternary-logic tables
constexpr int AND_OR = 0xEA, OR_XOR = 0x56;

struct Int4 {
  static int64_t stride(int64_t K) { return row_bytes(K); }

  // R output rows (from row n) for MT activation rows (from x row m0). Per 64-weight chunk and
  // row: the codes become two vectors of bf16 (128 + code) (32 inputs each), vdpbf16ps takes
  // their dot products with x in 16 fp32 lanes, and one FMA per half adds them scaled by the
  // half's scale. Two accumulators per (row, x row) and R rows in flight keep independent FMA
  // chains. The zero term, sum_g (zero_g - 136 scale_g) * xsum_g, goes into the same lanes
  // before the one horizontal sum per output.
  template <int R, int MT>
  static void tile(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
    const int64_t K = ctx.K, subs = K / SUB, half = K / 2, stride = row_bytes(K);
    const uint16_t* xb = ctx.xb + m0 * K;
    const float* xs = ctx.xs + m0 * subs;
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
        const __m512i lo = _mm512_ternarylogic_epi32(wv, nibble, bits, AND_OR);
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
        ctx.out[(m0 + m) * ctx.N + n + r] =
            f_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1])));
    }
  }
};

struct Int8 {
  static int64_t stride(int64_t K) { return K; }

  // Row-major int8 codes c with one scale per row: W[n, k] = scale[n] * c[n, k]. With u = c + 128
  // (the byte's sign bit flipped) split in nibbles u = 16 hi + lo, each nibble becomes the bf16
  // number 128 + nibble as for int4, and two vdpbf16ps per 32 inputs accumulate
  // A = sum (128 + hi) x and B = sum (128 + lo) x; then sum c x = 16 A + B - 2304 sum x
  // (the offsets cost 11 of fp32's 24 bits in the partial sums, below the bf16 rounding of the
  // result). No per-group scale: the accumulators take the products directly.
  template <int R, int MT>
  static void tile(const uint8_t* w, const Ctx& ctx, int64_t n, int64_t m0) {
    const int64_t K = ctx.K, subs = K / SUB;
    const uint16_t* xb = ctx.xb + m0 * K;
    __m512 a[R][MT], b[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) a[r][m] = b[r][m] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi16(0x000f);
    const __m512i bits = _mm512_set1_epi16(0x4300);
    const __m512i eight = _mm512_set1_epi16(0x0008);  // the sign flip, seen in the high nibble
    for (int64_t c = 0; c < K / SUB; ++c) {
      __m512i x[MT];
      for (int m = 0; m < MT; ++m) x[m] = _mm512_loadu_si512(xb + m * K + SUB * c);
      for (int r = 0; r < R; ++r) {
        const __m512i wv =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + SUB * c)));
        const __m512i lo = _mm512_ternarylogic_epi32(wv, nibble, bits, AND_OR);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wv, 4), bits, eight, OR_XOR);
        for (int m = 0; m < MT; ++m) {
          a[r][m] = _mm512_dpbf16_ps(a[r][m], (__m512bh)hi, (__m512bh)x[m]);
          b[r][m] = _mm512_dpbf16_ps(b[r][m], (__m512bh)lo, (__m512bh)x[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      float sum_x = 0.f;
      for (int64_t g = 0; g < subs; ++g) sum_x += ctx.xs[(m0 + m) * subs + g];
      for (int r = 0; r < R; ++r) {
        const float dot = _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(16.f), a[r][m], b[r][m])) -
                          2304.f * sum_x;
        ctx.out[(m0 + m) * ctx.N + n + r] = f_to_bf16(bf16_to_f(ctx.row_scale[n + r]) * dot);
      }
    }
  }
};

// Rows [n0, n1) of one thread for MT x rows from m0, R rows per tile.
template <typename Kind, int MT>
void rows_range(const uint8_t* w, const Ctx& ctx, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  const int64_t stride = Kind::stride(ctx.K);
  // this thread's rows are one run of memory: keep PREFETCH_BYTES of it requested ahead
  const char* base = reinterpret_cast<const char*>(w);
  const int64_t end = n1 * stride;
  int64_t next = n0 * stride;  // offset of the next line to prefetch
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const int64_t target = std::min(end, (n + R) * stride + PREFETCH_BYTES);
    for (; next < target; next += 64) _mm_prefetch(base + next, _MM_HINT_T0);
    Kind::template tile<R, MT>(w + n * stride, ctx, n, m0);
  }
  for (; n < n1; ++n) Kind::template tile<1, MT>(w + n * stride, ctx, n, m0);
}

// x [M, K] bfloat16 times the N packed rows -> [M, N] bfloat16
template <typename Kind>
at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& packed, const uint16_t* row_scale) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t subs = K / SUB;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  line_vector<float> xs(M * subs);  // per 32 inputs, the sum of x (the zero and offset terms' factor)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < subs; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < SUB; ++j) s += bf16_to_f(xb[m * K + g * SUB + j]);
      xs[m * subs + g] = s;
    }
  const Ctx ctx{K, N, xb, xs.data(), reinterpret_cast<uint16_t*>(out.data_ptr()), row_scale};
  const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());  // int8 codes: read as bytes
  at::parallel_for(0, N, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // x rows four at a time; later passes re-read from L2
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: rows_range<Kind, 4>(w, ctx, m0, n0, n1); break;
        case 3: rows_range<Kind, 3>(w, ctx, m0, n0, n1); break;
        case 2: rows_range<Kind, 2>(w, ctx, m0, n0, n1); break;
        default: rows_range<Kind, 1>(w, ctx, m0, n0, n1);
      }
    }
  });
  return out;
}
#endif  // PAGED_QUANT_AVX512: without it the entry points below only raise (available() is false)

void check_x(const at::Tensor& x, const at::Tensor& packed, const char* op) {
  TORCH_CHECK(available(), op, ": built without AVX-512 BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bfloat16, got ", x.sizes(),
              " ", x.scalar_type());
}

// x [M, K] bfloat16, packed [N, row_bytes(K)] uint8 (codes, scales, zeros per row)
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed) {
  check_x(x, packed, "int4_gemm");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % CHUNK == 0, "int4_gemm: K (", K, ") must be a multiple of ", CHUNK);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) == row_bytes(K) &&
                  packed.is_contiguous(),
              "int4_gemm: packed must be [N, ", row_bytes(K), "] uint8 contiguous for K ", K, ", got ", packed.sizes());
#ifdef PAGED_QUANT_AVX512
  return gemm<Int4>(x, packed, nullptr);
#else
  return at::Tensor();  // unreachable: check_x raised
#endif
}

// x [M, K] bfloat16, codes [N, K] int8, scale [N] bfloat16
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  check_x(x, codes, "int8_gemm");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % SUB == 0, "int8_gemm: K (", K, ") must be a multiple of ", SUB);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == K && codes.is_contiguous(),
              "int8_gemm: codes must be [N, ", K, "] int8 contiguous, got ", codes.sizes(), " ", codes.scalar_type());
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kBFloat16 && scale.size(0) == codes.size(0) &&
                  scale.is_contiguous(),
              "int8_gemm: scale must be [N] bfloat16 contiguous, got ", scale.sizes(), " ", scale.scalar_type());
#ifdef PAGED_QUANT_AVX512
  return gemm<Int8>(x, codes, reinterpret_cast<const uint16_t*>(scale.data_ptr()));
#else
  return at::Tensor();  // unreachable: check_x raised
#endif
}

bool kernels_available() { return available(); }

}  // namespace

TORCH_LIBRARY(paged_quant, m) {  // CPU kernels below; fakes in Python
  m.def("int4_gemm(Tensor x, Tensor packed) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("available() -> bool", &kernels_available);
}

TORCH_LIBRARY_IMPL(paged_quant, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
}

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // the same kernels, called from eager code without the dispatcher;
  // the GIL is released while they run, as torch's own ops do
  m.def("int4_gemm", &int4_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("available", &kernels_available);
}
