"""PiecewiseBackend: one compiled piece, dispatching on the runtime token count.

A piece is compiled once per compile range with the token dimension symbolic, and once per
`compile_sizes` entry with static shapes, all when the piece is built (at the first forward,
during start-up): the static compiles take fake inputs whose token dimension is that size. A
piece restored from the compile cache without its traced graph at hand loads its static
compiles at the first call of each size (the engine's warm-up). At run time an exact compile
size wins, else the range holding the token count.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from vllm.compilation.compiler_interface import graph_digest
from vllm.config.utils import Range
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.compilation.backends import VllmBackend

logger = init_logger(__name__)


def _is_symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and not isinstance(value.node.maybe_as_int(), int)


def find_token_locator(example_inputs: list[Any]) -> tuple[int, int | None] | None:
    """Where the token count is found at run time: (arg index, None) for a SymInt argument,
    (arg index, dim) for the first tensor with a symbolic dimension; None for a static piece."""
    for i, arg in enumerate(example_inputs):
        if _is_symbolic(arg):
            return i, None
    for i, arg in enumerate(example_inputs):
        if isinstance(arg, torch.Tensor):
            for d, size in enumerate(arg.shape):
                if _is_symbolic(size):
                    return i, d
    return None


def concrete_inputs(example_inputs: list[Any], size: int) -> list[Any] | None:
    """Fake inputs of a static compile for `size` tokens: `example_inputs` (Dynamo's fake
    values, the token dimension symbolic) with every symbol set to `size`, in a fake mode of
    their own (no shape environment: every shape static). Real tensors and other values are
    kept as they are. None when an input has no strided layout to rebuild (e.g. an MKLDNN
    tensor): that size is then compiled from the real inputs of its first call."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def concrete(value: Any) -> int:
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = value.node.expr
        return int(expr.subs(dict.fromkeys(expr.free_symbols, size)))

    mode = FakeTensorMode()
    inputs: list[Any] = []
    for arg in example_inputs:
        if isinstance(arg, torch.SymInt):
            inputs.append(concrete(arg))
        elif isinstance(arg, FakeTensor):
            if arg.layout != torch.strided:
                return None
            shape = [concrete(d) for d in arg.shape]
            stride = [concrete(d) for d in arg.stride()]
            with mode:
                tensor = torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device,
                                             requires_grad=arg.requires_grad)
            inputs.append(tensor)
        else:
            inputs.append(arg)
    return inputs


