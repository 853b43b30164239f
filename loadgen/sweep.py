"""A whole load-generator run: probe the targets, then one step per load value (per target,
interleaved), and the summary: per-step metrics, effective capacity, client health, comparison.

Steps of two targets alternate A B, B A, A B, ... so a slow drift of the machine (another job,
thermal throttling) hits both alike and their ratio survives. Unless ``reuse_prompts``, every
(step, target) gets its own prompt salt: the same sharing pattern with different text, so no step
starts with a cache warmed by the one before. The salt's base is fresh per run (``prompt_salt``
pins it), so a second run against a long-lived server does not find the first one's blocks.

Programmatic use (what ``conductor loadgen`` does)::

    cfg = LoadgenConfig(targets=["http://127.0.0.1:8000"], base=read_trace(path).head(300),
                        load_kind="speedup", loads=[1, 2, 4, 8], slo=SLO(ttft_s=30, tbt_s=0.1))
    outcome = run(cfg)            # RunOutcome: .summary (summary.json), .records()
    write_outputs("out/", outcome)
"""
from __future__ import annotations

import asyncio
import json
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from predictors.telemetry import SLO, RequestRecord

from .arrivals import rate_of, retimed, sped_up
from .metrics import dist, effective_capacity, summarize
from .progress import Progress
from .prompts import ENDPOINTS, ChatFraming, PromptSynth, build_body
from .runner import INTERRUPTED, RunnerOptions, Send, StepResult, new_session, probe, run_sends
from .workload import Workload

LOAD_KINDS = ("speedup", "rate")
#: A client using more than this share of one core is too busy to time requests well.
CPU_BOTTLENECK = 0.9


@dataclass
class LoadgenConfig:
    targets: list[str]
    base: Workload
    slo: SLO
    load_kind: str = "speedup"  # "speedup" compresses trace time; "rate" replaces arrivals
    loads: list[float] = field(default_factory=lambda: [1.0])
    attainment_target: float = 0.9
    model: str | None = None  # None: the first id from each target's GET /v1/models
    endpoint: str = "chat"
    prompt_format: str = "text"
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    timeout_s: float = 300.0
    max_concurrency: int | None = None
    max_lag_ms: float = 10.0
    reuse_prompts: bool = False
    #: Base of every prompt salt; None = a random one per run (recorded in summary.run).
    prompt_salt: str | None = None
    step_pause_s: float = 1.0
    probe_timeout_s: float = 3.0
    progress: bool = True
    api_key: str | None = None  # sent as "authorization: Bearer KEY"
    #: The workload at a given rate, when it is generated rather than replayed (synthetic).
    regenerate: Callable[[float], Workload] | None = None


@dataclass
class StepOutcome:
    step: int
    target_index: int
    target: str
    load: float
    workload: Workload
    result: StepResult
    summary: dict[str, Any]


@dataclass
class RunOutcome:
    config: LoadgenConfig
    models: list[str]
    steps: list[StepOutcome]
    summary: dict[str, Any]
    aborted: str | None = None

    @property
    def interrupted(self) -> bool:
        return self.aborted == INTERRUPTED

    def records(self) -> list[RequestRecord]:
        return [r for s in self.steps for r in s.result.records]


class TargetError(Exception):
    """A target that cannot be used (unreachable, or no model to name): one line."""


def load_label(kind: str, load: float) -> str:
    return f"{load:g}x" if kind == "speedup" else f"{load:g} req/s"


class LoadSpec(Protocol):
    """What scaling a workload to a load reads (LoadgenConfig and the simulator's SimConfig)."""

    base: Workload
    load_kind: str
    regenerate: Callable[[float], Workload] | None
    arrival: str
    cv: float
    seed: int


def workload_at(cfg: LoadSpec, load: float) -> Workload:
    if cfg.load_kind == "speedup":
        return sped_up(cfg.base, load)
    if cfg.regenerate is not None:
        return cfg.regenerate(load)
    return retimed(cfg.base, load, cfg.arrival, cfg.cv, cfg.seed)


def prepare(w: Workload, model: str, cfg: LoadgenConfig, salt: str, tag: str) -> list[Send]:
    """Every body of a step, encoded before its clock starts (synthesis never delays a send)."""
    synth = PromptSynth(w.block_tokens, salt)
    framing = ChatFraming.of()
    sends = []
    for r in w.requests:
        body, n = build_body(r, synth, model=model, endpoint=cfg.endpoint, prompt_format=cfg.prompt_format,
                             framing=framing)
        sends.append(Send(r, json.dumps(body, separators=(",", ":")).encode(), n, f"{tag}-r{r.index}"))
    return sends


