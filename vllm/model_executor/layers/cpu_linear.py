"""`dispatch_linear`: `F.linear` with faster kernels for the CPU's eager products.

On the dev machines torch's CPU `F.linear` leaves speed on the table in two places:
- float32 goes to MKL's sgemm, which reaches about half of what oneDNN's
  `mkldnn._linear_pointwise` does on the same plain [out, in] weight, for prefill- and
  decode-shaped products alike (1.5-2.4x at 2..1152 rows, measured on an AMD dev machine; on
  an Intel Xeon MKL is the faster one on prefill-sized products, from 129 rows, which go
  there: `aten_min_rows`);
- decode products with a few rows are bound by reading the weight, and both MKL and oneDNN
  read it at about half the machine's bandwidth (bfloat16: ~15 of ~30 GB/s). A small C++
  kernel (csrc/cpu_small_m_linear.cpp) streams the weight with prefetching instead, for up to
  4 rows (float32: 1.0-1.6x oneDNN; bfloat16: 1.5-2.3x), and up to 16 bfloat16 rows on CPUs
  with AVX512-BF16 dot products (1.1-1.5x at 8-16 rows). Since then it reads each thread's
  rows as a single stream, which made one-row products another 1.25-1.4x faster, and takes
  float32 products up to 16 rows on AVX2 and 12 on AVX-512 (the measured crossovers below);
  on Intel CPUs each thread reads several far-apart streams at once (`weight_streams`).
- batched decode products (4-5..64 rows on AVX-512, 7-10..64 on AVX2, per CPU vendor) are
  bound by the FMAs' use of loads more than by the weight's reads: -O2/-O3 keep a copy of
  each float32 weight in column panels (16 output columns by K), which the panel kernel
  (csrc/cpu_panel_linear.h) multiplies as outer products into tiles of rows x panels,
  1.4-1.5x oneDNN's prepacked products at 12-16 rows (`panel_rows`, PANEL_MIN_ROWS,
  AVX2_PANEL_MIN_ROWS and their per-vendor dicts). On AVX2 a bfloat16 weight gets a
  bfloat16 panel copy, widened in registers: 4..128 rows 1.1-1.6x the small-M kernel and
  the widened route (`bf16_packed_rows`). Where oneDNN has bfloat16 kernels
  (AVX512-BF16, AMX) a bfloat16 weight gets oneDNN's own reorder instead, which from 5 rows
  on beats the small-M kernel's dot products (1.4-1.8x at 5-32 rows on a Zen 4).

oneDNN builds and caches a primitive for every distinct row count (~0.55 MB each with the
weight shape, in two caches of 1024 entries), so a server whose per-step token counts keep
changing grew without visible objects (issue 18: ~25 MB per 1000 chat requests). Its products
are padded to a few row counts (`onednn_rows`: 4 per octave) so the caches stop growing once
the row buckets a workload uses have been seen.

bfloat16 products with more rows go to torch's bfloat16 GEMM, except where oneDNN has no
bfloat16 kernels for the CPU (below AVX-512): there that GEMM runs at a few GFLOP/s (5-7x
slower than float32 from 64 rows on an AVX2 machine, made batch-16 bfloat16 serving 5x slower
than llama.cpp), so the small-M kernel takes up to 48 rows and beyond that the weight is widened
to float32 block by block for oneDNN ("widened"; `bf16_widened()`). Other products (other
dtypes, other devices) keep `F.linear`, and so does traced code (torch.compile: Inductor
lowers `F.linear` itself). The choice is made in C++
(`vllm_cpu_linear::linear`, csrc/cpu_small_m_linear.cpp: choosing in Python cost ~5 us a call),
which also serves compiled models as an opaque op (`cpu_linear_op`) and computes with the panel
copies of prepacked weights (cpu_prepacked_linear.py). The kernels are built at first use for the
process's ISA level (vllm/utils/cpu_kernels.py: avx2, avx512 or avx512_bf16, VLLM_CPU_ISA to
force a lower one; `torch.ops.vllm_cpu_linear.isa()` says which), with vectors and tiles sized
for that level's registers; when the build fails the same routes are taken in Python.
VLLM_CPU_ONEDNN_LINEAR=0 / VLLM_CPU_SMALL_M_LINEAR=0 turn the two routes off;
VLLM_CPU_ATEN_LINEAR_MIN_ROWS sets where MKL takes over from oneDNN (0: never).
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from vllm.utils.cpu_info import cpu_vendor
from vllm.utils.cpu_kernels import load_cpu_extension, source_with_headers, switched_off

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCE = os.path.join(_CSRC, "cpu_small_m_linear.cpp")
_PANEL_HEADER = os.path.join(_CSRC, "cpu_panel_linear.h")
# Most rows a product may have for the small-M kernel (measured crossovers against oneDNN on
# cold weights; bfloat16 with AVX512-BF16 dot products goes further).
SMALL_M_MAX_ROWS = {torch.float32: 4, torch.bfloat16: 4}
# AVX2's 2 x 6 tiles with the next tile prefetched (csrc) beat oneDNN's prepacked float32
# products up to 16 rows on cold weights: a step of the 50M Llama's 33 products, 2 threads,
# 12 rows 19 ms against 27.5, 16 rows 25 against 30-33, 24 rows 33-34 against 34-37.
AVX2_F32_MAX_ROWS = 16
# AVX-512's 4 x 4 tiles against oneDNN's prepacked float32 products, same step of the 50M
# Llama's 33 products on cold weights (Intel Xeon with AVX-512 + AMX, 2 threads, medians of 5
# interleaved rounds, two runs): 5 rows 1.17x, 6 1.12x, 8 1.12-1.17x, 10 0.95x, 12 0.92-1.01x,
# 16 0.93x. (The earlier limit of 4 came from a Zen 4 machine.) Since the tiles read 4 weight
# streams, walk K in blocks of 256 and prefetch once per block (csrc), the 0.5B shape's 97
# products and the 50M Llama's 33 (same machine, 8 streams, two runs each): 10 rows 1.31x /
# 1.32x, 12 1.19-1.24x / 1.08-1.24x, 14 1.08x / 1.20x, 16 0.96x / 1.02x.
AVX512_F32_MAX_ROWS = 12
BF16_DOT_MAX_ROWS = 16
# Float32 products with a panel copy of the weight (csrc/cpu_panel_linear.h; -O2/-O3 prepack
# one): the panel kernel for PANEL_MIN_ROWS..PANEL_MAX_ROWS rows on AVX-512, the small-M kernel
# for fewer rows, oneDNN on the plain weight for more. Against oneDNN's prepacked products
# (Intel Xeon, AVX-512, 2 threads; the 50M Llama's layer products, 46 MB, so mostly from L3;
# paired rounds, best of 5-9, a loaded host: ranges over runs): 4 rows 1.7x (small-M 1.9x),
# 6-8 rows 1.6-1.8x (small-M 1.3x), 12-16 rows 1.4-1.5x (small-M 0.9-1.0x), 24-32 1.1-1.3x,
# 48-64 0.94-1.1x, 128 0.85-0.9x, 512-2048 0.8-0.9x; oneDNN on the plain weight 0.75-0.85x
# up to 64 rows, 0.9x at 512-2048 (it reorders the weight each call). The 0.5B shape's 97
# products, cold, one thread on a core of its own: 8 rows 1.44x (small-M 1.41x), 12 rows
# 1.32-1.44x (small-M 1.07-1.11x), 16 rows 1.25x, 32 1.23x, 48 1.15x, 64 0.92x. AVX2 (its 6-row
# tiles) was measured only as the AVX2 build on that Intel machine, where oneDNN keeps its
# AVX-512 kernels: 16 rows as fast as the small-M kernel's AVX2 tiles (0.77x / 0.81x oneDNN's
# AVX-512). Re-measured with the panels prefetching 32 lines ahead (below), on the same machine
# run as an AVX2-only CPU (VLLM_CPU_ISA=avx2, ONEDNN_MAX_CPU_ISA=AVX2, ...), 2 threads, cold,
# medians of 5 interleaved passes, panels against the small-M kernel: the 0.5B shape's
# products 8 rows 0.94x, 9 0.98x, 10 1.07x, 12 1.13-1.15x, 16 1.31-1.34x; the 50M Llama's
# 8 rows 1.18x, 10 1.12x, 12 1.22x, 16 1.26x (oneDNN's AVX2 products 0.74-1.06x). So AVX2
# takes panels from AVX2_PANEL_MIN_ROWS.
PANEL_MIN_ROWS = 5
# On the Zen 4 dev machine (AMD, AVX-512) the panel kernel beat the small-M kernel (two weight
# streams) at 4 rows too: cold, 2 threads, paired in-process rounds, the 0.5B shape's products
# 1.27-1.39x, the 50M Llama's 0.90-1.06x (at 3 rows 1.06x / 0.95x, at 5-12 rows panels
# 1.06-1.86x); batch-4 decode end to end (the same switch between requests of one engine)
# 0.5B shape 1.18x, 50M Llama 0.98x. Per CPU vendor, on AVX-512.
PANEL_MIN_ROWS_BY_VENDOR = {"AuthenticAMD": 4}
AVX2_PANEL_MIN_ROWS = 10
# The same Zen 4 run as AVX2 (VLLM_CPU_ISA=avx2), with the panels' next-block prefetch: panels
# against the small-M kernel, cold, 2 threads, paired medians of 7, the 0.5B shape's products
# (8 layers) / the 50M Llama's: 4 rows 1.09x / 0.76x, 5 1.17x / 0.90x, 6 1.32x / 0.80-0.97x,
# 7 1.27x / 1.18x, 8 1.43x / 1.25-1.47x, 9 1.53x / 1.33x, 10 1.56x / 1.24x. Per CPU vendor on AVX2.
AVX2_PANEL_MIN_ROWS_BY_VENDOR = {"AuthenticAMD": 7}
PANEL_MAX_ROWS = 64
# The panel kernel's software prefetch distance, in cache lines of each panel ahead (one line =
# one k step of 16 columns; 0 = the hardware prefetchers alone). The 0.5B shape's 97 products
# on cold panel copies (Intel Xeon, AVX-512), 32 lines against 8: 2 threads, paired medians
# of 7 rounds (`bench_cpu_linear.py --prepacked --panel-prefetch 8 32`) 5 rows 1.07x, 8 1.11x,
# 16 1.03x, 32 1.04x, 64 1.02x; one thread (medians of 4 passes) 5 rows 1.15x, 12 1.08x,
# 16 1.08x, 48 1.02x (64 lines within 3% of 32; 16 lines half way). The 50M Llama's products
# (mostly from L3), 2 threads: 8-16 rows 1.04-1.09x. The AVX2 build, on the same machine run
# as an AVX2-only CPU (oneDNN and MKL limited too), 0.5B shape, 2 threads, paired medians of 7:
# 10 rows 1.26x, 16 1.07x, 32 0.97x (1.09x per bandwidth).
PANEL_PREFETCH_LINES = 32
# Fewest rows of the float32 products that go to aten's F.linear (MKL's sgemm, on the exact
# rows) instead of oneDNN (rows padded to a bucket, `onednn_rows`), when no panel copy takes
# them; per CPU vendor, 0 = never. Intel Xeon (AVX-512 + AMX, KVM), 2 threads, every layer
# product of a model, paired medians of 5, MKL against the dispatcher's oneDNN: the 0.5B shape
# at 65-128 rows 0.81-0.96x, 129 1.12x, 160 0.98x and 256 0.92x (exact buckets), 200 1.13x,
# 300 1.07x, 512 1.02x, 600 1.15x, 1145 1.26-1.33x, 2048 1.12x; the 50M Llama's 1.06-1.34x from
# 65 rows; the 0.5B shape run as an AVX2-only CPU (oneDNN and MKL limited to AVX2) 128 and 256
# rows 0.98x, 129-2048 otherwise 1.11-1.19x. Not measured on AMD CPUs (oneDNN there, as before).
# The widened bfloat16 route's float32 blocks follow the same threshold (the 0.5B shape's
# products of 4 layers as AVX2, paired medians of 5, MKL against padded oneDNN: 129 rows
# 1.30x, 200 1.12x, 300 1.07x, 600 1.23x; exact buckets 1024 0.92x, 2048 0.95-0.98x).
ATEN_MIN_ROWS_BY_VENDOR = {"GenuineIntel": 129}
# bfloat16 products with a bfloat16 panel copy of the weight (-O2/-O3 prepack one where the
# build packs bfloat16: AVX2, `torch.ops.vllm_cpu_linear.bf16_panels()`): the panel kernel for
# these rows, per ISA level. Intel Xeon run as an AVX2-only CPU (VLLM_CPU_ISA=avx2, oneDNN
# and MKL limited to AVX2), the Qwen2.5-0.5B shape's 97 products, cold, 2 threads, paired
# medians of 5 against the plain weight's route (small-M to 48 rows, widened from 49): 1 row
# 0.66x, 2 0.77x, 3 0.90x, 4 1.10x, 6 1.33x, 8 1.14x, 12 1.26x, 16 1.29x, 24 1.32x, 32 1.42x,
# 48 1.47x, 64 1.59x, 96 1.35x, 128 1.18x, 256 1.02x, 512 1.03x.
BF16_PANEL_ROWS = {"avx2": (4, 128)}
# bfloat16 weights where oneDNN has bfloat16 kernels (AVX512-BF16, AMX) and the build packs no
# bfloat16 panels: -O2/-O3 keep oneDNN's reorder of each weight (`mkldnn._reorder_linear_weight`,
# its blocked layout) and products of these rows take it, rows padded as `onednn_rows`. AMD EPYC
# (Zen 4, AVX-512 + AVX512-BF16, KVM, 2 threads), cold weights, against the plain weight's route
# (small-M with AVX512-BF16 dot products to 16 rows, then torch's bfloat16 GEMM), [4864, 896] /
# [32000, 512]: 1 row 0.68x / 0.99x, 2 0.75x / 1.21x, 4 0.93x / 1.72x, 5 1.38x / 1.82x, 8
# 1.37x / 1.46x, 32 1.35x / 1.81x, 128 1.11x / 1.28x, 512 1.08x / 1.17x, 2048 1.05x / 1.07x (the
# 0.5B shape's [151936, 896] LM head at 16 rows 1.73x). Not measured on Intel's AMX.
ONEDNN_BF16_PACKED_ROWS = (5, 1 << 40)
# Fewest rows for the widened bfloat16 route: below it the small-M kernel is faster (AVX2 dev
# machine, 2 threads: small-M wins at 16-32 rows, the widened route at 64 and more, 1.1-2x
# at 256; both ~1.5-5x aten's bfloat16 GEMM from 8 rows on).
BF16_WIDENED_MIN_ROWS = 49

_onednn: bool | None = None


def onednn_linear_enabled() -> bool:
    global _onednn
    if _onednn is None:
        _onednn = (torch.backends.mkldnn.is_available()
                   and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                   and not switched_off("VLLM_CPU_ONEDNN_LINEAR"))
    return _onednn


def small_m_linear_available() -> bool:
    """Build (first call on this machine) and load the C++ linear kernels; True when usable.
    The first successful load also tells the C++ dispatcher the routing policy."""
    global _configured
    if _configured:  # (every eager linear asks: the answer costs nothing once it is yes)
        return True
    if not load_cpu_extension("small_m_linear", _SOURCE, "VLLM_CPU_SMALL_M_LINEAR",
                              source_text=_source_text()):
        return False
    # a bad VLLM_CPU_LINEAR_STREAMS, VLLM_CPU_LINEAR_PREFETCH_BYTES,
    # VLLM_CPU_PANEL_PREFETCH_LINES, VLLM_CPU_ATEN_LINEAR_MIN_ROWS,
    # VLLM_CPU_BF16_DOT_MIN_ROWS or VLLM_CPU_LINEAR_NT_LOADS stops here
    streams, distance, panel_lines = weight_streams(), prefetch_bytes(), panel_prefetch_lines()
    dot_rows, non_temporal = bf16_dot_min_rows(), nt_loads()
    torch.ops.vllm_cpu_linear.configure(_max_rows(torch.float32), _max_rows(torch.bfloat16),
                                        onednn_linear_enabled(), bf16_widened(),
                                        *panel_rows(), aten_min_rows(), *bf16_packed_rows())
    torch.ops.vllm_cpu_linear.prefetch_bytes(distance)
    torch.ops.vllm_cpu_linear.panel_prefetch_lines(panel_lines)
    torch.ops.vllm_cpu_linear.streams(streams)
    torch.ops.vllm_cpu_linear.bf16_dot_min_rows(dot_rows)
    torch.ops.vllm_cpu_linear.nt_loads(int(non_temporal))
    _configured = True
    return True


@functools.cache
def _source_text() -> str:
    """The kernel source with its headers pasted in (read once per process)."""
    return source_with_headers(_SOURCE, _PANEL_HEADER)


_configured = False
_max_rows_cache: dict[torch.dtype, int] = {}


# Weight streams per thread of the small-M kernel (csrc `streams`: each thread's rows cut into
# that many far-apart parts read side by side), per CPU vendor. On an Intel Xeon (AVX-512 +
# AMX, KVM, 2 threads) one stream per thread reads cold weights at 14-16 GB/s and eight at
# 19-20 (one-row products of all the Qwen2.5-0.5B shape's or the 50M Llama's linears, float32
# and bfloat16: 1.25-1.35x; two rows 1.3x, four 1.1x; the AVX2 build there, 4 streams:
# 1.25-1.5x): its L2 prefetchers keep more lines in flight for several streams than for one.
# On the Zen 4 dev machine (AMD EPYC, AVX-512 + AVX512-BF16, a 2-vCPU VM) two streams without
# software prefetch against one prefetching 8 KB ahead (the old default there), cold weights,
# 2 threads, paired in-process rounds (7-11 each, medians of the ratios): the 50M Llama's layer
# linears at one row float32 1.11x, bfloat16 1.38x; at two rows 1.20x / 1.28x; at four
# 1.17x / 1.00x; its LM head [32000, 512] 1.12x / 1.24x; the 0.5B shape's layer linears
# 1.14x / 1.17x, its LM head [151936, 896] 1.11x / 1.14x (four streams: 0.97-1.34x, below two
# on the LM heads; eight 1.04-1.29x): more lines in flight while each small product starts.
# Not measured on AVX2-only AMD CPUs (Zen 2/3), which take AMD's default.
STREAMS_BY_VENDOR = {"GenuineIntel": 8, "AuthenticAMD": 2}
# Software prefetch distance of one weight stream (bytes; 0 = none, the hardware prefetchers
# alone). With several streams per thread: on Intel (above) 1-4 KB measured the same, 8 KB a
# few % slower; on the Zen 4 machine none is best (2 KB with four streams 0.91-0.96x none, with
# eight 0.79-0.83x). With one stream, per ISA level the library was built for, measured on the
# two AMD dev machines: on the AVX-512 one (Zen 4) prefetching 4-16 KB ahead beat oneDNN's read
# rate and 1 KB was ~10% slower; on the AVX2-only one (Zen 2/3) any software prefetch lowered
# the read rate (one [4864, 896] float32 stream per thread: 19.5 GB/s without, 16.4 at 1 KB,
# 14.7 at 4 KB; the kernel on the 0.5B shape's weights ~10% faster without).
STREAMS_PREFETCH_BYTES = 2048
STREAMS_PREFETCH_BYTES_BY_VENDOR = {"AuthenticAMD": 0}
PREFETCH_BYTES = {"avx2": 0, "avx512": 8192, "avx512_bf16": 8192}
STREAM_COUNTS = (1, 2, 4, 8)


def weight_streams() -> int:
    """The small-M kernel's weight streams per thread: VLLM_CPU_LINEAR_STREAMS when set (1, 2, 4
    or 8; a ValueError names a bad value), else the measured default of this CPU's vendor."""
    raw = os.environ.get("VLLM_CPU_LINEAR_STREAMS")
    if raw is not None and raw.strip() != "":
        if raw.strip() not in {str(n) for n in STREAM_COUNTS}:
            raise ValueError(f"VLLM_CPU_LINEAR_STREAMS must be one of "
                             f"{', '.join(map(str, STREAM_COUNTS))} (weight streams per "
                             f"thread), got {raw!r}")
        return int(raw)
    return STREAMS_BY_VENDOR.get(cpu_vendor(), 1)


