"""Decision digests: what every decision on bench/decision_latency.py's world (100k blocks)
answers, to compare two versions of the scheduler that must decide alike (a speed-up).

One line per decision (and per ``evaluate``): policy, predictors and settings, request id,
prefill, decode, predicted TTFT and TBT, the refusal reason, and a digest of the whole
explanation record (JSON, sorted keys); then a digest of the decision log. Settings: conductor
with analytic, learned and constant predictors; every other policy; tight SLOs with early and
late rejection, and cost admission. Between decisions the stream finishes prefills, releases
requests and reports observed engine load, as bench/decision_latency.py's run does.

Run: ``.venv/bin/python bench/decision_digests.py OUT [N]`` at each version, then ``cmp`` the files.
"""
import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_latency as dl  # noqa: E402

from predictors.telemetry import SLO  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from scheduler.overload import CostWindow, OverloadParams  # noqa: E402

LEARNED = str(Path(__file__).resolve().parents[1] / "docs/runs/learned-8b-gap-conversation")
TIGHT = [("conductor", None, {"slo": (0.15, 0.0077), "early": True}),
         ("conductor", LEARNED, {"slo": (0.1, 0.011), "cost": True}),
         ("conductor_alg1", None, {"slo": (0.12, 0.0076), "late": True}),
         ("dynamo_cost", None, {"slo": (0.1, 0.0077)})]


def digest(rec: object) -> str:
    return hashlib.sha1(json.dumps(rec, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def line(*fields: object) -> str:
    return json.dumps(fields) + "\n"


def decide_all(out, policy: str, models: str | None, opts: dict, n: int) -> None:
    sched, world = dl.build(policy, 1, True, models)
    if "slo" in opts:
        sched.slo = SLO(*opts["slo"])
    sched.early_rejection = bool(opts.get("early"))
    sched.late_rejection = bool(opts.get("late"))
    if opts.get("cost"):
        sched.overload = CostWindow(OverloadParams(enabled=True))
    label = f"{None if models is None else Path(models).name} {sorted(opts.items())}"
    rng = random.Random(7)
    clock, live = world["clock"], []
    for k, f in enumerate(dl.requests(world, n)):
        clock[0] += 0.01 if k % 7 else 0.3
        if k % 11 == 0:  # what evaluate says, too
            e = sched.evaluate(f)
            out.write(line("eval", policy, label, f.request_id, getattr(e, "prefill", None),
                           getattr(e, "reason", None), getattr(e, "ttft_s", None), digest(e.explanation)))
        d = sched.decide(f)
        out.write(line(policy, label, f.request_id, getattr(d, "prefill", None), getattr(d, "decode", None),
                       getattr(d, "ttft_s", None), getattr(d, "tbt_s", None), getattr(d, "reason", None),
                       digest(d.explanation)))
        dl.advance(sched, rng, live, f.request_id if hasattr(d, "prefill") else None, 256)
        if k % 97 == 0:
            sched.observe_load(f"d{rng.randrange(64):02d}", running=rng.randrange(40), waiting=rng.randrange(5),
                               kv_usage=rng.random())
        if k % 89 == 0:
            sched.observe_load(f"p{rng.randrange(64):02d}", running=rng.randrange(4), waiting=rng.randrange(5),
                               kv_usage=rng.random())
    out.write(line("log", policy, label, digest(list(sched.decisions))))  # as /admin/decisions serves it
    print(policy, label, "done", file=sys.stderr)


def main() -> int:
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    runs = [("conductor", None, {}), ("conductor", LEARNED, {}), ("conductor", "constant", {})]
    runs += [(p, None, {}) for p in Scheduler.policy_names() if p != "conductor"] + TIGHT
    with open(sys.argv[1], "w") as out:
        for policy, models, opts in runs:
            decide_all(out, policy, models, opts, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
