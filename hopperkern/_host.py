"""Integer helpers for launchers on the host.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions whose host
calls check whether they run inside a kernel, a few microseconds each, and a launch computes several."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b, for ints, b > 0."""
    return -(-a // b) * b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