def prefetch_bytes() -> int:
    """The small-M kernel's prefetch distance: VLLM_CPU_LINEAR_PREFETCH_BYTES when set (a
    ValueError names a bad value), else the measured default: with several weight streams
    that of this CPU's vendor (STREAMS_PREFETCH_BYTES where not measured), with one that of
    the built ISA level."""
    if weight_streams() > 1:
        default = STREAMS_PREFETCH_BYTES_BY_VENDOR.get(cpu_vendor(), STREAMS_PREFETCH_BYTES)
    else:
        default = PREFETCH_BYTES.get(torch.ops.vllm_cpu_linear.isa(), 8192)
    return _non_negative_env("VLLM_CPU_LINEAR_PREFETCH_BYTES", "bytes",
                             "no software prefetch", default)


# Non-temporal weight loads (vmovntdqa, AVX-512 builds) in the small-M kernel's widening and
# bfloat16 dot-product loops for one-row products, per CPU vendor. On the Zen 4 dev machine the
# lines such a load brings in displace less of what L2 and L3 hold (a 2-8 MB working set read again
# after a 100 MB stream came back at ~40 GB/s instead of ~20, one thread). Measured there, 2
# threads, in-process paired rounds: one-row float32 products of the 50M Llama's layers 1.10x, its
# LM head 1.02x, the 0.5B shape's 1.02x; batch-1 decode end to end (the setting switched between
# requests of one engine) 50M float32 0.94-1.14x over seven runs, median 1.04x, the 0.5B shape
# 1.04x. Products of 2-3 rows read 0.85x with them and batch-3 decode 0.92x: one row only (csrc
# kNtMaxRows). The bfloat16 dot-product loop's one-row products (AVX512-BF16; the loop's own
# instantiation, as the widening loop's): batch-1 decode of the 50M Llama in bfloat16 0.98-1.11x
# over four paired runs (1.11, 0.98, 1.09, 1.02), the 0.5B shape 1.07x. The float32 panel kernel
# keeps plain loads (4-8 rows 0.99-1.10x; a run-time branch made its 16-row tile 1.7x slower). (A
# first version read every weight through a run-time branch, which made plain loads slower and
# showed non-temporal ones 1.1-1.5x ahead end to end: not their gain.) Software prefetches with the
# non-temporal hint instead (PREFETCHNTA, 2-8 KB ahead) measured 0.84-0.88x of none end to end.
# Others are not measured: plain loads.
NT_LOADS_BY_VENDOR = {"AuthenticAMD": True}


