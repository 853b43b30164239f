"""Who may call the gateway (client keys, admin token, Host allow-list, header size) and the keys
and encodings the gateway uses towards its engines; in-process, no servers but loopback ones."""
from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest
from aiohttp import web

from engines_adapters.engine_client import EngineClient
from engines_adapters.sim.pd import KVParams, KVPuller, PullError, parse_peer
from engines_adapters.sim.server import api_key_middleware
from gateway.auth import SCOPE_KEY, EdgeGuard, parse_auth
from gateway.config import ConfigError, parse_config


def test_keys_come_from_the_config_and_the_environment():
    env = {"CONDUCTOR_API_KEYS": "sk-env-1, c2s3Y3JldA==", "TEAM_B": "sk-b", "CONDUCTOR_ADMIN_TOKEN": "adm-env"}
    cfg = parse_auth({"api_keys": {"team-a": {"key": "sk-a", "trust_slo_headers": True},
                                   "team-b": {"key_env": "TEAM_B"}},
                      "admin_token": "adm-file", "allowed_hosts": ["Gateway.local:8000"], "engine_api_key": "ek"}, env)
    assert {n: k.key for n, k in cfg.api_keys.items()} == {"team-a": "sk-a", "team-b": "sk-b", "env-1": "sk-env-1",
                                                         "env-2": "c2s3Y3JldA=="}  # a base64 key keeps its "="
    assert cfg.api_keys["team-a"].trust_slo_headers and not cfg.api_keys["env-1"].trust_slo_headers
    assert cfg.admin_token == "adm-env" and cfg.engine_api_key == "ek"  # the environment wins
    assert cfg.allowed_hosts == ["gateway.local:8000"]
    assert "sk-a" not in repr(cfg) and "adm" not in repr(cfg)  # secrets stay out of logs
    assert parse_auth(None, {}).api_keys == {}


@pytest.mark.parametrize("auth, env, words", [
    ({"api_keys": {"a": {"key": ""}}}, {}, "non-empty"),
    ({"api_keys": {"a": {"key": "k k"}}}, {}, "spaces"),
    ({"api_keys": {"a": {"key": "k", "quota": 5}}}, {}, "unknown"),
    ({"api_keys": {"a": {"key_env": "NOPE"}}}, {}, "unset"),
    ({"api_keys": {"a": {"key": "k"}, "b": {"key": "k"}}}, {}, "share"),
    ({"api_keys": {"env-1": {"key": "k"}}}, {"CONDUCTOR_API_KEYS": "x"}, "also in the config"),
    ({"api_keys": {"a": {"key": "k"}}}, {"CONDUCTOR_API_KEYS": "k"}, "share"),
    ({"api_keys": {"a": {"key": "k"}}, "admin_token": "k"}, {}, "differ"),
    ({"api_keys": ["k"]}, {}, "table"),
    ({"allowed_hosts": "x"}, {}, "allowed_hosts"),
    ({"bogus": 1}, {}, "unknown"),
])
def test_bad_auth_config_is_one_clear_error(auth, env, words):
    with pytest.raises(ConfigError, match=words):
        parse_config({"auth": auth}, env)


def test_engine_api_keys_per_engine_and_for_the_embedded_engines():
    cfg = parse_config({"engines": [{"id": "a", "role": "both", "url": "http://127.0.0.1:1", "api_key": "ek"}]}, {})
    assert cfg.engines[0].api_key == "ek" and "ek" not in repr(cfg.engines[0])
    cfg = parse_config({"embedded": {"extra_args": ["--noise", "0"]}}, {"CONDUCTOR_ENGINE_API_KEY": "ek2"})
    assert cfg.embedded.extra_args == ["--noise", "0", "--api-key", "ek2"]  # started demanding the key sent
    assert parse_config({}, {}).embedded.extra_args == []


