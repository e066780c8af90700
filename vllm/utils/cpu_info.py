"""What the CPU can do, read from /proc/cpuinfo once per process.

The platform (native bf16?), the CPU kernel builder (a library built with -march=native
belongs to one instruction set) and the compile cache (its key names the machine) all ask;
they share this one read.
"""
from __future__ import annotations

import functools
import platform

CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpu_flags_line() -> str:
    """The first "flags" line of /proc/cpuinfo, as the kernel writes it (newline included);
    "" where there is no such file or line (macOS, some containers)."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (e.g. "avx2", "avx512_bf16", "amx_bf16"); empty if unknown."""
    line = cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_flags_text() -> str:
    """The flags as one string (the machine's name, `platform.machine()`, when unknown): a
    fingerprint of the instruction set for cache keys."""
    line = cpu_flags_line()
    return line.split(":", 1)[1].strip() if ":" in line else platform.machine()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matrix work runs in hardware (else torch emulates it)."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})
