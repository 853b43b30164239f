"""The path of one request: validate, tokenize, decide, hold the reservation, drive the
(prefill, decode) pair with vLLM's two-step PD protocol (or one ``both`` instance), forward the
response, and release the reservation exactly once whatever happens."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
from opentelemetry import trace
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engines_adapters.vllm_client import UpstreamError, UpstreamHTTPError, UpstreamTimeout, decode_body
from gateway.cluster import Cluster
from gateway.config import GatewayConfig
from gateway.errors import RequestError, error_response
from gateway.observability import GatewayMetrics, TelemetryWriter
from gateway.requests import ParsedRequest, parse_body, slo_override
from gateway.streaming import StreamTally, UpstreamStream
from gateway.tokenizers import PromptTokenizer
from predictors.telemetry import RequestRecord
from scheduler import Placement, Rejection, RequestFacts
from scheduler.hashing import block_hashes

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# a decode leg the engine refuses for lack of KV is the pair's failure, not the client's
_KV_LOST = (404, 409, 410)


class Proxy:
    def __init__(self, cfg: GatewayConfig, cluster: Cluster, metrics: GatewayMetrics, telemetry: TelemetryWriter,
                 tokenizer: PromptTokenizer, tracer: trace.Tracer):
        self.cfg, self.cluster, self.metrics = cfg, cluster, metrics
        self.telemetry, self.tokenizer, self.tracer = telemetry, tokenizer, tracer
        self.sched = cluster.scheduler
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._live: set[str] = set()  # request ids between arrival and finish

    async def handle(self, request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        client_rid = request.headers.get("x-request-id")
        rid = client_rid or f"cmpl-{uuid.uuid4().hex}"
        if rid in self._live:  # a client reusing an id must not collide in the ledger or an engine
            rid = f"{rid}.{uuid.uuid4().hex[:8]}"
        self._live.add(rid)
        rec = RequestRecord(rid, arrival_s=arrival)
        if client_rid is not None:
            rec.extra["client_request_id"] = client_rid
        span = self.tracer.start_span("conductor.request", start_time=self._ns(arrival),
                                      attributes={"conductor.request_id": rid, "conductor.endpoint": endpoint})
        try:
            req = parse_body(await self._read_body(request), endpoint, self.cfg.default_max_tokens)
            if self.cluster.models and req.model not in self.cluster.models:
                raise RequestError(404, f"model {req.model!r} does not exist; served: {', '.join(self.cluster.models)}",
                                   "model_not_found", "model")
            slo = slo_override(request.headers)
            tokens = await self.tokenizer.tokens(req)
        except RequestError as e:
            self._finish(rec, "error", e.status, span, error=e.code)
            return e.response()
        except ClientDisconnect:
            self._finish(rec, "aborted", 499, span)
            return Response(status_code=499)
        rec.prompt_tokens, rec.max_tokens = len(tokens), req.max_tokens
        facts = RequestFacts(rid, len(tokens), block_hashes(tokens, self.cfg.block_size), req.max_tokens, slo)
        return await self._watching(request, self._place_and_drive(req, facts, rec, span))

    async def _watching(self, request: Request, work) -> Response:
        """Run ``work`` (up to the response) while watching for the client leaving. uvicorn does
        not cancel a handler on disconnect: without this, a departed client's prefill leg and
        non-streamed decode would run on, holding their reservation."""
        main = asyncio.current_task()
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
            if not state["gone"]:
                raise
            main.uncancel()
            return Response(status_code=499)  # nobody is left to read it
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

    async def _place_and_drive(self, req: ParsedRequest, facts: RequestFacts, rec: RequestRecord, span) -> Response:
        exclude: set[str] = set()
        for attempt in range(2):  # one retry on another pair, only before any byte reached the client
            t0 = time.perf_counter()
            d = self.sched.decide(facts) if attempt == 0 else self.sched.retry_excluding(facts, exclude)
            self.metrics.decide.observe(time.perf_counter() - t0)
            rec.decided_s = time.monotonic()
            self._span(span, "decide", rec.arrival_s, rec.decided_s)
            if isinstance(d, Rejection):
                return self._reject(d, rec, span)
            self._note_placement(rec, d, span)
            self.metrics.inflight.inc()
            try:
                resp = await self._open(req, d, rec, span)
            except UpstreamError as e:
                self._release(rec)
                if e.retryable and e.engine:
                    self.cluster.report_failure(e.engine)
                    if attempt == 0:
                        exclude.add(e.engine)
                        continue
                return self._upstream_failure(e, rec, span)
            except BaseException:  # the client went away during the prefill leg
                self._release(rec)
                self._finish(rec, "aborted", 499, span)
                raise
            headers = {"x-request-id": self._echo_id(rec), "x-conductor-prefill": d.prefill, "x-conductor-decode": d.decode,
                       "x-conductor-hit-tokens": str(d.hit_tokens)}
            if rec.cached_tokens is not None:  # what the prefill instance itself found in its cache
                headers["x-conductor-prefill-cached-tokens"] = str(rec.cached_tokens)
            if req.stream:
                def done(tally: StreamTally, rec=rec, span=span) -> None:
                    self._release(rec)
                    self._complete(rec, tally, span)
                return UpstreamStream(resp, headers, done, idle_timeout_s=self.cfg.upstream_timeout_s)
            return await self._whole(resp, headers, rec, span)
        raise AssertionError("unreachable")

    async def _open(self, req: ParsedRequest, d: Placement, rec: RequestRecord, span):
        """Prefill leg (when disaggregated), then the decode leg up to its response headers."""
        path, body = PATHS[req.endpoint], req.body
        fwd = {"x-request-id": rec.request_id}
        params = None
        if d.prefill != d.decode:
            rec.prefill_start_s = time.monotonic()
            params, usage = await self.cluster.clients[d.prefill].prefill(path, body, fwd)
            rec.prefill_end_s = time.monotonic()
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            self.sched.prefill_done(rec.request_id)
            self._span(span, "prefill", rec.prefill_start_s, rec.prefill_end_s, {"conductor.instance": d.prefill})
        rec.decode_start_s = time.monotonic()
        client = self.cluster.clients[d.decode]
        resp = await client.open(path, decode_body(body, params), fwd)
        if resp.status != 200:
            try:
                data = await resp.read()
            except aiohttp.ClientError:
                data = b""
            finally:
                resp.release()
            err = UpstreamHTTPError(resp.status, data, d.decode)
            err.kv_lost = params is not None and resp.status in _KV_LOST
            err.retryable = err.retryable or err.kv_lost
            raise err
        return resp

    async def _whole(self, resp: aiohttp.ClientResponse, headers: dict[str, str], rec: RequestRecord, span) -> Response:
        tally = StreamTally()
        try:
            data = await asyncio.wait_for(resp.read(), self.cfg.upstream_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._release(rec)
            timeout = isinstance(e, asyncio.TimeoutError)
            return self._upstream_failure(UpstreamTimeout("engine timed out", rec.decode_instance) if timeout
                                          else UpstreamError(f"engine failed: {e}", rec.decode_instance), rec, span)
        except BaseException:  # the client left (see _watching): the engine aborts when we close
            self._release(rec)
            self._finish(rec, "aborted", 499, span)
            raise
        finally:
            resp.close()
        self._release(rec)
        tally.token_times.append(time.monotonic())
        try:
            tally.usage = json.loads(data).get("usage")
        except (ValueError, AttributeError):
            pass
        self._complete(rec, tally, span)
        return Response(data, status_code=200, media_type="application/json", headers=headers)

    # --- bookkeeping -------------------------------------------------------------------------

    def _release(self, rec: RequestRecord) -> None:
        if self.sched.release(rec.request_id):
            self.metrics.inflight.dec()

    def _note_placement(self, rec: RequestRecord, d: Placement, span) -> None:
        rec.policy = self.cfg.policy
        rec.prefill_instance, rec.decode_instance = d.prefill, d.decode
        rec.hit_tokens, rec.local_hit_tokens, rec.transfer_tokens = d.hit_tokens, d.local_hit_tokens, d.transfer_tokens
        rec.queue_tokens, rec.queue_requests = d.queue_tokens, d.queue_requests
        rec.decode_running, rec.decode_kv_tokens = d.decode_running, d.decode_kv_tokens
        rec.predicted_queue_s, rec.predicted_prefill_s = d.queue_s, d.prefill_s
        rec.predicted_transfer_s, rec.predicted_ttft_s, rec.predicted_tbt_s = d.transfer_s, d.ttft_s, d.tbt_s
        span.set_attributes({"conductor.prefill": d.prefill, "conductor.decode": d.decode,
                             "conductor.hit_tokens": d.hit_tokens, "conductor.predicted_ttft_s": d.ttft_s})

    def _reject(self, d: Rejection, rec: RequestRecord, span) -> Response:
        rec.reject_reason, rec.retry_after_s = d.reason, d.retry_after_s
        headers = {"x-conductor-reject-reason": d.reason, "x-request-id": self._echo_id(rec)}
        if d.retry_after_s is not None:
            headers["retry-after"] = str(max(1, int(-(-d.retry_after_s // 1))))
        self._finish(rec, "rejected" if d.status == 429 else "error", d.status, span, error=d.reason)
        return error_response(d.status, d.message, d.reason, headers=headers)

    def _upstream_failure(self, e: UpstreamError, rec: RequestRecord, span) -> Response:
        if isinstance(e, UpstreamHTTPError) and e.status < 500 and not e.kv_lost:
            # the engine refused the request itself (e.g. too long for its context): pass its answer on
            self._finish(rec, "error", e.status, span, error="engine_refused")
            return Response(e.body, status_code=e.status, media_type="application/json",
                            headers={"x-request-id": self._echo_id(rec)})
        status, code = (504, "upstream_timeout") if isinstance(e, UpstreamTimeout) else (503, "upstream_unavailable")
        self._finish(rec, "timeout" if status == 504 else "error", status, span, error=code)
        return error_response(status, str(e), code, headers={"x-request-id": self._echo_id(rec)})

    def _complete(self, rec: RequestRecord, tally: StreamTally, span) -> None:
        rec.token_times = tally.token_times
        rec.first_token_s = tally.token_times[0] if tally.token_times else None
        usage = tally.usage or {}
        rec.output_tokens = int(usage.get("completion_tokens") or len(tally.token_times))
        if rec.cached_tokens is None:  # colocated: the engine's own report is the prefix hit
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if rec.first_token_s is not None and rec.decode_start_s is not None:
            self._span(span, "transfer", rec.decode_start_s, rec.first_token_s)
            self._span(span, "decode", rec.first_token_s, time.monotonic())
        if tally.disconnected:
            self._finish(rec, "aborted", 499, span)
        elif tally.error:
            self._finish(rec, "timeout" if "timeout" in tally.error else "error", 200, span, error=tally.error)
        else:
            self._finish(rec, "ok", 200, span)

    def _finish(self, rec: RequestRecord, status: str, http_status: int, span, error: str | None = None) -> None:
        rec.status, rec.http_status, rec.error = status, http_status, error
        self._live.discard(rec.request_id)
        rec.end_s = time.monotonic()
        self.metrics.observe(rec)
        self.telemetry.write(rec)
        if rec.ttft_s is not None:
            span.set_attribute("conductor.actual_ttft_s", rec.ttft_s)
        span.set_attributes({"conductor.status": status, "http.status_code": http_status})
        span.end(end_time=self._ns(rec.end_s))

    @staticmethod
    def _echo_id(rec: RequestRecord) -> str:
        return rec.extra.get("client_request_id", rec.request_id)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._wall_offset_ns

    def _span(self, parent, name: str, start: float, end: float, attrs: dict | None = None) -> None:
        ctx = trace.set_span_in_context(parent)
        s = self.tracer.start_span(name, context=ctx, start_time=self._ns(start), attributes=attrs)
        s.end(end_time=self._ns(end))
