"""Conductor against the other built-in policies on the live embedded cluster (issue 15's live
confirmation): one gateway per policy, each with its own embedded cluster of simulated engines in
real time, every one admitting against the same SLO, and one ``conductor loadgen`` run sending the
same workload to each in turn. Loopback only.

    .venv/bin/python bench/experiments/live_baselines.py
        [--workload conversation|azure_code|synthetic|synthetic_gap|synthetic_gap_30s|conversation_gap]
        [--rivals P,P,...] [--slo-ttft-ms 30000,5000] [--limit N] [--speedup X | --rate R] [--repeat 2] [--defer]

Workloads (``--workload``; each writes its own page, docs/experiments/<page>.md with
<page>/results.json, and the loadgen outputs to out/experiments/<page>/):

- ``conversation`` (default): the first 400 requests of the Mooncake conversation trace at 16x
  (8x, the load before the analytic TBT fix of 2026-12-02, no longer overloads at TTFT 30 s),
  against dynamo_cost, sglang_cache_aware, prefix_only -> live-baselines.md;
- ``azure_code``: the Azure code trace (no shared prefixes) against dynamo_cost, least_loaded,
  random -> live-baselines-azure-code.md;
- ``synthetic``: loadgen's generator with the simulated experiments' reuse-heavy multi-turn
  setting (``_common.SYNTHETIC``: 4 turns, a shared 2048-token system prompt, gamma arrivals with
  cv 2) at ``--rate`` requests/s, against sglang_cache_aware, prefix_only, lmetric ->
  live-baselines-synthetic.md;
- ``synthetic_gap``: that workload as generated (20 s between turns) on the simulated 8P+8D points'
  ``llama3-70b-a800x8-gap`` engines, every gateway admitting with the learned predictors in
  data/models/synthetic-gap, against prefix_only, sglang_cache_aware, lmetric ->
  live-baselines-synthetic-gap.md; ``synthetic_gap_30s``: the same, 2500 requests at 105 req/s, for
  TTFT 30 s, against sglang_cache_aware, lmetric, prefix_only -> live-baselines-synthetic-gap-30s.md;
- ``conversation_gap``: the conversation trace's requests 1001-2500 (``--offset 1000``: its first 1000
  calibrated data/models/conversation-gap) at 16x on the same engines, against dynamo_cost,
  prefix_only, random, least_loaded -> live-baselines-conversation-gap.md. The other workloads run
  ``llama3-8b-h200`` engines and the analytic predictors.

The rivals are the strongest per workload of docs/experiments/goodput-curves.md (for the gap workloads,
the simulator's strongest at their load); the loads were chosen by a probe of the rivals alone or, for
the gap workloads, by the simulator (the pages say how). ``loadgen --repeat N`` runs the targets
one after another, in the listed order on even repetitions and reversed on odd ones, so over two
repetitions every target is as often early as late (a repeated load in comparison mode was the
position bias issue 15 measured). One load and one SLO per ``--slo-ttft-ms`` value; the page is
rewritten after each. ``--defer`` adds a target ``conductor+defer``: conductor with deferred
dispatch (``--policy-param defer=on``, gateway/waiting.py).

``--time-scale T`` runs the engines T times slower than real time (the embedded cluster's
``time_scale``, as bench/live_vs_sim.py does) and stretches everything else to match: arrivals and
think times T times wider, the SLOs, the gateway's upstream timeouts, loadgen's request timeout and
the wait room's seconds T times longer. The cluster then faces the same load in modelled time while
the gateway and the client handle 1/T of the requests and tokens per wall second, so a 2-core
machine measures placement rather than its own CPU; the page reports modelled seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as C

from gateway.config import GatewayConfig  # noqa: E402
from loadgen.runner import RunnerOptions  # noqa: E402
from predictors.cli_args import key_value  # noqa: E402
from scheduler.deferral_params import DeferParams  # noqa: E402
from scheduler.policies.conductor import WAIT_ROOM  # noqa: E402
from tests.servers import stop  # noqa: E402

TRACE = "data/traces/mooncake_conversation_trace.jsonl"
DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""
#: loadgen's synthetic flags for each ``_common.SYNTHETIC`` keyword (loadgen/workload_args.py)
SYNTHETIC_FLAGS = {"input_tokens": "--input-tokens", "output_tokens": "--output-tokens", "process": "--arrival",
                   "cv": "--burstiness", "turns": "--turns", "turn_gap_s": "--turn-gap",
                   "shared_prefix_blocks": "--shared-prefix-blocks"}


@dataclass(frozen=True)
class LiveWorkload:
    """What loadgen sends on one workload's page, by default at which load and against whom."""

    page: str  # docs/experiments/<page>.md, its <page>/results.json, out/experiments/<page>/
    title: str
    source: tuple[str, ...]  # loadgen flags that name the requests
    count_flag: str  # --limit (a trace's first N) | --requests (N generated)
    requests: int
    load_flag: str  # --speedup (trace time compressed) | --rate (requests/s)
    load: float
    rivals: str
    about: str = ""  # a sentence for the page's setup paragraph
    profile: str = "llama3-8b-h200"  # the embedded sim engines' profile
    # learned predictors (a `conductor calibrate` directory, relative to the repository), or None: analytic
    models: str | None = None
    models_from: str = ""  # where ``models`` come from


