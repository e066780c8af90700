// y = x W^T (+ b) for a few rows of x on the CPU, streaming the plain [N, K] weight once.
//
//   torch.ops.vllm_cpu_linear.small_m_linear(x [M, K], weight [N, K], bias [N] or None)
//       -> y [M, N]
//   torch.ops.vllm_cpu_linear.has_bf16_dot() -> bool, bf16_dot_min_rows(rows=-1) -> int
//   torch.ops.vllm_cpu_linear.small_m_loop(x, weight) -> the inner loop small_m_linear takes
//   torch.ops.vllm_cpu_linear.linear(x [..., K], weight [N, K], bias) -> [..., N]
//       the dispatcher of every CPU linear (end of file): small-M kernel, the panel kernel
//       on a prepacked weight (cpu_panel_linear.h), oneDNN, aten::linear; `configure`,
//       `set_packed`/`drop_packed`, `linear_route`
//   torch.ops.vllm_cpu_linear.onednn_rows(rows) -> the row count oneDNN computes with
//   torch.ops.vllm_cpu_linear.isa() -> the ISA level this library was built for ("avx2",
//       "avx512", "avx512_bf16"; vllm/utils/cpu_kernels.py builds one level per process)
//
// Decode-shaped products (M = 1..16) are bound by reading the weight. BLAS libraries reach
// only about half of the memory bandwidth there on the dev machines (bfloat16: ~15 of ~30 GB/s
// with cold weights), so this kernel does the plain thing: each thread reads its contiguous
// range of weight rows front to back, one row at a time, as a single stream, prefetching
// g_prefetch_bytes ahead of where it reads (the stream runs on into the next rows), and dots
// each row with every row of x. Accumulation is in float32; the result is rounded to x's dtype
// once (as oneDNN does). K is walked in blocks, so that a block of the weight stays in L1 while
// every group of four x rows passes over it. Where one stream per core keeps too few reads in
// flight (Intel CPUs: g_streams), each thread cuts its range into that many far-apart parts
// and reads them side by side in lockstep, each part one stream.
//
// That holds while x stays in L1. Three or more rows of x that do not fit there next to the
// weight rows being read (kStreamL1Bytes) would be read again from L2 for every weight row, so
// then four weight rows are read side by side (adjacent, the next four prefetched; or with
// g_streams > 1 four far-apart streams) and share each read of x.
//
// Measured on the dev machine (Zen 3, 2 threads, float32 unless said, paired rounds), against
// the kernel before, which always read four rows side by side:
// - cold weights (the Qwen2.5-0.5B shape's), one row of x: 1.3x on [1152, 896], [9728, 896]
//   and the [151936, 896] LM head, 1.1x on [896, 4864]; all the model's linears 1.25x (two
//   rows 1.2x, four 1.0x; bfloat16 three or four rows 1.45x); prefetching 4-16 KB ahead
//   measured the same, 1 KB ahead ~10% slower;
// - weights in L3 (the demo model's [*, 256] products): 1.3-1.5x for one row, 1.05-1.5x for
//   four, once the row loop calls the kernel inlined (a call through the size switches for
//   every row made one stream 0.7x there).
//
// Three inner loops:
// - widening: weight elements are widened to float in registers (float32 and bfloat16), x is
//   converted to a float buffer once; two vectors (2 x 16 lanes on AVX-512, 2 x 8 on AVX2)
//   per step, bfloat16 widened without shuffles (load2);
// - split bfloat16 (AVX2, one or two rows of bfloat16 x): x widened the same way as the
//   weight, in registers, read as it is (SplitBf16);
// - bfloat16 dot products (built for a CPU with AVX512-BF16, products of at least
//   g_dot_min_rows rows): vdpbf16ps multiplies 32 bfloat16 pairs per instruction, neither
//   operand is widened; one or two rows keep four independent sums. Where fewer rows take the
//   widening loop depends on the CPU (cpu_linear.py: BF16_DOT_MIN_ROWS_BY_VENDOR).
//
// x may have a row stride; its last dim, the weight and the bias must be dense. x, weight and
// bias share one dtype: float32 or bfloat16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

// Where oneDNN keeps a reordered weight (exported by libtorch_cpu; their header,
// ATen/native/mkldnn/MKLDNNCommon.h, is not installed).
namespace at::native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

// Vector width and tiles per instruction set (the library is built for one ISA level:
// vllm/utils/cpu_kernels.py). AVX-512 has 32 registers of 64 bytes; AVX2 has 16 of 32 bytes,
// and 64-byte vectors there are pairs of ymm registers: a 4 x 4 tile's 16 accumulators alone
// would take 32 of its 16 registers (spilled every step), so AVX2 uses 32-byte vectors and
// 2 x 4 tiles (8 accumulators, the x rows and the weight vectors fit beside them).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kTileN = 4;  // weight rows side by side when x is large
constexpr int kTileM = 4;  // x rows per pass over a block of the weight
#else
// AVX2: 2 weight rows x 6 x rows = 12 accumulators, beside them the 2 weight vectors and one
// x vector (15 of 16 registers): 8 loads per 12 FMAs, so 8-16-row products run at the FMA
// units' rate rather than the loads'.
constexpr int kVecBytes = 32;
constexpr int kTileN = 2;
constexpr int kTileM = 6;
#endif
constexpr int kLanes = kVecBytes / 4;     // floats per vector
// Fewest rows of x a bfloat16 product takes the dot-product loop for (AVX512-BF16 builds;
// fewer keep the widening loop), set from Python per CPU vendor (`bf16_dot_min_rows` op;
// cpu_linear.py says what was measured where).
int64_t g_dot_min_rows = 3;
// How far ahead of the read one stream prefetches (0: no software prefetch), set from Python
// per ISA level (`prefetch_bytes` op; cpu_linear.py says what was measured where).
int64_t g_prefetch_bytes = 8192;
constexpr int64_t kStreamL1Bytes = 20480;  // x (as float) + 2 weight rows, for one stream
// Weight streams one thread reads side by side (1, 2, 4 or 8), far apart in the weight: each
// thread's range of rows is cut into that many parts, read in lockstep (`streams` op, set from
// Python per CPU: cpu_linear.py says what was measured where). Products of several x rows take
// fewer streams (at most kMaxStreamAcc accumulators: AVX-512's 32 registers hold 16 beside the
// x and weight vectors, AVX2's 16 hold 4); a stream has at least kMinStreamRows rows; products
// of more rows of x (tiles of kTileN weight rows) read kTileN streams whenever g_streams > 1.
int64_t g_streams = 1;
constexpr int kMaxStreamAcc = kVecBytes == 64 ? 16 : 4;
constexpr int64_t kMinStreamRows = 16;
constexpr int kLineBytes = 64;

