// 16 fp32 lanes as a GCC/Clang vector extension, lowered to whatever the CPU has (one AVX-512
// register, two AVX2 ones, four NEON ones), and loads that widen 16 values of a tensor dtype
// into them. paged.core.native puts this before every kernel source it builds.
#include <c10/util/BFloat16.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

// A std::allocator whose storage starts on a 64-byte cache line. malloc aligns to 16 bytes only,
// so a 64-byte vector load or an AMX tile row read from a std::vector's buffer usually spanned
// two lines: gemm_amx's dequantized panels so took 1.3-1.6x the time of the same product from
// aligned panels (2,048 x 576 -> 3,072, Q4_1, 2-core Xeon).
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t LINE{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), LINE)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, LINE); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const noexcept { return false; }
};
// a std::vector on cache lines: for every buffer that kernels read with vector or tile loads
template <typename T>
using line_vector = std::vector<T, LineAllocator<T>>;

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
