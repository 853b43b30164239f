"""The learned predictors' online side: each term corrected from observations of that term, and
its served p90 tracked per deployment group (adaptive conformal, predictors/online_quantile.py).

A finished request's record (:func:`observe`) corrects prefill from a request that found its
prefill instance idle, TBT from the request's own token gaps, and the prefill->decode KV shipment
from the hand-over gap, each against the bundle's uncorrected answer for the state the request
was decided in; loads from the store or the host tier only track their live error. Functions of
the :class:`~predictors.learned.LearnedBundle` they update, which calls them.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from predictors.base import DecodeState
from predictors.learned_features import FEATURES, TERMS, prefill_features, tbt_features, transfer_features
from predictors.online_quantile import DEFAULT_ETA, QuantileTracker
from predictors.telemetry import RequestRecord
from predictors.types import Tier

if TYPE_CHECKING:
    from predictors.learned import LearnedBundle


class Ewma:
    """Per-key EWMA of actual / predicted, bounded, and the live error it has seen."""

    __slots__ = ("alpha", "lo", "hi", "factor", "count", "abs_err")

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 2.0):
        self.alpha, self.lo, self.hi = alpha, lo, hi
        self.factor: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.abs_err: dict[str, float] = {}

    def get(self, key: str) -> float:
        return self.factor.get(key, 1.0)

    def update(self, key: str, actual: float, base: float, served: float | None, correct: bool = True) -> None:
        """``base``: the model's answer without correction; ``served``: what was predicted then;
        ``correct`` False only tracks the live error (the factor stays)."""
        if not (actual > 0 and base > 0 and math.isfinite(actual) and math.isfinite(base)):
            return
        if correct:
            ratio = min(self.hi, max(self.lo, actual / base))
            f = self.factor.get(key, 1.0)
            self.factor[key] = min(self.hi, max(self.lo, f + self.alpha * (ratio - f)))
        self.count[key] = self.count.get(key, 0) + 1
        if served is not None and served > 0:
            e = abs(served / actual - 1.0)
            prev = self.abs_err.get(key)
            self.abs_err[key] = e if prev is None else prev + self.alpha * (e - prev)


#: Observations a TBT needs: a request's Mooncake TBT over fewer gaps is mostly noise.
MIN_TBT_INTERVALS = 8
#: Quantities whose p90 is tracked online (as ``conductor calibrate`` scores them: the hand-over is
#: the shipment's p90 plus the first step) and the term each one's status is shown under.
QUANTILE_TERMS = ("prefill", "tbt", "handover", "ttft")
TRACKED_AS = {"prefill": "prefill", "tbt": "tbt", "transfer": "handover"}


def trackers(b: LearnedBundle) -> dict[str, QuantileTracker]:
    """Fresh trackers (at start and at every reload: a new model has its own calibration)."""
    oq = b.models.meta.get("online_quantile")
    eta = b.quantile_eta if b.quantile_eta is not None else (
        oq.get("eta", DEFAULT_ETA) if isinstance(oq, dict) else DEFAULT_ETA)
    q = b.models.meta.get("quantile", 0.9)
    try:
        return {t: QuantileTracker(float(q), float(eta)) for t in QUANTILE_TERMS}
    except (TypeError, ValueError) as e:  # a hand-edited meta: the defaults, logged once
        b._warn("p90", f"online quantile settings refused ({e}); q 0.9, eta {DEFAULT_ETA}")
        return {t: QuantileTracker(0.9, DEFAULT_ETA) for t in QUANTILE_TERMS}


def track(b: LearnedBundle, rec: RequestRecord, p: str | None, d: str | None, lone: bool) -> None:
    """Each tracked term's outcome in ``rec`` against its calibrated p90 at its decision."""
    if rec.decided_s is None or rec.end_s is None:
        return
    t0, now = rec.decided_s, rec.end_s
    mt = rec.max_tokens or rec.output_tokens
    pre = ship = step = None
    if p is not None and p != d:
        _, rp, ts, _ = b._physics(p)
        pre = b._upper("prefill", p, prefill_features(rp, ts, rec.prompt_tokens, rec.hit_tokens))
        if lone and pre is not None and rec.prefill_start_s is not None and rec.prefill_end_s is not None:
            b.quantiles["prefill"].update(b._compiled(p).group_key, rec.prefill_end_s - rec.prefill_start_s,
                                          pre, t0, now)
    if d is not None:
        _, rd, tsd, _ = b._physics(d)
        x = tbt_features(rd, tsd, rec.decode_running, rec.decode_kv_tokens, rec.prompt_tokens, mt,
                         rec.decode_cluster_running or 0.0,
                         (rec.decode_kv_share or 1.0) if b._compiled(d).tbt_kv_share else 1.0)
        up = b._upper("tbt", d, x)
        m = b.model("tbt", d)[0]
        step = None if m is None else m.predict(x)
        if up is not None and len(rec.token_times) > MIN_TBT_INTERVALS:
            b.quantiles["tbt"].update(b._compiled(d).group_key, rec.tbt_s, up, t0, now)
        if p is not None and p != d:
            bw = min(b._physics(p)[1].net_bytes_per_s, rd.net_bytes_per_s)
            ship = b._upper("transfer", d, transfer_features(rd, tsd, rec.prompt_tokens, bw))
            if (ship is not None and step is not None and not rec.predicted_decode_wait_s
                    and rec.first_token_s is not None and rec.prefill_end_s is not None):
                b.quantiles["handover"].update(b._compiled(d).group_key,
                                               rec.first_token_s - rec.prefill_end_s, ship + step, t0, now)
    if pre is not None and ship is not None and step is not None and rec.ttft_s:
        queue, wait = rec.predicted_queue_s or 0.0, rec.predicted_decode_wait_s or 0.0
        b.quantiles["ttft"].update("all", rec.ttft_s, (queue + pre + ship + step + wait) * b.models.ttft_p90_scale,
                                   t0, now)