typedef float vf __attribute__((vector_size(kVecBytes)));
typedef uint32_t vu32 __attribute__((vector_size(kVecBytes)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Whether the widening and bfloat16 dot-product loops read weights with non-temporal loads
// (vmovntdqa; AVX-512 builds, one row of x, weights whose rows start on 64-byte boundaries),
// set from Python per CPU vendor (`nt_loads` op; cpu_linear.py says what was measured where).
bool g_nt_loads = false;
// Most rows of x for them: on the Zen 4 dev machine batch-3 decode of the 50M Llama measured
// 0.92x end to end with them (paired), the products of 2-3 rows 0.85x alone.
constexpr int64_t kNtMaxRows = 1;
// One vector of weight bytes from p; kNt: a non-temporal load (p 64-byte aligned: the caller
// checks).
template <bool kNt, typename V>
inline V load_weight(const void* p) {
  V v;
#if defined(__AVX512F__)
  if constexpr (kNt) {
    static_assert(sizeof(V) == 64, "one AVX-512 vector");
    const __m512i raw = _mm512_stream_load_si512(const_cast<void*>(p));
    std::memcpy(&v, &raw, sizeof(v));
    return v;
  }
#endif
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// 2 * kLanes weight elements from p as two float vectors (a, b), matched by x's float buffer
// (run_widen) at the same offsets p - w, p - w + kLanes:
// - float32: p[0, kLanes) and p[kLanes, 2 kLanes), x stored as is;
// - bfloat16: one vector of 2 * kLanes, widened with two integer ops and no shuffle (a
//   bfloat16 is a float's high half): the even elements (each 32-bit lane shifted left by
//   16) and the odd ones (the lane's low half cleared); x's buffer holds each block of
//   2 * kLanes elements in that order, evens then odds. (Widening in element order takes a
//   cross-lane shuffle per vector: vpmovzxwd, which AVX2 CPUs run on one port; on AVX-512
//   a vpmovzxwd of 16 elements to zmm measured no faster, per unit of bandwidth.)
template <bool kNt = false>
inline void load2(const float* p, vf& a, vf& b) {
  a = load_weight<kNt, vf>(p);
  b = load_weight<kNt, vf>(p + kLanes);
}
template <bool kNt = false>
inline void load2(const c10::BFloat16* p, vf& a, vf& b) {
  const vu32 raw = load_weight<kNt, vu32>(p);
  const vu32 even = raw << 16;
  const vu32 odd = raw & 0xffff0000u;
  std::memcpy(&a, &even, sizeof(a));
  std::memcpy(&b, &odd, sizeof(b));
}
inline float scalar(float v) { return v; }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }
// Lanes summed pairwise (a tree of vector adds, not a chain of dependent scalar adds: without
// -ffast-math the compiler keeps a written loop's order).
inline float hsum(vf v) {
  typedef float vf8 __attribute__((vector_size(32)));
  typedef float vf4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf8 a = v;
#endif
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Where to prefetch for weight row i of an NR-row tile at column k, the tile's rows rs
// elements apart: rows that each run on as a stream of their own (one row, or rows from
// far-apart parts of the weight: rs != K) g_prefetch_bytes ahead of where they read; a tile of
// adjacent rows the same column of the next tile. Callers prefetch only while g_prefetch_bytes
// > 0.
template <int NR, typename T>
inline const T* prefetch_at(const T* w, int64_t K, int64_t rs, int i, int64_t k) {
  const int64_t ahead = g_prefetch_bytes / static_cast<int64_t>(sizeof(T));
  if (NR == 1 || rs != K) return w + i * rs + k + ahead;
  return w + (i + NR) * K + k;
}

// One step of x (2 * kLanes elements at p) as the two float vectors load2 makes of the weight's
// step: a float buffer (run_widen) as it is; bfloat16 x split into even and odd elements, as
// load2 splits a bfloat16 weight, so that the even elements of one meet those of the other.
inline void load_x2(const float* p, vf& a, vf& b) {
  a = load(p);
  b = load(p + kLanes);
}
inline void load_x2(const c10::BFloat16* p, vf& a, vf& b) { load2(p, a, b); }

// Widening loop: the weight float or bfloat16, x float (a buffer: run_widen) or, with a
// bfloat16 weight, bfloat16 as it is (the split loop: see SplitBf16); 2 * kLanes elements per
// step (load2, load_x2; kNt: non-temporal loads, every weight row 64-byte aligned).
template <typename T, bool kNt = false, typename X = float>
struct Widen {
  using XT = X;
  static constexpr int64_t kStep = 2 * kLanes;
  // K block: AVX-512's 4 x 4 tiles of 5-16 x rows 1.2-1.3x faster at 256 than at 512 (whose
  // x block of 16 rows, 32 KB, left the weight rows little of L1); AVX2 measured 512.
  static constexpr int64_t kBlock = kVecBytes == 64 ? 256 : 512;
  static constexpr int kStepBytes = kStep * sizeof(T);
  static constexpr int kLinesPerStep = kStepBytes >= kLineBytes ? kStepBytes / kLineBytes : 1;

  // acc[i * MR + j] += w_i[k0:k1] . x_j[k0:k1] for the NR weight rows w_i = w + i * rs (rows
  // of K elements) and the MR rows x_j = x + j * x_stride; k1 - k0 is a multiple of kStep.
  // pf: prefetch ahead of the weight reads (false for the later groups of x rows over a tile's
  // block: the first group already prefetched for them).
  template <int NR, int MR>
  static inline void block(const T* w, int64_t K, int64_t rs, int64_t k0, int64_t k1,
                           const XT* x, int64_t x_stride, vf* acc_io, bool pf) {
    const bool prefetch = pf && g_prefetch_bytes > 0;
    if constexpr (NR == 1 && MR == 1) {
      // One stream, 256 bytes of weight (4 cache lines) an iteration, up to 8 accumulators:
      // with fewer, a row of cached weights would wait on the adds' latency, not on reads.
      constexpr int kPairs = 4 * kLineBytes / kStepBytes;
      constexpr int kAcc = 2 * kPairs < 8 ? 2 * kPairs : 8;
      vf a[kAcc] = {acc_io[0]};
      int64_t k = k0;
      for (; k + kPairs * kStep <= k1; k += kPairs * kStep) {
        if (prefetch) {
          const char* ahead = reinterpret_cast<const char*>(prefetch_at<1>(w, K, K, 0, k));
          for (int l = 0; l < 4; ++l) __builtin_prefetch(ahead + l * kLineBytes);
        }
        for (int u = 0; u < kPairs; ++u) {
          vf p, q, xa, xb;
          load2<kNt>(w + k + u * kStep, p, q);
          load_x2(x + k + u * kStep, xa, xb);
          a[(2 * u) % kAcc] += p * xa;
          a[(2 * u + 1) % kAcc] += q * xb;
        }
      }
      for (; k < k1; k += kStep) {
        vf p, q, xa, xb;
        load2<kNt>(w + k, p, q);
        load_x2(x + k, xa, xb);
        a[0] += p * xa;
        a[1] += q * xb;
      }
      for (int n = kAcc / 2; n > 0; n /= 2)
        for (int i = 0; i < n; ++i) a[i] += a[i + n];
      acc_io[0] = a[0];
      return;
    }
    // Small tiles keep even and odd halves in separate accumulators (two FMA chains each).
    constexpr int kSplit = NR * MR <= 4 ? 2 : 1;
    if constexpr (kSplit == 1 && kVecBytes == 32 && std::is_same_v<XT, float>) {
      // AVX2's large tiles: one half-step at a time, each x vector loaded once into one
      // register and multiplied into every weight row's accumulator (NR * MR + NR + 1
      // registers). The next tile's rows are always prefetched: the first group of x rows
      // streams the tile in from memory, and without the prefetch the other groups' FMAs
      // never overlap that wait (16-row products of the 50M Llama's weights: 30 -> 25 ms).
      vf acc[NR][MR];
      for (int i = 0; i < NR; ++i)
        for (int j = 0; j < MR; ++j) acc[i][j] = acc_io[i * MR + j];
      for (int64_t k = k0; k < k1; k += kStep) {
        if (NR > 1 || g_prefetch_bytes > 0) {  // every group, pf or not (measured)
          for (int i = 0; i < NR; ++i) {
            const char* ahead = reinterpret_cast<const char*>(prefetch_at<NR>(w, K, rs, i, k));
            for (int l = 0; l < kLinesPerStep; ++l) __builtin_prefetch(ahead + l * kLineBytes);
          }
        }
        if constexpr (std::is_same_v<T, float>) {
          for (int h = 0; h < 2; ++h) {
            vf wv[NR];
            for (int i = 0; i < NR; ++i) wv[i] = load(w + i * rs + k + h * kLanes);
            for (int j = 0; j < MR; ++j) {
              const vf xv = load(x + j * x_stride + k + h * kLanes);
              for (int i = 0; i < NR; ++i) acc[i][j] += wv[i] * xv;
            }
          }
        } else {  // one load widens into both halves
          vf wv[NR][2];
          for (int i = 0; i < NR; ++i) load2<kNt>(w + i * rs + k, wv[i][0], wv[i][1]);
          for (int h = 0; h < 2; ++h)
            for (int j = 0; j < MR; ++j) {
              const vf xv = load(x + j * x_stride + k + h * kLanes);
              for (int i = 0; i < NR; ++i) acc[i][j] += wv[i][h] * xv;
            }
        }
      }
      for (int i = 0; i < NR; ++i)
        for (int j = 0; j < MR; ++j) acc_io[i * MR + j] = acc[i][j];
      return;
    }
    vf acc[kSplit][NR][MR];
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) {
        acc[0][i][j] = acc_io[i * MR + j];
        acc[kSplit - 1][i][j] = kSplit == 2 ? vf{} : acc_io[i * MR + j];
      }
    for (int64_t k = k0; k < k1; k += kStep) {
      vf x0[MR], x1[MR];
      for (int j = 0; j < MR; ++j) load_x2(x + j * x_stride + k, x0[j], x1[j]);
      for (int i = 0; i < NR; ++i) {
        if (prefetch) {
          const char* ahead = reinterpret_cast<const char*>(prefetch_at<NR>(w, K, rs, i, k));
          for (int l = 0; l < kLinesPerStep; ++l) __builtin_prefetch(ahead + l * kLineBytes);
        }
        vf p, q;
        load2<kNt>(w + i * rs + k, p, q);
        for (int j = 0; j < MR; ++j) {
          acc[0][i][j] += p * x0[j];
          acc[kSplit - 1][i][j] += q * x1[j];
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j)
        acc_io[i * MR + j] = kSplit == 2 ? acc[0][i][j] + acc[1][i][j] : acc[0][i][j];
  }
};

// bfloat16 x against a bfloat16 weight, both split the same way (load2: each 32-bit lane's
// high half, and its low half shifted up): the even elements of one meet the even elements of
// the other, so x is read as it is, in bfloat16, with no float buffer. For one or two rows of
// x on AVX2: there the widening loop's float copy of x (4 bytes an element, read with two
// loads per step of weight) fell out of L1 beside the weight's stream at K = 4864 (the 0.5B
// shape's down projection read at 0.55x the rate of its K = 896 products); cold, 2 threads,
// paired, the 0.5B shape's products 1.04-1.07x at one row, 1.07-1.10x at two, the down
// projection alone 1.13x, the 50M Llama's (K 512 and 1376) 1.01x. (AVX-512 builds: 1.01x /
// 1.05x, not taken: their one-row products keep the non-temporal loads.)
constexpr int64_t kSplitMaxRows = 2;
using SplitBf16 = Widen<c10::BFloat16, false, c10::BFloat16>;

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// AVX512-BF16 loop: vdpbf16ps adds 32 bfloat16 products into 16 float lanes per step (kNt:
// non-temporal weight loads, every weight row 64-byte aligned).
template <bool kNt = false>
struct Bf16Dot {
  using T = c10::BFloat16;
  using XT = c10::BFloat16;
  static constexpr int64_t kStep = 32;
  static constexpr int64_t kBlock = 1024;  // K block (measured)

  template <int NR, int MR>
  static inline void block(const T* w, int64_t K, int64_t rs, int64_t k0, int64_t k1,
                           const T* x, int64_t x_stride, vf* acc_io, bool pf) {
    const bool prefetch = pf && g_prefetch_bytes > 0;
    if constexpr (NR == 1 && MR <= 2) {
      // One stream and one or two x rows: U independent sums per x row, else each step
      // waits on the previous vdpbf16ps (its latency, not the reads, bounds a cached row).
      constexpr int U = 4 / MR;
      __m512 a[U][MR];
      for (int u = 0; u < U; ++u)
        for (int j = 0; j < MR; ++j)
          a[u][j] = u == 0 ? (__m512)acc_io[j] : _mm512_setzero_ps();
      int64_t k = k0;
      for (; k + U * kStep <= k1; k += U * kStep) {
        if (prefetch) {
          const char* ahead = reinterpret_cast<const char*>(prefetch_at<1>(w, K, rs, 0, k));
          for (int u = 0; u < U; ++u) __builtin_prefetch(ahead + u * kLineBytes);
        }
        for (int u = 0; u < U; ++u) {
          const __m512bh wv = load_weight<kNt, __m512bh>(w + k + u * kStep);
          for (int j = 0; j < MR; ++j)
            a[u][j] = _mm512_dpbf16_ps(
                a[u][j], wv, (__m512bh)_mm512_loadu_si512(x + j * x_stride + k + u * kStep));
        }
      }
      for (; k < k1; k += kStep) {
        const __m512bh wv = load_weight<kNt, __m512bh>(w + k);
        for (int j = 0; j < MR; ++j)
          a[0][j] = _mm512_dpbf16_ps(a[0][j], wv,
                                     (__m512bh)_mm512_loadu_si512(x + j * x_stride + k));
      }
      for (int j = 0; j < MR; ++j) {
        __m512 sum = a[0][j];
        for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, a[u][j]);
        acc_io[j] = (vf)sum;
      }
      return;
    }
    __m512 acc[NR][MR];
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) acc[i][j] = (__m512)acc_io[i * MR + j];
    for (int64_t k = k0; k < k1; k += kStep) {
      __m512bh xv[MR];
      for (int j = 0; j < MR; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * x_stride + k);
      for (int i = 0; i < NR; ++i) {
        if (prefetch) __builtin_prefetch(prefetch_at<NR>(w, K, rs, i, k));
        const __m512bh wv = load_weight<kNt, __m512bh>(w + i * rs + k);
        for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) acc_io[i * MR + j] = (vf)acc[i][j];
  }
};
#else
constexpr bool kBf16Dot = false;
#endif

template <typename Loop, int NR, typename T, typename XT>
inline void block_rows(int mr, const T* w, int64_t K, int64_t rs, int64_t k0, int64_t k1,
                       const XT* x, int64_t x_stride, vf* acc, bool pf) {
  switch (mr) {
    case 1: Loop::template block<NR, 1>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 2: Loop::template block<NR, 2>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 3: Loop::template block<NR, 3>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 4: Loop::template block<NR, 4>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 5: Loop::template block<NR, 5>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    default: Loop::template block<NR, kTileM>(w, K, rs, k0, k1, x, x_stride, acc, pf); break;
  }
}

// An nr-row tile (1..4 adjacent rows: rs == K) or nr far-apart streams (2, 4 or 8 rows rs
// elements apart) against mr rows of x.
template <typename Loop, typename T, typename XT>
inline void block_tile(int nr, int mr, const T* w, int64_t K, int64_t rs, int64_t k0,
                       int64_t k1, const XT* x, int64_t x_stride, vf* acc, bool pf) {
  switch (nr) {
    case 1: block_rows<Loop, 1>(mr, w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 2: block_rows<Loop, 2>(mr, w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 3: block_rows<Loop, 3>(mr, w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    case 8: block_rows<Loop, 8>(mr, w, K, rs, k0, k1, x, x_stride, acc, pf); break;
    default: block_rows<Loop, 4>(mr, w, K, rs, k0, k1, x, x_stride, acc, pf); break;
  }
}

// Weight row w_row's dot with x row x_row, finished: the accumulator's lanes, the K tail, the
// bias.
template <typename T, typename XT>
inline T finish(vf a, const T* w_row, const XT* x_row, int64_t k_vec, int64_t K, float b) {
  float s = hsum(a);
  for (int64_t k = k_vec; k < K; ++k) s += scalar(w_row[k]) * scalar(x_row[k]);
  return T(s + b);
}

// MR (<= kTileM) rows of x against weight rows [n_begin, n_end), one row at a time: the loop
// the one-stream products run, with the kernel inlined (choosing it per row cost ~5 ns a row,
// a third of a cached 256-wide row).
template <typename Loop, int MR, typename T, typename XT>
void stream_rows(const XT* x, int64_t x_stride, int64_t K, int64_t k_vec, const T* wp,
                 int64_t n_begin, int64_t n_end, const T* bp, T* op, int64_t o_stride) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* w = wp + n * K;
    vf acc[MR] = {};
    Loop::template block<1, MR>(w, K, K, 0, k_vec, x, x_stride, acc, true);
    const float b = bp ? scalar(bp[n]) : 0.0f;
    for (int j = 0; j < MR; ++j)
      op[j * o_stride + n] = finish(acc[j], w, x + j * x_stride, k_vec, K, b);
  }
}

// Weight rows [n_begin, n_begin + S * per) as S streams side by side: stream s reads rows
// n_begin + s * per + [0, per) front to back, the S streams one row each at a time in
// lockstep, against the M (<= kTileM) rows of x.
template <typename Loop, typename T, typename XT>
void stream_tiles(int S, int M, const XT* x, int64_t x_stride, int64_t K, int64_t k_vec,
                  const T* wp, int64_t n_begin, int64_t per, const T* bp, T* op,
                  int64_t o_stride) {
  vf acc[kMaxStreamAcc];
  for (int64_t n = n_begin; n < n_begin + per; ++n) {
    std::fill(acc, acc + S * M, vf{});
    block_tile<Loop>(S, M, wp + n * K, K, per * K, 0, k_vec, x, x_stride, acc, true);
    for (int s = 0; s < S; ++s) {
      const int64_t row = n + s * per;
      const float b = bp ? scalar(bp[row]) : 0.0f;
      for (int j = 0; j < M; ++j)
        op[j * o_stride + row] =
            finish(acc[s * M + j], wp + row * K, x + j * x_stride, k_vec, K, b);
    }
  }
}

// How many streams a thread reads side by side for M rows of x: g_streams, halved while the
// tile would hold more than kMaxStreamAcc accumulators.
inline int streams_for(int64_t M) {
  int s = static_cast<int>(g_streams);
  while (s > 1 && s * M > kMaxStreamAcc) s /= 2;
  return s;
}

// x: M rows of XT with stride x_stride (float rows for the widening loop).
template <typename Loop, typename T, typename XT>
void run(const XT* x, int64_t x_stride, int64_t M, int64_t K, const T* wp, int64_t N,
         const T* bp, T* op, int64_t o_stride) {
  const int64_t k_vec = K / Loop::kStep * Loop::kStep;
  const int64_t groups = (M + kTileM - 1) / kTileM;
  // One weight row at a time (a single stream) while x stays in L1 next to the rows being
  // read; larger x is read from L2 once per weight row, so then kTileN rows side by side
  // share each read of it (measured: float32 [*, 896] products of 4 rows 0.8x as one stream,
  // bfloat16 ones 1.35x).
  const int64_t l1_bytes = (M * static_cast<int64_t>(sizeof(float)) + 2 * sizeof(T)) * K;
  const int64_t tile_n = M <= 2 || l1_bytes <= kStreamL1Bytes ? 1 : kTileN;
  const int64_t acc_stride = tile_n * kTileM;  // accumulators per group of x rows
  // grain: at least 64 weight rows per task (small products stay on one thread)
  at::parallel_for(0, N, 64, [&](int64_t n_begin, int64_t n_end) {
    if (tile_n == 1 && groups == 1) {
      const int S = streams_for(M);
      const int64_t per = (n_end - n_begin) / S;
      if (S > 1 && per >= kMinStreamRows) {
        stream_tiles<Loop>(S, static_cast<int>(M), x, x_stride, K, k_vec, wp, n_begin, per, bp,
                           op, o_stride);
        n_begin += S * per;  // the rows left over: one stream
      }
      switch (M) {
        case 1: stream_rows<Loop, 1>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                     o_stride); break;
        case 2: stream_rows<Loop, 2>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                     o_stride); break;
        case 3: stream_rows<Loop, 3>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                     o_stride); break;
        case 4: stream_rows<Loop, 4>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                     o_stride); break;
        case 5: stream_rows<Loop, 5>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                     o_stride); break;
        default: stream_rows<Loop, kTileM>(x, x_stride, K, k_vec, wp, n_begin, n_end, bp, op,
                                           o_stride); break;
      }
      return;
    }
    std::vector<vf> acc(groups * acc_stride);
    // One tile: nr weight rows `apart` rows from each other, from row n0 on.
    auto tile = [&](int64_t n0, int nr, int64_t apart) {
      const T* w = wp + n0 * K;
      std::fill(acc.begin(), acc.end(), vf{});
      // K in blocks: the tile's block (streamed in by the first group of x rows) and the x
      // rows' block stay in L1 while the other groups pass over it
      for (int64_t k0 = 0; k0 < k_vec; k0 += Loop::kBlock) {
        const int64_t k1 = std::min(k_vec, k0 + Loop::kBlock);
        for (int64_t g = 0; g < groups; ++g) {
          const int mr = static_cast<int>(std::min<int64_t>(kTileM, M - g * kTileM));
          block_tile<Loop>(nr, mr, w, K, apart * K, k0, k1, x + g * kTileM * x_stride,
                           x_stride, acc.data() + g * acc_stride, g == 0);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int mr = static_cast<int>(std::min<int64_t>(kTileM, M - g * kTileM));
        const vf* a = acc.data() + g * acc_stride;
        for (int i = 0; i < nr; ++i) {
          const int64_t row = n0 + i * apart;
          const float b = bp ? scalar(bp[row]) : 0.0f;
          for (int j = 0; j < mr; ++j)
            op[(g * kTileM + j) * o_stride + row] =
                finish(a[i * mr + j], wp + row * K, x + (g * kTileM + j) * x_stride, k_vec, K, b);
        }
      }
    };
    // With streams on, the tile's rows come from tile_n far-apart parts of the range (one
    // stream each); the rows left over, and every row otherwise, in tiles of adjacent rows.
    const int64_t per = g_streams > 1 ? (n_end - n_begin) / tile_n : 0;
    if (per >= kMinStreamRows) {
      for (int64_t n0 = n_begin; n0 < n_begin + per; ++n0) tile(n0, static_cast<int>(tile_n), per);
      n_begin += tile_n * per;
    }
    for (int64_t n0 = n_begin; n0 < n_end; n0 += tile_n)
      tile(n0, static_cast<int>(std::min<int64_t>(tile_n, n_end - n0)), 1);
  });
}

