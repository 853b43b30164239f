"""One instant's load views, shared by evaluations made in a row with nothing decided between
them (the wait room's pump, scheduler/deferral.py).

Why: a pump evaluates up to ``defer_scan`` waiting requests one after the other; each evaluation
used to read every prefill instance's queue from the ledger and ask the queue predictor again, and
walk the hit index for its prompt again, although between two evaluations that dispatch nobody
nothing changes: an evaluation reserves nothing, finishes nothing, and the ledger, the predictors
and the index are touched only by decisions, request ends and KV events, none of which runs inside
a pump between two evaluations. So one :class:`LoadFrame` answers them all, and is thrown away
(its owner makes a new one) as soon as anything is decided.

What a frame keeps, and why each is the same answer the evaluation would compute:

* the time: evaluations through a frame run at ``now`` (the scheduler's clock read when the frame
  was made), and so does a decision that follows them through it. A virtual clock does not move
  inside a pump anyway; a live one moved by the evaluations made since (about a millisecond each,
  at most ``defer_scan`` of them in a burst), which is also how old the views the room judged by
  are; no other event touches the ledger inside a pump, so its clock still only moves forward;
* per prefill pool (tuple of instance ids): the ledger's prefill views at ``now`` and the queue
  predictor's answer for each (pure functions of the ledger, the predictors and ``now``);
* per decode pool: the ledger's decode states at ``now``; and the cluster's decode load (an EWMA
  sampled at each call: a second call at the same instant with no reservation added or released
  returns the same value and changes nothing);
* per request (``matches``, owned by the caller and kept across frames): the hit index's answer
  for its prompt, valid while the index's ``version`` (bumped by every change) is the one it was
  computed at and the request's block-hash list is the very same object. An index without a
  ``version`` is walked every time;
* the last evaluation's context and policy choice (``keep_choice`` / ``chosen``), for a decision of
  the very same facts object with the same exclusions that follows it through the frame (the wait
  room letting the request go): the policy's choice is a pure function of what the frame holds and
  the request's own random stream, so the decision admits and commits it instead of choosing again.

Pure: no I/O, no clock of its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from predictors.base import DecodeState, PrefillState

if TYPE_CHECKING:
    from scheduler.hit_index import Match

#: request id -> (index version, the request's block-hash list, usable blocks, store walk, Match)
MatchCache = dict[str, tuple[int, list[int], int, bool, "Match"]]


class LoadFrame:
    """The load views of one instant; valid while nothing is decided (see the module docstring)."""

    __slots__ = ("now", "matches", "prefill", "decode", "decode_load", "hits", "_chosen")

    def __init__(self, now: float, matches: MatchCache | None = None):
        self.now = now
        self.matches: MatchCache = matches if matches is not None else {}
        # pool ids -> (states, active counts, predicted queue seconds)
        self.prefill: dict[tuple[str, ...], tuple[list[PrefillState], list[int], list[float]]] = {}
        self.decode: dict[tuple[str, ...], list[DecodeState]] = {}
        self.decode_load: dict[int, float] = {}  # eligible decode instances -> the ledger's decode load
        self.hits = 0  # answers given from the frame (tests and benchmarks read it)
        # the last evaluation's context and choice, for a decision of the very same request facts
        self._chosen: tuple[Any, frozenset[str], frozenset[str], Any, Any] | None = None

    def match(self, request_id: str, version: Any, hashes: list[int], usable: int, store: bool) -> Match | None:
        """The cached hit-index answer for this request, if still valid; None: walk the index."""
        got = self.matches.get(request_id)
        if got is None or version is None:
            return None
        ver, held, n, walk, m = got
        if ver != version or held is not hashes or n != usable or walk != store:
            return None
        self.hits += 1
        return m

    def keep_match(self, request_id: str, version: Any, hashes: list[int], usable: int, store: bool,
                   m: Match) -> None:
        if version is not None:
            self.matches[request_id] = (version, hashes, usable, store, m)

    def keep_choice(self, facts: Any, exclude: frozenset[str], avoid: frozenset[str], ctx: Any, choice: Any) -> None:
        """An evaluation's policy choice (before admission), kept for a decision that follows it."""
        self._chosen = (facts, exclude, avoid, ctx, choice)

    def chosen(self, facts: Any, exclude: frozenset[str], avoid: frozenset[str]) -> tuple[Any, Any] | None:
        """The kept choice, once, if it was made for these very facts (the same object: the same
        request, SLO and prompt) with the same exclusions; None: decide from the stages' start."""
        got, self._chosen = self._chosen, None
        if got is None or got[0] is not facts or got[1] != exclude or got[2] != avoid:
            return None
        self.hits += 1
        return got[3], got[4]
