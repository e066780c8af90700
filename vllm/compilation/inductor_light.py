"""Compiled CPU pieces run without importing Inductor (warm starts).

Importing anything under `torch._inductor` imports Dynamo with it: ~1.4 s on the dev
machines, more than everything else a warm -O2 start adds to an -O0 one. Running a compiled
CPU piece needs neither. Inductor's output code is a Python module whose `call(args)`
allocates buffers and calls C++ kernels, each built as a Python extension module (a `.so` in
the compile-cache entry's Inductor cache), and a few torch ops. So once a piece has been
compiled or loaded the full way, `describe()` writes down what running it again takes:
  source   the output code, rewritten: the values it imported from Inductor come from us,
           each kernel's build call becomes the already built kernel, and the benchmark
           harness at its end is gone;
  kernels  per kernel: its extension module's name, and a copy of its file kept under its
           sha256 in our own directory (`kernel_dir`): Inductor may build the same kernel
           again into its cache (two processes compiling at once both do), and the builds
           differ byte-wise;
  extern   the torch functions the code calls as `extern_kernels.<name>`;
With Inductor's C++ wrapper (`cpp_wrapper`, CPU -O3) the host code itself is C++, built with
the kernels into one extension module: the output code's `call` is a thin Python shim around
it, and that module is described and copied like a kernel.
and `load()` runs it: a `LightPiece`, called like the full artifact (outputs as a list,
autograd off). Only pieces whose runtime wrappers do nothing at inference are described: no
input mutated, no output that aliases another tensor, no effect tokens, RNG state, grad-mode
change or tensor subclasses, no inputs to realign, no constants (freezing), CPU only, one
graph in the FX cache entry. Anything else raises `NotLight` (the piece keeps loading the
full way), as does output code using something this module does not know.

In the compile cache the description is the piece entry's companion
`<piece>.<range>.light.json`, checksummed like the piece: `CompileCache.load_piece` tries it
first and `store_piece` writes it (cache.py).

Why not torch's own mechanism: loading a standalone-compile artifact
(`torch._inductor.CompiledArtifact.load`) or an AOT-compiled function
(`torch.compiler.load_compiled_function`) imports Inductor or Dynamo (1.4-3.4 s measured in
torch 2.13 on the dev machines), which is what this module exists to avoid. So `describe`
reads the artifact through torch's cache classes (`AOTAutogradCache`, `FxGraphCache`: the
parts of Inductor that are not public API), checks what it relies on, and raises `NotLight`
for anything else; the piece then loads the full way, with torch's API.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from vllm.compilation.cache_key import sha256_file
from vllm.logger import init_logger

logger = init_logger(__name__)

FORMAT = 1
_LIGHT = "__vllm_light__"
"""The name the rewritten source reads the kernels, extern functions and `align` from."""

_PLAIN_MODULES = frozenset({"cmath", "ctypes", "math", "os", "random", "tempfile", "torch"})
"""Modules output code may import as they are."""
_PROVIDED = {("torch._inductor.select_algorithm", "extern_kernels"): "extern_kernels",
             ("torch._inductor.codegen.memory_planning", "_align"): "align"}
"""Inductor values output code imports that we provide: (module, name) -> our attribute."""
_WRAPPER_BUILDERS = {("torch._inductor.codecache", "CppWrapperCodeCache")}
"""Inductor classes that C++-wrapper output code (`cpp_wrapper`) builds its host code with:
`inductor_entry = CppWrapperCodeCache.load_pybinding(...)` is a kernel build like
`async_compile.cpp_pybinding`, and the class may be used for nothing else."""
_UNUSED_IMPORTS = {("torch._inductor.hooks", "run_intermediate_hooks"),
                   ("torch._inductor.utils", "maybe_profile"),
                   ("torch._inductor.async_compile", "AsyncCompile")}
"""Inductor values output code imports that a piece may hold only if it never uses them."""
_HARNESS = frozenset({"get_args", "benchmark_compiled_module"})


class NotLight(Exception):
    """This piece cannot run without Inductor (the reason is the message)."""


class DamagedKernel(ValueError):
    """A kernel file differs from the one described (size or checksum)."""


# ---- describing (Inductor is loaded: the piece was just compiled or loaded) ---------------
def describe(artifact_path: str, inductor_cache_dir: str, kernel_dir: str) -> dict[str, Any]:
    """What `load` needs to run the piece saved at `artifact_path` (a standalone-compile
    binary artifact whose Inductor cache is `inductor_cache_dir`); its kernels are copied
    into `kernel_dir`. Raises `NotLight`."""
    from vllm.compilation.compiler_interface import inductor_cache_dir as use_cache_dir

    with use_cache_dir(inductor_cache_dir):
        entry = _autograd_entry(artifact_path)
        _check_wrappers(entry)
        graph = _fx_graph(entry)
        _check_graph(graph)
        source, kernel_names, extern_names, uses_align = rewrite(graph.source_code)
        kernels = _kernel_files(graph.source_code, kernel_names, inductor_cache_dir,
                                kernel_dir)
    from torch._inductor import utils as inductor_utils

    return {"format": FORMAT, "torch": torch.__version__, "source": source,
            "kernels": kernels, "extern": {name: _extern_path(name) for name in extern_names},
            "ops": sorted(map(list, {tuple(op) for op in used_ops(source)
                                     + cpp_wrapper_ops(graph.source_code)})),
            "align_bytes": inductor_utils.ALIGN_BYTES if uses_align else None}


def _autograd_entry(artifact_path: str) -> Any:
    import torch._inductor.config as inductor_config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.standalone_compile import CacheCompiledArtifact
    from torch.utils._appending_byte_serializer import BytesReader

    with open(artifact_path, "rb") as f:
        reader = BytesReader(f.read())
    if reader.read_bytes() != CacheCompiledArtifact.CACHE_HEADER:
        raise NotLight("the artifact is not in the cache-entry format")
    reader.read_bytes()  # torch's key: the full load checked it
    key = reader.read_str()
    with inductor_config.patch(unsafe_skip_cache_dynamic_shape_guards=True), \
            torch._functorch.config.patch(strict_autograd_cache=True):
        found = AOTAutogradCache._lookup(key, local=True, remote=False, args=[],
                                         cache_info={}, aot_config=None)
    if found is None:
        raise NotLight("its AOTAutograd entry is not in the Inductor cache")
    return found[0]


def _check_wrappers(entry: Any) -> None:
    """What AOTAutograd wraps around the compiled graph must be a plain call."""
    from torch._functorch._aot_autograd.schemas import OutputType

    meta = entry.runtime_metadata
    problems = []
    if getattr(entry, "compiled_bw", None) is not None:
        problems.append("it has a backward graph")
    if any(info.mutates_data or info.mutates_metadata
           or getattr(info, "mutates_storage_metadata", False) for info in meta.input_info):
        problems.append("it mutates an input")
    if any(info.output_type != OutputType.non_alias for info in meta.output_info):
        problems.append("an output aliases another tensor")
    if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized:
        problems.append("it returns intermediate bases, effect tokens or RNG state")
    if getattr(meta, "grad_enabled_mutation", None) is not None:
        problems.append("it changes the grad mode")
    if entry.maybe_subclass_meta is not None:
        problems.append("it takes or returns tensor subclasses")
    if any(getattr(w, "needs_post_compile", True) for w in entry.dispatch_wrappers):
        problems.append("its arguments are deduplicated or rebased")
    if problems:
        raise NotLight("; ".join(problems))


def _fx_graph(entry: Any) -> Any:
    import pickle

    from torch._inductor.codecache import FxGraphCache

    key = entry.compiled_fw.fx_graph_cache_info[0]
    directory = FxGraphCache._get_tmp_dir_for_key(key)
    try:
        files = sorted(os.listdir(directory))
    except OSError:
        files = []
    if len(files) != 1:
        raise NotLight(f"{len(files)} graphs under its FX cache key (one expected)")
    with open(os.path.join(directory, files[0]), "rb") as f:
        return pickle.load(f)


def _check_graph(graph: Any) -> None:
    problems = []
    if set(graph.device_types) != {"cpu"}:
        problems.append(f"it runs on {sorted(graph.device_types)}")
    if graph.mutated_input_idxs or graph.inputs_to_check:
        problems.append("its inputs are realigned or written back")
    if graph.constants or getattr(graph, "frozen_param_names", None) \
            or getattr(graph, "torchbind_constants", None):
        problems.append("it holds constants")
    if getattr(graph, "cudagraph_info", None) is not None:
        problems.append("it has CUDA-graph info")
    if not graph.source_code:
        problems.append("it has no output code")
    if problems:
        raise NotLight("; ".join(problems))


def rewrite(source: str) -> tuple[str, list[str], list[str], bool]:
    """Output code -> (code runnable without Inductor, the kernel variables it reads from
    `__vllm_light__.kernels`, the `extern_kernels` attributes it uses, whether it uses
    `align`). Raises `NotLight` for anything it does not know. (`used_ops` lists the torch
    ops it calls.)"""
    tree = ast.parse(source)
    body: list[ast.stmt] = []
    kernels: list[str] = []
    dropped: set[str] = set()
    builders: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # the docstring (the autotuning block, as text)
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(
                ("torch._inductor", "torch._dynamo")):
            for alias in stmt.names:
                pair = (stmt.module, alias.name)
                local = alias.asname or alias.name
                if pair in _PROVIDED:
                    body.append(_assign(local, _light_attr(_PROVIDED[pair])))
                elif pair in _WRAPPER_BUILDERS:
                    builders.add(local)
                    dropped.add(local)
                elif pair in _UNUSED_IMPORTS:
                    dropped.add(local)
                else:
                    raise NotLight(f"its output code imports {alias.name} from {stmt.module}")
            continue
        if _is_async_compile_stmt(stmt):
            continue
        kernel = _kernel_build(stmt, builders)
        if kernel is not None:
            kernels.append(kernel)
            body.append(_assign(kernel, ast.Subscript(value=_light_attr("kernels"),
                                                      slice=ast.Constant(kernel),
                                                      ctx=ast.Load())))
            continue
        if isinstance(stmt, ast.FunctionDef) and stmt.name in _HARNESS:
            continue
        if isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test):
            continue
        body.append(stmt)
    module = ast.Module(body=_without_unused_strings(body), type_ignores=[])
    extern, uses_align = set(), False
    for node in ast.walk(module):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names])
            for name in names:
                if name.split(".")[0] not in _PLAIN_MODULES or name.startswith("torch._"):
                    raise NotLight(f"its output code imports {name}")
        elif isinstance(node, ast.Name):
            if node.id in dropped or node.id in ("async_compile", "AsyncCompile"):
                raise NotLight(f"its output code uses {node.id}")
            uses_align = uses_align or (node.id == "align" and isinstance(node.ctx, ast.Load))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "extern_kernels"):
            extern.add(node.attr)
    defined = {s.name for s in body if isinstance(s, ast.FunctionDef)}
    defined |= {t.id for s in body if isinstance(s, ast.Assign) for t in s.targets
                if isinstance(t, ast.Name)}
    if "call" not in defined:
        raise NotLight("its output code defines no call()")
    return ast.unparse(ast.fix_missing_locations(module)), kernels, sorted(extern), uses_align


def used_ops(source: str) -> list[list[str]]:
    """The `torch.ops.<namespace>.<op>` the (rewritten) code refers to, directly or through a
    module-level alias of `torch.ops.<namespace>` (`aten = torch.ops.aten`), as
    [namespace, op] pairs. Some are registered by Python code (ours, or Inductor's own), so a
    load checks that each exists before the code runs."""
    tree = ast.parse(source)

    def namespace_of(node: ast.AST) -> str | None:  # `torch.ops.<ns>` -> ns
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "ops" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"):
            return node.attr
        return None

    aliases = {}
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            namespace = namespace_of(stmt.value)
            if namespace is not None:
                aliases[stmt.targets[0].id] = namespace
    ops = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        namespace = namespace_of(node.value)
        if namespace is None and isinstance(node.value, ast.Name):
            namespace = aliases.get(node.value.id)
        if namespace is not None:
            ops.add((namespace, node.attr))
    return [list(op) for op in sorted(ops)]


def _assign(name: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value, lineno=0)


def _light_attr(attr: str) -> ast.Attribute:
    return ast.Attribute(value=ast.Name(id=_LIGHT, ctx=ast.Load()), attr=attr, ctx=ast.Load())


def _is_async_compile_stmt(stmt: ast.stmt) -> bool:
    """`async_compile = AsyncCompile()`, `async_compile.wait(globals())`,
    `del async_compile`."""
    def is_async_compile(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "async_compile"

    if isinstance(stmt, ast.Assign):
        return (len(stmt.targets) == 1 and is_async_compile(stmt.targets[0])
                and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id == "AsyncCompile")
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        return (isinstance(func, ast.Attribute) and func.attr == "wait"
                and is_async_compile(func.value))
    if isinstance(stmt, ast.Delete):
        return len(stmt.targets) == 1 and is_async_compile(stmt.targets[0])
    return False


def _kernel_build(stmt: ast.stmt, builders: set[str]) -> str | None:
    """The variable of `NAME = async_compile.cpp_pybinding(...)` or of the C++ wrapper's
    `NAME = <builder>.load_pybinding(...)` (`builders`: the local names of
    `_WRAPPER_BUILDERS`), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Call)):
        return None
    func = stmt.value.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return None
    if func.value.id == "async_compile":
        if func.attr != "cpp_pybinding":
            raise NotLight(f"its output code builds a kernel with async_compile.{func.attr}")
        return stmt.targets[0].id
    if func.value.id in builders:
        if func.attr != "load_pybinding":
            raise NotLight(f"its output code builds its C++ wrapper with {ast.unparse(func)}")
        # With `kernel_code` the kernels are a second build the wrapper links to.
        extra = {k.arg: k.value for k in stmt.value.keywords}.get("kernel_code")
        if not (extra is None or isinstance(extra, ast.Constant) and extra.value is None):
            raise NotLight("its C++ wrapper is built apart from its kernels (kernel_code)")
        return stmt.targets[0].id
    return None


