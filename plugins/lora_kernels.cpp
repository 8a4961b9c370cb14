// The CPU LoRA kernel: every row of a step adds its own adapter to a linear layer's output, in one
// call per layer and projection (see lora_kernels.py for the contract and the layout).
// `vec`, `W` and `load_vec` come from core/native_vec.h, which the build puts before this source.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  const uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float f) { return static_cast<T>(f); }  // c10's conversions round to nearest even

inline float hsum(vec v) {
  float f[W];
  std::memcpy(f, &v, sizeof f);
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += f[i];
  return s;
}

template <typename T>
inline float dot(const T* a, const T* x, int64_t n) {
  vec acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += load_vec(a + i) * load_vec(x + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += to_f(a[i]) * to_f(x[i]);
  return s;
}

template <typename T>
inline void axpy(float* acc, float c, const T* b, int64_t n) {  // acc += c * b
  const vec cv = vec{} + c;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vec v;
    std::memcpy(&v, acc + i, sizeof v);
    v += cv * load_vec(b + i);
    std::memcpy(acc + i, &v, sizeof v);
  }
  for (; i < n; ++i) acc[i] += c * to_f(b[i]);
}

// Rows are independent; a few rows (a decode step) run on the calling thread. Per row the kernel
// is bound by its fp32 multiply-adds (R x (in + out)); doing 4 rows of one slot together, so that
// each adapter row is read once for them, measured no faster.
constexpr int64_t GRAIN_ROWS = 4;

template <typename T>
void apply_rows(T* y, const T* x, const T* a, const T* b, const int32_t* slots, const int32_t* ranks,
                int64_t rows, int64_t in, int64_t out, int64_t R, int64_t parts, int64_t max_rank, int64_t y_stride,
                int64_t x_stride) {
  at::parallel_for(0, rows, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    line_vector<float> acc(out);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t s = slots[t];
      if (s < 0) continue;
      const int64_t rank = ranks[s];
      if (rank == 0) continue;  // the adapter leaves this layer alone
      const T* xt = x + t * x_stride;
      const T* as = a + s * R * in;
      const T* bs = b + s * R * out;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < parts; ++p) {  // only the rows each part's adapter fills
        for (int64_t r = p * max_rank; r < p * max_rank + rank; ++r) {
          const float m = dot(as + r * in, xt, in);
          if (m != 0.f) axpy(acc.data(), m, bs + r * out, out);
        }
      }
      T* yt = y + t * y_stride;
      for (int64_t o = 0; o < out; ++o) yt[o] = from_f<T>(to_f(yt[o]) + acc[o]);
    }
  });
}

void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& token_slots, const at::Tensor& ranks, int64_t parts) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu(),
              "lora_apply: CPU tensors only");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_apply: y [T, out], x [T, in], "
              "a [S, R, in], b [S, R, out]");
  const auto dt = y.scalar_type();
  TORCH_CHECK(x.scalar_type() == dt && a.scalar_type() == dt && b.scalar_type() == dt,
              "lora_apply: y, x, a and b must share one dtype");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && ranks.scalar_type() == at::kInt,
              "lora_apply: token_slots and ranks must be int32");
  const int64_t rows = y.size(0), out = y.size(1), in = x.size(1), R = a.size(1);
  TORCH_CHECK(x.size(0) == rows && token_slots.numel() == rows, "lora_apply: x, y and token_slots disagree on rows");
  TORCH_CHECK(a.size(2) == in && b.size(2) == out && b.size(1) == R && a.size(0) == b.size(0) &&
              ranks.numel() == a.size(0), "lora_apply: a, b and ranks do not fit x and y");
  TORCH_CHECK(parts >= 1 && R % parts == 0, "lora_apply: R must be parts x max_rank");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && a.is_contiguous() && b.is_contiguous() &&
              token_slots.is_contiguous() && ranks.is_contiguous(), "lora_apply: rows must be contiguous");
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const int64_t max_rank = R / parts, S = a.size(0);
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(slots[t] < S, "lora_apply: row ", t, " names slot ", slots[t], " of ", S);
  if (dt == at::kFloat) {
    apply_rows(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), slots, rk, rows,
               in, out, R, parts, max_rank, y.stride(0), x.stride(0));
  } else if (dt == at::kBFloat16) {
    apply_rows(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), a.data_ptr<c10::BFloat16>(),
               b.data_ptr<c10::BFloat16>(), slots, rk, rows, in, out, R, parts, max_rank, y.stride(0), x.stride(0));
  } else if (dt == at::kHalf) {
    apply_rows(y.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), a.data_ptr<c10::Half>(), b.data_ptr<c10::Half>(),
               slots, rk, rows, in, out, R, parts, max_rank, y.stride(0), x.stride(0));
  } else {
    TORCH_CHECK(false, "lora_apply: float32, bfloat16 or float16 only, got ", dt);
  }
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // called from eager code; the GIL is released while it runs
  m.def("lora_apply", &lora_apply, py::call_guard<py::gil_scoped_release>());
}
