"""The wait room's settings (scheduler/deferral.py): ``defer_*`` policy parameters any policy takes,
parsed as every policy parameter is, and checked once at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, get_args

from scheduler.policies.base import _coerce  # the same parsing as every policy parameter

#: policy parameters the scheduler takes for itself (any policy accepts them) -> field name
PARAM_KEYS = {"defer": "enabled", "defer_horizon_s": "horizon_s", "defer_aging": "aging",
              "defer_scan": "scan", "defer_last_chance": "last_chance", "defer_slack": "slack",
              "defer_spill": "spill", "defer_spill_ratio": "spill_ratio",
              "defer_wait_holder": "wait_holder", "defer_holder_ratio": "holder_ratio",
              "defer_holder_fallback": "holder_fallback", "defer_floor_every": "floor_every",
              "defer_floor_quantile": "floor_quantile", "defer_slack_aging": "slack_aging",
              "defer_reeval_s": "reeval_s", "defer_eval_every_s": "eval_every_s",
              "defer_size": "size", "defer_share": "share", "defer_join": "join"}

#: how the room sizes a waiting request for its cheapest-first order (``defer_size``)
Size = Literal["prefill", "pools"]
SIZES: tuple[str, ...] = get_args(Size)


@dataclass(frozen=True)
class DeferParams:
    enabled: bool = False
    horizon_s: float = 1.0  # predicted queue (s) within which a request is dispatched at once
    aging: float = 0.0  # seconds of predicted cost forgiven per second waited (0: pure SJF)
    scan: int = 4  # evaluations in a row without a dispatch before a pump gives up (keeps it cheap)
    last_chance: bool = False  # dispatch a waiting request behind a long queue before it is too late
    slack: float = 0.1  # with last_chance: share of the TTFT SLO kept in hand then
    spill: bool = False  # a waiter whose chosen instance is busy may go to one with room if it meets its SLO there
    spill_ratio: float = math.inf  # with spill: only if its prefill there costs at most this x its cheapest
    # a request the policy would place off its cheapest instance (the prefix holder) while that one's queue
    # exceeds the horizon waits for it instead, if it meets its remaining TTFT SLO there and the other
    # instance's prefill costs more than holder_ratio x the holder's (see _wait_for_holder)
    wait_holder: bool = False
    holder_ratio: float = 1.5
    # with wait_holder: only while the policy's choice would still meet the SLO after the holder's queue
    # drained to the horizon (the wait never costs the request its way out)
    holder_fallback: bool = False
    # the fairness floor (0: off): every floor_every-th dispatch of the room goes to a long prompt (at least
    # the floor_quantile of the recent prompts offered), the cheapest its last evaluation placed within the SLO
    floor_every: int = 0
    floor_quantile: float = 0.75
    # priority = cost x (1 - waited / TTFT SLO) (- aging x waited): a waiter's own cost is forgiven as
    # its SLO runs out, so a long prompt catches up with the short ones before its deadline
    slack_aging: bool = False
    # a pump evaluates a waiting request again only once this many seconds passed since its last
    # evaluation (0: at every pump). Virtual time makes evaluations free; a live gateway pays ~1 ms
    # of its event loop for each (docs/experiments/live-baselines-synthetic.md)
    reeval_s: float = 0.0
    # the pumps' evaluation budget (0: none): one evaluation per this many seconds of the clock on
    # average, at most ``scan`` in a burst. It bounds the share of a live gateway's event loop the
    # room takes however many wait (a full room ran the whole scan at every wake-up), and the
    # simulator, on the same clock, spends the very same budget (docs/experiments/pump-cost.md)
    eval_every_s: float = 0.0
    # the room's job size, cheapest first: "prefill", the predicted prefill (+ pull) seconds on its
    # cheapest candidate; "pools", its share of both pools: those seconds over the prefill
    # instances plus the KV it holds while decoding (prompt + half its output, for its output
    # tokens at the predicted TBT) over the decode instances' KV. A decode-bound cluster spends its
    # KV, not its prefill, on each request (docs/experiments/live-baselines-synthetic.md)
    size: Size = "prefill"
    # order by a shared-cost size: the uncached prefix a waiter shares with other waiters counts once
    # for all of them (its share: 1 / how many wait with it), so a group that one prefill makes cheap
    # is served as the group it is rather than each refused as if alone
    share: bool = False
    # an arrival the policy would dispatch at once joins the room instead while anyone waits there, and
    # the room is pumped at once: it goes now only if no cheaper waiter takes the queue first (without
    # it an arrival overtakes every waiter whenever a queue is within the horizon as it arrives)
    join: bool = False

    def __post_init__(self) -> None:
        for name, v in (("defer_horizon_s", self.horizon_s), ("defer_aging", self.aging), ("defer_slack", self.slack),
                        ("defer_reeval_s", self.reeval_s), ("defer_eval_every_s", self.eval_every_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not (isinstance(self.holder_ratio, (int, float)) and not isinstance(self.holder_ratio, bool)
                and self.holder_ratio >= 1):
            raise ValueError(f"defer_holder_ratio must be a number >= 1, got {self.holder_ratio!r}")
        r = self.spill_ratio  # inf: any cost
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and r >= 1):
            raise ValueError(f"defer_spill_ratio must be a number >= 1 (inf: any cost), got {r!r}")
        if not isinstance(self.scan, int) or isinstance(self.scan, bool) or self.scan < 1:
            raise ValueError(f"defer_scan must be a positive integer, got {self.scan!r}")
        if self.size not in SIZES:
            raise ValueError(f"defer_size must be one of {', '.join(SIZES)}, got {self.size!r}")
        k = self.floor_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"defer_floor_every must be an integer >= 0 (0: off), got {k!r}")
        q = self.floor_quantile
        if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q <= 1):
            raise ValueError(f"defer_floor_quantile must be a number in [0, 1], got {q!r}")


def room_defaults(keys: Iterable[str]) -> dict[str, Any]:
    """The room's own defaults (``DeferParams()``) of these parameters: set over a policy's
    ``wait_room``, they give that policy the room every other policy has (``defer`` included)."""
    plain = DeferParams()
    return {key: getattr(plain, PARAM_KEYS[key]) for key in keys}


def split_params(policy_params: dict[str, Any], defaults: Mapping[str, Any] | None = None
                 ) -> tuple[DeferParams, dict[str, Any]]:
    """The deferral parameters out of a policy's raw parameters (TOML natives or
    ``--policy-param`` strings), and the rest for the policy. ``defaults``: the policy's own
    (``Policy.wait_room``), each overridden by a raw parameter of the same name."""
    rest = dict(policy_params)
    given = {**(defaults or {}), **{k: rest.pop(k) for k in PARAM_KEYS if k in rest}}
    kw: dict[str, Any] = {}
    for key, name in PARAM_KEYS.items():
        if key in given:
            hint = {"enabled": bool, "last_chance": bool, "spill": bool, "wait_holder": bool,
                    "holder_fallback": bool, "scan": int, "floor_every": int,
                    "slack_aging": bool, "size": Size, "share": bool, "join": bool}.get(name, float)
            kw[name] = _coerce(key, hint, given[key])
    return DeferParams(**kw), rest
