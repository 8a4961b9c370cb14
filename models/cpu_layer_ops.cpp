// Fused elementwise layers for the CPU (RMSNorm with its residual add, rotary embedding,
// SiLU-and-mul, GELU-tanh-and-mul); built and loaded by cpu_layer_ops.py (see its docstring for why and how).
// `vec`, `W` and `load_vec` come from core/native_vec.h, which the build puts before this source.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
    std::vector<float> h(n + W);
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
}
