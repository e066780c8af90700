"""Inductor output code rewritten to run without importing Inductor (inductor_light.py): what
the rewrite keeps, replaces and refuses. Real pieces loaded this way are tested in
test_graph_cache.py (in one process) and test_graph_cache_e2e.py (warm starts in new
processes)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.compilation import inductor_light
from vllm.compilation.inductor_light import NotLight, rewrite, used_ops

OUTPUT_CODE = '''"""
Compile-time auto-tuning block:
from torch._inductor.select_algorithm import AlgorithmSelectorCache
"""
# AOT ID: ['0_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels

aten = torch.ops.aten
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
async_compile = AsyncCompile()


cpp_fused_double_0 = async_compile.cpp_pybinding(
    ['const float*', 'float*', 'const int64_t'], r\'\'\'
extern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0) {}
\'\'\')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, arg1_1, s0 = args
        args.clear()
        buf0 = empty_strided_cpu((s0, 4), (4, 1), torch.float32)
        cpp_fused_double_0(arg0_1, buf0, s0)
        buf1 = empty_strided_cpu((s0, 4), (4, 1), torch.float32)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        return (buf1, align(s0 * 4))

runner = Runner(partitions=[])
call = runner.call


def get_args():
    from torch._dynamo.testing import rand_strided
    return []


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    return print_performance(lambda: call(list(args)), times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    compiled_module_main('None', benchmark_compiled_module)
'''


def test_rewrite_replaces_inductor_and_keeps_the_call():
    source, kernels, extern, uses_align = rewrite(OUTPUT_CODE)
    assert kernels == ["cpp_fused_double_0"] and extern == ["mm"] and uses_align
    for gone in ("torch._inductor", "torch._dynamo", "async_compile", "AsyncCompile",
                 "extern \"C\"", "get_args", "benchmark_compiled_module", "__main__"):
        assert gone not in source, gone

    def double(src, out, n):  # what the built kernel does, in Python
        out.copy_(src * 2)

    light = SimpleNamespace(kernels={"cpp_fused_double_0": double},
                            extern_kernels=SimpleNamespace(mm=torch.mm),
                            align=lambda n: (n + 63) & -64)
    namespace = {"__vllm_light__": light}
    exec(compile(source, "<test>", "exec"), namespace)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    out, aligned = namespace["call"]([x, w, 3])
    torch.testing.assert_close(out, (x * 2) @ w)
    assert aligned == 64


@pytest.mark.parametrize("change, reason", [
    ("from torch._inductor.select_algorithm import extern_kernels",
     "from torch._inductor.runtime.triton_helpers import libdevice"),
    ("cpp_fused_double_0 = async_compile.cpp_pybinding(",
     "cpp_fused_double_0 = async_compile.triton('k', "),
    ("        return (buf1, align(s0 * 4))",
     "        with maybe_profile(True):\n            pass\n        return (buf1, align(s0 * 4))"),
    ("        args.clear()",
     "        args.clear()\n        import torch._inductor.config"),
])
def test_rewrite_refuses_what_it_does_not_know(change, reason):
    assert change in OUTPUT_CODE
    with pytest.raises(NotLight):
        rewrite(OUTPUT_CODE.replace(change, reason))


def test_used_ops_finds_direct_and_aliased_op_references():
    source = ("import torch\naten = torch.ops.aten\ninductor_ops = torch.ops.inductor\n"
              "def call(args):\n"
              "    a = torch.ops.vllm_cpu_linear.linear.default(args[0], args[1])\n"
              "    b = aten.mm.default(a, a)\n"
              "    return (inductor_ops._alloc_from_pool(b, 0, torch.float32, (1,), (1,)),)\n")
    assert used_ops(source) == [["aten", "mm"], ["inductor", "_alloc_from_pool"],
                                ["vllm_cpu_linear", "linear"]]


def test_load_checks_ops_kernel_files_and_the_torch_version(tmp_path):
    record = {"format": inductor_light.FORMAT, "torch": torch.__version__, "source": "",
              "kernels": [{"var": "k", "module": "m.kernel", "attr": "kernel",
                           "file": "k.so", "size": 3, "sha256": "0" * 64}],
              "extern": {}, "ops": [["aten", "mm"]], "align_bytes": None}
    (tmp_path / "k.so").write_bytes(b"abc")
    with pytest.raises(inductor_light.DamagedKernel, match="k.so is damaged"):
        inductor_light.load(record, str(tmp_path))
    with pytest.raises(ValueError, match="another format or torch version"):
        inductor_light.load({**record, "torch": "0.0"}, str(tmp_path))
    # An op registered by Python code that has not run in this process: the piece loads
    # the full way instead of failing at its first call.
    with pytest.raises(ValueError, match="vllm_test_absent::nothing is not registered"):
        inductor_light.load({**record, "ops": [["vllm_test_absent", "nothing"]]},
                            str(tmp_path))


def test_rewrite_refuses_output_code_without_a_call():
    source = OUTPUT_CODE.replace("call = runner.call\n", "")
    with pytest.raises(NotLight, match="no call"):
        rewrite(source)


# The shape of C++-wrapper output code (`cpp_wrapper`, CPU -O3): the host code is C++ built
# into one extension module with the kernels; Python only converts the arguments.
CPP_WRAPPER_CODE = '''"""
Compile-time auto-tuning block:
from torch._inductor.async_compile import AsyncCompile
"""
import torch
from torch._inductor.codecache import CppWrapperCodeCache

cpp_wrapper_src = (
r\'\'\'
#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
void inductor_entry_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {
    aoti_torch_call_dispatcher("vllm_cpu_linear::linear", "", dispatch_vars.data());
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
        "vllm::unified_attention_with_output", "");
}
\'\'\'
)

inductor_entry = CppWrapperCodeCache.load_pybinding(
    argtypes=["std::vector<AtenTensorHandle>"],
    main_code=cpp_wrapper_src,
    device_type="cpu",
    num_outputs=1,
    kernel_code=None,
)

def _wrap_func(f):
    def g(args):
        input_tensors = [arg if isinstance(arg, torch.Tensor) else torch.tensor(arg)
                         for arg in args]
        args.clear()
        return f(input_tensors)
    return g

call = _wrap_func(inductor_entry)
def get_args():
    from torch._dynamo.testing import rand_strided
    return []
'''


def test_rewrite_takes_the_cpp_wrapper_module_as_the_kernel():
    source, kernels, extern, uses_align = rewrite(CPP_WRAPPER_CODE)
    assert kernels == ["inductor_entry"] and extern == [] and not uses_align
    # The wrapper's C++ source is not kept: the built module stands for it.
    for gone in ("torch._inductor", "CppWrapperCodeCache", "cpp_wrapper_src", "#include",
                 "get_args"):
        assert gone not in source, gone
    light = SimpleNamespace(kernels={"inductor_entry": lambda ts: [t * 3 for t in ts]})
    namespace = {"__vllm_light__": light}
    exec(compile(source, "<test>", "exec"), namespace)
    x = torch.randn(2)
    torch.testing.assert_close(namespace["call"]([x, 2])[0], x * 3)
    # The ops its C++ calls by name are checked at load like the Python references.
    assert inductor_light.cpp_wrapper_ops(CPP_WRAPPER_CODE) == [
        ["vllm", "unified_attention_with_output"], ["vllm_cpu_linear", "linear"]]


@pytest.mark.parametrize("change, replacement, reason", [
    ("    kernel_code=None,", "    kernel_code=cpp_wrapper_src,", "apart from its kernels"),
    ("CppWrapperCodeCache.load_pybinding(", "CppWrapperCodeCache.load_pybinding_async(",
     "with CppWrapperCodeCache.load_pybinding_async"),
    ("call = _wrap_func(inductor_entry)",
     "call = _wrap_func(inductor_entry)\nCppWrapperCodeCache.cache_clear()",
     "uses CppWrapperCodeCache"),
])
def test_rewrite_refuses_other_uses_of_the_cpp_wrapper_builder(change, replacement, reason):
    assert change in CPP_WRAPPER_CODE
    with pytest.raises(NotLight, match=reason):
        rewrite(CPP_WRAPPER_CODE.replace(change, replacement))


def _handle_entry(seen: list):
    """A C++ entry as the shim calls it: owned input handles in, output handles out (here
    inputs[0] * inputs[1]); notes each input's dtype, value and storage."""
    def entry(handles):
        inputs = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(handles)
        seen.append([(t.dtype, t.tolist(), t.data_ptr()) for t in inputs])
        return torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors([inputs[0] * inputs[1]])
    return entry


