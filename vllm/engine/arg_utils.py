"""`EngineArgs`: the engine's settings as one flat dataclass, and their command-line form.

`EngineArgs.add_cli_args(parser)` registers every field as a dashed flag (`--max-num-seqs`),
`EngineArgs.from_cli_args(args)` reads them back, and `create_engine_config()` builds the
typed configs and the resolved `VllmConfig`. `None` means "unset": the optimization level,
the platform or derived rules decide (DESIGN.md §3), so only what the user gave is recorded
as a `user` value.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from vllm.config import (
    CacheConfig,
    CompilationConfig,
    LoadConfig,
    ModelConfig,
    OptimizationLevel,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.model import TOKENIZER_MODES
from vllm.logger import init_logger
from vllm.utils.argparse_utils import (
    human_int,
    json_dict_type,
    non_negative_int,
    parse_json_object,
    positive_int,
)

__all__ = ["EngineArgs"]

# Top-level flags that are also fields of -cc; giving both is ambiguous.
_CC_MIRRORED = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def _optimization_level(text: str) -> str:
    """-O's value, checked here and kept as given ("2", "O2"), as upstream's parser leaves it;
    VllmConfig reads it as an OptimizationLevel."""
    try:
        OptimizationLevel.parse(text)
        return text
    except ValueError as exc:
        hint = ("; -O takes a level now: give a compilation config with -cc / "
                "--compilation-config" if text.lstrip().startswith("{") else "")
        raise argparse.ArgumentTypeError(str(exc) + hint) from None


def _validate_compilation_config(data: dict) -> None:
    CompilationConfig.from_dict(copy.deepcopy(data))


_compilation_config_json = json_dict_type("--compilation-config", _validate_compilation_config)


def _compilation_config_arg(text: str) -> CompilationConfig:
    """-cc as JSON or dotted keys, parsed into a CompilationConfig holding only the keys given
    (the rest unset, for the level to fill); a bare integer is the mode, as upstream (-cc 3)."""
    mode = _mode_shorthand(text)
    data = _compilation_config_json(text if mode is None else json.dumps({"mode": mode}))
    return CompilationConfig.from_dict(data)


_compilation_config_arg.accepts_dotted_keys = True  # type: ignore[attr-defined]


def _mode_shorthand(value: Any) -> int | None:
    """The compilation mode where compilation_config is given as just an integer (3, "3")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


logger = init_logger(__name__)

_generation_overrides = json_dict_type("--override-generation-config")
_hf_overrides = json_dict_type("--hf-overrides")

# upstream argument -> (the values accepted: the feature off, what this engine lacks)
COMPAT_ARGS: dict[str, tuple[tuple, str]] = {
    "cpu_offload_gb": ((0, 0.0), "CPU weight offloading"),
    "enable_lora": ((False,), "LoRA adapters"),
    "enable_sleep_mode": ((False,), "sleep mode"),
    "skip_tokenizer_init": ((False,), "tokenizer-free mode"),
    "disable_sliding_window": ((False,), "switch to drop sliding windows"),
    "calculate_kv_scales": ((False,), "FP8 KV-cache scales computed at run time (they come "
                            "from the checkpoint, else 1.0)"),
    "async_scheduling": ((None, False), "asynchronous scheduling"),
    "model_impl": (("auto", "vllm"), "Transformers-backend model implementation"),
}

# Upstream keyword spellings taken as another field's name (LLM(kv_cache_memory_bytes=...)).
ENGINE_ARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}