// The inner loop a product of x [M, K] with the weight takes (see the top of the file).
enum class SmallMLoop { kWiden, kWidenNt, kSplitBf16, kBf16Dot, kBf16DotNt };

SmallMLoop small_m_loop_for(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool nt = kVecBytes == 64 && g_nt_loads && M <= kNtMaxRows &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 64 == 0 &&
                  K * static_cast<int64_t>(weight.element_size()) % 64 == 0;
  if (x.scalar_type() == at::kBFloat16) {
    if (kBf16Dot && M >= g_dot_min_rows)
      return nt ? SmallMLoop::kBf16DotNt : SmallMLoop::kBf16Dot;
    if (kVecBytes == 32 && M <= kSplitMaxRows) return SmallMLoop::kSplitBf16;
  }
  return nt ? SmallMLoop::kWidenNt : SmallMLoop::kWiden;
}

// The widening loop (kNt: its non-temporal weight loads) on x copied to float rows.
template <typename T, bool kNt>
void run_widen(const at::Tensor& x, const at::Tensor& weight, const T* bp, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1);
  // x as float rows (a few KB: stays in cache while the weight streams by), each starting on
  // a cache line, so that no vector load of x straddles two lines
  // (bfloat16: each block of kStep elements evens first, then odds, as load2 widens the
  // weight; the K tail after the last whole block in order)
  constexpr int64_t kLineFloats = kLineBytes / sizeof(float);
  const int64_t xs = (K + kLineFloats - 1) / kLineFloats * kLineFloats;  // row stride
  std::vector<vf> storage(M * xs / kLanes);  // (aligned to the vector size)
  float* xf = reinterpret_cast<float*>(storage.data());
  const T* xp = x.data_ptr<T>();
  constexpr int64_t kStep = Widen<T>::kStep;
  const int64_t k_vec = std::is_same_v<T, float> ? 0 : K / kStep * kStep;
  for (int64_t m = 0; m < M; ++m) {
    const T* src = xp + m * x.stride(0);
    float* dst = xf + m * xs;
    for (int64_t k0 = 0; k0 < k_vec; k0 += kStep)
      for (int64_t e = 0; e < kLanes; ++e) {
        dst[k0 + e] = scalar(src[k0 + 2 * e]);
        dst[k0 + kLanes + e] = scalar(src[k0 + 2 * e + 1]);
      }
    for (int64_t k = k_vec; k < K; ++k) dst[k] = scalar(src[k]);
  }
  run<Widen<T, kNt>>(xf, xs, M, K, weight.data_ptr<T>(), weight.size(0), bp, out.data_ptr<T>(),
                     out.stride(0));
}

