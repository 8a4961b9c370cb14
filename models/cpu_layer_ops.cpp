// Fused elementwise layers for the CPU (RMSNorm with its residual add, rotary embedding,
// SiLU-and-mul, GELU-tanh-and-mul); built and loaded by cpu_layer_ops.py (see its docstring for why and how).
// `vec`, `W` and `load_vec` come from core/native_vec.h, which the build puts before this source.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Every value is computed in fp32 and rounded to the tensor's dtype exactly where the eager
// chain of torch ops rounds it (one rounding per eager op), so a fused op returns the eager
// values (up to the order of the RMSNorm sum, see norm_rows). fp32: rounding is the identity
// (and the build disables FMA contraction, so products are rounded as torch rounds them).
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  const uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float f) {  // round to nearest even, as c10 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  c10::BFloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.x = 0x7fc0;  // NaN
  } else {
    b.x = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}
template <>
inline c10::Half from_f<c10::Half>(float f) { return c10::Half(f); }

template <typename T>
inline float rounded(float f) { return to_f(from_f<T>(f)); }

// Rows are independent; a batch of a few rows runs on the calling thread (a parallel region
// costs more than a decode step's row).
constexpr int64_t GRAIN_ROWS = 16;

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, op, ": ", name,
              " must be float32, bfloat16 or float16, got ", s);
}

// ---- 16 lanes at a time -----------------------------------------------------------------------
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vec splat(float f) { return vec{} + f; }

// v rounded to T and read back (what storing it in a T tensor keeps), 16 lanes at a time
template <typename T>
inline vec round16(vec v) {
  float f[W];
  std::memcpy(f, &v, sizeof f);
  for (int i = 0; i < W; ++i) f[i] = rounded<T>(f[i]);
  std::memcpy(&v, f, sizeof v);
  return v;
}
template <>
inline vec round16<float>(vec v) { return v; }
template <>
inline vec round16<c10::BFloat16>(vec v) {  // round to nearest even on the bits; NaN stays NaN
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu bias = ((u >> 16) & 1u) + 0x7fffu;
  const vu is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = is_nan ? (u | 0x00400000u) & 0xffff0000u : (u + bias) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

template <typename T>
inline void store16(T* p, vec v) {  // v already holds values of T
  float f[W];
  std::memcpy(f, &v, sizeof f);
  for (int i = 0; i < W; ++i) p[i] = from_f<T>(f[i]);
}
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, vec v) {  // v's low 16 bits are zero: truncation
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

// ---- RMSNorm --------------------------------------------------------------------------------
// Eager (paged.models.layers.RMSNorm): h = x + residual (rounded); h32 = float(h);
// out = weight * round(h32 * rsqrt(mean(h32^2) + eps)) (rounded).
// Gemma's (paged.models.gemma2.GemmaRMSNorm, kGemma): the weight is float32 (1 + w) and multiplies
// the unrounded fp32 value: out = round(h32 * rsqrt(mean(h32^2) + eps) * weight), one rounding.
template <typename T, typename WT, bool kGemma>
void norm_rows(const T* x, const T* res, T* res_out, const WT* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    line_vector<float> h(n + W);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      int64_t i = 0;
      if (res != nullptr) {
        const T* rr = res + r * n;
        T* ro = res_out + r * n;
        for (; i + W <= n; i += W) {
          const vec sum = round16<T>(load_vec(xr + i) + load_vec(rr + i));
          store16(ro + i, sum);
          std::memcpy(h.data() + i, &sum, sizeof sum);
        }
        for (; i < n; ++i) {
          const T sum = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
          ro[i] = sum;
          h[i] = to_f(sum);
        }
      } else {
        for (; i + W <= n; i += W) {
          const vec v = load_vec(xr + i);
          std::memcpy(h.data() + i, &v, sizeof v);
        }
        for (; i < n; ++i) h[i] = to_f(xr[i]);
      }
      vec partial = splat(0.f);  // 16 running sums: closer to torch's tree sum than one
      for (i = 0; i + W <= n; i += W) {
        const vec v = load_vec(h.data() + i);
        partial += v * v;
      }
      float ss = 0.f;
      for (; i < n; ++i) ss += h[i] * h[i];
      for (int j = 0; j < W; ++j) ss += partial[j];
      const float inv = 1.f / std::sqrt(ss / float(n) + eps);
      T* o = out + r * n;
      if constexpr (kGemma) {
        for (i = 0; i + W <= n; i += W)
          store16(o + i, round16<T>((load_vec(h.data() + i) * splat(inv)) * load_vec(w + i)));
        for (; i < n; ++i) o[i] = from_f<T>((h[i] * inv) * w[i]);
      } else {
        for (i = 0; i + W <= n; i += W)
          store16(o + i, round16<T>(load_vec(w + i) * round16<T>(load_vec(h.data() + i) * splat(inv))));
        for (; i < n; ++i) o[i] = from_f<T>(to_f(w[i]) * rounded<T>(h[i] * inv));
      }
    }
  });
}

