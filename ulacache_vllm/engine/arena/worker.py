"""Worker side of the arena: the one KV buffer, the vid -> granule table, and each step's plan.

Before a step's forward (the connector's ``handle_preemptions``, the first thing vLLM's
``execute_model`` does) the step's :class:`ArenaStepPlan` is applied in order: copy steps
(every source of a step read before any write), then the v2g updates, then zeroing of newly
allocated pages where vLLM would zero them (``ArenaLayout.zero_new_pages``). vLLM's block
tables keep vids; ``translate`` writes granules into the device side of each table when vLLM
commits it (``patches/block_table_translate``), so slot mappings, attention block tables and
recurrent-state indices are physical while moves rewrite no row.

A copy step that fails (an exception from the copy; `engine/faults.py` injects them in tests) never
lets a request read bytes that were not moved, nor ends the engine: the step's destinations
are marked bad, later steps still run (what they copy from bad bytes is bad too), and every
moved page whose final bytes are bad is *lost*. The connector reports lost vids as KV load
errors; the scheduler (`scheduler._UlaSchedulerMixin`) ends the requests holding them with an
error before it emits their tokens of this step. Pages that did not move are never written by
a copy, so no other request notices. The scheduler's arena is unchanged by a failure (its
placement is what the plan says; only the lost pages' bytes are garbage, and they are freed
with their requests).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..faults import MoveFaults
from ..line import LineWorker
from ..metrics import UlaStats, per_rank_gauges
from .metrics import ARENA_COUNTERS, arena_gauges

logger = logging.getLogger("vllm.ulacache.arena_worker")
LOOP_MIN_BYTES = 16 << 10  # CPU: ranges this large on average are copied slice by slice
# The scheduler's figures the connector stats are made of (counters, and gauges with the
# bytes per kind): while they and the failed copies stay, there is nothing to report.
_REPORTED = ARENA_COUNTERS + ("arena_used_bytes", "arena_free_bytes", "arena_withheld_bytes",
                              "arena_total_bytes", "arena_used_by_kind")


class BadBytes:
    """Byte ranges of the buffer whose content is not what the arena's placement says (only
    built after a failed copy: the failure path, not the step's hot path)."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []  # disjoint [start, end)

    def within(self, s: int, e: int) -> list[tuple[int, int]]:
        return [(max(a, s), min(b, e)) for a, b in self.spans if a < e and s < b]

    def cut(self, s: int, e: int) -> None:
        out = []
        for a, b in self.spans:
            if b <= s or a >= e:
                out.append((a, b))
                continue
            if a < s:
                out.append((a, s))
            if b > e:
                out.append((e, b))
        self.spans = out

    def add(self, s: int, e: int) -> None:
        self.cut(s, e)
        self.spans.append((s, e))

    def failed(self, rows) -> None:
        """A copy step that did not (fully) run: every destination holds garbage."""
        for _, d, n in rows:
            self.add(d, d + n)

    def copied(self, rows) -> None:
        """A copy step that ran: destinations hold what their sources held (bad or good),
        every source read before any write."""
        moved = [(a - s + d, b - s + d) for s, d, n in rows for a, b in self.within(s, s + n)]
        for _, d, n in rows:
            self.cut(d, d + n)
        for a, b in moved:
            self.add(a, b)


