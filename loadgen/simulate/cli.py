"""``conductor simulate``: replay a trace (or a synthetic workload) through the live scheduler and
the sim engine's model in virtual time; write what ``conductor loadgen`` writes, plus
capacity.png and, with several policies, a side-by-side comparison."""
from __future__ import annotations

import argparse
import os
import sys

from engines_adapters.sim.profiles import profile_names
from engines_adapters.store.model import StoreSpec
from predictors.cli_args import (
    CLIError,
    Parser,
    key_value,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from predictors.learned import ModelError, load_models
from predictors.registry import predictor_names
from scheduler.deferral import split_params as split_defer
from scheduler.ledger import split_params as split_ledger
from scheduler.overload import split_params as split_overload
from scheduler.policies import POLICIES, make_policy

from ..workload_args import add_workload_args, describe, workload_from_args
from .cluster import ClusterSpec, SchedulerSpec
from .report import format_table, write_outputs
from .sweep import SimConfig, run_sweep


def build_parser() -> Parser:
    p = Parser(prog="conductor simulate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    add_workload_args(p)
    c = p.add_argument_group("simulated cluster")
    c.add_argument("--prefill", type=non_negative_int, default=0, metavar="N", help="prefill instances")
    c.add_argument("--decode", type=non_negative_int, default=0, metavar="M", help="decode instances")
    c.add_argument("--both", type=non_negative_int, default=0, metavar="K", help="colocated (prefill+decode) instances")
    c.add_argument("--profile", default="llama3-8b-h200", help=f"engine profile: {', '.join(profile_names())}")
    c.add_argument("--block-size", type=positive_int, default=16)
    c.add_argument("--noise", type=non_negative_float, default=0.02, help="sigma of the engines' step-time noise")
    c.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    c.add_argument("--max-num-seqs", type=positive_int, default=256)
    c.add_argument("--host-tier-tokens", type=non_negative_int, default=0, help="host-memory KV tier per engine")
    c.add_argument("--kv-event-lag-ms", type=non_negative_float, default=2.0,
                   help="delay from a step's end to its KV events reaching the hit index (default 2, as measured live)")
    c.add_argument("--poll-interval", type=positive_float, default=1.0, metavar="S",
                   help="engine load reports to the scheduler, as the gateway's health poll (default 1 s)")
    st = p.add_argument_group("shared KV store (Mooncake-style; docs/store.md)")
    st.add_argument("--store", action="store_true",
                    help="engines write prompts through to a shared store and load from it what they lack")
    st.add_argument("--store-nodes", type=positive_int, metavar="N",
                    help="store nodes (default: one per instance, each lending host DRAM)")
    st.add_argument("--store-gb", type=positive_float, default=64.0, help="DRAM per store node, GB (default 64)")
    st.add_argument("--store-ssd-gb", type=non_negative_float, default=0.0, help="SSD per store node, GB (0: none)")
    st.add_argument("--store-replicas", type=positive_int, default=1)
    st.add_argument("--store-protocol", choices=("rdma", "tcp"), default="rdma",
                    help="Transfer Engine bandwidth figures to model (default rdma)")
    st.add_argument("--store-blocks-per-object", type=positive_int, default=1,
                    help="KV blocks per store object (1: one per block, as vLLM's store connector)")
    st.add_argument("--store-write-back", action="store_true",
                    help="write blocks to the store when a device evicts them (HiCache's write_back), "
                         "not after every prefill")
    c.add_argument("--peer-pull", action="store_true",
                   help="prefill instances can fetch a prefix from another prefill instance (Mooncake's transfer "
                        "engine; no vLLM or SGLang PD protocol can): conductor plans such pulls, the engines run "
                        "them (not with --store)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--policy", default="conductor", help=f"policy: {', '.join(POLICIES)}")
    s.add_argument("--policy-param", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --policy (repeatable), e.g. defer=off (conductor without its wait room)")
    s.add_argument("--compare", metavar="POLICY[,POLICY...]",
                   help="also run these policies on the same cluster and workload, side by side")
    s.add_argument("--predictors", default="analytic", metavar="analytic|oracle|DIR",
                   help="analytic (public facts), oracle (the engine model's own timing: the upper bound), or a "
                        "directory written by conductor calibrate (learned, with online correction)")
    s.add_argument("--early-rejection", action="store_true", help="admit on decode load predicted at prefill end")
    s.add_argument("--admission", choices=("all", "conductor", "none"), default="all",
                   help="which policies refuse requests predicted to miss the SLO (429): all (default: placement "
                        "alone differs), conductor (the peers as their routers ship, without SLO admission), none")
    s.add_argument("--late-rejection", action="store_true",
                   help="no early rejection (the paper's baseline): the decode side checks the TBT SLO after "
                        "the prefill, on the load it has then; a refusal wastes the prefill")
    o = p.add_argument_group("outputs")
    o.add_argument("--reuse-bound", action="store_true",
                   help="also report the trace's prefix-reuse bound for the cluster's cache capacity (one global "
                        "LRU of the prefill instances' KV), and per policy the same LRU fed only the requests it "
                        "completed; a second or two per thousand requests, for the trace and for each run")
    o.add_argument("--telemetry", metavar="PATH", help="also write every request's record (with token times) here")
    o.add_argument("--keep-token-times", action="store_true", help="write every token time to requests.jsonl")
    o.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="parallel processes for the (policy, load) runs (default: 2)")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _policies(a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    names = [a.policy] + [x.strip() for x in (a.compare or "").split(",") if x.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise CLIError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    names = list(dict.fromkeys(names))
    params = dict(a.policy_param)
    try:  # the scheduler's own parameters (any policy takes them) first, as Scheduler() splits them
        _, rest = split_defer(params)
        _, rest = split_overload(rest, False)
        _, rest = split_ledger(rest)
        make_policy(a.policy, **rest)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return names, params


def _store_spec(a: argparse.Namespace) -> StoreSpec | None:
    if not a.store:
        return None
    kw = dict(nodes=a.store_nodes or (a.prefill + a.decode + a.both), dram_bytes=int(a.store_gb * 1e9),
              ssd_bytes=int(a.store_ssd_gb * 1e9), replicas=a.store_replicas)
    try:
        return StoreSpec.tcp(**kw) if a.store_protocol == "tcp" else StoreSpec(**kw)
    except ValueError as e:
        raise CLIError(f"--store: {e}") from None


def _check_out(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"{out} is not writable")
    except OSError as e:
        raise CLIError(f"cannot write to --out {out}: {e.strerror or e}") from None


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if a.prefill + a.decode + a.both == 0:
        raise CLIError("the cluster is empty: give --prefill N --decode M (P/D) and/or --both K")
    if (a.prefill == 0) != (a.decode == 0):
        raise CLIError(f"--prefill {a.prefill} --decode {a.decode}: disaggregated prefill needs decode instances "
                       "(and the reverse); use --both for colocated instances")
    if a.profile not in profile_names():
        raise CLIError(f"unknown profile {a.profile!r}; known: {', '.join(profile_names())}")
    if os.path.isdir(a.predictors):
        try:
            load_models(a.predictors)
        except ModelError as e:
            raise CLIError(f"--predictors {e}") from None
    elif a.predictors not in ("analytic", "oracle") and a.predictors not in predictor_names():
        raise CLIError(f"unknown predictors {a.predictors!r}; known: analytic, oracle, or a directory written by "
                       "conductor calibrate")
    elif a.predictors == "learned":
        raise CLIError("--predictors learned: give the model directory (conductor calibrate --out DIR)")
    if a.early_rejection and a.late_rejection:
        raise CLIError("--early-rejection and --late-rejection exclude each other")
    if a.peer_pull and a.store:
        raise CLIError("--peer-pull with --store is not modelled: use one or the other")
    policies, params = _policies(a)
    _check_out(a.out)
    store = _store_spec(a)
    w = workload_from_args(a, log)
    cluster = ClusterSpec(prefill=a.prefill, decode=a.decode, both=a.both, profile=a.profile, block_size=a.block_size,
                          noise=a.noise, seed=a.seed, kv_event_lag_s=a.kv_event_lag_ms / 1000,
                          poll_interval_s=a.poll_interval,
                          engine={"max_num_batched_tokens": a.max_num_batched_tokens, "max_num_seqs": a.max_num_seqs,
                                  "host_tier_tokens": a.host_tier_tokens},
                          store=store, store_blocks_per_object=a.store_blocks_per_object,
                          store_policy="write_back" if a.store_write_back else "write_through",
                          peer_pull=a.peer_pull)
    sched = SchedulerSpec(policy=policies[0], policy_params=params, slo=w.slo, early_rejection=a.early_rejection,
                          late_rejection=a.late_rejection,
                          seed=a.seed)
    cfg = SimConfig(base=w.base, cluster=cluster, scheduler=sched, policies=policies, slo=w.slo,
                    load_kind=w.load_kind, loads=w.loads, attainment_target=a.attainment_target, arrival=a.arrival,
                    cv=a.burstiness, seed=a.seed, predictors=a.predictors, admission=a.admission,
                    reuse_bound=a.reuse_bound, workers=a.workers, progress=not a.quiet, regenerate=w.regenerate)
    log(f"workload: {describe(w.base, a.offset)}; "
        f"cluster {a.prefill}P+{a.decode}D{f'+{a.both}B' if a.both else ''} {a.profile}; "
        f"{len(policies)} polic{'y' if len(policies) == 1 else 'ies'} x {len(w.loads)} load(s)")
    outcome = run_sweep(cfg)
    paths = write_outputs(a.out, outcome, keep_token_times=a.keep_token_times, telemetry=a.telemetry)
    print(format_table(outcome))
    print("wrote " + ", ".join(paths.values()))
    return 0
