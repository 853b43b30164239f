"""bench/experiments/live_baselines.py's workload choice builds the loadgen command each page says
it runs: the conversation default as its committed page states, the synthetic workload as the
simulated experiments generate it, the Azure trace as an Azure replay. No server is started."""
from __future__ import annotations

import importlib.util
import os
import sys
import tomllib

import pytest

from gateway.config import GatewayConfig, parse_config
from loadgen.cli import build_parser
from loadgen.synthetic import parse_dist, synthetic_workload
from loadgen.workload import read_trace
from loadgen.workload_args import workload_from_args
from scheduler.deferral import split_params
from scheduler.deferral_params import DeferParams
from scheduler.policies.conductor import WAIT_ROOM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # live_baselines imports _common by name


def _load():
    spec = importlib.util.spec_from_file_location("live_baselines", os.path.join(ROOT, "bench", "experiments",
                                                                                 "live_baselines.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["live_baselines"] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


L = _load()


def _args(*argv: str):
    return L.parser().parse_args(list(argv))


def _workload_of(*argv: str):
    """The workload loadgen would build from the command live_baselines runs for ``argv``."""
    a = _args(*argv)
    cmd = L.loadgen_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], L.WORKLOADS[a.workload], 30000.0, a,
                            L.C.OUT / "unused")
    assert cmd[2:4] == ["gateway.cli", "loadgen"]
    la = build_parser().parse_args(cmd[4:])
    assert la.target == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and la.repeat == a.repeat
    return la, workload_from_args(la, lambda msg: None)


def test_conversation_default_is_what_its_page_says():
    """The page's committed run is the default workload at the time scale its results.json records."""
    import json

    page = open(os.path.join(ROOT, "docs", "experiments", "live-baselines.md")).read()
    with open(os.path.join(ROOT, "docs", "experiments", "live-baselines", "results.json")) as f:
        recorded = json.load(f)["args"]
    a = _args("--time-scale", str(recorded.get("time_scale", 1.0)))
    flags = " ".join(L.workload_flags(L.WORKLOADS["conversation"], a))
    assert f"`conductor loadgen {flags} --repeat 2`" in page
    la, w = _workload_of()
    assert la.trace.endswith("mooncake_conversation_trace.jsonl") and len(w.base.requests) == 400
    assert (w.load_kind, w.loads) == ("speedup", [16.0])
    assert L.WORKLOADS["conversation"].page == "live-baselines"


def test_synthetic_is_the_simulated_experiments_workload():
    la, w = _workload_of("--workload", "synthetic", "--limit", "120", "--rate", "25")
    assert la.synthetic and (w.load_kind, w.loads) == ("rate", [25.0])
    s = L.LIVE_SYNTHETIC
    assert {k: v for k, v in s.items() if k != "turn_gap_s"} == {k: v for k, v in L.C.SYNTHETIC.items()
                                                                if k != "turn_gap_s"}
    want = synthetic_workload(120, 25.0, input_tokens=parse_dist(s["input_tokens"]),
                              output_tokens=parse_dist(s["output_tokens"]), process=s["process"], cv=s["cv"],
                              turns=s["turns"], turn_gap_s=s["turn_gap_s"],
                              shared_prefix_blocks=s["shared_prefix_blocks"], seed=0)
    assert w.regenerate is not None
    got = w.regenerate(25.0).requests
    key = [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in want.requests]
    assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in got] == key
    assert len({r.hash_ids[0] for r in got}) == 1  # the shared system prompt: reuse is there


def test_azure_code_replays_its_trace_and_loads_override():
    la, w = _workload_of("--workload", "azure_code", "--limit", "50", "--speedup", "3")
    assert la.trace.endswith("azure_code_2023.csv") and w.base.kind == "azure" and len(w.base.requests) == 50
    assert (w.load_kind, w.loads) == ("speedup", [3.0])
    _, w = _workload_of("--workload", "azure_code", "--limit", "50", "--rate", "7")
    assert (w.load_kind, w.loads) == ("rate", [7.0])
    _, w = _workload_of("--workload", "azure_code", "--limit", "50")
    assert (w.load_kind, w.loads) == ("speedup", [L.WORKLOADS["azure_code"].load])