@dataclass
class EngineArgs:
    """Every engine setting, flat, with upstream's names. `None` = unset (resolved later)."""

    model: str = "demo"
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int | None = 0
    served_model_name: str | list[str] | None = None
    trust_remote_code: bool = False
    load_format: str = "auto"
    enforce_eager: bool = False
    max_logprobs: int = 20
    tokenizer_mode: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    optimization_level: OptimizationLevel | int | str | None = None
    compilation_config: dict | CompilationConfig | str | None = dataclasses.field(
        default_factory=CompilationConfig)
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    distributed_executor_backend: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    disable_log_stats: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # upstream's arguments for what this engine ignores, or for features it leaves out
    # (accepted only "off"; see COMPAT_ARGS)
    quantization: str | None = None
    hf_overrides: dict | None = None
    swap_space: float = 4.0
    cpu_offload_gb: float = 0.0
    enable_lora: bool = False
    enable_sleep_mode: bool = False
    skip_tokenizer_init: bool = False
    calculate_kv_scales: bool = False
    disable_sliding_window: bool = False
    async_scheduling: bool | None = None
    model_impl: str = "auto"

    # ---- command line ---------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, repeatable_level: bool = False
                     ) -> argparse.ArgumentParser:
        """Register the engine flags on `parser` (dashed spellings, upstream's names); the
        defaults equal the dataclass defaults. Returns `parser`. `repeatable_level`: -O may
        be given several times and collects a list (benchmarks that measure each level)."""
        d = EngineArgs
        model = parser.add_argument_group("model")
        model.add_argument("--model", type=str, default=d.model,
                           help="Local Hugging Face model folder, Hugging Face Hub repo id "
                           "(ORG/NAME: downloaded into the Hub cache; HF_TOKEN for private or "
                           "gated repos, HF_HUB_OFFLINE=1 for the cache only), or 'demo' for "
                           "the built-in demo model. Default: %(default)s.")
        model.add_argument("--tokenizer", type=str, default=d.tokenizer,
                           help="Tokenizer folder or Hub repo id (default: the model's).")
        model.add_argument("--revision", type=str, default=d.revision,
                           help="Hub models: the branch, tag or commit sha to load (default: "
                           "the repo's default branch). Ignored for a local folder.")
        model.add_argument("--tokenizer-revision", type=str, default=d.tokenizer_revision,
                           help="Hub tokenizers: the branch, tag or commit sha (default: "
                           "--revision).")
        model.add_argument("--download-dir", type=str, default=d.download_dir,
                           help="Hub models: the Hugging Face cache folder to download into "
                           "and read from (default: HF_HUB_CACHE, else HF_HOME/hub, else "
                           "~/.cache/huggingface/hub).")
        model.add_argument("--dtype", type=str, default=d.dtype,
                           help="auto, float32, bfloat16 or float16 (aliases: float, half, "
                           "bf16, fp16). 'auto' lets the platform choose. Default: auto.")
        model.add_argument("--max-model-len", type=positive_int, default=d.max_model_len,
                           help="Prompt + output tokens per sequence (e.g. 2048 or 2k); "
                           "default: the model's max_position_embeddings.")
        model.add_argument("--seed", type=int, default=d.seed, help="Random seed.")
        model.add_argument("--served-model-name", type=str, nargs="+",
                           default=d.served_model_name,
                           help="Model name(s) the API accepts; the first is the one "
                           "responses report (default: --model).")
        model.add_argument("--trust-remote-code", action="store_true",
                           help="Allow the model folder's own Python code.")
        model.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                           help="The most logprobs a request may ask for per token (-1: the "
                           "whole vocabulary). Default: %(default)s.")
        model.add_argument("--tokenizer-mode", choices=list(TOKENIZER_MODES),
                           default=d.tokenizer_mode,
                           help="auto: the fast tokenizer where there is one; slow: the Python "
                           "one. Default: %(default)s.")
        model.add_argument("--generation-config", default=d.generation_config,
                           help="Default sampling parameters from: 'auto' (the model's "
                           "generation_config.json), 'vllm' (none) or a folder. Default: "
                           "%(default)s.")
        model.add_argument("--override-generation-config", type=_generation_overrides,
                           default=d.override_generation_config,
                           help="JSON, e.g. '{\"temperature\": 0.5}': default sampling "
                           "parameters over those of --generation-config.")
        model.add_argument("--load-format", choices=["auto", "safetensors", "dummy"],
                           default=d.load_format,
                           help="auto/safetensors: the folder's weights; dummy: random weights "
                           "of the right shapes (benchmarks). Default: %(default)s.")

        opt = parser.add_argument_group("optimization")
        opt.add_argument("--optimization-level", type=_optimization_level,
                         action="append" if repeatable_level else "store",
                         default=d.optimization_level, metavar="{0,1,2,3}",
                         help="-O0 no compilation or CUDA graphs (fastest start-up); -O1 "
                         "Inductor compilation, piecewise CUDA graphs; -O2 (default) full and "
                         "piecewise CUDA graphs, fusion passes, on the CPU prepacked linears "
                         "and Inductor's C++ wrapper; -O3 on CUDA autotuning and per-size "
                         "compiles, on the CPU one whole-graph compile. `vllm config -O<n>` "
                         "shows every value. Also -O2, -O 2, -O=2.")
        opt.add_argument("--enforce-eager", action="store_true",
                         help="Deprecated: the same as -O0.")
        opt.add_argument("-cc", "--compilation-config", default=CompilationConfig(),
                         type=_compilation_config_arg,
                         help="CompilationConfig as JSON ('{\"mode\": 3}'), or one key at a "
                         "time: -cc.mode=3, -cc.pass_config.fuse_norm_quant=false, "
                         "-cc.custom_ops+=+rms_norm,-quant_fp8 (appends to the list).")
        opt.add_argument("--cudagraph-capture-sizes", type=positive_int, nargs="+",
                         default=d.cudagraph_capture_sizes, metavar="N",
                         help="Batch sizes captured as CUDA graphs (exclusive with -cc's "
                         "cudagraph_capture_sizes).")
        opt.add_argument("--max-cudagraph-capture-size", type=non_negative_int,
                         default=d.max_cudagraph_capture_size,
                         help="Largest CUDA-graph batch size (exclusive with -cc's "
                         "max_cudagraph_capture_size).")

        cache = parser.add_argument_group("KV cache")
        cache.add_argument("--block-size", type=positive_int, default=d.block_size,
                           help="Tokens per KV cache block. Default: %(default)s.")
        cache.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=_kv_cache_memory,
                           default=d.kv_cache_memory,
                           help="Bytes for the KV cache, human readable (4GiB, 512MiB); on CUDA "
                           "it overrides --gpu-memory-utilization. Default: CPU: "
                           "VLLM_CPU_KVCACHE_SPACE (GiB) or 4 GiB; CUDA: from "
                           "--gpu-memory-utilization.")
        cache.add_argument("--gpu-memory-utilization", type=float,
                           default=d.gpu_memory_utilization,
                           help="CUDA: fraction of device memory to use. Default: %(default)s.")
        cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                           default=d.enable_prefix_caching,
                           help="Reuse the KV blocks of shared prompt prefixes.")
        cache.add_argument("--kv-cache-dtype", type=str, default=d.kv_cache_dtype,
                           help="dtype of the stored keys and values: auto (the model's), "
                           "bfloat16, float16, float32, fp8 (= fp8_e4m3) or fp8_e5m2 (one byte "
                           "a value, scaled by the checkpoint's k_scale / v_scale, else 1.0). "
                           "Default: %(default)s.")
        cache.add_argument("--num-gpu-blocks-override", type=positive_int,
                           default=d.num_gpu_blocks_override,
                           help="Use exactly this many KV blocks (tests, debugging).")

        sched = parser.add_argument_group("scheduler and parallelism")
        sched.add_argument("--max-num-batched-tokens", type=positive_int,
                           default=d.max_num_batched_tokens,
                           help="Tokens per engine step (default: platform's).")
        sched.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs,
                           help="Sequences running at once (default: platform's).")
        sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                           default=d.enable_chunked_prefill,
                           help="Split long prompts across steps.")
        sched.add_argument("-tp", "--tensor-parallel-size", type=positive_int,
                           default=d.tensor_parallel_size, help="Tensor-parallel ranks.")
        sched.add_argument("-pp", "--pipeline-parallel-size", type=positive_int,
                           default=d.pipeline_parallel_size,
                           help="Pipeline-parallel stages: the decoder layers split across "
                           "them (VLLM_PP_LAYER_PARTITION='a,b,...' to choose); world = tp x pp.")
        sched.add_argument("-dp", "--data-parallel-size", type=positive_int,
                           default=d.data_parallel_size,
                           help="Data-parallel replicas (only 1: run one server per replica).")
        sched.add_argument("--disable-custom-all-reduce", action="store_true",
                           help="Accepted for upstream's scripts: the all-reduce is always "
                           "torch.distributed's here (there is no custom one to disable).")
        sched.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"],
                           default=d.distributed_executor_backend,
                           help="uni: one process; mp: one local process per rank; ray: one "
                           "Ray actor per rank (multi-node; RAY_ADDRESS or a local cluster). "
                           "Default: ray inside a Ray job or when the world is larger than "
                           "this machine, else mp.")
        sched.add_argument("--disable-log-stats", action="store_true",
                           help="Do not log engine statistics.")
        compat = parser.add_argument_group(
            "upstream compatibility",
            "upstream's flags for what a local model folder ignores, or for features this "
            "engine leaves out (accepted only at their 'off' value)")
        compat.add_argument("--quantization", "-q", default=d.quantization,
                            help="Must be the checkpoint's own quantization (e.g. fp8) or "
                            "unset: there is no online quantization.")
        compat.add_argument("--hf-overrides", type=_hf_overrides, default=d.hf_overrides,
                            help="JSON: values set on the model's Hugging Face config, e.g. "
                            "'{\"rope_theta\": 20000}'.")
        compat.add_argument("--swap-space", type=float, default=d.swap_space,
                            help="Ignored: preempted requests are recomputed, never swapped.")
        compat.add_argument("--cpu-offload-gb", type=float, default=d.cpu_offload_gb,
                            help="Only 0 (no weight offloading).")
        for flag in ("--enable-lora", "--enable-sleep-mode", "--skip-tokenizer-init",
                     "--disable-sliding-window", "--calculate-kv-scales"):
            compat.add_argument(flag, action="store_true", help="Not supported (only off).")
        compat.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                            default=d.async_scheduling, help="Only off.")
        compat.add_argument("--model-impl", default=d.model_impl,
                            help="auto or vllm: this engine's own model code.")
        return parser

    def _check_compat_args(self, model_config: ModelConfig) -> None:
        """COMPAT_ARGS: ignored ones warn when set; left-out features must be off."""
        for name, (accepted, what) in COMPAT_ARGS.items():
            value = getattr(self, name)
            if value not in accepted:
                raise ValueError(f"{name}={value!r} is not supported: this engine has no "
                                 f"{what} (accepted: {', '.join(map(repr, accepted))})")
        if model_config.hub_snapshot is None:
            for name in ("revision", "download_dir"):
                if getattr(self, name) is not None:
                    logger.warning_once("%s=%r is ignored: the model is a local folder", name,
                                        getattr(self, name))
        if self.swap_space != EngineArgs.swap_space:
            logger.warning_once("swap_space is ignored: preempted requests are recomputed, "
                                "never swapped out")
        if self.quantization is not None and self.quantization != model_config.quant_method:
            have = model_config.quant_method
            theirs = repr(have) if have else "none (leave quantization unset)"
            raise ValueError(
                f"quantization={self.quantization!r} is not supported: this engine has no "
                f"online quantization; the checkpoint's is {theirs}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a parsed namespace (attributes named like the fields)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    # ---- configs --------------------------------------------------------------------------
    def create_compilation_config(self) -> CompilationConfig:
        """The user's CompilationConfig (a copy: resolution never mutates the caller's object),
        with --cudagraph-capture-sizes / --max-cudagraph-capture-size folded in.
        Raises ValueError for bad JSON, unknown keys, or a flag given twice (top level and -cc)."""
        cc = self.compilation_config
        mode = _mode_shorthand(cc)
        if mode is not None:
            cc = {"mode": mode}
        elif isinstance(cc, str):
            cc = parse_json_object(cc, "compilation_config")
        top = {name: getattr(self, name) for name in _CC_MIRRORED
               if getattr(self, name) is not None}
        if cc is None or isinstance(cc, dict):
            data = copy.deepcopy(cc or {})
            in_cc = {name for name in top if data.get(name) is not None}
        elif isinstance(cc, CompilationConfig):
            data = None
            in_cc = {name for name in top if getattr(cc, name) is not None}
        else:
            raise ValueError("compilation_config must be a dict, a JSON string, a "
                             f"CompilationConfig or a mode number, got {type(cc).__name__}")
        if in_cc:
            name = sorted(in_cc)[0]
            raise ValueError(f"--{name.replace('_', '-')} and compilation_config.{name} "
                             "(-cc) are mutually exclusive; give it only once")
        if data is not None:
            data.update(copy.deepcopy(top))
            return CompilationConfig.from_dict(data)
        # dataclasses.replace re-runs the validation in __post_init__ on a deep copy.
        return dataclasses.replace(copy.deepcopy(cc), **copy.deepcopy(top))

    def create_engine_config(self) -> VllmConfig:
        """Build ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, CompilationConfig
        and the resolved VllmConfig. Raises ValueError with a clear message on bad input."""
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, seed=0 if self.seed is None else self.seed,
            hf_overrides=self.hf_overrides, revision=self.revision,
            tokenizer_revision=self.tokenizer_revision, download_dir=self.download_dir,
            served_model_name=self.served_model_name,
            trust_remote_code=self.trust_remote_code, enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs, tokenizer_mode=self.tokenizer_mode,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config)
        self._check_compat_args(model_config)
        cache_config = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=self._kv_cache_memory(),
            enable_prefix_caching=self.enable_prefix_caching, cache_dtype=self.kv_cache_dtype,
            num_gpu_blocks_override=self.num_gpu_blocks_override)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend)
        _check_pipeline_parallel(model_config, parallel_config.pipeline_parallel_size)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill)
        return VllmConfig(
            model_config=model_config, cache_config=cache_config,
            parallel_config=parallel_config, scheduler_config=scheduler_config,
            compilation_config=self.create_compilation_config(),
            load_config=LoadConfig(load_format=self.load_format),
            optimization_level=self.optimization_level)

    def _kv_cache_memory(self) -> int | str | None:
        """--kv-cache-memory, else on the CPU VLLM_CPU_KVCACHE_SPACE (GiB), else None (the
        platform's default; on CUDA: from gpu_memory_utilization)."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        from vllm import envs
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None

        try:
            gib = envs.VLLM_CPU_KVCACHE_SPACE
        except ValueError:
            raise ValueError("VLLM_CPU_KVCACHE_SPACE must be a number of GiB, e.g. 4") from None
        return None if gib is None else int(gib * 1024**3)


def _kv_cache_memory(text: str) -> int:
    value = human_int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 4GiB, got {text!r}")
    return value


@dataclass
class AsyncEngineArgs(EngineArgs):
    """Upstream's argument class for the async engine (`AsyncLLMEngine.from_engine_args`):
    the same settings."""


def _check_pipeline_parallel(model_config: ModelConfig, pp_size: int) -> None:
    """pipeline_parallel_size > 1: the family supports it and the layer split is valid
    (ValueError naming the problem)."""
    if pp_size == 1:
        return
    from vllm.model_executor.models.pipeline import check_pp_supported, pp_partition
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    check_pp_supported(model_cls, pp_size)
    pp_partition(model_config.get_num_layers(), pp_size)
