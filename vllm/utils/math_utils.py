"""Integer helpers for sizes and block counts (upstream's `vllm.utils.math_utils`)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0)."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= x."""
    return cdiv(x, multiple) * multiple


def round_down(x: int, multiple: int) -> int:
    """The largest multiple of `multiple` that is <= x."""
    return (x // multiple) * multiple


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
