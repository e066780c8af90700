"""BlockPool and KVCacheManager: ref counts, LRU reuse, chained hashes with a token check."""
from __future__ import annotations

import pytest

from vllm.engine import block_pool as block_pool_mod
from vllm.engine.block_pool import BlockPool
from vllm.engine.kv_cache_manager import KVCacheManager
from vllm.engine.request import Request
from vllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int], **params) -> Request:
    params.setdefault("max_tokens", 8)
    sp = SamplingParams(**params)
    return Request(req_id, tokens, sp, max_tokens=sp.max_tokens)


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit `req` as the scheduler would, pretend its prompt ran, register its full blocks."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return num_hit


def test_block_zero_reserved_and_ref_counts():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 and pool.num_usable_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3 and blocks[0].ref_cnt == 1
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(blocks[:1])
    with pytest.raises(ValueError, match="reserved"):
        pool.free_blocks([pool.null_block])
    pool.check_invariants()


def test_lru_order_of_reuse_for_cache_entries():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    for i, blk in enumerate((a, b, c, d)):
        pool.cache_full_block(blk, 100 + i, [i], None)
    pool.free_blocks([c, a, d, b])
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [c.block_id, a.block_id,
                                                                d.block_id, b.block_id]


def test_blocks_holding_nothing_are_reused_first_and_before_never_used_ones():
    pool = BlockPool(8)
    a, b, c = pool.get_new_blocks(3)  # blocks 1-3; 4-7 never handed out
    pool.cache_full_block(a, 7, [1, 2], None)
    pool.free_blocks([a, b, c])
    # b and c hold no cache entry: next out, the last freed first, then the never-used
    # blocks; the cache entry a stays until last
    got = [blk.block_id for blk in pool.get_new_blocks(6)]
    assert got == [c.block_id, b.block_id, 4, 5, 6, 7]
    assert pool.find_cached_block(7, [1, 2], None) is a
    pool.check_invariants()


def test_reset_puts_the_former_cache_entries_first():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, 50 + i, [i], None)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    # written blocks with nothing to keep now, in their old order, before blocks 4-7
    assert [blk.block_id for blk in pool.get_new_blocks(7)] == [1, 2, 3, 4, 5, 6, 7]
    pool.check_invariants()


def test_free_cached_block_is_revived_then_evicted_lru():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    cid = pool.cache_full_block(a, 123, [1, 2], None)
    assert cid is not None
    pool.free_blocks([a, b, c])
    # Still findable while free; touching revives it out of the free queue.
    assert pool.find_cached_block(123, [1, 2], None) is a
    pool.touch([a])
    assert pool.num_free_blocks == 2 and a.ref_cnt == 1
    pool.free_blocks([a])
    # a went to the LRU tail: b and c are reused first, then a loses its cache entry.
    got = pool.get_new_blocks(2)
    assert a not in got and pool.find_cached_block(123, [1, 2], None) is a
    pool.get_new_blocks(1)
    assert pool.find_cached_block(123, [1, 2], None) is None
    pool.check_invariants()


def test_prefix_hit_leaves_one_token_and_shares_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    first = make_request("a", list(range(1, 13)))  # exactly 3 full blocks
    assert run_prefill(kv, first) == 0
    same = make_request("b", list(range(1, 13)))
    blocks, num_hit = kv.get_computed_blocks(same)
    # The whole prompt is cached, but one token must be left to compute: 2 blocks, not 3.
    assert num_hit == 8 and len(blocks) == 2
    assert kv.allocate_slots(same, same.num_tokens - num_hit, blocks) is not None
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert blocks[0].ref_cnt == 2
    longer = make_request("c", list(range(1, 15)))
    blocks, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 12
    other = make_request("d", [99] + list(range(2, 13)))
    assert kv.get_computed_blocks(other) == ([], 0)


def test_free_count_returns_to_start_and_abort_frees():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    start = kv.num_free_blocks
    reqs = [make_request(str(i), list(range(i, i + 10))) for i in range(3)]
    for req in reqs:
        run_prefill(kv, req)
    assert kv.num_free_blocks == start - 9
    for req in reqs:
        kv.free(req)
    assert kv.num_free_blocks == start
    kv.block_pool.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    req = make_request("a", list(range(20)))
    assert kv.allocate_slots(req, 20) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("a") == []


@pytest.mark.parametrize("collide", [False, True])
def test_hash_collision_never_reuses_wrong_kv(monkeypatch, collide):
    if collide:
        # Every block hashes to the same value: only the token/parent check separates them.
        monkeypatch.setattr(block_pool_mod, "hash_block_tokens", lambda parent, tokens: 7)
        import vllm.engine.kv_cache_manager as kvm

        monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: 7)
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    run_prefill(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Different first block: no hit at all.
    assert kv.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))[1] == 0
    # Same second block after a different first block: the chain must not match it either.
    run_prefill(kv, make_request("c", [4, 3, 2, 1, 5, 6, 7, 8, 0]))
    probe = make_request("d", [4, 3, 2, 1, 5, 6, 7, 8, 1])
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 8
    assert [b.block_id for b in blocks] == kv.get_block_ids("c")[:2]
    probe_a = make_request("e", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    blocks, num_hit = kv.get_computed_blocks(probe_a)
    assert num_hit == 8 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]


def test_duplicate_content_keeps_chain():
    """Two requests computing the same prefix concurrently: the second's blocks stay
    unregistered, yet its later blocks chain onto the first's entries."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    for req in (a, b):
        kv.allocate_slots(req, req.num_tokens)
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req)
    probe = make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 8
    assert blocks[0].block_id == kv.get_block_ids("a")[0]
    assert blocks[1].block_id == kv.get_block_ids("b")[1]


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    run_prefill(kv, make_request("a", list(range(10))))
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_prompt_logprobs_skip_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_request("a", list(range(10))))
    assert kv.get_computed_blocks(make_request("b", list(range(10)), prompt_logprobs=1))[1] == 0