#: the simulated experiments' synthetic workload with a 5 s think time between turns (20 s there):
#: with 20 s, the virtual-time simulator's 4P+2D llama3-8b-h200 cluster serves 1500 requests at
#: 300 req/s within 30 s (100% attainment), and a slice long enough to overload it (2500 requests)
#: arrives over ~4 minutes per target, too long for ten targets live
LIVE_SYNTHETIC = {**C.SYNTHETIC, "turn_gap_s": 5.0}


def synthetic_source(settings: dict[str, Any]) -> tuple[str, ...]:
    """``--synthetic`` and the flags that make loadgen generate ``settings`` (``_common.SYNTHETIC``'s keys)."""
    def text(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)
    return ("--synthetic", *[x for k, flag in SYNTHETIC_FLAGS.items() for x in (flag, text(settings[k]))])


#: where the gap workloads' learned predictors come from
COMMITTED_MODELS = "committed; data/models/README.md says how to regenerate them"

# the 8P+8D simulated points' cluster and workload (tight-overload.md) on 4P+2D: prefill binds at 5 s
SYNTHETIC_GAP = LiveWorkload("live-baselines-synthetic-gap",
                             "Conductor against every policy, live: synthetic multi-turn on the 70B gap cluster",
                             synthetic_source(C.SYNTHETIC), "--requests", 1500, "--rate", 52.5,
                             "prefix_only,sglang_cache_aware,lmetric",
                             about="The synthetic workload is the simulated experiments' as generated (bench/"
                                   "experiments/baselines.py: 4-turn conversations 20 s apart behind a shared "
                                   "2048-token system prompt, gamma arrivals with cv 2, seed 0), on the "
                                   "simulated 8P+8D points' engines (tight-overload.md) with their learned "
                                   "predictors.",
                             profile="llama3-70b-a800x8-gap", models="data/models/synthetic-gap",
                             models_from=COMMITTED_MODELS)