template <typename T>
void run_small_m(SmallMLoop loop, const at::Tensor& x, const at::Tensor& weight, const T* bp,
                 at::Tensor& out) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (loop == SmallMLoop::kSplitBf16)
      return run<SplitBf16>(x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
                            weight.data_ptr<T>(), weight.size(0), bp, out.data_ptr<T>(),
                            out.stride(0));
#if defined(__AVX512BF16__)
    if (loop == SmallMLoop::kBf16DotNt)
      return run<Bf16Dot<true>>(x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
                                weight.data_ptr<T>(), weight.size(0), bp, out.data_ptr<T>(),
                                out.stride(0));
    if (loop == SmallMLoop::kBf16Dot)
      return run<Bf16Dot<false>>(x.data_ptr<T>(), x.stride(0), x.size(0), x.size(1),
                                 weight.data_ptr<T>(), weight.size(0), bp, out.data_ptr<T>(),
                                 out.stride(0));
#endif
  }
  if (loop == SmallMLoop::kWidenNt) return run_widen<T, true>(x, weight, bp, out);
  run_widen<T, false>(x, weight, bp, out);
}

void check_small_m_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_m_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(),
              "small_m_linear: x's last dim and the weight must be dense");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "small_m_linear: unsupported dtype ", x.scalar_type());
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_small_m_args(x, weight);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a dense [N] tensor of x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) == 0 || weight.size(0) == 0) return out;
  const SmallMLoop loop = small_m_loop_for(x, weight);
  if (x.scalar_type() == at::kFloat)
    run_small_m<float>(loop, x, weight, has_bias ? bias->data_ptr<float>() : nullptr, out);
  else
    run_small_m<c10::BFloat16>(loop, x, weight,
                               has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out);
  return out;
}

