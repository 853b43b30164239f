"""One engine's HTTP surface as the gateway uses it: health, load (its metrics, parsed by the
engine's flavour), served models, tokenize, and requests (read whole, or opened up to the response
headers). Engine-family protocol (how a prefill/decode pair is driven) lives in
``engines_adapters.drivers``; this client only speaks HTTP.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from engines_adapters.drivers import LoadSample, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable, parse_metrics


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
                 connect_timeout_s: float = 5.0, timeout_s: float = 600.0, api_key: str | None = None,
                 bootstrap_port: int | None = None):
        self.session: Any = EngineSession(session, api_key)
        self.id, self.url, self.flavor = engine_id, url.rstrip("/"), flavor
        self.bootstrap_port = bootstrap_port  # an SGLang prefill's bootstrap server (None: SGLang's 8998)
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s

    def _timeout(self, streaming: bool) -> aiohttp.ClientTimeout:
        """A whole-answer limit for legs read at once; an idle limit for streams, which may
        legitimately run longer than any total limit (long generations)."""
        if streaming:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s)
        return aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)

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
                return parse_metrics(self.flavor, await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def models(self, timeout_s: float = 2.0) -> list[str]:
        return [m["id"] for m in await self.model_cards(timeout_s)]

    async def model_cards(self, timeout_s: float = 2.0) -> list[dict[str, Any]]:
        """``/v1/models`` entries with an ``id`` (vLLM lists LoRA adapters there too, each with a
        ``parent``: the base model it applies to)."""
        try:
            async with self.session.get(self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                data = await r.json()
            return [m for m in data.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            return []

    async def tokenize(self, payload: dict[str, Any]) -> list[int]:
        return list(json.loads(await self.post_json("/tokenize", payload, {}))["tokens"])