WORKLOADS = {
    "conversation": LiveWorkload("live-baselines", "Conductor against every policy, live", ("--trace", TRACE),
                                 "--limit", 400, "--speedup", 16.0, "dynamo_cost,sglang_cache_aware,prefix_only"),
    "azure_code": LiveWorkload("live-baselines-azure-code", "Conductor against every policy, live: Azure code trace",
                               ("--trace", "data/traces/azure_code_2023.csv"), "--limit", 4000, "--speedup", 120.0,
                               "dynamo_cost,least_loaded,random",
                               about="The Azure code trace has no prefix information: every prompt is unique, so "
                                     "placement can only balance load."),
    "synthetic": LiveWorkload("live-baselines-synthetic", "Conductor against every policy, live: synthetic multi-turn",
                              synthetic_source(LIVE_SYNTHETIC), "--requests", 1200, "--rate", 100.0,
                              "sglang_cache_aware,prefix_only,lmetric",
                              about="The synthetic workload is the simulated experiments' (bench/experiments/"
                                    "baselines.py: 4-turn conversations behind a shared 2048-token system prompt, "
                                    "gamma arrivals with cv 2, generated at the rate given, seed 0) with 5 s instead "
                                    "of 20 s between turns, so that a slice short enough to run live overloads the "
                                    "cluster."),
    "synthetic_gap": SYNTHETIC_GAP,
    # the same at TTFT 30 s on a longer, denser slice: at 1500 requests conductor + defer stops at
    # 1.16-1.20x the best other in the simulator (52.5-150 req/s), at 2500 and 105 req/s it reaches 1.26x
    "synthetic_gap_30s": dataclasses.replace(
        SYNTHETIC_GAP, page="live-baselines-synthetic-gap-30s",
        title="Conductor against every policy, live: synthetic multi-turn on the 70B gap cluster at TTFT 30 s",
        requests=2500, load=105.0, rivals="sglang_cache_aware,lmetric,prefix_only",
        about="The workload of live-baselines-synthetic-gap.md (seed 0, the simulated pages' evaluation slice), "
              "longer and denser, with the same engines and learned predictors."),
    # the simulated points' conversation slices on the same cluster: the models learned on the trace's first
    # 1000 requests (the training slice), the run replays the 1500 after them (the evaluation slice's start)
    "conversation_gap": LiveWorkload("live-baselines-conversation-gap",
                                     "Conductor against every policy, live: conversation trace on the 70B gap cluster",
                                     ("--trace", TRACE, "--offset", "1000"), "--limit", 1500, "--speedup", 16.0,
                                     "dynamo_cost,prefix_only,random,least_loaded",
                                     about="The conversation trace's requests 1001-2500 (`--offset 1000`), on the "
                                           "simulated 8P+8D points' engines with the learned predictors calibrated "
                                           "on the trace's first 1000 requests (baselines.py's training slice), so "
                                           "no replayed request was seen in training.",
                                     profile="llama3-70b-a800x8-gap", models="data/models/conversation-gap",
                                     models_from=COMMITTED_MODELS),
}


def workload_flags(w: LiveWorkload, a: argparse.Namespace) -> list[str]:
    """The loadgen flags that choose the requests and the load (the run's own flags come after),
    stretched ``--time-scale`` times in wall time: the load divided by it, think times multiplied."""
    load_flag, load = ("--rate", a.rate) if a.rate is not None else ("--speedup", a.speedup)
    if load is None:
        load_flag, load = w.load_flag, w.load
    source = list(w.source)
    if "--turn-gap" in source:
        k = source.index("--turn-gap") + 1
        source[k] = f"{float(source[k]) * a.time_scale:.12g}"
    return [*source, w.count_flag, str(a.limit or w.requests), load_flag, f"{load / a.time_scale:.12g}"]


def health_config(a: argparse.Namespace) -> str:
    """Top-level gateway config lines for ``--health-timeout-s`` (none: the gateway's default)."""
    return "" if a.health_timeout_s is None else f"health_timeout_s = {a.health_timeout_s:g}\n"


#: the gateway's limits on modelled durations (a prefill leg's queue wait, a stream's silence, a whole
#: answer), stretched with the engines at ``--time-scale``; the host-side ones (connect, health
#: probe, client headers and body, keep-alive) stay in wall seconds
UPSTREAM_TIMEOUTS = ("upstream_first_byte_timeout_s", "upstream_stall_timeout_s", "upstream_timeout_s")


