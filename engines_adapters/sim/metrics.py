"""Prometheus ``/metrics`` with vLLM v1's metric names (labels ``model_name``, ``engine``).

Gauges and the prefix-cache counters are read from the engine model at scrape time; latency
histograms are observed as requests progress. All times are *modelled* seconds (equal to wall
seconds at ``--time-scale 1``), so they describe the simulated GPU, not this process's lag.
"""
from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .model import EngineModel, Finished

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")


class Metrics(Protocol):
    """What the driver and the API use of a metrics set: vLLM's (:class:`EngineMetrics`) or SGLang's names."""

    registry: CollectorRegistry
    ttft: Any
    itl: Any

    def finished(self, f: Finished) -> None: ...

    def render(self) -> bytes: ...


class _EngineCollector:
    """Scrape-time view of the engine's load facts."""

    def __init__(self, engine: EngineModel, labels: tuple[str, str]):
        self.engine = engine
        self.labels = list(labels)

    def collect(self):
        st = self.engine.stats()
        lv = self.labels

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the model execution batch.", st.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed (incl. KV loads).", st.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", st.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", st.prefix_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", st.preemptions)
        yield gauge("sim:num_requests_kv_held", "Finished prefills holding KV for a decode instance.", st.held)
        yield gauge("sim:queued_prefill_tokens", "Prompt tokens not yet computed (waiting + running).",
                    st.queued_prefill_tokens)
        yield gauge("sim:kv_cache_free_blocks", "Free or evictable KV blocks.", st.kv_free_blocks)
        yield gauge("sim:host_cache_blocks", "Blocks held by the host-memory tier.", st.host_blocks)
        yield counter("sim:host_cache_hits", "Prefix tokens reloaded from the host tier.", st.host_hits)
        yield counter("sim:store_hits", "Prefix tokens loaded from the shared KV store.", st.store_hits)
        yield counter("sim:store_loads", "KV loads from the shared store.", st.store_loads)
        yield counter("sim:store_load_seconds", "Modelled seconds spent loading KV from the shared store.",
                      st.store_load_s)
        yield self._cache_config_info()

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's info gauge (value 1) whose labels carry the KV cache's configuration, as vLLM
        publishes CacheConfig (labelled by engine, not model): a client learns the capacity
        (num_gpu_blocks x block_size) from it instead of guessing."""
        e = self.engine
        info = {"block_size": str(e.block_size), "cache_dtype": "auto", "enable_prefix_caching": "True",
                "gpu_memory_utilization": str(e.profile.efficiency.get("gpu_memory_utilization", 0.9)),
                "num_cpu_blocks": str(e.kv.host_capacity), "num_gpu_blocks": str(e.kv.capacity),
                "prefix_caching_hash_algo": e.hash_algo, "engine": self.labels[1]}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        return g


class EngineMetrics:
    def __init__(self, engine: EngineModel, model_name: str, engine_index: str = "0"):
        self.registry = CollectorRegistry()
        labels = (model_name, engine_index)
        self.registry.register(_EngineCollector(engine, labels))
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time in the waiting queue.", REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time in the prefill phase.", REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Time in the decode phase.", REQUEST_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", LABELS,
                                     registry=r).labels(*labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", LABELS,
                                         registry=r).labels(*labels)
        self._success = Counter("vllm:request_success", "Successfully finished requests.",
                                LABELS + ("finished_reason",), registry=r)
        self._labels = labels

    def finished(self, f: Finished) -> None:
        self.e2e.observe(f.finished - f.arrival)
        self.queue.observe(max(0.0, f.scheduled - f.arrival))
        self.prefill.observe(max(0.0, f.first_token - f.scheduled))
        self.decode.observe(max(0.0, f.finished - f.first_token))
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.output_tokens)
        self._success.labels(*self._labels, f.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
