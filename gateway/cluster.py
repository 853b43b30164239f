"""The gateway's live view of its engines: clients and drivers (by each engine's flavour), KV
event subscribers feeding the scheduler's hit index, and health/load polling that ejects and
readmits instances."""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import aiohttp
import zmq
import zmq.asyncio

from engines_adapters.drivers import Pair, PairDriver, UpstreamUnavailable, flavor
from engines_adapters.engine_client import EngineClient
from engines_adapters.kv_events import KVEventSubscriber
from engines_adapters.net import POOL_KEEPALIVE_S
from gateway.config import EngineConfig, GatewayConfig
from gateway.store_tier import StoreTier
from predictors.analytic import analytic_predictors
from predictors.base import Predictors
from predictors.learned import learned_predictors
from scheduler import Instance, Role, Scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
#: how often a healthy engine's served models are asked again (they rarely change)
MODELS_EVERY_S = 1.0

#: the Scheduler's own keyword arguments: a policy parameter of the same name would collide with them
SCHEDULER_ARGS = set(inspect.signature(Scheduler).parameters) - {"instances", "policy_params"}


def build_scheduler(cfg: GatewayConfig, engines: list[EngineConfig]) -> Scheduler:
    """The scheduler for these engines, predicting from their public deployments and the
    configured prior; a bad policy, parameter or deployment raises ValueError."""
    params = dict(cfg.policy_params)
    clash = sorted(SCHEDULER_ARGS & params.keys())
    if "late_rejection" in clash:  # a refusal after the prefill, which no driver acts on
        raise ValueError("late_rejection is an experiment of `conductor simulate` (--late-rejection): the "
                         "gateway's drivers open the decode leg once the prefill is done")
    if clash:
        name = clash[0]
        where = f"the configuration's top-level {name!r}" if name in GatewayConfig.__dataclass_fields__ \
            else "the gateway sets it"
        raise ValueError(f"{name} is the scheduler's own setting, not a policy parameter ({where})")
    if cfg.policy.startswith("conductor"):
        params.setdefault("peer_pull", cfg.peer_kv_pull)
    # the role's name: Instance parses it into a Role (a bad one's error names the instance)
    instances = [Instance(e.id, cast(Role, e.role), deployment=e.deployment, healthy=False,
                          kv_capacity_tokens=e.kv_capacity_tokens, max_model_len=e.max_model_len, protocol=e.flavor)
                 for e in engines]
    return Scheduler(instances, policy=cfg.policy, slo=cfg.slo, block_size=cfg.block_size, clock=time.monotonic,
                     predictors=_predictors(cfg), early_rejection=cfg.early_rejection,
                     admission=cfg.admission,
                     keep_decisions=cfg.keep_decisions, priority_headroom=cfg.priority_headroom, **params)


