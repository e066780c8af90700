"""Build a model from its Hugging Face folder: meta-device construction, then the weights.

`get_model(vllm_config, load_format="auto")`:
 1. picks the class from `hf_config.architectures` (ModelRegistry);
 2. builds it on the meta device under `set_current_vllm_config` with the model dtype as
    torch's default dtype (no memory is touched, custom ops pick their forward);
 3. materialises every parameter on the platform device (ties and weight loaders kept; on
    the CPU large ones in transparent huge pages);
 4. loads `*.safetensors` (one file, or shards listed in model.safetensors.index.json) or,
    only for a folder without any safetensors, PyTorch `*.bin` files (pytorch_model.bin or the
    shards of pytorch_model.bin.index.json; torch.load with weights_only=True, memory-mapped)
    through the parameters' weight loaders, or fills random weights for load_format="dummy".
    A Hugging Face Hub model's weight files are downloaded first (at the commit its config
    was resolved to; nothing is fetched when the cache holds them);
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
from vllm.utils.hugepages import HugePageArena, weight_arena

logger = init_logger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SAFE_INDEX_NAME = "model.safetensors.index.json"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"


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
    files = _model_weight_files(model_config) if load_format != "dummy" else []
    dtype = model_config.torch_dtype or torch.float32
    device = vllm_config.platform.torch_device()
    with set_current_vllm_config(vllm_config), _default_dtype(dtype), torch.device("meta"):
        model = model_cls(vllm_config=vllm_config)
    materialize(model, device)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed=getattr(model_config, "seed", 0))
    else:
        load_safetensors_weights(model, files)
    with weight_arena():  # (CPU weights the processing makes: hugepages.weight_zeros)
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
    """Replace meta parameters by ones on `device` for the loader to fill, keeping ties (a
    shared Parameter stays shared) and attributes (weight_loader, shard_ids, ...); move
    buffers. On the CPU they are zero-filled and carved from one HugePageArena, small ones and
    large ones' tails included (vllm/utils/hugepages.py: decode streams every weight each
    step); elsewhere not initialised."""
    arena = None
    if torch.device(device).type == "cpu":
        arena = HugePageArena(sum(HugePageArena.room(p.shape, p.dtype)
                                  for p in model.parameters()))  # (ties counted once)
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(_empty_param(param, device, arena), requires_grad=False)
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


def _empty_param(param: torch.Tensor, device: torch.device | str,
                 arena: HugePageArena | None) -> torch.Tensor:
    """Storage for `param`: from the CPU's `arena`, else uninitialised on `device`."""
    if arena is not None:
        return arena.zeros(param.shape, param.dtype)
    return torch.empty_like(param, device=device)


def _model_weight_files(model_config: Any) -> list[str]:
    """The weight files of the model: a Hub model's are fetched into its snapshot first."""
    snapshot = getattr(model_config, "hub_snapshot", None)
    if snapshot is not None:
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.transformers_utils.hub import download_weights

        download_weights(snapshot, show_progress=get_tensor_model_parallel_rank() == 0)
    return weight_files(getattr(model_config, "model_path", model_config.model))


def weight_files(folder: str) -> list[str]:
    """The weight files of a model folder: the safetensors index's shards, or every
    *.safetensors; only when the folder has no safetensors at all, the same for PyTorch *.bin
    (pytorch_model.bin.index.json, or every *.bin but training state such as
    training_args.bin). The rule is `vllm.transformers_utils.hub.weight_file_names`, which
    also picks what a Hub model downloads."""
    from vllm.transformers_utils.hub import weight_file_names

    def read_index(name: str) -> Any:
        index_path = os.path.join(folder, name)
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError("no weight_map entries")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the weight index {index_path!r}: {exc}") from exc
        return {"weight_map": weight_map}

    names = [os.path.basename(p) for p in glob.glob(os.path.join(folder, "*"))
             if os.path.isfile(p)]
    chosen = weight_file_names(names, read_index)
    if not chosen:
        raise ValueError(f"no *.safetensors weight files (and no PyTorch *.bin) in model folder "
                         f"{folder!r}")
    files = [os.path.join(folder, name) for name in chosen]
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        index = SAFE_INDEX_NAME if chosen[0].endswith(".safetensors") else BIN_INDEX_NAME
        raise ValueError(f"{os.path.join(folder, index)!r} lists weight files that do not "
                         "exist: " + ", ".join(missing))
    return files


def _is_bin(path: str) -> bool:
    return not path.endswith(".safetensors")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint's state dict: torch.load with weights_only=True (no code runs from
    the file), memory-mapped where the file has the zip format (torch >= 1.6's default)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except Exception as exc:  # torch raises pickle, zip and runtime errors here
        raise WeightFileError(f"cannot read PyTorch weight file {path!r} (corrupt, truncated, or "
                              f"not a plain tensor state dict?): {_first_line(exc)}") from exc
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise WeightFileError(f"PyTorch weight file {path!r} is not a state dict of named "
                              "tensors")
    return state


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open_safetensors(path: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise WeightFileError(f"cannot read safetensors file {path!r} (corrupt or truncated?): "
                              f"{exc}") from exc


def count_tensors(files: list[str]) -> int:
    """How many tensors the files hold (safetensors: read from their headers only,
    milliseconds; *.bin: memory-mapped loads)."""
    total = 0
    for path in files:
        if _is_bin(path):
            total += len(_load_bin(path))
            continue
        with _open_safetensors(path) as handle:
            total += len(handle.keys())
    return total


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, CPU tensor) for every tensor of the safetensors (or PyTorch *.bin)
    files; a corrupt file is a ValueError."""
    for path in files:
        if _is_bin(path):
            for name, tensor in _load_bin(path).items():
                yield path, name, tensor
            continue
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
    kind = "PyTorch .bin" if files and _is_bin(files[0]) else "safetensors"
    bar = tqdm(total=count_tensors(files), desc=f"Loading {kind} weights", unit="tensor",
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
    """Random weights for benchmarks: norms the identity (weight 1, or the module's
    `identity_weight`: 0 for Gemma's (1 + w) norm), biases 0, others N(0, 0.02) (seeded)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = type(module).__name__.endswith("Norm")
            for name, param in module.named_parameters(recurse=False):
                if is_norm and name == "weight":
                    param.fill_(getattr(module, "identity_weight", 1.0))
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    values = torch.empty(param.shape, dtype=torch.float32).normal_(
                        0.0, 0.02, generator=generator)
                    param.copy_(values)
