"""Compilation settings: the compile mode, CUDA-graph modes, the pass flags and Inductor knobs.

Every field that an optimization level may fill is declared with the default `None` ("unset");
`VllmConfig.__post_init__` fills it from the level table, the platform and derived rules.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.config.utils import (
    Range,
    check_bool_fields,
    compile_ranges,
    config_from_dict,
    hash_fields,
    raises_validation_error,
    to_jsonable,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# The attention custom op (registered in vllm/attention/layer.py): the compiled graph is split
# around it (the default `splitting_ops`), and the attention+quant fusion rewrites it. Every
# other module takes the name from here.
ATTENTION_OP_NAME = "vllm::unified_attention_with_output"

# The `inductor_compile_config` key of a user's own graph pass (an `InductorPass`): the pass
# manager runs it after the configured passes (Inductor itself gets the manager under this key).
POST_GRAD_PASS_KEY = "post_grad_custom_post_pass"


class CompilationMode(enum.IntEnum):
    """How the model's forward is compiled."""

    NONE = 0  # eager PyTorch
    STOCK_TORCH_COMPILE = 1  # plain torch.compile with `backend`
    DYNAMO_TRACE_ONCE = 2  # one Dynamo trace, no guards re-evaluated, torch's own backend
    VLLM_COMPILE = 3  # our backend: passes, split at attention, per-piece Inductor, cache

    @classmethod
    def parse(cls, value: Any) -> CompilationMode:
        """Accept the enum, an int 0..3, a digit string or a name in any case."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ValueError(f"Invalid compilation mode: {value!r}. {cls._valid()}")
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"Invalid compilation mode: {value}. {cls._valid()}") from None
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                return cls.parse(int(text))
            try:
                return cls[text.upper()]
            except KeyError:
                raise ValueError(f"Invalid compilation mode: {value!r}. {cls._valid()}") from None
        raise ValueError(f"Invalid compilation mode: {value!r}. {cls._valid()}")

    @classmethod
    def _valid(cls) -> str:
        return "Valid modes are: " + ", ".join(f"{m.name} ({m.value})" for m in cls)


class CUDAGraphMode(enum.Enum):
    """What is captured as CUDA graphs. Tuple values are (decode mode, mixed-batch mode)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    @classmethod
    def parse(cls, value: Any) -> CUDAGraphMode:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"Invalid cudagraph_mode: {value!r}. Valid modes are: {names}")

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        assert not mode.separate_routine()
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.requires_piecewise_compilation()

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def without_piecewise(self) -> CUDAGraphMode:
        """PIECEWISE -> NONE, FULL_AND_PIECEWISE -> FULL_DECODE_ONLY, others unchanged."""
        if self == CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self == CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self

    @staticmethod
    def valid_runtime_modes() -> frozenset[CUDAGraphMode]:
        return frozenset({CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL})

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


