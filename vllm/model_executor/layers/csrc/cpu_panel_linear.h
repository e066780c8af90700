// y = x W^T (+ b) for float32 or bfloat16 x on a weight packed in column panels (the -O2
// prepacked copy).
//
//   torch.ops.vllm_cpu_linear.pack_panels(weight [N, K] float32 or bfloat16)
//       -> panels [ceil(N/16), K, 16] of the weight's dtype
//   torch.ops.vllm_cpu_linear.panel_linear(x [M, K], panels, N, bias [N] or None) -> y [M, N]
//   torch.ops.vllm_cpu_linear.bf16_panels() -> whether this build packs bfloat16 weights
//
// Pasted into cpu_small_m_linear.cpp's anonymous namespace (cpu_linear.py, `source_with_headers`), after
// its vector type `vf`, `load` and kLanes.
//
// Panel p holds weight rows 16p .. 16p+15 (output columns of y) column by column: element
// [p][k][c] is W[16p + c][k], rows past N zero. A step over k loads one cache line of each panel
// (16 output columns) and multiplies it by one element of each x row, broadcast: an outer
// product into a tile of MR x rows by NP panels of accumulators, no reduction across lanes at
// the end, and each weight line read once per tile for all of its x rows (the dot-product tiles
// of the small-M kernel load an x vector and a weight vector for every FMA pair, and reduce
// every accumulator across its lanes at the end).
//
// bfloat16 weights (AVX2 builds: where neither oneDNN nor the CPU has bfloat16 arithmetic) are
// packed the same way in bfloat16, half a cache line a step, with the 16 columns of a step in
// the order the widening reads them (kBf16PanelOrder), and widened to float32 in registers by
// interleaving with zero words, which takes a shuffle port and leaves the FMA ports to the
// tile; x is widened when it is copied into tiles, accumulation is in float32 and y is rounded
// to bfloat16 once at the end (as the small-M kernel does).
//
// Loops: x is first copied into tiles of its own ([rows of the tile] for each k, so a tile
// broadcasts from one pointer at fixed offsets: with a pointer per row of x the compiler ran
// out of general registers and reloaded some from the stack every step). Each thread takes a
// range of panel groups (NP panels, kPanelTileP); for a group, x's rows are taken in chunks of
// whole tiles of at least kPanelChunkRows rows, K in blocks of panel_k_block<T>() steps (the
// group's block of the weight stays in L1 while every MR-row tile of the chunk passes over it),
// the accumulators are written back to y between blocks. Prefetch: a chunk of one tile
// prefetches the panels' lines g_panel_prefetch_lines ahead; in a chunk of T >= 2 tiles over a
// float32 block, each tile prefetches its 1/T share of the next block's lines, evenly over its
// steps (`NextBlockShare`). With the first tile alone prefetching, that tile read the weight
// from memory while the FMAs waited, and the others computed from L1 while nothing was read:
// the 0.5B shape's products, paired, AVX2 float32 at 12-24 rows (tiles of 6) 1.21-1.26x, 8 rows
// 1.14x, AVX-512 at 24-64 rows (tiles of 12) 1.05-1.06x; bfloat16 panels (half the bytes a
// step) read 0.94-1.10x spread: unchanged.

// Output columns per panel (one cache line of float32).
constexpr int64_t kPanel = 16;
constexpr int kPanelVecs = static_cast<int>(kPanel) / kLanes;
#if defined(__AVX512F__)
// AVX-512: 12 rows x 2 panels = 24 accumulators of 16 lanes, 2 weight vectors and a broadcast
// (27 of 32 registers).
constexpr int kPanelTileM = 12;
constexpr int kPanelTileP = 2;
// Products of 13-16 rows (batch-16 decode) as one tile of 16 rows x 1 panel instead of a
// 12-row and a 4-row tile: every weight line is used by all rows as it arrives from memory,
// so the reads overlap the FMAs (with two tiles the first streamed the block while the FMAs
// waited, and the second computed from L1 while nothing was read).
constexpr int kPanelWideTileM = 16;
#else
// AVX2: a panel is two 8-lane vectors; 6 rows x 1 panel = 12 accumulators, 2 weight vectors
// and a broadcast (15 of 16 registers).
constexpr int kPanelTileM = 6;
constexpr int kPanelTileP = 1;
constexpr int kPanelWideTileM = 0;  // (none)
#endif
// K steps per block. AVX2 float32 128: with the next block prefetched, its 16 KB beside the
// current block's and the x tiles' did not fit L1 at 256 (spread prefetch 1.06x at 256, 1.19x at
// 128 on 16 rows; 128 without spread prefetch 0.91x).
template <typename T>
constexpr int64_t panel_k_block() {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return 128;
#endif
  return 256;
}
constexpr int64_t kPanelChunkRows = 64;
// (k steps of each panel ahead: a float32 step is one cache line, a bfloat16 one half a line)
int64_t g_panel_prefetch_lines = 32;  // cpu_linear.py sets its PANEL_PREFETCH_LINES at load

