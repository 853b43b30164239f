"""vLLM's two-step disaggregation protocol with Mooncake-connector style ``kv_transfer_params``.

1. Prefill: the router POSTs the body with ``kv_transfer_params.do_remote_decode = true``; the
   prefill engine computes the prompt, answers one token and ``kv_transfer_params =
   {"do_remote_prefill": true, "do_remote_decode": false, "remote_host", "remote_port",
   "remote_request_id", "remote_engine_id"}`` and holds the KV (until pulled or ``--kv-hold-timeout``).
2. Decode: the router POSTs the original body with those params. The decode engine pulls:
   ``POST http://remote_host:remote_port/kv/pull {"remote_request_id"}`` answers the KV's size
   (the payload is metadata only; the engine model charges bytes / bandwidth + latency), and once
   the modelled transfer is done ``POST /kv/release`` frees the prefill's blocks. A missing or
   expired hold is a 410 on the decode request, at once.

Only loopback prefill hosts are pulled from (this engine never reaches out beyond 127.0.0.1).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class KVParamsError(ValueError):
    """Malformed ``kv_transfer_params`` (HTTP 400)."""


class PullError(Exception):
    """The prefill side could not hand over the KV."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class KVParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_kv_params(raw: Any) -> KVParams | None:
    """Validate a request's ``kv_transfer_params``; None when absent (a plain request)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVParamsError("kv_transfer_params must be an object")
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        v = raw.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise KVParamsError(f"kv_transfer_params.{key} must be a boolean")
        flags[key] = v
    if flags["do_remote_decode"] and flags["do_remote_prefill"]:
        raise KVParamsError("kv_transfer_params cannot set both do_remote_decode and do_remote_prefill")
    if not flags["do_remote_prefill"]:
        return KVParams(do_remote_decode=flags["do_remote_decode"])
    host, port, rid = raw.get("remote_host"), raw.get("remote_port"), raw.get("remote_request_id")
    if not isinstance(host, str) or not host:
        raise KVParamsError("kv_transfer_params.remote_host must be a non-empty string")
    if not _is_loopback(host):
        raise KVParamsError(f"kv_transfer_params.remote_host {host!r} is not a loopback address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVParamsError("kv_transfer_params.remote_port must be an integer TCP port")
    if not isinstance(rid, str) or not rid:
        raise KVParamsError("kv_transfer_params.remote_request_id must be a non-empty string")
    return KVParams(do_remote_prefill=True, remote_host=host, remote_port=port, remote_request_id=rid)


def peer_host(host: str) -> str:
    """One spelling per loopback host, to compare peers: ``localhost`` is ``127.0.0.1``."""
    host = host.strip("[]").lower()
    return "127.0.0.1" if host == "localhost" else host


def parse_peer(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of a prefill peer; ValueError when malformed or
    not on loopback."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not _is_loopback(host):
        raise ValueError(f"{text!r} is not HOST:PORT on a loopback address")
    return peer_host(host), int(port)


def prefill_response_params(host: str, port: int, request_id: str, engine_id: str) -> dict[str, Any]:
    """What a prefill response carries for the router to hand to the decode instance."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": host, "remote_port": port,
            "remote_request_id": request_id, "remote_engine_id": engine_id}


class KVPuller:
    """The decode side's HTTP client to prefill instances (one pooled session per server)."""

    def __init__(self, timeout_s: float = 10.0, peers: frozenset[tuple[str, int]] | None = None):
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.peers = peers  # (host, port) of the prefill instances it may pull from; None: any on loopback
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    @staticmethod
    def _url(p: KVParams, path: str) -> str:
        host = p.remote_host
        if host is not None and ":" in host:
            host = f"[{host.strip('[]')}]"
        return f"http://{host}:{p.remote_port}{path}"

    def known(self, p: KVParams) -> bool:
        return self.peers is None or (peer_host(p.remote_host or ""), p.remote_port) in self.peers

    async def pull(self, p: KVParams) -> dict[str, Any]:
        """The held KV's metadata; raises PullError when it is gone, unreachable or not a peer's."""
        if not self.known(p):
            raise PullError(403, f"{p.remote_host}:{p.remote_port} is not a known prefill peer of this engine "
                                 f"(--kv-peers)", "kv_transfer_unknown_peer")
        try:
            async with self._sess().post(self._url(p, "/kv/pull"),
                                         json={"remote_request_id": p.remote_request_id}) as r:
                body = await r.json(content_type=None)
                if r.status == 200:
                    return body
                msg = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise PullError(502, f"cannot reach the prefill instance {p.remote_host}:{p.remote_port}: "
                                 f"{type(e).__name__}: {e}", "kv_transfer_unreachable") from None
        if r.status == 404:
            raise PullError(410, f"the KV of remote request {p.remote_request_id!r} is gone from the prefill "
                                 f"instance {p.remote_host}:{p.remote_port} (expired, released or never held)",
                            "kv_transfer_expired")
        raise PullError(502, f"the prefill instance refused the KV pull ({r.status}): {msg}", "kv_transfer_failed")

    def release(self, p: KVParams) -> None:
        """Tell the prefill side to free the held KV (fire and forget; a hold also expires)."""
        if not self.known(p):
            return
        t = asyncio.get_running_loop().create_task(self._release(p))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _release(self, p: KVParams) -> None:
        try:
            async with self._sess().post(self._url(p, "/kv/release"),
                                         json={"remote_request_id": p.remote_request_id}) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("KV release to %s:%s failed: %s", p.remote_host, p.remote_port, e)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        if self._session is not None:
            await self._session.close()
