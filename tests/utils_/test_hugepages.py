"""Large CPU tensors (weights, packed copies, KV cache) in mappings advised for transparent
huge pages: vllm/utils/hugepages.py and where the engine allocates them."""
from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.nn as nn

from vllm.utils import hugepages
from vllm.utils.hugepages import (
    ARENA_ALIGN,
    ARENA_MIN_MAPPING,
    HUGE_PAGE_BYTES,
    HugePageArena,
    cpu_zeros,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="transparent huge pages are a Linux feature")


@pytest.fixture
def thp_mode(monkeypatch):
    """Pretend the kernel's THP mode is the given one (the mapping is made either way; only
    whether the kernel then backs it by huge pages depends on the real machine)."""
    def set_mode(mode: str) -> None:
        monkeypatch.setattr(hugepages, "transparent_huge_pages", lambda: mode)
    monkeypatch.delenv("VLLM_CPU_HUGE_PAGES", raising=False)
    return set_mode


def in_own_mapping(t: torch.Tensor) -> bool:
    """The tensor starts on a huge page boundary of a storage a huge page larger than it."""
    storage = t.untyped_storage()
    return (t.data_ptr() % HUGE_PAGE_BYTES == 0
            and storage.nbytes() == t.numel() * t.element_size() + HUGE_PAGE_BYTES)


