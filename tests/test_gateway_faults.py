"""Faults a production gateway meets, end to end on sim engines: hung engines (SIGSTOP) before the
first byte and mid-stream, SIGTERM with streams in flight, a start-up that cannot bind, and a
flood of idle connections at a low open-file limit."""
from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import pytest
import requests

from engines_adapters.net import free_port
from tests.servers import ROOT, engine_entry, gateway, sim_engine, wait_until

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

LOOSE_SLO = ["[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]


@contextmanager
def stopped(proc: subprocess.Popen):
    """The engine hangs (SIGSTOP) inside the block and is continued after it, whatever happens."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def config(*lines: str, engines=()) -> str:
    cfg = list(lines)
    for name, e, role in engines:
        cfg += engine_entry(name, role, e["url"], e.get("kv"), e.get("replay"))
    return "\n".join([*cfg, *LOOSE_SLO]) + "\n"


def instances(url: str) -> dict[str, dict]:
    return {i["id"]: i for i in requests.get(url + "/admin/cluster", timeout=10).json()["instances"]}


def drained(url: str) -> dict[str, dict]:
    """The cluster view once every reservation is released (bounded wait: releases are asynchronous)."""
    for _ in range(200):
        view = instances(url)
        if all(i["active_requests"] == 0 and i["reserved_prefill_tokens"] == 0 for i in view.values()):
            return view
        time.sleep(0.05)
    return view


def sse_lines(url: str, body: dict, on_event=None) -> tuple[dict, list[bytes]]:
    lines: list[bytes] = []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if on_event:
                    on_event(len(lines))
        return dict(r.headers), lines


def in_flight(url: str) -> float:
    metrics = requests.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("conductor_requests_in_flight"))


def test_a_hung_decode_is_ejected_its_waiting_requests_retried_and_its_streams_ended():
    with sim_engine("prefill") as p1, sim_engine("decode") as d1, sim_engine("decode") as d2:
        # a stopped engine never answers, so any probe timeout finds it; the default 0.8 s also
        # trips on a live engine starved of CPU on a loaded machine (and ejected d1 would fail it)
        cfg = config('policy = "round_robin"', "health_timeout_s = 3",
                     engines=(("p1", p1, "prefill"), ("d1", d1, "decode"), ("d2", d2, "decode")))
        with gateway(cfg) as g:
            url = g["url"]
            model = requests.get(url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "stream"}], "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            # round robin alternates the decode instances: of two streams opened in turn, one is on d2
            opened = [requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60)
                      for _ in range(2)]
            on_d2 = next(r for r in opened if r.headers["x-conductor-decode"] == "d2")
            lines = on_d2.iter_lines()
            first = [next(lines) for _ in range(3)]  # it is flowing

            def whole(i: int) -> requests.Response:
                b = {"model": model, "messages": [{"role": "user", "content": f"whole {i}"}], "max_tokens": 1000,
                     "ignore_eos": True}
                return requests.post(url + "/v1/chat/completions", json=b, headers={"x-request-id": f"w{i}"},
                                     timeout=60)

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                wholes = [pool.submit(whole, i) for i in range(4)]  # two of them decode on d2
                for _ in range(600):  # bounded: until all four hold reservations (beside the 2 streams)
                    if in_flight(url) >= 6:
                        break
                    time.sleep(0.05)
                else:
                    pytest.fail("the four requests were not all placed within 30 s")
                with stopped(d2["proc"]):
                    answers = [w.result() for w in wholes]
                    rest = [line for line in lines if line]  # ends when the gateway ends the stream
                    # the stream on d1 decodes on for 3000 tokens: hang up on it rather than race
                    # its end (``drained`` waits 10 s: too short for it on a loaded machine)
                    for r in opened:
                        r.close()
                    view = drained(url)
            for r in opened:
                r.close()
            # the answers waiting on d2 (nothing had reached their clients) were retried on d1
            assert first and [a.status_code for a in answers] == [200] * 4
            assert {a.headers["x-conductor-decode"] for a in answers} == {"d1"}
            decisions = requests.get(url + "/admin/decisions", params={"limit": 100}).json()["decisions"]
            first_tries = [d["chosen"]["decode"] for d in decisions if d["request_id"].startswith("w")]
            assert "d2" in first_tries
            # the stream on d2 (already sending) ended with an SSE error naming the ejection
            err = json.loads(rest[-2][len(b"data: "):])["error"]
            assert "ejected" in err["message"] and rest[-1] == b"data: [DONE]"
            assert not view["d2"]["healthy"] and view["d1"]["healthy"]
            assert all(i["active_requests"] == 0 and i["reserved_prefill_tokens"] == 0 for i in view.values())


@contextmanager
def two_prefills(first_byte_timeout_s: float, *p1_flags: str):
    """Prefill p1 (started with ``p1_flags``) and p2, decode d1, behind a round-robin gateway with this
    first-byte limit, ejecting after 2 failures, its health checks far apart (only the requests' own
    timeouts can eject): yields (gateway URL, model, p2)."""
    with sim_engine("prefill", *p1_flags) as p1, sim_engine("prefill") as p2, sim_engine("decode") as d1:
        cfg = config('policy = "round_robin"', "health_interval_s = 60",
                     f"upstream_first_byte_timeout_s = {first_byte_timeout_s}", "eject_after_failures = 2",
                     engines=(("p1", p1, "prefill"), ("p2", p2, "prefill"), ("d1", d1, "decode")))
        with gateway(cfg) as g:
            yield g["url"], requests.get(g["url"] + "/v1/models").json()["data"][0]["id"], p2


def test_a_prefill_leg_timing_out_is_retried_on_another_pair_and_counted_toward_ejection():
    with two_prefills(1) as (url, model, p2):
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        with stopped(p2["proc"]):
            answers = [requests.post(url + "/v1/chat/completions", json=body, timeout=30) for _ in range(6)]
            view = drained(url)
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.headers["x-conductor-prefill"] for a in answers} == {"p1"}
        assert not view["p2"]["healthy"]  # two timeouts ejected it
        assert all(i["active_requests"] == 0 for i in view.values())


def test_a_prefill_leg_timing_out_in_a_working_engines_queue_is_retried_but_not_counted_toward_ejection():
    # p1 prefills one request at a time, each ~0.7 s (12,000 byte tokens at time scale 2): of the
    # five sent to it at once, the first answers within the 2 s first-byte limit and the last ones
    # wait past it. A queue, not a hang: they are retried on p2, and p1 stays in the cluster
    with two_prefills(2, "--time-scale", "2", "--max-num-seqs", "1") as (url, model, _):
        def ask(i: int) -> requests.Response:
            body = {"model": model, "messages": [{"role": "user", "content": f"{i} " + "hello " * 2000}],
                    "max_tokens": 2}
            return requests.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": f"q{i}"},
                                 timeout=60)

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(ask, range(10)))  # round robin: five of them on p1
        view = drained(url)
        decisions = requests.get(url + "/admin/decisions", params={"limit": 100}).json()["decisions"]
        tried_p1 = {d["request_id"] for d in decisions if d["chosen"] and d["chosen"]["prefill"] == "p1"}
        moved = [a for a in answers
                 if a.headers["x-request-id"] in tried_p1 and a.headers["x-conductor-prefill"] == "p2"]
        assert [a.status_code for a in answers] == [200] * 10
        assert len(moved) >= 2  # enough timeouts to have ejected p1 had they counted
        assert view["p1"]["healthy"] and view["p1"]["consecutive_failures"] == 0
        assert all(i["active_requests"] == 0 for i in view.values())


def test_a_stream_stalling_mid_way_ends_with_an_sse_error_after_the_stall_timeout():
    with sim_engine("prefill") as p1, sim_engine("decode") as d1:
        cfg = config("health_interval_s = 60", "upstream_stall_timeout_s = 1",
                     engines=(("p1", p1, "prefill"), ("d1", d1, "decode")))
        with gateway(cfg) as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            hang = {"done": False}

            def on_event(n: int) -> None:
                if n == 5 and not hang["done"]:
                    hang["done"] = True
                    os.kill(d1["proc"].pid, signal.SIGSTOP)

            try:
                _, lines = sse_lines(g["url"], body, on_event)
                view = drained(g["url"])
            finally:
                os.kill(d1["proc"].pid, signal.SIGCONT)
            err = json.loads(lines[-2][len(b"data: "):])["error"]
            assert err["code"] == "upstream_timeout" and lines[-1] == b"data: [DONE]"
            assert all(i["active_requests"] == 0 for i in view.values())


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("hang_an_engine", [False, True, False])
def test_sigterm_with_streams_in_flight_ends_the_gateway_and_its_engines_in_time(hang_an_engine):
    """Repeated: every SIGTERM ends it, a hung engine included, within the default shutdown budget."""
    with gateway("[embedded]\nprefill = 1\ndecode = 1\n") as g:
        url, proc = g["url"], g["proc"]
        model = requests.get(url + "/v1/models").json()["data"][0]["id"]
        engines = _children(proc.pid)  # the engines (and the embedded store)
        assert len(engines) >= 2
        body = {"model": model, "messages": [{"role": "user", "content": "long"}], "max_tokens": 5000,
                "ignore_eos": True, "stream": True}
        responses = [requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60)
                     for _ in range(6)]
        pool = concurrent.futures.ThreadPoolExecutor(1 + len(responses))
        whole = pool.submit(requests.post, url + "/v1/chat/completions", timeout=60,
                            json={**body, "stream": False})  # a non-streamed answer still decoding
        try:
            assert all(r.status_code == 200 for r in responses)
            # read every stream as it comes, as a client does: one left unread fills its socket
            # buffers, the gateway's last write can then never leave, and the stream is cut
            readers = [pool.submit(lambda r: [line for line in r.iter_lines() if line][-2:], r) for r in responses]
            for _ in range(600):  # bounded, 30 s: the non-streamed request is in progress too (7 reservations)
                if in_flight(url) >= 7:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the seven requests were not all in progress within 30 s")
            if hang_an_engine:
                os.kill(next(pid for pid in engines if b"decode" in open(f"/proc/{pid}/cmdline", "rb").read()),
                        signal.SIGSTOP)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            took = time.monotonic() - t0
            # every stream ended cleanly (an SSE error event, then [DONE]), none was cut
            endings = [f.result(timeout=10) for f in readers]
        finally:
            for r in responses:
                r.close()
        assert all(e[-1] == b"data: [DONE]" and b'"error"' in e[0] for e in endings), endings
        cut = whole.result()  # answered, not dropped: 503 the client can retry
        pool.shutdown()
        # (with its decode engine hung, the answer may be the ejection's, before the shutdown's)
        codes = {"shutting_down", "upstream_unavailable"} if hang_an_engine else {"shutting_down"}
        assert cut.status_code == 503 and cut.json()["error"]["code"] in codes, cut.text
        assert took < 9.5, f"shutdown took {took:.1f} s"  # the bound: shutdown_timeout_s (8) + the watchdog margin (1)
        for _ in range(100):
            if all(_gone(e) for e in engines):
                break
            time.sleep(0.05)
        assert all(_gone(e) for e in engines)


def test_a_start_up_that_cannot_bind_its_kv_event_socket_exits_with_one_clear_line():
    with sim_engine("both") as e, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kv = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "c.toml")
            with open(path, "w") as f:
                f.write("\n".join(engine_entry("b", "both", e["url"], kv, e["replay"])) + "\n")
            proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", path, "--port",
                                   str(free_port()), "--log-level", "warning"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("conductor serve: error:")]
    assert len(ours) == 1 and "Address already in use" in ours[0] and kv.rsplit(":", 1)[1] in ours[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_flood_of_idle_connections_at_a_low_open_file_limit_crashes_nothing():
    """At 256 open files, 400 idle connections (nothing sent, a partial head, a partial body) used
    to exhaust the descriptors until libzmq aborted the process (exit 134)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.toml")
        with open(path, "w") as f:
            f.write("header_timeout_s = 30\nbody_timeout_s = 30\n[embedded]\nprefill = 1\ndecode = 1\n")

        def low_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

        log = open(os.path.join(d, "gw.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", path, "--port", str(port),
                                 "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=low_limit,
                                env={**os.environ, "PYTHONHASHSEED": "0"})
        url = f"http://127.0.0.1:{port}"
        idle: list[socket.socket] = []
        try:
            wait_until(url + "/ready", proc, timeout_s=90)
            model = requests.get(url + "/v1/models").json()["data"][0]["id"]
            for i in range(400):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                except OSError:
                    continue
                if i % 3 == 1:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                elif i % 3 == 2:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99\r\n\r\n{")
                idle.append(s)
            time.sleep(2.0)  # the KV-event subscribers probe their replay sockets every second meanwhile
            assert proc.poll() is None, open(os.path.join(d, "gw.log")).read()[-2000:]
            body = {"model": model, "messages": [{"role": "user", "content": "still there? " + "k" * 2000}],
                    "max_tokens": 3}
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            for _ in range(100):  # the prefill's KV events still reach the index
                view = instances(url)
                if view["prefill-1"]["cached_blocks"]["device"] > 0:
                    break
                time.sleep(0.05)
            assert view["prefill-1"]["cached_blocks"]["device"] > 0 and view["prefill-1"]["healthy"]
            assert proc.poll() is None
        finally:
            for s in idle:
                s.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
