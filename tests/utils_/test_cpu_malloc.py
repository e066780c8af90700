"""Freed activation memory kept for the next step (vllm/utils/cpu_malloc.py) and the CPU
worker's use of it. Each case runs in a fresh process: malloc's settings are per process."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fresh_python import run_fresh
from vllm.utils import cpu_malloc

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux")
                                or cpu_malloc.heap_top_free(cpu_malloc._glibc() or object())
                                is None, reason="glibc >= 2.33 (mallopt, mallinfo2) only")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import ctypes, json, resource, torch
from vllm.utils import cpu_malloc
libc = cpu_malloc._glibc()
before = cpu_malloc.heap_top_free(libc)
kept = cpu_malloc.keep_freed_memory({pad})
# the heap's next growth (small blocks until it grows, as the engine's start-up does) takes
# the pad: up to 256 MiB of 64 KiB blocks, kept until the end
held, after = [], before
while len(held) < 4096 and after < {pad}:
    held.append(bytearray(64 << 10))
    after = cpu_malloc.heap_top_free(libc)
# a large tensor carved from the heap's free top: written, freed, its pages stay resident
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(40 << 18, dtype=torch.float32)  # 40 MiB: glibc would map it on its own
t.fill_(1.0)
del t
t = torch.empty(8 << 18, dtype=torch.float32)  # 8 MiB from the same, resident, space
t.fill_(2.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({{"kept": kept, "before": before, "after": after, "faults": faults,
                  "again": cpu_malloc.keep_freed_memory(1 << 20)}}))
"""


def probe(monkeypatch, pad: int, **env) -> dict:
    """PROBE's answer in a fresh process with `env` set for it alone."""
    with monkeypatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return json.loads(run_fresh(PROBE.format(pad=pad), ROOT).strip().splitlines()[-1])


@glibc_only
def test_the_heap_grows_by_the_pad_and_serves_large_tensors(monkeypatch):
    for name in (*cpu_malloc.USER_MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    pad = 256 << 20
    got = probe(monkeypatch, pad)
    assert got["kept"] is True and got["again"] is True
    assert got["before"] < pad <= got["after"]
    # 48 MiB written: mapped afresh they would fault ~12k 4 KiB pages (or 24 huge pages);
    # the 8 MiB tensor reuses the 40 MiB one's pages, so at most the 40 MiB fault in
    pages = (40 << 20) // 4096
    assert got["faults"] <= pages + 512, got


@glibc_only
def test_a_users_own_malloc_settings_and_a_zero_pad_leave_malloc_alone(monkeypatch):
    for name in (*cpu_malloc.USER_MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    off = probe(monkeypatch, 0)
    assert off["kept"] is False and off["after"] < (16 << 20)
    mine = probe(monkeypatch, 256 << 20, MALLOC_TOP_PAD_="65536")
    assert mine["kept"] is False and mine["after"] < (16 << 20)
    tunable = probe(monkeypatch, 256 << 20, GLIBC_TUNABLES="glibc.malloc.top_pad=65536")
    assert tunable["kept"] is False and tunable["after"] < (16 << 20)
    # another library's tunables are not malloc's: the pad still applies
    other = probe(monkeypatch, 256 << 20, GLIBC_TUNABLES="glibc.cpu.x86_rep_movsb_threshold=4096")
    assert other["kept"] is True and other["after"] >= (256 << 20)


def test_the_pad_variable_is_checked_by_name(monkeypatch):
    from vllm import envs

    monkeypatch.delenv("VLLM_CPU_MALLOC_TOP_PAD_MB", raising=False)
    assert envs.VLLM_CPU_MALLOC_TOP_PAD_MB == 1024
    monkeypatch.setenv("VLLM_CPU_MALLOC_TOP_PAD_MB", "0")
    assert envs.VLLM_CPU_MALLOC_TOP_PAD_MB == 0
    monkeypatch.setenv("VLLM_CPU_MALLOC_TOP_PAD_MB", "1GiB")
    with pytest.raises(ValueError, match="VLLM_CPU_MALLOC_TOP_PAD_MB='1GiB'"):
        _ = envs.VLLM_CPU_MALLOC_TOP_PAD_MB


@glibc_only
@pytest.mark.parametrize("pad_mb", ["64", "0"])
def test_the_cpu_worker_keeps_freed_memory_as_the_variable_says(monkeypatch, pad_mb):
    for name in (*cpu_malloc.USER_MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_MALLOC_TOP_PAD_MB", pad_mb)
    out = run_fresh(
        "from vllm import LLM\n"
        "from vllm.utils import cpu_malloc\n"
        "LLM(model='demo', optimization_level=0, max_model_len=64, kv_cache_memory='16MiB')\n"
        "print(cpu_malloc._applied)\n", ROOT)
    assert int(out.strip().splitlines()[-1]) == int(pad_mb) << 20