def nt_loads() -> bool:
    """Whether the linear kernels read weights with non-temporal loads: VLLM_CPU_LINEAR_NT_LOADS
    when set (1 or 0; a ValueError names a bad value), else the measured default of this CPU's
    vendor (NT_LOADS_BY_VENDOR; plain loads elsewhere)."""
    raw = os.environ.get("VLLM_CPU_LINEAR_NT_LOADS")
    if raw is not None and raw.strip() != "":
        if raw.strip() not in ("0", "1"):
            raise ValueError(f"VLLM_CPU_LINEAR_NT_LOADS must be 1 (non-temporal weight loads) or "
                             f"0 (plain loads), got {raw!r}")
        return raw.strip() == "1"
    return NT_LOADS_BY_VENDOR.get(cpu_vendor(), False)


# Fewest rows of x a bfloat16 product of the small-M kernel takes AVX512-BF16 dot products for
# (vdpbf16ps; fewer rows widen the weight to float32), per CPU vendor. On the Zen 4 dev
# machine (AVX-512 as two 256-bit halves) the widening loop's conversions bound a cached
# weight's read rate; the dot loop with independent sums reads [512-2048, 512] weights in
# cache 1.7-1.8x as fast at one row (2 threads 37-46 -> 62-81 GB/s; 1 thread 30-34 -> 53-56)
# and 1.3-1.4x at two. Cold weights (all the 50M Llama's linears) read at the memory's rate
# either way at ~30 GB/s (one row x0.99-1.03; two rows 1.14x for the dot loop), and the
# end-to-end batch-1 decode was within the run-to-run noise. Others keep 3, measured on an
# Intel Xeon (AVX-512 + AMX) before the one-row loop had independent sums.
BF16_DOT_MIN_ROWS_BY_VENDOR = {"AuthenticAMD": 1}
BF16_DOT_MIN_ROWS = 3