#if defined(__AVX2__) && !defined(__AVX512F__)
#define VLLM_BF16_PANELS 1
// _mm256_unpacklo/hi_epi16(0, v) turn the 16 bfloat16 of a 32-byte load into two float32
// vectors: words 0-3 and 8-11 (one 128-bit half each) into the first, 4-7 and 12-15 into the
// second; packed position q holds column kBf16PanelOrder[q], so the two vectors are columns
// 0-7 and 8-15.
constexpr int64_t kBf16PanelOrder[kPanel] = {0, 1, 2, 3, 8, 9, 10, 11,
                                             4, 5, 6, 7, 12, 13, 14, 15};

inline void widen_panel_line(const c10::BFloat16* p, vf* out) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  out[0] = reinterpret_cast<vf>(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw)));
  out[1] = reinterpret_cast<vf>(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw)));
}
#endif
constexpr bool kBf16Panels =
#if defined(VLLM_BF16_PANELS)
    true;
#else
    false;
#endif

bool bf16_panels() { return kBf16Panels; }

// One k step of a panel, the 16 columns as kPanelVecs float vectors.
template <typename T>
inline void panel_line(const T* p, vf* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int v = 0; v < kPanelVecs; ++v) out[v] = load(p + v * kLanes);
  } else {
#if defined(VLLM_BF16_PANELS)
    widen_panel_line(p, out);
#endif
  }
}

template <typename T>
void pack_panels_into(const T* w, T* out, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      T* dst = out + p * K * kPanel;
      const T* src[kPanel];  // the weight row of each packed position (nullptr: padding)
      for (int64_t q = 0; q < kPanel; ++q) {
        int64_t c = q;
#if defined(VLLM_BF16_PANELS)
        if constexpr (!std::is_same_v<T, float>) c = kBf16PanelOrder[q];
#endif
        src[q] = p * kPanel + c < N ? w + (p * kPanel + c) * K : nullptr;
      }
      for (int64_t k = 0; k < K; ++k)
        for (int64_t q = 0; q < kPanel; ++q) dst[k * kPanel + q] = src[q] ? src[q][k] : T(0.0f);
    }
  });
}

std::vector<int64_t> check_panel_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat ||
                   (weight.scalar_type() == at::kBFloat16 && kBf16Panels)),
              "pack_panels: a dense [N, K] weight of float32",
              kBf16Panels ? " or bfloat16" : " (this build packs no bfloat16)",
              " expected, got ", weight.scalar_type(), " of shape ", weight.sizes());
  return {(weight.size(0) + kPanel - 1) / kPanel, weight.size(1), kPanel};
}

// Packs `weight` into `packed` (the panels' shape, the weight's dtype, dense).
void pack_panels_out(const at::Tensor& weight, at::Tensor packed) {
  const std::vector<int64_t> shape = check_panel_weight(weight);
  TORCH_CHECK(packed.sizes().equals(shape) && packed.scalar_type() == weight.scalar_type() &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "pack_panels_out: out must be a dense CPU tensor of shape ",
              at::IntArrayRef(shape), " and the weight's dtype, got ", packed.scalar_type(),
              " of shape ", packed.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == at::kFloat)
    pack_panels_into(weight.data_ptr<float>(), packed.data_ptr<float>(), N, K);
  else
    pack_panels_into(weight.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), N, K);
}

at::Tensor pack_panels(const at::Tensor& weight) {
  at::Tensor packed = at::empty(check_panel_weight(weight), weight.options());
  pack_panels_out(weight, packed);
  return packed;
}

