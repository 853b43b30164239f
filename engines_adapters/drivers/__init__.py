"""Engine drivers by flavour: the PD protocol, the metric names and the KV-event wire of one
engine family, behind one key. A new family (SGLang, vLLM's Mooncake connector) is a new entry
here, not an edit of the gateway.

    driver_for("vllm").open(pair, request, lifecycle)
    parse_metrics("vllm", text) -> LoadSample
    kv_event_decoder("vllm")(payload) -> (ts, [BlockStored | BlockRemoved | AllBlocksCleared], dp_rank)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines_adapters.drivers.base import (
    DecodeResponse,
    EngineHTTP,
    LoadSample,
    Pair,
    PairDriver,
    PairHooks,
    PairRequest,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from engines_adapters.drivers.sglang import SGLangDriver, parse_sglang_metrics
from engines_adapters.drivers.vllm import VLLMTwoStepDriver, parse_vllm_metrics
from engines_adapters.drivers.vllm_mooncake import VLLMMooncakeDriver
from engines_adapters.kv_wire import Event, decode_batch
from engines_adapters.sglang_wire import decode_batch as decode_sglang_batch

#: A KV-event payload frame -> (timestamp, events in the normalised (vLLM) classes, DP rank).
KVBatchDecoder = Callable[[bytes], tuple[float, list[Event], int | None]]


@dataclass(frozen=True, slots=True)
class Flavor:
    """Everything the gateway needs to speak to one engine family."""

    name: str
    driver: PairDriver
    parse_metrics: Callable[[str], LoadSample]
    decode_kv_batch: KVBatchDecoder


FLAVORS: dict[str, Flavor] = {
    "vllm": Flavor("vllm", VLLMTwoStepDriver(), parse_vllm_metrics, decode_batch),
    "sglang": Flavor("sglang", SGLangDriver(), parse_sglang_metrics, decode_sglang_batch),
    # vLLM's own MooncakeConnector: same engine surface, metrics and events as vllm, another PD protocol
    "vllm-mooncake": Flavor("vllm-mooncake", VLLMMooncakeDriver(), parse_vllm_metrics, decode_batch),
}


def flavor(name: str) -> Flavor:
    """The flavour called ``name``; ValueError naming the known ones otherwise."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(f"unknown engine flavour {name!r}; known: {', '.join(FLAVORS)}") from None


def driver_for(name: str) -> PairDriver:
    return flavor(name).driver


def parse_metrics(name: str, text: str) -> LoadSample:
    return flavor(name).parse_metrics(text)


def kv_event_decoder(name: str) -> KVBatchDecoder:
    return flavor(name).decode_kv_batch


__all__ = ["FLAVORS", "DecodeResponse", "EngineHTTP", "Flavor", "KVBatchDecoder", "LoadSample", "Pair", "PairDriver",
           "PairHooks", "PairRequest", "SGLangDriver", "UpstreamError", "UpstreamHTTPError", "UpstreamTimeout",
           "UpstreamUnavailable",
           "VLLMTwoStepDriver", "driver_for", "flavor", "kv_event_decoder", "parse_metrics"]
