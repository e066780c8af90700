"""The compilers a piece can go through: "eager" (AOTAutograd + our passes, no codegen) and
"inductor" (standalone Inductor compile, savable as a binary artifact).

Both take a piece `GraphModule` and example inputs: fake tensors with a symbolic token
dimension for a compile range, or real tensors for one static compile size.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.counter import compilation_counter
from vllm.compilation.passes.inductor_pass import pass_context
from vllm.config.compilation import POST_GRAD_PASS_KEY
from vllm.config.utils import Range
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def _canonical_graph(gm: fx.GraphModule) -> str:
    """The graph's operations with nodes numbered by position, not named: two decoder
    layers' pieces differ only in their placeholders' names (the parameters' paths)."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def show(value: Any) -> str:
        if isinstance(value, fx.Node):
            return f"%{index[value]}"
        if isinstance(value, (list, tuple)):
            inner = ", ".join(show(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
        return repr(value)

    lines = []
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            target = str(target)
        elif callable(target):
            target = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
        elif node.op == "placeholder":
            target = ""  # its name
        lines.append(f"{node.op} {target} {show(node.args)} {show(node.kwargs)}")
    return "\n".join(lines)


def graph_digest(gm: fx.GraphModule) -> str:
    """The piece's operations (names aside), hashed: what `graph_hash` builds on. A graph
    loaded from the compile cache (re-traced from its code, so its nodes may differ in
    form) is keyed by the digest saved with it."""
    return hashlib.sha256(_canonical_graph(gm).encode()).hexdigest()


def graph_hash(gm: fx.GraphModule | None, example_inputs: list[Any],
               digest: str | None = None) -> str:
    """Identity of a piece compile: its operations (names aside; `digest` when known) and the
    shapes/dtypes it is compiled for."""
    h = hashlib.sha256((digest or graph_digest(gm)).encode())
    for arg in example_inputs:
        if isinstance(arg, torch.Tensor):
            h.update(f"{tuple(arg.shape)}|{arg.stride()}|{arg.dtype}|{arg.device};".encode())
        else:
            h.update(f"{type(arg).__name__}:{arg};".encode())
    return h.hexdigest()


def check_inductor_options(options: dict[str, Any]) -> None:
    """Refuse `inductor_compile_config` keys that are not Inductor options, with a ValueError
    naming the key and the closest options. Called before the first trace: Inductor itself
    would fail only inside the first piece's compile. (Not at config resolution: importing
    Inductor's config costs ~0.8 s, which warm starts never pay.)"""
    if not options:
        return
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"compilation_config.inductor_compile_config: {key!r} is not an Inductor "
                f"option{hint} (options are the names in torch._inductor.config, e.g. "
                "'max_autotune' or 'cpp.threads')")


def inductor_config_patches(vllm_config: VllmConfig, pass_manager: PostGradPassManager | None,
                            ) -> dict[str, Any]:
    """Inductor options from the config: freezing / max_autotune / coordinate descent / C++
    wrapper, then `inductor_compile_config` as given (it wins), then our pass manager."""
    cc = vllm_config.compilation_config
    patches: dict[str, Any] = {}
    if cc.freezing:
        patches["freezing"] = True
    if cc.max_autotune:
        patches["max_autotune"] = True
    if cc.coordinate_descent_tuning:
        patches["coordinate_descent_tuning"] = True
    if cc.cpp_wrapper:
        patches["cpp_wrapper"] = True
    # Our passes expect v1 auto_functionalized nodes (see fix_functionalization).
    patches["enable_auto_functionalized_v2"] = False
    from vllm import envs

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        # Off means off: Inductor's own caches (its FX graph cache in its default directory)
        # would otherwise still hand back earlier compiles, with our passes not run.
        patches["force_disable_caches"] = True
    patches.update(cc.inductor_compile_config or {})
    if pass_manager is not None:
        # The manager runs a user's own pass (POST_GRAD_PASS_KEY) after ours.
        patches[POST_GRAD_PASS_KEY] = pass_manager.as_inductor_pass()
    elif patches.get(POST_GRAD_PASS_KEY) is not None:
        # torch's own backend: the user's pass alone, as the CustomGraphPass Inductor keys
        # its cache by.
        from vllm.compilation.passes.pass_manager import as_custom_graph_pass

        patches[POST_GRAD_PASS_KEY] = as_custom_graph_pass(patches[POST_GRAD_PASS_KEY])
    return patches


class EagerCompiler:
    """Traces the piece to functional ATen with AOTAutograd, runs the pass manager on it and
    runs the result as plain PyTorch. Fast to build: for tests and for debugging passes."""

    name = "eager"

    def __init__(self, vllm_config: VllmConfig, pass_manager: PostGradPassManager) -> None:
        self.vllm_config = vllm_config
        self.pass_manager = pass_manager

    def compile(self, gm: fx.GraphModule, example_inputs: list[Any], compile_range: Range,
                piece_index: int, dump_dir: str | None, cache_dir: str | None = None
                ) -> Callable:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def fw_compiler(aten_gm: fx.GraphModule, _inputs: Any) -> Callable:
            with pass_context(compile_range=compile_range, piece_index=piece_index,
                              dump_dir=dump_dir):
                self.pass_manager(aten_gm.graph)
            aten_gm.recompile()
            return make_boxed_func(aten_gm.forward)

        compilation_counter.num_eager_compiles += 1
        backend = aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)
        return backend(gm, example_inputs)


class InductorCompiler:
    """`torch._inductor.standalone_compile` per piece; artifacts save/load in "binary" format."""

    name = "inductor"

    def __init__(self, vllm_config: VllmConfig, pass_manager: PostGradPassManager) -> None:
        self.vllm_config = vllm_config
        self.pass_manager = pass_manager

    @property
    def savable(self) -> bool:
        # Frozen graphs embed the weights as constants, prepacked as mkldnn tensors that
        # neither Inductor's cache nor ours can serialize (and a saved artifact must not hold
        # weights: the same config with other weights would load stale constants). A debug
        # dump compiles with Inductor's cache off, so that its trace is written.
        cc = self.vllm_config.compilation_config
        return not cc.freezing and not cc.debug_dump_path

    def _prepare(self) -> None:
        platform = getattr(self.vllm_config, "platform", None)
        if platform is None or platform.is_cpu():
            prepare_inductor(self.vllm_config)

    def compile(self, gm: fx.GraphModule, example_inputs: list[Any], compile_range: Range,
                piece_index: int, dump_dir: str | None, cache_dir: str | None = None) -> Any:
        from torch._inductor import standalone_compile

        patches = inductor_config_patches(self.vllm_config, self.pass_manager)
        if dump_dir:
            # Inductor's own debug trace (output_code.py, IR before/after fusion) next to our
            # pass dumps.
            patches["trace.enabled"] = True
            patches["trace.debug_dir"] = os.path.join(dump_dir, "inductor")
            patches["fx_graph_cache"] = False  # a cache hit would write no trace
        self._prepare()
        static = compile_range.is_single_size()
        start = time.perf_counter()
        with pass_context(compile_range=compile_range, piece_index=piece_index,
                          dump_dir=dump_dir), inductor_cache_dir(cache_dir), \
                _quiet_unless(self.savable, "torch._inductor.standalone_compile"):
            artifact = standalone_compile(
                gm, example_inputs,
                dynamic_shapes=_dynamic_shapes_source(example_inputs, static),
                options={"config_patches": patches})
        compilation_counter.num_inductor_compiles += 1
        logger.debug("Inductor compiled piece %d for %s (%s) in %.2f s", piece_index,
                     compile_range, "static" if static else "dynamic",
                     time.perf_counter() - start)
        return artifact

    @staticmethod
    def save(artifact: Any, path: str) -> None:
        artifact.save(path=path, format="binary")

    def load(self, path: str, cache_dir: str | None = None) -> Any:
        from torch._inductor import CompiledArtifact

        self._prepare()
        with inductor_cache_dir(cache_dir):
            return CompiledArtifact.load(path=path, format="binary")


@contextlib.contextmanager
def _quiet_unless(condition: bool, logger_name: str):
    """Silence a torch logger's warnings (e.g. "cannot save" for frozen graphs we never
    save) unless `condition`."""
    import logging

    if condition:
        yield
        return
    torch_logger = logging.getLogger(logger_name)
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_logger.setLevel(level)


@contextlib.contextmanager
def inductor_cache_dir(directory: str | None):
    """Point Inductor's cache (generated code, built C++ objects) at `directory` while
    compiling or loading, so a warm start finds the built objects next to our artifacts
    instead of running the C++ compiler again. None: leave Inductor's cache dir as it is."""
    if directory is None:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    os.makedirs(directory, exist_ok=True)
    with temporary_cache_dir(directory):
        yield


_inductor_prepared = False
_prepare_lock = threading.Lock()


def prepare_inductor(vllm_config: VllmConfig | None = None) -> None:
    """What Inductor does once per process before its first CPU compile or full load, done
    from the memo of an earlier start when the compile cache is on (inductor_memo.py):
    probing the CPU's vector ISA (it builds and loads a test library per candidate ISA, each
    in a child process: 1-1.5 s on the dev machines), hashing torch's source (`torch_key()`)
    and the precompiled-header check. It also imports Inductor's compiler and the modules its
    output code imports (~1.4 s, Dynamo included). Called on the first need only, so that a
    warm start whose pieces all load without Inductor (inductor_light.py) never pays it. (A
    background thread started with the weight loading saved nothing on 2 cores: its imports
    slowed the weight copies by as much.)"""
    global _inductor_prepared
    with _prepare_lock:
        if _inductor_prepared:
            return
        _inductor_prepared = True
        memo_dir = None
        if vllm_config is not None:
            from vllm.compilation.cache_key import cache_disabled_reason, cache_root

            if cache_disabled_reason(vllm_config) is None:
                memo_dir = cache_root(vllm_config)
        try:
            from vllm.compilation.inductor_memo import (
                memoize_precompiled_header,
                pick_vec_isa,
                prefill_torch_key,
            )

            pick_vec_isa(memo_dir)
            prefill_torch_key(memo_dir)
            memoize_precompiled_header(memo_dir)
            import torch._inductor.compile_fx  # noqa: F401
            import torch._inductor.select_algorithm  # noqa: F401
        except Exception as e:  # the real compile or load will meet (and report) the problem
            logger.debug("Inductor preparation failed: %s", e)


def _dynamic_shapes_source(example_inputs: list[Any], static: bool = False) -> str:
    """Symbolic example inputs come from Dynamo's fake mode: compile with the shape env of the
    ambient tracing context (where their symbols and value ranges live). A static compile size
    (its inputs concrete: fake ones of their own mode, or real ones) specializes."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor

    if static:
        return "from_example_inputs"
    fake = any(isinstance(a, (FakeTensor, torch.SymInt)) for a in example_inputs)
    if fake and TracingContext.try_get() is not None:
        return "from_tracing_context"
    return "from_example_inputs"


def make_compiler(vllm_config: VllmConfig, pass_manager: PostGradPassManager
                  ) -> EagerCompiler | InductorCompiler:
    backend = vllm_config.compilation_config.backend
    if backend == "eager":
        return EagerCompiler(vllm_config, pass_manager)
    if backend in ("inductor", ""):
        return InductorCompiler(vllm_config, pass_manager)
    raise ValueError(f"Invalid backend for piecewise compilation: {backend!r}; use 'inductor' "
                     "or 'eager'")