enum class PanelPrefetch { kNone, kAhead, kNextBlock };

// A tile's share of the next block's cache lines (of each of its NP panels, panels K * kPanel
// elements apart): `lines` lines from `first`, one prefetched each time the tile's steps have
// covered another 1/lines of the current block.
template <typename T>
struct NextBlockShare {
  const T* first = nullptr;
  int64_t lines = 0;
};

// acc(MR x rows, NP panels) over k in [k0, k1): w = the first panel's element [0][0], panels K *
// kPanel floats apart; xt = the tile's rows of x, [k][MR]; y the tile's first output, rows ys
// apart; ncols of the tile's NP * kPanel columns exist (the rest is the last panel's padding).
// first: start from the bias (or zero) instead of y. kPf: no prefetch, g_panel_prefetch_lines
// ahead, or `next` (kNextBlock).
template <int MR, int NP, PanelPrefetch kPf, typename T>
inline void panel_tile(const T* w, int64_t K, const float* xt, int64_t k0, int64_t k1,
                       float* y, int64_t ys, int64_t ncols, const float* bias, bool first,
                       NextBlockShare<T> next) {
  constexpr int V = NP * kPanelVecs;
  vf acc[MR][V];
  auto partial_load = [&](const float* src, int64_t c) {
    float tmp[kLanes] = {};
    for (int l = 0; l < kLanes && c + l < ncols; ++l) tmp[l] = src[l];
    return load(tmp);
  };
  for (int i = 0; i < V; ++i) {
    const int64_t c = static_cast<int64_t>(i) * kLanes;
    vf b = {};
    if (first && bias) b = c + kLanes <= ncols ? load(bias + c) : partial_load(bias + c, c);
    for (int r = 0; r < MR; ++r) {
      if (first) acc[r][i] = b;
      else acc[r][i] = c + kLanes <= ncols ? load(y + r * ys + c) : partial_load(y + r * ys + c, c);
    }
  }
  const int64_t panel_stride = K * kPanel;
  const int64_t ahead = g_panel_prefetch_lines * kPanel;
  constexpr int64_t kLineElems = kLineBytes / sizeof(T);
  const int64_t steps = k1 - k0;
  int64_t credit = 0;  // kNextBlock: next.lines per step, one line per `steps`
  for (int64_t k = k0; k < k1; ++k) {
    const T* wk = w + k * kPanel;
    if constexpr (kPf == PanelPrefetch::kAhead)
      for (int p = 0; p < NP; ++p) __builtin_prefetch(wk + p * panel_stride + ahead);
    if constexpr (kPf == PanelPrefetch::kNextBlock) {
      credit += next.lines;
      if (credit >= steps) {  // (a share longer than this block's steps loses its tail)
        credit -= steps;
        for (int p = 0; p < NP; ++p) __builtin_prefetch(next.first + p * panel_stride);
        next.first += kLineElems;
      }
    }
    vf wv[V];
    for (int p = 0; p < NP; ++p) panel_line(wk + p * panel_stride, wv + p * kPanelVecs);
    // float32 weight vectors stay in registers: where registers were free (tiles of few rows)
    // GCC made each weight vector a memory operand of every FMA, so a step loaded the line once
    // per row, and these CPUs load two 32-byte vectors a cycle: on AVX2 a 4-row tile took as
    // long as a 6-row one. The 0.5B shape's products, cold, paired: as AVX2 7-16 rows
    // 1.06-1.07x; AVX-512 28-64 rows (a 4-row tile after the 12-row ones) 1.02-1.03x.
    // (bfloat16 widens in registers anyway: 0.98-1.00x; the AVX-512 wide tile of one panel
    // broadcasts x from memory instead, and pinned its weight measured 0.63x at 13 rows.)
    if constexpr (std::is_same_v<T, float> && (kVecBytes == 32 || NP == 2))
      for (int i = 0; i < V; ++i) asm("" : "+v"(wv[i]));
    const float* xk = xt + k * MR;
    for (int r = 0; r < MR; ++r) {
      const float xv = xk[r];
      for (int i = 0; i < V; ++i) acc[r][i] += wv[i] * xv;
    }
  }
  for (int i = 0; i < V; ++i) {
    const int64_t c = static_cast<int64_t>(i) * kLanes;
    for (int r = 0; r < MR; ++r) {
      float* dst = y + r * ys + c;
      if (c + kLanes <= ncols) {
        std::memcpy(dst, &acc[r][i], sizeof(vf));
      } else {
        float tmp[kLanes];
        std::memcpy(tmp, &acc[r][i], sizeof(vf));
        for (int l = 0; l < kLanes && c + l < ncols; ++l) dst[l] = tmp[l];
      }
    }
  }
}

