"""Async HTTP clients of a Mooncake-style store: the master's router-facing admin HTTP (what the
gateway reads, real master or ``conductor sim-store``) and the sim store's data path (what the
sim engines call). Every failure is a :class:`StoreUnavailable` naming the URL."""
from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import aiohttp

#: Keys per ``/batch_query_keys`` call: a query string stays well under common request-line
#: limits (vLLM keys are about 110 characters; SGLang HiCache asks 128 pages at a time).
QUERY_BATCH = 48


class StoreUnavailable(Exception):
    """The store could not be reached or answered nonsense."""


class StoreClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0):
        self.session, self.url = session, url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self.session.request(method, self.url + path, json=body, timeout=self.timeout) as r:
                if r.status >= 500:
                    raise StoreUnavailable(f"store {self.url} answered {r.status} to {path}")
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise StoreUnavailable(f"store {self.url} unreachable: {e!r}") from None
        if r.status >= 400:
            raise StoreUnavailable(f"store {self.url} refused {path}: {data}")
        return data

    # --- the master's admin HTTP -----------------------------------------------------------
    async def health(self) -> bool:
        try:
            data = await self._call("GET", "/health")
        except StoreUnavailable:
            return False
        return isinstance(data, dict) and data.get("status") == "ok"

    async def batch_query(self, keys: list[str]) -> list[bool]:
        """Which keys the master holds (memory or disk replicas); no lease is taken."""
        out: list[bool] = []
        for i in range(0, len(keys), QUERY_BATCH):
            part = keys[i:i + QUERY_BATCH]
            data = await self._call("GET", "/batch_query_keys?keys=" + ",".join(quote(k, safe="@:_-.") for k in part))
            got = data.get("data") if isinstance(data, dict) else None
            if not isinstance(got, dict):
                raise StoreUnavailable(f"store {self.url}: /batch_query_keys answered no data map")
            out += [bool((got.get(k) or {}).get("ok")) for k in part]
        return out

    async def prefix(self, keys: list[str]) -> int:
        """Leading keys held, asking batch by batch and stopping at the first batch with a miss."""
        n = 0
        for i in range(0, len(keys), QUERY_BATCH):
            flags = await self.batch_query(keys[i:i + QUERY_BATCH])
            if not all(flags):
                return n + flags.index(False)
            n += len(flags)
        return n

    async def all_keys(self) -> list[str]:
        try:
            async with self.session.get(self.url + "/get_all_keys", timeout=self.timeout) as r:
                if r.status != 200:
                    raise StoreUnavailable(f"store {self.url} answered {r.status} to /get_all_keys")
                return [k for k in (await r.text()).splitlines() if k]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"store {self.url} unreachable: {e!r}") from None

    # --- the sim store's data path -----------------------------------------------------------
    async def put(self, keys: list[str], sizes: list[int]) -> dict[str, Any]:
        return await self._call("POST", "/api/put", {"keys": keys, "sizes": sizes})

    async def get(self, keys: list[str]) -> tuple[int, float]:
        """(leading keys found, modelled seconds their transfer takes)."""
        data = await self._call("POST", "/api/get", {"keys": keys})
        return int(data["found"]), float(data["seconds"])
