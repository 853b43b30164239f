"""The open-loop HTTP runner: send each request at its arrival time, stream the answer, time
every chunk.

One scheduler coroutine sleeps until each send time on the loop's monotonic clock and starts a
task per request; arrivals never wait for completions (unless ``max_concurrency`` caps them, and
then the wait is recorded apart). The client's own lateness is measured twice: the send lag
(when a request's task actually started minus when it was due) and the event-loop lag (how late
a 10 ms timer fires), so a run can say when the client, not the target, was the bottleneck.

All record times are seconds from the step's start (its first scheduled arrival).
"""
from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engines_adapters.net import POOL_KEEPALIVE_S
from predictors.telemetry import RequestRecord

from .progress import Progress
from .workload import Request

HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
#: Content-bearing fields of a streamed choice (chat deltas, completions text).
_DELTA_FIELDS = ("content", "reasoning_content", "reasoning")
ERROR_TEXT_MAX = 300
INTERRUPTED = "interrupted"


class TargetUnreachable(Exception):
    """The target did not answer the probe; the message is one line."""


@dataclass
class Send:
    """One request ready to go: its trace facts and the encoded body."""

    request: Request
    body: bytes
    prompt_tokens: int
    request_id: str


@dataclass
class RunnerOptions:
    path: str = "/v1/chat/completions"
    timeout_s: float = 300.0
    max_concurrency: int | None = None
    #: Stop sending after this many connection failures in a row (the target went away).
    abort_after_connect_errors: int = 10
    lead_in_s: float = 0.05
    monitor_period_s: float = 0.01
    headers: dict[str, str] = field(default_factory=dict)  # e.g. authorization