// panel_tile for `rows` (1..MR) rows of x: the tile instantiated for that many.
template <int MR, int NP, typename T>
inline void panel_tile_rows(int rows, const T* w, int64_t K, const float* xt, int64_t k0,
                            int64_t k1, float* y, int64_t ys, int64_t ncols, const float* bias,
                            bool first, PanelPrefetch pf, NextBlockShare<T> next = {}) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      switch (pf) {
        case PanelPrefetch::kAhead:
          return panel_tile<MR, NP, PanelPrefetch::kAhead, T>(w, K, xt, k0, k1, y, ys, ncols,
                                                              bias, first, next);
        case PanelPrefetch::kNextBlock:
          return panel_tile<MR, NP, PanelPrefetch::kNextBlock, T>(w, K, xt, k0, k1, y, ys,
                                                                  ncols, bias, first, next);
        default:
          return panel_tile<MR, NP, PanelPrefetch::kNone, T>(w, K, xt, k0, k1, y, ys, ncols,
                                                             bias, first, next);
      }
    }
    panel_tile_rows<MR - 1, NP, T>(rows, w, K, xt, k0, k1, y, ys, ncols, bias, first, pf, next);
  }
}

// x [M, K] in tiles, float32: the tile_m rows from r0 (fewer in the last tile) at
// xt + r0 * K, [k][rows].
template <typename X>
void copy_to_tiles(const X* xp, int64_t xs, int64_t M, int64_t K, int64_t tile_m, float* xt) {
  at::parallel_for(0, (M + tile_m - 1) / tile_m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * tile_m;
      const int64_t rows = std::min<int64_t>(tile_m, M - r0);
      float* dst = xt + r0 * K;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = static_cast<float>(xp[(r0 + r) * xs + k]);
    }
  });
}

template <typename T>
void panel_product(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* bp,
                   float* yp);

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  x.stride(1) == 1,
              "panel_linear: float32 or bfloat16 x [M, K] with a dense last dim expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == dtype &&
                  panels.is_contiguous() && panels.size(1) == K && panels.size(2) == kPanel &&
                  panels.size(0) == (N + kPanel - 1) / kPanel,
              "panel_linear: panels [ceil(N/16), K, 16] of x's K and dtype expected");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "panel_linear: bias must be a dense [N] tensor of x's dtype");
  // float32 accumulators go to y between K blocks: a bfloat16 product computes into a float32
  // y and is rounded once at the end
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor bias_f;
  if (has_bias) bias_f = dtype == at::kFloat ? *bias : bias->to(at::kFloat);
  if (M == 0 || N == 0) {
  } else if (K == 0) {
    has_bias ? y.copy_(bias_f.expand({M, N})) : y.zero_();
  } else if (dtype == at::kFloat) {
    panel_product<float>(x, panels, N, has_bias ? bias_f.data_ptr<float>() : nullptr,
                         y.data_ptr<float>());
  } else {
    panel_product<c10::BFloat16>(x, panels, N, has_bias ? bias_f.data_ptr<float>() : nullptr,
                                 y.data_ptr<float>());
  }
  return dtype == at::kFloat ? y : y.to(dtype);
}

