"""Where a live request's TTFT goes before the gateway sees it: one gateway, one loadgen pass.

    .venv/bin/python bench/live_arrival_probe.py [--policy conductor] [--policy-param KEY=VALUE ...]
        [--workload synthetic] [--slo-ttft-ms 5000] [--out DIR]

Why: live, the client's TTFT clock starts when loadgen sends; the gateway's (and the wait room's
remaining SLO) when its handler starts. Between the two the connection waits in the kernel's accept
queue, which a gateway short of CPU drains late, and nothing in the scheduler can see it. This runs
one ``conductor serve`` (the live baselines' config, telemetry on) under one pass of the workload of
``bench/experiments/live_baselines.py`` and prints, per request matched by id, that delay (gateway
arrival minus client send; both clocks are CLOCK_MONOTONIC, the offset is the smallest difference,
so the fastest request counts as 0), the TTFT seen at each end, the wait room's work (pumps, their
wall time, evaluations per waiting request) and the gateway's CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "experiments"))
sys.path.insert(0, str(ROOT))

import _common as C  # noqa: E402
import live_baselines as L  # noqa: E402

from predictors.cli_args import key_value  # noqa: E402
from tests.servers import stop  # noqa: E402


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decisions(url: str) -> list[dict[str, Any]]:
    """Every decision record the gateway kept, oldest first."""
    out: list[dict[str, Any]] = []
    before = None
    while True:
        q = f"{url}/admin/decisions?limit=1000" + (f"&before={before}" if before is not None else "")
        with urllib.request.urlopen(q, timeout=30) as r:
            body = json.load(r)
        out = body["decisions"] + out
        before = body["next_before"]
        if before is None:
            return out


def report(out: Path, slo_s: float) -> dict[str, Any]:
    """The figures this probe prints, from its output directory."""
    client = {r["request_id"]: r for r in map(json.loads, open(out / "loadgen" / "requests.jsonl"))}
    gw = {r["request_id"]: r for r in map(json.loads, open(out / "telemetry.jsonl"))}
    both = [k for k in gw if k in client and client[k]["sent_s"] is not None]
    offset = min(gw[k]["arrival_s"] - client[k]["sent_s"] for k in both)
    delay = {k: gw[k]["arrival_s"] - offset - client[k]["sent_s"] for k in both}
    ok = [k for k, r in client.items() if r["status"] == "ok"]
    summary = json.loads((out / "loadgen" / "summary.json").read_text())
    step = summary["targets"][0]["steps"][0] if "targets" in summary else summary["steps"][0]
    waited = [d["deferred"]["evaluations"] for d in json.loads((out / "decisions.json").read_text())
              if d.get("deferred")]
    return {"requests": len(client), "attainment": step["slo_attainment"],
            "ok": len(ok), "refused": sum(r["status"] == "rejected" for r in client.values()),
            "failed": sum(r["status"] in ("error", "timeout") for r in client.values()),
            "ok_ttft_met_at_client": sum(client[k]["ttft_s"] <= slo_s for k in ok),
            "ok_ttft_late_at_gateway": sum(k in gw and gw[k]["ttft_s"] is not None and gw[k]["ttft_s"] > slo_s
                                           for k in ok),
            "arrival_delay_over_1s": sum(v > 1 for v in delay.values()),
            "arrival_delay_over_slo": sum(v > slo_s for v in delay.values()),
            "arrival_delay_max_s": round(max(delay.values()), 2),
            "ok_late_at_client_with_delay_over_1s": sum(client[k]["ttft_s"] > slo_s and delay.get(k, 0) > 1
                                                        for k in ok),
            "waited": len(waited), "evaluations_while_waiting": sum(waited)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="conductor")
    p.add_argument("--policy-param", action="append", type=key_value, default=[], metavar="KEY=VALUE")
    p.add_argument("--workload", choices=sorted(L.WORKLOADS), default="synthetic")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--out", type=Path, default=C.OUT / "live-arrival-probe")
    a = p.parse_args(argv)
    w = L.WORKLOADS[a.workload]
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("telemetry.jsonl", "decisions.json"):
        (out / stale).unlink(missing_ok=True)
    extra = f'health_timeout_s = 5\ntelemetry_path = "{out / "telemetry.jsonl"}"\nkeep_decisions = 5000\n'
    proc, url = C.start_gateway(out, "gateway", policy=a.policy, store=False, admission=True, extra=extra,
                                prefill=4, decode=2, ttft_ms=a.slo_ttft_ms, tbt_ms=a.slo_tbt_ms,
                                policy_params=dict(a.policy_param) or None)
    try:
        la = L.parser().parse_args(["--workload", a.workload, "--repeat", "1", "--slo-tbt-ms", f"{a.slo_tbt_ms:g}"])
        cmd = L.loadgen_command([url], w, a.slo_ttft_ms, la, out / "loadgen")
        cpu0, t0 = cpu_s(proc.pid), time.monotonic()
        subprocess.run(cmd, cwd=ROOT, check=True)
        wall, cpu = time.monotonic() - t0, cpu_s(proc.pid) - cpu0
        (out / "decisions.json").write_text(json.dumps(decisions(url)))
        with urllib.request.urlopen(url + "/admin/cluster", timeout=30) as r:
            room = json.load(r).get("wait_room") or {}
    finally:
        stop(proc)
    res = {"policy": a.policy, "params": dict(a.policy_param), "slo_ttft_s": a.slo_ttft_ms / 1e3,
           "loadgen_wall_s": round(wall, 1), "gateway_cpu_s": round(cpu, 1),
           "load_average": os.getloadavg()[0], **report(out, a.slo_ttft_ms / 1e3),
           "pumps": room.get("pumps"), "pump_s": room.get("pump_s")}
    (out / "probe.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
