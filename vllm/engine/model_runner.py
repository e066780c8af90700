"""ModelRunner: execute one SchedulerOutput on the model and sample.

Steps: update the per-request state from the SchedulerOutput, fill the persistent input
buffers, build the attention metadata, pick the CUDA-graph mode and padded size, run the model
inside the forward context, compute logits only for the rows that sample (plus prompt-logprob
rows), sample, and return a ModelRunnerOutput.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.engine.input_buffers import InputBuffers
from vllm.engine.sched_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.sampler import Sampler, SamplingMetadata, gather_logprobs

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

PROMPT_LOGPROBS_ROWS = 512
"""Prompt positions whose logits are computed at once for prompt_logprobs."""


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Prompt + outputs, as the scheduler sent them (the runner never appends its own
    samples, so every tensor-parallel rank holds the same tokens)."""
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int

    _logit_bias: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False)
    _allowed_ids: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def logit_bias_tensors(self, vocab_size: int, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, bias values) of logit_bias inside the vocabulary, built once per
        request (a bias may name up to MAX_LOGIT_BIAS_ENTRIES tokens)."""
        if self._logit_bias is None:
            items = [(t, v) for t, v in self.sampling_params.logit_bias.items()
                     if t < vocab_size]
            self._logit_bias = (
                torch.tensor([t for t, _ in items], dtype=torch.int64, device=device),
                torch.tensor([v for _, v in items], dtype=torch.float32, device=device))
        return self._logit_bias

    def allowed_ids_tensor(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """allowed_token_ids inside the vocabulary, built once per request."""
        if self._allowed_ids is None:
            self._allowed_ids = torch.tensor(
                [t for t in self.sampling_params.allowed_token_ids if t < vocab_size],
                dtype=torch.int64, device=device)
        return self._allowed_ids


@dataclass(slots=True)
class PreparedBatch:
    """One step's inputs, as `_prepare_inputs` leaves them for `_run_model` and `_sample`."""

    req_ids: list[str]
    """The scheduled requests, in batch order."""
    input_ids: torch.Tensor
    """[num_padded_tokens] views of the persistent input buffers (padding lanes zero)."""
    positions: torch.Tensor
    attn_metadata: object
    cudagraph_mode: CUDAGraphMode
    batch_descriptor: object
    """The dispatcher's key for the CUDA graph to replay (None: none)."""
    sample_req_ids: list[str]
    """The requests that sample a token this step (their last scheduled token is their
    last known one), and the rows of their logits in the hidden states."""
    logits_indices: list[int]
    prompt_lp_rows: list[tuple[str, int, int, int]]
    """(request, first row, first position, number of rows) of prompt-logprob rows."""


# CPU KV cache memory taken at start-up: the blocks the first requests get (the free queue
# hands them out in id order). A large cache in huge pages is the kernel's zero pages until
# written (vllm/utils/hugepages.py). Writing all of it at start-up (as torch.zeros does) cost
# 22 s of a 25 s start-up for the default 4 GiB on a VM that hands freed memory back to its
# host (virtio-balloon free page reporting: ~5 s a GiB to fault back in, measured on the Zen 4
# dev machine); leaving all of it to the steps made a fresh process's first request wait for
# those faults instead (50M Llama: one decode step of 37 ms among ~4 ms ones). This much is
# taken now (~1.3 s there, a few ms on bare metal); blocks past it are taken as steps first
# write them (a server's first pass through its cache), and Worker.initialize_cache checks
# that the whole cache fits in the memory free at start-up.
KV_CACHE_BYTES_TAKEN_AT_START = 256 << 20


