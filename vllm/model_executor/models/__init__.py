"""Model implementations; `ModelRegistry` maps architecture names to them lazily."""
from vllm.model_executor.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