def client_health(results: list[StepResult], max_lag_ms: float) -> dict[str, Any]:
    """Send lag, event-loop lag and CPU use of the client, and whether it was the bottleneck."""
    send = dist([x * 1000 for r in results for x in r.send_lags_s])
    loop = dist([x * 1000 for r in results for x in r.loop_lags_s])
    cpu = max((r.cpu_util for r in results), default=0.0)
    reasons = []
    if send["p99"] is not None and send["p99"] > max_lag_ms:
        reasons.append(f"send lag p99 {send['p99']:.1f} ms > {max_lag_ms:g} ms")
    if loop["p99"] is not None and loop["p99"] > max_lag_ms:
        reasons.append(f"event-loop lag p99 {loop['p99']:.1f} ms > {max_lag_ms:g} ms")
    if cpu > CPU_BOTTLENECK:
        reasons.append(f"client CPU {cpu:.0%} of a core")
    return {"send_lag_ms": send, "loop_lag_ms": loop, "cpu_util": cpu, "max_lag_ms": max_lag_ms,
            "bottleneck": bool(reasons), "reason": "; ".join(reasons) or None}


_RATIO_KEYS = [("goodput_rps",), ("slo_attainment",), ("ttft_s", "p50"), ("ttft_s", "p90"), ("ttft_s", "p99"),
               ("tbt_s", "p50"), ("tbt_s", "p90"), ("tbt_s", "p99")]


def _get(d: dict, path: tuple[str, ...]) -> Any:
    v: Any = d
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None when either is missing or a is 0."""
    return None if a in (None, 0) or b is None else b / a


def compare(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """Candidate / baseline for goodput, attainment, TTFT and TBT percentiles, per step and for
    the effective capacity (> 1 is better for goodput, attainment and capacity; < 1 for latency)."""
    steps = []
    for sa, sb in zip(base["steps"], cand["steps"], strict=False):  # a run aborted early has fewer steps
        row = {"load": sa["load"]}
        for path in _RATIO_KEYS:
            row["_".join(path) + "_ratio"] = ratio(_get(sa, path), _get(sb, path))
        steps.append(row)
    ca, cb = base["effective_capacity"], cand["effective_capacity"]
    return {"baseline": base["target"], "candidate": cand["target"], "steps": steps,
            "effective_capacity_ratio": ratio(ca["value"], cb["value"]),
            "effective_capacity_methods": [ca["method"], cb["method"]]}


def _step_summary(o: StepOutcome, cfg: LoadgenConfig) -> dict[str, Any]:
    s = summarize(o.result.records, cfg.slo)
    s.update(step=o.step, load=o.load, load_kind=cfg.load_kind, target=o.target,
             offered_rps=rate_of(o.workload.requests), span_s=o.workload.span_s,
             client=client_health([o.result], cfg.max_lag_ms), aborted=o.result.aborted)
    return s


def spread(step_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per distinct load run more than once: min, mean and max of attainment and goodput."""
    by: dict[float, list[dict[str, Any]]] = {}
    for s in step_rows:
        by.setdefault(s["load"], []).append(s)
    out = []
    for load, rows in sorted(by.items()):
        if len(rows) < 2:
            continue
        row: dict[str, Any] = {"load": load, "runs": len(rows)}
        for key in ("slo_attainment", "goodput_rps"):
            vals = [r[key] for r in rows if r[key] is not None]
            row[key] = {"min": min(vals), "mean": sum(vals) / len(vals), "max": max(vals)} if vals else None
        out.append(row)
    return out


def _target_summary(ti: int, cfg: LoadgenConfig, steps: list[StepOutcome], model: str) -> dict[str, Any]:
    mine = sorted((s for s in steps if s.target_index == ti), key=lambda s: s.step)
    records = [r for s in mine for r in s.result.records]
    agg = summarize(records, cfg.slo, duration_s=sum(s.summary["duration_s"] for s in mine))
    step_rows = [s.summary for s in mine]
    agg.update(target=cfg.targets[ti], model=model, steps=step_rows,
               # a step cut short (target gone, Ctrl-C) did not send all its load: it says nothing
               # about capacity at that load
               effective_capacity=effective_capacity([s["load"] for s in step_rows],
                                                     [None if s.get("aborted") else s["slo_attainment"]
                                                      for s in step_rows], cfg.attainment_target),
               client=client_health([s.result for s in mine], cfg.max_lag_ms), spread=spread(step_rows))
    return agg