def _take_first_blocks(caches: dict[str, torch.Tensor], num_blocks: int) -> None:
    """Write zeros over the first blocks of every CPU cache [2, num_blocks, ...], as many as
    KV_CACHE_BYTES_TAKEN_AT_START holds over all of them, so their pages are resident."""
    per_block = sum(c.numel() * c.element_size() for c in caches.values()) // max(num_blocks, 1)
    first = min(num_blocks, KV_CACHE_BYTES_TAKEN_AT_START // max(per_block, 1))
    for cache in caches.values():
        if cache.dim() >= 2 and cache.shape[1] == num_blocks:
            cache[:, :first].zero_()
        else:  # another layout: all of it
            cache.zero_()


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_driver: bool = True) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.is_driver = is_driver
        """Tensor-parallel rank 0: the only rank that samples. The others run the same
        forward and logits (they hold collectives) and return nothing."""
        self.block_size = vllm_config.cache_config.block_size
        sc = vllm_config.scheduler_config
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        self.model: torch.nn.Module | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.input_buffers = InputBuffers(self.max_num_tokens, self.max_num_reqs, device)
        self.attn_metadata_builder = None
        # A CudagraphDispatcher when CUDA graphs are on (set with the capture): maps a batch
        # to (runtime mode, BatchDescriptor whose num_tokens is the padded size).
        self.cudagraph_dispatcher = None

    # ---- set-up -------------------------------------------------------------------------
    def load_model(self, load_format: str = "auto") -> None:
        from vllm.model_executor.model_loader import get_model

        self.model = get_model(self.vllm_config, load_format=load_format)
        self.vocab_size = self.vllm_config.model_config.get_vocab_size()
        backends = {layer.attn_backend for layer in self.attention_layers.values()}
        if len(backends) != 1:
            raise ValueError(f"the model's attention layers use {len(backends)} backends "
                             f"({sorted(b.get_name() for b in backends)}); one is supported")
        self.attn_backend = backends.pop()
        self.attn_metadata_builder = self.attn_backend.get_builder_cls()(self.vllm_config,
                                                                         self.device)

    @property
    def attention_layers(self) -> dict:
        return self.model.attention_layers

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Allocate one zeroed cache [2, num_blocks, block_size, kv_heads, head_size] per
        attention layer and bind it (zeroed: padding lanes read block 0 behind a mask, and
        0 * garbage could be NaN)."""
        from vllm.attention.layer import bind_kv_cache
        from vllm.utils.hugepages import cpu_zeros, huge_pages_enabled

        on_cpu = torch.device(self.device).type == "cpu"

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if on_cpu:  # in huge pages where large
                return cpu_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=self.device)

        caches = {name: zeros(layer.get_kv_cache_shape(num_blocks, self.block_size))
                  for name, layer in self.attention_layers.items()}
        if on_cpu and huge_pages_enabled():  # (else torch.zeros wrote all of it)
            _take_first_blocks(caches, num_blocks)
        bind_kv_cache(self.model, caches)
        self.kv_caches = caches
        return caches

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward at the full token budget without KV traffic (attention metadata None),
        plus logits and sampling for max_num_seqs rows: the activation peak."""
        from vllm.forward_context import set_forward_context

        num_tokens = self.max_num_tokens
        input_ids, positions = self.input_buffers.commit_tokens(0, num_tokens)
        with set_forward_context(None, self.vllm_config, attn_layers=self.attention_layers):
            hidden = self.model(input_ids, positions)
        rows = torch.arange(min(self.max_num_reqs, num_tokens), device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        if logits is None:  # a pipeline stage before the last
            return
        n = logits.shape[0]
        self.sampler(logits, SamplingMetadata(
            temperature=torch.ones(n, device=self.device), all_greedy=False, all_random=True,
            top_k=torch.full((n,), logits.shape[1], device=self.device),
            top_p=torch.ones(n, device=self.device), max_num_logprobs=1))

    # ---- CUDA graphs --------------------------------------------------------------------
    def _resolved_cudagraph_mode(self) -> CUDAGraphMode:
        """The resolved CUDA-graph mode, as `vllm config` shows it: config resolution already
        narrowed it to what the attention backend runs inside full graphs. The model's layers
        must have got a backend that runs it too (they get the default one)."""
        from vllm.config.vllm import cudagraph_mode_for_backend

        mode = self.vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
        support = self.attn_backend.cudagraph_support
        if cudagraph_mode_for_backend(mode, support, self.vllm_config.piecewise_compiled) != mode:
            name = self.attn_backend.get_name()
            raise RuntimeError(
                f"The resolved CUDA graph mode {mode} is more than the model's attention backend "
                f"{name} runs inside full graphs ({support.name}): the config was resolved for "
                f"another backend. Set VLLM_ATTENTION_BACKEND={name} or a cudagraph_mode it "
                "supports.")
        return mode

    def capture_model(self) -> None:
        """Capture the CUDA graphs the dispatcher keys (piecewise first, largest first), each
        after one warm-up run; afterwards `execute_model` dispatches to them."""
        mode = self._resolved_cudagraph_mode()
        if not mode:
            return
        if self.vllm_config.parallel_config.pipeline_parallel_size > 1:
            # The stages' send/recv run between the compiled pieces, outside any graph.
            logger.warning("CUDA graphs are not captured with pipeline parallelism (the "
                           "stages' compiled graphs run without them)")
            return
        from vllm.compilation.counter import compilation_counter
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.compilation.cudagraph_dispatcher import CudagraphDispatcher
        from vllm.utils.startup_timer import get_startup_timer

        dispatcher = CudagraphDispatcher(self.vllm_config)
        dispatcher.initialize_cudagraph_keys(mode)
        if mode.has_full_cudagraphs() and not isinstance(self.model, CUDAGraphWrapper):
            self.model = CUDAGraphWrapper(self.model, self.vllm_config, CUDAGraphMode.FULL)
        keys = dispatcher.capture_descriptors()
        # The graph wrappers record each capture; the warm-up runs between them go to the
        # same phase as one uncounted event, so the phase's count is the number of graphs.
        timer = get_startup_timer()
        start = time.perf_counter()
        captured_before = timer.seconds("cudagraph capture")
        for runtime_mode, descriptor in keys:
            compilation_counter.num_gpu_runner_capture_triggers += 1
            num_reqs = descriptor.num_reqs if descriptor.uniform else 1
            self.dummy_run(descriptor.num_tokens, num_reqs, descriptor.uniform)
            self.dummy_run(descriptor.num_tokens, num_reqs, descriptor.uniform,
                           runtime_mode, descriptor)
        captured = timer.seconds("cudagraph capture") - captured_before
        timer.record("cudagraph capture", time.perf_counter() - start - captured,
                     uncounted=True)
        self.cudagraph_dispatcher = dispatcher
        logger.info("Captured %d CUDA graphs (mode %s, sizes up to %d tokens)", len(keys), mode,
                    dispatcher.max_capture_size)

    def warm_up_sizes(self) -> tuple[int, list[int]]:
        """(the token count of the first, tracing warm-up forward; the compile sizes).

        The first forward is the Dynamo trace with the token dimension dynamic, so it must not
        be a compile size (that size would then be compiled twice: general and static): the
        smallest count >= 2 that is not one (2 rather than 1, so nothing specializes on a
        single token)."""
        sizes = sorted({int(s) for s in self.vllm_config.compilation_config.compile_sizes or []
                        if int(s) <= self.max_num_tokens})
        general = 2
        while general in sizes and general < self.max_num_tokens:
            general += 1
        return min(general, self.max_num_tokens), sizes

    @torch.inference_mode()
    def compile_or_warm_up_model(self) -> None:
        """Compile during start-up, not on the first request: a forward over dummy requests
        (KV in the reserved block 0) runs the Dynamo trace and compiles the dynamic graph
        (every compile range, and every `compile_sizes` entry statically); then one forward
        per `compile_sizes` entry runs it (a warm start loads its code there); then the CUDA
        graphs are captured. At -O0 the forward only warms up."""
        from vllm.config.compilation import CompilationMode

        reports = contextlib.nullcontext()
        if self.vllm_config.compilation_config.mode != CompilationMode.NONE:
            # (-O0 never imports the compile backend: ~0.5 s of start-up)
            from vllm.compilation.backends import deferred_cache_reports

            reports = deferred_cache_reports()
        general, sizes = self.warm_up_sizes()
        with reports:
            hidden = self.dummy_run(general)
            self.model.compute_logits(hidden[:1])
            for size in sizes:
                self.dummy_run(size)
        self.capture_model()

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_reqs: int = 1, uniform: bool = False,
                  runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                  batch_descriptor: object = None) -> torch.Tensor:
        """A forward over dummy requests whose KV lives in the reserved block 0 (warm-up and
        capture): `num_reqs` requests of equal length when `uniform`, else one request."""
        from vllm.forward_context import set_forward_context

        bs = self.block_size
        query_lens = [num_tokens // num_reqs] * num_reqs if uniform else [num_tokens]
        block_tables = [[0] * -(-q // bs) for q in query_lens]
        slot_mapping = [i % bs for q in query_lens for i in range(q)]
        metadata = self.attn_metadata_builder.build(
            query_lens, list(query_lens), block_tables, slot_mapping,
            num_padded_tokens=num_tokens if sum(query_lens) != num_tokens else None,
            device=self.device)
        input_ids, positions = self.input_buffers.commit_tokens(0, num_tokens)
        with set_forward_context(metadata, self.vllm_config, attn_layers=self.attention_layers,
                                 cudagraph_runtime_mode=runtime_mode,
                                 batch_descriptor=batch_descriptor):
            return self.model(input_ids, positions)

    # ---- one step -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                token_ids=list(new.token_ids), sampling_params=new.sampling_params,
                generator=new.generator, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _dispatch(self, num_tokens: int, num_reqs: int,
                  uniform_decode: bool) -> tuple[CUDAGraphMode, object, int]:
        if self.cudagraph_dispatcher is None:
            return CUDAGraphMode.NONE, None, num_tokens
        mode, descriptor = self.cudagraph_dispatcher.dispatch(num_tokens, num_reqs,
                                                              uniform_decode)
        return mode, descriptor, max(descriptor.num_tokens, num_tokens)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: input preparation (`_prepare_inputs`), the forward (`_run_model`),
        logits and sampling (`_sample`), then the requests' computed-token counts move on."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.vllm_config.parallel_config.pipeline_parallel_size > 1:
            output = self._execute_micro_batches(so)
        else:
            batch = self._prepare_inputs(so)
            hidden = self._run_model(batch)
            output = self._sample(hidden, batch)
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    def _execute_micro_batches(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Pipeline parallelism: the batch in micro-batches run in order on every stage, so
        that the stages overlap (models/pipeline.py `split_micro_batches`)."""
        from vllm.model_executor.models.pipeline import (
            merge_outputs,
            split_micro_batches,
            wait_pp_sends,
        )

        outputs = []
        for part in split_micro_batches(so, self.vllm_config.parallel_config
                                        .pipeline_parallel_size):
            batch = self._prepare_inputs(part)
            outputs.append(self._sample(self._run_model(batch), batch))
        wait_pp_sends()
        return merge_outputs(list(so.num_scheduled_tokens), outputs)

    # ---- input preparation --------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedBatch:
        """Fill the persistent input buffers (token ids, positions) for the scheduled tokens,
        pick the CUDA-graph mode and padded size, move the inputs to the device and build the
        attention metadata. Also notes which rows sample and which give prompt logprobs."""
        bs = self.block_size
        buffers = self.input_buffers
        req_ids = list(so.num_scheduled_tokens)
        num_tokens = so.total_num_scheduled_tokens
        buffers.check_fits(num_tokens, len(req_ids))

        query_lens, seq_lens, block_tables = [], [], []
        slot_mapping: list[int] = []
        sample_req_ids, logits_indices = [], []
        prompt_lp_rows: list[tuple[str, int, int, int]] = []  # (req, first row, first pos, n)
        offset = 0
        for req_id in req_ids:
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            if n == 1:  # decode: plain ints beat numpy's per-call overhead
                buffers.input_ids_np[offset] = state.token_ids[start]
                buffers.positions_np[offset] = start
                slot_mapping.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                buffers.input_ids_np[offset:offset + n] = state.token_ids[start:end]
                positions = np.arange(start, end, dtype=np.int64)
                buffers.positions_np[offset:offset + n] = positions
                block_ids = np.asarray(state.block_ids, dtype=np.int64)
                slot_mapping.extend((block_ids[positions // bs] * bs + positions % bs).tolist())
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(state.block_ids)
            if state.sampling_params.prompt_logprobs is not None:
                last = min(end, len(state.prompt_token_ids) - 1)
                if last > start:
                    prompt_lp_rows.append((req_id, offset, start, last - start))
            if end == len(state.token_ids):
                sample_req_ids.append(req_id)
                logits_indices.append(offset + n - 1)
            offset += n

        uniform_decode = all(q == 1 for q in query_lens)
        mode, batch_descriptor, num_padded = self._dispatch(num_tokens, len(req_ids),
                                                            uniform_decode)
        buffers.check_fits(num_padded, len(req_ids))
        input_ids, positions = buffers.commit_tokens(num_tokens, num_padded)
        attn_metadata = self.attn_metadata_builder.build(
            query_lens, seq_lens, block_tables, slot_mapping,
            num_padded_tokens=num_padded if num_padded != num_tokens else None,
            device=self.device)
        return PreparedBatch(req_ids, input_ids, positions, attn_metadata, mode,
                             batch_descriptor, sample_req_ids, logits_indices, prompt_lp_rows)

    # ---- model run ----------------------------------------------------------------------
    def _run_model(self, batch: PreparedBatch) -> torch.Tensor:
        """The (compiled, or CUDA-graph replayed) forward inside the forward context: hidden
        states [num_padded_tokens, hidden_size]."""
        from vllm.forward_context import set_forward_context

        with set_forward_context(batch.attn_metadata, self.vllm_config,
                                 attn_layers=self.attention_layers,
                                 cudagraph_runtime_mode=batch.cudagraph_mode,
                                 batch_descriptor=batch.batch_descriptor):
            return self.model(batch.input_ids, batch.positions)

    # ---- sampling -----------------------------------------------------------------------
    def _sample(self, hidden: torch.Tensor, batch: PreparedBatch) -> ModelRunnerOutput:
        """Logits of the rows that sample, the sampled tokens (and their logprobs), and the
        prompt logprobs asked for; the step's ModelRunnerOutput."""
        output = ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids={})
        if batch.sample_req_ids:
            self._sample_tokens(hidden, batch.sample_req_ids, batch.logits_indices, output)
        if batch.prompt_lp_rows:
            self._prompt_logprobs(hidden, batch.prompt_lp_rows, output)
        return output

    def _sample_tokens(self, hidden: torch.Tensor, req_ids: list[str],
                       logits_indices: list[int], output: ModelRunnerOutput) -> None:
        # The indices increase (one per request, in batch order): first..last spaced by one
        # is a run (all-decode batches), taken as a view instead of a gather.
        first, n = logits_indices[0], len(logits_indices)
        if logits_indices[-1] - first == n - 1:
            rows = hidden[first:first + n]
        else:
            rows = hidden[self.input_buffers.commit_logits_indices(logits_indices)]
        logits = self.model.compute_logits(rows)
        if not self.is_driver:
            return
        states = [self.requests[r] for r in req_ids]
        metadata = self._sampling_metadata(states, logits.shape[-1])
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        lp = result.logprobs_tensors
        lp_lists = None
        if lp is not None:
            lp_lists = (lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist())
        for row, (state, token) in enumerate(zip(states, sampled)):
            output.sampled_token_ids[state.req_id] = token
            k = state.sampling_params.logprobs
            if k is not None and lp_lists is not None:
                ids, lps, ranks = (x[row][:k + 1] for x in lp_lists)
                output.logprobs[state.req_id] = LogprobsLists(ids, lps, ranks)

    def _sampling_metadata(self, states: list[CachedRequestState],
                           vocab_size: int) -> SamplingMetadata:
        device = self.device
        params = [s.sampling_params for s in states]
        greedy = [p.temperature < 1e-5 for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        md = SamplingMetadata(
            temperature=None if all_greedy else tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            all_greedy=all_greedy, all_random=all_random)
        if not all_greedy:
            if not all_random:
                md.greedy_mask = tensor(greedy, torch.bool)
            if any(p.top_k > 0 for p in params):
                md.top_k = tensor([p.top_k if p.top_k > 0 else vocab_size for p in params],
                                  torch.int64)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = tensor([p.top_p for p in params], torch.float32)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = tensor([p.min_p for p in params], torch.float32)
            md.generators = {i: s.generator for i, s in enumerate(states)
                             if s.generator is not None and not greedy[i]}
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(wanted) if wanted else None
        rows, cols = [], []  # banned this step: stop tokens before min_tokens, bad words
        for i, (state, p) in enumerate(zip(states, params)):
            banned = p.all_stop_token_ids if state.num_output_tokens < p.min_tokens else ()
            if p.bad_words:
                # The whole sequence and where the output starts: slicing the output off
                # would copy it every step.
                words = p.banned_by_bad_words(state.token_ids, len(state.prompt_token_ids))
                banned = words.union(banned)
            for token in banned:
                if token < vocab_size:
                    rows.append(i)
                    cols.append(token)
        if rows:
            md.banned_tokens = (tensor(rows, torch.int64), tensor(cols, torch.int64))
        biased = [(i, bias) for i, (s, p) in enumerate(zip(states, params)) if p.logit_bias
                  for bias in [s.logit_bias_tensors(vocab_size, device)] if len(bias[0])]
        if biased:
            md.logit_bias = (
                torch.cat([torch.full((len(cols),), i, dtype=torch.int64, device=device)
                           for i, (cols, _) in biased]),
                torch.cat([cols for _, (cols, _) in biased]),
                torch.cat([values for _, (_, values) in biased]))
        limited = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if limited:
            allowed = torch.zeros(len(limited), vocab_size, dtype=torch.bool, device=device)
            for row, i in enumerate(limited):
                allowed[row, states[i].allowed_ids_tensor(vocab_size, device)] = True
            md.allowed_tokens = (tensor(limited, torch.int64), allowed)
        if any(p.needs_penalties for p in params):
            md.repetition_penalties = tensor([p.repetition_penalty for p in params],
                                             torch.float32)
            md.frequency_penalties = tensor([p.frequency_penalty for p in params],
                                            torch.float32)
            md.presence_penalties = tensor([p.presence_penalty for p in params], torch.float32)
            md.prompt_token_ids = _pad([s.prompt_token_ids for s in states], vocab_size, device)
            md.output_token_ids = _pad([s.token_ids[len(s.prompt_token_ids):] for s in states],
                                       vocab_size, device)
        return md

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[str, int, int, int]],
                         output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, predicted at positions 0..P-2."""
        for req_id, first_row, first_pos, n in rows:
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            lists: list[LogprobsLists] = []
            # In chunks: float32 logits and their log-softmax of a whole prompt chunk would
            # be 2 x rows x vocab floats at once (~10 GB for 8192 rows of a 152k vocabulary).
            for start in range(0, n, PROMPT_LOGPROBS_ROWS):
                rows_here = min(PROMPT_LOGPROBS_ROWS, n - start)
                row = first_row + start
                logits = self.model.compute_logits(hidden[row:row + rows_here])
                if not self.is_driver:
                    continue
                pos = first_pos + start + 1
                targets = torch.tensor(state.token_ids[pos:pos + rows_here], device=self.device)
                lp = gather_logprobs(logits.float().log_softmax(dim=-1), k, targets)
                ids, lps, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
                lists += [LogprobsLists(ids[i], lps[i], ranks[i]) for i in range(rows_here)]
            if self.is_driver:
                output.prompt_logprobs[req_id] = (first_pos, lists)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max([len(r) for r in rows] + [1])
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=device)
