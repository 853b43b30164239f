"""vLLM 0.33's in-tree MooncakeConnector on the vLLM surface (``--kv-connector mooncake``).

Instead of the two-step protocol's ``kv_transfer_params`` round trip (:mod:`.pd`), a router
names each handover with a ``transfer_id`` and sends both legs without waiting:

* prefill leg: ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
  "transfer_id": T}``. The engine computes the prompt, answers at once (one token, and *no*
  ``kv_transfer_params``: nothing to relay) and holds the KV under T until the decode takes it or
  ``--kv-hold-timeout``. A missing ``transfer_id`` is what vLLM warns about and ignores: the
  request runs as a plain one, nothing held.
* decode leg: ``{"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": T,
  "remote_engine_id": E, "remote_bootstrap_addr": "http://host:8998"}``. The engine asks the
  prefill's bootstrap server (``GET /query``: ``{"<dp>": {"engine_id", "worker_addr"}}``) whether
  E is served there, waits for T's KV (``--kv-transfer-timeout``) and decodes. A leg missing any of
  the three is vLLM's "Got invalid KVTransferParams": it runs without a transfer (recomputes).

The prefill's bootstrap server (``--mooncake-bootstrap-port``, default ``VLLM_MOONCAKE_BOOTSTRAP_PORT``
or 8998) is :func:`.bootstrap.mooncake_routes`; the transfer itself is modelled as for the other
protocols (the decode's /kv/pull long poll, the modelled network time, /kv/release).
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from .api import ApiError, OpenAIApi, _Gen, error_response
from .bootstrap import RoomParams, Rooms, fingerprint
from .pd import KVParams, _is_loopback


class MooncakeApi(OpenAIApi):
    def __init__(self, *args: Any, rooms: Rooms, **kw: Any):
        super().__init__(*args, **kw)
        self.rooms = rooms

    def _kv_params(self, body: dict, prompt: list[int]) -> KVParams | None:
        raw = body.get("kv_transfer_params")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
        flags = {}
        for key in ("do_remote_decode", "do_remote_prefill"):
            v = raw.get(key) or False
            if not isinstance(v, bool):
                raise ApiError(400, f"kv_transfer_params.{key} must be a boolean", "kv_transfer_params")
            flags[key] = v
        if flags["do_remote_decode"] and flags["do_remote_prefill"]:
            raise ApiError(400, "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
                           "kv_transfer_params")
        tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            tid = None
        if flags["do_remote_decode"]:
            if tid is None:  # vLLM: a warning, and no send
                return KVParams()
            return RoomParams(do_remote_decode=True, room=tid, key_field="transfer_id")
        if not flags["do_remote_prefill"]:
            return KVParams()
        eid, addr = raw.get("remote_engine_id"), raw.get("remote_bootstrap_addr")
        if tid is None or not isinstance(eid, str) or not eid or not isinstance(addr, str) or not addr:
            return KVParams()  # vLLM: "Got invalid KVTransferParams"; the decode recomputes the prompt
        u = urlsplit(addr)
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise ApiError(400, f"remote_bootstrap_addr {addr!r} must be http://HOST:PORT", "kv_transfer_params")
        if not _is_loopback(u.hostname):
            raise ApiError(400, f"remote_bootstrap_addr {addr!r} is not a loopback address", "kv_transfer_params")
        return RoomParams(do_remote_prefill=True, remote_host=u.hostname, remote_port=u.port, remote_request_id=tid,
                          room=tid, prompt_tokens=len(prompt), fingerprint=fingerprint(prompt),
                          key_field="transfer_id", remote_engine_id=eid)

    def _kv_params_out(self, g: _Gen, rid: str) -> dict | None:
        return None  # the MooncakeConnector's prefill has nothing to relay: the transfer id names it

    async def _run(self, request: web.Request, g: _Gen, echo: dict, rid: str | None = None) -> web.StreamResponse:
        kv = g.kv
        if not (isinstance(kv, RoomParams) and kv.do_remote_decode):
            return await super()._run(request, g, echo, rid)
        engine = self.driver.engine
        self.rooms.sweep(lambda r: engine.held_kv(r) is not None)  # holds that expired untaken
        rid = rid or self._request_id(request)
        if not self.rooms.claim(kv.room, rid, g.prompt):
            return error_response(409, f"transfer id {kv.room!r} is already in use on this prefill instance",
                                  "kv_transfer_params", echo)
        try:
            return await super()._run(request, g, echo, rid)
        finally:
            if engine.held_kv(rid) is None:  # it never came to hold KV (refused, failed, aborted)
                self.rooms.drop(kv.room, rid)

    async def _before_end(self, g: _Gen, rid: str) -> str | None:
        kv = g.kv
        if isinstance(kv, RoomParams) and kv.do_remote_decode:
            self.rooms.held(kv.room)  # pullable from now on; the answer goes out at once
        return None
