"""The seam between vLLM's logical KV addressing and where rows physically live.

Stock vLLM: a request-local position `p` lives at slot `block_table[req, p // B] * B + p % B`
of the layer's KV tensor and new rows are written at `slot_mapping` (same slot space). The CPU sparse-MLA backend computes exactly that, then passes the rows
through the layer's `KVTranslator`. The default translator is the identity (stock vLLM); the
ulacache backend installs one that maps logical addresses to device slots through its mapping
table, promoting host-resident rows before attention reads them.
"""
from __future__ import annotations

import torch


class KVTranslator:
    """Identity translation: logical rows are physical rows (stock vLLM behaviour)."""

    def write_slots(self, layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
        return slot_mapping

    def read_rows(self, layer_name: str, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def read_chunks(self, layer_name: str, rows: torch.Tensor, req_of_token: torch.Tensor):
        """Yields `(start, end, physical rows of tokens start:end)`; attention for a chunk
        runs before the next chunk is resolved, so a translator whose device pool cannot hold
        a whole step's selections may move rows between chunks."""
        yield 0, rows.shape[0], self.read_rows(layer_name, rows)


IDENTITY = KVTranslator()
_translators: dict[str, KVTranslator] = {}


def set_translator(layer_name: str, translator: KVTranslator | None) -> None:
    if translator is None:
        _translators.pop(layer_name, None)
    else:
        _translators[layer_name] = translator


def get_translator(layer_name: str) -> KVTranslator:
    return _translators.get(layer_name, IDENTITY)


def positions_to_slots(
    positions: torch.Tensor,  # [T, K] request-local positions, -1 = none
    req_of_token: torch.Tensor,  # [T] batch row of each token's request
    block_table: torch.Tensor,  # [R, max_blocks]
    block_size: int,
) -> torch.Tensor:
    """Request-local positions -> slots (`block * B + offset`, vLLM's slot space); -1 stays -1."""
    valid = positions >= 0
    pos = positions.clamp(min=0).long()
    blocks = block_table.long()[req_of_token.long().unsqueeze(1), pos // block_size]
    slots = blocks * block_size + pos % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def slots_to_rows(slots: torch.Tensor, block_size: int, block_stride_rows: int) -> torch.Tensor:
    """Slots -> rows of a flat row view whose blocks are `block_stride_rows` apart; -1 stays -1."""
    if block_stride_rows == block_size:
        return slots
    rows = (slots // block_size) * block_stride_rows + slots % block_size
    return torch.where(slots >= 0, rows, slots)
