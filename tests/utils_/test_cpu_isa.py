"""The C++ CPU kernels' instruction-set levels: detection from the CPU's flags, forcing a
lower level with VLLM_CPU_ISA (and the error for one the CPU lacks), the compiler flags and
cache directory of each level, and, for every level this machine has, the kernels built at
that level (in a subprocess: one process loads one level) matching their torch references."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm.utils import cpu_info, cpu_kernels
from vllm.utils.cpu_info import best_isa_level, cpu_isa_level, supported_isa_levels

AVX2 = frozenset("fpu sse2 sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt".split())
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
OLD_X86 = frozenset("fpu sse2 sse4_2 avx".split())  # Sandy Bridge: AVX without AVX2/FMA


@pytest.mark.parametrize("flags,best,supported", [
    (AVX2, "avx2", ["avx2"]),
    (AVX2 | {"avx512f"}, "avx2", ["avx2"]),  # AVX-512 F alone (Knights Landing): not enough
    (AVX512, "avx512", ["avx2", "avx512"]),
    (AVX512_BF16, "avx512_bf16", ["avx2", "avx512", "avx512_bf16"]),
    (AVX512_BF16 | {"amx_bf16", "amx_tile"}, "avx512_bf16", ["avx2", "avx512", "avx512_bf16"]),
    (AVX2 - {"fma"}, "native", []),
    (OLD_X86, "native", []),
    (frozenset(), "native", []),  # Arm, or no /proc/cpuinfo
])
def test_detection_from_flags(flags, best, supported):
    assert best_isa_level(flags) == best
    assert supported_isa_levels(flags) == supported
    assert cpu_isa_level(flags, forced="") == best


def test_forcing_a_lower_level(monkeypatch):
    assert cpu_isa_level(AVX512_BF16, forced="avx2") == "avx2"
    assert cpu_isa_level(AVX512_BF16, forced=" AVX512 ") == "avx512"
    assert cpu_isa_level(AVX512_BF16, forced="auto") == "avx512_bf16"
    monkeypatch.setenv("VLLM_CPU_ISA", "avx2")
    assert cpu_isa_level(AVX512) == "avx2"
    monkeypatch.setenv("VLLM_CPU_ISA", "")
    assert cpu_isa_level(AVX512) == "avx512"


def test_forcing_a_level_the_cpu_lacks_names_the_allowed_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"VLLM_CPU_ISA='avx512'.*lacks avx512bw, avx512dq, "
                       r"avx512f, avx512vl.*allows avx2$"):
        cpu_isa_level(AVX2, forced="avx512")
    with pytest.raises(ValueError, match=r"'avx512_bf16'.*lacks avx512_bf16.*avx2, avx512$"):
        cpu_isa_level(AVX512, forced="avx512_bf16")
    with pytest.raises(ValueError, match=r"'amx' is not a CPU ISA level; use one of avx2, "
                       r"avx512, avx512_bf16 \(this CPU allows: avx2\)"):
        cpu_isa_level(AVX2, forced="amx")
    with pytest.raises(ValueError, match="allows none"):
        cpu_isa_level(OLD_X86, forced="avx2")
    # the kernels' builder asks once per process, with this CPU's flags and the environment
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: AVX2)
    monkeypatch.setattr(cpu_kernels, "_process_isa", None)
    monkeypatch.setenv("VLLM_CPU_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="VLLM_CPU_ISA='avx512_bf16'"):
        cpu_kernels.load_cpu_extension("never_built", "/nonexistent.cpp", "VLLM_NEVER_BUILT")
    assert "never_built" not in cpu_kernels._loaded


def test_level_fixed_once_per_process(monkeypatch):
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: AVX512_BF16)
    monkeypatch.setattr(cpu_kernels, "_process_isa", None)
    monkeypatch.setenv("VLLM_CPU_ISA", "avx512")
    assert cpu_kernels.kernels_isa_level() == "avx512"
    monkeypatch.setenv("VLLM_CPU_ISA", "avx2")  # too late: a library may be loaded already
    assert cpu_kernels.kernels_isa_level() == "avx512"


def test_compiler_flags_per_level():
    avx2 = cpu_kernels.isa_cflags("avx2")
    assert {"-mavx2", "-mfma", "-mf16c", "-O3", "-fopenmp"} <= set(avx2)
    assert not [f for f in avx2 if f.startswith("-mavx512") or f == "-march=native"]
    avx512 = cpu_kernels.isa_cflags("avx512")
    assert {"-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"} <= set(
        avx512)
    assert "-mavx512bf16" not in avx512 and "-march=native" not in avx512
    assert set(avx512) < set(cpu_kernels.isa_cflags("avx512_bf16"))
    assert "-mavx512bf16" in cpu_kernels.isa_cflags("avx512_bf16")
    assert "-march=native" in cpu_kernels.isa_cflags("native")
    with pytest.raises(ValueError, match="unknown CPU ISA level 'sse'"):
        cpu_kernels.isa_cflags("sse")


def test_each_level_builds_into_its_own_directory(tmp_path, monkeypatch):
    """The build gets the level's flags and a directory (and library name) of its own; a
    second call at a level finds its library instead of building again."""
    import torch
    import torch.utils.cpp_extension

    builds = []

    def fake_load(name, sources, extra_cflags, build_directory, **kwargs):
        builds.append((name, extra_cflags, build_directory))
        open(os.path.join(build_directory, f"{name}.so"), "w").close()

    loaded = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_default_cache_root", lambda: str(tmp_path))
    src = tmp_path / "k.cpp"
    src.write_text("// kernel\n")
    for level in ("avx2", "avx512", "avx2"):
        assert cpu_kernels._build_and_load("k", str(src), None, level)
    assert [b[1] for b in builds] == [cpu_kernels.isa_cflags("avx2"),
                                      cpu_kernels.isa_cflags("avx512")]
    dirs = [os.path.relpath(b[2], tmp_path) for b in builds]
    assert dirs[0].startswith(os.path.join("cpu_kernels_k", "avx2-"))
    assert dirs[1].startswith(os.path.join("cpu_kernels_k", "avx512-"))
    assert "_avx2_" in builds[0][0] and "_avx512_" in builds[1][0]
    # the third call loads the avx2 library, copied out of its build folder
    assert len(loaded) == 1
    assert loaded[0] == os.path.join(os.path.dirname(builds[0][2]), f"{builds[0][0]}.so")


def test_summary_line_names_the_cpu_kernels_level(cpu_platform, monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(cpu_kernels, "_process_isa", "avx2")
    assert VllmConfig().summary_line().endswith("platform cpu, CPU kernels avx2")


@pytest.mark.slow
@pytest.mark.parametrize("level", supported_isa_levels() or ["none"])
def test_kernels_at_each_level_match_torch(level):
    """In a subprocess with VLLM_CPU_ISA=level: the linear (float32, bfloat16; 1..17 rows; odd
    K and N; each of the level's inner loops), panel (float32; bfloat16 on AVX2; through the
    dispatcher too), paged-attention and greedy-sampling kernels built at that level match
    torch, and every library reports the level it was compiled for."""
    if level == "none":
        pytest.skip("this CPU has none of the ISA levels")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_isa_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(script)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True,
                          env=dict(os.environ, VLLM_CPU_ISA=level, PYTHONPATH=path,
                                   VLLM_PLATFORM="cpu"),
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["level"] == level
    assert report["built"] == {name: [level, level] for name in report["built"]}
    assert report["linear_cases"] == 5 * 2 * 17
    # the small-M kernel's inner loops those cases went through: on AVX2 one or two rows of
    # bfloat16 x split like the weight, more rows widened; the bfloat16 dot products where the
    # CPU has them (from the vendor's bf16_dot_min_rows: widened below); non-temporal loads
    # for one row on AVX-512 where the vendor's default turns them on (the cases' weights
    # need not be 64-byte aligned: either loop)
    loops = {dtype: set(names) for dtype, names in report["small_m_loops"].items()}
    widen = {"widen", "widen_nt"}
    assert "widen" in loops["float32"] and loops["float32"] <= widen, loops
    if level == "avx2":
        assert loops["bfloat16"] == {"split_bf16", "widen"}, loops
    elif level == "avx512":
        assert "widen" in loops["bfloat16"] and loops["bfloat16"] <= widen, loops
    else:
        dot = {"bf16_dot", "bf16_dot_nt"}
        assert loops["bfloat16"] & dot and loops["bfloat16"] <= widen | dot, loops
    assert report["attention_cases"] == 12 and report["sampling_cases"] == 5
    assert report["bf16_dot"] == (level == "avx512_bf16")
    # float32 panels at every level, bfloat16 ones on AVX2: 3 shapes x 9 row counts each
    assert report["bf16_panels"] == (level == "avx2")
    assert report["panel_cases"] == 27 * (2 if level == "avx2" else 1)
    assert report["summary_line"].endswith(f"platform cpu, CPU kernels {level}")
