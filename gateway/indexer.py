"""The Mooncake Conductor indexer API, served from the gateway's own hit index, so a router built
for Mooncake's indexer can ask ours (docs: Mooncake ``docs/source/api-reference/http/
conductor-indexer.md``; shapes in docs/store.md):

* ``POST /query`` ``{model, token_ids, block_size, tenant_id?, instance_id?, lora_name?, cache_salt?}``
  -> ``{tenant: {instance_id: {longest_matched, GPU, CPU, DISK, DP: {"0": n}}}}``, tokens of the
  longest contiguous prefix of complete blocks per medium (GPU: the instance's device; CPU: device
  or host memory; DISK: 0, no instance here has a disk tier). The shared store appears as one more
  instance (``[store]``'s name, ``store`` by default) whose hits are CPU: a Mooncake store is a
  pool of host DRAM;
* ``POST /query_by_hash`` ``{..., seq_hashes | block_hash}``: the same for RFC #1527 rolling
  sequence hashes (XXH3-64, seed 1337). A hash cannot be inverted: it is answered for prefixes
  whose tokens the gateway has seen (proxied prompts and ``/query`` calls), otherwise no match;
* ``POST /register`` / ``/unregister``: KV-event publishers (vLLM or SGLang) subscribed to and
  indexed under their ``instance_id`` (not routable: the gateway routes to its configured engines).

Our index is per block size and namespace-blind: another ``block_size`` is a 400; a non-empty
``lora_name`` or ``cache_salt``, or a tenant other than ``default``, finds nothing (never a false hit).
Malformed bodies get a 400 naming the field.
"""
from __future__ import annotations

import ipaddress
import json
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import xxhash
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engines_adapters.kv_events import KVEventSubscriber
from gateway.errors import error_response
from scheduler.hashing import block_hashes

RFC_SEED = 1337
DEFAULT_TENANT = "default"
PUBLISHER_TYPES = ("vLLM", "SGLang", "Mooncake")


def rfc1527_seq_hashes(tokens: list[int], block_size: int) -> list[int]:
    """RFC #1527 rolling sequence hashes of every complete block (XXH3-64, seed 1337)."""
    out: list[int] = []
    prev = None
    n = len(tokens) // block_size
    data = array("I", tokens[:n * block_size])
    if sys.byteorder != "little":
        data.byteswap()
    raw = data.tobytes()
    step = 4 * block_size
    for i in range(n):
        local = xxhash.xxh3_64_intdigest(raw[i * step:(i + 1) * step], seed=RFC_SEED)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + local.to_bytes(8, "little"), seed=RFC_SEED)
        out.append(prev)
    return out


class BadField(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _str(body: dict, key: str, required: bool = False, default: str | None = None) -> str | None:
    v = body.get(key)
    if v is None:
        if required:
            raise BadField(key, f"{key} is required")
        return default
    if not isinstance(v, str):
        raise BadField(key, f"{key} must be a string")
    return v


def _int(body: dict, key: str, required: bool = True, minimum: int = 0) -> int | None:
    v = body.get(key)
    if v is None:
        if required:
            raise BadField(key, f"{key} is required")
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise BadField(key, f"{key} must be an integer >= {minimum}")
    return v


def _u64_list(body: dict, key: str, what: str) -> list[int]:
    v = body.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64
                                          for x in v):
        raise BadField(key, f"{key} must be a list of {what}")
    return v


