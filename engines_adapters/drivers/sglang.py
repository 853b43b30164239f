"""SGLang 0.5.23's prefill/decode protocol (``--disaggregation-mode``), driven as SGLang's own router
does (sgl-model-gateway ``pd_router.rs``: dual dispatch), and SGLang's metric names.

One request goes to the prefill and the decode instance *at once*, the client's body plus
``bootstrap_host`` (the prefill's host), ``bootstrap_port`` (its bootstrap server, default 8998)
and ``bootstrap_room`` (a random id in [1, 2^63-1], unique among this gateway's handovers in
flight; 0 is SGLang's health-check room). The decode instance finds the prefill's KV by the room
and streams the answer; the prefill's own answer (read whole) tells how much of the prompt its
cache held. Unlike the router, the prefill leg is sent with ``stream: false`` so that answer is
one JSON body (SGLang computes the same prefill either way).

Failure semantics (the gateway's, the same as for vLLM): nothing reaches the client before
:meth:`SGLangDriver.open` returns, so any failure there is an :class:`UpstreamError`; when either
leg fails the other is aborted (its connection closed: SGLang aborts the request and frees its
KV), and when ``open`` is cancelled (the client left) both are. A prefill refusing the room as
already taken (409) is the pair's failure, retried with a fresh room on another pair.
"""
from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engines_adapters.drivers.base import (
    DecodeResponse,
    LoadSample,
    Pair,
    PairHooks,
    PairRequest,
    UpstreamError,
    UpstreamHTTPError,
)

DEFAULT_BOOTSTRAP_PORT = 8998
MAX_ROOM = 2**63 - 1
#: A decode leg refused with one of these lost (or never found) the prefill's KV: the pair's failure.
KV_LOST = (404, 409, 410)


def parse_sglang_metrics(text: str) -> LoadSample:
    """SGLang's scheduler gauges summed over DP ranks (token usage: the fullest rank); waiting
    counts the PD queues too (decode requests waiting for or receiving their KV); the KV capacity
    is ``sglang:max_total_num_tokens``."""
    vals: dict[str, float] = {}
    usage = 0.0
    for fam in text_string_to_metric_families(text):
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


def _cached_tokens(data: bytes) -> int | None:
    try:
        answer = json.loads(data)
        if "meta_info" in answer:  # native /generate
            return answer["meta_info"].get("cached_tokens")
        return ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError, TypeError):
        return None


async def _read_error(resp: DecodeResponse) -> bytes:
    try:
        return await resp.read()
    except aiohttp.ClientError:
        return b""
    finally:
        resp.close()


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
            hooks.handed_over()
            resp = await pair.decode.open(request.path, request.body, request.headers)
            if resp.status != 200:
                raise UpstreamHTTPError(resp.status, await _read_error(resp), pair.decode.id)
            return resp
        host = urlsplit(pair.prefill.url).hostname or "127.0.0.1"
        port = getattr(pair.prefill, "bootstrap_port", None) or DEFAULT_BOOTSTRAP_PORT
        room = self.new_room()
        self._rooms.add(room)
        body = with_bootstrap(request.body, host, port, room)
        hooks.prefill_started()
        prefill = asyncio.ensure_future(pair.prefill.post_json(request.path, prefill_leg(body), request.headers))
        decode = asyncio.ensure_future(pair.decode.open(request.path, body, request.headers))
        resp: DecodeResponse | None = None
        out: DecodeResponse | None = None
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode.done() and prefill.exception() is not None:
                raise self._prefill_failed(prefill.exception(), pair)  # the decode would only wait for it
            resp = await decode  # a transport failure raises UpstreamError (retryable)
            if resp.status != 200:
                status, data = resp.status, await _read_error(resp)
                resp = None
                raise UpstreamHTTPError(status, data, pair.decode.id, kv_lost=status in KV_LOST)
            try:
                data = await prefill
            except UpstreamError as e:
                raise self._prefill_failed(e, pair) from None
            hooks.prefill_finished(_cached_tokens(data))
            out, resp = resp, None
            return out
        finally:
            self._rooms.discard(room)
            if resp is not None:
                resp.close()  # aborts the decode request
            for t in (prefill, decode):
                t.cancel()  # a leg still running is closed: the engine aborts it
            await asyncio.gather(prefill, decode, return_exceptions=True)
            late = decode.result() if decode.done() and not decode.cancelled() and not decode.exception() else None
            if late is not None and late is not out:
                late.close()  # a decode answer that arrived as we gave up: abort it too

    @staticmethod
    def _prefill_failed(e: BaseException | None, pair: Pair) -> UpstreamError:
        if isinstance(e, UpstreamHTTPError) and e.status == 409:  # room taken: the pair's failure, not the client's
            e.kv_lost, e.retryable = True, True
        return e if isinstance(e, UpstreamError) else UpstreamError(f"prefill {pair.prefill.id} failed: {e}",
                                                                     pair.prefill.id)

