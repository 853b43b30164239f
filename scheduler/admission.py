"""Admission: reject when the chosen pair's predicted TTFT or TBT exceeds the SLO.

Exceeding means strictly greater: a prediction equal to the SLO is admitted. A rejection
(HTTP 429) carries a machine-readable reason and a Retry-After in whole seconds (at least 1)
derived from predicted drain time:

* ``ttft_slo``: after ``ttft - slo`` seconds the prefill queue ahead has drained that much;
* ``tbt_slo``: when enough sequences on the decode instance are predicted to have finished for
  the TBT to fit (their predicted decode ends, soonest first);
* ``ttft_slo_unreachable`` / ``tbt_slo_unreachable``: even an empty queue / an idle decode
  instance would miss the SLO, so waiting alone cannot help; the Retry-After is then the time
  the chosen instance needs to drain completely (the answer is still a 429, as for any SLO miss).

Both violations are reported in the explanation; the reason names the first (TTFT).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from predictors.base import DecodeState, Predictors
from predictors.telemetry import SLO
from scheduler.ledger import Reservation
from scheduler.types import OVER_SLO


@dataclass(slots=True)
class Verdict:
    reason: str
    message: str
    retry_after_s: float | None
    status: int = OVER_SLO


def resolve_slo(configured: SLO, override: SLO | None) -> SLO:
    """The request's SLO: each field of the override when given, else the configured one."""
    if override is None:
        return configured
    return SLO(ttft_s=override.ttft_s if override.ttft_s is not None else configured.ttft_s,
               tbt_s=override.tbt_s if override.tbt_s is not None else configured.tbt_s)


def scaled_slo(slo: SLO, fraction: float) -> SLO:
    """The SLO a priority class is admitted against: each bound times its headroom fraction."""
    if fraction == 1.0:
        return slo
    return SLO(ttft_s=None if slo.ttft_s is None else slo.ttft_s * fraction,
               tbt_s=None if slo.tbt_s is None else slo.tbt_s * fraction)


def check_headroom(headroom: dict[str, float]) -> dict[str, float]:
    """Priority classes and their fractions of the SLO, each in (0, 1]; ValueError otherwise."""
    out = {}
    for cls, f in dict(headroom).items():
        if not isinstance(cls, str) or not cls or isinstance(f, bool) or not isinstance(f, (int, float)) \
                or not 0 < f <= 1:
            raise ValueError(f"priority_headroom: class {cls!r} needs a fraction of the SLO in (0, 1], got {f!r}")
        out[cls] = float(f)
    return out


def retry_seconds(seconds: float) -> float:
    """Whole seconds, at least one (HTTP Retry-After granularity)."""
    return float(max(1, math.ceil(seconds - 1e-9)))


def check_ttft(ttft_s: float, queue_s: float, slo_s: float | None, floor_s: float | None = None) -> Verdict | None:
    """``floor_s``: the best TTFT any candidate would give with its queue drained (default: the
    chosen one's); only when even that misses is the SLO unreachable."""
    if slo_s is None or ttft_s <= slo_s:
        return None
    floor = ttft_s - queue_s if floor_s is None else floor_s
    if floor > slo_s:
        return Verdict("ttft_slo_unreachable",
                       f"predicted TTFT {ttft_s:.3f}s exceeds the {slo_s:.3f}s SLO even with no queue "
                       f"({floor:.3f}s)", retry_seconds(queue_s))
    return Verdict("ttft_slo", f"predicted TTFT {ttft_s:.3f}s exceeds the {slo_s:.3f}s SLO; "
                               f"{queue_s:.3f}s of prefill is queued ahead", retry_seconds(ttft_s - slo_s))


def check_tbt(tbt_s: float, slo_s: float | None, state: DecodeState, departures: list[Reservation],
              prompt_tokens: int, max_tokens: int, predictors: Predictors, now: float) -> Verdict | None:
    if slo_s is None or tbt_s <= slo_s:
        return None
    idle = predictors.tbt.tbt(DecodeState(state.instance), prompt_tokens, max_tokens)
    if idle > slo_s:
        drained = max((r.decode_end_s - now for r in departures), default=0.0)
        return Verdict("tbt_slo_unreachable", f"predicted TBT {tbt_s * 1e3:.1f}ms exceeds the "
                       f"{slo_s * 1e3:.1f}ms SLO even on an idle instance ({idle * 1e3:.1f}ms)",
                       retry_seconds(drained))
    running, kv, wait = state.running, state.kv_tokens, None
    for r in departures:  # soonest predicted end first
        running, kv = max(0, running - 1), max(0, kv - r.kv_tokens)
        if predictors.tbt.tbt(state._replace(running=running, kv_tokens=kv), prompt_tokens, max_tokens) <= slo_s:
            wait = r.decode_end_s - now
            break
    if wait is None:  # our departures are not enough (load we did not place): the last one we know
        wait = max((r.decode_end_s - now for r in departures), default=1.0)
    return Verdict("tbt_slo", f"predicted TBT {tbt_s * 1e3:.1f}ms exceeds the {slo_s * 1e3:.1f}ms SLO on "
                              f"{state.instance} ({state.running} running)", retry_seconds(wait))
