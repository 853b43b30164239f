"""One simulated run: a workload replayed against a simulated cluster in virtual time.

Prompts are built exactly as ``conductor loadgen`` builds its request bodies (same synthesis, same
chat framing) and tokenised with the built-in tokenizer the gateway uses, so a prefix hit in the
simulation is the hit a live run of the same trace would see. Prompt tokens exist only while a
request is in flight.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from engines_adapters.tokenizer import ByteTokenizer
from predictors.telemetry import RequestRecord

from ..prompts import ChatFraming, PromptSynth, build_prompt
from ..workload import Request, Workload
from .cluster import ClusterSpec, SchedulerSpec, SimCluster
from .loop import EventLoop


@dataclass
class RunStats:
    """How the simulation itself went (not what it simulated)."""

    events: int = 0
    wall_s: float = 0.0
    sim_s: float = 0.0
    engine_steps: int = 0
    ignored_kv_events: int = 0
    wait_room: dict[str, int] = field(default_factory=dict)  # the room's counts (deferred dispatch on)

    def as_dict(self, wall: bool = True) -> dict[str, Any]:
        """``wall=False``: only what the seed determines (summary.json stays byte-identical)."""
        out: dict[str, Any] = {"events": self.events, "simulated_s": self.sim_s, "engine_steps": self.engine_steps,
                               "ignored_kv_events": self.ignored_kv_events}
        if self.wait_room:
            out["wait_room"] = dict(self.wait_room)
        if wall:
            out.update(wall_s=self.wall_s, events_per_s=self.events / self.wall_s if self.wall_s else None,
                       simulated_s_per_wall_s=self.sim_s / self.wall_s if self.wall_s else None)
        return out


@dataclass
class SimRun:
    records: list[RequestRecord]
    stats: RunStats
    scheduler_counts: dict[str, int] = field(default_factory=dict)


def prompt_tokens(req: Request, synth: PromptSynth, framing: ChatFraming, endpoint: str,
                  tokenizer: ByteTokenizer) -> list[int]:
    """The token ids the gateway would compute for ``req``'s body as loadgen sends it."""
    p = build_prompt(req, synth, endpoint, "text", framing)
    if endpoint == "chat":
        return tokenizer.encode_chat(p.fields["messages"])
    return tokenizer.encode(p.fields["prompt"])


class _Progress:
    """One stderr line, redrawn at most every ``every_s`` wall seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None, every_s: float = 1.0):
        self.label, self.total, self.stream, self.every_s = label, total, stream, every_s
        self.t0 = self._last = time.perf_counter()
        self.done = 0

    def tick(self, loop: EventLoop, force: bool = False) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        wall = now - self.t0
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(("\r" if tty else "") + f"{self.label}: {self.done}/{self.total} requests, "
                          f"trace time {loop.now:,.0f} s, "
                          f"wall {wall:.1f} s, {loop.events / max(wall, 1e-9):,.0f} events/s ")
        if force or not tty:
            self.stream.write("\n")
        self.stream.flush()


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """A simulation allocates millions of small objects (KV blocks, token times) and almost no
    reference cycles: the cyclic collector's frequent passes over a growing heap cost about a
    quarter of the run. Collect rarely while it runs; restore the thresholds after."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(200_000, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def simulate(workload: Workload, cluster: ClusterSpec, sched: SchedulerSpec, *, endpoint: str = "chat",
             salt: str = "sim", predictors: Callable | None = None, label: str = "simulate",
             progress: TextIO | None = sys.stderr, id_prefix: str = "sim") -> SimRun:
    """Replay ``workload`` (arrival times as given) on a fresh simulated cluster.

    Request ids are ``{id_prefix}-r{index}``. The scheduler breaks ties with a per-request RNG
    seeded by the id, so ``conductor simulate`` passes ``s{step}-t{target}``, the ids
    ``conductor loadgen`` sends: a live run and the simulation of the same step break ties alike."""
    loop = EventLoop()
    records: list[RequestRecord] = []
    bar = _Progress(label, len(workload.requests), progress)

    def done(rec: RequestRecord) -> None:
        records.append(rec)
        bar.done += 1

    sim = SimCluster(cluster, sched, loop, predictors=predictors, on_done=done)
    synth, framing, tok = PromptSynth(workload.block_tokens, salt), ChatFraming.of(), ByteTokenizer()
    requests = workload.requests
    if not requests:
        return SimRun([], RunStats())
    t0 = requests[0].arrival_s
    state = {"next": 0}

    def arrive(i: int) -> None:
        req = requests[i]
        extra: dict[str, Any] = {"trace_index": req.index}
        if req.line is not None:
            extra["trace_line"] = req.line
        if req.conversation is not None:
            extra.update(conversation=req.conversation, turn=req.turn)
        sim.arrive(f"{id_prefix}-r{req.index}", prompt_tokens(req, synth, framing, endpoint, tok), req.output_length,
                   req.output_length, extra)
        state["next"] = i + 1
        if i + 1 < len(requests):  # one pending arrival at a time keeps the heap small
            loop.at(requests[i + 1].arrival_s - t0, arrive, i + 1)

    def poll() -> None:
        sim.report_load()
        if state["next"] < len(requests) or sim.active():
            loop.at(loop.now + cluster.poll_interval_s, poll)

    loop.at(0.0, arrive, 0)
    loop.at(cluster.poll_interval_s, poll)
    wall0 = time.perf_counter()
    with _few_collections():
        loop.run(on_tick=lambda: bar.tick(loop))
    bar.tick(loop, force=True)
    stats = RunStats(events=loop.events, wall_s=time.perf_counter() - wall0, sim_s=loop.now,
                     engine_steps=sum(i.steps for i in sim.instances.values()), ignored_kv_events=sim.ignored_events,
                     wait_room=dict(sim.room.counts) if sim.room.enabled else {})
    if sim.active():
        raise RuntimeError(f"simulation ended with {sim.active()} requests unfinished (a bug)")
    if not sim.scheduler.ledger.is_idle():
        raise RuntimeError("simulation ended with reservations still held (a bug)")
    if len(sim.room):
        raise RuntimeError(f"simulation ended with {len(sim.room)} requests still waiting (a bug)")
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    counts = dict(sim.scheduler.counts)
    if sim.room.enabled:  # deferred dispatch: how many waited, went, missed their deadline
        counts.update({f"defer_{k}": v for k, v in sim.room.counts.items()})
    return SimRun(records, stats, counts)
