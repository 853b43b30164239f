"""Least work within SLO headroom for ``conductor`` (a departure from Algorithm 1, off unless
``least_work_headroom`` is set).

Algorithm 1 minimises this request's predicted TTFT, so at light load it leaves the instance
holding the prefix for an idle one whenever the holder's queue is longer than the prefill the
prefix saves: the prefix is recomputed (or pulled), capacity is spent that later arrivals wait
for, and the conversation's next turn finds its context on neither instance. A request that meets
its SLO comfortably on several instances gains nothing from the fastest of them; among those
whose predicted TTFT is within ``headroom`` x its (remaining) TTFT SLO, the one adding the least
work (transfer + prefill there: the most reused, the least recomputed) wins instead, the lower
predicted TTFT breaking ties. Measured in docs/experiments/least-work.md.
"""
from __future__ import annotations

from scheduler.cost import DecisionContext, PrefillCandidate, Terms


def least_work_within_headroom(ctx: DecisionContext, best: PrefillCandidate, rows: dict[str, Terms],
                               kv_est: dict[str, float], headroom: float
                               ) -> tuple[PrefillCandidate, str] | None:
    """The candidate adding the least work among those whose predicted TTFT is within
    ``headroom`` x the TTFT SLO (the admitted share of it), and the reason it won; None when
    ``best`` stands: no TTFT SLO, no candidate within the headroom, or ``best`` itself adds the
    least work (it then wins for the reason it had)."""
    slo = ctx.slo.ttft_s
    if slo is None:
        return None
    limit = headroom * slo * ctx.admit_fraction
    pick: PrefillCandidate | None = None
    pick_key = (0.0, 0.0)
    for c in ctx.prefill:
        t = rows[c.id]
        ttft = c.ttft(t) + kv_est.get(c.id, 0.0)
        if ttft > limit:
            continue
        key = (t.transfer_s + t.prefill_s, ttft)
        if pick is None or key < pick_key:
            pick, pick_key = c, key
    if pick is None or pick.id == best.id:
        return None
    b = rows[best.id]
    best_ttft = best.ttft(b) + kv_est.get(best.id, 0.0)
    if pick_key[0] >= b.transfer_s + b.prefill_s and pick_key[1] >= best_ttft:
        return None  # no less work and no faster (a tie the argmin broke its own way)
    t = rows[pick.id]
    why = (f"least work within {headroom:g}x the TTFT SLO ({limit:.4g}s): {pick_key[0]:.4g}s of transfer + "
           f"prefill ({t.hit_tokens} tokens reused), predicted TTFT {pick_key[1]:.4g}s; lowest predicted TTFT "
           f"{best.id} {best_ttft:.4g}s with {b.transfer_s + b.prefill_s:.4g}s of work ({b.hit_tokens} reused)")
    return pick, why