class Indexer:
    """The indexer API over a cluster (gateway.cluster.Cluster) and its scheduler's hit index."""

    def __init__(self, cluster: Any, block_size: int, store_name: str = "store", max_seq_hashes: int = 1 << 20):
        self.cluster, self.block_size, self.store_name = cluster, block_size, store_name
        self._by_seq: OrderedDict[int, int] = OrderedDict()  # RFC seq hash -> our index hash
        self.max_seq_hashes = max_seq_hashes
        self._registered: dict[str, tuple[str, KVEventSubscriber]] = {}  # "id|tenant|dp" -> (instance, sub)
        self.remember_prompts = False  # set by the first /query_by_hash: the proxy then maps its prompts too

    def routes(self) -> list[tuple[str, Callable]]:
        return [("/query", self.query), ("/query_by_hash", self.query_by_hash), ("/register", self.register),
                ("/unregister", self.unregister)]

    # --- helpers ---------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadField("body", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise BadField("body", "the body must be a JSON object")
        return body

    def remember(self, tokens: list[int], hashes: list[int]) -> None:
        """Map RFC #1527 sequence hashes of a prompt to our index hashes (for /query_by_hash)."""
        seq = rfc1527_seq_hashes(tokens[:len(hashes) * self.block_size], self.block_size)
        m = self._by_seq
        m.update(zip(seq, hashes, strict=True))
        while len(m) > self.max_seq_hashes:
            m.popitem(last=False)

    def _scope(self, body: dict) -> tuple[str, str | None, bool]:
        """(tenant, instance filter, whether the namespace is one the index can answer)."""
        _str(body, "model", required=True)
        bs = _int(body, "block_size", minimum=1)
        if bs != self.block_size:
            raise BadField("block_size", f"block_size {bs}: this index holds blocks of {self.block_size} tokens")
        lora = _str(body, "lora_name")
        if lora and body.get("lora_id") is not None:
            raise BadField("lora_id", "give lora_name or the deprecated lora_id, not both")
        salt = _str(body, "cache_salt")
        tenant = _str(body, "tenant_id", default=DEFAULT_TENANT) or DEFAULT_TENANT
        instance = _str(body, "instance_id")
        namespaced = bool(lora) or bool(salt) or body.get("lora_id") is not None or tenant != DEFAULT_TENANT
        return tenant, instance, not namespaced

    def _answer(self, tenant: str, instance: str | None, hashes: list[int], usable: int) -> dict:
        bs = self.block_size
        index = self.cluster.scheduler.index
        m = index.match(hashes, usable)
        held = index.match_held(hashes, usable)  # CPU: device, host, or what it wrote to the store
        ids = list(self.cluster.engines) + [r[0] for r in self._registered.values()]
        out: dict[str, dict] = {}
        for iid in ids:
            if instance is not None and iid != instance:
                continue
            gpu, cpu = m.device.get(iid, 0) * bs, held.get(iid, 0) * bs
            out[iid] = {"longest_matched": max(gpu, cpu), "GPU": gpu, "CPU": cpu, "DISK": 0,
                        "DP": {"0": max(gpu, cpu)}}
        tier = self.cluster.store_tier
        if instance in (None, self.store_name) and (tier is not None or m.store):
            store = m.store * bs
            out[self.store_name] = {"longest_matched": store, "GPU": 0, "CPU": store, "DISK": 0, "DP": {"0": store}}
        return {tenant: out}

    # --- routes ------------------------------------------------------------------------------------
    async def query(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            tenant, instance, ok = self._scope(body)
            tokens = _u64_list(body, "token_ids", "token ids (non-negative integers)")
        except BadField as e:
            return error_response(400, str(e), "invalid_parameter", e.field)
        if not ok:
            return JSONResponse({tenant: {}})
        hashes = block_hashes(tokens, self.block_size)
        self.remember(tokens, hashes)
        ans = self._answer(tenant, instance, hashes, len(hashes))
        tier = self.cluster.store_tier
        if tier is not None and self.store_name in ans[tenant] and hashes:  # the store tier knows more than events
            n = await tier.lookup(tokens, hashes, len(hashes))
            if n:
                entry = ans[tenant][self.store_name]
                entry["longest_matched"] = entry["CPU"] = entry["DP"]["0"] = max(entry["CPU"], n * self.block_size)
        return JSONResponse(ans)

    async def query_by_hash(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            tenant, instance, ok = self._scope(body)
            key = "seq_hashes" if "seq_hashes" in body else "block_hash"
            seq = _u64_list(body, key, "unsigned 64-bit rolling sequence hashes")
        except BadField as e:
            return error_response(400, str(e), "invalid_parameter", e.field)
        self.remember_prompts = True
        if not ok:
            return JSONResponse({tenant: {}})
        hashes = []
        for s in seq:  # hashes the gateway cannot map end the prefix, like a miss
            h = self._by_seq.get(s)
            if h is None:
                break
            hashes.append(h)
        return JSONResponse(self._answer(tenant, instance, hashes, len(hashes)))

    def _identity(self, body: dict) -> tuple[str, str, str]:
        iid = _str(body, "instance_id", required=True)
        if not iid:
            raise BadField("instance_id", "instance_id must not be empty")
        tenant = _str(body, "tenant_id", default=DEFAULT_TENANT) or DEFAULT_TENANT
        dp = _int(body, "dp_rank")
        typ = _str(body, "type", required=True)
        if typ not in PUBLISHER_TYPES:
            raise BadField("type", f"type must be one of {', '.join(PUBLISHER_TYPES)}")
        _str(body, "modelname", required=True)
        bs = _int(body, "block_size", minimum=1)
        if bs != self.block_size:
            raise BadField("block_size", f"block_size {bs}: this index holds blocks of {self.block_size} tokens")
        return f"{iid}|{tenant}|{dp}", iid, typ

    async def register(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            key, iid, typ = self._identity(body)
            endpoint = _str(body, "endpoint", required=True) or ""
            host, port = _loopback_tcp(endpoint)
            replay = _str(body, "replay_endpoint")
            if replay:
                _loopback_tcp(replay, "replay_endpoint")
            for f in ("lora_name", "additionalsalt"):
                _str(body, f)
        except BadField as e:
            return error_response(400, str(e), "invalid_parameter", e.field)
        if typ == "Mooncake":
            tier = self.cluster.store_tier
            if tier is None or tier.cfg.kv_events != endpoint:
                return error_response(400, "type Mooncake: the store's event publisher is configured in the gateway's "
                                           "[store] kv_events, not registered at run time", "invalid_parameter", "type")
            return JSONResponse({"status": "registered successfully", "instance_id": iid})
        if iid in self.cluster.engines:
            configured = self.cluster.engines[iid].kv_events
            if configured and urlsplit(configured).port == port:
                return JSONResponse({"status": "registered successfully", "instance_id": iid})
            return error_response(409, f"instance_id {iid!r} is a configured engine with its own KV events",
                                  "conflict", "instance_id")
        if key in self._registered:
            return error_response(409, f"{key} is already registered", "conflict", "instance_id")
        index = self.cluster.scheduler.index
        index.register(iid)
        # the publisher binds (it is registered by address): our subscriber connects to it
        sub = KVEventSubscriber(self.cluster._zmq, iid, f"tcp://*:{port}", index, engine_url=f"http://{host}",
                                replay_endpoint=replay or None)
        try:
            sub.open()
        except Exception as e:  # noqa: BLE001 - a socket error is the client's endpoint
            index.unregister(iid)
            return error_response(400, f"endpoint: cannot subscribe: {e}", "invalid_parameter", "endpoint")
        self._registered[key] = (iid, sub)
        self.cluster.watch_subscriber(sub)
        return JSONResponse({"status": "registered successfully", "instance_id": iid})

    async def unregister(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            key, iid, _typ = self._identity(body)
        except BadField as e:
            return error_response(400, str(e), "invalid_parameter", e.field)
        got = self._registered.pop(key, None)
        if got is None:
            return JSONResponse({"status": "unregistered successfully", "removed_instances": []})
        self.cluster.unwatch_subscriber(got[1])
        if not any(r[0] == iid for r in self._registered.values()):
            self.cluster.scheduler.index.unregister(iid)
        return JSONResponse({"status": "unregistered successfully", "removed_instances": [key]})


def _loopback_tcp(endpoint: str, field: str = "endpoint") -> tuple[str, int]:
    """(host, port) of a tcp:// endpoint on loopback (this gateway talks to nothing else)."""
    u = urlsplit(endpoint)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None:
        raise BadField(field, f"{field} must be tcp://HOST:PORT, got {endpoint!r}")
    try:
        if not (u.hostname == "localhost" or ipaddress.ip_address(u.hostname).is_loopback):
            raise BadField(field, f"{field} {endpoint}: only loopback publishers are subscribed to")
    except ValueError:
        raise BadField(field, f"{field} {endpoint}: not an IP address") from None
    return u.hostname, port
