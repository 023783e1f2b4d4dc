"""Worker side of the arena: the one KV buffer, the vid -> granule table, and each step's plan.

Before a step's forward (the connector's ``handle_preemptions``, the first thing vLLM's
``execute_model`` does) the step's :class:`ArenaStepPlan` is applied in order: copy steps
(every source of a step read before any write), then the v2g updates, then zeroing of newly
allocated pages. vLLM's block tables keep vids; ``translate`` writes granules into the device
side of each table when vLLM commits it (``patches/block_table_translate``), so slot mappings,
attention block tables and recurrent-state indices are physical while moves rewrite no row.
"""
from __future__ import annotations

import torch

_ACTIVE: "ArenaWorker | None" = None  # this worker process's arena (one engine per process)


def active() -> "ArenaWorker | None":
    return _ACTIVE


class ArenaWorker:
    def __init__(self, layout, kv_caches: dict[str, torch.Tensor]) -> None:
        global _ACTIVE
        self.layout = layout
        first = next(iter(kv_caches.values()))
        storage = first.untyped_storage()
        self.buf = torch.empty(0, dtype=torch.int8, device=first.device).set_(storage)
        if self.buf.numel() < layout.buffer_bytes:
            raise RuntimeError(f"ulacache arena: KV buffer of {self.buf.numel()} bytes, "
                               f"layout needs {layout.buffer_bytes}")
        for name, t in kv_caches.items():  # every layer views the one buffer
            if t.untyped_storage().data_ptr() != storage.data_ptr():
                raise RuntimeError(f"ulacache arena: layer {name} has its own KV storage")
        self.v2g = torch.zeros(1024, dtype=torch.int32, device=first.device)
        self.counters = {"steps": 0, "copies": 0, "bytes_copied": 0, "zeroed_pages": 0}
        self.stats: dict = {}
        _ACTIVE = self

    def close(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def apply(self, plan) -> None:
        buf = self.buf
        for step in plan.copies:
            rows = step.tolist()
            chunks = [buf[s:s + n].clone() for s, _, n in rows]
            for (_, d, n), c in zip(rows, chunks):
                buf[d:d + n].copy_(c)
            self.counters["copies"] += len(rows)
            self.counters["bytes_copied"] += int(step[:, 2].sum())
        if len(plan.vids):
            need = int(plan.vids.max()) + 1
            if need > len(self.v2g):
                grown = torch.zeros(max(need, 2 * len(self.v2g)), dtype=torch.int32,
                                    device=self.v2g.device)
                grown[:len(self.v2g)] = self.v2g
                self.v2g = grown
            self.v2g[torch.from_numpy(plan.vids)] = torch.from_numpy(plan.granules).to(torch.int32)
        for off, n in plan.zero.tolist():
            buf[off:off + n].zero_()
        self.counters["zeroed_pages"] += len(plan.zero)
        self.counters["steps"] += 1
        if plan.stats:
            self.stats = plan.stats

    def translate(self, block_table, num_reqs: int) -> None:
        """``block_table`` is one of vLLM's ``BlockTable``s: its host rows hold vids; its
        device tensor gets the granules (a separate tensor, also on the CPU build)."""
        buf = block_table.block_table
        if buf.gpu.data_ptr() == buf.cpu.data_ptr():
            buf.gpu = torch.zeros_like(buf.cpu)
        rows = buf.cpu[:num_reqs]
        buf.gpu[:num_reqs] = self.v2g[rows.long()]
