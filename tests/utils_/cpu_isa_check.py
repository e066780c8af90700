"""Run in a subprocess by test_cpu_isa.py, with VLLM_CPU_ISA set: build (or load) the CPU
kernels at that level, check that each library reports it, and compare the linear, paged
attention and greedy-sampling kernels with their torch references. Prints one JSON line."""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))


def check_linear() -> tuple[int, dict[str, list[str]]]:
    """The cases checked, and the small-M kernel's inner loops they took per dtype."""
    from vllm.model_executor.layers import cpu_linear

    assert cpu_linear.small_m_linear_available(), "the linear kernel did not build"
    cases = 0
    loops: dict[str, set[str]] = {}
    gen = torch.Generator().manual_seed(0)
    # odd K and N: shorter than one vector step, odd steps, several K blocks; 3+ rows with a
    # large K take the tiled path (weight rows side by side)
    for n, k in [(5, 7), (37, 61), (130, 33), (67, 515), (29, 2053)]:
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k, generator=gen).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype)
            for rows in range(1, 18):
                x = torch.randn(rows, k + 5, generator=gen).to(dtype)[:, 2:k + 2]  # strided
                want = x.double() @ w.double().t() + b.double()
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                got = cpu_linear.small_m_linear(x, w, b)
                torch.testing.assert_close(got.double(), want, atol=tol * math.sqrt(k),
                                           rtol=tol)
                loop = torch.ops.vllm_cpu_linear.small_m_loop(x, w)
                loops.setdefault(str(dtype).removeprefix("torch."), set()).add(loop)
                got = torch.ops.vllm_cpu_linear.linear(x, w, b)  # the dispatcher's route
                torch.testing.assert_close(got.double(), F.linear(x, w, b).double(),
                                           atol=tol * math.sqrt(k), rtol=tol)
                cases += 1
    return cases, {dtype: sorted(names) for dtype, names in loops.items()}


def check_panels() -> int:
    """The panel kernel at this level (float32; bfloat16 where the build packs it: AVX2) against
    a float64 product, and the dispatcher's route with a prepacked weight: the panel copy for
    the rows `panel_rows` / `bf16_packed_rows` give, F.linear's result on every route."""
    from vllm.model_executor.layers import cpu_linear
    from vllm.model_executor.layers.cpu_prepacked_linear import prepack

    op = torch.ops.vllm_cpu_linear
    gen = torch.Generator().manual_seed(1)
    dtypes = [torch.float32] + ([torch.bfloat16] if op.bf16_panels() else [])
    cases = 0
    for dtype in dtypes:
        lo, hi = (cpu_linear.panel_rows() if dtype == torch.float32
                  else cpu_linear.bf16_packed_rows())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for n, k in [(5, 7), (37, 61), (67, 515)]:
            w = torch.nn.Parameter(torch.randn(n, k, generator=gen).to(dtype),
                                   requires_grad=False)
            b = torch.randn(n, generator=gen).to(dtype)
            panels = op.pack_panels(w)
            assert panels.dtype == dtype
            assert prepack(w)
            for rows in (1, 4, 7, 13, 16, 17, 64, 70, 129):
                x = torch.randn(rows, k + 5, generator=gen).to(dtype)[:, 2:k + 2]  # strided
                want = x.double() @ w.double().t() + b.double()
                got = op.panel_linear(x, panels, n, b)
                assert got.dtype == dtype
                torch.testing.assert_close(got.double(), want, atol=tol * math.sqrt(k), rtol=tol)
                route = cpu_linear.linear_route(x, w, b)
                assert (route == "packed") == (lo <= rows <= hi), (dtype, rows, route)
                torch.testing.assert_close(op.linear(x, w, b).double(),
                                           F.linear(x, w, b).double(),
                                           atol=tol * math.sqrt(k), rtol=tol)
                cases += 1
    return cases


def check_attention() -> int:
    from test_cpu_paged_kernel import make_batch

    from vllm.attention.backends.cpu_paged_kernel import (
        cpu_paged_attention_available,
        paged_attention,
        paged_attention_reference,
    )

    assert cpu_paged_attention_available(), "the attention kernel did not build"
    cases = 0
    requests = [(9, 1), (0, 7), (5, 3), (30, 1), (13, 40), (0, 1), (15, 1)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # (the last: a sliding window and soft-capping, in the lanes and two-pass paths)
        for heads, kv_heads, head_size, block_size, window, cap in [
                (4, 4, 16, 4, None, None), (14, 2, 64, 16, None, None),
                (8, 1, 40, 8, None, None), (8, 8, 64, 16, 24, 20.0)]:
            query, cache, table, seq_lens, starts = make_batch(requests, heads, kv_heads,
                                                               head_size, block_size, dtype)
            scale = 1 / math.sqrt(head_size)
            reqs = torch.arange(len(requests))
            out = torch.full(query.shape, 7.0, dtype=dtype)
            ref = torch.zeros(query.shape, dtype=dtype)
            paged_attention(query, cache, table, seq_lens, starts, reqs, scale, out, window, cap)
            paged_attention_reference(query, cache, table, seq_lens, starts, reqs, scale, ref,
                                      window, cap)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
            cases += 1
    return cases


def check_sampling() -> int:
    from vllm.model_executor.layers.sampler import greedy_argmax
    from vllm.utils.cpu_kernels import cpu_extension_loaded

    gen = torch.Generator().manual_seed(0)
    cases = 0
    for vocab in (1, 15, 17, 1000, 151937):
        logits = torch.randn(5, vocab, generator=gen)
        logits[1, vocab // 2] = 100.0
        logits[2] = 3.0  # ties: the first index
        if vocab > 3:
            logits[3, 3] = float("nan")  # the first NaN's index, as torch
        logits[4] = float("-inf")
        torch.testing.assert_close(greedy_argmax(logits), logits.argmax(dim=-1))
        cases += 1
    assert cpu_extension_loaded("sampling"), "the sampling kernel did not build"
    return cases


def main() -> None:
    from vllm.utils.cpu_kernels import kernels_isa_level, loaded_isa_level

    linear_cases, small_m_loops = check_linear()
    report = {"level": kernels_isa_level(), "linear_cases": linear_cases,
              "small_m_loops": small_m_loops, "panel_cases": check_panels(),
              "attention_cases": check_attention(), "sampling_cases": check_sampling()}
    report["built"] = {
        "small_m_linear": [loaded_isa_level("small_m_linear"), torch.ops.vllm_cpu_linear.isa()],
        "paged_attention": [loaded_isa_level("paged_attention"), torch.ops.vllm_cpu_attn.isa()],
        "sampling": [loaded_isa_level("sampling"), torch.ops.vllm_cpu_sampling.isa()],
    }
    report["bf16_dot"] = torch.ops.vllm_cpu_linear.has_bf16_dot()
    report["bf16_panels"] = torch.ops.vllm_cpu_linear.bf16_panels()
    from vllm.config import VllmConfig

    report["summary_line"] = VllmConfig().summary_line()  # the engine's start-up line
    print(json.dumps(report))


if __name__ == "__main__":
    main()