def bf16_dot_min_rows() -> int:
    """Fewest rows for the bfloat16 dot-product loop: VLLM_CPU_BF16_DOT_MIN_ROWS when set (a
    whole number >= 1; a ValueError names a bad value), else the measured default of this
    CPU's vendor. (Only builds for AVX512-BF16 CPUs have the loop.)"""
    raw = os.environ.get("VLLM_CPU_BF16_DOT_MIN_ROWS")
    if raw is None or raw.strip() == "":
        return BF16_DOT_MIN_ROWS_BY_VENDOR.get(cpu_vendor(), BF16_DOT_MIN_ROWS)
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError("VLLM_CPU_BF16_DOT_MIN_ROWS must be a whole number of rows >= 1 (the "
                         f"fewest rows of x for bfloat16 dot products), got {raw!r}")
    return rows


def panel_prefetch_lines() -> int:
    """The panel kernel's prefetch distance in cache lines: VLLM_CPU_PANEL_PREFETCH_LINES when
    set (a ValueError names a bad value), else PANEL_PREFETCH_LINES."""
    return _non_negative_env("VLLM_CPU_PANEL_PREFETCH_LINES", "cache lines of each panel ahead",
                             "no software prefetch", PANEL_PREFETCH_LINES)


def aten_min_rows() -> int:
    """Fewest rows of the float32 products that go to MKL's sgemm instead of oneDNN:
    VLLM_CPU_ATEN_LINEAR_MIN_ROWS when set (0: never; a ValueError names a bad value), else
    the measured default of this CPU's vendor (ATEN_MIN_ROWS_BY_VENDOR; 0 for others)."""
    return _non_negative_env("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", "rows", "never",
                             ATEN_MIN_ROWS_BY_VENDOR.get(cpu_vendor(), 0))