def test_each_workload_has_its_own_page_and_rivals():
    pages = {w.page for w in L.WORKLOADS.values()}
    assert len(pages) == len(L.WORKLOADS)
    assert L.WORKLOADS["azure_code"].rivals.split(",")[0] == "dynamo_cost"
    assert "sglang_cache_aware" in L.WORKLOADS["synthetic"].rivals.split(",")


def test_health_timeout_reaches_every_gateway_config():
    def config(*argv: str):
        text = L.health_config(_args(*argv)) + L.C.GATEWAY_CONFIG.format(
            policy="conductor", admission="true", store="false", prefill=4, decode=2, ttft_ms=30000, tbt_ms=200)
        return parse_config(tomllib.loads(text))
    assert config().health_timeout_s == GatewayConfig().health_timeout_s
    assert config("--health-timeout-s", "5").health_timeout_s == 5.0


def test_defer_params_reach_conductor_defer_and_the_wait_room_accepts_them():
    a = _args("--defer", "--defer-param", "defer_scan=64", "--defer-param", "defer_wait_holder=on")
    params = L.defer_params(a)
    assert params == {"defer": "on", "defer_scan": "64", "defer_wait_holder": "on"}
    room, rest = split_params(params)
    assert room.enabled and room.scan == 64 and room.wait_holder and rest == {}
    assert L.defer_params(_args("--defer")) == {"defer": "on"}


def test_defer_b_is_conductor_defer_with_its_parameters_on_top():
    a = _args("--defer", "--defer-param", "defer_scan=64", "--defer-b", "defer_reeval_s=0.5", "--defer-b",
              "defer_scan=8")
    assert L.defer_params(a) == {"defer": "on", "defer_scan": "64"}  # conductor+defer: unchanged
    b = L.defer_params(a, "defer-b")
    assert b == {"defer": "on", "defer_scan": "8", "defer_reeval_s": "0.5"}
    room, rest = split_params(b)
    assert room.enabled and room.scan == 8 and room.reeval_s == 0.5 and rest == {}


def test_time_scale_stretches_the_load_and_the_slos_in_wall_time():
    """At --time-scale T loadgen sends the same requests T times further apart (think times too),
    and judges them against SLOs T times longer: the cluster sees the same load in modelled time."""
    base, w1 = _workload_of("--workload", "synthetic", "--limit", "80", "--rate", "20")
    la, w3 = _workload_of("--workload", "synthetic", "--limit", "80", "--rate", "20", "--time-scale", "3")
    assert la.turn_gap == 3 * base.turn_gap and w3.loads == pytest.approx([20.0 / 3], rel=1e-11)
    r1, r3 = w1.regenerate(20.0).requests, w3.regenerate(w3.loads[0]).requests
    assert [(r.input_length, r.output_length, r.hash_ids) for r in r3] == [
        (r.input_length, r.output_length, r.hash_ids) for r in r1]
    assert [r.arrival_s for r in r3] == pytest.approx([3 * r.arrival_s for r in r1])
    _, w = _workload_of("--workload", "azure_code", "--limit", "50", "--time-scale", "2")
    assert w.loads == [L.WORKLOADS["azure_code"].load / 2]
    cmd = L.loadgen_command(["http://127.0.0.1:1"], L.WORKLOADS["conversation"], 5000.0,
                            _args("--time-scale", "2.5", "--slo-tbt-ms", "100"), L.C.OUT / "unused")
    la = build_parser().parse_args(cmd[4:])
    assert (la.slo_ttft_ms, la.slo_tbt_ms) == (12500.0, 250.0)
    assert la.timeout == 2.5 * build_parser().get_default("timeout")  # the per-request limit, stretched too


