"""Prepacked weights in the C++ linear dispatcher (`vllm_cpu_linear::linear`): the panel copy
(and the routes beside it) gives F.linear's result for every row count, a weight changed in
place (or never prepacked) falls back to the plain weight, the copy is dropped with its
parameter; the Python fallback op `vllm::cpu_prepacked_linear` matches too."""
from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_prepacked_linear as cpl
from vllm.model_executor.layers.cpu_linear import (
    _max_rows,
    bf16_packed_rows,
    linear_route,
    panel_rows,
    small_m_linear_available,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not small_m_linear_available(),
    reason="needs oneDNN and the C++ linear dispatcher")
linear = torch.ops.vllm_cpu_linear.linear if small_m_linear_available() else None
# Rows beyond the small-M kernel's (12 on AVX-512, 16 on AVX2): products that take the panel
# copy when there is one, else oneDNN.
ROWS = _max_rows(torch.float32) + 4 if small_m_linear_available() else 8


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 16, 17, 64, 65, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, bias):
    """Rows in the panel kernel's range take the panel copy, fewer the small-M kernel on the
    plain weight, more oneDNN on the plain weight; every route gives F.linear's result."""
    torch.manual_seed(rows)
    weight = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    b = torch.randn(48) if bias else None
    assert cpl.prepack(weight)
    x = torch.randn(rows, 32)
    lo, hi = panel_rows()
    expected = ("packed" if lo <= rows <= hi
                else "small_m" if rows <= _max_rows(torch.float32) else "onednn")
    assert linear_route(x, weight, b) == expected
    out = linear(x, weight, b)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.ops.vllm.cpu_prepacked_linear(x, weight, b),
                               F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_stale_or_missing_copy_falls_back_and_copies_die_with_the_weight():
    weight = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)
    x = torch.randn(ROWS, 8)
    gc.collect()  # other tests' models and their copies
    before = cpl.num_prepacked()
    assert cpl.prepack(weight) and cpl.num_prepacked() == before + 1
    assert linear_route(x, weight) == "packed"
    with torch.no_grad():
        weight.mul_(2)  # in place: the reordered copy is stale
    assert linear_route(x, weight) == "onednn"
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    other = torch.randn(16, 8)  # never prepacked
    torch.testing.assert_close(linear(x, other), F.linear(x, other))
    del weight
    gc.collect()
    assert cpl.num_prepacked() == before


def test_not_eligible():
    """bfloat16 weights only where they get a packed copy (bfloat16 panels on AVX2, oneDNN's
    reorder where it has bfloat16 kernels); never a non-contiguous weight or another dtype."""
    bf16 = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16), requires_grad=False)
    assert cpl.prepack(bf16) == (bf16_packed_rows() != (0, 0))
    assert cpl.can_prepack(bf16) == (bf16_packed_rows() != (0, 0))
    assert not cpl.prepack(torch.randn(4, 4).t())  # not contiguous
    assert not cpl.prepack(torch.randn(4, 4, dtype=torch.float16))
    assert not cpl.prepack(torch.randn(4, 4, dtype=torch.float64))


def test_traced_by_the_compiler():
    weight = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
    cpl.prepack(weight)

    def f(x):
        return linear(x.relu(), weight, None).sum(-1)

    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)
    for rows in (9, 2):  # symbolic token count: one compile serves both
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), F.linear(x.relu(), weight).sum(-1))


