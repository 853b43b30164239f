"""Small helpers shared by the scheduler tests."""


class Clock:
    """A settable clock for the scheduler's injected ``clock()``."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids; different seeds give different blocks."""
    return [(seed * 7919 + k * 31) % 50_000 for k in range(n)]
