"""Future value for ``conductor`` (a departure from Algorithm 1, off unless ``future_weight`` is set).

Where a request whose prefix no instance holds is placed decides where its conversation lives: its
follow-ups will hit that instance's cache and go there. Algorithm 1 chooses on this request's TTFT
alone. This rule adds, for such a *new* request only, ``future_weight`` x each candidate's
follow-up load (scheduler/follow_up.py: the decayed prefill seconds of requests placed there
because it held their prefix), so a new conversation avoids the instance whose own conversations'
follow-ups are about to queue there. A request is new when the prefix only some instances hold
(the longest anywhere, in flight included, minus what every candidate or the store already has:
a system prompt shared by all binds nobody) is at most ``share`` of its prompt; a placement is
bound when its instance holds more than that share beyond the common prefix. Measured in
docs/experiments/future-value.md.
"""
from __future__ import annotations

from scheduler.cost import DecisionContext, PrefillCandidate
from scheduler.follow_up import FollowUpLoad


def held_blocks(ctx: DecisionContext) -> tuple[dict[str, int], int]:
    """Per candidate the prefix it holds (KV events or in flight), and the prefix every candidate
    (or the shared store) holds: the part no placement choice can gain or lose."""
    pending = ctx.pending
    held = {c.id: max(c.local_blocks, pending.get(c.id, 0)) for c in ctx.prefill}
    common = min(held.values(), default=0)
    return held, max(common, min(ctx.store_blocks, ctx.usable_blocks))


def is_new(ctx: DecisionContext, share: float) -> bool:
    """The request's affinity-bearing prefix (held by some instances only) is at most ``share``
    of its prompt: where it goes decides where its conversation lives."""
    held, common = held_blocks(ctx)
    best = max(held.values(), default=0)
    return (best - common) * ctx.block_size <= share * ctx.prompt_tokens


def bound_to(ctx: DecisionContext, instance: str, share: float) -> bool:
    """``instance`` holds more than ``share`` of the prompt beyond the common prefix: the request
    went there (or should have) because of its prefix, as a conversation's follow-up does."""
    held, common = held_blocks(ctx)
    return (held.get(instance, 0) - common) * ctx.block_size > share * ctx.prompt_tokens


def add_future(ctx: DecisionContext, scores: dict[str, float], load: FollowUpLoad, weight: float
               ) -> dict[str, float]:
    """Add ``weight`` x the follow-up load to every candidate's score (in place); the loads added."""
    now = ctx.now
    added = {}
    for c in ctx.prefill:
        v = load.value(c.id, now)
        if v:
            added[c.id] = v
            scores[c.id] += weight * v
    return added


def why_future(winner: PrefillCandidate, scores: dict[str, float], added: dict[str, float], weight: float
               ) -> str | None:
    """The reason line when the follow-up term changed the choice (the lowest score without it is
    another candidate's), else None."""
    base = {k: s - weight * added.get(k, 0.0) for k, s in scores.items()}
    lo = min(base, key=lambda k: (base[k], k))
    if base[winner.id] <= base[lo]:
        return None
    return (f"lowest predicted TTFT + {weight:g} x follow-up load {scores[winner.id]:.4g}s (new prefix; "
            f"follow-up load {added.get(winner.id, 0.0):.3g}s here vs {added.get(lo, 0.0):.3g}s on {lo}, "
            f"lowest without it at {base[lo]:.4g}s vs {base[winner.id]:.4g}s)")
