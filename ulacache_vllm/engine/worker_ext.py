"""Worker extension installed under `--kv-backend ulacache`: inspection RPCs.

`LLM.collective_rpc("ulacache_usage")` returns, per worker, the pool usage and counters of the
worker-side store (used by tests and for debugging; the same numbers reach `/metrics`).
"""
from __future__ import annotations


class UlaWorkerExtension:
    def _ulacache_store(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().store

    def ulacache_usage(self) -> dict:
        store = self._ulacache_store()
        out = dict(store.usage())
        out["totals"] = {
            "promotions": sum(g.mapping.stats.promotions for g in store.groups),
            "demotions": sum(g.mapping.stats.demotions for g in store.groups),
            "lookups": sum(g.mapping.stats.lookups for g in store.groups),
            "hits": sum(g.mapping.stats.hits for g in store.groups),
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
        return out
