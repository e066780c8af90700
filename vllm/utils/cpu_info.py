"""What the CPU can do, read from /proc/cpuinfo once per process.

The platform (native bf16?), the CPU kernel builder (which instruction-set level to build
the C++ kernels for) and the compile cache (its key names the machine) all ask; they share
this one read.

ISA levels of the C++ CPU kernels, lowest first (`ISA_LEVELS`): each names the /proc/cpuinfo
flags a CPU needs for it and the compiler flags a library is built with at that level.
`best_isa_level()` is the highest level the CPU has; `cpu_isa_level()` is the level this
process builds and loads its kernels for: the best one, or a lower one forced with
VLLM_CPU_ISA=avx2|avx512|avx512_bf16 (a level the CPU lacks is a ValueError). A CPU below
AVX2 (or not x86) gets the level "native": built with -march=native, as before the levels.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpuinfo_lines() -> dict[str, str]:
    """The first "flags" and "vendor_id" lines of /proc/cpuinfo, as the kernel writes them
    (newline included), by key; the one read of the file per process. Empty where there is no
    such file (macOS, some containers)."""
    lines: dict[str, str] = {}
    try:
        with open(CPUINFO) as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "vendor_id") and ":" in line:
                    lines.setdefault(key, line)
                    if len(lines) == 2:
                        break
    except OSError:
        pass
    return lines


def cpu_flags_line() -> str:
    """The first "flags" line of /proc/cpuinfo, as the kernel writes it (newline included);
    "" where there is no such file or line (macOS, some containers)."""
    return cpuinfo_lines().get("flags", "")


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"); "" where
    unknown."""
    line = cpuinfo_lines().get("vendor_id", "")
    return line.split(":", 1)[1].strip() if line else ""


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


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cpu_flags: frozenset[str]
    """/proc/cpuinfo flags the CPU needs (all of them)."""
    cflags: tuple[str, ...]
    """Compiler flags of the instruction set (the kernels' build adds -O3 etc.)."""


# Every x86 CPU with AVX2 (Haswell and later, Zen and later) also has FMA, F16C, BMI1/2.
_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"})
_AVX2_CFLAGS = ("-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2")
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_AVX512_CFLAGS = _AVX2_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

ISA_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", _AVX2_FLAGS, _AVX2_CFLAGS),
    IsaLevel("avx512", _AVX512_FLAGS, _AVX512_CFLAGS),
    IsaLevel("avx512_bf16", _AVX512_FLAGS | {"avx512_bf16"},
             _AVX512_CFLAGS + ("-mavx512bf16",)),
)
NATIVE = IsaLevel("native", frozenset(), ("-march=native",))
"""A CPU with none of the levels (x86 below AVX2, Arm, ...): built for the machine itself."""
ISA_ENV = "VLLM_CPU_ISA"


def isa_level(name: str) -> IsaLevel:
    """The level called `name` (a ValueError naming the levels for an unknown one)."""
    for level in ISA_LEVELS + (NATIVE,):
        if level.name == name:
            return level
    raise ValueError(f"unknown CPU ISA level {name!r}; the levels are "
                     + ", ".join(level.name for level in ISA_LEVELS))


def supported_isa_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels a CPU with these flags (default: this CPU's) can run, lowest first."""
    flags = cpu_flags() if flags is None else flags
    return [level.name for level in ISA_LEVELS if level.cpu_flags <= flags]


def best_isa_level(flags: frozenset[str] | None = None) -> str:
    """The highest level a CPU with these flags (default: this CPU's) can run; "native" when
    it has none of them."""
    levels = supported_isa_levels(flags)
    return levels[-1] if levels else NATIVE.name


def cpu_isa_level(flags: frozenset[str] | None = None, forced: str | None = None) -> str:
    """The level to build and load the C++ kernels for: VLLM_CPU_ISA (or `forced`) when set,
    else the best one the CPU has. Forcing a level the CPU lacks (or an unknown name) is a
    ValueError naming the levels this CPU allows."""
    if forced is None:
        forced = os.environ.get(ISA_ENV, "")
    forced = forced.strip().lower()
    flags = cpu_flags() if flags is None else flags
    best = best_isa_level(flags)
    if not forced or forced == "auto":
        return best
    allowed = supported_isa_levels(flags)
    known = [level.name for level in ISA_LEVELS]
    if forced not in known:
        raise ValueError(f"{ISA_ENV}={forced!r} is not a CPU ISA level; use one of "
                         f"{', '.join(known)} (this CPU allows: {', '.join(allowed) or 'none'})")
    if forced not in allowed:
        missing = ", ".join(sorted(isa_level(forced).cpu_flags - flags))
        raise ValueError(f"{ISA_ENV}={forced!r}: this CPU lacks {missing}; it allows "
                         f"{', '.join(allowed) or 'none of the levels'}")
    return forced
