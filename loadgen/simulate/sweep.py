"""Sweeps of simulated runs: every (policy, load) pair is one independent run on a fresh cluster,
run in parallel worker processes, summarised in ``conductor loadgen``'s summary schema (a policy
plays the part of a target)."""
from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from predictors.telemetry import SLO, RequestRecord

from ..arrivals import rate_of
from ..metrics import effective_capacity, summarize
from ..sweep import compare, load_label, workload_at
from ..workload import Workload
from .cluster import ClusterSpec, SchedulerSpec
from .run import RunStats, simulate


@dataclass
class SimConfig:
    base: Workload
    cluster: ClusterSpec
    scheduler: SchedulerSpec  # its policy is replaced by each of ``policies``
    policies: list[str]
    slo: SLO
    load_kind: str = "speedup"
    loads: list[float] = field(default_factory=lambda: [1.0])
    attainment_target: float = 0.9
    endpoint: str = "chat"
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    predictors: str = "analytic"
    admission: str = "all"  # all | conductor (the peers as their routers ship: no SLO admission) | none
    reuse_bound: bool = False  # also compute the trace's reuse bound for the cluster's cache capacity
    workers: int = 2
    progress: bool = True
    regenerate: Callable[[float], Workload] | None = None  # synthetic workloads at a rate
    # per policy, parameters it runs with under any --policy-param (an experiment pins a policy as
    # its page measured it, e.g. conductor before the wait room was its default)
    pinned: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class SimStep:
    policy: str
    load: float
    workload: Workload
    records: list[RequestRecord]
    stats: RunStats
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimOutcome:
    config: SimConfig
    steps: list[SimStep]
    summary: dict[str, Any]

    def records(self) -> list[RequestRecord]:
        return [r for s in self.steps for r in s.records]


_JOB_CONFIG: SimConfig | None = None  # set before forking the workers (closures do not pickle)


def _run_job(job: tuple[int, str, float]) -> tuple[list[RequestRecord], RunStats]:
    _, policy, load = job
    cfg = _JOB_CONFIG
    assert cfg is not None
    return _simulate(cfg, policy, load, progress=cfg.progress)


def _simulate(cfg: SimConfig, policy: str, load: float, progress: bool) -> tuple[list[RequestRecord], RunStats]:
    # the ids loadgen would send in step (load index), target (policy index): same tie-breaks
    id_prefix = f"s{cfg.loads.index(load)}-t{cfg.policies.index(policy)}"
    from .oracle import predictors_factory

    w = workload_at(cfg, load)
    # --policy-param belongs to the first policy (the others run with their defaults)
    params = {**cfg.pinned.get(policy, {}), **(cfg.scheduler.policy_params if policy == cfg.policies[0] else {})}
    admits = cfg.admission == "all" or (cfg.admission == "conductor" and policy.startswith("conductor"))
    sched = replace(cfg.scheduler, policy=policy, policy_params=params, admission=admits)
    label = f"{policy} @ {load_label(cfg.load_kind, load)}"
    run = simulate(w, cfg.cluster, sched, endpoint=cfg.endpoint, salt=f"sim-{cfg.seed}",
                   predictors=predictors_factory(cfg.predictors, cfg.cluster), label=label,
                   progress=sys.stderr if progress else None, id_prefix=id_prefix)
    for r in run.records:
        r.extra.update(target=policy, load=load)
    return run.records, run.stats


def run_sweep(cfg: SimConfig) -> SimOutcome:
    """Every (policy, load) run; in ``cfg.workers`` processes when there is more than one."""
    global _JOB_CONFIG
    jobs = [(i, p, load) for i, (p, load) in enumerate((p, load) for load in cfg.loads for p in cfg.policies)]
    if cfg.workers > 1 and len(jobs) > 1 and "fork" in multiprocessing.get_all_start_methods():
        _JOB_CONFIG = cfg
        try:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=min(cfg.workers, len(jobs)), mp_context=ctx) as pool:
                results = list(pool.map(_run_job, jobs))
        finally:
            _JOB_CONFIG = None
    else:
        results = [_simulate(cfg, p, load, cfg.progress) for _, p, load in jobs]
    steps = []
    for (_, policy, load), (records, stats) in zip(jobs, results, strict=True):
        w = workload_at(cfg, load)
        s = SimStep(policy, load, w, records, stats)
        s.summary = summarize(records, cfg.slo)
        s.summary.update(load=load, load_kind=cfg.load_kind, target=policy, offered_rps=rate_of(w.requests),
                         span_s=w.span_s, simulation=stats.as_dict(wall=False))
        steps.append(s)
    return SimOutcome(cfg, steps, build_summary(cfg, steps))


