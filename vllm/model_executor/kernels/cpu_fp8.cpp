// CPU kernels of the FP8 quantization ops, registered with the dispatcher for the CPU key.
//
// The op schemas are defined in Python (vllm/model_executor/kernels/fp8_ops.py), with a
// plain-torch implementation for every other device; loading this library (cpu_loader.py)
// adds these kernels, so a CPU call goes straight from the dispatcher to C++. The row
// kernels live in cpu_fp8_kernels.h (pasted in by the loader).
//
// Scale modes: a static per-tensor scale (a float32 tensor with one element), or dynamic
// scales per group of `group` consecutive columns (group <= 0: one per token, i.e. per row).
// Rows are spread over threads with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_fp8_kernels.h"

namespace {

using vllm_fp8::bf16_t;
using vllm_fp8::fp16_t;

struct QuantSpec {
  bool is_static;
  float scale;      // static
  int64_t group;    // dynamic: columns per scale
  float min_scale;  // dynamic
};

QuantSpec make_spec(const std::optional<at::Tensor>& scale, int64_t group, int64_t n,
                    double min_scale) {
  QuantSpec spec{false, 1.0f, n, static_cast<float>(min_scale)};
  if (scale.has_value() && scale->defined()) {
    TORCH_CHECK(scale->numel() == 1, "static FP8 quantization needs a one-element scale");
    spec.is_static = true;
    spec.scale = scale->to(at::kFloat).item<float>();
  } else {
    spec.group = group <= 0 ? n : group;
    TORCH_CHECK(n % spec.group == 0, "hidden size ", n, " is not a multiple of the group size ",
                spec.group);
  }
  return spec;
}

// Calls fn(T*) with a null pointer of the kernel element type for x's dtype.
template <typename Fn>
void dispatch_dtype(const at::Tensor& x, const char* name, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat:
      fn(static_cast<float*>(nullptr));
      break;
    case at::kBFloat16:
      fn(static_cast<bf16_t*>(nullptr));
      break;
    case at::kHalf:
      fn(static_cast<fp16_t*>(nullptr));
      break;
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", x.scalar_type(),
                  " (float32, bfloat16 and float16 are)");
  }
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mut_ptr(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor as_rows(const at::Tensor& x) { return x.contiguous().view({-1, x.size(-1)}); }

// Runs row(r, buf) (fills buf with row r as float32), then quantizes it, for every row.
template <typename RowFn>
void run_rows(int64_t rows, int64_t n, const QuantSpec& spec, uint8_t* out, float* scales,
              RowFn row) {
  const int64_t groups = spec.is_static ? 0 : n / spec.group;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(n + vllm_fp8::kLanes), 0.0f);
    for (int64_t r = begin; r < end; ++r) {
      row(r, buf.data());
      if (spec.is_static) {
        vllm_fp8::quant_static(buf.data(), n, spec.scale, out + r * n);
      } else {
        vllm_fp8::quant_groups(buf.data(), n, spec.group, spec.min_scale, out + r * n,
                               scales + r * groups);
      }
    }
  });
}

// (q, scales): q shaped like `like` with the last dim n; scales [..., n / group] (dynamic) or
// an empty tensor (static).
std::tuple<at::Tensor, at::Tensor> make_outputs(const at::Tensor& like, int64_t n,
                                                const QuantSpec& spec) {
  std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end());
  shape.back() = n;
  at::Tensor q = at::empty(shape, like.options().dtype(at::kFloat8_e4m3fn));
  if (spec.is_static) return {q, at::empty({0}, like.options().dtype(at::kFloat))};
  shape.back() = n / spec.group;
  return {q, at::empty(shape, like.options().dtype(at::kFloat))};
}

float* scale_ptr(at::Tensor& scales, const QuantSpec& spec) {
  return spec.is_static ? nullptr : scales.data_ptr<float>();
}

}  // namespace

// x [..., n] -> (q [..., n] e4m3fn, scales [..., n / group] float32, or empty when static).
static std::tuple<at::Tensor, at::Tensor> quant_fp8(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& scale,
                                                    int64_t group, double min_scale) {
  const at::Tensor x2d = as_rows(x);
  const int64_t rows = x2d.size(0), n = x2d.size(1);
  const QuantSpec spec = make_spec(scale, group, n, min_scale);
  auto [q, scales] = make_outputs(x, n, spec);
  uint8_t* out = reinterpret_cast<uint8_t*>(q.data_ptr());
  float* sc = scale_ptr(scales, spec);
  dispatch_dtype(x, "quant_fp8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = ptr<T>(x2d);
    run_rows(rows, n, spec, out, sc,
             [&](int64_t r, float* buf) { vllm_fp8::copy_row(src + r * n, n, buf); });
  });
  return {q, scales};
}

