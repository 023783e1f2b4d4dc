"""The DSA worker store's row pools: per sparse-MLA layer, a device pool and a host pool of
byte rows (``uint8 [rows, row_bytes]``, viewed in the KV dtype by attention), and the view of
them vLLM's attention reads as the layer's KV cache.

Device rows: the device pool, one trash block past it (padding writes), then in TP shard mode
the remote-row buffer (read by attention as device rows). Where the device pool is host
memory (the CPU build, ``host_in_view``), one tensor holds both pools and attention's view
spans both: host slot ``s`` is row ``host_base + s`` of that view.
"""
from __future__ import annotations

import torch

from .layout import DsaLayout


def wide(rows: torch.Tensor) -> torch.Tensor:
    """``uint8 [R, B]`` rows as the widest of int64 / int32 / int16 whose size divides ``B``
    (the same bytes, a view): a uint8 row gather-scatter moves one byte per element, ~6x the
    time of the same rows as int64 on CPU."""
    b = rows.shape[1]
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b % w == 0 and rows.storage_offset() % w == 0:
            return rows.view(dt)
    return rows


class RowPools:
    def __init__(self, layout: DsaLayout, device: torch.device, remote_rows: int = 0,
                 host_in_view: bool | None = None):
        bs = layout.block_size
        self.device = device
        self.dtype = getattr(torch, layout.mla_dtype)
        self.trash_slot = layout.device_slots  # one extra block past the pool takes padding
        # Remote-row buffer rows sit past the trash block (attention reads them as device rows).
        self.remote_base = layout.device_slots + bs
        rows = -(-(self.remote_base + remote_rows) // bs) * bs
        pin = device.type == "cuda"
        # Host pool in attention's view (module doc): where device rows are host memory too.
        self.host_in_view = device.type == "cpu" if host_in_view is None else host_in_view
        if self.host_in_view and device.type != "cpu":
            raise ValueError("host_in_view needs the device pool in host memory (CPU)")
        self.host_base = rows if self.host_in_view else None
        hrows = -(-layout.host_slots // bs) * bs  # whole blocks in attention's view
        self.device_bytes: dict[str, torch.Tensor] = {}
        self.host_bytes: dict[str, torch.Tensor] = {}
        self.host_rows: dict[str, torch.Tensor] = {}  # host pools viewed in the KV dtype
        # Attention's view of each layer's pool(s), in vLLM's [blocks, block, head] shape.
        self.kv_views: dict[str, torch.Tensor] = {}
        for name in layout.mla_layers:
            rb = layout.mla_row_bytes[name]
            if self.host_in_view:
                both = torch.zeros(rows + hrows, rb, dtype=torch.uint8, device=device)
                self.device_bytes[name] = both[:rows]
                self.host_bytes[name] = both[rows:rows + layout.host_slots]
                view = both
            else:
                self.device_bytes[name] = torch.zeros(rows, rb, dtype=torch.uint8,
                                                      device=device)
                self.host_bytes[name] = torch.zeros(layout.host_slots, rb, dtype=torch.uint8,
                                                    device="cpu", pin_memory=pin)
                view = self.device_bytes[name]
            self.host_rows[name] = self.host_bytes[name].view(self.dtype)
            self.kv_views[name] = view.view(self.dtype).view(-1, bs, layout.mla_head_size)
        # Both pools of each layer as whole words (`wide`), for the moves.
        self.wide_rows = {n: (wide(self.device_bytes[n]), wide(self.host_bytes[n]))
                          for n in layout.mla_layers}
