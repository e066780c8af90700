"""Installs the `vllm` package and its `vllm` console script."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_version() -> str:
    scope: dict = {}
    exec((ROOT / "vllm" / "version.py").read_text(), scope)
    return scope["__version__"]


setup(
    name="vllm",
    version=read_version(),
    description="A clean-room, vLLM-compatible LLM inference and serving engine built around "
    "optimization levels (-O0 .. -O3).",
    packages=find_packages(include=["vllm", "vllm.*"]),
    # the C++ kernel sources (built on the user's machine at first use) and their headers
    package_data={"vllm": ["demo_model/*", "model_executor/kernels/*.cpp",
                           "model_executor/kernels/*.h", "attention/csrc/*.cpp",
                           "distributed/csrc/*.cpp", "model_executor/layers/csrc/*.cpp",
                           "model_executor/layers/csrc/*.h", "utils/csrc/*.h"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "tokenizers",
        "safetensors",
        "tqdm",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "httpx",
        "prometheus_client",
        "numpy",
        "pyzmq",
        "msgspec",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "hypothesis-jsonschema", "openai", "ruff",
                 "matplotlib", "ray[default]"],
        "ray": ["ray[default]"],
        "cuda": ["triton"],
        "bench": ["llama-cpp-python[server]", "gguf"],
    },
    entry_points={"console_scripts": ["vllm=vllm.entrypoints.cli.main:main"]},
)