def upstream_config(a: argparse.Namespace) -> str:
    """Top-level gateway config lines for ``--time-scale`` (none in real time): at time scale 4 a
    prefill leg queued 15 modelled seconds hit the default 60 s first-byte limit, and two such
    timeouts ejected the instance."""
    if a.time_scale == 1:
        return ""
    defaults = GatewayConfig()
    return "".join(f"{k} = {getattr(defaults, k) * a.time_scale:g}\n" for k in UPSTREAM_TIMEOUTS)


def loadgen_command(urls: list[str], w: LiveWorkload, ttft_ms: float, a: argparse.Namespace,
                    out: Path) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "loadgen", *[x for u in urls for x in ("--target", u)],
            *workload_flags(w, a), "--repeat", str(a.repeat), "--slo-ttft-ms", f"{ttft_ms * a.time_scale:g}",
            "--slo-tbt-ms", f"{a.slo_tbt_ms * a.time_scale:g}", "--seed", "0", "--out", str(out), "--quiet",
            # loadgen's per-request limit stretched as the gateways' (at 6x, 300 s of wall time cut off
            # answers that met the SLO: 50 modelled seconds end to end)
            "--timeout", f"{RunnerOptions.timeout_s * a.time_scale:g}"]


def predictors_config(w: LiveWorkload) -> str:
    """Top-level gateway config lines for the workload's learned predictors (none: analytic)."""
    return "" if w.models is None else f'predictors = "learned"\npredictor_models = "{C.ROOT / w.models}"\n'


def start(policy: str, ttft_ms: float, a: argparse.Namespace, cfg_dir: Path) -> tuple[Any, str]:
    base, _, variant = policy.partition("+")  # conductor+defer: conductor, deferred dispatch on
    w = WORKLOADS[a.workload]
    shipped = a.shipped and policy == "conductor"
    params = None
    if variant:
        params = scaled_params(defer_params(a, variant), a.time_scale)
    elif shipped:  # its own wait room, with the room's seconds stretched as the SLO is
        params = scaled_params({k: f"{v:g}" for k, v in WAIT_ROOM.items() if k.endswith("_s")}, a.time_scale)
    return C.start_gateway(cfg_dir, f"{policy}-{ttft_ms:g}", policy=base, store=False, admission=True,
                           extra=health_config(a) + upstream_config(a) + predictors_config(w), prefill=a.prefill,
                           decode=a.decode, ttft_ms=ttft_ms * a.time_scale, tbt_ms=a.slo_tbt_ms * a.time_scale,
                           time_scale=a.time_scale, profile=w.profile, policy_params=params, shipped=shipped)


def run_slo(policies: list[str], ttft_ms: float, w: LiveWorkload, a: argparse.Namespace,
            cfg_dir: Path) -> dict[str, Any]:
    out = C.OUT / w.page / f"ttft-{ttft_ms:g}"
    load_before = os.getloadavg()
    t0 = time.monotonic()
    if a.one_at_a_time:
        summary = one_at_a_time(policies, ttft_ms, w, a, cfg_dir, out)
    else:
        procs = []
        try:
            for policy in policies:
                procs.append(start(policy, ttft_ms, a, cfg_dir))
            urls = [url for _, url in procs]
            subprocess.run(loadgen_command(urls, w, ttft_ms, a, out), cwd=C.ROOT, check=True)
        finally:
            stop(*(proc for proc, _ in procs))
        summary = json.loads((out / "summary.json").read_text())
    wall = time.monotonic() - t0
    load_after = os.getloadavg()
    print(f"  load average {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end", file=sys.stderr,
          flush=True)
    return {"wall_s": wall, "summary": summary, "load_average": {"start": load_before, "end": load_after},
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - wall))}


