"""LLMEngine: add requests, step, abort. Owns the tokenizer, scheduler, executor and output
processor; one `step()` is schedule -> execute -> update -> detokenize."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm.config.model import GENERATION_CONFIG_KEYS
from vllm.engine.executor import Executor
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.request import Request, RequestStatus
from vllm.engine.scheduler import Scheduler
from vllm.engine.step_recovery import StepRecovery
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams, truncate_prompt
from vllm.utils.startup_timer import StartupTimer, reset_startup_timer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

logger = init_logger(__name__)

PromptType = str | dict[str, Any]
"""A text prompt, {"prompt": text} or {"prompt_token_ids": [...]} (optionally with "prompt")."""

def load_tokenizer(tokenizer: str, trust_remote_code: bool = False, mode: str = "auto"):
    """The folder's tokenizer; `mode` "slow" takes the Python tokenizer over the fast one."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code,
                                               use_fast=mode != "slow")
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot load the tokenizer from {tokenizer!r}: {exc}") from exc
    if mode == "slow" and getattr(loaded, "is_fast", False):
        logger.warning("tokenizer_mode='slow', but %s has no slow (Python) tokenizer: using "
                       "its fast one", tokenizer)
    return loaded


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


@dataclass
class PreparedRequest:
    """A validated request, split into its n sequences (`InputProcessor.prepare_request`):
    what the scheduler and the output processor are given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    internal_ids: list[str]
    child_params: list[SamplingParams]
    max_tokens: int
    arrival_time: float | None = None


class InputProcessor:
    """The request side of an engine: the tokenizer, the model's generation defaults and the
    checks that turn a prompt and its SamplingParams into a `PreparedRequest`. `LLMEngine`
    is one; in `vllm serve`'s API process, so is `vllm.engine.core_client.EngineCoreClient`
    (the scheduler and the model then run in the engine-core process)."""

    output_processor: OutputProcessor

    def _init_inputs(self, vllm_config: VllmConfig, timer: StartupTimer) -> None:
        self.vllm_config = vllm_config
        self.model_config = mc = vllm_config.model_config
        with timer.phase("tokenizer loading"):
            self.tokenizer = load_tokenizer(mc.tokenizer_path, mc.trust_remote_code,
                                            mc.tokenizer_mode)
        self.generation_config = self._read_generation_config()
        self.eos_token_ids = self._eos_token_ids()
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.get_vocab_size()

    def _ids_in_use(self, internal_ids: list[str]) -> list[str]:
        """Those of `internal_ids` that a live sequence already has."""
        return [i for i in internal_ids if i in self.output_processor._seq_to_request]

    # ---- model facts --------------------------------------------------------------------
    def _read_generation_config(self) -> dict:
        path = os.path.join(self.model_config.generation_config_folder(),
                            "generation_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def _eos_token_ids(self) -> set[int]:
        ids = _as_id_set(getattr(self.tokenizer, "eos_token_id", None))
        if "eos_token_id" in self.generation_config:
            ids |= _as_id_set(self.generation_config["eos_token_id"])
        else:
            ids |= _as_id_set(getattr(self.model_config.hf_config, "eos_token_id", None))
        return ids

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation_config.json defaults applied (none with
        generation_config="vllm"), then override_generation_config's."""
        mc = self.model_config
        source = {} if mc.generation_config == "vllm" else dict(self.generation_config)
        source.update(mc.override_generation_config or {})
        values = {ours: source[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
                  if source.get(theirs) is not None}
        return SamplingParams(**values)

    # ---- requests -----------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                       ) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), cut to the last `truncate_prompt_tokens`
        (-1: max_model_len) and validated against max_model_len and the vocabulary. Raises
        ValueError."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError("a prompt must be a string, {'prompt': str} or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        kept = truncate_prompt(token_ids, truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(token_ids):
            token_ids, text = kept, self.tokenizer.decode(kept)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), "
                             f"got {bad[:5]}")
        return text, token_ids

    def _resolve_logprobs(self, params: SamplingParams) -> None:
        """-1 (the whole vocabulary) becomes the vocabulary size; more than max_logprobs (or
        the vocabulary) is a ValueError naming both."""
        limit = self.model_config.get_max_logprobs()
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked == -1:
                asked = self.vocab_size
                setattr(params, name, asked)
            if asked is not None and asked > limit:
                raise ValueError(
                    f"{name}={asked} is more than the {limit} allowed (max_logprobs="
                    f"{self.model_config.max_logprobs}, vocabulary {self.vocab_size}); "
                    "raise --max-logprobs, -1 for the whole vocabulary")

    def _check_token_params(self, params: SamplingParams) -> None:
        """Token ids in logit_bias and allowed_token_ids must be in the vocabulary."""
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = sorted(t for t in ids if t >= self.vocab_size)
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, "
                                 f"{self.vocab_size}): {bad[:5]}")

    def prepare_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None) -> PreparedRequest:
        """Validate a request and split it into its n sequences; raises ValueError for an
        invalid prompt (e.g. longer than max_model_len) or a request id already in use."""
        if params is None:
            params = self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.process_prompt(prompt, params.truncate_prompt_tokens)
        params = params.clone()
        self._resolve_logprobs(params)
        self._check_token_params(params)
        params.update_from_eos(self.eos_token_ids)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        room = self.max_model_len - len(token_ids)
        max_tokens = max(1, min(params.max_tokens or room, room))
        if params.n == 1:
            internal = [(request_id, params)]
        else:
            internal = []
            for i in range(params.n):
                child = params.clone()
                child.n = 1
                if child.seed is not None:
                    child.seed += i
                if i > 0:
                    # The prompt is the same: one sequence computes its logprobs, and the
                    # others may then use the prefix cache.
                    child.prompt_logprobs = None
                internal.append((f"{i}_{request_id}", child))
        taken = self._ids_in_use([i for i, _ in internal])
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        return PreparedRequest(request_id, text, token_ids, params, [i for i, _ in internal],
                               [p for _, p in internal], max_tokens, arrival_time)


