"""Per-request logical addresses: ``logical_block_id * block_size + offset``.

Requests grow block by block from a shared free list of logical blocks (like vLLM's block
pool, but the blocks are only names: where the rows live is the mapping table's business).
Per-request bookkeeping is a small tensor of block ids; address computation is vectorised.
"""

from __future__ import annotations

import torch


class LogicalAddressSpace:
    def __init__(self, num_blocks: int, block_size: int, device="cpu"):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self._blocks: dict[object, torch.Tensor] = {}
        self._len: dict[object, int] = {}

    @property
    def num_logical(self) -> int:
        return self.num_blocks * self.block_size

    def extend(self, req, num_new: int) -> torch.Tensor:
        """Append ``num_new`` tokens to ``req``; returns their logical addresses."""
        old = self._len.get(req, 0)
        new = old + num_new
        blocks = self._blocks.get(req, torch.empty(0, dtype=torch.int64, device=self.device))
        need = -(-new // self.block_size) - blocks.numel()
        if need > len(self._free):
            raise MemoryError(f"logical address space exhausted ({need} blocks needed)")
        if need > 0:
            ids = [self._free.pop() for _ in range(need)]
            blocks = torch.cat([blocks, torch.tensor(ids, dtype=torch.int64, device=self.device)])
        self._blocks[req], self._len[req] = blocks, new
        return self.addresses(req, torch.arange(old, new, device=self.device))

    def addresses(self, req, positions: torch.Tensor) -> torch.Tensor:
        b = self._blocks[req]
        return b[positions // self.block_size] * self.block_size + positions % self.block_size

    def length(self, req) -> int:
        return self._len.get(req, 0)

    def release(self, req) -> torch.Tensor:
        """Forget ``req``; returns all its addresses (to pass to ``TieredMapping.free``)."""
        n = self._len.pop(req, 0)
        blocks = self._blocks.pop(req, None)
        if blocks is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        addrs = (blocks[:, None] * self.block_size
                 + torch.arange(self.block_size, device=self.device)).reshape(-1)[:n]
        self._free.extend(reversed(blocks.tolist()))
        return addrs