def one_at_a_time(policies: list[str], ttft_ms: float, w: LiveWorkload, a: argparse.Namespace, cfg_dir: Path,
                  out: Path) -> dict[str, Any]:
    """--one-at-a-time: each (repetition, target) its own gateway and loadgen run, in loadgen's order
    (listed on even repetitions, reversed on odd ones), so no idle cluster shares the cores with the one
    under load; the runs' summaries merged as one multi-target loadgen run's."""
    steps: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    bottleneck = False
    for rep in range(a.repeat):
        for policy in (policies if rep % 2 == 0 else policies[::-1]):
            print(f"  [{rep + 1}/{a.repeat}] {policy}", file=sys.stderr, flush=True)
            proc, url = start(policy, ttft_ms, a, cfg_dir)
            run_out = out / f"rep{rep}-{policy}"
            try:
                cmd = loadgen_command([url], w, ttft_ms, argparse.Namespace(**{**vars(a), "repeat": 1}), run_out)
                subprocess.run(cmd, cwd=C.ROOT, check=True)
            finally:
                stop(proc)
            s = json.loads((run_out / "summary.json").read_text())
            steps[policy].append({**s["steps"][0], "step": rep})
            bottleneck = bottleneck or bool(s.get("client_bottleneck"))
    return {"targets": [{"steps": steps[p]} for p in policies], "client_bottleneck": bottleneck}


def target_rows(policies: list[str], summary: dict[str, Any],
                time_scale: float = 1.0) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """Per target: its repetitions' figures, TTFT and goodput in modelled seconds (wall / ``time_scale``)."""
    n = len(policies)
    per = []
    for k, policy in enumerate(policies):
        steps = summary["targets"][k]["steps"]
        att = [s["slo_attainment"] for s in steps]
        refused = sum(s["rejected"] for s in steps)
        positions = [(k if s["step"] % 2 == 0 else n - 1 - k) + 1 for s in steps]
        per.append({"policy": policy, "attainment": att, "positions": positions, "refused": refused,
                    "errors": sum(s["errors"] for s in steps),
                    "hit_ratio": [s["cached_tokens"]["hit_ratio"] for s in steps],
                    "ttft_p50_s": [s["ttft_s"]["p50"] / time_scale for s in steps],
                    "goodput_rps": [s["goodput_rps"] * time_scale for s in steps]})
    return per, table_rows(per)


def table_rows(per: list[dict[str, Any]]) -> list[list[Any]]:
    """The page's table from the targets' figures (``target_rows``, or results.json's)."""
    ours = {"conductor", "conductor+defer", "conductor+defer-b"}
    best_rival = max((p for p in per if p["policy"] not in ours), key=lambda p: C.mean(p["attainment"]) or 0.0)
    rows = []
    for p in per:
        m = C.mean(p["attainment"]) or 0.0
        ratio = m / (C.mean(best_rival["attainment"]) or 1.0) if p["policy"] in ours else None
        rows.append([f"**{p['policy']}**" if p["policy"] in ours else p["policy"],
                     ", ".join(f"{C.pct(x)} ({pos})" for x, pos in zip(p["attainment"], p["positions"], strict=True)),
                     C.pct(m), f"{C.pct(min(p['attainment']))}-{C.pct(max(p['attainment']))}",
                     "-" if ratio is None else f"**{ratio:.2f}x** (over {best_rival['policy']})",
                     p["refused"], C.pct(C.mean(p["hit_ratio"])), C.sec(C.mean(p["ttft_p50_s"])),
                     C.sec(C.mean(p["goodput_rps"]))])
    return rows


def section(ttft_ms: str, r: dict[str, Any]) -> str:
    """One SLO's table; one kept from an earlier run (``--keep-other-slos``) says when it ran."""
    kept = f" Kept from the run started {r['started_utc']} (`--keep-other-slos`)." if r.get("kept") else ""
    head = (f"`conductor loadgen` wall time {r['wall_s']:.0f} s; client bottleneck flagged: "
            f"{r.get('client_bottleneck')}{errors_note(r['targets'])}.{kept}")
    return f"""### TTFT <= {float(ttft_ms) / 1e3:g} s

{head}

""" + C.md_table(["policy", "attainment per repetition (position in the order)", "mean", "spread",
                  "conductor / best other", "refused", "prefix hit (engine-reported)", "TTFT p50 (s)",
                  "goodput (req/s)"], table_rows(r["targets"]))


