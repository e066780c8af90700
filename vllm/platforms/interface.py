"""The Platform interface: what a device can do and which level defaults it owns."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.levels import OptimizationLevel


class PlatformEnum(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


class Platform:
    """Base class. A subclass owns its level defaults through `level_table` (data)."""

    _enum: PlatformEnum
    device_name: str = ""
    device_type: str = ""
    dist_backend: str = "gloo"
    simple_compile_backend: str = "inductor"
    default_max_num_batched_tokens: int = 8192
    default_max_num_seqs: int = 256
    level_table: ClassVar[dict[OptimizationLevel, dict[str, Any]]] = {}
    """This platform's own level table: where it differs from the base table, leaf by leaf,
    each a `vllm.config.levels.Setting(value, reason)`. `VllmConfig` applies it after the
    base table, with the same code (vllm/config/levels.py)."""

    def __init__(self, forced: bool = False) -> None:
        self.forced = forced
        """True when chosen by VLLM_PLATFORM rather than detected."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(forced={self.forced})"

    # ---- identity ----------------------------------------------------------------------
    def is_cpu(self) -> bool:
        return self._enum == PlatformEnum.CPU

    def is_cuda(self) -> bool:
        return self._enum == PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self._enum == PlatformEnum.ROCM

    def is_cuda_alike(self) -> bool:
        return self._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM)

    # ---- capabilities ------------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether the hardware is present in this process."""
        raise NotImplementedError

    def verify_can_run(self) -> None:
        """Raise a clear error when a model cannot run here (a forced platform without its
        hardware may resolve configs but not run models)."""
        if not self.is_available():
            raise RuntimeError(
                f"The platform {self.device_name!r} was forced with VLLM_PLATFORM but its hardware "
                "is not available in this process: configs can be resolved (vllm config), but "
                "models cannot run. Unset VLLM_PLATFORM to use the detected platform.")

    def support_static_graph_mode(self) -> bool:
        """Whether CUDA graphs (or an equivalent) can be captured. (A platform without them
        says so in its level table too: `cudagraph_mode` NONE, required, at every level.)"""
        return False

    def supports_allreduce_rms_fusion(self, vllm_config: VllmConfig) -> bool:
        return False

    def get_device_capability(self) -> tuple[int, int] | None:
        return None

    def is_device_capability_family(self, capability: int) -> bool:
        """Whether the device's compute capability has the major version of `capability`
        (written as major x 10 + minor: 100 = Blackwell 10.x)."""
        current = self.get_device_capability()
        return current is not None and current[0] == capability // 10

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device_type)

    # ---- config hooks ------------------------------------------------------------------
    def resolve_auto_dtype(self, model_config: ModelConfig) -> tuple[str, str]:
        """The compute dtype for dtype="auto" (its torch name, e.g. "bfloat16"), and the reason
        for the choice. A name, so that resolving a config needs no torch."""
        name = model_config.checkpoint_dtype
        return name, f"checkpoint dtype {name}"