def with_tuple_output(gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """A copy of `gm` returning a tuple (what AOTAutograd wants) and whether it had to wrap a
    single output."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return gm, False
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    output.args = ((output.args[0],),)
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new, True


def inputs_to_constants(gm: fx.GraphModule, constants: dict[int, torch.Tensor]
                        ) -> fx.GraphModule:
    """A copy of `gm` where the placeholders at the given input positions read attributes
    holding those tensors (for Inductor freezing, which folds attributes, not inputs)."""
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for index, tensor in constants.items():
        node = placeholders[index]
        attr = f"_frozen_{index}_{node.name}"
        new.register_buffer(attr, tensor.detach(), persistent=False)
        with graph.inserting_before(node):
            get = graph.get_attr(attr)
        get.meta = dict(node.meta)
        node.replace_all_uses_with(get)
        graph.erase_node(node)
    new.recompile()
    return new


class PiecewiseBackend:
    """Callable standing in for one split submodule of the model graph.

    `constant_inputs` (piece input position -> tensor, the weights when Inductor freezing is
    on) become attributes of the compiled graph and are dropped from the call's arguments.
    `restore` rebuilds one from `saved_info()` and the compile cache, without example
    inputs (a warm start that skips Dynamo)."""

    def __init__(self, gm: fx.GraphModule, piece_index: int, example_inputs: list[Any],
                 vllm_backend: VllmBackend,
                 constant_inputs: dict[int, torch.Tensor] | None = None) -> None:
        gm, single_output = with_tuple_output(gm)
        keep: list[int] | None = None
        if constant_inputs:
            gm = inputs_to_constants(gm, constant_inputs)
            keep = [i for i in range(len(example_inputs)) if i not in constant_inputs]
            example_inputs = [example_inputs[i] for i in keep]
        self._setup(gm, piece_index, vllm_backend, single_output,
                    find_token_locator(example_inputs), graph_digest(gm), keep)
        self.range_keys: dict[Range, str] = {}
        for compile_range in self.ranges:
            self.range_keys[compile_range] = vllm_backend.piece_key(
                gm, example_inputs, compile_range, self.digest)
            self.range_runnables[compile_range] = vllm_backend.compile_piece(
                gm, example_inputs, piece_index, compile_range, self.digest)
        for size in sorted(self.compile_sizes):
            inputs = concrete_inputs(example_inputs, size)
            if inputs is not None:
                self.size_runnables[size] = vllm_backend.compile_piece(
                    gm, inputs, piece_index, Range(size, size), self.digest)

    def _setup(self, gm: fx.GraphModule | None, piece_index: int, vllm_backend: VllmBackend,
               single_output: bool, locator: tuple[int, int | None] | None, digest: str,
               keep: list[int] | None) -> None:
        self._gm = gm
        self._load_gm: Callable[[], fx.GraphModule] | None = None
        self.piece_index = piece_index
        self.vllm_backend = vllm_backend
        self.single_output = single_output
        self.locator = locator
        self.digest = digest
        self.keep = keep
        cc = vllm_backend.vllm_config.compilation_config
        self.ranges: list[Range] = list(vllm_backend.compile_ranges)
        self.compile_sizes: set[int] = set(cc.compile_sizes or []) if locator else set()
        self.range_runnables: dict[Range, Callable] = {}
        self.size_runnables: dict[int, Callable] = {}
        self._warned_outside = False
        if locator is None:
            # Nothing depends on the token count: one compile serves every batch.
            self.ranges = self.ranges[-1:]

    def saved_info(self) -> dict[str, Any]:
        """What `restore` needs (plain data: saved with the traced graph)."""
        return {"index": self.piece_index, "single_output": self.single_output,
                "locator": list(self.locator) if self.locator else None,
                "digest": self.digest, "keep": self.keep,
                "ranges": [[r.start, r.end, self.range_keys[r]] for r in self.ranges]}

    @property
    def gm(self) -> fx.GraphModule:
        """The piece's graph (compiled for a compile size the compile cache lacks). A restored
        piece builds it on first use: FX re-traces a graph it unpickles (~5 ms a piece)."""
        if self._gm is None:
            assert self._load_gm is not None
            self._gm, _ = with_tuple_output(self._load_gm())
        return self._gm

    @classmethod
    def restore(cls, load_gm: Callable[[], fx.GraphModule], info: dict[str, Any],
                vllm_backend: VllmBackend, loaded: dict[Range, Callable]) -> PiecewiseBackend:
        """A piece from `saved_info()` and its runnables loaded from the compile cache
        (`loaded`: range -> runnable, every range of `expected_ranges(info)`); `load_gm()`
        gives its graph when it is needed."""
        self = cls.__new__(cls)
        locator = tuple(info["locator"]) if info["locator"] else None
        self._setup(None, info["index"], vllm_backend, info["single_output"], locator,
                    info["digest"], info["keep"])
        self._load_gm = load_gm
        self.range_keys = {Range(s, e): key for s, e, key in info["ranges"]}
        if list(self.range_keys) != self.ranges:
            raise ValueError(f"piece {self.piece_index}: saved compile ranges "
                             f"{[str(r) for r in self.range_keys]} differ from the config's")
        self.range_runnables = {r: loaded[r] for r in self.ranges}
        return self

    def num_tokens(self, args: tuple) -> int | None:
        if self.locator is None:
            return None
        index, dim = self.locator
        value = args[index]
        return int(value) if dim is None else value.shape[dim]

    def runnable_for(self, num_tokens: int | None, args: tuple) -> Callable:
        if num_tokens is not None and num_tokens in self.compile_sizes:
            runnable = self.size_runnables.get(num_tokens)
            if runnable is None:
                start = time.perf_counter()
                # A restored piece builds its graph only if the size must be compiled (not
                # when the compile cache has it).
                graph = self._gm if self._gm is not None else (lambda: self.gm)
                runnable = self.vllm_backend.compile_piece(
                    graph, list(args), self.piece_index, Range(num_tokens, num_tokens),
                    self.digest)
                self.size_runnables[num_tokens] = runnable
                logger.debug("piece %d: static compile for %d tokens took %.2f s",
                             self.piece_index, num_tokens, time.perf_counter() - start)
            return runnable
        if num_tokens is not None:
            for compile_range in self.ranges:
                if num_tokens in compile_range:
                    return self.range_runnables[compile_range]
            if not self._warned_outside:
                self._warned_outside = True
                logger.warning("piece %d called with %d tokens, outside every compile range %s "
                               "(max_num_batched_tokens); using the last range's code",
                               self.piece_index, num_tokens, [str(r) for r in self.ranges])
        return self.range_runnables[self.ranges[-1]]

    def __call__(self, *args: Any) -> Any:
        if self.keep is not None:
            args = tuple(args[i] for i in self.keep)
        output = self.runnable_for(self.num_tokens(args), args)(*args)
        return output[0] if self.single_output else output
