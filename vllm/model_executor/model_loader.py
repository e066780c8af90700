"""Build a model from its Hugging Face folder: meta-device construction, then safetensors.

`get_model(vllm_config, load_format="auto")`:
 1. picks the class from `hf_config.architectures` (ModelRegistry);
 2. builds it on the meta device under `set_current_vllm_config` with the model dtype as
    torch's default dtype (no memory is touched, custom ops pick their forward);
 3. materialises every parameter on the platform device (ties and weight loaders kept);
 4. loads `*.safetensors` (one file, or shards listed in model.safetensors.index.json)
    through the parameters' weight loaders, or fills random weights for load_format="dummy";
 5. checks every parameter (and every part of a packed one) was loaded.
Every user-facing failure is a ValueError naming the file or tensor.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from vllm.logger import init_logger
from vllm.model_executor.custom_op import warn_unused_custom_ops
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.registry import ModelRegistry

logger = init_logger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SAFE_INDEX_NAME = "model.safetensors.index.json"


class WeightFileError(ValueError):
    """A weight file that cannot be read."""


def get_model(vllm_config: Any, load_format: str | None = "auto") -> nn.Module:
    """The model of `vllm_config.model_config`, on the platform device, ready for inference."""
    from vllm.config import set_current_vllm_config

    model_config = vllm_config.model_config
    if model_config is None:
        raise ValueError("get_model needs a VllmConfig with a model_config")
    load_format = _resolve_load_format(vllm_config, load_format)
    _check_tensor_parallel(vllm_config)
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures)
    files = weight_files(model_config.model) if load_format != "dummy" else []
    dtype = model_config.torch_dtype or torch.float32
    device = vllm_config.platform.torch_device()
    with set_current_vllm_config(vllm_config), _default_dtype(dtype), torch.device("meta"):
        model = model_cls(vllm_config=vllm_config)
    materialize(model, device)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed=getattr(model_config, "seed", 0))
    else:
        load_safetensors_weights(model, files)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif isinstance(module, ParallelLMHead):
            module.process_weights_after_loading()
    warn_unused_custom_ops(model, vllm_config.compilation_config.custom_ops)
    if getattr(model, "attention_layers", None) is None:
        from vllm.attention.layer import collect_attention_layers

        model.attention_layers = collect_attention_layers(model)
    logger.info("Loaded %s (%s, %s) on %s with load_format=%s", arch, model_config.model,
                str(dtype).replace("torch.", ""), device, load_format)
    return model.eval()


def _check_tensor_parallel(vllm_config: Any) -> None:
    from vllm.distributed import get_tensor_model_parallel_world_size

    wanted = vllm_config.parallel_config.tensor_parallel_size
    actual = get_tensor_model_parallel_world_size()
    if wanted != actual:
        raise RuntimeError(
            f"tensor_parallel_size={wanted} but the tensor-parallel group has {actual} "
            "rank(s): call init_distributed_environment() and initialize_model_parallel() "
            "in every worker before get_model()")


def _resolve_load_format(vllm_config: Any, load_format: str | None) -> str:
    if load_format in (None, "auto"):
        configured = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
        load_format = configured or "auto"
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of "
                         + ", ".join(LOAD_FORMATS))
    return load_format


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Replace meta parameters by uninitialised ones on `device`, keeping ties (a shared
    Parameter stays shared) and attributes (weight_loader, shard_ids, ...); move buffers."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            module._parameters[name] = new
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                raise RuntimeError(f"buffer {name!r} of {type(module).__name__} was built on the "
                                   "meta device; build buffers on the CPU explicitly")
            module._buffers[name] = buf.to(device)


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder (the index's shards, or every *.safetensors)."""
    index_path = os.path.join(folder, SAFE_INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the safetensors index {index_path!r}: {exc}") from exc
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise ValueError(f"{index_path!r} lists weight files that do not exist: "
                             + ", ".join(missing))
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.bin")))
        hint = (f" (found {', '.join(others)}: PyTorch .bin checkpoints are not supported; "
                "convert them to safetensors)") if others else ""
        raise ValueError(f"no *.safetensors weight files in model folder {folder!r}{hint}")
    return files


def _open_safetensors(path: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise WeightFileError(f"cannot read safetensors file {path!r} (corrupt or truncated?): "
                              f"{exc}") from exc


def count_tensors(files: list[str]) -> int:
    """How many tensors the files hold (read from their headers only: milliseconds)."""
    total = 0
    for path in files:
        with _open_safetensors(path) as handle:
            total += len(handle.keys())
    return total


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, CPU tensor) for every tensor; a corrupt file is a ValueError."""
    for path in files:
        with _open_safetensors(path) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise WeightFileError(f"cannot read tensor {name!r} from {path!r} (corrupt or "
                                     f"truncated?): {exc}") from exc
                yield path, name, tensor


def load_safetensors_weights(model: nn.Module, files: list[str],
                             show_progress: bool | None = None) -> None:
    """Load `files` through the model's weight loaders, with a tqdm bar of the tensors loaded
    on stderr (`show_progress`; None: on tensor-parallel rank 0 only)."""
    from tqdm.auto import tqdm

    if show_progress is None:
        from vllm.distributed import get_tensor_model_parallel_rank

        show_progress = get_tensor_model_parallel_rank() == 0
    current: dict[str, str] = {}
    bar = tqdm(total=count_tensors(files), desc="Loading safetensors weights", unit="tensor",
               disable=not show_progress, dynamic_ncols=True,
               postfix=f"{len(files)} file{'s' if len(files) > 1 else ''}")

    def named_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path, name, tensor in iterate_safetensors(files):
            current["file"], current["name"] = path, name
            yield name, tensor
            bar.update(1)  # the loader has taken the tensor in

    try:
        with torch.no_grad():
            loaded = model.load_weights(named_tensors())
    except WeightFileError:
        raise
    except ValueError as exc:
        where = f" (tensor {current.get('name')!r} in {current.get('file')!r})" if current else ""
        raise ValueError(f"{exc}{where}") from exc
    finally:
        bar.close()
    missing = missing_parameters(model, loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10
                                            else "")
        raise ValueError(f"the checkpoint in {os.path.dirname(files[0])!r} is missing tensors "
                         f"for: {shown}")


def missing_parameters(model: nn.Module, loaded: set[str]) -> list[str]:
    """Checkpoint-style names of the parameters (or packed parts) nothing was loaded into."""
    missing = []
    for name, param in model.named_parameters():
        if name in loaded:
            continue
        shards = getattr(param, "shard_ids", None)
        if not shards:
            missing.append(name)
            continue
        for shard in shards:
            if f"{name}:{shard}" not in loaded:
                missing.append(_checkpoint_name(model, name, shard))
    return missing


def _checkpoint_name(model: nn.Module, param_name: str, shard: Any) -> str:
    for param_part, ckpt_part, shard_id in getattr(model, "stacked_params_mapping", []):
        if shard_id == shard and param_part in param_name:
            return param_name.replace(param_part, ckpt_part)
    for param_part, ckpt_part, expert_id, shard_id in getattr(model, "expert_params_mapping",
                                                               []):
        if f"{expert_id}.{shard_id}" == str(shard) and param_part in param_name:
            return param_name.replace(param_part, ckpt_part)
    return f"{param_name} (part {shard})"


def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: norms 1, biases 0, others N(0, 0.02) (seeded)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, 0.02, generator=generator)
                param.copy_(values)
