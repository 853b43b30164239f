"""An engine's store connector, as the engine model sees it: synchronous and clock injected.

Two implementations of one small protocol (``lookup`` before a prefill, ``write`` after it):

* :class:`ModelConnector` talks to a :class:`~engines_adapters.store.model.StoreModel` in the same
  process (the virtual-time simulator, tests); keys are the engine's block hashes;
* the live sim engine (engines_adapters/sim/api.py) asks the ``conductor sim-store`` service over
  HTTP before it queues the request and hands the answer in with the request
  (``SimRequest.store_blocks`` / ``store_load_s``); it writes through after the step that
  finished the prefill.

Objects are one per block (``blocks_per_object=1``, vLLM's MooncakeStoreConnector) or one per
chunk of blocks (named by the chunk's last block hash), whose parts are only usable whole.
"""
from __future__ import annotations

from typing import Protocol

from .model import StoreModel


class StoreConnector(Protocol):
    def lookup(self, hashes: list[int], start: int, limit: int, now: float) -> tuple[int, float]:
        """Blocks beyond ``start`` (up to ``limit``) the store holds contiguously, loaded now;
        returns (blocks, modelled time the load ends). (0, now) when it holds nothing more."""
        ...

    def write(self, hashes: list[int], n: int, now: float) -> None:
        """Write-through of the first ``n`` blocks of a prompt just prefilled."""
        ...

    def write_blocks(self, hashes: list[int], now: float) -> None:
        """Write-back of blocks the device just evicted (each named by its chain hash)."""
        ...


class ModelConnector:
    """A store connector over an in-process store model."""

    def __init__(self, store: StoreModel, bytes_per_block: int, blocks_per_object: int = 1):
        if bytes_per_block <= 0 or blocks_per_object <= 0:
            raise ValueError("bytes_per_block and blocks_per_object must be positive")
        self.store, self.bpb, self.bpo = store, bytes_per_block, blocks_per_object
        self.loads = 0
        self.loaded_blocks = 0
        self.load_s = 0.0
        self.write_errors = 0
        self.last_error: str | None = None

    def lookup(self, hashes: list[int], start: int, limit: int, now: float) -> tuple[int, float]:
        c = self.bpo
        first = start // c  # the object holding block ``start``
        keys = [hashes[(j + 1) * c - 1] for j in range(first, limit // c)]
        if not keys:
            return 0, now
        got = self.store.get(keys, now)
        end = (first + got.found) * c
        if end <= start:
            return 0, now
        self.loads += 1
        self.loaded_blocks += end - start
        self.load_s += got.done_at - now
        return end - start, got.done_at

    def write(self, hashes: list[int], n: int, now: float) -> None:
        c = self.bpo
        keys = [hashes[(j + 1) * c - 1] for j in range(n // c)]
        if not keys:
            return
        r = self.store.put(keys, [self.bpb * c] * len(keys), now)
        self._failed(r.failed)

    def write_blocks(self, hashes: list[int], now: float) -> None:
        if self.bpo != 1 or not hashes:  # a chunk object is only written whole, by write-through
            return
        self._failed(self.store.put(list(hashes), [self.bpb] * len(hashes), now).failed)

    def _failed(self, failed: dict) -> None:
        if failed:  # the engine keeps serving; the prompt is recomputed next time
            self.write_errors += len(failed)
            self.last_error = next(iter(failed.values()))
