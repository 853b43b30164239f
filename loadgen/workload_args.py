"""Workload and load options shared by ``conductor loadgen`` and ``conductor simulate``: the same
flags mean the same thing in both, and build the same workload."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from predictors.cli_args import CLIError, non_negative_int, positive_float, positive_int
from predictors.telemetry import SLO

from .arrivals import PROCESSES
from .synthetic import parse_dist, synthetic_workload
from .workload import TRACE_BLOCK_TOKENS, TraceError, Workload, read_trace


def load_list(text: str) -> list[float]:
    """``2`` or ``1,2,4``: positive numbers, one sweep step each."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list, got {text!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
    return vals


def fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def dist_arg(text: str):
    try:
        return parse_dist(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--trace | --synthetic, --format, --limit, --speedup | --rate, arrivals, seed, SLOs, and the
    synthetic workload's options."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="PATH", help="Mooncake JSONL (hash_ids) or Azure CSV trace")
    src.add_argument("--synthetic", action="store_true", help="generate the workload (see the synthetic options)")
    p.add_argument("--format", choices=("auto", "mooncake", "azure"), default="auto",
                   help="trace format (default: by extension)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="replay only the first N requests")
    p.add_argument("--offset", type=non_negative_int, default=0, metavar="K",
                   help="skip the trace's first K requests and start at the next, at time 0: "
                        "replay a slice that predictors were not calibrated on")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--speedup", type=load_list, metavar="X[,X...]", help="compress trace time X-fold; a list sweeps")
    load.add_argument("--rate", type=load_list, metavar="R[,R...]",
                      help="replace arrivals by a process at R requests/s (order kept); a list sweeps")
    p.add_argument("--arrival", choices=PROCESSES, default="poisson", help="arrival process for --rate and --synthetic")
    p.add_argument("--burstiness", type=positive_float, default=1.0, metavar="CV",
                   help="gamma inter-arrival coefficient of variation (1 = Poisson, > 1 burstier)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true",
                   help="stop at the first malformed trace line (default: skip and count)")
    p.add_argument("--slo-ttft-ms", type=positive_float, metavar="MS")
    p.add_argument("--slo-tbt-ms", type=positive_float, metavar="MS",
                   help="bound on Mooncake TBT (slowest 10%% of gaps)")
    p.add_argument("--attainment-target", type=fraction, default=0.9, metavar="F",
                   help="effective capacity = highest load with attainment >= F (default 0.9)")
    g = p.add_argument_group("synthetic workload")
    g.add_argument("--requests", type=positive_int, default=200, metavar="N")
    g.add_argument("--input-tokens", type=dist_arg, default=parse_dist("lognormal:1024:0.5"), metavar="DIST",
                   help="new user tokens per turn: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, exp:MEAN")
    g.add_argument("--output-tokens", type=dist_arg, default=parse_dist("lognormal:128:0.5"), metavar="DIST")
    g.add_argument("--turns", type=positive_int, default=1, help="turns per conversation (context grows turn by turn)")
    g.add_argument("--turn-gap", type=float, default=10.0, metavar="S", help="mean think time between turns")
    g.add_argument("--shared-prefix-blocks", type=int, default=1, metavar="N",
                   help="512-token blocks every prompt starts with (a system prompt)")


def describe(w: Workload, offset: int = 0) -> str:
    """The workload line both commands print: what is replayed, and which part of the trace."""
    part = f"requests {offset + 1}-{offset + len(w.requests)}" if offset else f"{len(w.requests)} requests"
    return f"{w.source} ({w.kind}, {part}, {w.span_s:.1f} s of trace time)"


@dataclass
class WorkloadChoice:
    base: Workload
    slo: SLO
    load_kind: str  # "speedup" | "rate"
    loads: list[float]
    regenerate: Callable[[float], Workload] | None  # a synthetic workload generated at a rate


def workload_from_args(a: argparse.Namespace, log: Callable[[str], None]) -> WorkloadChoice:
    slo = SLO(None if a.slo_ttft_ms is None else a.slo_ttft_ms / 1000,
              None if a.slo_tbt_ms is None else a.slo_tbt_ms / 1000)
    regenerate: Callable[[float], Workload] | None = None
    if a.synthetic:
        if a.offset:
            raise CLIError("--offset applies to --trace (a generated workload has no earlier requests to skip)")
        if a.shared_prefix_blocks < 0 or a.turn_gap < 0:
            raise CLIError("--shared-prefix-blocks and --turn-gap must be >= 0")
        n = min(a.requests, a.limit or a.requests)

        def synth(rate: float) -> Workload:
            return synthetic_workload(n, rate, input_tokens=a.input_tokens, output_tokens=a.output_tokens,
                                      process=a.arrival, cv=a.burstiness, turns=a.turns, turn_gap_s=a.turn_gap,
                                      shared_prefix_blocks=a.shared_prefix_blocks, block_tokens=TRACE_BLOCK_TOKENS,
                                      seed=a.seed)

        base = synth(a.rate[0] if a.rate else 1.0)
        if a.rate:  # else --speedup (or nothing) compresses the rate-1 workload
            regenerate = synth
    else:
        try:
            base = read_trace(a.trace, a.format, strict=a.strict,
                              limit=None if a.limit is None else a.offset + a.limit, warn=log)
            base = base.after(a.offset)
        except TraceError as e:
            raise CLIError(str(e)) from None
        if base.skipped:
            log(f"warning: skipped {base.skipped} malformed line(s) of {a.trace} (--strict stops at the first)")
    if a.rate:
        return WorkloadChoice(base, slo, "rate", a.rate, regenerate)
    return WorkloadChoice(base, slo, "speedup", a.speedup or [1.0], regenerate)
