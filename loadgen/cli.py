"""``conductor loadgen``: replay a trace (or a synthetic workload) against OpenAI-compatible
targets, open loop, and write summary.json, requests.jsonl, goodput.png and latency.png."""
from __future__ import annotations

import argparse
import os
import sys

from predictors.cli_args import CLIError, Parser, positive_float, positive_int

from .prompts import ENDPOINTS, PROMPT_FORMATS
from .report import format_table, write_outputs
from .sweep import LoadgenConfig, TargetError, run
from .synthetic import to_mooncake_jsonl
from .workload_args import add_workload_args, describe, workload_from_args


def target_url(text: str) -> str:
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def build_parser() -> Parser:
    p = Parser(prog="conductor loadgen", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--target", type=target_url, action="append", required=True, metavar="URL",
                   help="base URL of an OpenAI-compatible server; give it twice to compare two targets")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    add_workload_args(p)
    p.add_argument("--max-concurrency", type=positive_int, metavar="N",
                   help="cap requests in flight (arrivals then wait; the wait is recorded apart)")
    p.add_argument("--model", help="model name (default: the first of the target's GET /v1/models)")
    p.add_argument("--api-key", metavar="KEY", help="sent as 'authorization: Bearer KEY' (servers started with one)")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="chat", help="chat = /v1/chat/completions (default)")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                   help="token-ids sends token-id prompts (completions only): exact lengths under any tokenizer")
    p.add_argument("--timeout", type=positive_float, default=300.0, metavar="S",
                   help="per-request timeout (default 300 s)")
    p.add_argument("--probe-timeout", type=positive_float, default=3.0, metavar="S")
    p.add_argument("--max-lag-ms", type=positive_float, default=10.0,
                   help="flag the run when the client's send or event-loop lag p99 exceeds this (default 10)")
    p.add_argument("--step-pause", type=float, default=1.0, metavar="S", help="idle time between sweep steps")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                   help="run every load N times, alternating which target goes first (position alone can move a "
                        "comparison by many points on a shared machine); the summary reports the spread")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="same prompt text in every step "
                        "(default: a fresh salt per step and target, so caches start cold)")
    p.add_argument("--prompt-salt", metavar="TEXT",
                   help="base of the prompt salts (default: random per run; pin it to replay the very same text)")
    p.add_argument("--keep-token-times", action="store_true", help="write every chunk time to requests.jsonl")
    p.add_argument("--save-workload", metavar="PATH", help="also write the base workload as a Mooncake JSONL trace")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _config(a: argparse.Namespace, log) -> LoadgenConfig:
    if a.endpoint == "chat" and a.prompt_format == "token-ids":
        raise CLIError("--prompt-format token-ids needs --endpoint completions")
    if len(set(a.target)) != len(a.target):
        raise CLIError("the same --target was given twice")
    w = workload_from_args(a, log)
    base, slo, kind, regenerate = w.base, w.slo, w.load_kind, w.regenerate
    loads = [x for x in w.loads for _ in range(a.repeat)]
    if a.save_workload:
        try:
            to_mooncake_jsonl(base, a.save_workload)
        except OSError as e:
            raise CLIError(f"cannot write {a.save_workload}: {e.strerror or e}") from None
    return LoadgenConfig(
        targets=a.target, base=base, slo=slo, load_kind=kind, loads=loads, attainment_target=a.attainment_target,
        model=a.model, endpoint=a.endpoint, prompt_format=a.prompt_format, arrival=a.arrival, cv=a.burstiness,
        seed=a.seed, timeout_s=a.timeout, max_concurrency=a.max_concurrency, max_lag_ms=a.max_lag_ms,
        reuse_prompts=a.reuse_prompts, prompt_salt=a.prompt_salt, step_pause_s=max(0.0, a.step_pause),
        probe_timeout_s=a.probe_timeout,
        progress=not a.quiet, api_key=a.api_key, regenerate=regenerate)


def _raise_fd_limit() -> None:
    """An open-loop run keeps one connection per request in flight; the default soft limit of
    1024 descriptors would make the client fail and blame the target."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):
        pass  # not raisable here: runs beyond ~1000 in flight may then report client errors


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    _raise_fd_limit()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:  # fail before the run, not after minutes of load
        os.makedirs(a.out, exist_ok=True)
        if not os.access(a.out, os.W_OK):
            raise PermissionError(f"{a.out} is not writable")
    except OSError as e:
        raise CLIError(f"cannot write to --out {a.out}: {e.strerror or e}") from None
    cfg = _config(a, log)
    log(f"workload: {describe(cfg.base, a.offset)}")
    try:
        outcome = run(cfg, log)
    except TargetError as e:
        raise CLIError(str(e)) from None
    paths = write_outputs(a.out, outcome, keep_token_times=a.keep_token_times)
    print(format_table(outcome.summary))
    print("wrote " + ", ".join(paths.values()))
    if outcome.interrupted:
        sys.stderr.write("conductor loadgen: interrupted: partial results written\n")
        return 130
    if outcome.aborted:
        sys.stderr.write(f"conductor loadgen: error: run aborted: {outcome.aborted}\n")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except CLIError as e:
        sys.stderr.write(f"conductor loadgen: error: {e}\n")
        sys.exit(2)
