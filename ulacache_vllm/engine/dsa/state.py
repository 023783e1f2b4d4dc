"""What the DSA worker store's parts share, as two public records (module doc of `store`):

* `LayerGroup`: one layer group's mapping table and this step's writes, read and remote
  fetch (the store, `residency.Residency`, `sharded_rows.ShardedRows`, `moves.TierMoves` and
  the group's `translator.GroupTranslator` read and write it);
* `StoreState`: the store-wide step, placement mode (identity placement, TP replicas) with
  its live map, counters, wall times and trace, which the store and its parts read; the mode
  changes only in the store and `Residency`.

A leaf of the store: it imports none of the parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ulacache_vllm.core.mapping import TieredMapping
from ulacache_vllm.core.remote_buffer import RemoteRowBuffer

from .counters import StoreCounters, Timer
from .trace import StepTrace


@dataclass
class LayerGroup:
    gid: int
    layers: list[str]
    mapping: TieredMapping
    row_bytes: int  # bytes of one entry over all the group's layers
    # This step's writes: (slot_mapping it was made for, rows to write); set by begin_step.
    write_key: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    # This step's resolved read: (device rows, host rows or None), made by the first layer.
    read_step: int = -1
    read: tuple[torch.Tensor, torch.Tensor | None] | None = None
    selected: list[torch.Tensor] = field(default_factory=list)  # logged for settle
    host_live: bool = False  # any host row may be read this step (fixed by begin_step)
    read_host: bool = False  # this step's read stages host rows (fixed by resolve)
    # (With the host pool in attention's view, host rows are read in place, never staged.)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    # TP shard mode: the remote-row buffer (a directory kept identically on every rank), this
    # step's misses (unique addresses, sorted, the same on every rank; where each lands in
    # the gathered rows), this rank's share to send (device row, host row), the per-rank
    # width of the gather, and the gathered rows per layer, kept for settle.
    remote: RemoteRowBuffer | None = None
    fetch_addrs: torch.Tensor | None = None
    fetch_index: torch.Tensor | None = None
    serve: tuple | None = None
    width: int = 0
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)


class StoreState:
    """The store-wide state every part reads (module doc)."""

    def __init__(self, num_local: int, device: torch.device, trace: StepTrace, *,
                 identity: bool, replicas: bool):
        self.step = 0
        # Identity placement (logical slot == device slot, nothing translated; `live` marks
        # the written local addresses) and, in TP shard mode, replicated rows.
        self.identity = identity
        self.replicas = replicas
        self.live = torch.zeros(num_local, dtype=torch.bool, device=device)
        self.counters = StoreCounters()
        self.time_s = {"write": 0.0, "read": 0.0, "copy": 0.0, "begin": 0.0, "exchange": 0.0}
        self.usage_changed = False  # pools changed since the last report (frees, lost rows)
        self.trace = trace

    def timed(self, key: str) -> Timer:
        """Adds the wall time of a ``with`` block to ``time_s[key]`` (a plain class: a
        generator context manager costs a few microseconds more, ~18 blocks a step)."""
        return Timer(self.time_s, key)
