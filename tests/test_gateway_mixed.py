"""One gateway in front of a vLLM pool and an SGLang pool of the same model: every request is
served by a pair of one protocol, and /admin/cluster says which engine speaks which."""
from __future__ import annotations

import pytest
import requests

from tests.servers import gateway, sim_engine

pytestmark = pytest.mark.slow


def test_a_mixed_fleet_serves_every_request_on_a_pair_of_one_protocol():
    with sim_engine("prefill") as vp, sim_engine("decode") as vd, \
            sim_engine("prefill", flavor="sglang") as sp, sim_engine("decode", flavor="sglang") as sd:
        cfg = ['policy = "round_robin"', "health_interval_s = 0.5", "[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]
        for name, e in (("vp", vp), ("vd", vd), ("sp", sp), ("sd", sd)):
            cfg += e["engine"].entry(name)
        with gateway("\n".join(cfg) + "\n") as g:
            view = {i["id"]: i for i in requests.get(g["url"] + "/admin/cluster").json()["instances"]}
            assert {k: (v["engine"], v["protocol"]) for k, v in view.items()} == {
                "vp": ("sim", "vllm"), "vd": ("sim", "vllm"), "sp": ("sim", "sglang"), "sd": ("sim", "sglang")}
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            pairs = set()
            for i in range(8):
                r = requests.post(g["url"] + "/v1/chat/completions", timeout=30, json={
                    "model": model, "messages": [{"role": "user", "content": f"mixed {i} " * 30}], "max_tokens": 3,
                    "ignore_eos": True, "stream": i % 2 == 0})
                assert r.status_code == 200, r.text
                pairs.add((r.headers["x-conductor-prefill"], r.headers["x-conductor-decode"]))
            assert pairs == {("vp", "vd"), ("sp", "sd")}
            view = requests.get(g["url"] + "/admin/cluster").json()["instances"]
            assert all(i["active_requests"] == 0 for i in view)
            # each pool's hit map is fed by its own flavour's KV-event decoder
            assert all(i["cached_blocks"]["device"] > 0 for i in view), view
