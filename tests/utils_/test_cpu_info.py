"""/proc/cpuinfo is read once per process, by vllm/utils/cpu_info.py alone."""
from __future__ import annotations

import builtins
import re
from pathlib import Path

import pytest

from vllm.utils import cpu_info

PACKAGE = Path(__file__).resolve().parents[2] / "vllm"
# (The compile cache's machine fingerprint moved here with issue 20's fold.)
NOT_YET_MOVED: set[str] = set()

FAKE = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
        "flags\t\t: fpu sse2 avx2 amx_bf16 avx512f\n\nprocessor\t: 1\n"
        "flags\t\t: fpu sse2 avx2 amx_bf16 avx512f\n")


@pytest.fixture
def fake_cpuinfo(tmp_path, monkeypatch):
    """A fake /proc/cpuinfo and a count of how often it is opened."""
    path = tmp_path / "cpuinfo"
    path.write_text(FAKE)
    monkeypatch.setattr(cpu_info, "CPUINFO", str(path))
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file) == str(path):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    cpu_info.cpuinfo_lines.cache_clear()
    yield opened
    cpu_info.cpuinfo_lines.cache_clear()


def test_flags_parsed(fake_cpuinfo):
    assert cpu_info.cpu_flags() == {"fpu", "sse2", "avx2", "amx_bf16", "avx512f"}
    assert cpu_info.cpu_flags_text() == "fpu sse2 avx2 amx_bf16 avx512f"
    assert cpu_info.cpu_flags_line() == "flags\t\t: fpu sse2 avx2 amx_bf16 avx512f\n"
    assert cpu_info.cpu_has_native_bf16()


def test_every_user_shares_one_read(fake_cpuinfo):
    from vllm.platforms import cpu as cpu_platform
    from vllm.utils import cpu_kernels

    assert cpu_platform.cpu_has_native_bf16()
    cpu_info.cpu_flags()
    cpu_info.cpu_flags_text()
    assert cpu_kernels.cpu_flags_text() == "fpu sse2 avx2 amx_bf16 avx512f"
    assert cpu_info.cpu_vendor() == "GenuineIntel"  # the linear kernels' stream default
    assert len(fake_cpuinfo) == 1


def test_vendor_missing_is_empty(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    monkeypatch.setattr(cpu_info, "CPUINFO", str(path))
    cpu_info.cpuinfo_lines.cache_clear()
    try:
        assert cpu_info.cpu_vendor() == ""
        assert cpu_info.cpu_flags() == {"fpu", "avx2"}
    finally:
        cpu_info.cpuinfo_lines.cache_clear()


def test_no_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_info, "CPUINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "arm64")
    cpu_info.cpuinfo_lines.cache_clear()
    try:
        assert cpu_info.cpu_flags() == frozenset()
        assert cpu_info.cpu_flags_text() == "arm64"
        assert not cpu_info.cpu_has_native_bf16()
        assert cpu_info.cpu_vendor() == ""
    finally:
        cpu_info.cpuinfo_lines.cache_clear()


def test_only_cpu_info_opens_proc_cpuinfo():
    users = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if re.search(r"/proc/cpuinfo", p.read_text())}
    assert users - NOT_YET_MOVED == {"utils/cpu_info.py"}, sorted(users)
