"""ActivationQuantFusionPass: SiluAndMul followed by FP8 quantization of its output -> one
fused op.

    y = silu_and_mul(x);  q[, s] = quant_fp8(y[, scale])
      -> q = silu_and_mul_static_fp8_quant(x, scale)
      -> q, s = silu_and_mul_dynamic_fp8_quant(x, group_size)   (per token or per group)

for every form of SiluAndMul and QuantFP8 (see matcher_utils), at the model dtype. The fused
op reads [gate | up] once and writes only the FP8 result (the activation in the model dtype
is never stored). Gate: `pass_config.fuse_act_quant`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.passes.fusion import matcher_utils as mu
from vllm.compilation.passes.inductor_pass import VllmInductorPass

if TYPE_CHECKING:
    from vllm.config import VllmConfig

WIDTH = 512  # example [gate | up] width: twice a multiple of every group size we register


class ActivationQuantFusionPass(VllmInductorPass):
    def __init__(self, vllm_config: VllmConfig | None = None, *,
                 schemes: list[mu.QuantScheme] | None = None,
                 dtypes: list[torch.dtype] | None = None,
                 decompose: list[bool] | None = None) -> None:
        super().__init__()
        import vllm.model_executor.kernels.fp8_ops  # noqa: F401  (defines the fused ops)

        self.patterns = mu.FusionPatterns(self.name)
        self.schemes = schemes if schemes is not None else mu.schemes_for(vllm_config)
        for dec, dtype, scheme in mu.combinations(
                decompose or mu.decompositions_for(vllm_config),
                dtypes or mu.dtypes_for(vllm_config), self.schemes):
            self._register(dec, dtype, scheme)

    def _register(self, decompose: bool, dtype: torch.dtype, scheme: mu.QuantScheme) -> None:
        inputs: list[Any] = [mu.example((5, WIDTH), dtype)]
        if scheme.static:
            inputs.append(mu.scale_example())
        for (act_name, act), (quant_name, quant) in mu.combinations(
                mu.silu_forms().items(), mu.quant_forms(scheme).items()):
            search, replace = _functions(act, quant, scheme)
            name = (f"silu_and_mul[{act_name}]+quant[{quant_name}]/{scheme}/{dtype}/"
                    f"{'decomposed' if decompose else 'aten'}")
            self.patterns.register(name, search, replace, inputs, decompose,
                                   mu.same_dtype_check(dtype, ["x"]))

    def apply(self, graph: fx.Graph) -> int:
        return self.patterns.apply(graph)

    def uuid_extra(self) -> str:
        return self.patterns.describe()


def _functions(act, quant, scheme: mu.QuantScheme):
    if scheme.static:
        fused = torch.ops.vllm.silu_and_mul_static_fp8_quant.default

        def search(x, scale):
            return quant(act(x), scale)[0]

        def replace(x, scale):
            return fused(x, scale)
        return search, replace

    fused = torch.ops.vllm.silu_and_mul_dynamic_fp8_quant.default
    group = scheme.op_group_size

    def search(x):
        return quant(act(x))

    def replace(x):
        return fused(x, group)
    return search, replace
