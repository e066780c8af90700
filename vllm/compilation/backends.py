"""VllmBackend: what Dynamo calls with the traced model graph (mode VLLM_COMPILE).

    graph --split at splitting_ops--> pieces --compile each non-splitting piece--> runnables

Splitting pieces (attention) run as they are, eagerly. Every other piece becomes a
`PiecewiseBackend` (compiled per compile range and per compile size, through the pass
manager), wrapped in a `CUDAGraphWrapper` when piecewise CUDA graphs are on. The split module
with those runnables in place of its submodules is what Dynamo runs.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.cache import (
    CompileCache,
    GraphCacheMiss,
    cache_directory_problem,
    cache_disabled_reason,
)
from vllm.compilation.compiler_interface import graph_hash, make_compiler
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.compilation.debug_dump import CompilationStageError, DebugDumper
from vllm.compilation.passes.pass_manager import PostGradPassManager
from vllm.compilation.piecewise_backend import PiecewiseBackend
from vllm.compilation.split import SplitItem, eager_runnable, split_graph
from vllm.config.compilation import CUDAGraphMode
from vllm.config.utils import Range, compile_ranges
from vllm.logger import init_logger
from vllm.utils.progress import waiting
from vllm.utils.startup_timer import get_startup_timer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def _fake_inputs(example_inputs: list[Any]) -> list[Any]:
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return list(example_inputs)
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
            for t in example_inputs]


def _inputs_from_meta(items: list[SplitItem]) -> dict[str, list[Any]] | None:
    """Each piece's example inputs from its placeholders' `example_value` (Dynamo's fake
    values, which split_module copies): no second fake run through the model. None when one
    is missing (then the pieces are run on fake inputs)."""
    inputs: dict[str, list[Any]] = {}
    for item in items:
        values = []
        for node in item.graph.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("example_value")
            if value is None:
                return None
            values.append(value)
        inputs[item.name] = values
    return inputs


class _PieceInputRecorder(torch.fx.Interpreter):
    """Runs the split module on fake inputs and records each submodule's inputs."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.inputs: dict[str, list[Any]] = {}

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        self.inputs[target] = list(args)
        return super().call_module(target, args, kwargs)

    def record(self, fake_inputs: list[Any]) -> dict[str, list[Any]]:
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        fake_mode = detect_fake_mode(fake_inputs)
        if fake_mode is None:
            with unset_fake_temporarily():
                self.run(*fake_inputs)
        else:
            with fake_mode:
                self.run(*fake_inputs)
        return self.inputs


