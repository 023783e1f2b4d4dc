"""The seam between vLLM's logical KV addressing and where rows physically live.

Stock vLLM: a request-local position `p` lives at slot `block_table[req, p // B] * B + p % B`
of the layer's KV tensor and new rows are written at `slot_mapping` (same slot space). The CPU sparse-MLA backend computes exactly that, then passes the rows
through the layer's `KVTranslator`, which the sparse-MLA impl holds as `impl.translator`: the
identity under stock vLLM, and under ulacache the one the worker store gives each layer when it
takes over the KV caches (`worker_store.GroupTranslator`: device rows through the mapping table,
host rows staged beside them).
"""
from __future__ import annotations

import torch


class KVTranslator:
    """Identity translation: logical rows are physical rows (stock vLLM behaviour).

    The interface every translator implements (ulacache's is `worker_store.GroupTranslator`):
    ``write_slots`` gives the physical slots for a layer's new rows (``trash_slot``: where
    padding goes, or None when the caller drops padding itself); ``resolve`` maps selected
    logical slots to ``(device slots, staged ids)``: -1 where not selected, and a list of id
    tensors of other sources (host rows; TP shard mode's fetched remote rows) whose rows
    ``staged_rows(layer)`` returns in the same order. All run inside the forward.
    """

    trash_slot: int | None = None

    def write_slots(self, layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
        return slot_mapping

    def resolve(self, layer_name: str, logical: torch.Tensor, req_of_token: torch.Tensor | None):
        return logical, []

    def staged_rows(self, layer_name: str) -> list[torch.Tensor]:
        return []


IDENTITY = KVTranslator()


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