template <bool kGemma>
std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x_in, const at::Tensor* res_in,
                                             const at::Tensor& weight, double eps, const char* op) {
  check_cpu(x_in, op, "x");
  check_cpu(weight, op, "weight");
  const int64_t n = x_in.size(-1);
  const auto w_type = kGemma ? at::kFloat : x_in.scalar_type();
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == w_type, op,
              ": weight must be [", n, "] of ", w_type, ", got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res, res_out;
  if (res_in != nullptr) {
    check_cpu(*res_in, op, "residual");
    TORCH_CHECK(res_in->sizes() == x.sizes() && res_in->scalar_type() == x.scalar_type(), op,
                ": residual must match x (", x.sizes(), " ", x.scalar_type(), "), got ", res_in->sizes(), " ",
                res_in->scalar_type());
    res = res_in->contiguous();
    res_out = at::empty(x.sizes(), x.options());
  }
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
#define PAGED_NORM(T)                                                                                          \
  norm_rows<T, std::conditional_t<kGemma, float, T>, kGemma>(                                                  \
      x.data_ptr<T>(), res_in ? res.data_ptr<T>() : nullptr, res_in ? res_out.data_ptr<T>() : nullptr,         \
      w.data_ptr<std::conditional_t<kGemma, float, T>>(), out.data_ptr<T>(), rows, n, e);                      \
  break;
    case at::kFloat:
      PAGED_NORM(float)
    case at::kBFloat16:
      PAGED_NORM(c10::BFloat16)
    default:
      PAGED_NORM(c10::Half)
#undef PAGED_NORM
  }
  return {out, res_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm_impl<false>(x, nullptr, weight, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm_impl<false>(x, &residual, weight, eps, "add_rms_norm");
}

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm_impl<true>(x, nullptr, weight, eps, "gemma_rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> gemma_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  return norm_impl<true>(x, &residual, weight, eps, "gemma_add_rms_norm");
}

// ---- rotary embedding -----------------------------------------------------------------------
// Eager (paged.models.rotary.RotaryEmbedding._rotate), per head, x1/x2 the two halves:
// [x1*cos - x2*sin, x2*cos + x1*sin], every product and sum rounded to the dtype.
template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  at::parallel_for(0, tokens, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs0;
      const T* s = sp + t * ss0;
      for (int64_t h = 0; h < heads; ++h) {
        const T* a = xp + t * xs0 + h * xs1;
        T* o = op + (t * heads + h) * 2 * half;
        int64_t j = 0;
        for (; j + W <= half; j += W) {
          const vec x1 = load_vec(a + j), x2 = load_vec(a + j + half), cj = load_vec(c + j), sj = load_vec(s + j);
          store16(o + j, round16<T>(round16<T>(x1 * cj) - round16<T>(x2 * sj)));
          store16(o + j + half, round16<T>(round16<T>(x2 * cj) + round16<T>(x1 * sj)));
        }
        for (; j < half; ++j) {
          const float x1 = to_f(a[j]), x2 = to_f(a[j + half]), cj = to_f(c[j]), sj = to_f(s[j]);
          o[j] = from_f<T>(rounded<T>(x1 * cj) - rounded<T>(x2 * sj));
          o[j + half] = from_f<T>(rounded<T>(x2 * cj) + rounded<T>(x1 * sj));
        }
      }
    }
  });
}