@dataclass
class PassConfig:
    """Which graph passes run inside our backend (VLLM_COMPILE only). `None` = level decides."""

    eliminate_noops: bool | None = None
    """Remove reshapes/views/slices that do nothing (they hide fusion patterns)."""
    fuse_norm_quant: bool | None = None
    """RMSNorm (+ residual add) followed by FP8 quantization -> one fused op."""
    fuse_act_quant: bool | None = None
    """SiluAndMul followed by FP8 quantization -> one fused op."""
    fuse_attn_quant: bool | None = None
    """Attention output followed by static FP8 quantization -> attention writing FP8."""
    fuse_allreduce_rms: bool | None = None
    """Tensor-parallel all-reduce followed by RMSNorm -> one fused collective."""
    # Upstream's flags for passes this engine does not have: accepted (so an upstream
    # configuration parses), off at every level; set on, the pass manager warns that nothing
    # is fused (docs/upstream-differences.md).
    enable_qk_norm_rope_fusion: bool | None = None
    """Q/K RMSNorm followed by rotary embedding -> one op (needs the rotary_embedding custom
    op). No pass here."""
    enable_sp: bool | None = None
    """Sequence parallelism (needs tensor parallelism). No pass here."""
    fuse_gemm_comms: bool | None = None
    """AsyncTP: GEMMs overlapped with their collectives (implies enable_sp). No pass here."""
    fuse_act_padding: bool | None = None
    """ROCm: RMSNorm with padding of the hidden size. No pass here."""
    fuse_mla_dual_rms_norm: bool | None = None
    """ROCm: the two RMSNorms of MLA's latent projections. No pass here."""
    fuse_rope_kvcache: bool | None = None
    """ROCm: rotary embedding followed by the KV-cache write. No pass here."""
    fuse_qk_norm_rope_kvcache: bool | None = None
    """ROCm: Q/K norm, rotary embedding and the KV-cache write. No pass here."""
    fuse_rope_kvcache_cat_mla: bool | None = None
    """MLA: rotary embedding, concatenation and the KV-cache write. No pass here."""
    sp_min_token_num: int | None = None
    """Smallest token count sequence parallelism would run for. No pass here."""

    @raises_validation_error
    def __post_init__(self) -> None:
        check_bool_fields(self, "pass_config")
        if self.sp_min_token_num is not None and (
                not isinstance(self.sp_min_token_num, int)
                or isinstance(self.sp_min_token_num, bool) or self.sp_min_token_num < 1):
            raise ValueError("pass_config.sp_min_token_num must be a positive integer, got "
                             f"{self.sp_min_token_num!r}")

    @classmethod
    def from_dict(cls, data: dict, path: str = "pass_config") -> PassConfig:
        return config_from_dict(cls, data, path)

    def enabled_passes(self) -> list[str]:
        """The flags of the switched-on passes, in the order the pass manager runs them (the
        pass registry's, vllm/compilation/passes/registry.py)."""
        from vllm.compilation.passes.registry import enabled_entries

        return [entry.flag for entry in enabled_entries(self)]

    def compute_hash(self) -> str:
        return hash_fields(self, exclude=())


