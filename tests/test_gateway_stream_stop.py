"""A stream the server cancels (uvicorn, once its graceful period is over) ends with an SSE error
event and ``[DONE]`` wherever in its forwarding the cancellation lands. On Python 3.11,
``asyncio.wait_for`` swallowed a cancellation arriving just as the engine's next bytes did: the
stream forwarded on, unaware, until the process ended under it (a cut stream, not an ended one)."""
import asyncio

import pytest

from gateway.streaming import UpstreamStream

EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


class _Content:
    """A busy decode engine's body: the next event is ready after one turn of the loop."""

    def __init__(self, events: int):
        self.left = events

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        if not self.left:
            return b""
        self.left -= 1
        return EVENT


class _Resp:
    def __init__(self, events: int):
        self.content = _Content(events)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("phase", range(12))
def test_a_stream_the_server_cancels_ends_with_an_error_event_at_any_phase_of_its_forwarding(phase):
    async def run() -> tuple[list[dict], list]:
        sent: list[dict] = []
        ended: list = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client stays to the end
            return {}

        stream = UpstreamStream(_Resp(20_000), {}, ended.append, idle_timeout_s=30)  # type: ignore[arg-type]
        task = asyncio.create_task(stream({"type": "http"}, receive, send))
        for _ in range(40 + phase):  # well into the forwarding, at each phase of one event's
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        await asyncio.wait_for(task, 10)
        return sent, ended

    sent, ended = asyncio.run(run())
    assert len(sent) > 2  # it was forwarding when cancelled
    last = sent[-1]
    assert last["more_body"] is False and b'"shutting_down"' in last["body"], last
    assert last["body"].endswith(b"data: [DONE]\n\n")
    assert len(ended) == 1 and ended[0].error == "the gateway is shutting down"
