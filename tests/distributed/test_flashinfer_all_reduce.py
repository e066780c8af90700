"""FlashInfer's fused all-reduce on CUDA, wired through a stand-in `flashinfer.comm` (no GPU
here): the workspace each TP rank creates (sizes, the ranks agreeing, cleanup), the call each
fused op makes (pattern, which outputs, the residual, the scale), the dispatch in the graph
ops (fused within the workspace's limit, torch.distributed beyond), the TP all-reduce emitted
as the op the pass matches, and the compile-cache key. The real kernel needs two Hopper or
Blackwell GPUs (tests/distributed/test_flashinfer_all_reduce_gate.py skips it elsewhere)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from vllm.distributed import all_reduce_ops, parallel_state
from vllm.distributed import flashinfer_all_reduce as fi
from vllm.distributed.all_reduce_ops import reference_rms_norm

HIDDEN = 64
WORLD = 2
GROUP = "test_flashinfer_group"


class FakeWorkspace:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.destroyed = False

    def destroy(self) -> None:
        self.destroyed = True


class FakeComm:
    """flashinfer.comm's unified API, computed in torch: every rank holds the same input, so
    the sum over the ranks is WORLD times it."""

    class AllReduceFusionPattern:
        kAllReduce = 0
        kARResidualRMSNorm = 1
        kARResidualRMSNormFP8Quant = 2

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.workspaces: list[FakeWorkspace] = []
        self.calls: list[dict] = []

    def create_allreduce_fusion_workspace(self, **kwargs):
        if self.fail:
            raise RuntimeError("cudaIpcOpenMemHandle failed\nmore detail")
        ws = FakeWorkspace(**kwargs)
        self.workspaces.append(ws)
        return ws

    def allreduce_fusion(self, *, input, workspace, pattern, residual_in, residual_out,
                         norm_out, quant_out, rms_gamma, rms_eps, scale_factor, **rest):
        self.calls.append(dict(pattern=pattern, norm_out=norm_out, quant_out=quant_out,
                               residual_in=residual_in, scale_factor=scale_factor, **rest))
        summed = input * workspace.kwargs["world_size"] + residual_in
        residual_out.copy_(summed)
        x = summed.float()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)).to(input.dtype)
        y = y * rms_gamma
        if pattern == self.AllReduceFusionPattern.kARResidualRMSNormFP8Quant:
            finfo = torch.finfo(torch.float8_e4m3fn)
            quant_out.copy_((y.float() / scale_factor).clamp(finfo.min, finfo.max))
        else:
            norm_out.copy_(y)
        return quant_out if quant_out is not None else norm_out


def vllm_config(fuse: bool = True, budget: int | None = 8192, dtype=torch.bfloat16):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(fuse_allreduce_rms=fuse)),
        model_config=SimpleNamespace(get_hidden_size=lambda: HIDDEN, torch_dtype=dtype),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget))


def tp_group(backend: str = "nccl", world: int = WORLD) -> parallel_state.GroupCoordinator:
    return parallel_state.GroupCoordinator(group=SimpleNamespace(group_name=GROUP),
                                           rank_in_group=1, world_size=world,
                                           ranks=list(range(world)), backend=backend)


@pytest.fixture
def comm(monkeypatch):
    """The stand-in flashinfer.comm, FlashInfer 'installed', and the other rank agreeing with
    whatever this one reports (all_gather_object over a world of WORLD)."""
    fake = FakeComm()
    monkeypatch.setattr(fi, "flashinfer_comm", lambda: fake)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object()
                        if name == "flashinfer" else real_find_spec(name, *a))
    other = {"view": None}

    def all_gather_object(views, mine, group=None):
        for i in range(len(views)):
            views[i] = mine if i == 1 or other["view"] is None else other["view"]

    monkeypatch.setattr("torch.distributed.all_gather_object", all_gather_object)
    fake.other = other
    yield fake
    fi.destroy_flashinfer_all_reduce()


def test_workspace_sized_by_the_limit_and_the_token_budget(comm):
    tp = tp_group()
    fused = fi.init_flashinfer_all_reduce(tp, vllm_config(budget=4096), capability=(9, 0))
    assert fused is not None and fi.get_flashinfer_all_reduce(GROUP) is fused
    assert fi.get_group(GROUP) is tp.group
    kwargs = comm.workspaces[0].kwargs
    # Hopper, 2 ranks: 64 MiB of bf16 rows of 64 = 524288 tokens, capped by the budget.
    assert kwargs == {"backend": "trtllm", "world_size": WORLD, "rank": 1,
                      "max_token_num": 4096, "hidden_dim": HIDDEN, "dtype": torch.bfloat16,
                      "group": tp.group}
    assert fused.max_tokens == 4096
    # 8 ranks on Hopper: 0.5 MiB / (64 x 2 bytes) = 4096 tokens, below a budget of 8192.
    fi.destroy_flashinfer_all_reduce()
    assert comm.workspaces[0].destroyed and fi.get_flashinfer_all_reduce(GROUP) is None
    fused = fi.init_flashinfer_all_reduce(tp_group(world=8), vllm_config(budget=8192),
                                          capability=(9, 0))
    assert fused.max_tokens == 4096


def test_nothing_without_the_fusion_or_off_cuda(comm):
    assert fi.init_flashinfer_all_reduce(tp_group(), vllm_config(fuse=False), (9, 0)) is None
    assert fi.init_flashinfer_all_reduce(tp_group("gloo"), vllm_config(), (9, 0)) is None
    assert fi.init_flashinfer_all_reduce(tp_group(world=1), vllm_config(), (9, 0)) is None
    assert comm.workspaces == []


@pytest.mark.parametrize("capability, world, reason", [
    ((8, 0), 2, "compute capability (8, 0)"),
    ((9, 0), 3, "world size 3"),
])
def test_unsupported_hardware_keeps_the_unfused_all_reduce(comm, caplog, capability, world,
                                                           reason):
    caplog.set_level(logging.WARNING, logger="vllm")
    assert fi.init_flashinfer_all_reduce(tp_group(world=world), vllm_config(),
                                         capability) is None
    assert comm.workspaces == []
    assert reason in caplog.text and "all-reduces unfused" in caplog.text


def test_a_rank_that_cannot_create_it_makes_every_rank_unfused(comm, caplog):
    caplog.set_level(logging.WARNING, logger="vllm")
    comm.other["view"] = (False, "creating the workspace failed: out of memory")
    assert fi.init_flashinfer_all_reduce(tp_group(), vllm_config(), (10, 0)) is None
    assert comm.workspaces[0].destroyed  # this rank's own workspace is freed again
    assert fi.get_flashinfer_all_reduce(GROUP) is None
    assert "out of memory" in caplog.text


def test_this_ranks_failure_is_reported_in_one_line(comm, caplog):
    caplog.set_level(logging.WARNING, logger="vllm")
    comm.fail = True
    assert fi.init_flashinfer_all_reduce(tp_group(), vllm_config(), (9, 0)) is None
    assert "cudaIpcOpenMemHandle failed" in caplog.text and "more detail" not in caplog.text


def make_fused(comm, max_tokens: int = 16, dtype=torch.float32) -> fi.FlashInferAllReduce:
    ws = comm.create_allreduce_fusion_workspace(world_size=WORLD)
    return fi.FlashInferAllReduce(comm, ws, SimpleNamespace(group_name=GROUP), WORLD, 0,
                                  max_tokens, HIDDEN, dtype)


def inputs(tokens: int = 5, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_call_norm(comm, with_residual):
    fused = make_fused(comm)
    x, residual, weight = inputs()
    y, res = fused.all_reduce_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    call = comm.calls[-1]
    assert call["pattern"] == FakeComm.AllReduceFusionPattern.kARResidualRMSNorm
    assert call["quant_out"] is None and call["norm_out"] is not None
    assert call["launch_with_pdl"] is True and call["fp32_acc"] is True
    if not with_residual:  # FlashInfer always adds a residual: zeros
        assert torch.count_nonzero(call["residual_in"]) == 0
    ref_y, ref_res = reference_rms_norm(x * WORLD, residual if with_residual else None,
                                        weight, 1e-5, None)
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(res, ref_res)


def test_fused_call_static_fp8_quant(comm):
    fused = make_fused(comm)
    x, residual, weight = inputs()
    scale = torch.tensor([0.02])
    q, res = fused.all_reduce_rms_norm(x, residual, weight, 1e-5, scale)
    call = comm.calls[-1]
    assert call["pattern"] == FakeComm.AllReduceFusionPattern.kARResidualRMSNormFP8Quant
    assert call["norm_out"] is None and call["scale_factor"] is scale
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    ref_q, ref_res = reference_rms_norm(x * WORLD, residual, weight, 1e-5, scale)
    torch.testing.assert_close(q.float(), ref_q.float(), atol=0.07, rtol=0.07)
    torch.testing.assert_close(res, ref_res)


def test_shapes_beyond_the_workspace_are_not_usable(comm):
    fused = make_fused(comm, max_tokens=16, dtype=torch.bfloat16)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    assert not fused.usable(x)  # a CPU tensor
    # The size rules on their own, for a stand-in CUDA tensor:
    for shape, dtype, ok in (((16, HIDDEN), torch.bfloat16, True),
                             ((17, HIDDEN), torch.bfloat16, False),
                             ((4, HIDDEN * 2), torch.bfloat16, False),
                             ((4, HIDDEN), torch.float16, False)):
        t = SimpleNamespace(is_cuda=True, dtype=dtype, shape=shape, numel=lambda s=shape:
                            s[0] * s[1], dim=lambda: 2)
        assert fused.usable(t) is ok, (shape, dtype)


@pytest.fixture
def registered(comm, monkeypatch):
    """A FlashInfer workspace registered for GROUP that accepts CPU tensors of up to 8 tokens,
    and torch.distributed's all-reduce replaced by a recorder (sum over WORLD equal ranks)."""
    fused = make_fused(comm, max_tokens=8)
    monkeypatch.setattr(fi.FlashInferAllReduce, "usable",
                        lambda self, x: x.shape[-1] == HIDDEN and x.numel() // HIDDEN <= 8)
    monkeypatch.setitem(fi._FUSED, GROUP, fused)
    unfused = []

    def torch_all_reduce(x, group_name):
        unfused.append(group_name)
        return x * WORLD

    monkeypatch.setattr(all_reduce_ops, "_torch_all_reduce", torch_all_reduce)
    return unfused


@pytest.mark.parametrize("quant", [False, True])
def test_graph_ops_fuse_within_the_limit_and_fall_back_beyond(comm, registered, quant):
    for tokens, expect_fused in ((8, True), (9, False)):
        x, residual, weight = inputs(tokens)
        scale = torch.tensor([0.02]) if quant else None
        calls, unfused = len(comm.calls), len(registered)
        if quant:
            y, res = torch.ops.vllm.fused_all_reduce_rms_norm_static_fp8_quant(
                x, residual, weight, scale, 1e-6, GROUP)
        else:
            y, res = torch.ops.vllm.fused_all_reduce_rms_norm(x, residual, weight, 1e-6, GROUP)
        assert (len(comm.calls) - calls, len(registered) - unfused) == (
            (1, 0) if expect_fused else (0, 1))
        ref_y, ref_res = reference_rms_norm(x * WORLD, residual, weight, 1e-6, scale)
        torch.testing.assert_close(res, ref_res)
        tol = 0.07 if quant else 1e-5
        torch.testing.assert_close(y.float(), ref_y.float(), atol=tol, rtol=tol)
    # The plain all-reduce op is torch.distributed's (FlashInfer fuses, it does not replace).
    x = torch.ones(2, HIDDEN)
    assert torch.equal(torch.ops.vllm.all_reduce(x, GROUP), x * WORLD)
    assert registered[-1] == GROUP


def test_the_tp_all_reduce_is_the_op_the_pass_matches(comm, monkeypatch):
    from vllm.compilation.passes.fusion.allreduce_rms_fusion import tp_group_name
    from vllm.distributed import tensor_model_parallel_all_reduce

    tp = tp_group()
    monkeypatch.setattr(parallel_state, "_TP", tp)
    assert tp_group_name() is None  # NCCL without a workspace: torch's collective

    def targets() -> list[str]:
        gm = make_fx(tensor_model_parallel_all_reduce, tracing_mode="fake")(torch.ones(2, 4))
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    tp.flashinfer_all_reduce = make_fused(comm)
    assert tp.all_reduce_is_fusable and tp_group_name() == GROUP
    assert targets() == ["vllm.all_reduce.default"]


def test_destroy_model_parallel_frees_the_workspace(comm, monkeypatch):
    tp = tp_group()
    tp.flashinfer_all_reduce = fi.init_flashinfer_all_reduce(tp, vllm_config(), (9, 0))
    monkeypatch.setattr(parallel_state, "_TP", tp)
    parallel_state.destroy_model_parallel()
    assert comm.workspaces[0].destroyed and fi.get_flashinfer_all_reduce(GROUP) is None
