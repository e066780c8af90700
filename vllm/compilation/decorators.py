"""`@support_torch_compile`: compile a model class's forward once, token dimension dynamic.

    @support_torch_compile
    class LlamaModel(nn.Module):
        def forward(self, input_ids, positions): ...

The model reads the current config (`set_current_vllm_config`) when it is built. With
compilation mode NONE the decorator does nothing. Otherwise the first forward traces with
Dynamo, dim 0 of every tensor argument marked dynamic (override with
`dynamic_arg_dims={"input_ids": 0, ...}`), and compiles through:
  VLLM_COMPILE        our VllmBackend (passes, split at attention, per-piece compile, cache)
  STOCK_TORCH_COMPILE torch's backend named by compilation_config.backend
  DYNAMO_TRACE_ONCE   the same, and any second trace is an error
Later traces (a guard failed) are recompiles: counted, logged as a warning, and an error
with VLLM_TEST_FAIL_ON_RECOMPILE=1 (tests) or in DYNAMO_TRACE_ONCE.

In VLLM_COMPILE, after the first trace the calls skip Dynamo (its guard checks cost ~130 us a
step on the demo model): a runner computes the graph's inputs and checks the arguments
(graph_cache.py); with the compile cache on it also saves the traced graph, and a later start
with the same key loads it and calls the compiled pieces without Dynamo at all. A call the
runner does not serve (another dtype) goes back to Dynamo for good, a recompile as above.

Contract for the model: load the weights before the first forward (with Inductor freezing the
weights are folded into the compiled code then), keep forward free of host syncs, and run it
under `torch.inference_mode()` / `no_grad()`.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm.compilation.counter import compilation_counter
from vllm.compilation.debug_dump import CompilationStageError
from vllm.compilation.graph_runner import GuardMismatch
from vllm.config.compilation import CompilationMode
from vllm.logger import init_logger
from vllm.utils.startup_timer import CPU_KERNEL_BUILD, get_startup_timer

logger = init_logger(__name__)

_T = TypeVar("_T", bound=type)


class RecompileError(RuntimeError):
    """Dynamo traced the model again after the first compile."""


def support_torch_compile(cls: _T | None = None, *,
                          dynamic_arg_dims: dict[str, int | list[int]] | None = None
                          ) -> Any:
    """Class decorator (bare or called with `dynamic_arg_dims`)."""
    if cls is None:
        return lambda c: _decorate(c, dynamic_arg_dims)
    return _decorate(cls, dynamic_arg_dims)


def _decorate(cls: _T, dynamic_arg_dims: dict[str, int | list[int]] | None) -> _T:
    if getattr(cls, "_vllm_compile_decorated", False) and "forward" not in cls.__dict__:
        return cls
    original_init = cls.__init__
    original_forward = cls.forward
    signature = inspect.signature(original_forward)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if "_vllm_compile_state" in self.__dict__:  # a decorated base class already did it
            return
        from vllm.config import get_current_vllm_config

        state = _CompileState.create(self, get_current_vllm_config(), original_forward,
                                     signature, dynamic_arg_dims)
        object.__setattr__(self, "_vllm_compile_state", state)

    @functools.wraps(original_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get("_vllm_compile_state")
        if state is None or torch.compiler.is_compiling():
            return original_forward(self, *args, **kwargs)
        return state(args, kwargs)

    cls.__init__ = __init__
    cls.forward = forward
    cls._vllm_compile_decorated = True
    return cls


def _model_source_files(model: Any) -> list[str]:
    files = []
    for klass in type(model).__mro__:
        module = sys.modules.get(klass.__module__)
        path = getattr(module, "__file__", None)
        if path and not klass.__module__.startswith("torch"):
            files.append(os.path.abspath(path))
    return sorted(set(files))


class _CompileState:
    """Per-model-instance compile state (None at mode NONE: the decorator is a no-op)."""

    def __init__(self, model: Any, vllm_config: Any, original_forward: Callable,
                 signature: inspect.Signature, dynamic_arg_dims: dict | None) -> None:
        self.model_ref = model
        self.vllm_config = vllm_config
        self.mode: CompilationMode = vllm_config.compilation_config.mode
        self.original_forward = original_forward
        self.signature = signature
        self.dynamic_arg_dims = dynamic_arg_dims
        self.compiled: Callable | None = None
        self.num_traces = 0
        self.vllm_backend: Any = None
        self.cached_graph: Any = None
        """The runner that calls the compiled graph without Dynamo (graph_cache.py), loaded
        from the compile cache or made after the first trace, while it serves."""
        self._graph_load_tried = False
        self._graph_runner_wanted = True
        compilation_counter.num_models_seen += 1

    @classmethod
    def create(cls, model: Any, vllm_config: Any, original_forward: Callable,
               signature: inspect.Signature, dynamic_arg_dims: dict | None
               ) -> _CompileState | None:
        if vllm_config is None:
            logger.warning_once("%s built outside set_current_vllm_config(): not compiled",
                                type(model).__name__)
            return None
        mode = vllm_config.compilation_config.mode
        if mode is None or mode == CompilationMode.NONE:
            return None
        return cls(model, vllm_config, original_forward, signature, dynamic_arg_dims)

    # ---- the backend Dynamo sees --------------------------------------------------------
    def _make_backend(self) -> Callable:
        if self.mode == CompilationMode.VLLM_COMPILE:
            inner: Callable = self._vllm_backend()
        else:
            inner = _torch_backend(self.vllm_config)

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
            if self.num_traces > 0:
                self._on_recompile(gm)
            if self.mode != CompilationMode.VLLM_COMPILE:
                compilation_counter.num_graphs_seen += 1
                compilation_counter.stock_torch_compile_count += 1
            result = inner(gm, example_inputs)
            self.num_traces += 1
            return result

        return backend

    def _vllm_backend(self) -> Any:
        if self.vllm_backend is None:
            from vllm.compilation.backends import VllmBackend
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            # Each tensor-parallel rank keeps its own cache entry (rank_<r>/): its graph
            # carries its own shard shapes and collectives.
            self.vllm_backend = VllmBackend(self.vllm_config,
                                            _model_source_files(self.model_ref),
                                            rank=get_tensor_model_parallel_rank())
        return self.vllm_backend

    def _on_recompile(self, gm: torch.fx.GraphModule) -> None:
        compilation_counter.num_recompiles += 1
        name = type(self.model_ref).__name__
        message = (f"{name}.forward was traced again by Dynamo (recompile #{self.num_traces}): "
                   "a guard of the first compile failed (a new input shape, dtype or Python "
                   "value). Set TORCH_LOGS=recompiles to see which guard.")
        if self.mode == CompilationMode.DYNAMO_TRACE_ONCE:
            raise RecompileError(message + " Mode DYNAMO_TRACE_ONCE allows one trace only.")
        from vllm import envs

        if envs.VLLM_TEST_FAIL_ON_RECOMPILE:
            raise RecompileError(message + " (VLLM_TEST_FAIL_ON_RECOMPILE=1)")
        logger.warning(message)

    def _guard_filter(self, guards: list[Any]) -> list[bool]:
        """Which of Dynamo's guards to keep. The symbolic shape guards go: the trace may have
        assumed facts about the token count (e.g. `2 <= num_tokens` from a view's stride
        rule), and the compiled code serves every token count. Dtype, device, rank, static
        dims and module state stay guarded (a change there is a recompile). In
        DYNAMO_TRACE_ONCE no guard is kept: the compiled code is always called."""
        if self.mode == CompilationMode.DYNAMO_TRACE_ONCE:
            return [False] * len(guards)
        return [getattr(g, "guard_type", "") != "SHAPE_ENV" for g in guards]

    # ---- calls ------------------------------------------------------------------------
    def _mark_dynamic(self, bound: inspect.BoundArguments) -> None:
        for name, value in bound.arguments.items():
            if name == "self" or not isinstance(value, torch.Tensor):
                continue
            dims = (self.dynamic_arg_dims or {}).get(name, 0 if self.dynamic_arg_dims is None
                                                     else None)
            if dims is None:
                continue
            for dim in ([dims] if isinstance(dims, int) else dims):
                torch._dynamo.mark_dynamic(value, dim % value.dim())

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        cached = self.cached_graph
        if cached is not None:
            try:
                return cached(args, kwargs)
            except GuardMismatch as e:
                self._leave_cached_graph(str(e))
            except Exception as e:
                _reraise(e, None)
        if self.compiled is not None and self.num_traces > 0:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:
                _reraise(e, None)
        return self._first_call(args, kwargs)

    def _leave_cached_graph(self, reason: str) -> None:
        self.cached_graph, self._graph_runner_wanted = None, False
        logger.warning("%s.forward was called with arguments the compiled graph does not serve "
                       "(%s): Dynamo serves the calls from now on",
                       type(self.model_ref).__name__, reason)

    def _first_call(self, args: tuple, kwargs: dict) -> Any:
        bound = self.signature.bind(self.model_ref, *args, **kwargs)
        if self.mode == CompilationMode.VLLM_COMPILE and not self._graph_load_tried:
            self._graph_load_tried = True
            from vllm.compilation.graph_cache import load_graph

            self.cached_graph = load_graph(self._vllm_backend(), self.model_ref,
                                           self.signature, self.original_forward, bound)
            if self.cached_graph is not None:
                return self(args, kwargs)
        timer = get_startup_timer()
        start = time.perf_counter()
        # The compiles and kernel builds in the first call are rows of their own.
        nested = ("inductor compilation", CPU_KERNEL_BUILD)
        nested_before = timer.total(nested)
        self._mark_dynamic(bound)
        if self.compiled is None:
            from vllm.compilation.compiler_interface import check_inductor_options

            check_inductor_options(self.vllm_config.compilation_config.inductor_compile_config)
            method = types.MethodType(_own_code_copy(self.original_forward), self.model_ref)
            self.compiled = torch.compile(
                method, backend=self._make_backend(), fullgraph=True, dynamic=False,
                options={"guard_filter_fn": self._guard_filter})
        try:
            # Treat the token dimension as "any size >= 0": without this, a first call with
            # N >= 2 tokens guards on N != 1 and a later 1-token batch would recompile.
            from torch.fx.experimental import _config as fx_config

            with fx_config.patch(backed_size_oblivious=True):
                output = self.compiled(*args, **kwargs)
        except Exception as e:
            _reraise(e, "dynamo trace")
        if self.vllm_backend is not None and self._graph_runner_wanted and self.num_traces == 1:
            from vllm.compilation.graph_cache import runner_after_trace

            # Later calls skip Dynamo's guard checks (and the graph is saved for warm starts).
            self._graph_runner_wanted = False
            self.cached_graph = runner_after_trace(self.vllm_backend, self.model_ref,
                                                   self.signature, self.original_forward,
                                                   bound, output)
        nested_seconds = timer.total(nested) - nested_before
        timer.record("dynamo tracing", time.perf_counter() - start - nested_seconds,
                     model=type(self.model_ref).__name__)
        return output


def _own_code_copy(fn: Callable) -> Callable:
    """`fn` with a code object of its own. Dynamo keeps compiled entries, and counts them
    against its recompile limit (8), per code object: without a copy, the 9th model instance
    built in one process (tests, benchmarks) fails as a recompile of the first ones."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def _reraise(e: Exception, stage: str | None) -> None:
    """Surface our own errors from inside Dynamo's wrappers; name the stage of others (on the
    first call: the trace), or re-raise them as they are (`stage=None`: a run-time error)."""
    from vllm.compilation.backends import find_stage_error

    inner = find_stage_error(e)
    if inner is not None:
        raise inner from inner.__cause__  # keep the original failure as the cause
    recompile = _find(e, RecompileError)
    if recompile is not None:
        raise recompile from e
    if stage is None:
        raise e
    raise CompilationStageError(stage, detail=f"{type(e).__name__}: {e}") from e


def _find(e: BaseException | None, kind: type) -> Any:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        inner = getattr(e, "inner_exception", None)
        e = inner if isinstance(inner, BaseException) else (e.__cause__ or e.__context__)
    return None


def _torch_backend(vllm_config: Any) -> Callable:
    """torch's own backend for modes STOCK_TORCH_COMPILE / DYNAMO_TRACE_ONCE, with our
    Inductor options when it is Inductor."""
    name = vllm_config.compilation_config.backend or "inductor"
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from vllm.compilation.compiler_interface import inductor_config_patches

        patches = inductor_config_patches(vllm_config, None)

        def compile_whole_graph(gm: Any, example_inputs: Any) -> Any:
            # Its own start-up row (the trace's row leaves it out), as our backend's pieces.
            with get_startup_timer().phase("inductor compilation", piece="whole graph",
                                           mode=vllm_config.compilation_config.mode.name):
                return compile_fx(gm, example_inputs, config_patches=patches)

        return compile_whole_graph
    if "." in name and name not in torch._dynamo.list_backends(exclude_tags=()):
        import importlib

        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)
