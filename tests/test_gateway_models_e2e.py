"""Several models and LoRA adapters end to end (issue 14): the gateway learns what each engine
serves from its /v1/models, lists every model and adapter, places a request only where its model
or adapter is served, and answers an unknown model with 404 and the list."""
from __future__ import annotations

import random
import threading

import pytest
import requests

from tests.servers import engine_entry, gateway, sim_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw():
    with (sim_engine("both", "--served-model-name", "base", "--lora-modules", "sql=/adapters/sql") as e1,
          sim_engine("both", "--served-model-name", "base") as e2,
          sim_engine("both", "--served-model-name", "other", "other-alias") as e3):
        cfg = []
        for name, e in (("e1", e1), ("e2", e2), ("e3", e3)):
            cfg += engine_entry(name, "both", e["url"], e["kv"], e["replay"])
        cfg.append('models = ["other"]')  # e3 also answers to other-alias: not routed there
        with gateway("\n".join(cfg) + "\n") as g:
            yield g


def ask(gw, model: str, prompt: str = "hello there") -> requests.Response:
    return requests.post(gw["url"] + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})


def test_models_lists_every_model_and_adapter_with_its_parent(gw):
    cards = {m["id"]: m for m in requests.get(gw["url"] + "/v1/models").json()["data"]}
    assert set(cards) == {"base", "sql", "other"}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["base"]["parent"] is None


def test_requests_land_only_where_their_model_or_adapter_is_served(gw):
    where = {m: {ask(gw, m, f"q{k} {m}").headers["x-conductor-prefill"] for k in range(12)}
             for m in ("sql", "other", "base")}
    assert where["sql"] == {"e1"}  # the only engine with the adapter loaded
    assert where["other"] == {"e3"}
    assert where["base"] <= {"e1", "e2"}
    r = ask(gw, "sql")
    assert r.json()["model"] == "sql"  # the engine ran it as the adapter (vLLM echoes the LoRA name)


def test_unknown_model_is_404_with_the_list(gw):
    for model in ("nope", "other-alias"):
        r = ask(gw, model)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "base, other, sql" in r.json()["error"]["message"]


def test_an_adapter_is_a_cache_namespace_of_its_own(gw):
    prompt = "".join(random.Random(31).choice("defgh ") for _ in range(2000))
    first = ask(gw, "sql", prompt)
    assert first.headers["x-conductor-prefill"] == "e1" and int(first.headers["x-conductor-hit-tokens"]) == 0
    for _ in range(200):  # e1's KV events reach the index asynchronously
        inst = {i["id"]: i for i in requests.get(gw["url"] + "/admin/cluster").json()["instances"]}
        if inst["e1"]["cached_blocks"]["device"] >= 2000 // 16:
            break
        threading.Event().wait(0.05)
    base = ask(gw, "base", prompt)  # the same tokens under the base model: none of the adapter's blocks
    assert int(base.headers["x-conductor-hit-tokens"]) == 0
    assert int(base.headers.get("x-conductor-prefill-cached-tokens", "0")) == 0
    again = ask(gw, "sql", prompt)
    assert again.headers["x-conductor-prefill"] == "e1" and int(again.headers["x-conductor-hit-tokens"]) >= 2000 - 32
