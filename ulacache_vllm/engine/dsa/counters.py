"""The DSA worker store's counters (what `/metrics` and `ulacache_usage` report) and the
wall-time `Timer` the store and the TP exchange (tp_shard) add their ``time_s`` with. A leaf
module: imports nothing of the engine."""
from __future__ import annotations

import time
from dataclasses import dataclass


class Timer:
    """Adds a ``with`` block's wall time to ``acc[key]`` (a plain class: a generator context
    manager costs a few microseconds more per use)."""
    __slots__ = ("acc", "key", "t0")

    def __init__(self, acc: dict, key: str):
        self.acc, self.key = acc, key

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.acc[self.key] += time.perf_counter() - self.t0
        return False


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    promotions: int = 0
    deferred: int = 0  # host entries read but not promoted (not read in enough steps in a row)
    demotions: int = 0
    bytes_moved: int = 0
    fallback_chunks: int = 0  # settles that promoted only part of a step's working set
    merged_plans: int = 0  # steps of a layer group whose settle and writes made one plan
    fast_path_exits: int = 0
    replica_exits: int = 0  # TP shard mode: switches from replicated rows to shards
    # TP shard mode: unique remote rows read per step, those found in the remote-row buffer,
    # and those fetched from their owners (rows, bytes).
    remote_lookups: int = 0
    remote_hits: int = 0
    remote_rows_fetched: int = 0
    remote_bytes_fetched: int = 0
    remote_fill_skips: int = 0  # settles of the buffer skipped while reads seldom hit it
    failed_copies: int = 0  # tier copies that raised (their requests ended with an error)
    # Prefix-cache hits: entries of cached blocks new requests took over; those on the host.
    prefix_hit_entries: int = 0
    prefix_hit_entries_host: int = 0