def kept_results(a: argparse.Namespace, w: LiveWorkload, slos: list[float]) -> dict[str, Any]:
    """``--keep-other-slos``: the page's saved tables for the SLOs not rerun, when the saved run had
    this run's setup in every other respect (else ValueError naming what differs)."""
    path = C.DOCS / w.page / "results.json"
    if not a.keep_other_slos or not path.exists():
        return {}
    saved = json.loads(path.read_text())
    now = json.loads(json.dumps(vars(a)))  # as the saved copy reads back (tuples become lists)
    differ = sorted(k for k in {**now, **saved["args"]} if k not in ("slo_ttft_ms", "keep_other_slos")
                    and saved["args"].get(k) != now.get(k))
    if differ:
        raise ValueError(f"the saved run differs in {', '.join(differ)}")
    return {k: {**v, "kept": True} for k, v in saved["results"].items() if float(k) not in slos}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:4]))
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="conversation",
                   help="what loadgen sends, and which page it writes (default: conversation)")
    p.add_argument("--rivals", help="comma-separated built-in policies to run beside conductor (default: the "
                   "workload's: " + "; ".join(f"{k} {w.rivals}" for k, w in WORKLOADS.items()) + ")")
    p.add_argument("--slo-ttft-ms", default="30000,5000", help="comma-separated TTFT SLOs, one run each")
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--limit", type=int, help="requests: a trace's first N, or N generated (default: the workload's: "
                   + "; ".join(f"{k} {w.requests}" for k, w in WORKLOADS.items()) + ")")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--speedup", type=float, help="trace speed-up (the load; default for the traces: "
                      + "; ".join(f"{k} {w.load:g}" for k, w in WORKLOADS.items() if w.load_flag == "--speedup") + ")")
    load.add_argument("--rate", type=float, help="requests/s (the load; default for synthetic: "
                      f"{WORKLOADS['synthetic'].load:g}; on a trace: its arrivals replaced by a Poisson process)")
    p.add_argument("--repeat", type=int, default=2, help="repetitions, the target order reversed on odd ones")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--defer", action="store_true", help="also run conductor with deferred dispatch (defer=on)")
    p.add_argument("--defer-only", action="store_true",
                   help="with --defer: run conductor with deferred dispatch only, not conductor without it too")
    p.add_argument("--defer-param", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="with --defer: a further policy parameter of conductor+defer (repeatable), e.g. the setting "
                        "tuned in deferral.md: defer_scan=64 defer_aging=0.05 defer_wait_holder=on")
    p.add_argument("--defer-b", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="with --defer: also run conductor+defer-b, conductor+defer with this parameter on top "
                        "(repeatable): an A/B of a deferral setting in the same run, e.g. defer_reeval_s=0.5")
    p.add_argument("--page", help="write docs/experiments/PAGE.md (and out/experiments/PAGE/) instead of the "
                                  "workload's own page: another setup of the same workload beside it")
    p.add_argument("--shipped", action="store_true",
                   help="conductor as shipped, its default wait room included (docs/experiments/default-wait-room.md); "
                        "without it the conductor target decides at arrival (defer=off), as the pages before measured")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="one gateway up at a time: each repetition of each target its own gateway and loadgen run "
                        "(same order), so the idle clusters of the other targets do not share the cores")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="T",
                   help="engines T times slower than real time, arrivals, think times, SLOs and the wait room's "
                        "seconds T times longer (default 1: real time); figures in modelled seconds")
    p.add_argument("--keep-other-slos", action="store_true",
                   help="keep the page's tables for the TTFT SLOs not given (when its saved run had this setup "
                        "otherwise), so one SLO can be rerun or added without rerunning the others")
    p.add_argument("--health-timeout-s", type=float,
                   help="every gateway's health_timeout_s (default: the gateway's 0.8 s); on a crowded machine "
                        "a starved engine misses two probes and is ejected with its requests in progress")
    return p


