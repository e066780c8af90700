"""dispatch_linear: the oneDNN route (float32) and the small-M C++ kernel (float32 and
bfloat16, a few rows) match F.linear; other dtypes, traced code and the environment switches
keep F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_linear


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (7, 64), (2, 3, 64), (0, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_float32(shape, with_bias):
    torch.manual_seed(0)
    w, b = torch.randn(48, 64), torch.randn(48) if with_bias else None
    x = torch.randn(*shape)
    torch.testing.assert_close(cpu_linear.dispatch_linear(x, w, b), F.linear(x, w, b),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the small-M linear kernel could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 12, 16, 18])
@pytest.mark.parametrize("n,k", [(37, 100), (130, 64), (1000, 33), (70, 1500), (5, 7)])
def test_small_m_kernel(dtype, rows, n, k):
    """Odd sizes: K not a multiple of the 16 lanes, an odd number of 16-lane steps (one row of
    x takes them two at a time), K over several blocks (1500), K shorter than one step (7),
    several passes of x rows over each weight row (more than one tile of x rows: 4 on
    AVX-512, 6 on AVX2, so 12 and 18 rows are whole tiles and 16 is not); strided rows of x.
    With K = 1500, 3+ rows of x are too large for one-row streaming: weight rows side by side
    (2 on AVX2, 4 on AVX-512), N not a multiple of them."""
    torch.manual_seed(rows)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    x = torch.randn(rows, k + 7).to(dtype)[:, 3:k + 3]
    got = cpu_linear.small_m_linear(x, w, b)
    want = (x.float() @ w.float().t() + b.float()).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums of up to 1500 products
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(cpu_linear.small_m_linear(x, w).float(),
                               (x.float() @ w.float().t()).to(dtype).float(), atol=tol, rtol=tol)


def test_bfloat16_dispatch_matches_f_linear():
    torch.manual_seed(0)
    w, b = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 80).bfloat16()
        torch.testing.assert_close(cpu_linear.dispatch_linear(x, w, b).float(),
                                   F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
def test_routes():
    """The C++ dispatcher's choice for each kind of product (the same choice `linear` makes)."""
    w = torch.randn(16, 8)
    f32, bf16 = cpu_linear._max_rows(torch.float32), cpu_linear._max_rows(torch.bfloat16)
    route = cpu_linear.linear_route
    assert route(torch.randn(f32, 8), w) == "small_m"
    assert route(torch.randn(1, 1, 8), w, torch.randn(16)) == "small_m"
    assert route(torch.randn(f32 + 1, 8), w) == "onednn"
    assert route(torch.randn(1, 8), w.t().contiguous().t()) == "onednn"  # weight not dense
    assert route(torch.randn(1, 8), w, torch.randn(32)[::2]) == "onednn"  # bias not dense
    assert route(torch.randn(bf16, 8).bfloat16(), w.bfloat16()) == "small_m"
    more_bf16 = "widened" if cpu_linear.bf16_widened() else "aten"
    assert route(torch.randn(bf16 + 1, 8).bfloat16(), w.bfloat16()) == more_bf16
    assert route(torch.randn(4, 8).double(), w.double()) == "aten"
    assert route(torch.randn(4, 8), w.double()) == "aten"  # mixed dtypes


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
def test_dispatcher_is_one_native_call():
    """Eager products go straight to the C++ op (no Python routing per call)."""
    w, x = torch.randn(16, 8), torch.randn(2, 8)
    with torch.profiler.profile() as prof:
        cpu_linear.dispatch_linear(x, w)
    names = [e.name for e in prof.events()]
    assert "vllm_cpu_linear::linear" in names and "vllm_cpu_linear::small_m_linear" not in names


# ---- bfloat16 where oneDNN has no bfloat16 kernels (AVX2): widened blocks ------------------

@pytest.fixture
def widened_policy():
    """The C++ dispatcher told to widen bfloat16 products of more than 4 rows (as on an AVX2
    CPU), whatever this machine is; the process's own policy is restored after."""
    _configure(bf16_small_rows=4, onednn=True, bf16_widened=True)
    yield
    _restore_policy()


