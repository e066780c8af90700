"""AttnQuantFusionPass: attention output followed by static per-tensor FP8 quantization ->
the attention op writing FP8 itself.

    out = empty_like(q);  auto_functionalized(unified_attention_with_output, ..., output=out)
    q8 = quant_fp8(out[, views], scale)
      -> out8 = empty_like(q, dtype=fp8)
         auto_functionalized(unified_attention_with_output, ..., output=out8,
                             output_scale=scale)

Only where the attention backend reports `fused_output_quant_supported` (the torch SDPA
backend quantizes while copying each result into the output instead of copying it and
quantizing it again). Needs attention inside the compiled graph: with this flag on and no
Inductor graph partition the config sets splitting_ops=[].

Two steps: (1) the plain-torch form of a static quant whose input is an attention output is
rewritten to the quant custom op (pattern matcher, every QuantFP8 form, model dtype); (2) every
static quant custom op reading an attention output (directly or through views, nothing else
reading it) is folded into the attention op (plain FX: the op is registered per layer name, so
a per-layer pattern would be needed otherwise). Both auto_functionalized and
auto_functionalized_v2 forms are handled. Gate: `pass_config.fuse_attn_quant`.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.inductor_pass import VllmInductorPass
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _attention_op() -> Any:
    from vllm.attention.layer import attention_op

    return attention_op.default


def _functionalized_targets() -> tuple:
    from torch._higher_order_ops.auto_functionalize import (
        auto_functionalized,
        auto_functionalized_v2,
    )

    return auto_functionalized, auto_functionalized_v2


def attention_output_chain(node: Any) -> list[fx.Node] | None:
    """[getitem, view, ...] when `node` is an attention op's output, possibly through views
    each read only by the next; else None."""
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
        if len(node.users) != 1:
            return None
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is operator.getitem and node.args[1] == 1):
        return None
    af = node.args[0]
    if not (isinstance(af, fx.Node) and af.target in _functionalized_targets()
            and af.args and af.args[0] is _attention_op()):
        return None
    return [node, *reversed(chain)]


def _backend_supports(vllm_config: VllmConfig | None) -> bool:
    from vllm.attention.selector import get_attn_backend
    from vllm.model_executor.kernels.fp8_ops import FP8_DTYPE

    head_size = 64
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        head_size = model_config.get_head_size()
    from vllm import envs

    backend = get_attn_backend(head_size, backend_name=envs.VLLM_ATTENTION_BACKEND)
    return backend.get_impl_cls().fused_output_quant_supported(FP8_DTYPE, True, True)


class AttnQuantFusionPass(VllmInductorPass):
    def __init__(self, vllm_config: VllmConfig | None = None, *,
                 backend_supported: bool | None = None,
                 dtypes: list[torch.dtype] | None = None,
                 decompose: list[bool] | None = None) -> None:
        super().__init__()
        import vllm.model_executor.kernels.fp8_ops  # noqa: F401  (defines the quant op)

        self.backend_supported = (_backend_supports(vllm_config) if backend_supported is None
                                  else backend_supported)
        if not self.backend_supported:
            logger.warning("fuse_attn_quant is on but the attention backend cannot write FP8 "
                           "output: attention + quant stays unfused")
        self.canonical = mu.FusionPatterns(f"{self.name}.canonicalize")
        for dec, dtype in mu.combinations(decompose or mu.decompositions_for(vllm_config),
                                          dtypes or mu.dtypes_for(vllm_config)):
            inputs = [mu.example((5, 256), dtype), mu.scale_example()]
            for form, quant in mu.quant_forms(mu.STATIC).items():
                if form == "custom":
                    continue  # already canonical
                self.canonical.register(
                    f"static quant[{form}] of attention output/{dtype}/"
                    f"{'decomposed' if dec else 'aten'}", *_canonicalize(quant), inputs, dec,
                    _check_attention_input(dtype))

    def apply(self, graph: fx.Graph) -> int:
        if not self.backend_supported:
            return 0
        self.canonical.patterns.apply(graph)
        quant = torch.ops.vllm.static_scaled_fp8_quant.default
        count = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is quant:
                count += self._fuse(graph, node)
        if count:
            mu.fusion_match_counter[self.name] += count
        return count

    def _fuse(self, graph: fx.Graph, quant: fx.Node) -> int:
        from vllm.model_executor.kernels.fp8_ops import FP8_DTYPE

        x, scale = quant.args[0], quant.args[1]
        chain = attention_output_chain(x)
        if chain is None or len(x.users) != 1:
            return 0
        getitem = chain[0]
        af = getitem.args[0]
        if len(af.users) != 1:
            return 0
        v2 = "_all_bases" in af.kwargs
        alloc = af.kwargs["_all_bases"][0] if v2 else af.kwargs.get("output")
        if not isinstance(alloc, fx.Node) or "dtype" not in _kwarg_names(alloc):
            return 0
        with graph.inserting_before(af):
            new_alloc = graph.call_function(alloc.target, alloc.args,
                                            {**alloc.kwargs, "dtype": FP8_DTYPE})
            new_alloc.meta = {**alloc.meta, "val": _as_fp8(alloc.meta.get("val"))}
            kwargs = dict(af.kwargs)
            kwargs["output_scale"] = scale
            if v2:
                kwargs["_all_bases"] = [new_alloc]
            else:
                kwargs["output"] = new_alloc
            new_af = graph.call_function(af.target, af.args, kwargs)
            old_val = af.meta.get("val")
            new_af.meta = dict(af.meta)
            if isinstance(old_val, (tuple, list)):
                new_af.meta["val"] = type(old_val)(
                    _as_fp8(v) if i >= 1 else v for i, v in enumerate(old_val))
            new_get = graph.call_function(operator.getitem, (new_af, 1))
            new_get.meta = {**getitem.meta, "val": _as_fp8(getitem.meta.get("val"))}
        # The views after the output are dtype-agnostic: re-point them at the FP8 output.
        first = chain[1] if len(chain) > 1 else quant
        first.replace_input_with(getitem, new_get)
        for view in chain[1:]:
            view.meta["val"] = _as_fp8(view.meta.get("val"))
        last = chain[-1] if len(chain) > 1 else new_get
        quant.replace_all_uses_with(last)
        graph.erase_node(quant)
        graph.erase_node(getitem)
        graph.erase_node(af)
        if not alloc.users:
            graph.erase_node(alloc)
        return 1

    def uuid_extra(self) -> str:
        return f"{self.backend_supported};{self.canonical.describe()}"


def _canonicalize(quant):
    def search(x, scale):
        return quant(x, scale)[0]

    def replace(x, scale):
        return torch.ops.vllm.static_scaled_fp8_quant.default(x, scale)

    return search, replace


def _kwarg_names(node: fx.Node) -> set[str]:
    schema = getattr(node.target, "_schema", None)
    return {a.name for a in schema.arguments} if schema is not None else set()


def _as_fp8(val: Any) -> Any:
    """The fake value of the same tensor in float8_e4m3fn (None stays None)."""
    from vllm.model_executor.kernels.fp8_ops import FP8_DTYPE

    if not isinstance(val, torch.Tensor):
        return val
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty_strided(val.shape, val.stride(), dtype=FP8_DTYPE, device="meta")
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=FP8_DTYPE, device=val.device)


def _check_attention_input(dtype: torch.dtype):
    def check(match: Any) -> bool:
        x = match.kwargs.get("x")
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        return (val is not None and val.dtype == dtype
                and attention_output_chain(x) is not None)

    return check
