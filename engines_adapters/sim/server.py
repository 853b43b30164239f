"""``conductor sim-engine``: one simulated vLLM 0.33 (or, ``--flavor sglang``, SGLang 0.5.23) engine
on 127.0.0.1.

Wires the engine model, its asyncio driver, the OpenAI/vLLM HTTP API, the KV event publisher and
the PD puller together. Prints one line ``sim-engine ready: http://HOST:PORT ...`` on stdout when
it accepts requests (``--port 0`` picks a free port and that line says which).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import uuid

from aiohttp import web

from predictors.cli_args import (
    CLIError,
    Parser,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from scheduler.hashing import VLLM_HASH_ALGOS

from .. import sglang_wire
from ..kv_wire import encode_batch
from ..store.mooncake import SCHEME as MOONCAKE, MooncakeRefused, MooncakeStoreClient
from .api import OpenAIApi, ServerInfo
from .bootstrap import MooncakePuller, RoomPuller, Rooms, bootstrap_routes, mooncake_routes
from .driver import EngineDriver
from .metrics import EngineMetrics, Metrics
from .model import ROLES, EngineModel
from .mooncake_api import MooncakeApi
from .pd import KVPuller, parse_peer
from .profiles import load_profile, profile_names
from .publisher import KVEventPublisher, check_endpoint, loopback_bind_address
from .sglang_api import SGLangApi
from .sglang_metrics import SGLangMetrics
from .store_link import StoreBytes, StoreFailures, StoreLink

FLAVORS = ("vllm", "sglang")
DISAGGREGATION_MODES = {"null": "both", "prefill": "prefill", "decode": "decode"}

log = logging.getLogger("conductor.sim_engine")


def build_parser() -> Parser:
    p = Parser(prog="conductor sim-engine",
               description="Run one simulated vLLM- or SGLang-compatible engine on loopback.")
    p.add_argument("--role", choices=ROLES, help="prefill, decode, or both (colocated); required for vllm")
    p.add_argument("--disaggregation-mode", choices=list(DISAGGREGATION_MODES),
                   help="SGLang's name for --role (null = both)")
    p.add_argument("--port", required=True, type=port, help="TCP port (0 = pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--flavor", default="vllm", choices=FLAVORS,
                   help="server surface, PD protocol, metric names and KV-event wire: vllm (0.33) or sglang (0.5.23)")
    p.add_argument("--disaggregation-bootstrap-port", type=port, default=8998,
                   help="sglang prefill: the bootstrap server's port (0 = pick a free one)")
    p.add_argument("--disaggregation-waiting-timeout", type=positive_float, default=300.0,
                   help="sglang decode: wall seconds to wait for the prefill's KV of a bootstrap room")
    p.add_argument("--kv-connector", choices=["two-step", "mooncake"], default="two-step",
                   help="vllm PD: the two-step kv_transfer_params round trip, or vLLM 0.33's MooncakeConnector "
                        "(transfer ids, a bootstrap server on the prefill)")
    p.add_argument("--mooncake-bootstrap-port", type=port,
                   default=int(os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998")),
                   help="--kv-connector mooncake prefill: the bootstrap server's port (default "
                        "$VLLM_MOONCAKE_BOOTSTRAP_PORT or 8998; 0 = pick a free one)")
    p.add_argument("--kv-transfer-timeout", type=positive_float, default=60.0,
                   help="--kv-connector mooncake decode: wall seconds to wait for a transfer id's KV")
    p.add_argument("--profile", default="llama3-8b-h200", help=f"timing profile: {', '.join(profile_names())}")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model names to answer to, the first in responses (default: the profile's short name)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served, as vLLM's: each a model name of its own with its own prefix-cache "
                        "namespace (the simulated adapter costs nothing extra)")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="real seconds per modelled second (0.01 = 100x faster)")
    p.add_argument("--seed", type=int, default=0, help="seed for noise, output text and lengths")
    p.add_argument("--noise", type=non_negative_float, default=0.02, help="sigma of multiplicative step-time noise")
    p.add_argument("--kv-events", metavar="ENDPOINT", help="publish KV events over ZMQ (vLLM bind/connect rule)")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", help="ROUTER endpoint answering replay requests")
    p.add_argument("--kv-events-topic", default="", help="topic frame of KV event messages")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="vLLM/SGLang style: {\"publisher\": \"zmq\", \"endpoint\", \"replay_endpoint\", \"topic\"}")
    p.add_argument("--block-size", "--page-size", dest="block_size", type=positive_int, default=16,
                   help="tokens per KV block (SGLang: page); default 16")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-model-len", type=positive_int, help="default: the profile's")
    p.add_argument("--kv-capacity-tokens", type=positive_int, help="GPU KV capacity (default: from the profile)")
    p.add_argument("--host-tier-tokens", type=non_negative_int, default=0, help="host-memory KV tier (0 = off)")
    p.add_argument("--kv-hold-timeout", type=positive_float, default=30.0,
                   help="modelled seconds a prefill holds KV nobody pulled")
    p.add_argument("--median-output-tokens", type=positive_int, default=128,
                   help="median of the output-length distribution (without ignore_eos)")
    p.add_argument("--kv-store", metavar="URL",
                   help="shared KV store: load prefixes from it, write prompts through; http://... a conductor "
                        "sim-store, mooncake://HOST:RPC_PORT a real mooncake_master (real bytes through "
                        "MooncakeDistributedStore; only in a loopback-only network namespace, docs/store.md)")
    p.add_argument("--kv-store-payload-bytes", type=positive_int, default=4, metavar="N",
                   help="mooncake:// store: real bytes put per token (the modelled KV size is recorded in "
                        "each object; default 4)")
    p.add_argument("--kv-store-segment-mb", type=positive_int, default=64, metavar="MB",
                   help="mooncake:// store: memory this engine mounts into the store's pool (default 64)")
    p.add_argument("--kv-store-recipe", choices=("vllm", "sglang"), default="vllm",
                   help="store key format: vLLM's MooncakeStoreConnector or SGLang HiCache's (default vllm)")
    p.add_argument("--kv-store-write", choices=("through", "back"), default="through",
                   help="when blocks reach the store: after each prefill (through, HiCache's write_through "
                        "default) or when the device evicts them (back, HiCache's write_back)")
    p.add_argument("--kv-store-lookup-timeout-ms", type=positive_int, default=250, metavar="MS",
                   help="how long a prefill waits for the store's lookup before it recomputes instead "
                        "(default 250)")
    p.add_argument("--kv-store-optional", action="store_true",
                   help="start even if the store is unreachable (warn; load and write when it answers)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* as vLLM does")
    p.add_argument("--kv-peers", metavar="HOST:PORT,...",
                   help="the only prefill instances a decode may pull KV from (default: any on loopback)")
    p.add_argument("--prefix-caching-hash-algo", default="sha256", choices=VLLM_HASH_ALGOS,
                   help="KV-event block ids by vLLM's recipe (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _check(args: argparse.Namespace) -> None:
    mode = DISAGGREGATION_MODES.get(args.disaggregation_mode) if args.disaggregation_mode else None
    if args.role is not None and mode is not None and args.role != mode:
        raise CLIError(f"--role {args.role} contradicts --disaggregation-mode {args.disaggregation_mode}")
    args.role = args.role or mode or ("both" if args.flavor == "sglang" else None)
    if args.role is None:
        raise CLIError("--role is required (prefill, decode or both)")
    if args.kv_events_config is not None:
        _kv_events_config(args)
    if args.kv_connector == "mooncake" and args.flavor != "vllm":
        raise CLIError("--kv-connector mooncake is vLLM's connector: use it with --flavor vllm")
    try:
        if not (args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback):
            raise CLIError(f"--host {args.host}: the simulated engine binds only to loopback addresses")
    except ValueError:
        raise CLIError(f"--host {args.host}: not an IP address") from None
    if args.profile not in profile_names():
        raise CLIError(f"unknown profile {args.profile!r}; known: {', '.join(profile_names())}")
    for flag in ("kv_events", "kv_events_replay"):
        ep = getattr(args, flag)
        if ep is not None:
            try:
                check_endpoint(ep)
                if flag == "kv_events_replay":  # the replay socket always binds
                    loopback_bind_address(ep)
            except ValueError as e:
                raise CLIError(f"--{flag.replace('_', '-')}: {e}") from None
    if args.kv_events_replay and not args.kv_events:
        raise CLIError("--kv-events-replay needs --kv-events")
    if args.kv_peers is not None:
        try:
            args.kv_peers = frozenset(parse_peer(x) for x in args.kv_peers.split(",") if x.strip())
        except ValueError as e:
            raise CLIError(f"--kv-peers: {e}") from None
    loras = {}
    for spec in args.lora_modules:
        lname, eq, path = spec.partition("=")
        if not eq or not lname or not path:
            raise CLIError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        loras[lname] = path
    args.lora_modules = loras
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise CLIError("--max-num-batched-tokens must be >= --max-num-seqs")


def _kv_events_config(args: argparse.Namespace) -> None:
    try:
        cfg = json.loads(args.kv_events_config)
    except ValueError as e:
        raise CLIError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CLIError("--kv-events-config must be a JSON object")
    if cfg.get("publisher", "zmq") not in ("zmq", "null") or cfg.get("enable_kv_cache_events") is False:
        return
    if cfg.get("publisher") == "null":
        return
    args.kv_events = args.kv_events or cfg.get("endpoint", "tcp://*:5557")
    args.kv_events_replay = args.kv_events_replay or cfg.get("replay_endpoint")
    args.kv_events_topic = args.kv_events_topic or cfg.get("topic", "")


def api_key_middleware(key: str):
    """vLLM's ``--api-key`` rule: ``/v1/*`` needs ``Authorization: Bearer KEY``, else 401
    ``{"error": "Unauthorized"}``; the other routes (health, metrics, tokenize, PD) stay open."""
    want = hashlib.sha256(key.encode()).digest()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1") and request.method != "OPTIONS":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), want):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def _engine(args: argparse.Namespace) -> EngineModel:
    profile = load_profile(args.profile)
    try:
        return EngineModel(
            profile, args.role, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, kv_capacity_tokens=args.kv_capacity_tokens,
            host_tier_tokens=args.host_tier_tokens, seed=args.seed, noise=args.noise,
            kv_events=bool(args.kv_events), kv_hold_timeout=args.kv_hold_timeout, store_writes=bool(args.kv_store),
            store_policy="write_back" if args.kv_store and args.kv_store_write == "back" else "write_through",
            event_hashes="sglang" if args.flavor == "sglang" else "vllm",
            median_output=args.median_output_tokens, max_model_len=args.max_model_len,
            hash_algo=args.prefix_caching_hash_algo,
            int_block_hashes=os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("0", "false", "False"))
    except ValueError as e:
        raise CLIError(str(e)) from None


async def _serve(args: argparse.Namespace, engine: EngineModel, publisher: KVEventPublisher | None) -> int:
    loop = asyncio.get_running_loop()
    names = args.served_model_name or [engine.profile.served_name]
    name = names[0]
    store = None
    if args.kv_store:
        store = _store_link(args, engine)
        try:
            opened = await store.open()
        except MooncakeRefused as e:
            await store.close()
            raise CLIError(f"cannot use the KV store at {args.kv_store}: {e}") from None
        if not opened:
            if not args.kv_store_optional:
                await store.close()
                raise CLIError(f"cannot reach the KV store at {args.kv_store}")
            log.warning("the KV store at %s does not answer; starting without it for now", args.kv_store)
    info = ServerInfo(host=args.host, port=args.port, role=args.role, served_name=name,
                      hf_name=engine.profile.model["name"], max_model_len=engine.max_model_len,
                      engine_id=f"sim-{uuid.uuid4().hex[:12]}", aliases=tuple(names[1:]),
                      lora_modules=args.lora_modules)
    runners: list[web.AppRunner] = []
    extra = ""
    if args.flavor == "sglang":
        rooms = Rooms()
        puller: KVPuller = (RoomPuller(args.block_size, args.disaggregation_waiting_timeout, peers=args.kv_peers)
                            if args.role == "decode" else KVPuller(peers=args.kv_peers))
        metrics: Metrics = SGLangMetrics(engine, name, args.role,
                                         lambda: (len(rooms), puller.waiting if isinstance(puller, RoomPuller) else 0))
        driver = EngineDriver(engine, time_scale=args.time_scale, metrics=metrics, publisher=publisher)
        api: OpenAIApi = SGLangApi(info, driver, metrics, puller, rooms=rooms, page_size=args.block_size,
                                   bootstrap_port=args.disaggregation_bootstrap_port,
                                   server_args=_server_args(args))
        if args.role == "prefill":
            boot = web.Application()
            boot.add_routes(bootstrap_routes(rooms, page_size=args.block_size, host=args.host,
                                             http_port=lambda: info.port, engine=engine, release_kv=driver.release_kv))
            bport = await _listen(boot, args.host, args.disaggregation_bootstrap_port, runners, "bootstrap server")
            api.bootstrap_port = bport  # type: ignore[attr-defined]
            extra = f" bootstrap_port={bport}"
    elif args.kv_connector == "mooncake":
        metrics = EngineMetrics(engine, name)
        driver = EngineDriver(engine, time_scale=args.time_scale, metrics=metrics, publisher=publisher)
        rooms = Rooms()
        puller = (MooncakePuller(args.kv_transfer_timeout, peers=args.kv_peers) if args.role == "decode"
                  else KVPuller(peers=args.kv_peers))
        api = MooncakeApi(info, driver, metrics, puller, rooms=rooms)
        if args.role == "prefill":
            boot = web.Application()
            boot.add_routes(mooncake_routes(rooms, engine_id=info.engine_id, worker_addr=f"tcp://{args.host}:0",
                                            engine=engine, release_kv=driver.release_kv))
            bport = await _listen(boot, args.host, args.mooncake_bootstrap_port, runners, "bootstrap server")
            extra = f" bootstrap_port={bport} engine_id={info.engine_id}"
    else:
        metrics = EngineMetrics(engine, name)
        driver = EngineDriver(engine, time_scale=args.time_scale, metrics=metrics, publisher=publisher)
        puller = KVPuller(peers=args.kv_peers)
        api = OpenAIApi(info, driver, metrics, puller)
    if store is not None:
        driver.on_store_writes = store.write
        driver.on_store_evicted = store.evicted
        store.announcer.kick = driver.kick
        api.store = store
        metrics.registry.register(StoreFailures(store))
        if isinstance(store.client, MooncakeStoreClient):
            metrics.registry.register(StoreBytes(store.client))
    app = web.Application(client_max_size=256 * 1024 * 1024,
                          middlewares=[api_key_middleware(args.api_key)] if args.api_key else [])
    app.add_routes(api.routes())
    try:
        info.port = await _listen(app, args.host, args.port, runners, "HTTP server")
    except CLIError:
        for r in runners:
            await r.cleanup()
        if store is not None:
            await store.close()
        raise
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: None if stop.done() else stop.set_result(0))
    engine_task = loop.create_task(driver.run())
    engine_task.add_done_callback(lambda t: None if stop.done() else stop.set_result(1))
    print(f"sim-engine ready: http://{args.host}:{info.port} role={args.role} profile={args.profile} "
          f"model={name} time_scale={args.time_scale} flavor={args.flavor}{extra}", flush=True)
    code = await stop
    if engine_task.done() and not engine_task.cancelled() and engine_task.exception() is not None:
        log.error("engine loop failed", exc_info=engine_task.exception())
        sys.stderr.write(f"conductor sim-engine: engine loop failed: {engine_task.exception()!r}\n")
    engine_task.cancel()
    for r in runners:
        await r.cleanup()
    await puller.close()
    if store is not None:
        await store.close()
    return code


def _store_link(args: argparse.Namespace, engine: EngineModel) -> StoreLink:
    mooncake = None
    if args.kv_store.startswith(MOONCAKE):
        try:
            mooncake = MooncakeStoreClient(args.kv_store, payload_bytes_per_token=args.kv_store_payload_bytes,
                                           block_size=engine.block_size, segment_bytes=args.kv_store_segment_mb << 20)
        except ValueError as e:
            raise CLIError(str(e)) from None
    return StoreLink(args.kv_store, engine, engine.profile.model["name"], args.kv_store_recipe, mooncake=mooncake,
                     write=args.kv_store_write, lookup_timeout_s=args.kv_store_lookup_timeout_ms / 1000)


async def _listen(app: web.Application, host: str, port_: int, runners: list[web.AppRunner], what: str) -> int:
    """Serve ``app`` on host:port; the port actually bound (``0`` picks one)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port_)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise CLIError(f"cannot listen on {host}:{port_} ({what}): {e.strerror or e}") from None
    runners.append(runner)
    return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # aiohttp's private server: set by start()


