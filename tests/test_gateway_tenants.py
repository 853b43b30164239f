"""Per-key tenant settings (gateway/tenants.py): parsing, salts by cache mode, priority classes
in the config, and /admin/decisions filtered by tenant, model, adapter."""
from __future__ import annotations

import json

import pytest

from gateway.admin import NumberedLog, decisions_page
from gateway.config import ConfigError, parse_config
from gateway.quotas import Limits
from gateway.tenants import Tenant, apply_salt, isolated_salt


def keys(**tables):
    return {"auth": {"admin_token": "adm", "api_keys": tables}}


def test_key_tables_carry_cache_mode_priority_and_limits():
    cfg = parse_config(keys(a={"key": "ka", "cache": "isolated", "priority": "critical",
                               "requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 4},
                            b={"key": "kb"}), {})
    a, b = cfg.auth.api_keys["a"].tenant, cfg.auth.api_keys["b"].tenant
    assert a == Tenant("isolated", "critical", Limits(60, 1000, None, None, 4))
    assert b == Tenant() and b.cache == "client" and b.priority == "standard" and not b.limits.limited()
    assert cfg.priority_headroom == {"critical": 1.0, "standard": 1.0, "sheddable": 0.5}
    cfg = parse_config({**keys(a={"key": "ka", "priority": "batch"}), "priority_headroom": {"batch": 0.3}}, {})
    assert cfg.priority_headroom["batch"] == 0.3 and cfg.priority_headroom["critical"] == 1.0


@pytest.mark.parametrize("table, words", [
    ({"cache": "private"}, "cache: must be one of shared, isolated, client"),
    ({"priority": "vip"}, "unknown class 'vip'"),
    ({"requests_per_minute": 0}, "positive number"),
    ({"tokens_per_minute": True}, "positive number"),
    ({"max_concurrent": 1.5}, "positive integer"),
    ({"request_burst": 5}, "needs requests_per_minute"),
    ({"tenant": "x"}, "unknown"),
])
def test_bad_tenant_settings_are_one_clear_error(table, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(keys(a={"key": "ka", **table}), {})


def test_bad_priority_headroom_is_refused():
    with pytest.raises(ConfigError, match="priority_headroom"):
        parse_config({"priority_headroom": {"sheddable": 2.0}}, {})


def test_salt_by_cache_mode():
    secret = b"s"
    body = {"cache_salt": "mine"}
    assert apply_salt(body, Tenant("client"), "a", secret) == "mine" and body["cache_salt"] == "mine"
    assert apply_salt(body, Tenant("shared"), "a", secret) is None and "cache_salt" not in body
    body = {"cache_salt": "mine"}
    salt = apply_salt(body, Tenant("isolated"), "a", secret)
    assert salt == body["cache_salt"] == isolated_salt(secret, "a") != "mine"
    assert isolated_salt(secret, "b") != salt and isolated_salt(b"other", "a") != salt  # per key, per secret
    assert apply_salt({}, None, None, secret) is None  # no key: the client's (none here)


def test_decisions_filter_by_tenant_model_adapter_with_a_cursor():
    log = NumberedLog(maxlen=100)
    for i in range(60):
        log.append({"request_id": f"r{i}", "tenant": "ab"[i % 2], "model": "m", "outcome": "placed",
                    **({"adapter": "sql"} if i % 3 == 0 else {})})

    def page(**q):
        return json.loads(decisions_page(log, {k: str(v) for k, v in q.items()}).body)

    a = page(tenant="a", limit=10)
    assert [d["seq"] for d in a["decisions"]] == list(range(40, 60, 2)) and a["next_before"] == 40
    older = page(tenant="a", limit=10, before=a["next_before"])
    assert [d["seq"] for d in older["decisions"]] == list(range(20, 40, 2))
    last = page(tenant="a", limit=10, before=older["next_before"])
    assert [d["seq"] for d in last["decisions"]] == list(range(0, 20, 2)) and last["next_before"] is None
    both = page(tenant="b", adapter="sql", limit=100)["decisions"]
    assert [d["seq"] for d in both] == [i for i in range(60) if i % 2 == 1 and i % 3 == 0]
    assert page(tenant="nobody")["decisions"] == [] and page(model="m", limit=5)["next_before"] == 55


def test_engines_models_narrow_what_is_routed_to_them():
    from gateway.cluster import Cluster

    engines = [{"id": "a", "role": "both", "url": "http://127.0.0.1:1", "models": ["base"]},
               {"id": "b", "role": "both", "url": "http://127.0.0.1:2"}]
    cfg = parse_config({"engines": engines}, {})
    cluster = Cluster(cfg, cfg.engines)
    try:
        listed = [{"id": "base"}, {"id": "sql", "parent": "base"}]
        assert [m["id"] for m in cluster._routed_cards("a", listed)] == ["base"]
        assert [m["id"] for m in cluster._routed_cards("b", listed)] == ["base", "sql"]
        sched = cluster.scheduler
        assert sched.serves("a", "base") and not sched.serves("a", "sql") and sched.serves("b", "sql")
        cluster._routed_cards("a", [])  # no answer: keeps what it served
        assert sched.serves("a", "base")
        cluster._routed_cards("a", [{"id": "other"}])  # lists none of its configured names: serves nothing
        assert not sched.serves("a", "base") and not sched.serves("a", "other")
    finally:
        cluster._zmq.term()
    with pytest.raises(ConfigError, match="models must be a non-empty list"):
        parse_config({"engines": [{**engines[0], "models": []}]}, {})
