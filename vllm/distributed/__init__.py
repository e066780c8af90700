"""Tensor parallelism: process groups and the collectives layers call."""
from vllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = ["destroy_distributed_environment", "destroy_model_parallel",
           "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
           "get_pp_group",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
           "init_distributed_environment", "initialize_model_parallel",
           "model_parallel_is_initialized", "tensor_model_parallel_all_gather",
           "tensor_model_parallel_all_reduce"]
