"""FlashInfer's fused all-reduce (+ residual add + RMSNorm [+ static FP8 quant]) on CUDA: when
it can serve the AllReduce+RMSNorm fusion, and the per-group workspace that calls it.

Upstream enables it for tensor parallelism over 2, 4 or 8 GPUs of compute capability 9.0
(Hopper) or 10.x (datacenter Blackwell) with FlashInfer installed, for inputs up to a size
that depends on the capability and the world size (beyond it: the unfused all-reduce).
`fusion_supported` is what `CudaPlatform.supports_allreduce_rms_fusion` asks (without
importing FlashInfer); the level then turns `fuse_allreduce_rms` on.

With the fusion on, each worker creates its tensor-parallel group's workspace after the
groups exist (`init_flashinfer_all_reduce`, collective over the group: FlashInfer's unified
API, `flashinfer.comm.create_allreduce_fusion_workspace` with the TRT-LLM backend, sized for
min(the size limit, the scheduler's token budget) rows of the model's hidden size and dtype).
From then on the group's all-reduce is emitted as `torch.ops.vllm.all_reduce`, the op the
pass matches, and the fused ops (vllm/distributed/all_reduce_ops.py) call
`flashinfer.comm.allreduce_fusion` for tensors within the workspace's limit. A rank that
cannot create the workspace makes every rank keep the unfused all-reduce.

Multi-GPU FlashInfer cannot be checked on one GPU: the wiring is tested on the CPU against a
stand-in `flashinfer.comm` (tests/distributed/test_flashinfer_all_reduce.py); the test that
runs the real kernel skips without two Hopper or Blackwell GPUs and FlashInfer.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

WORLD_SIZES = (2, 4, 8)

MAX_INPUT_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 0.5},
    100: {2: 64, 4: 32, 8: 1},
}
"""Largest all-reduce input (MiB) fused per capability (major*10 + minor, Blackwell under 100)
and world size; larger inputs take the unfused path."""


def _family(capability: tuple[int, int]) -> int | None:
    if tuple(capability) == (9, 0):
        return 90
    if capability[0] == 10:
        return 100
    return None


def fusion_supported(world_size: int, capability: tuple[int, int] | None,
                     flashinfer_present: bool | None = None) -> tuple[bool, str]:
    """(usable, why) for FlashInfer's fused all-reduce at this world size and capability."""
    if world_size < 2:
        return False, "one rank: no all-reduce"
    if world_size not in WORLD_SIZES:
        return False, f"world size {world_size} (FlashInfer fuses 2, 4 or 8 ranks)"
    if capability is None or _family(capability) is None:
        return False, f"compute capability {capability} (needs 9.0 or 10.x)"
    if flashinfer_present is None:
        flashinfer_present = importlib.util.find_spec("flashinfer") is not None
    if not flashinfer_present:
        return False, "FlashInfer is not installed"
    return True, f"FlashInfer fused all-reduce ({world_size} ranks, sm{_family(capability)})"


def max_tokens(world_size: int, capability: tuple[int, int], hidden_size: int,
               element_size: int) -> int:
    """Most tokens whose all-reduce input fits FlashInfer's limit (0: none)."""
    family = _family(capability)
    if family is None or world_size not in WORLD_SIZES or hidden_size <= 0:
        return 0
    limit = int(MAX_INPUT_MB[family][world_size] * (1 << 20))
    return limit // (hidden_size * element_size)