def test_cpp_entry_call_does_what_inductors_shim_does():
    """CppEntryCall against torch 2.13's own shim (the text it replaces) on the same entry:
    same results and input tensors; an int argument's 0-d tensor is made once per value."""
    namespace = {"torch": torch}
    exec(inductor_light._CPP_WRAPPER_SHIM, namespace)
    theirs_seen, ours_seen = [], []
    theirs = namespace["_wrap_func"](_handle_entry(theirs_seen))
    ours = inductor_light.CppEntryCall(_handle_entry(ours_seen))
    x = torch.randn(3)
    for scalar in (3, 3, 4, True, 2.5):
        args_theirs, args_ours = [x, scalar], [x, scalar]
        expected, got = theirs(args_theirs), ours(args_ours)
        torch.testing.assert_close(got[0], expected[0])
        assert args_ours == [] and args_theirs == []  # the code after a call may not keep them
    assert [[s[:2] for s in call] for call in ours_seen] == \
        [[s[:2] for s in call] for call in theirs_seen]
    int_storage = [call[1][2] for call in ours_seen]
    assert int_storage[0] == int_storage[1] != int_storage[2]  # 3 kept, 4 another tensor
    assert ours_seen[3][1][:2] == (torch.bool, True)  # not the int 1's tensor


def test_cpp_entry_call_keeps_a_bounded_number_of_ints(monkeypatch):
    monkeypatch.setattr(inductor_light.CppEntryCall, "MAX_INTS", 2)
    seen = []
    ours = inductor_light.CppEntryCall(_handle_entry(seen))
    for n in (1, 2, 3, 3):
        ours([torch.ones(1), n])
    assert [call[1][1] for call in seen] == [1, 2, 3, 3]
    assert sorted(ours._ints) == [1, 2]  # 3 came after the bound: made per call, not kept


def test_load_uses_cpp_entry_call_only_for_the_known_shim():
    """`_fast_call` swaps in CppEntryCall only where the code's shim is exactly torch's; other
    code keeps its own `call`."""
    entry = _handle_entry([])
    known = "import torch\n" + inductor_light._CPP_WRAPPER_SHIM + "\ncall = _wrap_func(entry)\n"
    namespace = {"entry": entry}
    exec(known, namespace)
    call = inductor_light._fast_call(known, namespace)
    assert isinstance(call, inductor_light.CppEntryCall)
    torch.testing.assert_close(call([torch.full((2,), 2.0), 3])[0], torch.full((2,), 6.0))
    direct = known.replace("call = _wrap_func(entry)", "call = entry")
    namespace = {"entry": entry}
    exec(direct, namespace)
    assert inductor_light._fast_call(direct, namespace) is entry
    # another shim (the test's C++-wrapper code converts without handles): its own call
    source = rewrite(CPP_WRAPPER_CODE)[0]
    namespace = {"__vllm_light__": SimpleNamespace(kernels={"inductor_entry": entry})}
    exec(source, namespace)
    assert inductor_light._fast_call(source, namespace) is namespace["call"]
