"""Hook: `BlockTable.commit_block_table` (v1/worker/block_table.py).

Under `--kv-backend ulacache` the product line's worker may commit vLLM's block tables itself
(`LineWorker.commit_block_table`): the arena's block tables hold virtual page ids, and
committing one (vLLM does it before computing slot mappings and building attention and mamba
metadata) writes their granules (physical page positions) into the table's device tensor
instead of copying the ids. The worker is found through vLLM's own KV transfer group (the
ulacache connector); without it, or when the line declines, vLLM's own copy runs. Each
table carries its KV cache group's index (``ula_group``, set when vLLM's
`MultiGroupBlockTable` builds its tables in group order), so a line can commit some groups'
tables and leave others to vLLM (the v4 line's CSA rows: logical block ids).
"""
from __future__ import annotations

from ._hook import replace, resolve

HOOK = "block_table_translate"
MODULE = "vllm.v1.worker.block_table"


def commit(orig, table, num_reqs: int) -> None:
    """The hook, given vLLM's original: the line worker commits the table, or vLLM does."""
    from ulacache_vllm.engine.connector import ula_connector

    # The connector is found once per table (a per-step lookup otherwise); a table that
    # found none asks again, so one committed before the connector exists is not stuck.
    conn = table.__dict__.get("_ula_connector") or ula_connector()
    if conn is None or not conn.worker.commit_block_table(table, num_reqs):
        orig(table, num_reqs)
        return
    table._ula_connector = conn


def apply() -> None:
    _, init = resolve(MODULE, "MultiGroupBlockTable.__init__", HOOK)
    init = getattr(init, "__ulacache_original__", init)

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        for i, table in enumerate(self.block_tables):
            table.ula_group = i

    replace(MODULE, "MultiGroupBlockTable.__init__", __init__, HOOK)
    _, orig = resolve(MODULE, "BlockTable.commit_block_table", HOOK)
    orig = getattr(orig, "__ulacache_original__", orig)

    def commit_block_table(self, num_reqs: int) -> None:
        commit(orig, self, num_reqs)

    replace(MODULE, "BlockTable.commit_block_table", commit_block_table, HOOK)
