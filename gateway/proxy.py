"""The path of one request through the gateway: read and validate it, tokenize, then let its
lifecycle (``scheduler.lifecycle``) decide, have the pair's driver (``engines_adapters.drivers``)
open the engines, and forward the response.

The request is finished exactly once whatever happens: the lifecycle releases the reservation
and tells the observers (telemetry, metrics, tracing) on its one ``finish``, and the
:class:`ReservationGuard` around the handler finishes it on any way out that did not (a bug, a
cancellation, a client that left). A streamed response finishes it when the stream ends.
"""
from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
import uuid
from collections.abc import Awaitable
from types import TracebackType

import aiohttp
from opentelemetry import trace
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engines_adapters.drivers import DecodeResponse, PairRequest, UpstreamError, UpstreamHTTPError, UpstreamTimeout
from engines_adapters.drivers.base import LocalResourceError
from gateway.auth import SCOPE_KEY
from gateway.cluster import Cluster
from gateway.config import GatewayConfig
from gateway.errors import RequestError, error_response
from gateway.indexer import Indexer
from gateway.observability import GatewayMetrics, RequestSpans, TelemetryWriter
from gateway.quotas import Quotas, Refusal
from gateway.requests import (
    ParsedRequest,
    cache_salt,
    check_prompt_size,
    check_request_id,
    parse_body,
    slo_override,
)
from gateway.streaming import StreamTally, UpstreamStream, prefill_usage
from gateway.tenants import apply_salt
from gateway.tokenizers import PromptTokenizer
from gateway.waiting import DeferringLifecycle, GatewayWaitRoom
from predictors.telemetry import RequestRecord
from scheduler import Rejection, RequestFacts
from scheduler.hashing import block_hashes, namespace_parent
from scheduler.lifecycle import Observer, RequestLifecycle

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class ClientGone(Exception):
    """The client disconnected before the gateway had a response for it."""


class ServerStopping(Exception):
    """The server's graceful period ended before the gateway had a response for the client."""


class ReservationGuard:
    """Finishes the request on every way out of the handler that did not: an exception or a
    cancellation (``aborted``, 499 when the client is gone; ``error``, 500 for our own bug), or a
    return that forgot to (``error``, 500). A streamed response takes the request over
    (:meth:`hand_off`): its end finishes it, however the stream ends."""

    __slots__ = ("lc", "handed_off")

    def __init__(self, lc: RequestLifecycle):
        self.lc, self.handed_off = lc, False

    def __enter__(self) -> ReservationGuard:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.lc.done or (et is None and self.handed_off):
            return
        if et is None:
            self.lc.finish("error", 500, error="unfinished")
        elif issubclass(et, (asyncio.CancelledError, ClientGone, ClientDisconnect)):
            self.lc.finish("aborted", 499)
        else:
            self.lc.finish("error", 500, error=f"gateway error: {et.__name__}")

    def hand_off(self, stream: UpstreamStream) -> UpstreamStream:
        self.handed_off = True
        return stream


def stream_outcome(tally: StreamTally) -> tuple[str, int, str | None]:
    """(status, HTTP status, error) of a forwarded stream: the 200 already went out."""
    if tally.disconnected:
        return "aborted", 499, None
    if tally.error:
        return ("timeout" if "timeout" in tally.error else "error"), 200, tally.error
    return "ok", 200, None


