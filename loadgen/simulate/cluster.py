"""A simulated P/D cluster in virtual time: sim engines, the live scheduler, and requests moving
through the same request lifecycle the gateway's proxy drives.

What the live path does, modelled here step for step:
* arrival: the prompt is synthesised and tokenised exactly as ``conductor loadgen`` and the
  gateway do (same text, same built-in tokenizer, same block hashes), then ``decide``;
* prefill leg (vLLM two-step): the prefill engine computes the prompt, emits one token and holds
  the KV; its finish is the prefill response (``prefill_finished`` with its cached tokens);
* decode leg: the decode engine pulls the KV (modelled at the network bandwidth by the engine
  model), streams the tokens (each one a ``token`` at the end of the step that made it) and
  finishes; the prefill side frees the held KV once the pull is done;
* KV events reach the hit index ``kv_event_lag_s`` after the step that produced them, and the
  engines' load is reported to the scheduler every ``poll_interval_s``, as the gateway polls;
* with a shared store (``ClusterSpec.store``): one :class:`StoreModel` for the cluster, every
  prefill-capable engine writes its prompts through to it and loads from it what its own cache
  lacks (engines_adapters/store/connector.py), and each decision is told how many of the prompt's
  blocks the store holds now (the gateway's store tier with no event lag);
* peer pulls (``ClusterSpec.peer_pull``, Mooncake's transfer engine; no vLLM or SGLang protocol has
  one): a prefill instance sent with a plan to pull a prefix from another prefill instance loads
  the blocks that instance still holds at dispatch, beyond its own, at the network bandwidth before
  computing the rest; the source's NIC is not modelled as busy, nor its copy as pinned;
* deferred dispatch (``defer=on`` among the policy parameters, scheduler/deferral.py): a request
  offered to the wait room may wait there; the room is pumped after every prefill finishes, on
  the load poll, and at its own next wake-up (a queue reaching the horizon, a deadline), and a
  request it releases is sent then. A request refused from the room is a rejection in the
  record, with its wait (``extra["wait_s"]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engines_adapters.kv_events import apply_events
from engines_adapters.sim.model import EngineModel, SimRequest, StepResult
from engines_adapters.sim.profiles import load_profile
from engines_adapters.store.connector import ModelConnector
from engines_adapters.store.model import StoreModel, StoreSpec
from predictors.base import Predictors
from predictors.telemetry import SLO, RequestRecord
from predictors.types import Role
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.deferral import WaitRoom
from scheduler.hashing import block_hashes
from scheduler.hit_index import HitIndex
from scheduler.lifecycle import Phase, RequestLifecycle

from .instance import SimInstance
from .loop import EventLoop


@dataclass
class ClusterSpec:
    """The simulated cluster: instance counts, engine profile and engine settings."""

    prefill: int = 2
    decode: int = 2
    both: int = 0
    profile: str = "llama3-8b-h200"
    block_size: int = 16
    noise: float = 0.02
    seed: int = 0
    kv_event_lag_s: float = 0.002
    poll_interval_s: float = 1.0
    engine: dict[str, Any] = field(default_factory=dict)  # extra EngineModel keyword arguments
    # extra EngineModel keyword arguments for prefill-capable instances only, over ``engine``
    # (e.g. a smaller prefix cache on the prefill side without starving the decode side)
    prefill_engine: dict[str, Any] = field(default_factory=dict)
    store: StoreSpec | None = None  # a shared Mooncake-style KV store (None: none)
    store_blocks_per_object: int = 1  # KV blocks per store object (1: vLLM's MooncakeStoreConnector)
    store_policy: str = "write_through"  # or write_back: blocks go to the store when a device evicts them
    # prefill instances can fetch a prefix from another prefill instance (conductor then plans such
    # pulls; False: as the gateway, whose engines' PD protocols cannot)
    peer_pull: bool = False

    def roles(self) -> list[tuple[str, Role]]:
        """(instance id, role), named as the embedded cluster names its engines."""
        out = []
        for role, n in ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode), (Role.BOTH, self.both)):
            out += [(f"{role.value}-{k + 1}", role) for k in range(n)]
        return out


@dataclass
class SchedulerSpec:
    policy: str = "conductor"
    policy_params: dict[str, Any] = field(default_factory=dict)
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=30.0, tbt_s=0.2))
    early_rejection: bool = False
    admission: bool = True  # False: never refuse over the SLO, as the peer routers ship
    late_rejection: bool = False  # no early rejection: TBT checked by the decode side after the prefill
    seed: int = 0


class _Live:
    __slots__ = ("lc", "tokens", "hashes", "max_tokens", "output_len", "prefill", "decode")

    def __init__(self, lc: RequestLifecycle, tokens: list[int], hashes: list[int], max_tokens: int,
                 output_len: int | None):
        self.lc, self.tokens, self.hashes, self.max_tokens, self.output_len = lc, tokens, hashes, max_tokens, output_len
        self.prefill: SimInstance | None = None
        self.decode: SimInstance | None = None


class SimCluster:
    def __init__(self, spec: ClusterSpec, sched: SchedulerSpec, loop: EventLoop,
                 predictors: Callable[[list[Instance]], Predictors] | None = None,
                 on_done: Callable[[RequestRecord], None] | None = None):
        self.spec, self.loop = spec, loop
        profile = load_profile(spec.profile)
        if spec.peer_pull and spec.store is not None:
            raise ValueError("peer pulls with a shared store are not modelled: use one or the other")
        self._block_bytes = profile.kv_bytes_per_token * spec.block_size
        self.peer_pulled_tokens = 0  # what dispatched pulls bring (what the source held then, not the plans)
        self.instances: dict[str, SimInstance] = {}
        members = []
        self.store = StoreModel(spec.store) if spec.store is not None else None
        self.connectors: dict[str, ModelConnector] = {}
        for k, (iid, role) in enumerate(spec.roles()):
            conn = None
            if self.store is not None and role is not Role.DECODE:
                conn = self.connectors[iid] = ModelConnector(
                    self.store, profile.kv_bytes_per_token * spec.block_size, spec.store_blocks_per_object)
            # a decode-only instance is never a prefill candidate: its KV events could not change a
            # decision (the live gateway indexes them all the same), so it does not produce them
            model = EngineModel(profile, role.value, block_size=spec.block_size, seed=spec.seed + k, noise=spec.noise,
                                kv_events=role is not Role.DECODE, event_hashes="index", store=conn,
                                store_policy=spec.store_policy,
                                **(spec.engine if role is Role.DECODE else {**spec.engine, **spec.prefill_engine}))
            self.instances[iid] = SimInstance(iid, role, model, loop, self._on_step)
            members.append(Instance(iid, role, deployment=profile.deployment.name))
        params = dict(sched.policy_params)
        if sched.policy.startswith("conductor"):  # as the gateway (engines cannot pull from a peer) unless modelled
            params.setdefault("peer_pull", spec.peer_pull)
        self.scheduler = Scheduler(members, policy=sched.policy, slo=sched.slo, block_size=spec.block_size,
                                   clock=loop.clock, early_rejection=sched.early_rejection,
                                   late_rejection=sched.late_rejection, seed=sched.seed, admission=sched.admission,
                                   keep_decisions=0, predictors=predictors(members) if predictors else None,
                                   index=HitIndex(spec.block_size, trust_event_hashes=True), **params)
        for iid, inst in self.instances.items():  # what the gateway reads from each engine's /metrics at start
            self.scheduler.set_capacity(iid, kv_capacity_tokens=inst.model.kv.capacity * spec.block_size)
        self.on_done = on_done
        self._live: dict[str, _Live] = {}
        self.ignored_events = 0
        self.room = WaitRoom(self.scheduler)  # with defer off, offer() is decide() and nothing waits
        self._wake_at: float | None = None

    # --- requests -----------------------------------------------------------------------
    def arrive(self, rid: str, tokens: list[int], max_tokens: int, output_len: int | None = None,
               extra: dict[str, Any] | None = None) -> None:
        """A request reaches the gateway now: decide, then send its first leg."""
        now = self.loop.now
        rec = RequestRecord(rid, arrival_s=now, prompt_tokens=len(tokens), max_tokens=max_tokens, sent_s=now)
        if extra:
            rec.extra.update(extra)
        lc = RequestLifecycle(self.scheduler, rec, self.loop.clock,
                              observers=(self._finished, self.scheduler.predictors.observe))
        facts = RequestFacts(rid, len(tokens), self._hashes(tokens), max_tokens)
        if self.store is not None:
            facts.store_blocks = self.store_prefix(facts.block_hashes)
        live = self._live[rid] = _Live(lc, tokens, facts.block_hashes, max_tokens, output_len)
        d = self.room.offer(lc, facts)  # a rejection finishes the request (``_finished`` forgets it)
        if d is None:
            self._schedule_wake()
        elif isinstance(d, Placement):
            self._send(live, d)

    def _send(self, live: _Live, d: Placement) -> None:
        """The placed request's first leg: the prefill instance's, or a colocated one's whole request."""
        lc, rid, tokens = live.lc, live.lc.request_id, live.tokens
        try:
            if d.prefill == d.decode:  # a colocated instance serves the whole request
                lc.handed_over()
                live.decode = self.instances[d.decode]
                live.decode.add(SimRequest(rid, tokens, live.max_tokens, output_len=live.output_len,
                                           block_hashes=live.hashes))
            else:
                lc.prefill_started()
                live.prefill = self.instances[d.prefill]
                load, pulled = self.peer_pull(d, live.hashes)
                if pulled:
                    lc.record.extra["peer_pulled_tokens"] = pulled
                live.prefill.add(SimRequest(rid, tokens, 1, output_len=1, hold_kv=True, block_hashes=live.hashes,
                                            **load))
        except ValueError as e:  # the engine refuses it (e.g. longer than its context): a 400
            lc.finish("error", 400, f"engine_refused: {e}")

    def peer_pull(self, d: Placement, hashes: list[int]) -> tuple[dict[str, Any], int]:
        """A planned pull from another prefill instance as the engine's KV load (the fields a store
        prefetch fills: the source's blocks of this prompt it still holds, beyond the puller's own),
        and the tokens it brings."""
        src = self.instances.get(d.transfer_from or "") if self.spec.peer_pull and d.transfer_tokens else None
        if src is None or src.id == d.prefill:
            return {}, 0
        dst = self.instances[d.prefill].model
        have = src.model.kv.match_gpu(hashes, min(d.hit_tokens // self.spec.block_size, len(hashes)))
        own = dst.kv.match_gpu(hashes, have)
        if have <= own:
            return {}, 0
        pulled = have - own
        self.peer_pulled_tokens += pulled * self.spec.block_size
        load_s = dst.transfer_latency_s + pulled * self._block_bytes / dst.net_bytes_per_s
        return {"store_blocks": have, "store_fetched": pulled, "store_load_s": load_s}, pulled * self.spec.block_size

    # --- the wait room (deferred dispatch) ----------------------------------------------
    def pump(self) -> None:
        """Dispatch what the wait room releases now; then wake again when it next may."""
        if not len(self.room):
            return
        for lc, d in self.room.pump():
            live = self._live.get(lc.request_id)
            if isinstance(d, Placement) and live is not None:
                self._send(live, d)
        self._schedule_wake()

    def _schedule_wake(self) -> None:
        t = self.room.next_wakeup()
        if t is not None and (self._wake_at is None or t < self._wake_at):
            self._wake_at = t
            self.loop.at(t, self._wake, t)

    def _wake(self, t: float) -> None:
        if self._wake_at != t:  # superseded by an earlier wake-up
            return
        self._wake_at = None
        self.pump()

    def store_prefix(self, hashes: list[int]) -> int:
        """Leading blocks of a prompt the store holds now (whole objects only)."""
        assert self.store is not None
        c = self.spec.store_blocks_per_object
        return c * self.store.prefix(hashes[c - 1::c], self.loop.now)

    def _hashes(self, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, self.spec.block_size)

    def _finished(self, rec: RequestRecord) -> None:
        self._live.pop(rec.request_id, None)
        if self.on_done is not None:
            self.on_done(rec)

    def active(self) -> int:
        return len(self._live)

    # --- engine outcomes ----------------------------------------------------------------
    def _on_step(self, inst: SimInstance, res: StepResult) -> None:
        end, live = res.end, self._live
        prefilled = False
        if inst.role is not Role.PREFILL:  # the prefill leg's single token is not the client's
            for rid, _tok in res.emitted:
                r = live.get(rid)
                if r is not None and r.decode is inst:
                    r.lc.token(end)
        for f in res.finished:
            r = live.get(f.request_id)
            if r is None:
                continue
            if f.kv_held and r.lc.phase is Phase.PREFILLING:
                prefilled = True
                if r.lc.prefill_finished(f.cached_tokens) is not None:  # refused by the decode side
                    if inst.model.release_kv(f.request_id):
                        inst.kick()
                    continue
                d = self.instances[r.lc.placement.decode]  # type: ignore[union-attr]
                r.decode = d
                try:
                    d.add(SimRequest(f.request_id, r.tokens, r.max_tokens, output_len=r.output_len, remote_kv=True,
                                     block_hashes=r.hashes))
                except ValueError as e:
                    inst.model.release_kv(f.request_id)
                    r.lc.finish("error", 400, f"engine_refused: {e}")
            elif r.decode is inst:
                r.lc.finish("ok", 200, usage={"completion_tokens": f.output_tokens,
                                              "prompt_tokens_details": {"cached_tokens": f.cached_tokens}})
        for rid in res.kv_loaded:  # the decode side has the KV: the prefill side frees it
            r = live.get(rid)
            src = r.prefill if r is not None else None
            if src is not None and src.model.release_kv(rid):
                src.kick()
        if res.events:
            self.loop.at(end + self.spec.kv_event_lag_s, self._deliver_events, inst.id, res.events)
        if prefilled:  # a prefill queue got shorter: the wait room may release someone
            self.pump()

    def _deliver_events(self, iid: str, events: list) -> None:
        self.ignored_events += apply_events(self.scheduler.index, iid, events)

    # --- load reports (the gateway's health poll) ---------------------------------------------
    def report_load(self) -> None:
        for iid, inst in self.instances.items():
            st = inst.model.stats()
            self.scheduler.observe_load(iid, running=st.running, waiting=st.waiting, kv_usage=st.kv_usage)
        self.pump()
