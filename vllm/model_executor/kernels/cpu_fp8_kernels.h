// Row kernels for FP8 (float8_e4m3fn) activation quantization on the CPU, alone and fused
// with the op producing the activation (RMSNorm with or without a residual add, SiluAndMul).
// No torch dependency: cpu_fp8.cpp binds these to tensors.
//
// Each kernel reproduces the rounding steps of the plain-torch form it replaces (the layer's
// forward_native followed by QuantFP8.forward_native): the norm / activation is computed in
// float32 and rounded to the input dtype where torch rounds it, then divided by the scale,
// clamped to +-448 and rounded to e4m3 (nearest even). A row is built in a float scratch
// buffer (it stays in L1/L2) and quantized from there, so the input is read from memory once.
//
// Written with GCC/Clang vector extensions (16 float lanes): the compiler maps them onto
// AVX-512, AVX2 (two halves) or whatever the target has, without intrinsics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace vllm_fp8 {

constexpr int kLanes = 16;
constexpr float kFp8Max = 448.0f;

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint8_t vu8 __attribute__((vector_size(16)));

struct bf16_t {
  uint16_t x;
};
struct fp16_t {
  uint16_t x;
};

inline uint32_t as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline vf splat(float v) { return vf{} + v; }
inline vu splat_u(uint32_t v) { return vu{} + v; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vabs(vf a) { return (vf)((vu)a & splat_u(0x7fffffffu)); }
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// ---- float16 <-> float32, scalar (float16 is rare on the CPU) -------------------------------
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero / subnormal: mant * 2^-24 is exact in float32
    return from_bits(sign | as_bits(static_cast<float>(mant) * 5.9604644775390625e-8f));
  }
  if (exp == 31) return from_bits(sign | 0x7f800000u | (mant << 13));
  return from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float v) {  // round to nearest even
  uint32_t f = as_bits(v);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o;
  if (f >= 0x47800000u) {  // overflow to inf, or NaN
    o = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (f < 0x38800000u) {  // below the smallest normal: let float addition round
    o = as_bits(from_bits(f) + 0.5f) - as_bits(0.5f);
  } else {
    const uint32_t odd = (f >> 13) & 1u;
    f += 0xc8000fffu;  // rebias the exponent (15 - 127) and add half an ulp minus one
    f += odd;
    o = f >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

// ---- element types: 16-lane loads/stores and "round to this dtype" ---------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
  static vf round(vf v) { return v; }
};

template <>
struct Elem<bf16_t> {
  static vf load(const bf16_t* p) {
    vu16 h;
    std::memcpy(&h, p, sizeof(h));
    return (vf)(__builtin_convertvector(h, vu) << 16);
  }
  static vu rounded_bits(vf v) {
    const vu u = (vu)v;
    return u + splat_u(0x7fffu) + ((u >> 16) & splat_u(1u));
  }
  static void store(bf16_t* p, vf v) {
    const vu16 h = __builtin_convertvector(rounded_bits(v) >> 16, vu16);
    std::memcpy(p, &h, sizeof(h));
  }
  static vf round(vf v) { return (vf)(rounded_bits(v) & splat_u(0xffff0000u)); }
};

template <>
struct Elem<fp16_t> {
  static vf load(const fp16_t* p) {
    vf v;
    for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i].x);
    return v;
  }
  static void store(fp16_t* p, vf v) {
    for (int i = 0; i < kLanes; ++i) p[i].x = float_to_half(v[i]);
  }
  static vf round(vf v) {
    for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(float_to_half(v[i]));
    return v;
  }
};

// Partial loads/stores for a row's tail (len < 16); missing lanes read as 0.
template <typename T>
inline vf load_n(const T* p, int64_t len) {
  T tmp[kLanes];
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, p, sizeof(T) * len);
  return Elem<T>::load(tmp);
}
template <typename T>
inline void store_n(T* p, vf v, int64_t len) {
  T tmp[kLanes];
  Elem<T>::store(tmp, v);
  std::memcpy(p, tmp, sizeof(T) * len);
}
template <typename T>
inline vf load_any(const T* p, int64_t len) {
  return len >= kLanes ? Elem<T>::load(p) : load_n(p, len);
}
template <typename T>
inline void store_any(T* p, vf v, int64_t len) {
  if (len >= kLanes) {
    Elem<T>::store(p, v);
  } else {
    store_n(p, v, len);
  }
}

