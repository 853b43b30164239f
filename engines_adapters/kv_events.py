"""KV cache event subscriber (vLLM 0.33 / SGLang ZMQ wire format: docs/protocols.md §2).

The payload decoder is the engine flavour's (``engines_adapters.drivers.kv_event_decoder``): it
turns the family's own event encoding into the normalised vLLM event classes the index is fed with.

One subscriber per engine keeps that engine's part of the hit index true: it replays history on
connect, replays again on a sequence gap, and drops and rebuilds the instance's index when replay
cannot cover the gap or the engine restarted (sequence went backwards).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass
from typing import Callable, cast
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from engines_adapters.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    decode_batch,
    int_hash,
    int_hashes,
    publisher_binds,
)
from scheduler.state import KVEventSink

log = logging.getLogger(__name__)
_END_SEQ = -1
_POLLIN = int(zmq.POLLIN)  # a plain int: ``EVENTS & zmq.POLLIN`` builds an enum member per batch


def _has_batch(sub: zmq.Socket) -> bool:
    """Whether a batch is queued; reading ZMQ_EVENTS also makes the socket process its commands
    (pyzmq types the option's value int | bytes: this one is an int)."""
    return bool(cast(int, sub.getsockopt(zmq.EVENTS)) & _POLLIN)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def apply_events(sink: KVEventSink, instance_id: str, events: list) -> int:
    """Apply one batch of decoded KV events to the hit index; returns how many it ignored (a run
    of removals counts once). The live subscriber and the virtual-time simulator both feed the
    index through here. vLLM sends one BlockRemoved per evicted block: consecutive ones of the
    same medium and group go to the index in one call (the same result, a fraction of the calls)."""
    ignored = 0
    i, n = 0, len(events)
    while i < n:
        ev = events[i]
        i += 1
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            ok = sink.block_stored(instance_id, int_hashes(ev.block_hashes),
                                   int_hash(parent) if parent is not None else None, list(ev.token_ids),
                                   ev.block_size, ev.medium, extra_keys=ev.extra_keys, lora_name=ev.lora_name,
                                   group_idx=ev.group_idx)
        elif isinstance(ev, BlockRemoved):
            hashes = int_hashes(ev.block_hashes)
            medium, group = ev.medium, ev.group_idx
            while i < n and type(nxt := events[i]) is BlockRemoved and nxt.medium == medium and nxt.group_idx == group:
                hashes += int_hashes(nxt.block_hashes)
                i += 1
            ok = sink.block_removed(instance_id, hashes, medium, group_idx=group)
        elif isinstance(ev, AllBlocksCleared):
            sink.all_cleared(instance_id)
            ok = True
        else:
            ok = False
        if ok is False:
            ignored += 1
    return ignored


def subscriber_address(endpoint: str, engine_url: str) -> str:
    """Where our side connects when the engine binds a wildcard: the engine's own host."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    scheme, rest = endpoint.split("://", 1)
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{urlsplit(engine_url).hostname or '127.0.0.1'}:{port}"


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    last_seq: int = -1
    gaps: int = 0
    replays: int = 0
    rebuilds: int = 0
    ignored: int = 0
    tail_recoveries: int = 0  # idle probes that found batches we had missed
    # KV-event lag of live batches: our wall clock at apply minus the batch's ts (the engine's wall
    # clock when it published; same host or synchronised clocks). How stale the hit index is.
    lag_n: int = 0
    lag_sum_s: float = 0.0
    lag_max_s: float = 0.0


class KVEventSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, instance_id: str, endpoint: str, sink: KVEventSink, *,
                 engine_url: str = "http://127.0.0.1", replay_endpoint: str | None = None, topic: bytes = b"",
                 replay_timeout_s: float = 2.0, idle_probe_s: float = 1.0,
                 decode: Callable[[bytes], tuple[float, list[Event], int | None]] = decode_batch):
        self.ctx, self.instance_id, self.sink, self.decode = ctx, instance_id, sink, decode
        self.endpoint, self.engine_url, self.replay_endpoint = endpoint, engine_url, replay_endpoint
        self.topic, self.replay_timeout_s, self.idle_probe_s = topic, replay_timeout_s, idle_probe_s
        self._last_heard = time.monotonic()
        self.stats = SubscriberStats()
        # a plain (not asyncio) socket whose FD the loop watches (``_on_fd``) while ``run`` runs:
        # pyzmq's asyncio socket built a poller, futures and timers per batch, which cost more
        # than applying the batch
        self._sub: zmq.Socket | None = None
        self._waiter: asyncio.Future | None = None  # ``_queued`` waiting for a batch
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None  # where the FD is watched
        self._live_last = -1
        self._resync = False

    def open(self) -> None:
        """Bind or connect the SUB socket now, so an engine that connects later finds it."""
        # typed as a plain-socket context (covariant in its socket type): pyzmq's stub then accepts socket_class
        ctx: zmq.Context[zmq.Socket] = self.ctx
        sub = ctx.socket(zmq.SUB, socket_class=zmq.Socket)  # the context's: its destroy closes it
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.setsockopt(zmq.LINGER, 0)
            if publisher_binds(self.endpoint):
                sub.connect(subscriber_address(self.endpoint, self.engine_url))
            else:
                sub.bind(self.endpoint)
        except BaseException:
            sub.close(0)  # never leak a socket: one left open keeps the context (and process) alive
            raise
        if not publisher_binds(self.endpoint) and self.endpoint.endswith(":0"):  # the port the OS chose
            self.endpoint = sub.get_string(zmq.LAST_ENDPOINT)
        self._sub = sub

    def resync(self) -> None:
        """Drop this instance's blocks and rebuild from replay at the next turn of the loop
        (the engine came back after an outage and may have restarted unnoticed)."""
        self._resync = True

    def close(self) -> None:
        if self._reader is not None:  # never a closed socket's FD left in the loop
            loop, fd = self._reader
            self._reader = None
            if not loop.is_closed():
                loop.remove_reader(fd)
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None

    async def run(self) -> None:
        if self._sub is None:
            self.open()
        sub = self._sub
        assert sub is not None
        loop = asyncio.get_running_loop()
        fd = sub.fileno()
        loop.add_reader(fd, self._on_fd, sub)
        self._reader = loop, fd
        try:
            await self._recover(0)  # a subscriber that joins late would otherwise see no history
            while True:
                if self._resync:
                    self._resync = False
                    self._live_last = -1
                    self._rebuild()
                    await self._recover(0)
                # a bound SUB only attaches a connecting PUB (and sends it our subscription) when
                # the socket processes its commands; reading ZMQ_EVENTS does that, and the bounded
                # wait makes sure it happens even when the FD edge fired while we were busy
                # (libzmq #2267)
                if not _has_batch(sub) and not await self._queued(loop, sub, 0.1):
                    if time.monotonic() - self._last_heard > self.idle_probe_s:
                        # a lost batch is otherwise noticed only when a later one arrives, and a
                        # quiet engine may send none (batches published before our subscription
                        # reached it, for one): ask the replay socket for anything we missed
                        self._last_heard = time.monotonic()
                        await self._recover(self.stats.last_seq + 1, gap_known=False)
                    continue
                self._last_heard = time.monotonic()
                try:  # queued: EVENTS said so
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.ignored += 1
                    continue
                await self._on_batch(struct.unpack(">Q", frames[1])[0], frames[2])
        finally:
            self.close()

    def _on_fd(self, sub: zmq.Socket) -> None:
        """The socket's FD signalled. ZMQ's FD is edge-like (it signals a change, not a level)
        and stays readable until the socket processes its commands: reading EVENTS does that (or
        the loop would call this again and again), and says whether a batch is queued."""
        if _has_batch(sub) and self._waiter is not None:
            _wake(self._waiter)

    async def _queued(self, loop: asyncio.AbstractEventLoop, sub: zmq.Socket, timeout_s: float) -> bool:
        """Whether a batch is queued once the FD signals one, or ``timeout_s`` passed."""
        self._waiter = woken = loop.create_future()
        timer = loop.call_later(timeout_s, _wake, woken)
        try:
            await woken
        finally:
            self._waiter = None
            timer.cancel()
        return _has_batch(sub)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        if seq < self._live_last:  # live batches from one publisher are ordered: it restarted
            self._live_last = seq
            self._rebuild()
            await self._recover(0)  # the new incarnation's history, from its first batch
            if seq > self.stats.last_seq:
                self._apply(seq, payload, live=True)
            return
        self._live_last = seq
        last = self.stats.last_seq
        if seq <= last:
            return  # already applied during a replay
        if seq > last + 1:
            self.stats.gaps += last >= 0
            await self._recover(last + 1)
        if seq > self.stats.last_seq:
            self._apply(seq, payload, live=True)

    def _rebuild(self) -> None:
        """Forget everything this instance holds; later events build it again."""
        self.stats.rebuilds += 1
        self.sink.drop_instance(self.instance_id)
        self.stats.last_seq = -1

    async def _recover(self, start: int, *, gap_known: bool = True) -> None:
        """Replay batches >= start; when the engine's buffer no longer reaches back that far (or
        there is no replay socket), drop the instance's index and keep what the replay gives.
        ``gap_known=False`` is an idle probe: an empty or failed answer means nothing was missed."""
        batches = await self._fetch_replay(start)
        if not gap_known:
            if not batches:
                return
            self.stats.tail_recoveries += 1
        covered = batches is not None and (batches[0][0] <= start if batches else start == 0)
        if not covered and (self.stats.last_seq >= 0 or start > 0):
            self._rebuild()
        for seq, payload in batches or ():
            if seq > self.stats.last_seq:
                self._apply(seq, payload)

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        if self.replay_endpoint is None:
            return None
        self.stats.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        addr = self.replay_endpoint
        out: list[tuple[int, bytes]] = []
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that arrives
        # as the answer does, and this task then outlives the gateway's shutdown (issue 8, step 4)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(subscriber_address(addr, self.engine_url) if publisher_binds(addr) else addr)
            async with asyncio.timeout(self.replay_timeout_s):
                await dealer.send_multipart([b"", struct.pack(">Q", start)])
            for _ in range(1_000_000):  # bounded: an engine buffers far fewer batches
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                # vLLM 0.33 answers [b"", topic, seq, payload]; <= 0.25 sent no topic: [b"", seq, payload]
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self.stats.ignored += 1
                    continue
                seq_frame, payload = frames[-2], frames[-1]
                if struct.unpack(">q", seq_frame)[0] == _END_SEQ:
                    return out
                out.append((struct.unpack(">Q", seq_frame)[0], payload))
        except asyncio.TimeoutError:
            log.warning("kv events %s: replay from %d timed out", self.instance_id, start)
        finally:
            dealer.close(0)
        return None

    def _apply(self, seq: int, payload: bytes, live: bool = False) -> None:
        try:
            ts, events, _ = self.decode(payload)
        except Exception as e:  # a malformed batch must not kill the subscriber
            log.warning("kv events %s: undecodable batch %d: %s", self.instance_id, seq, e)
            self.stats.ignored += 1
            self.stats.last_seq = seq
            return
        self.stats.last_seq = seq
        self.stats.batches += 1
        self.stats.events += len(events)
        self.stats.ignored += apply_events(self.sink, self.instance_id, events)
        if live and ts:  # replayed batches are old by design: not lag
            lag = max(0.0, time.time() - ts)
            st = self.stats
            st.lag_n += 1
            st.lag_sum_s += lag
            st.lag_max_s = max(st.lag_max_s, lag)