class VllmBackend:
    """The Dynamo backend for mode VLLM_COMPILE. One instance per compiled model."""

    def __init__(self, vllm_config: VllmConfig, model_source_files: Sequence[str] = (),
                 rank: int = 0) -> None:
        self.vllm_config = vllm_config
        cc = vllm_config.compilation_config
        self.splitting_ops = list(cc.splitting_ops or [])
        self.pass_manager = PostGradPassManager().configure(vllm_config)
        self.compiler = make_compiler(vllm_config, self.pass_manager)
        self.compile_ranges: list[Range] = compile_ranges(
            cc.compile_ranges_endpoints, vllm_config.scheduler_config.max_num_batched_tokens)
        self.model_source_files = list(model_source_files)
        self.rank = rank
        self.dumper = DebugDumper(vllm_config, rank)
        self.cache: CompileCache | None = None
        # Inductor freezing folds each piece's weights into its code: such pieces are not
        # saved (the prepacked weights cannot be serialized) nor shared between pieces.
        self.frozen = self.compiler.name == "inductor" and bool(
            vllm_config.compilation_config.freezing)
        self._shared: dict[str, tuple[int, Callable]] = {}
        self.split_gm: fx.GraphModule | None = None
        self.pieces: list[SplitItem] = []
        self.timer = get_startup_timer()
        self.traced_files: list[str] = []
        self.piece_backends: list[PiecewiseBackend] = []
        self.capture: Any = None
        """What serving calls without Dynamo and saving the traced graph need, taken at split
        time (`graph_cache.GraphCapture`); None when not possible."""

    # ---- Dynamo entry point ------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compilation_counter.num_graphs_seen += 1
        try:
            return self._compile(gm, example_inputs)
        except CompilationStageError as e:
            self.dumper.write_index()
            e.with_dump_dir(self.dumper.dir)
            raise

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        start = time.perf_counter()
        self.dumper.dump_config()
        self.dumper.dump_graph("graph.dynamo.py", gm, "the graph Dynamo traced from forward()")
        self._open_cache(gm)
        with _stage("split", self.dumper):
            split_gm, items = split_graph(gm, self.splitting_ops)
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_piecewise_capturable_graphs_seen += sum(
            not item.is_splitting for item in items)
        self.dumper.dump_graph("split_module.py", split_gm,
                               "the split module: calls the pieces in order")
        for item in items:
            kind = "splitting op, runs eagerly" if item.is_splitting else "compiled"
            self.dumper.dump_graph(f"piece_{item.index}.py", item.graph,
                                   f"piece {item.index} ({item.name}): {kind}")
        self.capture = None
        if not self.frozen:
            from vllm.compilation.graph_cache import capture_graph

            self.capture = capture_graph(gm, split_gm, items, save=self.cache is not None)
        with _stage("fake propagation through the pieces", self.dumper):
            piece_inputs = _inputs_from_meta(items) or \
                _PieceInputRecorder(split_gm).record(_fake_inputs(example_inputs))

        def make_piece(item: SplitItem) -> PiecewiseBackend:
            constants = _parameter_inputs(split_gm, item.name, example_inputs) \
                if self.frozen else None
            return PiecewiseBackend(item.graph, item.index, piece_inputs[item.name], self,
                                    constants)

        self.install_pieces(split_gm, items, make_piece)
        self.report_when_done()
        elapsed = time.perf_counter() - start
        logger.info("Compiled %d pieces (%d split at %s) with backend %s in %.2f s",
                    len(items), sum(i.is_splitting for i in items), self.splitting_ops or "nothing",
                    self.compiler.name, elapsed)
        self.pass_manager.log_match_counts()
        if self.capture is not None:
            return self.capture.record_first_outputs(split_gm.forward)
        return split_gm.forward

    def install_pieces(self, split_gm: fx.GraphModule, items: list[SplitItem],
                       make_piece: Callable[[SplitItem], PiecewiseBackend]) -> None:
        """Make `split_gm` (split into `items`) this backend's graph, each piece's runnable in
        place of its submodule: splitting pieces run their graph's code, the others a
        `make_piece(item)` (in a CUDA-graph wrapper when piecewise CUDA graphs are on)."""
        self.split_gm, self.pieces, self.piece_backends = split_gm, items, []
        cudagraph_mode = self.vllm_config.compilation_config.cudagraph_mode
        for item in items:
            if item.is_splitting:
                # Call the graph's code directly: nn.Module.__call__ costs microseconds a call.
                split_gm.__dict__[item.name] = eager_runnable(item.graph)
                continue
            piece = make_piece(item)
            self.piece_backends.append(piece)
            runnable: Callable = piece
            if cudagraph_mode is not None and cudagraph_mode.has_piecewise_cudagraphs():
                runnable = CUDAGraphWrapper(runnable, self.vllm_config, CUDAGraphMode.PIECEWISE)
            # Shadow the submodule: the split module's code looks it up as an attribute.
            split_gm.__dict__[item.name] = runnable

    def report_when_done(self) -> None:
        """The compile-cache line now, or at the end of `deferred_cache_reports()`."""
        if _deferred_reports is not None:
            _deferred_reports.append(self)
        else:
            self.report_cache()

    def report_cache(self) -> None:
        """Log "compile cache: hit|miss ... in <dir>" for what this backend compiled/loaded."""
        if self.cache is None:
            return
        if self.frozen:
            logger.info("compile cache: miss (Inductor freezing: the frozen pieces hold "
                        "prepacked weights that cannot be saved, so they are compiled at "
                        "every start; the C++ objects are reused from %s)",
                        self.cache.inductor_cache_dir)
            return
        self.cache.report()

    def _open_cache(self, gm: fx.GraphModule) -> None:
        reason = cache_disabled_reason(self.vllm_config)
        if reason is not None:
            # A directory that cannot be used is a setting to fix (VLLM_CACHE_ROOT,
            # compilation_config.cache_dir): the start goes on, compiling everything.
            log = logger.warning if cache_directory_problem(self.vllm_config) else logger.info
            log("compile cache: disabled (%s)", reason)
            return
        self.traced_files = traced_source_files(gm)
        try:
            self.cache = CompileCache.for_model(self.vllm_config, self.model_source_files,
                                                self.pass_manager.uuid(), self.rank,
                                                self.traced_files)
        except OSError as e:  # e.g. a root the checks above cannot see is read-only
            logger.warning("compile cache: disabled (cannot create its directory: %s)", e)
            return
        logger.info("compile cache: using %s", self.cache.directory)

    def use_cache(self, cache: CompileCache) -> None:
        """Compile into and load from `cache` (the entry a traced graph was loaded from)."""
        self.cache, self.traced_files = cache, list(cache.traced_files)
        logger.info("compile cache: using %s", cache.directory)

    # ---- one piece, one range or size ----------------------------------------------------
    @staticmethod
    def piece_key(gm: fx.GraphModule | None, example_inputs: list[Any], compile_range: Range,
                  digest: str | None = None) -> str:
        """The compile-cache key of one piece compile (`digest`: `graph_digest(gm)`)."""
        return graph_hash(gm, example_inputs, digest) + "|" + str(compile_range)

    def compile_piece(self, gm: fx.GraphModule | Callable[[], fx.GraphModule] | None,
                      example_inputs: list[Any], piece_index: int, compile_range: Range,
                      digest: str | None = None, key: str | None = None) -> Callable:
        """One piece compiled for one range or size, or loaded from the compile cache.
        `gm` None (with its `key`): a piece restored with the traced graph, whose graph is
        not at hand: loaded only (raises GraphCacheMiss when the cache does not have it).
        `gm` a function (with `digest`): what gives the graph, called only to compile it."""
        compilation_counter.num_backend_compilations += 1
        tag = compile_range.tag
        dump_dir = self.dumper.piece_dir(piece_index, tag)
        if key is None:
            graph = gm if isinstance(gm, fx.GraphModule) else None
            if graph is None and digest is None:
                raise ValueError("compile_piece: a piece without its graph needs its digest")
            key = self.piece_key(graph, example_inputs, compile_range, digest)
        # Pieces with the same code and input shapes (the middle decoder layers: the weights
        # are inputs) share one compiled callable: compiled or loaded once.
        shareable = self._shareable(dump_dir)
        shared = self.shared_runnable(key, piece_index, tag) if shareable else None
        if shared is not None:
            return shared
        runnable = self._compile_or_load(gm, example_inputs, piece_index, compile_range, key,
                                         dump_dir)
        if shareable:
            self.share(key, piece_index, runnable)
        return runnable

    def share(self, key: str, piece_index: int, runnable: Callable) -> None:
        self._shared[key] = (piece_index, runnable)

    def _shareable(self, dump_dir: str | None = None) -> bool:
        return self.compiler.name == "inductor" and not self.frozen and dump_dir is None

    def shared_runnable(self, key: str, piece_index: int, tag: str) -> Callable | None:
        if key not in self._shared:
            return None
        first, runnable = self._shared[key]
        compilation_counter.num_shared_piece_compiles += 1
        self.timer.record("inductor compilation", 0.0, piece=piece_index, range=tag,
                          backend=self.compiler.name, cache=f"shared with piece {first}")
        return runnable

    def piece_label(self, piece_index: int, compile_range: Range) -> str:
        """How the progress lines name one piece compile: "piece 3/25 (graph piece 4, tokens
        [1, 2048]) with inductor": its place among the compiled pieces of the split, its index
        (the start-up table's and the debug dump's), the token counts it serves."""
        compiled = [item.index for item in self.pieces if not item.is_splitting]
        place = (f"{compiled.index(piece_index) + 1}/{len(compiled)}"
                 if piece_index in compiled else str(piece_index))
        tokens = (f"{compile_range.start} tokens" if compile_range.is_single_size()
                  else f"tokens {compile_range}")
        return (f"piece {place} (graph piece {piece_index}, {tokens}) with "
                f"{self.compiler.name}")

    def _compile_or_load(self, gm: fx.GraphModule | Callable[[], fx.GraphModule] | None,
                         example_inputs: list[Any],
                         piece_index: int, compile_range: Range, key: str,
                         dump_dir: str | None) -> Callable:
        """The one path of a piece compile: from the compile cache when it has the piece,
        else compiled (and saved). Without a cache (or with frozen pieces) always compiled.
        A missing piece whose graph is not at hand (`gm` None) raises GraphCacheMiss; a
        function `gm` is called for the graph only when it is compiled."""
        tag = compile_range.tag
        what = self.piece_label(piece_index, compile_range)
        cache = None if self.frozen else self.cache
        with contextlib.ExitStack() as stack:
            if cache is not None:
                stack.enter_context(self.cache_lock(what))
            info = stack.enter_context(self.timer.phase(
                "inductor compilation", piece=piece_index, range=tag,
                backend=self.compiler.name))
            if cache is not None:
                name = cache.piece_entry(piece_index, tag)
                with waiting(logger, f"Loading {what} from the compile cache", announce=False,
                             done=f"Loaded {what} from the compile cache") as wait:
                    loaded = cache.load_piece(name, key, self.compiler)
                    if loaded is None and wait is not None:
                        wait.done = None
                if loaded is not None:
                    runnable, info["cache"] = loaded
                    return runnable
            if gm is None:
                info["cache"] = "load failed" if cache is not None and name in cache.dropped \
                    else "missing"
                raise GraphCacheMiss(f"compiled piece {piece_index} ({tag}) is missing or "
                                     "damaged in the compile cache")
            if cache is None:
                info["cache"] = "frozen" if self.cache is not None else "off"
            else:
                info["cache"] = "miss"
            if not isinstance(gm, fx.GraphModule):
                gm = gm()
            runnable = self._run_compiler(gm, example_inputs, piece_index, compile_range,
                                          dump_dir, what)
            if cache is not None:
                cache.store_piece(name, key, self.compiler, runnable)
            return runnable

    def _run_compiler(self, gm: fx.GraphModule, example_inputs: list[Any], piece_index: int,
                      compile_range: Range, dump_dir: str | None, what: str) -> Callable:
        # Inductor's cache in the compile-cache entry (frozen pieces too: their C++ objects
        # are reused); compilers without one (eager) take 5 arguments.
        extra = (self.cache.inductor_cache_dir,) if self.cache is not None else ()
        with _stage(f"{self.compiler.name} compile of piece {piece_index}", self.dumper,
                    piece_index), waiting(logger, f"Compiling {what}", done=f"Compiled {what}"):
            try:
                compiled = self.compiler.compile(gm, example_inputs, compile_range,
                                                 piece_index, dump_dir, *extra)
            except Exception as e:
                # Inductor reads its own cache while compiling: once more from an empty one,
                # in case a damaged file there was the cause.
                if self.cache is None or self.frozen or not self.cache.reset_inductor_cache(
                        f"compiling piece {piece_index} failed: {type(e).__name__}: {e}"):
                    raise
                compiled = self.compiler.compile(gm, example_inputs, compile_range,
                                                 piece_index, dump_dir, *extra)
        self._record_output_code(piece_index, compile_range.tag, dump_dir)
        return compiled

    @contextlib.contextmanager
    def cache_lock(self, what: str) -> Iterator[None]:
        """The compile cache's lock, for the compile or load of `what` (`piece_label`);
        another process compiling the same piece holds it as long as that takes: the wait
        logs progress."""
        assert self.cache is not None
        with contextlib.ExitStack() as stack:
            with waiting(logger, f"Waiting for another process to compile {what} (the compile "
                         f"cache {self.cache.directory} is locked)", announce=False):
                stack.enter_context(self.cache.lock())
            yield

    def _record_output_code(self, piece_index: int, tag: str, dump_dir: str | None) -> None:
        if dump_dir is None or self.compiler.name != "inductor":
            return
        import glob

        found = sorted(glob.glob(f"{dump_dir}/inductor/**/output_code.py", recursive=True))
        self.dumper.record_output_code(piece_index, tag, found[-1] if found else "(not found)")


