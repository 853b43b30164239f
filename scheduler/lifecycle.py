"""One request's life as a small state machine: it drives the scheduler's reservation and fills
the request's :class:`~predictors.telemetry.RequestRecord`.

Pure (no I/O, no awaits, the clock injected), so the gateway's asyncio proxy drives it live and
the virtual-time simulator drives it with the same transitions and the same record::

    ARRIVED --decide()--> PLACED --prefill_started()--> PREFILLING --prefill_finished()--> HANDED_OVER
       |  ^                 +-------------- colocated "both": handed_over() ------------------> |
       |  +--decide()-- WAITING (deferred dispatch: held at the gateway, nothing reserved)        |
       +--wait()-----------^   +--refuse()--> REJECTED                                            v
       +--decide() rejected--> REJECTED (terminal)                  token() ... --> STREAMING --> finish()
    PLACED | PREFILLING | HANDED_OVER (or ARRIVED) --retry(engine)--> ARRIVED   (before the first token)
    any non-terminal --finish(status, ...)--> FINISHED (terminal)

A transition out of order raises :class:`LifecycleError` (a bug in the driver of the machine), except
``finish``, which is allowed in every state and does something only the first time: the
reservation is released exactly once, ``end_s`` stamped and every observer called once with the
final record (telemetry writer, metrics, a predictor's ``observe`` hook). A rejected request is
finished by ``decide`` itself: it holds nothing, and its record is complete.

WAITING is the wait room's (scheduler/deferral.py): the request is held at the gateway until a
prefill queue is short; ``decide`` from it places (or refuses) it, ``refuse`` ends it when its
deadline passed, ``finish`` when the client went away. Leaving it stamps ``record.extra["wait_s"]``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any

from predictors.telemetry import RequestRecord
from scheduler.frame import LoadFrame
from scheduler.scheduler import Scheduler
from scheduler.types import OVER_SLO, Placement, Rejection, RequestFacts

log = logging.getLogger(__name__)

#: Called once with the final record when a request finishes (or is rejected).
Observer = Callable[[RequestRecord], None]


class Phase(StrEnum):
    ARRIVED = "arrived"
    WAITING = "waiting"  # deferred dispatch: held at the gateway, nothing reserved
    PLACED = "placed"  # holds a reservation, no engine has the request yet
    PREFILLING = "prefilling"  # the prefill leg is running on the prefill instance
    HANDED_OVER = "handed_over"  # the decode instance has (or is about to have) the request
    STREAMING = "streaming"  # at least one token reached the gateway: no retry any more
    FINISHED = "finished"
    REJECTED = "rejected"


_STREAMING = Phase.STREAMING
_TERMINAL = (Phase.FINISHED, Phase.REJECTED)
_RETRYABLE = (Phase.ARRIVED, Phase.PLACED, Phase.PREFILLING, Phase.HANDED_OVER)


class LifecycleError(RuntimeError):
    """A transition the state machine does not allow (a bug in whoever drives it)."""


class RequestLifecycle:
    """Drives one request's reservation in ``scheduler`` and fills ``record`` as it goes.

    ``clock`` is the time base of every stamp (``time.monotonic`` live, the virtual clock in the
    simulator); it should be the scheduler's own clock so that ledger and record agree.
    """

    __slots__ = ("scheduler", "record", "clock", "observers", "phase", "placement", "facts", "excluded",
                 "attempts", "waiting_since")

    def __init__(self, scheduler: Scheduler, record: RequestRecord, clock: Callable[[], float],
                 observers: Iterable[Observer] = ()):
        self.scheduler, self.record, self.clock = scheduler, record, clock
        self.observers: tuple[Observer, ...] = tuple(observers)
        self.phase = Phase.ARRIVED
        self.placement: Placement | None = None
        self.facts: RequestFacts | None = None
        self.excluded: set[str] = set()  # instances a retry must avoid
        self.attempts = 0  # decisions asked for (a retry makes it 2)
        self.waiting_since: float | None = None  # when it entered WAITING (deferred dispatch)

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def done(self) -> bool:
        """Finished or rejected: nothing held, observers told."""
        return self.phase in _TERMINAL

    def _expect(self, transition: str, *phases: Phase) -> None:
        if self.phase not in phases:
            allowed = " or ".join(p.value for p in phases)
            raise LifecycleError(f"request {self.record.request_id!r}: {transition}() in state {self.phase.value}, "
                                 f"allowed only in {allowed}")

    # --- placement ----------------------------------------------------------------------
    def decide(self, facts: RequestFacts | None = None, exclude: Iterable[str] = (),
               avoid: Iterable[str] = (), frame: LoadFrame | None = None) -> Placement | Rejection:
        """Ask the scheduler for a (prefill, decode) pair, avoiding ``exclude`` and every instance
        a retry excluded; ``avoid``: this decision only, not a prefill destination but still a
        holder to pull from. ``facts`` may be omitted after the first call (a retry reuses them).
        A placement moves to PLACED and copies the decision's features into the record; a
        rejection finishes the request as REJECTED (``rejected`` for 429, else ``error``)."""
        self._expect("decide", Phase.ARRIVED, Phase.WAITING)
        self._stop_waiting()
        if facts is not None:
            self.facts = facts
        elif self.facts is None:
            raise LifecycleError(f"request {self.record.request_id!r}: the first decide() needs the request's facts")
        self.excluded.update(exclude)
        self.attempts += 1
        kw = {"avoid": frozenset(avoid)} if avoid else {}
        if self.excluded:
            d = self.scheduler.retry_excluding(self.facts, self.excluded, **kw)
        else:
            d = self.scheduler.decide(self.facts, frame=frame, **kw)
        rec = self.record
        rec.decided_s = self.clock()
        if isinstance(d, Rejection):
            rec.reject_reason, rec.retry_after_s = d.reason, d.retry_after_s
            self._end(Phase.REJECTED, "rejected" if d.status == OVER_SLO else "error", d.status, d.reason)
            return d
        self.placement = d
        self.phase = Phase.PLACED
        rec.policy = d.policy or self.scheduler.policy_name
        rec.prefill_instance, rec.decode_instance = d.prefill, d.decode
        rec.hit_tokens, rec.local_hit_tokens, rec.transfer_tokens = d.hit_tokens, d.local_hit_tokens, d.transfer_tokens
        rec.transfer_from, rec.host_load_tokens = d.transfer_from, d.host_tokens
        rec.queue_tokens, rec.queue_requests = d.queue_tokens, d.queue_requests
        rec.decode_running, rec.decode_kv_tokens = d.decode_running, d.decode_kv_tokens
        rec.store_write_recent_bytes, rec.store_busy_s = d.store_write_recent_bytes, d.store_busy_s
        rec.store_loads_inflight = d.store_loads_inflight
        rec.decode_cluster_running, rec.decode_kv_share = d.decode_cluster_running, d.decode_kv_share
        rec.predicted_queue_s, rec.predicted_prefill_s = d.queue_s, d.prefill_s
        rec.predicted_transfer_s, rec.predicted_ttft_s, rec.predicted_tbt_s = d.transfer_s, d.ttft_s, d.tbt_s
        rec.predicted_decode_wait_s, rec.predicted_kv_transfer_s = d.decode_wait_s, d.kv_transfer_s
        rec.predicted_first_step_s = d.decode_first_step_s
        deployment = self.scheduler.deployment_name
        rec.prefill_deployment, rec.decode_deployment = deployment(d.prefill), deployment(d.decode)
        return d

    # --- deferred dispatch (scheduler/deferral.py) ----------------------------------------
    def wait(self) -> None:
        """Held at the gateway for a short prefill queue (the wait room's ``offer``): nothing reserved."""
        self._expect("wait", Phase.ARRIVED)
        self.phase = Phase.WAITING
        self.waiting_since = self.clock()

    def refuse(self, rejection: Rejection) -> None:
        """A waiting request refused without a decision (its deadline passed while it waited)."""
        self._expect("refuse", Phase.WAITING)
        self._stop_waiting()
        rec = self.record
        rec.decided_s = self.clock()
        rec.reject_reason, rec.retry_after_s = rejection.reason, rejection.retry_after_s
        self._end(Phase.REJECTED, "rejected" if rejection.status == OVER_SLO else "error", rejection.status,
                  rejection.reason)

    @property
    def waited_s(self) -> float | None:
        """Seconds it waited at the gateway (so far, while WAITING); None if it never waited."""
        if self.waiting_since is not None:
            return self.clock() - self.waiting_since
        w = self.record.extra.get("wait_s")
        return w if isinstance(w, float) else None

    def _stop_waiting(self) -> None:
        if self.waiting_since is not None:
            self.record.extra["wait_s"] = self.clock() - self.waiting_since
            self.waiting_since = None

    # --- the engine side (the driver's hooks) -------------------------------------------
    def prefill_started(self) -> None:
        """The prefill leg was sent to the prefill instance."""
        self._expect("prefill_started", Phase.PLACED)
        self.phase = Phase.PREFILLING
        self.record.prefill_start_s = self.clock()

    def prefill_finished(self, cached_tokens: int | None = None) -> Rejection | None:
        """The prefill instance is done (``cached_tokens``: the prefix it found in its own cache,
        as it reported): its queued work leaves the ledger, and the decode side takes over.

        With the scheduler's ``late_rejection`` the decode side may refuse it now (its TBT SLO
        checked against the load it has): the request ends REJECTED, its prefill wasted, and the
        rejection is returned (the driver then frees the KV the prefill instance holds)."""
        self._expect("prefill_finished", Phase.PREFILLING)
        rec = self.record
        rec.prefill_end_s = rec.decode_start_s = self.clock()
        rec.cached_tokens = cached_tokens
        self.scheduler.prefill_done(rec.request_id)
        self.phase = Phase.HANDED_OVER
        p = self.placement
        if self.scheduler.late_rejection and self.facts is not None and p is not None and p.decode != p.prefill:
            d = self.scheduler.admit_decode(self.facts, p.decode)
            if d is not None:
                rec.reject_reason, rec.retry_after_s = d.reason, d.retry_after_s
                rec.decode_start_s = None
                self._end(Phase.REJECTED, "rejected", d.status, d.reason)
                return d
        return None

    def store_loaded(self, tokens: int, seconds: float) -> None:
        """The prefill instance loaded part of the prompt's KV from the shared store (as it
        reported): kept in the record and in the decision's explanation (/admin/decisions)."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            return
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            return
        note = {"tokens": tokens, "seconds": float(seconds),
                "note": f"pulled {tokens} tokens from the store in {seconds:.3f} s"}
        self.record.extra["store_load"] = note
        if self.placement is not None:
            self.placement.explanation["store_load"] = note

    def handed_over(self) -> None:
        """A colocated ("both") instance gets the whole request: no separate prefill leg."""
        self._expect("handed_over", Phase.PLACED)
        self.record.decode_start_s = self.clock()
        self.phase = Phase.HANDED_OVER

    def token(self, t: float | None = None) -> None:
        """One token chunk reached the gateway at ``t`` (now by default); the first one moves to
        STREAMING, after which the request can no longer be retried."""
        if self.phase is _STREAMING:  # the per-token path (a simulation makes millions of calls)
            self.record.token_times.append(self.clock() if t is None else t)
            return
        self._expect("token", Phase.HANDED_OVER, Phase.STREAMING)
        rec = self.record
        now = self.clock() if t is None else t
        if self.phase is Phase.HANDED_OVER:
            rec.first_token_s = now
            self.phase = Phase.STREAMING
            self.scheduler.decode_started(rec.request_id)
        rec.token_times.append(now)

    # --- failure before the first token -------------------------------------------------
    def retry(self, engine: str | None = None) -> None:
        """Give the placement up (releasing its reservation) and go back to ARRIVED, so that the
        next ``decide()`` avoids ``engine`` (the instance that failed). Only before the first token."""
        self._expect("retry", *_RETRYABLE)
        if engine is not None:
            self.excluded.add(engine)
        self.scheduler.release(self.record.request_id)
        self.placement = None
        rec = self.record
        rec.prefill_start_s = rec.prefill_end_s = rec.decode_start_s = None
        rec.cached_tokens = None
        self.phase = Phase.ARRIVED

    # --- the end ------------------------------------------------------------------------
    def finish(self, status: str, http_status: int | None = None, error: str | None = None,
               usage: Mapping[str, Any] | None = None, token_times: Iterable[float] | None = None) -> bool:
        """End the request (``status``: ok | error | timeout | aborted): release its reservation,
        complete the record and tell every observer. True the first time; later calls (and calls
        after a rejection) change nothing and return False.

        ``token_times`` (when the caller counted tokens itself, as the gateway's stream forwarder
        does) replace the ones given to ``token()``; ``usage`` is the engine's OpenAI usage block:
        its ``completion_tokens`` (else the token count) and, when the prefill leg did not report
        any (a colocated instance), its ``prompt_tokens_details.cached_tokens``."""
        if self.phase in _TERMINAL:
            return False
        self._stop_waiting()
        rec = self.record
        if token_times is not None:
            rec.token_times = list(token_times)
            rec.first_token_s = rec.token_times[0] if rec.token_times else None
        usage = usage or {}
        rec.output_tokens = int(usage.get("completion_tokens") or len(rec.token_times))
        if rec.cached_tokens is None and self.placement is not None:
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self._end(Phase.FINISHED, status, http_status, error)
        return True

    def _end(self, phase: Phase, status: str, http_status: int | None, error: str | None) -> None:
        rec = self.record
        self.phase = phase  # first: an observer that finishes again is a no-op
        self.scheduler.release(rec.request_id)
        rec.status, rec.http_status, rec.error = status, http_status, error
        rec.end_s = self.clock()
        for observe in self.observers:
            try:
                observe(rec)
            except Exception:  # one broken observer must not starve the others or the caller
                log.exception("request %s: observer %r failed", rec.request_id, observe)
