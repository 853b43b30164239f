"""Per-key tenant settings: how the key's requests share the engines' prefix caches, its
priority class and its quotas. They hang on the key's table (``[auth.api_keys.NAME]``).

Why isolation: a prefix cache shared across tenants is a timing side channel. A request whose
prompt starts like another tenant's gets a faster first token (its prefix is cached), so a
client can probe, a token block at a time, what others have sent (a system prompt, a document).
vLLM and SGLang close it with ``cache_salt``: only requests with the same salt share blocks.
``isolated`` has the gateway set the salt itself, from a secret and the key's name, so a client
can neither opt out nor guess another tenant's salt.
"""
from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, field
from typing import Any

from gateway.quotas import Limits

CACHE_MODES = ("shared", "isolated", "client")
#: priority class -> fraction of the SLO its requests are admitted up to (the scheduler's
#: ``priority_headroom``); the class names follow the Gateway API inference extension's criticality
DEFAULT_PRIORITY_HEADROOM = {"critical": 1.0, "standard": 1.0, "sheddable": 0.5}
DEFAULT_PRIORITY = "standard"
_LIMITS = ("requests_per_minute", "tokens_per_minute", "request_burst", "token_burst")
FIELDS = ("cache", "priority", "max_concurrent", *_LIMITS)


@dataclass(frozen=True)
class Tenant:
    """``cache``: ``shared`` (no salt: the client's is dropped), ``isolated`` (the gateway's
    per-key salt, overriding the client's) or ``client`` (the client's own, if any: the default)."""

    cache: str = "client"
    priority: str = DEFAULT_PRIORITY
    limits: Limits = field(default_factory=Limits)


def parse_tenant(where: str, entry: dict[str, Any]) -> Tenant:
    """Take the tenant settings out of a key's table (``entry`` keeps the rest); ValueError."""
    raw = {k: entry.pop(k) for k in FIELDS if k in entry}
    cache = raw.pop("cache", "client")
    if cache not in CACHE_MODES:
        raise ValueError(f"{where}.cache: must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    priority = raw.pop("priority", DEFAULT_PRIORITY)
    if not isinstance(priority, str) or not priority:
        raise ValueError(f"{where}.priority: must be a priority class name, got {priority!r}")
    for k in _LIMITS:
        v = raw.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            raise ValueError(f"{where}.{k}: must be a positive number, got {v!r}")
    mc = raw.get("max_concurrent")
    if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc <= 0):
        raise ValueError(f"{where}.max_concurrent: must be a positive integer, got {mc!r}")
    for burst, rate in (("request_burst", "requests_per_minute"), ("token_burst", "tokens_per_minute")):
        if burst in raw and rate not in raw:
            raise ValueError(f"{where}.{burst}: needs {rate}")
    return Tenant(cache, priority, Limits(**raw))


def isolated_salt(secret: bytes, key_name: str) -> str:
    """The ``cache_salt`` of an isolated key: stable for a secret, unguessable without it."""
    return hmac.new(secret, b"conductor-cache-salt\x00" + key_name.encode(), hashlib.sha256).hexdigest()[:32]


def request_salt(tenant: Tenant | None, key_name: str | None, client_salt: str | None, secret: bytes) -> str | None:
    """The salt a request runs under, by its key's cache mode (no key: the client's)."""
    if tenant is None or tenant.cache == "client":
        return client_salt
    if tenant.cache == "shared":
        return None
    assert key_name is not None
    return isolated_salt(secret, key_name)


def apply_salt(body: dict[str, Any], tenant: Tenant | None, key_name: str | None, secret: bytes) -> str | None:
    """Set the body's ``cache_salt`` (what the engines namespace their caches by) to the one the
    key's mode gives, and return it (the gateway hashes the prompt within it too)."""
    salt = request_salt(tenant, key_name, body.get("cache_salt"), secret)
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt
    return salt
