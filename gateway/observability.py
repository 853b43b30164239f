"""Prometheus metrics, OpenTelemetry tracing and the telemetry JSONL writer of one gateway.

Everything is per-app (its own registry and tracer provider): no global singletons, so tests can
run several gateways in one process.
"""
from __future__ import annotations

import json
import logging
from typing import IO

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from predictors.telemetry import RequestRecord

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_ERR_BUCKETS = (-10, -5, -2, -1, -0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("conductor_requests", "Finished requests by outcome", ["status", "reason"], registry=r)
        self.ttft = Histogram("conductor_time_to_first_token_seconds", "Gateway-measured TTFT", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("conductor_inter_token_latency_seconds", "Gateway-measured gaps between token chunks",
                             buckets=_ITL_BUCKETS, registry=r)
        self.ttft_error = Histogram("conductor_ttft_prediction_error_seconds", "Predicted minus actual TTFT",
                                    buckets=_ERR_BUCKETS, registry=r)
        self.decide = Histogram("conductor_decision_seconds", "Scheduler decision time",
                                buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2), registry=r)
        self.inflight = Gauge("conductor_requests_in_flight", "Requests holding a reservation", registry=r)
        self.waiting = Gauge("conductor_requests_waiting", "Requests held at the gateway for a short prefill "
                             "queue (deferred dispatch)", registry=r)
        self.wait = Histogram("conductor_wait_seconds", "Time a request waited at the gateway before its "
                              "dispatch, refusal or departure, by outcome", ["status"], buckets=_TTFT_BUCKETS,
                              registry=r)
        self.inst_healthy = Gauge("conductor_instance_healthy", "1 when routable", ["instance", "role"], registry=r)
        self.inst_prefill_tokens = Gauge("conductor_instance_reserved_prefill_tokens", "Queued prefill tokens (ledger)",
                                         ["instance"], registry=r)
        self.inst_kv_share = Gauge("conductor_instance_kv_share", "Device KV per context token on a decode "
                                   "instance, learned from its KV usage (1: no prefix shared)", ["instance"],
                                   registry=r)
        self.inst_active = Gauge("conductor_instance_active_requests", "Requests reserved (ledger)", ["instance"],
                                 registry=r)
        self.inst_hit_tokens = Counter("conductor_instance_prefix_hit_tokens", "Prompt tokens served from cache",
                                       ["instance"], registry=r)
        self.inst_prompt_tokens = Counter("conductor_instance_prompt_tokens", "Prompt tokens routed", ["instance"],
                                          registry=r)
        self.refused = Counter("conductor_refused_at_edge", "Requests refused before any route ran (auth, "
                               "Host, header size)", ["reason"], registry=r)
        # per API key (names from the config only: bounded cardinality; no key: no sample)
        self.key_requests = Counter("conductor_api_key_requests", "Finished requests by API key and outcome",
                                    ["api_key", "status", "reason"], registry=r)
        self.key_tokens = Counter("conductor_api_key_tokens", "Prompt and output tokens by API key",
                                  ["api_key", "kind"], registry=r)
        self.key_ttft = Histogram("conductor_api_key_time_to_first_token_seconds", "Gateway-measured TTFT by API key",
                                  ["api_key"], buckets=_TTFT_BUCKETS, registry=r)

    def observe(self, rec: RequestRecord) -> None:
        self.requests.labels(rec.status, rec.reject_reason or "").inc()
        waited = rec.extra.get("wait_s")
        if waited is not None:  # it waited at the gateway (deferred dispatch)
            self.wait.labels(rec.status).observe(waited)
        key = rec.extra.get("api_key")
        if key is not None:
            self._observe_key(key, rec)
        if rec.status != "ok":
            return
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
            if rec.predicted_ttft_s is not None:
                self.ttft_error.observe(rec.predicted_ttft_s - rec.ttft_s)
        for gap in rec.intervals:
            self.itl.observe(gap)
        if rec.prefill_instance:
            self.inst_prompt_tokens.labels(rec.prefill_instance).inc(rec.prompt_tokens)
            self.inst_hit_tokens.labels(rec.prefill_instance).inc(rec.hit_tokens)


    def _observe_key(self, key: str, rec: RequestRecord) -> None:
        self.key_requests.labels(key, rec.status, rec.reject_reason or "").inc()
        if rec.status == "ok":
            self.key_tokens.labels(key, "prompt").inc(rec.prompt_tokens)
            self.key_tokens.labels(key, "output").inc(rec.output_tokens)
            if rec.ttft_s is not None:
                self.key_ttft.labels(key).observe(rec.ttft_s)


def make_tracer_provider(exporter: str, endpoint: str | None) -> TracerProvider | None:
    if exporter == "none":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "conductor-gateway"}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
    return provider


class RequestSpans:
    """OpenTelemetry spans of one finished request, built from its record (a lifecycle
    observer): the request, and its decide, prefill, transfer and decode phases."""

    def __init__(self, tracer: trace.Tracer, wall_offset_ns: int):
        self.tracer, self.wall_offset_ns = tracer, wall_offset_ns

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self.wall_offset_ns

    def __call__(self, rec: RequestRecord, endpoint: str) -> None:
        root = self.tracer.start_span("conductor.request", start_time=self._ns(rec.arrival_s),
                                      attributes={"conductor.request_id": rec.request_id,
                                                  "conductor.endpoint": endpoint})
        if rec.decided_s is not None:
            self._child(root, "decide", rec.arrival_s, rec.decided_s)
        if rec.prefill_instance is not None:
            root.set_attributes({"conductor.prefill": rec.prefill_instance, "conductor.decode": rec.decode_instance,
                                 "conductor.hit_tokens": rec.hit_tokens,
                                 "conductor.predicted_ttft_s": rec.predicted_ttft_s})
        if rec.prefill_start_s is not None and rec.prefill_end_s is not None:
            self._child(root, "prefill", rec.prefill_start_s, rec.prefill_end_s,
                        {"conductor.instance": rec.prefill_instance})
        end = rec.end_s if rec.end_s is not None else rec.arrival_s
        if rec.first_token_s is not None and rec.decode_start_s is not None:
            self._child(root, "transfer", rec.decode_start_s, rec.first_token_s)
            self._child(root, "decode", rec.first_token_s, end)
        if rec.ttft_s is not None:
            root.set_attribute("conductor.actual_ttft_s", rec.ttft_s)
        root.set_attributes({"conductor.status": rec.status, "http.status_code": rec.http_status or 0})
        root.end(end_time=self._ns(end))

    def _child(self, parent: trace.Span, name: str, start: float, end: float, attrs: dict | None = None) -> None:
        s = self.tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=self._ns(start),
                                   attributes=attrs)
        s.end(end_time=self._ns(end))


class TelemetryWriter:
    """One JSONL line per finished request: the schema the predictors train on."""

    def __init__(self, path: str | None):
        self._f: IO[str] | None = open(path, "a", buffering=1) if path else None

    def write(self, rec: RequestRecord) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec.to_dict()) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