class LLMEngine(InputProcessor):
    """The synchronous engine: requests in, RequestOutputs out, one step at a time."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None,
                 log_stats: bool = False, load_format: str = "auto",
                 startup_timer: StartupTimer | None = None,
                 output_processor_class: type[OutputProcessor] = OutputProcessor) -> None:
        """`startup_timer`: the process-wide timer, already reset and holding the config
        resolution (`from_engine_args`); None resets it here. `output_processor_class`: the
        engine-core process passes one that only collects each step's token ids (the API
        process detokenizes them)."""
        timer = startup_timer or reset_startup_timer()
        self.log_stats = log_stats
        logger.info("%s", vllm_config.summary_line())
        self._init_inputs(vllm_config, timer)
        self.device = vllm_config.platform.torch_device()
        executor_class = executor_class or Executor.get_class(vllm_config)
        self.executor = executor_class(vllm_config, load_format=load_format)
        self.scheduler = Scheduler(vllm_config.scheduler_config, vllm_config.cache_config,
                                   self.executor.num_blocks)
        self.output_processor = output_processor_class(self.tokenizer)
        self.step_recovery = StepRecovery(self)
        self._last_log = time.monotonic()
        self._generated_since_log = 0
        self._finish_startup(timer)

    def _finish_startup(self, timer: StartupTimer) -> None:
        """Close the start-up timer: `startup_phases` (phase -> seconds, "other" included, the
        rows adding up to `startup_seconds`), `startup_report` (every event) and one log
        table."""
        wall = timer.wall_seconds()
        self.startup_seconds = wall
        self.startup_phases: dict[str, float] = timer.phase_seconds(wall)
        self.startup_report: dict[str, Any] = {**timer.as_dict(), "wall_seconds": wall}
        logger.info("Start-up phases (ready in %.2f s, level O%d):\n%s", wall,
                    int(self.vllm_config.optimization_level), timer.table(wall))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        timer = reset_startup_timer()
        with timer.phase("config resolution"):
            config = engine_args.create_engine_config()
        kwargs.setdefault("log_stats", not engine_args.disable_log_stats)
        kwargs.setdefault("startup_timer", timer)
        return cls(config, **kwargs)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, **kwargs: Any) -> LLMEngine:
        return cls(vllm_config, **kwargs)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError for an invalid prompt (e.g. longer than
        max_model_len) or a request id already in use, leaving other requests untouched."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def _ids_in_use(self, internal_ids: list[str]) -> list[str]:
        return [i for i in internal_ids if i in self.scheduler.requests]

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Hand a `prepare_request` result to the output processor and the scheduler."""
        p = prepared
        self.output_processor.add_request(p.request_id, p.prompt, p.prompt_token_ids,
                                          p.params, p.internal_ids, p.child_params)
        for internal_id, child in zip(p.internal_ids, p.child_params):
            request = Request(internal_id, p.prompt_token_ids, child, p.max_tokens,
                              p.arrival_time)
            if child.seed is not None:
                request.generator = torch.Generator(device=self.device)
                request.generator.manual_seed(child.seed)
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        internal = self.output_processor.abort_requests(ids)
        self.scheduler.finish_requests(internal, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the RequestOutputs of requests that progressed
        (cumulative text and tokens; `finished` once all n sequences are done).

        A request that makes the step fail is finished with finish_reason "error" (its
        output is returned here, its exception by `pop_request_errors()`) and the others go
        on (see `vllm.engine.step_recovery`). What step() raises means the engine is broken
        (`vllm.engine.errors.is_fatal`): a worker died, a collective or the device failed,
        or steps keep failing with no request to blame."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.has_unfinished_requests():
            # The KV pool always holds one max-length sequence, so this is a bug: fail loudly
            # instead of spinning.
            raise RuntimeError(f"the scheduler could not schedule any of its "
                               f"{self.scheduler.get_num_unfinished_requests()} unfinished "
                               f"requests: {self.scheduler.stats()}")
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return []
        # A failure fails the requests that caused it (step_recovery); only an error that
        # means the engine itself is broken leaves step().
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - contained or re-raised by the recovery
            return self.step_recovery.after_failed_execute(scheduler_output, exc)
        try:
            core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            outputs, stopped = self.output_processor.process_outputs(core_outputs)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        except Exception as exc:  # noqa: BLE001 - contained or re-raised by the recovery
            return self.step_recovery.after_failed_update(scheduler_output, exc)
        self.step_recovery.on_success()
        if self.log_stats:
            self._generated_since_log += sum(len(o.new_token_ids) for o in core_outputs)
            self._maybe_log_stats()
        return outputs

    def pop_request_errors(self) -> dict[str, BaseException]:
        """request id -> exception, for the requests failed by a failing step since the last
        call (`step()` returned their final output, finish_reason "error")."""
        return self.step_recovery.pop_errors()

    def start_health_monitor(self, on_dead: Callable[[BaseException], None]) -> None:
        """Call `on_dead(error)` (from another thread) as soon as the executor sees the engine
        die while it may be idle, e.g. a tensor-parallel worker process exiting."""
        start = getattr(self.executor, "start_health_monitor", None)
        if start is not None:
            start(on_dead)

    def _maybe_log_stats(self, interval_s: float = 10.0) -> None:
        now = time.monotonic()
        if now - self._last_log < interval_s:
            return
        stats = self.scheduler.stats()
        logger.info("Engine: %.1f generated tokens/s, running %d, waiting %d, KV cache usage "
                    "%.1f%%, preemptions %d, prefix cache hit rate %.1f%%",
                    self._generated_since_log / (now - self._last_log), stats["running"],
                    stats["waiting"], 100 * stats["kv_cache_usage"], stats["num_preemptions"],
                    100 * stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1))
        self._last_log, self._generated_since_log = now, 0

    def stats(self) -> dict:
        """Scheduler and KV-cache gauges for logs and /metrics."""
        stats = self.scheduler.stats()
        stats["num_unfinished_requests"] = self.get_num_unfinished_requests()
        stats["block_size"] = self.vllm_config.cache_config.block_size
        stats["num_failed_steps"] = self.step_recovery.num_failed_steps
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
