"""Bad input gets a defined answer: a (reason, message) for a 400, never an exception."""
from __future__ import annotations

import math
from array import array
from typing import Any

from predictors.telemetry import SLO


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad_slo_field(v: Any) -> bool:
    return v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0)


def check_facts(facts: Any, block_size: int) -> tuple[str, str] | None:
    """None when the request facts are well-formed, else (reason, message)."""
    try:
        rid, prompt, hashes, max_tokens = facts.request_id, facts.prompt_tokens, facts.block_hashes, facts.max_tokens
        slo = getattr(facts, "slo", None)
    except AttributeError as e:
        return "bad_request", f"not request facts: {e}"
    if not isinstance(rid, str) or not rid:
        return "bad_request_id", f"request_id must be a non-empty string, got {rid!r}"
    if not _is_int(prompt):
        return "bad_prompt_tokens", f"prompt_tokens must be an integer, got {prompt!r}"
    if prompt <= 0:
        return "empty_prompt", "the prompt has no tokens"
    if not _is_int(max_tokens) or max_tokens < 0:
        return "bad_max_tokens", f"max_tokens must be a non-negative integer, got {max_tokens!r}"
    if not isinstance(hashes, (list, tuple)):
        return "bad_block_hashes", f"block_hashes must be a list, got {type(hashes).__name__}"
    if len(hashes) > prompt // block_size:
        return "bad_block_hashes", (f"{len(hashes)} block hashes for {prompt} prompt tokens at block size "
                                    f"{block_size} (at most {prompt // block_size})")
    try:  # every hash an unsigned 64-bit integer, checked at C speed (~15 ns a block)
        array("Q", hashes)
    except (TypeError, OverflowError, ValueError):
        return "bad_block_hashes", "block hashes must be unsigned 64-bit integers"
    for name in ("tenant", "model", "adapter", "priority"):
        v = getattr(facts, name, None)
        if v is not None and not isinstance(v, str):
            return "bad_request", f"{name} must be a string or None, got {type(v).__name__}"
    if slo is not None and (not isinstance(slo, SLO) or _bad_slo_field(slo.ttft_s) or _bad_slo_field(slo.tbt_s)):
        return "bad_slo", f"slo must be an SLO with positive finite fields or None, got {slo!r}"
    return None