def build_summary(cfg: LoadgenConfig, models: list[str], steps: list[StepOutcome],
                  aborted: str | None) -> dict[str, Any]:
    """summary.json: the first target's numbers at top level (all its steps together), each
    step in ``steps``; with several targets, each under ``targets`` and their ratios under
    ``comparison``."""
    per_target = [_target_summary(i, cfg, steps, models[i]) for i in range(len(cfg.targets))]
    w = cfg.base
    out = dict(per_target[0])
    out.update(
        load_kind=cfg.load_kind, loads=cfg.loads, attainment_target=cfg.attainment_target,
        client_bottleneck=any(t["client"]["bottleneck"] for t in per_target),
        workload={"source": w.source, "kind": w.kind, "requests": len(w.requests), "skipped_lines": w.skipped,
                  "problems": w.problems, "span_s": w.span_s, "offered_rps": rate_of(w.requests),
                  "block_tokens": w.block_tokens},
        run={"endpoint": cfg.endpoint, "path": ENDPOINTS[cfg.endpoint], "prompt_format": cfg.prompt_format,
             "models": models, "arrival": cfg.arrival, "cv": cfg.cv, "seed": cfg.seed,
             "max_concurrency": cfg.max_concurrency, "timeout_s": cfg.timeout_s, "reuse_prompts": cfg.reuse_prompts,
             "prompt_salt": cfg.prompt_salt},
        aborted=aborted,
    )
    if len(per_target) > 1:
        out["targets"] = per_target
        out["comparison"] = [compare(per_target[0], t) for t in per_target[1:]]
    return out


def auth_headers(cfg: LoadgenConfig) -> dict[str, str]:
    return {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def resolve_models(cfg: LoadgenConfig) -> list[str]:
    """Probe every target (fail fast, one line) and pick each one's model."""
    from .runner import TargetUnreachable

    models = []
    async with new_session() as session:
        for url in cfg.targets:
            try:
                status, ids = await probe(url, cfg.probe_timeout_s, session, auth_headers(cfg))
            except TargetUnreachable as e:
                raise TargetError(str(e)) from None
            if status in (401, 403):
                raise TargetError(f"target {url}: GET /v1/models answered HTTP {status} (pass the right --api-key)")
            if cfg.model:
                models.append(cfg.model)
            elif ids:
                models.append(ids[0])
            else:
                raise TargetError(f"target {url}: GET /v1/models gave no model (HTTP {status}); pass --model")
    return models


async def run_async(cfg: LoadgenConfig, log: Callable[[str], None] | None = None) -> RunOutcome:
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    models = await resolve_models(cfg)
    if cfg.prompt_salt is None:
        cfg.prompt_salt = secrets.token_hex(4)
    opts = RunnerOptions(path=ENDPOINTS[cfg.endpoint], timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency,
                         headers=auth_headers(cfg))
    steps: list[StepOutcome] = []
    aborted = None
    n_steps = len(cfg.loads)
    for i, load in enumerate(cfg.loads):
        w = workload_at(cfg, load)
        order = list(range(len(cfg.targets)))
        if i % 2:
            order.reverse()
        for ti in order:
            url = cfg.targets[ti]
            salt = cfg.prompt_salt if cfg.reuse_prompts else f"{cfg.prompt_salt}/step{i}/target{ti}"
            sends = prepare(w, models[ti], cfg, salt, f"s{i}-t{ti}")
            name = f"target {ti + 1} " if len(cfg.targets) > 1 else ""
            label = f"[{i + 1}/{n_steps}] {name}{load_label(cfg.load_kind, load)}"
            log(f"{label}: {len(sends)} requests to {url} over {w.span_s:.1f} s "
                f"(offered {rate_of(w.requests):.2f} req/s)")
            progress = Progress(len(sends), label, cfg.slo, enabled=cfg.progress)
            result = await run_sends(url, sends, opts, progress)
            for req, r in zip(w.requests, result.records, strict=True):
                r.extra.update(target=url, step=i, load=load)
                if req.line is not None:
                    r.extra["trace_line"] = req.line
                if req.conversation is not None:
                    r.extra.update(conversation=req.conversation, turn=req.turn)
            o = StepOutcome(i, ti, url, load, w, result, {})
            o.summary = _step_summary(o, cfg)
            steps.append(o)
            if result.aborted:
                aborted = INTERRUPTED if result.aborted == INTERRUPTED else f"target {url}: {result.aborted}"
                break
            if cfg.step_pause_s > 0 and (i, ti) != (n_steps - 1, order[-1]):
                try:
                    await asyncio.sleep(cfg.step_pause_s)
                except asyncio.CancelledError:  # Ctrl-C between steps: keep what ran
                    aborted = INTERRUPTED
                    break
        if aborted:
            break
    return RunOutcome(cfg, models, steps, build_summary(cfg, models, steps, aborted), aborted)


def run(cfg: LoadgenConfig, log: Callable[[str], None] | None = None) -> RunOutcome:
    return asyncio.run(run_async(cfg, log))
