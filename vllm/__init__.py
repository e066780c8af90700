"""A clean-room, vLLM-compatible inference engine built around optimization levels."""
from vllm.utils.omp_env import apply_omp_env_defaults as _apply_omp_env_defaults
from vllm.version import __version__

# torch's OpenMP runtime reads its wait policy once, at torch's import: set it before then.
_apply_omp_env_defaults()

# Heavy modules (torch, transformers) load on first use, so `import vllm` stays cheap.
_LAZY = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "EngineArgs": "vllm.engine.arg_utils",
    "LLMEngine": "vllm.engine.llm_engine",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
    "AsyncLLMEngine": "vllm.engine.async_llm",
    "TextPrompt": "vllm.inputs",
    "TokensPrompt": "vllm.inputs",
    "OptimizationLevel": "vllm.config.vllm",
    "CompilationConfig": "vllm.config.compilation",
    "CompilationMode": "vllm.config.compilation",
    "CUDAGraphMode": "vllm.config.compilation",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
