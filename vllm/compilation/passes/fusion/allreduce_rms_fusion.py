"""AllReduceFusionPass: the tensor-parallel all-reduce followed by RMSNorm (with or without
the residual add), and optionally by a static FP8 quantization of the norm's output -> one
fused op.

    r = all_reduce(x);  y = rms_norm(r, w, eps)                 -> y, r = fused(x, None, w)
    r = all_reduce(x);  y, res = rms_norm(r, w, eps, residual)  -> y, res = fused(x, residual, w)
    ... ;  q = quant_fp8(y, scale)                              -> q, res = fused_quant(...)

`all_reduce` is `torch.ops.vllm.all_reduce(x, group_name)`, the op
`tensor_model_parallel_all_reduce` emits when the group has a fusable all-reduce; `fused` is
`torch.ops.vllm.fused_all_reduce_rms_norm` (`..._static_fp8_quant`), both in
vllm/distributed/all_reduce_ops.py: on the CPU it sums the ranks' rows in shared memory, adds
the residual, normalises and quantises each row while it is in cache; on CUDA it is
FlashInfer's fused all-reduce (vllm/distributed/flashinfer_all_reduce.py). The plain pattern returns
the reduced tensor too: a decoder's first norm has no residual, and the reduced embedding is
the next layer's residual.

Every form of RMSNorm (native, ATen) and of QuantFP8 (native, custom op) is registered, at
the model dtype and epsilons, for the Inductor and the eager IR (see matcher_utils), with the
TP group's name (a constant of the op). Quantized patterns are registered before plain ones
and residual ones before plain ones (each plain pattern is a sub-pattern of the other).
Gate: `pass_config.fuse_allreduce_rms` (vllm/config/levels.py: TP > 1 and a platform with the
fused kernel).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.inductor_pass import VllmInductorPass

if TYPE_CHECKING:
    from vllm.config import VllmConfig

HIDDEN = 256


def tp_group_name() -> str | None:
    """The name of this process's tensor-parallel group when it all-reduces through the op
    the pass matches (None: nothing to match)."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp.group.group_name if tp.all_reduce_is_fusable else None


class AllReduceFusionPass(VllmInductorPass):
    def __init__(self, vllm_config: VllmConfig | None = None, *,
                 group_name: str | None = None,
                 dtypes: list[torch.dtype] | None = None,
                 decompose: list[bool] | None = None,
                 quant: bool | None = None) -> None:
        super().__init__(vllm_config)
        import vllm.model_executor.kernels.fp8_ops  # noqa: F401  (the quant ops)
        from vllm.distributed.all_reduce_ops import pattern_tracing

        self.group_name = group_name if group_name is not None else tp_group_name()
        self.patterns = mu.FusionPatterns(self.name, tracing_context=pattern_tracing)
        if self.group_name is None:
            return
        if quant is None:
            quant = mu.STATIC in mu.schemes_for(vllm_config)
        for dec, dtype, eps in mu.combinations(
                decompose or mu.decompositions_for(vllm_config),
                dtypes or mu.dtypes_for(vllm_config), mu.epsilons_for(vllm_config)):
            for with_quant in ((True, False) if quant else (False,)):
                for residual in (True, False):
                    self._register(dec, dtype, eps, with_quant, residual)

    def _register(self, decompose: bool, dtype: torch.dtype, eps: float, quant: bool,
                  residual: bool) -> None:
        inputs: list[Any] = [mu.example((5, HIDDEN), dtype)]
        if residual:
            inputs.append(mu.example((5, HIDDEN), dtype))
        inputs.append(mu.example((HIDDEN,), dtype))
        if quant:
            inputs.append(mu.scale_example())
        quant_forms = mu.quant_forms(mu.STATIC).items() if quant else [("none", None)]
        for (rms_name, rms), (quant_name, qfn) in mu.combinations(mu.rms_forms(eps).items(),
                                                                  quant_forms):
            search, replace = _functions(rms, qfn, residual, eps, self.group_name)
            name = (f"all_reduce+{'fused_add_' if residual else ''}rms[{rms_name}]"
                    f"{f'+quant[{quant_name}]' if quant else ''}/{dtype}/eps={eps}/"
                    f"{'decomposed' if decompose else 'aten'}/group={self.group_name}")
            names = ["x", "residual", "weight"] if residual else ["x", "weight"]
            self.patterns.register(name, search, replace, inputs, decompose,
                                   mu.same_dtype_check(dtype, names))

    def apply(self, graph: fx.Graph) -> int:
        if self.group_name is None:
            return 0
        return self.patterns.apply(graph)

    def uuid_extra(self) -> str:
        return f"{self.group_name}|{self.patterns.describe()}"


def _functions(rms, quant, residual: bool, eps: float, group: str):
    """(search, replace) with the argument names the pattern matcher binds."""
    ops = torch.ops.vllm
    all_reduce = ops.all_reduce.default
    plain = ops.fused_all_reduce_rms_norm.default
    fused_quant = ops.fused_all_reduce_rms_norm_static_fp8_quant.default

    if quant is not None and residual:
        def search(x, residual, weight, scale):
            y, res = rms(all_reduce(x, group), weight, residual)
            return quant(y, scale)[0], res

        def replace(x, residual, weight, scale):
            out = fused_quant(x, residual, weight, scale, eps, group)
            return out[0], out[1]
    elif quant is not None:
        def search(x, weight, scale):
            reduced = all_reduce(x, group)
            return quant(rms(reduced, weight), scale)[0], reduced

        def replace(x, weight, scale):
            out = fused_quant(x, None, weight, scale, eps, group)
            return out[0], out[1]
    elif residual:
        def search(x, residual, weight):
            y, res = rms(all_reduce(x, group), weight, residual)
            return y, res

        def replace(x, residual, weight):
            out = plain(x, residual, weight, eps, group)
            return out[0], out[1]
    else:
        def search(x, weight):
            reduced = all_reduce(x, group)
            return rms(reduced, weight), reduced

        def replace(x, weight):
            out = plain(x, None, weight, eps, group)
            return out[0], out[1]
    return search, replace
