"""Every policy by name, product and lab alike, as factories for ``TieredMapping(lru=...)``
(passed explicitly: the product knows only its own names)."""
from __future__ import annotations

import torch

from ulacache_vllm.core.policies import make_policy as product_policy
from ulacache_vllm.core.policies import small_pool_or

from . import pblru_queue
from .list_lru import ListLRU
from .pblru_bitmap import BitmapPBLRU

# In the order the benchmark tables list them.
NAMES = ("pblru", "pblru_queue", "pblru_bitmap", "exact_ts", "exact_list")


def make(name: str, num_slots: int, device, ring_size: int = 8, *,
         small_pool_slots: int | None = None, **kwargs):
    """The policy ``name`` (``kwargs``: the lab policy's constructor arguments)."""
    device = torch.device(device)
    if name == "pblru_queue":
        scan = small_pool_or(name, num_slots, device, pblru_queue.SMALL_POOL_SLOTS,
                             small_pool_slots)
        return scan or pblru_queue.QueuePBLRU(num_slots, device, ring_size=ring_size, **kwargs)
    if name == "pblru_bitmap":
        return BitmapPBLRU(num_slots, device, ring_size=ring_size, **kwargs)
    if name == "exact_list":
        return ListLRU(num_slots, device)
    return product_policy(name, num_slots, device, ring_size, small_pool_slots=small_pool_slots)


def factory(name: str):
    """``TieredMapping(..., lru=factory(name))``."""
    if name not in NAMES:
        raise ValueError(f"unknown policy {name!r}; one of {NAMES}")
    return lambda n, dev, ring: make(name, n, dev, ring)