def _non_negative_env(name: str, unit: str, zero_means: str, default: int) -> int:
    """A whole number of `unit` >= 0 from environment variable `name` (0: `zero_means`), else
    `default`; a ValueError names the variable and the bad value."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of {unit} >= 0 (0: {zero_means}), "
                         f"got {raw!r}")
    return value


def bf16_widened() -> bool:
    """Whether bfloat16 products with more rows than the small-M kernel takes are widened to
    float32 block by block for oneDNN (csrc `widened_linear`): where oneDNN has no bfloat16
    kernels for this CPU (below AVX-512), torch's bfloat16 GEMM runs at a few GFLOP/s."""
    return onednn_linear_enabled() and not _onednn_has_bf16()


def _onednn_has_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _max_rows(dtype: torch.dtype) -> int:
    rows = _max_rows_cache.get(dtype)
    if rows is None:
        rows = SMALL_M_MAX_ROWS.get(dtype, 0)
        if dtype == torch.float32 and torch.ops.vllm_cpu_linear.isa() == "avx2":
            rows = AVX2_F32_MAX_ROWS
        elif dtype == torch.float32 and torch.ops.vllm_cpu_linear.isa().startswith("avx512"):
            rows = AVX512_F32_MAX_ROWS
        elif dtype == torch.bfloat16 and torch.ops.vllm_cpu_linear.has_bf16_dot():
            rows = BF16_DOT_MAX_ROWS
        elif dtype == torch.bfloat16 and bf16_widened():
            rows = BF16_WIDENED_MIN_ROWS - 1
        _max_rows_cache[dtype] = rows
    return rows