def _without_unused_strings(body: list[ast.stmt]) -> list[ast.stmt]:
    """`body` less the module-level string constants nothing reads any more (the C++
    wrapper's source, once its build is replaced by the built module)."""
    loaded = {node.id for stmt in body for node in ast.walk(stmt)
              if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}

    def unused_string(stmt: ast.stmt) -> bool:
        return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id not in loaded
                and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str))
    return [stmt for stmt in body if not unused_string(stmt)]


_CPP_OP_CALL = re.compile(
    r'(?:aoti_torch_call_dispatcher|findSchemaOrThrow)\(\s*"([A-Za-z_]\w*)::([A-Za-z_]\w*)"')


def cpp_wrapper_ops(source: str) -> list[list[str]]:
    """The ops C++-wrapper output code calls through the dispatcher by name, as
    [namespace, op] pairs (`used_ops` finds the Python references)."""
    return [list(op) for op in sorted(set(_CPP_OP_CALL.findall(source)))]


def _kernel_files(source: str, names: list[str], inductor_cache_dir: str, kernel_dir: str
                  ) -> list[dict[str, Any]]:
    """Each built kernel's extension module, copied into `kernel_dir`: Inductor loads the
    output code (from its own cache: the piece was just loaded) and we read each kernel's
    module."""
    import shutil

    from torch._inductor.codecache import PyCodeCache

    from vllm.utils.file_utils import atomic_path

    module = PyCodeCache.load(source)
    # A kernel module loaded earlier in this process may be one of our copies (Inductor
    # reuses loaded kernel modules by name).
    roots = tuple(os.path.realpath(d) + os.sep for d in (inductor_cache_dir, kernel_dir))
    os.makedirs(kernel_dir, exist_ok=True)
    kernels = []
    for name in names:
        fn = getattr(module, name, None)
        ext = getattr(fn, "__self__", None)
        path = os.path.realpath(getattr(ext, "__file__", None) or "")
        if not path.startswith(roots) or not callable(fn):
            raise NotLight(f"kernel {name} is not a built extension in the compile cache")
        digest = sha256_file(path)
        final = os.path.join(kernel_dir, f"{digest}.so")
        if not (os.path.isfile(final) and sha256_file(final) == digest):
            with atomic_path(final) as tmp:
                shutil.copyfile(path, tmp)
                # Inductor may build the same kernel again meanwhile (another process).
                if sha256_file(tmp) != digest:
                    raise NotLight(f"kernel {name}'s file changed while it was copied")
        size = os.path.getsize(final)
        kernels.append({"var": name, "module": ext.__name__, "attr": fn.__name__,
                        "file": f"{digest}.so", "size": size, "sha256": digest})
    return kernels


