"""Default CUDA-graph capture sizes (the batch sizes graphs are captured for)."""
from __future__ import annotations

DEFAULT_MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then every 8 up to 248 (255), then every 16 from 256, all <= max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 255) + 1, 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def resolve_capture_sizes(user_sizes: list[int] | None, user_max: int | None, max_num_seqs: int,
                          max_num_batched_tokens: int) -> tuple[list[int], int, str]:
    """(sizes, max size, reason). User values win; inconsistent ones are an error."""
    if user_sizes is not None:
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
    if user_max is not None:
        max_size = min(user_max, max_num_batched_tokens)
        reason = f"max_cudagraph_capture_size={user_max}"
    else:
        max_size = min(max_num_seqs * 2, DEFAULT_MAX_CAPTURE_SIZE, max_num_batched_tokens)
        reason = (f"min(2 x max_num_seqs={2 * max_num_seqs}, {DEFAULT_MAX_CAPTURE_SIZE}, "
                  f"max_num_batched_tokens={max_num_batched_tokens})")
    if max_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {max_size}")
    sizes = default_capture_sizes(max_size)
    for extra in (max_num_seqs, max_num_batched_tokens):
        if extra <= max_size and extra not in sizes:
            sizes.append(extra)
    sizes.sort()
    if user_max is not None and sizes[-1] != user_max:
        reason = (f"max_cudagraph_capture_size={user_max} truncated to {sizes[-1]}, the largest "
                  "capture size not above it")
    return sizes, sizes[-1], reason
