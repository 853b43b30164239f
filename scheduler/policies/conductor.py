"""``conductor``: Mooncake's KVCache-centric scheduling (FAST'25, Algorithm 1), and where we
depart from it (measured in docs/experiments/conductor-vs-baselines.md).

Algorithm 1 (``conductor_alg1``, as published): for every prefill instance p, either recompute
beyond p's own prefix, or pull the best holder's prefix (the longest anywhere: another prefill
instance or the shared store) and prefill the rest; TTFT_p = T_transfer + T_queue + T_prefill;
p* = argmin TTFT_p. Whether p pulls follows either the paper's ratio rule (``pull_rule="ratio"``:
pull when p holds nothing of a prefix that exists, or best_len / p.prefix_len >
``balancing_threshold``) or the direct rule the paper also states (``pull_rule="direct"``,
default): pull when the transfer is faster than the prefill it saves. An overloaded holder thus
loses to an idle instance that fetches the prefix itself, and that fetch is how hot prefixes
replicate. The decode instance balances load: the lowest predicted TBT once this request joins.

``conductor`` (the default) changes five things, each measured in the virtual-time simulator (each
turned off alone on the policy as shipped: docs/experiments/ablation-shipped.md):
* the wait room (``WAIT_ROOM`` below, scheduler/deferral.py; ``defer=off`` decides at arrival, as
  Algorithm 1): a request behind more than 1 s of predicted prefill queue waits at the gateway,
  holding nothing, and the cheapest waiting request goes as queues drain. An engine serves its queue
  first come first served, so a scheduler that decides at arrival admits whichever request arrives
  while a queue is short; shortest job first serves more requests within the SLO. As the default it
  reaches 1.2x the best other policy at some load of every workload at both TTFT SLOs at 8P+8D
  (docs/experiments/default-wait-room.md). It applies only when the scheduler admits against the
  SLO (the room refuses a waiter at its deadline);
* the work term (``work_weight``, default 1): minimise TTFT + w x the work the request adds to
  the instance (its transfer + prefill there). Greedy TTFT recomputes a cached prefix elsewhere
  to skip a queue, spending capacity that every later request waits for;
* in-flight prefixes (``inflight``): a prefix placed on an instance but not yet announced by KV
  events counts as held there, so a burst sharing a new prefix follows its first request;
* the decode instance is the one giving the earliest first token within the TBT SLO (room for
  the KV, shipment, first step): balancing TBT alone sends requests to instances whose KV is
  full, where they wait after their prefill;
* overload admission by cost (``cost_admission=on``, opt-in, scheduler/overload.py): past the
  prefill capacity, the cheapest prefills are admitted first (docs/experiments/overload-admission.md);
* near-tie affinity (``affinity_margin_s`` / ``affinity_margin_rel``, opt-in,
  scheduler/policies/conductor_affinity.py): within the margin of the lowest score the holder of
  the longest prefix wins; measured without effect (docs/experiments/goodput-curves.md);
* least work within SLO headroom (``least_work_headroom``, opt-in,
  scheduler/policies/conductor_leastwork.py): among the candidates predicted to meet
  headroom x the TTFT SLO, the one adding the least transfer + prefill wins, so a request that
  meets its SLO comfortably either way stays on its prefix and spends the least capacity
  (docs/experiments/least-work.md). Tuned on the training slices no headroom beats it off, and
  a wide one loses attainment without raising the hit; so it stays off;
* future value (``future_weight``, opt-in, scheduler/policies/conductor_future.py): a request
  whose prefix no instance holds decides where its conversation lives; its score adds
  future_weight x each candidate's follow-up load (the decayed prefill work of requests placed
  there because it held their prefix), so new conversations avoid the instances whose
  follow-ups are about to arrive (docs/experiments/future-value.md). Tuned on the training
  slices no weight beats it off by more than noise; evaluated, it lowers the synthetic workload's
  prefix hit and, with deferral, attainment (by up to 11 points); so it stays off.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Hashable, Literal, Mapping

from predictors.types import Role, Tier
from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate, Terms
from scheduler.follow_up import FollowUpLoad
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice, argmin_scored, runner_up
from scheduler.policies.conductor_affinity import near_tie_holder
from scheduler.policies.conductor_future import add_future, bound_to, is_new, why_future
from scheduler.policies.conductor_leastwork import least_work_within_headroom

#: the wait room conductor runs with unless told otherwise (``defer=off``: decide at arrival, as
#: Algorithm 1): hold a request behind a prefill queue longer than 1 s, cheapest first, 0.05 s of
#: cost forgiven per second waited; wait for a busy prefix holder over a placement costing 1.5x its
#: prefill; arrivals join the room while anyone waits; a waiter evaluated again after 0.1 s, at most
#: one evaluation per 4 ms of the clock on average (a live gateway's event loop). Chosen on the
#: training slices (docs/experiments/deferral.md, tight-overload.md) and measured as the default in
#: docs/experiments/default-wait-room.md
WAIT_ROOM: Mapping[str, Any] = MappingProxyType({
    "defer": True, "defer_scan": 64, "defer_aging": 0.05, "defer_wait_holder": True, "defer_holder_ratio": 1.5,
    "defer_join": True, "defer_reeval_s": 0.1, "defer_eval_every_s": 0.004})


@dataclass(frozen=True)
class ConductorParams:
    pull_rule: Literal["direct", "ratio"] = "direct"
    balancing_threshold: float = 2.0  # the ratio rule's threshold
    # False: only the shared store is a source to pull from (engines that cannot fetch a prefix
    # from another prefill instance, e.g. vLLM's two-step PD without a shared KV store)
    peer_pull: bool = True
    # > 0 departs from Algorithm 1: minimise TTFT + work_weight x the work this request adds to the
    # instance (its transfer + prefill there). Greedy TTFT recomputes a cached prefix elsewhere to
    # skip a queue, spending capacity every later request waits for; the work term charges that.
    work_weight: float = 1.0
    # True departs from Algorithm 1 (which reads only the KV-event hit map): a prefix placed on an
    # instance and not yet announced counts as held there (scheduler/inflight.py)
    inflight: bool = True
    # "first_token": earliest first token within the TBT SLO; "tbt": Algorithm 1's load balancing
    decode_choice: Literal["first_token", "tbt"] = "first_token"
    # near-tie affinity (departs from Algorithm 1; 0 and 0: off): among the candidates whose score is
    # within max(affinity_margin_s, affinity_margin_rel x the lowest) of the lowest, the one already
    # holding the longest prefix of this request (KV events or in flight) wins, so the conversation's
    # follow-ups find it there; a candidate whose predicted TTFT would break the SLO the lowest meets
    # never wins this way (scheduler/policies/conductor_affinity.py)
    affinity_margin_s: float = 0.0
    affinity_margin_rel: float = 0.0
    # least work within SLO headroom (departs from Algorithm 1; 0: off): among the candidates whose
    # predicted TTFT is within least_work_headroom x the request's (remaining, admitted share of the)
    # TTFT SLO, the one adding the least work (transfer + prefill: the most reused) wins, then the
    # lower TTFT; none within it, or no TTFT SLO: the lowest score as without it. Decided before the
    # near-tie affinity, which only applies when this rule keeps the lowest score
    # (scheduler/policies/conductor_leastwork.py)
    least_work_headroom: float = 0.0
    # future value (departs from Algorithm 1; 0: off): a new request (the prefix only some instances
    # hold is <= future_new_share of its prompt) adds future_weight x each candidate's follow-up
    # load: the prefill seconds of requests bound there by their prefix (more than that share beyond
    # the common prefix), decayed with time constant future_tau_s (scheduler/policies/conductor_future.py)
    future_weight: float = 0.0
    future_tau_s: float = 30.0
    future_new_share: float = 0.25

    def __post_init__(self) -> None:
        if not self.balancing_threshold > 0:
            raise ValueError("balancing_threshold must be > 0")
        if self.work_weight < 0:
            raise ValueError("work_weight must be >= 0")
        if self.affinity_margin_s < 0 or self.affinity_margin_rel < 0:
            raise ValueError("affinity_margin_s and affinity_margin_rel must be >= 0")
        if not 0 <= self.least_work_headroom <= 1:
            raise ValueError("least_work_headroom must be in [0, 1] (a share of the TTFT SLO; 0: off)")
        if self.future_weight < 0 or not self.future_tau_s > 0 or not 0 <= self.future_new_share <= 1:
            raise ValueError("future_weight must be >= 0, future_tau_s > 0, future_new_share in [0, 1]")


class ConductorPolicy(Policy):
    name = "conductor"
    source = "Mooncake FAST'25 Algorithm 1 (KVCache-centric scheduling); direct pull rule from its text"
    score_name = "ttft_s"
    Params = ConductorParams
    # overload admission by cost stays opt-in (cost_admission=on): measured, it moved goodput by
    # -2.8 to +4.2 points and costs the longest prompts (docs/experiments/overload-admission.md)
    cost_admission = False
    wait_room = WAIT_ROOM
    params: ConductorParams

    def __init__(self, **params: Any):
        super().__init__(**params)
        # future value's state, kept only when the rule is on; the last choice's work per candidate
        # (request id, {candidate: transfer + prefill s}) for ``placed``
        p = self.params
        self.follow_up = FollowUpLoad(p.future_tau_s) if p.future_weight > 0 else None
        self._last_work: tuple[str, dict[str, float]] | None = None

    @property
    def reads_inflight(self) -> bool:
        return self.params.inflight

    def _pulls(self, c: PrefillCandidate, pull: Terms, recompute: Terms, best_blocks: int) -> bool:
        if self.params.pull_rule == "ratio":
            return c.local_blocks == 0 or best_blocks / c.local_blocks > self.params.balancing_threshold
        return pull.cache_s < recompute.cache_s  # the transfer costs less than the prefill it saves

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        holder, best_blocks = ctx.holder, ctx.holder_blocks
        if holder not in (None, Tier.STORE) and not self.params.peer_pull:
            holder, best_blocks = (Tier.STORE, ctx.store_blocks) if ctx.store_blocks else (None, 0)
        book = ctx.terms
        if book is None:
            raise RuntimeError("choose_prefill before the terms stage")
        rows: dict[str, Terms] = {}
        scores: dict[str, float] = {}
        chosen: dict[tuple[Hashable, int, int], Terms] = {}  # the way to serve depends only on (group, prefix facts)
        pending = ctx.pending  # empty unless ``inflight`` (see reads_inflight)
        kv_est = self._kv_shipment_estimates(ctx)
        kv_get = kv_est.get
        w = self.params.work_weight
        for c in ctx.prefill:
            cid = c.id
            view = c  # the candidate, or its view with the in-flight prefix
            if pending and pending.get(cid, 0) > c.local_blocks:  # queued behind the request bringing the prefix
                view = replace(c, device_blocks=pending[cid], local_blocks=pending[cid])
                view.local = book.local(view)
            key = (view.group, view.device_blocks, view.local_blocks)
            t = chosen.get(key)
            if t is None:
                t = view.local
                if holder is not None and best_blocks > view.local_blocks:  # someone holds more: pull or not
                    # not pulling is the engine default: the local prefix, plus what the shared store
                    # holds beyond it (a store connector loads that anyway), then recompute the rest
                    recompute = book.local(view)
                    pull = book.pull(view, holder, best_blocks)
                    t = pull if self._pulls(view, pull, recompute, best_blocks) else recompute
                chosen[key] = t
            rows[cid] = t
            # TTFT (c.ttft inlined, same order of additions) + shipment + w x the work added there
            scores[cid] = t.transfer_s + c.queue_s + t.prefill_s + kv_get(cid, 0.0) + w * (t.transfer_s + t.prefill_s)
        p = self.params
        fl, added = self.follow_up, None
        if fl is not None:
            self._last_work = (ctx.facts.request_id, {k: t.transfer_s + t.prefill_s for k, t in rows.items()})
            if is_new(ctx, p.future_new_share):
                added = add_future(ctx, scores, fl, p.future_weight)
        winner = argmin_scored(ctx.prefill, list(scores.values()), _queued_tokens, ctx.rng)
        why = (added and why_future(winner, scores, added, p.future_weight)) or \
            f"lowest predicted TTFT {scores[winner.id]:.4g}s{runner_up(scores, winner.id)}"
        least_work = None
        if p.least_work_headroom > 0:
            least_work = least_work_within_headroom(ctx, winner, rows, kv_est, p.least_work_headroom)
            if least_work is not None:
                winner, why = least_work
        if least_work is None and (p.affinity_margin_s > 0 or p.affinity_margin_rel > 0):
            holder_pick = near_tie_holder(ctx, winner, scores, rows, kv_est, p.affinity_margin_s,
                                          p.affinity_margin_rel)
            if holder_pick is not None:
                winner, why = holder_pick
        t = rows[winner.id]
        if t.transfer_from is not None and t.transfer_tokens:
            why += f"; pulls {t.transfer_tokens} tokens from {t.transfer_from} (replicates the prefix)"
        extra: dict[str, Any] = {"best_holder": holder, "best_hit_tokens": best_blocks * ctx.block_size,
                 "pull_rule": self.params.pull_rule, "peer_pull": self.params.peer_pull}
        if pending:
            extra["inflight_hit_tokens"] = {k: v * ctx.block_size for k, v in pending.items()}
        if added is not None:
            extra["follow_up_load_s"] = added  # what the score of each candidate carries (x future_weight)
        return PrefillChoice(winner, t, scores, why, rows, extra)

    def placed(self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
        """Future value: a request bound to its instance by its prefix adds its work there."""
        fl, last = self.follow_up, self._last_work
        if fl is None or last is None or last[0] != ctx.facts.request_id:
            return
        if bound_to(ctx, prefill, self.params.future_new_share):
            fl.add(prefill, last[1].get(prefill, 0.0), ctx.now)

    @staticmethod
    def _kv_shipment_estimates(ctx: DecisionContext) -> dict[str, float]:
        """Prefill->decode shipment per candidate, only when it differs (a mix of roles).

        With only prefill-role (or only ``both``) candidates it is the same for all and cannot
        change the argmin, so it is added after the decode choice instead.
        """
        roles = {c.role for c in ctx.prefill}
        if not (Role.BOTH in roles and Role.PREFILL in roles) or not ctx.decode:
            return {}
        ref = ctx.decode[0].id
        ship = ctx.predictors.transfer.transfer_time
        return {c.id: ship(ctx.prompt_tokens, c.id, ref) for c in ctx.prefill if c.role == Role.PREFILL}

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        if self.params.decode_choice == "tbt":
            scores = {d.id: d.tbt_s for d in ctx.decode}
            best = argmin_scored(ctx.decode, list(scores.values()), _running, ctx.rng)
            return DecodeChoice(best, scores, f"lowest predicted TBT {best.tbt_s:.4g}s with this request"
                                              f"{runner_up(scores, best.id)}")
        return self._earliest_first_token(ctx, prefill)

    def _earliest_first_token(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        """The decode instance that gives the earliest first token (room for the KV, shipment,
        first step) among those meeting the TBT SLO with this request added; lowest TBT when none
        does. Balancing TBT alone sends requests to instances whose KV is full, where they wait
        after their prefill for others to finish."""
        transfer, group, groups = ctx.predictors.transfer.transfer_time, ctx.predictors.group, ctx.predictors.groups
        groups_get = groups.get if groups is not None else None  # the live view of group(): no call per candidate
        shipments: dict[Hashable, float] = {}  # the shipment depends on the decode side's predictor group only
        first: dict[str, float] = {}
        ok: list[DecodeCandidate] = []  # those meeting the TBT SLO, and their first-token times
        ok_first: list[float] = []
        ready, prompt, pid, tbt_slo = ctx.prefill_ready_s, ctx.prompt_tokens, prefill.id, ctx.slo.tbt_s
        for d in ctx.decode:
            did = d.id
            if group is None:
                key: Hashable = did
            else:
                key = _MISSING if groups_get is None else groups_get(did, _MISSING)
                if key is _MISSING:
                    key = group(did)
            ship = shipments.get(key)
            if ship is None:
                ship = shipments[key] = transfer(prompt, pid, did)
            wait = d.kv_wait_s  # d.first_token_s(ready, ship) inlined
            f = first[did] = (wait if wait > ready else ready) + ship + d.tbt_s
            if tbt_slo is None or d.tbt_s <= tbt_slo:
                ok.append(d)
                ok_first.append(f)
        if not ok:
            ok, ok_first = ctx.decode, list(first.values())
        winner = argmin_scored(ok, ok_first, _tbt_then_running, ctx.rng)
        why = f"earliest first token {first[winner.id]:.4g}s (TBT {winner.tbt_s:.4g}s)"
        if winner.kv_wait_s > ctx.prefill_ready_s:
            why += f", after waiting {winner.kv_wait_s - ctx.prefill_ready_s:.3g}s for KV room"
        return DecodeChoice(winner, first, why + runner_up(first, winner.id))


_MISSING = object()


def _queued_tokens(c: PrefillCandidate) -> int:
    return c.state.queued_tokens


def _running(d: DecodeCandidate) -> int:
    return d.state.running


def _tbt_then_running(d: DecodeCandidate) -> tuple[float, int]:
    return d.tbt_s, d.state.running


@dataclass(frozen=True)
class ConductorAlg1Params(ConductorParams):
    work_weight: float = 0.0
    inflight: bool = False
    decode_choice: Literal["first_token", "tbt"] = "tbt"


class ConductorAlg1Policy(ConductorPolicy):
    """Algorithm 1 as published: TTFT argmin over the KV-event hit map, decode by load balancing."""

    name = "conductor_alg1"
    source = "Mooncake FAST'25 Algorithm 1 as published (the reference our conductor departs from)"
    Params = ConductorAlg1Params
    cost_admission = False
    wait_room: ClassVar[Mapping[str, Any]] = MappingProxyType({})  # Algorithm 1 decides at arrival