def _configure(bf16_small_rows: int | None = None, onednn: bool | None = None,
               bf16_widened: bool | None = None, aten_min_rows: int | None = None) -> None:
    """The C++ dispatcher's policy as the process's first load set it, but for the fields
    given."""
    def given(value, default):
        return default if value is None else value

    torch.ops.vllm_cpu_linear.configure(
        cpu_linear._max_rows(torch.float32),
        given(bf16_small_rows, cpu_linear._max_rows(torch.bfloat16)),
        given(onednn, cpu_linear.onednn_linear_enabled()),
        given(bf16_widened, cpu_linear.bf16_widened()), *cpu_linear.panel_rows(),
        given(aten_min_rows, cpu_linear.aten_min_rows()), *cpu_linear.bf16_packed_rows())


def _restore_policy() -> None:
    """The C++ dispatcher's policy as the process's first load set it."""
    _configure()


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.parametrize("shape,n,k", [
    ((5, 64), 48, 64),          # one block, rows padded for oneDNN (5 -> 5, exact)
    ((2, 9, 80), 96, 80),       # 3-D input, 18 rows padded to 20
    ((70, 4096), 600, 4096),    # three blocks of 256 weight rows (1M floats / K): 256+256+88
    ((0, 32), 16, 32),          # no rows
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_bfloat16_matches_float32_product(widened_policy, shape, n, k, with_bias):
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if with_bias else None
    x = torch.randn(*shape).bfloat16()
    if shape[0]:
        assert cpu_linear.linear_route(x, w, b) == "widened"
    got = cpu_linear.dispatch_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # float32 sums, rounded to bfloat16 once: within a bfloat16 rounding of the exact product
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(),
                               atol=1e-2 * k ** 0.5, rtol=1e-2)


def test_bf16_policy_follows_onednn_bf16_support(monkeypatch):
    """No oneDNN bfloat16 kernels (AVX2): the small-M kernel up to 48 rows, widened beyond;
    with them (AVX-512) torch's own bfloat16 GEMM keeps the larger products."""
    if not cpu_linear.small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    monkeypatch.setattr(cpu_linear, "_max_rows_cache", {})
    monkeypatch.setattr(torch.ops.vllm_cpu_linear, "has_bf16_dot", lambda: False)
    monkeypatch.setattr(cpu_linear, "_onednn_has_bf16", lambda: False)
    assert cpu_linear.bf16_widened()
    assert cpu_linear._max_rows(torch.bfloat16) == cpu_linear.BF16_WIDENED_MIN_ROWS - 1 == 48
    monkeypatch.setattr(cpu_linear, "_max_rows_cache", {})
    monkeypatch.setattr(cpu_linear, "_onednn_has_bf16", lambda: True)
    assert not cpu_linear.bf16_widened()
    assert cpu_linear._max_rows(torch.bfloat16) == cpu_linear.SMALL_M_MAX_ROWS[torch.bfloat16]


def test_float32_rows_follow_the_isa(monkeypatch):
    """The small-M kernel takes float32 products up to the rows where it measured faster than
    oneDNN's prepacked ones: 16 on AVX2, 12 on AVX-512; other levels 4."""
    if not cpu_linear.small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    for isa, rows in (("avx2", cpu_linear.AVX2_F32_MAX_ROWS), ("avx512", 12),
                      ("avx512_bf16", 12), ("native", 4)):
        monkeypatch.setattr(cpu_linear, "_max_rows_cache", {})
        monkeypatch.setattr(torch.ops.vllm_cpu_linear, "isa", lambda isa=isa: isa)
        assert cpu_linear._max_rows(torch.float32) == rows, isa
    assert cpu_linear.AVX2_F32_MAX_ROWS == 16
    monkeypatch.setattr(cpu_linear, "_max_rows_cache", {})


def test_env_switch_off(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_onednn", None)
    monkeypatch.setenv("VLLM_CPU_ONEDNN_LINEAR", "0")
    assert not cpu_linear.onednn_linear_enabled()
    monkeypatch.setattr(cpu_linear, "_onednn", None)  # re-read after the test


# ---- oneDNN row buckets (issue 18: the server's memory grew with every new batch size) ------

def test_onednn_rows_buckets():
    """Exact up to 8 rows, then rounded up to a quarter octave: never fewer rows, at most 25%
    more, monotone, 36 distinct counts for 5..2048 rows; the C++ rule is the same."""
    buckets = [cpu_linear.onednn_rows(r) for r in range(0, 4097)]
    assert buckets[:9] == list(range(9))
    assert [cpu_linear.onednn_rows(r) for r in (9, 10, 11, 17, 33, 65, 129, 1025, 1100)] == \
        [10, 10, 12, 20, 40, 80, 160, 1280, 1280]
    assert all(r <= b <= r * 1.25 for r, b in enumerate(buckets))
    assert buckets == sorted(buckets)
    assert len(set(buckets[5:2049])) == 36
    if cpu_linear.small_m_linear_available():
        assert [torch.ops.vllm_cpu_linear.onednn_rows(r) for r in range(0, 4097)] == buckets


@pytest.mark.parametrize("shape", [(9, 72), (11, 72), (17, 72), (33, 72), (100, 72),
                                   (3, 7, 72), (8, 72), (1280, 72)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_onednn_matches_f_linear(shape, with_bias):
    """Padded products (and exact ones) keep their rows, shape and values; a row-strided x."""
    torch.manual_seed(0)
    w, b = torch.randn(40, 72), torch.randn(40) if with_bias else None
    x = torch.randn(*shape[:-1], 80)[..., 3:75]
    got = cpu_linear.dispatch_linear(x, w, b)
    assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    # The Python route (no C++ build) pads the same way.
    torch.testing.assert_close(cpu_linear._onednn_padded(x, w, b), F.linear(x, w, b),
                               atol=1e-4, rtol=1e-4)


def _onednn_row_counts(fn) -> set[int]:
    """Row counts of the products that reached oneDNN while `fn` ran."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return {e.input_shapes[0][0] for e in prof.events()
            if e.name == "mkldnn::_linear_pointwise" and e.input_shapes and e.input_shapes[0]}


@pytest.mark.skipif(not cpu_linear.onednn_linear_enabled(), reason="no oneDNN")
def test_onednn_sees_few_row_counts():
    """Products of 5..300 rows (those beyond the small-M kernel's: 4 rows, 16 on AVX2) reach
    oneDNN with at most 25 row counts, not one per row count: oneDNN builds and caches a
    primitive per count (what made the server's memory grow)."""
    w = torch.randn(24, 16)
    first = max(5, cpu_linear._max_rows(torch.float32) + 1)

    def run():
        for rows in range(first, 301):
            cpu_linear.dispatch_linear(torch.randn(rows, 16), w)

    seen = _onednn_row_counts(run)
    # from aten_min_rows() rows on (Intel CPUs) products go to MKL's sgemm instead
    last = min(300, (cpu_linear.aten_min_rows() or 301) - 1)
    assert seen == {cpu_linear.onednn_rows(r) for r in range(first, last + 1)}
    assert len(seen) <= 25 < 301 - first


def _malloc_in_use() -> int | None:
    """glibc's bytes in use in malloc (all arenas); None without glibc's mallinfo2."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.skipif(not cpu_linear.onednn_linear_enabled(), reason="no oneDNN")
@pytest.mark.skipif(_malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_onednn_memory_stops_growing_with_new_row_counts():
    """Once the row buckets were seen, 200 new row counts add (almost) no native memory.
    Without the buckets each new count cached ~0.3-0.6 MB in oneDNN (here >= 40 MB); the bound
    is generous (other threads of the test process may allocate meanwhile)."""
    w = torch.randn(48, 40)  # a weight shape no other test uses: its cache entries are ours
    for rows in sorted({cpu_linear.onednn_rows(r) for r in range(101, 301)}):
        cpu_linear.dispatch_linear(torch.randn(rows, 40), w)  # the buckets, cached
    x = torch.randn(300, 40)
    before = _malloc_in_use()
    for rows in range(101, 301):
        cpu_linear.dispatch_linear(x[:rows], w)
    grown = _malloc_in_use() - before
    assert grown < 8 * 2**20, f"malloc in use grew {grown / 2**20:.1f} MB"


# ---- software prefetch distance per ISA level (measured per machine) -----------------------

@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
def test_prefetch_distance_default_env_and_results(monkeypatch):
    op = torch.ops.vllm_cpu_linear
    level = op.isa()
    monkeypatch.delenv("VLLM_CPU_LINEAR_PREFETCH_BYTES", raising=False)
    monkeypatch.setenv("VLLM_CPU_LINEAR_STREAMS", "1")
    assert cpu_linear.prefetch_bytes() == cpu_linear.PREFETCH_BYTES.get(level, 8192)
    monkeypatch.setenv("VLLM_CPU_LINEAR_STREAMS", "4")  # several streams: their vendor's
    real_vendor = cpu_linear.cpu_vendor
    for vendor, expected in (("GenuineIntel", cpu_linear.STREAMS_PREFETCH_BYTES),
                             ("AuthenticAMD", 0), ("", cpu_linear.STREAMS_PREFETCH_BYTES)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        assert cpu_linear.prefetch_bytes() == expected
    monkeypatch.setattr(cpu_linear, "cpu_vendor", real_vendor)
    monkeypatch.delenv("VLLM_CPU_LINEAR_STREAMS")
    assert cpu_linear.PREFETCH_BYTES["avx2"] == 0  # any software prefetch measured slower
    assert op.prefetch_bytes() == cpu_linear.prefetch_bytes()  # what the first load set
    monkeypatch.setenv("VLLM_CPU_LINEAR_PREFETCH_BYTES", "4096")
    assert cpu_linear.prefetch_bytes() == 4096
    for bad in ("-1", "4k", "1.5"):
        monkeypatch.setenv("VLLM_CPU_LINEAR_PREFETCH_BYTES", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_LINEAR_PREFETCH_BYTES.*{bad!r}"):
            cpu_linear.prefetch_bytes()
    # Every distance computes the same product (prefetching changes timing only).
    torch.manual_seed(0)
    before = op.prefetch_bytes()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            w, x = torch.randn(300, 1100).to(dtype), torch.randn(3, 1100).to(dtype)
            results = []
            for distance in (0, 1024, 8192):
                assert op.prefetch_bytes(distance) == distance
                results.append(op.linear(x, w))
            assert all(torch.equal(results[0], r) for r in results[1:])
    finally:
        op.prefetch_bytes(before)


# ---- bfloat16 dot products from how many rows (per CPU vendor) ----------------------------

def test_bf16_dot_min_rows_default_per_vendor_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_BF16_DOT_MIN_ROWS", raising=False)
    for vendor, rows in (("AuthenticAMD", 1), ("GenuineIntel", 3), ("", 3)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda vendor=vendor: vendor)
        assert cpu_linear.bf16_dot_min_rows() == rows, vendor
    for good, rows in (("1", 1), (" 4 ", 4), ("17", 17)):
        monkeypatch.setenv("VLLM_CPU_BF16_DOT_MIN_ROWS", good)
        assert cpu_linear.bf16_dot_min_rows() == rows
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("VLLM_CPU_BF16_DOT_MIN_ROWS", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_BF16_DOT_MIN_ROWS.*>= 1.*{bad!r}"):
            cpu_linear.bf16_dot_min_rows()


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.parametrize("n, k", [(300, 1100), (64, 512), (97, 96), (33, 40)])
def test_bf16_rows_match_the_reference_through_either_loop(n, k):
    """1-4 rows of bfloat16 products through the dot-product loop (min rows 1: the one- and
    two-row paths with independent sums, K tails included) and through the widening loop
    (min rows 5) match the float64 product within a bfloat16 rounding; on a build without
    AVX512-BF16 the setting is kept but both are the widening loop."""
    op = torch.ops.vllm_cpu_linear
    before = op.bf16_dot_min_rows()
    assert before == cpu_linear.bf16_dot_min_rows()  # what the first load set (-1: only ask)
    torch.manual_seed(0)
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    try:
        for min_rows in (1, 5):
            assert op.bf16_dot_min_rows(min_rows) == min_rows
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, k).bfloat16()
                got = op.small_m_linear(x, w, b)
                want = F.linear(x.double(), w.double(), b.double())
                torch.testing.assert_close(got.double(), want, atol=2e-2 * k ** 0.5, rtol=1e-2)
        assert op.bf16_dot_min_rows(0) == 5  # below 1 only asks
    finally:
        op.bf16_dot_min_rows(before)


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
def test_panel_prefetch_distance_default_and_env(monkeypatch):
    op = torch.ops.vllm_cpu_linear
    monkeypatch.delenv("VLLM_CPU_PANEL_PREFETCH_LINES", raising=False)
    assert cpu_linear.panel_prefetch_lines() == cpu_linear.PANEL_PREFETCH_LINES == 32
    assert op.panel_prefetch_lines(-1) == 32  # what the first load set (-1: only ask)
    for good, lines in (("0", 0), ("64", 64), (" 16 ", 16), ("", 32)):
        monkeypatch.setenv("VLLM_CPU_PANEL_PREFETCH_LINES", good)
        assert cpu_linear.panel_prefetch_lines() == lines
    for bad in ("-1", "2KB", "1.5"):
        monkeypatch.setenv("VLLM_CPU_PANEL_PREFETCH_LINES", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_PANEL_PREFETCH_LINES.*lines.*{bad!r}"):
            cpu_linear.panel_prefetch_lines()


# ---- weight streams per thread (per CPU vendor) ---------------------------------------------

def test_weight_streams_default_per_vendor_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_LINEAR_STREAMS", raising=False)
    for vendor, expected in (("GenuineIntel", 8), ("AuthenticAMD", 2), ("", 1)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        assert cpu_linear.weight_streams() == expected
    for good in ("1", "2", "4", "8"):
        monkeypatch.setenv("VLLM_CPU_LINEAR_STREAMS", good)
        assert cpu_linear.weight_streams() == int(good)
    for bad in ("0", "3", "16", "-1", "many"):
        monkeypatch.setenv("VLLM_CPU_LINEAR_STREAMS", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_LINEAR_STREAMS.*1, 2, 4, 8.*{bad!r}"):
            cpu_linear.weight_streams()


def test_aten_min_rows_default_per_vendor_and_env(monkeypatch):
    """Prefill-sized float32 products go to MKL's sgemm from 129 rows on Intel CPUs (measured
    faster there), never elsewhere; VLLM_CPU_ATEN_LINEAR_MIN_ROWS overrides (0: never) and a
    bad value is named."""
    monkeypatch.delenv("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", raising=False)
    for vendor, expected in (("GenuineIntel", 129), ("AuthenticAMD", 0), ("", 0)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        assert cpu_linear.aten_min_rows() == expected
    for good, expected in (("0", 0), ("65", 65), (" 300 ", 300), ("", 0)):
        monkeypatch.setenv("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", good)
        assert cpu_linear.aten_min_rows() == expected
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", bad)
        with pytest.raises(ValueError,
                           match=f"VLLM_CPU_ATEN_LINEAR_MIN_ROWS.*>= 0 \\(0: never\\).*{bad!r}"):
            cpu_linear.aten_min_rows()


@pytest.fixture
def aten_from_20_rows():
    """The C++ dispatcher told to send float32 products of 20+ rows to aten (MKL); the
    process's own policy is restored after."""
    _configure(onednn=True, aten_min_rows=20)
    yield
    _restore_policy()


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.skipif(not cpu_linear.onednn_linear_enabled(), reason="no oneDNN")
def test_products_from_aten_min_rows_go_to_aten_unpadded(aten_from_20_rows):
    """From the policy's row count on, float32 products skip oneDNN (and its padding to a
    bucket) for aten's F.linear on the exact rows; fewer rows keep oneDNN; bfloat16 and the
    small-M kernel's products are not affected; every route gives F.linear's result."""
    torch.manual_seed(0)
    w, b = torch.randn(40, 72), torch.randn(40)
    small = cpu_linear._max_rows(torch.float32)
    for rows, route in ((small, "small_m"), (19, "onednn"), (20, "aten"), (21, "aten"),
                        (300, "aten")):
        x = torch.randn(rows, 72)
        assert cpu_linear.linear_route(x, w, b) == route, rows
        torch.testing.assert_close(cpu_linear.dispatch_linear(x, w, b), F.linear(x, w, b),
                                   atol=1e-4, rtol=1e-4)
    assert _onednn_row_counts(lambda: cpu_linear.dispatch_linear(torch.randn(21, 72), w)) == set()
    assert _onednn_row_counts(lambda: cpu_linear.dispatch_linear(torch.randn(19, 72), w)) == {20}
    x3 = torch.randn(3, 9, 72)  # 27 rows over two leading dims
    assert cpu_linear.linear_route(x3, w) == "aten"
    torch.testing.assert_close(cpu_linear.dispatch_linear(x3, w), F.linear(x3, w))


@pytest.fixture
def widened_with_aten_from_20_rows():
    """The C++ dispatcher told to widen bfloat16 products of more than 4 rows (as on an AVX2
    CPU) and to send products of 20+ rows to aten; the process's own policy restored after."""
    _configure(bf16_small_rows=4, onednn=True, bf16_widened=True, aten_min_rows=20)
    yield
    _restore_policy()


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.skipif(not cpu_linear.onednn_linear_enabled(), reason="no oneDNN")
def test_widened_blocks_from_aten_min_rows_go_to_aten_unpadded(widened_with_aten_from_20_rows):
    """Widened bfloat16 products of aten_min_rows rows or more compute their float32 blocks in
    aten (MKL) on the exact rows, fewer rows in oneDNN padded to a bucket: oneDNN sees no row
    count from the threshold on, and both give the float32 product rounded to bfloat16."""
    torch.manual_seed(0)
    k = 4096  # blocks of 256 weight rows: 600 rows are three blocks (256 + 256 + 88)
    w, b = torch.randn(600, k).bfloat16(), torch.randn(600).bfloat16()
    for rows in (19, 20, 37):
        x = torch.randn(rows, k).bfloat16()
        assert cpu_linear.linear_route(x, w, b) == "widened"
        seen = _onednn_row_counts(lambda x=x: cpu_linear.dispatch_linear(x, w, b))
        assert seen == (set() if rows >= 20 else {20}), rows
        got = cpu_linear.dispatch_linear(x, w, b)
        want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * k ** 0.5, rtol=1e-2)


def test_python_route_without_cpp_keeps_aten_from_aten_min_rows(monkeypatch):
    """Without the C++ build the Python route makes the same choice: oneDNN below
    aten_min_rows() rows, F.linear from there (and always with 0)."""
    if not cpu_linear.onednn_linear_enabled():
        pytest.skip("no oneDNN")
    w = torch.randn(24, 16)
    monkeypatch.setenv("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", "40")
    assert cpu_linear._onednn_without_cpp(torch.randn(39, 16), w)
    assert cpu_linear._onednn_without_cpp(torch.randn(3, 13, 16), w)  # 39 rows
    assert not cpu_linear._onednn_without_cpp(torch.randn(40, 16), w)
    assert not cpu_linear._onednn_without_cpp(torch.randn(2, 20, 16), w)
    monkeypatch.setenv("VLLM_CPU_ATEN_LINEAR_MIN_ROWS", "0")
    assert cpu_linear._onednn_without_cpp(torch.randn(4096, 16), w)


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_stream_count_computes_the_product(dtype):
    """Streams cut each thread's rows into far-apart parts read side by side, with the rows
    left over read as one stream: every count, row count of x (one-stream and tiled paths),
    thread count and odd sizes give the product (float64 reference)."""
    op = torch.ops.vllm_cpu_linear
    assert op.streams() == cpu_linear.weight_streams()  # what the first load set
    torch.manual_seed(0)
    # 2 threads x 8 streams x 16 rows = 256 rows take the stream path; 37 are left over
    w = torch.randn(293, 1100).to(dtype)
    b = torch.randn(293).to(dtype)
    before, threads = op.streams(), torch.get_num_threads()
    tol = ({"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16
           else {"rtol": 1e-4, "atol": 1e-3})
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 2, 3, 4, 5, 8, 16):
                x = torch.randn(rows, 1100).to(dtype)
                ref = (x.double() @ w.double().t() + b.double()).to(dtype).float()
                for streams in (1, 2, 4, 8):
                    assert op.streams(streams) == streams
                    y = op.small_m_linear(x, w, b)
                    torch.testing.assert_close(y.float(), ref, **tol,
                                               msg=f"{rows} rows, {streams} streams")
        assert op.streams(3) == 8  # not a stream count: only reads it
    finally:
        op.streams(before)
        torch.set_num_threads(threads)


def test_nt_loads_default_per_vendor_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_LINEAR_NT_LOADS", raising=False)
    for vendor, expected in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        assert cpu_linear.nt_loads() is expected
    for raw, expected in (("1", True), ("0", False), (" 1 ", True)):
        monkeypatch.setenv("VLLM_CPU_LINEAR_NT_LOADS", raw)
        assert cpu_linear.nt_loads() is expected
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv("VLLM_CPU_LINEAR_NT_LOADS", "")  # empty: the vendor's default
    assert cpu_linear.nt_loads() is True
    for bad in ("2", "yes", "-1", "true"):
        monkeypatch.setenv("VLLM_CPU_LINEAR_NT_LOADS", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_LINEAR_NT_LOADS.*1.*0.*{bad!r}"):
            cpu_linear.nt_loads()


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the C++ linear dispatcher could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_temporal_weight_loads_give_the_same_products(dtype):
    """Non-temporal weight loads (AVX-512 builds, one-row products, aligned weights only: the
    inner loop `small_m_loop` names; the widening loop's, and the bfloat16 dot products' where
    the CPU has them) read the same values: the small-M kernel (stream counts
    1, 2 and 8) gives bit-identical results either way at one row, and at 2-4 rows (plain
    loads both ways), on an aligned weight and on one that starts 4 bytes off a vector
    boundary (plain loads there), which must not fault."""
    op = torch.ops.vllm_cpu_linear
    assert op.nt_loads() == int(cpu_linear.nt_loads())  # what the first load set
    torch.manual_seed(0)
    storage = torch.randn(300 * 544 + 16).to(dtype)
    aligned = storage[:300 * 544].view(300, 544)
    off = 4 // storage.element_size()
    shifted = storage[off:off + 300 * 544].view(300, 544)
    assert aligned.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 == 4

    def expected_loop(rows, is_aligned, nt):  # the kernel's inner loop (`small_m_loop`)
        nt_ok = op.isa().startswith("avx512") and nt and rows == 1 and is_aligned
        if dtype == torch.bfloat16:
            if op.has_bf16_dot() and rows >= op.bf16_dot_min_rows():
                return "bf16_dot_nt" if nt_ok else "bf16_dot"
            if op.isa() == "avx2" and rows <= 2:
                return "split_bf16"
        return "widen_nt" if nt_ok else "widen"

    before, streams = op.nt_loads(), op.streams()
    try:
        for w in (aligned, shifted):
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, 544).to(dtype)
                for n_streams in (1, 2, 8):
                    op.streams(n_streams)
                    results = []
                    for nt in (0, 1):
                        assert op.nt_loads(nt) == nt
                        results.append(op.small_m_linear(x, w, None))
                        assert op.small_m_loop(x, w) == expected_loop(rows, w is aligned, nt)
                    assert torch.equal(results[0], results[1]), (rows, n_streams)
                    ref = (x.double() @ w.double().t()).to(dtype).float()
                    tol = ({"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16
                           else {"rtol": 1e-4, "atol": 1e-3})
                    torch.testing.assert_close(results[1].float(), ref, **tol)
    finally:
        op.nt_loads(before)
        op.streams(streams)


def test_panel_rows_follow_the_isa(monkeypatch):
    """Products with a panel copy take the panel kernel from 5 rows on AVX-512 (4 on AMD) and
    10 on AVX2 (7 on AMD; where it measured faster than the small-M kernel, which AVX2 otherwise
    runs up to 16 rows), elsewhere from the first row count the small-M kernel does not take; up to
    PANEL_MAX_ROWS, beyond which oneDNN on the plain weight is faster. The dispatcher is
    configured with the same range."""
    if not cpu_linear.small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    assert (cpu_linear.PANEL_MIN_ROWS, cpu_linear.PANEL_MAX_ROWS) == (5, 64)
    for vendor, avx512_min, avx2_min in (("GenuineIntel", 5, 10), ("AuthenticAMD", 4, 7),
                                         ("", 5, 10)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        for isa, rows in (("avx2", (avx2_min, 64)), ("avx512", (avx512_min, 64)),
                          ("avx512_bf16", (avx512_min, 64)), ("native", (5, 64))):
            monkeypatch.setattr(cpu_linear, "_max_rows_cache", {})
            monkeypatch.setattr(torch.ops.vllm_cpu_linear, "isa", lambda isa=isa: isa)
            assert cpu_linear.panel_rows() == rows, (vendor, isa)
    monkeypatch.undo()
    cpu_linear._max_rows_cache.clear()
    lo, hi = cpu_linear.panel_rows()
    w = torch.nn.Parameter(torch.randn(24, 8), requires_grad=False)
    from vllm.model_executor.layers.cpu_prepacked_linear import prepack

    assert prepack(w)
    routes = {rows: cpu_linear.linear_route(torch.randn(rows, 8), w) for rows in range(1, 80)}
    assert {r for r, route in routes.items() if route == "packed"} == set(range(lo, hi + 1))


def test_bf16_packed_rows_follow_the_build(monkeypatch):
    """bfloat16 products take a packed copy where the build packs bfloat16 panels (AVX2:
    BF16_PANEL_ROWS names the level, 4..128 rows, measured faster than the small-M kernel and
    the widened route), else where oneDNN has bfloat16 kernels (its reorder, from 5 rows on),
    none elsewhere; the dispatcher is configured with the same, and the products match
    F.linear on every route."""
    if not cpu_linear.small_m_linear_available():
        pytest.skip("the C++ linear dispatcher could not be built")
    op = torch.ops.vllm_cpu_linear
    assert cpu_linear.BF16_PANEL_ROWS == {"avx2": (4, 128)}
    assert op.bf16_panels() == (op.isa() == "avx2")
    onednn = cpu_linear.ONEDNN_BF16_PACKED_ROWS
    for builds, isa, has_bf16, rows in ((True, "avx2", False, (4, 128)),
                                        (False, "avx2", False, (0, 0)),
                                        (True, "avx512", True, (0, 0)),
                                        (False, "avx512", False, (0, 0)),
                                        (False, "avx512_bf16", True, onednn)):
        monkeypatch.setattr(op, "bf16_panels", lambda builds=builds: builds)
        monkeypatch.setattr(op, "isa", lambda isa=isa: isa)
        monkeypatch.setattr(cpu_linear, "_onednn_has_bf16", lambda has=has_bf16: has)
        assert cpu_linear.bf16_packed_rows() == rows, (builds, isa, has_bf16)
    monkeypatch.undo()
    lo, hi = cpu_linear.bf16_packed_rows()
    w = torch.nn.Parameter(torch.randn(24, 8, dtype=torch.bfloat16), requires_grad=False)
    b = torch.randn(24, dtype=torch.bfloat16)
    from vllm.model_executor.layers.cpu_prepacked_linear import prepack

    assert prepack(w) == (lo > 0)
    routes = {}
    for rows in range(1, 140):
        x = torch.randn(rows, 8, dtype=torch.bfloat16)
        routes[rows] = cpu_linear.linear_route(x, w, b)
        torch.testing.assert_close(op.linear(x, w, b).float(), F.linear(x, w, b).float(),
                                   atol=3e-2, rtol=2e-2)
    assert {r for r, route in routes.items() if route == "packed"} == (
        set(range(lo, min(hi, 139) + 1)) if lo else set())


@pytest.mark.skipif(not cpu_linear.small_m_linear_available(),
                    reason="the small-M linear kernel could not be built")
def test_a_loaded_kernel_costs_each_call_no_source_reading(monkeypatch):
    """Every eager linear asks whether the kernels are there: once they are, the answer reads
    no kernel source (it pasted the headers into the source on every call, ~1.5% of a batch-1
    decode step of the 50M Llama)."""
    reads = []
    monkeypatch.setattr(cpu_linear, "source_with_headers", lambda *a: reads.append(a) or "")
    x, w = torch.randn(1, 64), torch.randn(48, 64)
    for _ in range(3):
        torch.testing.assert_close(cpu_linear.dispatch_linear(x, w), F.linear(x, w))
    assert reads == []
