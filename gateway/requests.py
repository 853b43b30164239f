"""Validating and tokenizing a client request before the scheduler sees it.

The body is kept as the client's own dict so unknown (engine-specific) fields pass through
untouched; only the fields the gateway must understand are checked here.
"""
from __future__ import annotations

import json
import math
import re
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


#: Deepest JSON nesting a body may have: far beyond any OpenAI request (tool schemas included),
#: far below what recursion in the parser, the encoder of the engine legs or a walk could hit.
MAX_JSON_DEPTH = 64
#: ``\\uD800``..``\\uDFFF`` escapes: only a body with one can hold a lone surrogate after parsing.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> Any:
    raise RequestError(400, f"request body is not valid JSON: {name} is not a JSON number", "invalid_json")


def load_json(raw: bytes) -> Any:
    """Strict JSON: no ``NaN``/``Infinity``, no lone UTF-16 surrogates (they cannot be encoded
    as UTF-8 for the tokenizer or an engine), at most :data:`MAX_JSON_DEPTH` levels."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        body = None  # deeper than the parser's own stack: reported below with the others
    if body is None or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        if body is None or json_depth(body) > MAX_JSON_DEPTH:
            raise RequestError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # rare: pairs (an emoji escaped) are fine, lone ones are not
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise RequestError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff escape "
                                    "without its pair): not a Unicode string", "invalid_json") from None
    return body


def json_depth(obj: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        items = o.values() if isinstance(o, dict) else o if isinstance(o, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        if d > MAX_JSON_DEPTH:
            return d
        stack.extend((v, d + 1) for v in items if isinstance(v, (dict, list)))
    return deepest


def parse_body(raw: bytes, endpoint: str, default_max_tokens: int) -> ParsedRequest:
    body = load_json(raw)
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
    if "kv_transfer_params" in body:  # the PD protocol's: an engine told to pull KV from where the client says
        raise RequestError(400, "'kv_transfer_params' is set by the gateway's disaggregation protocol, not by "
                                "clients", "invalid_field", "kv_transfer_params")
    stream = body.get("stream")
    stream = False if stream is None else stream  # null means the default, as in OpenAI's API
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "invalid_field", "stream")
    n = body.get("n")
    if n not in (None, 1) or isinstance(n, bool):
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
    check_sampling(body)
    return ParsedRequest(body, endpoint, model, stream, max_tokens)


def _in(lo: float | None, hi: float | None, lo_open: bool = False) -> Any:
    def ok(v: float) -> bool:
        return (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    return ok


#: Sampling parameters the gateway checks (vLLM's ``SamplingParams`` rules; null means the
#: default): name -> (integer only, valid, what a valid value is).
SAMPLING = {
    "temperature": (False, _in(0, None), "a number >= 0"),
    "top_p": (False, _in(0, 1, lo_open=True), "a number in (0, 1]"),
    "top_k": (True, _in(-1, None), "an integer >= -1 (-1 or 0: no limit)"),
    "min_p": (False, _in(0, 1), "a number in [0, 1]"),
    "presence_penalty": (False, _in(-2, 2), "a number in [-2, 2]"),
    "frequency_penalty": (False, _in(-2, 2), "a number in [-2, 2]"),
    "repetition_penalty": (False, _in(0, None, lo_open=True), "a number > 0"),
    "min_tokens": (True, _in(0, None), "an integer >= 0"),
    "seed": (True, _in(None, None), "an integer"),
    "top_logprobs": (True, _in(0, None), "an integer >= 0"),
}


def check_sampling(body: dict[str, Any]) -> None:
    """Refuse bad sampling values here, with the parameter named, rather than after a
    reservation (or never: an engine that clamps them)."""
    for key, (integer, ok, what) in SAMPLING.items():
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not ok(v):
            raise RequestError(400, f"'{key}' must be {what}, got {v!r}", "invalid_field", key)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise RequestError(400, "'stop' must be a string or a list of strings", "invalid_field", "stop")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RequestError(400, "'stream_options' must be an object", "invalid_field", "stream_options")


def prompt_chars(req: ParsedRequest) -> int:
    """Characters of the prompt's text (a token id counts as one): read before tokenizing, to
    refuse a prompt that cannot fit any engine's context without spending the work."""
    if req.endpoint == "chat":
        n = 0
        for m in req.body["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                n += len(content)
            elif isinstance(content, list):
                n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return n
    prompt = req.body["prompt"]
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    return 0


def check_prompt_size(req: ParsedRequest, max_model_len: int, chars_per_token: float) -> None:
    limit = int(max_model_len * chars_per_token)
    if max_model_len > 0 and (n := prompt_chars(req)) > limit:
        raise RequestError(400, f"the prompt has {n} characters: more than the longest context served "
                                f"({max_model_len} tokens) can hold at {chars_per_token:g} characters a token",
                           "context_length_exceeded", "messages" if req.endpoint == "chat" else "prompt")


#: A client's X-Request-Id: visible ASCII, bounded (it is echoed, sent to both engines and
#: written to telemetry; a non-ASCII header would not survive HTTP's Latin-1 header encoding).
MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID)


def check_request_id(rid: str) -> None:
    if not _REQUEST_ID.fullmatch(rid):
        raise RequestError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID} visible ASCII characters "
                                f"(got {len(rid)} characters)", "invalid_request_id", "x-request-id")


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


def slo_override(headers, configured: SLO, trusted: bool = False) -> SLO | None:
    """Per-request SLOs from ``x-slo-ttft-ms`` / ``x-slo-tbt-ms`` (llm-d's header names). A client
    may only tighten the configured SLOs (a looser value is capped at the configured one), so the
    headers cannot switch admission off; ``trusted`` (a key configured with
    ``trust_slo_headers``) takes them as they are."""
    vals = {}
    for name, key in (("x-slo-ttft-ms", "ttft_s"), ("x-slo-tbt-ms", "tbt_s")):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            v = float(raw) / 1000.0
        except ValueError:
            v = -1.0
        if not 0 < v < math.inf:  # 1e-320 ms is 0 s: no SLO at all, not a tight one
            raise RequestError(400, f"header {name} must be a positive number of milliseconds, got {raw[:40]!r}",
                               "invalid_header", name)
        limit = getattr(configured, key)
        vals[key] = v if trusted or limit is None else min(v, limit)
    return SLO(**vals) if vals else None
