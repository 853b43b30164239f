"""KV event publisher: ZMQ PUB (+ optional ROUTER replay), as vLLM 0.33's ZmqEventPublisher.

Runs on its own thread so the engine loop never blocks: :meth:`KVEventPublisher.publish` only
puts the batch on a bounded queue (a full queue drops the batch and counts it; a subscriber sees
the sequence gap and replays).

Endpoint rule (vLLM's): the PUB socket binds when the endpoint has ``*`` or ``::`` or is
``ipc://``/``inproc://``, and connects otherwise (with ``tcp://127.0.0.1:P`` the subscriber binds).
This engine only ever listens on loopback: a wildcard host is bound as 127.0.0.1.

Replay (ROUTER, always bound): a request ``[identity, b"", start_seq (8 bytes BE)]`` is answered
with ``[identity, b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq, then
the end marker ``[identity, b"", b"", (-1 as signed 8 bytes BE), b""]``.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count

import zmq

from ..kv_wire import END_SEQ, encode_batch, publisher_binds, seq_bytes

log = logging.getLogger(__name__)

_WILDCARD = re.compile(r"^tcp://(\*|\[::\]|::|0\.0\.0\.0)(:\d+)$")
_LOOPBACK = re.compile(r"^tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)$")


def loopback_bind_address(endpoint: str) -> str:
    """The address actually bound: wildcards become 127.0.0.1; only loopback is accepted."""
    m = _WILDCARD.match(endpoint)
    if m:
        return f"tcp://127.0.0.1{m.group(2)}"
    if endpoint.startswith(("ipc://", "inproc://")) or _LOOPBACK.match(endpoint):
        return endpoint
    raise ValueError(f"{endpoint!r}: this engine binds only to loopback (tcp://127.0.0.1:PORT, tcp://*:PORT, ipc://...)")


def check_endpoint(endpoint: str) -> None:
    if not re.match(r"^(tcp://[^\s]+:\d+|ipc://\S+|inproc://\S+)$", endpoint):
        raise ValueError(f"{endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
    if publisher_binds(endpoint):
        loopback_bind_address(endpoint)


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000, dp_rank: int = 0,
                 context: zmq.Context | None = None, encode: Callable[[float, list, int], bytes] = encode_batch):
        """``encode``: the payload's wire shape (vLLM's by default; ``sglang_wire.encode_batch``)."""
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
            loopback_bind_address(replay_endpoint)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._encode = encode
        self._hwm = hwm
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self._seq = count()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.published = 0
        self.dropped = 0

    def start(self, timeout: float = 5.0) -> None:
        """Open the sockets on the publisher thread; raises if they cannot be bound/connected."""
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("KV event publisher did not start")
        if self._error is not None:
            raise self._error

    def publish(self, ts: float, events: list) -> bool:
        """Queue one batch (never blocks). False if the queue was full and the batch dropped."""
        try:
            self._queue.put_nowait((ts, events))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(max(0.1, deadline - time.monotonic()))
        self._thread = None

    # --- publisher thread ---------------------------------------------------------------------
    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        if publisher_binds(self.endpoint):
            pub.bind(loopback_bind_address(self.endpoint))
        else:
            pub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(loopback_bind_address(self.replay_endpoint))
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except BaseException as e:  # reported to start()
            self._error = RuntimeError(f"cannot open KV event sockets: {e}")
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.01 if replay is not None else 0.1)
                except queue.Empty:
                    continue
                if item is None:
                    break
                ts, events = item
                try:
                    payload = self._encode(ts, events, self.dp_rank)
                    seq = next(self._seq)
                    pub.send_multipart((self.topic, seq_bytes(seq), payload))
                    self._buffer.append((seq, payload))
                    self.published += 1
                except Exception:  # keep publishing; a gap is recoverable by replay
                    log.exception("KV event publish failed")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring malformed replay request with %d frames", len(frames))
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((ident, b"", self.topic, seq_bytes(seq), payload))
        replay.send_multipart((ident, b"", b"", END_SEQ, b""))