def panel_rows() -> tuple[int, int]:
    """(fewest, most) rows of the float32 products that take the panel kernel when the weight
    has a panel copy (prepacked, -O2/-O3): on AVX-512 from PANEL_MIN_ROWS (or the CPU vendor's
    PANEL_MIN_ROWS_BY_VENDOR), on AVX2 from AVX2_PANEL_MIN_ROWS (or the vendor's
    AVX2_PANEL_MIN_ROWS_BY_VENDOR), else from the first row count
    the small-M kernel does not take; up to PANEL_MAX_ROWS."""
    isa = torch.ops.vllm_cpu_linear.isa()
    if isa.startswith("avx512"):
        return PANEL_MIN_ROWS_BY_VENDOR.get(cpu_vendor(), PANEL_MIN_ROWS), PANEL_MAX_ROWS
    if isa == "avx2":
        return AVX2_PANEL_MIN_ROWS_BY_VENDOR.get(cpu_vendor(), AVX2_PANEL_MIN_ROWS), PANEL_MAX_ROWS
    return _max_rows(torch.float32) + 1, PANEL_MAX_ROWS


def bf16_packed_rows() -> tuple[int, int]:
    """(fewest, most) rows of the bfloat16 products that take the weight's packed copy when it
    has one (-O2/-O3): bfloat16 panels where the build packs them (BF16_PANEL_ROWS of its ISA
    level), else oneDNN's reorder where oneDNN has bfloat16 kernels (ONEDNN_BF16_PACKED_ROWS);
    (0, 0) elsewhere (the weights are then not prepacked)."""
    if torch.ops.vllm_cpu_linear.bf16_panels():
        return BF16_PANEL_ROWS.get(torch.ops.vllm_cpu_linear.isa(), (0, 0))
    if onednn_linear_enabled() and _onednn_has_bf16():
        return ONEDNN_BF16_PACKED_ROWS
    return 0, 0


