"""CUDAGraphWrapper: capture a runnable once per batch shape, replay it afterwards.

The wrapper owns no inputs: the model runner keeps persistent max-size buffers and passes
slices of them, so at replay the graph reads the same addresses it captured. The runner tells
the wrapper what to do through the forward context (`cudagraph_runtime_mode`,
`batch_descriptor`), chosen by the `CudagraphDispatcher`.

Graphs come from a factory (`graph_factory`), so tests on the CPU use `FakeCUDAGraph`, which
counts captures and replays and re-runs the captured call on replay. A real
`torch.cuda.CUDAGraph` is only imported when a real graph is needed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm.compilation.counter import compilation_counter
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.utils.startup_timer import get_startup_timer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import BatchDescriptor

logger = init_logger(__name__)


class GraphLike(Protocol):
    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` while recording it; return its output (the output buffers of replays)."""

    def replay(self) -> None:
        """Re-run what was recorded, writing into the output buffers of the capture."""


class TorchCUDAGraph:
    """A `torch.cuda.CUDAGraph` behind the GraphLike interface; all graphs share one pool."""

    _pool: Any = None

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        if TorchCUDAGraph._pool is None:
            TorchCUDAGraph._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=TorchCUDAGraph._pool):
            output = fn()
        # Capturing records kernels without running them: replay once so the output buffers
        # hold this call's values.
        self.graph.replay()
        return output

    def replay(self) -> None:
        self.graph.replay()


class FakeCUDAGraph:
    """For CPU tests: capture runs `fn` once; replay runs it again and copies the results into
    the captured outputs (what a real replay leaves behind). Counts both."""

    instances: list[FakeCUDAGraph] = []

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None
        FakeCUDAGraph.instances.append(self)

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.num_captures += 1
        self._fn = fn
        self._outputs = fn()
        return self._outputs

    def replay(self) -> None:
        assert self._fn is not None, "replay before capture"
        self.num_replays += 1
        fresh = self._fn()
        _copy_into(self._outputs, fresh)


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


_factory_override: Callable[[], GraphLike] | None = None


@contextlib.contextmanager
def override_graph_factory(factory: Callable[[], GraphLike]) -> Iterator[None]:
    """Make wrappers built inside the block (e.g. by the compile backend) use `factory`."""
    global _factory_override
    previous, _factory_override = _factory_override, factory
    try:
        yield
    finally:
        _factory_override = previous


def non_owning(value: Any) -> Any:
    """`value` with every tensor replaced by an alias of its memory that does not keep the
    memory alive (lists and tuples are walked).

    An entry keeps its graph's outputs this way. A graph writes its outputs at the addresses
    of the capture, in the pool all graphs share; held as tensors, every (piece, size)'s
    outputs would stay allocated for good (~4 x hidden values per token per piece, summed over
    the capture sizes: gigabytes for a large model), where freed they are reused by the
    captures that follow, as the intermediate values of one forward are. A replay's outputs
    are consumed before the next replay, so they never meet another graph's."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device,
                                                              storage.nbytes())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            alias, value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(non_owning(v) for v in value)
    return value


@dataclasses.dataclass
class _Entry:
    graph: GraphLike
    output: Any
    """The capture's outputs as `non_owning` aliases: what each replay rewrites."""
    input_addresses: list[int]
    replays: int = 0


class CUDAGraphWrapper:
    """Wraps `runnable` for one graph mode (PIECEWISE for a compiled piece, FULL for the whole
    model). On each call:
      - runtime mode NONE, or a mode other than ours: call the runnable;
      - else, first time this `batch_descriptor` is seen: capture (returns the output);
      - else: replay and return the captured output buffers.
    Outputs of replays alias each other: consume them before the next replay of that key."""

    def __init__(self, runnable: Callable, vllm_config: VllmConfig, runtime_mode: CUDAGraphMode,
                 graph_factory: Callable[[], GraphLike] | None = None,
                 check_input_addresses: bool = False) -> None:
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"CUDAGraphWrapper mode must be PIECEWISE or FULL, got "
                             f"{runtime_mode}")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.graph_factory = graph_factory or _factory_override or TorchCUDAGraph
        self.check_input_addresses = check_input_addresses
        self.entries: dict[BatchDescriptor, _Entry] = {}

    def __getattr__(self, name: str) -> Any:
        # Delegate to the runnable (e.g. a model's compute_logits under a FULL wrapper).
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode, key = ctx.cudagraph_runtime_mode, ctx.batch_descriptor
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode or key is None:
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(key)
        addresses = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        if entry is None:
            start = time.perf_counter()
            graph = self.graph_factory()
            output = graph.capture(lambda: self.runnable(*args, **kwargs))
            self.entries[key] = _Entry(graph, non_owning(output), addresses)
            compilation_counter.num_cudagraph_captured += 1
            get_startup_timer().record("cudagraph capture", time.perf_counter() - start,
                                       mode=self.runtime_mode.name)
            logger.debug("Captured a %s CUDA graph for %s", self.runtime_mode, key)
            return output
        if self.check_input_addresses and addresses != entry.input_addresses:
            raise RuntimeError(
                f"CUDA graph for {key} replayed with inputs at other addresses than at capture "
                "(the runner must pass slices of its persistent buffers)")
        entry.graph.replay()
        entry.replays += 1
        compilation_counter.num_cudagraph_replayed += 1
        return entry.output
