"""AllReduceFusionPass on small graphs: all-reduce -> RMSNorm with and without the residual
add, with and without a static FP8 quant after it, both forms of RMSNorm and QuantFP8 (custom
ops on and off), the eager (ATen) and Inductor (decomposed) IR; op counts before and after,
numerics against the unfused module.

The all-reduce runs over a one-rank shared-memory segment registered under a test group name,
so the fused op's C++ kernel runs here without torch.distributed (a sum over one rank is a
copy); the two-rank sums are tests/distributed/test_shm_all_reduce.py's."""
from __future__ import annotations

import functools
import os
import secrets

import pytest
import torch
import torch.nn as nn

import vllm.distributed.all_reduce_ops  # noqa: F401  (the graph ops)
from tests.compile.passes.fp8_fusion_utils import QUANT_OPS, assert_fp8_close, compile_with_passes
from vllm.compilation.passes.fusion.allreduce_rms_fusion import AllReduceFusionPass
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import shm_all_reduce as shm
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

HIDDEN = 256
GROUP = "test_allreduce_fusion"
ALL_REDUCE = "vllm.all_reduce.default"
FUSED = "vllm.fused_all_reduce_rms_norm.default"
FUSED_QUANT = "vllm.fused_all_reduce_rms_norm_static_fp8_quant.default"


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not shm.load_kernel():
        pytest.skip("the shared-memory all-reduce kernel could not be built here")
    name = f"/vllm_ar_test_{os.getpid()}_{secrets.token_hex(4)}"
    handle = torch.ops.vllm_shm_ar.attach(name, 1 << 20, 0, 1, True)
    torch.ops.vllm_shm_ar.unlink(name)
    shm._COMMS[GROUP] = shm.ShmAllReduce(handle, 0, 1, 1 << 20, GROUP, name)
    yield
    shm.destroy_shm_all_reduce(GROUP)


@functools.lru_cache(maxsize=None)
def fusion_pass(dtype: torch.dtype, decompose: bool, quant: bool = True,
                group: str = GROUP) -> AllReduceFusionPass:
    return AllReduceFusionPass(None, group_name=group, dtypes=[dtype], decompose=[decompose],
                               quant=quant)


class TPBlock(nn.Module):
    """As in a tensor-parallel decoder: the embedding's all-reduce -> RMSNorm (no residual;
    the reduced tensor is the residual), a row-parallel matmul's all-reduce -> RMSNorm with
    the residual add; `quant`: each norm's output is quantized to FP8 (static scale)."""

    def __init__(self, dtype: torch.dtype, quant: bool, eps: float = 1e-6,
                 group: str = GROUP) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm1 = RMSNorm(HIDDEN, eps=eps, dtype=dtype)
        self.norm2 = RMSNorm(HIDDEN, eps=eps, dtype=dtype)
        for norm in (self.norm1, self.norm2):
            norm.weight.data = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
        self.w = nn.Parameter((torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.05).to(dtype),
                              requires_grad=False)
        self.quant = None
        if quant:
            from vllm.compilation.passes.fusion import matcher_utils as mu

            self.quant = QuantFP8(True, mu.STATIC.group_shape)
        self.scale = nn.Parameter(torch.tensor([0.02]), requires_grad=False)
        self.group = group

    def _out(self, y):
        if self.quant is None:
            return y, y
        q, s = self.quant(y, self.scale)
        return q, (q.to(torch.float32) * s).to(self.w.dtype)

    def forward(self, x):
        h = torch.ops.vllm.all_reduce(x, self.group)
        residual = h
        o1, y = self._out(self.norm1(h))
        partial = y @ self.w
        o = torch.ops.vllm.all_reduce(partial, self.group)
        y2, residual = self.norm2(o, residual)
        o2, _ = self._out(y2)
        return o1, o2, residual


def build(custom_ops: bool, **kwargs) -> TPBlock:
    config = VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["all" if custom_ops else "none"]))
    with set_current_vllm_config(config):
        return TPBlock(**kwargs)


def _input(dtype: torch.dtype, tokens: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(tokens, HIDDEN, generator=gen) * 2).to(dtype)


