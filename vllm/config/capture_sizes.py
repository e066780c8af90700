"""Default CUDA-graph capture sizes (the token counts graphs are captured for).

Two grids, merged: a token grid (1, 2, 4, every 8, then every 16) up to
min(2 x the widest decode batch, the platform's ceiling, the token budget), and the decode grid:
a uniform decode batch of r requests presents r x q tokens (q = 1 + speculative tokens), so the
request counts of the same grid (and max_num_seqs itself) times q are captured too, under the
same ceiling. A decode batch wider than the ceiling runs without a graph rather than raising it
(graph memory grows with the largest size).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_MAX_CAPTURE_SIZE = 512
"""The platform ceiling of the default capture sizes (1024 on Blackwell-class GPUs)."""


def default_max_capture_size(platform: Any = None) -> int:
    """The ceiling of the default capture sizes on `platform` (None: the current one): 1024 on
    Blackwell-class GPUs (compute capability 10.x), else DEFAULT_MAX_CAPTURE_SIZE."""
    if platform is None:
        from vllm.platforms import get_current_platform

        platform = get_current_platform()
    return 1024 if platform.is_device_capability_family(100) else DEFAULT_MAX_CAPTURE_SIZE


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then every 8 up to 248 (255), then every 16 from 256, all <= max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 255) + 1, 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def decode_tiers(max_num_seqs: int, num_speculative_tokens: int,
                 schedule: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int, int]]:
    """(first, last request count, query length) of each stretch of uniform decode batches.
    Without a schedule one stretch, 1..max_num_seqs, at 1 + num_speculative_tokens. A dynamic
    schedule [(first, last, draft tokens), ...] gives each stretch its own width (at most
    num_speculative_tokens); a count no entry covers takes the width of the entry before it."""
    if not schedule:
        return [(1, max_num_seqs, 1 + num_speculative_tokens)]
    entries = sorted((int(lo), int(width)) for lo, _hi, width in schedule)
    tiers = []
    for i, (lo, width) in enumerate(entries):
        start = 1 if i == 0 else lo
        end = entries[i + 1][0] - 1 if i + 1 < len(entries) else max_num_seqs
        end = min(end, max_num_seqs)
        if start <= end:
            tiers.append((start, end, 1 + min(width, num_speculative_tokens)))
    return tiers


def resolve_capture_sizes(user_sizes: list[int] | None, user_max: int | None, max_num_seqs: int,
                          max_num_batched_tokens: int, num_speculative_tokens: int = 0,
                          schedule: Sequence[Sequence[int]] | None = None,
                          ceiling: int = DEFAULT_MAX_CAPTURE_SIZE,
                          ) -> tuple[list[int], int, str]:
    """(sizes, max size, reason). User values win; inconsistent ones are an error."""
    if user_sizes is not None:
        if not user_sizes:
            raise ValueError(
                "cudagraph_capture_sizes=[] captures nothing while cudagraph_mode captures CUDA "
                "graphs; give at least one size, or set cudagraph_mode=NONE")
        sizes = sorted({s for s in user_sizes if s <= max_num_batched_tokens})
        if not sizes:
            raise ValueError(
                f"cudagraph_capture_sizes={user_sizes}: every size exceeds max_num_batched_tokens "
                f"({max_num_batched_tokens}); give at least one size <= it")
        if user_max is not None and user_max != sizes[-1]:
            raise ValueError(
                f"customized max_cudagraph_capture_size(={user_max}) should be consistent with "
                f"the max value of cudagraph_capture_sizes(={sizes[-1]})")
        return sizes, sizes[-1], "the user's capture sizes"
    query_len = 1 + num_speculative_tokens
    if user_max is not None:
        max_size = min(user_max, max_num_batched_tokens)
        reason = f"max_cudagraph_capture_size={user_max}"
    else:
        max_size = min(max_num_seqs * query_len * 2, ceiling, max_num_batched_tokens)
        widest = (f"max_num_seqs={max_num_seqs}" if query_len == 1 else
                  f"max_num_seqs={max_num_seqs} x query length {query_len}")
        reason = (f"min(2 x {widest}, {ceiling}, "
                  f"max_num_batched_tokens={max_num_batched_tokens})")
    if max_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {max_size}")
    sizes = set(default_capture_sizes(max_size))
    # Uniform decode batches: every request count of the grid (and the widest) times its
    # query length, under the same ceiling.
    limit = min(max_size if user_max is not None else ceiling, max_num_batched_tokens)
    for first, last, q in decode_tiers(max_num_seqs, num_speculative_tokens, schedule):
        widest_count = min(last, limit)
        if widest_count < first:
            continue
        counts = [c for c in default_capture_sizes(widest_count) if c >= first]
        counts.append(widest_count)
        sizes.update(c * q for c in counts if c * q <= limit)
    if max_num_batched_tokens <= max_size:
        sizes.add(max_num_batched_tokens)
    sizes = sorted(s for s in sizes if s <= max_size)
    if user_max is not None and sizes[-1] != user_max:
        reason = (f"max_cudagraph_capture_size={user_max} truncated to {sizes[-1]}, the largest "
                  "capture size not above it")
    return sizes, sizes[-1], reason