def _server_args(args: argparse.Namespace) -> dict:
    """SGLang's /server_info starts with every resolved server argument."""
    kv = None
    if args.kv_events:
        host, _, p = args.kv_events.rpartition(":")
        kv = {"publisher": "zmq", "endpoint_host": host.split("://", 1)[-1], "endpoint_port_base": int(p),
              "topic": args.kv_events_topic, "block_size": args.block_size, "dp_size": 1}
        if args.kv_events_replay:
            kv["replay_endpoint_port_base"] = int(args.kv_events_replay.rpartition(":")[2])
    return {"host": args.host, "port": args.port, "skip_server_warmup": True, "enable_metrics": True,
            "disaggregation_transfer_backend": "mooncake", "disaggregation_decode_allocation_policy": "early",
            "random_seed": args.seed, "kv_events": kv}


def main(argv: list[str]) -> int:
    """``conductor sim-engine``; a :class:`CLIError` is reported by the dispatcher (gateway/cli.py)."""
    args = build_parser().parse_args(argv)
    _check(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = _engine(args)
    publisher = None
    if args.kv_events:
        publisher = KVEventPublisher(args.kv_events, args.kv_events_replay, args.kv_events_topic,
                                     encode=sglang_wire.encode_batch if args.flavor == "sglang" else encode_batch)
        try:
            publisher.start()
        except RuntimeError as e:
            raise CLIError(str(e)) from None
    try:
        return asyncio.run(_serve(args, engine, publisher))
    finally:
        if publisher is not None:
            publisher.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
