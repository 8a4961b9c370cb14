"""A fused paged-decode attention kernel for the CPU (C++, built on first use).

Why: the torch backend's decode path gathers every request's K/V blocks into a contiguous buffer
(``index_select``) and then runs SDPA over it, so each layer writes a full copy of the batch's
context before reading it again; on a 2-core CPU that gather is as expensive as the attention
itself. This kernel reads the K/V rows straight from the paged cache through the block table.

``paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, out)``, one query token per
request (``b`` in ``0..B-1``)::

    q, out       [B, H, D]       the cache's dtype; any strides with a contiguous last dim
    k/v_cache    [num_blocks, block_size, Hkv, D] contiguous; float32, bfloat16 or float16
    block_table  [B, >= cdiv(seq_lens[b], block_size)] int32 (rows may be strided)
    seq_lens     [B] int32, >= 1: request b attends over its positions 0 .. seq_lens[b] - 1

Design: one work item per (request, KV head), split over the threads with ``at::parallel_for``
(so ``torch.set_num_threads`` applies). An item handles the ``G = H / Hkv`` query heads that share
the KV head together, so each K/V row is loaded once for the whole group. It walks the positions
``TILE`` at a time (a tile may span several blocks, so block size 1 costs nothing extra): the
scores of the tile for all G heads, then one online-softmax update per head (running max and sum;
the accumulator is rescaled once per tile, not once per key), then the tile's V rows are added to
the fp32 accumulator. Only positions below ``seq_len`` are ever read, so padding entries of the
block table and the stale tail of the last block (NaN in the tests) never enter the sums. Scores,
softmax and accumulation are fp32 whatever the cache dtype; the output is rounded once at the end.

Build: ``torch.utils.cpp_extension.load_inline`` with ``-O3 -march=native -fopenmp`` into the
torch extensions directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
which needs a C++ compiler and ninja (a dependency of the package). The name of the build carries
a hash of the source, the flags, the torch version and the CPU's feature flags, so a cached build
is never loaded by a different torch or on a CPU it was not compiled for. Only the few ATen and
dispatcher headers it needs are included (not ``torch/extension.h``, which alone takes ~30 s to
parse): the first build takes seconds, later processes load the cached library. ``load()`` returns
``None`` (after one warning) when the build or the load fails; the caller then keeps its own path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Positions per online-softmax step: the rescale of the accumulator happens once per tile, and the
// tile's G x TILE scores and its K/V rows (TILE x D per head) stay in L1/L2 between the passes.
constexpr int64_t TILE = 64;
constexpr int W = 16;  // fp32 lanes of `vec`

// A GCC/Clang vector extension: 16 fp32 lanes, lowered to whatever the CPU has (one AVX-512
// register, two AVX2 ones, four NEON ones). Plain loops over D did not vectorize well enough
// (short loops: the serial horizontal sums and FMA chains dominated).
typedef float vec __attribute__((vector_size(64)));

template <typename T>
inline vec load(const T* p) {  // 16 values widened to fp32 (the generic case: fp16)
  float f[W];
  for (int i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  vec v;
  std::memcpy(&v, f, sizeof v);
  return v;
}
template <>
inline vec load<float>(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
inline vec load<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 bits are the top half of an fp32
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  vec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline float hsum(vec a) {  // halving tree, not a serial chain of 16 adds
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &a, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + sizeof lo, sizeof hi);
  const v8 b = lo + hi;
  v4 c0, c1;
  std::memcpy(&c0, &b, sizeof c0);
  std::memcpy(&c1, reinterpret_cast<const char*>(&b) + sizeof c0, sizeof c1);
  const v4 c = c0 + c1;
  return (c[0] + c[2]) + (c[1] + c[3]);
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

// acc[0 : NV*16] = alpha * acc + sum_t p[t] * V_row_t, NV vectors kept in registers while the
// tile's rows stream by: NV independent FMA chains (one chain would wait on its own latency).
template <int NV, typename T>
inline void accumulate_rows(float* acc, float alpha, const float* p, const T* v, const int64_t* rows, int64_t n) {
  vec a[NV];
  for (int i = 0; i < NV; ++i) a[i] = load(acc + W * i) * alpha;
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < NV; ++i) a[i] += p[t] * load(v + rows[t] + W * i);
  for (int i = 0; i < NV; ++i) std::memcpy(acc + W * i, &a[i], sizeof(vec));
}

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                       const at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
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
  const int64_t items = B * Hkv;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));

  // Dynamic scheduling, not at::parallel_for's static halves: contexts are ragged (and a core
  // may be busy elsewhere), so a fixed split leaves a thread idle at the end.
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qf(G * D), acc(G * D), s(G * TILE), m(G), l(G);  // per-thread scratch
    std::vector<int64_t> rows(TILE);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
      for (int64_t g = 0; g < G; ++g) {  // the group's queries in fp32, scale folded in
        const T* src = qp + b * q_s0 + (h * G + g) * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = 0; start < len; start += TILE) {
        const int64_t n = std::min(TILE, len - start);
        for (int64_t t = 0; t < n; ++t) {  // cache row of each position, through the block table
          const int64_t j = start + t;
          rows[t] = ((int64_t)bt[b * bt_s0 + j / block_size] * block_size + j % block_size) * row + h * D;
        }
        for (int64_t g = 0; g < G; ++g) {
          // scores of the tile (the K rows are read from memory for the first head of the
          // group, from cache for the others) and their max
          const float* qg = qf.data() + g * D;
          float* sg = s.data() + g * TILE;
          float tile_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            const T* k = kp + rows[t];
            vec a = {};
            for (int64_t d = 0; d < DV; d += W) a += load(qg + d) * load(k + d);
            float dot = hsum(a);
            for (int64_t d = DV; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
            sg[t] = dot;
            tile_max = std::max(tile_max, dot);
          }
          // online softmax: new running max, weights, rescale of what was accumulated so far
          const float m_new = std::max(m[g], tile_max);
          const float alpha = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = exp_nonpositive(sg[t] - m_new);
            sum += sg[t];
          }
          l[g] = l[g] * alpha + sum;
          m[g] = m_new;
          // weighted V rows into the fp32 accumulator, 4 vectors (64 dims) at a time
          float* ag = acc.data() + g * D;
          int64_t d = 0;
          for (; d + 4 * W <= DV; d += 4 * W) accumulate_rows<4>(ag + d, alpha, sg, vp + d, rows.data(), n);
          for (; d < DV; d += W) accumulate_rows<1>(ag + d, alpha, sg, vp + d, rows.data(), n);
          for (; d < D; ++d) {
            float a = ag[d] * alpha;
            for (int64_t t = 0; t < n; ++t) a += sg[t] * static_cast<float>(vp[rows[t] + d]);
            ag[d] = a;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // len 0 (never for a decode): zeros
        T* dst = op + b * o_s0 + (h * G + g) * o_s1;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  }
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                  const at::Tensor& out) {
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
                  block_table.size(0) >= q.size(0),
              "paged_decode: block_table [>= B, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() >= q.size(0),
              "paged_decode: seq_lens [>= B] int32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  });
}

}  // namespace

TORCH_LIBRARY(paged_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, Tensor(a!) out) -> ()", &paged_decode);
}
"""

