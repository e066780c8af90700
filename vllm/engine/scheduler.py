"""Scheduler: continuous batching under a per-step token budget.

Every step, each request's `num_computed_tokens` catches up with its `num_tokens`: a prefill is
simply a request that is many tokens behind (chunked when the budget is short), a decode one
that is one token behind. Order: running requests first (oldest first), then waiting ones in
arrival order (FCFS: a waiting request that does not fit blocks the ones behind it). When the
KV pool runs dry the newest running request is preempted by recompute: its blocks are freed and
it goes back to the front of the waiting queue, keeping its outputs.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from vllm.config.cache import CacheConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.engine.kv_cache_manager import KVCacheManager
from vllm.engine.request import Request, RequestStatus
from vllm.engine.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int) -> None:
        sc = scheduler_config
        if sc.max_num_batched_tokens is None or sc.max_num_seqs is None or \
                sc.max_model_len is None:
            raise ValueError("SchedulerConfig must be resolved (max_num_batched_tokens, "
                             "max_num_seqs, max_model_len) before building a Scheduler")
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs
        self.max_model_len = sc.max_model_len
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner must forget at the next step (finished, aborted, preempted).
        self._dropped_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._dropped_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- scheduling ---------------------------------------------------------------------
    def _chunk(self, request: Request, num_new_tokens: int, budget: int) -> int:
        if self.long_prefill_token_threshold and num_new_tokens > 1:
            num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
        return min(num_new_tokens, budget)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._dropped_req_ids.add(request.request_id)
        self._preempted_req_ids.add(request.request_id)
        logger.debug("Preempted %s (recompute): KV cache full", request.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_now = False

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens,
                                  budget)
            if num_new <= 0:
                index += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            cached_reqs.append(CachedRequestData(
                request.request_id, [b.block_id for b in new_blocks],
                request.num_computed_tokens,
                request.all_token_ids[request.num_runner_tokens:]))
            request.num_runner_tokens = request.num_tokens
            budget -= num_new
            index += 1

        # 2. Waiting requests in arrival order (none after a preemption: the pool is full).
        while (self.waiting and budget > 0 and not preempted_now
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._chunk(request, num_new, budget)
            if kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                if kv.enable_caching and request.sampling_params.prompt_logprobs is None:
                    kv.prefix_cache_queries += request.num_tokens
                    kv.prefix_cache_hits += num_hit
            request.num_computed_tokens = num_hit
            request.num_runner_tokens = request.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                token_ids=list(request.all_token_ids), sampling_params=request.sampling_params,
                generator=request.generator, block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit))
            budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._dropped_req_ids, preempted_req_ids=self._preempted_req_ids)
        self._dropped_req_ids, self._preempted_req_ids = set(), set()
        return output

    # ---- results ------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the scheduled requests, append sampled tokens, check stop conditions,
        register newly full blocks in the prefix cache, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            request.num_computed_tokens += num_tokens
            new_token_ids: list[int] = []
            token = runner_output.sampled_token_ids.get(req_id)
            if token is not None:
                request.append_output_token_ids(token)
                new_token_ids.append(token)
                self._check_stop(request)
            self.kv_cache_manager.cache_blocks(request)
            prompt_logprobs = self._new_prompt_logprobs(request, runner_output)
            if new_token_ids or prompt_logprobs or request.is_finished():
                logprobs = runner_output.logprobs.get(req_id)
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=new_token_ids,
                    new_logprobs=[logprobs] if logprobs is not None and new_token_ids else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0)))
            if request.is_finished():
                self.running.remove(request)
                self._free_request(request)
        return outputs

    @staticmethod
    def _new_prompt_logprobs(request: Request, runner_output: ModelRunnerOutput):
        entry = runner_output.prompt_logprobs.get(request.request_id)
        if entry is None:
            return None
        start, chunk = entry
        # After a preemption the prompt is recomputed: skip positions already delivered.
        done = request.num_prompt_logprobs_done
        request.num_prompt_logprobs_done = max(done, start + len(chunk))
        chunk = chunk[max(done - start, 0):]
        return chunk or None

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if last in params.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    # ---- observability ------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_usable_blocks,
            "kv_cache_usage": kv.get_usage(),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
        }
