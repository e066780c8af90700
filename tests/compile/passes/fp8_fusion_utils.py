"""Helpers of the FP8 fusion-pass tests: run a small module through AOTAutograd the way our
backends do (with Inductor's decompositions for the Inductor IR, without for the eager
backend's), apply passes to the graph, count ops before and after, run the result."""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from vllm.compilation.passes.utility.post_cleanup import PostCleanupPass

QUANT_OPS = ("vllm.static_scaled_fp8_quant.default", "vllm.dynamic_scaled_fp8_quant.default")
FUSED_RMS = ("vllm.rms_norm_static_fp8_quant.default",
             "vllm.fused_add_rms_norm_static_fp8_quant.default",
             "vllm.rms_norm_dynamic_fp8_quant.default",
             "vllm.fused_add_rms_norm_dynamic_fp8_quant.default")
FUSED_ACT = ("vllm.silu_and_mul_static_fp8_quant.default",
             "vllm.silu_and_mul_dynamic_fp8_quant.default")


def op_counts(graph: fx.Graph) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            counts[str(node.target)] += 1
    return counts


def fp8_converts(graph: fx.Graph) -> int:
    """Nodes that convert to float8_e4m3fn: the plain-torch form of a quantization."""
    n = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        dtype = node.kwargs.get("dtype")
        if node.target is torch.ops.prims.convert_element_type.default:
            dtype = node.args[1]
        if dtype == torch.float8_e4m3fn and str(node.target) in (
                "aten._to_copy.default", "prims.convert_element_type.default"):
            n += 1
    return n


class Capture:
    """Result of `compile_with_passes`: op counts before/after and the final graph."""

    before: collections.Counter
    after: collections.Counter
    graph: fx.Graph
    fp8_converts_before: int
    fp8_converts_after: int


def compile_with_passes(module: torch.nn.Module, passes: Sequence[Callable[[fx.Graph], Any]],
                        decompose: bool, dynamic: bool = True,
                        functionalized_v2: bool = False) -> tuple[Callable, Capture]:
    """torch.compile(module) through AOTAutograd; `passes` run on the forward graph."""
    import torch._inductor.config as inductor_config
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    cap = Capture()

    def fw_compiler(gm: fx.GraphModule, _inputs: Any) -> Callable:
        cap.before = op_counts(gm.graph)
        cap.fp8_converts_before = fp8_converts(gm.graph)
        for graph_pass in passes:
            graph_pass(gm.graph)
        PostCleanupPass()(gm.graph)
        gm.recompile()
        cap.after = op_counts(gm.graph)
        cap.fp8_converts_after = fp8_converts(gm.graph)
        cap.graph = gm.graph
        return make_boxed_func(gm.forward)

    kwargs: dict[str, Any] = {"fw_compiler": fw_compiler, "keep_inference_input_mutations": True}
    if decompose:
        from torch._inductor.decomposition import select_decomp_table

        kwargs["decompositions"] = select_decomp_table()
    backend = aot_autograd(**kwargs)
    torch._dynamo.reset()
    # As our decorator does: no automatic dynamism (Python floats such as epsilons stay
    # constants), the token dimension marked dynamic.
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)

    def run(*args: Any) -> Any:
        if dynamic:
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                    torch._dynamo.mark_dynamic(arg, 0)
        with inductor_config.patch(enable_auto_functionalized_v2=functionalized_v2):
            return compiled(*args)

    return run, cap


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.0) -> None:
    """FP8 tensors equal bit for bit (or up to a fraction of one-step differences, for
    sums computed in another order); other tensors close."""
    if want.dtype == torch.float8_e4m3fn:
        assert got.dtype == want.dtype
        diff = got.view(torch.uint8).to(torch.int16) - want.view(torch.uint8).to(torch.int16)
        mismatch = (diff != 0).float().mean().item()
        assert mismatch <= max_mismatch, f"{mismatch:.4f} of the FP8 values differ"
        assert diff.abs().max().item() <= (1 if max_mismatch else 0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