_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-Wno-psabi"]  # psabi: notes on 64-byte vectors


def _build_name() -> str:
    """Source, flags, torch and the CPU's features: a cached build for another CPU (``-march=native``)
    or another torch ABI is never picked up."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = "\0".join([_SOURCE, " ".join(_CFLAGS), torch.__version__, cpu])
    return "paged_cpu_decode_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _ensure_ninja() -> None:
    """torch calls ``ninja`` from PATH; the pip package ``ninja`` puts it in the venv's bin, which
    is not on PATH when the interpreter is run as ``.venv/bin/python`` without activation."""
    if shutil.which("ninja") is None:
        import ninja  # raises ImportError: reported as "unavailable" by load()

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_STALE_LOCK_S = 300  # a build takes well under a minute


def _build_directory(name: str) -> str:
    """The build's folder under the torch extensions root. torch serialises concurrent builds
    with a ``lock`` file there and waits, without a timeout, for it to go; a build killed
    half-way (SIGKILL, a CI timeout) leaves it behind, so an old one is removed first."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    while os.path.exists(lock):  # another process is building: wait for it, unless it died
        try:
            if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
                os.remove(lock)
                break
        except FileNotFoundError:
            break
        time.sleep(0.2)
    return path


@functools.cache
def load() -> Callable[..., None] | None:
    """The kernel (``torch.ops.paged_cpu.paged_decode``), built on first use; ``None`` with one
    warning per process if it cannot be built or loaded."""
    try:
        from torch.utils import cpp_extension

        _ensure_ninja()
        name = _build_name()
        start = time.perf_counter()
        cpp_extension.load_inline(
            name,
            cpp_sources=_SOURCE,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],  # libgomp: resolves to the copy torch has already loaded
            build_directory=_build_directory(name),
            no_implicit_headers=True,
            is_python_module=False,  # loaded with torch.ops.load_library; the op registers itself
        )
        logger.debug("CPU paged-decode kernel ready in %.1f s", time.perf_counter() - start)
        return torch.ops.paged_cpu.paged_decode
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU paged-decode kernel unavailable, the torch backend gathers K/V instead: %s", e)
        return None
