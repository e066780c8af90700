"""Mixtral: Llama attention with a sparse mixture of experts in place of the MLP.

Router: softmax over the experts, keep the top `num_experts_per_tok`, renormalise them to sum
to one (as transformers does). Checkpoint names: `block_sparse_moe.gate.weight` and
`block_sparse_moe.experts.{e}.w1/w2/w3.weight` (gate, down, up), loaded into the stacked
`experts.w13_weight` / `experts.w2_weight`; or, as transformers 5 writes them with
`save_original_format=False`, `mlp.gate.weight` and every expert stacked in
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I].
"""
from typing import Any

import torch
import torch.nn as nn

from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, maybe_prefix


class MixtralMoE(nn.Module):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False,
                                     quant_config=None, prefix=maybe_prefix(prefix, "gate"))
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                                config.hidden_size, config.intermediate_size,
                                renormalize=True, activation=config.hidden_act,
                                prefix=maybe_prefix(prefix, "experts"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def _init_mlp(self, config: Any, quant_config: Any, prefix: str) -> None:
        self.block_sparse_moe = MixtralMoE(config, quant_config,
                                           prefix=maybe_prefix(prefix, "block_sparse_moe"))

    def _mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(hidden_states)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v")]

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.expert_params_mapping = FusedMoE.make_expert_params_mapping(
            self.config.num_local_experts)
        self.stacked_expert_params_mapping = FusedMoE.make_stacked_expert_params_mapping()

    def _load_one(self, name: str, tensor: torch.Tensor,
                  params: dict[str, nn.Parameter]) -> str | None:
        if ".mlp." in name:  # transformers 5's own layout: the MoE block is named `mlp`
            name = name.replace(".mlp.", ".block_sparse_moe.")
            for param_part, ckpt_suffix, shard_id in self.stacked_expert_params_mapping:
                if name.endswith(ckpt_suffix):
                    param_name = name[:-len(ckpt_suffix)] + param_part
                    param = params.get(param_name)
                    if param is None:
                        return None
                    param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=None)
                    return param_name
        return super()._load_one(name, tensor, params)

    def _load_expert_weight(self, name: str, tensor: torch.Tensor,
                            params: dict[str, nn.Parameter]) -> str | None:
        for param_part, ckpt_part, expert_id, shard_id in self.expert_params_mapping:
            if ckpt_part not in name:
                continue
            param_name = name.replace(ckpt_part, param_part)
            param = params.get(param_name)
            if param is None:
                return None
            param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
            return f"{param_name}:{expert_id}.{shard_id}"
        return None
