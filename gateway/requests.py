"""Validating and tokenizing a client request before the scheduler sees it.

The body is kept as the client's own dict so unknown (engine-specific) fields pass through
untouched; only the fields the gateway must understand are checked here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engines_adapters.tokenizer import ByteTokenizer, ChatTemplateError
from gateway.errors import RequestError
from predictors.telemetry import SLO


@dataclass
class ParsedRequest:
    body: dict[str, Any]
    endpoint: str  # "chat" | "completions"
    model: str
    stream: bool
    max_tokens: int


def parse_body(raw: bytes, endpoint: str, default_max_tokens: int) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required and must be a string", "missing_field", "model")
    if endpoint == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(400, "'messages' is required and must be a non-empty list", "missing_field", "messages")
    elif "prompt" not in body:
        raise RequestError(400, "'prompt' is required", "missing_field", "prompt")
    stream = body.get("stream")
    stream = False if stream is None else stream  # null means the default, as in OpenAI's API
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "invalid_field", "stream")
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError(400, "only n=1 is supported through disaggregated serving", "invalid_field", "n")
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):  # vLLM: max_completion_tokens wins
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise RequestError(400, f"'{key}' must be a positive integer", "invalid_field", key)
        max_tokens = v if max_tokens is None else max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    return ParsedRequest(body, endpoint, model, stream, max_tokens)


def cache_salt(req: ParsedRequest) -> str | None:
    """The request's ``cache_salt`` (vLLM's per-request prefix-cache namespace: only requests with
    the same salt share cached blocks), checked as vLLM checks it. It stays in the body, so the
    engines get it too; the gateway folds it into its own block hashes (``namespace_parent``)."""
    salt = req.body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(400, "'cache_salt' must be a non-empty string if provided", "invalid_field", "cache_salt")
    return salt


def builtin_tokens(req: ParsedRequest, tokenizer: ByteTokenizer) -> list[int]:
    try:
        if req.endpoint == "chat":
            return tokenizer.encode_chat(req.body["messages"])
        return tokenizer.encode_prompt(req.body["prompt"])
    except ChatTemplateError as e:
        raise RequestError(400, str(e), "invalid_prompt", "messages" if req.endpoint == "chat" else "prompt") from None


def slo_override(headers) -> SLO | None:
    """Per-request SLOs from ``x-slo-ttft-ms`` / ``x-slo-tbt-ms`` (llm-d's header names)."""
    vals = {}
    for name, key in (("x-slo-ttft-ms", "ttft_s"), ("x-slo-tbt-ms", "tbt_s")):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            v = float(raw)
        except ValueError:
            v = -1.0
        if not v > 0:
            raise RequestError(400, f"header {name} must be a positive number of milliseconds, got {raw!r}",
                               "invalid_header", name)
        vals[key] = v / 1000.0
    return SLO(**vals) if vals else None
