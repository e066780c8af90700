"""Scheduler: token budget, chunked prefill, mixed batches, recompute preemption, FCFS."""
from __future__ import annotations

from vllm.config.cache import CacheConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.engine.request import Request, RequestStatus
from vllm.engine.sched_output import ModelRunnerOutput
from vllm.engine.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def make_scheduler(budget=16, max_seqs=8, max_len=64, num_blocks=64, block_size=4,
                   chunked=True, caching=True, threshold=0) -> Scheduler:
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                         max_model_len=max_len, enable_chunked_prefill=chunked,
                         long_prefill_token_threshold=threshold)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    return Scheduler(sc, cc, num_blocks)


def add(sched: Scheduler, req_id: str, num_prompt: int, max_tokens=4, start=1, **params):
    sp = SamplingParams(max_tokens=max_tokens, **params)
    req = Request(req_id, list(range(start, start + num_prompt)), sp, max_tokens=max_tokens)
    sched.add_request(req)
    return req


def step(sched: Scheduler, token: int = 7):
    """One step with a fake runner that samples `token` for every request that caught up."""
    out = sched.schedule()
    sampled = {}
    for req_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[req_id] = token
    results = sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                              sampled))
    return out, results


def run_all(sched: Scheduler, max_steps=500):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched))
    raise AssertionError("requests did not finish")


def test_budget_and_max_num_seqs_respected():
    sched = make_scheduler(budget=16, max_seqs=3)
    for i in range(6):
        add(sched, f"r{i}", 5 + i, max_tokens=6, start=100 * i)
    for out, _ in run_all(sched):
        assert out.total_num_scheduled_tokens <= 16
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= 3
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_chunked_prefill_then_decode():
    sched = make_scheduler(budget=16)
    req = add(sched, "a", 40, max_tokens=3)
    chunks = [step(sched)[0].num_scheduled_tokens["a"] for _ in range(5)]
    assert chunks == [16, 16, 8, 1, 1]
    assert req.output_token_ids == [7, 7, 7] and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_long_prefill_threshold_caps_chunk():
    sched = make_scheduler(budget=16, threshold=6)
    add(sched, "a", 20)
    assert step(sched)[0].num_scheduled_tokens == {"a": 6}


def test_mixed_prefill_and_decode_in_one_step():
    sched = make_scheduler(budget=16)
    add(sched, "a", 6, max_tokens=10)
    step(sched)  # a's prefill
    add(sched, "b", 30, start=50)
    out, _ = step(sched)
    # Decodes first, then the new prompt gets what is left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]


def test_fcfs_without_chunking_blocks_later_requests():
    sched = make_scheduler(budget=16, max_len=16, chunked=False)
    add(sched, "a", 10)
    add(sched, "b", 10, start=20)  # does not fit next to a's 10 tokens
    add(sched, "c", 2, start=40)  # would fit, but must not overtake b
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a"]
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]


def test_preemption_under_tiny_pool_recomputes_newest():
    # 8 usable blocks of 4 tokens; three requests each growing to 16 tokens (4 blocks).
    sched = make_scheduler(budget=64, num_blocks=9, max_len=32)
    start = sched.kv_cache_manager.num_free_blocks
    reqs = [add(sched, f"r{i}", 8, max_tokens=8, start=10 * i + 1) for i in range(3)]
    preempted_seen = []
    for out, _ in run_all(sched):
        preempted_seen.extend(out.preempted_req_ids)
        assert not set(out.preempted_req_ids) & set(out.num_scheduled_tokens)
    assert sched.num_preemptions > 0
    # The newest running request is the victim.
    assert preempted_seen[0] == "r2"
    for req in reqs:
        assert req.output_token_ids == [7] * 8
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv_cache_manager.num_free_blocks == start
    sched.kv_cache_manager.block_pool.check_invariants()


def test_preempted_request_resumes_with_outputs_as_prompt():
    sched = make_scheduler(budget=64, num_blocks=9, max_len=32)
    reqs = [add(sched, f"r{i}", 8, max_tokens=8, start=10 * i + 1) for i in range(3)]
    resumed = None
    for _ in range(100):
        out, _ = step(sched)
        for new in out.scheduled_new_reqs:
            req = reqs[int(new.req_id[1:])]
            if req.num_preemptions:
                resumed = new
                # Prompt + outputs so far (the step then appended one more sampled token).
                assert new.token_ids == req.all_token_ids[:len(new.token_ids)]
                assert new.prompt_token_ids == req.prompt_token_ids
        if resumed or not sched.has_unfinished_requests():
            break
    assert resumed is not None and len(resumed.token_ids) > 8


def test_abort_frees_blocks():
    sched = make_scheduler()
    start = sched.kv_cache_manager.num_free_blocks
    add(sched, "a", 10, max_tokens=20)
    add(sched, "b", 10, max_tokens=20, start=30)
    step(sched)
    step(sched)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == start
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_abort_waiting_request():
    sched = make_scheduler(max_seqs=1)
    add(sched, "a", 4)
    add(sched, "b", 4)
    step(sched)
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == []


def test_prefix_hit_in_scheduler():
    sched = make_scheduler()
    add(sched, "a", 9, max_tokens=1)
    run_all(sched)
    add(sched, "b", 9, max_tokens=1)
    out, results = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 1}
    assert results[0].num_cached_tokens == 8
    assert sched.stats()["prefix_cache_hits"] == 8


def test_stop_conditions():
    sched = make_scheduler()
    eos = add(sched, "eos", 4, max_tokens=5)
    eos.sampling_params.update_from_eos({7})
    add(sched, "stop", 4, max_tokens=5, start=10, stop_token_ids=[7])
    min_tok = add(sched, "min", 4, max_tokens=5, start=20, min_tokens=3, stop_token_ids=[7])
    ignore = add(sched, "ignore", 4, max_tokens=2, start=30, ignore_eos=True)
    ignore.sampling_params.update_from_eos({7})
    _, results = step(sched)
    by_id = {r.request_id: r for r in results}
    assert by_id["eos"].finish_reason == "stop" and by_id["eos"].stop_reason is None
    assert by_id["stop"].finish_reason == "stop" and by_id["stop"].stop_reason == 7
    assert by_id["min"].finish_reason is None and by_id["ignore"].finish_reason is None
    run_all(sched)
    assert min_tok.num_output_tokens == 3 and min_tok.stop_reason == 7
    assert ignore.num_output_tokens == 2
    assert ignore.get_finished_reason() == "length"


def test_max_model_len_caps_output():
    sched = make_scheduler(max_len=12)
    req = add(sched, "a", 10, max_tokens=100)
    run_all(sched)
    assert req.num_tokens == 12 and req.get_finished_reason() == "length"