def test_time_scale_reaches_each_gateway_with_its_slo_and_the_wait_rooms_seconds(monkeypatch, tmp_path):
    import tests.servers

    configs: dict[str, tuple] = {}

    def serve(cfg, log, *flags, timeout_s):
        with open(cfg, "rb") as f:
            configs[os.path.basename(cfg)] = (parse_config(tomllib.load(f)), flags)
        return None, "http://127.0.0.1:1"

    monkeypatch.setattr(tests.servers, "serve", serve)
    a = _args("--defer", "--defer-param", "defer_aging=0.05", "--defer-param", "defer_reeval_s=0.5",
              "--defer-param", "defer_eval_every_s=0.004", "--time-scale", "4")
    L.start("conductor+defer", 5000.0, a, tmp_path)
    L.start("conductor", 5000.0, _args(), tmp_path)
    (cfg, flags), (real, plain) = configs["conductor+defer-5000.toml"], configs["conductor-5000.toml"]
    assert cfg.embedded.time_scale == 4.0 and real.embedded.time_scale == 1.0
    assert (cfg.slo.ttft_s, cfg.slo.tbt_s) == (20.0, 0.8) and (real.slo.ttft_s, real.slo.tbt_s) == (5.0, 0.2)
    room, rest = split_params(dict(f.split("=", 1) for f in flags if f != "--policy-param"))
    assert room.enabled and room.horizon_s == 4 * DeferParams().horizon_s and room.reeval_s == 2.0
    assert room.eval_every_s == 0.016  # the budget per second of the clock: as many per modelled second
    assert room.aging == 0.05 and rest == {}  # a ratio: the same at any time scale
    # conductor without --shipped: pinned as the pages measured it, deciding at arrival
    assert split_params(dict(f.split("=", 1) for f in plain if f != "--policy-param"), WAIT_ROOM)[0] == DeferParams()
    default = GatewayConfig()
    for key in ("upstream_first_byte_timeout_s", "upstream_stall_timeout_s", "upstream_timeout_s"):
        assert getattr(cfg, key) == 4 * getattr(default, key) and getattr(real, key) == getattr(default, key)
    for key in ("upstream_connect_timeout_s", "header_timeout_s", "keepalive_timeout_s"):  # the host's, not the model's
        assert getattr(cfg, key) == getattr(default, key)


def test_time_scale_reports_modelled_seconds():
    step = {"step": 0, "slo_attainment": 0.5, "rejected": 0, "errors": 0, "cached_tokens": {"hit_ratio": 0.5},
            "ttft_s": {"p50": 8.0}, "goodput_rps": 2.0}
    per, _ = L.target_rows(["conductor", "random"], {"targets": [{"steps": [step]}, {"steps": [step]}]}, 4.0)
    assert per[0]["ttft_p50_s"] == [2.0] and per[0]["goodput_rps"] == [8.0] and per[0]["attainment"] == [0.5]


def test_the_gap_workload_runs_its_profile_with_learned_predictors(monkeypatch, tmp_path):
    """synthetic_gap: every gateway's embedded engines on the 70B gap profile, admitting with the
    learned predictors of the workload's directory; the other workloads keep the 8B cluster and the
    analytic predictors. The load is the simulated experiments' synthetic workload, 20 s between turns."""
    import tests.servers

    configs: dict[str, object] = {}

    def serve(cfg, log, *flags, timeout_s):
        with open(cfg, "rb") as f:
            configs[os.path.basename(cfg)] = parse_config(tomllib.load(f))
        return None, "http://127.0.0.1:1"

    monkeypatch.setattr(tests.servers, "serve", serve)
    L.start("prefix_only", 5000.0, _args("--workload", "synthetic_gap", "--time-scale", "2"), tmp_path)
    L.start("conductor", 5000.0, _args("--workload", "synthetic"), tmp_path)
    gap, plain = configs["prefix_only-5000.toml"], configs["conductor-5000.toml"]
    w = L.WORKLOADS["synthetic_gap"]
    assert gap.embedded.profile == "llama3-70b-a800x8-gap" and gap.embedded.time_scale == 2.0
    assert gap.predictors == "learned" and gap.predictor_models == str(L.C.ROOT / w.models)
    assert (L.C.ROOT / w.models / "models.json").is_file()  # committed: the command runs on a fresh clone
    assert plain.embedded.profile == GatewayConfig().embedded.profile and plain.predictors == "analytic"
    la, wl = _workload_of("--workload", "synthetic_gap", "--limit", "40")
    assert la.turn_gap == L.C.SYNTHETIC["turn_gap_s"] and wl.loads == [w.load]


