"""Victim policies the product offers by name (``--ula-lru``), and the one factory that
builds them.

``pblru`` (round-label PB-LRU, the default) and ``exact_ts`` (an exact LRU). The factory decides
the small-pool case: a PB-LRU asked for a pool of at most ``pblru.SMALL_POOL_SLOTS`` slots
(or ``$ULACACHE_PBLRU_SMALL_POOL_SLOTS``) gets the exact timestamp scan
(``exact_lru.SmallPoolScan``, named after the requested policy), cheaper there than a PB-LRU
search. Other policies (the benchmarks' baselines) are passed to ``TieredMapping`` as a
factory (``lru=callable``); they live in ``benchmarks/lab``.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import pblru
from .exact_lru import SmallPoolScan, TimestampLRU
from .policy import EvictionPolicy, small_pool_threshold

POLICIES = ("pblru", "exact_ts")  # in the order the CLI lists them
PolicyFactory = Callable[[int, torch.device, int], EvictionPolicy]  # (slots, device, ring)


def small_pool_or(name: str, num_slots: int, device, default: int,
                  small_pool_slots: int | None):
    """The small-pool scan for ``name`` if ``num_slots`` is within the threshold, else None."""
    small = small_pool_threshold(default) if small_pool_slots is None else small_pool_slots
    return SmallPoolScan(num_slots, torch.device(device), name) if num_slots <= small else None


def make_policy(name: str, num_slots: int, device: torch.device | str, ring_size: int = 8, *,
                small_pool_slots: int | None = None) -> EvictionPolicy:
    """The policy ``name`` over ``num_slots`` device slots. ``small_pool_slots`` overrides the
    small-pool threshold (0: never the scan)."""
    device = torch.device(device)
    if name == "pblru":
        scan = small_pool_or(name, num_slots, device, pblru.SMALL_POOL_SLOTS, small_pool_slots)
        return scan or pblru.PBLRU(num_slots, device, ring_size=ring_size)
    if name == "exact_ts":
        return TimestampLRU(num_slots, device)
    raise ValueError(f"lru must be one of {'|'.join(POLICIES)} (or a policy factory), "
                     f"got {name!r}")