// Which inner loop small_m_linear(x, weight) takes: "widen", "widen_nt", "split_bf16",
// "bf16_dot" or "bf16_dot_nt".
std::string small_m_loop(const at::Tensor& x, const at::Tensor& weight) {
  check_small_m_args(x, weight);
  switch (small_m_loop_for(x, weight)) {
    case SmallMLoop::kWidenNt: return "widen_nt";
    case SmallMLoop::kSplitBf16: return "split_bf16";
    case SmallMLoop::kBf16Dot: return "bf16_dot";
    case SmallMLoop::kBf16DotNt: return "bf16_dot_nt";
    default: return "widen";
  }
}

bool has_bf16_dot() { return kBf16Dot; }

#include "cpu_panel_linear.h"

// ---- the CPU linear dispatcher -------------------------------------------------------------
// One C++ entry for every CPU product of the linear layers, eager and compiled: picking the
// kernel in Python cost ~5 us per call (and a Python custom op around it another ~10 us inside
// compiled graphs), a third of a batch-1 decode step of a small model.

struct Policy {
  int64_t f32_small_rows = 4;   // most rows for the small-M kernel, float32
  int64_t bf16_small_rows = 4;  // same, bfloat16
  bool onednn = true;           // float32 products with more rows: oneDNN (else aten::linear)
  int64_t aten_min_rows = 0;    // float32 products of at least this many rows: aten::linear
                                // (MKL's sgemm) even with oneDNN on, and so are the widened
                                // route's float32 blocks; 0: never
  bool bf16_widened = false;    // bfloat16 products with more rows: widened blocks in oneDNN
  // float32 products of panel_min_rows..panel_max_rows rows with a weight that has a current
  // panel copy (set_packed): the panel kernel, whatever the other fields say
  int64_t panel_min_rows = 5;
  int64_t panel_max_rows = 64;
  // the same for bfloat16 products with a current packed copy: bfloat16 panels (AVX2 builds)
  // or oneDNN's reorder of the weight (where oneDNN has bfloat16 kernels); 0..0: none
  int64_t bf16_panel_min_rows = 0;
  int64_t bf16_panel_max_rows = 0;
};
Policy g_policy;

