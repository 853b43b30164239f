"""The SSE relay (gateway/streaming.py) forwards the engine's bytes as whole events, whatever the
engine's chunking, rewrites only a P/D pair's usage, and ends a stalled or broken stream with an
SSE error; its per-read deadline (``ReadDeadline``) behaves as ``asyncio.timeout`` around each
read did, with one timer per stream."""
import asyncio
import json

import aiohttp
import pytest

from gateway.streaming import PREFILL_CACHED, ReadDeadline, StreamTally, UpstreamStream, rewrite_usage

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKENS = [b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i
          for i in range(5)]
FINISH = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":5,"total_tokens":105,'
         b'"prompt_tokens_details":{"cached_tokens":99}}}\n\n')
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(TOKENS) + FINISH + USAGE + DONE


class _Content:
    """An engine's body in the given pieces (each ready after one turn of the loop); then
    ``end``: b"" (the end), a stall (None: never answers) or an exception."""

    def __init__(self, pieces: list[bytes], end: object = b""):
        self.pieces, self.end = list(pieces), end

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        if self.pieces:
            return self.pieces.pop(0)
        if self.end is None:
            await asyncio.Event().wait()
        if isinstance(self.end, BaseException):
            raise self.end
        return b""


class _Resp:
    def __init__(self, content: _Content):
        self.content, self.closed = content, False

    def close(self) -> None:
        self.closed = True


def relay(pieces: list[bytes], *, end: object = b"", headers: dict[str, str] | None = None, idle_s: float = 30,
          send_delay_s: float = 0.0) -> tuple[list[dict], list[StreamTally], _Resp]:
    """Run one stream through UpstreamStream: (the ASGI messages sent, the tallies it ended with,
    the upstream response)."""
    async def run():
        sent: list[dict] = []
        ended: list[StreamTally] = []

        async def send(message: dict) -> None:
            if send_delay_s and message["type"] == "http.response.body":
                await asyncio.sleep(send_delay_s)  # a slow client
            sent.append(message)

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client stays to the end
            return {}

        resp = _Resp(_Content(pieces, end))
        stream = UpstreamStream(resp, dict(headers or {}), ended.append, idle_timeout_s=idle_s)  # type: ignore[arg-type]
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 10)
        return sent, ended, resp

    return asyncio.run(run())


def body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def cuts(data: bytes, every: int) -> list[bytes]:
    return [data[i:i + every] for i in range(0, len(data), every)]


@pytest.mark.parametrize("every", [1, 7, 64, 1000, len(STREAM)])
def test_the_client_gets_the_engines_bytes_as_whole_events_whatever_the_chunking(every):
    sent, ended, resp = relay(cuts(STREAM, every))
    assert body(sent) == STREAM
    assert sent[0]["type"] == "http.response.start" and sent[-1] == {"type": "http.response.body", "body": b"",
                                                                      "more_body": False}
    for m in sent[1:-1]:  # every forwarded piece is whole events
        assert m["body"].endswith(b"\n\n") and m["more_body"] is True
    (t,) = ended
    assert len(t.token_times) == len(TOKENS)  # the role-only and finish chunks carry no token
    assert t.usage == json.loads(USAGE[6:])["usage"] and t.done and t.error is None and not t.disconnected
    assert resp.closed


def test_a_pd_pairs_usage_reports_the_prefill_sides_hits_and_every_other_byte_is_the_engines():
    sent, ended, _ = relay(cuts(STREAM, 50), headers={PREFILL_CACHED: "64"})
    out = body(sent)
    assert out == rewrite_usage(STREAM, 64) and out != STREAM
    usage_line = next(line for line in out.split(b"\n") if b'"usage"' in line)
    assert json.loads(usage_line[6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert out.replace(usage_line + b"\n\n", b"") == STREAM.replace(USAGE, b"")
    assert ended[0].usage["prompt_tokens_details"]["cached_tokens"] == 99  # the tally keeps the engine's own


def test_an_engine_ending_without_a_blank_line_still_has_its_last_event_forwarded():
    sent, ended, _ = relay([ROLE, TOKENS[0], USAGE[:-2]])
    assert body(sent) == ROLE + TOKENS[0] + USAGE[:-2]
    assert ended[0].usage is not None and len(ended[0].token_times) == 1 and not ended[0].done


def test_an_error_the_engine_reports_in_band_is_forwarded_and_fails_the_request():
    err = b'data: {"error":{"message":"boom","code":500}}\n\n'
    sent, ended, _ = relay([ROLE, TOKENS[0], err, DONE])
    assert body(sent) == ROLE + TOKENS[0] + err + DONE
    assert ended[0].error == "engine reported an error in the stream"


def test_an_engine_breaking_mid_stream_ends_it_with_an_sse_error():
    sent, ended, _ = relay([ROLE, TOKENS[0]], end=aiohttp.ClientPayloadError("cut"))
    out = body(sent)
    assert out.startswith(ROLE + TOKENS[0]) and b'"upstream_failed"' in out and out.endswith(DONE)
    assert ended[0].error == "engine failed mid-stream: ClientPayloadError"


def test_an_engine_silent_past_the_stall_timeout_ends_the_stream_with_an_sse_error():
    sent, ended, resp = relay([ROLE, TOKENS[0]], end=None, idle_s=0.2)
    out = body(sent)
    assert out.startswith(ROLE + TOKENS[0]) and b'"upstream_timeout"' in out and out.endswith(DONE)
    assert ended[0].error == "upstream timeout mid-stream" and resp.closed


def test_a_slow_client_is_not_an_engine_stall():
    """The deadline covers the reads only: forwarding each event for longer than the stall
    timeout is the client's pace, not the engine's silence."""
    sent, ended, _ = relay([ROLE, TOKENS[0], TOKENS[1], DONE], idle_s=0.1, send_delay_s=0.15)
    assert body(sent) == ROLE + TOKENS[0] + TOKENS[1] + DONE and ended[0].error is None


def test_read_deadline_times_out_only_a_read_that_outlasts_it_and_leaves_other_cancellations_alone():
    class Slow:
        def __init__(self, delays: list[float]):
            self.delays = delays

        async def readany(self) -> bytes:
            await asyncio.sleep(self.delays.pop(0))
            return b"x"

    async def reads(delays: list[float], idle_s: float) -> int:
        d, n = ReadDeadline(idle_s), 0
        try:
            content = Slow(delays)
            while content.delays:
                await d.read(content)  # type: ignore[arg-type]
                n += 1
            return n
        finally:
            d.close()

    async def run() -> None:
        # many reads, each within the deadline, though together far past it
        assert await reads([0.02] * 10, 0.1) == 10
        with pytest.raises(asyncio.TimeoutError):
            await reads([0.01, 0.01, 5.0], 0.1)
        task = asyncio.create_task(reads([5.0], 10.0))  # someone else's cancellation stays one
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]

    asyncio.run(run())
