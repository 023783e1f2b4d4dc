"""Worker extension installed under `--kv-backend ulacache`: inspection RPCs.

`LLM.collective_rpc("ulacache_usage")` returns, per worker, the pool usage and counters of the
worker-side store, or for hybrid models the arena's (used by tests and for debugging; the same
numbers reach `/metrics`).
"""
from __future__ import annotations


class UlaWorkerExtension:
    def _ulacache_store(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().store

    def ulacache_usage(self) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        arena = get_kv_transfer_group().arena
        if arena is not None:  # hybrid models: the arena's figures as of the last step
            out = dict(arena.stats)
            out["worker"] = dict(arena.counters)  # copies and zeroing this worker executed
            out["alignment"] = arena.layout.alignment
            out["kinds"] = {g.kind: {"layers": len(g.layer_names), "page_bytes": g.page_bytes,
                                     "block_size": g.block_size, "band": g.band}
                            for g in arena.layout.groups}
            out["max_requests"] = arena.layout.max_requests
            out["kinds_null_bytes"] = arena.layout.null_page_bytes
            return out
        store = self._ulacache_store()
        out = dict(store.usage())
        t = store.totals()
        out["totals"] = {
            "promotions": sum(g.mapping.stats.promotions for g in store.groups),
            "demotions": sum(g.mapping.stats.demotions for g in store.groups),
            "lookups": sum(g.mapping.stats.lookups for g in store.groups),
            "hits": sum(g.mapping.stats.hits for g in store.groups),
            # TP shard mode (0 otherwise): unique remote entries read per step, buffer hits,
            # rows and bytes fetched from their owners.
            "replica_exits": t["replica_exits"],
            "remote_lookups": t["remote_lookups"],
            "remote_hits": t["remote_hits"],
            "remote_rows_fetched": t["remote_rows_fetched"],
            "remote_bytes_fetched": t["remote_bytes_fetched"],
            # Row copies that failed in the move path, and the entries they lost (their
            # requests ended with an error).
            "failed_moves": t["failed_copies"],
            "lost_entries": store.lost_entries,
        }
        pols = [getattr(g.mapping.policy, "inner", g.mapping.policy) for g in store.groups]
        out["victim_paths"] = [getattr(p, "victim_path", p.name) for p in pols]
        out["step"] = store.step
        out["identity_mode"] = store.identity
        out["time_s"] = dict(store.time_s)
        lay = store.layout
        # The step budget the engine core's scheduler runs with (vLLM's default lowered to
        # the device pool, or None when the configured value was kept).
        out["batch_tokens_lowered"] = list(lay.batch_tokens_lowered) if lay.batch_tokens_lowered else None
        out["block_size"] = lay.block_size
        out["num_logical"] = lay.num_logical  # tokens the engine's logical space holds
        out["tp_mode"] = lay.tp_mode
        out["tp_replicas"] = bool(getattr(store, "replicas", False))  # shard mode, still replicated
        out["tp_rank"] = store.shard.rank if store.shard else 0
        out["tp_world"] = lay.tp_world
        return out