def defer_params(a: argparse.Namespace, variant: str = "defer") -> dict[str, str]:
    """conductor+defer's policy parameters: deferred dispatch on, plus ``--defer-param``s (and for
    conductor+defer-b its ``--defer-b``s on top)."""
    return {"defer": "on", **dict(a.defer_param), **(dict(a.defer_b) if variant == "defer-b" else {})}


def scaled_params(params: dict[str, str], time_scale: float) -> dict[str, str]:
    """The wait room's seconds (``defer_*_s``, the horizon's default included) in wall seconds at
    ``time_scale``; its other parameters are ratios and counts."""
    if time_scale == 1:
        return params
    out = {"defer_horizon_s": f"{DeferParams.horizon_s:g}", **params}
    return {k: f"{float(v) * time_scale:g}" if k.startswith("defer_") and k.endswith("_s") else v
            for k, v in out.items()}


def errors_note(per: list[dict[str, Any]]) -> str:
    """Requests that failed or timed out (an ejected engine's, say), which the table counts as misses."""
    failed = [f"{p['policy']} {p['errors']}" for p in per if p["errors"]]
    return f"; requests failed or timed out: {', '.join(failed)}" if failed else ""


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    w = WORKLOADS[a.workload]
    if a.page is not None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", a.page):
            p.error(f"--page: lowercase letters, digits and dashes, got {a.page!r}")
        w = dataclasses.replace(w, page=a.page)
    if a.shipped:
        w = dataclasses.replace(w, title=f"{w.title}, conductor as shipped")
    rivals = w.rivals if a.rivals is None else a.rivals
    policies = [*([] if a.defer_only else ["conductor"]), *(["conductor+defer"] if a.defer else []),
                *(["conductor+defer-b"] if a.defer_b else []),
                *[x.strip() for x in rivals.split(",") if x.strip()]]
    try:
        slos = [float(x) for x in a.slo_ttft_ms.split(",") if x.strip()]
    except ValueError:
        p.error(f"--slo-ttft-ms: expected comma-separated milliseconds, got {a.slo_ttft_ms!r}")
    if len(set(policies)) != len(policies) or not slos:
        p.error("--rivals: conductor and each rival once; --slo-ttft-ms: at least one value")
    if (a.defer_param or a.defer_b or a.defer_only) and not a.defer:
        p.error("--defer-param, --defer-b and --defer-only need --defer")
    if a.shipped and a.defer_only:
        p.error("--shipped is conductor's target, which --defer-only drops")
    if w.models is not None and not (C.ROOT / w.models / "models.json").exists():
        p.error(f"--workload {a.workload}: no learned predictors in {w.models} ({w.models_from})")
    if any(v is not None and not v > 0 for v in (a.limit, a.speedup, a.rate, a.health_timeout_s, a.time_scale)):
        p.error("--limit, --speedup, --rate, --health-timeout-s and --time-scale must be > 0")
    try:
        results: dict[str, Any] = kept_results(a, w, slos)
    except ValueError as e:
        p.error(f"--keep-other-slos: {e}")
    cfg_dir = C.OUT / w.page / "gateways"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    for ttft_ms in slos:
        print(f"TTFT SLO {ttft_ms:g} ms: {', '.join(policies)}", file=sys.stderr, flush=True)
        r = run_slo(policies, ttft_ms, w, a, cfg_dir)
        per, _ = target_rows(policies, r["summary"], a.time_scale)
        results[f"{ttft_ms:g}"] = {"wall_s": r["wall_s"], "targets": per,
                                   "client_bottleneck": r["summary"].get("client_bottleneck"),
                                   "load_average": r["load_average"], "started_utc": r["started_utc"]}
        write_page(w, a, results)  # after each SLO: a run cut short keeps what it measured


