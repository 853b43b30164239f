"""Talking to a vLLM 0.33-compatible engine (real vLLM or the sim engine): the two-step
prefill/decode protocol (NixlConnector / Mooncake connector style), health and load scraping.

Wire details: ../shared/docs/PROTOCOLS.md §4-5.
"""
from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


class UpstreamError(Exception):
    """An engine failed; ``retryable`` when nothing reached the client and another pair may work."""

    retryable = False

    def __init__(self, message: str, engine: str | None = None):
        super().__init__(message)
        self.engine = engine


class UpstreamUnavailable(UpstreamError):
    retryable = True


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamHTTPError(UpstreamError):
    def __init__(self, status: int, body: bytes, engine: str):
        super().__init__(f"engine {engine} answered {status}: {body[:200]!r}", engine)
        self.status, self.body = status, body
        self.kv_lost = False  # a decode leg refused for want of the prefill's KV (the pair's fault)
        # an engine's 5xx may be its own fault (another pair may work); 4xx is the request's fault
        self.retryable = status >= 500


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: same request, one token, no stream, asking the engine to keep KV for decode."""
    b = copy.copy(body)
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b.pop("stream_options", None)
    b.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens, and the leg makes one token
    b["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return b


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's own request with the prefill's transfer params."""
    b = copy.copy(body)
    if kv_transfer_params is not None:
        b["kv_transfer_params"] = kv_transfer_params
    return b


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class LoadSample:
    running: int
    waiting: int
    kv_usage: float
    kv_capacity_tokens: int | None = None  # num_gpu_blocks x block_size, when the engine says


def parse_vllm_metrics(text: str) -> LoadSample:
    """vLLM's request gauges summed over label sets (models, DP engines), KV usage the highest;
    older names (gpu_cache_usage_perc) accepted; the KV capacity in tokens from
    ``vllm:cache_config_info`` (num_gpu_blocks x block_size), summed over DP engines."""
    vals: dict[str, float] = {}
    capacity: int | None = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":  # labels carry the config; one set per DP engine
                tokens = _cache_tokens(s.labels)
                if tokens is not None:
                    capacity = (capacity or 0) + tokens
            elif s.name.endswith("_perc"):  # a ratio per engine/model series: the fullest one counts
                vals[s.name] = max(vals.get(s.name, 0.0), s.value)
            else:
                vals[s.name] = vals.get(s.name, 0.0) + s.value
    kv = vals.get("vllm:kv_cache_usage_perc", vals.get("vllm:gpu_cache_usage_perc", 0.0))
    return LoadSample(int(vals.get("vllm:num_requests_running", 0)), int(vals.get("vllm:num_requests_waiting", 0)), kv,
                      capacity)


def _cache_tokens(labels: dict[str, str]) -> int | None:
    """KV capacity in tokens from vllm:cache_config_info's labels; None when not (yet) known
    (vLLM publishes num_gpu_blocks "None" before its profiling run)."""
    try:
        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return tokens if tokens > 0 else None


class EngineClient:
    """One engine behind its base URL. All calls are bounded by timeouts; none blocks the loop."""

    def __init__(self, session: aiohttp.ClientSession, engine_id: str, url: str, *, connect_timeout_s: float = 5.0,
                 timeout_s: float = 600.0):
        self.session, self.id, self.url = session, engine_id, url.rstrip("/")
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s

    def _timeout(self, streaming: bool) -> aiohttp.ClientTimeout:
        """A whole-answer limit for legs read at once; an idle limit for streams, which may
        legitimately run longer than any total limit (long generations)."""
        if streaming:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s)
        return aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict | None, dict]:
        """Run the prefill leg; returns the engine's ``kv_transfer_params`` for the decode leg and
        its ``usage`` (whose ``cached_tokens`` are the prefill instance's own prefix hits)."""
        data = await self.post_json(path, prefill_body(body), headers)
        try:
            answer = json.loads(data)
            return answer.get("kv_transfer_params"), answer.get("usage") or {}
        except (ValueError, AttributeError):
            raise UpstreamHTTPError(502, data, self.id) from None

    async def post_json(self, path: str, body: Any, headers: dict[str, str]) -> bytes:
        """POST and read the whole answer; a non-200 answer raises UpstreamHTTPError."""
        resp = await self.open(path, body, headers, streaming=False)
        try:
            data = await resp.read()
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"engine {self.id} timed out", self.id) from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(f"engine {self.id} failed: {e}", self.id) from None
        finally:
            resp.close()  # read to the end, or abandoned: never hand a half-read connection back
        if resp.status != 200:
            raise UpstreamHTTPError(resp.status, data, self.id)
        return data

    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str], *,
                   streaming: bool = True) -> aiohttp.ClientResponse:
        """Start a request and return the response once headers arrived (caller reads and closes it)."""
        try:
            resp = await self.session.request(
                "POST", self.url + path, data=_dumps(body),
                headers={**headers, "content-type": "application/json"}, timeout=self._timeout(streaming))
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            # could not connect (a connect timeout is also a TimeoutError): another pair may work
            raise UpstreamUnavailable(f"engine {self.id} unreachable: {e}", self.id) from None
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"engine {self.id} timed out", self.id) from None
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(f"engine {self.id} unreachable: {e}", self.id) from None
        return resp

    async def health(self, timeout_s: float = 2.0) -> bool:
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def load(self, timeout_s: float = 2.0) -> LoadSample | None:
        try:
            async with self.session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                return parse_vllm_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def models(self, timeout_s: float = 2.0) -> list[str]:
        try:
            async with self.session.get(self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                data = await r.json()
            return [m["id"] for m in data.get("data", [])]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            return []

    async def tokenize(self, payload: dict[str, Any]) -> list[int]:
        return list(json.loads(await self.post_json("/tokenize", payload, {}))["tokens"])
