"""Shared pieces of the paper's experiments (bench/experiments/*.py): the traces, the simulated
cluster, one sweep through ``loadgen.simulate`` (the same run_sweep / write_outputs that
``conductor simulate`` uses), markdown tables, and regenerating a doc's generated section while
keeping its hand-written discussion."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec  # noqa: E402
from loadgen.simulate.report import write_outputs  # noqa: E402
from loadgen.simulate.sweep import SimConfig, SimOutcome, run_sweep  # noqa: E402
from loadgen.workload import Workload, read_trace  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402
from scheduler.deferral_params import room_defaults  # noqa: E402
from scheduler.policies.conductor import WAIT_ROOM  # noqa: E402

TRACES = {
    "conversation": ROOT / "data/traces/mooncake_conversation_trace.jsonl",
    "azure_code": ROOT / "data/traces/azure_code_2023.csv",
}
#: the synthetic workload of the simulated experiments (conductor-vs-baselines.md §3b), as
#: ``synthetic_workload`` keywords: 4-turn conversations behind a shared 2048-token system prompt
#: (4 blocks of 512), gamma arrivals with cv 2; ``live_baselines.py`` sends it with loadgen's flags
SYNTHETIC: dict[str, Any] = {"input_tokens": "lognormal:2000:0.6", "output_tokens": "lognormal:250:0.5",
                             "process": "gamma", "cv": 2.0, "turns": 4, "turn_gap_s": 20.0,
                             "shared_prefix_blocks": 4}
PROFILE = "llama3-70b-a800x8"  # the paper's LLaMA3-70B on 8 x A800 per instance
DOCS = ROOT / "docs/experiments"
OUT = ROOT / "out/experiments"  # full outputs (requests.jsonl etc.), not committed
BEGIN, END = "<!-- BEGIN GENERATED", "<!-- END GENERATED -->"
#: a live gateway over its embedded cluster of simulated engines (real time, loopback only)
GATEWAY_CONFIG = """policy = "{policy}"
admission = {admission}
[slo]
ttft_ms = {ttft_ms:g}
tbt_ms = {tbt_ms:g}
[embedded]
prefill = {prefill}
decode = {decode}
seed = 0
store = {store}
"""


def load_trace(name: str, limit: int | None) -> Workload:
    return read_trace(str(TRACES[name]), limit=limit)


def cluster(prefill: int = 0, decode: int = 0, both: int = 0, seed: int = 0) -> ClusterSpec:
    """As ``conductor simulate``'s defaults: chunked prefill (8192-token budget), 256 sequences,
    prefix caching on, 2 ms KV-event lag, 1 s load polls."""
    return ClusterSpec(prefill=prefill, decode=decode, both=both, profile=PROFILE, block_size=16, noise=0.02,
                       seed=seed, kv_event_lag_s=0.002, poll_interval_s=1.0,
                       engine={"max_num_batched_tokens": 8192, "max_num_seqs": 256, "host_tier_tokens": 0})


#: conductor as the pages measured it before the wait room became its default (default-wait-room.md):
#: no room, and a ``defer=on`` setting over the room's own defaults. Every experiment runs it so (their
#: commands reproduce their pages) unless it asks for conductor as shipped (``shipped=True``)
CONDUCTOR_THEN = {**room_defaults(WAIT_ROOM), "defer": False}


def pinned(shipped: bool) -> dict[str, dict[str, Any]]:
    return {} if shipped else {"conductor": CONDUCTOR_THEN}


def sweep(base: Workload, spec: ClusterSpec, policies: list[str], *, loads: list[float], metric_slo: SLO,
          admission_slo: SLO | None = None, predictors: str = "analytic", early_rejection: bool = False,
          workers: int = 2, out: Path | None = None, seed: int = 0, shipped: bool = False,
          **sched_extra: Any) -> SimOutcome:
    """One ``conductor simulate`` sweep: ``policies`` x ``loads`` (trace speed-ups). The scheduler
    admits against ``admission_slo`` (None: admits everything); attainment and goodput are
    measured against ``metric_slo``. Full outputs go to ``out`` when given. ``shipped``: conductor
    with its own defaults, not ``CONDUCTOR_THEN``."""
    sched = SchedulerSpec(policy=policies[0], slo=admission_slo or SLO(None, None), early_rejection=early_rejection,
                          seed=seed)
    if sched_extra:
        sched = replace(sched, **sched_extra)
    cfg = SimConfig(base=base, cluster=spec, scheduler=sched, policies=policies, slo=metric_slo, load_kind="speedup",
                    loads=loads, seed=seed, predictors=predictors, workers=workers, progress=False,
                    pinned=pinned(shipped))
    t0 = time.perf_counter()
    outcome = run_sweep(cfg)
    print(f"  {','.join(policies)} x {loads} on {spec.prefill}P+{spec.decode}D+{spec.both}B, predictors {predictors}: "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if out is not None:
        write_outputs(str(out), outcome)
    return outcome


def start_gateway(cfg_dir: Path, name: str, *, policy: str, store: bool, admission: bool, prefill: int, decode: int,
                  ttft_ms: float, tbt_ms: float, extra: str = "",
                  policy_params: dict[str, str] | None = None, time_scale: float = 1.0,
                  profile: str | None = None, shipped: bool = False) -> tuple[Any, str]:
    """``conductor serve`` on a free loopback port with its config and log in ``cfg_dir``; returns
    (process, URL) once it is ready. ``extra``: more top-level config lines; ``policy_params``:
    its ``--policy-param`` flags; ``time_scale``: the embedded engines' (wall seconds per modelled one);
    ``profile``: theirs (None: the embedded default); ``shipped``: conductor with its own defaults,
    not ``CONDUCTOR_THEN``."""
    from tests.servers import serve

    cfg = cfg_dir / f"{name}.toml"
    cfg.write_text(extra + GATEWAY_CONFIG.format(policy=policy, admission=str(admission).lower(),
                                                 store=str(store).lower(), prefill=prefill, decode=decode,
                                                 ttft_ms=ttft_ms, tbt_ms=tbt_ms)
                   + ("" if time_scale == 1 else f"time_scale = {time_scale:g}\n")  # [embedded] is the last table
                   + ("" if profile is None else f'profile = "{profile}"\n'))
    pin = pinned(shipped).get(policy, {})
    params = {**{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in pin.items()}, **(policy_params or {})}
    flags = [x for k, v in params.items() for x in ("--policy-param", f"{k}={v}")]
    return serve(str(cfg), str(cfg_dir / f"{name}.log"), *flags, timeout_s=120)


def sim_arguments(p: Any, workloads: str, *, eval_requests: int = 1500, workers: int = 2,
                  train_help: str = "training requests (calibration and tuning slice)") -> None:
    """The options every simulated experiment takes: its slices, workloads, cluster, TBT SLO, workers."""
    p.add_argument("--train", type=int, default=1000, help=train_help)
    p.add_argument("--eval", type=int, default=eval_requests, help="evaluation requests (the next slice)")
    p.add_argument("--workloads", default=workloads)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--workers", type=int, default=workers)


def seeded_arguments(p: Any, workloads: str) -> Any:
    """Parse a seeded page's options: ``sim_arguments``, seeds 0..N-1 (1-5, as the pages recorded),
    the deferral pages' models, and ``--from-results``."""
    sim_arguments(p, workloads)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per run (1-5; the pages recorded 5)")
    p.add_argument("--reuse-models", action="store_true",
                   help="use out/experiments/deferral/<workload>/models when present (else calibrate there)")
    p.add_argument("--from-results", action="store_true", help="re-render the page from its results.json")
    a = p.parse_args()
    if not 1 <= a.seeds <= 5 or a.workers < 1:
        p.error("--seeds must be 1-5 (the pages recorded 5) and --workers at least 1")
    return a