def write_page(w: LiveWorkload, a: argparse.Namespace, results: dict[str, Any]) -> None:
    C.save_json(C.DOCS / w.page / "results.json", {"args": vars(a), "loadgen_workload": workload_flags(w, a),
                                                   "results": results})
    minutes = sum(r["wall_s"] for r in results.values() if not r.get("kept")) / 60
    about = f"{w.about}\n" if w.about else ""
    if a.shipped:
        about += ("conductor runs as shipped (`--shipped`): no `--policy-param` but the wait room's seconds stretched "
                  "by the time scale, so its default wait room `" + " ".join(
                      f"{k}={({True: 'on', False: 'off'}).get(v, v)}" for k, v in WAIT_ROOM.items()) + "`.\n")
    if a.defer_param:
        about += ("conductor+defer runs with `" + " ".join(f"{k}={v}" for k, v in defer_params(a).items())
                  + "` (`--policy-param`s).\n")
    if a.defer_b:
        about += ("conductor+defer-b runs with conductor+defer's parameters plus `"
                  + " ".join(f"{k}={v}" for k, v in dict(a.defer_b).items()) + "`.\n")
    if a.one_at_a_time:
        about += ("One gateway up at a time (`--one-at-a-time`): each repetition of each target starts its own "
                  "gateway and cluster, runs `--repeat 1` against it alone and stops it, in the order above, so "
                  "no idle cluster shares the cores.\n")
    if a.time_scale != 1:
        t = f"{a.time_scale:g}"
        about += (f"Time scale {t} (`--time-scale`): the engines run {t}x slower than real time, and the load "
                  "above, the SLOs given to the gateways and to loadgen, the gateways' upstream timeouts, loadgen's "
                  f"request timeout and the wait room's seconds are stretched {t}x to match, so the cluster sees the "
                  f"same load in modelled time while the gateway and the client carry 1/{t} of the requests per wall "
                  "second. SLOs, TTFT and goodput are in modelled seconds (wall / time scale).\n")
    if a.health_timeout_s is not None:
        about += (f"Every gateway probes its engines' health with a {a.health_timeout_s:g} s timeout (the default "
                  "0.8 s ejected a CPU-starved engine with its requests in progress).\n")
    pace = "real time" if a.time_scale == 1 else f"time scale {a.time_scale:g}"
    predictors = ("analytic predictors" if w.models is None
                  else f"learned predictors in `{w.models}` ({w.models_from})")
    gen = f"""
**Command** (regenerates this block and results.json; about {minutes:.0f} minutes of load):

```
{C.command_line()}
```

**Setup.** One `conductor serve` per policy, each with its own embedded cluster of {a.prefill} prefill +
{a.decode} decode simulated `{w.profile}` engines (vLLM two-step PD, {pace}, no store), every
gateway admitting against the SLO with the {predictors} (placement alone differs). Load:
`conductor loadgen {' '.join(workload_flags(w, a))} --repeat {a.repeat}` with every
gateway as a target: the targets run one after another, in the order listed on even repetitions and
reversed on odd ones (the number in brackets is the position). A request meets the SLO with its TTFT
within the SLO and TBT (mean of its slowest 10% of gaps) <= {a.slo_tbt_ms:g} ms; the goodput ratio at equal
offered load is the attainment ratio. {about}**2 shared cores: compare within a table and read the spread.**

""" + "\n".join(section(k, results[k]) for k in sorted(results, key=float, reverse=True))
    C.write_doc(C.DOCS / f"{w.page}.md", w.title, gen, DISCUSSION)
    print(gen)


if __name__ == "__main__":
    main()
