"""Upstream's path of the CUDA-graph dispatcher; it lives in vllm/compilation/."""
from vllm.compilation.cudagraph_dispatcher import CudagraphDispatcher

__all__ = ["CudagraphDispatcher"]
