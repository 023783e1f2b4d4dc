"""Engine-free core: logical address space, tiered slot pools, PB-LRU, exact LRU, traces (no vLLM import)."""

from .address_space import LogicalAddressSpace
from .exact_lru import ListLRU, TimestampLRU
from .fence import Fence, ManualEvent
from .mapping import (DEVICE, HOST, PENDING, REMOTE, STAGING, MappingStats, MovePlan,
                      TieredMapping, unpack)
from .pblru import PBLRU
from .pblru_bitmap import BitmapPBLRU
from .pblru_queue import QueuePBLRU
from .placement import Placement
from .pools import CapacityError, SlotPool
from .remote_buffer import FetchPlan, RemoteBufferStats, RemoteRowBuffer
from .store import RowStore

__all__ = [
    "LogicalAddressSpace", "ListLRU", "TimestampLRU", "Fence", "ManualEvent", "DEVICE", "HOST",
    "PENDING", "REMOTE", "STAGING", "MappingStats", "MovePlan", "TieredMapping", "unpack",
    "PBLRU", "QueuePBLRU", "BitmapPBLRU", "Placement", "CapacityError", "SlotPool", "RowStore",
    "FetchPlan", "RemoteBufferStats", "RemoteRowBuffer",
]
