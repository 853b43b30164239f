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


@pytest.mark.slow
@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
def test_the_gateways_store_tier_reads_a_real_mooncake_master():
    p = subprocess.run(["unshare", "-n", "sh", "-c", f'ip link set lo up && exec "{sys.executable}" "{SCENARIO}"'],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["health"]["status"] == "ok" and r["tier_started"] is True
    assert r["held_after_put"] == 12  # the vLLM store keys of the prompt's first 12 blocks
    assert r["remove"] == 0 and r["held_after_remove"] == 5  # a hole at block 5 ends the prefix
    assert r["batch_shape"] == ["disk_values", "error", "local_disk_values", "nof_values", "ok", "values"]
    assert r["batch_miss"] == "OBJECT_NOT_FOUND" and r["key_count"] == 11
    assert r["check_after_stop"] is False and r["stale"] is True and r["lookup_when_stale"] is None