at::Tensor rotate_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(x, "rotary", "q/k");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rotary: q and k must be [T, heads, head_dim] with an even head_dim and a contiguous last dim, got ",
              x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->size(0) == tokens && t->size(-1) == half &&
                    t->numel() == tokens * half && t->stride(-1) == 1,
                "rotary: cos and sin must be [T, (1,) head_dim/2] of q's dtype with a contiguous last dim, got ",
                t->sizes(), " ", t->scalar_type());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      rotate_rows<float>(x, cos, sin, out);
      break;
    case at::kBFloat16:
      rotate_rows<c10::BFloat16>(x, cos, sin, out);
      break;
    default:
      rotate_rows<c10::Half>(x, cos, sin, out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  return {rotate_one(q, cos, sin), rotate_one(k, cos, sin)};
}

// ---- SiLU and mul ---------------------------------------------------------------------------
// Eager (paged.models.layers.GatedMLP): gate, up = x.split(I); round(round(silu(gate)) * up), with
// silu(g) = g / (1 + exp(-g)) in fp32. exp is evaluated 16 lanes at a time (below; within 2 ulp of
// the correctly rounded fp32 value, where torch's own vectorized exp is within 1), so a bfloat16
// result can differ from eager's in the last bit where the fp32 value falls on a rounding boundary.
inline vec exp16(vec x) {  // Cephes' expf: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  x = x > splat(88.7f) ? splat(88.7f) : x;  // 2^128 = inf past ~88.4: silu(-inf) is then nan, as eager
  const vec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x * splat(1.44269504088896341f) + magic) - magic;
  const vec r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
  vec two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  // ~16k values per task: an MLP row is wide, and exp is the costliest op here
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + W <= inter; i += W) {
        const vec gi = load_vec(g + i);
        const vec silu = round16<T>(gi / (splat(1.f) + exp16(-gi)));
        store16(o + i, round16<T>(silu * load_vec(u + i)));
      }
      for (; i < inter; ++i) {
        const float gi = to_f(g[i]);
        o[i] = from_f<T>(rounded<T>(gi / (1.f + std::exp(-gi))) * to_f(u[i]));
      }
    }
  });
}

// A gated activation's op: x = [gate | up] in rows, out = act(gate) * up; ``rows_fn`` is the
// row kernel (a generic lambda, so the dtype picks its instantiation).
template <typename RowsFn>
at::Tensor act_and_mul(const at::Tensor& x_in, const char* name, RowsFn rows_fn) {
  check_cpu(x_in, name, "x");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0,
              name, ": x must be [T, 2 * intermediate_size], got ", x_in.sizes());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      rows_fn(x.data_ptr<float>(), out.data_ptr<float>(), rows, inter, x.stride(0));
      break;
    case at::kBFloat16:
      rows_fn(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, inter, x.stride(0));
      break;
    default:
      rows_fn(x.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), rows, inter, x.stride(0));
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return act_and_mul(x, "silu_and_mul", [](auto* in, auto* out, int64_t rows, int64_t inter, int64_t stride) {
    silu_mul_rows(in, out, rows, inter, stride);
  });
}

