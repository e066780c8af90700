"""The shared-memory all-reduce between two spawned CPU ranks: sums equal to gloo's at several
sizes and dtypes (beyond the size limit: gloo itself), the fused all-reduce + residual add +
RMSNorm (+ static FP8 quant) op against the unfused reference, the segment's clean-up (the
name is gone from /dev/shm once both ranks attached), a dead peer is an error instead of a
hang, and the environment switch."""
from __future__ import annotations

import multiprocessing
import os
import socket
import traceback

import pytest
import torch

MAX_BYTES = 64 * 1024  # small limit: the gloo fallback runs at small sizes too


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, init_method, env, queue):
    os.environ.update(env)
    try:
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        init_distributed_environment(world, rank, "gloo", init_method)
        initialize_model_parallel(world)
        queue.put((rank, "ok", fn(rank)))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int = 2, env: dict[str, str] | None = None, timeout: float = 240):
    """Run fn(rank) on `world` spawned ranks of a TP group; their return values by rank."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    env = {"VLLM_SHM_ALLREDUCE_MAX_BYTES": str(MAX_BYTES), **(env or {})}
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world, init, env, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _sums(rank):
    import torch.distributed as dist

    from vllm.distributed import (
        destroy_distributed_environment,
        get_tp_group,
        tensor_model_parallel_all_reduce,
    )
    from vllm.distributed.all_reduce_ops import reference_rms_norm

    tp = get_tp_group()
    comm = tp.shm_all_reduce
    assert comm is not None
    # Unlinked by rank 0 once every rank attached: nothing is left to clean up after a crash.
    # (The barrier: the other ranks may get here before rank 0 has unlinked it.)
    dist.barrier(group=tp.group)
    assert not os.path.exists("/dev/shm" + comm.name)
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((1,), (1, 896), (7, 896), (16, 1024), (16, 4096)):
            gen = torch.Generator().manual_seed(rank * 1000 + shape[-1] + len(shape))
            x = torch.randn(shape, generator=gen).to(dtype)
            got = tensor_model_parallel_all_reduce(x)
            want = x.clone()
            dist.all_reduce(want, group=tp.group)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, want), (dtype, shape)
            checked.append((str(dtype), shape, comm.usable(x)))
    # A non-contiguous input.
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8).t() * (rank + 1)
    assert torch.equal(tensor_model_parallel_all_reduce(x), x * 3 / (rank + 1))

    fused = []
    group = tp.group.group_name
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 5, 40):  # 40 x 1024 bf16 = 80 KiB: beyond the limit (gloo + torch)
            gen = torch.Generator().manual_seed(rank + tokens)
            x = torch.randn(tokens, 1024, generator=gen).to(dtype)
            shared = torch.Generator().manual_seed(7 + tokens)  # the same on both ranks
            residual = torch.randn(tokens, 1024, generator=shared).to(dtype)
            weight = (torch.rand(1024, generator=shared) + 0.5).to(dtype)
            scale = torch.tensor([0.05])
            reduced = x.clone()
            dist.all_reduce(reduced, group=tp.group)
            for res in (residual, None):
                y, r = torch.ops.vllm.fused_all_reduce_rms_norm(x, res, weight, 1e-6, group)
                ry, rr = reference_rms_norm(reduced, res, weight, 1e-6, None)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(y, ry, rtol=tol, atol=tol)
                torch.testing.assert_close(r, rr, rtol=tol, atol=tol)
                q, r = torch.ops.vllm.fused_all_reduce_rms_norm_static_fp8_quant(
                    x, res, weight, scale, 1e-6, group)
                rq, _ = reference_rms_norm(reduced, res, weight, 1e-6, scale)
                assert q.dtype == torch.float8_e4m3fn
                diff = (q.view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()
                assert (diff != 0).float().mean() < 0.01 and diff.max() <= 1
                fused.append((y.float().sum().item(), q.view(torch.uint8).sum().item()))
    destroy_distributed_environment()
    return checked, fused, comm.name


def test_two_ranks_sum_like_gloo_and_clean_up():
    results = run_ranks(_sums)
    checked, fused0, name = results[0]
    _, fused1, _ = results[1]
    assert {usable for *_, usable in checked} == {True, False}  # both paths ran
    assert fused0 == fused1  # both ranks computed the same bits
    assert not os.path.exists("/dev/shm" + name)


def _peer_exits(rank):
    import time

    from vllm.distributed import tensor_model_parallel_all_reduce

    if rank == 1:
        os._exit(0)  # dies without calling the all-reduce
    time.sleep(0.5)
    start = time.monotonic()
    try:
        tensor_model_parallel_all_reduce(torch.ones(16))
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_dead_peer_is_an_error_not_a_hang():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {"VLLM_SHM_ALLREDUCE_MAX_BYTES": str(MAX_BYTES)}
    procs = [ctx.Process(target=_entry, args=(_peer_exits, r, 2, init, env, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, status, (message, waited) = queue.get(timeout=240)
        assert rank == 0 and status == "ok"
        assert "rank 1" in message and "exited" in message, message
        assert waited < 30
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _switched_off(rank):
    from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

    tp = get_tp_group()
    x = torch.full((4, 8), float(rank + 1))
    # The fused op works without a segment too (gloo, then the norm in torch).
    y, r = torch.ops.vllm.fused_all_reduce_rms_norm(x, None, torch.ones(8), 1e-6,
                                                     tp.group.group_name)
    return (tp.shm_all_reduce is None, tensor_model_parallel_all_reduce(x)[0, 0].item(),
            r[0, 0].item())


def test_switch_off_keeps_gloo():
    results = run_ranks(_switched_off, env={"VLLM_CPU_SHM_ALLREDUCE": "0"})
    assert results[0] == (True, 3.0, 3.0) and results[1] == (True, 3.0, 3.0)


def test_bad_max_bytes_is_a_clear_error(monkeypatch):
    from vllm.distributed.shm_all_reduce import max_bytes_from_env

    monkeypatch.setenv("VLLM_SHM_ALLREDUCE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="VLLM_SHM_ALLREDUCE_MAX_BYTES='lots'"):
        max_bytes_from_env()
