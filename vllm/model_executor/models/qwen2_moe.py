"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (q/k/v bias from `qkv_bias`, none on o_proj,
per-layer sliding windows from `layer_types`) with a sparse mixture of experts plus one
shared expert in place of the MLP.

MoE block, per token x [H]:
  probs = softmax(gate(x)) in float32 over `num_experts`; keep the top `num_experts_per_tok`,
  rescaled to sum to one only when `norm_topk_prob` (False in Qwen1.5-MoE);
  out = sum_k w_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
where each expert and the shared expert are gated SiLU MLPs (sizes `moe_intermediate_size`
and `shared_expert_intermediate_size`). Layer i has the MoE block when it is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; otherwise a dense MLP of
`intermediate_size`.

Tensor parallelism: experts split along their intermediate size (FusedMoE), the shared expert
column/row parallel as a Llama MLP, the router and the shared-expert gate replicated. The
routed and shared partial sums are added before one all-reduce (the sigmoid gate is the same
on every rank, so scaling a partial sum scales the total).

Checkpoint names: `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (Hub
checkpoints and transformers 5's default `save_pretrained`) or the stacked
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (transformers 5 with
`save_original_format=False`), `mlp.shared_expert.{gate,up,down}_proj.weight`,
`mlp.shared_expert_gate.weight`.
"""
import re
from typing import Any

import torch
import torch.nn as nn

from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    layer_types_sliding_window,
    maybe_prefix,
)

# "...mlp.experts.7.up_proj.weight" -> experts "...mlp.experts", expert 7, proj "up_proj".
_PER_EXPERT_NAME = re.compile(
    r"^(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_SHARD_OF_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PARAM_OF_PROJ = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}


def layer_index(prefix: str) -> int:
    """The layer number at the end of a decoder layer's prefix ("model.layers.3" -> 3)."""
    last = prefix.rsplit(".", 1)[-1]
    if not last.isdigit():
        raise ValueError(f"cannot tell the layer index from the module prefix {prefix!r}; "
                         "expected it to end with '.<layer number>'")
    return int(last)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has the MoE block (transformers' rule): not listed in
    `mlp_only_layers`, experts configured, and (layer_idx + 1) divisible by
    `decoder_sparse_step`."""
    step = getattr(config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"the model config's decoder_sparse_step must be an integer >= 1, "
                         f"got {step!r}")
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    return (layer_idx not in mlp_only and getattr(config, "num_experts", 0) > 0
            and (layer_idx + 1) % step == 0)


class Qwen2MoeSparseMoeBlock(nn.Module):
    """forward(hidden [T, H]) -> [T, H]: routed experts plus an optional gated shared expert
    (`shared_intermediate_size` 0: none, as in Qwen3-MoE)."""

    def __init__(self, config: Any, shared_intermediate_size: int, quant_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False,
                                     quant_config=None, prefix=maybe_prefix(prefix, "gate"))
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                                reduce_results=False, activation=config.hidden_act,
                                prefix=maybe_prefix(prefix, "experts"))
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size > 0:
            self.shared_expert = LlamaMLP(config.hidden_size, shared_intermediate_size,
                                          config.hidden_act, quant_config=quant_config,
                                          prefix=maybe_prefix(prefix, "shared_expert"))
            # Summed with the routed partials below, then reduced once.
            self.shared_expert.down_proj.reduce_results = False
            self.shared_expert_gate = ReplicatedLinear(
                config.hidden_size, 1, bias=False, quant_config=None,
                prefix=maybe_prefix(prefix, "shared_expert_gate"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        if self.experts.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    # The window only with use_sliding_window, on the layers layer_types marks sliding.
    layer_sliding_window = staticmethod(layer_types_sliding_window)

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    @staticmethod
    def shared_expert_size(config: Any) -> int:
        return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)

    def _init_mlp(self, config: Any, quant_config: Any, prefix: str) -> None:
        if is_sparse_layer(config, layer_index(prefix)):
            self.mlp = Qwen2MoeSparseMoeBlock(config, self.shared_expert_size(config),
                                              quant_config, prefix=maybe_prefix(prefix, "mlp"))
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                quant_config=quant_config, prefix=maybe_prefix(prefix, "mlp"))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        num_experts = self.config.num_experts
        self.expert_params_mapping = FusedMoE.make_expert_params_mapping(
            num_experts, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj")
        self.stacked_expert_params_mapping = FusedMoE.make_stacked_expert_params_mapping()

    def _expert_target(self, name: str) -> tuple[str, str, int | None] | None:
        """(parameter name, shard id, expert id or None for a stacked tensor) of an expert
        checkpoint tensor; None for any other name."""
        match = _PER_EXPERT_NAME.match(name)
        if match is not None:
            proj = match["proj"]
            return (f"{match['experts']}.{_PARAM_OF_PROJ[proj]}", _SHARD_OF_PROJ[proj],
                    int(match["expert"]))
        for param_part, ckpt_suffix, shard_id in self.stacked_expert_params_mapping:
            if name.endswith(ckpt_suffix):
                return name[:-len(ckpt_suffix)] + param_part, shard_id, None
        return None

    def _load_expert_weight(self, name: str, tensor: torch.Tensor,
                            params: dict[str, nn.Parameter]) -> str | None:
        target = self._expert_target(name)
        param = params.get(target[0]) if target is not None else None
        if param is None:
            return None
        param_name, shard_id, expert_id = target
        param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
        # A stacked tensor fills every expert's part of the parameter at once.
        return param_name if expert_id is None else f"{param_name}:{expert_id}.{shard_id}"