// ---- GELU (tanh approximation) and mul --------------------------------------------------------
// Eager (GatedMLP with activation "gelu_pytorch_tanh", Gemma's GeGLU): round(round(gelu(gate)) *
// up) with gelu(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as torch's
// F.gelu(approximate="tanh") in fp32. Computed as g / (1 + exp(-2u)) (the same value: 0.5 (1 +
// tanh(u)) = sigmoid(2u)), which keeps full relative precision where 1 + tanh(u) cancels; exp16
// as for SiLU, so bfloat16 results can differ from eager in the last bit on a rounding boundary.
template <typename T>
void gelu_tanh_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  const float k2 = 2.f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + W <= inter; i += W) {
        const vec gi = load_vec(g + i);
        const vec two_u = splat(k2) * (gi + splat(0.044715f) * (gi * gi * gi));
        const vec gelu = round16<T>(gi / (splat(1.f) + exp16(-two_u)));
        store16(o + i, round16<T>(gelu * load_vec(u + i)));
      }
      for (; i < inter; ++i) {
        const float gi = to_f(g[i]);
        const float two_u = k2 * (gi + 0.044715f * (gi * gi * gi));
        o[i] = from_f<T>(rounded<T>(gi / (1.f + std::exp(-two_u))) * to_f(u[i]));
      }
    }
  });
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return act_and_mul(x, "gelu_tanh_and_mul", [](auto* in, auto* out, int64_t rows, int64_t inter, int64_t stride) {
    gelu_tanh_mul_rows(in, out, rows, inter, stride);
  });
}

// ---- a decode step's layers in one call --------------------------------------------------
// What paged.models.direct_decoder's Python loop calls for a step of decodes only, call for call
// and in its order, without returning to Python between the calls (~1 ms of a 7 ms step at batch
// 1 on the default model was the interpreter and the calls' argument conversions). The products
// and the attention are the GGUF and paged-decode kernels' own functions, handed over as
// capsules by their libraries; every operation is the one the Python loop runs, so the hidden
// states are bitwise the same (tests/models/test_direct_decoder.py).
using GemmFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, bool, bool,
                              int64_t);
using DecodeFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                int64_t, double);
using GroupedDecodeFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double, int64_t, double);

template <typename Fn>
Fn from_capsule(const pybind11::capsule& c, const char* name) {
  TORCH_CHECK(c.name() != nullptr && std::strcmp(c.name(), name) == 0, "decoder plan: expected the capsule ", name);
  return reinterpret_cast<Fn>(c.get_pointer());
}

struct GemmPart {  // one GGUFWeight: GGUFWeight.linear's gemm call
  at::Tensor packed;
  int64_t bits, group, super_block, many_min_rows, interleave;
  bool int8_activations, int8_panels;
};

struct Projection {  // a layer's linear: one GGUF weight, or row blocks of several (RowStackedWeight)
  std::vector<GemmPart> parts;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(GemmFn gemm, const at::Tensor& x) const {
    auto one = [&](const GemmPart& p) {
      return gemm(x, p.packed, p.bits, p.group, p.super_block, p.many_min_rows, p.int8_activations, p.int8_panels,
                  p.interleave);
    };
    at::Tensor out;
    if (parts.size() == 1) {
      out = one(parts[0]);
    } else {
      std::vector<at::Tensor> outs;
      for (const GemmPart& p : parts) outs.push_back(one(p));
      out = at::cat(outs, -1);
    }
    return bias ? out.add(*bias) : out;
  }
};

struct PlanLayer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Projection qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, q_size, kv_size;
  at::Tensor k_cache, v_cache;
  double scale, soft_cap;
  int64_t window;
};

class DecoderPlan {
 public:
  DecoderPlan(const pybind11::capsule& gemm, const pybind11::capsule& decode, const pybind11::capsule& grouped,
              at::Tensor norm, double norm_eps)
      : gemm_(from_capsule<GemmFn>(gemm, "paged.gguf.gemm")),
        decode_(from_capsule<DecodeFn>(decode, "paged.cpu_decode.write_and_decode")),
        grouped_(from_capsule<GroupedDecodeFn>(grouped, "paged.cpu_decode.write_and_decode_grouped")),
        norm_(std::move(norm)),
        norm_eps_(norm_eps) {}

