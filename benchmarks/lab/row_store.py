"""Reference row store: device, host and staging row tensors plus the ``copy_fn`` a MovePlan
needs. Used by tests and benchmarks to check that moves never lose data; the engine's own
``copy_fn`` does the same for every layer of a group.
"""

from __future__ import annotations

import torch

from ulacache_vllm.core.mapping import DEVICE, HOST, STAGING


class RowStore:
    def __init__(self, device_slots: int, host_slots: int, width: int = 1,
                 dtype=torch.int64, device="cpu"):
        self.bufs = {
            DEVICE: torch.full((device_slots, width), -1, dtype=dtype, device=device),
            HOST: torch.full((host_slots, width), -1, dtype=dtype, device=device),
            STAGING: torch.empty((0, width), dtype=dtype, device=device),
        }

    def copy_fn(self, src_tier, src_slots, dst_tier, dst_slots):
        if dst_tier == STAGING and self.bufs[STAGING].shape[0] < dst_slots.numel():
            b = self.bufs[STAGING]
            self.bufs[STAGING] = b.new_empty((dst_slots.numel(), b.shape[1]))
        self.bufs[dst_tier][dst_slots] = self.bufs[src_tier][src_slots]
        return None

    def write(self, tier: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.bufs[tier][slots] = rows.reshape(slots.numel(), -1).to(self.bufs[tier].dtype)

    def read(self, tier: int, slots: torch.Tensor) -> torch.Tensor:
        return self.bufs[tier][slots]
