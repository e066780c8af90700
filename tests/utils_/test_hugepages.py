"""Large CPU tensors (weights, packed copies, KV cache) in mappings advised for transparent
huge pages: vllm/utils/hugepages.py and where the engine allocates them."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from vllm.utils import hugepages
from vllm.utils.hugepages import HUGE_PAGE_BYTES, cpu_zeros

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


@linux_only
def test_materialized_cpu_parameters_are_in_huge_page_mappings(thp_mode):
    """The model loader's parameters: large ones mapped for huge pages (ties kept), small
    ones plain."""
    from vllm.model_executor.model_loader import materialize

    thp_mode("madvise")
    with torch.device("meta"):
        model = nn.Module()
        model.big = nn.Linear(1024, 1024, bias=True)  # 4 MiB weight, 4 KiB bias
        model.tied = nn.Linear(1024, 1024, bias=False)
    model.tied.weight = model.big.weight
    materialize(model, "cpu")
    assert in_own_mapping(model.big.weight)
    assert model.tied.weight is model.big.weight
    assert model.big.bias.untyped_storage().nbytes() == 1024 * 4
    model.big.weight.data.copy_(torch.ones(1024, 1024))  # the loader's write
    assert model.big.weight.sum().item() == 1024 * 1024
