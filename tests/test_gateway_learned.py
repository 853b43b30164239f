"""The gateway end to end with learned predictors: it answers, shows which model answers each
term, refuses a broken model file at reload while the old models keep serving, and reloads a
good one."""
from __future__ import annotations

import os
import time

import pytest
import requests
from learned_helpers import synth_records
from servers import gateway

from predictors.calibrate import calibrate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    good = str(tmp_path_factory.mktemp("good"))
    calibrate(synth_records(300, seed=11, noise=0.02), good, draw=False)
    bad = str(tmp_path_factory.mktemp("bad"))
    with open(os.path.join(bad, "models.json"), "w") as f:
        f.write('{"format": "conductor-learned-predictors", "version": 1, "terms": {"prefill": {"features": []')
    return good, bad


def _chat(url: str, text: str, max_tokens: int = 24) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "llama3-8b", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})


def test_gateway_serves_with_learned_predictors_and_reloads_safely(models):
    good, bad = models
    cfg = (f'predictors = "learned"\npredictor_models = "{good}"\n'
           '[embedded]\nprefill = 1\ndecode = 1\nprofile = "llama3-8b-h200-gap"\n')
    with gateway(cfg) as gw:
        url = gw["url"]
        for i in range(4):  # streamed: the gateway sees every token's time (a TBT observation)
            text = f"tell me about learned predictors, take {i} " * 20
            with requests.post(f"{url}/v1/chat/completions", timeout=60, stream=True, json={
                    "model": "llama3-8b", "stream": True, "max_tokens": 24,
                    "messages": [{"role": "user", "content": text}]}) as r:
                assert r.status_code == 200, r.text
                chunks = [line for line in r.iter_lines() if line.startswith(b"data: {")]
            assert len(chunks) > 8
        st = requests.get(f"{url}/admin/predictors", timeout=10).json()
        assert st["predictors"] == "learned" and st["source"] == os.path.abspath(good) and st["reloads"] == 0
        assert st["terms"]["prefill"]["instances"]["prefill-1"]["model"] == "group:llama3-8b-h200"
        assert st["terms"]["tbt"]["instances"]["decode-1"]["model"] == "group:llama3-8b-h200"
        assert st["ttft"]["observations"] == 4 and st["ttft"]["live_abs_error"] is not None
        assert st["terms"]["tbt"]["instances"]["decode-1"]["observations"] == 4
        tbt = st["terms"]["tbt"]["instances"]["decode-1"]  # the served p90's online tracker (live)
        assert tbt["p90_observations"] == 4 and 0 <= tbt["p90_live_coverage"] <= 1 and tbt["p90_scale"] > 0
        assert st["ttft"]["p90_observations"] == 4 and st["p90_tracking"]["q"] == 0.9
        decision = requests.get(f"{url}/admin/decisions?limit=1", timeout=10).json()["decisions"][-1]
        assert decision["outcome"] == "placed" and decision["terms"]["prefill_s"] > 0

        r = requests.post(f"{url}/admin/predictors/reload", json={"path": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_models"
        assert "previous ones keep serving" in r.json()["error"]["message"]
        st = requests.get(f"{url}/admin/predictors", timeout=10).json()
        assert st["source"] == os.path.abspath(good) and st["reloads"] == 0
        assert _chat(url, "still answering? " * 10).status_code == 200

        r = requests.post(f"{url}/admin/predictors/reload", timeout=10)  # the configured directory again
        assert r.status_code == 200 and r.json()["terms"] == ["prefill", "tbt", "transfer"]
        assert requests.get(f"{url}/admin/predictors", timeout=10).json()["reloads"] == 1
        r = requests.post(f"{url}/admin/predictors/reload", data=b"not json", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"

        # a recalibration rewrites models.json: the health poll picks it up
        path = os.path.join(good, "models.json")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text)
        os.utime(path, ns=(1, 10**18))
        deadline = time.monotonic() + 30
        while requests.get(f"{url}/admin/predictors", timeout=10).json()["reloads"] < 2:
            assert time.monotonic() < deadline, "the changed model file was not reloaded"
            time.sleep(0.2)


def test_analytic_gateway_refuses_a_reload_and_says_why():
    with gateway("[embedded]\nprefill = 1\ndecode = 1\n") as gw:
        st = requests.get(f"{gw['url']}/admin/predictors", timeout=10).json()
        assert st["predictors"] == "analytic" and st["terms"]["prefill"]["answered_by"] == "analytic"
        r = requests.post(f"{gw['url']}/admin/predictors/reload", timeout=10)
        assert r.status_code == 409 and "predictors = \"learned\"" in r.json()["error"]["message"]
