"""Hook: `BlockTable.commit_block_table` (v1/worker/block_table.py).

Under the arena (hybrid models with `--kv-backend ulacache`) block tables hold virtual page
ids; committing a table (vLLM does it before computing slot mappings and building attention
and mamba metadata) writes their granules (physical page positions) into the table's device
tensor instead of copying the ids. Without an active arena in the process, vLLM's own copy runs.
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "block_table_translate"
MODULE = "vllm.v1.worker.block_table"


def apply() -> None:
    _, orig = resolve(MODULE, "BlockTable.commit_block_table", HOOK)

    def commit_block_table(self, num_reqs: int) -> None:
        from ulacache_vllm.engine.arena import worker as arena_worker

        worker = arena_worker.active()
        if worker is None:
            return orig(self, num_reqs)
        worker.translate(self, num_reqs)

    replace(MODULE, "BlockTable.commit_block_table", commit_block_table, HOOK)
