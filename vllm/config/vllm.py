"""VllmConfig: the root config, and the resolution of optimization levels into settings.

`__post_init__` resolves in the order DESIGN.md §3 gives:
  1. the user's explicit values (every non-None leaf) are recorded as USER and never changed
     (environment overrides as ENV);
  2. the base level table (`OPTIMIZATION_LEVEL_TO_CONFIG`) fills the other leaves;
  3. the platform's own level table (`Platform.level_table`), applied by the same code,
     replaces what it names (an explicit value it cannot run is an error);
  4. derived values and the CUDA-graph rules (including what the attention backend can run
     inside a CUDA graph); then default capture sizes.
Nothing changes the config after that: the engine runs what `vllm config` shows. Every
reported leaf records where its value came from and why (`explain()`).
"""
from __future__ import annotations

import enum
import hashlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from vllm.config.cache import CacheConfig
from vllm.config.compilation import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
)
from vllm.config.levels import (
    LEVEL_CONTROLLED_FIELDS,
    OPTIMIZATION_LEVEL_TO_CONFIG,
    OptimizationLevel,
    Setting,
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

__all__ = ["VllmConfig", "OptimizationLevel", "ConfigSource", "Provenance",
           "OPTIMIZATION_LEVEL_TO_CONFIG"]

# The attention custom op: the default split point for piecewise compilation.
ATTENTION_OPS = CompilationConfig._attention_ops

# Leaves outside the level table whose provenance is also reported.
DERIVED_FIELDS = ("compilation_config.backend", "compilation_config.custom_ops",
                  "compilation_config.splitting_ops", "compilation_config.cudagraph_capture_sizes",
                  "compilation_config.max_cudagraph_capture_size",
                  "scheduler_config.max_num_batched_tokens", "scheduler_config.max_num_seqs",
                  "model_config.dtype")


class ConfigSource(enum.Enum):
    """Where a resolved value came from, in the order resolution applies them."""

    DEFAULT = "default"
    """the field's own default (nothing set it)"""
    USER = "user"
    """set explicitly (Python, CLI, -cc JSON, --config file)"""
    ENV = "env"
    """an environment variable (`Provenance.name`) overrides it"""
    LEVEL = "level"
    """the base level table (`Provenance.name`: "O2")"""
    PLATFORM = "platform"
    """the platform's level table or one of its defaults (`Provenance.name`: "cpu")"""
    DERIVED = "derived"
    """a rule over the other values (`Provenance.name`: the rule)"""


@dataclass(frozen=True)
class Provenance:
    """Where a resolved value came from (`source`, and which level, platform, environment
    variable or rule: `name`), with a one-line reason."""

    source: ConfigSource
    name: str = ""
    reason: str = ""

    @property
    def label(self) -> str:
        """As `vllm config` prints it: `user`, `level O2`, `platform cpu`, `env NAME`,
        `derived: <rule>` or `default`."""
        if self.source is ConfigSource.DERIVED:
            return f"derived: {self.name}"
        return f"{self.source.value} {self.name}" if self.name else self.source.value

    @property
    def explicit(self) -> bool:
        """Set by the user or the environment: tables never replace it."""
        return self.source in (ConfigSource.USER, ConfigSource.ENV)


_USER = Provenance(ConfigSource.USER, reason="set explicitly")


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
    speculative_config: Any = None
    """Upstream's speculative decoding settings: this engine has none, so only None is
    accepted (the capture sizes still know the decode query length a speculating engine
    would have: `uniform_decode_query_len`)."""
    provenance: dict[str, Provenance] = field(default_factory=dict, init=False, repr=False)
    _downgraded_from: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    # ---- resolution ---------------------------------------------------------------------
    @raises_validation_error
    def __post_init__(self) -> None:
        from vllm.platforms import get_current_platform

        self.platform = get_current_platform()
        if self.speculative_config is not None:
            raise ValueError(
                f"speculative_config={self.speculative_config!r}: speculative decoding is not "
                "supported by this engine; leave speculative_config unset")
        if self.model_config is not None:
            self.model_config.verify_with_parallel_config(
                self.parallel_config.tensor_parallel_size)
        if isinstance(self.compilation_config, dict):
            self.compilation_config = CompilationConfig.from_dict(self.compilation_config)
        self._resolve_level()
        self._record_user_values()
        self._apply_env_overrides()
        level = self.optimization_level
        self._apply_level_table(OPTIMIZATION_LEVEL_TO_CONFIG[level],
                                ConfigSource.LEVEL, f"O{int(level)}")
        self._apply_level_table(self.platform.level_table.get(level, {}),
                                ConfigSource.PLATFORM, self.platform.device_name)
        self._resolve_model_dtype()
        self._apply_derived_rules()
        self._resolve_cudagraph_mode()
        self._set_cudagraph_sizes()
        self._set_compile_sizes()
        self._set_compile_ranges()
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
        self.provenance["optimization_level"] = (
            Provenance(ConfigSource.USER) if explicit_level
            else Provenance(ConfigSource.DERIVED, "enforce_eager",
                            "--enforce-eager is the deprecated spelling of -O0") if enforce_eager
            else Provenance(ConfigSource.DEFAULT, reason="O2 is the default level"))

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
                self.provenance[path] = _USER

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
                      Provenance(ConfigSource.ENV, "TORCH_COMPILE_DISABLE",
                                 "torch.compile disabled by env"))

    def _apply_level_table(self, table: dict[str, Any], source: ConfigSource,
                           name: str) -> None:
        """Apply one level table (the base table, then the platform's): every leaf the user or
        the environment did not set takes the table's value. A leaf is a constant, a predicate
        (called with this config; its answer is recorded with what it asked) or a
        `Setting(value, reason)` whose reason is recorded too. A required `Setting` that an
        explicit value contradicts is an error naming its reason."""
        for path, leaf in iter_level_defaults(table):
            setting = leaf if isinstance(leaf, Setting) else Setting(leaf, "")
            prov = self.provenance.get(path)
            if prov is not None and prov.explicit:
                current = self.get_path(path)
                required = setting.value
                if setting.required and callable(required):
                    required = bool(required(self))
                if setting.required and current != required:
                    field_name = path.split(".")[-1]
                    raise ValueError(
                        f"{field_name}={_show(current)} cannot be honoured on the {name} "
                        f"platform: {setting.reason}. Leave {field_name} unset or set it to "
                        f"{_show(required)} there.")
                continue
            value, reasons = setting.value, []
            if callable(value):
                value = bool(value(self))
                reasons.append(f"{describe(setting.value)}: {'yes' if value else 'no'}")
            elif isinstance(value, list):
                value = list(value)
            if setting.reason:
                reasons.append(setting.reason)
            self._set(path, value, Provenance(source, name, "; ".join(reasons)))

    def _resolve_model_dtype(self) -> None:
        mc = self.model_config
        if mc is None:
            return
        # A name (torch_dtype imports torch when it is read): resolving needs no torch.
        if mc.dtype == "auto":
            mc.torch_dtype, reason = self.platform.resolve_auto_dtype(mc)
            self.provenance["model_config.dtype"] = self._platform(reason)
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
                      self._platform("platform's compiler"))
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
                ConfigSource.DERIVED, f"custom-op base '{base}'",
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
                      self._platform("platform default"))
        if sc.max_num_seqs is None:
            self._set("scheduler_config.max_num_seqs", self.platform.default_max_num_seqs,
                      self._platform("platform default"))
        if not sc.enable_chunked_prefill and sc.max_model_len and \
                sc.max_num_batched_tokens < sc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({sc.max_model_len}) with chunked prefill disabled: a long prompt "
                "could never be scheduled. Raise max_num_batched_tokens or enable chunked prefill.")
        self._set_splitting_ops()

    def _set_splitting_ops(self) -> None:
        cc, pc = self.compilation_config, self.parallel_config
        filled = cc.set_splitting_ops_for_v1(data_parallel_size=pc.data_parallel_size)
        if filled is not None:
            label, reason = filled
            self.provenance["compilation_config.splitting_ops"] = Provenance(
                ConfigSource.DERIVED, label, reason)

    def _resolve_cudagraph_mode(self) -> None:
        """What the compiled model and the attention backend can capture. (A platform without
        CUDA graphs says so in its level table: the mode is NONE by then.)"""
        cc = self.compilation_config
        mode = cc.cudagraph_mode
        path = "compilation_config.cudagraph_mode"
        if mode is None:  # a level always sets it; kept for safety on hand-built tables
            mode = CUDAGraphMode.NONE
            self._set(path, mode, Provenance(ConfigSource.DEFAULT, reason="nothing set it"))
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
        self._narrow_to_attention_backend()

    def _narrow_to_attention_backend(self) -> None:
        """Full CUDA graphs only for the batches the attention backend (the one layers get:
        `selector.default_backend()`) can run inside one. Decided here, not by the model
        runner, so that the resolved mode is the one that runs. An explicit mode is narrowed
        too (warned, and so recorded), as upstream: part of it can still be honoured."""
        cc = self.compilation_config
        mode = cc.cudagraph_mode
        if not mode.has_full_cudagraphs():
            return  # nothing to ask the backend (and nothing imported)
        from vllm.attention.selector import default_backend

        backend = default_backend()
        support = backend.cudagraph_support
        new = cudagraph_mode_for_backend(mode, support, self.piecewise_compiled)
        if new == mode:
            return
        path = "compilation_config.cudagraph_mode"
        why = f"the {backend.get_name()} attention backend " + (
            "cannot run inside a full CUDA graph" if support.name == "NEVER" else
            f"runs only {support.name.lower().replace('_', ' ')} batches inside full CUDA graphs")
        if self._is_user(path):
            why += f" ({mode} was set explicitly)"
            logger.warning("CUDA graph mode %s -> %s: %s.", mode, new, why)
        else:
            logger.info("CUDA graph mode %s -> %s: %s.", mode, new, why)
        self._downgrade(path, new, why)

    def _downgrade(self, path: str, new: Any, why: str) -> None:
        """Set a narrower value; after an earlier downgrade, the provenance names the value
        before both and both reasons."""
        old = self.get_path(path)
        if path in self._downgraded_from:
            first, reason = self._downgraded_from[path], (
                f"{self.provenance[path].reason}; then {old} -> {new}: {why}")
        else:
            first, reason = old, why
        self._downgraded_from[path] = first
        self._set(path, new, Provenance(ConfigSource.DERIVED, f"downgrade from {first}", reason))

    @property
    def piecewise_compiled(self) -> bool:
        """Whether the model is compiled in pieces (piecewise CUDA graphs can capture them)."""
        cc = self.compilation_config
        return cc.mode == CompilationMode.VLLM_COMPILE and bool(cc.splitting_ops)

    def _refuse_or_downgrade(self, path: str, new: Any, why: str) -> None:
        old = self.get_path(path)
        if self._is_user(path):
            raise ValueError(f"{path.split('.')[-1]}={old} cannot be honoured: {why}. "
                             f"Use {new} or leave it unset.")
        logger.info("CUDA graph mode %s -> %s: %s.", old, new, why)
        self._downgrade(path, new, why)

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per request and decode step (0: no speculative decoding)."""
        spec = self.speculative_config
        return int(spec.num_speculative_tokens) if spec is not None else 0

    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens per request in a uniform decode batch: 1 + num_speculative_tokens."""
        return 1 + self.num_speculative_tokens

    def _set_cudagraph_sizes(self) -> None:
        """The capture sizes and their maximum (config/capture_sizes.py); values given are
        kept (an inconsistent pair is an error, sizes above the token budget are dropped with
        a warning). Reads only the sub-configs, `speculative_config`, `num_speculative_tokens`
        and `model_config.enforce_eager`, so a stand-in with those attributes can run it."""
        cc, sc = self.compilation_config, self.scheduler_config
        provenance = self.__dict__.get("provenance")  # None on a stand-in

        def record(path: str, value: Any, prov: Provenance) -> None:
            setattr(cc, path.rsplit(".", 1)[1], value)
            if isinstance(provenance, dict):
                provenance[path] = prov

        sizes_path = "compilation_config.cudagraph_capture_sizes"
        max_path = "compilation_config.max_cudagraph_capture_size"
        # Nothing before this sets the two (no level leaf): a value here is the user's.
        user = {sizes_path: cc.cudagraph_capture_sizes, max_path: cc.max_cudagraph_capture_size}
        if cc.cudagraph_mode == CUDAGraphMode.NONE or self.model_config is None:
            if cc.cudagraph_capture_sizes is None:
                record(sizes_path, [], _NO_GRAPHS)
            if cc.max_cudagraph_capture_size is None:
                record(max_path, 0, _NO_GRAPHS)
            return
        from vllm.config.capture_sizes import default_max_capture_size, resolve_capture_sizes

        spec = self.speculative_config
        schedule = None
        if spec is not None and spec.uses_dynamic_speculative_decoding():
            schedule = spec.num_speculative_tokens_per_batch_size
        platform = self.__dict__.get("platform")
        sizes, max_size, reason = resolve_capture_sizes(
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, sc.max_num_seqs,
            sc.max_num_batched_tokens, self.num_speculative_tokens, schedule,
            default_max_capture_size(platform))
        for path, value in ((sizes_path, sizes), (max_path, max_size)):
            if user[path] is None:
                record(path, value, Provenance(ConfigSource.DERIVED, "capture sizes", reason))
            elif user[path] != value:
                logger.warning("%s: %s", path, reason)
                record(path, value, Provenance(ConfigSource.DERIVED, "adjusted user value",
                                               reason))

    def _set_compile_sizes(self) -> None:
        cc = self.compilation_config
        cc.post_init_cudagraph_sizes()
        cc.compile_sizes = [s for s in cc.compile_sizes
                            if s <= self.scheduler_config.max_num_batched_tokens]

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
        return prov is not None and prov.source is ConfigSource.USER

    def _platform(self, reason: str) -> Provenance:
        return Provenance(ConfigSource.PLATFORM, self.platform.device_name, reason)

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
            rows.append((path, value, self.provenance.get(path, Provenance(ConfigSource.DEFAULT))))
        return rows

    def explain_text(self) -> str:
        """The resolved table a person reads (`vllm config`)."""
        rows = [(path, _show(value), prov.label, prov.reason)
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
        return {path: {"value": to_jsonable(value), "source": prov.label, "reason": prov.reason}
                for path, value, prov in self.explain()}

    def summary_line(self) -> str:
        """The one start-up line: level, compile mode, CUDA-graph mode, enabled passes."""
        cc = self.compilation_config
        passes = ", ".join(cc.pass_config.enabled_passes()) or "none"
        line = (f"Optimization level O{int(self.optimization_level)}: compilation mode "
                f"{cc.mode.name}, backend {cc.backend}, CUDA graphs {cc.cudagraph_mode}, "
                f"passes: {passes}, platform {self.platform.device_name}")
        if self.platform.device_name == "cpu":  # the C++ kernels' instruction set (VLLM_CPU_ISA)
            from vllm.utils.cpu_kernels import kernels_isa_level

            line += f", CPU kernels {kernels_isa_level()}"
        return line

    def compute_hash(self) -> str:
        """Everything that changes the compiled graph, nothing that does not (memory sizing,
        the level itself, debug_dump_path)."""
        parts = [self.compilation_config.compute_hash(), self.parallel_config.compute_hash(),
                 self.scheduler_config.compute_hash(), self.cache_config.compute_hash(),
                 self.model_config.compute_hash() if self.model_config else "no-model",
                 self.platform.device_name]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_NO_GRAPHS = Provenance(ConfigSource.DERIVED, "no CUDA graphs", "nothing captured")


def cudagraph_mode_for_backend(mode: CUDAGraphMode, support: Any,
                               piecewise_compiled: bool) -> CUDAGraphMode:
    """`mode` narrowed to what an attention backend with this `AttentionCGSupport` runs inside
    full CUDA graphs: none (NEVER) -> the piecewise part, if the model is compiled in pieces;
    uniform single-token decode only -> full graphs for decode batches, mixed batches
    piecewise (or without graphs). The model runner checks its backend with the same rule."""
    from vllm.attention.backends.abstract import AttentionCGSupport

    if mode.has_full_cudagraphs() and support == AttentionCGSupport.NEVER:
        keeps_pieces = mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)
        return (CUDAGraphMode.PIECEWISE if piecewise_compiled and keeps_pieces
                else CUDAGraphMode.NONE)
    if mode.mixed_mode() == CUDAGraphMode.FULL and support not in (
            AttentionCGSupport.ALWAYS, AttentionCGSupport.UNIFORM_BATCH):
        return (CUDAGraphMode.FULL_AND_PIECEWISE if piecewise_compiled
                else CUDAGraphMode.FULL_DECODE_ONLY)
    return mode


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

