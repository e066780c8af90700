"""KVCacheManager: which blocks each request holds; prefix-cache lookup and registration."""
from __future__ import annotations

from vllm.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from vllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block lists on top of a BlockPool.

    Scheduling a request: `get_computed_blocks` (prefix hit, always leaving >= 1 token to
    compute so there are logits to sample from), then `allocate_slots` for the tokens of this
    step. After the step ran, `cache_blocks` registers the blocks that became full, so a block
    is only found by others once its KV has been written.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: the content id standing for each registered full block (chain parents).
        self._req_content_ids: dict[str, list[int]] = {}
        # Counted by the scheduler once per admitted request (not per lookup attempt).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- prefix cache -------------------------------------------------------------------
    def _block_hash(self, request: Request, index: int) -> int:
        """The chained hash of the request's full block `index` (memoised on the request;
        full blocks never change, so it survives preemption)."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[i - 1] if i else None, tokens))
        return hashes[index]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in full blocks, and its token count. At
        least one token is always left to compute."""
        if (not self.enable_caching or request.num_computed_tokens > 0
                or request.sampling_params.prompt_logprobs is not None):
            # Prompt logprobs need the logits of every prompt position.
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        blocks: list[KVCacheBlock] = []
        parent: int | None = None
        for i in range(max_blocks):
            tokens = request.all_token_ids[i * bs:(i + 1) * bs]
            block = self.block_pool.find_cached_block(self._block_hash(request, i), tokens,
                                                      parent)
            if block is None:
                break
            blocks.append(block)
            parent = block.content_id
        return blocks, len(blocks) * bs

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus the prefix
        hit `new_computed_blocks`). Returns the newly allocated blocks, or None (nothing
        changed) when the pool is too small right now."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = (cdiv(num_computed + num_new_tokens, self.block_size)
                      - len(blocks) - len(new_computed_blocks))
        # Hits on free cached blocks leave the free queue when touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.block_pool.num_free_blocks - num_revived:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        content_ids = self._req_content_ids.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            content_ids.extend(b.content_id for b in new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        content_ids = self._req_content_ids.setdefault(request.request_id, [])
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        for i in range(len(content_ids), num_full):
            parent = content_ids[i - 1] if i else None
            tokens = request.all_token_ids[i * bs:(i + 1) * bs]
            content_id = self.block_pool.cache_full_block(
                blocks[i], self._block_hash(request, i), tokens, parent)
            if content_id is None:
                return
            content_ids.append(content_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first into the LRU queue, so a shared
        prefix outlives the request-specific suffix."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._req_content_ids.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
