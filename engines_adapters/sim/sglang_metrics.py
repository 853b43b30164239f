"""Prometheus ``/metrics`` with SGLang 0.5.23's metric names (``sglang:...``; labels
``model_name``, ``engine_type`` (prefill | decode | unified), ``tp_rank``, ``pp_rank``,
``moe_ep_rank``), the same interface as :class:`.metrics.EngineMetrics` for the engine driver.

Gauges are read from the engine model at scrape time; histograms observed as requests progress,
in modelled seconds.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .metrics import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS
from .model import EngineModel, Finished

LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
ENGINE_TYPES = {"prefill": "prefill", "decode": "decode", "both": "unified"}


class _Collector:
    def __init__(self, engine: EngineModel, labels: list[str], pd_queues: Callable[[], tuple[int, int]]):
        self.engine, self.labels, self.pd_queues = engine, labels, pd_queues

    def collect(self):
        e = self.engine
        st = e.stats()
        total = e.kv.capacity * e.block_size
        used = (st.kv_capacity_blocks - st.kv_free_blocks) * e.block_size
        evictable = e.kv.n_lru * e.block_size
        hit_rate = st.prefix_hits / st.prefix_queries if st.prefix_queries else 0.0
        bootstrap, prealloc = self.pd_queues()
        for name, doc, value in (
            ("sglang:num_running_reqs", "The number of running requests.", st.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", st.waiting),
            ("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", 0),
            ("sglang:token_usage", "The token usage.", st.kv_usage),
            ("sglang:num_used_tokens", "The number of used tokens.", used),
            ("sglang:kv_used_tokens", "KV tokens referenced by requests.", used),
            ("sglang:kv_available_tokens", "KV tokens free or evictable.", total - used),
            ("sglang:kv_evictable_tokens", "KV tokens cached and evictable.", evictable),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.", total),
            ("sglang:page_size", "Tokens per KV page.", e.block_size),
            ("sglang:context_len", "The model's context length.", e.max_model_len),
            ("sglang:num_prefill_bootstrap_queue_reqs", "Prefill requests holding KV for a decode instance.",
             bootstrap),
            ("sglang:num_decode_prealloc_queue_reqs", "Decode requests waiting for their prefill's KV.", prealloc),
            ("sglang:num_decode_transfer_queue_reqs", "Decode requests whose KV is being transferred.", st.loading),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g


class SGLangMetrics:
    def __init__(self, engine: EngineModel, model_name: str, role: str,
                 pd_queues: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        self.registry = r = CollectorRegistry()
        labels = (model_name, ENGINE_TYPES[role], "0", "0", "0")
        r.register(_Collector(engine, list(labels), pd_queues))

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=r).labels(*labels)

        self.ttft = hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                        REQUEST_BUCKETS)
        self.queue = hist("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests", "Number of requests processed.")

    def finished(self, f: Finished) -> None:
        self.e2e.observe(f.finished - f.arrival)
        self.queue.observe(max(0.0, f.scheduled - f.arrival))
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.output_tokens)
        self.cached_tokens.inc(f.cached_tokens)
        self.requests.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
