"""The scheduler facade: one call per request, pure (no I/O, no awaits), clock injected.

``decide`` runs six stages over one :class:`DecisionContext`, each a method below:
validate -> eligible candidates (healthy, not excluded, context long enough) -> cache facts
(every instance's longest prefix, and the store's, from the prefix index) -> terms (each prefill
candidate's transfer, queue and prefill; each decode candidate's TBT) -> choice (the policy picks
the prefill instance, then the decode instance; a ``both`` instance decodes its own request) ->
admission (TTFT with the prefill->decode KV shipment, and TBT, against the SLO) -> commit
(reserve in the ledger, keep the explanation). A stage refuses by raising ``_Refused``.
The live gateway and the discrete-event simulator run this very code.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

import xxhash

from predictors.analytic import analytic_predictors
from predictors.base import DecodeState, Predictors, PrefillState
from predictors.facts import Deployment, load_deployment
from predictors.store_traffic import StoreTraffic
from predictors.telemetry import SLO
from predictors.types import Role, Tier
from scheduler import admission
from scheduler.admission import check_headroom
from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate, TermBook, best_holder
from scheduler.deferral import DeferParams, split_params as split_defer
from scheduler.explain import bare_record, decode_table, deferred_tables, prefill_table, request_labels
from scheduler.frame import LoadFrame
from scheduler.hit_index import HitIndex
from scheduler.inflight import InflightPrefixes
from scheduler.ledger import Ledger, Reservation
from scheduler.overload import CostWindow, split_params
from scheduler.policies import POLICIES, PrefillChoice, make_policy
from scheduler.state import LoadLedger, PrefixIndex
from scheduler.types import BAD_REQUEST, INTERNAL, UNAVAILABLE, Instance, Placement, Rejection, RequestFacts
from scheduler.validation import check_facts

#: Blocks of shared-store entries an instance may report beyond twice its device + host capacity.
STORE_ALLOWANCE_BLOCKS = 1 << 18


class _Pools:
    """Candidate instances by side, with the context lengths that decide whether to filter."""

    __slots__ = ("prefill", "decode", "prefill_max_len", "prefill_min_len", "decode_min_len", "prefill_only",
                 "mixed")

    def __init__(self, prefill: list[Instance], decode: list[Instance], max_len: dict[str, int]):
        self.prefill, self.decode = prefill, decode
        self.prefill_max_len = max((max_len[i.id] for i in prefill), default=0)
        self.prefill_min_len = min((max_len[i.id] for i in prefill), default=0)
        self.decode_min_len = min((max_len[i.id] for i in decode), default=0)
        self.prefill_only = any(i.role == Role.PREFILL for i in prefill)
        # whether the fleet mixes engine families (PD protocols): then pairs must match
        self.mixed = len({i.protocol for i in prefill + decode}) > 1


class Scheduler:
    """Decides (prefill, decode) pairs over a cluster of instances; see docs/scheduler.md."""

    def __init__(self, instances: Iterable[Instance], *, policy: str = "conductor", slo: SLO = SLO(),
                 block_size: int = 16, clock: Callable[[], float] = time.monotonic,
                 predictors: Predictors | None = None, seed: int = 0, early_rejection: bool = False,
                 admission: bool = True, late_rejection: bool = False,
                 keep_decisions: int = 1000, index: PrefixIndex | None = None, ledger: LoadLedger | None = None,
                 priority_headroom: dict[str, float] | None = None, **policy_params: Any):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        # overload admission by cost (scheduler/overload.py): any policy takes its parameters;
        # on by default for the policies that say so (conductor)
        cls = POLICIES.get(policy)
        overload, policy_params = split_params(policy_params, bool(cls and cls.cost_admission))
        # deferred dispatch (scheduler/deferral.py): any policy takes its parameters; the driver's
        # wait room reads them (the scheduler itself decides the same either way)
        self.defer: DeferParams
        self.defer, policy_params = split_defer(policy_params)
        self.policy = make_policy(policy, **policy_params)
        self.overload: CostWindow | None = CostWindow(overload) if overload.enabled else None
        self.policy_name = policy
        self.slo = slo
        self.block_size = block_size
        self.clock = clock
        self.seed = seed
        if early_rejection and late_rejection:
            raise ValueError("early_rejection and late_rejection exclude each other")
        self.early_rejection = early_rejection
        # priority class -> fraction of the SLO its requests are admitted up to: under overload a
        # class with less headroom is refused first, leaving the rest of the SLO to the others
        self.priority_headroom = check_headroom(priority_headroom or {})
        # False: never refuse over the SLO (verdicts still recorded) -- how the peer routers ship
        self.admission = admission
        self.late_rejection = late_rejection
        self.index: PrefixIndex = index if index is not None else HitIndex(block_size)
        self.ledger: LoadLedger = ledger if ledger is not None else Ledger()
        self.inflight = InflightPrefixes()
        self._inflight = self.policy.reads_inflight  # kept only for a policy that reads it
        # analytic predictors over the instances' public deployments unless some are injected
        self.predictors = predictors if predictors is not None else analytic_predictors()
        # the shared store's write-through traffic as the gateway knows it (a learned store term reads it)
        self.store_traffic = StoreTraffic()
        attach = getattr(self.predictors.transfer, "attach_store_traffic", None)
        if attach is not None:
            attach(self.store_traffic)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=max(0, keep_decisions))
        self.counts: dict[str, int] = {"placed": 0}
        self._instances: dict[str, Instance] = {}
        self._healthy: dict[str, bool] = {}
        self._max_len: dict[str, int] = {}
        self._deployment: dict[str, Deployment] = {}
        self._kv_capacity: dict[str, int] = {}
        self._group: dict[str, Any] = {}
        self._pool_cache: _Pools | None = None
        # model names (base models and LoRA adapters) each instance serves, once known
        # (``set_models``); an instance without an entry serves whatever it is asked
        self._models: dict[str, frozenset[str]] = {}
        self._model_pools: tuple[_Pools | None, dict[str, _Pools]] = (None, {})  # per model, over _pool_cache
        for inst in instances:
            if not self.add_instance(inst):
                raise ValueError(f"duplicate instance id {inst.id!r}")

    # --- cluster membership -------------------------------------------------------------
    @staticmethod
    def policy_names() -> list[str]:
        return list(POLICIES)

    def add_instance(self, inst: Instance) -> bool:
        """Register an instance; False if its id is taken. ValueError for an unknown deployment.

        Capacity the instance does not state is estimated from its public deployment until the
        engine reports its own (:meth:`set_capacity`)."""
        if not isinstance(inst, Instance):
            raise TypeError(f"expected an Instance, got {type(inst).__name__}")
        if inst.id in self._instances:
            return False
        try:
            deployment = load_deployment(inst.deployment)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        kv = inst.kv_capacity_tokens or deployment.estimated_kv_capacity_tokens()
        self._deployment[inst.id], self._kv_capacity[inst.id] = deployment, kv
        if self.predictors.register is not None:
            self.predictors.register(inst.id, deployment, kv)
        self.index.register(inst.id, max_blocks=self._index_blocks(kv, inst.host_capacity_tokens))
        typical = self.predictors.prefill.prefill_time(inst.id, 1024, 0) if inst.prefills else 0.0
        self.ledger.add_instance(inst.id, kv_capacity_tokens=kv, typical_prefill_s=typical)
        self._instances[inst.id] = inst
        self._healthy[inst.id] = bool(inst.healthy)
        self._max_len[inst.id] = inst.max_model_len or deployment.max_model_len
        self._group[inst.id] = self.predictors.group(inst.id) if self.predictors.group is not None else inst.id
        self._pool_cache = None
        return True

    def _index_blocks(self, kv_capacity_tokens: int, host_capacity_tokens: int) -> int:
        """Blocks the hit index accepts from one instance: twice its tiers, plus store entries."""
        return 2 * (kv_capacity_tokens + host_capacity_tokens) // self.block_size + STORE_ALLOWANCE_BLOCKS

    def set_capacity(self, instance_id: str, *, kv_capacity_tokens: int | None = None,
                     max_model_len: int | None = None) -> bool:
        """Capacity learned from the engine at run time (e.g. vLLM's ``vllm:cache_config_info``:
        num_gpu_blocks x block_size) replaces the configured value or the estimate. False for an
        unknown instance or nothing valid to set; True when something changed."""
        if not self._known(instance_id):
            return False
        changed = False
        if isinstance(kv_capacity_tokens, int) and kv_capacity_tokens > 0 \
                and kv_capacity_tokens != self._kv_capacity[instance_id]:
            self._kv_capacity[instance_id] = kv_capacity_tokens
            inst = self._instances[instance_id]
            self.ledger.set_kv_capacity(instance_id, kv_capacity_tokens)
            self.index.set_max_blocks(instance_id, self._index_blocks(kv_capacity_tokens, inst.host_capacity_tokens))
            if self.predictors.register is not None:
                self.predictors.register(instance_id, self._deployment[instance_id], kv_capacity_tokens)
                if self.predictors.group is not None:
                    self._group[instance_id] = self.predictors.group(instance_id)
            changed = True
        if isinstance(max_model_len, int) and max_model_len > 0 and max_model_len != self._max_len[instance_id]:
            self._max_len[instance_id] = max_model_len
            changed = True
        if changed:
            self._pool_cache = None
        return changed

    def set_models(self, instance_id: str, models: Iterable[str] | None) -> bool:
        """The model names an instance answers to (its base models and loaded LoRA adapters, as
        its ``/v1/models`` lists them); a request naming a model is placed only on instances
        serving it, prefill and decode side alike. None: forget (serves anything). True on a change."""
        if not self._known(instance_id):
            return False
        new = None if models is None else frozenset(models)
        if self._models.get(instance_id) == new:
            return False
        if new is None:
            self._models.pop(instance_id, None)
        else:
            self._models[instance_id] = new
        self._pool_cache = None
        return True

    def serves(self, instance_id: str, model: str) -> bool:
        names = self._models.get(instance_id)
        return names is None or model in names

    def max_model_len(self) -> int:
        """The longest context any known instance takes (0 with none): the gateway bounds a
        prompt's size by it before tokenizing."""
        return max(self._max_len.values(), default=0)

    def remove_instance(self, instance_id: str) -> bool:
        """Forget an instance (its index entries too); its reservations stay releasable once."""
        if not self._known(instance_id):
            return False
        del self._instances[instance_id], self._healthy[instance_id], self._max_len[instance_id]
        del self._group[instance_id], self._deployment[instance_id], self._kv_capacity[instance_id]
        self._models.pop(instance_id, None)
        self._pool_cache = None
        self.index.unregister(instance_id)
        self.ledger.remove_instance(instance_id)
        if self.predictors.unregister is not None:
            self.predictors.unregister(instance_id)
        return True

    def set_healthy(self, instance_id: str, healthy: bool) -> bool:
        if not self._known(instance_id):
            return False
        if self._healthy[instance_id] != bool(healthy):
            self._healthy[instance_id] = bool(healthy)
            self._pool_cache = None
        return True

    def observe_load(self, instance_id: str, *, running: int, waiting: int, kv_usage: float) -> bool:
        """Reconcile with scraped engine metrics (vllm:num_requests_running/waiting, kv_cache_usage_perc)."""
        if not self._known(instance_id):
            return False
        return self.ledger.observe(instance_id, running, waiting, kv_usage, self.clock())

    def deployment_name(self, instance_id: str) -> str | None:
        """The public deployment an instance runs (its telemetry's feature source); None if unknown."""
        d = self._deployment.get(instance_id)
        return None if d is None else d.name

    def _known(self, instance_id: Any) -> bool:
        return isinstance(instance_id, str) and instance_id in self._instances

    def _pools(self, exclude: frozenset[str]) -> "_Pools":
        """Healthy prefill and decode candidates (cached until membership or health changes)."""
        if not exclude and self._pool_cache is not None:
            return self._pool_cache
        live = [i for i in self._instances.values() if self._healthy[i.id] and i.id not in exclude]
        pools = _Pools([i for i in live if i.prefills], [i for i in live if i.decodes], self._max_len)
        if not exclude:
            self._pool_cache = pools
        return pools

    def _for_model(self, pools: _Pools, model: str) -> _Pools:
        """The candidates serving ``model`` (an adapter counts only where it is loaded); cached
        per model while the unfiltered pools are."""
        cached = pools is self._pool_cache
        if cached:
            base, by_model = self._model_pools
            if base is not pools:
                by_model = {}
                self._model_pools = (pools, by_model)
            hit = by_model.get(model)
            if hit is not None:
                return hit
        serves = self.serves
        prefill = [i for i in pools.prefill if serves(i.id, model)]
        if not prefill and pools.prefill:
            raise _Refused(UNAVAILABLE, "model_not_served",
                           f"no healthy prefill instance serves model {model!r}")
        out = _Pools(prefill, [i for i in pools.decode if serves(i.id, model)], self._max_len)
        if cached and len(self._model_pools[1]) < 1024:  # bounded: model names come from the engines
            self._model_pools[1][model] = out
        return out

    # --- request lifecycle --------------------------------------------------------------
    def decide(self, facts: RequestFacts, avoid: Collection[str] = ()) -> Placement | Rejection:
        """Place a request or refuse it; never raises. ``avoid``: prefill instances it must not be
        placed on, which still serve their cached prefix to a peer pull (the wait room's spill,
        scheduler/deferral.py)."""
        return self._guarded(facts, frozenset(), commit=True, avoid=avoid)

    def evaluate(self, facts: RequestFacts, avoid: Collection[str] = (),
                 frame: LoadFrame | None = None) -> Placement | Rejection:
        """What ``decide`` would answer now, without reserving or advancing policy state.
        ``frame``: at the frame's instant, sharing its load views and hit-index answers with the
        evaluations before it (scheduler/frame.py; valid only while nothing is decided)."""
        return self._guarded(facts, frozenset(), commit=False, avoid=avoid, frame=frame)

    def retry_excluding(self, facts: RequestFacts, exclude: set[str],
                        avoid: Collection[str] = ()) -> Placement | Rejection:
        """Release the request's reservation (if any) and decide again avoiding ``exclude``."""
        rid = getattr(facts, "request_id", None)
        if isinstance(rid, str):
            self.release(rid)
        try:
            excluded = frozenset(x for x in exclude if isinstance(x, str))
        except TypeError:
            excluded = frozenset()
        return self._guarded(facts, excluded, commit=True, avoid=avoid)

    def prefill_done(self, request_id: str) -> bool:
        """Prefill finished: its queued work leaves the prefill instance. Idempotent."""
        if not isinstance(request_id, str):
            return False
        now = self.clock()
        self.inflight.prefill_done(request_id, now)
        self.store_traffic.done(request_id, now)  # its write-through starts now
        return self.ledger.prefill_done(request_id, now)

    def admit_decode(self, facts: RequestFacts, decode: str) -> Rejection | None:
        """``late_rejection`` only (Mooncake's baseline without early rejection): when the request's
        prefill is done, its ``decode`` instance checks the TBT SLO against the sequences it is
        decoding then (prefill done, this request not counted) plus this one; a refusal wastes the
        prefill. None (admitted) otherwise, or for a request holding no reservation. The caller
        finishes the request."""
        slo = admission.scaled_slo(admission.resolve_slo(self.slo, facts.slo), self._headroom(facts))
        if not self.late_rejection or slo.tbt_s is None or facts.request_id not in self.ledger:
            return None
        now = self.clock()
        decoding = [x for x in self.ledger.decode_departures(decode)
                    if not x.prefill_pending and x.request_id != facts.request_id]
        state = DecodeState(decode, len(decoding), sum(x.kv_tokens for x in decoding))
        tbt = self.predictors.tbt.tbt(state, facts.prompt_tokens, facts.max_tokens)
        v = admission.check_tbt(tbt, slo.tbt_s, state, decoding, facts.prompt_tokens, facts.max_tokens,
                                self.predictors, now)
        if v is None:
            return None
        self._count(v.reason)
        record = bare_record(facts.request_id, self.policy_name, now, v.reason, v.message)
        record.update(request_labels(facts, self._headroom(facts)), stage="decode")
        return Rejection(facts.request_id, v.status, v.reason, v.message, v.retry_after_s, record)

    def release(self, request_id: str) -> bool:
        """Return everything the reservation holds; True the first time only."""
        if not isinstance(request_id, str):
            return False
        self.inflight.drop(request_id)
        self.store_traffic.done(request_id, None)
        return self.ledger.release(request_id, self.clock())

    def prefill_queues_s(self, now: float | None = None, frame: LoadFrame | None = None) -> dict[str, float]:
        """Each healthy prefill instance's predicted queue (s): what the wait room reads before
        evaluating anyone (scheduler/deferral.py). With a ``frame``: at its instant, from it."""
        pool = self._pools(frozenset()).prefill
        if frame is not None:
            states, _, queues = self._prefill_views(pool, frame.now, frame)
            return {s.instance: q for s, q in zip(states, queues, strict=True)}
        states, _ = self.ledger.prefill_views([i.id for i in pool], self.clock() if now is None else now)
        queue_time = self.predictors.queue.queue_time
        return {s.instance: queue_time(s) for s in states}

    def min_prefill_queue_s(self, now: float | None = None, frame: LoadFrame | None = None) -> float:
        """The shortest predicted prefill queue over the healthy prefill instances (inf with none)."""
        return min(self.prefill_queues_s(now, frame).values(), default=float("inf"))

    def _prefill_views(self, pool: list[Instance], now: float, frame: LoadFrame
                       ) -> tuple[list[PrefillState], list[int], list[float]]:
        """The ledger's prefill views of ``pool`` and their predicted queues, once per frame."""
        key = tuple(i.id for i in pool)
        got = frame.prefill.get(key)
        if got is None:
            states, actives = self.ledger.prefill_views(key, now)
            got = frame.prefill[key] = (states, actives, list(map(self.predictors.queue.queue_time, states)))
        else:
            frame.hits += 1
        return got

    def refuse(self, facts: RequestFacts, status: int, reason: str, message: str,
               retry_after_s: float | None = None) -> Rejection:
        """A refusal decided outside ``decide`` (the wait room's ``deadline``), counted and kept in
        the decision log as ``decide``'s own are."""
        return self._refuse(facts, status, reason, message, self.clock(), True, retry_after_s=retry_after_s)

    # --- reporting ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        rows = []
        for iid, inst in self._instances.items():
            t = self.ledger.instance_totals(iid)
            rows.append({"id": iid, "role": inst.role, "deployment": self._deployment[iid].name,
                         "kv_capacity_tokens": self._kv_capacity[iid], "max_model_len": self._max_len[iid],
                         "healthy": self._healthy[iid],
                         "reserved_prefill_tokens": t["reserved_prefill_tokens"],
                         "reserved_prefill_s": t["reserved_prefill_s"], "active_requests": t["active_requests"],
                         "running": t["running"], "kv_tokens": t["kv_tokens"],
                         "cached_blocks": self.index.cached_blocks(iid)})
        totals: dict[str, Any] = dict(self.ledger.totals())  # JSON for /debug: numbers and nested dicts
        totals.update(instances=len(self._instances), healthy=sum(self._healthy.values()),
                      index_blocks=self.index.blocks(), index_overflows=self.index.overflows,
                      decisions=dict(self.counts))
        return {"policy": self.policy_name, "instances": rows, "totals": totals,
                "index_mb": self.index.memory_bytes() / 1e6}

    # --- the decision -------------------------------------------------------------------
    def _guarded(self, facts: Any, exclude: frozenset[str], commit: bool,
                 avoid: Collection[str] = (), frame: LoadFrame | None = None) -> Placement | Rejection:
        try:
            return self._decide(facts, exclude, commit, frozenset(avoid), frame)
        except Exception as e:  # a bug of ours must not escape into the gateway's request path
            rid = getattr(facts, "request_id", None)
            record = bare_record(rid, self.policy_name, self.clock(), "internal_error", repr(e))
            if commit:
                self._count("internal_error")
                self.decisions.append(record)
            return Rejection(str(rid), INTERNAL, "internal_error", f"scheduler error: {e!r}", None, record)

    def _refuse(self, facts: Any, status: int, reason: str, message: str, now: float, commit: bool,
                record: dict[str, Any] | None = None, retry_after_s: float | None = None) -> Rejection:
        rid = getattr(facts, "request_id", None)
        if record is None:
            record = bare_record(rid, self.policy_name, now, reason, message)
            record.update(request_labels(facts))
        else:
            record["message"] = message
        if commit:
            self._count(reason)
            self.decisions.append(record)
        return Rejection(rid if isinstance(rid, str) else str(rid), status, reason, message, retry_after_s, record)

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _decide(self, facts: Any, exclude: frozenset[str], commit: bool,
                avoid: frozenset[str] = frozenset(), frame: LoadFrame | None = None) -> Placement | Rejection:
        """The stages in order; a stage that refuses raises :class:`_Refused`."""
        now = self.clock() if frame is None else frame.now
        try:
            self._validate(facts, now, commit)
            ctx = DecisionContext(facts, now, self.block_size, self.predictors, self._rng_for(facts.request_id))
            ctx.slo = admission.resolve_slo(self.slo, facts.slo)
            ctx.admit_fraction = self._headroom(facts)
            self._eligible(ctx, exclude)
            self._cache_facts(ctx, frame)
            self._terms(ctx, avoid, frame)
            choice = self._choose(ctx)
            if self.overload is not None:
                self._overload(ctx, choice, commit)
            self._admit(ctx, choice, commit)
        except _Refused as r:
            return self._refuse(facts, r.status, r.reason, r.message, now, commit, r.record, r.retry_after_s)
        return self._commit(ctx, choice, commit)

    # --- stage 0: the request is well formed and new -------------------------------------
    def _validate(self, facts: Any, now: float, commit: bool) -> None:
        bad = check_facts(facts, self.block_size)
        if bad is not None:
            raise _Refused(BAD_REQUEST, bad[0], bad[1])
        if commit and facts.request_id in self.ledger:
            raise _Refused(BAD_REQUEST, "duplicate_request_id",
                           f"request {facts.request_id!r} already holds a reservation")

    # --- stage 1: eligible candidates (healthy, not excluded, long enough a context) --------
    def _eligible(self, ctx: DecisionContext, exclude: frozenset[str]) -> None:
        facts = ctx.facts
        pools = self._pools(exclude)
        model = getattr(facts, "model", None)
        if model is not None and self._models:
            pools = self._for_model(pools, model)
        if not pools.prefill:
            raise _Refused(UNAVAILABLE, "no_healthy_prefill", "no healthy prefill instance")
        need = facts.prompt_tokens + facts.max_tokens
        if need > pools.prefill_max_len:
            raise _Refused(BAD_REQUEST, "prompt_too_long",
                           f"{facts.prompt_tokens} prompt + {facts.max_tokens} output tokens exceed the "
                           f"{pools.prefill_max_len}-token context")
        decode_pool = pools.decode
        if need > pools.decode_min_len:
            decode_pool = [i for i in decode_pool if self._max_len[i.id] >= need]
        prefill_pool = pools.prefill
        if pools.mixed:  # a prefill-only instance needs a decode instance of its protocol
            protos = {i.protocol for i in decode_pool}
            prefill_pool = [i for i in prefill_pool if i.role == Role.BOTH or i.protocol in protos]
        if need > pools.prefill_min_len or (not decode_pool and pools.prefill_only):
            prefill_pool = [i for i in prefill_pool
                            if self._max_len[i.id] >= need and (i.role == Role.BOTH or decode_pool)]
        if not prefill_pool:
            raise _Refused(UNAVAILABLE, "no_healthy_decode", "no healthy decode instance for a prefill-only instance")
        ctx.prefill_pool, ctx.decode_pool = prefill_pool, decode_pool

    # --- stage 2: cache facts (longest prefix per instance and in the store) ---------------
    def _cache_facts(self, ctx: DecisionContext, frame: LoadFrame | None = None) -> None:
        facts = ctx.facts
        # never the last prompt token's block (the engine recomputes that token for its logits)
        usable = min(len(facts.block_hashes), (facts.prompt_tokens - 1) // self.block_size)
        raw = getattr(facts, "store_blocks", None)
        told = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
        walk, version = told is None, getattr(self.index, "version", None)
        match = None if frame is None else frame.match(facts.request_id, version, facts.block_hashes, usable, walk)
        if match is None:
            try:  # a store answer from the store itself makes the index's store walk redundant
                match = self.index.match(facts.block_hashes, usable, store=walk)
            except TypeError:
                raise _Refused(BAD_REQUEST, "bad_block_hashes", "block hashes must be integers") from None
            if frame is not None:
                frame.keep_match(facts.request_id, version, facts.block_hashes, usable, walk, match)
        ctx.match = match
        ctx.store_blocks = ctx.match.store
        if told is not None and told > ctx.store_blocks:
            ctx.store_blocks = min(told, usable)
        ctx.usable_blocks = usable
        if self._inflight:
            self.inflight.expire(ctx.now)
            ctx.pending = self.inflight.match(facts.block_hashes, usable)

    # --- stage 3: every candidate's predicted terms ------------------------------------------
    def _terms(self, ctx: DecisionContext, avoid: frozenset[str] = frozenset(), frame: LoadFrame | None = None) -> None:
        pred, ledger, now, match = self.predictors, self.ledger, ctx.now, ctx.match
        assert match is not None, "the cache-facts stage runs first"
        book = ctx.terms = TermBook(ctx.facts.prompt_tokens, self.block_size, ctx.store_blocks, pred)
        self.store_traffic.advance(now)  # O(1) amortised: what the store term and the record read
        queue_time, group = pred.queue.queue_time, self._group if pred.groups is None else pred.groups
        dev, loc = match.device, match.local
        prefill, pool = ctx.prefill, ctx.prefill_pool
        if frame is None:
            states, actives = ledger.prefill_views([i.id for i in pool], now)
            queues: Iterable[float] = map(queue_time, states)  # lazily: asked in the order it always was
        else:
            states, actives, queues = self._prefill_views(pool, now, frame)
        for i, state, active, queue_s in zip(pool, states, actives, queues, strict=True):
            iid = i.id
            c = PrefillCandidate(iid, i.role, dev.get(iid, 0), loc.get(iid, 0), state, queue_s, active, group[iid])
            c.local = book.local(c)
            prefill.append(c)
        if frame is None:
            ctx.decode_load = ledger.decode_load(len(ctx.decode_pool), now)
        else:  # sampled at this instant once: a second call then returns the same and changes nothing
            n = len(ctx.decode_pool)
            load = frame.decode_load.get(n)
            if load is None:
                load = frame.decode_load[n] = ledger.decode_load(n, now)
            ctx.decode_load = load
        if pred.decode_load is not None:  # the cluster's decode load, before any TBT is asked
            pred.decode_load(ctx.decode_load)
        ctx.decode = self._decode_candidates(ctx.decode_pool, ctx.facts, now, None, frame)
        ctx.holder, ctx.holder_blocks = best_holder(prefill, ctx.store_blocks)
        if avoid:  # not a destination, still a holder to pull from
            prefill[:] = [c for c in prefill if c.id not in avoid]
            if not prefill:
                raise _Refused(UNAVAILABLE, "no_healthy_prefill", "every healthy prefill instance is avoided")

    # --- stage 4: the policy's choice of prefill, then decode ----------------------------
    def _choose(self, ctx: DecisionContext) -> _Choice:
        pc = self.policy.choose_prefill(ctx)
        p, terms = pc.candidate, pc.terms
        ctx.prefill_ready_s = p.ttft(terms)
        prefill_done_at = ctx.now + ctx.prefill_ready_s
        if self.early_rejection:  # decode load predicted when this prefill finishes (Mooncake §7.4)
            ctx.decode = self._decode_candidates(ctx.decode_pool, ctx.facts, ctx.now, prefill_done_at)
        if p.role != Role.BOTH and self._pools(frozenset()).mixed:  # never mix protocols
            proto = self._instances[p.id].protocol
            ctx.decode = [d for d in ctx.decode if self._instances[d.id].protocol == proto]
        self._kv_waits(ctx, prefill_done_at)
        if p.role != Role.BOTH:
            dc = self.policy.choose_decode(ctx, p)
            return _Choice(pc, dc.candidate, dc.why, dc.scores, True, prefill_done_at)
        d = next((x for x in ctx.decode if x.id == p.id), None)
        if d is None:
            d = self._decode_candidates([self._instances[p.id]], ctx.facts, ctx.now,
                                        prefill_done_at if self.early_rejection else None)[0]
        return _Choice(pc, d, "a 'both' instance decodes what it prefilled", {}, False, prefill_done_at)

    def _kv_waits(self, ctx: DecisionContext, ready_at: float) -> None:
        """Each decode candidate's wait for room for this request's KV (prompt + a block), from
        when the prefill would be done (a colocated instance prefills into its own memory)."""
        need = ctx.facts.prompt_tokens + self.block_size
        shipped = [d for d in ctx.decode if d.role != Role.BOTH]
        for d, wait in zip(shipped, self.ledger.decode_kv_waits([d.id for d in shipped], need, ready_at, ctx.now),
                           strict=True):
            d.kv_wait_s = wait

    # --- stage 4b: overload admission by cost (scheduler/overload.py) -----------------------
    def _overload(self, ctx: DecisionContext, ch: _Choice, commit: bool) -> None:
        """Judge the request's cost against the overload threshold; ``evaluate`` does not count it
        as demand, a retry does not count it twice."""
        assert self.overload is not None
        rows = ch.prefill.rows or {}
        cost = min(rows.get(c.id, c.local).prefill_s for c in ctx.prefill)
        slo = admission.scaled_slo(ctx.slo, ctx.admit_fraction)
        healthy = len(self._pools(frozenset()).prefill)
        ch.cost_verdict, ch.overload = self.overload.check(ctx.facts.request_id, cost, ctx.now, healthy, slo.ttft_s,
                                                           commit)

    # --- stage 5: admission against the SLO ----------------------------------------------
    def _admit(self, ctx: DecisionContext, ch: _Choice, commit: bool = True) -> None:
        """Fill in the pair's TTFT, SLO and record; a violated SLO refuses (raises ``_Refused``)."""
        facts, p, d = ctx.facts, ch.prefill.candidate, ch.decode
        ready = ctx.prefill_ready_s
        if d.id != p.id:  # a separate decode instance: room for the KV, the shipment, then its first step
            ch.kv_s = self.predictors.transfer.transfer_time(facts.prompt_tokens, p.id, d.id)
            ch.first_step_s = d.tbt_s
            ch.decode_wait_s = max(0.0, d.kv_wait_s - ready)
        ch.ttft = ready + ch.decode_wait_s + ch.kv_s + ch.first_step_s
        ch.slo = ctx.slo
        slo = admission.scaled_slo(ctx.slo, ctx.admit_fraction)  # a priority class's share of the SLO
        floor = None  # the best TTFT any candidate could give once its queue drains
        if slo.ttft_s is not None and ch.ttft > slo.ttft_s:
            rows = ch.prefill.rows or {}
            floor = min(c.ttft(rows.get(c.id, c.local)) - c.queue_s for c in ctx.prefill) + ch.kv_s + ch.first_step_s
        ttft_verdict = admission.check_ttft(ch.ttft, p.queue_s, slo.ttft_s, floor)
        departures, at = [], ctx.now
        late = self.late_rejection and d.id != p.id  # TBT is checked after the prefill (admit_decode)
        if slo.tbt_s is not None and d.tbt_s > slo.tbt_s and not late:
            departures = self.ledger.decode_departures(d.id)
            if self.early_rejection:  # d.state is the load at prefill_done_at: count from there
                at = ch.prefill_done_at
                departures = [r for r in departures if r.decode_start_s <= at < r.decode_end_s]
        tbt_verdict = None if late else admission.check_tbt(d.tbt_s, slo.tbt_s, d.state, departures,
                                                            facts.prompt_tokens, facts.max_tokens, self.predictors, at)
        ch.violations = [v for v in (ttft_verdict, tbt_verdict, ch.cost_verdict) if v is not None]
        record = self._record(ctx, ch, commit)
        verdict = ttft_verdict or tbt_verdict or ch.cost_verdict
        if verdict is not None and self.admission:
            raise _Refused(verdict.status, verdict.reason, verdict.message, record, verdict.retry_after_s)
        ch.record = record

    # --- stage 6: reserve in the ledger and keep the explanation --------------------------
    def _commit(self, ctx: DecisionContext, ch: _Choice, commit: bool) -> Placement:
        facts, p, d, terms = ctx.facts, ch.prefill.candidate, ch.decode, ch.prefill.terms
        rid, now = facts.request_id, ctx.now
        now_state = self.ledger.decode_state(d.id, now) if self.early_rejection else d.state
        placement = Placement(
            request_id=rid, prefill=p.id, decode=d.id, hit_tokens=terms.hit_tokens,
            local_hit_tokens=terms.local_hit_tokens, transfer_tokens=terms.transfer_tokens,
            transfer_from=terms.transfer_from, queue_s=p.queue_s, prefill_s=terms.prefill_s,
            transfer_s=terms.transfer_s, ttft_s=ch.ttft, tbt_s=d.tbt_s, queue_tokens=p.state.queued_tokens,
            queue_requests=p.state.queued_requests, decode_running=now_state.running,
            decode_kv_tokens=now_state.kv_tokens, decode_cluster_running=ctx.decode_load,
            explanation=ch.record, kv_transfer_s=ch.kv_s,
            decode_first_step_s=ch.first_step_s, decode_wait_s=ch.decode_wait_s,
            policy=self.policy_name, host_tokens=terms.host_tokens)
        traffic = self.store_traffic
        placement.store_write_recent_bytes, placement.store_busy_s = traffic.recent_bytes, traffic.busy_s
        placement.store_loads_inflight = traffic.loads
        if commit:
            decode_start = now + ch.ttft
            need = facts.prompt_tokens + facts.max_tokens
            self.policy.placed(ctx, p.id, d.id, ch.chose_decode)  # first: if it raises, nothing is held
            self.ledger.reserve(Reservation(rid, p.id, d.id, facts.prompt_tokens - terms.hit_tokens, terms.prefill_s,
                                            need, now, decode_start,
                                            decode_start + max(1, facts.max_tokens) * d.tbt_s,
                                            output_tokens=max(1, facts.max_tokens)), now)
            if self._inflight:
                self.inflight.add(rid, p.id, facts.block_hashes[:ctx.usable_blocks])
            # what its prefill will write through to the store: the prompt's whole blocks the store lacks
            new_blocks = facts.prompt_tokens // ctx.block_size - ctx.store_blocks
            dep = self._deployment.get(p.id)
            traffic.placed(rid, now, new_blocks * ctx.block_size * dep.model.kv_bytes_per_token
                           if new_blocks > 0 and dep is not None else 0, terms.transfer_from == Tier.STORE,
                           terms.transfer_s + p.queue_s + terms.prefill_s, terms.prefill_s,
                           facts.prompt_tokens - terms.hit_tokens)
            self.counts["placed"] += 1
            self.decisions.append(ch.record)
        return placement

    def _decode_candidates(self, pool: list[Instance], facts: RequestFacts, now: float,
                           at: float | None, frame: LoadFrame | None = None) -> list[DecodeCandidate]:
        """Decode candidates with their TBT once this request joins: now, or predicted at ``at``.
        A TBT predictor with ``tbt_many`` answers them all in one call (the learned one)."""
        ledger, tbt = self.ledger, self.predictors.tbt
        prompt, max_tokens = facts.prompt_tokens, facts.max_tokens
        if at is None and frame is not None:
            key = tuple(i.id for i in pool)
            states = frame.decode.get(key)
            if states is None:
                states = frame.decode[key] = ledger.decode_states(key, now)
        else:
            states = ledger.decode_states([i.id for i in pool], now) if at is None else [
                ledger.decode_state_at(i.id, at, now) for i in pool]
        many = getattr(tbt, "tbt_many", None)
        tbts = many(states, prompt, max_tokens) if many is not None else [tbt.tbt(s, prompt, max_tokens)
                                                                          for s in states]
        return [DecodeCandidate(i.id, i.role, s, t) for i, s, t in zip(pool, states, tbts, strict=True)]

    def _headroom(self, facts: RequestFacts) -> float:
        cls = getattr(facts, "priority", None)
        return 1.0 if cls is None else self.priority_headroom.get(cls, 1.0)

    def _rng_for(self, request_id: str) -> random.Random:
        """Randomness per request, reproducible from (seed, request id) whatever came before."""
        return random.Random(xxhash.xxh3_64_intdigest(request_id.encode("utf-8", "surrogatepass"),
                                                      self.seed & 0xFFFF_FFFF_FFFF_FFFF))

    def _record(self, ctx: DecisionContext, ch: _Choice, commit: bool = True) -> dict[str, Any]:
        pc, d, terms, slo, violations = ch.prefill, ch.decode, ch.prefill.terms, ch.slo, ch.violations
        rows = pc.rows or {}
        scores = pc.scores
        # an evaluation's record is read once, if at all (the wait room): its tables wait until then
        tables = (prefill_table(ctx.prefill, rows, scores), decode_table(ctx.decode, ch.decode_scores)) if commit \
            else deferred_tables(ctx.prefill, rows, scores, ctx.decode, ch.decode_scores)
        replication = None
        if terms.transfer_from is not None and terms.transfer_tokens > 0:
            replication = {"source": terms.transfer_from, "destination": pc.candidate.id,
                           "tokens": terms.transfer_tokens,
                           "blocks": [pc.candidate.local_blocks, terms.hit_tokens // ctx.block_size]}
        return {
            "request_id": ctx.facts.request_id, "policy": self.policy_name, "score": self.policy.score_name,
            "time_s": ctx.now, "outcome": "rejected" if violations and self.admission else "placed",
            "admission": self.admission,
            "prompt_tokens": ctx.facts.prompt_tokens, "max_tokens": ctx.facts.max_tokens,
            "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "early_rejection": self.early_rejection,
            **request_labels(ctx.facts, ctx.admit_fraction),
            "store_hit_tokens": ctx.store_blocks * ctx.block_size,
            "best_holder": {"id": ctx.holder, "hit_tokens": ctx.holder_blocks * ctx.block_size},
            "prefill": tables[0],
            "decode": tables[1],
            "chosen": {"prefill": pc.candidate.id, "decode": d.id},
            "terms": {"hit_tokens": terms.hit_tokens, "local_hit_tokens": terms.local_hit_tokens,
                      "transfer_tokens": terms.transfer_tokens, "transfer_from": terms.transfer_from,
                      "transfer_s": terms.transfer_s, "queue_s": pc.candidate.queue_s, "prefill_s": terms.prefill_s,
                      "decode_wait_s": ch.decode_wait_s, "kv_transfer_s": ch.kv_s,
                      "decode_first_step_s": ch.first_step_s, "ttft_s": ch.ttft,
                      "tbt_s": d.tbt_s},
            "why": {"prefill": pc.why, "decode": ch.decode_why, **({"extra": pc.extra} if pc.extra else {})},
            "replication": replication,
            "reason": violations[0].reason if violations else None,
            "violations": [{"reason": v.reason, "message": v.message, "retry_after_s": v.retry_after_s}
                           for v in violations],
            **({"overload": ch.overload} if ch.overload is not None else {}),
        }


class _Refused(Exception):
    """A stage's refusal: carried to ``_refuse`` (with the record when candidates were weighed)."""

    def __init__(self, status: int, reason: str, message: str, record: dict[str, Any] | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.record, self.retry_after_s = record, retry_after_s


@dataclass(slots=True)
class _Choice:
    """The policy's pair and what admission adds to it (TTFT with the KV shipment, verdicts)."""

    prefill: PrefillChoice
    decode: DecodeCandidate
    decode_why: str
    decode_scores: dict[str, float]
    chose_decode: bool  # False when a "both" instance decodes its own request
    prefill_done_at: float
    kv_s: float = 0.0
    first_step_s: float = 0.0
    decode_wait_s: float = 0.0
    ttft: float = 0.0
    slo: SLO = field(default_factory=SLO)
    violations: list[admission.Verdict] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    cost_verdict: admission.Verdict | None = None  # overload admission by cost (when on)
    overload: dict[str, Any] | None = None  # its figures for the decision record
