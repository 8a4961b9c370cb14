// 16 fp32 lanes as a GCC/Clang vector extension, lowered to whatever the CPU has (one AVX-512
// register, two AVX2 ones, four NEON ones), and loads that widen 16 values of a tensor dtype
// into them. paged.core.native puts this before every kernel source it builds.
#include <c10/util/BFloat16.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

constexpr int W = 16;  // fp32 lanes of `vec`
typedef float vec __attribute__((vector_size(64)));

template <typename T>
inline vec load_vec(const T* p) {  // 16 values widened to fp32 (the generic case: fp16)
  float f[W];
  for (int i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  vec v;
  std::memcpy(&v, f, sizeof v);
  return v;
}
template <>
inline vec load_vec<float>(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
inline vec load_vec<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 bits are the top half of an fp32
#ifdef __AVX512F__
  // one vpmovzxwd from memory and one shift (the generic conversion below compiles to two 256-bit
  // widenings, an insert and the shift where the compiler prefers 256-bit vectors, as for Zen 4)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#else
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#endif
}

}  // namespace