// ---- float32 -> e4m3fn -----------------------------------------------------------------------
// v is finite and within [-448, 448]. Normals: round the mantissa to 3 bits (nearest even) and
// rebias the exponent (127 -> 7). Below 2^-6 the e4m3 step is 2^-9, so the code is
// round(|v| * 512) (8, the smallest normal, has code 8 too): 2^23 + x rounds x to an integer.
inline vu8 to_e4m3(vf v) {
  const vu bits = (vu)v;
  const vu sign = (bits >> 24) & splat_u(0x80u);
  const vu abits = bits & splat_u(0x7fffffffu);
  const vu r = abits + splat_u(0x7ffffu) + ((abits >> 20) & splat_u(1u));
  const vu normal = ((((r >> 23) - splat_u(120u)) << 3) | ((r >> 20) & splat_u(7u))) &
                    splat_u(0x7fu);
  const vf a = (vf)abits;
  const vu sub = (vu)(a * splat(512.0f) + splat(8388608.0f)) & splat_u(0xfu);
  const vu code = (vu)(a < splat(0.015625f) ? (vi)sub : (vi)normal) | sign;
  return __builtin_convertvector(code, vu8);
}

inline vu8 quant16(vf v, vf scale) {
  return to_e4m3(vmin(vmax(v / scale, splat(-kFp8Max)), splat(kFp8Max)));
}

// exp for 16 lanes (Cephes-style: 2^n * p(r), |r| <= ln2/2), a few ulp from libm.
inline vf vexp(vf x) {
  x = vmin(vmax(x, splat(-87.3f)), splat(88.7f));
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * splat(1.44269504088896341f) + magic;
  const vf n = t - magic;
  const vi ni = (vi)t - (vi)magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const vf y = p * r * r + r + splat(1.0f);
  return (vf)((vi)y + (ni << 23));
}

// ---- quantization of a float row --------------------------------------------------------------
inline void quant_static(const float* buf, int64_t n, float scale, uint8_t* out) {
  const vf s = splat(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vu8 q = quant16(Elem<float>::load(buf + i), s);
    std::memcpy(out + i, &q, kLanes);
  }
  if (i < n) {
    const vu8 q = quant16(load_n(buf + i, n - i), s);
    std::memcpy(out + i, &q, n - i);
  }
}

inline float amax(const float* buf, int64_t n) {
  vf m = vf{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = vmax(m, vabs(Elem<float>::load(buf + i)));
  if (i < n) m = vmax(m, vabs(load_n(buf + i, n - i)));
  return hmax(m);
}

// One scale per `group` columns: max(amax / 448, min_scale).
inline void quant_groups(const float* buf, int64_t n, int64_t group, float min_scale,
                         uint8_t* out, float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, ++gi) {
    const int64_t len = std::min(group, n - g0);
    const float scale = std::max(amax(buf + g0, len) / kFp8Max, min_scale);
    scales[gi] = scale;
    quant_static(buf + g0, len, scale, out + g0);
  }
}

// ---- producers of one float row (buf holds n floats rounded up to 16) --------------------------
template <typename T>
inline void copy_row(const T* x, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; i += kLanes) {
    Elem<float>::store(buf + i, load_any(x + i, n - i));
  }
}

// RMSNorm.forward_native: x (+ residual) in float32 (the sum, rounded to T, is the new
// residual), normalized, rounded to T, times the weight in T.
template <typename T>
inline void rms_row(const T* x, const T* residual, T* residual_out, const T* weight, float eps,
                    int64_t n, float* buf) {
  vf acc = vf{};
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t len = n - i;
    vf v = load_any(x + i, len);
    if (residual != nullptr) {
      v += load_any(residual + i, len);
      store_any(residual_out + i, v, len);
    }
    Elem<float>::store(buf + i, v);
    acc += v * v;
  }
  const vf inv = splat(1.0f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    vf y = Elem<T>::round(Elem<float>::load(buf + i) * inv);
    if (weight != nullptr) y = Elem<T>::round(y * load_any(weight + i, n - i));
    Elem<float>::store(buf + i, y);
  }
}

// SiluAndMul.forward_native on x = [gate | up] (d each): silu(gate) rounded to T, times up,
// rounded to T.
template <typename T>
inline void silu_mul_row(const T* x, int64_t d, float* buf) {
  for (int64_t i = 0; i < d; i += kLanes) {
    const int64_t len = d - i;
    const vf g = load_any(x + i, len);
    const vf s = Elem<T>::round(g / (splat(1.0f) + vexp(-g)));
    Elem<float>::store(buf + i, Elem<T>::round(s * load_any(x + d + i, len)));
  }
}

}  // namespace vllm_fp8
