"""Dual dispatch: both legs of a prefill/decode pair sent at once, as SGLang's router does (and
vLLM's MooncakeConnector proxy, which fires the prefill without waiting for it). The engines
find each other by a handover id in the bodies (SGLang's bootstrap room, vLLM's transfer id).

:func:`dual_dispatch` returns the decode response once its headers arrived and the prefill leg
answered 200, after reporting the prefill through the hooks. Before that nothing has reached
the client, so every failure is an :class:`UpstreamError`, and the other leg is aborted (its
connection closed: the engine aborts the request and frees its KV). A prefill failing while the
decode waits aborts the decode at once: it would only wait for KV that never comes.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from engines_adapters.drivers.base import DecodeResponse, Pair, PairHooks, UpstreamError, UpstreamHTTPError

#: A decode leg refused with one of these lost (or never found) the prefill's KV: the pair's failure.
KV_LOST = (404, 409, 410)


def cached_tokens(data: bytes) -> int | None:
    """The prefix the prefill instance found in its own cache, from its answer (OpenAI usage or
    SGLang's native meta_info)."""
    try:
        answer = json.loads(data)
        if "meta_info" in answer:
            return answer["meta_info"].get("cached_tokens")
        return ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError, TypeError):
        return None


async def read_error(resp: DecodeResponse) -> bytes:
    """A failed answer's body (whatever can be read), the response closed."""
    try:
        return await resp.read()
    except aiohttp.ClientError:
        return b""
    finally:
        resp.close()


def _prefill_failed(e: BaseException | None, pair: Pair) -> UpstreamError:
    if isinstance(e, UpstreamHTTPError) and e.status == 409:  # handover id taken: the pair's failure
        e.kv_lost, e.retryable = True, True
    return e if isinstance(e, UpstreamError) else UpstreamError(f"prefill {pair.prefill.id} failed: {e}",
                                                                 pair.prefill.id)


async def one_leg(pair: Pair, path: str, body: dict[str, Any], headers: dict[str, str],
                  hooks: PairHooks) -> DecodeResponse:
    """A colocated instance: the client's body as is, one leg."""
    hooks.handed_over()
    resp = await pair.decode.open(path, body, headers)
    if resp.status != 200:
        raise UpstreamHTTPError(resp.status, await read_error(resp), pair.decode.id)
    return resp


async def dual_dispatch(pair: Pair, path: str, prefill_body: dict[str, Any], decode_body: dict[str, Any],
                        headers: dict[str, str], hooks: PairHooks) -> DecodeResponse:
    hooks.prefill_started()
    prefill = asyncio.ensure_future(pair.prefill.post_json(path, prefill_body, headers))
    decode = asyncio.ensure_future(pair.decode.open(path, decode_body, headers))
    resp: DecodeResponse | None = None
    out: DecodeResponse | None = None
    try:
        await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
        if prefill.done() and not decode.done() and prefill.exception() is not None:
            raise _prefill_failed(prefill.exception(), pair)
        resp = await decode  # a transport failure raises UpstreamError (retryable)
        if resp.status != 200:
            status, data = resp.status, await read_error(resp)
            resp = None
            raise UpstreamHTTPError(status, data, pair.decode.id, kv_lost=status in KV_LOST)
        try:
            data = await prefill
        except UpstreamError as e:
            raise _prefill_failed(e, pair) from None
        hooks.prefill_finished(cached_tokens(data))
        out, resp = resp, None
        return out
    finally:
        if resp is not None:
            resp.close()  # aborts the decode request
        for t in (prefill, decode):
            t.cancel()  # a leg still running is closed: the engine aborts it
        await asyncio.gather(prefill, decode, return_exceptions=True)
        late = decode.result() if decode.done() and not decode.cancelled() and not decode.exception() else None
        if late is not None and late is not out:
            late.close()  # a decode answer that arrived as we gave up: abort it too
