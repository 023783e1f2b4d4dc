"""The DSA line's layout figures: what the engine core's sizing (`sizing.plan_layout`) decided
for the logical address space, read by the scheduler's manager and the worker side (the store,
its parts and the CUDA glue). A leaf of the line: it imports nothing of the engine, so the
worker side depends on the figures, not on the sizing that makes them; `sizing.UlaLayout`
adds the line's hooks (its manager, its worker, its startup summary)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class DsaLayout:
    block_size: int
    device_slots: int  # MLA rows per layer in the device pool
    host_slots: int  # MLA rows per layer in the host pool
    num_logical: int  # logical token addresses (= device_slots + host_slots)
    num_blocks: int  # vLLM logical blocks incl. the null block
    mla_layers: list[str]  # sparse-MLA layers, model order
    leaders: list[str]  # layers that own a top-k (start a layer group)
    mla_row_bytes: dict[str, int]  # per layer, bytes of one MLA row (per token)
    mla_head_size: int
    mla_dtype: str
    indexer_bytes_per_token: int
    # (vLLM's default, the value that fits) when ulacache lowered a defaulted
    # max_num_batched_tokens to what the device pool holds in one step; else None.
    batch_tokens_lowered: tuple[int, int] | None = None
    # TP: "replicate" (every rank holds every row, as stock vLLM) or "shard" (rank r holds the
    # tokens t % tp_world == r: device_slots / host_slots are per rank, num_logical is the sum).
    tp_mode: str = "replicate"
    tp_world: int = 1
    remote_slots: int = 0  # shard: rows of the remote-row buffer per rank and layer group
    indexer_layers: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes/token

    @property
    def shards(self) -> int:
        """Ranks the logical space is split over (1 unless TP shard mode)."""
        return self.tp_world if self.tp_mode == "shard" else 1

    @property
    def device_blocks(self) -> int:
        """Logical blocks whose identity placement (slot == device row) is on the device."""
        return self.device_slots * self.shards // self.block_size