struct Packed {
  int64_t version;
  std::vector<int64_t> sizes;
  at::Tensor packed;
};
std::mutex g_packed_mutex;
std::unordered_map<const void*, Packed> g_packed;

enum class Route { kSmallM, kPacked, kOneDnn, kWidened, kAten };

const char* route_name(Route r) {
  switch (r) {
    case Route::kSmallM: return "small_m";
    case Route::kPacked: return "packed";
    case Route::kOneDnn: return "onednn";
    case Route::kWidened: return "widened";
    default: return "aten";
  }
}

at::Tensor find_packed(const at::Tensor& weight) {
  std::lock_guard<std::mutex> guard(g_packed_mutex);
  auto it = g_packed.find(weight.data_ptr());
  if (it == g_packed.end() || it->second.version != weight._version() ||
      !weight.sizes().equals(it->second.sizes))
    return at::Tensor();
  return it->second.packed;
}

int64_t rows_of(const at::Tensor& x) {
  const int64_t k = x.size(-1);
  return k ? x.numel() / k : 0;
}

Route choose(const at::Tensor& x, const at::Tensor& weight,
             const std::optional<at::Tensor>& bias, at::Tensor* packed) {
  if (!x.device().is_cpu() || x.dim() < 1 || weight.scalar_type() != x.scalar_type() ||
      weight.dim() != 2 || weight.layout() != at::kStrided || x.size(-1) != weight.size(1))
    return Route::kAten;
  const bool has_bias = bias.has_value() && bias->defined();
  const bool bias_dense = !has_bias || (bias->scalar_type() == x.scalar_type() &&
                                        bias->dim() == 1 && bias->is_contiguous());
  const int64_t rows = rows_of(x);
  const bool panel_rows =
      x.scalar_type() == at::kFloat
          ? rows >= g_policy.panel_min_rows && rows <= g_policy.panel_max_rows
          : x.scalar_type() == at::kBFloat16 && rows >= g_policy.bf16_panel_min_rows &&
                rows <= g_policy.bf16_panel_max_rows && rows > 0;
  if (panel_rows && bias_dense) {
    at::Tensor p = find_packed(weight);
    if (p.defined()) {
      if (packed) *packed = p;
      return Route::kPacked;
    }
  }
  const int64_t small = x.scalar_type() == at::kFloat      ? g_policy.f32_small_rows
                        : x.scalar_type() == at::kBFloat16 ? g_policy.bf16_small_rows
                                                           : 0;
  if (rows > 0 && rows <= small && weight.is_contiguous() && bias_dense) return Route::kSmallM;
  if (x.scalar_type() == at::kBFloat16 && g_policy.bf16_widened && g_policy.onednn &&
      rows > 0 && weight.is_contiguous() && bias_dense)
    return Route::kWidened;
  if (x.scalar_type() != at::kFloat) return Route::kAten;
  if (g_policy.aten_min_rows > 0 && rows >= g_policy.aten_min_rows) return Route::kAten;
  return g_policy.onednn ? Route::kOneDnn : Route::kAten;
}

