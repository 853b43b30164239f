"""SGLang's prefill/decode handover (``--disaggregation-mode``), as a router sees it.

The router sends the *same* request to a prefill and a decode instance at once, with
``bootstrap_host`` / ``bootstrap_port`` (the prefill's bootstrap server, default 8998) and a
``bootstrap_room`` (a random 63-bit id naming this one handover).

* The prefill instance runs a bootstrap HTTP server (:func:`bootstrap_routes`): SGLang's own
  ``GET|PUT /route``, ``GET /health``, ``POST /register_dp_rank``, ``POST /query_dp_ranks``; and,
  standing in for the Mooncake transfer engine's ZMQ handshake, ``POST /kv/pull`` (long poll:
  answers once the room's KV is computed and held) and ``POST /kv/release``. A prefill request
  holds its KV under its room (:class:`Rooms`) and answers the router only once the decode side
  has taken it (or with 500 when nobody did within ``--kv-hold-timeout``); a room already held
  by another live request is refused (409).
* The decode instance (:class:`RoomPuller`) checks the prefill's topology once (same page size,
  as SGLang insists), then polls for its room until ``--disaggregation-waiting-timeout``: a room
  that never appears (the prefill never got the request) or that holds another prompt (a room
  collision) ends in a clear 504 and nothing stays reserved on the decode side.

Only loopback bootstrap hosts are reached (this engine never talks beyond 127.0.0.1).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import xxhash
from aiohttp import web

from .pd import KVParams, KVPuller, PullError

MAX_ROOM = 2**63 - 1
#: A handover's name: SGLang's bootstrap room (int) or vLLM's Mooncake transfer id (str).
Key = int | str


def fingerprint(prompt: list[int]) -> str:
    """Names a prompt, so a decode instance can tell its own KV from a colliding room's."""
    return xxhash.xxh3_64_hexdigest(repr(prompt).encode())


@dataclass(frozen=True)
class RoomParams(KVParams):
    """A decode request's handover: where the bootstrap server is and which room to take."""

    room: Key = 0
    prompt_tokens: int = 0
    fingerprint: str = ""
    key_field: str = "bootstrap_room"  # how the bootstrap server's /kv routes name the handover
    remote_engine_id: str | None = None  # vLLM's MooncakeConnector: the prefill engine the router named

    @property
    def label(self) -> str:
        return f"bootstrap room {self.room}" if self.key_field == "bootstrap_room" else f"transfer id {self.room!r}"


@dataclass
class _Room:
    rid: str | None = None
    fingerprint: str = ""
    prompt_tokens: int = 0
    held: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0


class Rooms:
    """The prefill side's rooms: which live request holds (or will hold) each room's KV."""

    def __init__(self) -> None:
        self._rooms: dict[Key, _Room] = {}
        self._dp_ranks: dict[int, tuple[int, float]] = {}

    def __len__(self) -> int:
        return sum(1 for r in self._rooms.values() if r.rid is not None)

    def claim(self, room: Key, rid: str, prompt: list[int]) -> bool:
        """A prefill request takes ``room``; False if another live request has it (a collision)."""
        r = self._rooms.setdefault(room, _Room())
        if r.rid is not None:
            return False
        r.rid, r.fingerprint, r.prompt_tokens = rid, fingerprint(prompt), len(prompt)
        return True

    def held(self, room: Key) -> None:
        """The room's prefill finished: its KV can be pulled."""
        r = self._rooms.get(room)
        if r is not None:
            r.held.set()

    def sweep(self, still_held: Any) -> None:
        """Forget held rooms whose KV is gone (expired or aborted) without a decode taking it."""
        for k in [k for k, r in self._rooms.items() if r.held.is_set() and r.rid and not still_held(r.rid)]:
            self.drop(k)

    async def wait_released(self, room: Key, still_held: Any, poll_s: float = 0.2) -> bool:
        """Until the decode side took the KV (True) or the hold ended without it (False)."""
        r = self._rooms.get(room)
        if r is None:
            return False
        while not r.released.is_set():
            try:
                await asyncio.wait_for(r.released.wait(), poll_s)
            except asyncio.TimeoutError:
                if not still_held():
                    return False
        return True

    def drop(self, room: Key, rid: str | None = None) -> None:
        """Forget a room (only if ``rid`` still owns it, when given)."""
        r = self._rooms.get(room)
        if r is not None and (rid is None or r.rid == rid):
            del self._rooms[room]  # waiters on it see no owner and poll a fresh entry
            r.rid = None

    def rid_of(self, room: Key) -> str | None:
        r = self._rooms.get(room)
        return r.rid if r is not None else None

    async def wait_held(self, room: Key, wait_s: float) -> _Room | None:
        r = self._rooms.setdefault(room, _Room())
        r.waiters += 1
        try:
            await asyncio.wait_for(r.held.wait(), wait_s)
            return r
        except asyncio.TimeoutError:
            return None
        finally:
            r.waiters -= 1
            if not r.waiters and r.rid is None and self._rooms.get(room) is r:
                del self._rooms[room]

    def release(self, room: Key) -> bool:
        r = self._rooms.get(room)
        if r is None or r.rid is None or not r.held.is_set():
            return False
        r.released.set()
        return True

    def register_dp_rank(self, room: int, dp_rank: int) -> None:
        self._dp_ranks[room] = (dp_rank, time.monotonic())
        if len(self._dp_ranks) > 100_000:  # SGLang expires entries after 120 s
            cutoff = time.monotonic() - 120.0
            self._dp_ranks = {k: v for k, v in self._dp_ranks.items() if v[1] >= cutoff}

    def dp_ranks(self, rooms: list[int]) -> dict[str, int]:
        return {str(r): self._dp_ranks[r][0] for r in rooms if r in self._dp_ranks}


