"""The gateway's ASGI app: OpenAI routes through the proxy, health, readiness, metrics, admin."""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin import decisions_page, number_decisions
from gateway.admin_predictors import reload as admin_predictors_reload_, status as admin_predictors_status
from gateway.auth import EdgeGuard
from gateway.cluster import Cluster
from gateway.config import GatewayConfig
from gateway.embedded import EmbeddedCluster
from gateway.errors import RequestError, error_response
from gateway.indexer import Indexer
from gateway.mooncake_master import start_mooncake
from gateway.observability import GatewayMetrics, TelemetryWriter, make_tracer_provider
from gateway.openapi import add_routes_outside_fastapi
from gateway.proxy import Proxy
from gateway.tokenizers import BuiltinTokenizer, EngineTokenizer, HFTokenizer

log = logging.getLogger("conductor")
MODEL_CARD_KEYS = ("created", "root", "parent", "max_model_len")  # what /v1/models passes on from the engines


def create_app(cfg: GatewayConfig, guard: Any = None) -> FastAPI:
    """``guard``: a Prometheus collector of the connection guard's counters, shown on /metrics."""
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        embedded = cluster = master = None
        engines = list(cfg.engines)
        telemetry = TelemetryWriter(cfg.telemetry_path)
        provider = make_tracer_provider(cfg.otel_exporter, cfg.otel_endpoint)
        try:
            if cfg.embedded is not None:
                em = cfg.embedded
                log.info("starting embedded cluster: %d prefill + %d decode + %d both (profile %s, time scale %g)",
                         em.prefill, em.decode, em.both, em.profile, em.time_scale)
                embedded = EmbeddedCluster(em)
                engines += embedded.plan()
            master = state["master"] = await start_mooncake(cfg, embedded)
            cluster = Cluster(cfg, engines)
            cluster.open_kv_events()  # bound before any engine starts: the embedded ones get the real ports
            if embedded is not None:
                embedded.launch()
                await embedded.wait_ready()
                if embedded.store is not None and cfg.store is None:  # the embedded store unless one is named
                    cfg.store = embedded.store
            await cluster.start()
            tracer = provider.get_tracer("conductor") if provider else trace.NoOpTracer()
            metrics = GatewayMetrics()
            if guard is not None:
                metrics.registry.register(guard)
            state.update(cluster=cluster, metrics=metrics,
                         proxy=Proxy(cfg, cluster, metrics, telemetry, _tokenizer(cfg, cluster), tracer))
            number_decisions(cluster.scheduler)  # /admin/decisions pages by record number
            state["proxy"].waiting.start()  # the wait room's pump (deferred dispatch on); settle stops it
            state["indexer"] = state["proxy"].indexer = Indexer(cluster, cfg.block_size)
            gc.collect()
            gc.freeze()  # start-up objects leave the collector's view: no full-GC pauses on decisions
            log.info("cluster: %s; ready=%s", ", ".join(f"{e.id}({e.role}) {e.url}" for e in engines), cluster.ready())
            yield
        finally:
            # bounded: a hung engine or a stuck socket never holds the shutdown (serve's deadline)
            if "proxy" in state:  # uvicorn cancels the streams past its grace period but does not await them
                await state["proxy"].settle(timeout_s=cfg.shutdown_timeout_s / 16)
            if cluster is not None:
                await cluster.stop(timeout_s=cfg.shutdown_timeout_s / 4)
            if embedded is not None:
                embedded.stop(timeout_s=cfg.shutdown_timeout_s / 4)
            if master is not None:  # after its clients (the engines)
                master.stop(timeout_s=cfg.shutdown_timeout_s / 4)
            telemetry.close()
            if provider is not None:
                provider.shutdown()

    app = FastAPI(title="Conductor", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def chat(request: Request):
        return await state["proxy"].handle(request, "chat")

    async def completions(request: Request):
        return await state["proxy"].handle(request, "completions")

    # plain Starlette routes: the hot path skips FastAPI's dependency machinery
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    # the Mooncake Conductor indexer API (gateway/indexer.py)
    for path, name in (("/query", "query"), ("/query_by_hash", "query_by_hash"), ("/register", "register"),
                       ("/unregister", "unregister")):
        async def indexer_route(request: Request, name: str = name):
            return await getattr(state["indexer"], name)(request)
        app.add_route(path, indexer_route, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        cards = state["cluster"].cards  # an adapter keeps its parent (and max_model_len) as the engine said
        return {"object": "list", "data": [{**{k: v for k, v in cards.get(m, {}).items() if k in MODEL_CARD_KEYS},
                                            "id": m, "object": "model", "owned_by": "conductor"}
                                           for m in state["cluster"].models]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok = state["cluster"].ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        m: GatewayMetrics = state["metrics"]
        cluster: Cluster = state["cluster"]
        for inst in cluster.scheduler.snapshot()["instances"]:
            m.inst_healthy.labels(inst["id"], inst["role"]).set(1 if cluster.healthy.get(inst["id"]) else 0)
            m.inst_prefill_tokens.labels(inst["id"]).set(inst["reserved_prefill_tokens"])
            m.inst_active.labels(inst["id"]).set(inst["active_requests"])
            m.inst_kv_share.labels(inst["id"]).set(inst["kv_share"])
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/cluster")
    async def admin_cluster():
        view = state["cluster"].admin_view()
        waiting = state["proxy"].waiting
        if waiting.enabled:
            view["wait_room"] = waiting.view()
        return view

    @app.get("/admin/store")
    async def admin_store():
        tier = state["cluster"].store_tier
        view = tier.view() if tier is not None else {"store": None}
        if state.get("master") is not None:
            view["master"] = state["master"].view()
        return view

    async def admin_decisions(request: Request):
        try:
            return decisions_page(state["cluster"].scheduler.decisions, request.query_params)
        except RequestError as e:
            return e.response()

    app.add_route("/admin/decisions", admin_decisions, methods=["GET"])

    @app.get("/admin/predictors")
    async def admin_predictors():
        return admin_predictors_status(cfg, state["cluster"].scheduler)

    @app.post("/admin/predictors/reload")
    async def admin_predictors_reload(request: Request):
        return await admin_predictors_reload_(cfg, state["cluster"].scheduler, request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None,
                              headers=getattr(exc, "headers", None))  # e.g. Allow on a 405

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid parameter {param}: {first.get('msg', 'invalid')}", "invalid_parameter",
                              param)

    fastapi_openapi = app.openapi

    def openapi() -> dict:
        cluster = state.get("cluster")
        return add_routes_outside_fastapi(fastapi_openapi(), cluster.models if cluster is not None else [])

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        """A bug of ours still answers in the API's error shape (uvicorn logs the traceback)."""
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    def refused(reason: str) -> None:
        if "metrics" in state:
            state["metrics"].refused.labels(reason).inc()

    app.add_middleware(EdgeGuard, auth=cfg.auth, on_refused=refused)
    return app


def _tokenizer(cfg: GatewayConfig, cluster: Cluster):
    if cfg.tokenizer == "engine":
        def pick():
            for eid, ok in cluster.healthy.items():
                if ok:
                    return cluster.clients[eid]
            return None
        return EngineTokenizer(pick)
    if cfg.tokenizer == "hf":
        assert cfg.tokenizer_path is not None  # validate() requires it with 'hf'
        return HFTokenizer(cfg.tokenizer_path)
    return BuiltinTokenizer()
