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
    if shutil.which("unshare") is None:
        return "unshare (util-linux) not available"
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return "cannot create a network namespace here"
    return None


def in_netns(scenario: str, timeout: float = 120) -> dict:
    """Run one scenario of tests/mooncake_scenario.py in a network namespace of its own (it brings
    loopback up, nothing else is there); its RESULT line."""
    p = subprocess.run(["unshare", "-n", sys.executable, SCENARIO, scenario],
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
    assert r["after_master_stop"] == [200, None]  # master gone: served by recompute, nothing loaded


@pytest.mark.slow
@real_mooncake
def test_serve_starts_the_master_its_tier_reads_the_engines_keys_and_stopping_serve_stops_it():
    r = in_netns("serve", timeout=180)
    m = r["master"]
    assert m["started_by_gateway"] and m["running"] and m["rpc"].startswith("127.0.0.1:")
    assert r["store"] == {"mode": "query", "stale": False, "url": m["http"]} and r["health"]["status"] == "ok"
    assert m["http"].startswith("http://127.0.0.1:")
    assert r["blocks"] > 100 and r["key_count"] == r["blocks"] and r["prefills"] == ["prefill-1", "prefill-2"]
    # the second prefill instance: the gateway's tier found the whole prefix in the real master, and
    # the engine loaded it from there (real bytes) instead of computing it
    assert r["d2"]["transfer_from"] == "store" and r["d2"]["store_hit_tokens"] == r["blocks"] * 16, json.dumps(r)
    assert r["d2"]["store_load"]["tokens"] == r["blocks"] * 16 and r["tier_queries"] >= 2, json.dumps(r)
    assert r["master_alive_after_stop"] is False and r["master_answers_after_stop"] is False


def _serve(config: str, tmp_path) -> subprocess.CompletedProcess:
    from engines_adapters.net import free_port

    cfg = tmp_path / "c.toml"
    cfg.write_text(config)
    return subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_serve_without_the_master_binary_exits_2_saying_what_to_install(tmp_path):
    p = _serve('[store]\nkind = "mooncake"\nstart_master = true\nmaster_bin = "/nonexistent/mooncake_master"\n'
               "[embedded]\nstore = false\n", tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "/nonexistent/mooncake_master" in p.stderr and "pip install mooncake-transfer-engine-non-cuda" in p.stderr


def test_the_master_is_looked_up_beside_python_then_on_path(tmp_path):
    from gateway.mooncake_master import MasterMissing, find_master

    with pytest.raises(MasterMissing, match="install the test extra"):
        find_master(search=[str(tmp_path)])
    binary = tmp_path / "mooncake_master"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_master(search=["/nonexistent", str(tmp_path)]) == str(binary)


@pytest.mark.parametrize("store", ["start_master = true",  # started, or attached by its RPC address
                                   'url = "http://127.0.0.1:9"\nmaster_rpc = "127.0.0.1:9"'])
def test_embedded_engines_on_a_real_master_need_a_loopback_only_namespace(tmp_path, store):
    from engines_adapters.store.mooncake import loopback_only

    if loopback_only() is None:
        pytest.skip("this process already runs in a loopback-only network namespace")
    p = _serve(f'[store]\nkind = "mooncake"\n{store}\n[embedded]\nprefill = 1\ndecode = 1\n', tmp_path)
    if "mooncake_master not found" in p.stderr:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed")
    assert p.returncode == 2 and "network namespace with only loopback up" in p.stderr, p.stderr


def test_a_sim_engine_refuses_to_open_the_mooncake_client_outside_such_a_namespace():
    from engines_adapters.store.mooncake import loopback_only
    from tests.sim_helpers import run_cli

    if loopback_only() is None:
        pytest.skip("this process already runs in a loopback-only network namespace")
    p = run_cli("--role", "prefill", "--port", "0", "--kv-store", "mooncake://127.0.0.1:1")
    assert p.returncode == 2 and "unshare -n" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run_cli("--role", "prefill", "--port", "0", "--kv-store", "mooncake://127.0.0.1")
    assert p.returncode == 2 and "mooncake://HOST:PORT" in p.stderr


def test_loopback_only_asks_the_interfaces_of_this_namespace():
    from engines_adapters.store.mooncake import loopback_only

    up = {"lo": True, "eth0": True, "eth1": False}
    assert loopback_only(lambda: ["lo", "eth1"], lambda s, n: up[n]) is None
    assert "eth0" in str(loopback_only(lambda: ["lo", "eth0", "eth1"], lambda s, n: up[n]))


def test_a_payload_records_the_modelled_size_and_foreign_bytes_are_a_miss():
    from engines_adapters.store.mooncake import decode_payload, encode_payload, parse_url

    v = encode_payload(2 << 20, 64)
    assert len(v) == 64 and decode_payload(v) == 2 << 20
    assert decode_payload(b"") is None and decode_payload(b"x" * 64) is None
    assert parse_url("mooncake://127.0.0.1:50051") == ("127.0.0.1", 50051)
    for bad in ("http://127.0.0.1:1", "mooncake://127.0.0.1", "mooncake://:1", "mooncake://h:99999"):
        with pytest.raises(ValueError):
            parse_url(bad)


@pytest.mark.parametrize("section, needle", [
    ('kind = "redis"\nurl = "http://127.0.0.1:9003"', "kind must be sim or mooncake"),
    ('start_master = true', 'need kind = "mooncake"'),
    ('kind = "mooncake"\nstart_master = true\nurl = "http://127.0.0.1:9003"', "leave url and master_rpc out"),
    ('kind = "mooncake"\nurl = "http://127.0.0.1:9003"\nmaster_rpc = "10.0.0.1:50051"', "loopback only"),
    ('kind = "mooncake"\nstart_master = true\nmaster_args = "--x"', "master_args must be a list"),
])
def test_bad_mooncake_store_sections_are_named(section, needle):
    import tomllib

    from gateway.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=needle):
        parse_config(tomllib.loads("[store]\n" + section + "\n"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None or ctypes.util.find_library("ibverbs") is None,
                    reason="mooncake-transfer-engine-non-cuda (or libibverbs1) is not installed")
def test_a_master_started_by_serve_does_not_outlive_a_killed_gateway(tmp_path):
    """The master binds loopback only, so this runs in the host's namespace (engines off the store)."""
    import time

    import requests

    from engines_adapters.net import free_port
    from tests.servers import conductor, stop, wait_until

    cfg = tmp_path / "c.toml"
    cfg.write_text('[store]\nkind = "mooncake"\nstart_master = true\n'
                   "[embedded]\nprefill = 1\ndecode = 1\nstore = false\n")
    port = free_port()
    p = conductor("serve", "--config", str(cfg), "--port", str(port))
    try:
        wait_until(f"http://127.0.0.1:{port}/ready", p)
        master = requests.get(f"http://127.0.0.1:{port}/admin/store").json()["master"]
        assert requests.get(master["http"] + "/health", timeout=2).json()["status"] == "ok"
        if shutil.which("ss"):
            listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
            mine = [x.split()[3] for x in listening if f"pid={master['pid']}," in x]
            assert mine and all(a.startswith("127.0.0.1:") for a in mine), mine  # nothing beyond loopback
        p.kill()  # no shutdown at all: the master must still go (PR_SET_PDEATHSIG)
        p.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{master['pid']}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{master['pid']}")
    finally:
        stop(p)