// oneDNN builds a primitive for every distinct row count of a product and keeps it in two
// caches of 1024 entries each (ideep's primitive descriptors and oneDNN's primitives), ~0.55 MB
// per row count and weight shape together (measured on the demo model's products). A server's
// token counts per step take hundreds of values, so its memory grew with every new one: ~25 MB
// per 1000 chat requests, towards ~1 GB with both caches full, then churn (issue 18). Rows are
// therefore padded up to a bucket, 4 per octave (at most 25% more rows, ~8% on average over an
// octave; products of 5..8 rows stay exact): ~36 row counts up to 2048 rows, so a model's
// oneDNN caches stop growing once the buckets its batches use have been seen. The padding
// is compute thrown away (up to a quarter of the rows), so where MKL's sgemm measured faster
// on the exact rows (Policy::aten_min_rows: prefill-sized products) they go there; it keeps no
// state per row count.
int64_t onednn_rows(int64_t rows) {
  if (rows <= 8) return rows;
  int64_t octave = 8;  // rows in (octave, 2 * octave]
  while (octave * 2 < rows) octave *= 2;
  const int64_t step = octave / 4;
  return (rows + step - 1) / step * step;
}

at::Tensor onednn_call(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.has_value() && bias->defined() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// oneDNN on x [M, K] (rows dense) with M padded to onednn_rows(M) by zero rows; the result is
// the leading M rows of the padded product (a dense view).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0);
  const int64_t padded = onednn_rows(rows);
  if (padded == rows) return onednn_call(x, weight, bias);
  at::Tensor xp = at::empty({padded, x.size(1)}, x.options());
  const int64_t row_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
  char* dst = static_cast<char*>(xp.data_ptr());
  if (x.is_contiguous()) {
    // Plain memcpy/memset: the TensorIterator copy_ and zero_ cost ~10 us a call more, a
    // fifth of a 9..64-row product of the demo model's.
    std::memcpy(dst, x.data_ptr(), rows * row_bytes);
  } else {
    xp.narrow(0, 0, rows).copy_(x);
  }
  std::memset(dst + rows * row_bytes, 0, (padded - rows) * row_bytes);
  return onednn_call(xp, weight, bias).narrow(0, 0, rows);
}

// bfloat16 products with many rows where torch's bfloat16 GEMM has no fast path (oneDNN has
// no bfloat16 kernels below AVX-512: aten::linear then runs at a few GFLOP/s, 5-7x slower than
// float32 at 64..2048 rows on an AVX2 machine). The weight is widened to float32 a block of rows
// at a time into a buffer that stays in L2 (kWidenBlockFloats), and each block is one float32
// oneDNN product with x widened once (its rows padded once to onednn_rows, as above; from
// Policy::aten_min_rows rows an aten::linear, MKL's sgemm, on the exact rows); the
// result is rounded to bfloat16 block by block. No float32 copy of the whole weight is ever
// held (the LM head of a 150k vocabulary would need ~0.5 GB per call).
constexpr int64_t kWidenBlockFloats = 1024 * 1024;

void widen_rows(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  // prefill-sized products: each block in aten::linear (MKL's sgemm) on the exact rows, as
  // float32 products of as many rows go (Policy::aten_min_rows)
  const bool aten = g_policy.aten_min_rows > 0 && rows >= g_policy.aten_min_rows;
  const int64_t padded = aten ? rows : onednn_rows(rows);
  at::Tensor xf = at::empty({padded, k}, x.options().dtype(at::kFloat));
  xf.narrow(0, 0, rows).copy_(x);
  xf.narrow(0, rows, padded - rows).zero_();  // only the padding rows
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor bias_f = has_bias ? bias->to(at::kFloat) : at::Tensor();
  const int64_t per_buffer = kWidenBlockFloats / std::max<int64_t>(k, 1) / 16 * 16;
  const int64_t block = std::min<int64_t>(n, std::max<int64_t>(256, per_buffer));
  at::Tensor buffer = at::empty({block, k}, xf.options());
  const auto* w = weight.data_ptr<c10::BFloat16>();
  float* buf = buffer.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t nb = std::min(block, n - n0);
    at::parallel_for(0, nb, 8, [&](int64_t begin, int64_t end) {
      widen_rows(w + (n0 + begin) * k, buf + begin * k, (end - begin) * k);
    });
    std::optional<at::Tensor> bias_block;
    if (has_bias) bias_block = bias_f.narrow(0, n0, nb);
    at::Tensor part = aten ? at::linear(xf, buffer.narrow(0, 0, nb), bias_block)
                           : onednn_call(xf, buffer.narrow(0, 0, nb), bias_block);
    out.narrow(1, n0, nb).copy_(part.narrow(0, 0, rows));
  }
  return out;
}

std::vector<int64_t> out_sizes(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return sizes;
}

at::Tensor as_rows(const at::Tensor& x) {
  at::Tensor x2 = x.reshape({rows_of(x), x.size(-1)});
  return x2.stride(1) == 1 ? x2 : x2.contiguous();
}

// F.linear(x, weight, bias) for x [..., K], weight [N, K]: the small-M kernel for a few rows,
// the panel kernel on the weight's packed copy when one is registered and current,
// oneDNN on the plain weight (float32; from aten_min_rows rows aten::linear, MKL's sgemm, on
// the exact rows), aten::linear otherwise.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  at::Tensor packed;
  switch (choose(x, weight, bias, &packed)) {
    case Route::kSmallM:
      return small_m_linear(as_rows(x), weight, bias).view(out_sizes(x, weight));
    case Route::kPacked:
      if (packed.is_mkldnn())  // oneDNN's reorder (bfloat16); rows padded as onednn_linear's
        return onednn_linear(as_rows(x), packed, bias).view(out_sizes(x, weight));
      return panel_linear(as_rows(x), packed, weight.size(0), bias).view(out_sizes(x, weight));
    case Route::kOneDnn:
      if (x.dim() == 2 && x.stride(1) == 1) return onednn_linear(x, weight, bias);
      return onednn_linear(as_rows(x), weight, bias).view(out_sizes(x, weight));
    case Route::kWidened:
      return widened_linear(as_rows(x), weight, bias).view(out_sizes(x, weight));
    default:
      return at::linear(x, weight, bias);
  }
}

std::string linear_route(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  return route_name(choose(x, weight, bias, nullptr));
}

// The software prefetch distance of one weight stream, bytes (0: none); a negative value only
// reads it. Returns the distance in force.
int64_t prefetch_bytes(int64_t bytes) {
  if (bytes >= 0) g_prefetch_bytes = bytes;
  return g_prefetch_bytes;
}

// Whether one-row products read weights with non-temporal loads: 1 yes, 0 no; a negative
// value only reads it. Returns the setting in force.
int64_t nt_loads(int64_t v) {
  if (v >= 0) g_nt_loads = v > 0;
  return g_nt_loads;
}

// Fewest x rows of a bfloat16 product for the dot-product loop (>= 1; a smaller value only
// reads it). Returns the count in force. (Builds without AVX512-BF16 always widen.)
int64_t bf16_dot_min_rows(int64_t rows) {
  if (rows >= 1) g_dot_min_rows = rows;
  return g_dot_min_rows;
}