def _check(got, want, quant: bool) -> None:
    o1, o2, res = got
    if quant:
        assert_fp8_close(o1, want[0], max_mismatch=0.01)
        assert_fp8_close(o2, want[1], max_mismatch=0.01)
    else:
        tol = 2e-2 if o1.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(o1, want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(o2, want[1], rtol=tol, atol=tol)
    torch.testing.assert_close(res, want[2], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "inductor-ir"])
@pytest.mark.parametrize("custom_ops", [True, False], ids=["custom-ops", "torch-native"])
@pytest.mark.parametrize("quant", [False, True], ids=["no-quant", "static-fp8"])
def test_all_reduce_rms_fused(quant, custom_ops, decompose):
    dtype = torch.bfloat16
    module = build(custom_ops, dtype=dtype, quant=quant)
    fusion = fusion_pass(dtype, decompose)
    x = _input(dtype)
    want = module(x)
    run, cap = compile_with_passes(module, [fusion], decompose)
    got = run(x)

    assert fusion.matched_count == 2  # the plain norm and the fused-add one
    assert cap.before[ALL_REDUCE] == 2 and cap.after[ALL_REDUCE] == 0
    fused = FUSED_QUANT if quant else FUSED
    assert cap.after[fused] == 2
    assert cap.after["aten.rsqrt.default"] == 0 and cap.after["aten.pow.Tensor_Scalar"] == 0
    if quant:
        assert sum(cap.after[op] for op in QUANT_OPS) == 0 and cap.fp8_converts_after == 0
    _check(got, want, quant)
    # Another token count runs the same graph (symbolic shapes).
    x = _input(dtype, tokens=3)
    _check(run(x), module(x), quant)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_float32_and_epsilons(eps):
    module = build(False, dtype=torch.float32, quant=False, eps=eps)
    fusion = fusion_pass(torch.float32, False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    x = _input(torch.float32)
    got = run(x)
    assert fusion.matched_count == 2 and cap.after[FUSED] == 2
    _check(got, module(x), quant=False)


def test_without_quant_patterns_the_quant_stays():
    # Patterns registered without quantization (a model without static FP8): the all-reduce
    # and the norm still fuse; the quantization is left to the RMSNorm+quant pass.
    module = build(True, dtype=torch.bfloat16, quant=True)
    fusion = fusion_pass(torch.bfloat16, False, quant=False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    x = _input(torch.bfloat16)
    got = run(x)
    assert fusion.matched_count == 2
    assert cap.after[FUSED] == 2 and cap.after[FUSED_QUANT] == 0
    assert sum(cap.after[op] for op in QUANT_OPS) == 2
    _check(got, module(x), quant=True)


def test_other_group_is_not_fused():
    # The group name is a constant of the op: another group's all-reduce is not this one's.
    module = build(False, dtype=torch.float32, quant=False)
    fusion = fusion_pass(torch.float32, False, group="another_group")
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    run(_input(torch.float32))
    assert fusion.matched_count == 0 and cap.after[ALL_REDUCE] == 2


def test_reduced_value_read_elsewhere_still_fuses():
    # The reduced tensor of the plain pattern is an output of the fused op: other readers
    # (here the residual, and a sum) read it from there.
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(HIDDEN, eps=1e-6, dtype=torch.float32)

        def forward(self, x):
            h = torch.ops.vllm.all_reduce(x, GROUP)
            return self.norm(h), h.sum(-1)

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
            custom_ops=["none"]))):
        module = Reader()
    fusion = fusion_pass(torch.float32, False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    x = _input(torch.float32)
    got = run(x)
    assert fusion.matched_count == 1 and cap.after[ALL_REDUCE] == 0
    want = module(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_off_without_a_shared_memory_group():
    # TP = 1 (no group, no shared memory): the pass registers nothing and matches nothing.
    fusion = AllReduceFusionPass(None, dtypes=[torch.float32], decompose=[False])
    assert fusion.group_name is None and fusion.patterns.registered == []
    module = build(False, dtype=torch.float32, quant=False)
    run, cap = compile_with_passes(module, [fusion], decompose=False)
    run(_input(torch.float32))
    assert fusion.matched_count == 0 and cap.after[ALL_REDUCE] == 2


def test_uuid_changes_with_group_and_patterns():
    a = fusion_pass(torch.float32, False)
    b = fusion_pass(torch.float32, False, group="another_group")
    c = fusion_pass(torch.float32, False, quant=False)
    assert len({a.uuid(), b.uuid(), c.uuid()}) == 3