def vma_flags(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps entry of the mapping holding `address`."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and ":" in head:
                entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return entry


@linux_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_tensor_gets_its_own_aligned_mapping(thp_mode, dtype):
    thp_mode("madvise")
    shape = (3, HUGE_PAGE_BYTES // 2)
    t = cpu_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert in_own_mapping(t)
    assert not t.any()
    t.fill_(1)
    assert t.sum().item() == t.numel()


@linux_only
def test_mapping_is_advised_where_the_kernel_offers_huge_pages(thp_mode):
    if hugepages.transparent_huge_pages.__wrapped__() not in ("always", "madvise"):
        pytest.skip("this kernel's THP mode gives no huge pages")
    thp_mode("madvise")
    t = cpu_zeros((4 * HUGE_PAGE_BYTES // 4,), torch.float32)
    t.fill_(2.0)
    assert vma_flags(t.data_ptr()).get("THPeligible") == "1"


@linux_only
def test_only_whole_huge_pages_are_advised(thp_mode):
    """A tensor of 1.5 huge pages: its first 2 MiB advised, its tail left in small pages (a
    partial huge page would hold memory the tensor never uses)."""
    if hugepages.transparent_huge_pages.__wrapped__() != "madvise":
        pytest.skip("needs THP mode madvise to tell advised from not")
    thp_mode("madvise")
    t = cpu_zeros((3 * HUGE_PAGE_BYTES // 2,), torch.uint8)
    t.fill_(1)
    assert vma_flags(t.data_ptr()).get("THPeligible") == "1"
    assert vma_flags(t.data_ptr() + HUGE_PAGE_BYTES).get("THPeligible") == "0"


def test_small_tensor_and_switched_off_are_plain_zeros(thp_mode, monkeypatch):
    thp_mode("madvise")
    small = cpu_zeros((16, 16), torch.float32)
    assert small.untyped_storage().nbytes() == 16 * 16 * 4 and not small.any()
    monkeypatch.setenv("VLLM_CPU_HUGE_PAGES", "0")
    big = cpu_zeros((HUGE_PAGE_BYTES,), torch.uint8)
    assert big.untyped_storage().nbytes() == HUGE_PAGE_BYTES and not big.any()


@pytest.mark.parametrize("mode", ["never", ""])
def test_no_thp_means_plain_zeros(thp_mode, mode):
    thp_mode(mode)
    big = cpu_zeros((HUGE_PAGE_BYTES,), torch.uint8)
    assert big.untyped_storage().nbytes() == HUGE_PAGE_BYTES


def test_bad_switch_value_names_the_variable(thp_mode, monkeypatch):
    thp_mode("madvise")
    monkeypatch.setenv("VLLM_CPU_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="VLLM_CPU_HUGE_PAGES"):
        cpu_zeros((HUGE_PAGE_BYTES,), torch.uint8)


def test_thp_mode_is_read_from_the_bracketed_word(tmp_path, monkeypatch):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", str(path))
    read = hugepages.transparent_huge_pages.__wrapped__
    assert read() == "madvise"
    path.write_text("[always] madvise never\n")
    assert read() == "always"
    monkeypatch.setattr(hugepages, "THP_ENABLED", str(tmp_path / "missing"))
    assert read() == ""


def vma_rss_kb(address: int) -> int:
    """Resident KiB of the mapping holding `address`."""
    return int(vma_flags(address)["Rss"].split()[0])


def from_arena(t: torch.Tensor) -> bool:
    """Carved from a HugePageArena mapping (a buffer's memory: a storage that cannot grow)
    rather than torch's allocator."""
    return not t.untyped_storage().resizable()


@linux_only
def test_arena_carves_tensors_back_to_back_each_its_own(thp_mode):
    """Cache-line aligned, one after another, zero-filled, each with its own storage and
    version counter (the prepacked-copy registry keys on both)."""
    thp_mode("madvise")
    arena = HugePageArena(1 << 20)
    a = arena.zeros((3, 5), torch.float32)  # 60 bytes
    b = arena.zeros((7,), torch.bfloat16)
    c = arena.zeros((100, 3), torch.int8)
    assert all(from_arena(t) for t in (a, b, c))
    assert b.data_ptr() - a.data_ptr() == ARENA_ALIGN and c.data_ptr() - b.data_ptr() == 64
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0 and c.data_ptr() % ARENA_ALIGN == 0
    assert a.untyped_storage().nbytes() == 60 and c.untyped_storage().nbytes() == 300
    assert HugePageArena.room((3, 5), torch.float32) == ARENA_ALIGN
    assert not (a.any() or b.any() or c.any())
    a.fill_(3.0)
    assert a.sum().item() == 45.0 and not b.any()
    assert a._version > 0 and b._version == 0 and c._version == 0


@linux_only
def test_arena_maps_more_when_full(thp_mode):
    thp_mode("madvise")
    arena = HugePageArena(HUGE_PAGE_BYTES)
    first = arena.zeros((HUGE_PAGE_BYTES - 100,), torch.uint8)
    second = arena.zeros((1000,), torch.uint8)  # no room left in the first mapping
    third = arena.zeros((1000,), torch.uint8)
    assert second.data_ptr() % HUGE_PAGE_BYTES == 0
    assert second.data_ptr() != first.data_ptr()  # (both start a mapping)
    assert third.data_ptr() == second.data_ptr() + 1024
    huge = arena.zeros((ARENA_MIN_MAPPING + 1,), torch.uint8)  # larger than a new mapping
    huge[-1] = 1
    assert huge.sum().item() == 1


@linux_only
def test_arena_tails_and_small_tensors_are_advised(thp_mode):
    """What cpu_zeros leaves in small pages (a tensor under 2 MiB, a large one's tail) is
    advised in an arena: the whole mapping is."""
    if hugepages.transparent_huge_pages.__wrapped__() != "madvise":
        pytest.skip("needs THP mode madvise to tell advised from not")
    thp_mode("madvise")
    arena = HugePageArena(4 * HUGE_PAGE_BYTES)
    small = arena.zeros((HUGE_PAGE_BYTES // 2,), torch.uint8)
    large = arena.zeros((3 * HUGE_PAGE_BYTES // 2,), torch.uint8)
    small.fill_(1)
    large.fill_(1)
    assert vma_flags(small.data_ptr()).get("THPeligible") == "1"
    assert vma_flags(large.data_ptr() + large.numel() - 1).get("THPeligible") == "1"


@linux_only
def test_arena_gives_back_a_dead_tensors_pages_and_unmaps_when_all_are_gone(thp_mode):
    """A tensor dropped before its neighbours (a weight replaced after loading) leaves no
    resident memory behind; the mapping goes with its last tensor and the arena."""
    thp_mode("madvise")
    mib = 1 << 20
    arena = HugePageArena(32 * mib)
    first = arena.zeros((12 * mib,), torch.uint8)
    second = arena.zeros((12 * mib,), torch.uint8)
    first.fill_(1)
    second.fill_(2)
    view = second[5:]
    address = second.data_ptr()
    before = vma_rss_kb(address)
    assert before >= 24 * 1024
    del first
    gc.collect()
    assert vma_rss_kb(address) <= before - 10 * 1024
    del second
    gc.collect()
    assert view.sum().item() == 2 * (12 * mib - 5)  # a view keeps its memory
    del view, arena
    gc.collect()
    assert "Rss" not in vma_flags(address)


def test_arena_without_huge_pages_is_torch_zeros(thp_mode, monkeypatch):
    thp_mode("never")
    t = HugePageArena(1 << 20).zeros((4, 4), torch.float32)
    assert not from_arena(t) and not t.any()
    thp_mode("madvise")
    monkeypatch.setenv("VLLM_CPU_HUGE_PAGES", "0")
    assert not from_arena(HugePageArena().zeros((4, 4), torch.float32))


@linux_only
def test_materialized_cpu_parameters_share_one_huge_page_arena(thp_mode):
    """The model loader's parameters, large and small, carved from one arena in module order
    (ties kept, each parameter its own storage)."""
    from vllm.model_executor.model_loader import materialize

    thp_mode("madvise")
    with torch.device("meta"):
        model = nn.Module()
        model.big = nn.Linear(1024, 1024, bias=True)  # 4 MiB weight, 4 KiB bias
        model.tied = nn.Linear(1024, 1024, bias=False)
        model.small = nn.Linear(8, 8, bias=False)
    model.tied.weight = model.big.weight
    materialize(model, "cpu")
    weight, bias = model.big.weight, model.big.bias
    assert model.tied.weight is weight
    assert all(from_arena(p) for p in model.parameters())
    assert weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert bias.data_ptr() == weight.data_ptr() + 1024 * 1024 * 4
    assert model.small.weight.data_ptr() == bias.data_ptr() + 1024 * 4
    weight.data.copy_(torch.ones(1024, 1024))  # the loader's write
    assert weight.sum().item() == 1024 * 1024 and not bias.any()
    assert bias._version == 0
