"""How wrong are the analytic predictors about the simulated engine? Before and after they
stopped sharing the engine's constants.

    .venv/bin/python bench/prediction_error.py [--points] [--skip-e2e]
        [--trace data/traces/mooncake_conversation_trace.jsonl] [--limit 150] [--speedup 2]

"old" is the roofline fed the sim engine's own calibration (its mfu, attn_mfu, mbu, step
overhead, transfer latency and KV capacity: what ``predictors/analytic.py`` read until the split,
reproduced exactly as a Prior built from the sim profile); "new" is the same roofline with the
public :class:`~predictors.analytic.Prior` and the deployment's public capacity estimate, which
is what the gateway runs with now.

(a) direct: for a grid of prompt lengths x cached prefixes, and decode batches x contexts, the
    predicted prefill time and decode step time against the sim engine's EngineModel (noise
    off, one request or one batch on an idle engine): MAPE and the signed per-point error range.
(b) end to end: ``conductor serve`` (embedded 2P+2D sim engines, telemetry on) driven by
    ``conductor loadgen --trace ... --limit N --speedup X``, once per prior; the absolute
    percentage error of each completed request's predicted TTFT (``predicted_ttft_s``) against
    its measured TTFT (``ttft_s``) in the gateway's telemetry, p50 and p90.
Loopback only; no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines_adapters.sim.model import EngineModel  # noqa: E402
from engines_adapters.sim.profiles import Profile, load_profile, profile_names  # noqa: E402
from engines_adapters.sim.records import SimRequest  # noqa: E402
from predictors.analytic import Prior, Roofline, roofline_decode_step_s, roofline_prefill_s  # noqa: E402

PROMPTS = (256, 1024, 4096, 8192, 16384, 32768)
CACHED = (0.0, 0.5, 0.9)
BATCHES = (1, 8, 32, 128)
CONTEXTS = (1024, 4096)
TRACES = (ROOT / "data/traces/mooncake_conversation_trace.jsonl",)


def sim_prior(p: Profile) -> Prior:
    """The old predictor's constants: the sim engine's own calibration, as a Prior."""
    eff = p.efficiency
    return Prior(prefill_mfu=eff["mfu"], attn_mfu=eff.get("attn_mfu", eff["mfu"]), decode_mbu=eff["mbu"],
                 step_overhead_ms=eff["step_overhead_ms"], transfer_latency_ms=eff["transfer_latency_ms"])


def rooflines(p: Profile) -> dict[str, Roofline]:
    d = p.deployment
    return {"old": Roofline.from_deployment(d, sim_prior(p), p.kv_capacity_tokens),
            "new": Roofline.from_deployment(d, Prior())}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 120_000) for _ in range(n)]


def _run(e: EngineModel, req: SimRequest, now: float) -> tuple[float, int, float]:
    """Run one request to its end on an idle engine: (TTFT, cached tokens, end time)."""
    e.add_request(req, now)
    while e.has_work():
        r = e.step(now)
        now = r.end
        for f in r.finished:
            if f.request_id == req.request_id:
                return f.first_token - f.arrival, f.cached_tokens, now
    raise RuntimeError("request did not finish")


def actual_prefill(p: Profile, prompt: int, cached_frac: float, seed: int) -> tuple[float, int]:
    """The engine's TTFT (= prefill on an idle engine) for ``prompt`` tokens, of which a prefix
    of ``cached_frac`` was computed by an earlier request; (seconds, cached tokens it reports)."""
    rng = random.Random(seed)
    e = EngineModel(p, "both", noise=0.0, seed=seed)
    tokens = _tokens(rng, prompt)
    now = 0.0
    prefix = int(prompt * cached_frac)
    if prefix:
        _, _, now = _run(e, SimRequest("warm", tokens[:prefix], 1, output_len=1), now)
    ttft, cached, _ = _run(e, SimRequest("r", tokens, 1, output_len=1), now + 1.0)
    return ttft, cached


def actual_decode_step(p: Profile, batch: int, ctx: int, seed: int) -> tuple[float, int]:
    """Mean decode step of ``batch`` sequences of ``ctx``-token prompts; (seconds, KV tokens)."""
    rng = random.Random(seed)
    e = EngineModel(p, "both", noise=0.0, seed=seed, max_num_seqs=max(256, batch))
    for i in range(batch):
        e.add_request(SimRequest(f"r{i}", _tokens(rng, ctx), 10_000, output_len=10_000), 0.0)
    now = 0.0
    for _ in range(100_000):
        r = e.step(now)
        now = r.end
        if r.decode_seqs == batch and not r.prefill_tokens:
            break
    steps = 16
    kv0 = e.stats().kv_usage  # used only as a sanity check below
    durations = []
    for _ in range(steps):
        r = e.step(now)
        now = r.end
        durations.append(r.duration)
    # every sequence holds its prompt plus what it generated so far (one token per step)
    generated = len(durations) // 2 + 1
    kv = batch * (ctx + generated)
    assert kv0 > 0
    return statistics.mean(durations), kv


def direct(points: bool) -> dict[str, dict[str, list[float]]]:
    """Signed relative errors (predicted / actual - 1) per (deployment, quantity, predictor)."""
    errors: dict[str, dict[str, list[float]]] = {}
    for name in profile_names():
        p = load_profile(name)
        rl = rooflines(p)
        if points:
            print(f"\n[{name}]  prefill: prompt, cached -> engine ms | old ms | new ms")
        for prompt in PROMPTS:
            for frac in CACHED:
                actual, cached = actual_prefill(p, prompt, frac, seed=prompt + int(frac * 10))
                pred = {k: roofline_prefill_s(r, prompt, cached) for k, r in rl.items()}
                for k, v in pred.items():
                    errors.setdefault(f"{name}|prefill", {}).setdefault(k, []).append(v / actual - 1)
                if points:
                    print(f"  {prompt:>6} {cached:>6} -> {actual * 1e3:9.1f} | {pred['old'] * 1e3:9.1f} "
                          f"({pred['old'] / actual - 1:+6.1%}) | {pred['new'] * 1e3:9.1f} "
                          f"({pred['new'] / actual - 1:+6.1%})")
        if points:
            print(f"[{name}]  decode step: batch, context -> engine ms | old ms | new ms")
        for batch in BATCHES:
            for ctx in CONTEXTS:
                actual, kv = actual_decode_step(p, batch, ctx, seed=batch * 7 + ctx)
                pred = {k: roofline_decode_step_s(r, batch, kv) for k, r in rl.items()}
                for k, v in pred.items():
                    errors.setdefault(f"{name}|decode step", {}).setdefault(k, []).append(v / actual - 1)
                if points:
                    print(f"  {batch:>6} {ctx:>6} -> {actual * 1e3:9.2f} | {pred['old'] * 1e3:9.2f} "
                          f"({pred['old'] / actual - 1:+6.1%}) | {pred['new'] * 1e3:9.2f} "
                          f"({pred['new'] / actual - 1:+6.1%})")
    return errors


def _summary(errs: list[float]) -> str:
    mape = statistics.mean(abs(x) for x in errs)
    return f"{mape:6.1%}  {min(errs):+6.1%}..{max(errs):+6.1%}"


def print_direct(errors: dict[str, dict[str, list[float]]]) -> None:
    print("\n== (a) direct: predicted vs the sim engine's EngineModel (noise off), signed error = pred/actual - 1 ==")
    print(f"{'deployment':<19} {'quantity':<12} {'n':>3}   {'old (sim-profile-fed)':<24} {'new (public prior)':<24}")
    print(f"{'':<19} {'':<12} {'':>3}   {'MAPE    range':<24} {'MAPE    range':<24}")
    for key, by in errors.items():
        name, qty = key.split("|")
        print(f"{name:<19} {qty:<12} {len(by['old']):>3}   {_summary(by['old']):<24} {_summary(by['new']):<24}")


# --- (b) end to end ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"conductor serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("conductor serve not ready")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def end_to_end(label: str, prior: Prior, trace: Path, limit: int, speedup: float, profile: str) -> dict[str, float]:
    """One serve + loadgen run with ``prior``; TTFT absolute percentage errors from telemetry."""
    with tempfile.TemporaryDirectory(prefix=f"conductor-prederr-{label}-") as tmp:
        telemetry = Path(tmp) / "telemetry.jsonl"
        fields = "\n".join(f"{k} = {v!r}" for k, v in asdict(prior).items())
        cfg = Path(tmp) / "conductor.toml"
        cfg.write_text(f'telemetry_path = "{telemetry}"\n[embedded]\nprefill = 2\ndecode = 2\nprofile = "{profile}"\n'
                       f"[prior]\n{fields}\n")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        serve = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port",
                                  str(port), "--log-level", "warning"], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(url, serve)
            run = subprocess.run([sys.executable, "-m", "gateway.cli", "loadgen", "--target", url, "--trace",
                                  str(trace), "--limit", str(limit), "--speedup", f"{speedup:g}", "--slo-ttft-ms",
                                  "30000", "--slo-tbt-ms", "200", "--out", str(Path(tmp) / "out"), "--quiet"],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"loadgen failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        recs = [json.loads(line) for line in telemetry.read_text().splitlines() if line.strip()]
    ape = [abs(r["predicted_ttft_s"] - r["ttft_s"]) / r["ttft_s"] for r in recs
           if r.get("status") == "ok" and r.get("ttft_s") and r.get("predicted_ttft_s") is not None]
    signed = [r["predicted_ttft_s"] / r["ttft_s"] - 1 for r in recs
              if r.get("status") == "ok" and r.get("ttft_s") and r.get("predicted_ttft_s") is not None]
    return {"n": len(ape), "requests": len(recs), "p50": _percentile(ape, 0.5), "p90": _percentile(ape, 0.9),
            "median_signed": statistics.median(signed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", action="store_true", help="print every grid point of (a)")
    ap.add_argument("--skip-e2e", action="store_true", help="only (a)")
    ap.add_argument("--trace", type=Path, help="Mooncake trace (default: the one in data/traces/)")
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--profile", default="llama3-8b-h200", help="the embedded sim engines' profile for (b)")
    args = ap.parse_args()

    print_direct(direct(args.points))
    if args.skip_e2e:
        return 0
    trace = args.trace or next((t for t in TRACES if t.exists()), None)
    if trace is None or not trace.exists():
        print(f"\n(b) skipped: no trace (give --trace; looked in {', '.join(map(str, TRACES))})")
        return 1
    print(f"\n== (b) end to end: conductor serve (embedded 2P+2D, {args.profile}) + loadgen {trace.name} "
          f"--limit {args.limit} --speedup {args.speedup:g} ==")
    print("predictor               completed  TTFT abs. error p50    p90   median signed (pred/actual - 1)")
    priors = (("old (sim-profile-fed)", sim_prior(load_profile(args.profile))), ("new (public prior)", Prior()))
    for label, prior in priors:
        r = end_to_end(label.split()[0], prior, trace, args.limit, args.speedup, args.profile)
        print(f"{label:<23} {r['n']:>4}/{r['requests']:<4}          {r['p50']:6.1%} {r['p90']:6.1%}   "
              f"{r['median_signed']:+6.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