def test_the_conversation_gap_run_replays_requests_its_models_were_not_calibrated_on():
    """conversation_gap admits with models calibrated on the trace's first 1000 requests, so the run
    starts at the 1001st, retimed to 0; the models are committed."""
    w = L.WORKLOADS["conversation_gap"]
    assert w.profile == "llama3-70b-a800x8-gap" and (L.C.ROOT / w.models / "models.json").is_file()
    la, wl = _workload_of("--workload", "conversation_gap", "--limit", "30")
    whole = read_trace(str(L.C.ROOT / L.TRACE), limit=1030)
    assert la.offset == 1000 and wl.loads == [w.load] and len(wl.base.requests) == 30
    assert [r.hash_ids for r in wl.base.requests] == [r.hash_ids for r in whole.requests[1000:]]
    assert wl.base.requests[0].arrival_s == 0 and wl.base.requests[0].line == 1001


def test_the_30s_gap_workload_is_the_5s_one_longer_and_denser():
    short, long = L.WORKLOADS["synthetic_gap"], L.WORKLOADS["synthetic_gap_30s"]
    assert (long.source, long.profile, long.models) == (short.source, short.profile, short.models)
    assert long.page != short.page and long.requests > short.requests and long.load > short.load
    la, wl = _workload_of("--workload", "synthetic_gap_30s", "--limit", "40", "--time-scale", "1.5")
    assert wl.loads == [long.load / 1.5] and la.turn_gap == L.C.SYNTHETIC["turn_gap_s"] * 1.5


def test_defer_only_drops_plain_conductor(monkeypatch, tmp_path):
    ran: list[list[str]] = []
    monkeypatch.setattr(L, "run_slo", lambda policies, *rest: ran.append(policies) or {
        "wall_s": 0, "summary": {}, "load_average": {}, "started_utc": ""})
    monkeypatch.setattr(L, "target_rows", lambda *a, **k: ([], []))
    monkeypatch.setattr(L, "write_page", lambda *a, **k: None)
    monkeypatch.setattr(L.C, "OUT", tmp_path)
    L.main(["--defer", "--defer-only", "--rivals", "random", "--slo-ttft-ms", "5000"])
    L.main(["--defer", "--rivals", "random", "--slo-ttft-ms", "5000"])
    assert ran == [["conductor+defer", "random"], ["conductor", "conductor+defer", "random"]]


def test_a_workload_without_its_learned_predictors_is_refused_with_the_command_that_writes_them(monkeypatch,
                                                                                                  capsys):
    import dataclasses

    w = dataclasses.replace(L.WORKLOADS["synthetic_gap"], models="out/no-such-models")
    monkeypatch.setitem(L.WORKLOADS, "synthetic_gap", w)
    with pytest.raises(SystemExit) as e:
        L.main(["--workload", "synthetic_gap"])
    assert e.value.code == 2 and w.models_from in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--workload", "nope"], ["--speedup", "2", "--rate", "3"], ["--limit", "0"],
                                  ["--time-scale", "0"],
                                  ["--health-timeout-s", "0"], ["--defer-param", "defer_scan=64"],
                                  ["--defer", "--defer-param", "defer_scan"], ["--defer-b", "defer_reeval_s=0.5"],
                                  ["--defer-only"], ["--rivals", "conductor"]])