def _policy_summary(cfg: SimConfig, policy: str, steps: list[SimStep]) -> dict[str, Any]:
    mine = sorted((s for s in steps if s.policy == policy), key=lambda s: s.load)
    records = [r for s in mine for r in s.records]
    agg = summarize(records, cfg.slo, duration_s=sum(s.summary["duration_s"] for s in mine))
    rows = [s.summary for s in mine]
    agg.update(target=policy, steps=rows,
               effective_capacity=effective_capacity([s["load"] for s in rows], [s["slo_attainment"] for s in rows],
                                                     cfg.attainment_target))
    return agg


def build_summary(cfg: SimConfig, steps: list[SimStep]) -> dict[str, Any]:
    """summary.json as ``conductor loadgen`` writes it, with policies as targets, plus the
    simulated cluster and the simulation's own speed."""
    per_policy = [_policy_summary(cfg, p, steps) for p in cfg.policies]
    out = dict(per_policy[0])
    c, w = cfg.cluster, cfg.base
    out.update(
        load_kind=cfg.load_kind, loads=cfg.loads, attainment_target=cfg.attainment_target,
        workload={"source": w.source, "kind": w.kind, "requests": len(w.requests), "skipped_lines": w.skipped,
                  "problems": w.problems, "span_s": w.span_s, "offered_rps": rate_of(w.requests),
                  "block_tokens": w.block_tokens},
        run={"mode": "simulate", "endpoint": cfg.endpoint, "arrival": cfg.arrival, "cv": cfg.cv, "seed": cfg.seed,
             "predictors": cfg.predictors, "policies": cfg.policies, "admission": cfg.admission,
             "policy_params": cfg.scheduler.policy_params, "early_rejection": cfg.scheduler.early_rejection,
             "late_rejection": cfg.scheduler.late_rejection,
             "cluster": {"prefill": c.prefill, "decode": c.decode, "both": c.both, "profile": c.profile,
                         "block_size": c.block_size, "noise": c.noise, "kv_event_lag_ms": c.kv_event_lag_s * 1e3,
                         "poll_interval_s": c.poll_interval_s, "engine": c.engine,
                         **({"prefill_engine": c.prefill_engine} if c.prefill_engine else {})}},
        simulation={"events": sum(s.stats.events for s in steps), "simulated_s": sum(s.stats.sim_s for s in steps)},
    )
    if cfg.reuse_bound:
        from engines_adapters.sim.profiles import load_profile

        from .reuse import completed, reuse_bound, served_bound

        cap = load_profile(c.profile).kv_capacity_tokens * (c.prefill + c.both)
        out["reuse_bound"] = reuse_bound(cfg.base, c.block_size, cap, cfg.endpoint, salt=f"sim-{cfg.seed}")
        for t in per_policy:  # beside each policy's hit: the bound over the requests it completed
            mine = [s for s in steps if s.policy == t["target"]]
            counts = [served_bound(s.workload, completed(s.records), c.block_size, cap, cfg.endpoint,
                                   salt=f"sim-{cfg.seed}") for s in mine]
            total, hit = sum(n for n, _ in counts), sum(h for _, h in counts)
            t["served_reuse_bound"] = hit / total if total else None
        out["served_reuse_bound"] = per_policy[0]["served_reuse_bound"]
    if len(per_policy) > 1:
        out["targets"] = per_policy
        out["comparison"] = [compare(per_policy[0], t) for t in per_policy[1:]]
    return out
