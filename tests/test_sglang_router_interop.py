"""Checked by a router we did not write: SGLang's own router (``sglang-router`` 0.3.2 from the
package registry, a test dependency) drives `--flavor sglang` sim engines in its PD mode (dual
dispatch with bootstrap rooms) and in its regular mode, and must serve streamed chat completions
end to end. If it refuses something, our engine is what is wrong.

The router and engines run in a private network namespace with only loopback (``unshare -n``):
the router tries to fetch the workers' tokenizers from the Hugging Face hub, and tests never send
traffic off the machine. Needs root (CI runs as root) or user namespaces."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "sglang_router_run.py")


def _isolated() -> bool:
    """Whether a loopback-only network namespace can be made here (``unshare -n``: root, or user
    namespaces); the runner brings its loopback up itself."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0


def run_router(mode: str) -> dict:
    pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (make setup installs it)")
    if not _isolated():
        pytest.skip("cannot make a loopback-only network namespace (unshare -n) for the router here")
    r = subprocess.run(["unshare", "-n", sys.executable, RUNNER, "--lo-up", mode], cwd=ROOT, capture_output=True,
                       text=True, timeout=240, env={**os.environ, "PYTHONHASHSEED": "0", "NO_PROXY": "*"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_chats(out: dict) -> None:
    assert [m["id"] for m in out["models"]["data"]] == ["llama3-8b"]
    for chat in out["chats"]:
        assert chat["status"] == 200 and chat["done"], chat
        assert chat["content_chunks"] == 8 and chat["usage"]["completion_tokens"] == 8, chat
    g = out["generate"]
    assert g["status"] == 200 and g["body"]["meta_info"]["completion_tokens"] == 5, g


def test_sglang_router_drives_a_prefill_decode_pair():
    out = run_router("pd")
    _check_chats(out)
    # both legs reached their engines, and every handover's KV moved from prefill to decode
    p, d = out["engines"]["prefill"], out["engines"]["decode"]
    assert p["role"] == "prefill" and d["role"] == "decode" and p["held"] == 0
    assert 'engine_type="prefill"' in out["metrics"]["prefill"]
    for chat in out["chats"]:  # the decode pulled each prompt's KV (all but the last token) instead of computing it
        u = chat["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1, u


def test_sglang_router_drives_colocated_engines():
    out = run_router("regular")
    _check_chats(out)
    a, b = out["engines"]["a"], out["engines"]["b"]
    assert a["prefix_queries"] > 0 and b["prefix_queries"] > 0  # round robin reached both
    for chat in out["chats"]:  # no handover here: each engine computed its prompts itself
        u = chat["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] - 1, u
