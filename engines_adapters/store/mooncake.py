"""The sim engine's data path to a real Mooncake store: ``--kv-store mooncake://HOST:RPC_PORT``.

Real bytes move through ``mooncake.store.MooncakeDistributedStore`` (the
``mooncake-transfer-engine-non-cuda`` wheel, CPU over TCP), under the engine's own store keys,
with the same three calls as the ``conductor sim-store`` data path (:class:`~.client.StoreClient`),
so :class:`~engines_adapters.sim.store_link.StoreLink` drives either:

* ``put``: the keys the master lacks (``batch_is_exist`` first, as SGLang HiCache does) are put with
  a **scaled-down payload** (``payload_bytes_per_token`` a token, 4 by default: 64 B a 16-token
  block instead of LLaMA3-8B's 2 MiB of KV). Its first 12 bytes record the modelled size of the
  block's KV, so whoever reads it knows what the load would have moved;
* ``get``: the keys' payloads are read back (``get_batch``) and the leading ones found are counted;
  the modelled transfer time is one Transfer Engine transfer of their recorded modelled bytes at the
  store model's rates (engines_adapters/store/model.py ``StoreSpec``: op latency + bytes / per-transfer
  bandwidth), in the engine's modelled seconds, as ``conductor sim-store`` answers;
* ``health``: a TCP connect to the master, and the client's ``health_check()`` once set up.
  Against a master that has gone, ``get`` finds nothing and ``put`` fails at once (the engine
  recomputes); ``close`` would block in the client for seconds, so it is skipped then.

The client's transfer engine listens on wildcard addresses (it cannot be told to bind loopback),
so it only opens inside a network namespace whose only interface up is loopback
(:func:`loopback_only`): ``unshare -n sh -c 'ip link set lo up && ...'`` (docs/store.md). Its calls
block, so they run on daemon threads (at most 8 at once); ``setup`` against a master that does not answer retries
for about 90 s, hence the TCP probe first.
"""
from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from .client import StoreUnavailable
from .model import StoreSpec

SCHEME = "mooncake://"
#: payload header: magic, modelled bytes of the block's KV (u64 big endian)
_HEADER = struct.Struct(">4sQ")
_MAGIC = b"CSIM"
IFF_UP, SIOCGIFFLAGS, SIOCSIFFLAGS = 0x1, 0x8913, 0x8914  # <linux/if.h>, <linux/sockios.h>


class MooncakeRefused(Exception):
    """The real client must not open here (wildcard listeners outside a loopback-only namespace,
    or the wheel is missing): a configuration error, not an outage."""


