"""SGLang 0.5.23's prefill/decode protocol (``--disaggregation-mode``), driven as SGLang's own router
does (sgl-model-gateway ``pd_router.rs``: dual dispatch), and SGLang's metric names.

One request goes to the prefill and the decode instance *at once*, the client's body plus
``bootstrap_host`` (the prefill's host), ``bootstrap_port`` (its bootstrap server, default 8998)
and ``bootstrap_room`` (a random id in [1, 2^63-1], unique among this gateway's handovers in
flight; 0 is SGLang's health-check room). The decode instance finds the prefill's KV by the room
and streams the answer; the prefill's own answer (read whole) tells how much of the prompt its
cache held. Unlike the router, the prefill leg is sent with ``stream: false`` so that answer is
one JSON body (SGLang computes the same prefill either way).

Failure semantics (the gateway's, the same as for vLLM; :mod:`.dual`): nothing reaches the
client before :meth:`SGLangDriver.open` returns, so any failure there is an
:class:`UpstreamError`; when either leg fails the other is aborted (its connection closed: SGLang
aborts the request and frees its KV), and when ``open`` is cancelled (the client left) both are.
A prefill refusing the room as already taken (409) is the pair's failure, retried with a fresh
room on another pair.
"""
from __future__ import annotations

import copy
import random
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from engines_adapters.drivers.base import DecodeResponse, LoadSample, Pair, PairHooks, PairRequest, metric_samples
from engines_adapters.drivers.dual import dual_dispatch, one_leg

DEFAULT_BOOTSTRAP_PORT = 8998
MAX_ROOM = 2**63 - 1


#: the samples :func:`parse_sglang_metrics` reads (the others are never parsed)
_LOAD_SAMPLES = metric_samples([f"sglang:{n}" for n in (
    "token_usage", "num_running_reqs", "num_queue_reqs", "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs", "max_total_num_tokens")])


def parse_sglang_metrics(text: str) -> LoadSample:
    """SGLang's scheduler gauges summed over DP ranks (token usage: the fullest rank); waiting
    counts the PD queues too (decode requests waiting for or receiving their KV); the KV capacity
    is ``sglang:max_total_num_tokens``."""
    vals: dict[str, float] = {}
    usage = 0.0
    for fam in text_string_to_metric_families(_LOAD_SAMPLES(text)):
        for s in fam.samples:
            if s.name == "sglang:token_usage":
                usage = max(usage, s.value)
            else:
                vals[s.name] = vals.get(s.name, 0.0) + s.value
    waiting = sum(vals.get(f"sglang:{n}", 0.0) for n in (
        "num_queue_reqs", "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs"))
    cap = int(vals.get("sglang:max_total_num_tokens", 0)) or None
    return LoadSample(int(vals.get("sglang:num_running_reqs", 0)), int(waiting), usage, cap)


def with_bootstrap(body: dict[str, Any], host: str, port: int | None, room: int) -> dict[str, Any]:
    """The client's body with the three fields SGLang's router injects."""
    b = copy.copy(body)
    b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"] = host, port, room
    return b


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: read whole (its usage says what its cache held)."""
    b = copy.copy(body)
    b["stream"] = False
    b.pop("stream_options", None)
    return b


class SGLangDriver:
    """Drives an SGLang pair by dual dispatch with a bootstrap room."""

    flavor = "sglang"

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.SystemRandom()
        self._rooms: set[int] = set()  # rooms of handovers in flight: never reused while live

    def new_room(self) -> int:
        while True:
            room = self._rng.randint(1, MAX_ROOM)
            if room not in self._rooms:
                return room

    async def open(self, pair: Pair, request: PairRequest, hooks: PairHooks) -> DecodeResponse:
        if pair.colocated:
            return await one_leg(pair, request.path, request.body, request.headers, hooks)
        host = urlsplit(pair.prefill.url).hostname or "127.0.0.1"
        port = getattr(pair.prefill, "bootstrap_port", None) or DEFAULT_BOOTSTRAP_PORT
        room = self.new_room()
        self._rooms.add(room)
        body = with_bootstrap(request.body, host, port, room)
        try:
            return await dual_dispatch(pair, request.path, prefill_leg(body), body, request.headers, hooks)
        finally:
            self._rooms.discard(room)
