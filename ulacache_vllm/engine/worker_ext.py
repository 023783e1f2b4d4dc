"""Worker extension installed under `--kv-backend ulacache`: inspection RPCs.

`LLM.collective_rpc("ulacache_usage")` returns, per worker, what the product line's worker
reports (`LineWorker.usage`: the DSA store's pools and counters, or the arena's figures); the
same numbers reach `/metrics`. Used by tests and for debugging.
"""
from __future__ import annotations


class UlaWorkerExtension:
    def ulacache_usage(self) -> dict:
        from .connector import ula_connector

        conn = ula_connector()
        if conn is None:
            raise RuntimeError("ulacache_usage: this engine does not run --kv-backend ulacache")
        return conn.worker.usage()
