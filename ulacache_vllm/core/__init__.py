"""Engine-free core: logical address space, tiered slot pools, PB-LRU, exact LRU, the TP remote-row buffer (no vLLM import)."""

from .exact_lru import TimestampLRU
from .mapping import DEVICE, HOST, REMOTE, STAGING, MappingStats, MovePlan, TieredMapping, unpack
from .pblru import PBLRU
from .placement import Placement
from .pools import CapacityError, SlotPool
from .remote_buffer import RemoteBufferStats, RemoteRowBuffer

__all__ = [
    "TimestampLRU", "DEVICE", "HOST",
    "REMOTE", "STAGING", "MappingStats", "MovePlan", "TieredMapping", "unpack",
    "PBLRU", "Placement", "CapacityError", "SlotPool",
    "RemoteBufferStats", "RemoteRowBuffer",
]
