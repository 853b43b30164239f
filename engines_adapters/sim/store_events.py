"""KV events for store-resident blocks: what a live sim engine announces once its store connector
has written blocks to the shared store, or found them there and loaded them.

The medium is the one the engine family uses for that tier (``EngineModel.store_medium``): vLLM's
MooncakeStoreConnector sends its worker's BlockStored events with ``medium="cpu"`` (lower case,
as the Mooncake master names memory replicas; the OffloadingConnector's host tier is ``"CPU"``),
SGLang's ``StorageMedium.EXTERNAL`` names an L3/L4 storage backend such as Mooncake. Block ids,
parents, token ids and extra keys are those of the engine's device events for the same blocks,
so a subscriber links both to one chain. A block is announced once per residency (vLLM's
connector announces each block once per epoch); a lookup that finds an announced block gone
announces its removal in the same medium (vLLM's connector has no removal event: this is the sim
keeping a subscriber's store tier honest, say so where it matters).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..kv_wire import BlockHash, BlockRemoved, BlockStored
from .kv_cache import lora_int_id
from .model import EngineModel


class StoreAnnouncer:
    def __init__(self, engine: EngineModel, kick: Callable[[], None] | None = None, max_entries: int = 1 << 20):
        """``kick``: wake the engine loop so the events are published without waiting for a step."""
        self.engine = engine
        self.kick = kick
        self.max_entries = max_entries
        self.held: OrderedDict[int, BlockHash] = OrderedDict()  # block hash -> event id announced in the store
        self.stored_events = 0
        self.removed_events = 0

    def _emit(self, ev: BlockStored | BlockRemoved) -> None:
        events = self.engine.kv.events
        assert events is not None
        events.append(ev)
        if self.kick is not None:
            self.kick()

    def _remember(self, h: int, vh: BlockHash) -> None:
        held = self.held
        held[h] = vh
        held.move_to_end(h)
        while len(held) > self.max_entries:
            held.popitem(last=False)

    def stored_prefix(self, tokens: list[int], hashes: list[int], salt: str | None, lora: str | None,
                      a: int, b: int) -> None:
        """Blocks ``a..b`` of a request's chain are in the store (written through, or loaded)."""
        e = self.engine
        if e.kv.events is None or b <= a:
            return
        fresh = [i for i in range(a, b) if hashes[i] not in self.held]
        if not fresh:
            return
        bs = e.block_size
        ids = e.event_ids(tokens[:b * bs], hashes, salt, lora)
        x = fresh[0]
        for k, i in enumerate(fresh):  # one event per contiguous run, as the device's
            last = k + 1 == len(fresh) or fresh[k + 1] != i + 1
            if not last:
                continue
            y = i + 1
            self._emit(BlockStored(block_hashes=ids[x:y], parent_block_hash=ids[x - 1] if x else None,
                                   token_ids=tokens[x * bs:y * bs], block_size=bs, lora_id=lora_int_id(lora),
                                   medium=e.store_medium, lora_name=lora,
                                   extra_keys=e.event_extra_keys(x, y, lora, salt), group_idx=0))
            self.stored_events += 1
            if k + 1 < len(fresh):
                x = fresh[k + 1]
        for i in fresh:
            self._remember(hashes[i], ids[i])

    def stored_blocks(self, blocks: list[tuple[int, BlockHash | None, BlockHash | None, object, str | None,
                                               list[int]]]) -> None:
        """Write-back: single evicted blocks now in the store, parents first:
        (block hash, event id, parent event id, extra keys, LoRA adapter, tokens)."""
        e = self.engine
        if e.kv.events is None:
            return
        for h, vh, parent, keys, lora, tokens in blocks:
            if vh is None or h in self.held:
                continue
            self._emit(BlockStored(block_hashes=[vh], parent_block_hash=parent, token_ids=list(tokens),
                                   block_size=e.block_size, lora_id=lora_int_id(lora), medium=e.store_medium,
                                   lora_name=lora, extra_keys=[keys], group_idx=0))
            self.stored_events += 1
            self._remember(h, vh)

    def removed(self, hashes: list[int]) -> None:
        """Blocks announced before that the store turned out not to hold any more."""
        if self.engine.kv.events is None:
            return
        ids = [self.held.pop(h) for h in hashes if h in self.held]
        if ids:
            self._emit(BlockRemoved(block_hashes=ids, medium=self.engine.store_medium, group_idx=0))
            self.removed_events += 1
