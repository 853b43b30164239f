"""``conductor sim-store``: one modelled Mooncake store on 127.0.0.1 (master + its memory nodes).

It answers the part of the master's admin HTTP a router uses, with the master's shapes
(``GET /health``, ``/metrics`` with ``master_*`` names, ``/query_key``, ``/batch_query_keys``,
``/get_all_keys``, ``/get_all_segments``, ``/kv_events/status``, ``POST /api/v1/remove_all``),
optionally publishes the master's KV events (``--kv-events``, RFC #1527 format, see events.py),
and serves the sim engines' data path over loopback (``POST /api/put``, ``/api/get``,
``/api/exists``: JSON stand-ins for the client's ``batch_put_from`` / ``batch_get_into`` /
``batch_is_exist``; no bytes move, their transfer is modelled). Times in answers are modelled
seconds (the store runs at the engines' ``--time-scale``).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
import time
from typing import Any

import zmq
from aiohttp import web

from predictors.cli_args import CLIError, Parser, non_negative_float, port, positive_float, positive_int

from .events import encode_payload, event_map
from .model import ERROR_NAMES, OBJECT_NOT_FOUND, StoreModel, StoreSpec

log = logging.getLogger("conductor.sim_store")
MAX_KEYS = 100_000  # keys per data-path call


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


class StoreService:
    def __init__(self, model: StoreModel, time_scale: float = 1.0, kv_events: str | None = None,
                 backend_id: str = "sim-store"):
        self.model, self.scale, self.backend_id = model, time_scale, backend_id
        self._t0 = time.monotonic()
        self._pub: zmq.Socket | None = None
        self._ctx: zmq.Context | None = None
        self.kv_events = kv_events
        self._seq = self._event_id = 0
        self.published_batches = self.published_events = self.dropped_events = 0
        if kv_events is not None:
            self._ctx = zmq.Context()
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.bind(kv_events)

    def now(self) -> float:
        """Modelled seconds since start (the engines' clock scale)."""
        return (time.monotonic() - self._t0) / self.scale

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()
        if self._ctx is not None:
            self._ctx.term()

    def segment(self, node: int) -> str:
        return f"sim-store-node-{node}:0"

    def _publish(self) -> None:
        ev = self.model.events
        if ev is None or not ev:
            return
        if self._pub is not None:
            ts = int(time.time() * 1000)
            maps = []
            for kind, key, medium in ev:
                self._event_id += 1
                maps.append(event_map(self._event_id, ts, kind, str(key), medium, self.backend_id))
            self._seq += 1
            try:
                self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), encode_payload(ts, maps)], zmq.NOBLOCK)
                self.published_batches += 1
                self.published_events += len(maps)
            except zmq.Again:
                self.dropped_events += len(maps)
        ev.clear()

    # --- the master's admin HTTP ------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [web.get("/health", self.health), web.get("/metrics", self.metrics),
                web.get("/metrics/summary", self.metrics), web.get("/query_key", self.query_key),
                web.get("/batch_query_keys", self.batch_query_keys), web.get("/get_all_keys", self.all_keys),
                web.get("/get_all_segments", self.all_segments), web.get("/kv_events/status", self.events_status),
                web.post("/api/v1/remove_all", self.remove_all), web.post("/api/put", self.put),
                web.post("/api/get", self.get), web.post("/api/exists", self.exists)]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "leader", "ha_state": "serving", "service_ready": True,
                                  "leader_address": None, "view_version": None})

    async def metrics(self, request: web.Request) -> web.Response:
        m, spec = self.model.metrics(), self.model.spec
        lines = []
        for name, value in m.items():
            kind = "counter" if name.endswith("_total") or name.startswith("evicted") else "gauge"
            lines += [f"# TYPE master_{name} {kind}", f"master_{name} {value}"]
        lines.append("# TYPE master_segment_allocated_bytes gauge")
        for n in range(spec.nodes):
            lines.append(f'master_segment_allocated_bytes{{segment="{self.segment(n)}"}} {self.model.used_bytes(n)}')
        lines.append("# TYPE master_active_clients gauge")
        lines.append("master_active_clients 0")
        return web.Response(body=("\n".join(lines) + "\n").encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    def _values(self, key: str) -> tuple[list[dict] | None, list[dict] | None]:
        reps = self.model.query(key, self.now())
        if reps is None:
            return None, None
        mem = [self._desc(r.node, r.size) for r in reps if r.medium == "cpu"]
        disk = [self._desc(r.node, r.size) for r in reps if r.medium != "cpu"]
        return mem or None, disk or None

    def _desc(self, node: int, size: int) -> dict[str, Any]:
        return {"size_": size, "buffer_address_": 0, "protocol_": "tcp", "transport_endpoint_": self.segment(node)}

    async def query_key(self, request: web.Request) -> web.Response:
        key = request.query.get("key", "")
        mem, _disk = self._values(key) if key else (None, None)
        if mem is None:  # memory replicas only, as the master answers
            return web.json_response({"success": False, "error_code": OBJECT_NOT_FOUND,
                                      "error_message": ERROR_NAMES[OBJECT_NOT_FOUND]}, status=404)
        return web.json_response({"success": True, "data": mem})

    async def batch_query_keys(self, request: web.Request) -> web.Response:
        keys = [k for k in request.query.get("keys", "").split(",") if k]
        if not keys:
            return _bad("No keys provided. Use ?keys=key1,key2,...")
        data = {}
        for k in keys:
            mem, disk = self._values(k)
            ok = mem is not None or disk is not None
            data[k] = {"ok": ok, "error": None if ok else ERROR_NAMES[OBJECT_NOT_FOUND], "values": mem,
                       "disk_values": disk, "local_disk_values": None, "nof_values": None}
        return web.json_response({"success": True, "data": data})

    async def all_keys(self, request: web.Request) -> web.Response:
        return web.Response(text="".join(f"{k}\n" for k in self.model.keys()))

    async def all_segments(self, request: web.Request) -> web.Response:
        return web.Response(text="".join(f"{self.segment(n)}\n" for n in range(self.model.spec.nodes)))

    async def events_status(self, request: web.Request) -> web.Response:
        return web.json_response({"enabled": self._pub is not None, "published_batches": self.published_batches,
                                  "published_events": self.published_events, "dropped_events": self.dropped_events,
                                  "skipped_unparsed_keys": 0})

    async def remove_all(self, request: web.Request) -> web.Response:
        now, n = self.now(), 0
        for k in self.model.keys():
            n += self.model.remove(k, now, force=True) == 0
        self._publish()
        return web.json_response({"removed_count": n})

    # --- the engines' data path -------------------------------------------------------------
    async def _keys(self, request: web.Request, sizes: bool = False) -> tuple[list[str], list[int]]:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text='{"error": "body is not JSON"}', content_type="application/json") from None
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys) or len(keys) > MAX_KEYS:
            raise web.HTTPBadRequest(text=f'{{"error": "keys: expected a list of at most {MAX_KEYS} non-empty '
                                          f'strings"}}', content_type="application/json")
        out_sizes: list[int] = []
        if sizes:
            out_sizes = body.get("sizes")
            if not isinstance(out_sizes, list) or len(out_sizes) != len(keys):
                raise web.HTTPBadRequest(text='{"error": "sizes: expected one integer per key"}',
                                         content_type="application/json")
        return keys, out_sizes

    async def put(self, request: web.Request) -> web.Response:
        keys, sizes = await self._keys(request, sizes=True)
        now = self.now()
        r = self.model.put(keys, sizes, now)
        self._publish()
        return web.json_response({"stored": len(r.stored), "existing": r.existing, "failed": r.failed,
                                  "seconds": r.done_at - now})

    async def get(self, request: web.Request) -> web.Response:
        keys, _ = await self._keys(request)
        now = self.now()
        r = self.model.get(keys, now)
        return web.json_response({"found": r.found, "bytes": r.bytes, "seconds": r.done_at - now})

    async def exists(self, request: web.Request) -> web.Response:
        keys, _ = await self._keys(request)
        return web.json_response({"exists": [int(x) for x in self.model.exists(keys, self.now())]})


