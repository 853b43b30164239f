"""One engine's HTTP surface as the gateway uses it: health, load (its metrics, parsed by the
engine's flavour), served models, tokenize, and requests (read whole, or opened up to the response
headers). Engine-family protocol (how a prefill/decode pair is driven) lives in
``engines_adapters.drivers``; this client only speaks HTTP.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from typing import Any

import aiohttp

from engines_adapters.drivers import LoadSample, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable, parse_metrics
from engines_adapters.drivers.base import LocalResourceError

log = logging.getLogger(__name__)

#: errnos of a failed connect that are the gateway's own shortage, not the engine's fault
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})
_last_local_log = [0.0]


def local_os_error(e: BaseException) -> OSError | None:
    """The local resource error (out of descriptors, ports, buffers) behind a failed connect, if any."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 5:  # aiohttp wraps the OSError (os_error, __cause__)
        inner = getattr(cur, "os_error", None)
        for c in (cur, inner):
            if isinstance(c, OSError) and c.errno in LOCAL_ERRNOS:
                return c
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return None


def _log_local(engine_id: str, err: OSError) -> None:
    now = time.monotonic()
    if now - _last_local_log[0] >= 5.0:  # at most one line every 5 s under a storm
        _last_local_log[0] = now
        log.warning("cannot open a connection to engine %s: %s (the gateway's own limit; not counted "
                    "against the engine)", engine_id, err.strerror or err)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class EngineSession:
    """The gateway's shared session as one engine's calls use it: each call carries the engine's
    API key (vLLM's ``--api-key``: ``Authorization: Bearer``) and asks for identity encoding, and
    a body the engine compresses anyway is decompressed: the gateway forwards an engine's bytes
    without its ``Content-Encoding``, so they must never be compressed."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None = None):
        self._session = session
        self.headers = {"accept-encoding": "identity"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def request(self, method: str, url: str, *, headers: dict[str, str] | None = None, **kw: Any) -> Any:
        return self._session.request(method, url, headers={**(headers or {}), **self.headers}, auto_decompress=True,
                                     **kw)

    def get(self, url: str, **kw: Any) -> Any:
        return self.request("GET", url, **kw)

    def __getattr__(self, name: str) -> Any:  # closed, close(), ...: the shared session's own
        return getattr(self._session, name)


class EngineClient:
    """One engine behind its base URL. All calls are bounded by timeouts; none blocks the loop.
    ``flavor`` names the engine family (``engines_adapters.drivers.FLAVORS``): its metric names.
    ``bootstrap_port``: where an SGLang prefill instance's bootstrap server listens."""

    def __init__(self, session: aiohttp.ClientSession, engine_id: str, url: str, *, flavor: str = "vllm",
                 connect_timeout_s: float = 5.0, timeout_s: float = 300.0, first_byte_timeout_s: float = 60.0,
                 health_timeout_s: float = 2.0, api_key: str | None = None, bootstrap_port: int | None = None):
        self.session: Any = EngineSession(session, api_key)
        self.id, self.url, self.flavor = engine_id, url.rstrip("/"), flavor
        self.bootstrap_port = bootstrap_port  # an SGLang prefill's bootstrap server (None: SGLang's 8998)
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self.first_byte_timeout_s, self.health_timeout_s = first_byte_timeout_s, health_timeout_s
        # monotonic time of the engine's last answer to a request (headers in): a request that timed out
        # while the engine answered others waited in its queue; no hang (``GatewayCluster.report_failure``)
        self.answered_at = float("-inf")

    def _timeout(self, streaming: bool | None) -> aiohttp.ClientTimeout:
        """Answers read whole (a prefill leg) are the first byte: bounded by the first-byte limit.
        A streamed answer's headers are its first byte (bounded in ``open``) and its body may run
        longer than any total limit (the caller bounds the silence between chunks); a decode leg
        not streamed sends everything at the end, bounded by the whole-answer limit."""
        if streaming is None:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        total = self.timeout_s if streaming else self.first_byte_timeout_s
        return aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout_s)

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
        # a streamed answer's headers come before its first token: the first-byte limit bounds them
        streamed = streaming and isinstance(body, dict) and bool(body.get("stream"))
        request = self.session.request("POST", self.url + path, data=_dumps(body),
                                       headers={**headers, "content-type": "application/json"},
                                       timeout=self._timeout(None if streamed else streaming))
        try:
            async with asyncio.timeout(self.first_byte_timeout_s if streamed else None):
                resp = await request
        except (aiohttp.ClientError, OSError) as e:  # TimeoutError is an OSError
            local = local_os_error(e)
            if local is not None:
                _log_local(self.id, local)
                raise LocalResourceError(f"gateway cannot open a connection: {local.strerror or local}",
                                         self.id) from None
            if isinstance(e, asyncio.TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError):
                raise UpstreamTimeout(f"engine {self.id} timed out", self.id) from None
            # could not connect (a connect timeout included), or the connection broke: another pair may work
            raise UpstreamUnavailable(f"engine {self.id} unreachable: {e}", self.id) from None
        self.answered_at = time.monotonic()
        return resp

    async def get_json(self, url: str, timeout_s: float = 5.0) -> Any:
        """GET a JSON document from an engine-side URL (e.g. a prefill's bootstrap server);
        UpstreamUnavailable when it cannot be had."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    raise UpstreamUnavailable(f"engine {self.id}: {url} answered {r.status}", self.id)
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise UpstreamUnavailable(f"engine {self.id}: {url} unreachable: {e}", self.id) from None

    async def health(self, timeout_s: float | None = None) -> bool | None:
        """True when the engine answered 200 in time; False when it did not; None when the gateway
        could not even try (out of descriptors or ports): no evidence against the engine."""
        try:
            async with self.session.get(self.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s or self.health_timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            local = local_os_error(e)
            if local is not None:
                _log_local(self.id, local)
                return None
            return False

    async def load(self, timeout_s: float | None = None) -> LoadSample | None:
        try:
            async with self.session.get(self.url + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s or self.health_timeout_s)) as r:
                if r.status != 200:
                    return None
                return parse_metrics(self.flavor, await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def models(self, timeout_s: float | None = None) -> list[str]:
        return [m["id"] for m in await self.model_cards(timeout_s)]

    async def model_cards(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """``/v1/models`` entries with an ``id`` (vLLM lists LoRA adapters there too, each with a
        ``parent``: the base model it applies to)."""
        try:
            async with self.session.get(self.url + "/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s or self.health_timeout_s)) as r:
                data = await r.json()
            return [m for m in data.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            return []

    async def tokenize(self, payload: dict[str, Any]) -> list[int]:
        return list(json.loads(await self.post_json("/tokenize", payload, {}))["tokens"])