_deferred_reports: list[VllmBackend] | None = None


@contextlib.contextmanager
def deferred_cache_reports() -> Iterator[None]:
    """Backends that compile inside the block log their compile-cache line once, when it
    ends (after the engine's warm-up has also compiled the static sizes), not after the
    first compile."""
    global _deferred_reports
    outer, _deferred_reports = _deferred_reports, []
    try:
        yield
    finally:
        backends, _deferred_reports = _deferred_reports, outer
        for backend in backends:
            backend.report_cache()


def _parameter_inputs(split_gm: fx.GraphModule, name: str, example_inputs: list[Any]
                      ) -> dict[int, torch.Tensor]:
    """Positions of the arguments of submodule `name` that are model parameters (Dynamo passes
    parameters as graph inputs), with the parameter tensors."""
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    index_of = {node: i for i, node in enumerate(placeholders)}
    call = next(n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name)
    constants = {}
    for position, arg in enumerate(call.args):
        i = index_of.get(arg)
        if i is not None and isinstance(example_inputs[i], torch.nn.Parameter):
            constants[position] = example_inputs[i]
    return constants


def traced_source_files(gm: fx.GraphModule) -> list[str]:
    """Files of user code that Dynamo traced (from the graph's stack traces), torch excluded."""
    import os

    torch_dir = os.path.dirname(torch.__file__)
    files = set()
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        for line in trace.splitlines():
            line = line.strip()
            if line.startswith('File "'):
                path = line[6:line.find('"', 6)]
                if os.path.isfile(path) and not path.startswith(torch_dir):
                    files.add(path)
    return sorted(files)


class _stage:
    """Turns any failure inside the block into a CompilationStageError naming the stage."""

    def __init__(self, stage: str, dumper: DebugDumper | None = None,
                 piece_index: int | None = None) -> None:
        self.stage, self.dumper, self.piece_index = stage, dumper, piece_index

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, CompilationStageError):
            return False
        if not isinstance(exc, Exception):
            return False  # Ctrl-C (KeyboardInterrupt), SystemExit: not a compile failure
        inner = find_stage_error(exc)
        if inner is not None:
            raise inner.with_dump_dir(self.dumper.dir if self.dumper else None) \
                from inner.__cause__
        error = CompilationStageError(self.stage, self.piece_index,
                                      self.dumper.dir if self.dumper else None,
                                      detail=f"{type(exc).__name__}: {exc}")
        if self.dumper is not None:
            self.dumper.record_failure(error, exc)
        raise error from exc


def find_stage_error(exc: BaseException | None) -> CompilationStageError | None:
    """Our stage error somewhere in an exception chain (Dynamo and Inductor wrap errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CompilationStageError):
            return exc
        inner = getattr(exc, "inner_exception", None)
        exc = inner if isinstance(inner, BaseException) else (exc.__cause__ or exc.__context__)
    return None