def test_bad_options_exit_before_any_load(argv, capsys):
    with pytest.raises(SystemExit) as e:
        L.main(argv)
    assert e.value.code == 2


def test_failed_requests_are_named_beside_the_table():
    def step(k: int, met: float, errors: int) -> dict:
        return {"step": k, "slo_attainment": met, "rejected": 1, "errors": errors, "cached_tokens": {"hit_ratio": 0.5},
                "ttft_s": {"p50": 1.0}, "goodput_rps": 2.0}
    summary = {"targets": [{"steps": [step(0, 0.5, 7), step(1, 0.9, 0)]},
                           {"steps": [step(0, 0.8, 0), step(1, 0.6, 0)]}]}
    per, rows = L.target_rows(["conductor", "random"], summary)
    assert L.errors_note(per) == "; requests failed or timed out: conductor 7"
    assert rows[0][1] == "50.0% (1), 90.0% (2)" and rows[1][1] == "80.0% (2), 60.0% (1)"  # order reversed on odd
    assert rows[0][4] == "**1.00x** (over random)"
    assert L.errors_note([{**p, "errors": 0} for p in per]) == ""


def test_one_at_a_time_runs_each_target_alone_in_loadgens_order_and_merges_the_steps(monkeypatch, tmp_path):
    """--one-at-a-time: one gateway up per (repetition, target), listed order then reversed, every
    gateway stopped before the next starts; the merged summary reads as one multi-target run."""
    import json

    events, up = [], set()

    def start(policy, ttft_ms, a, cfg_dir):
        assert not up, "a gateway is still up when the next starts"
        up.add(policy)
        events.append(policy)
        return policy, f"http://127.0.0.1:1/{policy}"

    def stop(*procs):
        for p in procs:
            up.discard(p)

    def run(cmd, **kw):
        out = cmd[cmd.index("--out") + 1]
        assert cmd.count("--target") == 1 and cmd[cmd.index("--repeat") + 1] == "1"
        policy = cmd[cmd.index("--target") + 1].rsplit("/", 1)[1]
        os.makedirs(out)
        met = {"conductor": 0.9, "random": 0.6}[policy] - 0.1 * len([e for e in events if e == policy])
        step = {"step": 0, "slo_attainment": met, "rejected": 1, "errors": 0, "cached_tokens": {"hit_ratio": 0.5},
                "ttft_s": {"p50": 1.0}, "goodput_rps": 2.0}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"steps": [step], "client_bottleneck": policy == "random"}, f)

    monkeypatch.setattr(L, "start", start)
    monkeypatch.setattr(L, "stop", stop)
    monkeypatch.setattr(L.subprocess, "run", run)
    a = _args("--one-at-a-time", "--repeat", "2", "--rivals", "random")
    summary = L.one_at_a_time(["conductor", "random"], 30000.0, L.WORKLOADS["conversation"], a, tmp_path, tmp_path)
    assert events == ["conductor", "random", "random", "conductor"] and not up
    assert summary["client_bottleneck"] is True
    per, rows = L.target_rows(["conductor", "random"], summary)
    assert rows[0][1] == "80.0% (1), 70.0% (2)" and rows[1][1] == "50.0% (2), 40.0% (1)"


