"""Mixture of experts with stacked expert weights, in plain PyTorch.

`FusedMoE` holds every expert's gate/up projection in one tensor `w13_weight [E, 2*I, H]`
(gate rows first) and the down projections in `w2_weight [E, H, I]`, with I split over
tensor-parallel ranks. `forward(hidden [T, H], router_logits [T, E]) -> [T, H]`.

Checkpoints store experts either one tensor per expert and projection (Mixtral's
`experts.{e}.w1.weight`, Qwen-MoE's `experts.{e}.gate_proj.weight`: see
`make_expert_params_mapping`) or, as transformers 5 holds them in memory (and saves them with
`save_original_format=False`), stacked over the experts: `experts.gate_up_proj [E, 2*I, H]`
(gate rows first) and `experts.down_proj [E, H, I]` (see
`make_stacked_expert_params_mapping`; loaded with `expert_id=None`).

The expert computation is the custom op `vllm::fused_moe_experts`, opaque to Dynamo, so the
model's forward stays free of data-dependent shapes: inside it, tokens are sorted by expert
and each expert multiplies only its own tokens (one host sync for the per-expert counts, cheap
on the CPU). While a CUDA graph is being captured it uses a sync-free dense form instead
(every expert on every token, weighted by a zero/non-zero routing matrix).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.linear import copy_checked, divide, set_weight_attrs


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), keep the top k, optionally rescale them to sum to 1.
    Returns (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate_up = F.linear(x, w13)
    inter = gate_up.shape[-1] // 2
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)


def fused_experts_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Sort (token, expert) pairs by expert; each expert runs one matmul on its tokens."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_index = order // top_k
    sorted_x = hidden.index_select(0, token_index)
    sorted_y = torch.empty_like(sorted_x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            sorted_y[start:end] = _expert_mlp(sorted_x[start:end], w13[expert], w2[expert])
            start = end
    weights = topk_weights.reshape(-1).index_select(0, order).to(hidden.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token_index, sorted_y * weights.unsqueeze(-1))


def fused_experts_dense(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """No host syncs: every expert on every token, weighted by its routing weight (0 if not
    chosen). E/k times the work of the grouped form; for graph capture and tiny batches."""
    num_experts = w13.shape[0]
    routing = torch.zeros(hidden.shape[0], num_experts, dtype=topk_weights.dtype,
                          device=hidden.device).scatter_(1, topk_ids, topk_weights)
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        weight = routing[:, expert].to(hidden.dtype).unsqueeze(-1)
        out += _expert_mlp(hidden, w13[expert], w2[expert]) * weight
    return out


def fused_moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return fused_experts_dense(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_grouped(hidden, w13, w2, topk_weights, topk_ids)


def _fused_moe_experts_fake(hidden, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(hidden)


# Registered through a library fragment, as the attention op is, not `torch.library.custom_op`:
# custom_op wraps the implementation in torch's "disable Dynamo" decorator, whose first call
# imports Dynamo (~0.8 s of a start-up, at every level, also where nothing is compiled or a
# warm start loads the compiled pieces without it), and checks arguments on every call.
_lib = torch.library.Library("vllm", "FRAGMENT")  # noqa: TOR901
_lib.define("fused_moe_experts(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, "
            "Tensor topk_ids) -> Tensor")
_lib.impl("fused_moe_experts", fused_moe_experts, "CompositeExplicitAutograd")
torch.library.register_fake("vllm::fused_moe_experts", _fused_moe_experts_fake, lib=_lib)


class FusedMoE(nn.Module):

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None, renormalize: bool = True,
                 reduce_results: bool = True, activation: str = "silu",
                 prefix: str = "") -> None:
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"MoE activation {activation!r} is not supported; supported: silu")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        dtype = params_dtype or torch.get_default_dtype()
        inter = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size,
                                                   dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype),
                                      requires_grad=False)
        experts = range(num_experts)
        set_weight_attrs(self.w13_weight, {
            "weight_loader": self.weight_loader,
            "shard_ids": [f"{e}.{w}" for e in experts for w in ("w1", "w3")]})
        set_weight_attrs(self.w2_weight, {"weight_loader": self.weight_loader,
                                          "shard_ids": [f"{e}.w2" for e in experts]})

    @staticmethod
    def make_expert_params_mapping(num_experts: int, ckpt_gate_proj_name: str = "w1",
                                   ckpt_down_proj_name: str = "w2",
                                   ckpt_up_proj_name: str = "w3",
                                   ) -> list[tuple[str, str, int, str]]:
        """(parameter name part, checkpoint name part, expert id, shard id) for each expert
        projection, e.g. ("experts.w13_weight", "experts.3.w1.weight", 3, "w1")."""
        mapping = []
        for expert in range(num_experts):
            for shard_id, ckpt_name in (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                                        ("w3", ckpt_up_proj_name)):
                param = "experts.w2_weight" if shard_id == "w2" else "experts.w13_weight"
                mapping.append((param, f"experts.{expert}.{ckpt_name}.weight", expert, shard_id))
        return mapping

    @staticmethod
    def make_stacked_expert_params_mapping(ckpt_gate_up_proj_name: str = "gate_up_proj",
                                           ckpt_down_proj_name: str = "down_proj",
                                           ) -> list[tuple[str, str, str]]:
        """(parameter name part, checkpoint name suffix, shard id) for checkpoints that stack
        every expert in one tensor per projection: ("experts.w13_weight",
        "experts.gate_up_proj", "w13") and ("experts.w2_weight", "experts.down_proj", "w2").
        Match the suffix with `endswith` (a per-expert name never ends so)."""
        return [("experts.w13_weight", f"experts.{ckpt_gate_up_proj_name}", "w13"),
                ("experts.w2_weight", f"experts.{ckpt_down_proj_name}", "w2")]

    def _load_stacked(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      weight_name: str, shard_id: str) -> None:
        """Every expert at once: w13 [E, 2*I, H] (gate rows, then up rows) or w2 [E, H, I]."""
        inter, full = self.intermediate_size_per_partition, self.intermediate_size
        start = self.tp_rank * inter
        if shard_id == "w13":
            expected = (self.num_experts, 2 * full, self.hidden_size)
        elif shard_id == "w2":
            expected = (self.num_experts, self.hidden_size, full)
        else:
            raise ValueError(f"{weight_name}: a stacked MoE tensor's shard id must be w13 or "
                             f"w2, got {shard_id!r}")
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"{weight_name}: stacked expert tensor of shape "
                             f"{tuple(loaded_weight.shape)} does not fit {expected} "
                             f"(num_experts, ...)")
        if shard_id == "w13":
            copy_checked(param.data.narrow(1, 0, inter), loaded_weight.narrow(1, start, inter))
            copy_checked(param.data.narrow(1, inter, inter),
                         loaded_weight.narrow(1, full + start, inter))
        else:
            copy_checked(param.data, loaded_weight.narrow(2, start, inter))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      weight_name: str = "", shard_id: str = "",
                      expert_id: int | None = -1) -> None:
        """One expert's projection (`expert_id` in [0, E); shard id w1 gate, w3 up, w2 down)
        or, with `expert_id=None`, every expert stacked (shard id w13 or w2)."""
        if expert_id is None:
            self._load_stacked(param, loaded_weight, weight_name, shard_id)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{weight_name}: expert id {expert_id} is out of range "
                             f"(num_experts={self.num_experts})")
        inter = self.intermediate_size_per_partition
        if shard_id in ("w1", "w3"):  # gate / up: [I, H], split by rows
            shard = loaded_weight.narrow(0, self.tp_rank * inter, inter)
            offset = 0 if shard_id == "w1" else inter
            copy_checked(param.data[expert_id].narrow(0, offset, inter), shard)
        elif shard_id == "w2":  # down: [H, I], split by columns
            copy_checked(param.data[expert_id], loaded_weight.narrow(1, self.tp_rank * inter,
                                                                      inter))
        else:
            raise ValueError(f"{weight_name}: MoE shard id must be w1, w2 or w3, got "
                             f"{shard_id!r}")

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = torch.ops.vllm.fused_moe_experts(hidden_states, self.w13_weight, self.w2_weight,
                                               topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"hidden_size={self.hidden_size}, "
                f"intermediate_size_per_partition={self.intermediate_size_per_partition}")
