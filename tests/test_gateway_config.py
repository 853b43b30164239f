import pytest

from gateway.config import ConfigError, load_config, parse_config


def test_default_is_embedded_2p2d():
    cfg = load_config(None)
    assert cfg.host == "127.0.0.1" and cfg.port == 8000
    assert cfg.embedded is not None and (cfg.embedded.prefill, cfg.embedded.decode) == (2, 2)
    assert cfg.engines == []


def test_example_config_parses():
    cfg = load_config("examples/conductor.toml")
    assert [e.role for e in cfg.engines] == ["prefill", "decode"]
    assert cfg.embedded is None
    assert cfg.slo.ttft_s == pytest.approx(30.0) and cfg.slo.tbt_s == pytest.approx(0.2)


@pytest.mark.parametrize("raw, words", [
    ({"engines": [{"id": "a", "role": "middle", "url": "http://x"}]}, "role"),
    ({"engines": [{"id": "a", "role": "both", "url": "x"}]}, "url"),
    ({"engines": [{"id": "a", "role": "both", "url": "http://x"}, {"id": "a", "role": "both", "url": "http://y"}]},
     "duplicate"),
    ({"bogus": 1}, "unknown key"),
    ({"slo": {"ttft_ms": -5}}, "positive"),
    ({"embedded": {"prefill": 1, "decode": 0}}, "pairs"),
    ({"tokenizer": "hf"}, "tokenizer_path"),
    # each key's type, from its field's annotation (a truthy "false" would have been obeyed as true)
    ({"port": "8000"}, "config: port must be an integer, got '8000'"),
    ({"early_rejection": "false"}, "early_rejection must be true or false"),
    ({"admission": 1}, "admission must be true or false"),
    ({"policy": 3}, "policy must be a string"),
    ({"policy_params": 5}, "policy_params must be a table"),
    ({"telemetry_path": 7}, "telemetry_path must be a string"),
    ({"embedded": {"prefill": "2"}}, "embedded: prefill must be an integer"),
    ({"engines": [{"id": "a", "role": "both", "url": "http://x", "max_model_len": 1.5}]},
     r"engines\[0\]: max_model_len must be an integer"),
    ({"store": {"timeout_s": "soon"}}, "store: timeout_s must be a number"),
    ({"slo": 5}, "slo: expected a table"),
    ({"embedded": 5}, "embedded: expected a table"),
    ({"engines": 5}, "engines: expected a list of tables"),
    ({"engines": [5]}, r"engines\[0\]: expected a table"),
])
def test_bad_config_is_one_clear_error(raw, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(raw)


def test_numbers_and_absent_values_keep_their_types():
    cfg = parse_config({"health_interval_s": 1, "telemetry_path": None, "embedded": {"time_scale": 2}})
    assert cfg.health_interval_s == 1 and cfg.telemetry_path is None and cfg.embedded.time_scale == 2


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_engines_name_a_public_deployment_and_the_prior_is_configurable():
    from predictors.analytic import Prior

    e = {"id": "a", "role": "both", "url": "http://x"}
    cfg = parse_config({"engines": [{**e, "deployment": "llama3-70b-a800x8", "kv_capacity_tokens": 1000,
                                     "max_model_len": 4096}], "prior": {"decode_mbu": 0.6}})
    eng = cfg.engines[0]
    assert (eng.deployment, eng.kv_capacity_tokens, eng.max_model_len) == ("llama3-70b-a800x8", 1000, 4096)
    assert cfg.prior == Prior(decode_mbu=0.6) and parse_config({}).prior == Prior()
    cfg = parse_config({"engines": [{**e, "profile": "llama3-70b-a800x8"}]})
    assert cfg.engines[0].deployment == "llama3-70b-a800x8"
    for raw, words in (({"engines": [{**e, "deployment": "gpt5"}]}, "engine a: unknown deployment 'gpt5'; known: "),
                       ({"engines": [{**e, "deployment": "llama3-8b-h200@time-scale-2"}]}, None),
                       ({"engines": [{**e, "deployment": "llama3-70b-a800x8", "profile": "llama3-8b-h200"}]},
                        "not both"),
                       ({"engines": [{**e, "kv_capacity_tokens": 0}]}, "positive integer"),
                       ({"prior": {"mfu": 0.5}}, "unknown key"), ({"prior": {"decode_mbu": 0}}, r"\(0, 1\]")):
        if words is None:
            parse_config(raw)  # a time-scaled deployment is a public fact too
        else:
            with pytest.raises(ConfigError, match=words):
                parse_config(raw)


def _eng(eid, role, kind="vllm", **kw):
    return {"id": eid, "role": role, "url": f"http://127.0.0.1:9/{eid}", "kind": kind, **kw}


def test_each_engine_says_which_protocol_it_speaks():
    cfg = parse_config({"engines": [_eng("p", "prefill", "sglang", bootstrap_port=9001), _eng("d", "decode", "sglang"),
                                    _eng("sp", "prefill", "sim"), _eng("sd", "decode", "sim", protocol="vllm"),
                                    _eng("gp", "prefill", "sim", protocol="sglang"), _eng("vd", "decode")]})
    assert [e.flavor for e in cfg.engines] == ["sglang", "sglang", "vllm", "vllm", "sglang", "vllm"]
    assert cfg.engines[0].bootstrap_port == 9001
    assert parse_config({"embedded": {"engine": "sglang"}}).embedded.engine == "sglang"


@pytest.mark.parametrize("engines, words", [
    ([_eng("sg-p", "prefill", "sglang"), _eng("v-d", "decode", "vllm")], r"sg-p \(sglang prefill\).*v-d \(vllm\)"),
    ([_eng("v-p", "prefill"), _eng("sg-d", "decode", "sim", protocol="sglang")], r"v-p \(vllm prefill\).*sg-d"),
    ([_eng("p", "prefill", protocol="trtllm"), _eng("d", "decode")], "protocol must be one of"),
    ([_eng("p", "prefill", "sglang", bootstrap_port=0), _eng("d", "decode", "sglang")], "bootstrap_port"),
])
def test_a_pair_that_would_mix_protocols_is_refused_naming_both(engines, words):
    with pytest.raises(ConfigError, match=words):
        parse_config({"engines": engines})
    with pytest.raises(ConfigError, match="engine must be one of"):
        parse_config({"embedded": {"engine": "trtllm"}})


def test_a_policy_parameter_naming_a_scheduler_setting_is_one_clear_error():
    """``[policy_params]`` reaches Scheduler(**params): a key naming one of its own arguments
    collided (a TypeError traceback at start-up) or, for late_rejection, was obeyed by the
    scheduler and ignored by the drivers."""
    from gateway.cluster import SCHEDULER_ARGS, build_scheduler

    assert {"admission", "clock", "late_rejection", "seed"} <= SCHEDULER_ARGS
    for name in sorted(SCHEDULER_ARGS):
        cfg = parse_config({"policy_params": {name: 1}})
        with pytest.raises(ValueError, match=name) as err:
            build_scheduler(cfg, [])
        assert ("top-level" in str(err.value)) == (name in ("admission", "block_size", "early_rejection",
                                                            "keep_decisions", "policy", "predictors",
                                                            "priority_headroom", "slo"))
    build_scheduler(parse_config({"policy_params": {"cost_eta": 2.0}}), [])  # a real parameter still goes through