// Weight streams per thread of the small-M kernel (1, 2, 4 or 8); a value outside that set only
// reads it. Returns the count in force.
int64_t streams(int64_t n) {
  if (n == 1 || n == 2 || n == 4 || n == 8) g_streams = n;
  return g_streams;
}

void configure(int64_t f32_small_rows, int64_t bf16_small_rows, bool onednn,
               bool bf16_widened, int64_t panel_min_rows, int64_t panel_max_rows,
               int64_t aten_min_rows, int64_t bf16_panel_min_rows,
               int64_t bf16_panel_max_rows) {
  g_policy = Policy{f32_small_rows, bf16_small_rows, onednn,         aten_min_rows,
                    bf16_widened,   panel_min_rows,  panel_max_rows, bf16_panel_min_rows,
                    bf16_panel_max_rows};
}

// The whole 2 MiB pages of [p, p + n) advised for transparent huge pages and collapsed into
// them now (MADV_COLLAPSE, Linux 6.1+; before that khugepaged may, later). For memory whose
// allocation we do not control (oneDNN's reorder of a weight); vllm/utils/hugepages.py says
// why and maps our own tensors for huge pages from the start. Whether the kernel collapsed.
bool collapse_huge_pages(void* p, int64_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (older headers lack the name)
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~(kHuge - 1);
  if (n <= 0 || hi <= lo) return false;
  void* start = reinterpret_cast<void*>(lo);
  madvise(start, hi - lo, MADV_HUGEPAGE);
  return madvise(start, hi - lo, kMadvCollapse) == 0;
#else
  return false;
#endif
}

// Keep `packed` (the weight's panels, pack_panels; or for a bfloat16 weight oneDNN's reorder
// of it, mkldnn._reorder_linear_weight) for products with `weight` while the weight keeps its
// storage, shape and version (an in-place change makes the copy stale: not used). huge_pages:
// a reorder's memory is collapsed into transparent huge pages (collapse_huge_pages).
int64_t set_packed(const at::Tensor& weight, const at::Tensor& packed, bool huge_pages) {
  const bool reorder = packed.is_mkldnn();
  TORCH_CHECK(weight.dim() == 2 && packed.dim() == (reorder ? 2 : 3) &&
                  packed.scalar_type() == weight.scalar_type() &&
                  (reorder ? weight.scalar_type() == at::kBFloat16 &&
                                 packed.sizes().equals(weight.sizes())
                           : packed.is_contiguous() &&
                                 packed.size(0) == (weight.size(0) + kPanel - 1) / kPanel &&
                                 packed.size(1) == weight.size(1) && packed.size(2) == kPanel),
              "set_packed: the weight's panels (pack_panels) or, for a bfloat16 weight, "
              "oneDNN's reorder of it expected, got a tensor of shape ", packed.sizes());
  if (reorder && huge_pages)
    collapse_huge_pages(at::native::data_ptr_from_mkldnn(packed),
                        at::native::nbytes_from_mkldnn(packed));
  std::lock_guard<std::mutex> guard(g_packed_mutex);
  g_packed[weight.data_ptr()] = Packed{weight._version(), weight.sizes().vec(), packed};
  return reinterpret_cast<int64_t>(weight.data_ptr());
}

void drop_packed(int64_t key) {
  std::lock_guard<std::mutex> guard(g_packed_mutex);
  g_packed.erase(reinterpret_cast<const void*>(key));
}

int64_t num_packed() {
  std::lock_guard<std::mutex> guard(g_packed_mutex);
  return static_cast<int64_t>(g_packed.size());
}

// Shapes for the compiler's fake tensors (symbolic token counts included).
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

#include "cpu_isa_level.h"

}  // namespace

TORCH_LIBRARY(vllm_cpu_linear, m) {
  m.def("isa() -> str", &isa_level);
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
  // Whether bfloat16 products (of bf16_dot_min_rows rows or more) use AVX512-BF16 dot
  // products.
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("small_m_loop(Tensor x, Tensor weight) -> str", &small_m_loop);
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
  m.impl("linear", c10::DispatchKey::Meta, &linear_meta);
  m.def("linear_route(Tensor x, Tensor weight, Tensor? bias=None) -> str", &linear_route);
  m.def("onednn_rows(int rows) -> int", &onednn_rows);
  m.def("configure(int f32_small_rows, int bf16_small_rows, bool onednn, "
        "bool bf16_widened=False, int panel_min_rows=5, int panel_max_rows=64, "
        "int aten_min_rows=0, int bf16_panel_min_rows=0, int bf16_panel_max_rows=0) -> ()",
        &configure);
  m.def("prefetch_bytes(int bytes=-1) -> int", &prefetch_bytes);
  m.def("nt_loads(int v=-1) -> int", &nt_loads);
  m.def("streams(int n=-1) -> int", &streams);
  m.def("bf16_dot_min_rows(int rows=-1) -> int", &bf16_dot_min_rows);
  m.def("set_packed(Tensor weight, Tensor packed, bool huge_pages=False) -> int", &set_packed);
  // (exposed for tests: whether the kernel collapsed a tensor's whole 2 MiB pages)
  m.def("collapse_huge_pages(Tensor t) -> bool", [](const at::Tensor& t) {
    return t.is_mkldnn() ? collapse_huge_pages(at::native::data_ptr_from_mkldnn(t),
                                               at::native::nbytes_from_mkldnn(t))
                         : collapse_huge_pages(t.data_ptr(), t.nbytes());
  });
  m.def("drop_packed(int key) -> ()", &drop_packed);
  m.def("num_packed() -> int", &num_packed);
  // The weight's current packed copy, if one is registered (tests, inspection).
  m.def("packed_of(Tensor weight) -> Tensor?", [](const at::Tensor& weight) {
    at::Tensor p = find_packed(weight);
    return p.defined() ? std::optional<at::Tensor>(p) : std::nullopt;
  });
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.impl("pack_panels", c10::DispatchKey::CPU, &pack_panels);
  // the same into a given tensor (one mapped for huge pages: vllm/utils/hugepages.py)
  m.def("pack_panels_out(Tensor weight, Tensor(a!) out) -> ()");
  m.impl("pack_panels_out", c10::DispatchKey::CPU, &pack_panels_out);
  m.def("panel_linear(Tensor x, Tensor panels, int N, Tensor? bias=None) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
  m.def("panel_prefetch_lines(int lines=-1) -> int", &panel_prefetch_lines);
  // Whether pack_panels takes bfloat16 weights in this build (AVX2).
  m.def("bf16_panels() -> bool", &bf16_panels);
}
