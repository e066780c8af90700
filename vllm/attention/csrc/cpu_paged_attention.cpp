// Paged attention on the CPU that reads the KV cache in place (no gather, no padding).
//
//   torch.ops.vllm_cpu_attn.paged_attention(query, kv_cache, block_table, seq_lens,
//                                           query_start_loc, req_indices, scale, out,
//                                           window=0, soft_cap=0.0, k_scale=1.0,
//                                           v_scale=1.0)
//   torch.ops.vllm_cpu_attn.write_and_attend(query, key, value, kv_cache, slot_mapping,
//                                            block_table, seq_lens, query_start_loc,
//                                            req_indices, scale, out, window=0,
//                                            soft_cap=0.0, k_scale=1.0, v_scale=1.0)
//                                            (2-D q/k/v/out)
//
// query  [T, H, D]   (rows may be strided; the head and channel dims must be dense)
// kv_cache [2, num_blocks, block_size, KVH, D]   contiguous, float32, bfloat16, float16 or
//                                               FP8 (float8_e4m3fn, float8_e5m2), whatever
//                                               the query's (float32, bfloat16, float16)
// k_scale, v_scale: the cache holds K / k_scale and V / v_scale (FP8 caches' per-layer scales;
// 1.0 otherwise); written rows are divided by them, read ones multiplied
// block_table [R, max_blocks] int32, seq_lens [R] int64, query_start_loc [R + 1] int64
// req_indices [n] int64: the requests to compute (others' rows of `out` are left alone)
// out    [T, H, D]   written for the rows of the listed requests
//
// Request r owns query rows query_start_loc[r] .. query_start_loc[r+1]; its context is
// seq_len - query_len cached tokens, and its query row i (absolute position p = context + i)
// attends to cache positions 0 .. p, or with a sliding window W > 0 to the W positions
// p - W + 1 .. p (transformers' sliding-window causal mask: key j is visible when
// p - W < j <= p). The new tokens' K/V must already be in the cache. Only blocks holding
// positions visible to some row of a work item are read: the padding entries of a block-table
// row (dummy block 0) are never touched, and with a window the blocks before every row's
// window are skipped, so a long context costs no more than its last W positions.
// soft_cap c > 0 (logits soft-capping, Gemma 2): each scaled score s = scale * q.k becomes
// c * tanh(s / c) before the mask and the softmax; 0 = none. The no-cap path is a separate
// instantiation of the kernel (a template flag), so it runs exactly the code it ran before.
//
// Work items are (request, chunk of up to kRowChunk query rows, group of KV heads): the
// G = H / KVH query heads that share a KV head are computed together, so each K/V row is read
// once and used G times; KV heads are split into groups only as far as needed to keep every
// thread busy, since a whole position row (all heads) streams sequentially. Items are handed
// out longest first from an atomic counter inside at::parallel_for (mixed lengths stay
// balanced). All arithmetic is float32. An item with few rows per KV head (decode) scores every
// position first and then adds the weighted V rows (two_pass_item; head sizes 16-128), or
// runs an online softmax over chunks of 16 keys row by row (fold_keys); one with many (a
// prompt's chunk, GQA groups) runs the online softmax with its rows in the vector lanes
// (fold_lanes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowChunk = 16;  // query rows per work item
constexpr int kKeys = 16;          // keys scored together (one 16-lane vector)
constexpr int64_t kDenseMaxRows = 8;  // scores_dense below this many rows (measured)
constexpr int64_t kCacheOrderMinRows = 4;  // two_pass_item in cache order from (measured)

// 16 float lanes (GCC/Clang vector extensions: AVX-512 registers, two AVX2 halves, ...).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned

inline vf splat(float v) { return vf{} + v; }
inline vf load_u(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store_u(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// The ISA's own vector width (kLanes floats: 16 on AVX-512, 8 below), for the paths written
// for it (two_pass_item, fold_lanes): a 16-lane vector below AVX-512 is a pair of registers,
// and arrays of them were kept on the stack.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vl __attribute__((vector_size(kLanes * 4)));
typedef int32_t vli __attribute__((vector_size(kLanes * 4)));
typedef float vl_u __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
inline vl load_l(const float* p) { return *reinterpret_cast<const vl_u*>(p); }
inline void store_l(float* p, vl v) { *reinterpret_cast<vl_u*>(p) = v; }
// The largest and the sum of the lanes of a float vector (vf or vl).
template <typename V>
inline float hmax(V v) {
  float m = v[0];
  for (int i = 1; i < static_cast<int>(sizeof(V) / 4); ++i) m = std::max(m, v[i]);
  return m;
}
template <typename V>
inline float hsum(V v) {
  float s = 0.0f;
  for (int i = 0; i < static_cast<int>(sizeof(V) / 4); ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their running max), about 2 ulp; exactly 0 below -87
// (so masked -inf scores give 0). 2^n * e^y with n = round(x / ln 2), |y| <= ln 2 / 2, and a
// degree-6 Taylor polynomial for e^y.
template <typename V>
inline V exp_nonpositive(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V t = x * 1.44269504088896341f;
  const V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const V y = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n * ln2 in two parts
  V p = V{} + 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? V{} : p * scale;
}

// cap * tanh(x / cap), lane-wise, about 3 ulp. With a = |x / cap|: below 0.3 the odd Taylor
// series of tanh to a^13 (truncation < 1e-10 relative); from 0.3 on (1 - t) / (1 + t) with
// t = e^(-2a) <= 0.55, which loses at most a bit or two to the subtraction (and is exactly 1
// once t underflows to 0); then x's sign.
template <typename V>
inline V soft_cap(V x, float cap, float inv_cap) {
  const V y = x * inv_cap;
  const V a = y < 0.0f ? -y : y;
  const V a2 = a * a;
  V p = V{} + 21844.0f / 6081075.0f;
  p = p * a2 - 1382.0f / 155925.0f;
  p = p * a2 + 62.0f / 2835.0f;
  p = p * a2 - 17.0f / 315.0f;
  p = p * a2 + 2.0f / 15.0f;
  p = p * a2 - 1.0f / 3.0f;
  const V series = a + a * a2 * p;
  const V t = exp_nonpositive(-2.0f * a);
  const V th = a < 0.3f ? series : (1.0f - t) / (1.0f + t);
  return (y < 0.0f ? -th : th) * cap;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::Float8_e4m3fn v) { return static_cast<float>(v); }
inline float to_float(c10::Float8_e5m2 v) { return static_cast<float>(v); }

// FP8 caches: the largest finite value of each format (a stored value saturates there).
template <typename T>
constexpr float kFp8Max = 0.0f;
template <>
constexpr float kFp8Max<c10::Float8_e4m3fn> = 448.0f;
template <>
constexpr float kFp8Max<c10::Float8_e5m2> = 57344.0f;
template <typename T>
constexpr bool kIsFp8 = kFp8Max<T> > 0.0f;

// out[0:n] = the FP8 bytes of x[0:n] (|x| at most the format's largest finite value, or NaN),
// rounded to nearest even as c10's (and torch's) conversion rounds them, 16 at a time (c10's
// own is a scalar loop of branches: ~4 ns a value for E4M3, a tenth of a 2048-token prompt's
// time at 8 layers). Fp8: c10::Float8_e4m3fn (3 mantissa bits, bias 7) or c10::Float8_e5m2
// (2, 15).
template <typename Fp8>
inline void to_fp8(const float* x, uint8_t* out, int64_t n) {
  constexpr int kMant = std::is_same_v<Fp8, c10::Float8_e4m3fn> ? 3 : 2;
  constexpr int kBias = kMant == 3 ? 7 : 15;
  constexpr int kShift = 23 - kMant;
  const float min_normal = std::ldexp(1.0f, 1 - kBias);
  const float inv_step = std::ldexp(1.0f, kBias - 1 + kMant);  // 1 / the subnormal step
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    vf v;
    std::memcpy(&v, x + i, sizeof(v));
    vi bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const vi sign = (bits >> 24) & 0x80;
    const vi abs_bits = bits & 0x7FFFFFFF;
    vf a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    // normal: the mantissa rounded to kMant bits (nearest even; a carry moves the exponent),
    // the exponent rebiased from 127 to kBias
    const vi normal = ((abs_bits + ((1 << (kShift - 1)) - 1) + ((abs_bits >> kShift) & 1)) >>
                       kShift) - ((127 - kBias) << kMant);
    // below the smallest normal: multiples of the subnormal step, to nearest even by adding
    // and taking away 2^23
    const vi sub = __builtin_convertvector((a * inv_step + 8388608.0f) - 8388608.0f, vi);
    const vi code = a != a ? vi{} + 0x7F : (a < min_normal ? sub : normal);  // NaN: 0x7F
    const vi signed_code = code | sign;
    for (int l = 0; l < 16; ++l) out[i + l] = static_cast<uint8_t>(signed_code[l]);
  }
  for (; i < n; ++i) {
    const Fp8 f(x[i]);
    std::memcpy(out + i, &f, 1);
  }
}

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}

struct Item {
  int64_t req;
  int64_t head0;  // KV heads [head0, head1)
  int64_t head1;
  int64_t row0;  // query rows [row0, row1) of the request
  int64_t row1;
  int64_t cost;
};

// Per-thread scratch, sized for the largest work item of the call. The buffers of one path
// are sized when it first runs (`for_fold`, `for_copies`, `for_lanes`): a decode call never
// allocates (nor zeroes) the others, ~100 KB per thread a call before, nor a float32 prompt
// the block copies it does not make.
struct Scratch {
  std::vector<float> q, acc, m, l;
  std::vector<float> kt, probs;  // fold_keys
  std::vector<float> kbuf, vbuf;  // the block's float K/V copies (fold_keys, fold_lanes)
  std::vector<float> scores;  // two_pass_item: [rows][positions]
  std::vector<float> part;    // two_pass_item in cache order: [rows][kLanes keys][kLanes]
  std::vector<int64_t> first, limit;  // each row's first and last visible position
  Scratch(int64_t rows, int64_t D)
      : q(rows * D), acc(rows * D), m(rows), l(rows), first(rows), limit(rows) {}
  // fold_lanes' path: per group of kLanes rows Q^T [D][kLanes], running max and sum, first
  // and last visible position; the chunk's probabilities [16 keys][kLanes]
  std::vector<float> qt, gm, gl, ptile;
  std::vector<int32_t> gfirst, glimit;
  void for_lanes(int64_t groups, int64_t D) {
    if (static_cast<int64_t>(gm.size()) >= groups * kLanes) return;
    qt.resize(groups * D * kLanes);
    gm.resize(groups * kLanes);
    gl.resize(groups * kLanes);
    gfirst.resize(groups * kLanes);
    glimit.resize(groups * kLanes);
    ptile.resize(kKeys * kLanes);
  }
  void for_fold(int64_t rows, int64_t D) {
    if (!probs.empty()) return;
    kt.resize(D * kKeys);
    probs.resize(rows * kKeys);
  }
  void for_copies(int64_t block_elems) {  // the block's float K/V (not when read in place)
    if (!kbuf.empty()) return;
    kbuf.resize(block_elems);
    vbuf.resize(block_elems);
  }
};

// out[j] = sum of the 16 lanes of p[j], for j < 16: four rounds that each add the two halves
// of pairs of vectors, interleaved so that the last round leaves key j in lane j.
inline vf reduce16(const vf* p) {
  vf v[8], w[4], x[2];
  for (int j = 0; j < 8; ++j) {
    const vf a = p[j], b = p[j + 8];  // -> lanes 0-7: key j, lanes 8-15: key j + 8
    v[j] = __builtin_shuffle(a, b, vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(a, b, vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int j = 0; j < 4; ++j) {
    const vf a = v[j], b = v[j + 4];  // -> groups of 4: keys j, j + 4, j + 8, j + 12
    w[j] = __builtin_shuffle(a, b, vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(a, b, vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  for (int j = 0; j < 2; ++j) {
    const vf a = w[j], b = w[j + 2];  // -> pairs: keys j, j + 2, ..., j + 14
    x[j] = __builtin_shuffle(a, b, vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(a, b, vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  return __builtin_shuffle(x[0], x[1], vi{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
         __builtin_shuffle(x[0], x[1], vi{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

// kLanes floats widened from T.
inline vl load_lanes(const float* p) { return load_l(p); }
inline vl load_lanes(const c10::BFloat16* p) {
  typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
  typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
  vu16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu32 wide = __builtin_convertvector(raw, vu32) << 16;
  vl v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
inline vl load_lanes(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  vl v;
#if defined(__AVX512F__) || defined(__F16C__)
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}

// FP8 through float16: an e5m2 byte is the high byte of the float16 of the same value; an
// e4m3fn byte's exponent and mantissa bits, moved into a float16's (the sign to its sign),
// read 2^-8 of the value (float16's exponent bias is 8 more), subnormals included.
template <typename Fp8>
inline vl load_fp8_lanes(const Fp8* p) {
  typedef uint8_t vu8 __attribute__((vector_size(kLanes)));
  typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
  vu8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu16 b = __builtin_convertvector(raw, vu16);
  vu16 half_bits;
  if constexpr (std::is_same_v<Fp8, c10::Float8_e5m2>)
    half_bits = b << 8;
  else
    half_bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8);
  vl v = load_lanes(reinterpret_cast<const c10::Half*>(&half_bits));
  if constexpr (std::is_same_v<Fp8, c10::Float8_e4m3fn>) v *= 256.0f;
  return v;
}
inline vl load_lanes(const c10::Float8_e4m3fn* p) { return load_fp8_lanes(p); }
inline vl load_lanes(const c10::Float8_e5m2* p) { return load_fp8_lanes(p); }

// dst[0:n] = float(src[0:n]).
// (Plain loops the compiler vectorizes at the ISA's own width: a copy through 16-lane vectors
// went through the stack in 16-byte pieces below AVX-512.)
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
  } else {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store_l(dst + i, load_lanes(src + i));
    for (; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

// out[j] = sum of the lanes of p[j], for j < kLanes (reduce16 on AVX-512; below it the same
// three rounds for 8 lanes).
#if defined(__AVX512F__)
inline vl reduce_lanes(const vl* p) { return reduce16(p); }
#else
inline vl reduce_lanes(const vl* p) {
  vl v[4], w[2];
  for (int j = 0; j < 4; ++j) {  // -> lanes 0-3: key j, lanes 4-7: key j + 4
    const vl a = p[j], b = p[j + 4];
    v[j] = __builtin_shuffle(a, b, vli{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(a, b, vli{4, 5, 6, 7, 12, 13, 14, 15});
  }
  for (int j = 0; j < 2; ++j) {  // -> pairs: keys j, j + 2, j + 4, j + 6
    const vl a = v[j], b = v[j + 2];
    w[j] = __builtin_shuffle(a, b, vli{0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(a, b, vli{2, 3, 10, 11, 6, 7, 14, 15});
  }
  return __builtin_shuffle(w[0], w[1], vli{0, 8, 2, 10, 4, 12, 6, 14}) +
         __builtin_shuffle(w[0], w[1], vli{1, 9, 3, 11, 5, 13, 7, 15});
}
#endif

// Scores of one row against kLanes keys `k_stride` elements apart (keys >= nk score 0; the
// caller masks): a vector dot product per key, then one reduce_lanes.
template <typename T>
inline vl scores_lanes(const float* q, int64_t D, const T* k, int64_t k_stride, int nk) {
  vl p[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    vl a{};
    if (j < nk) {
      const T* kj = k + j * k_stride;
      for (int64_t c = 0; c < D; c += kLanes) a += load_l(q + c) * load_lanes(kj + c);
    }
    p[j] = a;
  }
  return reduce_lanes(p);
}

// Scores of one row against a chunk of nk keys (lanes >= nk are zero; the caller masks).
// Head sizes that are a multiple of 16: a vector dot product per key over K rows `k_stride`
// elements apart.
#if defined(__AVX512F__)
// One 16-lane vector per key, then one reduce16 for the 16 keys (scores_lanes).
inline vf scores_dense(const float* q, int64_t D, const float* k, int64_t k_stride, int nk) {
  return scores_lanes(q, D, k, k_stride, nk);
}
#else
// Below AVX-512 the 16 accumulators of reduce16 are 32 half-vectors, twice the register file:
// they were kept on the stack and the cross-lane shuffles went through general registers (a
// decode call of the 50M Llama spent ~100 us at 96 positions, AVX2). Each key's dot product is
// summed within two 8-lane registers and reduced on its own instead.
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8_u __attribute__((vector_size(32), aligned(4), may_alias));
inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8_u*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8_u*>(p) = v; }
inline vf scores_dense(const float* q, int64_t D, const float* k, int64_t k_stride, int nk) {
  alignas(64) float out[kKeys] = {};
  for (int j = 0; j < nk; ++j) {
    const float* kj = k + j * k_stride;
    vf8 a0{}, a1{};
    for (int64_t c = 0; c < D; c += kKeys) {
      a0 += load8(q + c) * load8(kj + c);
      a1 += load8(q + c + 8) * load8(kj + c + 8);
    }
    const vf8 a = a0 + a1;
    out[j] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
  }
  return load_u(out);
}
#endif

// Other head sizes: through K^T [D][kKeys], one broadcast FMA per channel.
inline vf scores_transposed(const float* q, int64_t D, const float* kt) {
  // kt is a std::vector's storage: 4-byte aligned only, so unaligned loads (an aligned vector
  // dereference faults on AVX2, where the 64-byte vector is split into 32-byte moves).
  vf a0{}, a1{};
  int64_t d = 0;
  for (; d + 2 <= D; d += 2) {
    a0 += q[d] * load_u(kt + d * kKeys);
    a1 += q[d + 1] * load_u(kt + (d + 1) * kKeys);
  }
  for (; d < D; ++d) a0 += q[d] * load_u(kt + d * kKeys);
  return a0 + a1;
}

// One chunk of up to kKeys keys at positions pos0 .. pos0 + nk - 1 (float rows of K/V given
// by k_rows / v_rows with stride `row_stride`), folded into the online softmax of each of the
// item's few rows (fewer than kDenseMaxRows per KV head: fold_lanes takes more); kCap: scores
// soft-capped at `cap` first.
template <bool kCap>
inline void fold_keys(Scratch& s, int64_t r0, int64_t n_rows, int64_t D, const float* k_rows,
                      const float* v_rows, int64_t row_stride, int64_t pos0, int nk, float cap,
                      float inv_cap) {
  // Head sizes that are a multiple of 16: per-key dot products over the rows in place; others
  // through K^T [D][kKeys] (zero lanes past nk).
  const bool dense = D % kKeys == 0;
  if (!dense) {
    float* kt = s.kt.data();
    for (int j = 0; j < kKeys; ++j) {
      const float* k = k_rows + j * row_stride;
      for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = j < nk ? k[d] : 0.0f;
    }
  }
  vi lane;
  for (int j = 0; j < kKeys; ++j) lane[j] = j;
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t row = r0; row < r0 + n_rows; ++row) {
    float* p = s.probs.data() + row * kKeys;
    // Lanes [lo, visible) hold this row's visible keys (lo > 0 only at its window's start).
    const int64_t visible = std::min<int64_t>(nk, s.limit[row] - pos0 + 1);
    const int64_t lo = std::max<int64_t>(0, s.first[row] - pos0);
    if (visible <= lo) {
      store_u(p, splat(0.0f));
      continue;
    }
    const float* q = s.q.data() + row * D;
    vf score = dense ? scores_dense(q, D, k_rows, row_stride, static_cast<int>(visible))
                     : scores_transposed(q, D, s.kt.data());
    if constexpr (kCap) score = soft_cap(score, cap, inv_cap);
    score = (lane < static_cast<int32_t>(visible)) & (lane >= static_cast<int32_t>(lo))
                ? score
                : neg_inf;
    const float new_max = std::max(s.m[row], hmax(score));
    const float alpha = std::exp(s.m[row] - new_max);  // 0 on the first chunk
    const vf e = exp_nonpositive(score - new_max);
    store_u(p, e);
    s.l[row] = s.l[row] * alpha + hsum(e);
    s.m[row] = new_max;
    if (alpha != 1.0f) {
      float* acc = s.acc.data() + row * D;
      for (int64_t c = 0; c < D; ++c) acc[c] *= alpha;
    }
  }
  // acc += P V
  const float* v = v_rows;
  const int64_t v_stride = row_stride;
  for (int64_t row = r0; row < r0 + n_rows; ++row) {
    const float* p = s.probs.data() + row * kKeys;
    float* acc = s.acc.data() + row * D;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + kKeys <= D; c += kKeys) {
      vf a = load_u(acc + c);
      for (int j = 0; j < nk; ++j) a += p[j] * load_u(v + j * v_stride + c);
      store_u(acc + c, a);
    }
#else
    // Two 8-lane accumulators: a 16-lane one was kept on the stack and moved through general
    // registers on every key (AVX2).
    for (; c + kKeys <= D; c += kKeys) {
      vf8 a0 = load8(acc + c), a1 = load8(acc + c + 8);
      for (int j = 0; j < nk; ++j) {
        const float* vj = v + j * v_stride + c;
        a0 += p[j] * load8(vj);
        a1 += p[j] * load8(vj + 8);
      }
      store8(acc + c, a0);
      store8(acc + c + 8, a1);
    }
#endif
    for (; c < D; ++c) {
      float a = acc[c];
      for (int j = 0; j < nk; ++j) a += p[j] * v[j * v_stride + c];
      acc[c] = a;
    }
  }
}

// ---- items with many rows per KV head (prompts, GQA groups): rows in the lanes ------------
// A group of up to kLanes query rows of one KV head (the ISA's vector width: 16 on AVX-512, 8
// below) folds a chunk of up to 16 keys at a time with the rows in the vector lanes: each key's
// scores for the group's rows are one vector, the sum over d of K[j][d] (broadcast) * Q^T[d]
// (Q^T made once per item), four keys at a time so that every Q^T load serves four FMA chains.
// The online softmax is then lane-wise (a running max and sum per lane, no horizontal
// reductions), and the chunk's probabilities [key][lane] weight the V rows row by row, in
// DV-channel accumulators. Lanes past the group's rows are masked (limit -1): probability 0.
constexpr int kPvVectors = 64 / kLanes;  // P V accumulators: 64 channels at a time

template <bool kCap>
inline void fold_lanes(Scratch& s, int64_t grp, int64_t r0, int64_t n_valid, int64_t D,
                       const float* k, const float* v, int64_t stride, int64_t pos0, int nk,
                       float cap, float inv_cap) {
  const float* qt = s.qt.data() + grp * D * kLanes;
  vl sc[kKeys];
  int j = 0;
  for (; j + 4 <= nk; j += 4) {
    const float* k0 = k + j * stride;
    const float* k1 = k0 + stride;
    const float* k2 = k1 + stride;
    const float* k3 = k2 + stride;
    vl a0{}, a1{}, a2{}, a3{};
    for (int64_t d = 0; d < D; ++d) {
      const vl qv = load_l(qt + d * kLanes);
      a0 += k0[d] * qv;
      a1 += k1[d] * qv;
      a2 += k2[d] * qv;
      a3 += k3[d] * qv;
    }
    sc[j] = a0;
    sc[j + 1] = a1;
    sc[j + 2] = a2;
    sc[j + 3] = a3;
  }
  for (; j < nk; ++j) {
    const float* kj = k + j * stride;
    vl a{};
    for (int64_t d = 0; d < D; ++d) a += kj[d] * load_l(qt + d * kLanes);
    sc[j] = a;
  }
  vli first, limit;
  std::memcpy(&first, s.gfirst.data() + grp * kLanes, sizeof(first));
  std::memcpy(&limit, s.glimit.data() + grp * kLanes, sizeof(limit));
  const vl neg_inf = vl{} - std::numeric_limits<float>::infinity();
  const vl m_old = load_l(s.gm.data() + grp * kLanes);
  vl mx = m_old;
  for (j = 0; j < nk; ++j) {
    vl x = sc[j];
    if constexpr (kCap) x = soft_cap(x, cap, inv_cap);
    const int32_t pos = static_cast<int32_t>(pos0 + j);
    x = (limit >= pos) & (first <= pos) ? x : neg_inf;
    sc[j] = x;
    mx = x > mx ? x : mx;
  }
  const vl m_safe = mx == neg_inf ? vl{} : mx;        // lanes with no visible key yet
  const vl alpha = exp_nonpositive(m_old - m_safe);  // 0 on a lane's first visible chunk
  vl sum{};
  float* pt = s.ptile.data();
  for (j = 0; j < nk; ++j) {
    const vl e = exp_nonpositive(sc[j] - m_safe);
    store_l(pt + j * kLanes, e);
    sum += e;
  }
  store_l(s.gl.data() + grp * kLanes, load_l(s.gl.data() + grp * kLanes) * alpha + sum);
  store_l(s.gm.data() + grp * kLanes, mx);
  for (int64_t i = 0; i < n_valid; ++i) {
    float* acc = s.acc.data() + (r0 + i) * D;
    const float a_i = alpha[i];
    if (a_i != 1.0f)
      for (int64_t c = 0; c < D; ++c) acc[c] *= a_i;
    int64_t c0 = 0;
    for (; c0 + kPvVectors * kLanes <= D; c0 += kPvVectors * kLanes) {
      vl a[kPvVectors];
      for (int c = 0; c < kPvVectors; ++c) a[c] = load_l(acc + c0 + c * kLanes);
      for (int jj = 0; jj < nk; ++jj) {
        const float w = pt[jj * kLanes + i];
        const float* vj = v + jj * stride + c0;
        for (int c = 0; c < kPvVectors; ++c) a[c] += w * load_l(vj + c * kLanes);
      }
      for (int c = 0; c < kPvVectors; ++c) store_l(acc + c0 + c * kLanes, a[c]);
    }
    for (; c0 + kLanes <= D; c0 += kLanes) {
      vl a = load_l(acc + c0);
      for (int jj = 0; jj < nk; ++jj) a += pt[jj * kLanes + i] * load_l(v + jj * stride + c0);
      store_l(acc + c0, a);
    }
    for (; c0 < D; ++c0) {
      float a = acc[c0];
      for (int jj = 0; jj < nk; ++jj) a += pt[jj * kLanes + i] * v[jj * stride + c0];
      acc[c0] = a;
    }
  }
}

// ---- items with few rows per KV head (decode): two passes, K and V read in place ----------
// fold_keys runs an online softmax per chunk of 16 keys (a running max and sum per row, the
// accumulator rescaled each time) over float copies of each block's K and V. With a row or
// two per KV head that bookkeeping and the copies cost more than the dot products (a decode
// call of the 50M Llama, 8 heads of 64 at 150 positions: 27 us on one thread). Here each KV
// head's rows are scored against every visible position first, straight from the cache
// (bfloat16 and half widened in registers), then one max, one exp pass and one sum per row,
// then the probability-weighted V rows are added, DV vectors of kLanes channels per row. Measured
// on the Zen 4 dev machine (AVX-512, bfloat16, one decode row, 8 heads of 64, the call from
// Python): 150 positions 26.9 -> 14.7 us on one thread, 18.1 -> 12.2 on two; 500 positions
// 80 -> 42 and 51 -> 25 us; with the cache cold (evicted by the weights, as in a model step)
// 1.0-1.2x, the reads' speed bounding both; 16 such rows 1.3-1.7x warm, 1.1-1.2x cold.
// An item of whole position rows (every KV head: a batch of decode requests) with at least
// kCacheOrderMinRows rows reads each chunk in cache order instead, position by position (each
// key's 16-lane partial dot products kept per row, reduced 16 keys at a time; V added into
// the rows' accumulators in memory): one thread reads a cold cache sequentially at ~29 GB/s
// here but head by head (16 rows 1 KB apart, then the next head's) at ~16. Zen 4, 2 threads,
// 16 decode rows, 8 heads of 64, cold: bfloat16 at 192-248 positions 1.38-1.47x, float32
// 1.25-1.34x; 4-8 rows 1.03-1.29x; batch-16 runs of the 50M Llama end to end 1.05x (float32)
// and 1.11x (bfloat16). Items of some of the heads (1-2 requests on 2 threads) keep the head
// by head order: cache order measured 0.72-0.87x there (strided slices of each row).
// Written in vectors of the ISA's width (kLanes; chunks of kLanes keys), it serves AVX2 builds
// too, where it replaced fold_keys (whose 16-lane vectors are register pairs there): Zen 4 as
// AVX2, 2 threads, cold, 16 decode rows of 8 heads of 64 at 192 positions float32 1.68-1.90x,
// bfloat16 1.29x, GQA 14/2 1.39x; one request at 150-1000 positions 1.36-2.35x.

// The item's rows (Scratch `s`: query, first and last visible position set; head_rows rows
// per KV head, KV heads [head0, head1), row (g - head0) * head_rows + i) against positions
// [key0, n_keys), whose block ids are `blocks`: leaves each row's unnormalized result in
// s.acc (zeroed by the caller) and its softmax sum in s.l (the caller divides). Both passes
// walk the positions in cache order, every KV head of the item at each chunk, so a cold cache
// streams block by block (the next block prefetched) rather than in strided slices per head.
// DV = D / kLanes.
template <typename T, bool kCap, int DV>
void two_pass_item(Scratch& s, int64_t head0, int64_t head1, int64_t head_rows, const T* cache,
                   const int32_t* blocks, int64_t num_blocks, int64_t BS, int64_t c_pos,
                   int64_t c_blk, int64_t c_kv, int64_t key0, int64_t n_keys, float cap,
                   float inv_cap, bool cache_order) {
  constexpr int64_t D = DV * kLanes;
  const int64_t n_rows = head_rows * (head1 - head0);
  const int64_t npos = n_keys - key0;
  // a row's scores: npos, then -inf up to a whole vector (+ a vector of slack for the last
  // chunk's full-width store)
  const int64_t stride = (npos + kLanes - 1) / kLanes * kLanes + kLanes;
  if (static_cast<int64_t>(s.scores.size()) < n_rows * stride) s.scores.resize(n_rows * stride);
  if (cache_order && static_cast<int64_t>(s.part.size()) < n_rows * kLanes * kLanes)
    s.part.resize(n_rows * kLanes * kLanes);
  const int64_t width_bytes = (head1 - head0) * D * static_cast<int64_t>(sizeof(T));
  vli lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  const vl neg_inf = vl{} - std::numeric_limits<float>::infinity();
  // The item's part of block number b of the sequence (anywhere in the cache), from `base`
  // (K or V), if the sequence reaches it: prefetched a block ahead of the reads.
  const auto prefetch_block = [&](const T* base, const int32_t* ids, int64_t b, int64_t end,
                                  int64_t offset, int64_t bytes) {
    if (b * BS >= end || ids[b] < 0 || ids[b] >= num_blocks) return;
    const char* p = reinterpret_cast<const char*>(base + ids[b] * c_blk + offset);
    for (int64_t j = 0; j < BS; ++j)
      for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(p + j * c_pos * sizeof(T) + off);
  };
  // pass 1: scores, chunk by chunk (a chunk never crosses a block)
  for (int64_t p0 = key0; p0 < n_keys;) {
    const int64_t block = blocks[p0 / BS];
    TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
    const int64_t j0 = p0 % BS;
    const int nk = static_cast<int>(std::min<int64_t>({kLanes, BS - j0, n_keys - p0}));
    if (j0 == 0) prefetch_block(cache, blocks, p0 / BS + 1, n_keys, head0 * D, width_bytes);
    const T* chunk = cache + block * c_blk + j0 * c_pos;
    if (cache_order) {  // each key's partial dot products (kLanes) per row into s.part
      for (int j = 0; j < nk; ++j) {
        for (int64_t g = head0; g < head1; ++g) {
          const T* k = chunk + j * c_pos + g * D;
          vl kg[DV];
          for (int c = 0; c < DV; ++c) kg[c] = load_lanes(k + c * kLanes);
          for (int64_t row = (g - head0) * head_rows; row < (g - head0 + 1) * head_rows; ++row) {
            const float* q = s.q.data() + row * D;
            vl a = load_l(q) * kg[0];
            for (int c = 1; c < DV; ++c) a += load_l(q + c * kLanes) * kg[c];
            store_l(s.part.data() + (row * kLanes + j) * kLanes, a);
          }
        }
      }
    }
    for (int64_t row = 0; row < n_rows; ++row) {
      float* out = s.scores.data() + row * stride + (p0 - key0);
      const int64_t visible = std::min<int64_t>(nk, s.limit[row] - p0 + 1);
      const int64_t lo = std::max<int64_t>(0, s.first[row] - p0);
      if (visible <= lo) {
        store_l(out, neg_inf);
        continue;
      }
      vl score;
      if (cache_order) {
        vl part[kLanes];
        for (int j = 0; j < kLanes; ++j)
          part[j] = j < nk ? load_l(s.part.data() + (row * kLanes + j) * kLanes) : vl{};
        score = reduce_lanes(part);
      } else {
        score = scores_lanes(s.q.data() + row * D, D, chunk + (head0 + row / head_rows) * D,
                             c_pos, nk);
      }
      if constexpr (kCap) score = soft_cap(score, cap, inv_cap);
      store_l(out, (lane < static_cast<int32_t>(visible)) & (lane >= static_cast<int32_t>(lo))
                       ? score
                       : neg_inf);
    }
    p0 += nk;
  }
  // softmax numerators in place, one max per row
  const int64_t padded = stride - kLanes;
  for (int64_t row = 0; row < n_rows; ++row) {
    float* sc = s.scores.data() + row * stride;
    for (int64_t i = npos; i < padded; ++i) sc[i] = -std::numeric_limits<float>::infinity();
    vl mx = neg_inf;
    for (int64_t i = 0; i < padded; i += kLanes) {
      const vl v = load_l(sc + i);
      mx = v > mx ? v : mx;
    }
    const float m = hmax(mx);
    if (m == -std::numeric_limits<float>::infinity()) {  // no visible key: all weights 0
      s.l[row] = 0.0f;
      std::fill(sc, sc + padded, 0.0f);
      continue;
    }
    vl sum{};
    for (int64_t i = 0; i < padded; i += kLanes) {
      const vl e = exp_nonpositive(load_l(sc + i) - m);
      store_l(sc + i, e);
      sum += e;
    }
    s.l[row] = hsum(sum);
  }
  // pass 2: acc (zero on entry) += sum over positions of p * V, in the same order
  for (int64_t p0 = key0; p0 < n_keys;) {
    const int64_t block = blocks[p0 / BS];
    const int64_t j0 = p0 % BS;
    const int64_t nk = std::min<int64_t>(BS - j0, n_keys - p0);
    if (j0 == 0)
      prefetch_block(cache + c_kv, blocks, p0 / BS + 1, n_keys, head0 * D, width_bytes);
    const T* chunk = cache + c_kv + block * c_blk + j0 * c_pos;
    for (int64_t j = 0; cache_order && j < nk; ++j) {  // acc rows updated in memory
      for (int64_t g = head0; g < head1; ++g) {
        const T* v = chunk + j * c_pos + g * D;
        vl vg[DV];
        bool loaded = false;
        for (int64_t row = (g - head0) * head_rows; row < (g - head0 + 1) * head_rows; ++row) {
          const float wj = s.scores[row * stride + (p0 - key0) + j];
          if (wj == 0.0f) continue;  // masked (or underflowed): nothing to add
          if (!loaded) {
            for (int c = 0; c < DV; ++c) vg[c] = load_lanes(v + c * kLanes);
            loaded = true;
          }
          float* acc = s.acc.data() + row * D;
          for (int c = 0; c < DV; ++c)
            store_l(acc + c * kLanes, load_l(acc + c * kLanes) + wj * vg[c]);
        }
      }
    }
    for (int64_t row = 0; !cache_order && row < n_rows; ++row) {
      const float* w = s.scores.data() + row * stride + (p0 - key0);
      const T* v = chunk + (head0 + row / head_rows) * D;
      float* acc = s.acc.data() + row * D;
      vl a[DV];
      for (int c = 0; c < DV; ++c) a[c] = load_l(acc + c * kLanes);
      for (int64_t j = 0; j < nk; ++j) {
        const float wj = w[j];
        if (wj == 0.0f) continue;  // masked (or underflowed): nothing to add
        const T* vj = v + j * c_pos;
        for (int c = 0; c < DV; ++c) a[c] += wj * load_lanes(vj + c * kLanes);
      }
      for (int c = 0; c < DV; ++c) store_l(acc + c * kLanes, a[c]);
    }
    p0 += nk;
  }
}

// two_pass_item for this head size, if it takes it (D = 16, 32, 64 or 128); false otherwise.
template <typename T, bool kCap>
bool two_pass_dispatch(int64_t D, Scratch& s, int64_t head0, int64_t head1, int64_t head_rows,
                       const T* cache, const int32_t* blocks, int64_t num_blocks, int64_t BS,
                       int64_t c_pos, int64_t c_blk, int64_t c_kv, int64_t key0,
                       int64_t n_keys, float cap, float inv_cap, bool cache_order) {
  switch (D) {
#define VLLM_TWO_PASS(HD)                                                                    \
  case HD:                                                                                   \
    two_pass_item<T, kCap, HD / kLanes>(s, head0, head1, head_rows, cache, blocks, num_blocks, \
                                        BS, c_pos, c_blk, c_kv, key0, n_keys, cap, inv_cap,   \
                                        cache_order);                                         \
    return true;
    VLLM_TWO_PASS(16)
    VLLM_TWO_PASS(32)
    VLLM_TWO_PASS(64)
    VLLM_TWO_PASS(128)
#undef VLLM_TWO_PASS
    default:
      return false;
  }
}

template <typename QT, typename T, bool kCap>
void run(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
         const at::Tensor& req_indices, double scale_d, int64_t window, double cap_d,
         double k_scale, double v_scale, at::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t c_pos = KVH * D;           // cache stride of one position
  const int64_t c_blk = BS * c_pos;         // of one block
  const int64_t c_kv = num_blocks * c_blk;  // K -> V
  const int64_t bt_row = block_table.stride(0);
  // The cache holds K / k_scale and V / v_scale: k_scale goes into the query's scale, v_scale
  // into each output row's softmax normalization.
  const float scale = static_cast<float>(scale_d * k_scale);
  const float out_scale = static_cast<float>(v_scale);
  const float cap = static_cast<float>(cap_d);
  const float inv_cap = kCap ? 1.0f / cap : 0.0f;
  // Keys a query row at position p may see start at first_visible(p); window <= 0: all.
  const auto first_visible = [window](int64_t p) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  };

  const QT* q_ptr = query.data_ptr<QT>();
  const T* cache = kv_cache.data_ptr<T>();
  QT* o_ptr = out.data_ptr<QT>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* reqs = req_indices.data_ptr<int64_t>();
  const int64_t n_reqs = req_indices.numel();

  // Pieces of (request, chunk of query rows); each is split into groups of KV heads only as
  // far as needed to give every thread two items (a group's rows of a block are contiguous,
  // so whole-head groups stream the cache sequentially).
  int64_t n_pieces = 0;
  for (int64_t i = 0; i < n_reqs; ++i) {
    const int64_t r = reqs[i];
    const int64_t ql = starts[r + 1] - starts[r];
    n_pieces += (ql + kRowChunk - 1) / kRowChunk;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t n_groups = std::min<int64_t>(
      KVH, std::max<int64_t>(1, (2 * threads + n_pieces - 1) / std::max<int64_t>(n_pieces, 1)));
  const int64_t group_size = (KVH + n_groups - 1) / n_groups;
  std::vector<Item> items;
  items.reserve(n_pieces * n_groups);
  int64_t max_rows = 0;  // query rows of the largest item
  for (int64_t i = 0; i < n_reqs; ++i) {
    const int64_t r = reqs[i];
    const int64_t ql = starts[r + 1] - starts[r];
    const int64_t ctx = lens[r] - ql;
    TORCH_CHECK(ql >= 0 && ctx >= 0, "request ", r, ": query_len ", ql, " > seq_len ", lens[r]);
    TORCH_CHECK(lens[r] < (int64_t{1} << 31), "request ", r, ": seq_len ", lens[r],
                " is over 2^31 - 1 positions");
    for (int64_t row0 = 0; row0 < ql; row0 += kRowChunk) {
      const int64_t row1 = std::min(ql, row0 + kRowChunk);
      const int64_t keys = ctx + row1;
      TORCH_CHECK((keys + BS - 1) / BS <= block_table.size(1), "request ", r, " needs ",
                  (keys + BS - 1) / BS, " blocks; the block table has ", block_table.size(1));
      const int64_t read = keys - first_visible(ctx + row0);  // positions the item reads
      for (int64_t g0 = 0; g0 < KVH; g0 += group_size) {
        const int64_t g1 = std::min(KVH, g0 + group_size);
        items.push_back({r, g0, g1, row0, row1, read * (row1 - row0) * (g1 - g0)});
        max_rows = std::max(max_rows, (row1 - row0) * G * (g1 - g0));
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;

  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch s(max_rows, D);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t idx = next.fetch_add(1); idx < n_items; idx = next.fetch_add(1)) {
        const Item& it = items[idx];
        const int64_t ql = starts[it.req + 1] - starts[it.req];
        const int64_t ctx = lens[it.req] - ql;
        const int64_t head_rows = (it.row1 - it.row0) * G;  // rows per KV head
        // row = (g - head0) * head_rows + t * G + j: query row it.row0 + t, head g * G + j
        for (int64_t g = it.head0; g < it.head1; ++g) {
          for (int64_t t = 0; t < it.row1 - it.row0; ++t) {
            const int64_t tok = starts[it.req] + it.row0 + t;
            for (int64_t j = 0; j < G; ++j) {
              const int64_t row = (g - it.head0) * head_rows + t * G + j;
              const QT* src = q_ptr + tok * q_tok + (g * G + j) * q_head;
              float* dst = s.q.data() + row * D;
              for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
              s.limit[row] = ctx + it.row0 + t;  // last visible position
              s.first[row] = first_visible(s.limit[row]);
              s.m[row] = -std::numeric_limits<float>::infinity();
              s.l[row] = 0.0f;
            }
          }
        }
        const int64_t n_rows = head_rows * (it.head1 - it.head0);
        std::fill(s.acc.begin(), s.acc.begin() + n_rows * D, 0.0f);
        const int64_t n_keys = ctx + it.row1;
        // The item's first row has the earliest window: positions before it are read by no row.
        const int64_t key0 = first_visible(ctx + it.row0);
        const int32_t* blocks = table + it.req * bt_row;
        // Few rows per KV head (decode): two passes over the cache in place (two_pass_item),
        // in cache order where the item reads whole position rows and has rows enough.
        const bool in_cache_order =
            it.head1 - it.head0 == KVH && head_rows * KVH >= kCacheOrderMinRows;
        const bool done =
            head_rows < kDenseMaxRows &&
            two_pass_dispatch<T, kCap>(D, s, it.head0, it.head1, head_rows, cache, blocks,
                                       num_blocks, BS, c_pos, c_blk, c_kv, key0, n_keys, cap,
                                       inv_cap, in_cache_order);
        // Otherwise block by block: each block's K and V rows of the group's heads are copied
        // (widened) into float buffers in memory order, which streams them at the memory's
        // speed, the next block (anywhere in the cache) prefetched meanwhile; the folds then
        // read the buffers from L1/L2. Many rows per KV head (prompts, GQA groups of a chunk)
        // fold with the rows in the lanes (fold_lanes, float K/V read in place: the copy cost as
        // much as the folds of a short prompt's items); few (decode where two_pass_item is not
        // built) per row (fold_keys).
        const int64_t width = (it.head1 - it.head0) * D;  // the group's part of a position
        const bool lanes = !done && head_rows >= kDenseMaxRows;
        const bool in_place = lanes && std::is_same_v<T, float>;
        if (!done && !lanes) s.for_fold(max_rows, D);
        if (!done && !in_place) s.for_copies(BS * group_size * D);
        const int64_t head_groups = (head_rows + kLanes - 1) / kLanes;
        if (lanes) {
          s.for_lanes(head_groups * (it.head1 - it.head0), D);
          for (int64_t g = it.head0; g < it.head1; ++g) {
            for (int64_t rg = 0; rg < head_groups; ++rg) {
              const int64_t grp = (g - it.head0) * head_groups + rg;
              float* qt = s.qt.data() + grp * D * kLanes;
              for (int64_t i = 0; i < kLanes; ++i) {
                const int64_t in_head = rg * kLanes + i;
                const bool valid = in_head < head_rows;
                const int64_t row = (g - it.head0) * head_rows + in_head;
                for (int64_t d = 0; d < D; ++d)
                  qt[d * kLanes + i] = valid ? s.q[row * D + d] : 0.0f;
                s.gfirst[grp * kLanes + i] = valid ? static_cast<int32_t>(s.first[row]) : 0;
                s.glimit[grp * kLanes + i] = valid ? static_cast<int32_t>(s.limit[row]) : -1;
                s.gm[grp * kLanes + i] = -std::numeric_limits<float>::infinity();
                s.gl[grp * kLanes + i] = 0.0f;
              }
            }
          }
        }
        const T* group_base = cache + it.head0 * D;
        for (int64_t b = key0 / BS; !done && b * BS < n_keys; ++b) {
          const int64_t block = blocks[b];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
          const int64_t in_block = std::min(BS, n_keys - b * BS);
          const int64_t j_first = std::max<int64_t>(0, key0 - b * BS);  // within this block
          const T* k_src = group_base + block * c_blk;
          const T* next = nullptr;
          if ((b + 1) * BS < n_keys) {
            const int64_t nb = blocks[b + 1];
            if (nb >= 0 && nb < num_blocks) next = group_base + nb * c_blk;
          }
          for (int64_t j = j_first; j < in_block; ++j) {
            if (!in_place) {
              widen(k_src + j * c_pos, s.kbuf.data() + j * width, width);
              widen(k_src + c_kv + j * c_pos, s.vbuf.data() + j * width, width);
            }
            if (next != nullptr) {
              const char* nk = reinterpret_cast<const char*>(next + j * c_pos);
              for (int64_t off = 0; off < width * static_cast<int64_t>(sizeof(T)); off += 64) {
                __builtin_prefetch(nk + off);
                __builtin_prefetch(nk + c_kv * sizeof(T) + off);
              }
            }
          }
          for (int64_t g = it.head0; g < it.head1; ++g) {
            const float* kg = s.kbuf.data() + (g - it.head0) * D;
            const float* vg = s.vbuf.data() + (g - it.head0) * D;
            for (int64_t j0 = j_first; j0 < in_block; j0 += kKeys) {
              const int nk = static_cast<int>(std::min<int64_t>(kKeys, in_block - j0));
              if (lanes) {
                const int64_t grp0 = (g - it.head0) * head_groups;
                const int64_t row0 = (g - it.head0) * head_rows;
                // float K/V in place (from the cache), others from the block's float copies
                const float* kc = kg + j0 * width;
                const float* vc = vg + j0 * width;
                int64_t stride = width;
                if constexpr (std::is_same_v<T, float>) {
                  if (in_place) {
                    kc = k_src + (g - it.head0) * D + j0 * c_pos;
                    vc = kc + c_kv;
                    stride = c_pos;
                  }
                }
                for (int64_t rg = 0; rg < head_groups; ++rg)
                  fold_lanes<kCap>(s, grp0 + rg, row0 + rg * kLanes,
                                   std::min<int64_t>(kLanes, head_rows - rg * kLanes), D, kc, vc,
                                   stride, b * BS + j0, nk, cap, inv_cap);
              } else {
                fold_keys<kCap>(s, (g - it.head0) * head_rows, head_rows, D,
                                       kg + j0 * width, vg + j0 * width, width, b * BS + j0,
                                       nk, cap, inv_cap);
              }
            }
          }
        }
        if (lanes) {  // the groups' softmax sums back into the rows' s.l
          for (int64_t g = it.head0; g < it.head1; ++g)
            for (int64_t in_head = 0; in_head < head_rows; ++in_head)
              s.l[(g - it.head0) * head_rows + in_head] =
                  s.gl[((g - it.head0) * head_groups + in_head / kLanes) * kLanes +
                       in_head % kLanes];
        }
        for (int64_t g = it.head0; g < it.head1; ++g) {
          for (int64_t t = 0; t < it.row1 - it.row0; ++t) {
            const int64_t tok = starts[it.req] + it.row0 + t;
            for (int64_t j = 0; j < G; ++j) {
              const int64_t row = (g - it.head0) * head_rows + t * G + j;
              const float inv = s.l[row] > 0.0f ? out_scale / s.l[row] : 0.0f;
              const float* a = s.acc.data() + row * D;
              QT* dst = o_ptr + tok * o_tok + (g * G + j) * o_head;
              for (int64_t d = 0; d < D; ++d) dst[d] = from_float<QT>(a[d] * inv);
            }
          }
        }
      }
    }
  });
}

// The (query, cache) dtype pairs the kernel is built for: a float32, bfloat16 or float16
// query over a cache of any of those or of FP8 (float8_e4m3fn, float8_e5m2): kv_cache_dtype
// may differ from the model's dtype (a 16-bit cache under float32 weights halves the bytes
// read, FP8 quarters them). The arithmetic is float32 whatever the pair.
bool cache_dtype_supported(at::ScalarType query, at::ScalarType cache) {
  const bool query_ok = query == at::kFloat || query == at::kBFloat16 || query == at::kHalf;
  const bool cache_ok = cache == at::kFloat || cache == at::kBFloat16 || cache == at::kHalf ||
                        cache == at::kFloat8_e4m3fn || cache == at::kFloat8_e5m2;
  return query_ok && cache_ok;
}

std::string unsupported_pair(const char* op, const at::Tensor& query,
                             const at::Tensor& kv_cache) {
  return std::string(op) + ": a " + c10::toString(query.scalar_type()) + " query over a " +
         c10::toString(kv_cache.scalar_type()) +
         " cache is not supported (queries: Float, BFloat16, Half; caches: those, "
         "Float8_e4m3fn, Float8_e5m2)";
}

// Calls f(QT{}, T{}) for the query and cache types of a supported pair.
template <typename F>
void dispatch_types(at::ScalarType query, at::ScalarType cache, F&& f) {
  const auto with_query = [&](auto cache_type) {
    switch (query) {
      case at::kFloat:
        return f(float{}, cache_type);
      case at::kBFloat16:
        return f(c10::BFloat16{}, cache_type);
      default:  // at::kHalf (cache_dtype_supported)
        return f(c10::Half{}, cache_type);
    }
  };
  switch (cache) {
    case at::kFloat:
      return with_query(float{});
    case at::kBFloat16:
      return with_query(c10::BFloat16{});
    case at::kHalf:
      return with_query(c10::Half{});
    case at::kFloat8_e4m3fn:
      return with_query(c10::Float8_e4m3fn{});
    default:  // at::kFloat8_e5m2
      return with_query(c10::Float8_e5m2{});
  }
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& req_indices,
                     double scale, at::Tensor out, int64_t window, double soft_cap,
                     double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] tensor");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(cache_dtype_supported(query.scalar_type(), kv_cache.scalar_type()),
              unsupported_pair("paged_attention", query, kv_cache));
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && out.sizes() == query.sizes(),
              "head sizes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "the channel dim must be dense");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be a row-dense int32 [R, max_blocks] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && req_indices.scalar_type() == at::kLong &&
                  req_indices.is_contiguous(),
              "seq_lens, query_start_loc and req_indices must be contiguous int64");
  TORCH_CHECK(std::isfinite(soft_cap) && soft_cap >= 0.0,
              "soft_cap must be 0 (none) or a positive finite number, got ", soft_cap);
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0.0 && std::isfinite(v_scale) &&
                  v_scale > 0.0,
              "k_scale and v_scale must be positive finite numbers, got ", k_scale, " and ",
              v_scale);
  const auto dispatch = [&](auto cap_flag) {
    constexpr bool kCap = decltype(cap_flag)::value;
    dispatch_types(query.scalar_type(), kv_cache.scalar_type(),
                   [&](auto query_type, auto cache_type) {
                     run<decltype(query_type), decltype(cache_type), kCap>(
                         query, kv_cache, block_table, seq_lens, query_start_loc, req_indices,
                         scale, window, soft_cap, k_scale, v_scale, out);
                   });
  };
  if (soft_cap > 0.0)
    dispatch(std::true_type{});
  else
    dispatch(std::false_type{});
}

// Writes the batch's new K/V rows into the cache by slot, then runs paged_attention: the
// attention layer's whole CPU step in one call. query/out [T, H * D], key/value [T, KVH * D]
// (rows may be strided, the rest dense); slot_mapping [S] int64, S <= T: rows 0..S-1 are
// written (padding lanes point into the dummy block 0).
void write_and_attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      at::Tensor kv_cache, const at::Tensor& slot_mapping,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, const at::Tensor& req_indices,
                      double scale, at::Tensor out, int64_t window, double soft_cap,
                      double k_scale, double v_scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] tensor");
  const int64_t D = kv_cache.size(4), KVH = kv_cache.size(3);
  const int64_t n_slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(query.dim() == 2 && out.dim() == 2 && key.dim() == 2 && value.dim() == 2,
              "query, key, value and out must be 2-D");
  TORCH_CHECK(query.size(1) % D == 0 && key.size(1) == KVH * D && value.size(1) == KVH * D,
              "query/key/value widths do not match the cache's heads");
  TORCH_CHECK(query.stride(1) == 1 && key.stride(1) == 1 && value.stride(1) == 1 &&
                  out.stride(1) == 1,
              "rows must be dense");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(cache_dtype_supported(query.scalar_type(), kv_cache.scalar_type()),
              unsupported_pair("write_and_attend", query, kv_cache));
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0.0 && std::isfinite(v_scale) &&
                  v_scale > 0.0,
              "k_scale and v_scale must be positive finite numbers, got ", k_scale, " and ",
              v_scale);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() <= key.size(0),
              "slot_mapping must be contiguous int64 with at most one entry per token");
  const int64_t T = query.size(0), H = query.size(1) / D;
  const int64_t row_bytes = KVH * D * kv_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + n_slots * row_bytes;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  // A row of another dtype is converted, rounded to nearest even; into an FP8 cache it is
  // divided by its scale first and saturates at the format's largest finite value.
  std::vector<float> scaled(KVH * D);
  const auto convert_row = [&](char* dst, const char* src, float scale) {
    dispatch_types(key.scalar_type(), kv_cache.scalar_type(), [&](auto src_type, auto dst_type) {
      using S = decltype(src_type);
      using C = decltype(dst_type);
      const S* in = reinterpret_cast<const S*>(src);
      C* o = reinterpret_cast<C*>(dst);
      if constexpr (kIsFp8<C>) {
        for (int64_t i = 0; i < KVH * D; ++i)  // (divided, as cache_storage.to_cache does)
          scaled[i] = std::min(std::max(to_float(in[i]) / scale, -kFp8Max<C>), kFp8Max<C>);
        to_fp8<C>(scaled.data(), reinterpret_cast<uint8_t*>(o), KVH * D);
      } else {
        for (int64_t i = 0; i < KVH * D; ++i) o[i] = C(to_float(in[i]));
      }
    });
  };
  const bool same = key.scalar_type() == kv_cache.scalar_type();
  const float k_div = static_cast<float>(k_scale), v_div = static_cast<float>(v_scale);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < n_slots, "slot ", slot, " out of range");
    if (same) {
      std::memcpy(k_cache + slot * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_cache + slot * row_bytes, v_src + t * v_stride, row_bytes);
    } else {
      convert_row(k_cache + slot * row_bytes, k_src + t * k_stride, k_div);
      convert_row(v_cache + slot * row_bytes, v_src + t * v_stride, v_div);
    }
  }
  paged_attention(query.as_strided({T, H, D}, {query.stride(0), D, 1}), kv_cache, block_table,
                  seq_lens, query_start_loc, req_indices, scale,
                  out.as_strided({T, H, D}, {out.stride(0), D, 1}), window, soft_cap, k_scale,
                  v_scale);
}

#include "cpu_isa_level.h"

}  // namespace

TORCH_LIBRARY(vllm_cpu_attn, m) {
  m.def("isa() -> str", &isa_level);
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor req_indices, float scale, Tensor(a!) out, "
      "int window=0, float soft_cap=0.0, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def(
      "write_and_attend(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor req_indices, float scale, Tensor(b!) out, int window=0, "
      "float soft_cap=0.0, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.impl("write_and_attend", c10::DispatchKey::CPU, &write_and_attend);
}
