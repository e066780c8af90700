"""Token embedding and LM head split over tensor-parallel ranks by vocabulary rows.

Each rank holds rows [vocab_start, vocab_end) of the (padded) vocabulary; rows past the real
vocabulary are zero. At TP=1 the layers are a plain embedding / weight holder.
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
from vllm.model_executor.layers.linear import copy_checked, prepacking_wanted, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> embeddings [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition,
                                   num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not "
                             f"match a vocabulary of {self.num_embeddings} rows")
        rows = self.vocab_end_index - self.vocab_start_index
        shard = loaded_weight.narrow(0, self.vocab_start_index, rows)
        copy_checked(param.data[:rows], shard)
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        embeddings = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1)
        return tensor_model_parallel_all_reduce(embeddings)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection's weight, split like the embedding (LogitsProcessor applies it).

    With `compilation_config.prepack_linear_weights` (the CPU at -O2/-O3) its weight gets a
    prepacked copy (column panels) after loading, like the decoder's linears: the LM head is
    the largest product of a decode step (151936 x 896 on Qwen2.5-0.5B: 16 rows in 14 ms with
    oneDNN's reorder against 25 ms on the plain weight, measured here), and batch-1..4 steps
    keep reading the plain weight through the small-M kernel. The copy costs the weight's size
    again in memory (a tied embedding keeps its own table for the lookups)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, prefix)
        self.want_prepack = prepacking_wanted()
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition,
                                                 dtype=self.weight.dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's weight (tie_word_embeddings)."""
        self.weight = embed_tokens.weight
        return self

    def process_weights_after_loading(self) -> None:
        """Queue the (loaded, possibly tied) weight for prepacking (finished in the background,
        after ready if need be)."""
        if self.want_prepack:
            from vllm.model_executor.layers.cpu_prepacked_linear import prepack_in_background

            prepack_in_background(self.weight)

    def forward(self, input_):
        raise RuntimeError("ParallelLMHead holds the LM head weight; apply it with "
                           "LogitsProcessor (model.compute_logits)")
