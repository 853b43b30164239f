"""`conductor` and `conductor serve` as a user meets them: help, and one-line errors with exit 2."""
import subprocess
import sys

import pytest

from engines_adapters.net import free_port
from tests.servers import ROOT

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_help_lists_every_command():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("serve", "sim-engine", "loadgen", "simulate", "calibrate"):
        assert cmd in r.stdout
    assert run("serve", "--help").returncode == 0


@pytest.mark.parametrize("config, words", [
    ('policy = "nope"\n', "unknown policy"),
    ('policy = "round_robin"\n[policy_params]\nfoo = 1\n', "no parameter"),
    ('[policy_params]\ncost_eta = 0\n', "cost_eta must be a positive number"),
    ('[policy_params]\ncost_admission = "maybe"\n', "cost_admission must be true or false"),
    ('[policy_params]\nlate_rejection = true\n', "late_rejection is an experiment of `conductor simulate`"),
    ('[policy_params]\nadmission = false\n', "admission is the scheduler's own setting, not a policy parameter"),
    ('[[engines]]\nid = "a"\nrole = "both"\nurl = "http://127.0.0.1:1"\ndeployment = "gpt5"\n',
     "unknown deployment 'gpt5'; known: llama3-70b-a800x8, llama3-8b-h200"),
    ('[[engines]]\nid = "a"\nrole = "both"\nurl = "http://127.0.0.1:1"\nprofile = "gpt5"\n',  # deprecated alias
     "unknown deployment 'gpt5'"),
    ('[prior]\nprefill_mfu = 2.0\n', "prior prefill_mfu must be in (0, 1]"),
    ('[embedded]\nprofile = "gpt5"\n', "unknown profile 'gpt5'"),
    ("port = = 1\n", "not valid TOML"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, config, words):
    path = tmp_path / "c.toml"
    path.write_text(config)
    r = run("serve", "--config", str(path))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and words in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        port = free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        r = run("serve", "--port", str(port))
    assert r.returncode == 2 and "cannot bind" in r.stderr and r.stderr.count("\n") == 1


def test_the_gateway_holds_its_port_while_its_engines_start(tmp_path):
    """Bound before the embedded engines choose theirs, so none of them (nor another gateway) can
    take it while they start."""
    import socket
    import time

    from tests.servers import conductor, stop, wait_until

    port, log = free_port(), tmp_path / "serve.log"
    proc = conductor("serve", "--port", str(port), "--log-level", "info", log=str(log))
    try:
        deadline = time.monotonic() + 60
        while "starting embedded cluster" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.02)
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
        second = run("serve", "--port", str(port))
        assert second.returncode == 2 and "cannot bind" in second.stderr
        wait_until(f"http://127.0.0.1:{port}/ready", proc, timeout_s=90)
    finally:
        stop(proc)


def test_calibrate_is_built_and_asks_for_its_arguments():
    r = run("calibrate")
    assert r.returncode == 2 and "--telemetry" in r.stderr and "not built" not in r.stderr


def test_embedded_engines_do_not_outlive_a_killed_gateway():
    import signal
    import time

    import requests

    from tests.servers import conductor, stop, wait_until

    port = free_port()
    proc = conductor("serve", "--port", str(port), "--log-level", "warning")
    try:
        wait_until(f"http://127.0.0.1:{port}/ready", proc, timeout_s=90)
        urls = [i["url"] for i in requests.get(f"http://127.0.0.1:{port}/admin/cluster").json()["instances"]]
        assert len(urls) == 4
        proc.send_signal(signal.SIGKILL)  # no graceful shutdown: the engines must go by themselves
        proc.wait(10)
        deadline = time.monotonic() + 20
        alive = urls
        while alive and time.monotonic() < deadline:
            alive = []
            for u in urls:
                try:
                    requests.get(u + "/health", timeout=0.5)
                    alive.append(u)
                except requests.RequestException:
                    pass
            time.sleep(0.1)
        assert alive == []
    finally:
        stop(proc)