def parse_url(url: str) -> tuple[str, int]:
    """``mooncake://host:port`` -> the master's RPC (host, port)."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not a {SCHEME} URL: {url!r}")
    host, _, port = url[len(SCHEME):].rstrip("/").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected {SCHEME}HOST:PORT (the master's RPC address), got {url!r}")
    return host, int(port)


def _if_up(sock: socket.socket, name: str) -> bool:
    flags = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("16sH22x", name.encode()[:15], 0))
    return bool(struct.unpack_from("16sH", flags)[1] & IFF_UP)


def loopback_only(interfaces: Callable[[], list[str]] | None = None,
                  is_up: Callable[[socket.socket, str], bool] = _if_up) -> str | None:
    """None if every network interface of this process's namespace but loopback is down; else
    why not. (Asked of the kernel, not /sys, which shows the namespace it was mounted in.)"""
    try:
        names = interfaces() if interfaces else [n for _, n in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            up = [n for n in names if n != "lo" and is_up(sock, n)]
    except OSError as e:
        return f"cannot inspect the network interfaces: {e}"
    return f"network interfaces up besides loopback: {', '.join(up)}" if up else None


def loopback_up() -> None:
    """Bring ``lo`` up (``ip link set lo up`` without iproute2): the first thing to do in a fresh
    ``unshare -n`` namespace, where it starts down. Needs CAP_NET_ADMIN there (root has it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifr = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0))
        flags = struct.unpack_from("16sH", ifr)[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


NETNS_HINT = ("the Mooncake client's transfer engine listens on all addresses: run inside a network namespace "
              "with only loopback up, e.g. unshare -n sh -c 'ip link set lo up && exec CMD' (docs/store.md)")


def encode_payload(modelled_bytes: int, payload_bytes: int) -> bytes:
    head = _HEADER.pack(_MAGIC, modelled_bytes)
    return head + b"\0" * max(0, payload_bytes - len(head))


def decode_payload(value: bytes) -> int | None:
    """The modelled bytes a payload records; None for a miss (empty) or bytes that are not ours."""
    if len(value) < _HEADER.size:
        return None
    magic, modelled = _HEADER.unpack_from(value)
    return modelled if magic == _MAGIC else None


class MooncakeStoreClient:
    """A real ``MooncakeDistributedStore`` behind the sim-store data path's three async calls."""

    def __init__(self, url: str, spec: StoreSpec | None = None, payload_bytes_per_token: int = 4,
                 block_size: int = 16, segment_bytes: int = 64 << 20, local_buffer_bytes: int = 16 << 20,
                 timeout_s: float = 5.0):
        self.url, self.timeout_s = url, timeout_s
        self.host, self.port = parse_url(url)
        self.spec = spec or StoreSpec()
        self.payload_bytes = max(_HEADER.size, payload_bytes_per_token * block_size)
        self.segment_bytes, self.local_buffer_bytes = segment_bytes, local_buffer_bytes
        self._store: Any = None
        self._slots = threading.BoundedSemaphore(8)  # calls in flight in the client at once
        self._setup_lock = asyncio.Lock()
        # real bytes moved vs the KV they stand for (the engine's /metrics)
        self.put_payload_bytes = 0
        self.put_modelled_bytes = 0
        self.get_payload_bytes = 0
        self.get_modelled_bytes = 0
        self.foreign_values = 0

    async def _run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a daemon thread: a call stuck in the client (a master gone away) must
        not hold the engine's exit, as a pool's worker threads would."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, v: Any) -> None:
            if not fut.done():
                fut.set_result(v) if ok else fut.set_exception(v)

        def work() -> None:
            with self._slots:
                try:
                    ok, v = True, fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                    ok, v = False, e
            try:
                loop.call_soon_threadsafe(settle, ok, v)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

        threading.Thread(target=work, name="mooncake-client", daemon=True).start()
        return await fut

    async def _call(self, fn: Any, *args: Any) -> Any:
        """A data-path call, bounded: a master gone away makes the client retry for long."""
        try:
            return await asyncio.wait_for(self._run(fn, *args), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"Mooncake master {self.host}:{self.port}: "
                                   f"no answer in {self.timeout_s:g} s") from None

    def _reachable(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0):
                return True
        except OSError:
            return False

    async def _ensure(self) -> Any:
        """The set-up client; set up on first use once the master answers (raises StoreUnavailable)."""
        if self._store is not None:
            return self._store
        async with self._setup_lock:
            if self._store is None:
                why = loopback_only()
                if why is not None:
                    raise MooncakeRefused(f"{why}; {NETNS_HINT}")
                try:
                    from mooncake.store import MooncakeDistributedStore
                except ImportError:
                    raise MooncakeRefused("the mooncake package is missing: pip install "
                                          "mooncake-transfer-engine-non-cuda (the test extra installs it)") from None
                if not await self._run(self._reachable):
                    raise StoreUnavailable(f"Mooncake master {self.host}:{self.port} unreachable")
                store = MooncakeDistributedStore()
                rc = await self._run(store.setup, "127.0.0.1", "P2PHANDSHAKE", self.segment_bytes,
                                     self.local_buffer_bytes, "tcp", "", f"{self.host}:{self.port}")
                if rc != 0:
                    raise StoreUnavailable(f"Mooncake client setup against {self.host}:{self.port} returned {rc}")
                self._store = store
        return self._store

    async def health(self) -> bool:
        try:
            store = await self._ensure()
            # health_check() answers 0 from local state even when the master has gone: ask it too
            return await self._run(self._reachable) and await self._call(store.health_check) == 0
        except StoreUnavailable:
            return False

    async def put(self, keys: list[str], sizes: list[int]) -> dict[str, Any]:
        """Put what the master lacks; ``sizes`` are the modelled bytes (recorded in each payload)."""
        store = await self._ensure()
        exist = await self._call(store.batch_is_exist, keys)
        todo = [(k, s) for k, s, e in zip(keys, sizes, exist, strict=True) if e != 1]
        out: dict[str, Any] = {"stored": len(todo), "existing": len(keys) - len(todo), "failed": {}}
        if not todo:
            return out
        values = [encode_payload(s, self.payload_bytes) for _, s in todo]
        rc = await self._call(store.put_batch, [k for k, _ in todo], values)
        if rc != 0:
            out["stored"] = 0
            out["failed"] = {k: f"put_batch returned {rc}" for k, _ in todo}
            return out
        self.put_payload_bytes += sum(map(len, values))
        self.put_modelled_bytes += sum(s for _, s in todo)
        return out

    async def get(self, keys: list[str]) -> tuple[int, float]:
        """(leading keys read back, modelled seconds one transfer of their KV takes)."""
        store = await self._ensure()
        values = await self._call(store.get_batch, keys)
        found = modelled = payload = 0
        for v in values:
            m = decode_payload(v) if isinstance(v, bytes) else None
            if m is None:
                self.foreign_values += bool(v)
                break
            found += 1
            modelled += m
            payload += len(v)
        self.get_payload_bytes += payload
        self.get_modelled_bytes += modelled
        if not found:
            return 0, 0.0
        return found, self.spec.op_latency_s + modelled / self.spec.transfer_bytes_per_s

    async def close(self) -> None:
        """Unmount from the master, bounded; skipped when it has gone (the client would retry)."""
        store, self._store = self._store, None
        if store is not None and await self._run(self._reachable):
            try:
                await asyncio.wait_for(self._run(store.close), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                pass