def test_background_prepacking_registers_every_queued_weight():
    """What the engine does while it loads: queue, go on; steady-state measurements wait."""
    gc.collect()
    weights = [torch.nn.Parameter(torch.randn(64, 32), requires_grad=False) for _ in range(5)]
    before = cpl.num_prepacked()
    assert all(cpl.prepack_in_background(w) for w in weights)
    assert not cpl.prepack_in_background(torch.randn(4, 4).t())  # not contiguous
    x = torch.randn(ROWS, 32)
    torch.testing.assert_close(linear(x, weights[-1]), F.linear(x, weights[-1]))  # any state
    assert cpl.wait_for_prepacking() >= 0.0
    assert cpl.num_prepacked() == before + len(weights)
    for w in weights:
        assert linear_route(x, w) == "packed"
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_background_prepacking_carves_the_panels_from_one_arena(monkeypatch):
    """The background thread's panel copies sit back to back in one huge-page arena
    (vllm/utils/hugepages.py), each the plain product's."""
    from vllm.utils import hugepages

    monkeypatch.setattr(hugepages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv("VLLM_CPU_HUGE_PAGES", raising=False)
    weights = [torch.randn(96, 40), torch.randn(33, 40), torch.randn(64, 24)]
    assert all(cpl.prepack_in_background(w) for w in weights)
    cpl.wait_for_prepacking()
    panels = [torch.ops.vllm_cpu_linear.packed_of(w) for w in weights]
    assert panels[0].data_ptr() % hugepages.HUGE_PAGE_BYTES == 0
    for w, prev, nxt in zip(weights, panels, panels[1:]):
        room = hugepages.HugePageArena.room(cpl.panel_shape(w), w.dtype)
        assert nxt.data_ptr() == prev.data_ptr() + room
    for w in weights:
        x = torch.randn(ROWS, w.shape[1])
        assert linear_route(x, w) == "packed"
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    del weights, panels
    gc.collect()


def test_no_reordering_while_the_engine_loads():
    """Reorders running while the engine still loads (weight copies, the KV cache's zero
    fill) oversubscribed the cores with two OpenMP teams: 4 s more to ready on the Qwen2.5-0.5B
    shape. Queued weights wait for `finish_prepacking_in_background()` (ready)."""
    import time

    gc.collect()
    before = cpl.num_prepacked()
    weights = [torch.nn.Parameter(torch.randn(64, 32), requires_grad=False) for _ in range(3)]
    assert all(cpl.prepack_in_background(w) for w in weights)
    time.sleep(0.2)  # a started thread would have reordered these by now
    assert not [t for t in threading.enumerate() if t.name == "vllm-prepack"]
    assert cpl.num_prepacked() == before
    assert cpl.finish_prepacking_in_background() == 3
    cpl.wait_for_prepacking()
    assert cpl.num_prepacked() == before + 3


def test_background_thread_ends_with_the_wait():
    """A live thread that ran OpenMP work slows the main thread's parallel regions: the
    prepacking thread must be gone once `wait_for_prepacking` returns."""
    weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    assert cpl.prepack_in_background(weight)
    cpl.wait_for_prepacking()
    assert not [t for t in threading.enumerate() if t.name == "vllm-prepack"]
    assert cpl.wait_for_prepacking() == 0.0  # nothing queued: no thread, no wait


def test_finishing_in_background_does_not_wait_and_the_thread_ends_by_itself(caplog):
    """The engine reports ready without waiting: the thread prepacks what is queued, logs,
    and ends on its own (no live thread left behind once the work is done)."""
    import logging
    import time

    gc.collect()
    before = cpl.num_prepacked()
    gate = threading.Event()
    weights = [torch.nn.Parameter(torch.randn(256, 128), requires_grad=False)
               for _ in range(3)]
    original = cpl.prepack

    def gated_prepack(weight, arena):  # hold the thread until the finish request was made
        gate.wait(timeout=30)
        return original(weight, arena)

    cpl.prepack = gated_prepack
    try:
        assert all(cpl.prepack_in_background(w) for w in weights)
        start = time.perf_counter()
        assert cpl.finish_prepacking_in_background() >= 2  # returns with work still queued
        assert time.perf_counter() - start < 1.0
        assert cpl.num_prepacked() == before  # nothing done yet: the plain routes serve
        x = torch.randn(8, 128)
        torch.testing.assert_close(linear(x, weights[0]), F.linear(x, weights[0]))
        with caplog.at_level(logging.INFO, logger="vllm"):
            gate.set()
            deadline = time.time() + 30
            while [t for t in threading.enumerate() if t.name == "vllm-prepack"]:
                assert time.time() < deadline, "the prepacking thread did not end"
                time.sleep(0.01)
    finally:
        cpl.prepack = original
    assert cpl.num_prepacked() == before + 3
    assert "3 weights prepacked" in caplog.text and "after the engine was ready" in caplog.text
    assert cpl.finish_prepacking_in_background() == 0  # nothing running any more
    assert cpl.wait_for_prepacking() == 0.0


EXIT_RIGHT_AFTER_READY = """
import torch
from vllm.model_executor.layers import cpu_prepacked_linear as cpl
weights = [torch.nn.Parameter(torch.randn(2048, 2048), requires_grad=False) for _ in range(30)]
assert all(cpl.prepack_in_background(w) for w in weights)
x = torch.randn(64, 2048)
for w in weights[:5]:
    torch.nn.functional.linear(x, w)  # the main thread's OpenMP work, as in a warm-up
cpl.finish_prepacking_in_background()  # "ready"; then the script ends at once
print("exiting", flush=True)
"""


def test_a_process_exiting_while_prepacking_exits_cleanly(tmp_path):
    """A process that ends right after ready, the thread still inside oneDNN, was aborted at
    exit ("terminate called without an active exception", rc 134): the queued weights are
    dropped and the reorder in progress is waited for at exit."""
    import subprocess
    import sys

    script = tmp_path / "exit_now.py"
    script.write_text(EXIT_RIGHT_AFTER_READY)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exiting" in result.stdout and "terminate called" not in result.stderr


# ---- the panel kernel (csrc/cpu_panel_linear.h) ----------------------------------------------

def test_pack_panels_layout():
    """Panel p holds weight rows 16p..16p+15 column by column ([p][k][c] = W[16p + c][k]), the
    last panel's missing rows zero."""
    w = torch.randn(37, 5)
    panels = torch.ops.vllm_cpu_linear.pack_panels(w)
    assert panels.shape == (3, 5, 16)
    padded = torch.cat([w, torch.zeros(11, 5)])
    torch.testing.assert_close(panels, padded.view(3, 16, 5).transpose(1, 2), rtol=0, atol=0)


def test_pack_panels_out_fills_a_given_tensor():
    """pack_panels_out writes pack_panels' layout into the tensor given (prepack's, mapped for
    huge pages) and refuses one of another shape or dtype."""
    op = torch.ops.vllm_cpu_linear
    w = torch.randn(37, 5)
    out = torch.full(cpl.panel_shape(w), 9.0)
    op.pack_panels_out(w, out)
    torch.testing.assert_close(out, op.pack_panels(w), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="pack_panels_out: out must be"):
        op.pack_panels_out(w, torch.empty(2, 5, 16))
    with pytest.raises(RuntimeError, match="pack_panels_out: out must be"):
        op.pack_panels_out(w, torch.empty(cpl.panel_shape(w), dtype=torch.float64))


def test_prepacked_panels_live_in_a_huge_page_mapping(monkeypatch):
    """prepack's float32 panel copy of a large weight is mapped for huge pages (where the
    kernel offers them: vllm/utils/hugepages.py) and gives the plain product."""
    from vllm.utils import hugepages

    monkeypatch.setattr(hugepages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv("VLLM_CPU_HUGE_PAGES", raising=False)
    op = torch.ops.vllm_cpu_linear
    w = torch.randn(1024, 768)  # 3 MiB of panels
    assert op.packed_of(w) is None
    assert cpl.prepack(w)
    packed = op.packed_of(w)
    assert packed.shape == cpl.panel_shape(w)
    assert packed.data_ptr() % hugepages.HUGE_PAGE_BYTES == 0
    assert packed.untyped_storage().nbytes() == packed.numel() * 4 + hugepages.HUGE_PAGE_BYTES
    x = torch.randn(16, 768)
    assert op.linear_route(x, w) == "packed"
    torch.testing.assert_close(op.linear(x, w), x @ w.t(), rtol=1e-4, atol=1e-4)
    del w, packed
    gc.collect()


def test_collapse_huge_pages_takes_any_cpu_tensor():
    """The collapse the oneDNN reorder gets: False for a tensor holding no whole huge page,
    a bool for a large one (whether the kernel collapsed it is the machine's), the values
    untouched."""
    op = torch.ops.vllm_cpu_linear
    assert op.collapse_huge_pages(torch.ones(16)) is False
    big = torch.arange(3 << 20, dtype=torch.float32)
    assert op.collapse_huge_pages(big) in (True, False)
    assert torch.equal(big, torch.arange(3 << 20, dtype=torch.float32))


def test_large_bfloat16_reorder_collapsed_keeps_its_product(monkeypatch):
    """A bfloat16 weight whose packed copy is oneDNN's reorder (where oneDNN has bfloat16
    kernels), large enough to hold whole huge pages: set_packed collapses them, and the product
    through the copy stays the plain one."""
    from vllm.utils import hugepages

    op = torch.ops.vllm_cpu_linear
    if op.bf16_panels() or not cpl.can_prepack(torch.ones(4, 4, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bfloat16 reorder copies in this build")
    monkeypatch.setattr(hugepages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv("VLLM_CPU_HUGE_PAGES", raising=False)
    w = torch.randn(2048, 1024).to(torch.bfloat16)  # 4 MiB
    assert cpl.prepack(w)
    assert op.packed_of(w).is_mkldnn
    x = torch.randn(16, 1024).to(torch.bfloat16)
    assert op.linear_route(x, w) == "packed"
    torch.testing.assert_close(op.linear(x, w).float(), (x.float() @ w.float().t()),
                               rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_panel_kernel_computes_the_product(n_threads):
    """Every row count through the tiles and their leftovers (1..30, chunks of 64 and more),
    output columns that end inside a panel or a group of panels, K tails around the K block,
    bias or not, a row-strided x: the product within float32 rounding (float64 reference)."""
    op = torch.ops.vllm_cpu_linear
    threads, prefetch = torch.get_num_threads(), op.panel_prefetch_lines()
    torch.set_num_threads(n_threads)
    op.panel_prefetch_lines(0 if n_threads == 1 else 16)  # with and without prefetching
    try:
        torch.manual_seed(n_threads)
        for n, k in ((1, 3), (16, 256), (33, 257), (50, 600), (96, 1)):
            w = torch.randn(n, k)
            b = torch.randn(n)
            panels = op.pack_panels(w)
            for rows in [*range(1, 31), 64, 65, 131]:
                x = torch.randn(rows, k + 3)[:, 2:k + 2]  # row stride k + 3
                for bias in (None, b):
                    ref = x.double() @ w.double().t()
                    if bias is not None:
                        ref = ref + bias.double()
                    got = op.panel_linear(x, panels, n, bias)
                    assert got.shape == (rows, n)
                    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4,
                                               msg=f"{rows} x [{n}, {k}], bias {bias is not None}")
    finally:
        torch.set_num_threads(threads)
        op.panel_prefetch_lines(prefetch)


def test_panel_kernel_rejects_what_does_not_fit():
    op = torch.ops.vllm_cpu_linear
    panels = op.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="panels"):
        op.panel_linear(torch.randn(2, 9), panels, 20, None)  # K 9 against 8
    with pytest.raises(RuntimeError, match="panels"):
        op.panel_linear(torch.randn(2, 8), panels, 40, None)  # N needs 3 panels
    with pytest.raises(RuntimeError, match="bias"):
        op.panel_linear(torch.randn(2, 8), panels, 20, torch.randn(19))
    if not op.bf16_panels():
        with pytest.raises(RuntimeError, match="float32.*this build packs no bfloat16"):
            op.pack_panels(torch.randn(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        op.pack_panels(torch.randn(20, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="dtype"):  # float32 panels, bfloat16 x
        op.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), panels, 20, None)
    with pytest.raises(RuntimeError, match="bias"):  # bias of another dtype
        op.panel_linear(torch.randn(2, 8), panels, 20, torch.randn(20, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="pack_panels"):  # not this weight's panels
        op.set_packed(torch.randn(40, 8), panels)