// RMSNorm (optionally after adding a residual) then FP8 quantization.
// Returns (q, scales (empty when static), residual_out (empty without a residual)).
static std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_quant_fp8(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, const std::optional<at::Tensor>& scale,
    int64_t group, double min_scale) {
  const at::Tensor x2d = as_rows(x);
  const int64_t rows = x2d.size(0), n = x2d.size(1);
  const QuantSpec spec = make_spec(scale, group, n, min_scale);
  const bool has_res = residual.has_value() && residual->defined();
  const bool has_w = weight.has_value() && weight->defined();
  at::Tensor res2d, res_out, w;
  if (has_res) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "residual dtype must match x");
    res2d = as_rows(*residual);
    res_out = at::empty(x.sizes(), x.options());
  } else {
    res_out = at::empty({0}, x.options());
  }
  if (has_w) {
    TORCH_CHECK(weight->scalar_type() == x.scalar_type(), "weight dtype must match x");
    TORCH_CHECK(weight->numel() == n, "weight must have ", n, " elements");
    w = weight->contiguous();
  }
  auto [q, scales] = make_outputs(x, n, spec);
  uint8_t* out = reinterpret_cast<uint8_t*>(q.data_ptr());
  float* sc = scale_ptr(scales, spec);
  const float feps = static_cast<float>(eps);
  dispatch_dtype(x, "rms_norm_quant_fp8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = ptr<T>(x2d);
    const T* res = has_res ? ptr<T>(res2d) : nullptr;
    T* rout = has_res ? mut_ptr<T>(res_out) : nullptr;
    const T* wp = has_w ? ptr<T>(w) : nullptr;
    run_rows(rows, n, spec, out, sc, [&](int64_t r, float* buf) {
      vllm_fp8::rms_row(src + r * n, res ? res + r * n : nullptr, rout ? rout + r * n : nullptr,
                        wp, feps, n, buf);
    });
  });
  return {q, scales, res_out};
}

// SiluAndMul (x [..., 2d] -> [..., d]) then FP8 quantization.
static std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant_fp8(
    const at::Tensor& x, const std::optional<at::Tensor>& scale, int64_t group,
    double min_scale) {
  const at::Tensor x2d = as_rows(x);
  const int64_t rows = x2d.size(0), d = x2d.size(1) / 2;
  const QuantSpec spec = make_spec(scale, group, d, min_scale);
  auto [q, scales] = make_outputs(x, d, spec);
  uint8_t* out = reinterpret_cast<uint8_t*>(q.data_ptr());
  float* sc = scale_ptr(scales, spec);
  dispatch_dtype(x, "silu_and_mul_quant_fp8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = ptr<T>(x2d);
    run_rows(rows, d, spec, out, sc,
             [&](int64_t r, float* buf) { vllm_fp8::silu_mul_row(src + r * 2 * d, d, buf); });
  });
  return {q, scales};
}

namespace {

constexpr double kMinScale = 1.0 / (448.0 * 512.0);  // fp8_ops.MIN_SCALE

at::Tensor static_scaled_fp8_quant(const at::Tensor& x, const at::Tensor& scale) {
  return std::get<0>(quant_fp8(x, scale, 0, kMinScale));
}

std::tuple<at::Tensor, at::Tensor> dynamic_scaled_fp8_quant(const at::Tensor& x,
                                                            int64_t group_size) {
  return quant_fp8(x, std::nullopt, group_size, kMinScale);
}

at::Tensor rms_norm_static_fp8_quant(const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& scale, double epsilon) {
  return std::get<0>(rms_norm_quant_fp8(x, std::nullopt, weight, epsilon, scale, 0, kMinScale));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_static_fp8_quant(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& scale, double epsilon) {
  auto [q, s, res] = rms_norm_quant_fp8(x, residual, weight, epsilon, scale, 0, kMinScale);
  return {q, res};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_dynamic_fp8_quant(const at::Tensor& x,
                                                              const at::Tensor& weight,
                                                              double epsilon,
                                                              int64_t group_size) {
  auto [q, s, res] =
      rms_norm_quant_fp8(x, std::nullopt, weight, epsilon, std::nullopt, group_size, kMinScale);
  return {q, s};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_dynamic_fp8_quant(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double epsilon,
    int64_t group_size) {
  return rms_norm_quant_fp8(x, residual, weight, epsilon, std::nullopt, group_size, kMinScale);
}

at::Tensor silu_and_mul_static_fp8_quant(const at::Tensor& x, const at::Tensor& scale) {
  return std::get<0>(silu_and_mul_quant_fp8(x, scale, 0, kMinScale));
}

std::tuple<at::Tensor, at::Tensor> silu_and_mul_dynamic_fp8_quant(const at::Tensor& x,
                                                                  int64_t group_size) {
  return silu_and_mul_quant_fp8(x, std::nullopt, group_size, kMinScale);
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm, CPU, m) {
  m.impl("static_scaled_fp8_quant", &static_scaled_fp8_quant);
  m.impl("dynamic_scaled_fp8_quant", &dynamic_scaled_fp8_quant);
  m.impl("rms_norm_static_fp8_quant", &rms_norm_static_fp8_quant);
  m.impl("fused_add_rms_norm_static_fp8_quant", &fused_add_rms_norm_static_fp8_quant);
  m.impl("rms_norm_dynamic_fp8_quant", &rms_norm_dynamic_fp8_quant);
  m.impl("fused_add_rms_norm_dynamic_fp8_quant", &fused_add_rms_norm_dynamic_fp8_quant);
  m.impl("silu_and_mul_static_fp8_quant", &silu_and_mul_static_fp8_quant);
  m.impl("silu_and_mul_dynamic_fp8_quant", &silu_and_mul_dynamic_fp8_quant);
}
