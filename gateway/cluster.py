"""The gateway's live view of its engines: clients and drivers (by each engine's flavour), KV
event subscribers feeding the scheduler's hit index, and health/load polling that ejects and
readmits instances."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import zmq.asyncio

from engines_adapters.drivers import Pair, PairDriver, flavor
from engines_adapters.engine_client import EngineClient
from engines_adapters.kv_events import KVEventSubscriber
from gateway.config import EngineConfig, GatewayConfig
from gateway.store_tier import StoreTier
from predictors.analytic import analytic_predictors
from predictors.base import Predictors
from predictors.learned import learned_predictors
from scheduler import Instance, Scheduler

log = logging.getLogger(__name__)

def build_scheduler(cfg: GatewayConfig, engines: list[EngineConfig]) -> Scheduler:
    """The scheduler for these engines, predicting from their public deployments and the
    configured prior; a bad policy, parameter or deployment raises ValueError."""
    params = dict(cfg.policy_params)
    if cfg.policy.startswith("conductor"):
        params.setdefault("peer_pull", cfg.peer_kv_pull)
    instances = [Instance(e.id, e.role, deployment=e.deployment, healthy=False, kv_capacity_tokens=e.kv_capacity_tokens,
                          max_model_len=e.max_model_len, protocol=e.flavor) for e in engines]
    return Scheduler(instances, policy=cfg.policy, slo=cfg.slo, block_size=cfg.block_size, clock=time.monotonic,
                     predictors=_predictors(cfg), early_rejection=cfg.early_rejection,
                     admission=cfg.admission,
                     keep_decisions=cfg.keep_decisions, priority_headroom=cfg.priority_headroom, **params)


def _predictors(cfg: GatewayConfig) -> Predictors:
    if cfg.predictors == "learned":  # a missing or broken model: the analytic prior answers (logged)
        return learned_predictors(cfg.predictor_models, prior=cfg.prior, online=cfg.predictor_online, strict=False)
    return analytic_predictors(prior=cfg.prior)


class Cluster:
    def __init__(self, cfg: GatewayConfig, engines: list[EngineConfig]):
        self.cfg, self.engines = cfg, {e.id: e for e in engines}
        self.scheduler = build_scheduler(cfg, engines)
        self.session: aiohttp.ClientSession | None = None
        self.clients: dict[str, EngineClient] = {}
        self.drivers: dict[str, PairDriver] = {}
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.healthy: dict[str, bool] = {e.id: False for e in engines}
        self.failures: dict[str, int] = {e.id: 0 for e in engines}
        self.models: list[str] = []
        self.adapters: set[str] = set()  # LoRA adapters the engines list (a /v1/models entry with a parent)
        self.cards: dict[str, dict] = {}  # each model's card as an engine listed it (/v1/models)
        self._zmq = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []
        self._sub_tasks: dict[str, asyncio.Task] = {}
        self.store_tier: StoreTier | None = None

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        for e in self.engines.values():
            fl = flavor(e.flavor)
            self.clients[e.id] = EngineClient(self.session, e.id, e.url, flavor=fl.name,
                                              api_key=e.api_key or self.cfg.auth.engine_api_key,
                                              connect_timeout_s=self.cfg.upstream_connect_timeout_s,
                                              timeout_s=self.cfg.upstream_timeout_s, bootstrap_port=e.bootstrap_port)
            self.drivers[e.id] = fl.driver
            if e.kv_events:
                self._subscribe(e)
        if self.cfg.store is not None:
            st = self.cfg.store
            self.store_tier = StoreTier(st, self.cfg.block_size, st.model or "")
            if not await self.store_tier.start():
                log.warning("store %s does not answer yet: its tier stays off until it does", st.url)
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._poll_forever(), name="health-poll"))

    def _subscribe(self, e: EngineConfig) -> None:
        sub = KVEventSubscriber(self._zmq, e.id, e.kv_events, self.scheduler.index, engine_url=e.url,
                                replay_endpoint=e.kv_events_replay,
                                decode=flavor(e.flavor).decode_kv_batch)
        sub.open()
        self.subscribers[e.id] = sub
        self._sub_tasks[e.id] = asyncio.create_task(self._keep_subscribed(sub), name=f"kv-events-{e.id}")

    async def _keep_subscribed(self, sub: KVEventSubscriber) -> None:
        """A subscriber that fails (a socket error, a bug) is logged and restarted with backoff,
        starting from a resync, so an instance's index never silently freezes."""
        backoff = 0.1
        while True:
            try:
                await sub.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events %s: subscriber failed; restarting in %.1f s", sub.instance_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            sub.resync()  # run() reopens the socket; a failure to (e.g. port not yet free) loops here

    def watch_subscriber(self, sub: KVEventSubscriber) -> None:
        """Keep a subscriber registered at run time (the indexer API's /register) running."""
        self._sub_tasks[f"registered:{id(sub)}"] = asyncio.create_task(self._keep_subscribed(sub),
                                                                       name=f"kv-events-{sub.instance_id}")

    def unwatch_subscriber(self, sub: KVEventSubscriber) -> None:
        task = self._sub_tasks.pop(f"registered:{id(sub)}", None)
        if task is not None:
            task.cancel()
            task.add_done_callback(lambda _t: sub.close())

    async def stop(self) -> None:
        tasks = self._tasks + list(self._sub_tasks.values())
        pending = set(tasks)
        while pending:  # cancel again until done: a cancellation can be lost (asyncio.wait_for on 3.11)
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._sub_tasks.clear()
        if self.session is not None:
            await self.session.close()
        if self.store_tier is not None:
            await self.store_tier.stop()
        self._zmq.term()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.poll_once()
            except Exception:  # polling must outlive any one bad answer
                log.exception("health poll failed")
            reload_models = getattr(self.scheduler.predictors, "reload_if_changed", None)
            if reload_models is not None:  # learned predictors: a recalibrated models.json is picked up
                reload_models()

    async def poll_once(self) -> None:
        ids = list(self.clients)
        results = await asyncio.gather(*(self._poll(i) for i in ids))
        if self.store_tier is not None:
            await self.store_tier.check()
        models: set[str] = set()
        adapters: set[str] = set()
        for eid, cards in zip(ids, results, strict=True):
            cards = self._routed_cards(eid, cards)
            models.update(m["id"] for m in cards)
            adapters.update(m["id"] for m in cards if m.get("parent") and m.get("parent") != m["id"])
        if models:
            self.models = sorted(models)
            self.adapters = adapters

    def _routed_cards(self, eid: str, cards: list[dict]) -> list[dict]:
        """The engine's model cards the gateway routes to it (all, or those its config names);
        the scheduler learns them: a request goes only where its model or adapter is served."""
        if not cards:  # an engine that did not answer keeps what it served
            return cards
        allowed = self.engines[eid].models
        if allowed is not None:  # an engine listing none of its configured names serves nothing
            cards = [m for m in cards if m["id"] in allowed]
        for m in cards:
            self.cards.setdefault(m["id"], m)
        self.scheduler.set_models(eid, [m["id"] for m in cards])
        return cards

    async def _poll(self, eid: str) -> list[dict]:
        client = self.clients[eid]
        ok = await client.health()
        if ok:
            if self.failures[eid] and eid in self.subscribers:
                # back after an outage, however short: it may have restarted with an empty cache
                # (its event sequence cannot always tell), so rebuild its blocks from replay
                self.subscribers[eid].resync()
            self.failures[eid] = 0
            if not self.healthy[eid]:
                log.info("instance %s is healthy: admitted", eid)
                self.set_healthy(eid, True)
            load = await client.load()
            if load is not None:
                self.scheduler.observe_load(eid, running=load.running, waiting=load.waiting, kv_usage=load.kv_usage)
                if load.kv_capacity_tokens and self.engines[eid].kv_capacity_tokens is None:
                    self.scheduler.set_capacity(eid, kv_capacity_tokens=load.kv_capacity_tokens)  # the engine's own
            return await client.model_cards()
        self.failures[eid] += 1
        if self.healthy[eid] and self.failures[eid] >= self.cfg.eject_after_failures:
            log.warning("instance %s failed %d health checks: ejected", eid, self.failures[eid])
            self.set_healthy(eid, False)
        return []

    def set_healthy(self, eid: str, healthy: bool) -> None:
        self.healthy[eid] = healthy
        self.scheduler.set_healthy(eid, healthy)

    def pair(self, prefill: str, decode: str) -> tuple[PairDriver, Pair]:
        """The driver and clients for a placement (a pair never mixes flavours: the prefill's drives)."""
        return self.drivers[prefill], Pair(self.clients[prefill], self.clients[decode])

    def report_failure(self, eid: str) -> None:
        """A request could not reach the engine: count it like a failed health check."""
        self.failures[eid] += 1
        if self.healthy[eid] and self.failures[eid] >= self.cfg.eject_after_failures:
            self.set_healthy(eid, False)

    def ready(self) -> bool:
        roles = {self.engines[i].role for i, h in self.healthy.items() if h}
        return "both" in roles or {"prefill", "decode"} <= roles

    def admin_view(self) -> dict:
        snap = self.scheduler.snapshot()
        if self.store_tier is not None:
            snap["store"] = self.store_tier.view()
        for inst in snap.get("instances", []):
            e = self.engines.get(inst["id"])
            if e is not None:
                inst["url"] = e.url
                inst["kind"] = e.kind
                inst["engine"] = e.kind  # the software (vllm, sglang, or the sim engine) ...
                inst["protocol"] = e.flavor  # ... and the PD protocol / KV-event wire it speaks
                inst["healthy"] = self.healthy.get(e.id, False)
                inst["consecutive_failures"] = self.failures.get(e.id, 0)
                sub = self.subscribers.get(e.id)
                if sub is not None:
                    inst["kv_events"] = vars(sub.stats).copy()
        return snap
