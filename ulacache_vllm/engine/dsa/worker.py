"""The DSA line's worker half (`line.LineWorker`): builds the `UlaWorkerStore` over the
engine's sparse-MLA layers (TP shard mode: with its `TPExchange` over vLLM's TP group), runs
its pre-forward contract each step, and reports its counters and pools.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ..config import UlaSettings, trace_file_for
from ..line import LineWorker
from ..metrics import UlaStats, per_rank_gauges
from .store import UlaWorkerStore

if TYPE_CHECKING:
    from .layout import DsaLayout

logger = init_logger("vllm.ulacache.dsa")
STATS_EVERY = 32  # steps between connector stats when nothing moved


class DsaWorker(LineWorker):
    def __init__(self, store: UlaWorkerStore):
        self.store = store

    @classmethod
    def build(cls, layout: DsaLayout, vllm_config, settings: UlaSettings,
              kv_caches: dict) -> "DsaWorker":
        from ..ranks import first_worker_of_engine

        ctx = vllm_config.compilation_config.static_forward_context
        device = next(iter(kv_caches.values())).device
        trace_file = None
        if settings.trace_path and first_worker_of_engine():
            pc = vllm_config.parallel_config
            trace_file = trace_file_for(settings.trace_path, pc.data_parallel_rank,
                                        pc.data_parallel_size)
        exchange = _tp_exchange(layout, settings) if layout.shards > 1 else None
        return cls(UlaWorkerStore(layout, settings, ctx, device, trace_file, exchange))

    def begin_step(self, step, forward_context) -> None:
        # This step's write slots per layer, from the forward context vLLM set up for it.
        sm = forward_context.slot_mapping
        if step.hits:
            self.count_prefix_hits(step.hits)
        self.store.begin_step(step.freed, sm if isinstance(sm, dict) else None)

    def count_prefix_hits(self, blocks: list[int]) -> None:
        """Counts the entries of cached blocks that new requests took over this step, and how
        many sat in the host tier (outside the forward; counters only)."""
        st = self.store
        bs = st.layout.block_size
        b = torch.tensor(blocks, dtype=torch.int64, device=st.device)
        addrs = (b.unsqueeze(1) * bs + torch.arange(bs, device=st.device)).reshape(-1)
        if st.shard is not None:
            if st.replicas:
                st.counters.prefix_hit_entries += int(addrs.numel()) * len(st.groups)
                return
            addrs = addrs[st.shard.owned(addrs)] // st.shard.world
        for g in st.groups:
            st.counters.prefix_hit_entries += int(addrs.numel())
            if not st.identity:
                _, host = g.mapping.locate(addrs)
                st.counters.prefix_hit_entries_host += int((host >= 0).sum())

    def take_lost(self) -> set[int]:
        return self.store.take_lost_blocks()

    def stats(self, rank: int):
        # vLLM ships connector stats through the scheduler to the stat loggers every step it
        # gets them (~1-2 ms per step on a small CPU model): report when rows moved or pools
        # changed, otherwise every STATS_EVERY steps (counters accumulate). vLLM adds up the
        # stats of an engine's workers: every rank reports its own pools and counters.
        st = self.store
        if not st.stats_due(STATS_EVERY):
            return None
        c = st.take_counters()
        data = {k: getattr(c, k) for k in c.__dataclass_fields__}
        data.update(per_rank_gauges(st.usage(), rank))
        return UlaStats(data=data)

    def usage(self) -> dict:
        st = self.store
        out = dict(st.usage())
        t = st.totals()
        out["totals"] = {
            "promotions": sum(g.mapping.stats.promotions for g in st.groups),
            # Host entries read but left on the host (--ula-promote-after).
            "deferred": sum(g.mapping.stats.deferred for g in st.groups),
            "demotions": sum(g.mapping.stats.demotions for g in st.groups),
            "lookups": sum(g.mapping.stats.lookups for g in st.groups),
            "hits": sum(g.mapping.stats.hits for g in st.groups),
            # TP shard mode (0 otherwise): unique remote entries read per read, buffer hits,
            # rows and bytes fetched from their owners, settles of the buffer skipped.
            "replica_exits": t["replica_exits"],
            # Group steps whose settle and writes moved rows as one plan (no TP shard).
            "merged_plans": t["merged_plans"],
            "remote_lookups": t["remote_lookups"],
            "remote_hits": t["remote_hits"],
            "remote_rows_fetched": t["remote_rows_fetched"],
            "remote_bytes_fetched": t["remote_bytes_fetched"],
            "remote_fill_skips": t["remote_fill_skips"],
            # Row copies that failed in the move path, and the entries they lost (their
            # requests ended with an error).
            "failed_moves": t["failed_copies"],
            "lost_entries": st.lost_entries,
            # Prefix-cache hits: entries of cached blocks new requests took over, and those
            # that sat in the host tier then.
            "prefix_hit_entries": t["prefix_hit_entries"],
            "prefix_hit_entries_host": t["prefix_hit_entries_host"],
        }
        out["victim_paths"] = [g.mapping.policy.victim_path for g in st.groups]
        out["step"] = st.step
        out["identity_mode"] = st.identity
        out["time_s"] = dict(st.time_s)
        if st.exchange is not None:  # TP shard mode: the exchange's parts (`TPExchange`)
            out["time_s"].update(st.exchange.time_s)
        lay = st.layout
        # The step budget the engine core's scheduler runs with (vLLM's default lowered to
        # the device pool, or None when the configured value was kept).
        out["batch_tokens_lowered"] = (list(lay.batch_tokens_lowered)
                                       if lay.batch_tokens_lowered else None)
        out["block_size"] = lay.block_size
        out["num_logical"] = lay.num_logical  # tokens the engine's logical space holds
        out["tp_mode"] = lay.tp_mode
        out["tp_replicas"] = st.replicas  # shard mode, still replicated
        out["tp_rank"] = st.shard.rank if st.shard else 0
        out["tp_world"] = lay.tp_world
        return out


def _tp_exchange(layout: DsaLayout, settings: UlaSettings):
    from vllm.distributed import parallel_state as ps

    from .tp_shard import TokenShard, TPExchange

    tp = ps.get_tp_group()
    if tp.world_size != layout.shards:
        raise RuntimeError(f"ulacache: TP group of {tp.world_size} ranks, layout for "
                           f"{layout.shards}")
    # Small payloads over vLLM's CPU shared-memory communicator when it is up, the rest over
    # the TP group's gloo process group (a CUDA build would use device_group).
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
        _CPUSHMDistributed,
    )

    comm = tp.device_communicator
    fast = None
    if isinstance(comm, CpuCommunicator) and isinstance(comm.dist_module, _CPUSHMDistributed):
        def fast(out, t, dm=comm.dist_module):
            dm.all_gather_into_tensor(out, t)
    logger.info("ulacache TP shard mode: rank %d of %d, shared-memory gathers: %s",
                tp.rank_in_group, tp.world_size, fast is not None)
    return TPExchange(TokenShard(tp.rank_in_group, tp.world_size), tp.cpu_group,
                      lockstep_check=settings.tp_lockstep_check, fast_gather=fast)
