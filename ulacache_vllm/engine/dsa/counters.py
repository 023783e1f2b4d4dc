"""The DSA worker store's counters (what `/metrics` and `ulacache_usage` report)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_moved: int = 0
    fallback_chunks: int = 0  # settles that promoted only part of a step's working set
    fast_path_exits: int = 0
    replica_exits: int = 0  # TP shard mode: switches from replicated rows to shards
    # TP shard mode: unique remote rows read per step, those found in the remote-row buffer,
    # and those fetched from their owners (rows, bytes).
    remote_lookups: int = 0
    remote_hits: int = 0
    remote_rows_fetched: int = 0
    remote_bytes_fetched: int = 0
    failed_copies: int = 0  # tier copies that raised (their requests ended with an error)
    # Prefix-cache hits: entries of cached blocks new requests took over; those on the host.
    prefix_hit_entries: int = 0
    prefix_hit_entries_host: int = 0
