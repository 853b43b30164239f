"""Forwarding an engine's response body to the client, byte for byte.

SSE bytes are forwarded as whole events (never re-encoded); each forwarded event that carries
content is timestamped for TTFT and inter-token telemetry. A client disconnect cancels the
forwarding at once, which closes the upstream connection (the engine aborts the request).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from starlette.responses import Response

from engines_adapters.drivers.base import DecodeResponse, StreamBody
from gateway.errors import sse_error

# a chat delta or completion choice with non-empty text: a token chunk, not a role-only chunk
_CONTENT = re.compile(rb'"(?:content|text|reasoning_content)":\s?"(?!")')
_USAGE = re.compile(rb'"usage":\s?\{')
#: the response header naming the prefix tokens the prefill instance itself found cached
PREFILL_CACHED = "x-conductor-prefill-cached-tokens"


class StreamTally:
    """What the gateway measures of one response as it passes through."""

    __slots__ = ("token_times", "usage", "error", "disconnected", "done", "on_first")

    def __init__(self, on_first: Callable[[], object] | None = None) -> None:
        self.token_times: list[float] = []
        self.on_first = on_first  # called at the first token (the decode engine admitted the request)
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.disconnected = False  # the client left before the stream's end
        self.done = False  # the terminating [DONE] event was forwarded

    def scan_events(self, events: bytes, now: float) -> bool:
        """Tally whole SSE ``events`` forwarded at ``now``; True when one of them carries usage."""
        if b"data: [DONE]" in events:
            self.done = True
        if b'data: {"error"' in events and self.error is None:  # the engine failed in-band
            self.error = "engine reported an error in the stream"
        n = len(_CONTENT.findall(events))
        if n:
            if not self.token_times and self.on_first is not None:
                self.on_first()
            self.token_times.extend([now] * n)
        if b'"usage":' not in events or _USAGE.search(events) is None:  # (most events: a byte search only)
            return False
        for line in events.split(b"\n"):
            if line.startswith(b"data: {") and _USAGE.search(line):
                try:
                    self.usage = json.loads(line[6:]).get("usage") or self.usage
                except ValueError:
                    pass
        return True


def prefill_usage(usage: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """The usage block a client should see from a disaggregated pair: ``cached_tokens`` is what
    the prefill instance found in its own cache. The decode engine counts the KV it pulled from
    the prefill as cached (``prompt_tokens - 1`` even for a cold prompt): a 99.99% "hit rate"."""
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = cached_tokens
    return {**usage, "prompt_tokens_details": details}


def rewrite_usage(events: bytes, cached_tokens: int) -> bytes:
    """``events`` with each usage-carrying ``data:`` line's usage replaced by :func:`prefill_usage`
    (re-encoded; every other line is the engine's bytes)."""
    lines = events.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data: {") and _USAGE.search(line):
            try:
                obj = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                obj["usage"] = prefill_usage(obj["usage"], cached_tokens)
                lines[i] = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
    return b"\n".join(lines)


class UpstreamStream(Response):
    """ASGI response streaming an aiohttp response; ``on_done(tally)`` runs exactly once. A
    disaggregated pair's usage events report the prefill side's cached tokens, the number its
    ``x-conductor-prefill-cached-tokens`` header carries."""

    def __init__(self, resp: DecodeResponse, headers: dict[str, str],
                 on_done: Callable[[StreamTally], None], idle_timeout_s: float,
                 on_first: Callable[[], object] | None = None):
        self.resp, self.extra_headers, self.on_done, self.idle_timeout_s = resp, headers, on_done, idle_timeout_s
        cached = headers.get(PREFILL_CACHED)
        self.prefill_cached_tokens = None if cached is None else int(cached)
        self.tally = StreamTally(on_first)
        self.status_code, self.background = 200, None
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        """End the forwarding from outside (the engine was found hung): the client gets an SSE
        error saying why, then the stream ends as a failed one."""
        if self.aborted is None:
            self.aborted = reason
            self.resp.close()  # the pending read fails at once

    async def __call__(self, scope, receive, send) -> None:
        main = asyncio.current_task()
        assert main is not None  # an ASGI app is always called from a task
        tally = self.tally

        async def watch_disconnect() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not tally.done:  # a client closing after [DONE] got the whole answer
                        tally.disconnected = True
                        main.cancel()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        started = False
        try:
            hdrs = [(k.encode(), v.encode()) for k, v in self.extra_headers.items()]
            hdrs.append((b"content-type", b"text/event-stream"))
            hdrs.append((b"cache-control", b"no-cache"))
            await send({"type": "http.response.start", "status": 200, "headers": hdrs})
            started = True
            await self._pump(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not tally.disconnected:
                if not started:
                    raise
                # not the client: the server is stopping (its graceful period is over): the
                # stream ends cleanly with an error event rather than a cut connection
                tally.error = "the gateway is shutting down"
                try:
                    async with asyncio.timeout(0.5):
                        await send({"type": "http.response.body", "more_body": False,
                                    "body": sse_error(503, tally.error, "shutting_down")})
                except (TimeoutError, OSError):
                    pass
            if hasattr(main, "uncancel"):
                main.uncancel()
        finally:
            watcher.cancel()
            self.resp.close()  # an unfinished upstream stream is aborted, the engine frees its KV
            self.on_done(tally)  # synchronous: runs to the end even while cancelled

    async def _pump(self, send) -> None:
        tally, content, cached = self.tally, self.resp.content, self.prefill_cached_tokens
        deadline = ReadDeadline(self.idle_timeout_s)
        buf = b""
        try:
            while True:
                # a deadline on each read, not asyncio.timeout: that cost a timer per token event
                # (wait_for too, and on 3.11 it drops a cancellation arriving with the engine's
                # next bytes: a stream the server stops would forward on, to be cut)
                chunk = await deadline.read(content)
                if not chunk:
                    break
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, buf = buf[: cut + 2], buf[cut + 2 :]
                if tally.scan_events(events, time.monotonic()) and cached is not None:
                    events = rewrite_usage(events, cached)
                await send({"type": "http.response.body", "body": events, "more_body": True})
        except asyncio.TimeoutError:
            tally.error = "upstream timeout mid-stream"
            await send({"type": "http.response.body", "body": sse_error(504, tally.error, "upstream_timeout"),
                        "more_body": True})
            return
        except aiohttp.ClientError as e:
            tally.error = self.aborted or f"engine failed mid-stream: {e.__class__.__name__}"
            await send({"type": "http.response.body", "body": sse_error(502, tally.error, "upstream_failed"),
                        "more_body": True})
            return
        finally:
            deadline.close()
        if buf:  # an engine that ended without a final blank line
            if tally.scan_events(buf, time.monotonic()) and cached is not None:
                buf = rewrite_usage(buf, cached)
            await send({"type": "http.response.body", "body": buf, "more_body": True})


class ReadDeadline:
    """What ``asyncio.timeout(idle_s)`` around each read of a stream does (the task cancelled
    when one read outlasts ``idle_s``, TimeoutError out of that read), with one timer for the
    whole stream instead of one per read: the timer is moved on only when it fires before the
    read then under way is due, at most once per ``idle_s``. Time between reads (the forwarding)
    is not counted. Made, used and closed in one task."""

    __slots__ = ("loop", "task", "idle_s", "since", "expired", "cancelling", "timer")

    def __init__(self, idle_s: float):
        task = asyncio.current_task()
        assert task is not None
        self.loop, self.task, self.idle_s = asyncio.get_running_loop(), task, idle_s
        self.since: float | None = None  # when the read under way started; None between reads
        self.expired = False
        self.cancelling = self.task.cancelling()  # as asyncio.timeout: a cancellation of ours only
        self.timer: asyncio.TimerHandle | None = self.loop.call_at(self.loop.time() + idle_s, self._due)

    async def read(self, content: StreamBody) -> bytes:
        self.since = self.loop.time()
        try:
            return await content.readany()
        except asyncio.CancelledError as e:
            if self.expired and self.task.uncancel() <= self.cancelling:
                raise asyncio.TimeoutError from e
            raise
        finally:
            self.since = None

    def _due(self) -> None:
        now, since = self.loop.time(), self.since
        if since is not None and now >= since + self.idle_s:
            self.timer, self.expired = None, True
            self.task.cancel()
            return
        self.timer = self.loop.call_at((now if since is None else since) + self.idle_s, self._due)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
