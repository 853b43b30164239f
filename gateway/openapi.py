"""The gateway's OpenAPI description, including the routes the hot path serves outside FastAPI's
machinery (``POST /v1/*``, ``GET /admin/decisions``): what a client generator or a fuzzer
(schemathesis) reads. Bodies are described as the gateway checks them (gateway/requests.py);
other fields pass through to the engines (``additionalProperties``)."""
from __future__ import annotations

from typing import Any

from gateway.admin import DEFAULT_PAGE, MAX_PAGE
from gateway.requests import MAX_REQUEST_ID

_NUM = {"type": "number"}
_SAMPLING: dict[str, Any] = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "enum": [1, None], "description": "only 1 through disaggregated serving"},
    "temperature": {**_NUM, "minimum": 0},
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "ignore_eos": {"type": "boolean"},
}
_PART = {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _PART, "minItems": 1}]},
    "name": {"type": "string"}}}
CHAT: dict[str, Any] = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "minLength": 1}, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1}, **_SAMPLING}}
COMPLETION: dict[str, Any] = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1}]},
        **_SAMPLING}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_HEADERS = [
    {"name": "x-request-id", "in": "header", "required": False,
     "schema": {"type": "string", "pattern": f"^[!-~]{{1,{MAX_REQUEST_ID}}}$"}},
    {"name": "x-slo-ttft-ms", "in": "header", "required": False, "schema": {"type": "number", "exclusiveMinimum": 0},
     "description": "tighter TTFT SLO for this request (capped at the configured one unless the key is trusted)"},
    {"name": "x-slo-tbt-ms", "in": "header", "required": False, "schema": {"type": "number", "exclusiveMinimum": 0}},
]


def _generate(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "parameters": _HEADERS,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "the engine's answer, whole (JSON) or streamed (text/event-stream)",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{str(s): {"description": d, **_ERR} for s, d in (
                (400, "invalid request"), (401, "missing or invalid API key"), (404, "unknown model"),
                (413, "body too large"), (429, "the SLOs cannot be met (Retry-After)"),
                (503, "no healthy engine pair"),
                (504, "engine timed out"))}}}}


def add_routes_outside_fastapi(schema: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """``schema`` (FastAPI's) with the routes it cannot see; ``models``: the names served now
    (any other is a 404), when known."""
    model = {"type": "string", "minLength": 1, **({"enum": list(models)} if models else {})}
    schema.setdefault("components", {}).setdefault("schemas", {}).update(
        {"ChatCompletionRequest": {**CHAT, "properties": {**CHAT["properties"], "model": model}},
         "CompletionRequest": {**COMPLETION, "properties": {**COMPLETION["properties"], "model": model}},
         "Error": ERROR})
    paths = schema.setdefault("paths", {})
    paths["/v1/chat/completions"] = _generate("OpenAI chat completion, scheduled on a prefill/decode pair",
                                              "ChatCompletionRequest")
    paths["/v1/completions"] = _generate("OpenAI text completion, scheduled on a prefill/decode pair",
                                         "CompletionRequest")
    paths["/admin/decisions"] = {"get": {
        "summary": "the latest decision explanations, a page at a time (newest page first)",
        "parameters": [
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "default": DEFAULT_PAGE},
             "description": f"records per page (at most {MAX_PAGE})"},
            {"name": "before", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0},
             "description": "cursor: records numbered below this (a page's next_before)"}],
        "responses": {"200": {"description": "decisions, limit, total, next_before",
                              "content": {"application/json": {"schema": {"type": "object"}}}},
                      "400": {"description": "invalid parameter", **_ERR}}}}
    return schema