def observe(b: LearnedBundle, rec: RequestRecord) -> None:
    """A finished request's record: each term's correction from its own observation, and the
    tracked p90s' outcomes (the bundle's :meth:`~predictors.learned.LearnedBundle.observe`)."""
    if rec.status != "ok":
        return
    p, d = rec.prefill_instance, rec.decode_instance
    if rec.ttft_s and rec.predicted_ttft_s:
        b.ttft_err.update("all", rec.ttft_s, rec.predicted_ttft_s, rec.predicted_ttft_s)
    if b.online:
        track(b, rec, p, d, lone=rec.queue_requests == 0 and not rec.transfer_tokens
              and not rec.host_load_tokens)
    # prefill: the leg of a request that found its prefill instance idle is its prefill
    if (p is not None and p != d and rec.queue_requests == 0 and rec.prefill_start_s is not None
            and rec.prefill_end_s is not None and not rec.transfer_tokens and not rec.host_load_tokens):
        base = b.prefill_base(p, rec.prompt_tokens, rec.hit_tokens)
        if base is not None:
            b.ewma["prefill"].update(p, rec.prefill_end_s - rec.prefill_start_s, base, rec.predicted_prefill_s)
            b._regroup(p)
    # a load from the store or the host tier (one kind only) by a request that found its
    # instance idle: its leg minus its (corrected) prefill, for the live error only. Not a
    # correction: the load is a small part of a leg that prefills joining the instance later
    # stretch, and the factor ran to its bound (served store legs of lone prefills in
    # operation: 27.9% MAPE corrected, 3.6% not; docs/predictors.md, "Store loads")
    store = rec.transfer_tokens if rec.transfer_from == Tier.STORE else 0
    load = (Tier.STORE, store) if store and not rec.host_load_tokens else (
        (Tier.HOST, rec.host_load_tokens) if rec.host_load_tokens and not rec.transfer_tokens else None)
    if (load is not None and p is not None and p != d and rec.queue_requests == 0
            and rec.prefill_start_s is not None and rec.prefill_end_s is not None):
        base = b.transfer_base(load[1], load[0], p, rec.store_busy_s)  # as at its decision
        if base is not None:
            loaded = rec.prefill_end_s - rec.prefill_start_s - b.prefill_time(p, rec.prompt_tokens,
                                                                             rec.hit_tokens)
            b.ewma[str(load[0])].update(b.correction_key("store", p), loaded, base,
                                        None if rec.predicted_transfer_s is None else rec.predicted_transfer_s,
                                        correct=False)
    # TBT: the request's own token gaps against the state it was placed in
    if d is not None and len(rec.token_times) > MIN_TBT_INTERVALS:
        state = DecodeState(d, rec.decode_running, rec.decode_kv_tokens, rec.decode_kv_share or 1.0)
        base = b.tbt_base(state, rec.prompt_tokens, rec.max_tokens or rec.output_tokens,
                          rec.decode_cluster_running or 0.0)
        if base is not None:
            b.ewma["tbt"].update(b.correction_key("tbt", d), rec.tbt_s, base, rec.predicted_tbt_s)
    # the prefill -> decode KV shipment: the hand-over gap minus the first decode step
    if (p is not None and d is not None and p != d and not rec.predicted_decode_wait_s
            and rec.prefill_end_s is not None and rec.first_token_s is not None):
        state = DecodeState(d, rec.decode_running, rec.decode_kv_tokens, rec.decode_kv_share or 1.0)
        step = b._tbt(state, rec.prompt_tokens, rec.max_tokens or rec.output_tokens,
                      rec.decode_cluster_running or 0.0)
        base = b.transfer_base(rec.prompt_tokens, p, d)
        if base is not None:
            shipped = rec.first_token_s - rec.prefill_end_s - step
            b.ewma["transfer"].update(b.correction_key("transfer", d), shipped, base,
                                      rec.predicted_kv_transfer_s)


def status(b: LearnedBundle, instances: Sequence[str] = ()) -> dict[str, Any]:
    """What /admin/predictors shows: per term and instance, the model answering, its correction
    and live error, and the tracked p90's scale and coverage; the TTFT's live error and p90."""
    terms: dict[str, Any] = {"queue": {"answered_by": "ledger: the sum of queued predicted prefill seconds "
                                                     "(Mooncake's T_queue over the prefill term below)"}}
    for t in TERMS:
        e = b.ewma[t]
        per: dict[str, Any] = {}
        for i in instances:
            m, which = b.model(t, i)
            k = b.correction_key(t, i)
            per[i] = {"model": which, "corrected_by": k, "correction": round(e.get(k), 4),
                      "observations": e.count.get(k, 0),
                      "live_abs_error": None if k not in e.abs_err else round(e.abs_err[k], 4)}
            qt = TRACKED_AS.get(t)
            if qt is not None:  # the served p90: its tracker's scale and live coverage (the group's)
                per[i].update(b.quantiles[qt].status(b._compiled(i).group_key))
        terms[t] = {"features": list(FEATURES[t]), "instances": per}
    err = b.ttft_err.abs_err.get("all")
    return {"predictors": "learned", "source": b.source, "reloads": b.reloads, "online": b.online,
            "meta": b.models.meta, "terms": terms,
            "ttft": {"observations": b.ttft_err.count.get("all", 0),
                     "live_abs_error": None if err is None else round(err, 4),
                     **b.quantiles["ttft"].status("all")},
            "p90_tracking": {"eta": b.quantiles["ttft"].eta, "q": b.quantiles["ttft"].q}}
