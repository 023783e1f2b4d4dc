"""Engine-free core: tiered mapping tables, slot pools, PB-LRU and an exact LRU, token placement
for TP shard mode, the TP remote-row buffer (no vLLM import)."""

from .exact_lru import TimestampLRU
from .mapping import DEVICE, HOST, STAGING, MappingStats, MovePlan, TieredMapping
from .pblru import PBLRU
from .placement import TokenShard
from .pools import CapacityError, SlotPool
from .remote_buffer import RemoteBufferStats, RemoteRowBuffer

__all__ = [
    "TimestampLRU", "DEVICE", "HOST", "STAGING", "MappingStats", "MovePlan", "TieredMapping",
    "PBLRU", "TokenShard", "CapacityError", "SlotPool", "RemoteBufferStats", "RemoteRowBuffer",
]
