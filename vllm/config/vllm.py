"""VllmConfig: the root config, and the resolution of optimization levels into settings.

`__post_init__` resolves in the order DESIGN.md §3 gives:
  1. the user's explicit values (every non-None leaf) are recorded as `user` and never changed;
  2. the level preset fills the leaves still unset (`None`);
  3. the platform hook fills or narrows platform-owned leaves (an explicit user value it cannot
     honour is an error);
  4. derived values and the CUDA-graph downgrade rules; then default capture sizes.
Every level-controlled leaf records where its value came from and why (`explain()`).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from vllm.config.cache import CacheConfig
from vllm.config.compilation import (
    ATTENTION_OP_NAME,
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
)
from vllm.config.levels import (
    LEVEL_CONTROLLED_FIELDS,
    OPTIMIZATION_LEVEL_TO_CONFIG,
    OptimizationLevel,
    describe,
    iter_level_defaults,
)
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.utils import directory_problem, raises_validation_error, to_jsonable
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["VllmConfig", "OptimizationLevel", "Provenance", "OPTIMIZATION_LEVEL_TO_CONFIG"]

# The attention custom op: the default split point for piecewise compilation.
ATTENTION_OPS = [ATTENTION_OP_NAME]

# Leaves outside the level table whose provenance is also reported.
DERIVED_FIELDS = ("compilation_config.backend", "compilation_config.custom_ops",
                  "compilation_config.splitting_ops", "compilation_config.cudagraph_capture_sizes",
                  "compilation_config.max_cudagraph_capture_size",
                  "scheduler_config.max_num_batched_tokens", "scheduler_config.max_num_seqs",
                  "model_config.dtype")


@dataclass(frozen=True)
class Provenance:
    """Where a resolved value came from: `user`, `level O2`, `platform cpu`, `derived: <rule>`,
    `env <NAME>` or `default`, with a one-line reason."""

    source: str
    reason: str = ""


@dataclass
class VllmConfig:
    model_config: ModelConfig | None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    optimization_level: OptimizationLevel | int | str | None = None
    """O0..O3 (also 0..3, "2", "O2"); None = O2, the default."""
    provenance: dict[str, Provenance] = field(default_factory=dict, init=False, repr=False)

    # ---- resolution ---------------------------------------------------------------------
    @raises_validation_error
    def __post_init__(self) -> None:
        from vllm.platforms import get_current_platform

        self.platform = get_current_platform()
        if self.model_config is not None:
            self.model_config.verify_with_parallel_config(
                self.parallel_config.tensor_parallel_size)
        if isinstance(self.compilation_config, dict):
            self.compilation_config = CompilationConfig.from_dict(self.compilation_config)
        self._resolve_level()
        self._record_user_values()
        self._apply_env_overrides()
        self._apply_level_preset()
        self.platform.apply_level_defaults(self)
        self._resolve_model_dtype()
        self._apply_derived_rules()
        self._resolve_cudagraph_mode()
        self._set_cudagraph_sizes()
        self._set_compile_sizes()
        self._set_compile_ranges()
        self.platform.check_and_update_config(self)
        self._set_debug_dump_path()

    def _resolve_level(self) -> None:
        enforce_eager = self.model_config is not None and self.model_config.enforce_eager
        explicit_level = self.optimization_level is not None
        level = (OptimizationLevel.parse(self.optimization_level) if explicit_level
                 else OptimizationLevel.O2)
        if enforce_eager:
            if explicit_level and level != OptimizationLevel.O0:
                raise ValueError(
                    f"enforce_eager=True (--enforce-eager) means -O0 and contradicts the explicit "
                    f"optimization level -O{int(level)}; pass only one of them "
                    "(--enforce-eager is deprecated: use -O0).")
            _warn_enforce_eager_once()
            level = OptimizationLevel.O0
        self.optimization_level = level
        self.provenance["optimization_level"] = Provenance(
            "user" if explicit_level else ("derived: enforce_eager" if enforce_eager
                                           else "default"),
            "--enforce-eager is the deprecated spelling of -O0" if enforce_eager
            else "" if explicit_level else "O2 is the default level")

    def _record_user_values(self) -> None:
        for path in (*LEVEL_CONTROLLED_FIELDS, *DERIVED_FIELDS):
            value = self.get_path(path)
            if path == "compilation_config.backend" and value == "":
                continue
            if path == "compilation_config.custom_ops" and not value:
                continue
            if path == "model_config.dtype" and value in (None, "auto"):
                continue
            if value is not None:
                self.provenance[path] = Provenance("user", "set explicitly")

    def _apply_env_overrides(self) -> None:
        from vllm import envs

        cc = self.compilation_config
        # Read now so that a value that is no on/off is a config error, not a mid-compile one.
        _ = envs.VLLM_DISABLE_COMPILE_CACHE, envs.VLLM_TEST_FAIL_ON_RECOMPILE
        if envs.TORCH_COMPILE_DISABLE and cc.mode != CompilationMode.NONE:
            # As upstream, over an explicit mode too: torch.compile cannot run at all.
            if cc.mode is not None:
                logger.warning("TORCH_COMPILE_DISABLE=1: torch.compile cannot run, so the "
                               "compilation mode %s becomes NONE", _show(cc.mode))
            self._set("compilation_config.mode", CompilationMode.NONE,
                      Provenance("env TORCH_COMPILE_DISABLE", "torch.compile disabled by env"))

    def _apply_level_preset(self) -> None:
        """Fill every leaf of the level's table that is still unset (`None`); a predicate is
        called with this config and its answer recorded with what it asked."""
        level = self.optimization_level
        for path, preset in iter_level_defaults(OPTIMIZATION_LEVEL_TO_CONFIG[level]):
            if self.get_path(path) is not None:
                continue
            if callable(preset):
                value = bool(preset(self))
                reason = f"{describe(preset)}: {'yes' if value else 'no'}"
            else:
                value, reason = (list(preset) if isinstance(preset, list) else preset), ""
            self._set(path, value, Provenance(f"level O{int(level)}", reason))

    def _resolve_model_dtype(self) -> None:
        mc = self.model_config
        if mc is None:
            return
        # A name (torch_dtype imports torch when it is read): resolving needs no torch.
        if mc.dtype == "auto":
            mc.torch_dtype, reason = self.platform.resolve_auto_dtype(mc)
            self.provenance["model_config.dtype"] = Provenance(
                f"platform {self.platform.device_name}", reason)
        else:
            mc.torch_dtype = mc.dtype
        if self.scheduler_config.max_model_len is None:
            self.scheduler_config.max_model_len = mc.max_model_len

    def _check_backend(self) -> None:
        """The backend named for the resolved mode exists: checked here, not after the
        weights are loaded."""
        cc = self.compilation_config
        if cc.mode == CompilationMode.VLLM_COMPILE:
            if cc.backend not in ("inductor", "eager"):
                raise ValueError(f"Invalid backend for piecewise compilation: {cc.backend!r}. "
                                 "With mode VLLM_COMPILE (every level from -O1) the backend "
                                 "must be 'inductor' or 'eager'.")
        elif cc.mode != CompilationMode.NONE and "." not in cc.backend:
            import torch._dynamo

            known = torch._dynamo.list_backends(exclude_tags=())
            if cc.backend not in known:
                raise ValueError(f"compilation_config.backend {cc.backend!r} is not a "
                                 f"torch.compile backend; choose one of {', '.join(known)}, "
                                 "or give a 'module.function' path")

    def _apply_derived_rules(self) -> None:
        cc, sc = self.compilation_config, self.scheduler_config
        if cc.backend == "":
            self._set("compilation_config.backend", self.platform.simple_compile_backend,
                      Provenance(f"platform {self.platform.device_name}", "platform's compiler"))
        self._check_backend()
        if cc.use_inductor_graph_partition:
            raise ValueError(
                "compilation_config.use_inductor_graph_partition=True is not supported: this "
                "engine's compile backend splits the graph at splitting_ops itself and captures "
                "each piece as a piecewise CUDA graph. Leave it unset (off at every level, as "
                "upstream).")
        if not any(op in ("all", "none") for op in cc.custom_ops):
            inductor = cc.backend == "inductor" and cc.mode != CompilationMode.NONE
            base = "none" if inductor else "all"
            cc.custom_ops = [*cc.custom_ops, base]
            self.provenance.setdefault("compilation_config.custom_ops", Provenance(
                f"derived: custom-op base '{base}'",
                "Inductor fuses the plain-torch ops" if inductor else "no Inductor: use kernels"))
        if cc.mode != CompilationMode.VLLM_COMPILE and (cc.backend == "eager"
                                                       or cc.mode != CompilationMode.NONE):
            if self.get_path("compilation_config.freezing") and self._is_user(
                    "compilation_config.freezing"):
                logger.warning("Inductor freezing only applies with an Inductor backend and "
                               "mode VLLM_COMPILE; it has no effect here.")
        if sc.max_num_batched_tokens is None:
            self._set("scheduler_config.max_num_batched_tokens",
                      self.platform.default_max_num_batched_tokens,
                      Provenance(f"platform {self.platform.device_name}", "platform default"))
        if sc.max_num_seqs is None:
            self._set("scheduler_config.max_num_seqs", self.platform.default_max_num_seqs,
                      Provenance(f"platform {self.platform.device_name}", "platform default"))
        if not sc.enable_chunked_prefill and sc.max_model_len and \
                sc.max_num_batched_tokens < sc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({sc.max_model_len}) with chunked prefill disabled: a long prompt "
                "could never be scheduled. Raise max_num_batched_tokens or enable chunked prefill.")
        self._set_splitting_ops()

    def _set_splitting_ops(self) -> None:
        cc, pc = self.compilation_config, self.compilation_config.pass_config
        if cc.mode != CompilationMode.VLLM_COMPILE:
            if cc.splitting_ops is None:
                self._set("compilation_config.splitting_ops", [],
                          Provenance("derived: no piecewise compile", "mode is not VLLM_COMPILE"))
            return
        if pc.fuse_attn_quant:
            if cc.splitting_ops is None:
                self._set("compilation_config.splitting_ops", [], Provenance(
                    "derived: fuse_attn_quant", "attention+quant fusion needs attention inside "
                    "the compiled graph"))
            elif set(ATTENTION_OPS) <= set(cc.splitting_ops):
                raise ValueError(
                    "compilation_config.pass_config.fuse_attn_quant=True needs the attention op "
                    f"inside the compiled graph, but splitting_ops={cc.splitting_ops} splits at "
                    "it; remove it from splitting_ops.")
        elif cc.splitting_ops is None:
            self._set("compilation_config.splitting_ops", list(ATTENTION_OPS), Provenance(
                "derived: default split points", "split the graph at attention"))

    def _resolve_cudagraph_mode(self) -> None:
        cc = self.compilation_config
        mode = cc.cudagraph_mode
        path = "compilation_config.cudagraph_mode"
        user = self._is_user(path)
        if mode is None:  # a level always sets it; kept for safety on hand-built tables
            mode = CUDAGraphMode.NONE
            self._set(path, mode, Provenance("default", "nothing set it"))
        if not self.platform.support_static_graph_mode() and mode != CUDAGraphMode.NONE:
            self._refuse_or_downgrade(
                path, CUDAGraphMode.NONE,
                f"the {self.platform.device_name} platform has no CUDA graphs")
            return
        if mode.requires_piecewise_compilation() and cc.mode != CompilationMode.VLLM_COMPILE:
            new = mode.without_piecewise()
            self._refuse_or_downgrade(
                path, new, f"piecewise CUDA graphs need compilation mode VLLM_COMPILE, but the "
                f"mode is {cc.mode.name}")
            mode = new
        if mode.requires_piecewise_compilation() and cc.splitting_ops == []:
            new = CUDAGraphMode.NONE if mode == CUDAGraphMode.PIECEWISE else CUDAGraphMode.FULL
            self._refuse_or_downgrade(path, new, "splitting_ops is empty, so there are no pieces "
                                      "to capture piecewise")
        del user

    def _refuse_or_downgrade(self, path: str, new: Any, why: str) -> None:
        old = self.get_path(path)
        if self._is_user(path):
            raise ValueError(f"{path.split('.')[-1]}={old} cannot be honoured: {why}. "
                             f"Use {new} or leave it unset.")
        logger.info("CUDA graph mode %s -> %s: %s.", old, new, why)
        self._set(path, new, Provenance(f"derived: downgrade from {old}", why))

    def _set_cudagraph_sizes(self) -> None:
        cc, sc = self.compilation_config, self.scheduler_config
        sizes_path = "compilation_config.cudagraph_capture_sizes"
        max_path = "compilation_config.max_cudagraph_capture_size"
        if cc.cudagraph_mode == CUDAGraphMode.NONE or self.model_config is None:
            if cc.cudagraph_capture_sizes is None:
                self._set(sizes_path, [], Provenance("derived: no CUDA graphs", "nothing captured"))
            if cc.max_cudagraph_capture_size is None:
                self._set(max_path, 0, Provenance("derived: no CUDA graphs", "nothing captured"))
            return
        from vllm.config.capture_sizes import resolve_capture_sizes

        sizes, max_size, reason = resolve_capture_sizes(
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, sc.max_num_seqs,
            sc.max_num_batched_tokens)
        for path, value in ((sizes_path, sizes), (max_path, max_size)):
            if self._is_user(path) and self.get_path(path) != value:
                logger.warning("%s: %s", path, reason)
                self._set(path, value, Provenance("derived: adjusted user value", reason))
            elif not self._is_user(path):
                self._set(path, value, Provenance("derived: capture sizes", reason))

    def _set_compile_sizes(self) -> None:
        cc = self.compilation_config
        expanded: list[int] = []
        for size in cc.compile_sizes or []:
            items = cc.cudagraph_capture_sizes if size == "cudagraph_capture_sizes" else [size]
            for item in items:
                if item <= self.scheduler_config.max_num_batched_tokens and item not in expanded:
                    expanded.append(int(item))
        cc.compile_sizes = sorted(expanded)

    def _set_compile_ranges(self) -> None:
        """Record the resolved token budget on the compilation config, so that
        `compilation_config.get_compile_ranges()` can answer."""
        self.compilation_config.max_num_batched_tokens = (
            self.scheduler_config.max_num_batched_tokens)

    def _set_debug_dump_path(self) -> None:
        from vllm import envs

        cc = self.compilation_config
        env_path = envs.VLLM_DEBUG_DUMP_PATH
        if env_path:
            if cc.debug_dump_path and cc.debug_dump_path != env_path:
                logger.warning("Config-specified debug dump path is overridden by "
                               "VLLM_DEBUG_DUMP_PATH to %s", env_path)
            cc.debug_dump_path = env_path
        if cc.debug_dump_path:
            cc.debug_dump_path = os.path.abspath(os.path.expanduser(cc.debug_dump_path))
            # Checked here, so that a bad path is named as such, not met as a failure in the
            # middle of a compile.
            problem = directory_problem(cc.debug_dump_path)
            if problem is not None:
                what = "VLLM_DEBUG_DUMP_PATH" if env_path else "compilation_config.debug_dump_path"
                raise ValueError(f"{what} {cc.debug_dump_path!r} cannot hold the debug dump: "
                                 f"{problem}")
            if cc.mode == CompilationMode.NONE:
                logger.warning("debug_dump_path %s is set, but compilation mode NONE (-O0) "
                               "compiles nothing, so nothing is dumped; use -O1 or higher.",
                               cc.debug_dump_path)

    # ---- provenance helpers -------------------------------------------------------------
    def get_path(self, path: str) -> Any:
        obj: Any = self
        for part in path.split("."):
            if obj is None:
                return None
            obj = getattr(obj, part)
        return obj

    def _set(self, path: str, value: Any, provenance: Provenance) -> None:
        *parents, leaf = path.split(".")
        obj: Any = self
        for part in parents:
            obj = getattr(obj, part)
            if obj is None:
                return
        setattr(obj, leaf, value)
        self.provenance[path] = provenance

    def _is_user(self, path: str) -> bool:
        prov = self.provenance.get(path)
        return prov is not None and prov.source == "user"

    def platform_set(self, path: str, value: Any, reason: str) -> None:
        """For platform hooks: set a platform-owned leaf, or refuse an explicit user value."""
        current = self.get_path(path)
        if current == value:
            return
        if self._is_user(path):
            name = path.split('.')[-1]
            raise ValueError(f"{name}={_show(current)} cannot be honoured on the "
                             f"{self.platform.device_name} platform: {reason}. Leave {name} "
                             f"unset or set it to {_show(value)} there.")
        self._set(path, value, Provenance(f"platform {self.platform.device_name}", reason))

    def explain(self) -> list[tuple[str, Any, Provenance]]:
        """(field, resolved value, provenance) for the level and every level-controlled leaf."""
        rows = [("optimization_level", f"O{int(self.optimization_level)}",
                 self.provenance["optimization_level"])]
        for path in (*LEVEL_CONTROLLED_FIELDS, *DERIVED_FIELDS):
            if path.startswith("model_config") and self.model_config is None:
                continue
            value = self.get_path(path)
            if path == "model_config.dtype":
                value = str(self.model_config.resolved_dtype)
            rows.append((path, value, self.provenance.get(path, Provenance("default", ""))))
        return rows

    def explain_text(self) -> str:
        """The resolved table a person reads (`vllm config`)."""
        rows = [(path, _show(value), prov.source, prov.reason)
                for path, value, prov in self.explain()]
        widths = [max(len(r[i]) for r in rows + [("field", "value", "source", "reason")])
                  for i in range(3)]
        lines = [f"{'field':<{widths[0]}}  {'value':<{widths[1]}}  {'source':<{widths[2]}}  reason"]
        lines.append("-" * (sum(widths) + 14))
        for path, value, source, reason in rows:
            lines.append(f"{path:<{widths[0]}}  {value:<{widths[1]}}  {source:<{widths[2]}}  "
                         f"{reason}".rstrip())
        return "\n".join(lines)

    def explain_json(self) -> dict:
        return {path: {"value": to_jsonable(value), "source": prov.source, "reason": prov.reason}
                for path, value, prov in self.explain()}

    def summary_line(self) -> str:
        """The one start-up line: level, compile mode, CUDA-graph mode, enabled passes."""
        cc = self.compilation_config
        passes = ", ".join(cc.pass_config.enabled_passes()) or "none"
        return (f"Optimization level O{int(self.optimization_level)}: compilation mode "
                f"{cc.mode.name}, backend {cc.backend}, CUDA graphs {cc.cudagraph_mode}, "
                f"passes: {passes}, platform {self.platform.device_name}")

    def compute_hash(self) -> str:
        """Everything that changes the compiled graph, nothing that does not (memory sizing,
        the level itself, debug_dump_path)."""
        parts = [self.compilation_config.compute_hash(), self.parallel_config.compute_hash(),
                 self.scheduler_config.compute_hash(), self.cache_config.compute_hash(),
                 self.model_config.compute_hash() if self.model_config else "no-model",
                 self.platform.device_name]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _show(value: Any) -> str:
    if hasattr(value, "name") and not isinstance(value, str):
        return value.name
    return str(value)


_enforce_eager_warned = False


def _warn_enforce_eager_once() -> None:
    global _enforce_eager_warned
    if _enforce_eager_warned:
        return
    _enforce_eager_warned = True
    message = ("enforce_eager / --enforce-eager is deprecated and means -O0 (no compilation, no "
               "CUDA graphs); use -O0 / optimization_level=0 instead.")
    logger.warning(message)
    warnings.warn(message, DeprecationWarning, stacklevel=4)