def _extern_path(name: str) -> list[str]:
    """How to find `extern_kernels.<name>` without Inductor: ["torch", fn] or
    ["op", namespace, op, overload]."""
    from torch._inductor.select_algorithm import extern_kernels

    value = getattr(extern_kernels, name)
    if getattr(torch, name, None) is value:
        return ["torch", name]
    if isinstance(value, torch._ops.OpOverload):
        return ["op", value.namespace, value._opname, value._overloadname]
    raise NotLight(f"extern kernel {name} is {value!r}")


# ---- loading (no Inductor) -----------------------------------------------------------------
_CPP_WRAPPER_SHIM = ast.unparse(ast.parse("""  # (compared after ast.unparse: layout aside)
def _wrap_func(f):
    def g(args):
        input_tensors = [arg if isinstance(arg, torch.Tensor)
                         else torch.tensor(arg, device='cpu') for arg in args]
        input_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(input_tensors)
        args.clear()
        del input_tensors
        output_handles = f(input_handles)
        output_tensors = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(output_handles)
        return output_tensors
    return g
"""))
"""The Python shim C++-wrapper output code (torch 2.13) defines around its C++ entry."""


class CppEntryCall:
    """What `_CPP_WRAPPER_SHIM` does, with the 0-d tensors its int arguments (the token count)
    become kept per value: torch.tensor() took ~3 us a call, paid by every piece of every step.
    The entry only reads its inputs (no piece mutates one: `describe` checks)."""

    MAX_INTS = 8192

    def __init__(self, entry: Callable[[list[Any]], list[Any]]) -> None:
        self._entry = entry
        self._ints: dict[int, torch.Tensor] = {}

    def _scalar(self, value: Any) -> torch.Tensor:
        if type(value) is not int:
            return torch.tensor(value, device="cpu")
        tensor = self._ints.get(value)
        if tensor is None:
            tensor = torch.tensor(value, device="cpu")
            if len(self._ints) < self.MAX_INTS:
                self._ints[value] = tensor
        return tensor

    def __call__(self, args: list[Any]) -> list[Any]:
        handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(
            [a if isinstance(a, torch.Tensor) else self._scalar(a) for a in args])
        args.clear()
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(self._entry(handles))