def _predictors(cfg: GatewayConfig) -> Predictors:
    if cfg.predictors == "learned":  # a missing or broken model: the analytic prior answers (logged)
        return learned_predictors(cfg.predictor_models, prior=cfg.prior, online=cfg.predictor_online, strict=False,
                                  quantile_eta=cfg.predictor_quantile_eta)
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
        # work in progress on each engine that its ejection ends: waiters of requests before their
        # first byte, and abort callbacks of forwarded responses
        self._eject_waiters: dict[str, set[asyncio.Future]] = {e.id: set() for e in engines}
        self._open: dict[str, dict[object, Callable[[str], None]]] = {e.id: {} for e in engines}
        self._models_at: dict[str, float] = {}
        self._served: dict[str, list[dict]] = {}  # each engine's /v1/models entries, last known
        self.store_tier: StoreTier | None = None

    async def start(self) -> None:
        """Open the engines' clients, the KV-event subscribers, the first health poll; a failure
        part-way undoes what was opened (sockets, session) and raises."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        # engine connections in use at once: one per request in progress, and each engine's probes
        # (the descriptors netguard keeps for them); 0 (no limit) when the requests are not bounded
        limit = self.cfg.max_concurrent_requests + 4 * len(self.engines) if self.cfg.max_concurrent_requests else 0
        conn = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300, keepalive_timeout=POOL_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        for e in self.engines.values():
            fl = flavor(e.flavor)
            self.clients[e.id] = EngineClient(self.session, e.id, e.url, flavor=fl.name,
                                              api_key=e.api_key or self.cfg.auth.engine_api_key,
                                              connect_timeout_s=self.cfg.upstream_connect_timeout_s,
                                              timeout_s=self.cfg.upstream_timeout_s,
                                              first_byte_timeout_s=self.cfg.upstream_first_byte_timeout_s,
                                              health_timeout_s=self.cfg.health_timeout_s,
                                              bootstrap_port=e.bootstrap_port)
            self.drivers[e.id] = fl.driver
        self.open_kv_events()
        self._subscribe_all()
        if self.cfg.store is not None:
            st = self.cfg.store
            self.store_tier = StoreTier(st, self.cfg.block_size, st.model or "")
            if not await self.store_tier.start():
                log.warning("store %s does not answer yet: its tier stays off until it does", st.url)
        await self.poll_once()
        for eid in self.clients:  # one loop per engine: a hung engine never delays another's checks
            self._tasks.append(asyncio.create_task(self._watch(eid), name=f"health-{eid}"))
        self._tasks.append(asyncio.create_task(self._side_checks(), name="side-checks"))

    def open_kv_events(self) -> None:
        """Bind (or connect) every engine's KV-event socket, once. Called before engines start,
        an endpoint with port 0 gets a port from the OS, written back into the engine's config:
        no other socket can take it between choosing and binding (an engine's PUB connecting
        early can even connect to itself on a port not yet bound)."""
        for e in self.engines.values():
            if e.kv_events and e.id not in self.subscribers:
                sub = KVEventSubscriber(self._zmq, e.id, e.kv_events, self.scheduler.index, engine_url=e.url,
                                        replay_endpoint=e.kv_events_replay,
                                        decode=flavor(e.flavor).decode_kv_batch)
                try:
                    sub.open()
                except zmq.ZMQError as err:
                    raise RuntimeError(f"cannot bind the KV-event socket {e.kv_events} of engine {e.id}: "
                                       f"{err.strerror}") from None
                e.kv_events = sub.endpoint
                self.subscribers[e.id] = sub

    def _subscribe_all(self) -> None:
        for eid, sub in self.subscribers.items():
            if eid not in self._sub_tasks:
                self._sub_tasks[eid] = asyncio.create_task(self._keep_subscribed(sub), name=f"kv-events-{eid}")

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

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop within ``timeout_s`` whatever the engines and tasks do: nothing here may wait on
        an engine (a hung one never answers) or on a task that ignores its cancellation."""
        deadline = time.monotonic() + timeout_s
        tasks = self._tasks + list(self._sub_tasks.values())
        pending = {t for t in tasks if not t.done()}
        # cancel again until done (a cancellation can be lost: asyncio.wait_for on 3.11), up to half the time
        while pending and time.monotonic() < deadline - timeout_s / 2:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.25)
        if pending:
            log.warning("shutdown: %d background task(s) did not stop: %s", len(pending),
                        ", ".join(sorted(t.get_name() for t in pending)))
        self._tasks.clear()
        self._sub_tasks.clear()
        if self.session is not None:
            # closing waits for every connection's transport to close; one stuck (a peer that stopped
            # reading) would hold the shutdown forever: bounded, and the rest is the process exit's
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await self.session.close()
            except TimeoutError:
                log.warning("shutdown: engine connections did not close in time")
            self.session = None
        if self.store_tier is not None:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await self.store_tier.stop()
            except TimeoutError:
                log.warning("shutdown: the store tier did not stop in time")
            self.store_tier = None
        for sub in self.subscribers.values():
            sub.close()
        # destroy, not term: term blocks until every socket is closed, and one left open (a
        # subscriber's socket leaked by a failed bind or connect) would hold the process forever
        if not self._zmq.closed:
            self._zmq.destroy(linger=0)

    async def _watch(self, eid: str) -> None:
        """Probe one engine every ``health_interval_s``; a probe that took longer (a timeout) is
        followed at once, so a hung engine is ejected after ``eject_after_failures`` timeouts."""
        interval = self.cfg.health_interval_s
        while True:
            started = time.monotonic()
            try:
                self._learn_models({eid: await self._poll(eid)})
            except Exception:  # polling must outlive any one bad answer
                log.exception("health poll of %s failed", eid)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _side_checks(self) -> None:
        """Every health interval, beside the engines' own probes: the shared store's health, and
        learned predictors' models.json (a recalibrated one is picked up)."""
        reload_models = getattr(self.scheduler.predictors, "reload_if_changed", None)
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                if self.store_tier is not None:
                    await self.store_tier.check()
                if reload_models is not None:
                    reload_models()
            except Exception:  # checking must outlive any one bad answer
                log.exception("store check or predictor reload failed")

    async def poll_once(self) -> None:
        ids = list(self.clients)
        self._learn_models(dict(zip(ids, await asyncio.gather(*(self._poll(i) for i in ids)), strict=True)))
        if self.store_tier is not None:
            await self.store_tier.check()

    def _learn_models(self, answers: dict[str, list[dict] | None]) -> None:
        """The served models and LoRA adapters: the union of each engine's last /v1/models list
        (what the gateway routes to it: ``_routed_cards``)."""
        fresh = {eid: self._routed_cards(eid, cards) for eid, cards in answers.items() if cards}
        if not fresh:
            return
        self._served.update(fresh)
        cards = [m for ms in self._served.values() for m in ms]
        if cards:
            self.models = sorted({m["id"] for m in cards})
            self.adapters = {m["id"] for m in cards if m.get("parent") and m.get("parent") != m["id"]}

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

    async def _poll(self, eid: str) -> list[dict] | None:
        """One probe of ``eid``; returns its /v1/models entries when they were asked for and given."""
        client = self.clients[eid]
        now = time.monotonic()
        want_models = now - self._models_at.get(eid, -MODELS_EVERY_S) >= MODELS_EVERY_S
        # health, load and models at once: a probe lasts at most one timeout, not three
        ok, load, served = await asyncio.gather(
            client.health(), client.load(), client.model_cards() if want_models else _none())
        if ok is None:  # the gateway could not even try (out of descriptors): no evidence either way
            return None
        if ok:
            if self.failures[eid] and eid in self.subscribers:
                # back after an outage, however short: it may have restarted with an empty cache
                # (its event sequence cannot always tell), so rebuild its blocks from replay
                self.subscribers[eid].resync()
            self.failures[eid] = 0
            if not self.healthy[eid]:
                log.info("instance %s is healthy: admitted", eid)
                self.set_healthy(eid, True)
            if load is not None:
                self.scheduler.observe_load(eid, running=load.running, waiting=load.waiting, kv_usage=load.kv_usage)
                if load.kv_capacity_tokens and self.engines[eid].kv_capacity_tokens is None:
                    self.scheduler.set_capacity(eid, kv_capacity_tokens=load.kv_capacity_tokens)  # the engine's own
            if served:
                self._models_at[eid] = now
            return served
        self.failures[eid] += 1
        if self.healthy[eid] and self.failures[eid] >= self.cfg.eject_after_failures:
            log.warning("instance %s failed %d health checks: ejected, its requests in progress ended",
                        eid, self.failures[eid])
            self.set_healthy(eid, False)
            self._end_work_on(eid, f"engine {eid} stopped answering health checks (ejected)")
        return None

    def _end_work_on(self, eid: str, reason: str) -> None:
        """An engine found hung: requests waiting for its first byte are retried elsewhere, and
        its forwarded responses end with an error (their reservations are released)."""
        for w in self._eject_waiters[eid]:
            if not w.done():
                w.set_result((eid, reason))
        for abort in list(self._open[eid].values()):
            abort(reason)

    async def until_ejected(self, work: Awaitable[T], engines: tuple[str, ...]) -> T:
        """``work`` (opening a pair, up to its first byte), ended early when one of ``engines`` is
        ejected as hung: UpstreamUnavailable naming it, so the request may go to another pair."""
        waiter = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(work)
        for eid in engines:
            self._eject_waiters[eid].add(waiter)
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_close_result)  # an answer that arrives anyway is closed, not leaked
            raise
        finally:
            for eid in engines:
                self._eject_waiters[eid].discard(waiter)
        if task.done():
            return task.result()
        task.cancel()
        task.add_done_callback(_close_result)
        eid, reason = waiter.result()
        raise UpstreamUnavailable(reason, eid)

    def track(self, eid: str, key: object, abort: Callable[[str], None]) -> None:
        """A response being forwarded from ``eid``: ``abort(reason)`` ends it if ``eid`` is found hung."""
        self._open[eid][key] = abort

    def untrack(self, eid: str, key: object) -> None:
        self._open[eid].pop(key, None)

    def set_healthy(self, eid: str, healthy: bool) -> None:
        self.healthy[eid] = healthy
        self.scheduler.set_healthy(eid, healthy)

    def pair(self, prefill: str, decode: str) -> tuple[PairDriver, Pair]:
        """The driver and clients for a placement (a pair never mixes flavours: the prefill's drives)."""
        return self.drivers[prefill], Pair(self.clients[prefill], self.clients[decode])

    def report_failure(self, eid: str, why: str = "failed requests", *, sent_at: float | None = None) -> None:
        """A request could not reach the engine, or it timed out: count it like a failed health check.
        A timeout (``sent_at``: when its request was sent) is not counted when the engine answered
        another request since: it waited in a working engine's queue, which ejecting would only
        move onto the others (admission's miss, not a hang)."""
        if sent_at is not None and self.clients[eid].answered_at > sent_at:
            log.info("instance %s: a request timed out in its queue while it answered others: not counted", eid)
            return
        self.failures[eid] += 1
        if self.healthy[eid] and self.failures[eid] >= self.cfg.eject_after_failures:
            log.warning("instance %s: %d consecutive failures (%s): ejected", eid, self.failures[eid], why)
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


async def _none() -> None:
    return None


def _close_result(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        close = getattr(task.result(), "close", None)
        if close is not None:
            close()
