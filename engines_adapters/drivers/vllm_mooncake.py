"""vLLM 0.33's in-tree MooncakeConnector (bootstrap server + transfer ids), driven by dual dispatch.

Per request the gateway mints ``transfer_id = "xfer-" + uuid``, learns the prefill engine's id
from its bootstrap server (``GET http://<prefill host>:<bootstrap_port>/query`` ->
``{"<dp_rank>": {"engine_id", "worker_addr"}}``, once per prefill instance; the port is
``VLLM_MOONCAKE_BOOTSTRAP_PORT``, default 8998), and sends both legs at once:

* prefill: the client's body with ``stream: false``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1``), no ``stream_options``, and ``kv_transfer_params =
  {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}``; its answer carries
  no params (the prefill holds the KV under T), only its usage;
* decode: the client's own body with ``{"do_remote_decode": false, "do_remote_prefill": true,
  "transfer_id": T, "remote_engine_id": <that engine id>, "remote_bootstrap_addr":
  "http://<prefill host>:<bootstrap_port>"}``, streamed back.

Failure semantics are :mod:`.dual`'s. An engine id that the prefill no longer serves (it
restarted) is forgotten, so the next request asks its bootstrap server again.
Wire details: docs/protocols.md §6.
"""
from __future__ import annotations

import copy
import uuid
from typing import Any
from urllib.parse import urlsplit

from engines_adapters.drivers.base import DecodeResponse, Pair, PairHooks, PairRequest, UpstreamUnavailable
from engines_adapters.drivers.dual import dual_dispatch, one_leg
from engines_adapters.drivers.vllm import prefill_body

DEFAULT_BOOTSTRAP_PORT = 8998


def mooncake_prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    b = prefill_body(body)
    b["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    return b


def mooncake_decode_body(body: dict[str, Any], transfer_id: str, engine_id: str, bootstrap: str) -> dict[str, Any]:
    b = copy.copy(body)
    b["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
                               "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap}
    return b


class VLLMMooncakeDriver:
    flavor = "vllm-mooncake"

    def __init__(self) -> None:
        self._engine_ids: dict[str, str] = {}  # bootstrap address -> the prefill engine's id (dp rank 0)

    async def engine_id(self, pair: Pair, bootstrap: str) -> str:
        eid = self._engine_ids.get(bootstrap)
        if eid is None:
            get_json = getattr(pair.prefill, "get_json", None)
            if get_json is None:
                raise UpstreamUnavailable(f"engine {pair.prefill.id}: no way to query {bootstrap}", pair.prefill.id)
            ranks = await get_json(bootstrap + "/query")
            try:
                eid = str(ranks["0"]["engine_id"]) if "0" in ranks else str(next(iter(ranks.values()))["engine_id"])
            except (KeyError, TypeError, StopIteration, AttributeError):
                raise UpstreamUnavailable(f"engine {pair.prefill.id}: {bootstrap}/query answered no engine: "
                                          f"{str(ranks)[:200]}", pair.prefill.id) from None
            self._engine_ids[bootstrap] = eid
        return eid

    async def open(self, pair: Pair, request: PairRequest, hooks: PairHooks) -> DecodeResponse:
        if pair.colocated:
            return await one_leg(pair, request.path, request.body, request.headers, hooks)
        host = urlsplit(pair.prefill.url).hostname or "127.0.0.1"
        port = getattr(pair.prefill, "bootstrap_port", None) or DEFAULT_BOOTSTRAP_PORT
        bootstrap = f"http://{host}:{port}"
        eid = await self.engine_id(pair, bootstrap)
        tid = f"xfer-{uuid.uuid4()}"
        try:
            return await dual_dispatch(pair, request.path, mooncake_prefill_body(request.body, tid),
                                       mooncake_decode_body(request.body, tid, eid, bootstrap), request.headers, hooks)
        except Exception:
            self._engine_ids.pop(bootstrap, None)  # the prefill may have restarted under a new engine id
            raise