def _fast_call(source: str, namespace: dict[str, Any]) -> Callable[[list[Any]], Any]:
    """The piece's `call`: a `CppEntryCall` where the code is C++-wrapper output whose shim is
    exactly `_CPP_WRAPPER_SHIM` (`call = _wrap_func(<entry>)`), else the code's own."""
    call = namespace["call"]
    tree = ast.parse(source)
    shims = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "_wrap_func"]
    assigns = [s for s in tree.body if isinstance(s, ast.Assign)
               and [ast.unparse(t) for t in s.targets] == ["call"]]
    if len(shims) != 1 or ast.unparse(shims[0]) != _CPP_WRAPPER_SHIM or len(assigns) != 1:
        return call
    value = assigns[0].value
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) == "_wrap_func"
            and len(value.args) == 1 and isinstance(value.args[0], ast.Name)
            and not value.keywords):
        return call
    return CppEntryCall(namespace[value.args[0].id])


class LightPiece:
    """A compiled piece's `call` run directly: called like the full artifact."""

    def __init__(self, call: Callable[[list[Any]], Any], name: str) -> None:
        self._call = call
        self.name = name

    def __call__(self, *args: Any) -> list[Any]:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return list(self._call(list(args)))
        return list(self._call(list(args)))


def load(record: dict[str, Any], kernel_dir: str, name: str = "piece") -> LightPiece:
    """The piece `record` (from `describe`) describes, its kernels from `kernel_dir`.
    Raises `DamagedKernel`, or OSError, ValueError, ImportError ... when a file is missing
    or from another torch."""
    if record.get("format") != FORMAT or record.get("torch") != torch.__version__:
        raise ValueError("described by another format or torch version")
    for namespace, op in record["ops"]:
        try:
            getattr(getattr(torch.ops, namespace), op)
        except (AttributeError, RuntimeError):
            raise ValueError(f"op {namespace}::{op} is not registered in this process") \
                from None
    # What the kernels' module init reads (Inductor sets it before loading one).
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    kernels = {}
    for kernel in record["kernels"]:
        path = os.path.join(kernel_dir, kernel["file"])
        if os.path.getsize(path) != kernel["size"] or sha256_file(path) != kernel["sha256"]:
            raise DamagedKernel(f"kernel file {path} is damaged (size or checksum)")
        kernels[kernel["var"]] = getattr(_extension(kernel["module"], path), kernel["attr"])
    align_bytes = record["align_bytes"]
    light = SimpleNamespace(
        kernels=kernels,
        extern_kernels=SimpleNamespace(**{n: _resolve_extern(p)
                                          for n, p in record["extern"].items()}),
        align=(lambda nbytes: (nbytes + align_bytes - 1) & -align_bytes) if align_bytes
        else None)
    namespace: dict[str, Any] = {"__name__": f"vllm_light_{name}", _LIGHT: light}
    exec(compile(record["source"], f"<compiled {name}>", "exec"), namespace)
    return LightPiece(_fast_call(record["source"], namespace), name)


def _extension(module_name: str, path: str) -> Any:
    """Load a kernel's extension module, under the name Inductor gives it (so that Inductor,
    if it loads the same kernel later in this process, reuses it)."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load kernel {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def _resolve_extern(path: list[str]) -> Any:
    if path[0] == "torch":
        return getattr(torch, path[1])
    _, namespace, op, overload = path
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)