  static Projection projection(const std::vector<pybind11::tuple>& parts, std::optional<at::Tensor> bias) {
    // each part: (packed, bits, group, super_block, many_min_rows, int8_activations, int8_panels, interleave)
    Projection p;
    for (const pybind11::tuple& t : parts)
      p.parts.push_back({t[0].cast<at::Tensor>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
                         t[4].cast<int64_t>(), t[7].cast<int64_t>(), t[5].cast<bool>(), t[6].cast<bool>()});
    TORCH_CHECK(!p.parts.empty(), "decoder plan: a projection without parts");
    p.bias = std::move(bias);
    return p;
  }

  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                 const std::vector<pybind11::tuple>& qkv, std::optional<at::Tensor> qkv_bias,
                 const std::vector<pybind11::tuple>& o, std::optional<at::Tensor> o_bias,
                 const std::vector<pybind11::tuple>& gate_up, std::optional<at::Tensor> gate_up_bias,
                 const std::vector<pybind11::tuple>& down, std::optional<at::Tensor> down_bias, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, at::Tensor k_cache, at::Tensor v_cache, double scale,
                 int64_t window, double soft_cap) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), input_eps, post_eps, projection(qkv, qkv_bias),
                       projection(o, o_bias), projection(gate_up, gate_up_bias), projection(down, down_bias),
                       num_heads, num_kv_heads, head_dim, num_heads * head_dim, num_kv_heads * head_dim,
                       std::move(k_cache), std::move(v_cache), scale, soft_cap, window});
  }

  // DirectDecoder._layers for a step of decodes only (groups: the rows of each request, as
  // paged_decode_grouped takes them; none: one row a request)
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const std::optional<at::Tensor>& groups) const {
    const int64_t T = hidden.size(0);
    at::Tensor h = hidden, residual, x;
    bool first = true;
    for (const PlanLayer& L : layers_) {
      if (first) {
        residual = h, x = rms_norm(h, L.input_norm, L.input_eps), first = false;
      } else {
        std::tie(x, residual) = add_rms_norm(h, residual, L.input_norm, L.input_eps);
      }
      const std::vector<at::Tensor> qkv = L.qkv(gemm_, x).split_with_sizes({L.q_size, L.kv_size, L.kv_size}, -1);
      auto [q, k] = rotary(qkv[0].reshape({T, L.num_heads, L.head_dim}), qkv[1].reshape({T, L.num_kv_heads, L.head_dim}),
                           cos, sin);
      const at::Tensor v = qkv[2].view({T, L.num_kv_heads, L.head_dim});
      const at::Tensor out =
          groups ? grouped_(q, k, v, L.k_cache, L.v_cache, slot_mapping, block_table, seq_lens, *groups, L.scale,
                            L.window, L.soft_cap)
                 : decode_(q, k, v, L.k_cache, L.v_cache, slot_mapping, block_table, seq_lens, L.scale, L.window,
                           L.soft_cap);
      std::tie(x, residual) = add_rms_norm(L.o(gemm_, out.reshape({T, L.q_size})), residual, L.post_norm, L.post_eps);
      h = L.down(gemm_, silu_and_mul(L.gate_up(gemm_, x)));
    }
    return std::get<0>(add_rms_norm(h, residual, norm_, norm_eps_));
  }

 private:
  GemmFn gemm_;
  DecodeFn decode_;
  GroupedDecodeFn grouped_;
  at::Tensor norm_;
  double norm_eps_;
  std::vector<PlanLayer> layers_;
};
}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // the same kernels, called from eager code without the dispatcher;
  // the GIL is released while they run, as torch's own ops do
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("gemma_rms_norm", &gemma_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("gemma_add_rms_norm", &gemma_add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, py::call_guard<py::gil_scoped_release>());
  py::class_<DecoderPlan>(m, "DecoderPlan")
      .def(py::init<const py::capsule&, const py::capsule&, const py::capsule&, at::Tensor, double>())
      .def("add_layer", &DecoderPlan::add_layer)
      .def("run", &DecoderPlan::run, py::call_guard<py::gil_scoped_release>());
}