def call(guard: EdgeGuard, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body or the inner scope, response headers) of one request through the guard."""
    seen: dict = {}

    async def inner(scope, receive, send):
        seen.update(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard.app = inner
    hdrs = [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "GET", "path": path, "headers": hdrs, "query_string": b""}
    out: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        out.append(msg)

    asyncio.run(guard(scope, receive, send))
    status = out[0]["status"]
    resp_headers = {k.decode(): v.decode() for k, v in out[0]["headers"]}
    return status, (json.loads(out[1]["body"]) if status != 200 else seen), resp_headers


def guard(refused: list[str] | None = None, **auth) -> EdgeGuard:
    cfg = parse_auth(auth, {})
    return EdgeGuard(None, cfg, on_refused=(refused if refused is not None else []).append)


def test_client_keys_guard_v1_and_name_the_caller():
    refused: list[str] = []
    g = guard(refused, api_keys={"team-a": {"key": "sk-a"}}, admin_token="adm")
    status, body, headers = call(g, "/v1/chat/completions")
    assert status == 401 and body["error"]["code"] == "missing_api_key" and headers["www-authenticate"] == "Bearer"
    assert body["error"]["type"] == "invalid_request_error"
    assert call(g, "/v1/models", {"Authorization": "Bearer sk-b"})[0] == 401
    assert call(g, "/v1/models", {"Authorization": "Basic sk-a"})[0] == 401
    assert call(g, "/v1/models", {"Authorization": "Bearer adm"})[0] == 401  # the admin token is no client key
    status, scope, _ = call(g, "/v1/models", {"Authorization": "Bearer sk-a"})
    assert status == 200 and scope[SCOPE_KEY].name == "team-a"
    for open_path in ("/health", "/ready", "/openapi.json"):
        assert call(g, open_path)[0] == 200
    assert refused == ["missing_api_key", "invalid_api_key", "invalid_api_key", "invalid_api_key"]


@pytest.mark.parametrize("path", ["/admin/decisions", "/admin/cluster", "/metrics"])
def test_admin_paths_need_the_admin_token(path):
    g = guard(api_keys={"team-a": {"key": "sk-a"}}, admin_token="adm")
    assert call(g, path)[0] == 401
    assert call(g, path, {"Authorization": "Bearer sk-a"})[0] == 403  # a client key is not enough
    assert call(g, path, {"Authorization": "Bearer adm"})[0] == 200
    assert call(guard(admin_token="adm"), path)[0] == 401  # an admin token alone still guards admin
    assert call(guard(api_keys={"a": {"key": "sk-a"}}), path, {"Authorization": "Bearer sk-a"})[0] == 403
    assert call(guard(), path)[0] == 200  # nothing configured: open, as before


def test_host_allow_list():
    g = guard(allowed_hosts=["gateway.local", "127.0.0.1:8000"])
    assert call(g, "/health", {"Host": "gateway.local:9999"})[0] == 200
    assert call(g, "/health", {"Host": "127.0.0.1:8000"})[0] == 200
    assert call(g, "/health", {"Host": "127.0.0.1:8001"})[0] == 400
    status, body, _ = call(g, "/v1/models", {"Host": "evil.example"})
    assert status == 400 and body["error"]["code"] == "host_not_allowed"
    assert call(g, "/health")[0] == 400  # no Host at all
    assert call(guard(), "/health", {"Host": "anything.example"})[0] == 200  # no list: any Host


def run_app(app: web.Application, body):
    """Start ``app`` on a free loopback port, run ``body(url)``, stop it."""
    async def go():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await body(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_engine_client_sends_its_key_and_never_forwards_compressed_bytes():
    seen: list[dict] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        payload = gzip.compress(json.dumps({"ok": True, "path": request.path}).encode())
        # a misbehaving engine (or a proxy in front of one) compressing whatever was asked
        return web.Response(body=payload, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_get("/health", answer)

    async def body(url):
        async with aiohttp.ClientSession(auto_decompress=False) as s:  # the gateway's session
            c = EngineClient(s, "e1", url, api_key="ek-1")
            data = await c.post_json("/v1/completions", {"prompt": "x"}, {"x-request-id": "r"})
            healthy = await c.health()
        return data, healthy

    data, healthy = run_app(app, body)
    assert json.loads(data) == {"ok": True, "path": "/v1/completions"} and healthy
    assert all(h["Authorization"] == "Bearer ek-1" and h["Accept-Encoding"] == "identity" for h in seen)


def test_sim_engine_api_key_guards_v1_like_vllm():
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[api_key_middleware("ek")])
    app.router.add_get("/v1/models", ok)
    app.router.add_get("/health", ok)

    async def body(url):
        async with aiohttp.ClientSession() as s:
            out = []
            for path, hdrs in (("/v1/models", {}), ("/v1/models", {"Authorization": "Bearer nope"}),
                               ("/v1/models", {"Authorization": "Bearer ek"}), ("/health", {})):
                async with s.get(url + path, headers=hdrs) as r:
                    out.append((r.status, await r.json()))
            return out

    assert run_app(app, body) == [(401, {"error": "Unauthorized"}), (401, {"error": "Unauthorized"}),
                                  (200, {"ok": True}), (200, {"ok": True})]


def test_sim_decode_pulls_kv_only_from_known_peers():
    puller = KVPuller(peers=frozenset({parse_peer("localhost:8100")}))
    stranger = KVParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=8101, remote_request_id="r")
    with pytest.raises(PullError) as e:
        asyncio.run(puller.pull(stranger))  # refused before any connection is tried
    assert e.value.status == 403 and e.value.code == "kv_transfer_unknown_peer"
    assert puller.known(KVParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=8100))
    assert KVPuller().known(stranger)  # no --kv-peers: any loopback prefill, as before
    for bad in ("8100", "10.0.0.1:8100", "127.0.0.1:0", "127.0.0.1:x"):
        with pytest.raises(ValueError):
            parse_peer(bad)