def build_parser() -> Parser:
    p = Parser(prog="conductor sim-store", description="Run one modelled Mooncake store (master + memory "
               "nodes) on loopback: the master's admin HTTP, optional KV events, and the sim engines' data path.")
    p.add_argument("--port", required=True, type=port, help="HTTP port (the master's metrics port; 0 = pick one)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--nodes", type=positive_int, default=1, help="store nodes (default 1)")
    p.add_argument("--dram-gb", type=positive_float, default=64.0, help="DRAM per node, GB (default 64)")
    p.add_argument("--ssd-gb", type=non_negative_float, default=0.0, help="SSD per node, GB (default 0: none)")
    p.add_argument("--replicas", type=positive_int, default=1)
    p.add_argument("--protocol", choices=("rdma", "tcp"), default="rdma",
                   help="Transfer Engine bandwidth figures to model (default rdma)")
    p.add_argument("--lease-ttl-ms", type=non_negative_float, default=10000.0,
                   help="read lease, as mooncake_master --default_kv_lease_ttl (default 10000)")
    p.add_argument("--eviction-high-watermark-ratio", type=positive_float, default=0.90)
    p.add_argument("--eviction-ratio", type=positive_float, default=0.05)
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="real seconds per modelled second")
    p.add_argument("--kv-events", metavar="ENDPOINT", help="publish the master's KV events (ZMQ PUB binds here)")
    p.add_argument("--backend-id", default="sim-store", help="backend_id in KV events")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _spec(a: argparse.Namespace) -> StoreSpec:
    kw = dict(nodes=a.nodes, dram_bytes=int(a.dram_gb * 1e9), ssd_bytes=int(a.ssd_gb * 1e9), replicas=a.replicas,
              lease_ttl_s=a.lease_ttl_ms / 1000, high_watermark=a.eviction_high_watermark_ratio,
              eviction_ratio=a.eviction_ratio)
    try:
        return StoreSpec.tcp(**kw) if a.protocol == "tcp" else StoreSpec(**kw)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _check_loopback(host: str, what: str) -> None:
    try:
        if not (host == "localhost" or ipaddress.ip_address(host).is_loopback):
            raise CLIError(f"{what} {host}: the sim store binds only to loopback addresses")
    except ValueError:
        raise CLIError(f"{what} {host}: not an IP address") from None