def seeds_label(n: int) -> str:
    """"seeds 0-4" (or "seed 0"): which seeds a page ran."""
    return f"seeds 0-{n - 1}" if n > 1 else "seed 0"


def mean(xs: Any) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def sec(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def command_line() -> str:
    """The command that regenerates this experiment, as run from the repository root."""
    script = os.path.relpath(sys.argv[0], ROOT)
    return " ".join([".venv/bin/python", script, *map(shlex.quote, sys.argv[1:])])


def write_doc(path: Path, title: str, generated: str, discussion: str, command: str | None = None) -> None:
    """Write ``path``: the title, the generated block (replaced on every run) and, below it, the
    hand-written discussion already in the file (``discussion`` only when there is none yet).
    ``command``: what generated it, when not this process's command line."""
    kept = discussion
    if path.exists():
        text = path.read_text()
        if END in text:
            kept = text.split(END, 1)[1].lstrip("\n")
    stamp = f"{BEGIN}: by {command or command_line()}; edit below the END marker only -->"
    path.write_text(f"# {title}\n\n{stamp}\n{generated.rstrip()}\n{END}\n\n{kept.rstrip()}\n")


#: the hand-written part of a new page, until someone writes it
DISCUSSION = "## Discussion\n\n(hand-written; kept when the command regenerates the block above)\n"


def seeded_page(page: str, title: str, a: Any, run: Callable[[], list[Any]],
                render: Callable[[list[Any], str, int], str]) -> list[Any]:
    """A seeded page (``seeded_arguments``): its results (``run()``'s, saved to its results.json with
    this command line; with ``--from-results`` that file's), rendered into docs/experiments/PAGE.md."""
    if a.from_results:
        saved = json.loads((DOCS / page / "results.json").read_text())
        results, command, seeds = saved["results"], saved["command"], saved["seeds"]
    else:
        results, command, seeds = run(), command_line(), a.seeds
        save_json(DOCS / page / "results.json", {"command": command, "seeds": seeds, "results": results})
    write_doc(DOCS / f"{page}.md", title, render(results, command, seeds), DISCUSSION, command)
    print(f"wrote {DOCS / page}.md")
    return results


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Lay out, write (its folder made) and close a page's matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