@dataclass
class CompilationConfig:
    """How the model is compiled and captured. Leaves that are `None` are filled by the level."""

    mode: CompilationMode | None = None
    """NONE / STOCK_TORCH_COMPILE / DYNAMO_TRACE_ONCE / VLLM_COMPILE (an int 0..3 or a name)."""
    backend: str = ""
    """Compiler for the pieces: "inductor" or "eager" ("" = the platform's default)."""
    custom_ops: list[str] = field(default_factory=list)
    """Per-op kernel choice: "all", "none", "+name", "-name"."""
    splitting_ops: list[str] | None = None
    """Ops the graph is split at for piecewise compilation (default: the attention op)."""
    use_inductor_graph_partition: bool | None = None
    """Let Inductor partition around the splitting ops instead of splitting in Dynamo's graph."""
    compile_sizes: list[int | str] | None = None
    """Token counts that get an extra static-shape compile ("cudagraph_capture_sizes" expands)."""
    compile_ranges_endpoints: list[int] | None = None
    """Extra split points of the dynamic compile range [1, max_num_batched_tokens]."""
    inductor_compile_config: dict = field(default_factory=dict)
    """Options passed to Inductor as they are."""
    freezing: bool | None = None
    """Inductor freezing: weights become constants, prepacked for the CPU GEMM kernels."""
    prepack_linear_weights: bool | None = None
    """CPU: float32 linear weights (the LM head's included) packed into column panels once
    after loading, used by an opaque op in the compiled graph (the panel kernel for batched
    decode products); unlike freezing the weights stay graph inputs (cacheable). Costs each
    weight's size again in memory."""
    max_autotune: bool | None = None
    """Inductor max-autotune (benchmarks GEMM templates at compile time)."""
    coordinate_descent_tuning: bool | None = None
    """Inductor coordinate-descent tuning of generated kernels' launch parameters."""
    cpp_wrapper: bool | None = None
    """Inductor's C++ wrapper: each compiled graph's host code (buffer allocation, kernel and
    op calls) is generated as C++ and built with the kernels, instead of Python. Saves the
    Python interpreter per op at run time; costs a bigger C++ build at compile time."""
    cudagraph_mode: CUDAGraphMode | None = None
    """NONE / PIECEWISE / FULL / FULL_DECODE_ONLY / FULL_AND_PIECEWISE."""
    cudagraph_num_of_warmups: int = 0
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    pass_config: PassConfig = field(default_factory=PassConfig)
    cache_dir: str = ""
    """Compile cache directory ("" = derived from VLLM_CACHE_ROOT and the config hash)."""
    debug_dump_path: str | None = None
    """Write graphs, pieces and the resolved config here for debugging."""
    max_num_batched_tokens: int | None = field(default=None, init=False, repr=False,
                                               compare=False)
    """The resolved token budget (scheduler_config's), recorded by `VllmConfig` for
    `get_compile_ranges()`; not a setting."""

    _attention_ops: ClassVar[list[str]] = [ATTENTION_OP_NAME]
    """The attention ops: the default `splitting_ops` of a piecewise compile."""

    @raises_validation_error
    def __post_init__(self) -> None:
        if self.mode is not None:
            self.mode = CompilationMode.parse(self.mode)
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if isinstance(self.pass_config, dict):
            self.pass_config = PassConfig.from_dict(self.pass_config)
        piecewise = self.mode == CompilationMode.VLLM_COMPILE
        if self.backend not in ("", "inductor", "eager") and piecewise:
            raise ValueError(
                f"Invalid backend for piecewise compilation: {self.backend!r}. "
                "With mode VLLM_COMPILE the backend must be 'inductor' or 'eager'.")
        check_bool_fields(self, "compilation_config")
        self._validate_custom_ops()
        if self.splitting_ops is not None and (
                not isinstance(self.splitting_ops, list)
                or not all(isinstance(op, str) and op for op in self.splitting_ops)):
            raise ValueError(
                "compilation_config.splitting_ops must be a list of op names, e.g. "
                f'["{ATTENTION_OP_NAME}"]; got {self.splitting_ops!r}')
        if not isinstance(self.inductor_compile_config, dict) or not all(
                isinstance(key, str) for key in self.inductor_compile_config):
            raise ValueError(
                "compilation_config.inductor_compile_config must map Inductor option names to "
                f'values, e.g. {{"max_autotune": true}}; got {self.inductor_compile_config!r}')
        user_pass = self.inductor_compile_config.get(POST_GRAD_PASS_KEY)
        if user_pass is not None:
            from vllm.compilation.passes.inductor_pass import InductorPass

            if not isinstance(user_pass, InductorPass):
                raise ValueError(
                    f"compilation_config.inductor_compile_config[{POST_GRAD_PASS_KEY!r}] must be "
                    f"an InductorPass (subclass it, or wrap a function as "
                    f"CallableInductorPass(fn)); got {user_pass!r}")
        for name in ("cudagraph_capture_sizes", "compile_ranges_endpoints", "compile_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and not isinstance(sizes, (list, tuple)):
                example = ('[1, 2, 4] or ["cudagraph_capture_sizes"]' if name == "compile_sizes"
                           else "[1, 2, 4]")
                raise ValueError(f"compilation_config.{name} must be a list, e.g. {example}; "
                                 f"got {sizes!r}")
        for name in ("cudagraph_capture_sizes", "compile_ranges_endpoints"):
            sizes = getattr(self, name)
            if sizes is not None:
                bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
                if bad:
                    raise ValueError(f"compilation_config.{name} must hold positive integers; "
                                     f"got {bad[0]!r}")
        if self.compile_sizes is not None:
            for s in self.compile_sizes:
                if isinstance(s, str) and s != "cudagraph_capture_sizes":
                    raise ValueError(
                        f"compilation_config.compile_sizes: unknown entry {s!r}; entries are "
                        "positive integers or the string 'cudagraph_capture_sizes'")
                if isinstance(s, (int, float)) and (isinstance(s, bool) or s <= 0):
                    raise ValueError(
                        f"compilation_config.compile_sizes must hold positive integers; got {s!r}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 0:
            raise ValueError("compilation_config.max_cudagraph_capture_size must be >= 0; "
                             f"got {self.max_cudagraph_capture_size}")

    def _validate_custom_ops(self) -> None:
        if not isinstance(self.custom_ops, list):
            raise ValueError(f"compilation_config.custom_ops must be a list, got "
                             f"{self.custom_ops!r}")
        for op in self.custom_ops:
            if op in ("all", "none"):
                continue
            if not isinstance(op, str) or len(op) < 2 or op[0] not in "+-":
                raise ValueError(
                    f"Invalid syntax '{op}' for custom op, must be 'all', 'none', '+op' or '-op' "
                    "(where 'op' is the registered op name)")
        bases = [op for op in self.custom_ops if op in ("all", "none")]
        if len(set(bases)) > 1:
            raise ValueError("custom_ops can contain only one base mode: 'all' or 'none'")
        enabled = {op[1:] for op in self.custom_ops if op.startswith("+")}
        disabled = {op[1:] for op in self.custom_ops if op.startswith("-")}
        both = sorted(enabled & disabled)
        if both:
            raise ValueError("custom_ops cannot both enable and disable the same operation(s): "
                             + ", ".join(both))
        pass_config = self.pass_config
        if (isinstance(pass_config, PassConfig) and pass_config.enable_qk_norm_rope_fusion
                and "rotary_embedding" in disabled):
            raise ValueError(
                "custom_ops cannot both enable and disable the same operation(s): "
                "rotary_embedding (pass_config.enable_qk_norm_rope_fusion needs the "
                "rotary_embedding custom op, custom_ops disables it with -rotary_embedding)")

    @classmethod
    def from_dict(cls, data: dict, path: str = "compilation_config") -> CompilationConfig:
        """Build from a JSON-like dict; unknown keys are an error naming the closest key.
        Upstream's deprecated `level` (the same numbers as `mode`) is read as `mode`."""
        if isinstance(data, dict) and "level" in data:
            data = dict(data)
            level = data.pop("level")
            logger.warning_once("%s.level is deprecated: use mode (the same numbers)%s", path,
                                "; mode is given too and wins" if "mode" in data else "")
            data.setdefault("mode", level)
        return config_from_dict(cls, data, path, nested={"pass_config": PassConfig})

    def non_default_dict(self) -> dict[str, Any]:
        """The settings that differ from a fresh `CompilationConfig()` (pass_config's per
        flag), JSON-encodable, in the form `from_dict` reads back: what a user gave."""
        fresh = CompilationConfig()
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.init or value == getattr(fresh, f.name):
                continue
            if f.name == "pass_config":
                value = {k: v for k, v in dataclasses.asdict(value).items()
                         if v != getattr(fresh.pass_config, k)}
            data[f.name] = to_jsonable(value)
        return data

    def is_custom_op_enabled(self, name: str) -> bool:
        """Whether the custom kernel of op `name` is used (else its plain-torch form)."""
        if f"+{name}" in self.custom_ops:
            return True
        if f"-{name}" in self.custom_ops:
            return False
        bases = [op for op in self.custom_ops if op in ("all", "none")]
        if len(bases) != 1:
            raise ValueError(
                f"custom_ops must hold exactly one base mode ('all' or 'none') once resolved; "
                f"got {self.custom_ops}")
        return bases[0] == "all"

    def splitting_ops_contain_attention(self) -> bool:
        """Whether the graph is split at every attention op (so attention runs outside the
        compiled pieces)."""
        return self.splitting_ops is not None and all(
            op in self.splitting_ops for op in self._attention_ops)

    def set_splitting_ops_for_v1(self, all2all_backend: str | None = None,
                                 data_parallel_size: int = 1) -> tuple[str, str] | None:
        """Fill `splitting_ops` when it is unset: the attention ops for a piecewise compile
        (mode VLLM_COMPILE), none when the attention+quant fusion needs attention inside the
        graph or nothing is compiled in pieces. An explicit list is kept; one that splits at
        attention while `pass_config.fuse_attn_quant` is on is an error. Calling it again
        changes nothing. Returns (label, reason) when it filled the list, else None.

        `all2all_backend`/`data_parallel_size`: upstream splits at the MoE ops too for DeepEP
        high-throughput all-to-all with data parallelism, which this engine does not have."""
        if (all2all_backend or "").startswith("deepep") and data_parallel_size > 1:
            raise ValueError(f"all2all_backend={all2all_backend!r} with data_parallel_size="
                             f"{data_parallel_size} is not supported: this engine has no DeepEP "
                             "all-to-all (its MoE layers run without expert parallelism)")
        if self.mode != CompilationMode.VLLM_COMPILE:
            if self.splitting_ops is None:
                self.splitting_ops = []
                return "no piecewise compile", "mode is not VLLM_COMPILE"
            return None
        if self.pass_config.fuse_attn_quant:
            if self.splitting_ops is None:
                self.splitting_ops = []
                return ("fuse_attn_quant",
                        "attention+quant fusion needs attention inside the compiled graph")
            if self.splitting_ops_contain_attention():
                raise ValueError(
                    "compilation_config.pass_config.fuse_attn_quant=True needs the attention op "
                    f"inside the compiled graph, but splitting_ops={self.splitting_ops} splits "
                    "at it; remove it from splitting_ops.")
            return None
        if self.splitting_ops is None:
            self.splitting_ops = list(self._attention_ops)
            return "default split points", "split the graph at attention"
        return None

    def post_init_cudagraph_sizes(self) -> None:
        """Once the capture sizes are known: sort them (no repeats), fill an unset maximum from
        them, expand "cudagraph_capture_sizes" in `compile_sizes` (sorted, no repeats), and
        refuse a compile size that CUDA graphs would pad (`check_compile_sizes_padding`)."""
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))
            if self.max_cudagraph_capture_size is None:
                self.max_cudagraph_capture_size = (self.cudagraph_capture_sizes[-1]
                                                   if self.cudagraph_capture_sizes else 0)
        expanded: set[int] = set()
        for size in self.compile_sizes or []:
            if size == "cudagraph_capture_sizes":
                expanded.update(self.cudagraph_capture_sizes or [])
            else:
                expanded.add(int(size))
        self.compile_sizes = sorted(expanded)
        self.check_compile_sizes_padding(self.cudagraph_mode)

    def check_compile_sizes_padding(self, cudagraph_mode: CUDAGraphMode | None) -> None:
        """With CUDA graphs on, a batch is padded up to the next capture size, so a compile
        size below the largest capture size that is not one itself would never run: a
        ValueError naming it and the size it would be padded to."""
        sizes = sorted(self.cudagraph_capture_sizes or [])
        if not cudagraph_mode or not sizes:
            return
        for size in self.compile_sizes or []:
            if isinstance(size, int) and size <= sizes[-1] and size not in sizes:
                padded = next(s for s in sizes if s >= size)
                raise ValueError(
                    f"compilation_config.compile_sizes entry {size} would be padded to {padded} "
                    f"by CUDA graphs (capture sizes {sizes}), so its static compile would never "
                    f"run; use capture sizes as compile sizes (e.g. "
                    "['cudagraph_capture_sizes']), sizes above the largest capture size, or "
                    "add it to cudagraph_capture_sizes")

    def get_compile_ranges(self) -> list[Range]:
        """The token-count ranges each piece is compiled for with a dynamic batch dimension:
        [1, e0], [e0+1, e1], ..., [e_last+1, max_num_batched_tokens], split at
        `compile_ranges_endpoints`. Known once `VllmConfig` has resolved the token budget
        (it records it here); before that, a ValueError."""
        if self.max_num_batched_tokens is None:
            raise ValueError("compile ranges are known once VllmConfig has resolved "
                             "scheduler_config.max_num_batched_tokens; build the VllmConfig "
                             "first")
        return compile_ranges(self.compile_ranges_endpoints, self.max_num_batched_tokens)

    def compute_hash(self) -> str:
        """Hash of everything here that changes the compiled graph (not paths, warm-up counts or
        which CUDA graphs are captured: the capture sizes follow max_num_seqs, and a size that
        is also compiled statically is in the expanded `compile_sizes`). A user's graph pass in
        `inductor_compile_config` is left out: the pass manager's uuid, which holds its
        `uuid()`, is in the compile cache's key."""
        exclude = ("cache_dir", "debug_dump_path", "cudagraph_num_of_warmups",
                   "cudagraph_capture_sizes", "max_cudagraph_capture_size",
                   "max_num_batched_tokens")
        if POST_GRAD_PASS_KEY not in self.inductor_compile_config:
            return hash_fields(self, exclude=exclude)
        options = dict(self.inductor_compile_config)
        del options[POST_GRAD_PASS_KEY]
        return hash_fields(dataclasses.replace(self, inductor_compile_config=options),
                           exclude=exclude)
