"""Who may talk to the gateway: client API keys for ``/v1/*``, a separate admin token for
``/admin/*`` and ``/metrics``, a Host-header allow-list, and the keys the gateway itself shows
its engines. All optional: with none configured the gateway is open, as on loopback by default.

Keys are a table per key, named (``[auth.api_keys.NAME]``), so per-key settings (today
``trust_slo_headers``; later tenants, quotas, priorities) hang on the key they belong to.
Checked by :class:`EdgeGuard`, a plain ASGI middleware, before a route runs or a body is read.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import error_response
from gateway.tenants import Tenant, parse_tenant

ENV_API_KEYS = "CONDUCTOR_API_KEYS"  # comma-separated keys, named env-1, env-2, ...
ENV_ADMIN_TOKEN = "CONDUCTOR_ADMIN_TOKEN"
ENV_ENGINE_API_KEY = "CONDUCTOR_ENGINE_API_KEY"
ENV_CACHE_SALT_SECRET = "CONDUCTOR_CACHE_SALT_SECRET"  # isolated keys' salts derive from it (gateway/tenants.py)
#: the scope key under which a request's :class:`ApiKey` reaches the handler (absent: auth is off)
SCOPE_KEY = "conductor.api_key"
OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json"})  # probes and the API description


class AuthConfigError(ValueError):
    """A bad ``[auth]`` section or auth environment variable (one line)."""


@dataclass
class ApiKey:
    """One client key and what its holder may do."""

    name: str
    key: str = field(repr=False)
    trust_slo_headers: bool = False  # take x-slo-* headers as given, even looser than the configured SLOs
    tenant: Tenant = field(default_factory=Tenant)  # cache isolation, priority class, quotas


@dataclass
class AuthConfig:
    api_keys: dict[str, ApiKey] = field(default_factory=dict)  # by name
    admin_token: str | None = field(default=None, repr=False)
    allowed_hosts: list[str] = field(default_factory=list)  # empty: any Host
    engine_api_key: str | None = field(default=None, repr=False)  # default for engines without their own
    # isolated keys' cache salts derive from it; None: a random one per gateway process
    cache_salt_secret: str | None = field(default=None, repr=False)


def _secret(where: str, v: Any) -> str:
    if not isinstance(v, str) or not v or any(c.isspace() or c == "," for c in v):
        raise AuthConfigError(f"{where}: must be a non-empty string without spaces or commas")
    return v


def parse_auth(raw: Any, environ: Mapping[str, str] | None = None) -> AuthConfig:
    """The ``[auth]`` table merged with the environment (``CONDUCTOR_API_KEYS`` adds keys,
    ``CONDUCTOR_ADMIN_TOKEN`` and ``CONDUCTOR_ENGINE_API_KEY`` replace the file's)."""
    environ = os.environ if environ is None else environ
    if raw is not None and not isinstance(raw, dict):
        raise AuthConfigError("auth: expected a table")
    raw = dict(raw or {})
    known = {"api_keys", "admin_token", "allowed_hosts", "engine_api_key", "cache_salt_secret"}
    if set(raw) - known:
        raise AuthConfigError(f"auth: unknown key(s) {', '.join(sorted(set(raw) - known))}")
    cfg = AuthConfig()
    keys = raw.get("api_keys", {})
    if not isinstance(keys, dict):
        raise AuthConfigError("auth.api_keys: expected one table per key, [auth.api_keys.NAME] with key = ...")
    for name, entry in keys.items():
        where = f"auth.api_keys.{name}"
        if not isinstance(entry, dict):
            raise AuthConfigError(f"{where}: expected a table with key = \"...\" (or key_env = \"VAR\")")
        entry = dict(entry)
        if "key_env" in entry:
            var = entry.pop("key_env")
            if "key" in entry or not isinstance(var, str) or var not in environ:
                raise AuthConfigError(f"{where}: key_env names an unset variable (or key is also given)")
            entry["key"] = environ[var]
        try:
            if "tenant" in entry:
                raise ValueError(f"{where}: unknown key(s) tenant")
            entry["tenant"] = parse_tenant(where, entry)
        except ValueError as e:
            raise AuthConfigError(str(e)) from None
        unknown = set(entry) - set(ApiKey.__dataclass_fields__) - {"name"}
        if unknown:
            raise AuthConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        if not isinstance(entry.get("trust_slo_headers", False), bool):
            raise AuthConfigError(f"{where}: trust_slo_headers must be true or false")
        entry["name"] = name
        entry["key"] = _secret(f"{where}.key", entry.get("key"))
        cfg.api_keys[name] = ApiKey(**entry)
    for i, key in enumerate(k.strip() for k in environ.get(ENV_API_KEYS, "").split(",") if k.strip()):
        name = f"env-{i + 1}"  # a key with a name of its own: [auth.api_keys.NAME] key_env = "VAR"
        if name in cfg.api_keys:
            raise AuthConfigError(f"{ENV_API_KEYS}: key name {name!r} is also in the config")
        cfg.api_keys[name] = ApiKey(name, _secret(f"{ENV_API_KEYS} entry {i + 1}", key))
    if len({k.key for k in cfg.api_keys.values()}) != len(cfg.api_keys):
        raise AuthConfigError("auth.api_keys: two names share one key (a key must say who holds it)")
    for attr, var in (("admin_token", ENV_ADMIN_TOKEN), ("engine_api_key", ENV_ENGINE_API_KEY),
                      ("cache_salt_secret", ENV_CACHE_SALT_SECRET)):
        v = environ.get(var) or raw.get(attr)
        setattr(cfg, attr, None if v is None else _secret(f"auth.{attr} ({var})", v))
    if cfg.admin_token is not None and cfg.admin_token in {k.key for k in cfg.api_keys.values()}:
        raise AuthConfigError("auth.admin_token: must differ from every client key")
    hosts = raw.get("allowed_hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise AuthConfigError("auth.allowed_hosts: expected a list of host or host:port strings")
    cfg.allowed_hosts = [h.lower() for h in hosts]
    return cfg


def _digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


#: Paths outside /admin/ behind the admin token: metrics, and the Mooncake Conductor indexer API
#: (gateway/indexer.py: it shows what every instance caches, and /register subscribes to publishers).
ADMIN_PATHS = frozenset(("/admin", "/metrics", "/query", "/query_by_hash", "/register", "/unregister"))


class EdgeGuard:
    """ASGI middleware refusing, before any route runs or a body is read: a Host not on the
    allow-list (400), ``/v1/*`` without a client key (401), ``/admin/*`` and
    ``/metrics`` without the admin token (401 without credentials, 403 with the wrong ones).
    Keys are compared by their SHA-256 digest (a dictionary look-up, whatever the number of keys).
    ``on_refused(reason)`` counts each refusal (the gateway's metrics)."""

    def __init__(self, app: Any, auth: AuthConfig, on_refused: Callable[[str], None] = lambda reason: None):
        self.app, self.on_refused = app, on_refused
        self.keys = {_digest(k.key): k for k in auth.api_keys.values()}
        self.admin = None if auth.admin_token is None else _digest(auth.admin_token)
        self.hosts = frozenset(auth.allowed_hosts)
        # admin paths close when clients need keys but no admin token is set: a client key is no admin
        self.admin_open = self.admin is None and not self.keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.check(scope)
            if refusal is not None:
                status, message, code = refusal
                self.on_refused(code)
                headers = {"www-authenticate": "Bearer"} if status == 401 else None
                await error_response(status, message, code, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: dict) -> tuple[int, str, str] | None:
        host = authz = None
        for k, v in scope["headers"]:
            if k == b"host":
                host = v
            elif k == b"authorization":
                authz = v
        if self.hosts and not self._host_ok(host):
            return 400, "the Host header names no host this gateway serves", "host_not_allowed"
        path = scope["path"]
        if path.startswith("/v1/"):
            if not self.keys:
                return None
            if authz is None:
                return 401, "missing API key: send 'Authorization: Bearer <key>'", "missing_api_key"
            key = self.keys.get(_digest(_bearer(authz)))
            if key is None:
                return 401, "invalid API key", "invalid_api_key"
            scope[SCOPE_KEY] = key
        elif path.startswith("/admin/") or path in ADMIN_PATHS:
            if self.admin_open:
                return None
            if self.admin is None:
                return 403, "admin endpoints are closed: client keys are set but no admin token", "admin_disabled"
            if authz is None:
                return 401, "missing admin token: send 'Authorization: Bearer <admin token>'", "missing_admin_token"
            if _digest(_bearer(authz)) != self.admin:
                return 403, "not the admin token", "invalid_admin_token"
        return None

    def _host_ok(self, host: bytes | None) -> bool:
        if host is None:
            return False
        h = host.decode("latin-1").lower()
        if h in self.hosts:
            return True
        name = h.rsplit(":", 1)[0] if not h.endswith("]") else h  # "[::1]:8000" -> "[::1]"
        return name in self.hosts


def _bearer(authz: bytes) -> bytes:
    scheme, _, token = authz.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
