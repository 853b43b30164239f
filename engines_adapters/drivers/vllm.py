"""vLLM 0.33's two-step prefill/decode protocol (NixlConnector, and Mooncake's own
``mooncake_connector_v1``), and vLLM's metric names.

1. The prefill leg: the client's body with ``stream: false``, ``max_tokens: 1`` and
   ``kv_transfer_params.do_remote_decode: true``, read whole.
2. Its answer's ``kv_transfer_params`` say where the KV cache waits.
3. The decode leg: the client's own body with those params, streamed back.

A colocated ("both") instance gets the client's body as is: one leg. There is nothing to abort on
the prefill side when the decode leg fails: the prefill has finished, and vLLM frees KV blocks held
for a remote decode that never comes after its own timeout.
Wire details: docs/protocols.md §1 (metrics: §3).
"""
from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engines_adapters.drivers.base import (
    DecodeResponse,
    LoadSample,
    Pair,
    PairHooks,
    PairRequest,
    UpstreamHTTPError,
    metric_samples,
)

#: A decode leg refused with one of these after a prefill leg has lost (or never had) its KV.
KV_LOST = (404, 409, 410)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: same request, one token, no stream, asking the engine to keep KV for decode."""
    b = copy.copy(body)
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b.pop("stream_options", None)
    b.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens, and the leg makes one token
    b["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return b


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's own request with the prefill's transfer params."""
    b = copy.copy(body)
    if kv_transfer_params is not None:
        b["kv_transfer_params"] = kv_transfer_params
    return b


#: the samples :func:`parse_vllm_metrics` reads (the others are never parsed)
_LOAD_SAMPLES = metric_samples(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                                "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"))


def parse_vllm_metrics(text: str) -> LoadSample:
    """vLLM's request gauges summed over label sets (models, DP engines), KV usage the highest;
    older names (gpu_cache_usage_perc) accepted; the KV capacity in tokens from
    ``vllm:cache_config_info`` (num_gpu_blocks x block_size), summed over DP engines."""
    vals: dict[str, float] = {}
    capacity: int | None = None
    for fam in text_string_to_metric_families(_LOAD_SAMPLES(text)):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":  # labels carry the config; one set per DP engine
                tokens = _cache_tokens(s.labels)
                if tokens is not None:
                    capacity = (capacity or 0) + tokens
            elif s.name.endswith("_perc"):  # a ratio per engine/model series: the fullest one counts
                vals[s.name] = max(vals.get(s.name, 0.0), s.value)
            else:
                vals[s.name] = vals.get(s.name, 0.0) + s.value
    kv = vals.get("vllm:kv_cache_usage_perc", vals.get("vllm:gpu_cache_usage_perc", 0.0))
    return LoadSample(int(vals.get("vllm:num_requests_running", 0)), int(vals.get("vllm:num_requests_waiting", 0)), kv,
                      capacity)


def _cache_tokens(labels: dict[str, str]) -> int | None:
    """KV capacity in tokens from vllm:cache_config_info's labels; None when not (yet) known
    (vLLM publishes num_gpu_blocks "None" before its profiling run)."""
    try:
        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return tokens if tokens > 0 else None


class VLLMTwoStepDriver:
    """Drives a vLLM pair: prefill leg read whole, then the decode leg with its transfer params."""

    flavor = "vllm"

    async def open(self, pair: Pair, request: PairRequest, hooks: PairHooks) -> DecodeResponse:
        params = None
        if pair.colocated:
            hooks.handed_over()
        else:
            hooks.prefill_started()
            data = await pair.prefill.post_json(request.path, prefill_body(request.body), request.headers)
            try:
                answer = json.loads(data)
                params, usage = answer.get("kv_transfer_params"), answer.get("usage") or {}
            except (ValueError, AttributeError):
                raise UpstreamHTTPError(502, data, pair.prefill.id) from None
            # the prefill instance's own prefix hits
            hooks.prefill_finished((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
            store = answer.get("kv_store")  # the sim engine's store connector: what it loaded
            note = getattr(hooks, "store_loaded", None)
            if isinstance(store, dict) and note is not None:
                note(store.get("loaded_tokens"), store.get("load_s"))
        resp = await pair.decode.open(request.path, decode_body(request.body, params), request.headers)
        if resp.status != 200:
            try:
                data = await resp.read()
            except aiohttp.ClientError:
                data = b""
            finally:
                resp.close()
            raise UpstreamHTTPError(resp.status, data, pair.decode.id,
                                    kv_lost=params is not None and resp.status in KV_LOST)
        return resp
