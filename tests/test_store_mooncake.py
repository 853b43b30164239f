"""The real Mooncake store end to end: ``mooncake_master`` and ``MooncakeDistributedStore`` from the
``mooncake-transfer-engine-non-cuda`` wheel (test extra), CPU over TCP, with the gateway's store
tier reading the real master. The client's transfer engine listens on wildcard addresses, so the
scenario runs in a network namespace of its own with only loopback up (``unshare -n``): nothing
listens beyond this machine. Skipped where the wheel, libibverbs or namespaces are unavailable."""
from __future__ import annotations

import ctypes.util
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.servers import ROOT

SCENARIO = os.path.join(ROOT, "tests", "mooncake_scenario.py")


def _unavailable() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda is not installed"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs1 is not installed (make setup installs it as root)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare/ip not available"
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return "cannot create a network namespace here"
    return None


def in_netns(scenario: str, timeout: float = 120) -> dict:
    """Run one scenario of tests/mooncake_scenario.py in a network namespace of its own, only
    loopback up; its RESULT line."""
    p = subprocess.run(["unshare", "-n", "sh", "-c",
                        f'ip link set lo up && exec "{sys.executable}" "{SCENARIO}" {scenario}'],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


real_mooncake = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.mark.slow
@real_mooncake
def test_the_gateways_store_tier_reads_a_real_mooncake_master():
    r = in_netns("tier")
    assert r["health"]["status"] == "ok" and r["tier_started"] is True
    assert r["held_after_put"] == 12  # the vLLM store keys of the prompt's first 12 blocks
    assert r["remove"] == 0 and r["held_after_remove"] == 5  # a hole at block 5 ends the prefix
    assert r["batch_shape"] == ["disk_values", "error", "local_disk_values", "nof_values", "ok", "values"]
    assert r["batch_miss"] == "OBJECT_NOT_FOUND" and r["key_count"] == 11
    assert r["check_after_stop"] is False and r["stale"] is True and r["lookup_when_stale"] is None


@pytest.mark.slow
@real_mooncake
def test_a_prefix_computed_on_one_engine_is_loaded_from_the_real_master_on_another():
    r = in_netns("engines")
    blocks = (r["prompt_tokens"] - 1) // 16  # every block but the one holding the last token
    assert r["first_cached"] == 0 and r["key_count"] >= blocks and r["engine_keys_held"] == blocks
    # real bytes, scaled down: 4 bytes a token (64 a block) in the master; the modelled KV recorded
    # (LLaMA3-8B: 128 KiB a token, 2 MiB a block)
    assert r["allocated_bytes"] == r["e1_put_payload"] == r["key_count"] * 64
    assert r["e1_put_modelled"] == r["key_count"] * 16 * 131072
    # prefill-2 loaded the prefix instead of computing it, and was charged the modelled load time
    assert r["second_cached"] == blocks * 16 == r["kv_store"]["loaded_tokens"] == r["e2_store_hits"]
    assert r["e2_get_payload"] == blocks * 64 and r["e2_get_modelled"] == blocks * 16 * 131072
    expected_s = 1e-4 + r["e2_get_modelled"] / (87e9 / 4)  # one RDMA transfer (store model defaults)
    assert r["e2_load_s"] == pytest.approx(expected_s, rel=1e-6)
    assert r["kv_store"]["load_s"] == pytest.approx(expected_s, rel=1e-6)
