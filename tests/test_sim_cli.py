"""Bad command lines: one clear line on stderr and a non-zero exit, never a traceback."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.sim_helpers import ROOT, run_cli

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("args,needle", [
    (["--port", "8000"], "--role"),
    (["--role", "leader", "--port", "8000"], "invalid choice"),
    (["--role", "both", "--port", "70000"], "not a TCP port"),
    (["--role", "both", "--port", "8000", "--profile", "gpt-5-on-a-toaster"], "unknown profile"),
    (["--role", "both", "--port", "8000", "--time-scale", "0"], "must be > 0"),
    (["--role", "both", "--port", "8000", "--time-scale", "fast"], "time-scale"),
    (["--role", "both", "--port", "8000", "--host", "0.0.0.0"], "loopback"),
    (["--role", "both", "--port", "8000", "--kv-events", "http://x"], "ZMQ endpoint"),
    (["--role", "both", "--port", "8000", "--kv-events", "tcp://*:5557", "--kv-events-replay", "tcp://10.0.0.1:5"],
     "loopback"),
    (["--role", "both", "--port", "8000", "--flavor", "trtllm"], "invalid choice: 'trtllm'"),
    (["--port", "8000"], "--role is required"),
    (["--role", "prefill", "--disaggregation-mode", "decode", "--port", "8000", "--flavor", "sglang"], "contradicts"),
    (["--role", "both", "--port", "8000", "--kv-events-config", "{oops"], "not JSON"),
    (["--role", "both", "--port", "8000", "--max-num-seqs", "512", "--max-num-batched-tokens", "256"], ">="),
])
def test_bad_arguments(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_one_line_also_under_python_m_gateway_cli():
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "sim-engine", "--role", "both", "--port", "1",
                        "--profile", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "unknown profile" in r.stderr


def test_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run_cli("--role", "both", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0 and "--kv-events" in r.stdout and "--time-scale" in r.stdout
