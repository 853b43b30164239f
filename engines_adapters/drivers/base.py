"""What driving one (prefill, decode) pair means, whatever the engine family.

An engine family (vLLM with its two-step connector protocol, SGLang with its bootstrap rooms,
vLLM's Mooncake connector with transfer ids) has its own way of moving one request's KV cache
from the prefill instance to the decode instance. A :class:`PairDriver` speaks one of them: it
opens the prefill leg, hands the request over, opens the decode leg up to its response headers
and returns that response for the gateway to forward. It reports how far it got through
:class:`PairHooks` (the request lifecycle has exactly these methods), and it fails with an
:class:`UpstreamError` whose ``retryable`` says whether another pair may still serve the request
(nothing has reached the client before ``open`` returns).

Abort semantics: closing the returned response aborts the engine request (the engine frees its
KV when the connection drops); a driver whose legs overlap (SGLang dispatches both at once) must
abort the surviving leg when the other fails or when ``open`` is cancelled (the client left).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


class UpstreamError(Exception):
    """An engine failed; ``retryable`` when nothing reached the client and another pair may work."""

    retryable = False

    def __init__(self, message: str, engine: str | None = None):
        super().__init__(message)
        self.engine = engine


class UpstreamUnavailable(UpstreamError):
    """The engine could not be reached or broke the connection: another pair may work."""

    retryable = True


class UpstreamTimeout(UpstreamError):
    """The engine did not answer in time: before the first byte another pair may work (504 for
    the client when none does)."""

    retryable = True


class LocalResourceError(UpstreamError):
    """The gateway itself ran out of something (file descriptors, ephemeral ports, buffers)
    reaching the engine: not the engine's fault, so never retried or counted against it (503)."""


class UpstreamHTTPError(UpstreamError):
    """The engine answered with a status other than 200.

    An engine's 5xx may be its own fault (another pair may work); a 4xx is the request's fault and
    is passed on to the client, unless ``kv_lost``: a decode leg refused for want of the prefill's
    KV cache is the pair's failure, not the client's, and is retried on another pair."""

    def __init__(self, status: int, body: bytes, engine: str, *, kv_lost: bool = False):
        super().__init__(f"engine {engine} answered {status}: {body[:200]!r}", engine)
        self.status, self.body, self.kv_lost = status, body, kv_lost
        self.retryable = status >= 500 or kv_lost


@dataclass(slots=True)
class LoadSample:
    """An engine's own view of its load, from its metrics endpoint (whatever the names there)."""

    running: int
    waiting: int
    kv_usage: float
    kv_capacity_tokens: int | None = None  # num_gpu_blocks x block_size, when the engine says


def metric_samples(names: Iterable[str]) -> Callable[[str], str]:
    """A filter of a Prometheus text page down to the sample lines of ``names`` (no comments):
    a load poll reads four gauges of a page that is mostly histograms (vLLM's: ~230 lines), and
    the text parser took ~10 ms a page, polled twice a second per engine."""
    starts = tuple(n + c for n in names for c in "{ \t")  # the name, then its labels or its value

    def only(text: str) -> str:
        return "\n".join(line for line in text.split("\n") if line.startswith(starts)) + "\n"
    return only


class StreamBody(Protocol):
    async def readany(self) -> bytes: ...


class DecodeResponse(Protocol):
    """The decode leg's response once its headers arrived (``aiohttp.ClientResponse`` is one).
    The gateway reads it (streamed through ``content`` or whole with ``read``) and always closes
    it; closing before the end aborts the engine request."""

    @property
    def status(self) -> int: ...
    @property
    def content(self) -> StreamBody: ...
    async def read(self) -> bytes: ...
    def close(self) -> None: ...


class EngineHTTP(Protocol):
    """What a driver needs of one engine's HTTP client (``engines_adapters.engine_client``)."""

    id: str
    url: str

    async def post_json(self, path: str, body: Any, headers: dict[str, str]) -> bytes: ...
    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str], *,
                   streaming: bool = True) -> DecodeResponse: ...


@dataclass(frozen=True, slots=True)
class Pair:
    """The prefill and decode instances chosen for one request; the same client twice is a
    colocated ("both") instance: the degenerate pair with a single leg."""

    prefill: EngineHTTP
    decode: EngineHTTP

    @property
    def colocated(self) -> bool:
        return self.prefill.id == self.decode.id


@dataclass(slots=True)
class PairRequest:
    """One client request as a driver sends it: the OpenAI path and body, the headers every leg
    carries (``x-request-id``)."""

    request_id: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class PairHooks(Protocol):
    """How far the pair got, reported as it happens (``scheduler.lifecycle.RequestLifecycle``)."""

    def prefill_started(self) -> None: ...
    # the lifecycle returns a late rejection (``late_rejection``, which the gateway refuses): ignored here
    def prefill_finished(self, cached_tokens: int | None = None) -> object: ...
    def handed_over(self) -> None: ...


class PairDriver(Protocol):
    """Drives (prefill, decode) pairs of one engine family with that family's PD protocol."""

    flavor: str

    async def open(self, pair: Pair, request: PairRequest, hooks: PairHooks) -> DecodeResponse:
        """Run the request on ``pair`` up to the decode leg's response headers.

        Calls ``hooks.prefill_started()`` then ``hooks.prefill_finished(cached)`` around a prefill
        leg, or ``hooks.handed_over()`` for a colocated pair, before opening the decode leg.
        Raises UpstreamError when a leg fails (after aborting its peer); a non-200 decode answer
        is read, closed and raised as UpstreamHTTPError."""
        ...
