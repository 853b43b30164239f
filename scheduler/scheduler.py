"""The scheduler facade: one call per request, pure (no I/O, no awaits), clock injected.

It keeps the cluster's membership (instances, health, capacity, models, the candidate pools) and
the request's calls; ``decide`` and ``evaluate`` run the stages of scheduler/stages.py (validate,
eligible, cache facts, terms, choice, admission, commit) over one ``DecisionContext``.
The live gateway and the discrete-event simulator run this very code.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Collection, Iterable

from predictors.analytic import analytic_predictors
from predictors.base import Predictors
from predictors.facts import Deployment, load_deployment
from predictors.store_traffic import StoreTraffic
from predictors.telemetry import SLO
from predictors.types import Role
from scheduler import stages
from scheduler.admission import check_headroom
from scheduler.deferral_params import DeferParams, split_params as split_defer
from scheduler.explain import bare_record, request_labels
from scheduler.frame import LoadFrame
from scheduler.hit_index import HitIndex
from scheduler.inflight import InflightPrefixes
from scheduler.ledger import Ledger, split_params as split_ledger
from scheduler.overload import CostWindow, split_params
from scheduler.policies import POLICIES, make_policy
from scheduler.state import LoadLedger, PrefixIndex
from scheduler.types import INTERNAL, UNAVAILABLE, Instance, Placement, Rejection, RequestFacts

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
        # deferred dispatch (scheduler/deferral.py): any policy takes its parameters; on by default
        # for the policies that say so (conductor) when they admit against the SLO (the room refuses
        # a waiter at its deadline: without admission nothing is refused for the SLO, so nothing
        # waits unless defer=on); the driver's wait room reads them (the scheduler itself decides
        # the same either way)
        self.defer: DeferParams
        self.defer, policy_params = split_defer(policy_params, cls.wait_room if cls and admission else None)
        # the decode wait replayed as the engine admits, first come first served, and the TBT of
        # a cache sharing prefix blocks (both on by default; decode_fifo=off, decode_share=off
        # for the earlier models: docs/scheduler.md); any policy takes them
        ledger_options, policy_params = split_ledger(policy_params)
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
        self.ledger: LoadLedger = ledger if ledger is not None else Ledger(**ledger_options)
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
            raise stages.Refused(UNAVAILABLE, "model_not_served",
                                 f"no healthy prefill instance serves model {model!r}")
        out = _Pools(prefill, [i for i in pools.decode if serves(i.id, model)], self._max_len)
        if cached and len(self._model_pools[1]) < 1024:  # bounded: model names come from the engines
            self._model_pools[1][model] = out
        return out

    # --- request lifecycle --------------------------------------------------------------
    def decide(self, facts: RequestFacts, avoid: Collection[str] = (),
               frame: LoadFrame | None = None) -> Placement | Rejection:
        """Place a request or refuse it; never raises. ``avoid``: prefill instances it must not be
        placed on, which still serve their cached prefix to a peer pull (the wait room's spill,
        scheduler/deferral.py). ``frame``: the one an evaluation of these very facts was just made
        through, nothing decided since (the wait room letting a request go): its load views,
        hit-index answer and policy choice are taken, not recomputed; admission runs again."""
        return self._guarded(facts, frozenset(), commit=True, avoid=avoid, frame=frame)

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

    def decode_started(self, request_id: str) -> bool:
        """Its first token came: the decode engine holds its KV (the ledger learns each decode
        instance's prefix sharing from these). True the first time only."""
        if not isinstance(request_id, str):
            return False
        return self.ledger.decode_started(request_id, self.clock())

    def admit_decode(self, facts: RequestFacts, decode: str) -> Rejection | None:
        """``late_rejection`` only (Mooncake's baseline without early rejection): when the request's
        prefill is done, its ``decode`` instance checks the TBT SLO against the sequences it is
        decoding then (prefill done, this request not counted) plus this one; a refusal wastes the
        prefill. None (admitted) otherwise, or for a request holding no reservation. The caller
        finishes the request."""
        return stages.admit_decode(self, facts, decode)

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
            states, _, queues = stages.prefill_views(self, pool, frame.now, frame)
            return {s.instance: q for s, q in zip(states, queues, strict=True)}
        states, _ = self.ledger.prefill_views([i.id for i in pool], self.clock() if now is None else now)
        queue_time = self.predictors.queue.queue_time
        return {s.instance: queue_time(s) for s in states}

    def pool_scale(self) -> tuple[int, int]:
        """The healthy prefill instances and the KV tokens of the healthy decode instances: what the
        wait room's ``pools`` size divides a request's work by (scheduler/deferral_waiter.py)."""
        pools = self._pools(frozenset())
        return len(pools.prefill), sum(self._kv_capacity[i.id] for i in pools.decode)

    def min_prefill_queue_s(self, now: float | None = None, frame: LoadFrame | None = None) -> float:
        """The shortest predicted prefill queue over the healthy prefill instances (inf with none)."""
        return min(self.prefill_queues_s(now, frame).values(), default=float("inf"))

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
                         "running": t["running"], "kv_tokens": t["kv_tokens"], "kv_share": t["kv_share"],
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
            return stages.decide(self, facts, exclude, commit, frozenset(avoid), frame)
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

    def _headroom(self, facts: RequestFacts) -> float:
        cls = getattr(facts, "priority", None)
        return 1.0 if cls is None else self.priority_headroom.get(cls, 1.0)