class ArenaWorker(LineWorker):
    def __init__(self, layout, kv_caches: dict[str, torch.Tensor],
                 faults: MoveFaults | None = None) -> None:
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
        # The buffer as rows of one granule (the arena's alignment): every page, copy and
        # zeroing is whole granules, so a step's copies are one gather and one scatter.
        a = layout.alignment
        wide = next(t for t in (torch.int64, torch.int32, torch.int16, torch.int8)
                    if a % t.itemsize == 0)  # (CPU gathers are ~5x faster on 8-byte words)
        self.granules = self.buf[:self.buf.numel() // a * a].view(wide).view(-1, a // wide.itemsize)
        self.v2g = torch.zeros(1024, dtype=torch.int32, device=first.device)
        self.counters = {"steps": 0, "copies": 0, "bytes_copied": 0, "zeroed_pages": 0,
                         "failed_copy_steps": 0, "lost_pages": 0, "stalled_copy_steps": 0}
        self.stats_seen: dict = {}  # the scheduler's arena figures, as the last plan with some
        self.fences_seen = (0, 0)  # the scheduler's step fences (opened, passed)
        self._fresh = False  # figures or a failed copy since the last ``stats``
        self.faults = faults  # test-only (`engine/faults.py`); None: no fault can fire
        self.lost: set[int] = set()  # vids whose bytes a failed copy lost, not yet reported
        self._reported: dict = {}  # counters and gauges as last sent (`stats`)
        self._sig = None  # the figures `stats` last looked at
        self._on_cpu = first.device.type == "cpu"
        self._rows: dict = {}  # per block table: its tensors, row count and flat views

    def before_step(self, plan) -> None:
        # Copies, v2g updates and zeroing land before vLLM commits this step's block tables.
        self.apply(plan)

    def commit_block_table(self, block_table, num_reqs: int) -> bool:
        self.translate(block_table, num_reqs)
        return True

    def apply(self, plan) -> None:
        self.fences_seen = plan.fences
        if plan.stats is not None:
            self.stats_seen = plan.stats
            self._fresh = True
        self.counters["steps"] += 1
        if not plan:  # most decode steps: nothing placed, moved or new
            return
        bad: BadBytes | None = None
        for step in plan.copies:
            try:
                if self.faults is not None and self.faults.before_copy("arena", len(step)):
                    self.counters["stalled_copy_steps"] += 1
                self._copy(step)
            except Exception as err:  # noqa: BLE001 - any copy failure: see the module doc
                bad = bad or BadBytes()
                bad.failed(step.tolist())
                self.counters["failed_copy_steps"] += 1
                self._fresh = True
                logger.error("ulacache arena: a page copy step failed (%s: %s); %d pages' "
                             "destinations marked lost", type(err).__name__, err, len(step))
                continue
            if bad is not None:
                bad.copied(step.tolist())
            self.counters["copies"] += len(step)
            self.counters["bytes_copied"] += int(step[:, 2].sum())
        if len(plan.vids):
            need = int(plan.vids.max()) + 1
            if need > len(self.v2g):
                grown = torch.zeros(max(need, 2 * len(self.v2g)), dtype=torch.int32,
                                    device=self.v2g.device)
                grown[:len(self.v2g)] = self.v2g
                self.v2g = grown
            dev = self.v2g.device
            self.v2g[torch.from_numpy(plan.vids).to(dev)] = torch.from_numpy(
                plan.granules).to(dev, torch.int32)
        if bad is not None:
            self._lose(plan, bad)
        if len(plan.new) and self.layout.zero_new_pages:
            self._zero(plan.new)
            self.counters["zeroed_pages"] += len(plan.new)

    def _gather(self, nbytes: np.ndarray) -> bool:
        """Whole-step index ops (a gather and a scatter, or one fill) rather than a slice copy
        per range: always on an accelerator (two kernels instead of one per page); on the
        CPU only for ranges under ``LOOP_MIN_BYTES`` on average, where a range's Python cost
        outweighs the memcpy speed of a slice (benchmarks/arena_apply.py)."""
        return (self.granules.device.type != "cpu"
                or int(nbytes.sum()) < LOOP_MIN_BYTES * len(nbytes))

    def _copy(self, step: np.ndarray) -> None:
        """One copy step: every source is read before any write."""
        if self._gather(step[:, 2]):
            g = self.granules
            src = g.index_select(0, self._index(step[:, 0], step[:, 2]))
            g.index_copy_(0, self._index(step[:, 1], step[:, 2]), src)
            return
        buf = self.buf
        rows = step.tolist()
        chunks = [buf[s:s + n].clone() for s, _, n in rows]
        for (_, d, n), c in zip(rows, chunks):
            buf[d:d + n].copy_(c)

    def _zero(self, ranges: np.ndarray) -> None:
        if self._gather(ranges[:, 1]):
            self.granules.index_fill_(0, self._index(ranges[:, 0], ranges[:, 1]), 0)
            return
        for off, n in ranges.tolist():
            self.buf[off:off + n].zero_()

    def _index(self, offsets: np.ndarray, nbytes: np.ndarray) -> torch.Tensor:
        """The granule rows of byte ranges (granule-aligned), concatenated, on the buffer's
        device."""
        a = self.layout.alignment
        counts = nbytes // a
        # Row j of range i is offsets[i] // a + j: a ramp restarting at each range's start.
        first = np.cumsum(counts) - counts
        rows = np.repeat(offsets // a - first, counts) + np.arange(int(counts.sum()))
        return torch.from_numpy(rows).to(self.granules.device)

    def _lose(self, plan, bad: BadBytes) -> None:
        """The plan's placed pages whose final bytes are bad (new pages hold nothing yet, so
        nothing of theirs is lost)."""
        offs = plan.granules.astype(np.int64) * self.layout.alignment
        new = set(plan.new[:, 0].tolist())
        lost = [v for v, o, n in zip(plan.vids.tolist(), offs.tolist(), plan.sizes.tolist())
                if o not in new and bad.within(o, o + n)]
        self.lost.update(lost)
        self.counters["lost_pages"] += len(lost)
        logger.error("ulacache arena: %d pages lost by a failed copy; their requests end with "
                     "an error", len(lost))

    def take_lost(self) -> set[int]:
        out, self.lost = self.lost, set()
        return out

    def stats(self, rank: int):
        """The arena's counters as increments since the last report, its gauges as they are;
        sent when they changed: the scheduler's counters (in the plan's stats) and this
        worker's failed copies."""
        if not self._fresh:  # no new figures and no failed copy since the last call
            return None
        self._fresh = False
        seen, failed = self.stats_seen, self.counters["failed_copy_steps"]
        sig = (failed, *(seen.get(k) for k in _REPORTED))
        if sig == self._sig:  # what the last call saw: it reported it, or found nothing new
            return None
        self._sig = sig
        s = {**seen, "failed_copies": failed}
        if len(s) == 1:
            return None
        keys = ARENA_COUNTERS + ("failed_copies",)
        data = {}
        for k in keys:
            d = s.get(k, 0) - self._reported.get(k, 0)
            if d:
                data[k] = d
        gauges = arena_gauges(s)
        if not data and gauges == self._reported.get("gauges"):
            return None
        self._reported = {**{k: s.get(k, 0) for k in keys}, "gauges": gauges}
        data.update(per_rank_gauges(gauges, rank))
        return UlaStats(data=data)

    def usage(self) -> dict:
        """The arena's figures as of the last step."""
        out = dict(self.stats_seen)
        out["arena_fences_opened"], out["arena_fences_passed"] = self.fences_seen
        out["worker"] = dict(self.counters)  # copies and zeroing this worker executed
        lay = self.layout
        out["alignment"] = lay.alignment
        out["kinds"] = {g.kind: {"layers": len(g.layer_names), "page_bytes": g.page_bytes,
                                 "block_size": g.block_size, "band": g.band,
                                 "pages_per_request": g.pages_per_max_request}
                        for g in lay.groups}
        out["max_requests"] = lay.max_requests
        out["kinds_null_bytes"] = lay.null_page_bytes
        return out

    def translate_ids(self, vids) -> list[int]:
        """Granules of vids (vLLM's align-mode state copies address ``state[block_id]``)."""
        v2g = self.v2g.tolist() if len(vids) > 8 else None
        return [v2g[v] if v2g is not None else int(self.v2g[v]) for v in vids]

    def translate(self, block_table, num_reqs: int) -> None:
        """``block_table`` is one of vLLM's ``BlockTable``s: its host rows hold vids; its
        device tensor gets the granules (a separate tensor, also on the CPU build)."""
        buf = block_table.block_table
        if buf.gpu.data_ptr() == buf.cpu.data_ptr():
            buf.gpu = torch.zeros_like(buf.cpu)
        if not self._on_cpu:
            buf.gpu[:num_reqs] = self.v2g[buf.cpu[:num_reqs].long()]
            return
        # CPU: one gather of the first rows, flat, into the device rows in place (views kept
        # per table and row count: building them costs more than the gather).
        views = self._rows.get(id(buf))
        if views is None or views[0] is not buf.cpu or views[1] is not buf.gpu \
                or views[2] != num_reqs:
            n = num_reqs * buf.cpu.shape[1]
            views = self._rows[id(buf)] = (buf.cpu, buf.gpu, num_reqs, buf.cpu.view(-1)[:n],
                                           buf.gpu.view(-1)[:n])
        torch.index_select(self.v2g, 0, views[3], out=views[4])
