"""RMSNormQuantFusionPass: RMSNorm (with or without the residual add) followed by FP8
quantization of its output -> one fused op.

    y = rms_norm(x, w, eps);            q[, s] = quant_fp8(y[, scale])
      -> q[, s] = rms_norm_{static,dynamic}_fp8_quant(x, w, [scale,] eps[, group_size])
    y, r = rms_norm(x, w, eps, residual); q[, s] = quant_fp8(y[, scale])
      -> q[, s], r = fused_add_rms_norm_{static,dynamic}_fp8_quant(...)

for static per-tensor, dynamic per-token and dynamic per-group scales, every form of RMSNorm
and QuantFP8 (see matcher_utils), epsilons 1e-5 / 1e-6 / the model's, at the model dtype.
Fused-add patterns are registered first: the plain pattern is a sub-pattern of it.
The fused op reads the row once (C++ on the CPU, Triton on CUDA) and gives the same bits as
the unfused pair. Gate: `pass_config.fuse_norm_quant`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.inductor_pass import VllmInductorPass

if TYPE_CHECKING:
    from vllm.config import VllmConfig

HIDDEN = 256  # example width: a multiple of every group size we register


class RMSNormQuantFusionPass(VllmInductorPass):
    def __init__(self, vllm_config: VllmConfig | None = None, *,
                 schemes: list[mu.QuantScheme] | None = None,
                 dtypes: list[torch.dtype] | None = None,
                 decompose: list[bool] | None = None) -> None:
        super().__init__()
        import vllm.model_executor.kernels.fp8_ops  # noqa: F401  (defines the fused ops)

        self.patterns = mu.FusionPatterns(self.name)
        self.schemes = schemes if schemes is not None else mu.schemes_for(vllm_config)
        for dec, dtype, eps, scheme in mu.combinations(
                decompose or mu.decompositions_for(vllm_config),
                dtypes or mu.dtypes_for(vllm_config), mu.epsilons_for(vllm_config),
                self.schemes):
            for residual in (True, False):  # fused-add first: plain is its sub-pattern
                self._register(dec, dtype, eps, scheme, residual)

    def _register(self, decompose: bool, dtype: torch.dtype, eps: float,
                  scheme: mu.QuantScheme, residual: bool) -> None:
        x = mu.example((5, HIDDEN), dtype)
        weight = mu.example((HIDDEN,), dtype)
        inputs: list[Any] = [x, mu.example((5, HIDDEN), dtype)] if residual else [x]
        inputs.append(weight)
        if scheme.static:
            inputs.append(mu.scale_example())
        fused = _fused_op(scheme, residual)
        group = scheme.op_group_size
        for (rms_name, rms), (quant_name, quant) in mu.combinations(
                mu.rms_forms(eps).items(), mu.quant_forms(scheme).items()):
            search, replace = _functions(rms, quant, fused, scheme, residual, eps, group)
            name = (f"{'fused_add_' if residual else ''}rms[{rms_name}]+quant[{quant_name}]"
                    f"/{scheme}/{dtype}/eps={eps}/{'decomposed' if decompose else 'aten'}")
            names = ["x", "residual", "weight"] if residual else ["x", "weight"]
            self.patterns.register(name, search, replace, inputs, decompose,
                                   mu.same_dtype_check(dtype, names))

    def apply(self, graph: fx.Graph) -> int:
        return self.patterns.apply(graph)

    def uuid_extra(self) -> str:
        return self.patterns.describe()


def _fused_op(scheme: mu.QuantScheme, residual: bool) -> Any:
    ops = torch.ops.vllm
    if scheme.static:
        return (ops.fused_add_rms_norm_static_fp8_quant if residual
                else ops.rms_norm_static_fp8_quant).default
    return (ops.fused_add_rms_norm_dynamic_fp8_quant if residual
            else ops.rms_norm_dynamic_fp8_quant).default


def _functions(rms, quant, fused, scheme: mu.QuantScheme, residual: bool, eps: float,
               group: int):
    """(search, replace) with the argument names the pattern matcher binds."""
    if scheme.static and residual:
        def search(x, residual, weight, scale):
            y, res = rms(x, weight, residual)
            return quant(y, scale)[0], res

        def replace(x, residual, weight, scale):
            return fused(x, residual, weight, scale, eps)
    elif scheme.static:
        def search(x, weight, scale):
            return quant(rms(x, weight), scale)[0]

        def replace(x, weight, scale):
            return fused(x, weight, scale, eps)
    elif residual:
        def search(x, residual, weight):
            y, res = rms(x, weight, residual)
            q, s = quant(y)
            return q, s, res

        def replace(x, residual, weight):
            return fused(x, residual, weight, eps, group)
    else:
        def search(x, weight):
            return quant(rms(x, weight))

        def replace(x, weight):
            return fused(x, weight, eps, group)
    return search, replace
