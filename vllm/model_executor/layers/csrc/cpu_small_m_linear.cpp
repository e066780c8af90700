// y = x W^T (+ b) for a few rows of x on the CPU, streaming the plain [N, K] weight once.
//
//   torch.ops.vllm_cpu_linear.small_m_linear(x [M, K], weight [N, K], bias [N] or None)
//       -> y [M, N]
//
// Decode-shaped products (M = 1..8) are bound by reading the weight. BLAS libraries reach
// only a fraction of the memory bandwidth there on the dev machines (7-14 GB/s of about
// 35 GB/s with cold weights), so this kernel does the plain thing: each thread streams a
// contiguous range of weight rows, four at a time, and dots them with every row of x (kept as
// float in L1/L2). bfloat16 weights are widened to float in registers; accumulation is in
// float32, the result is rounded to x's dtype once (as oneDNN does).
//
// x may have a row stride; its last dim, the weight and the bias must be dense. x, weight and
// bias share one dtype: float32 or bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load(const c10::BFloat16* p) {
  vu16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu32 wide = __builtin_convertvector(raw, vu32) << 16;
  vf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
inline float scalar(float v) { return v; }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// NR weight rows x MR rows of x: acc[i][j] = sum_k w[i][k] * x[j][k].
template <int NR, int MR, typename T>
inline void tile(const T* w, int64_t K, const float* x, int64_t x_stride, float* dots) {
  vf acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = vf{};
  const int64_t k_vec = K / kLanes * kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    vf xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = load(x + j * x_stride + k);
    for (int i = 0; i < NR; ++i) {
      // The next tile's rows follow these in memory: fetch them while this tile computes
      // (short rows give the hardware prefetcher little time to ramp up on its own).
      __builtin_prefetch(w + (i + NR) * K + k);
      const vf wv = load(w + i * K + k);
      for (int j = 0; j < MR; ++j) acc[i][j] += wv * xv[j];
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = k_vec; k < K; ++k) s += scalar(w[i * K + k]) * x[j * x_stride + k];
      dots[i * MR + j] = s;
    }
  }
}

template <int NR, typename T>
inline void tile_rows(int mr, const T* w, int64_t K, const float* x, int64_t x_stride,
                      float* dots) {
  switch (mr) {
    case 1: tile<NR, 1>(w, K, x, x_stride, dots); break;
    case 2: tile<NR, 2>(w, K, x, x_stride, dots); break;
    case 3: tile<NR, 3>(w, K, x, x_stride, dots); break;
    default: tile<NR, 4>(w, K, x, x_stride, dots); break;
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  // x as float, dense [M, K] (a few KB: stays in cache while the weight streams by)
  std::vector<float> xf(M * K);
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = scalar(xp[m * x.stride(0) + k]);
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t o_stride = out.stride(0);
  // grain: at least 64 weight rows per task (small products stay on one thread)
  at::parallel_for(0, N, 64, [&](int64_t n_begin, int64_t n_end) {
    float dots[4 * 4];
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, n_end - n0));
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, M - m0));
        const T* w = wp + n0 * K;
        const float* xr = xf.data() + m0 * K;
        switch (nr) {
          case 1: tile_rows<1>(mr, w, K, xr, K, dots); break;
          case 2: tile_rows<2>(mr, w, K, xr, K, dots); break;
          case 3: tile_rows<3>(mr, w, K, xr, K, dots); break;
          default: tile_rows<4>(mr, w, K, xr, K, dots); break;
        }
        for (int i = 0; i < nr; ++i) {
          const float b = bp ? scalar(bp[n0 + i]) : 0.0f;
          for (int j = 0; j < mr; ++j) op[(m0 + j) * o_stride + n0 + i] = T(dots[i * mr + j] + b);
        }
      }
    }
  });
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(),
              "small_m_linear: x's last dim and the weight must be dense");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a dense [N] tensor of x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) == 0 || weight.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(x, weight, bias, out); break;
    case at::kBFloat16: run<c10::BFloat16>(x, weight, bias, out); break;
    default: TORCH_CHECK(false, "small_m_linear: unsupported dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(vllm_cpu_linear, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
}