class Proxy:
    def __init__(self, cfg: GatewayConfig, cluster: Cluster, metrics: GatewayMetrics, telemetry: TelemetryWriter,
                 tokenizer: PromptTokenizer, tracer: trace.Tracer):
        self.cfg, self.cluster, self.metrics = cfg, cluster, metrics
        self.telemetry, self.tokenizer = telemetry, tokenizer
        self.indexer: Indexer | None = None  # the indexer API, when served (gateway/app.py)
        self.sched = cluster.scheduler
        self._live: set[str] = set()  # request ids between arrival and finish
        self.quotas = Quotas({k.name: k.tenant.limits for k in cfg.auth.api_keys.values()}, time.monotonic)
        # isolated keys' cache salts: HMAC(secret, key name); a random secret lasts one process
        self._salt_secret = (cfg.auth.cache_salt_secret or secrets.token_hex(32)).encode()
        ledger = self.sched.ledger
        metrics.inflight.set_function(lambda: len(ledger))  # requests holding a reservation, read at scrape
        # the predictors hear every finished request too (online correction, learned models)
        self._observers: tuple[Observer, ...] = (self._forget, metrics.observe, telemetry.write,
                                                 self.sched.predictors.observe)
        # deferred dispatch (defer=on): the first decision may wait at the gateway (gateway/waiting.py)
        self.waiting = GatewayWaitRoom(self.sched)
        metrics.waiting.set_function(lambda: len(self.waiting))
        if self.waiting.enabled:  # a request ending frees queue: the waiting may go
            self._observers += (self.waiting.observe,)
        self._spans = None if isinstance(tracer, trace.NoOpTracer) else RequestSpans(
            tracer, time.time_ns() - time.monotonic_ns())
        # characters a token may take, at most, when bounding a prompt before tokenizing it
        self._chars_per_token = cfg.prompt_chars_per_token or (1.0 if cfg.tokenizer == "builtin" else 8.0)

    async def handle(self, request: Request, endpoint: str) -> Response:
        client_rid = request.headers.get("x-request-id")
        try:
            if client_rid is not None:
                check_request_id(client_rid)
            bad_rid = None
        except RequestError as e:
            client_rid, bad_rid = None, e  # the request gets an id of ours, and its 400 is recorded
        key = request.scope.get(SCOPE_KEY)
        lc = self._arrive(client_rid, endpoint)
        rec = lc.record
        if key is not None:
            rec.extra["api_key"] = key.name
        with ReservationGuard(lc) as guard:
            try:
                if bad_rid is not None:
                    raise bad_rid
                if key is not None and (over := self.quotas.arrive(key.name, rec.request_id)) is not None:
                    return self._over_quota(over, lc)
                slo = slo_override(request.headers, self.cfg.slo, trusted=key is not None and key.trust_slo_headers)
                req = parse_body(await self._read_body(request), endpoint, self.cfg.default_max_tokens)
                if self.cluster.models and req.model not in self.cluster.models:
                    served = ", ".join(self.cluster.models)
                    raise RequestError(404, f"model {req.model!r} does not exist; served: {served}",
                                       "model_not_found", "model")
                salt = cache_salt(req)
                if key is not None:  # the key's cache mode: shared, isolated or the client's salt
                    salt = apply_salt(req.body, key.tenant, key.name, self._salt_secret)
                check_prompt_size(req, self.sched.max_model_len(), self._chars_per_token)
                tokens = await self.tokenizer.tokens(req)
            except RequestError as e:
                lc.finish("error", e.status, error=e.code)
                echo = {"x-request-id": self._echo_id(rec)}
                return error_response(e.status, e.message, e.code, e.param, headers=echo)
            except ClientDisconnect:
                lc.finish("aborted", 499)
                return Response(status_code=499)
            rec.prompt_tokens, rec.max_tokens = len(tokens), req.max_tokens
            rec.extra["model"] = req.model
            if key is not None and (over := self.quotas.charge_tokens(key.name, len(tokens) + req.max_tokens,
                                                                               rec.request_id)):
                return self._over_quota(over, lc)
            # a salt or a LoRA adapter is a namespace of the engines' prefix caches: hash within it
            lora = req.model if req.model in self.cluster.adapters else None
            root = namespace_parent(salt, lora) if salt or lora else None
            if lora is not None:
                rec.extra["adapter"] = lora
            if key is not None:
                rec.extra["priority"] = key.tenant.priority
            facts = RequestFacts(rec.request_id, len(tokens), block_hashes(tokens, self.cfg.block_size, root),
                                 req.max_tokens, slo, tenant=key and key.name, model=req.model, adapter=lora,
                                 priority=key and key.tenant.priority)
            ix = self.indexer  # (the indexer API knows the base namespace only)
            if ix is not None and ix.remember_prompts and root is None:  # /query_by_hash in use: map this prompt
                asyncio.get_running_loop().call_soon(ix.remember, tokens, facts.block_hashes)
            tier = self.cluster.store_tier
            if tier is not None:  # what the shared store holds of this prompt (None: tier stale), in its namespace
                usable = min(len(facts.block_hashes), (len(tokens) - 1) // self.cfg.block_size)
                facts.store_blocks = await tier.lookup(tokens, facts.block_hashes, usable,
                                                       (salt, lora) if root is not None else None)
            try:
                return await self._watching(request, self._place_and_drive(req, facts, guard))
            except ClientGone:
                lc.finish("aborted", 499)
                return Response(status_code=499)  # nobody is left to read it
            except ServerStopping:
                lc.finish("error", 503, error="shutting_down")
                return error_response(503, "the gateway is shutting down; retry elsewhere or later",
                                      "shutting_down", headers={"x-request-id": self._echo_id(rec),
                                                                "retry-after": "1"})

    async def settle(self, timeout_s: float) -> None:
        """Let cancelled requests finish their way out (a stream's last SSE error event, a 503)
        before the engines' connections close under them; bounded by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        await self.waiting.stop(ServerStopping)  # the requests still waiting: 503, they held nothing
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _arrive(self, client_rid: str | None, endpoint: str) -> RequestLifecycle:
        arrival = time.monotonic()
        rid = client_rid or f"cmpl-{uuid.uuid4().hex}"
        if rid in self._live:  # a client reusing an id must not collide in the ledger or an engine
            rid = f"{rid}.{uuid.uuid4().hex[:8]}"
        self._live.add(rid)
        rec = RequestRecord(rid, arrival_s=arrival)
        if client_rid is not None:
            rec.extra["client_request_id"] = client_rid
        observers = self._observers
        if self._spans is not None:
            observers += (functools.partial(self._spans, endpoint=endpoint),)
        if self.waiting.enabled:  # its prefill finishing wakes the wait room's pump
            return DeferringLifecycle(self.sched, rec, time.monotonic, observers, on_drained=self.waiting.nudge)
        return RequestLifecycle(self.sched, rec, time.monotonic, observers)

    def _forget(self, rec: RequestRecord) -> None:
        self._live.discard(rec.request_id)
        self.quotas.release(rec.request_id, refund=rec.prefill_start_s is None)  # no engine worked on it

    async def _watching(self, request: Request, work: Awaitable[Response]) -> Response:
        """Run ``work`` (up to the response) while watching for the client leaving. uvicorn does
        not cancel a handler on disconnect: without this, a departed client's prefill leg and
        non-streamed decode would run on, holding their reservation. Raises ClientGone then, or
        ServerStopping when the cancellation is the server's (its graceful period is over)."""
        main = asyncio.current_task()
        assert main is not None
        state = {"active": True, "gone": False}

        async def watch() -> None:
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    state["gone"] = True
                    if state["active"]:
                        main.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            result = await work
            state["active"] = False  # no await between here and the return: no stray cancel
            return result
        except asyncio.CancelledError:
            state["active"] = False
            main.uncancel()
            # not the client leaving: the server stopping (uvicorn cancels what outlives its
            # graceful period): a 503 the client can act on, not a bare 500
            raise (ClientGone() if state["gone"] else ServerStopping()) from None
        finally:
            state["active"] = False
            watcher.cancel()

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limit}", "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _place_and_drive(self, req: ParsedRequest, facts: RequestFacts, guard: ReservationGuard) -> Response:
        lc = guard.lc
        leg = PairRequest(facts.request_id, PATHS[req.endpoint], req.body, {"x-request-id": facts.request_id})
        failed: UpstreamError | None = None
        for attempt in range(2):  # one retry on another pair, only before any byte reached the client
            t0 = time.perf_counter()
            # the first decision may wait for a short prefill queue (deferred dispatch); a retry may not
            first = self.waiting.offer(lc, facts) if attempt == 0 else lc.decide(facts)
            self.metrics.decide.observe(time.perf_counter() - t0)
            d = first if first is not None else await self.waiting.wait(lc)
            if isinstance(d, Rejection):
                if failed is not None:  # no other pair for the retry: the client hears what failed
                    return self._upstream_failure(failed, lc)
                return self._rejected(d, lc.record)
            driver, pair = self.cluster.pair(d.prefill, d.decode)
            sent_at = time.monotonic()
            try:  # an engine found hung meanwhile ends the wait at once (retried like a failure)
                resp = await self.cluster.until_ejected(driver.open(pair, leg, lc), (d.prefill, d.decode))
            except UpstreamError as e:
                if e.retryable and e.engine and not isinstance(e, LocalResourceError):
                    if isinstance(e, UpstreamTimeout):
                        self.cluster.report_failure(e.engine, "timeouts", sent_at=sent_at)
                    else:
                        self.cluster.report_failure(e.engine)
                    if attempt == 0:
                        lc.retry(e.engine)
                        failed = e
                        continue
                return self._upstream_failure(e, lc)
            rec = lc.record
            headers = {"x-request-id": self._echo_id(rec), "x-conductor-prefill": d.prefill,
                       "x-conductor-decode": d.decode,
                       "x-conductor-hit-tokens": str(d.hit_tokens)}
            if rec.cached_tokens is not None:  # what the prefill instance itself found in its cache
                headers["x-conductor-prefill-cached-tokens"] = str(rec.cached_tokens)
            if req.stream:
                done = functools.partial(self._stream_done, lc, d.decode, resp)
                # the first token tells the ledger the decode engine holds this request's KV (a
                # whole response shows it only at the end: the ledger's share learns from streams)
                stream = UpstreamStream(resp, headers, done, idle_timeout_s=self.cfg.upstream_stall_timeout_s,
                                        on_first=functools.partial(lc.scheduler.decode_started, lc.request_id))
                self.cluster.track(d.decode, resp, stream.abort)
                return guard.hand_off(stream)
            # late binding is safe: both ways below return (mypy cannot type a default-argument lambda)
            self.cluster.track(d.decode, resp, lambda _reason: resp.close())  # noqa: B023
            try:
                return await self._whole(resp, headers, lc)
            finally:
                self.cluster.untrack(d.decode, resp)
        raise AssertionError("unreachable")

    def _stream_done(self, lc: RequestLifecycle, decode: str, resp: DecodeResponse, tally: StreamTally) -> None:
        self.cluster.untrack(decode, resp)
        status, http_status, error = stream_outcome(tally)
        if status == "timeout":  # the engine went silent mid-stream: evidence against it
            self.cluster.report_failure(decode, "stalled streams")
        lc.finish(status, http_status, error, usage=tally.usage, token_times=tally.token_times)

    async def _whole(self, resp: DecodeResponse, headers: dict[str, str], lc: RequestLifecycle) -> Response:
        """A non-streamed answer, read whole (a client leaving cancels the read: the guard and
        ``_watching`` see to the rest, and closing the response aborts the engine request)."""
        try:
            async with asyncio.timeout(self.cfg.upstream_timeout_s):  # not wait_for: it can drop a cancellation
                data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            engine = lc.record.decode_instance
            failure = (UpstreamTimeout("engine timed out", engine) if isinstance(e, asyncio.TimeoutError)
                       else UpstreamError(f"engine failed: {e}", engine))
            return self._upstream_failure(failure, lc)
        finally:
            resp.close()
        now = time.monotonic()
        try:
            answer = json.loads(data)
            usage = answer.get("usage")
        except (ValueError, AttributeError):
            answer = usage = None
        cached = lc.record.cached_tokens
        if cached is not None and isinstance(usage, dict):  # P/D: the prefill side's hits, not the pulled KV
            answer["usage"] = prefill_usage(usage, cached)
            data = json.dumps(answer, separators=(",", ":")).encode()
        lc.finish("ok", 200, usage=usage, token_times=[now])
        return Response(data, status_code=200, media_type="application/json", headers=headers)

    # --- answers that end the request ----------------------------------------------------

    def _rejected(self, d: Rejection, rec: RequestRecord) -> Response:
        """The lifecycle already finished a rejected request; this is the client's answer."""
        headers = {"x-conductor-reject-reason": d.reason, "x-request-id": self._echo_id(rec)}
        if d.retry_after_s is not None:
            headers["retry-after"] = str(max(1, int(-(-d.retry_after_s // 1))))
        return error_response(d.status, d.message, d.reason, headers=headers)

    def _over_quota(self, r: Refusal, lc: RequestLifecycle) -> Response:
        """429 ``rate_limited``: Retry-After from the bucket (absent when waiting cannot help)."""
        rec = lc.record
        rec.reject_reason, rec.retry_after_s = "rate_limited", r.retry_after_s
        rec.extra["quota"] = r.limit
        lc.finish("rejected", 429, error="rate_limited")
        headers = {"x-conductor-reject-reason": "rate_limited", "x-request-id": self._echo_id(rec)}
        if r.retry_after_s is not None:
            headers["retry-after"] = str(max(1, int(-(-r.retry_after_s // 1))))
        return error_response(429, r.message, "rate_limited", headers=headers)

    def _upstream_failure(self, e: UpstreamError, lc: RequestLifecycle) -> Response:
        echo = {"x-request-id": self._echo_id(lc.record)}
        if isinstance(e, UpstreamHTTPError) and e.status < 500 and not e.kv_lost:
            # the engine refused the request itself (e.g. too long for its context): pass its answer on
            lc.finish("error", e.status, error="engine_refused")
            return Response(e.body, status_code=e.status, media_type="application/json", headers=echo)
        if isinstance(e, LocalResourceError):  # the gateway's own shortage: try again shortly
            lc.finish("error", 503, error="gateway_overloaded")
            return error_response(503, str(e), "gateway_overloaded", headers={**echo, "retry-after": "1"})
        status, code = (504, "upstream_timeout") if isinstance(e, UpstreamTimeout) else (503, "upstream_unavailable")
        lc.finish("timeout" if status == 504 else "error", status, error=code)
        return error_response(status, str(e), code, headers=echo)

    @staticmethod
    def _echo_id(rec: RequestRecord) -> str:
        return rec.extra.get("client_request_id", rec.request_id)
