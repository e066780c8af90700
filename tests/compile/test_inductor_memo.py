"""Inductor's vector-ISA build checks and torch_key() remembered between starts
(inductor_memo.py)."""
from __future__ import annotations

import inspect
import json

import pytest
from torch._inductor import config as inductor_config
from torch._inductor import cpu_vec_isa

from vllm.compilation import inductor_memo
from vllm.compilation.inductor_memo import (
    MEMO,
    PCH_MEMO,
    TORCH_KEY_MEMO,
    memoize_precompiled_header,
    pick_vec_isa,
    prefill_torch_key,
)

try:
    from tests.fresh_python import run_fresh
except ImportError:  # tests/ itself on sys.path
    from fresh_python import run_fresh


def _forget_probes() -> None:
    """Inductor caches its checks per process: clear them, as in a new process."""
    for obj in vars(cpu_vec_isa).values():
        members = vars(obj).values() if inspect.isclass(obj) else [obj]
        for member in members:
            if hasattr(member, "cache_clear"):
                member.cache_clear()


@pytest.fixture
def probes(monkeypatch):
    """Count the (fake, always successful) build checks Inductor runs."""
    calls: list[str] = []

    def check_build(isa, code):
        calls.append(str(isa))
        return True

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)
    _forget_probes()
    yield calls
    _forget_probes()


def test_checks_are_answered_from_the_memo_of_an_earlier_start(tmp_path, probes, monkeypatch):
    pick_vec_isa(str(tmp_path))
    first = len(probes)
    if first == 0:
        pytest.skip("no vector ISA to check on this machine")
    memo = json.loads((tmp_path / MEMO).read_text())
    assert all(memo["results"].values()) and len(memo["results"]) <= first
    picked = str(cpu_vec_isa.pick_vec_isa())

    _forget_probes()  # a new process: no checks run, the same ISA picked
    pick_vec_isa(str(tmp_path))
    assert len(probes) == first
    assert str(cpu_vec_isa.pick_vec_isa()) == picked

    # Another compiler (CXX) is another fingerprint: checked again, and remembered.
    _forget_probes()
    monkeypatch.setenv("CXX", "some-other-g++")
    pick_vec_isa(str(tmp_path))
    assert len(probes) == 2 * first

    # No directory (the compile cache is off) or an explicit vec_isa_ok: Inductor as it is,
    # the memo neither read nor written. (Which checks Inductor then runs depends on the
    # machine's ISA, so only the memo is asserted on.)
    _forget_probes()
    pick_vec_isa(None)
    assert len(probes) == 3 * first

    def no_memo(*args, **kwargs):
        raise AssertionError("the memo was read")

    _forget_probes()
    monkeypatch.setattr(inductor_memo, "_read_entries", no_memo)
    monkeypatch.setattr(inductor_memo, "_write_json", no_memo)
    # (config.patch, not monkeypatch: pytest 9's undo would delete the config attribute)
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        pick_vec_isa(str(tmp_path))
    assert inductor_config.cpp.vec_isa_ok is None


def test_torch_key_is_set_from_the_memo(tmp_path, monkeypatch):
    from torch._inductor import codecache

    real = codecache.torch_key()
    prefill_torch_key(str(tmp_path))  # computed (here: already), then remembered
    memo = json.loads((tmp_path / TORCH_KEY_MEMO).read_text())
    assert bytes.fromhex(memo["key"]) == real
    # A new process: set from the memo, not computed.
    codecache.torch_key.clear()
    try:
        monkeypatch.setattr(codecache, "build_code_hash",
                            lambda *a: pytest.fail("torch's source hashed again"))
        prefill_torch_key(str(tmp_path))
        assert codecache.torch_key() == real
        # Another torch (other fingerprint): computed again.
        memo["fingerprint"]["torch"] = "0.0"
        (tmp_path / TORCH_KEY_MEMO).write_text(json.dumps(memo))
        codecache.torch_key.clear()
        monkeypatch.undo()
        prefill_torch_key(str(tmp_path))
        assert codecache.torch_key() == real
    finally:
        codecache.torch_key.clear()
        codecache.torch_key.set(real)