def test_keep_other_slos_reruns_one_slo_and_keeps_the_others_of_the_same_setup(monkeypatch, tmp_path):
    """--keep-other-slos: a rerun of one SLO keeps the page's other tables (saying when they ran) when
    the saved run had the same setup; without it the page holds only what ran; another setup is an error."""
    def run_slo(policies, ttft_ms, w, a, cfg_dir):
        met = {30000.0: 0.9, 5000.0: 0.6}[ttft_ms] - (0.1 if a.keep_other_slos else 0.0)
        step = {"step": 0, "slo_attainment": met, "rejected": 1, "errors": 0, "cached_tokens": {"hit_ratio": 0.5},
                "ttft_s": {"p50": 1.0}, "goodput_rps": 2.0}
        other = {**step, "slo_attainment": 0.5}
        return {"wall_s": 60.0, "summary": {"targets": [{"steps": [step]}, {"steps": [other]}]},
                "load_average": {"start": [0, 0, 0], "end": [0, 0, 0]}, "started_utc": f"T{ttft_ms:g}"}

    monkeypatch.setattr(L, "run_slo", run_slo)
    monkeypatch.setattr(L.C, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(L.C, "OUT", tmp_path / "out")
    page = tmp_path / "docs" / "live-baselines.md"

    def tables() -> dict[str, str]:
        text = page.read_text()
        return {h.split(" s\n", 1)[0]: h for h in text.split("### TTFT <= ")[1:]}

    L.main(["--rivals", "random", "--slo-ttft-ms", "30000,5000"])
    assert list(tables()) == ["30", "5"] and "90.0%" in tables()["30"] and "60.0%" in tables()["5"]
    L.main(["--rivals", "random", "--slo-ttft-ms", "5000", "--keep-other-slos"])
    t = tables()
    assert list(t) == ["30", "5"] and "90.0%" in t["30"] and "Kept from the run started T30000" in t["30"]
    assert "60.0%" not in t["5"] and "50.0% (1)" in t["5"] and "Kept" not in t["5"]  # rerun
    with pytest.raises(SystemExit) as e:
        L.main(["--rivals", "lmetric", "--slo-ttft-ms", "5000", "--keep-other-slos"])
    assert e.value.code == 2 and list(tables()) == ["30", "5"]  # the page untouched
    L.main(["--rivals", "random", "--slo-ttft-ms", "5000"])
    assert list(tables()) == ["5"]


def test_the_experiments_pin_conductor_as_measured_unless_asked_for_it_as_shipped():
    # CONDUCTOR_THEN under a page's parameters gives the room every page before measured: none, or a
    # defer=on setting over the room's own defaults (not conductor's WAIT_ROOM)
    then, rest = split_params(L.C.CONDUCTOR_THEN, WAIT_ROOM)
    assert then == DeferParams() and rest == {}
    setting, _ = split_params({**L.C.CONDUCTOR_THEN, "defer": "on", "defer_scan": "64"}, WAIT_ROOM)
    assert setting == DeferParams(enabled=True, scan=64)
    assert L.C.pinned(False) == {"conductor": L.C.CONDUCTOR_THEN} and L.C.pinned(True) == {}


def test_shipped_runs_conductor_with_its_room_and_the_rooms_seconds_stretched(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(L.C, "start_gateway", lambda *args, **kw: calls.append(kw))
    for policy, argv in (("conductor", ()), ("conductor", ("--shipped",)),
                         ("conductor", ("--shipped", "--time-scale", "4")), ("dynamo_cost", ("--shipped",))):
        L.start(policy, 5000, _args(*argv), tmp_path)
    plain, shipped, scaled, rival = calls
    assert plain["policy_params"] is None and not plain["shipped"]  # pinned by start_gateway: defer=off
    assert shipped["shipped"] and split_params(shipped["policy_params"], WAIT_ROOM)[0] == split_params({}, WAIT_ROOM)[0]
    room, _ = split_params(scaled["policy_params"], WAIT_ROOM)
    assert (room.horizon_s, room.reeval_s, room.eval_every_s) == (4.0, 0.4, 0.016) and room.join
    assert not rival["shipped"] and rival["policy_params"] is None
    for argv in (["--shipped", "--defer", "--defer-only"], ["--page", "../elsewhere"]):
        with pytest.raises(SystemExit) as e:
            L.main(argv)  # refused before any server starts
        assert e.value.code == 2
