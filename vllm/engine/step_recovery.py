"""A failed step fails the requests that caused it; the engine goes on serving the others.

When `executor.execute_model` raises, the scheduler is as it was before the step (its update
never ran: each request keeps its blocks, its tokens and its computed count) and the model
runner is part-way through its update. `StepRecovery.after_failed_execute` then:

1. re-raises a fatal error (`vllm.engine.errors.is_fatal`: a worker died or hung, a collective
   or the device failed): the engine is dead;
2. runs the executor's health check (a forward, logits and sampling over dummy inputs on every
   rank); if that fails too, the engine is dead (`EngineFatalError`);
3. finds the culprits: with one request in the step, it is the culprit; with more, each
   scheduled sequence runs its part of the step again alone (same tokens, its own KV blocks,
   a copy of its RNG) and the requests whose run raises are the culprits. When none raises
   alone (the batch as a whole failed) every request of the step fails, and
   `max_unattributed_failures` such steps in a row (no successful step between) mean the
   engine is dead; failures out of memory count towards that limit even when a request is
   to blame (memory that runs out again and again is the engine's problem);
4. resynchronises the runner: it forgets every sequence of the step and relearns the
   survivors from the scheduler, so the next step retries them exactly as scheduled;
5. finishes the culprits: out of the output processor and the scheduler (their blocks freed,
   the runner told to drop them); their last RequestOutput has finish_reason "error" on the
   sequences that were still running, and `pop_errors()` names the exception of each.

A failure after the model ran (updating the scheduler, detokenizing) cannot be retried, the
scheduler being part-way through its update: `after_failed_update` fails all the step's
requests (counted as unattributed).

Known limit: a seeded request that survives may draw different random numbers than it would
have, when the failed step had already advanced its generator.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.engine.errors import EngineFatalError, is_fatal
from vllm.engine.request import RequestStatus
from vllm.engine.sched_output import NewRequestData, SchedulerOutput
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.engine.llm_engine import LLMEngine
    from vllm.engine.request import Request
    from vllm.outputs import RequestOutput

logger = init_logger(__name__)

__all__ = ["StepRecovery"]

MAX_UNATTRIBUTED_FAILURES = 3
"""Failed steps in a row that no request could be blamed for (or that ran out of memory)
before the engine is dead."""


class StepRecovery:
    """Failure handling for one `LLMEngine` (see the module docstring)."""

    def __init__(self, engine: LLMEngine,
                 max_unattributed_failures: int = MAX_UNATTRIBUTED_FAILURES) -> None:
        self.engine = engine
        self.max_unattributed_failures = max_unattributed_failures
        self.num_unattributed_in_a_row = 0
        self.num_failed_steps = 0
        self._errors: dict[str, BaseException] = {}

    # ---- the engine's hooks -------------------------------------------------------------
    def on_success(self) -> None:
        self.num_unattributed_in_a_row = 0

    def pop_errors(self) -> dict[str, BaseException]:
        """request id -> the exception that failed it, for the requests failed since the last
        call (their final RequestOutput was returned by the step that failed them)."""
        errors, self._errors = self._errors, {}
        return errors

    def after_failed_execute(self, so: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Recover from `execute_model(so)` raising `exc`; returns the failed requests' final
        outputs. Raises EngineFatalError (or `exc` itself when fatal) if the engine is dead."""
        if is_fatal(exc):
            raise exc
        self.num_failed_steps += 1
        internal = list(so.num_scheduled_tokens)
        users = self._user_ids(internal)
        logger.error("An engine step failed (%d sequence(s) of %d request(s) scheduled): %r",
                     len(internal), len(set(users.values())), exc, exc_info=exc)
        self._check_health(exc)
        probe_id = None
        if len(set(users.values())) == 1:
            culprits = {users[internal[0]]: exc} if internal else {}
        else:
            culprits, probe_id = self._run_alone(so, internal, users)
        attributed = bool(culprits)
        if not attributed:
            culprits = dict.fromkeys(users.values(), exc)
        self._resync(so, internal, users, culprits, probe_id)
        if not attributed or _out_of_memory(exc):
            self._count_unattributed(exc)
        return self._fail(culprits)

    def after_failed_update(self, so: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Recover from the scheduler update or the output processing of `so` raising: every
        request of the step fails."""
        if is_fatal(exc):
            raise exc
        self.num_failed_steps += 1
        users = self._user_ids(list(so.num_scheduled_tokens))
        logger.error("Processing the outputs of an engine step failed; failing its %d "
                     "request(s): %r", len(set(users.values())), exc, exc_info=exc)
        self._count_unattributed(exc)
        return self._fail(dict.fromkeys(users.values(), exc))

    # ---- steps ----------------------------------------------------------------------------
    def _user_ids(self, internal_ids: list[str]) -> dict[str, str]:
        """internal (per-sequence) id -> the user request id it belongs to."""
        seqs = self.engine.output_processor._seq_to_request
        users = {}
        for iid in internal_ids:
            entry = seqs.get(iid)
            users[iid] = entry[0].request_id if entry is not None else iid
        return users

    def _check_health(self, cause: Exception) -> None:
        check = getattr(self.engine.executor, "check_health", None)
        if check is None:
            return
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any failure here means a broken engine
            raise EngineFatalError(f"an engine step failed ({cause!r}) and the engine then "
                                   f"failed its health check ({exc!r})") from exc

    def _count_unattributed(self, cause: Exception) -> None:
        self.num_unattributed_in_a_row += 1
        if self.num_unattributed_in_a_row >= self.max_unattributed_failures:
            raise EngineFatalError(
                f"{self.num_unattributed_in_a_row} engine steps in a row failed without a "
                f"request to blame or out of memory; the last with {cause!r}") from cause

    def _run_alone(self, so: SchedulerOutput, internal: list[str], users: dict[str, str]
                   ) -> tuple[dict[str, BaseException], str | None]:
        """Run each scheduled sequence's part of the step alone; the user requests of those
        that raise, with their exception (and the runner id of the last probe, to forget)."""
        scheduler = self.engine.scheduler
        culprits: dict[str, BaseException] = {}
        previous: str | None = None
        for iid in internal:
            if users[iid] in culprits or iid not in scheduler.requests:
                continue
            request = scheduler.requests[iid]
            probe_id = _unused_id(f"\0probe-{iid}", scheduler.requests)
            data = self._new_request_data(iid, request, probe_id, copy_generator=True)
            n = so.num_scheduled_tokens[iid]
            probe = SchedulerOutput(
                scheduled_new_reqs=[data], scheduled_cached_reqs=[],
                num_scheduled_tokens={probe_id: n}, total_num_scheduled_tokens=n,
                finished_req_ids={previous} if previous is not None else set())
            previous = probe_id
            try:
                self.engine.executor.execute_model(probe)
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                if is_fatal(exc):
                    raise
                culprits[users[iid]] = exc
                logger.error("Request %s fails on its own: %r", users[iid], exc)
        return culprits, previous

    def _resync(self, so: SchedulerOutput, internal: list[str], users: dict[str, str],
                culprits: dict[str, BaseException], probe_id: str | None) -> None:
        """Make the runner forget the step's sequences and relearn the survivors."""
        scheduler = self.engine.scheduler
        survivors = [iid for iid in internal
                     if users[iid] not in culprits and iid in scheduler.requests]
        forget = set(internal) | set(so.finished_req_ids)
        if probe_id is not None:
            forget.add(probe_id)
        message = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(iid, scheduler.requests[iid])
                                for iid in survivors],
            scheduled_cached_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            finished_req_ids=forget)
        try:
            self.engine.executor.execute_model(message)
        except Exception as exc:  # noqa: BLE001
            raise EngineFatalError(f"could not resynchronise the model runner after a failed "
                                   f"step: {exc!r}") from exc

    def _new_request_data(self, iid: str, request: Request, runner_id: str | None = None,
                          copy_generator: bool = False) -> NewRequestData:
        """The runner's full view of a scheduled sequence, as the scheduler holds it."""
        generator = request.generator
        if copy_generator and generator is not None:
            generator = torch.Generator(device=generator.device)
            generator.set_state(request.generator.get_state())
        return NewRequestData(
            req_id=runner_id or iid, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.all_token_ids), sampling_params=request.sampling_params,
            generator=generator,
            block_ids=self.engine.scheduler.kv_cache_manager.get_block_ids(iid),
            num_computed_tokens=request.num_computed_tokens)

    def _fail(self, culprits: dict[str, BaseException]) -> list[RequestOutput]:
        """Finish the culprit requests everywhere; their final outputs (finish_reason
        "error" on the sequences that were still running)."""
        engine = self.engine
        outputs = []
        for request_id, exc in culprits.items():
            state = engine.output_processor.requests.get(request_id)
            internal = engine.output_processor.abort_requests([request_id])
            if state is None:  # not a user request: a lone sequence
                internal = [request_id]
            engine.scheduler.finish_requests(internal, RequestStatus.FINISHED_ABORTED)
            self._errors[request_id] = exc
            if state is None:
                continue
            for seq in state.sequences:
                if seq.finish_reason is None:
                    seq.finish_reason = "error"
            output = state.make_output()
            if output is not None:
                outputs.append(output)
        if culprits:
            logger.warning("Failed request(s) %s; the engine goes on serving the others",
                           ", ".join(culprits))
        return outputs


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError))


def _unused_id(candidate: str, taken: Any) -> str:
    while candidate in taken:
        candidate += "'"
    return candidate