async def _serve(a: argparse.Namespace, svc: StoreService) -> int:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes(svc.routes())
    runner = web.AppRunner(app, access_log=None, max_line_size=1 << 20, max_field_size=1 << 16)
    await runner.setup()
    site = web.TCPSite(runner, a.host, a.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise CLIError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: None if stop.done() else stop.set_result(0))
    spec = svc.model.spec
    print(f"sim-store ready: http://{a.host}:{bound} nodes={spec.nodes} dram_gb={a.dram_gb} protocol={a.protocol} "
          f"kv_events={a.kv_events or 'off'} time_scale={a.time_scale}", flush=True)
    code = await stop
    await runner.cleanup()
    return code


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    _check_loopback(a.host, "--host")
    if a.kv_events is not None:
        ep = a.kv_events
        if not ep.startswith("tcp://") or ep.count(":") != 2:
            raise CLIError(f"--kv-events {ep}: expected tcp://127.0.0.1:PORT")
        _check_loopback(ep[len("tcp://"):].rsplit(":", 1)[0], "--kv-events")
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = StoreModel(_spec(a), events=a.kv_events is not None)
    try:
        svc = StoreService(model, a.time_scale, a.kv_events, a.backend_id)
    except zmq.ZMQError as e:
        raise CLIError(f"--kv-events {a.kv_events}: {e}") from None
    try:
        return asyncio.run(_serve(a, svc))
    finally:
        svc.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
