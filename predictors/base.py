"""Narrow predictor protocols the scheduler asks for every term of a decision.

Four questions, one protocol each, so an analytic model and a learned one are interchangeable
per term: how long a prefill instance's queue takes to drain (queue), how long this prompt's
prefill takes given its cached prefix (prefill), how long moving KV takes (transfer), and what
time-between-tokens a decode instance delivers once this request joins (TBT). All times are
seconds. Every method receives the instance id so per-instance models (another GPU, another
deployment) fit behind the same call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, NamedTuple, Protocol, runtime_checkable

from predictors.facts import Deployment
from predictors.telemetry import RequestRecord


class PrefillState(NamedTuple):
    """Queued prefill work on one prefill instance, as the ledger sees it (plus observed metrics)."""

    instance: str
    queued_tokens: int = 0  # uncached prompt tokens reserved and not yet prefilled
    queued_s: float = 0.0  # their predicted prefill seconds, minus the head's elapsed part
    queued_requests: int = 0


class DecodeState(NamedTuple):
    """Running sequences and the KV tokens they hold on one decode instance.

    ``kv_tokens`` counts each sequence's whole context, as a decode step reads it; ``kv_share`` is
    the device KV the engine holds per such token (below 1 where running sequences share prefix
    blocks, held once), so that the cache fits ``capacity / kv_share`` of them."""

    instance: str
    running: int = 0
    kv_tokens: int = 0
    kv_share: float = 1.0


@runtime_checkable
class QueuePredictor(Protocol):
    def queue_time(self, state: PrefillState) -> float:
        """Seconds until a prefill submitted now would start on ``state.instance``."""


@runtime_checkable
class PrefillPredictor(Protocol):
    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``prompt_tokens`` when the first ``cached_tokens`` are already on device."""


@runtime_checkable
class TransferPredictor(Protocol):
    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        """Seconds to move the KV of ``tokens`` tokens onto ``destination``'s device.

        ``source`` is another instance id, ``Tier.STORE`` (the shared store) or ``Tier.HOST`` (the
        destination's own host memory). ``source == destination`` moves nothing: 0.
        """


@runtime_checkable
class TBTPredictor(Protocol):
    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        """Predicted TBT on ``state.instance`` once this request (prompt + max_tokens) joins."""


@dataclass
class Predictors:
    """The bundle a scheduler decides with; each term can be swapped on its own.

    ``group`` (optional) names instances the prefill and transfer predictors answer alike for
    (same inputs, same answer: e.g. one public deployment), so a decision computes those terms
    once per group; None treats every instance as its own group.

    ``groups`` (optional) is the bundle's live view of ``group``, for groups that move (e.g. with
    an online correction): kept current for every instance ``group`` was asked about, read by the
    scheduler at every decision; without it, what ``group`` answered at registration holds.

    ``register`` / ``unregister`` (optional) tell the bundle which instances exist: the scheduler
    calls ``register(instance, deployment, kv_capacity_tokens)`` when an instance joins (and again
    when its capacity is learned from the engine) and ``unregister(instance)`` when it leaves, so
    per-instance models know the public facts of what they predict for.
    """

    queue: QueuePredictor
    prefill: PrefillPredictor
    transfer: TransferPredictor
    tbt: TBTPredictor
    group: Callable[[str], Hashable] | None = None
    register: Callable[[str, Deployment, int], None] | None = None
    unregister: Callable[[str], None] | None = None
    groups: Mapping[str, Hashable] | None = None
    #: the scheduler tells the TBT predictor the cluster's decode load (reservations per eligible
    #: decode instance) once per decision, before it asks for any TBT (optional)
    decode_load: Callable[[float], None] | None = None

    def observe(self, record: RequestRecord) -> None:
        """A request finished: hand its record to each term predictor that learns from outcomes
        (an ``observe(record)`` method: online correction, training-data capture). Analytic
        predictors have none; a predictor shared by several terms hears each record once."""
        seen: set[int] = set()
        for p in (self.queue, self.prefill, self.transfer, self.tbt):
            hook = getattr(p, "observe", None)
            if hook is not None and id(p) not in seen:
                seen.add(id(p))
                hook(record)
