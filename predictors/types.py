"""The project's shared vocabulary: an instance's role and a KV cache tier.

One definition used by the scheduler, the predictors, the engine adapters, the simulated engine
and the gateway's configuration. Both are ``StrEnum``s, so they compare equal to the plain
strings that wire formats, configs and JSON records carry ("prefill", "store", ...).
"""
from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What an instance does: prefill only, decode only, or both (colocated, aggregated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


class Tier(StrEnum):
    """Where KV blocks live: an instance's device (GPU), its host memory, or the shared store."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"


ROLES: tuple[str, ...] = tuple(r.value for r in Role)
TIERS: tuple[str, ...] = tuple(t.value for t in Tier)


def parse_role(value: object) -> Role:
    """``Role`` from its name; ValueError naming the choices otherwise."""
    if isinstance(value, str):
        try:
            return Role(value)
        except ValueError:
            pass
    raise ValueError(f"role must be one of {', '.join(ROLES)}, got {value!r}")