@dataclass
class StepResult:
    records: list[RequestRecord]
    wall_s: float
    send_lags_s: list[float]
    loop_lags_s: list[float]
    cpu_s: float
    aborted: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu_util(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def new_session() -> aiohttp.ClientSession:
    """No connection cap (open loop) and no default timeout (each request sets its own)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                                                keepalive_timeout=POOL_KEEPALIVE_S),
                                 timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())[:ERROR_TEXT_MAX]


async def probe(base_url: str, timeout_s: float = 3.0, session: aiohttp.ClientSession | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """GET /v1/models: (HTTP status, model ids). Raises :class:`TargetUnreachable` quickly when
    nothing answers, so a dead target costs one short timeout, not a storm of them."""
    own = session is None
    session = session or new_session()
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s),
                               headers=headers or {}) as resp:
            if resp.status != 200:
                return resp.status, []
            try:
                data = await resp.json(content_type=None)
                return 200, [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
            except (ValueError, AttributeError, aiohttp.ContentTypeError):
                return 200, []
    except asyncio.TimeoutError:
        raise TargetUnreachable(
            f"target {base_url} unreachable: no answer to GET /v1/models within {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as e:
        raise TargetUnreachable(f"target {base_url} unreachable: {_one_line(e)}") from None
    finally:
        if own:
            await session.close()


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's first line."""
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(Exception(err["message"]))
        if isinstance(err, str):
            return _one_line(Exception(err))
    except (ValueError, AttributeError):
        pass
    return _one_line(Exception(text)) or "(empty body)"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class _Step:
    """State of one step: the session, the clock origin, the outcome of every request."""

    def __init__(self, session: aiohttp.ClientSession, url: str, sends: list[Send], opts: RunnerOptions,
                 progress: Progress | None):
        self.session, self.url, self.sends, self.opts, self.progress = session, url, sends, opts, progress
        self.loop = asyncio.get_running_loop()
        self.records: list[RequestRecord | None] = [None] * len(sends)
        self.sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        self.send_lags: list[float] = []
        self.connect_errors_in_a_row = 0
        self.aborted: str | None = None
        self.t0 = 0.0
        self.headers = {**HEADERS, **opts.headers}

    async def schedule(self) -> None:
        loop, tasks = self.loop, []
        self.t0 = loop.time() + self.opts.lead_in_s
        try:
            for i, s in enumerate(self.sends):
                if self.aborted:
                    break
                due = self.t0 + s.request.arrival_s
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(loop.create_task(self.one(i, s, due)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C: stop sending, cut what is in flight, keep it all
            self.aborted = INTERRUPTED
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def one(self, i: int, s: Send, due: float) -> None:
        loop = self.loop
        lag = loop.time() - due
        self.send_lags.append(lag)
        rec = RequestRecord(s.request_id, arrival_s=s.request.arrival_s, prompt_tokens=s.prompt_tokens,
                            max_tokens=s.request.output_length)
        rec.extra["send_lag_s"] = lag
        self.records[i] = rec
        if self.progress:
            self.progress.on_sent(lag)
        acquired = False
        try:
            if self.sem:
                waited = loop.time()
                await self.sem.acquire()
                acquired = True
                rec.extra["queue_wait_s"] = loop.time() - waited
            rec.sent_s = loop.time() - self.t0
            await self.exchange(s, rec)
        except asyncio.CancelledError:
            rec.status, rec.error, rec.end_s = "aborted", INTERRUPTED, self.now()
            raise
        except Exception as e:  # one request's surprise must not end the run
            rec.status, rec.error, rec.end_s = "error", f"client: {type(e).__name__}: {_one_line(e)}", self.now()
        finally:
            if acquired and self.sem is not None:
                self.sem.release()
        if self.progress:
            self.progress.on_done(rec)

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def exchange(self, s: Send, rec: RequestRecord) -> None:
        timeout = aiohttp.ClientTimeout(total=self.opts.timeout_s)
        try:
            async with self.session.post(self.url, data=s.body, headers={**self.headers, "x-request-id": s.request_id},
                                         timeout=timeout) as resp:
                self.connect_errors_in_a_row = 0
                rec.http_status = resp.status
                h = resp.headers
                rec.prefill_instance = h.get("x-conductor-prefill")
                rec.decode_instance = h.get("x-conductor-decode")
                prefill_hits = h.get("x-conductor-prefill-cached-tokens")
                if prefill_hits is not None and prefill_hits.isdigit():
                    # disaggregated: the decode engine counts pulled KV as cached; the prefill
                    # instance's own prefix hits are what the cache saved
                    rec.extra["prefill_cached_tokens"] = int(prefill_hits)
                if resp.status != 200:
                    body = await resp.content.read(65536)
                    rec.end_s = self.now()
                    msg = _error_message(body)
                    if resp.status == 429:
                        rec.status = "rejected"
                        rec.retry_after_s = _retry_after(h.get("retry-after"))
                        rec.reject_reason = h.get("x-conductor-reject-reason") or msg
                    else:
                        rec.status = "error"
                        rec.error = f"HTTP {resp.status}: {msg}"
                    return
                if resp.content_type == "application/json":
                    await self.read_whole(resp, rec)
                else:
                    await self.read_stream(resp, rec)
        except asyncio.TimeoutError:
            rec.status, rec.error = "timeout", f"no complete answer within {self.opts.timeout_s:g} s"
            rec.end_s = self.now()
        except aiohttp.ClientConnectorError as e:
            rec.status, rec.error = "error", f"connect: {_one_line(e)}"
            rec.end_s = self.now()
            self.connect_errors_in_a_row += 1
            if self.connect_errors_in_a_row >= self.opts.abort_after_connect_errors and not self.aborted:
                self.aborted = (f"target became unreachable ({self.connect_errors_in_a_row} connection failures "
                                f"in a row: {_one_line(e)})")
        except (aiohttp.ClientError, OSError) as e:
            rec.status, rec.error = "error", f"{type(e).__name__}: {_one_line(e)}"
            rec.end_s = self.now()

    async def read_whole(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        """A server that ignored ``stream: true``: the whole answer is its one and only chunk."""
        try:
            data = await resp.json()
        except ValueError:
            rec.status, rec.error, rec.end_s = "error", "a JSON answer that does not parse", self.now()
            return
        now = rec.end_s = self.now()
        rec.extra["streamed"] = False
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            rec.status, rec.error = "error", "no choices in the answer"
            return
        rec.first_token_s, rec.token_times = now, [now]
        usage = data.get("usage") or {}
        completion = usage.get("completion_tokens")
        rec.output_tokens = completion if isinstance(completion, int) else 1
        self._usage(usage, rec)
        rec.status = "ok"

    @staticmethod
    def _usage(usage: dict[str, Any], rec: RequestRecord) -> None:
        if isinstance(usage.get("prompt_tokens"), int):
            rec.extra["usage_prompt_tokens"] = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if "prefill_cached_tokens" in rec.extra:
            rec.cached_tokens = rec.extra["prefill_cached_tokens"]
        elif isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]

    async def read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        """Time every SSE line; a token chunk is one whose choice carries content (a role-only
        first chunk is not). Tokens come from ``usage`` when the target reports it."""
        done = finished = False
        chunks = 0
        last = self.now()
        usage: dict[str, Any] | None = None
        async for line in resp.content:
            last = self.now()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.status, rec.error = "error", f"bad SSE chunk: {data[:80]!r}"
                rec.end_s = last
                return
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                err = chunk["error"]
                rec.status = "error"
                message = err.get("message", err) if isinstance(err, dict) else err
                rec.error = "stream error: " + _one_line(Exception(message))
                rec.end_s = last
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta")
                has = bool(choice.get("text")) or (isinstance(delta, dict) and any(delta.get(k) for k in _DELTA_FIELDS))
                if has:
                    chunks += 1
                    if rec.first_token_s is None:
                        rec.first_token_s = last
                    rec.token_times.append(last)
                if choice.get("finish_reason"):
                    finished = True
        rec.end_s = last
        rec.extra["content_chunks"] = chunks
        rec.output_tokens = chunks
        if usage:
            if isinstance(usage.get("completion_tokens"), int):
                rec.output_tokens = usage["completion_tokens"]
            self._usage(usage, rec)
        if not (done or finished):
            rec.status, rec.error = "error", "stream ended before [DONE] or a finish_reason"
        elif not chunks:
            rec.status, rec.error = "error", "no tokens in the answer"
        else:
            rec.status = "ok"


async def _loop_lag(loop: asyncio.AbstractEventLoop, period: float, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(period)
        out.append(loop.time() - t - period)


async def run_sends(base_url: str, sends: list[Send], opts: RunnerOptions, progress: Progress | None = None,
                    session: aiohttp.ClientSession | None = None) -> StepResult:
    """Replay ``sends`` open loop against ``base_url`` and return one record per request
    (requests never sent because the run was aborted get status ``aborted``)."""
    own = session is None
    session = session or new_session()
    loop = asyncio.get_running_loop()
    step = _Step(session, base_url + opts.path, sends, opts, progress)
    stop = asyncio.Event()
    loop_lags: list[float] = []
    helpers = [loop.create_task(_loop_lag(loop, opts.monitor_period_s, loop_lags, stop))]
    if progress:
        helpers.append(loop.create_task(progress.run(stop)))
    # A full collection of the heap (matplotlib and numpy make it large) stalls the loop for
    # tens of ms: collect now, before the clock starts, and keep what exists out of later ones.
    gc.collect()
    gc.freeze()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        await step.schedule()
    finally:
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        gc.unfreeze()
        stop.set()
        await asyncio.gather(*helpers, return_exceptions=True)
        if own:
            await session.close()
    records = []
    for s, rec in zip(sends, step.records, strict=True):
        if rec is None:
            rec = RequestRecord(s.request_id, arrival_s=s.request.arrival_s, prompt_tokens=s.prompt_tokens,
                                max_tokens=s.request.output_length, status="aborted", error=step.aborted)
        records.append(rec)
    return StepResult(records, wall, step.send_lags, loop_lags, cpu, step.aborted)