template <typename T>
void panel_product(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* bp,
                   float* yp) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool wide = kPanelWideTileM > 0 && M > kPanelTileM && M <= kPanelWideTileM;
  const int64_t tile_m = wide ? kPanelWideTileM : kPanelTileM;
  at::Tensor tiles = at::empty({M * K}, x.options().dtype(at::kFloat));
  float* xt = tiles.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    copy_to_tiles(x.data_ptr<float>(), x.stride(0), M, K, tile_m, xt);
  else
    copy_to_tiles(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, tile_m, xt);
  const T* wp = panels.data_ptr<T>();
  const int64_t num_panels = panels.size(0);
  const int64_t groups = (num_panels + kPanelTileP - 1) / kPanelTileP;
  constexpr int64_t kBlock = panel_k_block<T>();
  const PanelPrefetch ahead =
      g_panel_prefetch_lines > 0 ? PanelPrefetch::kAhead : PanelPrefetch::kNone;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    if constexpr (kPanelWideTileM > 0) {
      if (wide) {  // one tile of all M rows, panel by panel
        for (int64_t p = begin * kPanelTileP; p < std::min(num_panels, end * kPanelTileP); ++p) {
          const int64_t c0 = p * kPanel;
          for (int64_t k0 = 0; k0 < K; k0 += kBlock)
            panel_tile_rows<kPanelWideTileM, 1, T>(
                static_cast<int>(M), wp + p * K * kPanel, K, xt, k0, std::min(K, k0 + kBlock),
                yp + c0, N, std::min(N - c0, kPanel), bp ? bp + c0 : nullptr, k0 == 0, ahead);
        }
        return;
      }
    }
    // (chunks of whole tiles, at least kPanelChunkRows rows: products of up to
    // PANEL_MAX_ROWS rows read the weight once)
    constexpr int64_t kChunk = (kPanelChunkRows + kPanelTileM - 1) / kPanelTileM * kPanelTileM;
    for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
      const int64_t m1 = std::min(M, m0 + kChunk);
      const int64_t tiles = (m1 - m0 + kPanelTileM - 1) / kPanelTileM;  // in this chunk
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * kPanelTileP;
        const int64_t np = std::min<int64_t>(kPanelTileP, num_panels - p0);
        for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
          const int64_t k1 = std::min(K, k0 + kBlock);
          // the next block of a full group: this group's, or the next group's first
          constexpr int64_t kLineElems = kLineBytes / sizeof(T);
          const T* next_block = nullptr;
          int64_t next_lines = 0;
          if (std::is_same_v<T, float> && tiles > 1 && np == kPanelTileP &&
              ahead == PanelPrefetch::kAhead && (k1 < K || g + 1 < end)) {
            next_block = k1 < K ? wp + (p0 * K + k1) * kPanel
                                : wp + (p0 + kPanelTileP) * K * kPanel;
            const int64_t next_steps =
                k1 < K ? std::min(K, k1 + kBlock) - k1 : std::min(K, kBlock);
            next_lines = (next_steps * kPanel + kLineElems - 1) / kLineElems;
          }
          for (int64_t r0 = m0; r0 < m1; r0 += kPanelTileM) {
            const int rows = static_cast<int>(std::min<int64_t>(kPanelTileM, m1 - r0));
            PanelPrefetch pf = r0 == m0 ? ahead : PanelPrefetch::kNone;
            NextBlockShare<T> share;
            if (next_block) {  // tile t of `tiles`: lines [t * L / tiles, (t + 1) * L / tiles)
              const int64_t t = (r0 - m0) / kPanelTileM;
              const int64_t from = t * next_lines / tiles, to = (t + 1) * next_lines / tiles;
              share = {next_block + from * kLineElems, to - from};
              pf = PanelPrefetch::kNextBlock;
            }
            // a full group of panels, or the last group's panels one at a time
            for (int64_t p = p0; p < p0 + np; p += (np == kPanelTileP ? np : 1)) {
              const int64_t c0 = p * kPanel;
              const T* w = wp + p * K * kPanel;
              const float* xr = xt + r0 * K;
              float* yr = yp + r0 * N + c0;
              const float* b = bp ? bp + c0 : nullptr;
              if (np == kPanelTileP)
                panel_tile_rows<kPanelTileM, kPanelTileP, T>(
                    rows, w, K, xr, k0, k1, yr, N, std::min(N - c0, kPanelTileP * kPanel), b,
                    k0 == 0, pf, share);
              else
                panel_tile_rows<kPanelTileM, 1, T>(rows, w, K, xr, k0, k1, yr, N,
                                                std::min(N - c0, kPanel), b, k0 == 0, pf);
            }
          }
        }
      }
    }
  });
}

// The prefetch distance of the panel kernel, cache lines of each panel ahead (0: none); a
// negative value only reads it. Returns the distance in force.
int64_t panel_prefetch_lines(int64_t lines) {
  if (lines >= 0) g_panel_prefetch_lines = lines;
  return g_panel_prefetch_lines;
}