def _bad(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


def bootstrap_routes(rooms: Rooms, *, page_size: int, host: str, http_port: Any, engine: Any,
                     release_kv: Any) -> list[web.RouteDef]:
    """The prefill's bootstrap server. ``http_port`` is called for the engine's HTTP port (known
    once it listens); ``engine.held_kv(rid)`` tells whether a room's KV is still held;
    ``release_kv(rid)`` frees it once the decode side has it."""

    def info() -> dict[str, Any]:
        return {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": page_size,
                "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
                "enable_kv_cache_sharding": False, "prefill_http_port": http_port(),
                "decode_allocation_policy": "early"}

    async def route_get(request: web.Request) -> web.Response:
        q = request.query
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        try:
            vals = [int(q[k]) for k in keys]
        except (KeyError, ValueError):
            return _bad(400, "Missing inputs for bootstrap server.")
        if all(v == -1 for v in vals):
            return web.json_response(info())
        if vals != [0, 0, 0, 0]:
            return _bad(404, f"unknown rank {dict(zip(keys, vals, strict=True))}")
        return web.json_response({"rank_ip": host, "rank_port": http_port()})

    async def route_put(request: web.Request) -> web.Response:
        return web.Response(text="OK")  # one simulated rank: registered from the start

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def register_dp_rank(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            rooms.register_dp_rank(int(body["bootstrap_room"]), int(body["dp_rank"]))
        except (ValueError, KeyError, TypeError):
            return _bad(400, "expected {\"bootstrap_room\": int, \"dp_rank\": int}")
        return web.Response(text="OK")

    async def query_dp_ranks(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            wanted = [int(r) for r in body["bootstrap_rooms"]]
        except (ValueError, KeyError, TypeError):
            return _bad(400, "expected {\"bootstrap_rooms\": [int, ...]}")
        return web.json_response(rooms.dp_ranks(wanted))

    return [web.get("/route", route_get), web.put("/route", route_put), web.get("/health", health),
            web.post("/register_dp_rank", register_dp_rank), web.post("/query_dp_ranks", query_dp_ranks),
            *kv_routes(rooms, engine, release_kv)]


def mooncake_routes(rooms: Rooms, *, engine_id: str, worker_addr: str, engine: Any,
                    release_kv: Any) -> list[web.RouteDef]:
    """vLLM 0.33 MooncakeConnector's bootstrap server on a prefill instance (``POST /register``,
    ``GET /query``), one simulated rank (dp 0, tp 0, pp 0), plus the /kv handover routes."""
    ranks: dict[str, dict[str, Any]] = {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": worker_addr}}}}

    async def register(request: web.Request) -> web.Response:
        try:
            b = await request.json()
            dp, tp, pp, eid, addr = str(int(b["dp_rank"])), str(int(b["tp_rank"])), str(int(b["pp_rank"])), \
                str(b["engine_id"]), str(b["addr"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"detail": "expected engine_id, dp_rank, tp_rank, pp_rank, addr"}, status=400)
        entry = ranks.setdefault(dp, {"engine_id": eid, "worker_addr": {}})
        if entry["engine_id"] != eid:
            return web.json_response({"detail": f"dp rank {dp} belongs to engine {entry['engine_id']}"}, status=400)
        known = entry["worker_addr"].setdefault(tp, {})
        if known.get(pp, addr) != addr:
            return web.json_response({"detail": f"rank tp{tp}/pp{pp} registered at {known[pp]}"}, status=400)
        known[pp] = addr
        return web.json_response({"status": "ok"})

    async def query(request: web.Request) -> web.Response:
        return web.json_response(ranks)

    return [web.post("/register", register), web.get("/query", query), *kv_routes(rooms, engine, release_kv)]


def _key(body: Any) -> Key:
    """The handover a /kv request names: ``bootstrap_room`` (int) or ``transfer_id`` (str)."""
    if "bootstrap_room" in body:
        return int(body["bootstrap_room"])
    key = body["transfer_id"]
    if not isinstance(key, str) or not key:
        raise ValueError("transfer_id must be a non-empty string")
    return key


def kv_routes(rooms: Rooms, engine: Any, release_kv: Any) -> list[web.RouteDef]:
    """The stand-in for the transfer engine's handshake: the decode side's long poll for a
    handover's KV (``POST /kv/pull``) and its release once the KV arrived (``POST /kv/release``)."""

    async def pull(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            room, fp, wait_s = _key(body), str(body.get("fingerprint", "")), float(body["wait_s"])
        except (ValueError, KeyError, TypeError):
            return _bad(400, "expected {\"bootstrap_room\": int | \"transfer_id\": str, \"fingerprint\": str, "
                             "\"wait_s\": float}")
        r = await rooms.wait_held(room, max(0.0, min(wait_s, 30.0)))
        if r is None or r.rid is None:
            return web.json_response({"error": f"room {room} has no KV yet"}, status=404)
        if fp and r.fingerprint != fp:
            return web.json_response({"error": f"room {room} holds the KV of another prompt "
                                               f"({r.prompt_tokens} tokens)"}, status=409)
        held = engine.held_kv(r.rid)
        if held is None:
            return web.json_response({"error": f"the KV of room {room} is gone (expired or aborted)"}, status=410)
        return web.json_response({"handover": room, "num_tokens": held.num_tokens,
                                  "num_blocks": held.num_blocks, "block_size": held.block_size})

    async def release(request: web.Request) -> web.Response:
        try:
            room = _key(await request.json())
        except (ValueError, KeyError, TypeError):
            return _bad(400, "expected {\"bootstrap_room\": int} or {\"transfer_id\": str}")
        rid = rooms.rid_of(room)
        if rid is None or not rooms.release(room):
            return web.json_response({"error": f"room {room} holds no KV"}, status=404)
        release_kv(rid)
        rooms.drop(room, rid)
        return web.json_response({"released": True, "handover": room})

    return [web.post("/kv/pull", pull), web.post("/kv/release", release)]


class RoomPuller(KVPuller):
    """The decode side (SGLang): finds its room's KV on the prefill's bootstrap server, or times out."""

    def __init__(self, page_size: int, waiting_timeout_s: float, poll_s: float = 5.0,
                 peers: frozenset[tuple[str, int]] | None = None):
        super().__init__(timeout_s=poll_s + 10.0, peers=peers)
        self.page_size, self.waiting_timeout_s, self.poll_s = page_size, waiting_timeout_s, poll_s
        self._topology_ok: set[tuple[str, int]] = set()
        self.waiting = 0  # decode requests waiting for their room (SGLang's prealloc queue)

    async def _bootstrap_get(self, p: RoomParams, path: str) -> dict:
        """GET a JSON object from the prefill's bootstrap server, or the PullError saying why not."""
        host, port_ = p.remote_host or "", p.remote_port or 0
        try:
            async with self._sess().get(self._url(p, path), timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                body = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise PullError(502, f"cannot reach the prefill bootstrap server {host}:{port_}: "
                                 f"{type(e).__name__}: {e}", "bootstrap_unreachable") from None
        if not isinstance(body, dict):
            raise PullError(502, f"the prefill bootstrap server {host}:{port_} is not ready",
                            "bootstrap_unreachable")
        return body

    async def _check_topology(self, p: RoomParams) -> None:
        addr = (p.remote_host or "", p.remote_port or 0)
        if addr in self._topology_ok:
            return
        body = await self._bootstrap_get(
            p, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        if body.get("page_size") != self.page_size:
            raise PullError(500, f"the prefill at {addr[0]}:{addr[1]} uses page size {body.get('page_size')} and "
                                 f"this decode instance {self.page_size}: both servers must use the same "
                                 f"--page-size value", "bootstrap_mismatch")
        self._topology_ok.add(addr)

    async def pull(self, p: KVParams) -> dict[str, Any]:
        assert isinstance(p, RoomParams)
        if not self.known(p):  # --kv-peers names the prefills' bootstrap servers here
            raise PullError(403, f"{p.remote_host}:{p.remote_port} is not a known prefill bootstrap server of this "
                                 f"engine (--kv-peers)", "kv_transfer_unknown_peer")
        await self._check_topology(p)
        deadline = time.monotonic() + self.waiting_timeout_s
        last = "the prefill instance never received it"
        self.waiting += 1
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PullError(504, f"{p.label}: no KV from the prefill at {p.remote_host}:"
                                         f"{p.remote_port} within {self.waiting_timeout_s:g} s ({last})",
                                    "bootstrap_timeout")
                body = {p.key_field: p.room, "fingerprint": p.fingerprint, "wait_s": min(left, self.poll_s)}
                try:
                    async with self._sess().post(self._url(p, "/kv/pull"), json=body) as r:
                        answer = await r.json(content_type=None)
                        status = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    raise PullError(502, f"cannot reach the prefill bootstrap server {p.remote_host}:{p.remote_port}:"
                                         f" {type(e).__name__}: {e}", "bootstrap_unreachable") from None
                if status == 200 and isinstance(answer, dict):
                    return answer
                if status == 409:  # another prompt's KV under our room: a collision; it may yet clear
                    last = "a room collision: the room holds another prompt's KV"
                    await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                elif status == 410:
                    raise PullError(410, f"{p.label}: the prefill's KV is gone (expired or aborted)",
                                    "kv_transfer_expired")
                elif status != 404:
                    raise PullError(502, f"the prefill bootstrap server refused the pull ({status}): {answer}",
                                    "kv_transfer_failed")
        finally:
            self.waiting -= 1

    async def _release(self, p: KVParams) -> None:
        assert isinstance(p, RoomParams)
        try:
            async with self._sess().post(self._url(p, "/kv/release"), json={p.key_field: p.room}) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # the prefill's hold expires on its own


class MooncakePuller(RoomPuller):
    """The decode side of vLLM's MooncakeConnector: the prefill's bootstrap server must know the
    ``remote_engine_id`` the router named (``GET /query``), then the transfer id's KV is awaited."""

    def __init__(self, waiting_timeout_s: float, poll_s: float = 5.0,
                 peers: frozenset[tuple[str, int]] | None = None):
        super().__init__(0, waiting_timeout_s, poll_s, peers)
        self._engines: dict[tuple[str, int], set[str]] = {}

    async def _check_topology(self, p: RoomParams) -> None:
        addr = (p.remote_host or "", p.remote_port or 0)
        if addr not in self._engines:
            body = await self._bootstrap_get(p, "/query")
            self._engines[addr] = {str(v.get("engine_id")) for v in body.values() if isinstance(v, dict)}
        if p.remote_engine_id not in self._engines[addr]:
            self._engines.pop(addr, None)  # it may have restarted with a new id: ask again next time
            raise PullError(400, f"remote_engine_id {p.remote_engine_id!r} is not served by the bootstrap server "
                                 f"{addr[0]}:{addr[1]}", "kv_transfer_failed")
