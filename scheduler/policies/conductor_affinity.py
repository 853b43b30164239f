"""Near-tie affinity for ``conductor`` (a departure from Algorithm 1, off unless its margins are set).

Greedy cost picks one instance among several whose predicted costs differ by less than the
predictors can tell apart; when the runner-up already holds this request's prefix and the winner
does not, the choice spends a cache hit the conversation's next turn would have found. Within a
small margin of the lowest cost the holder of the longest prefix wins instead. Measured in
docs/experiments/goodput-curves.md.
"""
from __future__ import annotations

from scheduler.cost import DecisionContext, PrefillCandidate, Terms

# the holder may use at most this share of the SLO slack the lowest-cost candidate leaves (the
# decode side's shipment and first step come on top of both, and must still fit)
SLACK_SHARE = 0.5


def near_tie_holder(ctx: DecisionContext, best: PrefillCandidate, scores: dict[str, float], rows: dict[str, Terms],
                    kv_est: dict[str, float], margin_s: float, margin_rel: float
                    ) -> tuple[PrefillCandidate, str] | None:
    """The candidate holding a longer prefix than ``best`` (on its device/host, or in flight
    there) whose score is within max(margin_s, margin_rel x best's) of ``best``'s, and the reason
    it won; None when ``best`` stands. The longest such prefix wins, then the lower score."""
    lo = scores[best.id]
    margin = max(margin_s, margin_rel * lo)
    best_hit = rows[best.id].local_hit_tokens
    slo = ctx.slo.ttft_s
    limit = None
    if slo is not None:
        slo *= ctx.admit_fraction
        best_ttft = best.ttft(rows[best.id]) + kv_est.get(best.id, 0.0)
        if best_ttft <= slo:
            limit = best_ttft + SLACK_SHARE * (slo - best_ttft)
    pick: PrefillCandidate | None = None
    for c in ctx.prefill:
        t = rows[c.id]
        if c.id == best.id or t.local_hit_tokens <= best_hit or scores[c.id] > lo + margin:
            continue
        if limit is not None and c.ttft(t) + kv_est.get(c.id, 0.0) > limit:
            continue
        if pick is None or (t.local_hit_tokens, -scores[c.id]) > (rows[pick.id].local_hit_tokens, -scores[pick.id]):
            pick = c
    if pick is None:
        return None
    why = (f"holds the longest prefix ({rows[pick.id].local_hit_tokens} tokens; {best.id} {best_hit}) within "
           f"{margin:.3g}s of the lowest predicted TTFT: {scores[pick.id]:.4g}s against {best.id} {lo:.4g}s")
    return pick, why
