"""Victim policies by name, and the one factory that builds them.

The factory decides the small-pool case: a PB-LRU asked for a pool of at most its
small-pool threshold (``SMALL_POOL_SLOTS`` of its module, or ``$ULACACHE_PBLRU_SMALL_POOL_SLOTS``)
gets the exact timestamp scan (``exact_lru.SmallPoolScan``, named after the requested policy),
which is cheaper there than a PB-LRU search.
"""
from __future__ import annotations

import torch

from . import pblru, pblru_queue
from .exact_lru import ListLRU, SmallPoolScan, TimestampLRU
from .pblru_bitmap import BitmapPBLRU
from .policy import EvictionPolicy, small_pool_threshold

# name -> (class, small-pool default threshold as a callable, or None: never the scan).
# In the order the CLI and the benchmarks list them.
POLICIES = {
    "pblru": (pblru.PBLRU, lambda: pblru.SMALL_POOL_SLOTS),
    "pblru_queue": (pblru_queue.QueuePBLRU, lambda: pblru_queue.SMALL_POOL_SLOTS),
    "pblru_bitmap": (BitmapPBLRU, None),
    "exact_ts": (TimestampLRU, None),
    "exact_list": (ListLRU, None),
}
RING_POLICIES = ("pblru", "pblru_queue", "pblru_bitmap")  # take ring_size


def make_policy(name: str, num_slots: int, device: torch.device | str, ring_size: int = 8, *,
                small_pool_slots: int | None = None, **kwargs) -> EvictionPolicy:
    """The policy ``name`` over ``num_slots`` device slots. ``small_pool_slots`` overrides the
    small-pool threshold (0: never the scan); ``kwargs`` go to the policy's constructor."""
    try:
        cls, small_default = POLICIES[name]
    except KeyError:
        raise ValueError(f"lru must be one of {'|'.join(POLICIES)}, got {name!r}") from None
    device = torch.device(device)
    if small_default is not None:
        small = small_pool_threshold(small_default()) if small_pool_slots is None else small_pool_slots
        if num_slots <= small:
            return SmallPoolScan(num_slots, device, name)
    if name in RING_POLICIES:
        kwargs["ring_size"] = ring_size
    return cls(num_slots, device, **kwargs)
