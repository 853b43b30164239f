"""``conductor loadgen`` end to end: sweeps, effective capacity, two targets, outputs, bad input."""
import json
import time
from itertools import islice
from pathlib import Path

import matplotlib.image
import pytest

from engines_adapters.net import free_port
from gateway.cli import main as _conductor
from loadgen.fixed_target import spawn
from tests.traces import MOONCAKE

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow


def conductor(argv):
    """The real command in-process; argparse errors exit via SystemExit, returned as the code."""
    try:
        return _conductor(argv)
    except SystemExit as e:
        return e.code


def trace_slice(tmp_path, n):
    p = tmp_path / "slice.jsonl"
    with open(MOONCAKE) as f:
        p.write_text("".join(islice(f, n)))
    return p


def test_sweep_two_targets_capacity_and_outputs(tmp_path, capsys):
    """One prefill slot of 20 ms (capacity 50 req/s) against two slots: TTFT queues with load,
    so attainment falls on the first and the effective capacity lies inside the sweep."""
    out = tmp_path / "out"
    common = ("--ttft-ms", "20", "--itl-ms", "2")
    with spawn(*common, "--prefill-slots", "1") as a, spawn(*common, "--prefill-slots", "2") as b:
        rc = conductor(["loadgen", "--target", a, "--target", b, "--synthetic", "--requests", "40",
                        "--input-tokens", "uniform:200:600", "--output-tokens", "6", "--turns", "2",
                        "--turn-gap", "0.1",
                        "--rate", "10,20,90", "--slo-ttft-ms", "100", "--slo-tbt-ms", "50",
                        "--step-pause", "0.2", "--out", str(out), "--seed", "3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    s = json.loads((out / "summary.json").read_text())
    for key in ("requests", "completed", "rejected", "errors", "slo_attainment", "goodput_rps", "steps"):
        assert key in s
    for key in ("ttft_s", "tbt_s"):
        assert set(s[key]) >= {"p50", "p90", "p99"}
    ta, tb = s["targets"]
    assert [st["load"] for st in ta["steps"]] == [10, 20, 90] and s["steps"] == ta["steps"]
    assert ta["steps"][0]["slo_attainment"] >= 0.9 and ta["steps"][-1]["slo_attainment"] < 0.6
    cap_a, cap_b = ta["effective_capacity"], tb["effective_capacity"]
    assert cap_a["method"] == "interpolated" and 20 <= cap_a["value"] <= 90
    assert cap_b["value"] > cap_a["value"]  # twice the prefill capacity
    assert s["comparison"][0]["effective_capacity_ratio"] > 1
    assert s["comparison"][0]["steps"][-1]["goodput_rps_ratio"] > 1
    assert s["requests"] == 120 and s["completed"] == 120  # top level: target A, all steps
    # steps interleaved A B, B A, A B
    order = [line.split("]")[1].split(":")[0].strip() for line in captured.err.splitlines()
             if line.startswith("[") and "requests to" in line]
    assert order == ["target 1 10 req/s", "target 2 10 req/s", "target 2 20 req/s", "target 1 20 req/s",
                     "target 1 90 req/s", "target 2 90 req/s"]
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 240
    r = lines[0]
    assert {"arrival_s", "sent_s", "ttft_s", "tbt_s", "tpot_s", "status", "output_tokens"} <= set(r)
    assert r["extra"]["gaps"]["n"] == 5 and "send_lag_s" in r["extra"] and "token_times" not in r
    assert r["prefill_instance"] == "prefill-0" and r["extra"]["conversation"] is not None
    for png in ("goodput.png", "latency.png"):
        img = matplotlib.image.imread(out / png)
        assert img.shape[0] > 400 and img.shape[1] > 800 and img.std() > 0.05  # drawn, not blank
    assert "effective capacity ≈" in captured.out and "client send lag p50" in captured.out


def test_repeat_alternates_which_target_goes_first_and_reports_the_spread(tmp_path, capsys):
    out = tmp_path / "out"
    with spawn("--ttft-ms", "5", "--itl-ms", "1") as a, spawn("--ttft-ms", "5", "--itl-ms", "1") as b:
        rc = conductor(["loadgen", "--target", a, "--target", b, "--synthetic", "--requests", "6",
                        "--input-tokens", "200", "--output-tokens", "3", "--rate", "20", "--repeat", "3",
                        "--step-pause", "0", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    order = [line.split("]")[1].split(":")[0].strip() for line in captured.err.splitlines()
             if line.startswith("[") and "requests to" in line]
    assert order == ["target 1 20 req/s", "target 2 20 req/s", "target 2 20 req/s", "target 1 20 req/s",
                     "target 1 20 req/s", "target 2 20 req/s"]
    s = json.loads((out / "summary.json").read_text())
    for t in s["targets"]:
        assert [st["load"] for st in t["steps"]] == [20, 20, 20]
        (sp,) = t["spread"]
        assert sp["runs"] == 3 and sp["slo_attainment"]["min"] <= sp["slo_attainment"]["mean"] <= 1.0
    assert "over 3 runs: attainment" in captured.out


def test_trace_replay_prompt_lengths_exact_through_the_server(tmp_path, capsys):
    p = trace_slice(tmp_path, 30)
    with spawn("--ttft-ms", "5", "--itl-ms", "0.2") as url:
        rc = conductor(["loadgen", "--target", url, "--trace", str(p), "--speedup", "50", "--out", str(tmp_path / "o"),
                        "--quiet", "--keep-token-times"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["completed"] == 30 and s["slo_attainment"] == 1.0 and s["load_kind"] == "speedup"
    assert s["prompt_tokens"]["requests_checked"] == 30 and s["prompt_tokens"]["requests_mismatched"] == 0
    assert s["effective_capacity"]["method"] == "lower_bound"
    assert len(s["run"]["prompt_salt"]) == 8  # fresh per run: a long-lived server starts cold
    rec = json.loads((tmp_path / "o" / "requests.jsonl").read_text().splitlines()[0])
    assert len(rec["token_times"]) == rec["output_tokens"] == 500 and rec["extra"]["trace_line"] == 1


def test_malformed_trace_skipped_or_strict(tmp_path, capsys):
    p = trace_slice(tmp_path, 4)
    p.write_text(p.read_text() + "garbage\n")
    with spawn("--ttft-ms", "1", "--itl-ms", "0") as url:
        rc = conductor(["loadgen", "--target", url, "--trace", str(p), "--limit", "5", "--speedup", "1000",
                        "--out", str(tmp_path / "o"), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 0 and f"{p}:5: not JSON" in err
        s = json.loads((tmp_path / "o" / "summary.json").read_text())
        assert s["workload"]["skipped_lines"] == 1 and s["requests"] == 4
        rc = conductor(["loadgen", "--target", url, "--trace", str(p), "--strict", "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [f"conductor loadgen: error: {p}:5: not JSON (Expecting value at column 1)"]


def test_ctrl_c_keeps_partial_results(tmp_path):
    """SIGINT mid-run: sending stops, requests in flight are cut, what ran is written, exit 130."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "o"
    root = Path(__file__).resolve().parents[1]
    with spawn("--ttft-ms", "50", "--itl-ms", "20") as url:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "loadgen", "--target", url, "--synthetic",
                                 "--requests", "300", "--rate", "20", "--output-tokens", "20", "--out", str(out),
                                 "--quiet"],
                                cwd=root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                # a suite started in the background ('cmd &' in a script) inherits SIGINT
                                # ignored, and Python then never turns it into KeyboardInterrupt
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        started = False
        for line in proc.stderr:  # the step has started sending
            if "requests to" in line:
                started = True
                break
        assert started, "loadgen never said it started sending"
        time.sleep(1.5)  # ~30 sent of 300 (15 s of arrivals: the interrupt lands mid-run however slow the machine)
        os.kill(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        rc = proc.wait(30)
    assert rc == 130, rest
    assert "interrupted: partial results written" in rest
    s = json.loads((out / "summary.json").read_text())
    assert s["aborted"] == "interrupted" and s["completed"] >= 5
    statuses = [json.loads(line)["status"] for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(statuses) == 300 and statuses.count("aborted") >= 50 and statuses.count("ok") == s["completed"]
    assert set(statuses) <= {"ok", "aborted"}


def test_unreachable_target_fails_fast_in_one_line(tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    rc = conductor(["loadgen", "--target", dead, "--trace", str(trace_slice(tmp_path, 3)),
                    "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and time.monotonic() - t < 5
    assert len([line for line in err if "error" in line]) == 1
    assert err[-1].startswith(f"conductor loadgen: error: target {dead} unreachable: ")


def test_api_key_is_sent(tmp_path, capsys):
    p = str(trace_slice(tmp_path, 2))
    with spawn("--ttft-ms", "1", "--itl-ms", "0", "--api-key", "sesame") as url:
        rc = conductor(["loadgen", "--target", url, "--trace", p, "--out", str(tmp_path / "o"), "--quiet"])
        assert rc == 2 and "answered HTTP 401 (pass the right --api-key)" in capsys.readouterr().err
        rc = conductor(["loadgen", "--target", url, "--trace", p, "--out", str(tmp_path / "o"), "--quiet",
                        "--api-key", "sesame", "--speedup", "100", "--prompt-salt", "pinned"])
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert rc == 0 and s["completed"] == 2 and s["run"]["prompt_salt"] == "pinned"


@pytest.mark.parametrize("args,needle", [
    (["--rate", "0"], "values must be > 0"),
    (["--rate", "1", "--speedup", "2"], "not allowed with argument"),
    (["--prompt-format", "token-ids"], "needs --endpoint completions"),
    (["--target", "ftp://x"], "expected an http"),
    (["--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
    (["--offset", "-1"], "argument --offset"),
    (["--offset", "2"], "cannot skip 2 requests: only 2 were read"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, needle):
    base = {"--target": "http://127.0.0.1:9", "--trace": str(trace_slice(tmp_path, 2)), "--out": str(tmp_path / "o")}
    argv = ["loadgen"]
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    rc = conductor(argv + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0]
