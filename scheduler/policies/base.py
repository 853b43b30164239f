"""The one interface every policy implements, and the small helpers they share.

A policy picks a prefill instance, then (unless that instance is ``both`` and decodes the
request itself) a decode instance, from raw candidate facts; it is told when a placement is
made so stateful policies (round robin, routing history) advance only on real placements.
Each choice carries the policy's own score per candidate and a one-line reason.
"""
from __future__ import annotations

import dataclasses
import math
import random
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence, TypeVar

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


@dataclass(frozen=True)
class NoParams:
    """A policy without parameters."""


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """``value`` as the field's declared type: native values pass type-checked, and strings
    (from ``--policy-param k=v``) are parsed. ValueError names the parameter."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            v = hint(value)
        except ValueError:
            raise ValueError(f"{name} must be {'an integer' if hint is int else 'a number'}, got {value!r}") from None
        if hint is int and isinstance(value, float) and v != value:
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return v
    return value  # str and other types: taken as given


def parse_params(cls: type, raw: dict[str, Any], policy: str) -> Any:
    """Build a policy's parameter dataclass from raw values (TOML natives or CLI strings)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"policy {policy!r} has no parameter(s) {sorted(unknown)}; known: {sorted(fields) or 'none'}")
    hints = typing.get_type_hints(cls)
    try:
        return cls(**{k: _coerce(k, hints[k], v) for k, v in raw.items()})
    except ValueError as e:
        raise ValueError(f"policy {policy!r}: {e}") from None


class Policy(ABC):
    """Base class: typed parameters (a frozen dataclass ``Params``), validated at construction."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""  # where the rule comes from
    score_name: ClassVar[str] = "score"  # what ``scores`` hold (lower wins unless said)
    Params: ClassVar[type] = NoParams
    # overload admission by cost (scheduler/overload.py) by default; ``cost_admission=on|off`` overrides
    cost_admission: ClassVar[bool] = False
    # the wait room's settings by default (``defer_*`` parameters, scheduler/deferral_params.py; empty:
    # no wait room unless ``defer=on``); the policy's own parameters override each
    wait_room: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def __init__(self, **params: Any):
        self.params = parse_params(self.Params, params, self.name)

    @classmethod
    def parameters(cls) -> dict[str, Any]:
        """Parameter names and their defaults (for --help and docs)."""
        return {f.name: f.default for f in dataclasses.fields(cls.Params)}

    @abstractmethod
    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        """The prefill instance (with the terms of how it serves) and every candidate's score."""

    @abstractmethod
    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        """The decode instance for a request whose prefill runs on ``prefill``."""

    @property
    def reads_inflight(self) -> bool:
        """Whether ``ctx.pending`` (prefixes placed but not yet announced) is used: the scheduler
        keeps that registry only for a policy that reads it."""
        return False

    def placed(  # noqa: B027 (an optional hook: a stateless policy ignores placements)
            self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
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


def argmin_scored(items: Sequence[T], scores: list[float], tie: Callable[[T], Any],
                  rng: random.Random | None = None) -> T:
    """``argmin(items, key=lambda x: (score of x, *tie(x)), rng)`` from the scores in item order:
    the lowest score is found in C (``min``, ``index``, ``count``: no key call and no tuple per
    candidate); only items sharing it go through ``tie``. A NaN among the scores takes the
    tuple path (its comparisons differ)."""
    total = sum(scores)
    if total != total:  # a NaN (or inf - inf): exactly argmin's answer the slow way
        pairs = list(zip(scores, items, strict=True))
        return argmin(pairs, key=lambda p: (p[0], tie(p[1])), rng=rng)[1]
    lo = min(scores)
    if scores.count(lo) == 1:
        return items[scores.index(lo)]
    return argmin([x for x, s in zip(items, scores, strict=True) if s == lo], key=tie, rng=rng)


def softmax_pick(items: Sequence[T], costs: Sequence[float], temperature: float, rng: random.Random) -> T:
    """Dynamo's softmax sampling over costs normalised to [0, 1]: p ~ exp(-(c - min)/((max - min) T))."""
    lo, hi = min(costs), max(costs)
    if hi == lo or not math.isfinite(hi - lo):
        return items[rng.randrange(len(items))]
    weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    return rng.choices(list(items), weights=weights, k=1)[0]


def runner_up(scores: dict[str, float], winner: str) -> str:
    """" (next X 1.234)" for the reason line, or "" with a single candidate: the lowest
    (score, id) but the winner's. Found with ``min``/``count`` in C, not a tuple per candidate
    (the tuple path only with a NaN, whose comparisons differ)."""
    keys, vals = list(scores), list(scores.values())
    if winner in scores:
        i = keys.index(winner)
        del keys[i], vals[i]
    if not keys:
        return ""
    total = sum(vals)
    if total != total:  # a NaN (or inf - inf)
        v, k = min(zip(vals, keys, strict=True))
    else:
        v = min(vals)
        if vals.count(v) == 1:
            k = keys[vals.index(v)]
        else:  # equal scores: the lowest id, with its own score (0.0 and -0.0 are equal)
            k = min(k for k, x in zip(keys, vals, strict=True) if x == v)
            v = vals[keys.index(k)]
    return f" (next {k} {v:.4g})"
