"""The one interface every policy implements, and the small helpers they share.

A policy picks a prefill instance, then (unless that instance is ``both`` and decodes the
request itself) a decode instance, from raw candidate facts; it is told when a placement is
made so stateful policies (round robin, routing history) advance only on real placements.
Each choice carries the policy's own score per candidate and a one-line reason.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence, TypeVar

from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate, Terms

T = TypeVar("T")


@dataclass(slots=True)
class PrefillChoice:
    candidate: PrefillCandidate
    terms: Terms  # how the request will be served there
    scores: dict[str, float]  # the policy's score per candidate id (see Policy.score_name)
    why: str
    rows: dict[str, Terms] | None = None  # per-candidate terms when not the engine-default ones
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeChoice:
    candidate: DecodeCandidate
    scores: dict[str, float]
    why: str


class Policy(ABC):
    """Base class: parameters with defaults, validated at construction."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""  # where the rule comes from
    score_name: ClassVar[str] = "score"  # what ``scores`` hold (lower wins unless said)
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **params: Any):
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ValueError(f"policy {self.name!r} has no parameter(s) {sorted(unknown)}; "
                             f"known: {sorted(self.defaults) or 'none'}")
        self.params = {**self.defaults, **params}

    @abstractmethod
    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        """The prefill instance (with the terms of how it serves) and every candidate's score."""

    @abstractmethod
    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        """The decode instance for a request whose prefill runs on ``prefill``."""

    def placed(self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
        """A placement was made (not called for rejections). ``chose_decode`` is False when a
        ``both`` prefill instance decodes the request itself and ``choose_decode`` was not asked."""


def argmin(items: Sequence[T], key: Callable[[T], Any], rng: random.Random | None = None) -> T:
    """The item with the smallest key; ties go to the first, or to a random one when ``rng`` is given."""
    best: list[T] = []
    best_key = None
    for it in items:
        k = key(it)
        if best_key is None or k < best_key:
            best, best_key = [it], k
        elif k == best_key:
            best.append(it)
    if rng is not None and len(best) > 1:
        return best[rng.randrange(len(best))]
    return best[0]


def softmax_pick(items: Sequence[T], costs: Sequence[float], temperature: float, rng: random.Random) -> T:
    """Dynamo's softmax sampling over costs normalised to [0, 1]: p ~ exp(-(c - min)/((max - min) T))."""
    lo, hi = min(costs), max(costs)
    if hi == lo or not math.isfinite(hi - lo):
        return items[rng.randrange(len(items))]
    weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    return rng.choices(list(items), weights=weights, k=1)[0]


def runner_up(scores: dict[str, float], winner: str) -> str:
    """" (next X 1.234)" for the reason line, or "" with a single candidate."""
    others = [(v, k) for k, v in scores.items() if k != winner]
    if not others:
        return ""
    v, k = min(others)
    return f" (next {k} {v:.4g})"
