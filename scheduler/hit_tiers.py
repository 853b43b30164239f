"""The hit map's tiers (scheduler/hit_index.py): the slot of each tier in the index, and which
tier a KV event's ``medium`` names (vLLM's, SGLang's and the Mooncake store's spellings).
"""
from __future__ import annotations

from predictors.types import TIERS, Tier

# tier slots in the index: positions in TIERS (device, host, store)
DEV, HOST, STORE = (TIERS.index(t) for t in (Tier.DEVICE, Tier.HOST, Tier.STORE))
TIER_NAMES = TIERS

#: KV-event ``medium`` -> tier (vLLM: GPU, CPU; SGLang: GPU, CPU_PINNED, DISK, EXTERNAL).
MEDIUM_TIERS = {"GPU": DEV, "CPU": HOST, "CPU_PINNED": HOST, "DISK": STORE, "EXTERNAL": STORE}
#: Exact lower-case media of the Mooncake store: vLLM's MooncakeStoreConnector announces blocks it
#: wrote there as ``cpu`` (the master's own events say ``cpu``/``disk``), unlike the upper-case
#: ``CPU`` of vLLM's host-memory offloading; so case decides before the case-blind table.
STORE_MEDIA = {"cpu": STORE, "disk": STORE}


def tier_of(medium: str | None) -> int | None:
    """The tier a KV event's medium names (None -> device, as vLLM omits the default)."""
    if medium is None:
        return DEV
    if not isinstance(medium, str):
        return None
    t = STORE_MEDIA.get(medium)
    return t if t is not None else MEDIUM_TIERS.get(medium.upper())