def flashinfer_comm() -> Any | None:
    """flashinfer.comm when it has the unified fused all-reduce API (imported only when asked,
    which only CUDA does); None otherwise."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        import flashinfer.comm as comm
    except ImportError:
        return None
    if hasattr(comm, "allreduce_fusion") and hasattr(comm, "create_allreduce_fusion_workspace"):
        return comm
    return None


# ---- the workspace of a tensor-parallel group ----------------------------------------------
@dataclass
class FlashInferAllReduce:
    """This rank's FlashInfer workspace for one tensor-parallel group."""

    comm: Any  # flashinfer.comm
    workspace: Any
    group: Any
    world_size: int
    rank: int
    max_tokens: int
    hidden_size: int
    dtype: torch.dtype

    def usable(self, x: torch.Tensor) -> bool:
        """Within what the workspace was made for (the same on every rank: shapes agree)."""
        return (x.is_cuda and x.dtype == self.dtype and x.dim() >= 1
                and x.shape[-1] == self.hidden_size
                and x.numel() // self.hidden_size <= self.max_tokens)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                            weight: torch.Tensor, epsilon: float,
                            scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of sum + residual, or its static FP8 quant; sum + residual), in one kernel.
        FlashInfer's patterns all add a residual: without one it adds zeros, so the second
        output is the reduced tensor itself."""
        patterns = self.comm.AllReduceFusionPattern
        rows = x.reshape(-1, self.hidden_size).contiguous()
        residual_in = (residual.reshape(-1, self.hidden_size).contiguous()
                       if residual is not None else torch.zeros_like(rows))
        residual_out = torch.empty_like(rows)
        if scale is not None:
            out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
            pattern, norm_out, quant_out = patterns.kARResidualRMSNormFP8Quant, None, out
        else:
            out = torch.empty_like(rows)
            pattern, norm_out, quant_out = patterns.kARResidualRMSNorm, out, None
        self.comm.allreduce_fusion(
            input=rows, workspace=self.workspace, pattern=pattern,
            launch_with_pdl=True, trigger_completion_at_end=True,
            residual_out=residual_out, norm_out=norm_out, quant_out=quant_out,
            residual_in=residual_in, rms_gamma=weight, rms_eps=epsilon,
            # The static scale as the unfused quant takes it (x / scale), as upstream passes it.
            scale_factor=scale, use_oneshot=None, fp32_acc=True)
        return out.view(x.shape), residual_out.view(x.shape)

    def close(self) -> None:
        if self.workspace is not None:
            destroy = getattr(self.workspace, "destroy", None)
            if destroy is not None:
                destroy()
            self.workspace = None


_FUSED: dict[str, FlashInferAllReduce] = {}


def get_flashinfer_all_reduce(group_name: str) -> FlashInferAllReduce | None:
    return _FUSED.get(group_name)


def get_group(group_name: str) -> Any:
    fused = _FUSED.get(group_name)
    return fused.group if fused is not None else None


def _workspace_tokens(world_size: int, capability: tuple[int, int], hidden_size: int,
                      dtype: torch.dtype, token_budget: int | None) -> int:
    limit = max_tokens(world_size, capability, hidden_size, dtype.itemsize)
    return min(limit, token_budget) if token_budget else limit


def init_flashinfer_all_reduce(tp: Any, vllm_config: Any,
                               capability: tuple[int, int] | None = None
                               ) -> FlashInferAllReduce | None:
    """Collective over the tensor-parallel group `tp` (a GroupCoordinator; every rank calls
    it): create this rank's workspace when the AllReduce+RMSNorm fusion is on and FlashInfer
    can serve it; None on every rank when any rank cannot (they keep the unfused all-reduce).
    """
    import torch.distributed as dist

    pass_config = vllm_config.compilation_config.pass_config
    if not pass_config.fuse_allreduce_rms or tp.world_size < 2 or tp.backend != "nccl":
        return None
    if capability is None:
        capability = torch.cuda.get_device_capability()
    model_config = vllm_config.model_config
    hidden, dtype = model_config.get_hidden_size(), model_config.torch_dtype
    ok, why = fusion_supported(tp.world_size, capability)
    comm = flashinfer_comm() if ok else None
    if ok and comm is None:
        why = "flashinfer.comm has no allreduce_fusion / create_allreduce_fusion_workspace"
    tokens = _workspace_tokens(tp.world_size, capability, hidden, dtype,
                               vllm_config.scheduler_config.max_num_batched_tokens)
    workspace = None
    if comm is not None:
        try:
            workspace = comm.create_allreduce_fusion_workspace(
                backend="trtllm", world_size=tp.world_size, rank=tp.rank_in_group,
                max_token_num=tokens, hidden_dim=hidden, dtype=dtype, group=tp.group)
        except Exception as e:  # noqa: BLE001 (any failure: every rank stays unfused)
            why = f"creating the workspace failed: {str(e).splitlines()[0] if str(e) else e!r}"
    views: list[Any] = [None] * tp.world_size
    dist.all_gather_object(views, (workspace is not None, why), group=tp.group)
    if not all(ready for ready, _ in views):
        if workspace is not None and hasattr(workspace, "destroy"):
            workspace.destroy()
        reason = next(reason for ready, reason in views if not ready)
        logger.warning("AllReduce+RMSNorm fusion is on but FlashInfer's fused all-reduce is "
                       "unavailable (%s): tensor parallelism all-reduces unfused", reason)
        return None
    fused = FlashInferAllReduce(comm, workspace, tp.group, tp.world_size, tp.rank_in_group,
                                tokens, hidden, dtype)
    _FUSED[tp.group.group_name] = fused
    logger.info("FlashInfer fused all-reduce: %d ranks, up to %d tokens of %d per call "
                "(unfused beyond)", tp.world_size, tokens, hidden)
    return fused


def destroy_flashinfer_all_reduce(group_name: str | None = None) -> None:
    """Free the workspace of `group_name` (of every group when None)."""
    for name in list(_FUSED) if group_name is None else [group_name]:
        fused = _FUSED.pop(name, None)
        if fused is not None:
            fused.close()