def test_prepare_inductor_imports_the_compiler_once(tmp_path):
    """`prepare_inductor` (before the first Inductor compile or full load) imports Inductor's
    compiler and the modules its output code imports, once per process; until it runs (a
    fresh process, or one whose pieces all load without Inductor) nothing of Inductor is
    imported by our compilation modules."""
    code = (
        "import sys\n"
        "import vllm.compilation.backends, vllm.compilation.graph_cache\n"
        "from vllm.compilation import compiler_interface as ci, inductor_memo\n"
        "assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules\n"
        "calls = []\n"
        "real = inductor_memo.pick_vec_isa\n"
        "inductor_memo.pick_vec_isa = lambda d: (calls.append(d), real(d))[1]\n"
        "ci.prepare_inductor(None)\n"
        "ci.prepare_inductor(None)\n"
        "missing = [m for m in ('torch._inductor.compile_fx', 'torch._inductor.select_algorithm')"
        " if m not in sys.modules]\n"
        "assert not missing, missing\n"
        "assert calls == [None], calls\n")
    run_fresh(code, tmp_path)


class _Isa:
    """Like Inductor's VecISA options: a repr with an address, a stable str."""

    def __str__(self) -> str:
        return "avx2"


def _codecache(tmp_path, calls):
    """A stand-in for torch._inductor.codecache in a new process: its `_precompile_header`
    (the preprocessor run and the build) counts its calls and leaves `<path>` + `.gch`."""
    def precompile_header(header, cmd_line, **options):
        calls.append(header)
        path = tmp_path / "pch" / f"{header.replace('/', '_')}.h"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"#include <{header}>")
        (tmp_path / "pch" / f"{path.name}.gch").write_text("compiled")
        return str(path)

    return type("codecache", (), {"_precompile_header": staticmethod(precompile_header)})


def test_precompiled_header_check_is_answered_from_the_memo(tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    calls: list[str] = []
    args = ("torch/csrc/inductor/cpp_prefix.h", "g++ -O3")

    first = _codecache(tmp_path, calls)
    memoize_precompiled_header(str(memo), first)
    path = first._precompile_header(*args, vec_isa=_Isa(), shared=True)
    assert calls == ["torch/csrc/inductor/cpp_prefix.h"] and (memo / PCH_MEMO).is_file()
    memoize_precompiled_header(str(memo), first)  # installed once: no double wrapping
    assert first._precompile_header(*args, vec_isa=_Isa(), shared=True) == path
    assert len(calls) == 1

    later = _codecache(tmp_path, calls)  # a new process: the memo answers
    memoize_precompiled_header(str(memo), later)
    assert later._precompile_header(*args, vec_isa=_Isa(), shared=True) == path
    assert len(calls) == 1
    # Other flags, a precompiled file that is gone, another torch: Inductor checks again.
    later._precompile_header(args[0], "g++ -O2", vec_isa=_Isa(), shared=True)
    assert len(calls) == 2
    (tmp_path / "pch" / "torch_csrc_inductor_cpp_prefix.h.h.gch").unlink()
    later._precompile_header(*args, vec_isa=_Isa(), shared=True)
    assert len(calls) == 3
    monkeypatch.setattr(inductor_memo, "_torch_fingerprint", lambda: {"torch": "other"})
    other = _codecache(tmp_path, calls)
    memoize_precompiled_header(str(memo), other)
    other._precompile_header(*args, vec_isa=_Isa(), shared=True)
    assert len(calls) == 4
    # Without a memo directory (compile cache off) nothing is installed.
    bare = _codecache(tmp_path, calls)
    original = bare._precompile_header
    memoize_precompiled_header(None, bare)
    assert bare._precompile_header is original