def small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (last dim dense), weight [N, K] and bias [N] dense, all float32 or all bfloat16
    -> [M, N]. Needs `small_m_linear_available()`."""
    return torch.ops.vllm_cpu_linear.small_m_linear(x, weight, bias)


def linear_route(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> str:
    """Which kernel `dispatch_linear` picks: "small_m", "packed" (the panel copy of a
    prepacked weight), "onednn", "widened", "aten" (F.linear)."""
    if small_m_linear_available():
        return torch.ops.vllm_cpu_linear.linear_route(x, weight, bias)
    return "onednn" if x.device.type == "cpu" and _onednn_without_cpp(x, weight) else "aten"


def onednn_rows(rows: int) -> int:
    """The row count a product of `rows` rows is computed with in oneDNN: `rows` up to 8, then
    rounded up to a quarter of its octave (9..16 -> 10, 12, 14, 16; 17..32 -> 20 ... 32; ...),
    so at most 25% more rows and ~36 distinct counts up to 2048 (csrc/cpu_small_m_linear.cpp's
    `onednn_rows`, which the C++ dispatcher uses, is the same rule)."""
    if rows <= 8:
        return rows
    octave = 1 << ((rows - 1).bit_length() - 1)  # rows in (octave, 2 * octave]
    step = octave // 4
    return -(-rows // step) * step


def _onednn_padded(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with the rows padded to `onednn_rows` (zero rows, dropped after)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:
        xp = x2.new_zeros(padded, x2.shape[1])
        xp[:rows] = x2
        x2 = xp
    out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def _onednn_without_cpp(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Without the C++ build: float32 products go to oneDNN (the only fast route left for few
    rows), but not those of `aten_min_rows()` rows or more (F.linear's MKL sgemm there)."""
    if x.dtype != torch.float32 or weight.dtype != x.dtype or not onednn_linear_enabled():
        return False
    threshold = aten_min_rows()
    return threshold == 0 or x.numel() < threshold * x.shape[-1]


def dispatch_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (x [..., K], weight [N, K]), routed as the module docstring
    says. Inside traced code it stays `F.linear` (Inductor lowers it itself); compiled models
    that want the CPU kernels call `cpu_linear_op` instead."""
    if x.device.type != "cpu" or x.requires_grad or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if small_m_linear_available():
        return torch.ops.vllm_cpu_linear.linear(x, weight, bias)
    if _onednn_without_cpp(x, weight):
        return _onednn_padded(x, weight, bias)
    return F.linear(x, weight, bias)


def cpu_linear_op() -> Any:
    """The op compiled models call for CPU linears, opaque to Dynamo and Inductor: the C++
    dispatcher `vllm_cpu_linear::linear` (called straight from Inductor's code), or without
    the C++ build the Python custom op `vllm::cpu_prepacked_linear` around `dispatch_linear`."""
    if small_m_linear_available():
        return torch.ops.vllm_cpu_linear.linear
    from vllm.model_executor.layers.cpu_prepacked_linear import cpu_prepacked_linear

    return cpu_prepacked_linear
